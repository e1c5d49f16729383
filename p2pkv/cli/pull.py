"""The consumer's side of the demo and ``p2pkv fetch``: connect, look up, fetch, verify."""

from __future__ import annotations

import argparse
import functools
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence

import attrs

from ..config import NodeConfig
from ..node import Node, open_node
from .blocks import demo_keys, verify_blocks
from .settings import KiB, MiB, fetch_settings, is_loopback, run_trio, set_env_defaults


@attrs.define
class PullReport:
    blocks: int
    block_len: int
    connect_s: float = 0.0
    lookup_s: float = 0.0
    hits: int = 0
    fetch_s: float = 0.0
    loaded: int = 0
    failed: dict[bytes, str] = attrs.Factory(dict)
    bad: list[bytes] = attrs.Factory(list)
    verify_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_len

    @property
    def verified(self) -> bool:
        return self.loaded == self.blocks and not self.failed and not self.bad


Progress = Callable[[str], None]


async def pull(
    node: Node,
    address: tuple[str, int],
    keys: Sequence[bytes],
    *,
    seed: int,
    batch: int,
    progress: Progress,
    corrupt: bool = False,
) -> PullReport:
    """Connect to ``address``, look ``keys`` up, fetch them (scattered order), verify."""
    report = PullReport(len(keys), node.store.block_len)
    # A worker's KV tier is allocated up front; fault its pages in before timing, so the
    # throughput is the data plane's, not the first touch of fresh memory.
    node.store.array.fill(0)
    t0 = time.perf_counter()
    peer = await node.connect(address)
    report.connect_s = time.perf_counter() - t0
    progress(
        f"connected to {peer.peer_id} at {address[0]}:{address[1]} "
        f"(cold connect {_ms(report.connect_s)})"
    )
    # Ask in a shuffled order: destination slots are handed out in order, so the source
    # slots are scattered and NIXL cannot merge the blocks into one big copy.
    order = list(keys)
    random.Random(seed).shuffle(order)
    t0 = time.perf_counter()
    hits = await node.lookup(peer, order)
    report.lookup_s = time.perf_counter() - t0
    report.hits = sum(hits)
    progress(f"lookup: {report.hits:,}/{len(keys):,} hits in {_ms(report.lookup_s)}")
    batch = batch or max(1, len(order))
    loaded: list[bytes] = []
    for i in range(0, len(order), batch):
        t0 = time.perf_counter()
        result = await node.fetch(peer, order[i : i + batch])
        report.fetch_s += time.perf_counter() - t0
        report.loaded += len(result.loaded)
        loaded += result.loaded
        report.failed.update(result.failed)
        progress(
            f"fetch: {min(i + batch, len(order)):,}/{len(order):,} blocks "
            f"({size_text(report.loaded * report.block_len)}) in {_ms(report.fetch_s)}"
        )
    if corrupt and loaded:  # test hook: one wrong byte must fail the run
        slot = node.store.slot_of(loaded[0])
        assert slot is not None
        node.store.array[slot * report.block_len] ^= 0xFF
    t0 = time.perf_counter()
    report.bad = verify_blocks(node.store, keys, seed)
    report.verify_s = time.perf_counter() - t0
    progress(
        f"verify: {len(keys) - len(report.bad):,}/{len(keys):,} blocks match "
        f"in {_ms(report.verify_s)}"
    )
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def render(report: PullReport, transport: str) -> str:
    moved = report.loaded * report.block_len  # what arrived, not what was asked for
    gbps = moved / report.fetch_s / 1e9 if report.fetch_s else 0.0
    rows = [
        ("transport", transport),
        ("blocks", f"{report.blocks:,} x {size_text(report.block_len)} (scattered order)"),
        ("bytes", f"{size_text(moved)} of {size_text(report.nbytes)}"),
        ("cold connect", _ms(report.connect_s)),
        ("lookup", f"{_ms(report.lookup_s)} ({report.hits:,} hits)"),
        ("fetch", _ms(report.fetch_s)),
        ("throughput", f"{gbps:.2f} GB/s"),
        ("verified", "yes, every byte" if report.verified else "NO"),
    ]
    return "\n".join(f"  {name:<13} {value}" for name, value in rows)


def finish(report: PullReport, transport: str) -> int:
    print(render(report, transport))
    if report.verified:
        return 0
    problems = []
    if report.failed:
        reasons = sorted(set(report.failed.values()))
        problems.append(f"{len(report.failed):,} blocks not loaded ({', '.join(reasons)})")
    # A block that never arrived is "not loaded" above, not also "differs".
    wrong = [k for k in report.bad if k not in report.failed]
    if wrong:
        problems.append(
            f"{len(wrong):,} blocks differ from the source's bytes "
            f"(first: key {wrong[0].hex()[:16]}...)"
        )
    print(f"p2pkv: FAILED: {'; '.join(problems)}", file=sys.stderr)
    return 1


def stderr_progress(prefix: str) -> Progress:
    def progress(line: str) -> None:
        print(f"[{prefix}] {line}", file=sys.stderr, flush=True)

    return progress


async def consume(
    cfg: NodeConfig,
    address: tuple[str, int],
    *,
    blocks: int,
    seed: int,
    batch: int,
    progress: Progress,
    corrupt: bool = False,
) -> PullReport:
    async with open_node(cfg) as node:
        return await pull(
            node,
            address,
            demo_keys(blocks, seed),
            seed=seed,
            batch=batch,
            progress=progress,
            corrupt=corrupt,
        )


def cmd_fetch(args: argparse.Namespace) -> int:
    host, port = args.address  # parsed by the command line (parse_address)
    set_env_defaults(loopback=is_loopback(host))
    cfg, blocks, seed = fetch_settings(args, f"{socket.gethostname()}-fetch-{os.getpid()}")
    report = run_trio(
        functools.partial(
            consume,
            cfg,
            (host, port),
            blocks=blocks,
            seed=seed,
            batch=args.batch,
            progress=stderr_progress("fetch"),
            corrupt=args.corrupt_for_test,
        )
    )
    return finish(report, cfg.transport)
