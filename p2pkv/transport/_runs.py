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

import numpy as np
import numpy.typing as npt

Slots = npt.NDArray[np.int64]


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
