"""End-to-end fidelity: Serval's ``LLM`` against Hugging Face transformers, float32, tiny random checkpoints.

For every architecture (plus an untied Qwen2 and a tied Llama; Gemma 3's sliding window wider than every
prompt), greedy token
ids must be *identical* to ``transformers``' ``generate(do_sample=False)`` for a
batch of mixed-length prompts under each way the engine can split the work:
the default configuration, chunked prefill forced small (mixed prefill and
decode steps), prefix caching cold then warm (including prompts that share a
long prefix and are admitted in the same step), and preemption by recompute on
a KV pool that holds only one maximal sequence. Logprobs of the sampled tokens,
their top-N and the prompt logprobs must match ``log_softmax`` of HF's logits.
After every run the KV pool is consistent and every block is free again.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.model.architecture import Architecture
from tests.conftest import assert_pool_clean, random_token_ids, token_prompt

MAX_TOKENS = 20
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
# Preemption: the pool holds exactly one max_model_len sequence (10 usable blocks in each KV cache group + the
# null block: ``Case.preempt_num_blocks``).
PREEMPT_MAX_MODEL_LEN = 160
LOGPROB_ATOL = 1e-4
NUM_LOGPROBS = 5

TOKEN_PROMPT_LENGTHS = (3, 17, 32, 50, 97, 120)
TEXT_PROMPTS = ("def fibonacci(n):\n    return", "The quick brown fox jumps over the lazy dog, and then")
SHARED_PREFIX_LENGTH = 70  # 4 full blocks + 6 tokens
SHARED_SUFFIX_LENGTHS = (0, 1, 9, 26, 40)

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)

VARIANTS = [
    pytest.param(("llama", None), id="llama"),
    pytest.param(("mistral", None), id="mistral"),
    pytest.param(("qwen2", None), id="qwen2"),
    pytest.param(("qwen3", None), id="qwen3"),
    pytest.param(("gemma3", None), id="gemma3"),
    pytest.param(("qwen2", False), id="qwen2-untied"),
    pytest.param(("llama", True), id="llama-tied"),
]
BASE_VARIANTS = VARIANTS[:5]


def _token_prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [random_token_ids(rng, n) for n in TOKEN_PROMPT_LENGTHS]


def _shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(4321)
    prefix = random_token_ids(rng, SHARED_PREFIX_LENGTH)
    return [prefix + random_token_ids(rng, n) for n in SHARED_SUFFIX_LENGTHS]


class Case:
    """One checkpoint with its prompts and HF's greedy continuations of them."""

    def __init__(self, path: str, ref, tie: bool | None) -> None:
        self.path = path
        groups = Architecture.from_model(path).kv_cache_groups()  # Gemma 3's sliding layers: a group of their own
        self.preempt_num_blocks = PREEMPT_MAX_MODEL_LEN // BLOCK_SIZE * len(groups) + 1
        self.ref = ref
        self.is_base = tie is None  # the architecture's default embedding tying
        self.text_prompts = list(TEXT_PROMPTS)
        # Mixed lengths, text interleaved with token ids so the batch is not sorted by length.
        self.prompt_token_ids = _token_prompts()
        text_ids = [ref.tokenizer(text)["input_ids"] for text in self.text_prompts]
        self.prompt_token_ids[2:2] = text_ids[:1]
        self.prompt_token_ids.append(text_ids[1])
        self.prompts: list = [token_prompt(ids) for ids in self.prompt_token_ids]
        self.prompts[2] = self.text_prompts[0]
        self.prompts[-1] = self.text_prompts[1]
        self.shared_prompt_token_ids = _shared_prefix_prompts()
        self.expected = [ref.greedy(ids, MAX_TOKENS) for ids in self.prompt_token_ids]
        self.shared_expected = [ref.greedy(ids, MAX_TOKENS) for ids in self.shared_prompt_token_ids]

    def llm(self, **overrides) -> LLM:
        kwargs = dict(
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=16,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            seed=0,
        )
        kwargs.update(overrides)
        return LLM(model=self.path, **kwargs)


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tiny_checkpoint, hf_reference) -> Case:
    arch, tie = request.param
    return Case(tiny_checkpoint(arch, tie), hf_reference(arch, tie), tie)


@pytest.fixture(scope="module", params=BASE_VARIANTS)
def base_case(request, tiny_checkpoint, hf_reference) -> Case:
    arch, tie = request.param
    return Case(tiny_checkpoint(arch, tie), hf_reference(arch, tie), tie)


def assert_greedy_equal(outputs, prompt_token_ids, expected, label="", tokenizer=None) -> None:
    assert len(outputs) == len(expected)
    for i, (output, ids, want) in enumerate(zip(outputs, prompt_token_ids, expected)):
        assert output.prompt_token_ids == ids, f"{label} prompt {i}: prompt tokens differ"
        assert len(output.outputs) == 1
        completion = output.outputs[0]
        assert completion.token_ids == want, (
            f"{label} prompt {i} ({len(ids)} tokens): Serval {completion.token_ids} != HF {want}"
        )
        assert completion.finish_reason == "length"
        if tokenizer is not None:  # the incremental detokenizer agrees with a one-shot decode
            assert completion.text == tokenizer.decode(want, skip_special_tokens=True), f"{label} prompt {i}"


def record_schedules(llm, monkeypatch) -> list[dict[str, int]]:
    """Records ``num_scheduled_tokens`` of every step the engine takes."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    original = scheduler.schedule
    steps: list[dict[str, int]] = []

    def schedule():
        output = original()
        steps.append(dict(output.num_scheduled_tokens))
        return output

    monkeypatch.setattr(scheduler, "schedule", schedule)
    return steps


# ------------------------------------------------------------------ greedy


def test_reference_is_hf_generate(base_case):
    """The HF reference greedy loop is ``generate(do_sample=False)`` (which would stop at EOS)."""
    import torch

    eos = base_case.ref.model.config.eos_token_id
    for ids, want in zip(
        base_case.prompt_token_ids + base_case.shared_prompt_token_ids, base_case.expected + base_case.shared_expected
    ):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = base_case.ref.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=4,
            )
        generated = out[0, len(ids) :].tolist()
        assert generated == (want[: want.index(eos) + 1] if eos in want else want)


def test_greedy_matches_hf_default(case):
    llm = case.llm()
    outputs = llm.generate(case.prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs][2] == case.text_prompts[0]
    assert_greedy_equal(outputs, case.prompt_token_ids, case.expected, "default", case.ref.tokenizer)
    assert_pool_clean(llm)


def test_greedy_matches_hf_one_request_at_a_time(base_case):
    llm = base_case.llm(max_num_seqs=1, enable_prefix_caching=False)
    outputs = llm.generate(base_case.prompts, GREEDY, use_tqdm=False)
    assert_greedy_equal(outputs, base_case.prompt_token_ids, base_case.expected, "max_num_seqs=1")
    assert_pool_clean(llm)


def test_greedy_matches_hf_small_chunked_prefill(base_case, monkeypatch):
    llm = base_case.llm(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    steps = record_schedules(llm, monkeypatch)
    for label in ("chunked cold", "chunked warm"):  # the warm run chunks on top of cached prefixes
        steps.clear()
        outputs = llm.generate(base_case.prompts, GREEDY, use_tqdm=False)
        assert_greedy_equal(outputs, base_case.prompt_token_ids, base_case.expected, label, base_case.ref.tokenizer)
        assert all(sum(step.values()) <= 16 and max(step.values()) <= 8 for step in steps)
        # Mixed steps happened: some request decoding while another one's prompt chunk runs.
        assert any(1 in step.values() and max(step.values()) > 1 for step in steps)
        assert_pool_clean(llm)
    assert [o.num_cached_tokens for o in outputs] == [
        (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for ids in base_case.prompt_token_ids
    ]


def test_greedy_matches_hf_prefix_caching_cold_and_warm(base_case):
    llm = base_case.llm()
    prompts = base_case.prompts + [token_prompt(ids) for ids in base_case.shared_prompt_token_ids]
    prompt_token_ids = base_case.prompt_token_ids + base_case.shared_prompt_token_ids
    expected = base_case.expected + base_case.shared_expected
    num_main = len(base_case.prompts)

    cold = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_greedy_equal(cold, prompt_token_ids, expected, "cold")
    # Nothing cached yet, except that the shared-prefix prompts admitted in the same step as
    # the first of them reuse its (not yet computed) prefix blocks.
    shared_hit = SHARED_PREFIX_LENGTH // BLOCK_SIZE * BLOCK_SIZE
    assert [o.num_cached_tokens for o in cold] == [0] * (num_main + 1) + [shared_hit] * (len(prompts) - num_main - 1)
    assert_pool_clean(llm)

    warm = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_greedy_equal(warm, prompt_token_ids, expected, "warm", base_case.ref.tokenizer)
    assert [o.num_cached_tokens for o in warm] == [
        (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for ids in prompt_token_ids
    ]
    assert all(o.num_cached_tokens > 0 for o, ids in zip(warm, prompt_token_ids) if len(ids) > BLOCK_SIZE)
    stats = llm.llm_engine.engine_core.get_stats().prefix_cache_stats
    assert stats.num_hit_tokens > 0
    assert_pool_clean(llm)

    # A follow-up turn: the previous prompt and its output, plus new tokens, hits the blocks that
    # were filled while decoding (all but the last output token, whose KV was never computed).
    rng = random.Random(77)
    follow_ups = [ids + want + random_token_ids(rng, 5) for ids, want in zip(prompt_token_ids[3:6], expected[3:6])]
    outputs = llm.generate([token_prompt(ids) for ids in follow_ups], GREEDY, use_tqdm=False)
    assert_greedy_equal(
        outputs,
        follow_ups,
        [base_case.ref.greedy(ids, MAX_TOKENS) for ids in follow_ups],
        "follow-up",
        base_case.ref.tokenizer,
    )
    assert [o.num_cached_tokens for o in outputs] == [
        (len(ids) + MAX_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE for ids in prompt_token_ids[3:6]
    ]
    assert_pool_clean(llm)


PREEMPTION_CONFIGS = {
    "caching": dict(enable_prefix_caching=True),
    "no-caching": dict(enable_prefix_caching=False),
    "priority-chunked": dict(scheduling_policy="priority", max_num_batched_tokens=48, long_prefill_token_threshold=24),
}


@pytest.mark.parametrize("config", list(PREEMPTION_CONFIGS))
def test_greedy_matches_hf_under_preemption(base_case, config):
    llm = base_case.llm(
        max_model_len=PREEMPT_MAX_MODEL_LEN,
        num_gpu_blocks_override=base_case.preempt_num_blocks,
        **PREEMPTION_CONFIGS[config],
    )
    prompts = base_case.prompts + [token_prompt(ids) for ids in base_case.shared_prompt_token_ids]
    prompt_token_ids = base_case.prompt_token_ids + base_case.shared_prompt_token_ids
    expected = base_case.expected + base_case.shared_expected
    assert max(len(ids) for ids in prompt_token_ids) + MAX_TOKENS <= PREEMPT_MAX_MODEL_LEN
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    priority = [i % 3 for i in range(len(prompts))] if config.startswith("priority") else None
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
    assert scheduler.num_preemptions > 0
    assert llm.llm_engine.engine_core.get_stats().num_preemptions == scheduler.num_preemptions
    assert_greedy_equal(outputs, prompt_token_ids, expected, config, base_case.ref.tokenizer)
    assert_pool_clean(llm)


# ---------------------------------------------------------------- logprobs


def check_position(position, token_id, hf_row, num, tokenizer, label) -> None:
    """One position's logprobs dict against HF's log_softmax row."""
    assert token_id in position, f"{label}: the chosen token {token_id} is missing"
    chosen = position[token_id]
    hf_value = hf_row[token_id].item()
    assert chosen.logprob == pytest.approx(hf_value, abs=LOGPROB_ATOL), label
    # Rank of the chosen token: 1 + how many are more likely (near-ties may go either way).
    lower = int((hf_row > hf_value + LOGPROB_ATOL).sum()) + 1
    upper = int((hf_row > hf_value - LOGPROB_ATOL).sum())
    assert lower <= chosen.rank <= max(lower, upper), f"{label}: rank {chosen.rank} not in [{lower}, {upper}]"
    top = {t: lp for t, lp in position.items() if lp.rank is not None and lp.rank <= num}
    assert sorted(lp.rank for lp in top.values()) == list(range(1, num + 1)), f"{label}: ranks {position}"
    assert len(position) in (num, num + 1)
    hf_top_values, hf_top_ids = hf_row.topk(num)
    kth = hf_top_values[-1].item()
    # The top-N sets agree except for tokens tied (within tolerance) at the N-th place.
    for t in set(top) ^ set(hf_top_ids.tolist()):
        assert abs(hf_row[t].item() - kth) < LOGPROB_ATOL, f"{label}: top-{num} sets differ at token {t}"
    ordered = sorted(top, key=lambda t: top[t].rank)
    values = [top[t].logprob for t in ordered]
    assert values == sorted(values, reverse=True), f"{label}: top-{num} not in rank order"
    for t, lp in position.items():
        assert lp.logprob == pytest.approx(hf_row[t].item(), abs=LOGPROB_ATOL), f"{label}: token {t}"
        assert lp.decoded_token == tokenizer.decode([t]), f"{label}: decoded token of {t}"


def check_logprobs_close(output, ref, num, label, check_prompt=True) -> None:
    prompt = output.prompt_token_ids
    completion = output.outputs[0]
    tokens = completion.token_ids
    hf_logprobs = ref.log_softmax(prompt + tokens)
    # Generated tokens.
    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens), label
    cumulative = 0.0
    for i, (token_id, position) in enumerate(zip(tokens, completion.logprobs)):
        row = hf_logprobs[len(prompt) - 1 + i]
        check_position(position, token_id, row, num, ref.tokenizer, f"{label} output {i}")
        cumulative += row[token_id].item()
    assert completion.cumulative_logprob == pytest.approx(cumulative, abs=LOGPROB_ATOL * len(tokens)), label
    if check_prompt:
        check_prompt_logprobs_close(output, ref, num, label)


def check_prompt_logprobs_close(output, ref, num, label) -> None:
    prompt = output.prompt_token_ids
    hf_logprobs = ref.log_softmax(prompt)
    # Entry j is the logprob of prompt[j] given prompt[:j]; the first has no context.
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt), (
        f"{label}: {len(prompt_logprobs or [])} prompt logprob entries for {len(prompt)} prompt tokens"
    )
    assert prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        check_position(
            prompt_logprobs[j], prompt[j], hf_logprobs[j - 1], num, ref.tokenizer, f"{label} prompt position {j}"
        )


LOGPROB_CONFIGS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
    "preempted": dict(max_model_len=PREEMPT_MAX_MODEL_LEN),  # and the case's one-sequence pool
}


@pytest.mark.parametrize("config", ["default"])
def test_logprobs_match_hf(case, config):
    _check_logprobs_match_hf(case, config)


@pytest.mark.parametrize("config", [name for name in LOGPROB_CONFIGS if name != "default"])
def test_logprobs_match_hf_under_scheduling_stress(base_case, config, request):
    """Chunked and preempted schedules on the base architectures (the tying variants run the default)."""
    if config == "preempted" and Architecture.from_model(base_case.path).architecture == "Gemma3ForCausalLM":
        # A known defect, found 2026-12-08 and open: with two KV cache groups, prefix caching and preemption, one
        # logprob of prompt 3 parts from transformers' (-0.0135 against -0.0060 at output 18); the greedy tokens
        # agree, and without prefix caching it passes. Strict: the test fails the day it is fixed, so this goes.
        request.node.add_marker(pytest.mark.xfail(strict=True, reason="multi-group prefix caching under preemption"))
    _check_logprobs_match_hf(base_case, config)


def _check_logprobs_match_hf(case, config):
    pool = {"num_gpu_blocks_override": case.preempt_num_blocks} if config == "preempted" else {}
    llm = case.llm(**LOGPROB_CONFIGS[config], **pool)
    # Prompt logprobs under preemption have their own test (test_prompt_logprobs_survive_preemption).
    with_prompt = config != "preempted"
    params = SamplingParams(
        temperature=0.0,
        ignore_eos=True,
        max_tokens=MAX_TOKENS,
        logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS if with_prompt else None,
    )
    outputs = llm.generate(case.prompts, params, use_tqdm=False)
    assert_greedy_equal(outputs, case.prompt_token_ids, case.expected, config)
    for i, output in enumerate(outputs):
        check_logprobs_close(output, case.ref, NUM_LOGPROBS, f"{config} prompt {i}", check_prompt=with_prompt)
    if config == "preempted":
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert_pool_clean(llm)


def test_prompt_logprobs_survive_preemption(tiny_checkpoint, hf_reference):
    """A preempted request is recomputed from scratch; its prompt logprobs must still come out once.

    Also covers preemption in the middle of a chunked prefill (the victim is
    the most recently admitted request, often still prefilling).
    """
    case = Case(tiny_checkpoint("llama"), hf_reference("llama"), None)
    llm = case.llm(
        max_model_len=PREEMPT_MAX_MODEL_LEN,
        num_gpu_blocks_override=case.preempt_num_blocks,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
    )
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, prompt_logprobs=2)
    outputs = llm.generate(case.prompts, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert_greedy_equal(outputs, case.prompt_token_ids, case.expected, "preempted")
    for i, output in enumerate(outputs):
        check_prompt_logprobs_close(output, case.ref, 2, f"preempted prompt {i}")
    assert_pool_clean(llm)


def test_sampled_logprobs_match_hf(base_case):
    """Random sampling: logprobs are the raw model's (before temperature and filters), ranks included."""
    llm = base_case.llm()
    params = [
        SamplingParams(temperature=1.5, top_k=50, seed=i, ignore_eos=True, max_tokens=MAX_TOKENS, logprobs=NUM_LOGPROBS)
        for i in range(len(base_case.prompts))
    ]
    outputs = llm.generate(base_case.prompts, params, use_tqdm=False)
    ranks = []
    for i, output in enumerate(outputs):
        check_logprobs_close(output, base_case.ref, NUM_LOGPROBS, f"sampled prompt {i}", check_prompt=False)
        ranks += [position[t].rank for t, position in zip(output.outputs[0].token_ids, output.outputs[0].logprobs)]
    assert max(ranks) > NUM_LOGPROBS  # some sampled tokens lie outside the top-N: their own rank is reported
    assert_pool_clean(llm)


def test_logprobs_counts_and_mixed_batch(base_case):
    """Different logprobs / prompt_logprobs counts in one batch; 0 means the chosen token only."""
    llm = base_case.llm()
    ids = base_case.prompt_token_ids[3]
    counts = [(None, None), (0, 0), (1, 3), (NUM_LOGPROBS, None)]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, logprobs=lp, prompt_logprobs=plp)
        for lp, plp in counts
    ]
    outputs = llm.generate([token_prompt(ids)] * len(counts), params, use_tqdm=False)
    hf_logprobs = base_case.ref.log_softmax(ids + base_case.expected[3][:8])
    for (lp, plp), output in zip(counts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == base_case.expected[3][:8]
        if lp is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
        else:
            assert len(completion.logprobs) == 8
            for i, (token_id, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
                if lp > 0:
                    check_position(
                        position,
                        token_id,
                        hf_logprobs[len(ids) - 1 + i],
                        lp,
                        base_case.ref.tokenizer,
                        f"logprobs={lp} output {i}",
                    )
                else:
                    assert set(position) == {token_id}
                assert position[token_id].logprob == pytest.approx(
                    hf_logprobs[len(ids) - 1 + i][token_id].item(), abs=LOGPROB_ATOL
                )
        if plp is None:
            assert output.prompt_logprobs is None
        else:
            assert len(output.prompt_logprobs) == len(ids) and output.prompt_logprobs[0] is None
            for j in range(1, len(ids)):
                position = output.prompt_logprobs[j]
                assert position[ids[j]].logprob == pytest.approx(hf_logprobs[j - 1][ids[j]].item(), abs=LOGPROB_ATOL)
                if plp > 0:
                    check_position(
                        position,
                        ids[j],
                        hf_logprobs[j - 1],
                        plp,
                        base_case.ref.tokenizer,
                        f"prompt_logprobs={plp} position {j}",
                    )
                else:
                    assert set(position) == {ids[j]}
    assert_pool_clean(llm)
