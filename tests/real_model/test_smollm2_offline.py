"""The offline engine on a real pretrained model, SmolLM2-135M-Instruct (float32), against transformers.

* The prompt ids of ``LLM.chat`` are transformers' ``apply_chat_template`` ids: default system prompt,
  one given, several turns, with and without the generation prompt.
* Greedy outputs of one batch of chat prompts equal ``generate(do_sample=False)`` token for token, each
  stopped by ``<|im_end|>`` where transformers stops ("The capital of France is Paris."), and the text is
  ``tokenizer.decode`` of those tokens.
* Streamed text deltas (``RequestOutputKind.DELTA``, one per step) of long outputs full of multi-byte
  characters split across byte-level tokens (CJK, emoji, a regex forcing accented, CJK and emoji text)
  concatenate to ``tokenizer.decode``; every partial concatenation is a prefix of it (no U+FFFD for a
  character still arriving).
* TP=2 is refused at start-up: 9 attention heads do not divide by 2.

Every KV block is free again after each run.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.engine_args import EngineArgs
from engine.sampling_params import RequestOutputKind, StructuredOutputsParams
from tests.conftest import assert_pool_clean, make_llm
from tests.real_model.smollm2 import (
    CAPITAL_ANSWER,
    CONVERSATIONS,
    DEFAULT_SYSTEM_PROMPT,
    ENGINE_KWARGS,
    EOS_TOKEN_ID,
    MAX_NEW_TOKENS,
    NAMES,
    assert_greedy_equals_transformers,
    greedy_params,
    hf_decode,
    hf_tokenizer,
    template_ids,
)

REPLACEMENT_CHAR = "\ufffd"
STREAM_MAX_TOKENS = 64
FORCED_TEXT = "Café naïve déjà vu — 你好，世界！🌍🎉 おはよう"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = make_llm(smollm2_path, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def chat_outputs(llm) -> dict:
    """Every conversation in one ``LLM.chat`` batch, greedy: name -> its RequestOutput."""
    outputs = llm.chat([CONVERSATIONS[name] for name in NAMES], greedy_params(), use_tqdm=False)
    assert_pool_clean(llm)
    return dict(zip(NAMES, outputs))


def test_the_default_system_prompt_is_the_templates(smollm2_path):
    rendered = hf_tokenizer(smollm2_path).apply_chat_template(
        CONVERSATIONS["capital"], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", NAMES)
def test_chat_prompt_ids_equal_the_transformers_template(smollm2_path, chat_outputs, name):
    assert chat_outputs[name].prompt_token_ids == template_ids(smollm2_path, CONVERSATIONS[name])


def test_prompt_ids_without_the_generation_prompt(smollm2_path, llm):
    conversations = [CONVERSATIONS["multi_turn"], CONVERSATIONS["capital"]]
    outputs = llm.chat(conversations, greedy_params(1), use_tqdm=False, add_generation_prompt=False)
    for conversation, output in zip(conversations, outputs):
        expected = template_ids(smollm2_path, conversation, add_generation_prompt=False)
        assert output.prompt_token_ids == expected
        assert expected[-2:] == [EOS_TOKEN_ID, 198]  # ends with the last turn's "<|im_end|>\n"
    assert_pool_clean(llm)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_generate(smollm2_path, chat_outputs, name):
    completion = chat_outputs[name].outputs[0]
    expected = assert_greedy_equals_transformers(smollm2_path, name, completion)
    ended_turn = expected[-1] == EOS_TOKEN_ID
    assert len(expected) == MAX_NEW_TOKENS or ended_turn
    # vLLM's stop_reason: None for EOS (only stop strings and stop_token_ids name themselves).
    assert (completion.finish_reason, completion.stop_reason) == ("stop" if ended_turn else "length", None)


def test_the_capital_of_france_is_paris(chat_outputs):
    completion = chat_outputs["capital"].outputs[0]
    assert completion.text == CAPITAL_ANSWER
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == EOS_TOKEN_ID


def stream_deltas(llm, prompts: dict[str, dict], params: SamplingParams) -> dict[str, tuple[list[str], list[int]]]:
    """Runs ``prompts`` together with DELTA outputs: name -> (the text deltas in order, all token ids)."""
    engine = llm.llm_engine
    deltas = {name: ([], []) for name in prompts}
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params.clone(output_kind=RequestOutputKind.DELTA))
    while engine.has_unfinished_requests():
        for output in engine.step():
            [completion] = output.outputs
            texts, token_ids = deltas[output.request_id]
            texts.append(completion.text)
            token_ids.extend(completion.token_ids)
    return deltas


def chat_prompt(llm, name: str) -> dict:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(CONVERSATIONS[name], tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def test_streamed_multibyte_text_equals_tokenizer_decode(smollm2_path, llm, chat_outputs):
    names = ("cjk", "emoji")
    streams = stream_deltas(llm, {name: chat_prompt(llm, name) for name in names}, greedy_params(STREAM_MAX_TOKENS))
    tokenizer = hf_tokenizer(smollm2_path)
    for name in names:
        texts, token_ids = streams[name]
        # The same greedy tokens as the batch above, continued past MAX_NEW_TOKENS.
        assert token_ids[:MAX_NEW_TOKENS] == chat_outputs[name].outputs[0].token_ids
        assert len(token_ids) == STREAM_MAX_TOKENS, "the test wants a long output (no early <|im_end|>)"
        # Multi-byte characters split across tokens: some tokens alone decode to U+FFFD.
        assert sum(REPLACEMENT_CHAR in tokenizer.decode([token_id]) for token_id in token_ids) >= 4
        expected = hf_decode(smollm2_path, token_ids)
        assert "".join(texts) == expected
        for end in range(len(texts)):
            assert expected.startswith("".join(texts[:end])), (name, texts[:end])
        assert any(ord(char) > 0x2FFF for char in expected)  # CJK or emoji made it into the text
    assert_pool_clean(llm)


def test_forced_multibyte_text_streams_whole_characters(smollm2_path, llm):
    """A regex forces a fixed text (accents, CJK, emoji): whatever tokens the model picks for it, the stream
    is that text exactly, then ``<|im_end|>`` (the only token the finished grammar allows)."""
    import re

    prompt = chat_prompt(llm, "emoji")
    params = greedy_params(STREAM_MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex=re.escape(FORCED_TEXT)))
    [(texts, token_ids)] = stream_deltas(llm, {"forced": prompt}, params).values()
    tokenizer = hf_tokenizer(smollm2_path)
    assert token_ids[-1] == EOS_TOKEN_ID
    assert any(REPLACEMENT_CHAR in tokenizer.decode([token_id]) for token_id in token_ids)
    assert "".join(texts) == hf_decode(smollm2_path, token_ids) == FORCED_TEXT
    for end in range(len(texts)):
        assert FORCED_TEXT.startswith("".join(texts[:end]))
    assert_pool_clean(llm)


def test_tp2_is_refused_because_9_heads_do_not_divide_by_2(smollm2_path):
    with pytest.raises(ValueError) as refused:
        EngineArgs(model=smollm2_path, tensor_parallel_size=2, **ENGINE_KWARGS).create_engine_config()
    message = str(refused.value)
    assert "9" in message and "tensor_parallel_size" in message
    assert "divide" in message or "divisible" in message
