"""The prepared device check (``benchmarks/gpu_check.sh``): kernels, parity and speed on one CUDA GPU.

On a machine with a CUDA GPU, ``bash benchmarks/gpu_check.sh`` runs, each phase in its own Python
process (``python -m benchmarks.gpu_check PHASE``) under its own timeout:

* ``hardware``: the ceilings, measured: device-to-device copy bandwidth (bytes read + written per
  second) and bf16 matmul FLOP/s (8192^3), both timed with CUDA events.
* ``kernels``: the Triton kernel tests (and the CUDA graph tests), natively.
* ``checkpoint``: a random Llama-3-8B-shaped bf16 checkpoint, made on the spot (no downloads).
* ``decode_graphs`` / ``decode_eager``: decode tokens/s at batch 1, 32 and 256, with CUDA graphs
  and eagerly, against the memory-bandwidth roofline.
* ``prefill``: prefill tokens/s against the matmul roofline.
* ``parity_ours`` / ``parity_hf``: greedy tokens of the whole engine and of transformers, float32
  without TF32, on random prompts; compared by ``report``.
* ``quant``: ``quant_linear`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 weights on SmolLM2-135M's shapes, the K-quants
  Q4_K, Q5_K, Q6_K on Llama-3.2-1B's; fp16 activations): its error against the dequantized weight, its time
  beside torch's fp16 matmul, its bandwidth at M = 1.
* ``report``: results.json, table.md and the table, printed last.

``--smoke`` runs the same phases on a CPU with a tiny model and Triton's interpreter, so that every
code path except the CUDA specifics runs in CI (tests/serval/test_gpu_check.py).
"""
