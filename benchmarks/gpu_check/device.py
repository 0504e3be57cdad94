"""The device the phases run on, its timers, and the two ceilings (copy bandwidth, matmul FLOP/s).

On CUDA, microbenchmarks are timed with CUDA events after warm-up; on a CPU (smoke run) with
``time.perf_counter``. Whole ``generate`` calls are timed with ``perf_counter`` on both (their
outputs are on the host, so the device has finished when they return).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def disable_tf32() -> dict:
    """float32 matmuls and convolutions in full precision (torch would otherwise allow TF32 in cuDNN)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return tf32_flags()


def tf32_flags() -> dict:
    return {
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def time_repeated_s(fn: Callable[[], object], device: str, warmup: int, reps: int) -> float:
    """Mean seconds of one ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if is_cuda(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    begin = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - begin) / reps


def copy_bandwidth(device: str, nbytes: int, warmup: int, reps: int) -> dict:
    """Copy ``nbytes`` to another buffer on ``device``: bandwidth = (bytes read + bytes written) / time."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = time_repeated_s(lambda: dst.copy_(src), device, warmup, reps)
    return {"copy_bytes": nbytes, "copy_s": copy_s, "copy_bytes_per_s": 2 * nbytes / copy_s}


def matmul_throughput(device: str, n: int, warmup: int, reps: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """An n x n x n matmul on random data: FLOP/s = 2 n^3 / time."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    matmul_s = time_repeated_s(lambda: torch.matmul(a, b), device, warmup, reps)
    return {
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_s": matmul_s,
        "matmul_flops_per_s": 2 * n**3 / matmul_s,
    }


def describe(device: str) -> dict:
    """Device name and library versions, for the record."""
    import triton

    info = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            total_memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
    else:
        import platform

        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info
