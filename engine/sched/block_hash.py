"""Chained block hashes for prefix caching.

The hash of a full block covers the hash of the block before it, the block's
token ids and any extra keys (the cache salt and the LoRA adapter on the first
block), so equal hashes mean equal prefixes, not only equal blocks. The default hash is
SHA-256: a collision would silently serve one request another's KV cache, so
a fast non-cryptographic hash is not an acceptable default.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.lora_request import LoRARequest

BlockHash = bytes
HashFunction = Callable[[bytes], bytes]

# The "parent" of a sequence's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"serval/prefix-cache/root").digest()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


HASH_FUNCTIONS: dict[str, HashFunction] = {"sha256": _sha256, "blake2b": _blake2b}


def get_hash_function(name: str) -> HashFunction:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"Unknown prefix-caching hash {name!r}; choose one of {sorted(HASH_FUNCTIONS)}.") from None


_TOKEN_BYTES = struct.calcsize("@q")


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """The token ids as native int64s: a fixed-width, unambiguous encoding (struct packs a list faster than
    array does)."""
    return struct.pack(f"@{len(token_ids)}q", *token_ids)


def hash_block_tokens(
    hash_fn: HashFunction, parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """The hash of one full block given its parent's hash."""
    payload = parent_hash + _encode_tokens(token_ids)
    if extra_keys:
        payload += repr(extra_keys).encode()
    return hash_fn(payload)


def extend_block_hashes(
    hash_fn: HashFunction,
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    lora_key: tuple | None = None,
) -> None:
    """Appends the hash of every full block of ``token_ids`` not hashed yet (the prefix cache's and the
    KV-aware router's hashes): each block's is ``hash_block_tokens`` of its parent's, its tokens and, for the
    first block only, the salt.

    One pass: the unhashed tokens are encoded once and each block hashes a slice of that (encoding block by
    block, one call per block, is slower on a long prompt); decoding hashes only the blocks it filled.
    ``lora_key`` (multi-LoRA: ``lora_hash_key`` / ``LoRAHashKeys``; None: the base model) joins the first
    block's extra keys like the salt, so requests of different adapters never share a block (their KV differs).
    """
    num_full_blocks = len(token_ids) // block_size
    if len(block_hashes) >= num_full_blocks:
        return
    if not block_hashes and (cache_salt is not None or lora_key):
        # The salt goes into the first block only; chaining carries it to every later block.
        extra_keys = (cache_salt,) if not lora_key else (cache_salt, lora_key)
        block_hashes.append(hash_block_tokens(hash_fn, ROOT_HASH, token_ids[:block_size], extra_keys))
    start = len(block_hashes) * block_size
    encoded = _encode_tokens(token_ids[start : num_full_blocks * block_size])
    block_bytes = block_size * _TOKEN_BYTES
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for offset in range(0, len(encoded), block_bytes):
        parent = hash_fn(parent + encoded[offset : offset + block_bytes])
        block_hashes.append(parent)


def lora_hash_key(lora_name: str | None) -> tuple | None:
    """The first block's key for adapter ``lora_name`` (None: the base model): its name, as vLLM keys it, not
    its int id, which each replica assigns for itself; so every replica, and the KV-aware router, which knows
    only the name, hash one adapter's prompt alike."""
    return None if lora_name is None else ("lora", lora_name)


class LoRAHashKeys:
    """One engine's ``lora_key`` for each adapter: ``lora_hash_key`` of its name, except for a name that comes
    back from another path or with other contents (unloaded, then loaded again from elsewhere, or rewritten in
    place), which is keyed by its path and content digest too.

    A name alone would let the new adapter hit the old one's cached blocks, KV of other weights (vLLM's
    stale-reuse bug, vllm-project/vllm#42125). The first source a name is seen with keeps the bare name, so the
    router's predictions match in the usual case; a later one only costs the router's predicted hits for it.
    """

    def __init__(self) -> None:
        self._first_source: dict[str, tuple[str, str]] = {}  # name -> (path, content digest)

    def key(self, lora_request: LoRARequest | None) -> tuple | None:
        """The key for a request's adapter (None: the base model)."""
        if lora_request is None:
            return None
        name, source = lora_request.lora_name, (lora_request.lora_path, lora_request.content_digest)
        if self._first_source.setdefault(name, source) == source:
            return lora_hash_key(name)
        return ("lora", name, *source)
