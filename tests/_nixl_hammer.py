"""Hammer one shared NIXL agent from several threads; exit 0 unless something broke.

Run in a subprocess by ``test_nixl_transport.py`` (a segfault must fail one test, not kill
the test run): ``python _nixl_hammer.py SECONDS [EARLY]``. Threads, all on the agent of
transport A (and of A2, a second transport over A's region, as a reconfiguration builds):

* two writers: post writes to A's current peers, poll until done, release (a share EARLY
  of them, 0.1 unless given, while still in flight);
* a registrar: re-adds peers (same metadata), removes registrations, releases departed
  peers by agent name;
* a reconfigurer: creates A2 over A's region (same shared agent), registers a peer there
  (which makes A's registration of that name stale), writes, closes A2;
* a progressor: drives progress on every agent (the targets must progress).

An unexpected exception in any thread, or no completed writes, exits 1. Prints one JSON line
of counts.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pkv.errors import TransportError
from p2pkv.transport.base import (
    RegionLayout,
    RemotePeer,
    TransferState,
)
from p2pkv.transport.nixl import NixlTransport

NUM_BLOCKS, BLOCK_LEN, TARGETS = 64, 64 * 1024, 3


def region(num_blocks: int) -> tuple[np.ndarray[tuple[int], np.dtype[np.uint8]], RegionLayout]:
    array = np.random.default_rng().integers(0, 256, num_blocks * BLOCK_LEN, dtype=np.uint8)
    return array, RegionLayout(array.ctypes.data, num_blocks, BLOCK_LEN)


def main(seconds: float, early_share: float = 0.1) -> int:
    counts: Counter[str] = Counter()
    failures: list[BaseException] = []
    lock = threading.Lock()
    a_region, a_layout = region(NUM_BLOCKS)
    a = NixlTransport.create(agent_name="hammer-A", region=a_region, layout=a_layout)
    targets = []
    for i in range(TARGETS):
        t_region, t_layout = region(NUM_BLOCKS)
        transport = NixlTransport.create(
            agent_name=f"hammer-T{i}", region=t_region, layout=t_layout
        )
        targets.append((transport, t_region, t_layout))
    peers: dict[str, RemotePeer] = {}
    for transport, _, layout in targets:
        peers[transport.agent_name] = a.add_remote_peer(
            transport.agent_name, transport.metadata(), layout
        )
    stop = threading.Event()

    def count(key: str) -> None:
        with lock:
            counts[key] += 1

    def guarded(fn: object) -> threading.Thread:
        def run() -> None:
            try:
                fn()  # type: ignore[operator]
            except BaseException as exc:
                failures.append(exc)
                stop.set()

        return threading.Thread(target=run, daemon=True)

    def writer() -> None:
        rng = random.Random()
        while not stop.is_set():
            with lock:
                peer = rng.choice(list(peers.values()))
            n = rng.randint(1, 16)
            try:
                handle = a.post_write(
                    peer, rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
                )
            except TransportError:
                count("post_refused")  # stale or released registration: expected here
                continue
            count("posted")
            early = rng.random() < early_share
            deadline = time.monotonic() + 2.0
            while not early and time.monotonic() < deadline:
                state = a.poll(handle)
                if state is not TransferState.PROC:
                    count("done" if state is TransferState.DONE else "err")
                    break
                time.sleep(0)
            if early:
                count("released_in_flight")
            a.release(handle)
            a.release(handle)

    def registrar() -> None:
        rng = random.Random()
        while not stop.is_set():
            transport, _, layout = rng.choice(targets)
            name = transport.agent_name
            action = rng.random()
            if action < 0.6:
                new = a.add_remote_peer(name, transport.metadata(), layout)
                with lock:
                    old, peers[name] = peers.get(name), new
                if old is not None and rng.random() < 0.5:
                    a.remove_remote_peer(old)
                count("readded")
            elif action < 0.8:
                released = a.release_departed_peers([n for n in peers if n != name])
                new = a.add_remote_peer(name, transport.metadata(), layout)
                with lock:
                    peers[name] = new
                count("departed_released" if released else "departed_none")
            else:
                a.statistics()
                count("statistics")
            time.sleep(0.002)

    def reconfigurer() -> None:
        rng = random.Random()
        while not stop.is_set():
            a2 = NixlTransport.create(agent_name="hammer-A", region=a_region, layout=a_layout)
            try:
                transport, _, layout = rng.choice(targets)
                peer = a2.add_remote_peer(transport.agent_name, transport.metadata(), layout)
                try:
                    handle = a2.post_write(peer, [0, 1], [rng.randrange(NUM_BLOCKS), 5])
                except TransportError:
                    count("reconfig_post_refused")  # the registrar re-added it meanwhile
                    continue
                deadline = time.monotonic() + 2.0
                while a2.poll(handle) is TransferState.PROC and time.monotonic() < deadline:
                    time.sleep(0)
                a2.release(handle)
                count("reconfigured")
            finally:
                a2.close()
            time.sleep(0.01)

    def progressor() -> None:
        while not stop.is_set():
            for transport, _, _ in targets:
                transport.progress()
            a.progress()
            time.sleep(0)

    threads = [guarded(f) for f in (writer, writer, registrar, reconfigurer, progressor)]
    for thread in threads:
        thread.start()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join(10)
    alive = sum(thread.is_alive() for thread in threads)
    a.close()
    for transport, _, _ in targets:
        transport.close()
    stats = a.statistics()
    counts["live_agents_after"] = stats.live_agents
    print(json.dumps(dict(counts)), flush=True)
    for exc in failures:
        print(f"FAILED: {exc!r}", file=sys.stderr)
    ok = not failures and not alive and counts["done"] > 0 and stats.live_agents == 0
    return 0 if ok else 1


if __name__ == "__main__":
    args = [float(a) for a in sys.argv[1:3]]
    sys.exit(main(*args))
