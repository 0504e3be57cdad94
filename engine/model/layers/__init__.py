"""Building blocks of the decoder, with a TP loading seam.

- ``linear``: column / merged / QKV / row-parallel linears (with a LoRA delta), ``VocabEmbedding``, ``LMHead``.
- ``attention``: ``SelfAttention``, packed qkv, optional q/k RMSNorm, rope, paged attention, o_proj.
- ``mlp``: ``GatedMLP`` (SwiGLU, GeGLU), gate and up packed as ``gate_up_proj``.
- ``norm``: ``RMSNorm``, with vLLM's fused add + norm; ``GemmaRMSNorm`` (x * (1 + w) in float32).
- ``rotary``: ``RotaryEmbedding`` (default, linear, dynamic NTK, llama3, yarn).
- ``linear_method``: ``LinearMethod``, how a layer stores its weight; it chooses the layer's product at load.
- ``cpu_prepack``: the float products, chosen once per layer (oneDNN-packed on CPU; float32 copies on AVX2).
"""
