"""CPU tensors moved onto transparent huge pages (2 MiB): the weights every decode step streams whole.

A batch-1 step reads every weight once, so its speed is the memory's: on 4 KiB pages a 1B model's 700 MB are
180,000 pages a step, a TLB miss each. llama.cpp's weights, mapped from the file, sit in the page cache's large
folios; ours are copied into anonymous memory, which Linux gives huge pages only where asked
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most distributions). ``on_huge_pages(t)``
asks: a copy of ``t`` in an anonymous mapping of its own, advised ``MADV_HUGEPAGE`` before it is first touched,
so the copy's page faults take huge pages where the kernel has them free (``always`` gives them anyway;
``never``, another OS or a refused call: ``t`` as is). A mapping of its own, not ``torch.empty``: glibc serves
a large allocation from memory already touched once its mmap threshold has grown, and advice does not turn
pages already there into huge ones.

Only the mapping's whole huge pages inside the tensor are advised: a tensor costs no more resident memory than
its bytes.
"""

from __future__ import annotations

import functools
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _can_ask() -> bool:
    """Whether huge pages can be asked for here (Linux with THP not ``never``)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_MODE, encoding="ascii") as mode:
            return "[never]" not in mode.read()
    except OSError:
        return False


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a new contiguous CPU tensor on huge pages, or ``t`` itself where that cannot be (not
    on the CPU, smaller than two huge pages, no THP). The result is a view of a mapping up to 2 MiB longer,
    unmapped when the last tensor over it is freed."""
    nbytes = t.numel() * t.element_size()
    if not _can_ask() or t.device.type != "cpu" or nbytes < 2 * HUGE_PAGE:
        return t
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while a tensor views it
    offset = -buffer.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:
        return t
    out = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
