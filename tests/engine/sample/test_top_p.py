"""Top-p's fast path (``engine.sample.filters.top_p_from_candidates``) against the vocabulary sort it skips."""

from __future__ import annotations

import pytest
import torch

from engine.sample.filters import apply_top_k_top_p, top_p_from_candidates


@pytest.mark.parametrize("temperature", [0.2, 1.0, 5.0])
def test_top_p_from_the_top_candidates_keeps_what_the_full_sort_keeps(temperature):
    """Top-p without top-k looks at the most likely tokens first and sorts the vocabulary only when they hold
    less than top_p; either way it keeps exactly the tokens the sort keeps (top_k = vocab forces the sort)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 4096, generator=generator) * 4 / temperature
    top_p = torch.tensor([0.5, 0.9, 0.95, 1.0] * 4)
    candidates_cover = top_p_from_candidates(logits.clone(), top_p) is not None
    assert candidates_cover == (temperature < 1.0)  # peaked rows: the candidates; flat ones: the sort
    fast = apply_top_k_top_p(logits.clone(), None, top_p)
    sorted_ = apply_top_k_top_p(logits.clone(), torch.full((16,), 4096), top_p)
    filtered = top_p < 1.0  # top_p 1.0 is no filter (the sort also drops tokens whose probability underflows to 0)
    assert torch.equal(fast.isfinite()[filtered], sorted_.isfinite()[filtered])
    assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])
    assert fast[~filtered].isfinite().all()


def test_a_top_p_below_float32s_least_keeps_the_most_likely_token():
    """1e-50 passes SamplingParams' (0, 1] check but is 0 as float32: both paths keep the top token (the
    candidates' path indexed position -1 and crashed the engine: found by the /v1/messages fuzzing)."""
    logits = torch.tensor([[4.0, 1.0, 0.5, 3.0]])
    top_p = torch.tensor([1e-50], dtype=torch.float32)
    for top_k in (None, torch.tensor([4])):
        kept = apply_top_k_top_p(logits.clone(), top_k, top_p)
        assert kept.isfinite().tolist() == [[True, False, False, False]]
