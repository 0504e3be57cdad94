"""The decode step a model runner may run in place of its eager forward: one choice per runner.

``ModelRunner.decode_step`` is the CPU's ``NativeDecodeStep`` (the whole layer stack in one native call,
chosen at load from what the layers declare: ``native_decode.native_decode_step``) or CUDA's
``DecodeGraphRunner`` (replayed graphs, captured over the KV caches: ``cuda_graphs.capture_decode_graphs``),
or None; every other step, and every step it declines, runs the model's eager forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from engine.worker.request_state import CachedRequestState
from engine.worker.step_inputs import StepInputs


class DecodeStep(Protocol):
    """Runs some decode steps of one rank's model exactly as its eager forward would."""

    @property
    def logits_rows(self) -> range:
        """The LM head's ``native_rows`` in a step this ran (the rows its layers multiplied natively)."""
        ...

    def can_run(self, inputs: StepInputs, requests: Mapping[str, CachedRequestState]) -> bool:
        """Whether it runs this step (else the eager forward does)."""
        ...

    def run(self, inputs: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The step's last hidden states [T, hidden] (final-normed, as the model's forward returns them),
        each layer's new K/V written into ``kv_caches``."""
        ...
