"""Load a model's weights from its source (``engine.model.source``: a Hugging Face directory or a GGUF file).

Weights are read lazily, tensor by tensor, from the source and handed to each parameter's
``weight_loader(param, tensor, shard_id=None)``, which copies (and casts) the
part this tensor-parallel rank owns. With pipeline parallelism only this
stage's tensors are read (``model.wants_weight``). Loading fails listing every
missing and unexpected checkpoint weight of this rank's part.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model.layers.linear import default_weight_loader


class WeightLoadingError(RuntimeError):
    """The checkpoint does not match the model's parameters."""


def map_checkpoint_name(name: str, packed: list[tuple[str, str, object]]) -> tuple[str, object]:
    """Checkpoint name -> (model parameter name, shard id or None)."""
    for packed_part, ckpt_part, shard_id in packed:
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{packed_part}."), shard_id
    return name, None


def _expected_shards(model: nn.Module) -> dict[str, list]:
    """Parameter name -> shard ids it must receive ([None] for plain parameters)."""
    names = {n for n, _ in model.named_parameters()}  # deduplicated: tied weights appear once
    expected: dict[str, list] = {}
    for mod_name, module in model.named_modules():
        shard_ids = module.shard_ids() if hasattr(module, "shard_ids") else [None]
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if full in names:
                expected[full] = shard_ids
    return expected


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: list[tuple[str, str, object]],
    skip_suffixes: Iterable[str] = (),
) -> None:
    """Load checkpoint (name, tensor) pairs into ``model``; raise ``WeightLoadingError`` on any mismatch."""
    params = dict(model.named_parameters())
    expected = _expected_shards(model)
    skip = tuple(skip_suffixes)
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if skip and ckpt_name.endswith(skip):
            continue
        target, shard_id = map_checkpoint_name(ckpt_name, packed)
        param = params.get(target)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        except ValueError as e:
            raise WeightLoadingError(f"cannot load {ckpt_name!r}: {e}") from None
        shards = expected[target] if shard_id is None else [shard_id]
        loaded.update((target, s) for s in shards)
    missing = sorted(_display(n, s) for n, ids in expected.items() for s in ids if (n, s) not in loaded)
    if missing or unexpected:
        raise WeightLoadingError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing weights {missing or 'none'}; unexpected weights {sorted(unexpected) or 'none'}"
        )


def _display(name: str, shard_id: object) -> str:
    """Name a missing packed shard by its checkpoint name (qkv_proj + 'k' -> k_proj)."""
    if shard_id is None:
        return name
    part = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}.get(shard_id, shard_id)
    packed = name.split(".")[-2]
    return name.replace(f".{packed}.", f".{part}.")
