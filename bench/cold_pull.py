"""Cold pull: blocks from a never-seen peer whose host thread is busy, vs. warm idle peers.

Reproduce (about 1-2 minutes on 2 cores; ``--quick`` for a smoke run)::

    .venv/bin/python bench/cold_pull.py

The reference system answered peers only inside its scheduler step, so a cold pull from a
busy source took 13.6-14.3 s while the data moved in < 0.5 s (vLLM #55179). Here the
source is a separate process whose *main thread* is the host: it steps in 1 s steps
(``spin``: pure-Python CPU work that holds the GIL; ``sleep``: ``time.sleep(1.0)``), while
its node runs on the engine thread of :func:`p2pkv.start_node`. This process is the
consumer. Per repetition and in rotating order it measures, on the same bytes:

* ``warm``: lookup + fetch over a session that is already up (keys evicted between runs);
* ``cold``: connect + lookup + fetch from a brand-new consumer node (new peer id, new NIXL
  agent) the source has never seen: handshake and registration on both sides included.

Each kind runs with the source idle and busy. The target (DESIGN.md) is
``cold, busy <= 1.2 x warm, idle`` (medians), for both busy modes. Consumer regions are
allocated page-aligned (like the store's default) and touched before timing (a worker's KV
tier is), so page faults on fresh memory are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio
from _regions import touched_region  # bench/ is on sys.path when run as a script

import p2pkv
from p2pkv.cli import Child, demo_keys, emit, fill_store, set_env_defaults, verify_blocks
from p2pkv.node import Node, Peer

TARGET = 1.2  # DESIGN.md, "Performance targets"
MiB = 1 << 20


# --- the source process: a node on its engine thread, the host thread busy in 1 s steps ---


LOOPS_PER_TICK = 16  # the spinning host notes the time after this many loops


def _step(mode: str, ticks: list[float]) -> None:
    """One 1 s step of the host; a spinning host appends a tick to ``ticks`` every
    LOOPS_PER_TICK loops of its own work (perf_counter, one clock for both processes)."""
    if mode == "sleep":
        time.sleep(1.0)
    elif mode == "spin":
        end = time.perf_counter() + 1.0
        while (now := time.perf_counter()) < end:
            for _ in range(LOOPS_PER_TICK):
                sum(range(2000))  # Python bytecode: holds the GIL between switch intervals
            ticks.append(now)


def _host_rates(ticks: list[float], since: float, window: list[float] | None) -> list[float]:
    """The spinning host's loops per second inside ``window`` (a pull) and outside it,
    since ``since``, and the window's length; [] without a window or ticks."""
    if not window or not ticks:
        return []
    t0, t1 = window
    inside = sum(t0 <= t <= t1 for t in ticks) * LOOPS_PER_TICK
    outside = len(ticks) * LOOPS_PER_TICK - inside
    span = ticks[-1] - since
    if not 0 < t1 - t0 < span:
        return []
    return [inside / (t1 - t0), outside / (span - (t1 - t0)), t1 - t0]


def source_main(args: argparse.Namespace) -> None:
    node_interval = args.node_switch_interval_us * 1e-6 if args.node_switch_interval_us else None
    cfg = p2pkv.NodeConfig(
        peer_id="source",
        num_blocks=args.blocks,
        block_len=args.block_len,
        transport="nixl",
        switch_interval=node_interval,
    )
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    with p2pkv.start_node(cfg) as node:
        fill_store(node.store, demo_keys(args.blocks), 0)
        interval_us = sys.getswitchinterval() * 1e6
        emit({"event": "listening", "address": list(node.address), "interval_us": interval_us})
        mode, steps, pending = "idle", 0, b""
        ticks: list[float] = []  # the spinning host's work in this mode, since `since`
        since = time.perf_counter()
        while True:
            if mode != "idle":
                _step(mode, ticks)
                steps += 1
            wait = None if mode == "idle" else 0.0
            if not select.select([0], [], [], wait)[0]:
                continue
            chunk = os.read(0, 4096)
            if not chunk:
                return  # EOF: the orchestrator is done (or gone)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                rates: list[float] = []
                if line.strip():
                    request = json.loads(line)
                    rates = _host_rates(ticks, since, request.get("window"))
                    mode = request["mode"]  # idle | sleep | spin
                emit({"mode": mode, "steps": steps, "host_rates": rates})
                ticks, since = [], time.perf_counter()


# --- the consumer (this process) ------------------------------------------------------------


async def timed_pull(
    node: Node, address: tuple[str, int], peer: Peer | None, keys: Sequence[bytes]
) -> dict[str, float]:
    """(connect if ``peer`` is None) + lookup + fetch; every key must load."""
    t0 = time.perf_counter()
    if peer is None:
        peer = await node.connect(address)
    t1 = time.perf_counter()
    hits = await node.lookup(peer, keys)
    result = await node.fetch(peer, keys)
    t2 = time.perf_counter()
    if not all(hits) or result.failed:
        raise SystemExit(
            f"pull failed: {len(result.failed)} blocks, e.g. "
            f"{next(iter(result.failed.values()), '?')}"
        )
    return {"total": t2 - t0, "connect": t1 - t0, "start": t0, "end": t2}


def evict_all(node: Node, keys: Sequence[bytes]) -> None:
    # Highest slot first: the free list is a stack, so the next fetch gets ascending slots.
    slots = sorted(((node.store.slot_of(k) or 0, k) for k in keys), reverse=True)
    for _slot, key in slots:
        node.store.evict(key)


async def consume(args: argparse.Namespace, source: Child, address: tuple[str, int]) -> int:
    keys = demo_keys(args.blocks)
    rng = np.random.default_rng(1)
    order = [keys[i] for i in rng.permutation(len(keys))]  # scattered source slots
    nbytes = args.blocks * args.block_len
    conditions = [
        ("warm", "idle"),
        ("cold", "idle"),
        ("warm", "spin"),
        ("cold", "spin"),
        ("cold", "sleep"),
        ("warm", "sleep"),
    ]
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    connects: dict[str, list[float]] = defaultdict(list)
    cold_region = touched_region(nbytes)

    def cfg(peer_id: str) -> p2pkv.NodeConfig:
        return p2pkv.NodeConfig(
            peer_id=peer_id,
            num_blocks=args.blocks,
            block_len=args.block_len,
            transport="nixl",
            max_landing_share=1.0,  # one pull fills the whole store
        )

    # The spinning host's loops per second during each pull and around it, per spin pull.
    host_rates: list[list[float]] = []
    current, window = "idle", [0.0, 0.0]

    async def set_mode(mode: str) -> None:
        nonlocal current
        reply = await trio.to_thread.run_sync(
            source.request, {"mode": mode, "window": window if current == "spin" else None}
        )
        assert reply["mode"] == mode, reply
        if current == "spin" and reply["host_rates"]:
            host_rates.append(reply["host_rates"])
        current = mode

    async with p2pkv.open_node(cfg("warm"), region=touched_region(nbytes)) as warm:
        peer = await warm.connect(address)
        await timed_pull(warm, address, peer, order)  # first transfer: wire-up
        evict_all(warm, keys)
        for rep in range(args.reps):
            for kind, mode in conditions[rep % 2 :] + conditions[: rep % 2]:
                await set_mode(mode)
                if kind == "warm":
                    t = await timed_pull(warm, address, peer, order)
                    evict_all(warm, keys)
                else:
                    pid = f"cold-{rep}-{mode}"
                    async with p2pkv.open_node(cfg(pid), region=cold_region) as cold:
                        t = await timed_pull(cold, address, None, order)
                        sample = keys if rep == 0 and mode == "spin" else keys[::64]
                        bad = verify_blocks(cold.store, sample)
                        if bad:
                            raise SystemExit(f"{len(bad)} blocks differ from the source's")
                    connects[mode].append(t["connect"])
                times[kind, mode].append(t["total"])
                window = [t["start"], t["end"]]
                print(
                    f"  rep {rep + 1}/{args.reps} {kind:<4} {mode:<5} {t['total'] * 1e3:8.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        await set_mode("idle")
    return report(args, times, connects, host_rates)


def report(
    args: argparse.Namespace,
    times: dict[tuple[str, str], list[float]],
    connects: dict[str, list[float]],
    host_rates: list[list[float]],
) -> int:
    med = {c: statistics.median(v) for c, v in times.items()}
    base = med["warm", "idle"]
    size = args.blocks * args.block_len
    print(
        f"\ncold pull: {args.blocks:,} blocks x {args.block_len // 1024} KiB = "
        f"{size / MiB:,.0f} MiB, scattered order, {args.reps} reps, 2-process NIXL, "
        f"source switch interval {args.interval_us:.0f} us while its node runs"
    )
    print(
        f"  {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} (others' work shares these cores)"
    )
    print(
        f"  {'condition':<18}{'median':>10}{'min':>10}{'max':>10}{'vs warm,idle':>14}"
        f"{'connect':>10}"
    )
    for (kind, mode), values in times.items():
        conn = f"{statistics.median(connects[mode]) * 1e3:8.1f}ms" if kind == "cold" else ""
        print(
            f"  {kind + ', ' + mode:<18}{med[kind, mode] * 1e3:8.1f}ms"
            f"{min(values) * 1e3:8.1f}ms{max(values) * 1e3:8.1f}ms"
            f"{med[kind, mode] / base:13.2f}x{conn:>10}"
        )
    if host_rates:
        during = statistics.median(r[0] for r in host_rates)
        around = statistics.median(r[1] for r in host_rates)
        # What serving a pull cost the host: the share of its rate it lost, over the pull.
        lost = statistics.median((1 - r[0] / r[1]) * r[2] for r in host_rates)
        print(
            f"  the spinning host's own work, loops/s: {during:,.0f} while a pull ran, "
            f"{around:,.0f} around it in the same 1 s steps ({during / around:.2f} of it); "
            f"host time lost per pull {lost * 1e3:.1f} ms (medians of {len(host_rates)} "
            f"spin pulls)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bench": "cold_pull",
                    "args": {k: v for k, v in vars(args).items() if k != "role"},
                    "cores": os.cpu_count(),
                    "load": os.getloadavg(),
                    "times_s": {f"{kind}, {mode}": v for (kind, mode), v in times.items()},
                    "connect_s": connects,
                    "host_loops_per_s_during_around": host_rates,
                },
                f,
                indent=1,
            )
    worst = 0.0
    for mode in ("spin", "sleep"):
        ratio = med["cold", mode] / base
        worst = max(worst, ratio)
        print(f"cold, busy ({mode}) / warm, idle = {ratio:.2f} (target <= {TARGET})")
    print(
        f"{'PASS' if worst <= TARGET else 'FAIL'}: cold pull ratio {worst:.2f} "
        f"(target <= {TARGET}); warm idle pull {base * 1e3:.1f} ms = "
        f"{size / base / 1e9:.2f} GB/s"
    )
    return 0 if worst <= TARGET else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=1024, help="default: %(default)s")
    parser.add_argument("--block-len", type=int, default=2 * MiB, help="default: 2 MiB")
    parser.add_argument("--reps", type=int, default=5, help="default: %(default)s")
    parser.add_argument("--quick", action="store_true", help="128 blocks, 2 reps")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument(
        "--switch-interval-us",
        type=float,
        default=0.0,
        help="experiment: sys.setswitchinterval in the source before its node starts "
        "(default: Python's 5000 us)",
    )
    parser.add_argument(
        "--node-switch-interval-us",
        type=float,
        default=1000.0,
        help="the source node's NodeConfig.switch_interval in us; 0: None, the node leaves "
        "the interval alone (default: %(default)s, the config's default)",
    )
    parser.add_argument(
        "--role", default="bench", choices=["bench", "source"], help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.reps = 128, 2
    set_env_defaults()
    if args.role == "source":
        source_main(args)
        return 0
    argv_child = [sys.executable, __file__, "--role", "source", "--blocks", str(args.blocks)]
    argv_child += ["--block-len", str(args.block_len)]
    argv_child += ["--switch-interval-us", str(args.switch_interval_us)]
    argv_child += ["--node-switch-interval-us", str(args.node_switch_interval_us)]
    with Child(argv_child, name="source process") as source:
        hello: dict[str, Any] = source.receive(timeout=300)
        host, port = hello["address"]
        args.interval_us = hello["interval_us"]
        return trio.run(consume, args, source, (host, int(port)))


if __name__ == "__main__":
    sys.exit(main())
