"""The native quantized linear (``quant_linear``: GGUF block weights packed, 14-bit activations; Q8_0 and Q4_1 unless
``--formats`` names others, the K-quants as random valid super-blocks) against float32 products on the dequantized
weight: MKL's ``F.linear`` and a oneDNN-packed copy (as cpu_prepack.py keeps it).

Prints, per thread count, shape (K, N) and row count M, the microseconds of each and the ratios; for M = 1
also the effective bandwidth of quant_linear (its weight bytes / time) against a STREAM-like read of this
run (a 256 MB ``torch.sum``) and the memory floor (weight bytes / that bandwidth).

    python benchmarks/bench_quant_linear.py
    python benchmarks/bench_quant_linear.py --threads 2 --rows 1 32 256
    python benchmarks/bench_quant_linear.py --threads 2 --rows 1 8 32 256 --formats Q8_0 Q4_1 Q5_0 Q5_1
    python benchmarks/bench_quant_linear.py --threads 2 --rows 1 8 64 512 --against OTHER.so
    python benchmarks/bench_quant_linear.py --threads 2 --rows 1 8 32 256 --shapes 5 6 7 --formats Q8_0 Q4_1 Q4_K Q6_K

``--against`` loads another build of the kernels module (another commit's ``.so``, from its
``~/.cache/torch_extensions`` directory) beside this one and prints, instead, both builds' ``quant_linear``
times on the same packed weights, measured alternately (each the better of two turns), and their ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels.cpu import load_cpu_kernels
from engine.model.quantization import kquants
from engine.model.quantization.blocks import QuantType, dequantize, quantize
from engine.model.quantization.packed import pack

# SmolLM2-135M's projections (K = in_features, N = out_features): qkv, o, gate_up, down, lm head.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
SHAPES += [(2048, 2048), (2048, 8192), (8192, 2048)]  # a 1B model's (Llama-3.2-1B): o, gate or up, down
DEFAULT_FORMATS = ("Q8_0", "Q4_1")
ROTATION_BYTES = 256 << 20


def seconds(fn, budget: float = 0.15) -> float:
    """The median time of one call, over calls filling about ``budget`` seconds."""
    fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    times = []
    for _ in range(max(3, min(200, int(budget / max(once, 1e-7))))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def rotating(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``tensor`` filling about ROTATION_BYTES, taken in turn so that each call reads its weight from
    as far out in the memory hierarchy as the STREAM-like read does (the model's other layers evict it)."""
    count = max(1, min(400, ROTATION_BYTES // (tensor.numel() * tensor.element_size())))
    return [tensor.clone() for _ in range(count)]


def cycling(fn, tensors: list[torch.Tensor]):
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(tensors)
        return fn(tensors[state["i"]])

    return call


def read_bandwidth() -> float:
    """Bytes per second of a sum over 256 MB (far past every cache)."""
    data = torch.ones(64 << 20)
    return data.numel() * 4 / seconds(lambda: data.sum(), budget=1.0)


def cpu_name() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")


def blocks_of(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """``weight`` quantized; a K-quant (which gguf cannot write) as random super-blocks of its shape."""
    if qtype.super_block:
        return kquants.random_rows(*weight.shape, qtype.value, torch.Generator().manual_seed(0))
    return quantize(weight, qtype)


def bench_shape(ops, formats: list[QuantType], k: int, n: int, rows: list[int], bandwidth: float) -> None:
    weight = torch.randn(n, k) * 0.05
    quantized = {q: blocks_of(weight, q) for q in formats}
    dense = dequantize(quantize(weight, QuantType.Q8_0), QuantType.Q8_0)
    packed = rotating(torch.ops.mkldnn._reorder_linear_weight(dense, 64))
    dense_copies = rotating(dense)
    quantized_copies = {q: rotating(pack(w, q)) for q, w in quantized.items()}
    for m in rows:
        x = torch.randn(m, k)
        fl = seconds(cycling(lambda w: F.linear(x, w), dense_copies))
        dnn = seconds(cycling(lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed))
        cells = [f"{k:5d} {n:6d} {m:4d} | {fl * 1e6:9.1f} {dnn * 1e6:9.1f}"]
        for q in formats:
            t = seconds(cycling(lambda w, q=q: ops.quant_linear(x, w, q.kernel_id), quantized_copies[q]))
            cells.append(f"{t * 1e6:9.1f} {fl / t:5.2f}x {dnn / t:5.2f}x")
            if m == 1:
                nbytes = quantized[q].numel()
                cells.append(f"{nbytes / t / 1e9:5.1f} GB/s ({nbytes / bandwidth / t:4.0%} of floor)")
        print(" | ".join(cells), flush=True)


def load_module(path: str, loaded: str):
    """A built kernels module by its file (its name is the file's stem: torch's loader names the init so).

    Refuses a module named as the one ``loaded`` already: Python then runs the first module's code for both (two
    copies of one checkout's build time the same code). Each checkout names its build apart (engine/kernels/cpu.py).
    """
    name = Path(path).name.split(".")[0]
    if name == loaded:
        raise SystemExit(f"{path} is named {name}, as this checkout's build: build the other in another checkout")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_against(ops, other, formats: list[QuantType], k: int, n: int, rows: list[int]) -> None:
    for q in formats:
        copies = rotating(pack(blocks_of(torch.randn(n, k) * 0.05, q), q))
        for m in rows:
            x = torch.randn(m, k)
            turns = {build: [] for build in (ops, other)}
            for build in (ops, other, ops, other):
                turns[build].append(seconds(cycling(lambda w, b=build: b.quant_linear(x, w, q.kernel_id), copies)))
            ours, theirs = min(turns[ops]), min(turns[other])
            print(f"{q.value} {k:5d} {n:6d} {m:4d} | {ours * 1e6:9.1f} {theirs * 1e6:9.1f} | {ours / theirs:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--shapes", type=int, nargs="+", help="indices into SHAPES (default: all)")
    parser.add_argument("--against", metavar="SO", help="another build of the kernels module to time beside this one")
    parser.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS, help="block formats (QuantType names)")
    args = parser.parse_args()
    formats = [QuantType.parse(name) for name in args.formats]
    ops = load_cpu_kernels()
    other = args.against and load_module(args.against, ops.__name__)
    assert ops is not None and hasattr(ops, "quant_linear"), "the native CPU kernels are not built here"
    print(f"CPU: {cpu_name()}; torch {torch.__version__}")
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth()
        print(f"\n{threads} thread(s); read bandwidth (256 MB torch.sum): {bandwidth / 1e9:.1f} GB/s; times in us")
        if args.against:
            print(f"fmt      K      N    M |  this build {Path(args.against).name} | this / that")
            for k, n in shapes:
                bench_against(ops, other, formats, k, n, args.rows)
            continue
        names = " | ".join(f"{q.value} us vs F.lin vs oneDNN" for q in formats)
        print(f"    K      N    M |  F.linear    oneDNN | {names} (M=1: GB/s, floor)")
        for k, n in shapes:
            bench_shape(ops, formats, k, n, args.rows, bandwidth)


if __name__ == "__main__":
    main()
