"""KV cache groups: a model's layers grouped by how far back they attend, each group with its own blocks.

vLLM's hybrid KV cache manager, with its uniform page size. Layers of one attention window (full attention,
or a sliding window of so many positions) form groups of ``group_size`` layers each, the smallest number of
layers any one window has (a window with more layers is split into several groups, its last one possibly
smaller). Slot ``j`` of every group is one cache tensor per layer position: layer ``layers[j]`` of each
group uses tensor ``j``. A block id names one page in each of those tensors and belongs to one group at a
time (one shared ``BlockPool``), so a block costs ``group_size`` layers' pages, and each group holds for a
request only the blocks its own layers still read: a sliding group drops the blocks that fall wholly
before the window of every later query of the request (``num_skipped_blocks``), so a long request holds
there about ``window / block_size + 1`` blocks. A model whose layers all attend alike has one group of all
its layers (one tensor per layer): the engine as if there were no groups.

Order: full attention first, then the windows from the shortest; layers ascending within each.
Pure Python: the scheduler reads the windows, the workers the layers (``layer_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers attending alike: ``window`` positions back (the query's own included), or all (None)."""

    window: int | None
    layers: tuple[int, ...] = ()  # the model's layer indices; layers[j] uses cache slot j

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks that no query at position ``num_computed_tokens`` or later reads (0 without a window):
        such a query at p attends keys p - window < k <= p."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def max_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds here at once, when a step computes at most
        ``max_step_tokens`` of them: its window's blocks and the step's (all of them without a window)."""
        all_blocks = -(-num_tokens // block_size)
        if self.window is None:
            return all_blocks
        return min(all_blocks, -(-(self.window - 1 + max_step_tokens) // block_size) + 1)


# What the scheduler assumes when no model told it otherwise: every layer attends to every position.
FULL_ATTENTION = (KVCacheGroup(None),)


def kv_cache_groups(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer ``i`` attends ``windows[i]`` positions back (None: all of them)."""
    layers_of: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        layers_of.setdefault(window, []).append(layer)
    if not layers_of:
        return FULL_ATTENTION
    size = min(len(layers) for layers in layers_of.values())
    order = sorted(layers_of, key=lambda window: (window is not None, window or 0))
    return tuple(
        KVCacheGroup(window, tuple(layers_of[window][start : start + size]))
        for window in order
        for start in range(0, len(layers_of[window]), size)
    )


def layer_slots(groups: Sequence[KVCacheGroup]) -> dict[int, tuple[int, int]]:
    """Layer index -> (its group, its cache slot)."""
    return {layer: (g, slot) for g, group in enumerate(groups) for slot, layer in enumerate(group.layers)}
