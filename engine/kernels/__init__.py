"""Kernels: native CPU ops and the GPU's Triton kernels, each beside its torch reference.

- ``cpu``: builds the C++ CPU ops in ``csrc/`` on first use (decode attention, the decode stack, fused
  elementwise ops, ``skinny_linear``, row-wise argmax, the grammar bitmask); plain torch where they cannot be built.
- ``memory``: transparent huge pages for the KV cache (``advise_huge_pages``).
- ``triton_cache``: the KV-cache write from slot mappings.
- ``triton_decode``: paged decode attention (split-K over long contexts, a merge kernel).
- ``triton_prefill``: paged attention for a mixed batch, one launch.
- ``triton_quant``: ``quant_linear``, the GEMM on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) for
  GPUs.
- ``triton_common``: what the attention kernels share (the tile load through the block table, online softmax).
"""
