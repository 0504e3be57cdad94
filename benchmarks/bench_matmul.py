"""GFLOP/s of the linear layers of a workload on this CPU: float32 (MKL's ``F.linear``, a oneDNN-packed copy,
and the native ``skinny_linear`` up to 8 rows), bf16, and bf16 with prepacked weights.

Tells how far an engine's matmuls are from what the machine can do, per row count (decode batches are
tens of rows, prefill chunks thousands).

    python benchmarks/bench_matmul.py --workload w1
    python benchmarks/bench_matmul.py --workload w3 --rows 1 8 32 256 --threads 1 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.kernels.cpu import load_cpu_kernels
from engine.model.layers.cpu_prepack import NO_NATIVE_ROWS, CPUFloat32Product, PackedProduct, float_product, pack_weight

# (in_features, out_features) of the projections: qkv, o, gate_up, down, lm_head.
SHAPES = {
    "w1": [(896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 16384)],
    "w2": [(256, 512), (256, 256), (256, 1376), (688, 256), (256, 8192)],
    "w3": [(576, 832), (576, 576), (576, 3072), (1536, 576), (576, 49152)],  # SmolLM2-135M
}


def gflops(fn, num_flops: float, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return num_flops * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(SHAPES), default="w1")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 512, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    skinny = getattr(kernels, "skinny_linear", None)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"{threads} thread(s)")
        print(
            f"{'shape':>12} {'rows':>5} {'fp32':>7} {'fp32-pk':>7} {'native':>7} {'bf16':>7} {'bf16-pk':>7}  (GFLOP/s)"
        )
        for in_features, out_features in SHAPES[args.workload]:
            for rows in args.rows:
                print(_row(in_features, out_features, rows, skinny), flush=True)


def _row(in_features: int, out_features: int, rows: int, skinny) -> str:
    """One shape at one row count: each variant's GFLOP/s (nan where it does not apply)."""
    weight32 = torch.randn(out_features, in_features) * 0.05
    weight16 = weight32.bfloat16()
    packed16 = float_product(weight16)  # the bf16 layers' product: packed only with bf16 matrix instructions
    packed32 = CPUFloat32Product(weight32, pack_weight(weight32), None)
    x32 = torch.randn(rows, in_features)
    x16 = x32.bfloat16()
    flops = 2.0 * rows * in_features * out_features
    nan = float("nan")
    results = [
        gflops(lambda: F.linear(x32, weight32), flops),
        gflops(lambda: packed32(x32, None, NO_NATIVE_ROWS), flops),
        gflops(lambda: skinny(x32, weight32), flops) if skinny is not None and rows <= 8 else nan,
        gflops(lambda: F.linear(x16, weight16), flops),
        gflops(lambda: packed16(x16, None, NO_NATIVE_ROWS), flops) if isinstance(packed16, PackedProduct) else nan,
    ]
    return f"{in_features:>5}x{out_features:<6} {rows:>5} " + " ".join(f"{r:>7.1f}" for r in results)


if __name__ == "__main__":
    main()
