"""Sampler: masks, penalties, greedy, seeded and filtered sampling, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sample import (
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
    make_generator,
    tokenize_bad_words,
    validate_token_ids,
)
from engine.sample.penalties import apply_penalties
from engine.sampling_params import SamplingParams

VOCAB = 8
EOS = 0
# Distinct probabilities, far from every filter threshold used below.
PROBS = torch.tensor([0.32, 0.22, 0.16, 0.12, 0.08, 0.05, 0.03, 0.02])
LOGITS = PROBS.log()


def sample(logits, requests, eos=EOS, bad_words=None):
    meta = SamplingMetadata.from_requests(requests, logits.shape[1], eos, bad_words_token_ids=bad_words)
    return Sampler()(logits, meta)


def req(params, prompt=(), output=(), generator=None):
    return (params, list(prompt), list(output), generator)


# ---------------------------------------------------------------- greedy & masks


def test_greedy_is_argmax_fast_path():
    logits = torch.randn(5, 50)
    meta = SamplingMetadata.from_requests([req(SamplingParams(temperature=0))] * 5, 50, EOS)
    assert meta.is_argmax_only
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_take_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, 30)
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3)] * 3
    out = sample(logits, [req(p) for p in params])
    assert torch.equal(logits, before)
    for row in (0, 2, 4):
        assert out.sampled_token_ids[row] == logits[row].argmax()
    for row in (1, 3, 5):
        assert out.sampled_token_ids[row] in logits[row].topk(3).indices


def test_logit_bias_and_allowed_token_ids():
    logits = LOGITS.repeat(2, 1)
    greedy = SamplingParams(temperature=0, logit_bias={6: 10.0})
    allowed = SamplingParams(temperature=0, allowed_token_ids=[3, 5])
    out = sample(logits, [req(greedy), req(allowed)])
    assert out.sampled_token_ids.tolist() == [6, 3]
    torch.manual_seed(1)
    random_allowed = SamplingParams(temperature=1.0, allowed_token_ids=[4, 7])
    out = sample(LOGITS.repeat(500, 1), [req(random_allowed)] * 500)
    assert set(out.sampled_token_ids.tolist()) == {4, 7}


def test_bad_words_ban_last_token_after_matching_prefix():
    bad_words = [[[0], [1, 2, 3]]]
    params = SamplingParams(temperature=0)
    logits = torch.tensor([[9.0, 0, 0, 8.0, 0, 0, 0, 0]])
    out = sample(logits, [req(params, output=[5, 1, 2])], eos=None, bad_words=bad_words)
    assert out.sampled_token_ids.item() not in (0, 3)
    out = sample(logits, [req(params, output=[5, 2])], eos=None, bad_words=bad_words)
    assert out.sampled_token_ids.item() == 3  # prefix [1, 2] not matched; 0 always banned


def test_tokenize_bad_words_adds_spaced_variant_like_vllm():
    class FakeTokenizer:
        table = {"bad": [10, 11], " bad": [12, 11], "x": [5], " x": [6, 7], "same": [3], " same": [3]}

        def encode(self, text, add_special_tokens=False):
            return self.table[text]

    assert tokenize_bad_words([" bad", "x", "same"], FakeTokenizer()) == [[10, 11], [12, 11], [5], [3]]


@pytest.mark.parametrize(
    "num_output, ignore_eos, banned",
    [
        (0, False, {EOS, 7}),
        (1, True, {7}),
        (2, False, set()),
    ],
)
def test_min_tokens_bans_eos_and_stop_tokens(num_output, ignore_eos, banned):
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], ignore_eos=ignore_eos)
    meta = SamplingMetadata.from_requests([req(params, output=[3] * num_output)], VOCAB, EOS)
    assert set(meta.min_tokens_banned_ids.get(0, [])) == banned
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, EOS] = 5.0, 6.0
    token = Sampler()(logits, meta).sampled_token_ids.item()
    assert token == (EOS if EOS not in banned else 7 if 7 not in banned else 1)


def test_validate_token_ids():
    validate_token_ids(SamplingParams(logit_bias={1: 1.0}, allowed_token_ids=[7]), VOCAB)
    with pytest.raises(ValueError, match="logit_bias"):
        validate_token_ids(SamplingParams(logit_bias={8: 1.0}), VOCAB)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        validate_token_ids(SamplingParams(allowed_token_ids=[100]), VOCAB)


# ---------------------------------------------------------------- penalties


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    result = logits.clone()
    for token in range(logits.shape[0]):
        value = result[token].item()
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        value -= frequency * output.count(token) + presence * (token in output)
        result[token] = value
    return result


penalty = st.floats(-2.0, 2.0, allow_nan=False)
token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(token_lists, token_lists, penalty, penalty, st.floats(0.1, 3.0)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_penalties_match_reference(rows, seed):
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    requests, expected = [], []
    for i, (prompt, output, presence, frequency, repetition) in enumerate(rows):
        params = SamplingParams(
            temperature=0,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logprobs=VOCAB - 1,
        )
        requests.append(req(params, prompt, output))
        expected.append(reference_penalties(logits[i], prompt, output, presence, frequency, repetition))
    meta = SamplingMetadata.from_requests(requests, VOCAB, None)
    processed = logits.clone()
    apply_penalties(processed, meta)
    torch.testing.assert_close(processed, torch.stack(expected))
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, processed.argmax(-1))


# ---------------------------------------------------------------- seeded sampling


def run_steps(batch_params, seeded_row, steps_logits):
    """Samples ``len(steps_logits)`` steps; returns the tokens of ``seeded_row``."""
    generators = {i: make_generator(p.seed) for i, p in enumerate(batch_params) if p.seed is not None}
    tokens = []
    for logits in steps_logits:
        requests = [req(p, generator=generators.get(i)) for i, p in enumerate(batch_params)]
        rows = torch.stack([logits] * len(batch_params))
        tokens.append(sample(rows, requests).sampled_token_ids[seeded_row].item())
    return tokens


def test_seeded_sampling_independent_of_batch():
    steps = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = run_steps([seeded], 0, steps)
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(seed=7, top_k=5)]
    torch.manual_seed(99)
    assert run_steps(others + [seeded], 3, steps) == alone
    torch.manual_seed(5)
    assert run_steps([seeded] + others[::-1], 0, steps) == alone
    assert run_steps([seeded.clone(seed=1235)], 0, steps) != alone


# ---------------------------------------------------------------- filter statistics


def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Exact filtered distribution: temperature, min-p, top-k, top-p (no ties assumed)."""
    probs = (logits / temperature).softmax(-1)
    keep = probs >= min_p * probs.max()
    order = probs.argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    mass_before = 0.0
    for token in order.tolist():
        if mass_before >= top_p:
            keep[token] = False
        mass_before += kept[token].item()
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


NUM_DRAWS = 20_000


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1.0),
        dict(temperature=0.6),
        dict(temperature=1.7),
        dict(top_k=3),
        dict(top_p=0.6),
        dict(top_p=0.9, temperature=0.8),
        dict(min_p=0.3),
        dict(min_p=0.2, top_k=5, top_p=0.7, temperature=1.3),
    ],
)
def test_empirical_frequencies_match_filtered_softmax(kwargs):
    torch.manual_seed(2024)
    params = SamplingParams(**kwargs)
    meta = SamplingMetadata.from_requests([req(params)] * NUM_DRAWS, VOCAB, None)
    tokens = Sampler()(LOGITS.repeat(NUM_DRAWS, 1), meta).sampled_token_ids
    freqs = torch.bincount(tokens, minlength=VOCAB).double() / NUM_DRAWS
    expected = reference_distribution(LOGITS, **kwargs).double()
    assert torch.all(freqs[expected == 0] == 0), "sampled outside the filtered support"
    sigma = (expected * (1 - expected) / NUM_DRAWS).sqrt()
    # 5 sigma per token: a false alarm has probability ~1e-6 per token (fixed seed anyway).
    assert torch.all((freqs - expected).abs() <= 5 * sigma + 1e-9), (freqs, expected)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.integers(0, 20),
    temperature=st.floats(0.05, 3.0),
    allowed=st.one_of(st.none(), st.lists(st.integers(0, 19), min_size=1, max_size=6)),
)
def test_samples_stay_in_support(seed, top_k, temperature, allowed):
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(seed)).round(decimals=1).repeat(64, 1)
    params = SamplingParams(temperature=temperature, top_k=top_k, allowed_token_ids=allowed, seed=seed)
    out = sample(logits, [req(params, generator=make_generator(seed))] * 64)
    row = logits[0].clone()
    if allowed is not None:
        row[[t for t in range(20) if t not in allowed]] = -math.inf
    support = set(range(20)) if not top_k else {t for t in range(20) if row[t] >= row.topk(top_k).values[-1]}
    support &= {t for t in range(20) if row[t] > -math.inf}
    assert set(out.sampled_token_ids.tolist()) <= support


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_topn_with_sampled_token_and_rank():
    torch.manual_seed(3)
    logits = torch.randn(4, 40)
    params = [
        SamplingParams(logprobs=3, temperature=2.0, presence_penalty=1.0),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=5, top_k=10),
        SamplingParams(logprobs=0, temperature=0.5),
    ]
    out = sample(logits, [req(p, output=[1, 2]) for p in params])
    raw = logits.log_softmax(-1)
    assert out.logprob_token_ids.shape == out.logprobs.shape == (4, 6)
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    order = raw.argsort(dim=-1, descending=True)
    for row in range(4):
        rank = (order[row] == out.sampled_token_ids[row]).nonzero().item() + 1
        assert out.sampled_token_ranks[row].item() == rank


def test_logprobs_whole_vocab():
    out = sample(LOGITS[None], [req(SamplingParams(logprobs=-1, temperature=0))])
    assert out.logprobs.shape == (1, VOCAB + 1)
    assert out.sampled_token_ranks.item() == 1
    torch.testing.assert_close(out.logprobs[0, 1:].exp().sum(), torch.tensor(1.0))


def test_prompt_logprobs_chunk():
    torch.manual_seed(4)
    logits = torch.randn(5, 30)
    next_ids = torch.tensor([3, 9, 0, 29, 9])
    result = compute_prompt_logprobs(logits, next_ids, 2)
    raw = logits.log_softmax(-1)
    assert torch.equal(result.token_ids[:, 0], next_ids)
    torch.testing.assert_close(result.logprobs[:, 0], raw[torch.arange(5), next_ids])
    assert torch.equal(result.token_ids[:, 1:], raw.topk(2).indices)
    expected_ranks = (raw > raw[torch.arange(5), next_ids][:, None]).sum(-1) + 1
    assert torch.equal(result.ranks, expected_ranks)
    assert compute_prompt_logprobs(logits, next_ids, -1).token_ids.shape == (5, 31)


def test_native_argmax_matches_torch_including_ties_and_non_finite_values():
    from engine.kernels.cpu import load_cpu_kernels
    from engine.sample.sampler import argmax

    assert load_cpu_kernels() is not None, "the native CPU ops must build on CI machines"
    generator = torch.Generator().manual_seed(0)
    for num_rows, vocab_size in [(1, 1), (3, 7), (64, 8192), (5, 16385)]:
        logits = torch.randn(num_rows, vocab_size, generator=generator)
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    logits = torch.zeros(6, 40)
    logits[0, [3, 9]] = 5.0  # a tie: the first index wins
    logits[1, 17] = float("nan")  # NaN is the maximum
    logits[1, 30] = float("nan")
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")
    logits[4, 0] = 1.0
    logits[5, 39] = 1.0
    assert argmax(logits).tolist() == [3, 17, 11, 0, 0, 39] == logits.argmax(dim=-1).tolist()
    strided = torch.randn(40, 8, generator=generator).t()  # non-contiguous rows
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))


def test_inverse_cdf_draws_the_normalised_row_and_never_a_zero_weight_token():
    """``sample_inverse_cdf`` over a vocabulary of 300 (two full blocks and a padded one): the support
    spans block boundaries, the extreme uniforms (0 and just below 1) land on the first and last tokens
    of non-zero weight, and 200k draws match the normalised weights."""
    from engine.sample.filters import sample_inverse_cdf

    weights = torch.zeros(1, 300)
    support = {3: 0.5, 127: 1.0, 128: 2.0, 255: 0.25, 256: 1.25, 270: 3.0}  # unnormalised
    for token, weight in support.items():
        weights[0, token] = weight
    edges = sample_inverse_cdf(
        weights.expand(2, -1), torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))])
    )
    assert edges.tolist() == [3, 270]
    torch.manual_seed(0)
    draws = sample_inverse_cdf(weights.expand(200_000, -1), torch.rand(200_000))
    counts = torch.bincount(draws, minlength=300).float()
    assert set(counts.nonzero().flatten().tolist()) == set(support)
    expected = weights[0] / weights.sum()
    assert torch.allclose(counts / counts.sum(), expected, atol=0.004)
