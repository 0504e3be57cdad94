"""GGUF's block formats, as Serval keeps them in memory: a weight [N, K] is a uint8 tensor [N, row_bytes(K)].

Each row is K / 32 blocks back to back, exactly as llama.cpp's file stores them (ggml-common.h), so a
tensor-parallel shard of rows or of whole blocks is a plain ``narrow`` of the bytes:

* Q8_0 (34 bytes): fp16 scale d, then 32 int8 q;            w = d * q
* Q4_0 (18 bytes): fp16 d, then 16 bytes of 4-bit q;         w = d * (q - 8)
* Q4_1 (20 bytes): fp16 d, fp16 min m, then 16 bytes;        w = d * q + m
* Q5_0 (22 bytes): fp16 d, uint32 qh, then 16 bytes;         w = d * (q - 16)
* Q5_1 (24 bytes): fp16 d, fp16 m, uint32 qh, then 16 bytes; w = d * q + m

In the 4- and 5-bit formats byte j of the 16 holds element j's low 4 bits in its low nibble and element
j + 16's in its high one; the 5-bit formats' bit j of qh (little-endian) is element j's fifth (value 16).

The K-quants (Q4_K, Q5_K, Q6_K: ``kquants``) are super-blocks of 256 weights (``block_weights``), their layout
and dequantization in ``kquants``; ``super_block`` marks them.
``dequantize`` is the reference every kernel is checked against: each weight is computed in float32 as the
formula reads (one rounding per operation, no fused multiply-add), from the fp16 scales widened to float32.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from engine.model.quantization import kquants

BLOCK = 32  # weights per block, in every format but the K-quants' super-blocks (``block_weights``)


class QuantType(enum.Enum):
    """A block format; its value is the name GGUF (``GGMLQuantizationType``) gives it."""

    Q8_0 = "Q8_0"
    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q5_0 = "Q5_0"
    Q5_1 = "Q5_1"

    # K-quants: super-blocks of 256 (kquants.py)
    Q4_K = "Q4_K"
    Q5_K = "Q5_K"
    Q6_K = "Q6_K"

    @property
    def super_block(self) -> bool:
        """A K-quant: 256-weight super-blocks, laid out and dequantized by ``kquants``."""
        return self.value in kquants.LAYOUTS

    @property
    def block_weights(self) -> int:
        """Weights in one block of this format (a row is a whole number of them)."""
        return kquants.SUPER_BLOCK if self.super_block else BLOCK

    @property
    def block_bytes(self) -> int:
        if self.super_block:
            return kquants.LAYOUTS[self.value].block_bytes
        return {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[self.value]

    @property
    def has_min(self) -> bool:
        """Whether a block stores a min m after its scale d (w = d * q + m); the 32-weight formats only."""
        return self in (QuantType.Q4_1, QuantType.Q5_1)

    @property
    def scale_bytes(self) -> int:
        """Bytes of fp16 scale (and min) at a 32-weight block's start."""
        return 4 if self.has_min else 2

    @property
    def high_bits_bytes(self) -> int:
        """Bytes of the 5-bit formats' qh (the quants' fifth bits) after the scales; 0 in the others."""
        return 4 if self in (QuantType.Q5_0, QuantType.Q5_1) else 0

    @property
    def header_bytes(self) -> int:
        """Bytes before a block's (low) quants: the scales, then qh."""
        return self.scale_bytes + self.high_bits_bytes

    @property
    def kernel_id(self) -> int:
        """The number the native and Triton kernels know this format by."""
        if self.super_block:
            return {"Q4_K": 10, "Q5_K": 11, "Q6_K": 12}[self.value]
        return {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4}[self.value]

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` weights (``k`` a multiple of ``block_weights``)."""
        if k % self.block_weights:
            raise ValueError(f"{self.value} needs rows of a multiple of {self.block_weights} weights, got {k}")
        return k // self.block_weights * self.block_bytes

    def row_weights(self, row_bytes: int) -> int:
        """Weights in a row of ``row_bytes`` bytes."""
        return row_bytes // self.block_bytes * self.block_weights

    @classmethod
    def of_gguf(cls, gguf_type_name: str) -> QuantType | None:
        """The format of a GGUF tensor type kept quantized here; None for any other (it is dequantized)."""
        return cls.__members__.get(gguf_type_name)

    @classmethod
    def parse(cls, name: str) -> QuantType:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown block format {name!r}; known: {', '.join(cls.__members__)}") from None


def dequantize(raw: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, K] (module docstring); any device."""
    if qtype.super_block:
        return kquants.dequantize(raw, qtype.value)

    n = raw.shape[0]
    blocks = raw.reshape(n, -1, qtype.block_bytes)
    d = _fp16(blocks, 0)
    body = blocks[..., qtype.header_bytes :]
    if qtype is QuantType.Q8_0:
        return (d * body.view(torch.int8).float()).reshape(n, -1)
    q = torch.cat([body & 0x0F, body >> 4], dim=-1)
    if qtype.high_bits_bytes:
        qh = blocks[..., qtype.scale_bytes : qtype.header_bytes]  # bit j of the little-endian uint32: byte j // 8
        bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=raw.device)) & 1
        q = q | (bits.reshape(q.shape) << 4)
    q = q.float()
    if qtype.has_min:
        w = d * q + _fp16(blocks, 2)
    else:
        w = d * (q - (8.0 if qtype is QuantType.Q4_0 else 16.0))
    return w.reshape(n, -1)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 [N, blocks, 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def quantize(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """float [N, K] -> uint8 [N, row_bytes] with gguf's quantizer (bit-identical to llama.cpp's); CPU. The
    K-quants raise (gguf writes none: llama.cpp's ``llama-quantize`` does)."""
    if qtype.super_block:
        raise ValueError(f"{qtype.value} cannot be quantized here: use llama.cpp's llama-quantize")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    qtype.row_bytes(weight.shape[-1])  # checks K
    values = weight.detach().to(torch.float32).cpu().numpy()
    raw = gguf_quantize(np.ascontiguousarray(values), GGMLQuantizationType[qtype.value])
    return torch.from_numpy(np.ascontiguousarray(raw))
