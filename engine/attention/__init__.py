"""Paged attention: the backend interface, a step's metadata, and the backends.

- ``backend``: the ``AttentionBackend`` interface and ``ATTENTION_BACKEND_IMPORT_PATHS`` (the backends by name).
- ``metadata``: ``AttentionMetadata``, one step's flattened-batch layout shared by every layer; ``PAD_SLOT_ID``.
- ``torch_paged``: paged attention in plain torch, any device (the CPU backend; decodes on the native kernel).
- ``triton_paged``: the Triton backend (CUDA): decode-only steps on the split-K kernel, others on the mixed one.
"""

from engine.attention.backend import (
    ATTENTION_BACKEND_IMPORT_PATHS,
    AttentionBackend,
    get_attention_backend,
    resolve_backend_name,
)
from engine.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = [
    "ATTENTION_BACKEND_IMPORT_PATHS",
    "AttentionBackend",
    "AttentionMetadata",
    "build_attention_metadata",
    "get_attention_backend",
    "resolve_backend_name",
]
