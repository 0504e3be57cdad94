"""Temperature, min-p, top-k and top-p, and the seeded random draw.

Order (vLLM V1): temperature, min-p, top-k, top-p, then one draw from the
renormalised distribution. Filters set dropped logits to -inf; every row keeps
at least its most likely token. Ties at the top-k threshold are all kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    if top_k is None:
        kept = top_p_from_candidates(logits, top_p)
        if kept is not None:
            return kept
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


TOP_P_CANDIDATES = 64  # the most likely tokens top_p_from_candidates looks at before sorting the vocabulary


def top_p_from_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Top-p without sorting the vocabulary, or None when some row needs the sort.

    When each row's ``TOP_P_CANDIDATES`` largest logits hold ``top_p`` of its mass (a chat model sampled at
    a low temperature nearly always does), the kept set lies among them: the tokens whose more likely
    tokens hold less than ``top_p``; everything below the least of them is dropped. One ``topk`` and one
    ``softmax`` over the vocabulary instead of a sort of it (a sort of a large vocabulary at every step
    is the sampler's largest cost on CPU: docs/benchmarks.md).
    """
    k = min(TOP_P_CANDIDATES, logits.shape[1])
    top_logits, top_ids = logits.topk(k, dim=-1)  # descending
    # The candidates' probabilities by the softmax the sort path uses: torch.logsumexp's exp is 4x slower on CPU
    # (MKL's slow path for the underflows a sharp distribution's tail is made of).
    top_probs = logits.softmax(dim=-1).gather(1, top_ids)
    cum_probs = top_probs.cumsum(dim=-1)
    keeps_all = top_p >= 1.0
    if not bool(((cum_probs[:, -1] >= top_p) | keeps_all).all()):
        return None
    # At least the most likely token: a top_p too small for float32 (1e-50 > 0 passes the request's check)
    # rounds to 0, and then not even the first, which has nothing above it, is below it.
    num_kept = ((cum_probs - top_probs) < top_p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
    threshold = top_logits.gather(1, (num_kept - 1).unsqueeze(1))
    threshold.masked_fill_(keeps_all.unsqueeze(1), NEG_INF)
    return logits.masked_fill_(logits < threshold, NEG_INF)


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


CDF_BLOCK = 128  # tokens per block of sample_inverse_cdf's two-level search


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative ``weights`` (``[rows, vocab]``, any positive sum) the token where its
    cumulative weight first exceeds ``uniforms[row]`` times the row's total: exactly a draw from the
    normalised row, far cheaper on CPU than an exponential race (``argmax(p / E)``), whose
    vocabulary-wide Exponential noise is a large share of a small model's decode step.

    Two levels, since a dense cumulative sum over the whole vocabulary is slow on CPU (a sequential scan
    of every token; the block sums and one block's scan are far less work): the block whose cumulative sum
    passes the target, then the token within that block.
    """
    rows, vocab = weights.shape
    pad = -vocab % CDF_BLOCK
    blocks = (F.pad(weights, (0, pad)) if pad else weights).view(rows, -1, CDF_BLOCK)  # [rows, n_blocks, B]
    block_sums = blocks.sum(dim=-1)  # [rows, n_blocks]
    block_cdf = block_sums.cumsum(dim=-1)
    total = block_cdf[:, -1:]  # [rows, 1]
    # Strictly below the total, so rounding never lands past the last block of non-zero weight.
    targets = torch.minimum(uniforms.unsqueeze(1) * total, _just_below(total))
    block = torch.searchsorted(block_cdf, targets, right=True).clamp_(max=blocks.shape[1] - 1)  # [rows, 1]
    before = block_cdf.gather(1, block) - block_sums.gather(1, block)
    within = blocks.gather(1, block.unsqueeze(-1).expand(rows, 1, CDF_BLOCK)).squeeze(1).cumsum(dim=-1)  # [rows, B]
    # Within [0, the block's own total): the two sums round apart, never onto a token of zero weight.
    offsets = torch.minimum((targets - before).clamp_(min=0.0), _just_below(within[:, -1:]))
    token = torch.searchsorted(within, offsets, right=True).clamp_(max=CDF_BLOCK - 1)
    return (block * CDF_BLOCK + token).squeeze(1)


def _just_below(values: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(values, torch.zeros_like(values))
