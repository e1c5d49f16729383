"""Per-key cost of the BlockStore's engine-side operations, and what a big store costs (issue 9).

Reproduce (about a minute on 2 cores)::

    PYTHONPATH=. .venv/bin/python bench/store_ops.py
    PYTHONPATH=. .venv/bin/python bench/store_ops.py --baseline /tmp/old_store.py  # old code too

One cycle is what one 4,096-block lookup + fetch asks of the two stores: the producer pins
the keys and later unpins them; the consumer asks which keys it has (``present``),
reserves slots, and commits the landed blocks (``commit_many``). Each op is timed alone,
in one process, one after the other as in a cycle, with the GC off (p2pkv leaves the
collector to the host; a collection in the middle of one op would swamp its figure). Keys
are 32-byte hashes, the stores hold 64-byte blocks (nothing copies blocks, so their size
does not matter). The producer's store holds the keys; the consumer's is empty, so
``reserve`` takes free slots; ``reserve_evict`` is the same call on a full store, where
every slot comes from evicting.

Each figure is ns per key: the median of ``--reps`` reps with its min-max, by the wall
clock and by the calling thread's CPU time (``time.thread_time``; the GIL offers inside a
long call, ``time.sleep(0)`` every 0.5 ms, count in the first but not in the second). With
``--baseline FILE`` (a ``store.py`` of another commit, e.g. ``git show 04a7d30:p2pkv/store.py``)
the old store is timed in the same run, op by op, alternating with the new one.

``scale`` opens a 262,144-block store: the time ``BlockStore(...)`` takes (the region is
allocated beforehand and handed in) and the Python heap it costs per block (tracemalloc,
which also counts NumPy's buffers), empty and once every slot holds a key (the keys' own
bytes objects are not counted: the caller owns them). Target (issue 9): open <= 0.5 s,
<= 100 B per block; the engine-side ops together <= 1 us per key.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from p2pkv import store as new_store_module

SIZES = (256, 4096, 16384)
CYCLE = ("pin", "unpin", "present", "reserve", "commit_many")
OPS = (*CYCLE, "reserve_evict")
BLOCK = 64
SCALE_BLOCKS = 262_144


def load_store(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_store", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_store"] = module
    spec.loader.exec_module(module)
    return module


def keys_of(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(8, "little")).digest() for i in range(n)]


def timed(call: Callable[[], Any]) -> tuple[float, float]:
    """Seconds the call took: (wall clock, this thread's CPU)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    call()
    return time.perf_counter() - t0, time.thread_time() - c0


def one_rep(module: ModuleType, n: int) -> dict[str, tuple[float, float]]:
    """Seconds per op for one rep of every op at n keys (the GC off throughout)."""
    gc.collect()
    gc.disable()
    try:
        return ops(module, n)
    finally:
        gc.enable()


def ops(module: ModuleType, n: int) -> dict[str, tuple[float, float]]:
    cls = module.BlockStore
    blocks = max(16_384, 2 * n)
    keys = keys_of(n)
    src = cls(blocks, BLOCK)
    slots = src.reserve("fill", n)
    src.commit_many("fill", slots, keys)
    dst = cls(blocks, BLOCK)
    out: dict[str, tuple[float, float]] = {}
    out["pin"] = timed(lambda: src.pin("o", keys))
    out["unpin"] = timed(lambda: src.unpin("o"))
    out["present"] = timed(lambda: dst.present(keys))
    got: list[int] = []
    out["reserve"] = timed(lambda: got.extend(dst.reserve("f", n)))
    out["commit_many"] = timed(lambda: dst.commit_many("f", got, keys))
    full = cls(n, BLOCK)
    fslots = full.reserve("fill", n)
    full.commit_many("fill", fslots, keys_of(n, b"full"))
    out["reserve_evict"] = timed(lambda: full.reserve("f", n))
    return out


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def scale(module: ModuleType) -> dict[str, float]:
    cls = module.BlockStore
    region = np.zeros(SCALE_BLOCKS * BLOCK, dtype=np.uint8)
    opens = []
    for _ in range(3):
        gc.collect()
        t0 = time.perf_counter()
        store = cls(SCALE_BLOCKS, BLOCK, region)
        opens.append(time.perf_counter() - t0)
        del store
    keys = keys_of(SCALE_BLOCKS, b"scale")
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store = cls(SCALE_BLOCKS, BLOCK, region)
    empty = tracemalloc.get_traced_memory()[0] - base
    slots = store.reserve("fill", SCALE_BLOCKS)
    store.commit_many("fill", slots, keys)
    del slots
    gc.collect()
    full = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del store
    return {
        "open_s": min(opens),
        "bytes_per_block_empty": empty / SCALE_BLOCKS,
        "bytes_per_block_full": full / SCALE_BLOCKS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--baseline", help="a store.py to time alongside p2pkv.store")
    parser.add_argument("--json", help="write every rep's raw numbers here")
    args = parser.parse_args()
    if args.reps < 5:
        parser.error("--reps must be >= 5 (a median with its spread)")
    stores = {"new": new_store_module}
    if args.baseline:
        stores["old"] = load_store(args.baseline)
    print(f"cores {os.cpu_count()}, load average {loadavg()}")
    print(
        f"stores: new = {new_store_module.__file__}"
        + f", old = {args.baseline}" * bool(args.baseline)
    )
    raw: dict[str, Any] = {"cores": os.cpu_count(), "loadavg_start": os.getloadavg(), "ops": {}}
    for n in args.sizes:
        reps: dict[str, list[dict[str, tuple[float, float]]]] = {name: [] for name in stores}
        for rep in range(args.reps):
            order = list(stores) if rep % 2 == 0 else list(reversed(stores))
            for name in order:
                reps[name].append(one_rep(stores[name], n))
        for clock, which in (("wall clock", 0), ("thread CPU", 1)):
            print(f"\n{n} keys, {clock}: ns per key, median [min-max] of {args.reps} reps")
            print(f"{'op':>14}" + "".join(f"{name:>24}" for name in stores))
            for op in (*OPS, "cycle"):
                row = f"{op:>14}"
                for name in stores:
                    per_rep = [
                        (sum(r[o][which] for o in CYCLE) if op == "cycle" else r[op][which])
                        * 1e9
                        / n
                        for r in reps[name]
                    ]
                    s = spread(per_rep)
                    entry = raw["ops"].setdefault(name, {}).setdefault(clock, {})
                    entry.setdefault(str(n), {})[op] = {**s, "reps": per_rep}
                    row += f"{s['median']:>10.0f} [{s['min']:.0f}-{s['max']:.0f}]".rjust(24)
                print(row)
    print(f"\nscale: a {SCALE_BLOCKS:,}-block store (targets: open <= 0.5 s, <= 100 B/block)")
    raw["scale"] = {}
    for name, module in stores.items():
        s = scale(module)
        raw["scale"][name] = s
        print(
            f"{name:>5}: open {s['open_s'] * 1e3:.1f} ms, Python heap "
            f"{s['bytes_per_block_empty']:.1f} B/block empty, "
            f"{s['bytes_per_block_full']:.1f} B/block full (keys' own bytes not counted)"
        )
    raw["loadavg_end"] = os.getloadavg()
    print(f"\nload average {loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
