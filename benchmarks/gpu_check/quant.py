"""The ``quant`` phase: ``quant_linear`` (engine/kernels/triton_quant.py, triton_kquant.py) on a small model's
shapes, and its rows.

For every format, (K, N) and M, with float16 activations: the relative error against
``x.float() @ dequantize(w).T`` (float32 without TF32), and the seconds of one call beside torch's float16
matmul on the dequantized weight; at M = 1 also the weight bytes read per second. The 32-weight formats run
on SmolLM2-135M's shapes, the K-quants (K a multiple of 256) on Llama-3.2-1B's. The weights are random
block bytes made on the device (random quants, scales that keep ``y`` near unit size), so no gguf is
needed there. The cases run M by M (every format and shape at M = 1 first), so a phase deadline skips the
largest batches. On CUDA each call is timed inside a CUDA graph (the engine's decode path: no Python launch
cost) that cycles through enough copies of the weight to miss the L2 cache.

``quant_rows`` turns the record into the report's rows (no torch: the report runs on the CPU).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from benchmarks.gpu_check.settings import QUANT_FP16_REL_TOL, Settings

QUANT_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def random_blocks(n: int, k: int, qtype, device: str, generator):
    """uint8 [n, row_bytes(k)]: random quants, positive fp16 scales of ~1/(64 sqrt(k)); a min (Q4_1, Q5_1) is
    minus half the quants' range times d (-8 d, -16 d). A K-quant's d is that over 32 (its 6-bit or int8
    sub-block scales multiply it), its dmin (Q4_K, Q5_K) the quants' mean times d (7.5 d, 15.5 d)."""
    import torch

    from engine.model.quantization import kquants

    blocks = torch.randint(
        0, 256, (n, k // qtype.block_weights, qtype.block_bytes), dtype=torch.uint8, device=device, generator=generator
    )
    scale = (0.5 + torch.rand(n, k // qtype.block_weights, 1, device=device, generator=generator)) / (64 * math.sqrt(k))
    if qtype.super_block:
        halves = [f.offset for f in kquants.LAYOUTS[qtype.value].fields if f.half]  # d (and dmin)
        values = [scale / 32, scale / 32 * (15.5 if qtype.value == "Q5_K" else 7.5)]
        for offset, value in zip(halves, values):
            blocks[..., offset : offset + 2] = value.half().view(torch.uint8)
        return blocks.reshape(n, -1)
    middle = 16 if qtype.high_bits_bytes else 8
    header = torch.cat([scale, -middle * scale], dim=-1) if qtype.has_min else scale
    blocks[..., : qtype.scale_bytes] = header.half().view(torch.uint8)
    return blocks.reshape(n, -1)


def time_per_call_s(fn, operands: list, device: str, warmup: int, reps: int) -> float:
    """Seconds of one ``fn(operand)``, cycling through ``operands``; on CUDA inside a CUDA graph."""
    import torch

    from benchmarks.gpu_check.device import is_cuda, time_repeated_s

    if not is_cuda(device):
        return time_repeated_s(lambda: [fn(o) for o in operands], device, warmup, reps) / len(operands)
    for operand in operands[:2]:
        fn(operand)  # compiles (Triton) and picks the algorithm (cuBLAS) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for operand in operands:
            fn(operand)
    replay_s = time_repeated_s(graph.replay, device, warmup, reps)
    return replay_s / len(operands)


def measure_case(settings: Settings, qtype, k: int, n: int, m: int, generator) -> dict:
    """One (format, K, N, M): relative error, our seconds per call, torch fp16's, and the bandwidth."""
    import torch

    from engine.kernels.triton_quant import quant_linear
    from engine.model.quantization.blocks import dequantize

    device = settings.device
    weight = random_blocks(n, k, qtype, device, generator)
    x = torch.randn(m, k, device=device, generator=generator).half()
    dense = dequantize(weight, qtype)
    expected = x.float() @ dense.T
    error = float((quant_linear(x, weight, qtype).float() - expected).norm() / expected.norm())
    copies = max(1, math.ceil(settings.quant_rotate_bytes / (2 * dense.numel())))
    dense16 = [dense.half() for _ in range(copies)]
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    del dense, expected
    ours_s = time_per_call_s(
        lambda w: quant_linear(x, w, qtype), weights, device, settings.bench_warmup, settings.quant_reps
    )
    torch_s = time_per_call_s(lambda w: x @ w.T, dense16, device, settings.bench_warmup, settings.quant_reps)
    return {
        "format": qtype.value,
        "k": k,
        "n": n,
        "m": m,
        "rel_error": error,
        "weight_bytes": weight.numel(),
        "weight_copies": copies,
        "ours_s": ours_s,
        "torch_fp16_s": torch_s,
        "weight_bytes_per_s": weight.numel() / ours_s,
        "torch_fp16_weight_bytes_per_s": 2 * k * n / torch_s,
    }


def run_quant(settings: Settings, work: Path, deadline: float) -> dict:
    """Every M x format x shape, in that order; what would start past the deadline is skipped."""
    import torch

    from benchmarks.gpu_check.device import disable_tf32
    from benchmarks.gpu_check.phases import log
    from engine.model.quantization.blocks import QuantType

    disable_tf32()  # the float32 reference
    generator = torch.Generator(device=settings.device).manual_seed(settings.seed)
    record = {"tolerance": QUANT_FP16_REL_TOL, "activation_dtype": "float16", "cases": [], "skipped": []}
    for m in settings.quant_batches:
        for name in QUANT_FORMATS:
            qtype = QuantType[name]
            for k, n in settings.quant_kquant_shapes if qtype.super_block else settings.quant_shapes:
                if time.time() > deadline:
                    record["skipped"].append({"format": name, "k": k, "n": n, "m": m})
                    continue
                case = measure_case(settings, qtype, k, n, m, generator)
                record["cases"].append(case)
                log(describe_case(case))
    if record["skipped"]:
        log(f"quant: {len(record['skipped'])} cases skipped (phase deadline)")
    return record


def describe_case(case: dict) -> str:
    return (
        f"quant {case['format']} K={case['k']} N={case['n']} M={case['m']}: rel err {case['rel_error']:.1e}, "
        f"{case['ours_s'] * 1e6:.1f} us (torch fp16 {case['torch_fp16_s'] * 1e6:.1f} us, "
        f"{case['torch_fp16_s'] / case['ours_s']:.2f}x), weights {case['weight_bytes_per_s'] / 1e9:.1f} GB/s"
    )


def quant_rows(record: dict, hardware: dict | None) -> list:
    """Per format: one correctness row (judged), then per M the summed time over the shapes beside torch's."""
    from benchmarks.gpu_check.report import FAIL, PASS, Row  # here: report imports this module

    rows = []
    for name in QUANT_FORMATS:
        cases = [c for c in record["cases"] if c["format"] == name]
        if not cases:
            continue
        worst = max(c["rel_error"] for c in cases)
        rows.append(
            Row(
                f"quant_linear {name} fp16 vs dequantize ({len(cases)} cases)",
                f"max rel err {worst:.1e}",
                target=f"<= {record['tolerance']:g}",
                verdict=PASS if worst <= record["tolerance"] else FAIL,
            )
        )
        for m in sorted({c["m"] for c in cases}):
            rows.append(_timing_row(name, [c for c in cases if c["m"] == m], m, hardware))
    return rows


def _timing_row(name: str, cases: list[dict], m: int, hardware: dict | None):
    """Our summed seconds over ``cases`` beside torch fp16's (ratio: torch / ours); at M = 1 the bandwidth."""
    from benchmarks.gpu_check.report import Row

    ours_s = sum(c["ours_s"] for c in cases)
    torch_s = sum(c["torch_fp16_s"] for c in cases)
    measured = f"{ours_s * 1e6:.1f} us"
    if m == 1:
        bandwidth = sum(c["weight_bytes"] for c in cases) / ours_s
        measured += f", weights {bandwidth / 1e9:.1f} GB/s"
        if hardware:
            measured += f" ({bandwidth / hardware['copy_bytes_per_s']:.2f} of copy)"
    return Row(
        f"quant_linear {name} M={m}, {len(cases)} shapes summed",
        measured,
        f"torch fp16 {torch_s * 1e6:.1f} us",
        f"{torch_s / ours_s:.2f}",
    )
