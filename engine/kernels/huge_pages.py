"""CPU tensors moved onto transparent huge pages (2 MiB): the weights every decode step streams whole.

A batch-1 step reads every weight once, so its speed is the memory's: on 4 KiB pages a 1B model's 700 MB are
180,000 pages a step, a TLB miss each. llama.cpp's weights, mapped from the file, sit in the page cache's large
folios; ours are copied into anonymous memory, which Linux gives huge pages only where asked
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most distributions). ``on_huge_pages(t)``
asks: a copy of ``t`` in a buffer advised ``MADV_HUGEPAGE`` before it is first touched, so the copy's page
faults take huge pages (``always`` gives them anyway; ``never``, another OS or a failed call: ``t`` as is).

Only the buffer's whole huge pages are advised, none past the tensor's last byte: a tensor costs no more
resident memory than its bytes.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where huge pages cannot be asked for."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(_THP_MODE, encoding="ascii") as mode:
            if "[never]" in mode.read():
                return None
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a new contiguous CPU tensor on huge pages, or ``t`` itself where that cannot be (not
    on the CPU, smaller than one huge page, no THP). The result is a view of a buffer up to 2 MiB longer."""
    madvise = _madvise()
    nbytes = t.numel() * t.element_size()
    if madvise is None or t.device.type != "cpu" or nbytes < 2 * HUGE_PAGE:
        return t
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # not touched: large blocks are fresh mmaps
    offset = -buffer.data_ptr() % HUGE_PAGE
    length = nbytes // HUGE_PAGE * HUGE_PAGE  # the tensor's whole huge pages, from its aligned start
    if madvise(buffer.data_ptr() + offset, length, _MADV_HUGEPAGE) != 0:
        return t
    out = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
