"""``extend_block_hashes`` (the prefix cache's and the KV-aware router's chained block hashes): its one-pass
hashing gives exactly the block-by-block values, whatever the prompt's split across calls."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from engine.sched.block_hash import ROOT_HASH, extend_block_hashes, get_hash_function, hash_block_tokens


def block_by_block(hash_fn, token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for index in range(len(token_ids) // block_size):
        extra_keys = (cache_salt,) if index == 0 and cache_salt is not None else ()
        parent = hash_block_tokens(
            hash_fn, parent, token_ids[index * block_size : (index + 1) * block_size], extra_keys
        )
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("algo", ["sha256", "blake2b"])
@pytest.mark.parametrize("cache_salt", [None, "tenant-1"])
def test_one_pass_equals_block_by_block_for_any_split(algo, cache_salt):
    hash_fn = get_hash_function(algo)
    rng = random.Random(7)
    tokens = [rng.randrange(0, 200_000) for _ in range(1000)]
    expected = block_by_block(hash_fn, tokens, 16, cache_salt)
    whole: list[bytes] = []
    extend_block_hashes(hash_fn, whole, tokens, 16, cache_salt)
    assert whole == expected and len(whole) == 62
    pieces: list[bytes] = []  # as a decoding request grows: a few tokens per call
    for end in range(0, len(tokens) + 1, 13):
        extend_block_hashes(hash_fn, pieces, tokens[:end], 16, cache_salt)
    extend_block_hashes(hash_fn, pieces, tokens, 16, cache_salt)
    assert pieces == expected


def test_the_encoding_is_native_int64s_after_the_parent():
    """The format a replica's and a router's hashes agree on (and a previous release's)."""
    tokens = [3, 70_000, 5, 1]
    expected = hashlib.sha256(ROOT_HASH + array("q", tokens).tobytes() + repr(("s",)).encode()).digest()
    hashes: list[bytes] = []
    extend_block_hashes(get_hash_function("sha256"), hashes, tokens + [9], 4, "s")
    assert hashes == [expected]
