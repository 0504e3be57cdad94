"""The Triton attention backend (the GPU path, in progress): the torch backend with Triton kernels for
the KV-cache write and every decode of a step (``engine/kernels/triton_paged.py``).

Prefill chunks still go through the torch backend's SDPA path; a Triton prefill kernel and CUDA
graphs are the next parts of issue 8. On a CPU it runs through Triton's interpreter (tests only).
"""

from __future__ import annotations

import torch

from engine.attention.backend import register_backend
from engine.attention.torch_paged import TorchPagedAttention, _NativeDecode
from engine.kernels.triton_paged import paged_decode_attention, write_kv_cache


class TritonPagedAttention(TorchPagedAttention):
    name = "triton"

    def __init__(self) -> None:
        super().__init__(use_cpu_kernel=False)

    @staticmethod
    def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv_cache(kv_cache, k.to(kv_cache.dtype).contiguous(), v.to(kv_cache.dtype).contiguous(), slot_mapping)

    def _has_native_decode(self, device: torch.device) -> bool:
        return True  # the Triton decode kernel, on any device Triton runs on

    @staticmethod
    def _native_decode(kv_cache: torch.Tensor, q: torch.Tensor, native: _NativeDecode, scale: float,
                       out: torch.Tensor) -> None:
        out[native.tokens] = paged_decode_attention(q[native.tokens].contiguous(), kv_cache, native.block_tables,
                                                    native.seq_lens, scale)


register_backend("triton", TritonPagedAttention)
