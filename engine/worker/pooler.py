"""The pooler: one vector per pooling request from its prompt's final hidden states (vLLM's ``Pooler``).

A pooling request is a prefill that samples nothing. Chunked prefill may spread its prompt over several
steps; each step the runner hands this the rows of the batch's hidden states [T, hidden] (final-normed,
as the model's forward returns them) and it pools what the chunk adds, as ``pooler_config.pooling_type``
says:

* LAST: the last prompt token's row (the chunk that ends the prompt);
* MEAN: the mean over every prompt token: a float32 running sum across chunks, divided at the end;
* CLS: the first prompt token's row (the chunk that starts the prompt), kept until the prompt ends.

The step that completes a prompt gives its vector: float32, cut to ``dimensions`` entries, then
L2-normalized unless the request (or the config) says not to. A pooling request always starts at position
0 (it never reads the prefix cache, and a preempted one is recomputed from the start), so a chunk at 0
starts its state afresh; a finished or preempted request's state is dropped (``forget``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import PoolerConfig
from engine.worker.request_state import CachedRequestState
from engine.worker.step_inputs import StepInputs


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.pooling_type = config.pooling_type
        self.normalize = config.normalize
        # A prompt's pooled state between its chunks: MEAN the float32 sum so far, CLS the first row.
        self._partial: dict[str, torch.Tensor] = {}

    def forget(self, req_id: str) -> None:
        self._partial.pop(req_id, None)

    def pool(
        self, requests: Mapping[str, CachedRequestState], pooling_req_ids: set[str], inputs: StepInputs, hidden
    ) -> dict[str, list[float]]:
        """The vector of each pooling request (of ``pooling_req_ids``) whose prompt this step completes; the
        others' chunks are folded into their state."""
        done: list[str] = []
        vectors: list[torch.Tensor] = []
        offsets = inputs.token_offsets
        for i, req_id in enumerate(inputs.req_ids):
            if req_id not in pooling_req_ids:
                continue
            state = requests[req_id]
            start, end = inputs.starts[i], inputs.starts[i] + inputs.query_lens[i]
            vector = self._pool_chunk(req_id, hidden[offsets[i] : offsets[i + 1]], start, end, state.num_prompt_tokens)
            if vector is not None:
                done.append(req_id)
                vectors.append(self._finish(vector, state))
        if not done:
            return {}
        flat = torch.cat(vectors).cpu().tolist()  # one device-to-host copy for the step
        pooled, position = {}, 0
        for req_id, vector in zip(done, vectors):
            pooled[req_id] = flat[position : position + len(vector)]
            position += len(vector)
        return pooled

    def _pool_chunk(
        self, req_id: str, rows: torch.Tensor, start: int, end: int, num_prompt_tokens: int
    ) -> torch.Tensor | None:
        """Folds one chunk (prompt positions ``[start, end)``, its ``rows``) in; the float32 pooled vector
        once ``end`` reaches the prompt's end, else None."""
        is_done = end == num_prompt_tokens
        if self.pooling_type == "LAST":
            return rows[-1].float() if is_done else None
        if self.pooling_type == "CLS":
            # A copy: ``rows`` may be a view of a CUDA graph's output, which the next step overwrites.
            first = rows[0].to(torch.float32, copy=True) if start == 0 else self._partial.pop(req_id)
            if not is_done:
                self._partial[req_id] = first
            return first if is_done else None
        total = rows.sum(dim=0, dtype=torch.float32)
        if start > 0:
            total += self._partial.pop(req_id)
        if not is_done:
            self._partial[req_id] = total
            return None
        return total / num_prompt_tokens

    def _finish(self, vector: torch.Tensor, state: CachedRequestState) -> torch.Tensor:
        """``dimensions`` entries (Matryoshka truncation), then L2-normalized (vLLM's order)."""
        params = state.pooling_params
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector
