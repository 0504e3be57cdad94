"""GFLOP/s of the linear layers of a workload on this CPU: float32, bf16, and bf16 with prepacked weights.

Tells how far an engine's matmuls are from what the machine can do, per row count (decode batches are
tens of rows, prefill chunks thousands).

    python benchmarks/bench_matmul.py --workload w1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.model.layers.cpu_prepack import can_prepack, linear, pack_weight

# (in_features, out_features) of the projections: qkv, o, gate_up, down, lm_head.
SHAPES = {
    "w1": [(896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 16384)],
    "w2": [(256, 512), (256, 256), (256, 1376), (688, 256), (256, 8192)],
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
    args = parser.parse_args()
    print(f"{'shape':>12} {'rows':>5} {'fp32':>7} {'bf16':>7} {'bf16-packed':>12}   (GFLOP/s)")
    for in_features, out_features in SHAPES[args.workload]:
        weight32 = torch.randn(out_features, in_features) * 0.05
        weight16 = weight32.bfloat16()
        packed = pack_weight(weight16) if can_prepack(weight16) else None
        for rows in args.rows:
            x32 = torch.randn(rows, in_features)
            x16 = x32.bfloat16()
            flops = 2.0 * rows * in_features * out_features
            results = [
                gflops(lambda: F.linear(x32, weight32), flops),
                gflops(lambda: F.linear(x16, weight16), flops),
                gflops(lambda: linear(x16, weight16, None, packed), flops) if packed is not None else float("nan"),
            ]
            print(
                f"{in_features:>5}x{out_features:<6} {rows:>5} "
                f"{results[0]:>7.1f} {results[1]:>7.1f} {results[2]:>12.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
