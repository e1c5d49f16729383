"""Control plane: round trip of a lookup of 1,024 keys on loopback, p50 / p99.

Reproduce (about 15 s; ``--quick`` for a smoke run)::

    .venv/bin/python bench/control_plane.py

Two processes: a source (``p2pkv serve --fill 1024``, NIXL) and this process as the
consumer, connected once. Each sample is one ``node.lookup(peer, keys)`` with all 1,024
keys present (every key is pinned at the source, the usual case before a fetch). Between
samples, untimed, a one-block fetch closes the round (that releases the pins and the
request slot; a lookup round otherwise stays open for its lease) and the block is evicted
again. A single-key lookup is measured the same way, as the fixed cost of a round trip.
Target (DESIGN.md): p50 <= 1 ms for 1,024 keys.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import trio

import p2pkv
from p2pkv.cli import Child, demo_keys, set_env_defaults

TARGET_P50_S = 1e-3


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(args: argparse.Namespace, address: tuple[str, int]) -> dict[int, list[float]]:
    cfg = p2pkv.NodeConfig(
        peer_id="consumer", num_blocks=16, block_len=args.block_len, transport="nixl"
    )
    keys = demo_keys(args.keys)
    samples: dict[int, list[float]] = {args.keys: [], 1: []}
    async with p2pkv.open_node(cfg) as node:
        peer = await node.connect(address)
        for rep in range(args.warmup + args.samples):
            for n in samples:
                t0 = time.perf_counter()
                hits = await node.lookup(peer, keys[:n])
                elapsed = time.perf_counter() - t0
                if not all(hits):
                    raise SystemExit(f"lookup missed {hits.count(False)} keys")
                result = await node.fetch(peer, keys[:1])  # closes the round
                assert result.loaded == keys[:1], result.failed
                node.store.evict(keys[0])
                if rep >= args.warmup:
                    samples[n].append(elapsed)
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1024, help="default: %(default)s")
    parser.add_argument("--samples", type=int, default=300, help="default: %(default)s")
    parser.add_argument("--warmup", type=int, default=20, help="default: %(default)s")
    parser.add_argument("--block-len", type=int, default=64 * 1024, help="default: 64 KiB")
    parser.add_argument("--quick", action="store_true", help="30 samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.warmup = 30, 5
    set_env_defaults()
    argv_child = [
        sys.executable,
        "-m",
        "p2pkv",
        "serve",
        "--exit-on-eof",
        "--peer-id",
        "source",
        "--blocks",
        str(args.keys),
        "--block-len",
        str(args.block_len),
        "--fill",
        str(args.keys),
    ]
    with Child(argv_child, name="source process") as source:
        host, port = source.receive(timeout=300)["address"]
        samples = trio.run(measure, args, (host, int(port)))
    print(
        f"\ncontrol plane: lookup round trip, 2 processes on loopback, {args.samples} samples each"
    )
    print(
        f"  {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} (others' work shares these cores)"
    )
    print(f"  {'keys':>6}{'p50':>10}{'p90':>10}{'p99':>10}{'min':>10}{'max':>10}")
    for n, values in samples.items():
        cols = [
            statistics.median(values),
            pct(values, 0.9),
            pct(values, 0.99),
            min(values),
            max(values),
        ]
        print(f"  {n:>6}" + "".join(f"{v * 1e3:8.2f}ms" for v in cols))
    p50 = statistics.median(samples[args.keys])
    passed = p50 <= TARGET_P50_S
    print(
        f"{'PASS' if passed else 'FAIL'}: lookup of {args.keys:,} keys p50 {p50 * 1e3:.2f} ms "
        f"(target <= {TARGET_P50_S * 1e3:.0f} ms), p99 {pct(samples[args.keys], 0.99) * 1e3:.2f} ms"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
