"""Paged attention: metadata, the backend interface and the plain-torch backend."""

from engine.attention.backend import AttentionBackend, get_attention_backend, register_backend, resolve_backend_name
from engine.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "build_attention_metadata",
    "get_attention_backend",
    "register_backend",
    "resolve_backend_name",
]
