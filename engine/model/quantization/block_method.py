"""``BlockQuantLinearMethod``: a linear (or embedding) whose weight stays in a GGUF block format.

The weight is a uint8 ``nn.Parameter`` [out, row_bytes(in)] (``blocks``): a column-parallel shard is a
narrow of its rows, a row-parallel one a narrow of whole blocks, so the layers' weight loaders shard it
unchanged. Products:

* CPU: the native ``quant_linear`` (``engine/kernels/csrc/quant_linear.cpp``) on the weight repacked once
  after loading (``packed.pack``: 16 rows interleaved, the same bytes): activations quantized per block to
  14 bits and exact integer dot products; each output row depends only on its input row, bit for
  bit, so batching and prefix caching change no token. Activations of another dtype compute in float32 and
  round back.
* CUDA: the Triton kernel (``engine.kernels.triton_quant``), activations in their own dtype.
* Where neither is available (no compiler, native ops switched off): the torch reference, the weight
  dequantized per call; exact, slow.

Embedding rows are dequantized for the ids asked (the model's dtype). A tied head and embedding share one
Parameter, so the packing is marked on it (``packed``) and done once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import load_cpu_kernels
from engine.model.layers.linear_method import LinearMethod
from engine.model.quantization.blocks import QuantType, dequantize
from engine.model.quantization.packed import pack, unpack_rows


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

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On the CPU with the native kernels, the packed layout (once per Parameter); else as stored."""
        weight = layer.weight
        if getattr(weight, "packed", False) or weight.device.type != "cpu" or _native() is None:
            return
        weight.data = pack(weight.data, self.qtype)
        weight.packed = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(layer.weight, "packed", False):
            y = _native().quant_linear(x.float(), layer.weight, self.qtype.kernel_id, _float(bias))
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.device.type == "cuda":
            from engine.kernels.triton_quant import quant_linear

            return quant_linear(x, layer.weight, self.qtype, bias)
        return F.linear(x, dequantize(layer.weight, self.qtype).to(x.dtype), bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if getattr(layer.weight, "packed", False):
            rows = unpack_rows(layer.weight, ids, self.qtype)
        else:
            rows = layer.weight.index_select(0, ids.reshape(-1))
        values = dequantize(rows, self.qtype).to(self.compute_dtype)
        return values.reshape(*ids.shape, -1)


def _native():
    """The native CPU kernels where they have ``quant_linear``, else None."""
    kernels = load_cpu_kernels()
    return kernels if kernels is not None and hasattr(kernels, "quant_linear") else None


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()
