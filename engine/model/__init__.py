"""Model definitions (Llama / Mistral / Qwen2 / Qwen3) and weight loading.

Entry point: ``get_model(model_path, dtype, device="cpu")`` (a directory or a .gguf file); see ``LlamaForCausalLM``
for the forward / ``compute_logits`` interface the model runner uses.
"""

from engine.model.architecture import Architecture, parse_dtype
from engine.model.loader import WeightLoadingError, get_model
from engine.model.registry import MODEL_REGISTRY, get_model_class

__all__ = ["MODEL_REGISTRY", "Architecture", "WeightLoadingError", "get_model", "get_model_class", "parse_dtype"]
