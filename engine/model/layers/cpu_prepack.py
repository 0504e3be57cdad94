"""oneDNN-prepacked weights for bf16 linears on CPU.

A bf16 ``F.linear`` on CPU re-lays out the weight for oneDNN on every call; at
decode batch sizes (tens of rows) that costs up to a third of the matmul, and
with one row far more. Packing once after loading removes it. Only bf16 on a
CPU with oneDNN bf16 support is packed; everything else keeps ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows the packed layout is tuned for (a typical decode batch); any row count works.
_BATCH_SIZE_HINT = 64


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through the packed weight when there is one (x: [T, in] -> [T, out])."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Packs the weight of every module that has a ``packed_weight`` slot; returns how many."""
    num_packed = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and can_prepack(module.weight):
            module.packed_weight = pack_weight(module.weight)
            num_packed += 1
    return num_packed
