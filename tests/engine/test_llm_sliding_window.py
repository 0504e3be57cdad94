"""Sliding-window attention end to end: Serval's ``LLM`` against transformers, float32, tiny random checkpoints.

A Mistral checkpoint whose every layer slides (window 12), a Qwen2 one with ``use_sliding_window`` and
``max_window_layers=1`` (layer 0 full, layer 1 sliding, window 20), and a Gemma 3 one (layer 0 sliding, window
12, with its own rope base; layer 1 full), all written by transformers, with
prompts several windows long and blocks of 8 tokens. One engine per checkpoint runs every scheduling
stress at once: prefill chunked small, prefix caching, and a KV pool of the fewest blocks the scheduler
accepts (so it preempts). Greedy tokens must equal transformers' and logprobs its ``log_softmax``. After
every engine step the KV cache manager is consistent and each request holds, in a sliding group, no more
blocks than its window and one step's tokens span; when all is done every block is free again.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine import SamplingParams
from engine.model.architecture import Architecture
from engine.worker.native_decode import NativeDecodeStep
from tests.conftest import HFReference, assert_pool_clean, random_token_ids, token_prompt
from tests.engine.test_llm_fidelity import Case, assert_greedy_equal, check_logprobs_close

BLOCK_SIZE = 8
MAX_MODEL_LEN = 160
MAX_STEP_TOKENS = 8  # long_prefill_token_threshold: the most tokens a request computes in one step
MAX_TOKENS = 20
# arch -> what transformers' config is given: every layer sliding; one full layer and one sliding.
SLIDING = {
    "mistral": dict(sliding_window=12),
    "qwen2": dict(use_sliding_window=True, sliding_window=20, max_window_layers=1),
    "gemma3": dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"]),
}
# The most blocks a request holds in a sliding group: its window and a step's tokens, block-aligned.
MAX_SLIDING_BLOCKS = {window: -(-(window - 1 + MAX_STEP_TOKENS) // BLOCK_SIZE) + 1 for window in (12, 20)}
# The fewest the scheduler accepts, one max_model_len sequence (+ the null block): Mistral's one sliding
# group holds 4 blocks of it; Qwen2's full group all 20, its sliding one 5; Gemma 3's 20 and 4.
NUM_BLOCKS = {"mistral": 1 + 4, "qwen2": 1 + 20 + 5, "gemma3": 1 + 20 + 4}


def engine_kwargs(arch: str) -> dict:
    return dict(
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=NUM_BLOCKS[arch],
        max_num_batched_tokens=16,
        long_prefill_token_threshold=MAX_STEP_TOKENS,
        enable_prefix_caching=True,
    )


def write_sliding_checkpoint(source: str, target, changes: dict) -> str:
    """``source``'s weights and tokenizer under a config that transformers builds with ``changes`` and saves."""
    import transformers

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.pop("layer_types", None)  # derived again from the sliding fields
    config_class = getattr(transformers, transformers.AutoConfig.for_model(config["model_type"]).__class__.__name__)
    config_class(**{**config, **changes}).save_pretrained(target)
    return str(target)


@pytest.fixture(scope="module", params=list(SLIDING))
def case(request, tiny_checkpoint, tmp_path_factory) -> Case:
    arch = request.param
    path = write_sliding_checkpoint(tiny_checkpoint(arch), tmp_path_factory.mktemp("sliding") / arch, SLIDING[arch])
    case = Case(path, HFReference(path), None)
    case.arch = arch
    return case


@pytest.fixture(scope="module")
def llm(case):
    return case.llm(**engine_kwargs(case.arch))


def generate_checking_blocks(llm, prompts, params: SamplingParams) -> list:
    """``llm.generate`` step by step: after every step the pool is consistent and no request holds more blocks
    in a sliding group than ``MAX_SLIDING_BLOCKS`` (the null blocks standing in for freed ones aside)."""
    engine = llm.llm_engine
    kv = engine.engine_core.engine_core.scheduler.kv_cache_manager
    windows = [group.window for group in kv.groups]
    assert any(windows), "the model has a sliding group"
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step() if output.finished)
        kv.check_integrity()
        for request_id, req_blocks in kv.req_to_blocks.items():
            for window, blocks in zip(windows, req_blocks):
                held = sum(1 for block in blocks if block is not kv.block_pool.null_block)
                assert window is None or held <= MAX_SLIDING_BLOCKS[window], f"{request_id}: {held} blocks"
    return [finished[request_id] for request_id in ids]


def test_the_checkpoints_slide(case):
    arch = Architecture.from_model(case.path)
    windows = [arch.attention_window(i) for i in range(arch.num_hidden_layers)]
    expected = {"MistralForCausalLM": [12, 12], "Qwen2ForCausalLM": [None, 20], "Gemma3ForCausalLM": [12, None]}
    assert windows == expected[arch.architecture]
    assert max(len(ids) for ids in case.prompt_token_ids) > 5 * max(w for w in windows if w)


def test_greedy_tokens_and_logprobs_match_hf(case, llm):
    """Chunked prefill, decodes and preemption (recompute) with the window: transformers' tokens and logprobs."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = generate_checking_blocks(llm, case.prompts, params)
    assert_greedy_equal(outputs, case.prompt_token_ids, case.expected, "sliding", case.ref.tokenizer)
    for i, output in enumerate(outputs):
        check_logprobs_close(output, case.ref, 5, f"sliding prompt {i}", check_prompt=False)
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert_pool_clean(llm)
    # Llama-shaped decode steps ran on the native decode stack, each layer with its group's block tables and
    # window; Gemma's layers (four norms each) are not the stack's: they decode one by one.
    decode_step = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.decode_step
    assert isinstance(decode_step, NativeDecodeStep) == (case.arch != "gemma3")


def test_prefix_caching_matches_hf(case, llm):
    """Prompts sharing a long prefix, cold then warm (the first run's blocks cached): still transformers' tokens."""
    prompts = [token_prompt(ids) for ids in case.shared_prompt_token_ids]
    for label in ("cold", "warm"):
        outputs = generate_checking_blocks(
            llm, prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
        )
        assert_greedy_equal(outputs, case.shared_prompt_token_ids, case.shared_expected, label)
        assert_pool_clean(llm)
    assert any(o.num_cached_tokens > 0 for o in outputs)
    rng = random.Random(5)  # a follow-up turn: the cached prompt and its output, then new tokens
    follow_up = case.shared_prompt_token_ids[2] + case.shared_expected[2] + random_token_ids(rng, 7)
    (output,) = llm.generate([token_prompt(follow_up)], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert output.outputs[0].token_ids == case.ref.greedy(follow_up, MAX_TOKENS)[: len(output.outputs[0].token_ids)]
    assert_pool_clean(llm)


def test_ngram_speculation_matches_hf(case):
    """Verify steps (1 + k query rows a request, the native kernel's rows) keep each row's window."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = case.llm(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, speculative_config=spec)
    outputs = llm.generate(case.prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS))
    assert_greedy_equal(outputs, case.prompt_token_ids, case.expected, "ngram")
    assert llm.llm_engine.engine_core.engine_core.scheduler.spec_decode.stats.num_draft_tokens > 0
    assert_pool_clean(llm)


def test_a_draft_model_is_refused(case):
    """A draft model would read the target's first group's blocks, which a sliding group drops."""
    with pytest.raises(ValueError, match="draft model"):
        case.llm(block_size=BLOCK_SIZE, speculative_config={"model": case.path, "num_speculative_tokens": 2})
