"""vLLM's built-in ``p2p`` tier against p2pkv's tier, through vLLM 0.33's own tiering manager.

Reproduce (needs ``bash scripts/setup.sh``, which installs vLLM lean; a few minutes)::

    PYTHONPATH=. .venv/bin/python bench/vllm_tier.py [--n 1024 --chunk-mib 2 --reps 5]

Both tiers run on the same two-process harness as tests/test_vllm_tier.py
(tests/vllm_harness.py): a real ``TieringOffloadingManager`` per process, driven the way
vLLM's scheduler drives it, every byte of every pull checked. Per repetition, and in
alternating order (which tier goes first flips each repetition), each tier gets fresh
processes and measures:

* ``warm idle``: a pull of N chunks over a session that is already up (a 4-chunk pull warmed
  it), source idle. Time = from the request's arrival to the step where every chunk is a HIT.
* ``cold, source sleeping``: a brand-new consumer pulls the same N chunks from the source
  while the source "runs the model" in 1 s steps (``time.sleep``; vLLM's lock is free).
* ``idle CPU``: over ``--idle-s`` seconds with the session connected and nothing to do, the
  CPU of the tier's own threads in each process (every thread except the harness's scheduler
  thread and command loop and vLLM's ``vllm_offload_tier_poll``), then those two separately;
  and the tier's own share of vLLM's poll thread: the microseconds its ``get_finished_jobs``
  plus ``serve_external_requests`` take per idle round (vLLM runs a round every 1 ms).

If p2pkv's tier does not import, only the built-in tier runs, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import vllm_harness as H

SEED = 11
WARMUP_KEYS = 4
HARNESS_THREADS = {"MainThread", H.SCHEDULER_THREAD}


def tier_configs() -> tuple[dict[str, Callable[[int], dict[str, Any]]], str | None]:
    tiers: dict[str, Callable[[int], dict[str, Any]]] = {"built-in p2p": H.builtin_tier}
    missing = H.p2pkv_tier_missing()
    if missing is None:
        tiers["p2pkv"] = H.p2pkv_tier
    return tiers, missing


def cpu_split(
    before: list[dict[str, Any]], after: list[dict[str, Any]], secs: float
) -> dict[str, float]:
    """% of a core over ``secs``: tier threads, vLLM's poll thread, the harness's threads."""
    start = {t["tid"]: t["cpu_s"] for t in before}
    out = {"tier": 0.0, "poll": 0.0, "harness": 0.0}
    for t in after:
        used = t["cpu_s"] - start.get(t["tid"], 0.0)
        if t["name"] == H.POLL_THREAD:
            out["poll"] += used
        elif t["name"] in HARNESS_THREADS:
            out["harness"] += used
        else:
            out["tier"] += used
    return {k: 100.0 * v / secs for k, v in out.items()}


def one_rep(
    ctx: Any, make: Callable[[int], dict[str, Any]], args: argparse.Namespace
) -> dict[str, float]:
    chunks = args.n + WARMUP_KEYS + 8
    size = int(args.chunk_mib * (1 << 20))
    keys = H.make_keys(f"bench-{time.monotonic_ns()}", args.n)
    warm = H.make_keys(f"warmup-{time.monotonic_ns()}", WARMUP_KEYS)
    out: dict[str, float] = {}
    with H.nodes(ctx) as started:

        def start(name: str) -> H.VllmNode:
            node = H.VllmNode(
                ctx, make(H.free_port()), num_chunks=chunks, chunk_bytes=size, name=name
            )
            started.append(node)
            return node

        src, dst = start("src"), start("dst")
        src.fill(keys + warm, SEED)
        assert H.bytes_ok(dst.pull(src, "warmup", warm, seed=SEED, timeout_s=120.0))
        result = dst.pull(src, "warm", keys, seed=SEED, timeout_s=120.0)
        assert H.bytes_ok(result), f"warm pull not byte-exact: {set(result['outcome'])}"
        out["warm_idle_s"] = result["elapsed_s"]

        before = [dst.thread_cpu(), src.thread_cpu()]
        time.sleep(args.idle_s)  # the measurement window itself
        after = [dst.thread_cpu(), src.thread_cpu()]
        for role, b, a in zip(("consumer", "source"), before, after, strict=True):
            for part, pct in cpu_split(b, a, args.idle_s).items():
                out[f"idle_{role}_{part}_pct"] = pct

        # The tier's share of vLLM's tier-poll thread: what one idle round asks of it, in
        # us per call, as % of a core at the default 1 ms interval.
        cost = dst.poll_round_cost()
        out["idle_poll_round_us"] = sum(cost.values())
        out["idle_poll_round_pct"] = sum(cost.values()) / 1000.0 * 100.0

        src.set_step(1.0, "sleep")
        cold = start("dst-cold")
        result = cold.pull(src, "cold", keys, seed=SEED, timeout_s=120.0)
        assert H.bytes_ok(result), f"cold pull not byte-exact: {set(result['outcome'])}"
        out["cold_sleeping_s"] = result["elapsed_s"]
        out["cold_over_warm"] = out["cold_sleeping_s"] / out["warm_idle_s"]
    return out


ROWS = [
    ("warm_idle_s", "warm-idle pull (s)"),
    ("cold_sleeping_s", "cold pull, source sleeping in 1 s steps (s)"),
    ("cold_over_warm", "cold-sleeping / warm-idle"),
    ("idle_consumer_tier_pct", "idle CPU, consumer, tier threads (% core)"),
    ("idle_source_tier_pct", "idle CPU, source, tier threads (% core)"),
    ("idle_consumer_poll_pct", "idle CPU, consumer, vllm_offload_tier_poll (% core)"),
    ("idle_source_poll_pct", "idle CPU, source, vllm_offload_tier_poll (% core)"),
    ("idle_consumer_harness_pct", "idle CPU, consumer, harness scheduler loop (% core)"),
    ("idle_poll_round_us", "tier calls of one idle tier-poll round (us)"),
    ("idle_poll_round_pct", "the same at the 1 ms poll interval (% core)"),
]


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1024, help="chunks per pull")
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="paired repetitions")
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window (s)")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if (missing := H.vllm_missing()) is not None:
        sys.exit(missing)
    tiers, p2pkv_missing = tier_configs()
    ctx = H.forkserver()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in tiers}
    order = list(tiers)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            runs[name].append(one_rep(ctx, tiers[name], args))
            print(f"rep {rep + 1}/{args.reps} {name}: {runs[name][-1]}", file=sys.stderr)

    load = os.getloadavg()
    print(f"## vLLM tier bench: {args.n} x {args.chunk_mib:g} MiB, {args.reps} paired reps\n")
    print(
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. "
        "Median [min-max]."
    )
    if p2pkv_missing is not None:
        print(f"\np2pkv's tier did not load ({p2pkv_missing}): built-in tier only.")
    names = list(tiers)
    ratio = "built-in / p2pkv" if len(names) == 2 else ""
    print("\n| metric | " + " | ".join(names) + (f" | {ratio} (medians) |" if ratio else " |"))
    print("|---" * (len(names) + 1 + bool(ratio)) + "|")
    for key, label in ROWS:
        cells = [fmt([r[key] for r in runs[n]]) for n in names]
        if ratio:
            a, b = (statistics.median(r[key] for r in runs[n]) for n in names)
            cells.append(f"{a / b:.2f}" if b else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "cores": os.cpu_count(),
                    "load": load,
                    "p2pkv_missing": p2pkv_missing,
                    "runs": runs,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
