"""Pooling parameters (vLLM's ``PoolingParams``): how one embedding request's pooled vector is finished.

Pure Python (the engine core imports it). A pooling request runs its prompt through the model once, as a
prefill that samples nothing; the model runner pools the prompt's final hidden states as the engine's
``pooler_config`` says (``pooling_type``), keeps the first ``dimensions`` entries and L2-normalizes the
result when ``normalize`` says so. Whether the model allows ``dimensions`` is checked by the front end
(``Processor``), which knows the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import RequestKind, RequestOutputKind


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first this many entries (Matryoshka truncation; None: all ``hidden_size``).
    ``normalize``: L2-normalize the vector (after truncation, as vLLM does); None: ``pooler_config.normalize``."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")

    @property
    def kind(self) -> RequestKind:
        return RequestKind.EMBED

    @property
    def n(self) -> int:
        """One vector per prompt: a pooling request is never fanned out (``SamplingParams.n``'s counterpart)."""
        return 1

    @property
    def output_kind(self) -> RequestOutputKind:
        """A pooling request has one output, at its end."""
        return RequestOutputKind.FINAL_ONLY
