"""GPU data plane: cross-process GPU->GPU writes, and local host<->GPU staging vs torch.

Reproduce on the GPU machine (one call, ~1-2 min; wheels as docs/performance.md says)::

    UCX_LOG_LEVEL=info python3 bench/gpu.py --json gpu.json

1. **Cross-process, same GPU.** Two processes, each a :class:`NixlTransport` over a torch
   CUDA tensor (the node's data plane, peer mode); each WRITEs blocks into the other's
   region (a fetch is the producer writing into the consumer: "both directions" is A
   fetching from B and B from A). Scattered source order (a fixed permutation), 1 GiB in
   2 MiB blocks and 256 MiB in 64 KiB blocks. Timed: post + polling to DONE + release.
   Also a raw NIXL READ over the same registration (the transport itself only writes), to
   show ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``'s effect. Every transfer is byte-checked once.
   Target: >= 250 GB/s at 2 MiB both directions.
2. **Local staging.** :mod:`p2pkv.staging` (the loopback agent, cuda_copy) copies 256 MiB
   of scattered blocks between a pinned host tensor and a GPU tensor, against torch
   copying the same blocks in the same order, captured in one CUDA graph and replayed
   (H2D and D2H, 2 MiB and 64 KiB). Target: NIXL >= 0.8 x torch. The copy is cut over
   the staging lanes (``P2PKV_STAGING_LANES``, default by core count; the JSON records it).

Medians of ``--reps`` repetitions after two warm-ups. ``--json PATH`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

MiB = 1 << 20
CROSS = {2 * MiB: 512, 64 * 1024: 4096}  # block_len -> blocks per region (1 GiB, 256 MiB)
STAGE_BYTES = 256 * MiB
CROSS_TARGET_GBS = 250.0
STAGE_TARGET = 0.8


def _order(torch: Any, n: int, seed: int) -> list[int]:
    """Which source block goes to slot i: a fixed permutation (``scattered``, the default:
    one descriptor per block), or the identity (``contiguous``: NIXL merges the adjacent
    descriptors of a run). Spawned children read the choice from the environment."""
    if os.environ.get("P2PKV_BENCH_ORDER", "scattered") == "contiguous":
        return list(range(n))
    return list(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist())


def _source(torch: Any, seed: int, n: int, block_len: int, device: str) -> Any:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(
        0, 256, (n, block_len), generator=gen, dtype=torch.uint8, device=device
    ).reshape(-1)


def _transport(
    torch: Any, name: str, seed: int, n: int, block_len: int, device: str
) -> tuple[Any, Any]:
    from p2pkv.transport import _nixl_agent
    from p2pkv.transport.base import RegionLayout
    from p2pkv.transport.nixl import NixlTransport

    threads = os.environ.get("P2PKV_BENCH_GPU_THREADS")
    if threads:
        _nixl_agent.GPU_BACKEND_PARAMS["num_threads"] = threads
    region = _source(torch, seed, n, block_len, device)
    layout = RegionLayout(int(region.data_ptr()), n, block_len)
    return region, NixlTransport.create(agent_name=name, region=region, layout=layout)


def _write_all(tp: Any, peer: Any, local: list[int], remote: list[int]) -> float:
    from p2pkv.transport.base import TransferState

    t0 = time.perf_counter()
    h = tp.post_write(peer, local, remote)
    while (state := tp.poll(h)) is TransferState.PROC:
        pass
    tp.release(h)
    dt = time.perf_counter() - t0
    if state is not TransferState.DONE:
        raise RuntimeError(f"write ended {state}: {tp.failure(h)!r}")
    return dt


def _read_all(tp: Any, peer: Any, local: list[int], remote: list[int]) -> float:
    shared = tp._state.shared
    agent = shared.agent
    t0 = time.perf_counter()
    with shared.call_lock:
        x = agent.make_prepped_xfer("READ", shared.local_dlist, local, peer.native.dlist, remote)
        state = agent.transfer(x)
        while state == "PROC":
            state = agent.check_xfer_state(x)
        agent.release_xfer_handle(x)
    dt = time.perf_counter() - t0
    if state != "DONE":
        raise RuntimeError(f"read ended {state}")
    return dt


def _peer_side(
    conn: Any, role: str, seed: int, other_seed: int, reps: int, device: str
) -> dict[str, Any]:
    """Both processes run this: for each block size, exchange metadata, then take turns
    being the initiator (timing) and the target (making progress)."""
    import torch

    from p2pkv.transport.base import RegionLayout

    results: dict[str, Any] = {}
    for block_len, full in CROSS.items():
        n = full if device != "cpu" else full // 32  # a dry run: small
        region, tp = _transport(torch, f"bench-{role}-{block_len}", seed, n, block_len, device)
        conn.send((tp.agent_name, tp.metadata(), tp.layout.base_addr))
        name, metadata, base = conn.recv()
        peer = tp.add_remote_peer(name, metadata, RegionLayout(base, n, block_len))
        perm = _order(torch, n, block_len)
        ident = list(range(n))
        for turn in ("a", "b"):
            if turn == role:
                conn.recv()  # the target is progressing
                row: dict[str, Any] = {}
                for op, fn in (("write", _write_all), ("read", _read_all)):
                    times = [fn(tp, peer, perm, ident) for _ in range(reps + 2)][2:]
                    row[op] = n * block_len / statistics.median(times) / 1e9
                    if op == "write":  # the peer checks what landed in its region
                        conn.send("check")
                        if conn.recv() != "ok":
                            raise RuntimeError("written bytes differ")
                    else:
                        want = _source(torch, other_seed, n, block_len, device).view(n, block_len)
                        got = region.view(n, block_len)[perm]
                        if not torch.equal(got, want):
                            raise RuntimeError("read bytes differ")
                        region.copy_(_source(torch, seed, n, block_len, device))
                conn.send("done")
                results[f"{block_len}"] = row
            else:
                conn.send("ready")
                while True:
                    while not conn.poll():
                        tp.progress()
                    msg = conn.recv()
                    if msg == "done":
                        break
                    # Our block i came from the initiator's block perm[i].
                    want = _source(torch, other_seed, n, block_len, device).view(n, block_len)[perm]
                    got = region.view(n, block_len)
                    same = torch.equal(got, want)
                    region.copy_(_source(torch, seed, n, block_len, device))  # for the reads
                    if device != "cpu":
                        torch.cuda.synchronize()
                    conn.send("ok" if same else "bad")
        tp.close()
        del region
    return results


def cross_process(reps: int, device: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_child_main, args=(theirs, reps, device))
    child.start()
    try:
        mine = _peer_side(ours, "a", 1, 2, reps, device)
        other = ours.recv()
    finally:
        child.join(60)
    out: dict[str, Any] = {}
    for block_len in CROSS:
        k = f"{block_len}"
        out[k] = {
            "a_to_b_write_GBps": mine[k]["write"],
            "b_to_a_write_GBps": other[k]["write"],
            "a_from_b_read_GBps": mine[k]["read"],
            "b_from_a_read_GBps": other[k]["read"],
        }
    return out


def _child_main(conn: Any, reps: int, device: str) -> None:
    conn.send(_peer_side(conn, "b", 2, 1, reps, device))


def _graph(torch: Any, dst: Any, src: Any, perm: list[int]) -> Any:
    """One CUDA graph copying block ``src[perm[i]]`` into ``dst[i]`` for every i."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        for i, j in enumerate(perm):
            dst[i].copy_(src[j], non_blocking=True)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i, j in enumerate(perm):
            dst[i].copy_(src[j], non_blocking=True)
    return g


def _time_graph(torch: Any, g: Any, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return STAGE_BYTES / statistics.median(times[2:]) / 1e9


def _stage(src: Any, s: list[int], dst: Any, d: list[int], op: str) -> None:
    """dst[d[i]] <- src[s[i]] through the loopback agent; ``op`` READ pulls (the
    destination is the local side) instead of pushing (:meth:`LoopbackAgent.copy`)."""
    if op == "WRITE":
        src.agent.copy(src, s, dst, d)
        return
    agent = src.agent
    with agent.lock:  # lane 0 alone: READ is the slower variant, kept for comparison
        nx = agent.lanes[0].agent
        x = nx.make_prepped_xfer("READ", dst.lanes[0].local_dlist, d, src.lanes[0].loop_dlist, s)
        state = nx.transfer(x)
        while state == "PROC":
            state = nx.check_xfer_state(x)
        nx.release_xfer_handle(x)
    if state != "DONE":
        raise RuntimeError(f"staging READ ended {state}")


def staging_vs_torch(reps: int, op: str) -> dict[str, Any]:
    import torch

    from p2pkv import staging

    out: dict[str, Any] = {}
    for block_len in (2 * MiB, 64 * 1024):
        n = STAGE_BYTES // block_len
        host = torch.randint(0, 256, (STAGE_BYTES,), dtype=torch.uint8).pin_memory()
        back = torch.zeros(STAGE_BYTES, dtype=torch.uint8).pin_memory()
        gpu = torch.zeros(STAGE_BYTES, dtype=torch.uint8, device="cuda")
        perm = _order(torch, n, 7)
        ident = list(range(n))
        hv, gv, bv = (t.view(n, block_len) for t in (host, gpu, back))

        h2d_graph, d2h_graph = _graph(torch, gv, hv, perm), _graph(torch, bv, gv, perm)
        row: dict[str, float] = {
            "torch_h2d_GBps": _time_graph(torch, h2d_graph, reps),
            "torch_d2h_GBps": _time_graph(torch, d2h_graph, reps),
        }
        del h2d_graph, d2h_graph
        gpu.zero_()
        back.zero_()
        torch.cuda.synchronize()
        h, g_, b = (staging.attach_region(t, block_len) for t in (host, gpu, back))
        out["lanes"] = len(h.agent.lanes)
        try:
            for name, src, dst in (("h2d", h, g_), ("d2h", g_, b)):
                times = []
                for _ in range(reps + 2):
                    t0 = time.perf_counter()
                    _stage(src, perm, dst, ident, op)
                    times.append(time.perf_counter() - t0)
                row[f"nixl_{name}_GBps"] = STAGE_BYTES / statistics.median(times[2:]) / 1e9
        finally:
            for r in (h, g_, b):
                r.release()
        # GPU slot i holds host block perm[i]; back slot i holds GPU block perm[i].
        if not (torch.equal(gv.cpu(), hv[perm]) and torch.equal(bv, hv[perm][perm])):
            raise RuntimeError("staged bytes differ")
        row["h2d_ratio"] = row["nixl_h2d_GBps"] / row["torch_h2d_GBps"]
        row["d2h_ratio"] = row["nixl_d2h_GBps"] / row["torch_d2h_GBps"]
        out[f"{block_len}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--skip-cross", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of part 1 only")
    parser.add_argument("--skip-staging", action="store_true")
    parser.add_argument(
        "--gpu-threads", type=int, default=0, help="UCX num_threads of the agents over VRAM"
    )
    parser.add_argument(
        "--op", choices=("WRITE", "READ"), default="WRITE", help="staging: NIXL operation"
    )
    parser.add_argument(
        "--order",
        choices=("scattered", "contiguous"),
        default="scattered",
        help="slot order of every transfer (default: scattered, one descriptor per block)",
    )
    args = parser.parse_args(argv)
    os.environ["P2PKV_BENCH_ORDER"] = args.order  # the spawned children read it too
    for key, value in (
        ("UCX_MEM_MMAP_HOOK_MODE", "none"),
        ("UCX_NET_DEVICES", "lo"),  # one host
        ("NIXL_LOG_LEVEL", "WARN"),
    ):
        os.environ.setdefault(key, value)
    import torch

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
    }
    ok = True
    if args.gpu_threads:  # the spawned child reads it too
        os.environ["P2PKV_BENCH_GPU_THREADS"] = str(args.gpu_threads)
    if not args.skip_cross:
        result["cross_process"] = cross = cross_process(args.reps, args.device)
        for block_len, row in cross.items():
            print(f"cross-process {int(block_len) // 1024} KiB: " + json.dumps(row), flush=True)
        big = cross[f"{2 * MiB}"]
        ok &= min(big["a_to_b_write_GBps"], big["b_to_a_write_GBps"]) >= CROSS_TARGET_GBS
    result["gpu_threads"] = args.gpu_threads
    result["order"] = args.order
    result["staging_op"] = args.op
    staged = args.device == "cuda" and not args.skip_staging
    stage = staging_vs_torch(args.reps, args.op) if staged else {}
    result["staging"] = stage
    result["staging_lanes"] = stage.pop("lanes", None)
    for block_len, row in stage.items():
        print(f"staging {int(block_len) // 1024} KiB: " + json.dumps(row), flush=True)
        ok &= min(row["h2d_ratio"], row["d2h_ratio"]) >= STAGE_TARGET
    result["pass"] = bool(ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print("PASS" if ok else "FAIL", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
