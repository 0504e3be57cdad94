"""Weights prepared once after loading for linears on CPU.

* float32: the layer also keeps its weight packed into oneDNN's layout (``mkldnn._linear_pointwise``), which
  products of ``PACKED_MIN_ROWS`` rows or more take: against MKL's sgemm on the unpacked weight, at decode
  sizes (4-32 rows) the packed products are faster and at prefill sizes about even (docs/benchmarks.md), and
  each row's result does not depend on how many rows the call has (a prefix-cache hit's last rows equal the
  full prompt's bit for bit), which MKL's does not at a few rows. One or two rows keep the unpacked weight:
  MKL's GEMV (as transformers computes a decode step) or, inside ``skinny_products()``, the native
  ``skinny_linear``, both faster than the packed call there. The copy doubles the weights' memory; the KV
  cache is sized after it.
* bf16 on a CPU with bf16 matrix instructions (AVX-512 BF16, AMX): a bf16 ``F.linear`` re-lays out the
  weight for oneDNN on every call; at decode batch sizes (tens of rows) that re-layout is a large part
  of the matmul's time, and with one row a larger part still. The weight is packed once into oneDNN's
  layout.
* bf16 on a CPU without them (AVX2): oneDNN emulates bf16 products, far slower than float32 ones
  (``benchmarks/bench_matmul.py``): the layer keeps a float32 copy of its bf16
  weight, packed once into oneDNN's layout, and computes in float32, rounding the output back to bf16
  (the model's dtype stays bf16: activations, KV cache; the products are more exact, not less). Packed,
  the float32 products are faster at decode sizes (tens of rows) than ``F.linear``'s MKL path and about
  even at prefill sizes.

Inside ``skinny_products()`` (the model runner's speculative steps, the draft model's forwards, a decode-only
step's LM head), float32 products of the enabled row counts below ``PACKED_MIN_ROWS`` go to the native
``skinny_linear``, which reads each weight row once for all rows (on AVX2, MKL's sgemm at a few rows takes
several times its one-row time). Everything else (GPUs) keeps ``F.linear``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from engine.kernels.cpu import has_bf16_matmul, load_cpu_kernels, product_dtype

# Rows the packed layout is tuned for (a typical decode batch); any row count works.
_BATCH_SIZE_HINT = 64
# A float32 product of this many rows or more takes the packed weight (module docstring).
PACKED_MIN_ROWS = 3
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
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and has_bf16_matmul())


def computes_in_fp32(weight: torch.Tensor) -> bool:
    """A bf16 weight on a CPU without bf16 matrix instructions (see the module docstring)."""
    return product_dtype(weight.dtype, weight.device) == torch.float32 and weight.dtype != torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed_weight: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` through the prepared weight when there is one (x: [T, in] -> [T, out])."""
    if packed_weight is not None and packed_weight.dtype == x.dtype == torch.float32 and x.shape[0] < PACKED_MIN_ROWS:
        packed_weight = None  # one or two rows: the unpacked weight is faster (module docstring)
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
