"""Does local staging scale with more loopback agents, or with more requests on one?

    python3 bench/notes/staging_lanes.py [--reps 10] [--json out.json]   (GPU machine)

256 MiB of scattered blocks (64 KiB and 2 MiB) between a pinned host tensor and a GPU
tensor, H2D and D2H, every variant byte-checked once, medians of ``--reps`` after two
warm-ups, against torch copying the same blocks in a CUDA graph (as ``bench/gpu.py``):

- ``lanes=L``: :class:`p2pkv.staging.LoopbackAgent` with L loopback agents, the copy cut
  into L parts posted at once from L threads (what ``copy()`` does);
- ``one-thread L``: the same L agents and parts, all posted from one thread, then polled;
- ``requests=k``: one agent, the copy posted as k requests back to back, then polled;
- ``phases``: for one agent and one request, the time in make_prepped_xfer, transfer()
  (the post) and polling to DONE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu as bench_gpu  # bench/gpu.py: the torch graph baseline

from p2pkv import staging

MiB = 1 << 20
TOTAL = 256 * MiB


def _wait(nx: Any, xfers: list[Any]) -> None:
    states = ["PROC"] * len(xfers)
    while "PROC" in states:
        for i, x in enumerate(xfers):
            if states[i] == "PROC":
                states[i] = nx.check_xfer_state(x)
    for x in xfers:
        nx.release_xfer_handle(x)
    if any(s != "DONE" for s in states):
        raise RuntimeError(f"ended {states}")


def requests_copy(src: Any, s: Any, dst: Any, d: Any, k: int) -> None:
    lane = src.agent.lanes[0]
    nx = lane.agent
    parts = staging.lane_parts(len(s), k, 1)
    xfers = [
        nx.make_prepped_xfer("WRITE", src.lanes[0].local_dlist, s[p], dst.lanes[0].loop_dlist, d[p])
        for p in parts
    ]
    for x in xfers:
        nx.transfer(x)
    _wait(nx, xfers)


def one_thread_copy(src: Any, s: Any, dst: Any, d: Any) -> None:
    agent = src.agent
    parts = staging.lane_parts(len(s), len(agent.lanes), 1)
    posted = []
    for i, p in enumerate(parts):
        nx = agent.lanes[i].agent
        x = nx.make_prepped_xfer(
            "WRITE", src.lanes[i].local_dlist, s[p], dst.lanes[i].loop_dlist, d[p]
        )
        nx.transfer(x)
        posted.append((nx, x))
    for nx, x in posted:
        _wait(nx, [x])


def phases(src: Any, s: Any, dst: Any, d: Any) -> tuple[float, float, float]:
    nx = src.agent.lanes[0].agent
    t0 = time.perf_counter()
    x = nx.make_prepped_xfer("WRITE", src.lanes[0].local_dlist, s, dst.lanes[0].loop_dlist, d)
    t1 = time.perf_counter()
    state = nx.transfer(x)
    t2 = time.perf_counter()
    while state == "PROC":
        state = nx.check_xfer_state(x)
    t3 = time.perf_counter()
    nx.release_xfer_handle(x)
    return t1 - t0, t2 - t1, t3 - t2


def timed(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return TOTAL / statistics.median(times[2:]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--lanes", default="1,2,3,4,6")
    parser.add_argument("--json")
    args = parser.parse_args()
    import numpy as np
    import torch

    out: dict[str, Any] = {}
    for block_len in (64 * 1024, 2 * MiB):
        n = TOTAL // block_len
        host = torch.randint(0, 256, (TOTAL,), dtype=torch.uint8).pin_memory()
        back = torch.zeros(TOTAL, dtype=torch.uint8).pin_memory()
        gpu = torch.zeros(TOTAL, dtype=torch.uint8, device="cuda")
        perm = bench_gpu._order(torch, n, 7)
        hv, gv, bv = (t.view(n, block_len) for t in (host, gpu, back))
        g1, g2 = bench_gpu._graph(torch, gv, hv, perm), bench_gpu._graph(torch, bv, gv, perm)
        row: dict[str, Any] = {
            "torch_h2d": bench_gpu._time_graph(torch, g1, args.reps),
            "torch_d2h": bench_gpu._time_graph(torch, g2, args.reps),
        }
        del g1, g2
        s = np.asarray(perm, dtype=np.int32)
        ident = np.arange(n, dtype=np.int32)
        want_gpu = hv[perm].cuda()
        want_back = hv[perm][perm]
        for lanes in [int(x) for x in args.lanes.split(",")]:
            agent = staging.LoopbackAgent(lanes)
            h, g_, b = (agent.attach(t, block_len) for t in (host, gpu, back))
            variants: dict[str, Any] = {f"lanes={lanes}": agent.copy}
            if lanes > 1:
                variants[f"one-thread {lanes}"] = one_thread_copy
            else:
                for k in (2, 4, 8):
                    variants[f"requests={k}"] = lambda a, x, c, y, k=k: requests_copy(a, x, c, y, k)
            for name, fn in variants.items():
                for d, (src, dst) in (("h2d", (h, g_)), ("d2h", (g_, b))):
                    (gv if d == "h2d" else bv).zero_()
                    torch.cuda.synchronize()
                    gbps = timed(lambda f=fn, a=src, x=s, c=dst, y=ident: f(a, x, c, y), args.reps)
                    ok = torch.equal(gv, want_gpu) if d == "h2d" else torch.equal(bv, want_back)
                    row[f"{name} {d}"] = gbps
                    row[f"{name} {d} ratio"] = gbps / row[f"torch_{d}"]
                    print(
                        f"{block_len // 1024} KiB {name} {d}: {gbps:.1f} GB/s "
                        f"({gbps / row[f'torch_{d}']:.2f} x torch {row[f'torch_{d}']:.1f})"
                        + ("" if ok else " BYTES DIFFER"),
                        flush=True,
                    )
                    if not ok:
                        row[f"{name} {d} bytes_differ"] = True
            if lanes == 1:
                ph = [phases(h, s, g_, ident) for _ in range(args.reps + 2)][2:]
                med = [statistics.median(p[i] for p in ph) * 1e6 / n for i in range(3)]
                row["phases_h2d_us_per_block"] = med
                print(f"{block_len // 1024} KiB phases h2d us/block make/post/poll: {med}")
            for r in (h, g_, b):
                r.release()
        out[str(block_len)] = row
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
