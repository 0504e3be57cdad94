"""Paged attention.

Modules: ``metadata`` (a step's ``AttentionMetadata``), ``backend`` (the ``AttentionBackend`` interface and
``ATTENTION_BACKEND_IMPORT_PATHS``, the backends by name), ``torch_paged`` (plain torch, any device; the CPU
backend), ``triton_paged`` (Triton kernels, CUDA).
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
