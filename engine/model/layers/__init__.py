"""Building blocks of the decoder, with a TP loading seam.

- ``linear``: column / merged / QKV / row-parallel linears (with a LoRA delta), ``VocabEmbedding``, ``LMHead``.
- ``attention``: ``SelfAttention``, packed qkv, optional q/k RMSNorm, rope, paged attention, o_proj.
- ``mlp``: ``SwiGLUMLP``, gate and up packed as ``gate_up_proj``.
- ``norm``: ``RMSNorm``, with vLLM's fused add + norm.
- ``rotary``: ``RotaryEmbedding`` (default, linear, dynamic NTK, llama3, yarn).
- ``cpu_prepack``: linear weights prepared once after loading on CPU (oneDNN-packed; float32 copies on AVX2).
- ``cpu_decode``: ``CPUDecodeStack``, a decode-only CPU step's layer stack in one native call.
"""
