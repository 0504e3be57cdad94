"""Draft-model proposer: a small model with the target's vocabulary drafts greedily, on the output rank.

Its KV cache has the target's block geometry and is indexed by the target's block tables (vLLM's
layout): the scheduler allocates ``num_speculative_tokens`` lookahead slots past each step's tokens
for the proposals' KV. Per request it tracks how many leading positions of the request's tokens
its cache holds; after a step it first catches up on the tokens it has not seen (a whole prompt the
first time, else the verified tokens; drafts it fed earlier count where the target accepted them),
then runs one decode per further draft. All requests go through each forward together. Greedy
drafts are a point mass for the rejection sampler, which keeps sampling lossless whatever the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.backend import resolve_backend_name
from engine.config import EngineConfig
from engine.model import get_model
from engine.model.layers.cpu_prepack import SPECULATIVE_ROWS
from engine.model.layers.linear_method import process_weights_after_loading
from engine.sample.sampler import argmax
from engine.sampling_params import RequestKind
from engine.spec_decode.proposer import ProposerInputs
from engine.worker.input_batch import InputBatch
from engine.worker.request_state import CachedRequestState
from engine.worker.step_inputs import build_step_inputs


@dataclass
class _DraftCache:
    """What the draft's KV cache holds for one request state."""

    state: CachedRequestState
    num_valid: int = 0  # leading positions of state.token_ids held
    fed_start: int = 0  # where the drafts fed by the last proposal begin
    fed: list[int] = field(default_factory=list)

    def num_reusable(self) -> int:
        """Positions held once the drafts the target accepted are counted in."""
        tokens, start = self.state.token_ids, self.fed_start
        num_matching = 0
        for draft, token in zip(self.fed, tokens[start:]):
            if draft != token:
                break
            num_matching += 1
        return max(self.num_valid, start + num_matching) if self.fed else self.num_valid


@dataclass
class _Sequence:
    """A request's tokens as ``build_step_inputs`` reads them (no drafts to verify; the draft model samples)."""

    token_ids: list[int]
    slot: int
    spec_token_ids: list[int] = field(default_factory=list)
    kind: RequestKind = RequestKind.GENERATE


class DraftModelProposer:
    def __init__(self, config: EngineConfig, input_batch: InputBatch) -> None:
        self.config = config
        self.input_batch = input_batch
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self._caches: dict[str, _DraftCache] = {}

    def load_model(self, dtype: torch.dtype, device: torch.device) -> None:
        """The whole draft (no tensor parallelism: it runs on the output rank alone)."""
        backend = resolve_backend_name(self.config.model_config.attention_backend, device)
        self.model = get_model(self.config.speculative_config.model, dtype=dtype, device=device, attn_backend=backend)
        windows = [group.window for group in (self.input_batch.kv_cache_groups[0], *self.model.kv_cache_groups)]
        if any(window is not None for window in windows):
            raise ValueError(
                "A draft model attends through the target's first KV cache group's blocks: both need full "
                f"attention there, not sliding windows (target's first group, then the draft's: {windows})"
            )
        process_weights_after_loading(self.model)
        self.dtype = dtype

    def kv_cache_block_bytes(self) -> int:
        num_elements = 1
        for dim in self.model.get_kv_cache_shape(1, self.input_batch.block_size):
            num_elements *= dim
        return num_elements * self.model.num_kv_cache_tensors * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.model.make_kv_caches(num_blocks, self.input_batch.block_size)

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        self._forget_gone_requests()
        active = [(i, state, num) for i, (state, num) in enumerate(zip(inputs.states, inputs.max_num_drafts)) if num]
        drafts: list[list[int]] = [[] for _ in inputs.states]
        if not active:
            return drafts
        caches = [self._cache_of(state) for _, state, _ in active]
        # Catch up: every position the cache lacks, up to the last known token (whose logits give draft 1).
        starts = [min(cache.num_reusable(), len(state.token_ids) - 1) for cache, (_, state, _) in zip(caches, active)]
        sequences = {state.req_id: _Sequence(state.token_ids, state.slot) for _, state, _ in active}
        counts = {state.req_id: len(state.token_ids) - start for start, (_, state, _) in zip(starts, active)}
        next_tokens = self._forward(sequences, counts, starts)
        current = [(row, state, num) for row, state, num in active]
        for step in range(max(num for _, _, num in active)):
            for (row, _, _), token in zip(current, next_tokens):
                drafts[row].append(token)
            current = [(row, state, num) for row, state, num in current if step + 1 < num]
            if not current:
                break
            # One decode per request still drafting: its latest draft, at the position after its tokens so far.
            for row, state, _ in current:
                sequences[state.req_id].token_ids = state.token_ids + drafts[row]
            positions = [len(state.token_ids) + step for _, state, _ in current]
            next_tokens = self._forward({s.req_id: sequences[s.req_id] for _, s, _ in current}, None, positions)
        for cache, (row, state, _) in zip(caches, active):
            cache.num_valid, cache.fed_start, cache.fed = len(state.token_ids), len(state.token_ids), drafts[row][:-1]
        return drafts

    def _forward(self, sequences: dict[str, _Sequence], counts: dict[str, int] | None, starts: list[int]) -> list[int]:
        """One draft forward: ``counts[r]`` tokens (1 if None) of each sequence from ``starts``; the argmax
        after each sequence's last one."""
        counts = counts or dict.fromkeys(sequences, 1)
        inputs = build_step_inputs(
            sequences,
            self.input_batch.block_table,
            counts,
            self.input_batch.block_size,
            self.input_batch.device,
            dict(zip(sequences, starts)),
        )
        # Its catch-ups after a verify step (the accepted drafts and the token after: at most k + 1) run like
        # a verify step's queries; so do its products of a few rows (cpu_prepack.native_rows_of_step).
        inputs.attn_metadata.max_verify_query_len = self.config.speculative_config.num_speculative_tokens + 1
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, None)
        logits = self.model.compute_logits(hidden[inputs.sample_indices], SPECULATIVE_ROWS)  # [sequences, vocab]
        return argmax(logits.float()).tolist()

    def _cache_of(self, state: CachedRequestState) -> _DraftCache:
        cache = self._caches.get(state.req_id)
        if cache is None or cache.state is not state:  # new, or re-added after preemption (new blocks)
            cache = self._caches[state.req_id] = _DraftCache(state)
        return cache

    def _forget_gone_requests(self) -> None:
        if len(self._caches) > len(self.input_batch.requests):
            live = self.input_batch.requests
            self._caches = {r: c for r, c in self._caches.items() if live.get(r) is c.state}
