"""Store lock: how long the host thread's ``get`` + ``put`` waits while the engine pins.

Reproduce (about 15 s on 2 cores; ``--help`` for the knobs)::

    .venv/bin/python bench/store_lock.py

Target (issue 7 item 8): a host-thread store call never waits more than ~1 ms on the
engine; before the fix a 65,536-key ``pin`` held the shared lock for 9-62 ms and a host
``get`` + ``put`` waited 62-155 ms.

What runs, in this one process: an engine thread pins ``--keys`` keys for one owner and
unpins them, again and again (the worst an engine can do to the host: a maximal lookup
round, back to back). The host thread (the main thread) sleeps ``--host-gap-us`` (a
scheduler doing other work; 0 spins instead), then does one ``get`` of a pinned key and
one ``put`` of a fresh block (its own ring of keys), timed together with
``time.perf_counter_ns``. Each ``--batch`` value is one store setting (``inf``: every
engine call under one lock acquisition, as before the fix); the settings take turns in
``--rounds`` rounds of ``--seconds`` each, so they share the machine's load alike, and the
report gives each one's p50 / p99 / max wait and the engine's pin + unpin rate.

The clock starts once the host thread holds the GIL, so what is timed is waiting for the
store (its lock, and the engine thread finishing a batch), not waiting for the GIL to come
back after the sleep: a busy engine thread keeps the GIL up to one switch interval (5 ms
by default) from any other thread, whatever the store does.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from p2pkv.store import BATCH_KEYS, BlockStore

NS_PER_US = 1000


def key(tag: bytes, i: int) -> bytes:
    return tag + i.to_bytes(8, "little") + bytes(24 - len(tag))


class Setting:
    """One store (one batch size, or no engine at all) with its engine keys in place."""

    def __init__(self, batch: int | None, keys: int, ring: int, block_len: int) -> None:
        self.idle = batch == 0
        names = {None: "inf (one lock per call)", 0: "no engine (noise floor)"}
        self.name = names.get(batch, f"{batch}")
        self.store = BlockStore(keys + ring + 8, block_len, batch_keys=batch or sys.maxsize)
        self.keys = [key(b"e", i) for i in range(keys)]
        slots = self.store.reserve("fill", keys)
        self.store.commit_many("fill", slots, self.keys)
        self.waits_ns: list[int] = []
        self.cycles = 0
        self.engine_s = 0.0


def engine(setting: Setting, stop: threading.Event) -> None:
    store, keys = setting.store, setting.keys
    if setting.idle:
        stop.wait()
        return
    t0 = time.perf_counter()
    while not stop.is_set():
        store.pin("lookup", keys)
        store.unpin("lookup")
        setting.cycles += 1
    setting.engine_s += time.perf_counter() - t0


def host(setting: Setting, seconds: float, gap_s: float, ring: int, block: bytes) -> None:
    store = setting.store
    hot = setting.keys[len(setting.keys) // 2]
    ring_keys = [key(b"h", i) for i in range(ring)]
    waits = setting.waits_ns
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter_ns()
        store.get(hot)
        store.put(ring_keys[i % ring], block)
        waits.append(time.perf_counter_ns() - t0)
        i += 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=65_536, help="keys per engine pin")
    p.add_argument(
        "--batch",
        default=f"0,inf,{BATCH_KEYS}",
        help="comma-separated batch sizes to compare; inf: one batch per call (the old store);"
        f" 0: no engine thread, the machine's noise floor (default 0,inf,{BATCH_KEYS})",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=1.0, help="per setting per round")
    p.add_argument("--host-gap-us", type=float, default=500.0, help="host sleep between ops")
    p.add_argument("--block-len", type=int, default=4096)
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval")
    args = p.parse_args(argv)

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    ring = 256
    batches = [None if b.strip() == "inf" else int(b) for b in args.batch.split(",")]
    settings = [Setting(b, args.keys, ring, args.block_len) for b in batches]
    block = bytes(range(256)) * (args.block_len // 256) + bytes(args.block_len % 256)

    print(
        f"store_lock: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f}, Python {sys.version.split()[0]}, "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms"
    )
    print(
        f"engine: pin + unpin of {args.keys:,} keys, back to back; host: get + put every "
        f"{args.host_gap_us:g} us; {args.rounds} rounds x {args.seconds:g} s per setting"
    )
    for _ in range(args.rounds):
        for s in settings:
            stop = threading.Event()
            t = threading.Thread(target=engine, args=(s, stop), name="engine")
            t.start()
            try:
                host(s, args.seconds, args.host_gap_us / 1e6, ring, block)
            finally:
                stop.set()
                t.join()

    print(
        f"{'batch_keys':>24} {'ops':>7} {'p50 us':>8} {'p99 us':>8} {'max us':>8} "
        f"{'> 1 ms':>7} {'engine keys/s':>14}"
    )
    for s in settings:
        w = np.array(s.waits_ns) / NS_PER_US
        over = float(np.mean(w > 1000)) * 100
        rate = f"{s.cycles * args.keys / s.engine_s:,.0f}" if s.engine_s else "-"
        print(
            f"{s.name:>24} {len(w):>7} {np.percentile(w, 50):>8.0f} "
            f"{np.percentile(w, 99):>8.0f} {w.max():>8.0f} {over:>6.2f}% {rate:>14}"
        )
        s.store._check_invariants()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
