"""The proposer protocol: what the model runner asks for after each step's sampling.

Contract: after the output rank has sampled (and appended) every sampled request's tokens,
``propose`` gets those requests' states and, per request, the most drafts it may return (0: none;
within max_tokens and the draft's max_model_len); it returns each request's draft tokens, at most
that many, possibly none. The drafts are verified by the next step that schedules the request: a
proposer is never told which were accepted except through the tokens it sees next time (a draft
model keeps its own KV cache in step with that). ``ProposerInputs.hidden_states`` is the seam for
proposers that read the target's last hidden states (EAGLE / MTP heads): the built-in ones ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.worker.request_state import CachedRequestState


@dataclass
class ProposerInputs:
    states: list[CachedRequestState]  # the requests sampled this step, their new tokens appended
    max_num_drafts: list[int]  # per state: the most drafts it may take
    hidden_states: torch.Tensor | None = None  # [num_sample_rows, hidden]: the target's at the sampled rows


class Proposer(Protocol):
    def propose(self, inputs: ProposerInputs) -> list[list[int]]:
        """Draft tokens per state of ``inputs`` (at most ``max_num_drafts[i]`` each)."""
