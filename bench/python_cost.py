"""Python cost per block of a lookup + fetch cycle, both processes together (issue 9).

Reproduce (a few minutes on 2 cores; ``--quick`` for a smoke run)::

    PYTHONPATH=. .venv/bin/python bench/python_cost.py
    PYTHONPATH=. .venv/bin/python bench/python_cost.py --baseline /work/main  # old code too

Two processes per pair, NIXL over loopback, 64 KiB blocks, scattered source slots (as in
``dataplane.py``). One cycle is what a consumer does to bring blocks in: ``node.lookup``
of every key (a round the producer pins) and ``node.fetch`` of them all (which uses that
round). A rep runs cycles back to back, as many as make 4,096 blocks (16 of 256 blocks,
one of 4,096 or more; the host's evictions between them are not timed), and each figure
is per cycle; a lone cycle after an idle gap (``--cycles 1``, the only kind before
2026-12-03) also pays for cold caches and the orchestrator's requests (see
``bench/notes/python_cost.md``; work a node leaves for after a fetch returns falls in the
next cycle's window, so all but the last cycle of a rep carry it). For each cycle the CPU
time of both processes
(``time.process_time``: every thread, user + system) is taken around it, so it includes
the copy itself, which the kernel (UCX cma, ``process_vm_writev``) does on the producer's
worker thread.

The copy's own CPU is taken out two ways. **python** subtracts the copy of that very
cycle: the thread CPU the producer's data plane spent inside its post calls (NIXL's
``transfer()``, which with one copy thread on host memory does the whole copy, UCX cma's
``process_vm_writev``, before it returns; ``TransportStatistics.post_cpu_s``). **over bare**
subtracts, as ``bench/README.md`` does, the CPU of a bare NIXL pair doing the same writes
(same block count, order and region layout) in the same run. The second is a difference
of two independent ~15 us-per-block copies, whose CPU alone varies by more than the 3 us
measured (it once read -3.6 us); the first needs no second copy. The nodes copy with one
thread, like the bare pair (``nixl_copy_threads=1``): copy threads make a fetch faster, but
spend more CPU on the copy, which is not Python's. Each rep prints, per block: ``total``
(the p2pkv pair's CPU), ``copy`` (its post calls'), ``python`` (total - copy), ``bare``
(the bare pair's CPU), ``over bare`` (total - bare), the two Trio threads' CPU and the GC's
share of it. Pairs alternate rep by rep (rotating who goes first); each figure is the
median of the reps with its min-max. ``--baseline PATH`` adds a third pair whose children
import p2pkv from ``PATH`` (e.g. a checkout of ``main``), so old and new code are compared
in the same run (code older than ``post_cpu_s`` has "over bare" only).

Target (issue 9, done-when 1): python <= 3 us per block at 4,096 blocks, and flat from 256
to 16,384 blocks. ``--json PATH`` writes every rep's raw numbers. Diagnosis: with
``PYTHON_COST_PROFILE=DIR`` set, each p2pkv child writes a cProfile of its Trio thread's
CPU (``time.thread_time``) to ``DIR/<name>.prof``: the consumer's over its timed windows
only (not the evictions between cycles, set-up or shutdown), the producer's from the end of
its store fill on (its work all falls inside those windows, with the orchestrator's
requests and its shutdown).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import trio
from _regions import touched_region  # bench/ is on sys.path when run as a script
from dataplane import bare_main, connect_all, order, spawn

import p2pkv
from p2pkv.cli import Child, demo_keys, emit, fill_store, receive_commands, set_env_defaults

KiB = 1024
TARGET_US = 3.0
TARGET_BLOCKS = 4096


def cpu_s() -> float:
    return time.process_time()


class GcClock:
    """Collections and their thread CPU, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.count = 0
        self.cpu = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.count += 1
            self.cpu += time.thread_time() - self._start


def post_cpu(node: p2pkv.Node) -> float | None:
    """CPU seconds this node's data plane spent inside its post calls (the copy: NIXL's
    transfer(), UCX cma, one copy thread); None where the code measured has no such figure
    (an older checkout run as ``--baseline``)."""
    value = getattr(node.transport.statistics(), "post_cpu_s", None)
    return None if value is None else float(value)


_PROFILE: Any = None  # cProfile.Profile with PYTHON_COST_PROFILE set: the timed windows only


def _profiling(on: bool) -> None:
    if _PROFILE is not None:
        if on:
            _PROFILE.enable()
        else:
            _PROFILE.disable()


async def node_main(args: argparse.Namespace) -> None:
    gc_clock = GcClock()
    # One copy thread, as in the bare pair whose CPU is subtracted: copy threads spend more
    # CPU on the copy itself (bench/dataplane.py measures what they buy), not in Python.
    cfg = p2pkv.NodeConfig(
        peer_id=args.role_name,
        num_blocks=args.blocks,
        block_len=args.block_len,
        transport="nixl",
        nixl_copy_threads=1,
    )
    if "max_landing_share" in attrs.fields_dict(p2pkv.NodeConfig):
        # One fetch fills the whole store, as the bare pair's write (a --baseline from
        # before the setting has no such field and fetches in one go anyway).
        cfg = attrs.evolve(cfg, max_landing_share=1.0)
    region = touched_region(args.blocks * args.block_len)
    keys = demo_keys(args.blocks)
    wanted = [keys[i] for i in order(args.blocks)]
    async with p2pkv.open_node(cfg, region=region) as node:
        if args.fill:
            fill_store(node.store, keys)
        emit({"address": list(node.address)})
        if args.fill:
            # The producer's work all falls inside the consumer's timed windows: profile
            # all of it from here on (its set-up and store fill stay out).
            _profiling(True)
        peer = None
        async for cmd in receive_commands():
            op = cmd["op"]
            if op == "connect":
                peer = await node.connect(tuple(cmd["address"]))
                emit({"ok": True})
            elif op == "cpu":
                post = post_cpu(node)  # first: outside the window this reading opens
                emit(
                    {
                        "cpu": cpu_s(),
                        "thread": time.thread_time(),
                        "gc": gc_clock.cpu,
                        "gcs": gc_clock.count,
                        "post": post,
                    }
                )
            elif op == "cycle":
                assert peer is not None
                got: dict[str, Any] = dict.fromkeys(("t", "cpu", "thread", "gc", "gcs"), 0)
                got.update(post=0.0, hits=0, n=0)
                for _ in range(cmd.get("count", 1)):  # the evictions between are not timed
                    # The transport's statistics (locks, counts) are read outside the timing.
                    gc0, gcs0, post0 = gc_clock.cpu, gc_clock.count, post_cpu(node)
                    c0, t0, th0 = cpu_s(), time.perf_counter(), time.thread_time()
                    _profiling(True)
                    hits = sum(await node.lookup(peer, wanted))
                    result = await node.fetch(peer, wanted)
                    _profiling(False)
                    got["t"] += time.perf_counter() - t0
                    got["cpu"] += cpu_s() - c0
                    got["thread"] += time.thread_time() - th0
                    got["gc"] += gc_clock.cpu - gc0
                    got["gcs"] += gc_clock.count - gcs0
                    if post0 is None or got["post"] is None:
                        got["post"] = None
                    else:
                        got["post"] += (post_cpu(node) or 0.0) - post0
                    got["hits"] += hits
                    got["n"] += len(result.loaded)
                    # Highest slot first: the next fetch gets ascending slots again.
                    slots = sorted(((node.store.slot_of(k) or 0, k) for k in keys), reverse=True)
                    for _slot, key in slots:
                        node.store.evict(key)
                emit(got)


@contextlib.contextmanager
def pythonpath(path: str | None) -> Iterator[None]:
    """Children spawned inside import p2pkv from ``path`` (None: as we do); the rest of
    ``PYTHONPATH`` (where a machine without a package index keeps the dependencies) stays
    behind it."""
    old = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(path), old]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def run_size(args: argparse.Namespace) -> dict[str, list[float]]:
    """Raw per-rep results for one block count: CPU seconds and wall seconds per pair."""
    n, cycles = args.blocks, cycles_per_rep(args)
    variants = ["p2pkv"] + (["baseline"] if args.baseline else [])
    with contextlib.ExitStack() as stack:
        pairs: dict[str, tuple[Child, Child]] = {}
        for v in variants:
            with pythonpath(args.baseline if v == "baseline" else None):
                src = spawn(args, "node", f"{v}-src", "--fill", script=__file__)
                src = stack.enter_context(src)
                dst = stack.enter_context(spawn(args, "node", f"{v}-dst", script=__file__))
            pairs[v] = (src, dst)
        tgt = stack.enter_context(spawn(args, "bare", "bare-target", script=__file__))
        ini = stack.enter_context(spawn(args, "bare", "bare-initiator", script=__file__))
        connect_all(list(pairs.values()), tgt, ini, 600)
        order_ = [*variants, "bare"]
        res: dict[str, list[float]] = {}
        for rep in range(args.reps + 1):  # rep 0 warms every path up and is not counted
            k = rep % len(order_)
            for which in order_[k:] + order_[:k]:
                if which == "bare":
                    c0 = tgt.request({"op": "cpu"})["cpu"]
                    r = ini.request({"op": "write", "order": "scattered", "count": cycles})
                    assert r["state"] == "DONE", r
                    cpu = r["cpu"] + tgt.request({"op": "cpu"})["cpu"] - c0
                else:
                    src, dst = pairs[which]
                    s0 = src.request({"op": "cpu"})
                    r = dst.request({"op": "cycle", "count": cycles})
                    want = n * cycles
                    assert r["hits"] == want and r["n"] == want, f"{which}: {r} of {want} blocks"
                    s1 = src.request({"op": "cpu"})
                    cpu = r["cpu"] + s1["cpu"] - s0["cpu"]
                    if rep:  # the two Trio threads alone: the engine's Python
                        posts = (r["post"], s1["post"], s0["post"])
                        if None not in posts:  # the copy's own CPU in this very cycle
                            copy = (r["post"] + s1["post"] - s0["post"]) / cycles
                            res.setdefault(f"{which}_copy", []).append(copy)
                        trio_cpu = (r["thread"] + s1["thread"] - s0["thread"]) / cycles
                        res.setdefault(f"{which}_trio", []).append(trio_cpu)
                        gc_cpu = (r["gc"] + s1["gc"] - s0["gc"]) / cycles
                        res.setdefault(f"{which}_gc", []).append(gc_cpu)
                        gcs = (r["gcs"] + s1["gcs"] - s0["gcs"]) / cycles
                        res.setdefault(f"{which}_gcs", []).append(gcs)
                if rep:  # per cycle
                    res.setdefault(f"{which}_cpu", []).append(cpu / cycles)
                    res.setdefault(f"{which}_t", []).append(r["t"] / cycles)
            if rep:
                msg = ", ".join(f"{v} {res[f'{v}_cpu'][-1] / n * 1e6:.1f}" for v in order_)
                print(
                    f"  {n} blocks rep {rep}/{args.reps}: CPU us/block {msg}",
                    file=sys.stderr,
                    flush=True,
                )
    return res


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def cycles_per_rep(args: argparse.Namespace) -> int:
    """Cycles back to back in one rep: ``--cycles``, else as many as make 4,096 blocks."""
    if args.cycles:
        return int(args.cycles)
    return max(1, TARGET_BLOCKS // int(args.blocks))


def figures(res: dict[str, list[float]], v: str, n: int) -> dict[str, list[float]]:
    """Variant ``v``'s per-rep figures at ``n`` blocks, us per block: ``total``, ``bare``,
    ``over bare`` (total - bare), ``trio threads``, ``of it GC`` and, where its copy was
    measured in every rep, ``copy`` and ``python`` (total - copy)."""

    def per_block(key: str) -> list[float]:
        return [c / n * 1e6 for c in res[key]]

    total, bare = per_block(f"{v}_cpu"), per_block("bare_cpu")
    out = {
        "total": total,
        "bare": bare,
        "over bare": [t - b for t, b in zip(total, bare, strict=True)],
        "trio threads": per_block(f"{v}_trio"),
        "of it GC": per_block(f"{v}_gc"),
    }
    if len(res.get(f"{v}_copy", [])) == len(total):
        copy = per_block(f"{v}_copy")
        out["copy"] = copy
        out["python"] = [t - c for t, c in zip(total, copy, strict=True)]
    return out


def fixed_and_marginal(sizes: dict[str, dict[str, list[float]]], v: str) -> dict[str, float]:
    """Variant ``v``'s cycle split into what every cycle pays and what each block adds: a
    least-squares line through the median Python CPU per cycle (us) against the blocks per
    cycle, ``fixed`` (its intercept, us per cycle) and ``marginal`` (its slope, us per
    block), and the slope between each two adjacent sizes (``"256-1024"``...). A per-block
    average that falls with size while the slopes stay level is a fixed cost per cycle, not
    work that grows faster than the blocks. Empty with fewer than two sizes."""
    points = []
    for size, res in sorted(sizes.items(), key=lambda kv: int(kv[0])):
        n = int(size)
        fig = figures(res, v, n)
        points.append((n, statistics.median(fig.get("python", fig["over bare"])) * n))
    if len(points) < 2:
        return {}
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    out = {"fixed": my - slope * mx, "marginal": slope}
    for (x1, y1), (x2, y2) in itertools.pairwise(points):
        out[f"{x1}-{x2}"] = (y2 - y1) / (x2 - x1)
    return out


def summary(values: Sequence[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5, help="default: %(default)s")
    parser.add_argument(
        "--sizes",
        default="256,1024,4096,16384",
        help="blocks per fetch, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--block-kib", type=int, default=64, help="default: %(default)s")
    parser.add_argument(
        "--cycles",
        type=positive,
        help="cycles back to back per rep (default: as many as make 4,096 blocks; "
        "1 measures a lone cycle after an idle gap)",
    )
    parser.add_argument("--baseline", help="also run children importing p2pkv from this path")
    parser.add_argument("--json", help="write the raw per-rep results here")
    parser.add_argument("--quick", action="store_true", help="256 and 1,024 blocks, 2 reps")
    parser.add_argument(
        "--role", default="bench", choices=["bench", "node", "bare"], help=argparse.SUPPRESS
    )
    parser.add_argument("--role-name", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--block-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    set_env_defaults()
    if args.role == "node":
        prof_dir = os.environ.get("PYTHON_COST_PROFILE")  # the Trio thread's CPU, by function
        if prof_dir:
            import cProfile

            global _PROFILE
            _PROFILE = cProfile.Profile(time.thread_time)
            trio.run(node_main, args)
            _PROFILE.disable()
            _PROFILE.dump_stats(os.path.join(prof_dir, f"{args.role_name}.prof"))
            return 0
        trio.run(node_main, args)
        return 0
    if args.role == "bare":
        bare_main(args)
        return 0
    if args.quick:
        args.sizes, args.reps = "256,1024", 2
    args.block_len = args.block_kib * KiB
    raw: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cores": os.cpu_count(),
        "block_len": args.block_len,
        "reps": args.reps,
        "baseline": args.baseline,
        "sizes": {},
    }
    raw["cycles"] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        args.blocks = size
        raw["cycles"][str(size)] = cycles_per_rep(args)
        raw["sizes"][str(size)] = run_size(args)
    raw["loadavg"] = os.getloadavg()
    variants = ["p2pkv"] + (["baseline"] if args.baseline else [])
    print(
        f"\nPython CPU per block of a lookup + fetch cycle, both processes, "
        f"{args.block_kib} KiB blocks, NIXL over loopback; median [min-max] of {args.reps} "
        f"alternating reps, us per block; a rep is "
        + ", ".join(f"{c} cycle{'s' if c > 1 else ''} of {n}" for n, c in raw["cycles"].items())
    )
    print(
        f"  {raw['date']}, {raw['cores']} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in raw['loadavg'])} (others' work shares these cores)"
    )
    columns = ["total", "copy", "python", "bare", "over bare", "trio threads", "of it GC"]
    print(f"  {'blocks':>7} {'variant':<9}" + "".join(f" {c:>20}" for c in columns))
    ok = True
    for size, res in raw["sizes"].items():
        n = int(size)
        for v in variants:
            fig = figures(res, v, n)
            print(
                f"  {n:>7} {v:<9}"
                + "".join(f" {summary(fig[c]) if c in fig else 'n/a':>20}" for c in columns)
            )
            if v == "p2pkv" and n == TARGET_BLOCKS:
                what = "python" if "python" in fig else "over bare"
                got = statistics.median(fig[what])
                ok = got <= TARGET_US
                print(
                    f"{'PASS' if ok else 'FAIL'}: {what} {got:.2f} us per block at {n} blocks "
                    f"(target <= {TARGET_US:.0f} us)"
                )
    for v in variants:
        split = fixed_and_marginal(raw["sizes"], v)
        if split:
            steps = ", ".join(f"{k} {x:.2f}" for k, x in split.items() if "-" in k)
            print(
                f"  {v}: fixed {split['fixed']:.0f} us per cycle + {split['marginal']:.2f} us "
                f"per block (least squares over the medians); between sizes: {steps}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
