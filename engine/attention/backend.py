"""Attention backend interface and registry (``ATTENTION_BACKEND_IMPORT_PATHS``).

A backend owns the KV-cache layout and the paged attention computation. One
backend instance serves every layer; each layer passes its own cache tensor.

Contract of ``forward(kv_cache, q, k, v, attn_metadata, scale)``:

* ``q``: [num_tokens, num_heads, head_dim]; ``k``, ``v``: [num_tokens, num_kv_heads, head_dim]
  (rope already applied), tokens flattened as described in ``metadata.py``;
* first writes the new K/V of *all* tokens into ``kv_cache`` at
  ``attn_metadata.slot_mapping``, then computes causal attention of each
  request's new tokens over its whole cached sequence (so a request may read
  blocks another request of the same step just filled);
* returns [num_tokens, num_heads * head_dim] in ``q.dtype``;
* ``window`` (the layer's sliding window, None: full): the query at position p attends only keys at
  positions k with ``p - window < k <= p`` (transformers' ``sliding_window_causal_mask_function``), and
  reads nothing of the blocks wholly before them (a KV cache group may have freed them: the null block).

A backend whose ``accepts_written_kv`` is True also takes ``kv_is_written=True``:
the caller has already stored the new K/V at ``slot_mapping`` (e.g. fused with
rope, ``engine/kernels``), so the backend skips its own write.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels.memory import advise_huge_pages


class AttentionBackend(ABC):
    name: str = "abstract"
    accepts_written_kv: bool = False  # see the module docstring
    # Whether a decode-only step can be captured in a CUDA graph: no host syncs, no host planning
    # from the batch's values (only from its size and ``max_seq_len``), padded rows (slot -1, seq_len 0) ignored.
    supports_cuda_graphs: bool = False

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @abstractmethod
    def forward(
        self,
        kv_cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        kv_is_written: bool = False,
        window: int | None = None,
    ) -> torch.Tensor:
        """See the module docstring."""

    def allocate_kv_caches(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer (on CPU backed by huge pages where the OS allows)."""
        shape = self.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        caches = []
        for _ in range(num_layers):
            cache = torch.empty(shape, dtype=dtype, device=device)
            advise_huge_pages(cache)  # before the first touch; blocks are read scattered (TLB misses)
            caches.append(cache.zero_())
        return caches


# Backend name -> "module:class", imported on first use (Triton is slow to import and absent from CPU-only
# installs); the same style as EXECUTOR_IMPORT_PATHS and CORE_HOST_IMPORT_PATHS.
ATTENTION_BACKEND_IMPORT_PATHS = {
    "torch": "engine.attention.torch_paged:TorchPagedAttention",
    "triton": "engine.attention.triton_paged:TritonPagedAttention",
}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``"auto"`` becomes the device's backend: Triton kernels on CUDA, the torch reference elsewhere."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" else "torch"


def resolve_kv_cache_dtype(kv_cache_dtype: str, backend_name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: ``"auto"`` is the model's ``dtype``. Another is a 16-bit cache under a float32
    model, which the torch backend and the CPU kernels read (q stays float32, the rows widen exactly); any other
    pair is a ValueError."""
    cache = dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
    if cache != dtype and (backend_name != "torch" or dtype != torch.float32 or cache.itemsize != 2):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a float32 model and the torch attention backend "
            f"(here {dtype}, {backend_name}): a bfloat16 or float16 cache under float32 activations, or 'auto'"
        )
    return cache


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """A new backend instance by name (a key of ``ATTENTION_BACKEND_IMPORT_PATHS``); ``"torch"`` is the default."""
    if name not in ATTENTION_BACKEND_IMPORT_PATHS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKEND_IMPORT_PATHS)}")
    module_name, _, class_name = ATTENTION_BACKEND_IMPORT_PATHS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)()
