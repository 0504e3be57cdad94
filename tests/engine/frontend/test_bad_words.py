"""``bad_words`` end to end: the front end turns them into token ids, the worker bans those ids.

The Processor tokenizes each word (vLLM's rule: as given and with a leading
space) into ``SamplingParams.bad_words_token_ids``; nothing on the worker
loads a tokenizer, so a request with bad words must run with tokenizer
loading broken once the engine is up.
"""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.sample import tokenize_bad_words
from tests.conftest import assert_pool_clean, make_llm, random_token_ids, token_prompt

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return make_llm(tiny_checkpoint("llama"), max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def prompt() -> dict:
    return token_prompt(random_token_ids(random.Random(5), 20))


def _greedy(**changes) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **changes)


def _single_token_word(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A generated token whose text encodes back to exactly that one token (so banning it is exact)."""
    for token_id in token_ids:
        word = tokenizer.decode([token_id])
        if word.strip() and word == word.lstrip() and tokenizer.encode(word, add_special_tokens=False) == [token_id]:
            return word, token_id
    pytest.skip("no generated token round-trips through the tokenizer as a single word")


def test_the_processor_carries_the_bad_words_as_token_ids(llm, prompt):
    engine = llm.llm_engine
    words = ["hello", " world", "x"]
    request = engine.processor.make_request("r", prompt["prompt_token_ids"], _greedy(bad_words=words))
    assert request.sampling_params.bad_words == words
    assert request.sampling_params.bad_words_token_ids == tokenize_bad_words(words, engine.tokenizer)
    assert request.sampling_params.bad_words_token_ids  # the check above compares something
    plain = engine.processor.make_request("s", prompt["prompt_token_ids"], _greedy())
    assert plain.sampling_params.bad_words_token_ids is None


def test_a_bad_word_is_never_generated_and_the_worker_loads_no_tokenizer(llm, prompt, monkeypatch):
    import transformers

    baseline = llm.generate([prompt], _greedy())[0].outputs[0].token_ids
    word, token_id = _single_token_word(llm.llm_engine.tokenizer, baseline)

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("a tokenizer was loaded while the engine ran")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    banned = llm.generate([prompt], _greedy(bad_words=[word]))[0].outputs[0].token_ids
    # The word as given is token_id; its spaced form may be one other token, banned as well.
    banned_ids = {ids[0] for ids in tokenize_bad_words([word], llm.llm_engine.tokenizer)}
    assert token_id in banned_ids and token_id in baseline
    assert not banned_ids & set(banned)
    first = min(baseline.index(t) for t in banned_ids if t in baseline)
    assert banned[:first] == baseline[:first]  # identical up to where a banned token would come
    assert_pool_clean(llm)
