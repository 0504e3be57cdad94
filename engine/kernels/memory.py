"""Transparent huge pages for big, long-lived CPU tensors (the KV cache); freed heap pages given back.

Decode attention reads each request's blocks wherever the block pool put them; with 4 KiB pages
nearly every 16-token block is a TLB miss. Backing the cache with 2 MiB pages removes most of
those misses (benchmarks/bench_kernels.py). Linux only, where THP is ``madvise`` or
``always``; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

_MADV_HUGEPAGE = 14
_HUGE_PAGE_BYTES = 2 << 20


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back ``tensor``'s memory with huge pages; call before first touching it.

    Only the whole 2 MiB pages inside the tensor are advised. Returns whether the advice was taken.
    """
    libc = _libc()
    num_bytes = tensor.numel() * tensor.element_size()
    if libc is None or tensor.device.type != "cpu" or num_bytes < 2 * _HUGE_PAGE_BYTES:
        return False
    start = (tensor.data_ptr() + _HUGE_PAGE_BYTES - 1) & ~(_HUGE_PAGE_BYTES - 1)
    end = (tensor.data_ptr() + num_bytes) & ~(_HUGE_PAGE_BYTES - 1)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


def release_freed_memory() -> None:
    """Returns the heap's free pages to the OS (glibc's ``malloc_trim``, whatever its trim threshold).

    For the load: each weight read into a tensor and then copied (packed, onto huge pages) frees the tensor,
    and a heap that keeps what is freed (the worker's ``keep_freed_memory_in_heap``) would hold every one of
    them resident beside its copy.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
