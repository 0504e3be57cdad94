"""``BlockQuantLinearMethod``: a linear (or embedding) whose weight stays in a GGUF block format.

The weight is a uint8 ``nn.Parameter`` [out, row_bytes(in)] (``blocks``): a column-parallel shard is a
narrow of its rows, a row-parallel one a narrow of whole blocks, so the layers' weight loaders shard it
unchanged. Its product, chosen once by ``process_weights_after_loading`` from the weight's device and the
native kernels there:

* ``NativeBlockProduct`` (CPU with the native kernels): ``quant_linear``
  (``engine/kernels/csrc/quant_linear.cpp``) on the weight repacked once after loading (``packed.pack``: 16
  rows interleaved, the same bytes): activations quantized per block to 14 bits and exact integer dot
  products; each output row depends only on its input row, bit for bit, so batching and prefix caching
  change no token. Activations of another dtype compute in float32 and round back.
* ``TritonBlockProduct`` (CUDA): the Triton kernel (``engine.kernels.triton_quant``, every format: the
  32-weight blocks and the K-quants' super-blocks), on the file's layout, activations in their own dtype.
* ``TorchBlockProduct`` (elsewhere: no compiler, native ops switched off; every layer before its weights are
  processed): the torch reference, the weight dequantized per call; exact, slow.

Embedding rows are dequantized for the ids asked (the model's dtype), read through the product (the packed
layout or the file's). A tied head and embedding share one Parameter, so the packing is marked on it
(``packed``) and done once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import load_cpu_kernels
from engine.kernels.huge_pages import on_huge_pages
from engine.model.layers.linear_method import LinearMethod
from engine.model.quantization.blocks import QuantType, dequantize
from engine.model.quantization.packed import pack, unpack_rows


class TorchBlockProduct:
    """The reference: ``x @ dequantize(w).T``, the weight in the file's layout (``linear_method``'s product)."""

    native_format: int | None = None
    packed = None

    def __init__(self, weight: torch.Tensor, qtype: QuantType) -> None:
        self.weight, self.qtype = weight, qtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.qtype).to(x.dtype), bias)

    def file_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight in the file's layout (uint8 [T, row_bytes])."""
        return self.weight.index_select(0, ids.reshape(-1))


class TritonBlockProduct(TorchBlockProduct):
    def __init__(self, weight: torch.Tensor, qtype: QuantType) -> None:
        super().__init__(weight, qtype)
        from engine.kernels.triton_quant import quant_linear  # Triton: imported on a GPU only

        self.quant_linear = quant_linear

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        return self.quant_linear(x, self.weight, self.qtype, bias)


class NativeBlockProduct(TorchBlockProduct):
    """``quant_linear`` on the packed layout; the native decode stack runs it by the format's kernel id."""

    def __init__(self, weight: torch.Tensor, qtype: QuantType, kernels) -> None:
        super().__init__(weight, qtype)
        self.kernels, self.native_format = kernels, qtype.kernel_id

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        bias = None if bias is None else bias.float()
        return self.kernels.quant_linear(x.float(), self.weight, self.native_format, bias).to(x.dtype)

    def file_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return unpack_rows(self.weight, ids, self.qtype)


def block_product(weight: torch.Tensor, qtype: QuantType) -> TorchBlockProduct:
    """The product of ``weight`` (a Parameter, or a part of one: ``parted``) in ``qtype`` (module docstring);
    on the CPU with the native kernels, the packed layout first (once per tensor: a tied head finds it packed
    by its embedding)."""
    kernels = load_cpu_kernels() if weight.device.type == "cpu" else None
    if not hasattr(kernels, "quant_linear"):
        kernels = None
    if getattr(weight, "packed", False) and kernels is None:
        raise RuntimeError(f"a {qtype.value} weight packed for the native kernels, which are off now")
    if kernels is not None:
        if not getattr(weight, "packed", False):
            weight.data = on_huge_pages(pack(weight.data, qtype))  # streamed whole each step: few TLB misses
            weight.packed = True
        return NativeBlockProduct(weight, qtype, kernels)
    if weight.device.type == "cuda":
        return TritonBlockProduct(weight, qtype)
    return TorchBlockProduct(weight, qtype)


class BlockQuantLinearMethod(LinearMethod):
    """The weight in ``qtype``'s blocks (module docstring); one instance per format, shared by layers."""

    is_quantized = True

    def __init__(self, qtype: QuantType, compute_dtype: torch.dtype) -> None:
        self.qtype = qtype
        self.compute_dtype = compute_dtype

    def __repr__(self) -> str:
        return f"BlockQuantLinearMethod({self.qtype.value})"

    def create_weight(self, out_features: int, in_features: int, weight_loader: Callable) -> nn.Parameter:
        shape = (out_features, self.qtype.row_bytes(in_features))
        p = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        p.weight_loader = weight_loader
        return p

    def torch_product(self, weight: nn.Parameter) -> TorchBlockProduct:
        return TorchBlockProduct(weight, self.qtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The product (``block_product``)."""
        layer.product = block_product(layer.weight, self.qtype)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        values = dequantize(layer.product.file_rows(ids), self.qtype).to(self.compute_dtype)
        return values.reshape(*ids.shape, -1)
