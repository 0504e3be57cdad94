"""``BlockQuantLinearMethod``: a linear (or embedding) whose weight stays in a GGUF block format.

The weight is a uint8 ``nn.Parameter`` [out, row_bytes(in)] (``blocks``): a column-parallel shard is a
narrow of its rows, a row-parallel one a narrow of whole blocks, so the layers' weight loaders shard it
unchanged. Products:

* CPU: the native ``quant_linear`` (``engine/kernels/csrc/quant_linear.cpp``): float32 activations, the
  weights dequantized in registers; each output row depends only on its input row, bit for bit, so batching
  and prefix caching change no token. Activations of another dtype compute in float32 and round back.
* CUDA: the Triton kernel (``engine.kernels.triton_quant``), activations in their own dtype.
* Where neither is available (no compiler, native ops switched off): the torch reference, the weight
  dequantized per call; exact, slow.

Embedding rows are dequantized for the ids asked (the model's dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import load_cpu_kernels
from engine.model.layers.linear_method import LinearMethod
from engine.model.quantization.blocks import QuantType, dequantize


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
        """Nothing to prepare: the kernels read the blocks as stored."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cuda":
            from engine.kernels.triton_quant import quant_linear

            return quant_linear(x, layer.weight, self.qtype, bias)
        kernels = load_cpu_kernels()
        if kernels is None or not hasattr(kernels, "quant_linear"):
            return F.linear(x, dequantize(layer.weight, self.qtype).to(x.dtype), bias)
        y = kernels.quant_linear(x.float(), layer.weight, self.qtype.kernel_id, _float(bias))
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.index_select(0, ids.reshape(-1))
        values = dequantize(rows, self.qtype).to(self.compute_dtype)
        return values.reshape(*ids.shape, -1)


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()
