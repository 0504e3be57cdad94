"""The CPU kernels' layout of GGUF blocks: 16 weight rows interleaved, the same bytes as the file's rows.

``pack`` turns a weight in the file's layout (``blocks.py``: uint8 [N, row_bytes]) into the layout
``engine/kernels/csrc/quant_blocks.h`` documents: per group of 16 rows and block, the 16 scales (and mins),
for Q5_0 / Q5_1 then the 16 rows' qh words (4 bytes a row, their bits reordered: ``HIGH_BIT_POSITION``), then
the quants in 64-byte chunks holding 4 bytes of each row, so that one vector lane is one output row.
Q8_0's quants are stored offset by 128 (unsigned, as VNNI's ``vpdpbusd`` multiplies them), with -128
read as -127 (llama.cpp's quantizer never writes -128). Rows past the last whole group are kept as they are.
``unpack_rows`` reads rows back in the file's layout (embedding lookups on a tied, packed weight).
The K-quants' super-blocks (``qtype.super_block``) pack the same way, field by field (``kquants.pack``).
"""

from __future__ import annotations

import torch

from engine.model.quantization import kquants
from engine.model.quantization.blocks import BLOCK, QuantType

GROUP = 16  # weight rows interleaved


def _high_bit_position(j: int) -> int:
    """Where the packed qh word keeps the fifth bit of weight j (file bit j): weight 16 h + 4 c + i, the
    low nibble (h = 0) or high nibble (h = 1) of byte i of quant chunk c, lands in byte i at bit 4 h + c.
    So a lane's word shifted by 4 - c (h = 0) or -c (h = 1) puts chunk c's four fifth bits at bit 4 of the
    bytes that hold their nibbles: two vector ops, and the nibble plus it is the 5-bit quant."""
    h, c, i = j // 16, j % 16 // 4, j % 4
    return 8 * i + 4 * h + c


HIGH_BIT_POSITION = [_high_bit_position(j) for j in range(BLOCK)]
_FILE_BIT = [HIGH_BIT_POSITION.index(p) for p in range(BLOCK)]  # the inverse


def _chunks(qtype: QuantType) -> int:
    return (qtype.block_bytes - qtype.header_bytes) // 4


def _bits(words: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] little-endian uint32 -> its 32 bits [..., 32], bit j at j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).reshape(*words.shape[:-1], BLOCK)


def _words(bits: torch.Tensor) -> torch.Tensor:
    """``_bits``' inverse."""
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=bits.device)
    return (bits.reshape(*bits.shape[:-1], 4, 8) * weights).sum(-1, dtype=torch.uint8)


def _reorder(words: torch.Tensor, order: list[int]) -> torch.Tensor:
    """qh words [..., 4] with bit p of the result taken from bit ``order[p]``."""
    return _words(_bits(words)[..., torch.tensor(order, device=words.device)])


def pack(raw: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """uint8 [N, row_bytes] in the file's layout -> the packed layout, same shape (module docstring)."""
    if qtype.super_block:
        return kquants.pack(raw, qtype.value)

    n, row_bytes = raw.shape
    whole, nb, c = n // GROUP * GROUP, row_bytes // qtype.block_bytes, _chunks(qtype)
    s, h, g = qtype.scale_bytes, qtype.header_bytes, whole // GROUP
    groups = raw[:whole].reshape(g, GROUP, nb, qtype.block_bytes).transpose(1, 2)  # [G, nb, 16, bb]
    scales = groups[..., :s].reshape(g, nb, GROUP, s // 2, 2).permute(0, 1, 3, 2, 4)  # all d, then all m
    high = _reorder(groups[..., s:h], _FILE_BIT) if h > s else groups[..., s:h]  # [G, nb, 16, 4 or 0]
    quants = groups[..., h:].reshape(g, nb, GROUP, c, 4).permute(0, 1, 3, 2, 4)  # [G, nb, chunk, row, 4]
    if qtype is QuantType.Q8_0:
        quants = (quants.contiguous().view(torch.int8).to(torch.int16).clamp(min=-127) + 128).to(torch.uint8)
    parts = [
        scales.reshape(g, nb, GROUP * s),
        high.reshape(g, nb, GROUP * (h - s)),
        quants.reshape(g, nb, GROUP * 4 * c),
    ]
    body = torch.cat(parts, dim=-1)
    return torch.cat([body.reshape(whole, row_bytes), raw[whole:]]).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Rows ``ids`` (int64 [T]) of a packed weight, in the file's layout: uint8 [T, row_bytes]."""
    if qtype.super_block:
        return kquants.unpack_rows(packed, ids, qtype.value)

    n, row_bytes = packed.shape
    whole, nb, c = n // GROUP * GROUP, row_bytes // qtype.block_bytes, _chunks(qtype)
    s, h = qtype.scale_bytes, qtype.header_bytes
    ids = ids.reshape(-1)
    if whole == 0:
        return packed[ids]
    in_group = ids < whole
    group_ids, lanes = torch.where(in_group, ids, 0) // GROUP, ids % GROUP
    groups = packed[:whole].reshape(-1, nb, GROUP * qtype.block_bytes)[group_ids]  # [T, nb, 16 * bb]
    pick = torch.arange(ids.numel())
    scales = groups[..., : GROUP * s].reshape(-1, nb, s // 2, GROUP, 2)[pick, :, :, lanes]  # [T, nb, s / 2, 2]
    high = groups[..., GROUP * s : GROUP * h]  # [T, nb, 16 * 4 or 0]
    if h > s:
        high = _reorder(high.reshape(-1, nb, GROUP, h - s)[pick, :, lanes], HIGH_BIT_POSITION)  # [T, nb, 4]
    quants = groups[..., GROUP * h :].reshape(-1, nb, c, GROUP, 4)[pick, :, :, lanes]  # [T, nb, chunk, 4]
    if qtype is QuantType.Q8_0:
        quants = (quants.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    parts = [scales.reshape(-1, nb, s), high, quants.reshape(-1, nb, 4 * c)]
    rows = torch.cat(parts, dim=-1).reshape(-1, row_bytes)
    tail = packed[torch.where(in_group, n - 1, ids)] if whole < n else rows
    return torch.where(in_group.unsqueeze(-1), rows, tail)
