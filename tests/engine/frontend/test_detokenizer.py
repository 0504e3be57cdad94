"""Incremental detokenizer and stop strings, over a byte-level BPE trained here."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import engine.frontend.detokenizer
from engine.frontend.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "Café crème brûlée, naïve façade, résumé, Ångström, smörgåsbord.",
    "日本語のテキストです。東京は大きな都市です。中文字符测试，你好世界。",
    "Emoji: 😀 😃 🚀 🎉 👍🏽 ❤️ 🇫🇷 and more 🤖 tokens 🧪.",
    "Mixed: naïve 東京 🚀 café 你好 😀 stop STOP END end.",
] * 4

SPECIAL_TOKENS = ["<eos>", "<pad>", "<sep>"]


@pytest.fixture(autouse=True, params=["decode_stream", "windowed"])
def decode_path(request, monkeypatch):
    """Every test runs on both paths: the tokenizers DecodeStream and the windowed decode."""
    if request.param == "windowed":
        monkeypatch.setattr(engine.frontend.detokenizer, "_make_decode_stream", lambda tokenizer, skip: None)
    return request.param


@functools.cache
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        additional_special_tokens=["<sep>"],
        clean_up_tokenization_spaces=False,
    )


def stream(
    ids: list[int], params: SamplingParams, prompt: str = "Hello", chunk: int = 1, is_stop_token: bool = False
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feeds ``ids`` ``chunk`` at a time; returns the detokenizer and the streamed deltas."""
    tok = tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    deltas = []
    for start in range(0, len(ids), chunk):
        is_last = start + chunk >= len(ids)
        detok.update(ids[start : start + chunk], is_finished=is_last, is_stop_token=is_stop_token and is_last)
        deltas.append(detok.get_next_output_text(finished=is_last or detok.is_stopped, delta=True))
        if detok.is_stopped:
            break
    return detok, deltas


def reference(ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


def test_tokenizer_splits_multibyte_characters():
    tok = tokenizer()
    pieces = [tok.decode([i]) for i in tok.encode("😀🚀東京")]
    assert any("\ufffd" in p for p in pieces), "test tokenizer should split characters across tokens"


@pytest.mark.parametrize("text", CORPUS[:5])
@pytest.mark.parametrize("chunk", [1, 3])
def test_roundtrip_of_encoded_text(text, chunk):
    ids = tokenizer().encode(text)
    detok, deltas = stream(ids, SamplingParams(), chunk=chunk)
    assert detok.output_text == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_partial_character_is_held_until_complete():
    tok = tokenizer()
    ids = tok.encode("a😀")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    emitted = [detok.update([i]) or detok.get_next_output_text(False, True) for i in ids]
    assert "".join(emitted) == "a😀"
    assert all("\ufffd" not in e for e in emitted)


token_ids = st.lists(st.integers(min_value=0, max_value=419), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ids=token_ids, chunk=st.integers(1, 4), skip=st.booleans())
def test_final_text_equals_decode(ids, chunk, skip):
    params = SamplingParams(skip_special_tokens=skip)
    detok, deltas = stream(ids, params, chunk=chunk)
    assert detok.output_text == reference(ids, skip)
    assert "".join(deltas) == detok.output_text


@settings(max_examples=150, deadline=None)
@given(
    ids=token_ids,
    stop=st.sampled_from(["o", "é", "東京", "😀", "st", "\ufffd", "the lazy"]),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_stop_string_cut_and_never_partially_streamed(ids, stop, include, chunk):
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok, deltas = stream(ids, params, chunk=chunk)
    full = reference(ids)
    if stop in full:
        # Matched at its first occurrence; text cut before it (or right after it).
        cut = full.index(stop) + (len(stop) if include else 0)
        assert detok.stop_reason == stop
        assert detok.output_text == full[:cut]
    else:
        assert detok.stop_reason is None
        assert detok.output_text == full
    # Deltas only ever append, so every streamed prefix is a prefix of the cut
    # text: nothing past the cut (no partial stop string) was ever sent.
    streamed = "".join(deltas)
    assert streamed == detok.output_text
    if not include:
        assert stop not in streamed


def test_stop_string_across_token_boundaries():
    tok = tokenizer()
    ids = tok.encode("Hello world! The quick brown fox")
    detok, deltas = stream(ids, SamplingParams(stop=["d! The q"]))
    assert detok.stop_reason == "d! The q"
    assert detok.output_text == "Hello worl"
    assert "".join(deltas) == "Hello worl"


def test_earliest_stop_string_wins():
    assert find_stop_string("abcdef", 0, ["ef", "cd"]) == ("cd", 2)
    assert find_stop_string("abcdef", 5, ["ef", "cd"]) == ("ef", 4)
    assert find_stop_string("abcdef", 0, ["xyz"]) is None


def test_streaming_holds_back_possible_stop_prefix():
    tok = tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    for token_id in tok.encode("end ST"):
        detok.update([token_id])
    assert detok.get_next_output_text(finished=False, delta=False) == "end ST"[:-3]
    assert detok.get_next_output_text(finished=True, delta=False) == "end ST"


def test_stop_token_excluded_unless_included():
    tok = tokenizer()
    ids = tok.encode("hello") + [tok.convert_tokens_to_ids("<sep>")]
    detok, _ = stream(ids, SamplingParams(skip_special_tokens=False), is_stop_token=True)
    assert detok.output_text == "hello"
    detok, _ = stream(
        ids, SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), is_stop_token=True
    )
    assert detok.output_text == "hello<sep>"


def test_special_tokens_skipped_or_kept():
    tok = tokenizer()
    ids = tok.encode("ab") + [tok.eos_token_id] + tok.encode(" cd")
    assert stream(ids, SamplingParams())[0].output_text == "ab cd"
    assert stream(ids, SamplingParams(skip_special_tokens=False))[0].output_text == "ab<eos> cd"


def test_min_tokens_defers_stop_strings():
    tok = tokenizer()
    ids = tok.encode("end end end")
    detok, _ = stream(ids, SamplingParams(stop=["end"], min_tokens=len(ids)))
    assert detok.stop_reason is None and detok.output_text == "end end end"
    detok, _ = stream(ids, SamplingParams(stop=["end"], include_stop_str_in_output=True))
    assert detok.stop_reason == "end" and detok.output_text == "end"
