"""Idle engine: CPU used by a connected, idle pair of nodes (two processes, NIXL).

Reproduce (about 10 s; ``--quick`` for a 1 s window)::

    .venv/bin/python bench/idle_cpu.py

Two processes each run a node over NIXL; the second connects to the first (handshake and
registration done, heartbeats on). After a short settle time each process reports its own
``getrusage`` (user + system time of all its threads, and its voluntary context switches,
i.e. wake-ups) at the start and the end of the window; nothing else talks to them in
between. A busy-polling engine would show ~100 % of a core and thousands of wake-ups per
second. Target (DESIGN.md): <= 1 % of one core per engine (the upstream issue asks < 2 %).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack, ExitStack
from typing import Any

import trio

import p2pkv
from p2pkv.cli import Child, emit, receive_commands, set_env_defaults

TARGET = 0.01  # of one core


def usage() -> dict[str, Any]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu": ru.ru_utime + ru.ru_stime,
        "wakeups": ru.ru_nvcsw,
        "t": time.monotonic(),
        "threads": len(os.listdir("/proc/self/task")),
    }


async def node_main(args: argparse.Namespace) -> None:
    """``args.count`` nodes in this process (one NIXL agent each, small regions); with
    ``--connect`` each of them dials that address. Reports this process's usage and the
    peers of its first node."""
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(args.count):
            peer_id = args.role if args.count == 1 else f"{args.role}-{i}"
            cfg = p2pkv.NodeConfig(
                peer_id=peer_id, num_blocks=64, block_len=64 * 1024, transport="nixl"
            )
            nodes.append(await stack.enter_async_context(p2pkv.open_node(cfg)))
        if args.connect:
            host, port = args.connect.rsplit(":", 1)
            for node in nodes:
                await node.connect((host, int(port)))
        emit({"address": list(nodes[0].address)})
        async for _cmd in receive_commands():
            emit({**usage(), "peers": nodes[0].statistics().peers})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="window (default: 3)")
    parser.add_argument("--settle", type=float, default=1.0, help="before the window (s)")
    parser.add_argument("--quick", action="store_true", help="1 s window")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument(
        "--peers", type=int, default=1, help="idle peers connected to node-a (default: 1)"
    )
    parser.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--connect", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    set_env_defaults()
    if args.role != "bench":
        trio.run(node_main, args)
        return 0
    if args.quick:
        args.seconds, args.settle = 1.0, 0.5
    me = [sys.executable, __file__]
    # The peers of node-a: up to 16 nodes per process (one NIXL agent each).
    counts = [min(16, args.peers - i) for i in range(0, args.peers, 16)]
    with Child([*me, "--role", "node-a"], name="node-a") as a, ExitStack() as stack:
        host, port = a.receive(300)["address"]
        peers = []
        for j, count in enumerate(counts):
            role = "node-b" if args.peers == 1 else f"peers-{j}"
            argv = [*me, "--role", role, "--count", str(count), "--connect", f"{host}:{port}"]
            peers.append(stack.enter_context(Child(argv, name=role)))
        for child in peers:
            child.receive(300)
        procs = [a, *peers]
        time.sleep(args.settle)
        start = [p.request({}) for p in procs]
        time.sleep(args.seconds)
        end = [p.request({}) for p in procs]
    names = ["node-a", *(p.name for p in peers)]
    load = os.getloadavg()[0]
    print(
        f"\nidle engine: node-a and {args.peers} peer node(s) in {len(peers)} process(es), "
        f"NIXL, connected and idle, {args.seconds:.0f} s window "
        f"(load average {load:.2f} on {os.cpu_count()} cores)"
    )
    nodes = [1, *counts] if args.peers > 1 else [1, 1]
    print(
        f"  {'process':<9}{'nodes':>6}{'peers':>6}{'threads':>8}{'CPU':>10}{'of a core':>11}"
        f"{'per node':>10}{'wake-ups/s':>12}"
    )
    worst = 0.0  # the target is per engine: node-a with all the peers, or one peer node
    for name, n, s, e in zip(names, nodes, start, end, strict=True):
        elapsed = e["t"] - s["t"]
        share = (e["cpu"] - s["cpu"]) / elapsed
        worst = max(worst, share / n)
        print(
            f"  {name:<9}{n:>6}{e['peers']:>6}{e['threads']:>8}"
            f"{(e['cpu'] - s['cpu']) * 1e3:8.1f}ms{share:11.2%}{share / n:10.2%}"
            f"{(e['wakeups'] - s['wakeups']) / elapsed:12.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bench": "idle_cpu",
                    "args": {"seconds": args.seconds, "settle": args.settle, "peers": args.peers},
                    "cores": os.cpu_count(),
                    "load": os.getloadavg(),
                    "processes": [
                        {
                            "name": name,
                            "nodes": n,
                            "peers": e["peers"],
                            "threads": e["threads"],
                            "core_share": (e["cpu"] - s["cpu"]) / (e["t"] - s["t"]),
                            "wakeups_per_s": (e["wakeups"] - s["wakeups"]) / (e["t"] - s["t"]),
                        }
                        for name, n, s, e in zip(names, nodes, start, end, strict=True)
                    ],
                },
                f,
                indent=1,
            )
    passed = worst <= TARGET
    print(
        f"{'PASS' if passed else 'FAIL'}: idle engine {worst:.2%} of a core "
        f"(target <= {TARGET:.0%})"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
