"""Contiguous runs in a pairwise slot mapping (coalescing, issue 9).

A batch of writes maps local slot ``local[i]`` to remote slot ``remote[i]``. Where
consecutive local slots map to consecutive remote slots, the blocks form one *run*: one
address range on each side, copied as one piece. Runs never reach outside the slots named:
a run is only ever a stretch of the pairs given, so every block of it was bounds-checked.

Ordering the pairs by local slot (:func:`run_order`) makes a run the caller listed out of
order adjacent again; order within a batch does not matter, since a batch completes (or
fails) as a whole.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import TransportError

Slots = npt.NDArray[np.int64]


def slot_indices(slots: Sequence[int], num_blocks: int, side: str, op: str) -> Slots:
    """``slots`` as int64, refused with a :class:`TransportError` unless a flat sequence
    of integers in ``0..num_blocks - 1``: a float is never truncated to a slot, a string
    never parsed, a nested list never flattened. The one check of every data plane's
    slot lists (NIXL, the in-process transport, the staging lanes).

    A list or tuple (the producer's plan) is packed by struct: 3-4x faster than NumPy's
    conversion of a list, and strict (only what has ``__index__``).
    """
    array: npt.NDArray[np.integer[Any]]
    if type(slots) is list or type(slots) is tuple:
        try:
            array = np.frombuffer(struct.pack(f"{len(slots)}q", *slots), dtype=np.int64)
        except (struct.error, TypeError):
            raise TransportError(f"{side} slots must be integers", op=op) from None
    else:
        array = np.asarray(slots)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise TransportError(f"{side} slots must be a flat sequence of integers", op=op)
    # Bounded in the array's own type, before any cast could wrap a value into range.
    if array.size and (int(array.min()) < 0 or int(array.max()) >= num_blocks):
        raise TransportError(f"{side} slot out of range 0..{num_blocks - 1}", op=op)
    return array.astype(np.int64, copy=False)


def run_order(local: Slots, remote: Slots) -> tuple[Slots, Slots]:
    """The pairs ordered by local slot (unchanged if already ascending).

    Unstable sort: 3.5x faster than a stable one (4,096 slots: ~90 vs ~310 us here); the
    order of pairs with one local slot twice does not matter.
    """
    if local.size < 2 or bool(np.all(local[1:] > local[:-1])):
        return local, remote
    order = np.argsort(local)
    return local[order], remote[order]


def contiguous_runs(local: Slots, remote: Slots) -> tuple[Slots, Slots, Slots]:
    """Maximal runs of the pairs *as listed*: (local starts, remote starts, lengths)."""
    if not local.size:
        return local, remote, np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    lengths = np.diff(np.append(starts, local.size))
    return local[starts], remote[starts], lengths


def split_runs(
    local_starts: Slots, remote_starts: Slots, lengths: Slots, max_len: int
) -> tuple[Slots, Slots, Slots]:
    """The runs cut into pieces of at most ``max_len`` blocks: (local starts, remote
    starts, lengths). Every piece lies inside the run it came from."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    pieces = (lengths + max_len - 1) // max_len
    if not lengths.size or int(pieces.max()) == 1:
        return local_starts, remote_starts, lengths
    run = np.repeat(np.arange(lengths.size), pieces)
    first = np.cumsum(pieces) - pieces  # index of each run's first piece
    offset = (np.arange(run.size) - first[run]) * max_len
    sizes = np.minimum(lengths[run] - offset, max_len)
    return local_starts[run] + offset, remote_starts[run] + offset, sizes
