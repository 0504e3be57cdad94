"""Weights prepared once after loading for bf16 linears on CPU.

* On a CPU with bf16 matrix instructions (AVX-512 BF16, AMX), a bf16 ``F.linear`` re-lays out the
  weight for oneDNN on every call; at decode batch sizes (tens of rows) that costs up to a third of
  the matmul, and with one row far more. The weight is packed once into oneDNN's layout.
* On a CPU without them (AVX2), oneDNN emulates bf16 products at about 15 GFLOP/s against 90-180 in
  float32 (``benchmarks/bench_matmul.py`` on cpu-2c-avx2): the layer keeps a float32 copy of its bf16
  weight, packed once into oneDNN's layout, and computes in float32, rounding the output back to bf16
  (the model's dtype stays bf16: activations, KV cache; the products are more exact, not less). Packed,
  the float32 products run 2-3x faster at decode sizes (tens of rows) than ``F.linear``'s MKL path
  (896 x 9728 at 32 rows: 71 against 30 GFLOP/s) and about even at prefill sizes.

Inside ``skinny_products()`` (the model runner's speculative steps, the draft model's forwards), float32
weights on CPU at 2 to 8 rows go to the native ``skinny_linear``, which reads each weight row once for all
rows: MKL's sgemm at those sizes takes 3-5x its one-row time on AVX2 (a 256 x 8192 LM head at 5 rows:
1.8 ms, against 0.5). Elsewhere MKL keeps every product, whose rows do not depend on how many there are
(a prefix-cache hit's last rows equal the full prompt's bit for bit); the native kernel sums in another
order. A decode-only step's LM head (the model runner, with ``cpu_decode``) may take it from one row on.
Everything else (other row counts, GPUs) keeps ``F.linear``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import has_bf16_matmul, load_cpu_kernels, product_dtype

# Rows the packed layout is tuned for (a typical decode batch); any row count works.
_BATCH_SIZE_HINT = 64
# Row counts the native skinny_linear takes (one row stays on MKL's GEMV, as transformers computes it).
_SKINNY_ROWS = range(2, 9)
_skinny_enabled = False  # inside skinny_products() only
_skinny_rows = _SKINNY_ROWS


@contextlib.contextmanager
def skinny_products(enabled: bool = True, rows: range = _SKINNY_ROWS):
    """Within the block, float32 products of ``rows`` rows (2 to 8 unless given; at most 8) use the native
    ``skinny_linear`` (see the module docstring)."""
    global _skinny_enabled, _skinny_rows
    previous = _skinny_enabled, _skinny_rows
    _skinny_enabled, _skinny_rows = enabled, rows
    try:
        yield
    finally:
        _skinny_enabled, _skinny_rows = previous


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and has_bf16_matmul()


def computes_in_fp32(weight: torch.Tensor) -> bool:
    """A bf16 weight on a CPU without bf16 matrix instructions (see the module docstring)."""
    return product_dtype(weight.dtype, weight.device) == torch.float32 and weight.dtype != torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed_weight: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` through the prepared weight when there is one (x: [T, in] -> [T, out])."""
    if packed_weight is None:
        if _skinny_enabled and x.shape[0] in _skinny_rows and x.dtype == weight.dtype == torch.float32:
            skinny_linear = getattr(load_cpu_kernels(), "skinny_linear", None) if x.device.type == "cpu" else None
            if skinny_linear is not None:
                return skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if packed_weight.dtype == torch.float32 and x.dtype != torch.float32:  # the float32 copy of a bf16 weight
        out = torch.ops.mkldnn._linear_pointwise(x.float(), packed_weight, _float(bias), "none", [], "")
        return out.to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()


def prepack_linears(model: nn.Module) -> int:
    """Prepares the weight of every module that has a ``packed_weight`` slot (a oneDNN layout, or a
    float32 copy: see the module docstring); returns how many."""
    num_packed = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        if can_prepack(module.weight):
            module.packed_weight = pack_weight(module.weight)
        elif computes_in_fp32(module.weight):
            module.packed_weight = pack_weight(module.weight.float())
        else:
            continue
        num_packed += 1
    return num_packed
