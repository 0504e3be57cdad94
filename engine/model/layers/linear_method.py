"""How a linear (or embedding) layer stores its weight and computes with it: vLLM's ``LinearMethodBase``.

Every ``LinearBase``, ``VocabEmbedding`` and ``LMHead`` holds a ``quant_method``; its layers call only these
methods, so a format plugs in without the layers (or TP sharding, LoRA on top, the loader) knowing which:

* ``create_weight(out_features, in_features, weight_loader)``: the stored weight, an ``nn.Parameter`` whose
  first dimension is the output rows (so a column shard is a ``narrow(0, ...)``) and whose second is
  linear in the input columns (a row-parallel shard of whole blocks is a ``narrow(1, ...)`` of it).
* ``process_weights_after_loading(layer)``: once, after the checkpoint is in (prepacked layouts).
* ``apply(layer, x, bias)``: ``x [T, in] -> [T, out]``, ``x @ W.T + bias``.
* ``embed(layer, ids)``: rows of ``W`` for token ids, in the layer's compute dtype.

``UNQUANTIZED`` (float weights, ``cpu_prepack``'s products) is every layer's method unless the model's
quantization plan (``engine.model.quantization.plan``) gives it another.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.cpu_prepack import can_prepack, computes_in_fp32, linear, pack_weight


class LinearMethod(abc.ABC):
    """The contract in the module docstring."""

    is_quantized = False

    @abc.abstractmethod
    def create_weight(self, out_features: int, in_features: int, weight_loader: Callable) -> nn.Parameter: ...

    @abc.abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None: ...

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    @abc.abstractmethod
    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethod):
    """Float weights (the model's dtype) and ``cpu_prepack``'s products."""

    def create_weight(self, out_features: int, in_features: int, weight_loader: Callable) -> nn.Parameter:
        p = nn.Parameter(torch.empty((out_features, in_features)), requires_grad=False)
        p.weight_loader = weight_loader
        return p

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """A oneDNN layout (or a float32 copy of a bf16 weight) for CPU products: see ``cpu_prepack``."""
        if not hasattr(layer, "packed_weight"):
            return
        if can_prepack(layer.weight):
            layer.packed_weight = pack_weight(layer.weight)
        elif computes_in_fp32(layer.weight):
            layer.packed_weight = pack_weight(layer.weight.float())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.packed_weight)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


UNQUANTIZED = UnquantizedLinearMethod()


def process_weights_after_loading(model: nn.Module) -> int:
    """Runs every layer's ``quant_method.process_weights_after_loading`` once; returns how many packed."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return sum(getattr(m, "packed_weight", None) is not None for m in model.modules())
