"""Chained block hashes for prefix caching.

The hash of a full block covers the hash of the block before it, the block's
token ids and any extra keys (the cache salt on the first block), so equal
hashes mean equal prefixes, not only equal blocks. The default hash is
SHA-256: a collision would silently serve one request another's KV cache, so
a fast non-cryptographic hash is not an acceptable default.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

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


def hash_block_tokens(
    hash_fn: HashFunction, parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """The hash of one full block given its parent's hash."""
    # 'q' (int64) is a fixed-width, unambiguous encoding of the token ids.
    payload = parent_hash + array("q", token_ids).tobytes()
    if extra_keys:
        payload += repr(extra_keys).encode()
    return hash_fn(payload)


def extend_block_hashes(
    hash_fn: HashFunction,
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
) -> None:
    """Appends the hash of every full block of ``token_ids`` not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else ROOT_HASH
        start = block_index * block_size
        # The salt goes into the first block only; chaining carries it to every later block.
        extra_keys = (cache_salt,) if block_index == 0 and cache_salt is not None else ()
        block_hashes.append(hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size], extra_keys))
