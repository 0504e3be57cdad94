"""Reading and checking one PEFT LoRA adapter directory against the base model.

A PEFT adapter is ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) plus ``adapter_model.safetensors`` holding, per adapted
projection, ``base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A.weight``
[r, in] and ``...lora_B.weight`` [out, r]. ``load_adapter`` raises ValueError naming
the problem for anything it cannot serve; nothing else raises for bad input.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.architecture import Architecture

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by PEFT's module name: their parent module in the decoder layer.
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, module) its A [r, in] and B [out, r] with the scaling folded
    into B, so applying it is ``x @ A.T @ B.T``."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shape(arch: Architecture, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a full (unsharded) projection of ``arch``."""
    hidden, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv, inter = arch.num_key_value_heads * arch.head_dim, arch.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def read_adapter_config(path: str, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) from ``adapter_config.json``; ValueError for what is missing or unsupported."""
    config_path = Path(path) / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (not a PEFT adapter directory).") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is unreadable: {error}.") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a LORA config.")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {path!r}: r must be a positive integer and lora_alpha a number.")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, above max_lora_rank ({max_lora_rank}).")
    targets = config.get("target_modules") or []
    unknown = sorted(set([targets] if isinstance(targets, str) else targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(
            f"LoRA adapter {path!r} targets modules the model lacks or Serval cannot adapt: {unknown} "
            f"(supported: {sorted(TARGET_MODULES)})."
        )
    for key in ("modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} is not supported.")
    if config.get("bias", "none") != "none" or config.get("use_dora"):
        raise ValueError(f"LoRA adapter {path!r}: bias training and DoRA are not supported.")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def load_adapter(path: str, arch: Architecture, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Reads and checks the adapter at ``path`` for a model of ``arch``; ValueError naming the problem."""
    rank, scaling = read_adapter_config(path, max_lora_rank)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None or TARGET_MODULES.get(match[3]) != match[2]:
            raise ValueError(f"LoRA adapter {path!r}: unexpected tensor {name!r}.")
        layer = int(match[1])
        if layer >= arch.num_hidden_layers:
            raise ValueError(f"LoRA adapter {path!r}: {name!r} names layer {layer}; the model has fewer layers.")
        pairs.setdefault((layer, match[3]), {})[match[4]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights.")
    weights = {}
    for (layer, module), pair in pairs.items():
        in_features, out_features = module_shape(arch, module)
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} lacks lora_A or lora_B.")
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise ValueError(
                f"LoRA adapter {path!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"expected ({rank}, {in_features}) and ({out_features}, {rank}) for this model."
            )
        weights[(layer, module)] = (a.to(dtype), (b.to(torch.float32) * scaling).to(dtype))
    return LoRAAdapter(rank=rank, scaling=scaling, weights=weights)


def adapter_digest(path: str) -> str:
    """What the adapter at ``path`` holds: a digest of its config and weights files ("" for a file it lacks),
    so an adapter rewritten in place reads as another adapter (slots, host LRU and prefix cache)."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = Path(path) / name
        digest.update(name.encode() + b"\0" + (file.read_bytes() if file.is_file() else b""))
    return digest.hexdigest()[:16]


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = Path(path) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}.")
    try:
        return load_file(str(weights_path))
    except (OSError, SafetensorError, ValueError) as error:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is unreadable: {error}.") from None
