"""The CPU kernels' layout of GGUF blocks: 16 weight rows interleaved, the same bytes as the file's rows.

``pack`` turns a weight in the file's layout (``blocks.py``: uint8 [N, row_bytes]) into the layout
``engine/kernels/csrc/quant_blocks.h`` documents: per group of 16 rows and block, the 16 scales (and mins),
then the quants in 64-byte chunks holding 4 bytes of each row, so that one vector lane is one output row.
Q8_0's quants are stored offset by 128 (unsigned, as VNNI's ``vpdpbusd`` multiplies them), with -128
read as -127 (llama.cpp's quantizer never writes -128). Rows past the last whole group are kept as they are.
``unpack_rows`` reads rows back in the file's layout (embedding lookups on a tied, packed weight).
The K-quants' super-blocks (``qtype.super_block``) pack the same way, field by field (``kquants.pack``).
"""

from __future__ import annotations

import torch

from engine.model.quantization import kquants
from engine.model.quantization.blocks import QuantType

GROUP = 16  # weight rows interleaved


def _chunks(qtype: QuantType) -> int:
    return (qtype.block_bytes - qtype.header_bytes) // 4


def pack(raw: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """uint8 [N, row_bytes] in the file's layout -> the packed layout, same shape (module docstring)."""
    if qtype.super_block:
        return kquants.pack(raw, qtype.value)

    n, row_bytes = raw.shape
    whole, nb, h, c = n // GROUP * GROUP, row_bytes // qtype.block_bytes, qtype.header_bytes, _chunks(qtype)
    g = whole // GROUP
    groups = raw[:whole].reshape(g, GROUP, nb, qtype.block_bytes).transpose(1, 2)  # [G, nb, 16, bb]
    headers = groups[..., :h].reshape(g, nb, GROUP, h // 2, 2).permute(0, 1, 3, 2, 4)  # all d, then all m
    quants = groups[..., h:].reshape(g, nb, GROUP, c, 4).permute(0, 1, 3, 2, 4)  # [G, nb, chunk, row, 4]
    if qtype is QuantType.Q8_0:
        quants = (quants.contiguous().view(torch.int8).to(torch.int16).clamp(min=-127) + 128).to(torch.uint8)
    body = torch.cat([headers.reshape(g, nb, GROUP * h), quants.reshape(g, nb, GROUP * 4 * c)], dim=-1)
    return torch.cat([body.reshape(whole, row_bytes), raw[whole:]]).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Rows ``ids`` (int64 [T]) of a packed weight, in the file's layout: uint8 [T, row_bytes]."""
    if qtype.super_block:
        return kquants.unpack_rows(packed, ids, qtype.value)

    n, row_bytes = packed.shape
    whole, nb, h, c = n // GROUP * GROUP, row_bytes // qtype.block_bytes, qtype.header_bytes, _chunks(qtype)
    ids = ids.reshape(-1)
    if whole == 0:
        return packed[ids]
    in_group = ids < whole
    group_ids, lanes = torch.where(in_group, ids, 0) // GROUP, ids % GROUP
    groups = packed[:whole].reshape(-1, nb, GROUP * qtype.block_bytes)[group_ids]  # [T, nb, 16 * bb]
    pick = torch.arange(ids.numel())
    headers = groups[..., : GROUP * h].reshape(-1, nb, h // 2, GROUP, 2)[pick, :, :, lanes]  # [T, nb, h / 2, 2]
    quants = groups[..., GROUP * h :].reshape(-1, nb, c, GROUP, 4)[pick, :, :, lanes]  # [T, nb, chunk, 4]
    if qtype is QuantType.Q8_0:
        quants = (quants.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    rows = torch.cat([headers.reshape(-1, nb, h), quants.reshape(-1, nb, 4 * c)], dim=-1).reshape(-1, row_bytes)
    tail = packed[torch.where(in_group, n - 1, ids)] if whole < n else rows
    return torch.where(in_group.unsqueeze(-1), rows, tail)
