"""``serval make-model PATH --lora BASE``: a random PEFT LoRA adapter for the checkpoint BASE.

Writes PEFT's own format (``adapter_config.json``, ``adapter_model.safetensors``
with PEFT's tensor names) so ``peft.PeftModel.from_pretrained`` loads it onto
the transformers model. Deterministic: the same options give the same bytes.
Unlike PEFT's init (B = 0, a no-op), both A and B are random, so every adapter
visibly changes the model's outputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHORT_NAMES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


def make_lora_adapter(
    path: str | Path,
    base: str | Path,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down"),
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Writes the adapter into ``path`` (created); returns it. ``targets``: short names (q, k, ..., down)."""
    from safetensors.torch import save_file

    from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
    from engine.model.architecture import Architecture

    unknown = sorted(set(targets) - set(SHORT_NAMES))
    if unknown or rank < 1:
        raise ValueError(f"--lora-targets: unknown {unknown} (choose from {list(SHORT_NAMES)}); rank must be >= 1.")
    modules = [SHORT_NAMES[t] for t in SHORT_NAMES if t in targets]  # a fixed order: deterministic bytes
    tensors = _random_weights(Architecture.from_model(str(base)), modules, rank, seed)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def _random_weights(arch, modules: list[str], rank: int, seed: int) -> dict:
    """PEFT's tensors of every layer's ``modules``: A ~ N(0, 1/in), B ~ N(0, 0.01/r), a clear change to the
    model's outputs, not a different model."""
    import torch

    from engine.lora.adapter import TARGET_MODULES, module_shape

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module in modules:
            in_features, out_features = module_shape(arch, module)
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) / rank**0.5 * 0.1
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--lora`` options of ``serval make-model``."""
    parser.add_argument(
        "--lora",
        type=Path,
        default=None,
        metavar="BASE",
        help="instead: a random PEFT LoRA adapter for the checkpoint BASE into PATH (--seed applies)",
    )
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-targets", default="q,k,v,o,gate,up,down", help="comma-separated short names")
    parser.add_argument("--rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA), not alpha/r")


def run_lora(args: argparse.Namespace) -> int:
    """``make-model --lora``: writes the adapter; returns the exit code."""
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    make_lora_adapter(args.path, args.lora, args.lora_rank, args.lora_alpha, targets, args.rslora, args.seed)
    return 0
