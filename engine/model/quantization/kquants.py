"""GGUF's K-quants (Q4_K, Q5_K, Q6_K): super-blocks of 256 weights with per-sub-block 6-bit (Q6_K: int8) scales.

A row of K weights is K / 256 super-blocks back to back, exactly as ggml-common.h lays them out:

* Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m (8 each, packed as
  ``get_scale_min_k4`` reads them), 128 bytes qs. Sub-block s (32 weights) of the pair j = s // 2 reads
  qs[32 j + l], its low nibble for even s, its high one for odd s:   w = (d sc_s) q - (dmin m_s)
* Q5_K (176 bytes): Q4_K's d, dmin and scales, then 32 bytes qh, then qs: q = nibble + 16 * bit s of qh[l].
* Q6_K (210 bytes): ql 128, qh 64, int8 scales 16, fp16 d. The half n (128 weights) reads ql[64 n ..],
  qh[32 n ..]; its sub-block t of 32 (t = 0 .. 3) takes the low nibbles of ql[64 n + 32 (t % 2) + l] for t < 2,
  the high ones after, and bits 2 t, 2 t + 1 of qh[32 n + l] on top; weights l < 16 use scale 8 n + 2 t, the
  rest 8 n + 2 t + 1:   w = (d sc) (q - 32)

``dequantize`` computes each weight in float32 as gguf's numpy does (every product above is exact in float32;
Q4_K / Q5_K round once, at the subtraction), so it equals the ``gguf`` package's dequantization bit for bit.

The packed layout for the CPU kernels (``pack``; ``engine/kernels/csrc/kquant_blocks.h`` reads it) moves the
file's bytes, never changes them: rows in groups of 16, each group's super-block s the 16 rows' bytes of it,
field by field in ``Layout.fields`` order: an fp16 field as the 16 rows' 2 bytes, a byte field in 64-byte chunks
holding 4 bytes of each row (row r's at 4 r). Rows past the last whole group stay as the file has them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SUPER_BLOCK = 256  # weights per super-block
GROUP = 16  # weight rows interleaved (packed.GROUP)


@dataclass(frozen=True)
class Field:
    """``size`` bytes at ``offset`` of the file's super-block; ``half``: one fp16 (packed 2 bytes a row)."""

    offset: int
    size: int
    half: bool = False


@dataclass(frozen=True)
class Layout:
    block_bytes: int
    fields: tuple[Field, ...]  # in the packed layout's order: every byte of the super-block once


LAYOUTS = {
    "Q4_K": Layout(144, (Field(0, 2, True), Field(2, 2, True), Field(4, 12), Field(16, 128))),
    "Q5_K": Layout(176, (Field(0, 2, True), Field(2, 2, True), Field(4, 12), Field(16, 32), Field(48, 128))),
    "Q6_K": Layout(210, (Field(208, 2, True), Field(192, 16), Field(0, 128), Field(128, 64))),
}


def dequantize(raw: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [N, K / 256 * block_bytes] in the file's layout -> float32 [N, K] (module docstring); any device."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, LAYOUTS[name].block_bytes)
    w = _dequantize_q6_k(blocks) if name == "Q6_K" else _dequantize_q45_k(blocks, name == "Q5_K")
    return w.reshape(n, -1)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()  # [N, S, 1]


def scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes [..., 12] of Q4_K / Q5_K -> 6-bit scales and mins, each [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _dequantize_q45_k(blocks: torch.Tensor, five_bits: bool) -> torch.Tensor:
    sc, mins = scales_and_mins(blocks[..., 4:16])
    d = _fp16(blocks, 0) * sc.float()  # [N, S, 8]
    dm = _fp16(blocks, 2) * mins.float()
    qs = blocks[..., -128:].reshape(*blocks.shape[:2], 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device).view(2, 1)) & 0x0F).reshape(
        *blocks.shape[:2], 8, 32
    )
    if five_bits:
        qh = blocks[..., 16:48].reshape(*blocks.shape[:2], 1, 32)
        bits = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(8, 1)
        q = q | (((qh >> bits) & 1) << 4)
    return d.unsqueeze(-1) * q.float() - dm.unsqueeze(-1)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    s = blocks.shape[:2]
    d = _fp16(blocks, 208) * blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device).view(2, 1)
    ql = ((blocks[..., :128].reshape(*s, 2, 1, 64) >> shifts) & 0x0F).reshape(*s, 2, 4, 32)
    qh_shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(4, 1)
    qh = ((blocks[..., 128:192].reshape(*s, 2, 1, 32) >> qh_shifts) & 0x03).reshape(*s, 2, 4, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(*s, 16, 16)
    return d.unsqueeze(-1) * q.float()


@functools.cache
def _permutation(name: str) -> torch.Tensor:
    """int64 [16, block_bytes]: where byte j of row r's super-block lies in the group's packed super-block."""
    layout = LAYOUTS[name]
    where = torch.empty(GROUP, layout.block_bytes, dtype=torch.int64)
    at = 0
    for field in layout.fields:
        i = torch.arange(field.size)
        for r in range(GROUP):
            if field.half:
                where[r, field.offset + i] = at + 2 * r + i
            else:
                where[r, field.offset + i] = at + i // 4 * 4 * GROUP + 4 * r + i % 4
        at += GROUP * field.size
    return where


def _grouped(raw: torch.Tensor, name: str) -> tuple[int, int, int]:
    n, row_bytes = raw.shape
    return n // GROUP * GROUP, row_bytes // LAYOUTS[name].block_bytes, LAYOUTS[name].block_bytes


def pack(raw: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [N, row_bytes] in the file's layout -> the packed layout, the same shape (module docstring)."""
    whole, nsb, bb = _grouped(raw, name)
    source = torch.empty(GROUP * bb, dtype=torch.int64)
    source[_permutation(name).reshape(-1)] = torch.arange(GROUP * bb)  # packed byte <- its (row, byte)
    groups = raw[:whole].reshape(whole // GROUP, GROUP, nsb, bb).transpose(1, 2).reshape(-1, nsb, GROUP * bb)
    body = groups[..., source].reshape(whole, nsb * bb)
    return torch.cat([body, raw[whole:]]).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, name: str) -> torch.Tensor:
    """Rows ``ids`` (int64 [T]) of a packed weight, in the file's layout: uint8 [T, row_bytes]."""
    n = packed.shape[0]
    whole, nsb, bb = _grouped(packed, name)
    ids = ids.reshape(-1)
    if whole == 0:
        return packed[ids]
    in_group = ids < whole
    groups = packed[:whole].reshape(-1, nsb, GROUP * bb)[torch.where(in_group, ids, 0) // GROUP]  # [T, nsb, 16 bb]
    where = _permutation(name)[ids % GROUP].unsqueeze(1).expand(-1, nsb, -1)  # [T, nsb, bb]
    rows = groups.gather(2, where).reshape(ids.numel(), -1)
    tail = packed[torch.where(in_group, n - 1, ids)] if whole < n else rows
    return torch.where(in_group.unsqueeze(-1), rows, tail)


def random_rows(n: int, k: int, name: str, generator: torch.Generator, scale: float = 1e-3) -> torch.Tensor:
    """uint8 [n, K / 256 * block_bytes]: valid super-blocks of random bytes, their fp16 fields finite (about
    ``scale``, positive), for kernel tests and benchmarks (gguf cannot quantize the K-quants)."""
    layout = LAYOUTS[name]
    blocks = torch.randint(0, 256, (n, k // SUPER_BLOCK, layout.block_bytes), dtype=torch.uint8, generator=generator)
    for field in layout.fields:
        if field.half:
            value = (torch.rand(n, k // SUPER_BLOCK, 1, generator=generator) + 0.5) * scale
            blocks[..., field.offset : field.offset + 2] = value.half().view(torch.uint8)
    return blocks.reshape(n, -1)
