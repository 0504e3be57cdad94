"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, explicit head_dim).

Both are the Llama decoder; the differences are flags set by ``Architecture``
from the architecture name (``qkv_bias``, ``has_qk_norm``).
"""

from engine.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
