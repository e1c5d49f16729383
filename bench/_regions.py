"""Memory the benchmarks hand to nodes and to the bare-NIXL baseline alike."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def touched_region(nbytes: int) -> npt.NDArray[np.uint8]:
    """Page-aligned like the store's own region, and touched: the copy speed of the kernel
    (cma) depends on the source and destination page offsets (up to 3x here), and page
    faults on fresh memory are not what we measure."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    offset = -raw.ctypes.data % 4096
    region = raw[offset : offset + nbytes]
    region.fill(1)
    return region
