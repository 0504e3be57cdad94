"""What the Triton kernels share: the options of their ``tl.dot`` calls."""

from __future__ import annotations

import os

import torch

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows (and columns)
# Key positions the attention kernels read per iteration, whatever the cache's block size: each
# position finds its block through the block table, so a tile spans several blocks (or a part of one).
KV_TILE = 64


def dot_options(dtype: torch.dtype) -> dict:
    """``PRECISION`` and ``UPCAST`` for the kernels' ``tl.dot``s.

    float32 inputs keep full precision (Triton would use TF32 by default). Triton's interpreter computes
    16-bit ``tl.dot`` wrongly (version 3.9: garbage), so interpreted kernels upcast to float32 first; on
    a GPU 16-bit inputs go to the tensor cores as they are.
    """
    upcast = is_interpreted() and dtype != torch.float32
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def is_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
