"""Model definitions (Llama / Mistral / Qwen2 / Qwen3 / Gemma 3) and weight loading.

Entry point: ``get_model(model_path, dtype, device="cpu")`` (a directory or a .gguf file); see ``LlamaForCausalLM``
for the forward / ``compute_logits`` interface the model runner uses.

- ``registry``: architecture name -> model class, and the factory ``get_model``.
- ``llama``: the Llama-family decoder (Llama, Mistral; Qwen by flags); ``qwen``: Qwen2 and Qwen3.
- ``gemma3``: Gemma 3's text decoder (Llama's layers with Gemma's norms, GeGLU, scaled embedding).
- ``layers``: its building blocks (a package).
- ``architecture``: ``Architecture``, the shapes and flags read once from a config.
- ``source``: ``open_model_source``, a Hugging Face directory or a GGUF file read tensor by tensor.
- ``gguf_file``: ``GGUFFile``, the GGUF reader.
- ``loader``: checkpoint tensors into the model's parameters (per-rank slices, the engine's dtype).
"""

from engine.model.architecture import Architecture, parse_dtype
from engine.model.loader import WeightLoadingError
from engine.model.registry import MODEL_REGISTRY, get_model, get_model_class

__all__ = ["MODEL_REGISTRY", "Architecture", "WeightLoadingError", "get_model", "get_model_class", "parse_dtype"]
