"""``PartedBlockMethod``: a packed linear (qkv_proj, gate_up_proj) whose parts a GGUF file stores in different
block formats, each part kept in its own (llama.cpp's Q4_K_M writes V as Q6_K, Q and K as Q4_K, on half the
layers); vLLM's GGUF layers do the same.

While loading, the weight is one uint8 Parameter [out, widest row_bytes]: each part's rows padded to the widest
of the formats, so that the layer's own ``weight_loader`` (its shard offsets, tensor-parallel ranks, replicated
KV heads) places it unchanged. ``process_weights_after_loading`` then cuts the runs of consecutive parts in one
format out of it, gives each the product ``BlockQuantLinearMethod`` would (``block_product``: packed for the
native kernels where they run), and keeps their bytes back to back in the Parameter, now 1-D: the file's bytes,
the padding gone. The product computes each run and concatenates their outputs along the features (then adds
the bias): each run's values are exactly its own format's product, so batch invariance and the reference hold.
Where every run is native, the native decode stack computes it the same way (``native_format`` ``PARTED``; its
``packed`` is then the runs' table, int64 [runs, 3]: kernel id, rows, row bytes, which decode_stack.cpp reads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear_method import LinearMethod
from engine.model.quantization.block_method import TorchBlockProduct, block_product
from engine.model.quantization.blocks import QuantType

PARTED = -2  # the native decode stack's format code for a parted product (decode_stack.cpp)


class PartedBlockProduct:
    """The runs' products side by side: ``x -> cat(run(x) for run) + bias``."""

    def __init__(self, weight: torch.Tensor, runs: list[TorchBlockProduct]) -> None:
        self.weight, self.runs = weight, runs
        native = all(run.native_format is not None for run in runs)
        self.native_format = PARTED if native else None
        table = [[run.native_format, *run.weight.shape] for run in runs]
        self.packed = torch.tensor(table, dtype=torch.int64) if native else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        y = torch.cat([run(x, None, native_rows) for run in self.runs], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)


class PartedBlockMethod(LinearMethod):
    """``formats``: the layer's shard id -> the format its checkpoint part is stored in (module docstring)."""

    is_quantized = True

    def __init__(self, formats: dict, compute_dtype: torch.dtype) -> None:
        self.formats, self.compute_dtype = dict(formats), compute_dtype

    def __repr__(self) -> str:
        return f"PartedBlockMethod({', '.join(f'{s}: {q.value}' for s, q in self.formats.items())})"

    def create_weight(self, out_features: int, in_features: int, weight_loader: Callable) -> nn.Parameter:
        widest = max(qtype.row_bytes(in_features) for qtype in self.formats.values())
        p = nn.Parameter(torch.zeros((out_features, widest), dtype=torch.uint8), requires_grad=False)

        def load_padded(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if shard_id not in self.formats:
                raise ValueError(f"{self!r} has no part {shard_id!r}")
            weight_loader(param, F.pad(loaded, (0, widest - loaded.shape[1])), shard_id)

        p.weight_loader = load_padded
        return p

    def torch_product(self, weight: nn.Parameter):
        return _UnprocessedParts(self)

    def runs(self, layer: nn.Module) -> list[tuple[QuantType, int, int]]:
        """(format, first row, rows) of each run of consecutive parts stored in one format."""
        runs: list[tuple[QuantType, int, int]] = []
        for shard_id in layer.shard_ids():
            offset, size = layer.shard_rows(shard_id)
            qtype = self.formats[shard_id]
            if runs and runs[-1][0] is qtype and runs[-1][1] + runs[-1][2] == offset:
                runs[-1] = (qtype, runs[-1][1], runs[-1][2] + size)
            else:
                runs.append((qtype, offset, size))
        return runs

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Cuts the runs out, one product each, their bytes back to back in the (now 1-D) weight."""
        weight, in_features = layer.weight, layer.in_features
        parts = []
        for qtype, offset, size in self.runs(layer):
            rows = weight.data[offset : offset + size, : qtype.row_bytes(in_features)].contiguous()
            parts.append((qtype, block_product(rows, qtype)))
        weight.data = torch.cat([product.weight.reshape(-1) for _, product in parts])
        at = 0
        for _, product in parts:  # each run reads its bytes where they now lie
            size = product.weight.numel()
            product.weight = weight.data[at : at + size].view(product.weight.shape)
            at += size
        layer.product = PartedBlockProduct(weight, [product for _, product in parts])

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a parted block weight is a packed linear's, never an embedding's")


class _UnprocessedParts:
    """The product before the weights are processed: the padded weight, dequantized part by part."""

    native_format: int | None = None
    packed = None

    def __init__(self, method: PartedBlockMethod) -> None:
        self.method = method

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, native_rows: range) -> torch.Tensor:
        raise RuntimeError("a parted block layer computes once its weights are processed")
