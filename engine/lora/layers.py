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

Kernels: on CUDA the shrink and expand are Triton kernels (``engine.lora.triton_ops``,
the step's tokens sorted by slot once, on the first layer); elsewhere plain torch.
``lora_kernels`` chooses, once per layer, from the device, as the attention
backend's ``auto`` does.
"""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import tp_all_reduce
from engine.lora.adapter import LoRAAdapter


def lora_kernels(device: torch.device) -> str:
    """``"triton"`` on CUDA, ``"torch"`` elsewhere (the Triton kernels run on CPU only interpreted: tests)."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


class LoRABatch:
    """The step's (slot, token rows) groups; set by ``LoRAManager.prepare`` before each forward."""

    def __init__(self) -> None:
        self._groups: list[tuple[int, torch.Tensor | None]] = []
        self._plan = None  # the groups as the Triton kernels read them, made on first use

    @property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        return self._groups

    @groups.setter
    def groups(self, groups: list[tuple[int, torch.Tensor | None]]) -> None:
        self._groups, self._plan = groups, None

    def token_plan(self, num_tokens: int, max_loras: int, device: torch.device):
        """The groups as one slot per token (-1: none), sorted by slot (``triton_ops.LoRATokenPlan``);
        made once per step and shared by every layer."""
        from engine.lora.triton_ops import plan_lora_tokens

        if self._plan is None or self._plan.num_tokens != num_tokens:
            slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
            for slot, rows in self._groups:
                if rows is None:
                    slots.fill_(slot)
                else:
                    slots[rows] = slot
            self._plan = plan_lora_tokens(slots, max_loras)
        return self._plan


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
        self.kernels = lora_kernels(device)
        # Each slice's (offset, size) in the output, as the expand kernel reads them.
        pieces = [(offset, size) for offset, size, _ in slices.values()]
        self.slice_table = torch.tensor(pieces, dtype=torch.int32, device=device)

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
        if not self.batch.groups:
            return y
        if self.kernels == "triton":
            return self.apply_triton(x, y)
        return self.apply_torch(x, y)

    def apply_triton(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``apply`` through the Triton kernels (any device Triton runs on; CPU: interpreted)."""
        from engine.lora.triton_ops import lora_expand, lora_shrink

        plan = self.batch.token_plan(x.shape[0], self.lora_a.shape[0], x.device)
        shrunk = lora_shrink(x, self.lora_a, plan)
        if self.in_shard is not None:  # every TP rank runs the same groups: the collectives pair up
            shrunk = tp_all_reduce(shrunk)
        return lora_expand(shrunk, self.lora_b, y, self.slice_table, self.max_rank, plan)

    def apply_torch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``apply`` in plain torch: one shrink and one expand per adapter group."""
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
