"""n-gram speculative decoding on a real pretrained model, SmolLM2-135M-Instruct (float32): greedy tokens
equal transformers' ``generate(do_sample=False)`` (which the plain engine equals, test_smollm2_offline), for
the same batch of chat prompts, the copy task drafting from its prompt and the others mostly rejecting;
the text of several tokens a step (multi-byte characters among them) is ``tokenizer.decode``'s. Every KV
block is free again after the run.
"""

from __future__ import annotations

import pytest

from tests.conftest import assert_pool_clean, make_llm
from tests.real_model.smollm2 import (
    CONVERSATIONS,
    ENGINE_KWARGS,
    NAMES,
    assert_greedy_equals_transformers,
    greedy_params,
)

pytestmark = pytest.mark.slow  # a second 135M engine and 40 greedy steps of six prompts: ~15-50 s at load

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def ngram_llm(smollm2_path):
    llm = make_llm(smollm2_path, speculative_config=NGRAM, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def spec_stats(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.get_stats().spec_decoding_stats


@pytest.fixture(scope="module")
def ngram_outputs(ngram_llm):
    outputs = ngram_llm.chat([CONVERSATIONS[name] for name in NAMES], greedy_params(), use_tqdm=False)
    assert_pool_clean(ngram_llm)
    return dict(zip(NAMES, outputs))


def test_drafts_were_accepted_and_rejected(ngram_outputs, ngram_llm):
    stats = spec_stats(ngram_llm)
    assert stats.num_accepted_tokens >= 10, stats  # the copy task's drafts hold
    assert stats.num_draft_tokens > stats.num_accepted_tokens, stats  # and some drafts are wrong


@pytest.mark.parametrize("name", NAMES)
def test_ngram_greedy_tokens_equal_transformers_generate(smollm2_path, ngram_outputs, name):
    completion = ngram_outputs[name].outputs[0]
    assert_greedy_equals_transformers(smollm2_path, name, completion)
