"""Batched LoRA on a linear layer: every token's rows through its own adapter, grouped by adapter.

A ``LinearLoRA`` holds ``max_loras`` device slots of one linear layer's adapters.
A packed layer (q/k/v, gate/up) holds one A block per packed projection, stacked:
``A`` is [slots, n_proj * max_rank, in] and ``B`` [slots, out, n_proj * max_rank],
B's rows of projection p reading only p's rank block (zero elsewhere), so one
shrink (x @ A.T) and one expand (@ B.T) serve every projection at once. Ranks
below ``max_rank`` are zero-padded, which adds exact zeros. The scaling (alpha/r
or alpha/sqrt(r)) is folded into B when the adapter is loaded.

Tensor parallelism: A and B are sharded the way the base layer is. A column-parallel
layer keeps A whole and this rank's rows of each projection's B (``source``: where
they start in the full B); a row-parallel layer (``in_shard``) keeps its columns of
A, sums the shrink over the TP group, and keeps B whole, so its delta, like its
base output, is complete after the reduction.

``LoRABatch`` is the step's token-to-slot mapping, shared by every adapted layer:
``groups`` lists (slot, token indices) per adapter in the step (indices None:
every token), and is empty when no token has an adapter, so the layers then add
no work.
"""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import tp_all_reduce
from engine.lora.adapter import LoRAAdapter


class LoRABatch:
    """The step's (slot, token rows) groups; set by ``LoRAManager.prepare`` before each forward."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []


class LinearLoRA:
    """The adapters' A/B slots of one linear layer; ``apply`` adds each group's delta to the base output.

    ``slices``: PEFT module name -> (offset, size, source): its rows in this rank's (packed) output, and
    where they start in the adapter's full B. ``in_shard``: a row-parallel layer's (start, size) of the
    input columns on this rank (None: all of them, no reduction).
    """

    def __init__(
        self,
        batch: LoRABatch,
        slices: dict[str, tuple[int, int, int]],
        in_features: int,
        out_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        in_shard: tuple[int, int] | None = None,
    ) -> None:
        self.batch, self.slices, self.max_rank, self.in_shard = batch, slices, max_rank, in_shard
        width = len(slices) * max_rank
        self.lora_a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)

    def set_slot(self, slot: int, adapter: LoRAAdapter, layer: int) -> None:
        """Writes ``adapter``'s weights of decoder layer ``layer`` into ``slot`` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for index, (module, (offset, size, source)) in enumerate(self.slices.items()):
            weights = adapter.weights.get((layer, module))
            if weights is None:
                continue
            a, b = weights
            if self.in_shard is not None:
                a = a.narrow(1, *self.in_shard)
            start = index * self.max_rank
            self.lora_a[slot, start : start + a.shape[0]].copy_(a)
            self.lora_b[slot, offset : offset + size, start : start + a.shape[0]].copy_(b.narrow(0, source, size))

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``, [T, out]) plus each token's adapter delta, in place."""
        for slot, rows in self.batch.groups:
            shrunk = (x if rows is None else x.index_select(0, rows)) @ self.lora_a[slot].T
            if self.in_shard is not None:  # every TP rank runs the same groups: the collectives pair up
                shrunk = tp_all_reduce(shrunk)
            delta = shrunk @ self.lora_b[slot].T
            if rows is None:
                y += delta
            else:
                y.index_add_(0, rows, delta)
        return y
