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

from dataclasses import dataclass

import torch

from engine.distributed.parallel_state import tp_all_reduce
from engine.lora.adapter import LoRAAdapter


def lora_kernels(device: torch.device) -> str:
    """``"triton"`` on CUDA, ``"torch"`` elsewhere (the Triton kernels run on CPU only interpreted: tests)."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


@dataclass
class PaddedGroups:
    """The step's groups as the torch path runs them: one batched matmul over [groups, longest group, ...].

    ``whole``: the one slot when every token uses it (two plain matmuls, no gather). Otherwise ``slots``
    (a slice of the slot axis when the groups' slots are consecutive, else their indices), ``index``
    [groups * longest] each group's token rows padded with row 0, ``mask`` [groups, longest, 1] zeroing
    the padding's shrunk rows (None: no padding), so a padded row adds exact zeros to row 0.
    """

    whole: int | None = None
    slots: slice | torch.Tensor | None = None
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    longest: int = 0


def pad_groups(groups: list[tuple[int, torch.Tensor | None]], device, dtype: torch.dtype) -> PaddedGroups:
    """``PaddedGroups`` of ``LoRABatch.groups`` (sorted by slot)."""
    if len(groups) == 1 and groups[0][1] is None:
        return PaddedGroups(whole=groups[0][0])
    groups = sorted(groups, key=lambda group: group[0])
    slots = [slot for slot, _ in groups]
    counts = [len(rows) for _, rows in groups]
    longest = max(counts)
    index = torch.zeros(len(groups), longest, dtype=torch.int64, device=device)
    for row, (_, rows) in enumerate(groups):
        index[row, : len(rows)] = rows
    mask = None
    if min(counts) < longest:
        mask = (torch.arange(longest, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]).to(dtype)
        mask = mask[:, :, None]
    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
    chosen = slice(slots[0], slots[0] + len(slots)) if consecutive else torch.tensor(slots, device=device)
    return PaddedGroups(slots=chosen, index=index.view(-1), mask=mask, longest=longest)


class LoRABatch:
    """The step's (slot, token rows) groups; set by ``LoRAManager.prepare`` before each forward.

    Each kernel path reads them in its own form, made on the step's first layer and shared by the rest.
    """

    def __init__(self) -> None:
        self._groups: list[tuple[int, torch.Tensor | None]] = []
        self._plans: dict = {}

    @property
    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        return self._groups

    @groups.setter
    def groups(self, groups: list[tuple[int, torch.Tensor | None]]) -> None:
        self._groups, self._plans = groups, {}

    def padded(self, x: torch.Tensor) -> PaddedGroups:
        """The torch path's ``PaddedGroups``."""
        key = ("torch", x.dtype)
        if key not in self._plans:
            self._plans[key] = pad_groups(self._groups, x.device, x.dtype)
        return self._plans[key]

    def token_plan(self, num_tokens: int, max_loras: int, device: torch.device):
        """The groups as one slot per token (-1: none), sorted by slot (``triton_ops.LoRATokenPlan``)."""
        from engine.lora.triton_ops import plan_lora_tokens

        key = ("triton", num_tokens)
        if key not in self._plans:
            slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
            for slot, rows in self._groups:
                if rows is None:
                    slots.fill_(slot)
                else:
                    slots[rows] = slot
            self._plans[key] = plan_lora_tokens(slots, max_loras)
        return self._plans[key]


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
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # see _transposed
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
        """``apply`` in plain torch: the groups padded to the longest, one batched shrink and expand for all
        (a handful of ops whatever the number of adapters: per-step op overhead dominates small batches)."""
        plan = self.batch.padded(x)
        if plan.whole is not None:
            shrunk = x @ self.lora_a[plan.whole].T
            if self.in_shard is not None:  # every TP rank runs the same groups: the collectives pair up
                shrunk = tp_all_reduce(shrunk)
            return y.addmm_(shrunk, self.lora_b[plan.whole].T)
        if plan.longest == 0:
            return y
        a_t, b_t = self._transposed(plan.slots)
        rows = x.index_select(0, plan.index).view(-1, plan.longest, x.shape[1])
        shrunk = torch.bmm(rows, a_t)
        if self.in_shard is not None:
            shrunk = tp_all_reduce(shrunk)
        if plan.mask is not None:
            shrunk.mul_(plan.mask)
        delta = torch.bmm(shrunk, b_t)
        return y.index_add_(0, plan.index, delta.view(-1, y.shape[1]))

    def _transposed(self, slots: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A [n, in, width] and B [n, width, out] of ``slots``, transposed for bmm: views of a slot range,
        kept (the slots' contents change in place), so a step's layers do not rebuild them; a copy otherwise."""
        if isinstance(slots, torch.Tensor):
            return self.lora_a[slots].transpose(1, 2), self.lora_b[slots].transpose(1, 2)
        key = (slots.start, slots.stop)
        if key not in self._views:
            self._views[key] = (self.lora_a[slots].transpose(1, 2), self.lora_b[slots].transpose(1, 2))
        return self._views[key]
