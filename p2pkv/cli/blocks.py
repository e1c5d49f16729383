"""The demo's blocks: deterministic contents that a consumer can verify on its own.

Block contents are derived from the key, so a consumer needs nothing but the seed to know
the bytes it should get: ``key_i = sha256(seed, i)`` and block = a pseudo-random base block
(fixed per seed and block length) XOR the key's first 8 bytes, repeated. Cheap (one pass
over memory), and every word of a block depends on both its position and its key, so a
missing, stale, shifted or swapped block never verifies.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..store import BlockStore


def demo_keys(n: int, seed: int = 0) -> list[bytes]:
    """The ``n`` demo keys for ``seed``: ``sha256(seed || i)``, 32 bytes each."""
    prefix = seed.to_bytes(8, "little", signed=True)
    return [hashlib.sha256(prefix + i.to_bytes(8, "little")).digest() for i in range(n)]


@functools.lru_cache(maxsize=8)
def _base_block(block_len: int, seed: int) -> npt.NDArray[np.uint64]:
    words = -(-block_len // 8)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, block_len])
    base = np.frombuffer(rng.bytes(words * 8), dtype=np.uint64)
    base.flags.writeable = False
    return base


def demo_block(key: bytes, block_len: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """The bytes of ``key``'s demo block (a new array)."""
    word = np.uint64(int.from_bytes(key[:8], "little"))
    return np.bitwise_xor(_base_block(block_len, seed), word).view(np.uint8)[:block_len]


def fill_store(store: BlockStore, keys: Sequence[bytes], seed: int = 0) -> None:
    for key in keys:
        store.put(key, demo_block(key, store.block_len, seed))


def verify_blocks(store: BlockStore, keys: Sequence[bytes], seed: int = 0) -> list[bytes]:
    """Keys whose block is missing from ``store`` or differs from the demo bytes in any byte."""
    bad: list[bytes] = []
    for key in keys:
        view = store.get(key)
        got = None if view is None else np.frombuffer(view, dtype=np.uint8)
        if got is None or not np.array_equal(got, demo_block(key, store.block_len, seed)):
            bad.append(key)
    return bad
