"""Temperature, min-p, top-k and top-p, and the seeded random draw.

Order (vLLM V1): temperature, min-p, top-k, top-p, then one draw from the
renormalised distribution. Filters set dropped logits to -inf; every row keeps
at least its most likely token. Ties at the top-k threshold are all kept.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` per row, in place (greedy rows carry 1.0)."""
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's ``top_k`` largest logits, then the smallest top set with mass >= ``top_p``.

    ``top_k`` holds ``vocab_size`` and ``top_p`` 1.0 for rows without the filter.
    Top-p drops the least likely tokens whose cumulative (ascending) mass is
    at most ``1 - top_p``, after renormalising over the top-k survivors.
    """
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_index = (logits.shape[1] - top_k).clamp_(0, logits.shape[1] - 1).unsqueeze(1)
        kth_value = logits_sort.gather(1, kth_index)
        logits_sort.masked_fill_(logits_sort < kth_value, NEG_INF)
    if top_p is not None:
        cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        is_dropped = cum_probs <= 1.0 - top_p.unsqueeze(1)
        is_dropped[:, -1] = False
        logits_sort.masked_fill_(is_dropped, NEG_INF)
    return logits.scatter_(1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row drawn from ``probs`` (``sample_inverse_cdf``), at one uniform per row.

    Row ``i`` in ``generators`` draws its uniform from its own generator only
    (reproducible whatever the batch); others use the default one.
    """
    return sample_inverse_cdf(probs, draw_uniforms(probs.shape[0], generators, probs.device))


def draw_uniforms(num_rows: int, generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """``[num_rows]`` uniforms in [0, 1): the rows in ``generators`` from theirs, the rest (all at once)
    from torch's default generator."""
    uniforms = torch.empty(num_rows, dtype=torch.float32, device=device)
    if len(generators) < num_rows:
        uniforms.uniform_()
    for row, generator in generators.items():
        uniforms[row : row + 1].uniform_(generator=generator)
    return uniforms


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative ``weights`` (``[rows, vocab]``, any positive sum) the token where its
    cumulative weight first exceeds ``uniforms[row]`` times the row's total: exactly a draw from the
    normalised row. One cumulative sum and a binary search a row: some 20x cheaper on CPU than an
    exponential race (``argmax(p / E)``), whose vocabulary-wide Exponential noise was a fifth of a
    decode step of the 10M model at 64 sequences.
    """
    cdf = weights.cumsum(dim=-1)  # [rows, vocab]
    total = cdf[:, -1:]  # [rows, 1]
    # Strictly below the total, so rounding never lands past the last token of non-zero weight.
    targets = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)
