"""Microbenchmarks of Serval's native CPU ops against the plain-torch code they replace.

Minimum over many repetitions (other work on the machine only ever adds time). Decode attention runs
over all layers of a workload's decode step, on a KV cache with randomly placed blocks, cold (the
caches evicted before each repetition, as in a real step where the matmuls run in between) and with
4 KiB or huge pages; the fused elementwise ops (AVX-512 or AVX2 path, whichever this CPU built) run
at the workload's decode and prefill sizes, in the activation dtype (``--dtype``: a bf16 model keeps
bf16 activations, a float32 model float32 ones).

    python benchmarks/bench_kernels.py --workload w2
    python benchmarks/bench_kernels.py --workload w2 --dtype float32 --skip-attention
    python benchmarks/bench_kernels.py --workload w1 --threads 1
    python benchmarks/bench_kernels.py --workload w1 --skip-elementwise
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels.cpu import load_cpu_kernels  # noqa: E402
from engine.kernels.memory import advise_huge_pages  # noqa: E402
from engine.model.layers.norm import RMSNorm  # noqa: E402
from engine.model.layers.rotary import RotaryEmbedding  # noqa: E402

# (layers, requests, heads, kv heads, head dim, hidden, intermediate, context lengths of the decode step)
SHAPES = {
    "w2": dict(
        layers=4,
        num_reqs=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        hidden=256,
        intermediate=688,
        min_len=129,
        max_len=256,
        prefill_tokens=2048,
    ),
    "w1": dict(
        layers=24,
        num_reqs=32,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        hidden=896,
        intermediate=4864,
        min_len=257,
        max_len=384,
        prefill_tokens=2048,
    ),
}
BLOCK_SIZE = 16
_EVICT = torch.ones(16 << 20)  # 64 MiB, larger than the L3


def best_of(fn, reps: int, cold: bool = False) -> float:
    """Minimum wall time of fn() in microseconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if cold:
            _EVICT.add_(1.0)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def decode_attention(shape: dict, kernels, reps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    n, max_blocks = shape["num_reqs"], -(-shape["max_len"] // BLOCK_SIZE)
    lens = torch.randint(shape["min_len"], shape["max_len"], (n,), generator=gen, dtype=torch.int32)
    num_blocks = 4 * n * max_blocks  # a pool 4x larger than used, blocks drawn at random
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: n * max_blocks] + 1).to(torch.int32).view(n, -1)
    q = torch.randn(n, shape["num_heads"], shape["head_dim"], generator=gen).bfloat16()
    cache_shape = (2, num_blocks, BLOCK_SIZE, shape["num_kv_heads"], shape["head_dim"])
    for huge in (False, True):
        caches = []
        for _ in range(shape["layers"]):
            cache = torch.empty(cache_shape, dtype=torch.bfloat16)
            if huge:
                advise_huge_pages(cache)
            caches.append(cache.normal_(generator=gen))

        def step():
            for cache in caches:
                kernels.paged_decode_attention(q, cache, tables, lens, 0.125)

        pages = "huge pages" if huge else "4 KiB pages"
        print(
            f"decode attention, {shape['layers']} layers, {pages}: hot {best_of(step, reps):9.1f} us, "
            f"cold {best_of(step, reps, cold=True):9.1f} us"
        )
        caches.clear()  # free this round's caches before the next round allocates its own


def elementwise(shape: dict, kernels, reps: int, dtype: torch.dtype) -> None:
    for rows in (shape["num_reqs"], shape["prefill_tokens"]):
        width, hidden = shape["intermediate"], shape["hidden"]
        gate_up = torch.randn(rows, 2 * width).to(dtype)
        torch_silu = best_of(lambda: F.silu(gate_up[:, :width]) * gate_up[:, width:], reps)
        print(
            f"silu*mul   {rows:5d} x {width}: native {best_of(lambda: kernels.silu_and_mul(gate_up), reps):8.1f} us, "
            f"torch {torch_silu:8.1f} us"
        )
        norm = RMSNorm(hidden).to(dtype)
        x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
        native = best_of(lambda: kernels.fused_add_rms_norm(x, residual, norm.weight, 1e-6), reps)
        plain = best_of(lambda: norm._norm(x + residual), reps)
        print(f"add+norm   {rows:5d} x {hidden}: native {native:8.1f} us, torch {plain:8.1f} us")
        h, hk, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
        rotary = RotaryEmbedding(d, {"rope_theta": 10000.0}, 4096)
        qkv = torch.randn(rows, (h + 2 * hk) * d).to(dtype)
        q, k, v = (t.view(rows, -1, d) for t in qkv.split([h * d, hk * d, hk * d], dim=-1))
        positions = torch.randint(0, 4096, (rows,))
        slots = torch.randperm(rows * 2)[:rows]
        cache = torch.zeros(2, rows * 2 // BLOCK_SIZE + 1, BLOCK_SIZE, hk, d).to(dtype)
        table = rotary.table(4095, q.device)

        def plain_rope():
            cos_sin = rotary.cos_sin_for(positions, 4095)
            q2, k2 = rotary(positions, q, k, cos_sin)
            flat = cache.view(2, -1, hk, d)
            flat[0].index_copy_(0, slots, k2)
            flat[1].index_copy_(0, slots, v)

        native = best_of(lambda: kernels.rotary_embedding_and_cache(positions, q, k, v, table, cache, slots), reps)
        print(f"rope+cache {rows:5d} tokens: native {native:8.1f} us, torch {best_of(plain_rope, reps):8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(SHAPES), default="w2")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="of the elementwise ops")
    parser.add_argument("--skip-attention", action="store_true", help="only the fused elementwise ops")
    parser.add_argument("--skip-elementwise", action="store_true", help="only decode attention")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None or not hasattr(kernels, "silu_and_mul"):
        sys.exit("the fused native CPU ops (AVX-512 or AVX2 with FMA and F16C) are not available here")
    print(
        f"workload {args.workload}, {torch.get_num_threads()} threads, min of {args.reps} repetitions, "
        f"elementwise in {args.dtype}"
    )
    if not args.skip_attention:
        decode_attention(SHAPES[args.workload], kernels, args.reps)
    if not args.skip_elementwise:
        elementwise(SHAPES[args.workload], kernels, args.reps, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
