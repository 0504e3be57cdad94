"""The reasoning parsers (``engine.reasoning``): each rule, and a stream cut anywhere joins into ``extract``."""

from __future__ import annotations

import itertools

import pytest

from engine.reasoning import REASONING_PARSERS, Phase, reasoning_parser

QWEN3, DEEPSEEK_R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize(
    ("parser", "text", "prompt", "expected"),
    [
        (QWEN3, "<think>a b c</think>answer", None, ("a b c", "answer")),
        (DEEPSEEK_R1, "<think>a b c</think>answer", None, ("a b c", "answer")),
        (DEEPSEEK_R1, "a b</think>x", None, ("a b", "x")),  # starts inside the reasoning
        (QWEN3, "a b</think>x", None, (None, "a b</think>x")),  # reasoning only after an opening <think>
        (DEEPSEEK_R1, "never closed", None, ("never closed", None)),
        (QWEN3, "<think>never closed", None, ("never closed", None)),
        (QWEN3, "<think></think>", None, ("", None)),
        (QWEN3, "x<think>y</think>z", None, (None, "x<think>y</think>z")),  # a later tag is content
        (QWEN3, "<thin", None, (None, "<thin")),  # an unfinished start tag is content
        (QWEN3, "", None, (None, "")),
        (QWEN3, "y</think>z", "<|im_start|>assistant\n<think>\n", ("y", "z")),  # the template opened it
        (DEEPSEEK_R1, '{"a": 1}', "assistant\n<think>a b c</think>", (None, '{"a": 1}')),  # prefilled
        (DEEPSEEK_R1, "<think>r</think>c", "<think>old</think>", (None, "<think>r</think>c")),
        (QWEN3, "<think>r</think>c", "<think>old</think>", ("r", "c")),  # a new one may open
    ],
)
def test_extract(parser, text, prompt, expected):
    assert parser.extract(text, prompt) == expected


@pytest.mark.parametrize("parser", [QWEN3, DEEPSEEK_R1])
@pytest.mark.parametrize("text", ["<think>a b c</think>answer", "a</thi", "<th", "x<think>y</think>z", "</think>"])
def test_a_stream_cut_anywhere_joins_into_extract(parser, text):
    reasoning, content = parser.extract(text)
    for cuts in itertools.combinations(range(1, len(text)), 2):
        stream = parser.stream()
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(d.reasoning for d in deltas) == (reasoning or "")
        assert "".join(d.content for d in deltas) == (content or "")
        assert stream.has_reasoning == (reasoning is not None)


def test_bytes_and_offsets():
    stream = QWEN3.stream(binary=True)
    assert stream.phase is Phase.OPENING and stream.feed(b"<th") == (b"", b"")
    assert stream.num_opening_matched == 3
    assert stream.feed(b"ink>ab</thi") == (b"ab", b"")
    assert stream.content_start is None
    assert stream.feed(b'nk>{"') == (b"", b'{"')
    assert stream.content_start == len("<think>ab</think>")


def test_unknown_parser():
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        reasoning_parser("granite")
