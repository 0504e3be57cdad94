"""``architectures`` name (from config.json) -> model class."""

from __future__ import annotations

from torch import nn

from engine.model.llama import LlamaForCausalLM
from engine.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for ``architecture``; ``ValueError`` naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
