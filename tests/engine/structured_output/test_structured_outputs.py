"""Structured outputs in the engine (real xgrammar, the tiny random-weight checkpoint, the offline ``LLM``).

Every constraint is bounded (enums, bounded integers, strings with maxLength, arrays with
maxItems, compact JSON) so that the grammar, not luck, ends each output: every output must finish
with "stop" and validate. The engine's composition with chunked prefill, prefix caching,
preemption, ``n`` > 1, seeds, logprobs and stop strings is checked on the same engine, and
after every batch the KV pool is clean.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.sched.request import Request
from tests.conftest import assert_pool_clean, make_llm

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "maximum": 99}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "role", "address", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" digit digit? ")" | "none"\ndigit ::= [0-9]'
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm(model_path):
    # A small pool and step budget: a long prompt is chunked and a crowd of requests preempts.
    engine = make_llm(
        model_path,
        max_model_len=512,
        num_gpu_blocks_override=40,
        max_num_batched_tokens=64,
        block_size=16,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    yield engine
    engine.llm_engine.shutdown()


def constrained(**constraint) -> SamplingParams:
    defaults = {"temperature": 1.0, "seed": 0, "max_tokens": MAX_TOKENS}
    params = {**defaults, **{k: constraint.pop(k) for k in list(constraint) if k in SamplingParams.__annotations__}}
    return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **params)


def assert_valid(text: str, params: SamplingParams) -> None:
    constraint = params.structured_outputs
    if constraint.json is not None:
        schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
        jsonschema.validate(json.loads(text), schema)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice
    elif constraint.grammar is not None:
        assert re.fullmatch(r"\([0-9][0-9]?\)|none", text), text


def run(llm, prompts, params) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_clean(llm)
    return outputs


def test_every_kind_of_constraint_ends_the_output_and_validates(llm):
    params = [
        constrained(json=PERSON, seed=1),
        constrained(json=json.dumps(PERSON), temperature=0.0),
        constrained(regex=REGEX),
        constrained(choice=CHOICES),
        constrained(grammar=GRAMMAR),
    ]
    for output, param in zip(run(llm, ["tell me"] * len(params), params), params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert_valid(completion.text, param)


def test_json_is_compact_with_disable_any_whitespace_and_the_schema_keeps_its_order(llm):
    (output,) = run(llm, ["x"], [constrained(json=PERSON, seed=3)])
    text = output.outputs[0].text
    assert list(json.loads(text)) == list(PERSON["properties"])
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


def test_n_three_with_a_seed_all_validate_and_repeat_exactly(llm):
    params = constrained(json=PERSON, n=3, seed=7)
    first, again = run(llm, ["seeded"], [params])[0], run(llm, ["seeded"], [params])[0]
    assert len(first.outputs) == 3
    for completion in first.outputs:
        assert completion.finish_reason == "stop"
        assert_valid(completion.text, params)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_structured_and_free_requests_in_one_batch_leave_the_free_ones_untouched(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [f"prompt number {i}" for i in range(16)]
    alone = [o.outputs[0].token_ids for o in run(llm, prompts[::2], [free] * 8)]
    mixed_params = [free if i % 2 == 0 else constrained(json=PERSON, seed=i) for i in range(16)]
    mixed = run(llm, prompts, mixed_params)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone
    for output, params in zip(mixed[1::2], mixed_params[1::2]):
        assert output.outputs[0].finish_reason == "stop"
        assert_valid(output.outputs[0].text, params)


def test_a_long_chunked_prompt_and_a_prefix_cache_hit_keep_the_constraint(llm):
    long_prompt = "a long prompt that takes several steps of prefill " * 12  # > 64 tokens: chunked
    first, second = run(llm, [long_prompt, long_prompt], [constrained(regex=REGEX, seed=s) for s in (1, 2)])
    hits = run(llm, [long_prompt], [constrained(choice=CHOICES)])[0]
    assert hits.num_cached_tokens > 0
    for output, constraint in ((first, REGEX), (second, REGEX)):
        assert re.fullmatch(constraint, output.outputs[0].text)
    assert hits.outputs[0].text in CHOICES


def test_preempted_structured_requests_keep_their_grammar(llm):
    # 40 blocks of 16 for 12 requests growing past 50 tokens each: the pool runs dry and some are preempted.
    core = llm.llm_engine.engine_core
    before = core.get_stats().num_preemptions
    params = [constrained(json=PERSON, seed=i) for i in range(12)]
    outputs = run(llm, [f"preempt me {i} " * 3 for i in range(12)], params)
    assert core.get_stats().num_preemptions > before
    for output, param in zip(outputs, params):
        assert output.outputs[0].finish_reason == "stop"
        assert_valid(output.outputs[0].text, param)


def test_logprobs_see_the_masked_distribution_and_stop_strings_still_apply(llm):
    # Two one-token choices: the first position's distribution is over exactly those two tokens, the
    # second's is the stop token alone; every other token's logprob is -inf.
    (output,) = run(llm, ["pick"], [constrained(choice=["a", "b"], logprobs=4, temperature=0.0)])
    completion = output.outputs[0]
    assert completion.text in ("a", "b") and completion.finish_reason == "stop"
    first, last = completion.logprobs
    finite = {token_id: lp.logprob for token_id, lp in first.items() if math.isfinite(lp.logprob)}
    tokenizer = llm.get_tokenizer()
    assert {tokenizer.decode([t]) for t in finite} == {"a", "b"}
    assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, rel_tol=1e-4)
    assert [lp.logprob for t, lp in last.items() if math.isfinite(lp.logprob)] == [pytest.approx(0.0, abs=1e-5)]
    stopped = run(llm, ["colour"], [constrained(regex=REGEX, stop=["-"], temperature=0.0)])[0].outputs[0]
    assert stopped.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", stopped.text)


@pytest.mark.parametrize(
    "constraint, reason",
    [
        ({"json": {"type": "strin"}}, "Unsupported type"),
        ({"regex": "a(b"}, "parenthesis"),
        ({"grammar": 'root ::= "a" |'}, "EBNF"),
        ({"choice": []}, "must not be empty"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ],
)
def test_bad_constraints_are_refused_before_anything_is_queued(llm, constraint, reason):
    with pytest.raises(ValueError, match=reason):
        llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert_pool_clean(llm)


def test_min_tokens_with_a_grammar_is_refused(llm):
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate(["x"], constrained(choice=CHOICES, min_tokens=2), use_tqdm=False)


def test_a_grammar_that_fails_to_compile_in_the_core_finishes_its_request_with_the_reason(llm):
    # Straight to the core, past the front end's check: the core's own contract.
    core = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(structured_outputs={"regex": "a(b"})
    core.add_request(Request("bad-grammar", [5, 6, 7], params, eos_token_id=1))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    (output,) = outputs
    assert output.finish_reason == "error" and "parenthesis" in output.stop_reason
    assert output.new_token_ids == []
    assert_pool_clean(llm)


def test_a_matcher_rolls_back_accepted_tokens_and_accepts_again(model_path):
    """Speculative decoding takes rejected draft tokens back: the matcher returns to the earlier state."""
    from transformers import AutoTokenizer

    from engine.config import StructuredOutputsConfig
    from engine.structured_output.backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    backend = XgrammarBackend(tokenizer, len(tokenizer), StructuredOutputsConfig())
    grammar = backend.make_grammar(backend.compile(StructuredOutputsParams(choice=["ab", "cd"])), [1])
    a, b, c, d = (tokenizer.convert_tokens_to_ids(t) for t in "abcd")
    assert grammar.accept_token(a) and grammar.accept_token(b) and not grammar.accept_token(c)
    grammar.rollback(2)
    assert grammar.num_accepted_tokens == 0
    assert grammar.accept_token(c) and grammar.accept_token(d) and grammar.accept_token(1)
    assert grammar.is_terminated()


@pytest.mark.parametrize("vocab", [2048, 8195])
def test_the_bitmask_stage_masks_exactly_the_disallowed_tokens_of_grammar_rows(vocab):
    """Native op, plain-torch fallback and xgrammar's reference agree, bit for bit: whole-word runs, single
    bits, a vocabulary that ends mid-word, and grammar rows that are not every row or in order."""
    import torch
    import xgrammar as xgr

    from engine.kernels.cpu import load_cpu_kernels, use_cpu_kernels
    from engine.sample.grammar_bitmask import apply_grammar_bitmask

    assert load_cpu_kernels() is not None, "the native kernels must build here"
    generator = torch.Generator().manual_seed(0)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    bitmask[:, 5:40] = 0  # runs of disallowed words
    bitmask[:, 40:60] = -1  # and of allowed ones
    logits = torch.randn(5, vocab, generator=generator)
    sampled, grammar_rows = ["a", "b", "c", "d", "e"], ["d", "a", "c"]
    expected = logits.clone()
    spread = torch.full((5, words), -1, dtype=torch.int32)
    spread[[3, 0, 2]] = bitmask
    xgr.apply_token_bitmask_inplace(expected, spread, indices=[3, 0, 2])
    native, fallback = logits.clone(), logits.clone()
    apply_grammar_bitmask(native, sampled, grammar_rows, bitmask)
    with use_cpu_kernels(False):
        apply_grammar_bitmask(fallback, sampled, grammar_rows, bitmask)
    assert torch.equal(native, expected) and torch.equal(fallback, expected)
    assert torch.equal(native[[1, 4]], logits[[1, 4]])  # free rows untouched
