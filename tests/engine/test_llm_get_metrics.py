"""``LLM.get_metrics()`` on a real tiny engine: vLLM's reader shape (``engine.metrics.reader``), named as
the replicas' Prometheus series, with values that match what the engine did."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.metrics.reader import Counter, Gauge
from tests.conftest import make_llm, token_prompt

PROMPT_LENGTHS = (5, 9)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint("llama"), max_model_len=64, max_num_seqs=2)
    yield llm
    llm.shutdown()


def by_name(metrics) -> dict:
    names = [metric.name for metric in metrics]
    assert len(names) == len(set(names)), names
    return {metric.name: metric for metric in metrics}


def test_get_metrics_counts_what_the_engine_did(llm, tiny_checkpoint):
    before = by_name(llm.get_metrics())
    assert before["serval_generation_tokens"] == Counter(
        "serval_generation_tokens", {"model_name": tiny_checkpoint("llama")}, 0
    )
    prompts = [token_prompt(range(10, 10 + length)) for length in PROMPT_LENGTHS]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    after = by_name(llm.get_metrics())
    num_generated = sum(len(completion.token_ids) for output in outputs for completion in output.outputs)
    assert num_generated == MAX_TOKENS * len(prompts)
    assert after["serval_generation_tokens"].value == num_generated
    assert after["serval_prompt_tokens"].value == sum(PROMPT_LENGTHS)
    for name in ("serval_num_requests_running", "serval_num_requests_waiting"):
        assert isinstance(after[name], Gauge) and after[name].value == 0  # every request finished
    assert 0.0 <= after["serval_kv_cache_usage_perc"].value <= 1.0
    assert after["serval_num_preemptions"].value == 0
    assert not [name for name in after if "spec_decode" in name]  # no speculative_config


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_get_metrics_counts_ngram_speculation(tiny_checkpoint):
    """A prompt that repeats itself gives the n-gram proposer drafts from the first decode step on."""
    llm = make_llm(tiny_checkpoint("llama"), max_model_len=64, max_num_seqs=2, speculative_config=NGRAM)
    try:
        (output,) = llm.generate(
            [token_prompt([10, 11, 12, 13] * 4)],
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS * 2),
            use_tqdm=False,
        )
        metrics = by_name(llm.get_metrics())
    finally:
        llm.shutdown()
    assert len(output.outputs[0].token_ids) == MAX_TOKENS * 2
    assert metrics["serval_generation_tokens"].value == MAX_TOKENS * 2  # emitted tokens, drafts or not
    drafted = metrics["serval_spec_decode_num_draft_tokens"].value
    accepted = metrics["serval_spec_decode_num_accepted_tokens"].value
    assert metrics["serval_spec_decode_num_drafts"].value > 0 and drafted > 0
    assert 0 <= accepted <= drafted
    per_pos = metrics["serval_spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == NGRAM["num_speculative_tokens"] and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a draft's token i is accepted only after 0..i-1
