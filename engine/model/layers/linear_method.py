"""How a linear (or embedding) layer stores its weight and computes with it: vLLM's ``LinearMethodBase``.

Every ``LinearBase``, ``VocabEmbedding`` and ``LMHead`` holds a ``quant_method``; its layers call only these
methods, so a format plugs in without the layers (or TP sharding, LoRA on top, the loader) knowing which:

* ``create_weight(out_features, in_features, weight_loader)``: the stored weight, an ``nn.Parameter`` whose
  first dimension is the output rows (so a column shard is a ``narrow(0, ...)``) and whose second is
  linear in the input columns (a row-parallel shard of whole blocks is a ``narrow(1, ...)`` of it).
* ``torch_product(weight)``: the plain-torch product, the layer's ``product`` until its weights are processed.
* ``process_weights_after_loading(layer)``: once, after the checkpoint is in: the one place the layer's
  ``product`` is chosen, from the weight's device and format and the CPU's ISA (prepacked layouts made then).
* ``apply(layer, x, bias, native_rows)``: ``x [T, in] -> [T, out]``, ``x @ W.T + bias``: the layer's product,
  nothing decided per call; ``native_rows`` is the step's fact ``cpu_prepack`` documents.
* ``embed(layer, ids)``: rows of ``W`` for token ids, in the layer's compute dtype.

A product is a callable ``(x, bias, native_rows) -> y`` with ``weight``, ``packed`` (a packed copy it reads, or
None) and ``native_format`` (how ``engine.worker.native_decode``'s stack computes it, None where it cannot).
A layer that only looks rows up (``VocabEmbedding``: ``multiplies`` False) gets no float product of its own.

``UNQUANTIZED`` (float weights, ``cpu_prepack``'s products) is every layer's method unless the model's
quantization plan (``engine.model.quantization.plan``) gives it another.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.memory import release_freed_memory
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS, TorchProduct, float_product


class LinearMethod(abc.ABC):
    """The contract in the module docstring."""

    is_quantized = False

    @abc.abstractmethod
    def create_weight(self, out_features: int, in_features: int, weight_loader: Callable) -> nn.Parameter: ...

    @abc.abstractmethod
    def torch_product(self, weight: nn.Parameter): ...

    @abc.abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None: ...

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range = NO_NATIVE_ROWS
    ) -> torch.Tensor:
        return layer.product(x, bias, native_rows)

    @abc.abstractmethod
    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethod):
    """Float weights (the model's dtype) and ``cpu_prepack``'s products."""

    def create_weight(self, out_features: int, in_features: int, weight_loader: Callable) -> nn.Parameter:
        p = nn.Parameter(torch.empty((out_features, in_features)), requires_grad=False)
        p.weight_loader = weight_loader
        return p

    def torch_product(self, weight: nn.Parameter) -> TorchProduct:
        return TorchProduct(weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """``cpu_prepack.float_product``: a oneDNN layout (or a float32 copy of a bf16 weight) on CPU."""
        if layer.multiplies:
            layer.product = float_product(layer.weight)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


UNQUANTIZED = UnquantizedLinearMethod()


def process_weights_after_loading(model: nn.Module) -> int:
    """Runs every layer's ``quant_method.process_weights_after_loading`` once; returns how many keep a packed
    copy of their weight."""
    layers = [module for module in model.modules() if getattr(module, "quant_method", None) is not None]
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
        release_freed_memory()  # the weight it replaced: the load then holds one layer twice, not the model
    return sum(layer.product.packed is not None for layer in layers)
