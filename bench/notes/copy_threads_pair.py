"""Copy threads on a small machine: p2pkv pairs with different K beside bare NIXL, one run.

    PYTHONPATH=. .venv/bin/python bench/notes/copy_threads_pair.py [--threads 1,2] [--reps 7]

Reuses ``bench/dataplane.py``'s roles (two processes per pair, NIXL over loopback, the
producer WRITEs scattered 64 KiB x 4,096 and 2 MiB x 256 blocks into the consumer). One
p2pkv pair per K (``P2PKV_NIXL_COPY_THREADS`` set in its children's environment) and one
bare pair stay up for the whole run; every rep runs each of them once, in an order that
rotates rep by rep. Prints, per block size, the median [min-max] over reps of fetch time
and of bare time / p2pkv time (same rep), and the load average. Written to decide the
default K on 2 cores (``docs/design.md``, "Data plane parallelism").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataplane import connect_all, spawn

from p2pkv.cli import Child, set_env_defaults
from p2pkv.transport._nixl_agent import COPY_THREADS_ENV

SCRIPT = str(Path(__file__).resolve().parent.parent / "dataplane.py")
SIZES = ((64 * 1024, 4096), (2 << 20, 256))


def run(block_len: int, blocks: int, threads: list[int], reps: int) -> dict[str, list[float]]:
    args = argparse.Namespace(blocks=blocks, block_len=block_len)
    times: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        pairs: dict[str, tuple[Child, Child]] = {}
        for k in threads:
            os.environ[COPY_THREADS_ENV] = str(k)
            src = stack.enter_context(spawn(args, "node", f"k{k}-src", "--fill", script=SCRIPT))
            dst = stack.enter_context(spawn(args, "node", f"k{k}-dst", script=SCRIPT))
            pairs[f"K={k}"] = (src, dst)
        os.environ.pop(COPY_THREADS_ENV, None)
        tgt = stack.enter_context(spawn(args, "bare", "bare-target", script=SCRIPT))
        ini = stack.enter_context(spawn(args, "bare", "bare-initiator", script=SCRIPT))
        connect_all(list(pairs.values()), tgt, ini, 300)
        names = ["bare", *pairs]
        for rep in range(reps + 1):  # rep 0 warms up
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                if name == "bare":
                    r = ini.request({"op": "write", "order": "scattered"})
                    assert r["state"] == "DONE", r
                else:
                    src, dst = pairs[name]
                    assert dst.request({"op": "lookup", "order": "scattered"})["n"] == blocks
                    r = dst.request({"op": "fetch", "order": "scattered", "verify": rep == 0})
                    assert r["n"] == blocks, r
                if rep:
                    times.setdefault(name, []).append(r["t"])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,2", help="K values (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    set_env_defaults()
    threads = [int(k) for k in args.threads.split(",")]
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load:.2f} before; {args.reps} reps")
    for block_len, blocks in SIZES:
        t = run(block_len, blocks, threads, args.reps)
        for name, values in t.items():
            line = f"  {block_len // 1024:>5} KiB x {blocks:>5} {name:>5}: "
            line += f"{statistics.median(values) * 1e3:6.1f} ms"
            if name != "bare":
                ratios = [b / p for b, p in zip(t["bare"], values, strict=True)]
                line += (
                    f"   bare / p2pkv {statistics.median(ratios):.2f} "
                    f"[{min(ratios):.2f}-{max(ratios):.2f}]"
                )
            print(line, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
