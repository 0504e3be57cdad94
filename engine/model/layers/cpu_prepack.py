"""The products of a float linear (``x @ W.T + b``), one chosen per layer when its weights are processed.

``float_product(weight)`` picks it once (``UnquantizedLinearMethod.process_weights_after_loading``), from the
weight's device and dtype and the CPU's ISA; the layer then calls only that product:

* ``CPUFloat32Product`` (float32 on CPU): the layer also keeps its weight packed into oneDNN's layout
  (``mkldnn._linear_pointwise``), which products of ``PACKED_MIN_ROWS`` rows or more take: against MKL's
  sgemm on the unpacked weight, at decode sizes (4-32 rows) the packed products are faster and at prefill
  sizes about even (docs/benchmarks.md), and each row's result does not depend on how many rows the call has
  (a prefix-cache hit's last rows equal the full prompt's bit for bit), which MKL's does not at a few rows.
  One or two rows keep the unpacked weight: MKL's GEMV (as transformers computes a decode step) or, for the
  row counts the step names (``native_rows``), the native ``skinny_linear``, both faster than the packed
  call there. The copy doubles the weights' memory; the KV cache is sized after it.
* ``PackedProduct`` (bf16 on a CPU with bf16 matrix instructions: AVX-512 BF16, AMX): a bf16 ``F.linear``
  re-lays out the weight for oneDNN on every call; at decode batch sizes (tens of rows) that re-layout is a
  large part of the matmul's time, and with one row a larger part still. The weight is packed once.
* ``Float32CopyProduct`` (bf16 on a CPU without them: AVX2): oneDNN emulates bf16 products, far slower than
  float32 ones (``benchmarks/bench_matmul.py``): the layer keeps a float32 copy of its bf16 weight, packed
  once into oneDNN's layout, and computes in float32, rounding the output back to bf16 (the model's dtype
  stays bf16: activations, KV cache; the products are more exact, not less). Packed, the float32 products
  are faster at decode sizes (tens of rows) than ``F.linear``'s MKL path and about even at prefill sizes.
* ``TorchProduct``: ``F.linear`` (GPUs; every layer before its weights are processed).

``native_rows`` is a step's fact, passed down with each call: the row counts whose float32 CPU products take
the native ``skinny_linear``, which reads each weight row once for all rows (on AVX2, MKL's sgemm at a few
rows takes several times its one-row time). A step that verifies drafts and the draft model's forwards name
``SPECULATIVE_ROWS`` (``native_rows_of_step``), a native decode step's LM head the rows its stack multiplies
natively; every other call ``NO_NATIVE_ROWS``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu import has_bf16_matmul, load_cpu_kernels, product_dtype

# Rows the packed layout is tuned for (a typical decode batch); any row count works.
_BATCH_SIZE_HINT = 64
# A float32 product of this many rows or more takes the packed weight (module docstring).
PACKED_MIN_ROWS = 3
NO_NATIVE_ROWS = range(0)
# A speculative step's row counts for skinny_linear (one row stays on MKL's GEMV, as transformers computes it).
SPECULATIVE_ROWS = range(2, 9)


def native_rows_of_step(max_verify_query_len: int) -> range:
    """The ``native_rows`` of a forward whose queries of up to ``max_verify_query_len`` tokens verify drafts
    (``AttentionMetadata.max_verify_query_len``): their few rows per request, more than one, multiply natively."""
    return SPECULATIVE_ROWS if max_verify_query_len > 1 else NO_NATIVE_ROWS


class TorchProduct:
    """``F.linear`` on the weight as stored. ``native_format``: how ``engine.worker.native_decode``'s stack
    computes this product (-1: float32, ``skinny_linear`` / the packed copy / ``at::linear``), None where it
    cannot; ``packed``: the oneDNN-packed copy the product reads, if any."""

    native_format: int | None = None
    packed: torch.Tensor | None = None

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class CPUFloat32Product(TorchProduct):
    """float32 on CPU: MKL or ``skinny_linear`` for a few rows, the packed copy (where oneDNN is) for more."""

    native_format = -1

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor | None, skinny_linear) -> None:
        super().__init__(weight)
        self.packed, self.skinny_linear = packed, skinny_linear

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and rows >= PACKED_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        if rows in native_rows and self.skinny_linear is not None:
            return self.skinny_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class PackedProduct(TorchProduct):
    """The weight in oneDNN's layout, in its own dtype (bf16 with bf16 matrix instructions)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.packed = pack_weight(weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class Float32CopyProduct(TorchProduct):
    """A packed float32 copy of a bf16 weight: products in float32, the output rounded back to bf16."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.packed = pack_weight(weight.float())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        bias = None if bias is None else bias.float()
        return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, bias, "none", [], "").to(x.dtype)


def float_product(weight: torch.Tensor) -> TorchProduct:
    """The product for a float ``weight`` (module docstring), chosen from its device, its dtype and the ISA;
    its activations come in the weight's dtype."""
    onednn = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        kernels = load_cpu_kernels()
        skinny_linear = getattr(kernels, "skinny_linear", None)
        return CPUFloat32Product(weight, pack_weight(weight) if onednn else None, skinny_linear)
    if onednn and weight.dtype == torch.bfloat16 and has_bf16_matmul():
        return PackedProduct(weight)
    if onednn and product_dtype(weight.dtype, weight.device) == torch.float32:
        return Float32CopyProduct(weight)
    return TorchProduct(weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)
