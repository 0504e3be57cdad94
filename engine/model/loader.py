"""Build a model from its source (``engine.model.source``: a Hugging Face directory or a GGUF file).

Weights are read lazily, tensor by tensor, from the source and handed to each parameter's
``weight_loader(param, tensor, shard_id=None)``, which copies (and casts) the
part this tensor-parallel rank owns. With pipeline parallelism only this
stage's tensors are read (``model.wants_weight``). Loading fails listing every
missing and unexpected checkpoint weight of this rank's part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from engine.model.architecture import Architecture, parse_dtype
from engine.model.layers.linear import default_weight_loader
from engine.model.source import open_model_source


class WeightLoadingError(RuntimeError):
    """The checkpoint does not match the model's parameters."""


def _map_name(name: str, packed: list[tuple[str, str, object]]) -> tuple[str, object]:
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
        target, shard_id = _map_name(ckpt_name, packed)
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


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model_path: str,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    *,
    attn_backend: str = "torch",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> nn.Module:
    """Build this rank's part of the model at ``model_path``, load its weights cast to ``dtype``; eval mode.

    The part is pipeline stage ``pp_rank`` of ``pp_size``, tensor-parallel slice
    ``tp_rank`` of ``tp_size`` (defaults: the whole model). ``dtype`` defaults to
    the checkpoint's (float32 if unrecorded). The result follows the interface
    documented on ``LlamaForCausalLM``.
    """
    from engine.attention.backend import get_attention_backend
    from engine.model.registry import get_model_class

    source = open_model_source(model_path)
    model_cls = get_model_class((source.hf_config.get("architectures") or ["<none>"])[0])
    arch = Architecture.from_hf_config(source.hf_config)
    dtype = parse_dtype(dtype) or arch.torch_dtype or torch.float32
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(
            arch,
            get_attention_backend(attn_backend),
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )
    model.load_weights(source.iter_weights(model.wants_weight))
    return model.eval()
