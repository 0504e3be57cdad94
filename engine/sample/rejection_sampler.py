"""Speculative decoding's lossless rejection sampler: which draft tokens the target keeps.

Inputs (one call per step):

* ``logits`` ``[num_rows, vocab]``: the target's raw logits. Request ``i`` owns
  ``1 + num_draft_tokens[i]`` consecutive rows: row ``j`` is the target's
  distribution for draft position ``j``, the last row the bonus position.
* ``draft_token_ids[i]``: request ``i``'s ``num_draft_tokens[i]`` proposed tokens.
* ``draft_probs``: None when every draft is a point mass (n-gram proposer,
  greedy draft model: ``q(d) = 1``), else ``[sum(num_draft_tokens), vocab]``
  float32 draft-model probabilities, one row per draft position in request order.
* ``metadata``: a :class:`SamplingMetadata` with one row per logits row, built
  with ``from_requests`` so that row ``j`` of request ``i`` sees the request's
  outputs plus its first ``j`` drafts (penalties, min_tokens and bad words then
  treat the drafts as already emitted). A request's rows share its params and
  its one generator.

The target distribution at a row is exactly the :class:`Sampler`'s: masks, then
penalties; greedy rows take the argmax, random rows apply temperature, min-p,
top-k / top-p and a softmax.

Output (:class:`RejectionSamplerOutput`), per request: its accepted drafts, then
one more token: the target's correction at the first rejected position, or the
bonus token from the last row when every draft held.

Lossless guarantee: each emitted token is distributed exactly as if the target
had sampled it alone. Greedy requests accept a draft iff it equals the target's
argmax, so they emit what plain greedy decoding would. Random requests accept
draft ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection the
replacement is drawn from ``normalize(max(p - q, 0))`` (for a point mass: ``p``
without ``d``), the standard scheme (Leviathan et al. 2023; Chen et al. 2023).

Seed guarantee: a request with a generator draws only from it, always in the
same order (``num_draft_tokens[i]`` uniforms, then one uniform for the
extra token, drawn by ``sample_inverse_cdf``), so the same seed and inputs give the
same tokens whatever else is in the batch; with no drafts that is exactly the
:class:`Sampler`'s draw. Other random requests use torch's default generator.
The caller's logits are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.sample.filters import apply_min_p, apply_temperature, apply_top_k_top_p, sample_inverse_cdf
from engine.sample.logprobs import compute_logprobs, gather_logprobs
from engine.sample.masks import apply_all_masks
from engine.sample.metadata import SamplingMetadata
from engine.sample.penalties import apply_penalties
from engine.sample.sampler import argmax
from engine.sched.step_outputs import LogprobsLists


@dataclass
class RejectionSamplerOutput:
    """Per request: emitted tokens (``1 <= len <= num_draft_tokens[i] + 1``), accepted drafts
    (``len(token_ids[i]) - 1``), and one raw-logprob row per emitted token, cut to the
    request's ``SamplingParams.logprobs`` (None for a request that asked for none; the
    whole field None when no request did)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[LogprobsLists | None] | None


class _Layout(NamedTuple):
    """Where each request's rows and drafts sit in the flattened batch."""

    starts: list[int]  # request i's first logits row
    num_drafts: list[int]
    draft_rows: torch.Tensor  # [num_drafts_total] int64: the logits row judging each draft
    draft_ids: torch.Tensor  # [num_drafts_total] int64
    draft_starts: list[int]  # request i's first draft_probs row


class TargetDistributions(NamedTuple):
    """The target per logits row: argmax (None when no row is greedy) and probabilities
    (None when every row is greedy)."""

    greedy_ids: torch.Tensor | None
    probs: torch.Tensor | None


def target_distributions(logits: torch.Tensor, metadata: SamplingMetadata) -> TargetDistributions:
    """The Sampler's processing of ``logits`` (vLLM V1 order), on a float32 copy."""
    if metadata.is_argmax_only:
        return TargetDistributions(argmax(logits), None)
    logits = logits.to(torch.float32, copy=True)
    apply_all_masks(logits, metadata)
    apply_penalties(logits, metadata)
    greedy_ids = None if metadata.all_random else argmax(logits)
    if metadata.all_greedy:
        return TargetDistributions(greedy_ids, None)
    apply_temperature(logits, metadata.temperature)
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p)
    apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return TargetDistributions(greedy_ids, logits.softmax(dim=-1))


class RejectionSampler:
    """Stateless; all per-request state (generators included) is in the metadata."""

    def __call__(
        self,
        logits: torch.Tensor,
        num_draft_tokens: list[int],
        draft_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None,
        metadata: SamplingMetadata,
        num_logprobs: Sequence[int | None] | None = None,
    ) -> RejectionSamplerOutput:
        """Judges the drafts (see the module docstring). ``num_logprobs[i]`` is request ``i``'s
        ``SamplingParams.logprobs``; required when any row asks for logprobs, since the
        metadata keeps only the batch's largest count."""
        layout = _layout(logits, num_draft_tokens, draft_token_ids, draft_probs, metadata)
        raw_logprobs = None if metadata.max_num_logprobs is None else compute_logprobs(logits)
        target = target_distributions(logits, metadata)
        greedy = _greedy_requests(metadata, layout.starts)
        uniforms, extra_uniforms = _draw(layout, metadata, greedy, logits.device)
        accepted = _accept(layout, target, greedy, uniforms, draft_probs)
        num_accepted = _leading_true_counts(accepted.tolist(), layout.num_drafts)
        extra = _extra_tokens(layout, target, greedy, num_accepted, extra_uniforms, draft_probs)
        draft_lists = [list(ids) for ids in draft_token_ids]
        token_ids = [draft_lists[i][:m] + [t] for i, (m, t) in enumerate(zip(num_accepted, extra))]
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _logprobs_lists(raw_logprobs, layout.starts, token_ids, metadata, num_logprobs)
        return RejectionSamplerOutput(token_ids, num_accepted, logprobs)


def _layout(logits, num_draft_tokens, draft_token_ids, draft_probs, metadata) -> _Layout:
    """Checks the shapes agree and indexes the batch."""
    num_rows = sum(num_draft_tokens) + len(num_draft_tokens)
    if logits.shape[0] != num_rows or metadata.num_reqs != num_rows:
        raise ValueError(
            f"expected {num_rows} logits / metadata rows (1 + drafts per request), "
            f"got {logits.shape[0]} / {metadata.num_reqs}"
        )
    if [len(ids) for ids in draft_token_ids] != list(num_draft_tokens):
        raise ValueError("draft_token_ids lengths differ from num_draft_tokens")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(num_draft_tokens), logits.shape[1]):
        raise ValueError(f"draft_probs must be [{sum(num_draft_tokens)}, {logits.shape[1]}]")
    starts, draft_starts, rows, row, draft = [], [], [], 0, 0
    for k in num_draft_tokens:
        starts.append(row)
        draft_starts.append(draft)
        rows.extend(range(row, row + k))
        row, draft = row + k + 1, draft + k
    flat_ids = [t for ids in draft_token_ids for t in ids]
    return _Layout(
        starts=starts,
        num_drafts=list(num_draft_tokens),
        draft_rows=torch.tensor(rows, dtype=torch.int64, device=logits.device),
        draft_ids=torch.tensor(flat_ids, dtype=torch.int64, device=logits.device),
        draft_starts=draft_starts,
    )


def _greedy_requests(metadata: SamplingMetadata, starts: list[int]) -> list[bool]:
    if metadata.all_greedy or metadata.all_random:
        return [metadata.all_greedy] * len(starts)
    return metadata.is_greedy_row[starts].tolist()


def _draw(layout: _Layout, metadata, greedy: list[bool], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft a uniform in [0, 1), then per request one for its extra token (random requests).

    A seeded request draws its draft uniforms, then its extra one, from its own generator; the rest
    share the default generator (the extra uniforms of the whole batch at once, as the Sampler draws).
    """
    uniforms = torch.zeros(len(layout.draft_ids), dtype=torch.float32, device=device)
    extra = torch.zeros(len(layout.starts), dtype=torch.float32, device=device)
    if all(greedy):
        return uniforms, extra
    generators = [metadata.generators.get(start) for start in layout.starts]
    if any(g is None and not gr for g, gr in zip(generators, greedy)):
        uniforms.uniform_()
        extra.uniform_()
    for i, generator in enumerate(generators):
        if generator is None or greedy[i]:
            continue
        first, k = layout.draft_starts[i], layout.num_drafts[i]
        if k:
            uniforms[first : first + k].uniform_(generator=generator)
        extra[i : i + 1].uniform_(generator=generator)
    return uniforms, extra


def _accept(layout: _Layout, target: TargetDistributions, greedy, uniforms, draft_probs) -> torch.Tensor:
    """[num_drafts_total] bool: whether each draft passes its own test (ignoring earlier ones)."""
    rows, ids = layout.draft_rows, layout.draft_ids
    draft_greedy = torch.tensor(
        [g for g, k in zip(greedy, layout.num_drafts) for _ in range(k)], dtype=torch.bool, device=ids.device
    )
    accepted = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    if target.greedy_ids is not None:
        accepted |= draft_greedy & (ids == target.greedy_ids[rows])
    if target.probs is not None:
        p = target.probs[rows, ids]
        q = 1.0 if draft_probs is None else draft_probs[torch.arange(len(ids), device=ids.device), ids]
        # u < p / q without the division; p = 0 (a forbidden draft) never passes since u >= 0.
        accepted |= ~draft_greedy & (uniforms * q < p)
    return accepted


def _leading_true_counts(accepted: list[bool], num_drafts: list[int]) -> list[int]:
    counts, first = [], 0
    for k in num_drafts:
        m = 0
        while m < k and accepted[first + m]:
            m += 1
        counts.append(m)
        first += k
    return counts


def _extra_tokens(layout: _Layout, target, greedy, num_accepted, extra_uniforms, draft_probs) -> list[int]:
    """The token after the accepted drafts: the target's argmax (greedy), else a draw from the
    residual ``max(p - q, 0)`` at a rejected position or from ``p`` at the bonus position."""
    rows = torch.tensor(
        [s + m for s, m in zip(layout.starts, num_accepted)], dtype=torch.int64, device=extra_uniforms.device
    )
    greedy_tokens = None if target.greedy_ids is None else target.greedy_ids[rows]
    if target.probs is None:
        return greedy_tokens.tolist()
    dist = target.probs[rows]  # advanced indexing copies
    rejected = [i for i, (m, k) in enumerate(zip(num_accepted, layout.num_drafts)) if m < k and not greedy[i]]
    if rejected:
        req_idx = torch.tensor(rejected, dtype=torch.int64, device=extra_uniforms.device)
        draft_idx = torch.tensor(
            [layout.draft_starts[i] + num_accepted[i] for i in rejected],
            dtype=torch.int64,
            device=extra_uniforms.device,
        )
        if draft_probs is None:
            dist[req_idx, layout.draft_ids[draft_idx]] = 0.0
        else:
            dist[req_idx] = (dist[req_idx] - draft_probs[draft_idx]).clamp_min_(0.0)
        # p <= q everywhere only through rounding (then p == q); keep p rather than an empty row.
        empty = dist.sum(dim=-1) <= 0.0
        dist[empty] = target.probs[rows[empty]]
    sampled = sample_inverse_cdf(dist, extra_uniforms)
    if greedy_tokens is not None:
        is_greedy = torch.tensor(greedy, dtype=torch.bool, device=extra_uniforms.device)
        sampled = torch.where(is_greedy, greedy_tokens, sampled)
    return sampled.tolist()


def _logprobs_lists(
    raw_logprobs: torch.Tensor,
    starts: list[int],
    token_ids: list[list[int]],
    metadata: SamplingMetadata,
    num_logprobs: Sequence[int | None] | None,
) -> list[LogprobsLists | None]:
    """One raw-logprob row per emitted token (the row that produced it), cut per request."""
    if num_logprobs is None or len(num_logprobs) != len(starts):
        raise ValueError(
            "a row asks for logprobs: pass num_logprobs=[each request's SamplingParams.logprobs] "
            "(the metadata keeps only the batch's largest count)"
        )
    rows = [start + j for start, ids in zip(starts, token_ids) for j in range(len(ids))]
    device = raw_logprobs.device
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64, device=device)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    tensors = gather_logprobs(raw_logprobs[rows_t], flat, metadata.max_num_logprobs)
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    lists: list[LogprobsLists | None] = []
    first = 0
    for emitted, num in zip(token_ids, num_logprobs):
        end = first + len(emitted)
        if num is None:
            lists.append(None)
        else:
            width = len(ids[first]) if num == -1 else num + 1
            lists.append(
                LogprobsLists(
                    [r[:width] for r in ids[first:end]], [r[:width] for r in values[first:end]], ranks[first:end]
                )
            )
        first = end
    return lists
