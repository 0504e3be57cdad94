"""Per-step sampling metadata: the batch's sampling parameters as tensors.

The model runner builds one :class:`SamplingMetadata` per step (rows in batch
order, one per request that needs a token) with
:meth:`SamplingMetadata.from_requests` and hands it to the sampler. When every
request is greedy with nothing to mask, penalise or report, construction only
reads the params and the sampler takes an argmax fast path.

Reproducible seeding: a request with ``SamplingParams.seed`` owns a
``torch.Generator`` (:func:`make_generator`) that the runner creates once and
passes every step; its draws depend on nothing but that generator, so the same
seed gives the same tokens whatever else is in the batch. Requests without a
seed draw from torch's default generator of the logits' device. ``n > 1`` is
fanned out above the sampler into ``n`` requests; give child ``i`` the seed
``seed + i`` (vLLM's convention) and hence its own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.sampling_params import SamplingParams


class RequestSamplingState(NamedTuple):
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy


def has_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def reads_output_tokens(params: SamplingParams, bad_words_token_ids: list[list[int]] | None) -> bool:
    """Whether a row's metadata depends on the tokens it has produced (penalties, bad words)."""
    return has_penalties(params) or bool(bad_words_token_ids)


def num_logprobs_for(num: int | None, vocab_size: int) -> int | None:
    """``SamplingParams.logprobs`` / ``prompt_logprobs`` as a count (-1 = whole vocab)."""
    if num is None:
        return None
    return vocab_size if num == -1 else min(num, vocab_size)


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError when ``logit_bias`` or ``allowed_token_ids`` name ids outside the vocab.

    Meant for the front end (a 400); the sampler itself ignores such ids.
    """
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} contains token ids outside the vocabulary (size {vocab_size}): {bad[:8]}.")


@dataclass
class SamplingMetadata:
    """The batch's sampling state; row ``i`` describes logits row ``i``.

    Tensors live on ``device``. Optional tensors are None when no row needs them.
    """

    num_reqs: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # [num_reqs] float32; greedy rows hold 1.0
    is_greedy_row: torch.Tensor | None  # [num_reqs] bool, when mixed
    top_k: torch.Tensor | None  # [num_reqs] int64, vocab_size = disabled
    top_p: torch.Tensor | None  # [num_reqs] float32
    min_p: torch.Tensor | None  # [num_reqs] float32
    generators: dict[int, torch.Generator]  # row -> the request's own generator
    max_num_logprobs: int | None  # top-N to return (largest request), None = none
    # Row i's output tokens so far where the row reads them (penalties, bad words), else [].
    output_token_ids: list[list[int]]
    # Penalties (None when no row has any).
    prompt_token_ids: torch.Tensor | None = None  # [num_reqs, max_len] int64, padded with vocab_size
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # Masks, sparse per row.
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    min_tokens_banned_ids: dict[int, list[int]] = field(default_factory=dict)  # rows still under min_tokens

    @property
    def is_no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @property
    def is_no_masks(self) -> bool:
        return not (self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids or self.min_tokens_banned_ids)

    @property
    def is_argmax_only(self) -> bool:
        """True when the sampler can return the plain argmax of the logits."""
        return self.all_greedy and self.is_no_penalties and self.is_no_masks and self.max_num_logprobs is None

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[RequestSamplingState | tuple],
        vocab_size: int,
        eos_token_id: int | Sequence[int] | None,
        device: torch.device | str = "cpu",
        bad_words_token_ids: Sequence[list[list[int]] | None] | None = None,
    ) -> SamplingMetadata:
        """Builds the metadata for ``requests`` (batch order).

        Each request is ``(params, prompt_token_ids, output_token_ids, generator)``;
        ``generator`` is required to make a seeded request reproducible (None
        means "draw from the shared default generator"). ``bad_words_token_ids``
        holds, per row, the pre-tokenized ``params.bad_words``
        (``SamplingParams.bad_words_token_ids``, which the front end fills in with
        :func:`engine.sample.masks.tokenize_bad_words`, once per request);
        rows with bad words but no entry here are not masked.
        """
        reqs = [RequestSamplingState(*r) for r in requests]
        params = [r.params for r in reqs]
        greedy = [is_greedy(p) for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        num_logprobs = [num_logprobs_for(p.logprobs, vocab_size) for p in params]
        max_num_logprobs = max((n for n in num_logprobs if n is not None), default=None)
        meta = cls(
            num_reqs=len(reqs),
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=None,
            is_greedy_row=None,
            top_k=None,
            top_p=None,
            min_p=None,
            generators={},
            max_num_logprobs=max_num_logprobs,
            output_token_ids=_output_token_ids(reqs, bad_words_token_ids),
        )
        if not all_greedy:
            _fill_random(meta, reqs, greedy, vocab_size, device)
        if any(has_penalties(p) for p in params):
            _fill_penalties(meta, reqs, vocab_size, device)
        _fill_masks(meta, reqs, vocab_size, _eos_ids(eos_token_id), bad_words_token_ids)
        return meta


def _eos_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return list(eos_token_id)


def _output_token_ids(reqs: list[RequestSamplingState], bad_words_token_ids) -> list[list[int]]:
    """Each row's output tokens, copied only for the rows that read them."""
    bad_words = bad_words_token_ids or [None] * len(reqs)
    return [list(r.output_token_ids) if reads_output_tokens(r.params, b) else [] for r, b in zip(reqs, bad_words)]


def _fill_random(
    meta: SamplingMetadata, reqs: list[RequestSamplingState], greedy: list[bool], vocab_size: int, device
) -> None:
    params = [r.params for r in reqs]
    meta.temperature = torch.tensor(
        [1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=device
    )
    if not meta.all_random:
        meta.is_greedy_row = torch.tensor(greedy, dtype=torch.bool, device=device)
    if any(0 < p.top_k < vocab_size for p in params):
        meta.top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=torch.int64, device=device
        )
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    meta.generators = {i: r.generator for i, r in enumerate(reqs) if r.generator is not None and not greedy[i]}


def _fill_penalties(meta: SamplingMetadata, reqs: list[RequestSamplingState], vocab_size: int, device) -> None:
    params = [r.params for r in reqs]
    max_len = max((len(r.prompt_token_ids) for r in reqs), default=0)
    prompt = torch.full((len(reqs), max_len), vocab_size, dtype=torch.int64)
    for i, r in enumerate(reqs):
        if has_penalties(r.params) and r.prompt_token_ids:
            prompt[i, : len(r.prompt_token_ids)] = torch.as_tensor(list(r.prompt_token_ids), dtype=torch.int64)
    meta.prompt_token_ids = prompt.to(device)

    def vec(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    meta.presence_penalties = vec([p.presence_penalty for p in params])
    meta.frequency_penalties = vec([p.frequency_penalty for p in params])
    meta.repetition_penalties = vec([p.repetition_penalty for p in params])


def _fill_masks(
    meta: SamplingMetadata, reqs: list[RequestSamplingState], vocab_size: int, eos_ids: list[int], bad_words_token_ids
) -> None:
    for i, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            meta.logit_bias[i] = {t: b for t, b in p.logit_bias.items() if 0 <= t < vocab_size}
        if p.allowed_token_ids is not None:
            meta.allowed_token_ids[i] = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
        if bad_words_token_ids is not None and bad_words_token_ids[i]:
            meta.bad_words_token_ids[i] = bad_words_token_ids[i]
        if len(r.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_ids)
            banned = [t for t in banned if 0 <= t < vocab_size]
            if banned:
                meta.min_tokens_banned_ids[i] = banned
