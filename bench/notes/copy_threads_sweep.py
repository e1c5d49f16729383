"""Bare NIXL copy-thread sweep (issue 9): one write of N blocks, two processes, UCX cma.

    BL=65536 NB=4096 PIECES=1048576,16777216 .venv/bin/python \\
        bench/notes/copy_threads_sweep.py '{"num_threads": "4", "split_batch_size": "16"}'

The initiator's agent is made like p2pkv's (STRICT, no progress thread, UCX error mode
``peer``) plus the UCX parameters given as JSON (none: one copy thread). Prints the median
throughput and initiator CPU of 5 reps for: ``scat`` (scattered sources, per-block
descriptors), ``contig_perblock`` (contiguous, ``skip_desc_merge=True``), ``contig_merged``
(contiguous, NIXL merging), ``piecesNK`` (contiguous as explicit descriptors of N KiB,
``initialize_xfer``); then the initiator's idle CPU over 1 s and its thread count.
Results of the GPU machine's run: ``dataplane-h200/2026-12-01-2211-bare-sweep.txt``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

for _key, _value in (
    ("UCX_MEM_MMAP_HOOK_MODE", "none"),
    ("UCX_NET_DEVICES", "lo"),
    ("NIXL_LOG_LEVEL", "WARN"),
):
    os.environ.setdefault(_key, _value)
BL = int(os.environ.get("BL", 65536))
N = int(os.environ.get("NB", 4096))


def descs(base: int, n: int, size: int) -> npt.NDArray[np.uint64]:
    d = np.zeros((n, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(size)
    d[:, 1] = size
    return d


def make_agent(name: str, params: dict[str, str]) -> tuple[Any, npt.NDArray[np.uint8]]:
    from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    cfg = nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        backends=[],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(name, cfg)
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer", **params})
    region = np.ones(N * BL, dtype=np.uint8)
    agent.register_memory([(region.ctypes.data, region.nbytes, 0, "")], "DRAM")
    return agent, region


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def target(conn: Connection, params: dict[str, str]) -> None:
    agent, region = make_agent("tgt", params)
    conn.send((agent.get_agent_metadata(), region.ctypes.data))
    while not (conn.poll(0.01) and conn.recv() == "stop"):
        agent.get_new_notifs()  # the target makes progress, as a p2pkv node does


def main() -> None:
    params = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=target, args=(theirs, params))
    child.start()
    metadata, remote_base = ours.recv()
    agent, region = make_agent("ini", params)
    name = agent.add_remote_agent(metadata)
    local = agent.prep_xfer_dlist("", descs(region.ctypes.data, N, BL), "DRAM")
    remote = agent.prep_xfer_dlist(name, descs(remote_base, N, BL), "DRAM")
    scattered = np.random.default_rng(7).permutation(N).astype(np.int32)
    ascending = np.arange(N, dtype=np.int32)
    pieces = [int(x) for x in os.environ.get("PIECES", "").split(",") if x]
    res: dict[str, list[tuple[float, float]]] = {}

    def timed(label: str, xfer: Any) -> None:
        c0, t0 = cpu(), time.perf_counter()
        state = agent.transfer(xfer)
        while state == "PROC":
            state = agent.check_xfer_state(xfer)
        agent.release_xfer_handle(xfer)
        assert state == "DONE", state
        res.setdefault(label, []).append((time.perf_counter() - t0, cpu() - c0))

    for _rep in range(6):  # the first rep warms up and is dropped below
        for size in pieces:
            n = N * BL // size
            local_d = agent.get_xfer_descs(descs(region.ctypes.data, n, size), "DRAM")
            remote_d = agent.get_xfer_descs(descs(remote_base, n, size), "DRAM")
            timed(f"pieces{size >> 10}K", agent.initialize_xfer("WRITE", local_d, remote_d, name))
        for label, src, skip in (
            ("scat", scattered, False),
            ("contig_perblock", ascending, True),
            ("contig_merged", ascending, False),
        ):
            timed(
                label,
                agent.make_prepped_xfer(
                    "WRITE", local, src, remote, ascending, skip_desc_merge=skip
                ),
            )
    for label, samples in res.items():
        t = statistics.median(s[0] for s in samples[1:])
        c = statistics.median(s[1] for s in samples[1:])
        print(
            f"{json.dumps(params)} {label}: {N * BL / t / 1e9:.2f} GB/s "
            f"t={t * 1e3:.1f}ms cpu={c * 1e3:.1f}ms"
        )
    c0 = cpu()
    time.sleep(1.0)
    threads = len(os.listdir("/proc/self/task"))
    print(f"  idle cpu initiator {(cpu() - c0) * 100:.1f}% threads {threads}")
    ours.send("stop")
    child.join()


if __name__ == "__main__":
    main()
