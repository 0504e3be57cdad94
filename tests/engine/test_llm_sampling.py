"""Random sampling through the whole engine: reproducible seeds, and distributions that are exactly right.

* Seeded requests give the same tokens across runs, batch compositions,
  prefix-cache states, chunked prefill, logprobs on or off and preemption;
  ``n`` > 1 children use ``seed + i`` (vLLM's convention).
* Top-k, top-p and min-p (and their combination, after temperature) are
  checked statistically: thousands of one-token completions of one prompt,
  drawn in a single ``generate`` call with the filters mixed row by row,
  against the exact filtered softmax computed (in float64) from Hugging
  Face's logits for that prompt. Tokens outside the filtered support must
  never appear; the counts must pass a chi-square test and a per-token
  binomial bound (false-alarm rate about 1e-5 per run).
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_pool_clean, random_token_ids, token_prompt
from tests.conftest import make_llm as make_test_llm

# ------------------------------------------------------------ reproducibility

SEEDED_ARCH = "llama"
SEEDED_LENGTHS = (4, 15, 33, 60, 90, 120)
SEEDED_MAX_TOKENS = 16
PREEMPT_MAX_MODEL_LEN = 160
PREEMPT_NUM_BLOCKS = PREEMPT_MAX_MODEL_LEN // 16 + 1


def seeded_params(seed: int, **changes) -> SamplingParams:
    fields = dict(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=SEEDED_MAX_TOKENS, ignore_eos=True)
    fields.update(changes)
    return SamplingParams(**fields)


@pytest.fixture(scope="module")
def seeded_model(tiny_checkpoint) -> str:
    return tiny_checkpoint(SEEDED_ARCH)


@pytest.fixture(scope="module")
def seeded_prompts() -> list[dict]:
    rng = random.Random(99)
    return [token_prompt(random_token_ids(rng, n)) for n in SEEDED_LENGTHS]


# This module's engines (float32, seed 0 from the conftest); call sites override further.
make_llm = functools.partial(make_test_llm, max_model_len=256, max_num_seqs=16, enable_prefix_caching=True)


def token_ids(outputs) -> list[list[int]]:
    return [completion.token_ids for output in outputs for completion in output.outputs]


@pytest.fixture(scope="module")
def seeded_reference(seeded_model, seeded_prompts) -> list[list[int]]:
    """The seeded batch run once on a fresh engine (cold prefix cache)."""
    llm = make_llm(seeded_model)
    params = [seeded_params(1000 + i) for i in range(len(seeded_prompts))]
    outputs = llm.generate(seeded_prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == SEEDED_MAX_TOKENS for o in outputs)
    assert_pool_clean(llm)
    return token_ids(outputs)


@pytest.fixture(scope="module")
def seeded_llm(seeded_model) -> LLM:
    return make_llm(seeded_model)


def test_same_seed_same_tokens_across_runs_and_batches(seeded_llm, seeded_prompts, seeded_reference):
    llm = seeded_llm
    params = [seeded_params(1000 + i) for i in range(len(seeded_prompts))]
    # Again, twice (prefix cache warm now).
    for _ in range(2):
        assert token_ids(llm.generate(seeded_prompts, params, use_tqdm=False)) == seeded_reference
    # One prompt at a time.
    alone = [token_ids(llm.generate(prompt, p, use_tqdm=False))[0] for prompt, p in zip(seeded_prompts, params)]
    assert alone == seeded_reference
    # Reversed, interleaved with unseeded, greedy and shorter requests.
    rng = random.Random(5)
    batch, batch_params, where = [], [], {}
    for i in reversed(range(len(seeded_prompts))):
        batch += [
            token_prompt(random_token_ids(rng, rng.randrange(2, 80))),
            seeded_prompts[i],
            token_prompt(random_token_ids(rng, 7)),
        ]
        batch_params += [
            SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 30)),
            params[i],
            SamplingParams(temperature=0.0, max_tokens=3),
        ]
        where[i] = len(batch) - 2
    mixed = token_ids(llm.generate(batch, batch_params, use_tqdm=False))
    assert [mixed[where[i]] for i in range(len(seeded_prompts))] == seeded_reference
    assert_pool_clean(llm)


def test_same_seed_twice_in_one_batch_and_other_seeds_differ(seeded_llm, seeded_prompts, seeded_reference):
    prompt = seeded_prompts[2]
    outputs = token_ids(
        seeded_llm.generate(
            [prompt, prompt, prompt], [seeded_params(1002), seeded_params(1002), seeded_params(7)], use_tqdm=False
        )
    )
    assert outputs[0] == outputs[1] == seeded_reference[2]
    assert outputs[2] != outputs[0]
    assert_pool_clean(seeded_llm)


def test_seeded_tokens_do_not_depend_on_logprobs(seeded_llm, seeded_prompts, seeded_reference):
    params = [seeded_params(1000 + i, logprobs=3, prompt_logprobs=1) for i in range(len(seeded_prompts))]
    outputs = seeded_llm.generate(seeded_prompts, params, use_tqdm=False)
    assert token_ids(outputs) == seeded_reference
    for output in outputs:
        completion = output.outputs[0]
        assert len(completion.logprobs) == SEEDED_MAX_TOKENS
        assert all(token in position for token, position in zip(completion.token_ids, completion.logprobs))
    assert_pool_clean(seeded_llm)


@pytest.mark.parametrize("config", ["preemption", "chunked", "no-prefix-caching"])
def test_seeded_tokens_survive_preemption_and_chunking(seeded_model, seeded_prompts, seeded_reference, config):
    overrides = {
        "preemption": dict(max_model_len=PREEMPT_MAX_MODEL_LEN, num_gpu_blocks_override=PREEMPT_NUM_BLOCKS),
        "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
        "no-prefix-caching": dict(enable_prefix_caching=False, max_num_seqs=2),
    }[config]
    llm = make_llm(seeded_model, **overrides)
    params = [seeded_params(1000 + i) for i in range(len(seeded_prompts))]
    assert token_ids(llm.generate(seeded_prompts, params, use_tqdm=False)) == seeded_reference
    if config == "preemption":
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert_pool_clean(llm)


def test_n_completions_with_seed(seeded_llm, seeded_prompts):
    prompt = seeded_prompts[1]
    params = seeded_params(77, n=3)
    first = seeded_llm.generate(prompt, params, use_tqdm=False)
    assert len(first) == 1 and len(first[0].outputs) == 3
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == SEEDED_MAX_TOKENS for c in first[0].outputs)
    completions = token_ids(first)
    assert len({tuple(c) for c in completions}) == 3, "the n completions should differ"
    # Reproducible, and child i samples like a single request seeded with seed + i.
    assert token_ids(seeded_llm.generate(prompt, params, use_tqdm=False)) == completions
    singles = [token_ids(seeded_llm.generate(prompt, seeded_params(77 + i), use_tqdm=False))[0] for i in range(3)]
    assert singles == completions
    # Without a seed: still n completions, not all the same.
    unseeded = seeded_llm.generate(prompt, seeded_params(None, n=3), use_tqdm=False)
    assert len(unseeded[0].outputs) == 3 and len({tuple(c) for c in token_ids(unseeded)}) > 1
    assert_pool_clean(seeded_llm)


# --------------------------------------------------------------- statistics

STAT_ARCH = "qwen2"
STAT_PROMPT = [300]
NUM_SAMPLES = 4000
# Every filter alone and combined, each after a temperature (vLLM's order: temperature, min-p, top-k, top-p).
STAT_CONFIGS = {
    "temperature-only": dict(temperature=1.0),
    "top_k": dict(temperature=1.5, top_k=12),
    "top_p": dict(temperature=1.5, top_p=0.6),
    "min_p": dict(temperature=1.5, min_p=0.15),
    "combined": dict(temperature=1.2, top_k=40, top_p=0.85, min_p=0.03),
}
SEEDED_STAT_CONFIG = dict(temperature=1.5, top_k=12, top_p=0.8)
NUM_GREEDY_ROWS = 50


def filtered_distribution(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The exact sampling distribution (float64), written independently of the engine's sampler.

    min-p keeps tokens with probability >= min_p * the top probability; top-k
    keeps the k most likely; top-p keeps, in descending order, every token
    whose preceding mass (after renormalising over the survivors so far) is
    below top_p. Asserts that no token sits within a rounding error of a
    threshold, so float32 vs float64 cannot change the support.
    """
    probs = (logits.double() / temperature).softmax(dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p > 0:
        threshold = min_p * probs.max()
        assert ((probs - threshold).abs() > 1e-4 * threshold).all(), "a token sits on the min-p threshold"
        keep &= probs >= threshold
    if top_k > 0:
        ranks = torch.empty_like(order)
        ranks[order] = torch.arange(len(order))
        keep &= ranks < top_k
    if top_p < 1.0:
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        kept = kept / kept.sum()
        sorted_kept = kept[order]
        mass_before = sorted_kept.cumsum(0) - sorted_kept
        assert ((mass_before - top_p).abs()[sorted_kept > 0] > 1e-4).all(), "a token sits on the top-p threshold"
        in_top_p = torch.zeros_like(keep)
        in_top_p[order] = mass_before < top_p
        keep &= in_top_p
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum()


def chi_square_z(counts: torch.Tensor, expected_probs: torch.Tensor, num: int) -> tuple[float, int]:
    """Pearson's chi-square over the support (bins with expectation < 5 pooled), as a Wilson-Hilferty z-score."""
    support = expected_probs > 0
    expected = expected_probs[support] * num
    observed = counts[support].double()
    small = expected < 5
    bins_e = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    bins_o = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    if bins_e[-1] == 0:
        bins_e, bins_o = bins_e[:-1], bins_o[:-1]
    chi2 = float(((bins_o - bins_e) ** 2 / bins_e).sum())
    df = len(bins_e) - 1
    if df == 0:
        return 0.0, 0
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return z, df


def assert_matches_distribution(samples: list[int], expected: torch.Tensor, label: str) -> None:
    num = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=len(expected))
    outside = sorted(set(torch.nonzero((counts > 0) & (expected == 0)).flatten().tolist()))
    assert not outside, f"{label}: sampled tokens outside the filtered support: {outside}"
    z, df = chi_square_z(counts, expected, num)
    assert z < 4.5, f"{label}: chi-square z-score {z:.2f} (df {df}) — the empirical distribution is off"
    # Per token, where the normal approximation of the binomial holds (the chi-square covers the rest).
    mean = expected * num
    sigma = (num * expected * (1 - expected)).sqrt()
    checked = mean >= 10
    excess = ((counts.double() - mean).abs() - 6 * sigma)[checked]
    assert (excess <= 0).all(), f"{label}: a token's count is more than 6 sigma from its expectation"
    # The support is really exercised: the likely tokens all appear.
    assert all(counts[t] > 0 for t in torch.nonzero(expected * num > 20).flatten().tolist()), label


@pytest.fixture(scope="module")
def stat_llm(tiny_checkpoint) -> LLM:
    return make_llm(tiny_checkpoint(STAT_ARCH), max_model_len=64, max_num_seqs=1024, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def stat_logits(hf_reference) -> torch.Tensor:
    return hf_reference(STAT_ARCH).next_token_logits(STAT_PROMPT)


def test_filtered_distributions_match_exact_softmax(stat_llm, stat_logits):
    """All filter configurations in one generate call, rows interleaved, unseeded, plus greedy rows."""
    configs = list(STAT_CONFIGS.items())
    params = []
    for _ in range(NUM_SAMPLES):
        params += [SamplingParams(max_tokens=1, detokenize=False, **fields) for _, fields in configs]
    greedy_at = set(range(0, len(params), len(params) // NUM_GREEDY_ROWS))
    params = [SamplingParams(temperature=0.0, max_tokens=1) if i in greedy_at else p for i, p in enumerate(params)]
    outputs = stat_llm.generate([token_prompt(STAT_PROMPT)] * len(params), params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids[0] for o in outputs]
    assert all(len(o.outputs[0].token_ids) == 1 for o in outputs)
    argmax = int(stat_logits.argmax())
    assert all(tokens[i] == argmax for i in greedy_at), "greedy rows mixed with random rows must take the argmax"
    for index, (name, fields) in enumerate(configs):
        samples = [t for i, t in enumerate(tokens) if i % len(configs) == index and i not in greedy_at]
        assert_matches_distribution(samples, filtered_distribution(stat_logits, **fields), name)
    assert_pool_clean(stat_llm)


def test_seeded_draws_follow_the_filtered_distribution(stat_llm, stat_logits):
    """Per-request generators (seed i for request i) sample the same distribution as the shared one."""
    params = [
        SamplingParams(max_tokens=1, seed=seed, detokenize=False, **SEEDED_STAT_CONFIG) for seed in range(NUM_SAMPLES)
    ]
    outputs = stat_llm.generate([token_prompt(STAT_PROMPT)] * len(params), params, use_tqdm=False)
    samples = [o.outputs[0].token_ids[0] for o in outputs]
    assert_matches_distribution(samples, filtered_distribution(stat_logits, **SEEDED_STAT_CONFIG), "seeded")
    # And the same seeds again give the very same draws.
    again = stat_llm.generate([token_prompt(STAT_PROMPT)] * 200, params[:200], use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in again] == samples[:200]
    assert_pool_clean(stat_llm)


def test_filter_reference_sanity(stat_logits):
    """The reference itself: supports of the expected sizes, and top-k/top-p/min-p really bite."""
    sizes = {
        name: int((filtered_distribution(stat_logits, **fields) > 0).sum()) for name, fields in STAT_CONFIGS.items()
    }
    assert sizes["temperature-only"] == stat_logits.numel()
    assert sizes["top_k"] == 12
    assert 3 <= sizes["top_p"] < 40 and 3 <= sizes["min_p"] < 40 and 3 <= sizes["combined"] < 40
