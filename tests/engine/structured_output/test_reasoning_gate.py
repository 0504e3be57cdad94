"""A grammar gated by a reasoning parser (``reasoning_gate``): real xgrammar on the tiny tokenizer, whose
``<think>`` and ``</think>`` are several tokens each (the general case; Qwen3's are one)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from engine.config import StructuredOutputsConfig
from engine.reasoning import REASONING_PARSERS
from engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def backends(tokenizer, parser_name: str):
    """(a gated backend, a plain one) over the same vocabulary, and the schema compiled by each."""
    from engine.structured_output.backend import XgrammarBackend

    config = StructuredOutputsConfig(disable_any_whitespace=True)
    gated = XgrammarBackend(tokenizer, len(tokenizer), config, REASONING_PARSERS[parser_name])
    plain = XgrammarBackend(tokenizer, len(tokenizer), config)
    params = StructuredOutputsParams(json=SCHEMA)
    return (gated, gated.compile(params)), (plain, plain.compile(params))


def mask(grammar, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_grammar_starts_after_the_reasoning_and_rollback_reopens_it(tokenizer):
    (gated, compiled), (plain, plain_compiled) = backends(tokenizer, "deepseek_r1")
    grammar = gated.make_grammar(compiled, [EOS], ids(tokenizer, "user: hi\nassistant:"))
    reference = plain.make_grammar(plain_compiled, [EOS])
    everything = torch.full_like(mask(reference, len(tokenizer)), -1)
    assert torch.equal(mask(grammar, len(tokenizer)), everything)  # inside the reasoning: anything goes
    for token_id in ids(tokenizer, "a b c, not JSON at all</think>"):
        assert grammar.accept_token(token_id) and not grammar.is_terminated()
    assert torch.equal(mask(grammar, len(tokenizer)), mask(reference, len(tokenizer)))  # the schema's start
    assert not grammar.accept_token(ids(tokenizer, "x")[0])  # the schema refuses what the reasoning took
    for token_id in [*ids(tokenizer, '{"a":12}'), EOS]:
        assert grammar.accept_token(token_id) and reference.accept_token(token_id)
    assert grammar.is_terminated()
    grammar.rollback(len(ids(tokenizer, '{"a":12}')) + 2)  # EOS, the JSON and the end tag's last token
    assert not grammar.is_terminated()
    assert torch.equal(mask(grammar, len(tokenizer)), everything)
    assert grammar.accept_token(ids(tokenizer, ">")[0]) and grammar.accept_token(ids(tokenizer, "{")[0])


def test_a_token_holding_the_end_tag_and_the_answer_hands_the_grammar_its_rest(tokenizer):
    """``>>`` ends the tag and begins the answer with ``>``: a grammar whose answer begins so takes it, another
    refuses the token (and the reasoning stays open for another)."""
    (gated, _), _ = backends(tokenizer, "deepseek_r1")
    straddling = gated.reasoning_gate.token_bytes.index(b">>")
    for regex, takes_it in ((r">[0-9]", True), (r"[0-9]", False)):
        grammar = gated.make_grammar(gated.compile(StructuredOutputsParams(regex=regex)), [EOS], [])
        for token_id in ids(tokenizer, "r</think"):
            assert grammar.accept_token(token_id)
        assert grammar.accept_token(straddling) == takes_it
        if not takes_it:
            assert grammar.accept_token(ids(tokenizer, ">")[0])
        for token_id in [*ids(tokenizer, "1"), EOS]:
            assert grammar.accept_token(token_id)
        assert grammar.is_terminated()


def test_qwen3_allows_the_grammar_or_a_start_tag_then_only_the_tag(tokenizer):
    (gated, compiled), (plain, plain_compiled) = backends(tokenizer, "qwen3")
    grammar = gated.make_grammar(compiled, [EOS], ids(tokenizer, "assistant:"))
    reference = plain.make_grammar(plain_compiled, [EOS])
    first = mask(grammar, len(tokenizer))
    open_angle = ids(tokenizer, "<")[0]
    assert torch.equal(first & mask(reference, len(tokenizer)), mask(reference, len(tokenizer)))
    assert first[open_angle // 32] & (1 << (open_angle % 32))  # "<" may begin <think>
    assert grammar.accept_token(open_angle)
    tag_rest = ids(tokenizer, "<think>")[1:]
    allowed = mask(grammar, len(tokenizer))
    assert allowed[tag_rest[0] // 32] & (1 << (tag_rest[0] % 32))
    assert not allowed[ids(tokenizer, "{")[0] // 32] & (1 << (ids(tokenizer, "{")[0] % 32))  # "<" must go on
    for token_id in [*tag_rest, *ids(tokenizer, "free text</think>")]:
        assert grammar.accept_token(token_id)
    assert torch.equal(mask(grammar, len(tokenizer)), mask(reference, len(tokenizer)))


def test_qwen3_without_a_start_tag_is_constrained_from_the_first_token(tokenizer):
    (gated, compiled), _ = backends(tokenizer, "qwen3")
    grammar = gated.make_grammar(compiled, [EOS], [])
    assert not grammar.accept_token(ids(tokenizer, "x")[0])
    for token_id in [*ids(tokenizer, '{"a":1}'), EOS]:
        assert grammar.accept_token(token_id)
    assert grammar.is_terminated()


def test_a_prompt_that_closed_the_reasoning_starts_the_grammar_at_once(tokenizer):
    (gated, compiled), _ = backends(tokenizer, "deepseek_r1")
    grammar = gated.make_grammar(compiled, [EOS], ids(tokenizer, "assistant:<think>a b c</think>"))
    assert not grammar.accept_token(ids(tokenizer, "x")[0])
    assert grammar.accept_token(ids(tokenizer, "{")[0])
