"""Linear and embedding layers with a tensor-parallel loading seam.

Every parameter carries ``param.weight_loader(param, loaded, shard_id=None)``:
the loader hands it the *full* checkpoint tensor and the layer copies the part
that belongs to its rank (``tp_rank`` of ``tp_size``, default 0 of 1) into the
right place (for packed layers, the right shard: ``"q"/"k"/"v"`` or ``0/1``).
Copying casts to the parameter's dtype.

With ``tp_size > 1`` the forward of ``RowParallelLinear`` and ``VocabEmbedding``
sums the ranks' partial outputs (``tp_all_reduce``) and ``LMHead`` concatenates
the ranks' vocab shards (``tp_all_gather``) over the tensor-parallel group that
``engine.distributed.init_distributed`` built; with ``tp_size == 1`` (one
device) no collective is ever called.

Weights are allocated with ``torch.empty`` (no random init): construction is
cheap and every value comes from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.distributed.parallel_state import tp_all_gather, tp_all_reduce
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS
from engine.model.layers.linear_method import UNQUANTIZED, LinearMethod


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole tensor; shapes must match exactly, and block bytes (uint8) go only into block bytes."""
    if (param.dtype == torch.uint8) != (loaded.dtype == torch.uint8):
        raise ValueError(f"a {loaded.dtype} tensor cannot load into a {param.dtype} parameter (block bytes)")
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _param(shape: tuple[int, ...], loader: Callable) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    return p


class LinearBase(nn.Module):
    """y = x @ W.T + b with W of shape [out_local, in_local].

    ``lora``: multi-LoRA (``engine.lora.layers.LinearLoRA``) adds each token's adapter delta to y;
    None (LoRA off) costs one attribute test per call. ``quant_method`` stores W and computes the product
    (``engine.model.layers.linear_method``) through the layer's ``product``, chosen when the weights are
    processed; ``quantize_as`` gives the layer another method before loading. ``forward(x, native_rows)``:
    ``native_rows`` is the step's fact ``cpu_prepack`` documents.
    """

    lora = None
    multiplies = True
    quant_method: LinearMethod = UNQUANTIZED

    def __init__(self, in_local: int, out_local: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_local, out_local
        self.weight = self.quant_method.create_weight(out_local, in_local, self.weight_loader)
        self.bias = _param((out_local,), self.weight_loader) if bias else None
        self.product = self.quant_method.torch_product(self.weight)  # chosen by process_weights_after_loading

    def quantize_as(self, method: LinearMethod) -> None:
        """Store the weight as ``method`` does (before the checkpoint loads)."""
        self.quant_method = method
        self.weight = method.create_weight(self.out_features, self.in_features, self.weight_loader)
        self.product = method.torch_product(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor, native_rows: range = NO_NATIVE_ROWS) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias, native_rows)
        return y if self.lora is None else self.lora.apply(x, y)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(in_features, out_features, bias, tp_rank, tp_size)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert out_features % tp_size == 0, (out_features, tp_size)
        super().__init__(in_features, out_features // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed along dim 0 (e.g. gate_up_proj, shard ids 0, 1)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)

    def shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))

    def shard_rows(self, shard_id) -> tuple[int, int]:
        """(offset, size) of ``shard_id`` inside this rank's packed output."""
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # an already-packed checkpoint tensor
            return ColumnParallelLinear.weight_loader(self, param, loaded)
        offset, size = self.shard_rows(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections packed as [q_heads*D | kv_heads*D | kv_heads*D] (shard ids "q", "k", "v").

    KV heads are replicated when ``tp_size > num_kv_heads``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        assert num_heads % tp_size == 0
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        sizes = [self.num_heads * head_dim * tp_size] + [self.num_kv_heads * head_dim * tp_size] * 2
        super().__init__(hidden_size, sizes, bias, tp_rank, tp_size)

    def shard_ids(self) -> list:
        return ["q", "k", "v"]

    def shard_rows(self, shard_id) -> tuple[int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            return ColumnParallelLinear.weight_loader(self, param, loaded)
        offset, size = self.shard_rows(shard_id)
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial outputs are summed over the TP group.

    The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert in_features % tp_size == 0, (in_features, tp_size)
        super().__init__(in_features // tp_size, out_features, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            return default_weight_loader(param, loaded)
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor, native_rows: range = NO_NATIVE_ROWS) -> torch.Tensor:
        if self.tp_size == 1:
            y = self.quant_method.apply(self, x, self.bias, native_rows)
            return y if self.lora is None else self.lora.apply(x, y)
        y = tp_all_reduce(self.quant_method.apply(self, x, None, native_rows))
        if self.lora is not None:  # after the reduction: the LoRA delta reduces its own shrink
            y = self.lora.apply(x, y)
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding, vocab split across ranks (rows [r*V/tp, (r+1)*V/tp)); ``quant_method`` as LinearBase's
    (it only looks rows up: no float product of its own)."""

    multiplies = False
    quant_method: LinearMethod = UNQUANTIZED

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        assert vocab_size % tp_size == 0, (vocab_size, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_size, self.local_vocab = vocab_size, vocab_size // tp_size
        self.vocab_start = tp_rank * self.local_vocab
        self.hidden_size = hidden_size
        self.weight = self.quant_method.create_weight(self.local_vocab, hidden_size, self.weight_loader)
        self.product = self.quant_method.torch_product(self.weight)

    def quantize_as(self, method: LinearMethod) -> None:
        self.quant_method = method
        self.weight = method.create_weight(self.local_vocab, self.hidden_size, self.weight_loader)
        self.product = method.torch_product(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded.narrow(0, self.vocab_start, self.local_vocab))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embed(self, input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        out = self.quant_method.embed(self, local.clamp(0, self.local_vocab - 1)) * mine.unsqueeze(-1)
        return tp_all_reduce(out)  # each token's row comes from the one rank holding it


class LMHead(nn.Module):
    """Vocab-parallel output projection; the ranks' logit shards are concatenated along vocab.

    With tied embeddings it reuses ``embedding.weight`` (the same Parameter) and the embedding's
    ``quant_method``; its ``product`` is its own.
    """

    multiplies = True

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        tied_to: VocabEmbedding | None = None,
    ):
        super().__init__()
        self.tp_size = tp_size
        self.is_tied = tied_to is not None
        # Untied: an embedding of its own holds the vocab-sharding weight_loader (not a submodule).
        self._rows = [tied_to or VocabEmbedding(vocab_size, hidden_size, tp_rank, tp_size)]
        self.weight = self._rows[0].weight
        self.product = self.quant_method.torch_product(self.weight)  # chosen by process_weights_after_loading

    @property
    def quant_method(self) -> LinearMethod:
        return self._rows[0].quant_method

    def quantize_as(self, method: LinearMethod) -> None:
        """Tied: follows the embedding (quantized first); untied: quantizes its own rows."""
        if not self.is_tied:
            self._rows[0].quantize_as(method)
        self.weight = self._rows[0].weight
        self.product = self.quant_method.torch_product(self.weight)

    def forward(self, hidden: torch.Tensor, native_rows: range = NO_NATIVE_ROWS) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden, None, native_rows)
        return logits if self.tp_size == 1 else tp_all_gather(logits)  # [T, V/tp] -> [T, V]
