"""``architectures`` name (from config.json) -> model class, and the model factory ``get_model``."""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from engine.attention.backend import get_attention_backend
from engine.model.architecture import Architecture, parse_dtype
from engine.model.gemma3 import Gemma3ForCausalLM
from engine.model.llama import PACKED_MODULES, LlamaForCausalLM
from engine.model.quantization.plan import plan_quantization
from engine.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.model.source import open_model_source

logger = logging.getLogger(__name__)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its language model (text only)
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for ``architecture``; ``ValueError`` naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


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
    quantization: str | None = None,
) -> nn.Module:
    """Build this rank's part of the model at ``model_path``, load its weights cast to ``dtype``; eval mode.

    The part is pipeline stage ``pp_rank`` of ``pp_size``, tensor-parallel slice
    ``tp_rank`` of ``tp_size`` (defaults: the whole model). ``dtype`` defaults to
    the checkpoint's (float32 if unrecorded). ``quantization`` is ``ModelConfig.quantization``: which
    layers keep block-format weights (``engine.model.quantization.plan``). The result follows the
    interface documented on ``LlamaForCausalLM``.
    """
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
        stored_types = source.stored_types()
        plan = plan_quantization(model, stored_types, PACKED_MODULES, quantization)
        plan.apply(model, dtype)
    model.load_weights(source.iter_weights(model.wants_weight, blocks=plan.checkpoint))
    logger.info(
        "Weights of %s: %.1f MB held; %s (float and dequantized tensors as %s)",
        os.path.basename(os.path.normpath(model_path)),
        held_bytes(model) / 1e6,
        plan.describe(stored_types, model.wants_weight),
        str(dtype).removeprefix("torch."),
    )
    return model.eval()


def held_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (block bytes, rope tables), each storage counted once."""
    tensors = [*model.parameters(), *model.buffers()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
