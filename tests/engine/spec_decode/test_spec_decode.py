"""Speculative decoding end to end on the offline engine: outputs, limits, seeds, grammars, configs.

Greedy outputs must be token-for-token those of the same engine without speculation, with the
n-gram proposer, a draft model (another tiny checkpoint with the same vocabulary) and the target
as its own draft, across chunked prefill, prefix-cache hits and forced preemption; the KV pool's
invariants are checked after every step. The rejection sampler's distributional guarantee is
tested on its own (tests/engine/sample/test_rejection_sampler.py).
"""

from __future__ import annotations

import json
import random
import re
import shutil

import jsonschema
import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.conftest import assert_pool_clean, make_llm, random_token_ids, token_prompt

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# A small pool and step budget: long prompts are chunked and the crowd preempts.
TIGHT = dict(max_model_len=192, num_gpu_blocks_override=26, max_num_batched_tokens=40, block_size=8, max_num_seqs=8)


def spec_configs(model_path: str, draft_path: str) -> dict[str, dict]:
    return {
        "ngram": NGRAM,
        "draft_model": {"model": draft_path, "num_speculative_tokens": K},
        "draft_is_target": {"model": model_path, "num_speculative_tokens": K},
    }


@pytest.fixture(scope="module")
def draft_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")  # a different tiny model over the same 512-token vocabulary


def workload(seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts with shared prefixes (prefix-cache hits), a long one (chunked), repetitive ones (n-gram hits),
    and greedy params with penalties, logit bias and min_tokens (every sampler stage sees the drafts)."""
    rng = random.Random(seed)
    shared = random_token_ids(rng, 24)
    prompts = [shared + random_token_ids(rng, n) for n in (3, 9, 17)]
    prompts += [random_token_ids(rng, 120), random_token_ids(rng, 6) * 5, random_token_ids(rng, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5)
    params[2] = SamplingParams(temperature=0.0, max_tokens=30, logit_bias={7: 3.0}, min_tokens=20)
    return [token_prompt(p) for p in prompts], params


def generate_checked(llm, prompts, params) -> list[list[int]]:
    """Runs the requests step by step, checking the KV pool and every running request after each step."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    num_spec_tokens = scheduler.spec_decode.config.num_speculative_tokens if scheduler.spec_decode else 0
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt, param)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        scheduler.kv_cache_manager.check_integrity()
        for request in scheduler.running:
            assert request.num_computed_tokens < request.num_tokens  # no unverified draft counts as computed
            assert len(request.spec_token_ids) <= num_spec_tokens
            # Verifying every draft and the token after stays within max_tokens.
            assert (
                not request.spec_token_ids
                or request.num_output_tokens + len(request.spec_token_ids) < request.max_tokens
            )
    assert_pool_clean(llm)
    return [outputs[str(index)] for index in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(model_path):
    llm = make_llm(model_path, **TIGHT)
    prompts, params = workload()
    outputs = generate_checked(llm, prompts, params)
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0, "the workload must force preemption"
    llm.shutdown()
    return outputs


@pytest.mark.slow  # about 10 s each on 2 cores
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_is_target"])
def test_greedy_outputs_equal_the_non_speculative_ones(model_path, draft_path, reference, method):
    llm = make_llm(model_path, speculative_config=spec_configs(model_path, draft_path)[method], **TIGHT)
    prompts, params = workload()
    assert generate_checked(llm, prompts, params) == reference
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    stats = scheduler.get_stats().spec_decoding_stats
    assert scheduler.num_preemptions > 0 and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    llm.shutdown()


def test_the_target_as_its_own_draft_accepts_at_least_98_percent(model_path):
    # Plain greedy requests: the draft drafts the raw argmax, which penalties or a logit bias would move.
    llm = make_llm(model_path, speculative_config={"model": model_path, "num_speculative_tokens": 4}, **TIGHT)
    rng = random.Random(1)
    prompts = [token_prompt(random_token_ids(rng, n)) for n in (5, 30, 70, 11)]
    generate_checked(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 4)
    stats = llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate >= 0.98, stats
    llm.shutdown()


@pytest.fixture(scope="module")
def ngram_llm(model_path):
    llm = make_llm(model_path, **TIGHT, speculative_config=NGRAM)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def draft_llm(model_path, draft_path):
    llm = make_llm(model_path, **TIGHT, speculative_config={"model": draft_path, "num_speculative_tokens": K})
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("engine", ["ngram_llm", "draft_llm"])
def test_seeded_sampling_repeats_alone_or_in_a_crowd(request, engine):
    llm = request.getfixturevalue(engine)
    rng = random.Random(2)
    prompt = token_prompt(random_token_ids(rng, 6) * 4)
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=40, ignore_eos=True)
    alone = generate_checked(llm, [prompt], [seeded])
    crowd = [token_prompt(random_token_ids(rng, 20)) for _ in range(4)]
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=i) for i in range(2)]
    others += [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 2
    together = generate_checked(llm, crowd[:2] + [prompt] + crowd[2:], others[:2] + [seeded] + others[2:])
    assert together[2] == alone[0]
    assert generate_checked(llm, [prompt], [seeded]) == alone


def test_limits_hold_with_drafts_in_flight(model_path, draft_llm):
    # A draft never runs past max_tokens or max_model_len: the outputs stop exactly there.
    repetitive = random_token_ids(random.Random(3), 5) * 6
    long_prompt = random_token_ids(random.Random(4), TIGHT["max_model_len"] - 7)
    outputs = generate_checked(
        draft_llm,
        [token_prompt(repetitive), token_prompt(long_prompt)],
        [
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0.0, ignore_eos=True),
        ],
    )
    assert [len(tokens) for tokens in outputs] == [5, 7]


def test_logprobs_of_accepted_tokens_equal_the_non_speculative_ones(model_path, ngram_llm):
    prompt = token_prompt(random_token_ids(random.Random(5), 4) * 6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = make_llm(model_path, **TIGHT)
    expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    plain.shutdown()
    drafts_before = (
        ngram_llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats.num_accepted_tokens
    )
    got = ngram_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (
        ngram_llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats.num_accepted_tokens
        > drafts_before
    )
    assert got.token_ids == expected.token_ids
    assert len(got.logprobs) == len(expected.logprobs) == 24
    for mine, theirs in zip(got.logprobs, expected.logprobs):
        assert mine.keys() == theirs.keys()
        for token_id, logprob in mine.items():
            assert logprob.logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)
            assert logprob.rank == theirs[token_id].rank


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 999}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("engine", ["ngram_llm", "draft_llm"])
def test_constrained_outputs_stay_valid_under_speculation(request, engine):
    llm = request.getfixturevalue(engine)
    constraints = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(regex=r"(ab|cd){2,6}x"),
    ]
    params = [
        SamplingParams(structured_outputs=c, temperature=t, seed=s, max_tokens=80)
        for c in constraints
        for t, s in ((0.0, None), (1.0, 3))
    ]
    outputs = llm.generate(["abcdab {"] * len(params), params, use_tqdm=False)
    assert_pool_clean(llm)
    for output, param in zip(outputs, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        if param.structured_outputs.json is not None:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        else:
            assert re.fullmatch(r"(ab|cd){2,6}x", completion.text), completion.text
    assert llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats.num_draft_tokens > 0


def test_disable_by_batch_size_verifies_no_draft_while_the_batch_is_that_large(model_path):
    spec = {**NGRAM, "disable_by_batch_size": 3}
    llm = make_llm(model_path, **TIGHT, speculative_config=spec)
    repetitive = random_token_ids(random.Random(6), 4) * 6
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    generate_checked(llm, [token_prompt(repetitive)] * 3, [params] * 3)  # three run side by side throughout
    stats = llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats
    assert stats.num_drafts == 0
    generate_checked(llm, [token_prompt(repetitive)] * 2, [params] * 2)
    assert llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats.num_drafts > 0
    llm.shutdown()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 4096}, "speculative_config.max_model_len"),
        ({"model": "DRAFT_OTHER_VOCAB", "num_speculative_tokens": 2}, "vocabulary"),
        ({"model": "DRAFT_SHORT", "num_speculative_tokens": 2}, "speculative_config.max_model_len"),
    ],
)
def test_bad_speculative_configs_fail_at_start_up_naming_the_field(model_path, tmp_path, spec, field):
    from engine.engine_args import EngineArgs
    from serval.tools.make_model import make_model

    if spec.get("model") == "DRAFT_OTHER_VOCAB":
        spec = {**spec, "model": str(make_model(tmp_path / "v", arch="llama", size="small", seed=0, quiet=True))}
    elif spec.get("model") == "DRAFT_SHORT":
        short = tmp_path / "short"
        shutil.copytree(model_path, short)
        config = json.loads((short / "config.json").read_text())
        (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
        spec = {**spec, "model": str(short)}
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=model_path, max_model_len=256, speculative_config=spec).create_engine_config()


def test_a_stop_string_inside_a_verified_run_drops_the_tokens_after_it(model_path, draft_path):
    # The target drafts for itself, so steps bring several tokens: those past the stop string are not output.
    prompts = ["abc abc abc abc", "one two one two one"]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    plain = make_llm(model_path, max_model_len=256)
    texts = [o.outputs[0].text for o in plain.generate(prompts, greedy, use_tqdm=False)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1, stop=[t[9:12]]) for t in texts
    ]
    expected = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    spec = make_llm(
        model_path, max_model_len=256, speculative_config={"model": model_path, "num_speculative_tokens": 4}
    )
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats.num_accepted_tokens > 0
    spec.shutdown()
    for mine, theirs in zip(got, expected):
        mine, theirs = mine.outputs[0], theirs.outputs[0]
        assert (mine.text, mine.token_ids, mine.finish_reason) == (theirs.text, theirs.token_ids, "stop")
        assert len(mine.logprobs) == len(mine.token_ids)
        assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)


def test_ngram_lookup_takes_the_longest_suffix_match_and_its_earliest_occurrence():
    from engine.spec_decode.ngram import propose_ngram

    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    assert propose_ngram(tokens, 1, 3, 2) == [9, 1]  # "2 3" (the longest suffix found) first occurs at 1
    assert propose_ngram(tokens, 3, 3, 2) == []  # "5 2 3" never occurred before
    assert propose_ngram([4, 4], 1, 2, 3) == [4]  # as much as follows the match
    assert propose_ngram([7], 1, 3, 2) == [] and propose_ngram([1, 2, 3], 1, 3, 2) == []
