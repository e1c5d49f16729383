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

Sizes below 256 keys are what a lookup of a few keys asks (the control plane's common
case): there each rep calls every op ``CALLS_PER_REP // n`` times, stores put back between
calls untimed, and takes the median call. ``unpin_keys`` (dropping the pins of
some keys) and ``release_reserved`` (a fetch that landed nothing) are timed too, apart
from the cycle.

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
from functools import partial
from itertools import islice
from types import ModuleType
from typing import Any

import numpy as np

from p2pkv import store as new_store_module

SIZES = (1, 4, 16, 256, 4096, 16384)
CYCLE = ("pin", "unpin", "present", "reserve", "commit_many")
OPS = (*CYCLE, "reserve_evict", "unpin_keys", "release_reserved")
FILLED = 1024  # keys the producer's store holds at least
CALLS_PER_REP = 2048  # keys' worth of calls one rep makes of each op at small sizes
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
    """Seconds the call took: (wall clock, this thread's CPU). The wall clock's readings
    are the inner pair: reading the thread's CPU time is a system call (~0.3 us), which
    would otherwise count in a few-microsecond call's figure."""
    c0 = time.thread_time()
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    return t1 - t0, time.thread_time() - c0


def one_rep(module: ModuleType, n: int) -> dict[str, tuple[float, float]]:
    """Seconds per op for one rep of every op at n keys (the GC off throughout)."""
    gc.collect()
    gc.disable()
    try:
        return ops(module, n)
    finally:
        gc.enable()


def ops(module: ModuleType, n: int) -> dict[str, tuple[float, float]]:
    """Each op's median call at n keys. Below 256 keys one call is a few microseconds, so
    each op is called ``CALLS_PER_REP // n`` times (the stores put back as they were
    between calls, untimed) and the median call is the rep's figure."""
    cls = module.BlockStore
    blocks = max(16_384, 2 * n)
    calls = max(1, CALLS_PER_REP // n) if n < 256 else 1
    keys = keys_of(max(n, FILLED))
    src = cls(blocks, BLOCK)
    src.commit_many("fill", src.reserve("fill", len(keys)), keys)
    keys = keys[:n]
    dst = cls(blocks, BLOCK)
    full = cls(max(n, FILLED), BLOCK)
    fresh = iter(keys_of(full.num_blocks + (calls + 1) * n, b"full"))
    full.commit_many(
        "fill", full.reserve("fill", full.num_blocks), list(islice(fresh, full.num_blocks))
    )
    times: dict[str, list[tuple[float, float]]] = {op: [] for op in OPS}
    got: list[int] = []
    for _ in range(calls):
        times["pin"].append(timed(lambda: src.pin("o", keys)))
        times["unpin"].append(timed(lambda: src.unpin("o")))
        times["present"].append(timed(lambda: dst.present(keys)))
        times["reserve"].append(timed(lambda: got.extend(dst.reserve("f", n))))
        times["commit_many"].append(timed(lambda: dst.commit_many("f", got, keys)))
        got.clear()
        for key in keys:  # the consumer's store empty again
            dst.evict(key)
        times["reserve_evict"].append(timed(lambda: got.extend(full.reserve("f", n))))
        full.commit_many("f", got, list(islice(fresh, n)))  # full again
        got.clear()
        pinned = src.pin("o", keys)
        times["unpin_keys"].append(timed(partial(src.unpin_keys, "o", pinned)))
        got.extend(dst.reserve("f", n))
        times["release_reserved"].append(timed(lambda: dst.release_reserved("f", got)))
        got.clear()
    return {
        op: (statistics.median(w for w, _ in per), statistics.median(c for _, c in per))
        for op, per in times.items()
    }


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
