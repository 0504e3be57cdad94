"""Quantized weights: linears (and embeddings) that keep GGUF's block formats in memory.

* ``blocks``: ``QuantType`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), the byte layout of a row, torch dequantization (the
  reference every kernel is checked against) and quantization (gguf's own, bit-identical to llama.cpp's); the
  K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks) in ``kquants``.
* ``parted``: a packed layer whose parts the file stores in different formats, each part kept in its own.
"""
