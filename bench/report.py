"""Run every benchmark, keep the raw results, and write docs/performance.md with plots.

Reproduce::

    .venv/bin/python bench/report.py run            # every bench on this machine (~25 min)
    .venv/bin/python bench/report.py run --only cold_pull,idle_cpu --quick
    .venv/bin/python bench/report.py render         # docs/performance.md + docs/perf/*.png

``run`` calls each benchmark script with ``--json`` and files the result under
``bench/results/<machine>/<bench>.json`` next to ``_machine.json`` (cores, CPU model, GPU,
load average before and after, date), so every table says which machine it came from.
``_machine.json`` is rewritten by every run, ``--only`` runs too, so each result also keeps
the load average around its own bench (``_run``), and its section prints that.
A bench that fails or is not available here (vLLM not installed, no GPU) is skipped with its
reason in ``_skipped.json``; nothing stale is kept for it. ``--machine NAME`` names the
folder (default: ``<cores>core-<gpu or cpu>``), which is how results from the GPU machine
(run there with ``--only ...``, brought back as files) sit beside this machine's.

``render`` needs only the JSON files (and matplotlib): one section per bench, each table
the median of its paired repetitions with min-max, the command that reproduces it, the
machine and the date; hand-written analysis for a bench lives in ``bench/notes/<bench>.md``
and is pasted under its table. The renderer of each bench is beside its entry in BENCHES.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NOTES = ROOT / "bench" / "notes"
DOC = ROOT / "docs" / "performance.md"
IMG = ROOT / "docs" / "perf"

Json = dict[str, Any]


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    argv: Callable[[bool], list[str]]  # quick -> arguments after the script path
    render: Callable[[Json, str], str]  # (result, machine) -> markdown (may write plots)
    needs: str = ""  # "vllm" or "gpu": skipped where missing
    timeout_s: float = 1800.0
    file: str = ""  # the script, when it is not bench/<name>.py

    @property
    def script(self) -> Path:
        return ROOT / "bench" / f"{self.file or self.name}.py"

    def command(self, quick: bool) -> str:
        script = f"bench/{self.file or self.name}.py"
        return " ".join([".venv/bin/python", script, *self.argv(quick)])


# ---------------------------------------------------------------- helpers for renderers


def num(x: float, digits: int = 3) -> str:
    """``digits`` significant digits, but never an exponent: 1,399 rather than 1.4e+03."""
    return f"{x:,.0f}" if abs(x) >= 10 ** (digits - 1) else f"{x:.{digits}g}"


def fmt_range(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    v = [x * scale for x in values]
    return f"{num(statistics.median(v), digits)} [{num(min(v), digits)}-{num(max(v), digits)}]"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot(name: str, draw: Callable[[Any], None], size: tuple[float, float] = (6.0, 3.4)) -> str:
    """Draw with matplotlib into docs/perf/<name>.png; returns the markdown image link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size, dpi=110)
    draw(ax)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / f"{name}.png")
    plt.close(fig)
    return f"![{name}](perf/{name}.png)"


# ---------------------------------------------------------------- renderers


def render_vllm_tier(res: Json, machine: str) -> str:
    runs: dict[str, list[Json]] = res["runs"]
    names = list(runs)
    rows_def = [
        ("warm_idle_s", "warm-idle pull (s)", 1.0),
        ("cold_sleeping_s", "cold pull, source sleeping in 1 s steps (s)", 1.0),
        ("cold_over_warm", "cold-sleeping / warm-idle", 1.0),
        ("idle_consumer_tier_pct", "idle CPU of the tier's threads, consumer (% of a core)", 1.0),
        ("idle_source_tier_pct", "idle CPU of the tier's threads, source (% of a core)", 1.0),
        ("idle_poll_round_us", "tier calls in one idle tier-poll round (µs)", 1.0),
    ]
    rows = []
    for key, label, scale in rows_def:
        cells = [fmt_range([r[key] for r in runs[n]], scale) for n in names]
        if len(names) == 2:
            a, b = (statistics.median(r[key] for r in runs[n]) for n in names)
            cells.append(f"{a / b:.2f}" if b else "-")
        rows.append([label, *cells])
    header = ["metric", *names] + (["ratio of medians"] if len(names) == 2 else [])
    out = [table(header, rows)]

    def bars(ax: Any) -> None:
        keys = [("warm_idle_s", "warm idle"), ("cold_sleeping_s", "cold, source sleeping")]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            meds = [statistics.median(r[k] for r in runs[n]) for k, _ in keys]
            lo = [m - min(r[k] for r in runs[n]) for m, (k, _) in zip(meds, keys, strict=True)]
            hi = [max(r[k] for r in runs[n]) - m for m, (k, _) in zip(meds, keys, strict=True)]
            xs = [j + i * width for j in range(len(keys))]
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=n)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))])
        ax.set_xticklabels([label for _, label in keys])
        ax.set_ylabel("seconds (median, min-max)")
        ax.set_title(f"{res['args']['n']} x {res['args']['chunk_mib']:g} MiB through vLLM")
        ax.legend()

    out.append(plot(f"vllm_tier-{machine}", bars))
    return "\n\n".join(out)


def render_cold_pull(res: Json, machine: str) -> str:
    times: dict[str, list[float]] = res["times_s"]
    base = statistics.median(times["warm, idle"])
    a = res["args"]
    rows = []
    for cond, values in times.items():
        kind, mode = cond.split(", ")
        conn = res["connect_s"].get(mode, []) if kind == "cold" else []
        rows.append(
            [
                cond,
                fmt_range(values, 1e3) + " ms",
                f"{statistics.median(values) / base:.2f} x",
                fmt_range(conn, 1e3) + " ms" if conn else "",
            ]
        )
    size = a["blocks"] * a["block_len"]
    out = [
        f"{a['blocks']:,} x {a['block_len'] // 1024} KiB = {size / 2**20:,.0f} MiB, "
        f"{a['reps']} reps; warm idle {size / base / 1e9:.2f} GB/s."
        + (
            f" The source's switch interval while its node ran: {a['interval_us']:.0f} us."
            if "interval_us" in a
            else ""
        )
        + (
            " Its spinning host's own work while a pull ran: "
            f"{statistics.median(r[0] for r in rates):,.0f} loops/s, against "
            f"{statistics.median(r[1] for r in rates):,.0f} around the pulls; host time "
            f"lost per pull {statistics.median((1 - r[0] / r[1]) * r[2] for r in rates) * 1e3:.1f}"
            " ms."
            if (rates := res.get("host_loops_per_s_during_around"))
            else ""
        ),
        table(["condition", "time", "vs warm, idle", "connect"], rows),
    ]

    def bars(ax: Any) -> None:
        conds = list(times)
        meds = [statistics.median(times[c]) * 1e3 for c in conds]
        lo = [m - min(times[c]) * 1e3 for m, c in zip(meds, conds, strict=True)]
        hi = [max(times[c]) * 1e3 - m for m, c in zip(meds, conds, strict=True)]
        ax.bar(range(len(conds)), meds, yerr=[lo, hi], capsize=3, color="tab:blue")
        ax.set_xticks(range(len(conds)))
        ax.set_xticklabels(conds, rotation=20, ha="right")
        ax.set_ylabel("ms (median, min-max)")
        ax.set_title("cold vs warm pull, source idle / busy")

    out.append(plot(f"cold_pull-{machine}", bars))
    return "\n\n".join(out)


def render_idle_cpu(res: Json, machine: str) -> str:
    rows = [
        [
            p["name"],
            str(p.get("nodes", 1)),
            str(p["peers"]),
            f"{p['core_share']:.3%}",
            f"{p['core_share'] / p.get('nodes', 1):.3%}",
            f"{p['wakeups_per_s']:.1f}",
        ]
        for p in res["processes"]
    ]
    peers = res["args"].get("peers", 1)
    header = ["process", "nodes", "peers", "CPU (of a core)", "per node", "wake-ups/s"]
    return (
        f"{res['args']['seconds']:g} s window; node-a has {peers} idle peer(s) connected "
        "(up to 16 peer nodes per process, one NIXL agent each).\n\n" + table(header, rows)
    )


def render_dataplane(res: Json, machine: str) -> str:
    def rng(x: Json, scale: float = 1.0) -> str:
        return f"{x['median'] * scale:.3g} [{x['min'] * scale:.3g}-{x['max'] * scale:.3g}]"

    rows: list[list[str]] = []
    series: dict[str, list[tuple[str, float, float]]] = {}
    for row in res["rows"]:
        bl, n = row["block_len"], row["blocks"]
        size = f"{bl // 1024} KiB" if bl < 2**20 else f"{bl // 2**20} MiB"
        for mode, m in row["modes"].items():
            gbs = {k: n * bl / m[k]["median"] / 1e9 for k in ("bare", "p2pkv")}
            extra = ""
            if "merged_ratio" in m:
                extra = f"NIXL merging the list: {rng(m['merged_ratio'])}"
            rows.append(
                [
                    mode,
                    size,
                    f"{n:,}",
                    rng(m["bare"], 1e3),
                    rng(m["p2pkv"], 1e3),
                    f"{gbs['bare']:.2f} / {gbs['p2pkv']:.2f}",
                    rng(m["ratio"]),
                    extra,
                ]
            )
            series.setdefault(mode, []).append((size, gbs["bare"], gbs["p2pkv"]))
    header = [
        "order",
        "block",
        "blocks",
        "bare per-block (ms)",
        "p2pkv (ms)",
        "GB/s bare / p2pkv",
        "p2pkv / bare",
        "",
    ]
    out = [f"{res['reps']} alternating paired reps.", table(header, rows)]

    def bars(ax: Any) -> None:
        labels = [f"{mode}\n{size}" for mode, pts in series.items() for size, _, _ in pts]
        bare = [b for pts in series.values() for _, b, _ in pts]
        p2p = [p for pts in series.values() for _, _, p in pts]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], bare, 0.4, label="bare NIXL, one descriptor per block")
        ax.bar([x + 0.2 for x in xs], p2p, 0.4, label="p2pkv node.fetch")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels)
        ax.set_ylabel("GB/s (median)")
        ax.set_title("data plane throughput by block size and slot order")
        ax.legend(fontsize=8)

    out.append(plot(f"dataplane-{machine}", bars))
    return "\n\n".join(out)


def render_control_plane(res: Json, machine: str) -> str:
    lat = res["latency_s"]
    counts = sorted(lat["p2pkv"], key=int)
    own = "bare_own" in lat  # runs until 2026-12-03 had one bare kind, in its own process
    rows = []
    for n in counts:
        ours, bare, cpu = lat["p2pkv"][n], lat["bare"][n], res["consumer_cpu_s"][n]
        r = res["ratio"][n]
        row = [
            n,
            f"{ours['p50'] * 1e3:.3f} / {ours['p99'] * 1e3:.3f}",
            f"{bare['p50'] * 1e3:.3f} / {bare['p99'] * 1e3:.3f}",
            f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]",
        ]
        if own:
            o, q = lat["bare_own"][n], res["ratio_own"][n]
            row += [
                f"{o['p50'] * 1e3:.3f} / {o['p99'] * 1e3:.3f}",
                f"{q['median']:.2f} [{q['min']:.2f}-{q['max']:.2f}]",
            ]
        rows.append([*row, f"{cpu['p50'] * 1e6:.0f}"])
    where = " (answered in the source's process)" if own else ""
    header = [
        "keys",
        "p2pkv p50 / p99 (ms)",
        f"bare Trio TCP{where} p50 / p99 (ms)",
        "p2pkv / bare (p50, per rep)",
    ]
    if own:
        header += ["bare_own (a process of its own) p50 / p99 (ms)", "p2pkv / bare_own"]
    header.append("consumer Trio-thread CPU p50 (us)")
    verdicts = [
        f"{'PASS' if t['pass'] else 'FAIL'} {name}: {t['got']:.3g} (target <= {t['limit']:.3g})"
        for name, t in res["targets"].items()
    ]
    closed_by = "release" if res.get("close") == "release" else "one-block fetch"
    out = [
        f"{res['samples_per_kind']} samples per kind in {res['reps']} alternating reps; "
        f"each p2pkv round closed, untimed, by a {closed_by}.",
        table(header, rows),
        "; ".join(verdicts) + ".",
    ]

    def lines(ax: Any) -> None:
        xs = [int(n) for n in counts]
        styles = (("p2pkv", "o-"), ("bare", "s--"), ("bare_own", "^:"))
        for kind, style in [(k, st) for k, st in styles if k in lat]:
            ax.plot(xs, [lat[kind][n]["p50"] * 1e3 for n in counts], style, label=f"{kind} p50")
            ax.plot(
                xs,
                [lat[kind][n]["p99"] * 1e3 for n in counts],
                style,
                alpha=0.4,
                label=f"{kind} p99",
            )
        ax.set_xscale("log")
        ax.set_xlabel("keys per lookup")
        ax.set_ylabel("round trip (ms)")
        ax.set_title("lookup latency against key count")
        ax.legend(fontsize=8)

    out.append(plot(f"control_plane-{machine}", lines))
    return "\n\n".join(out)


def render_python_cost(res: Json, machine: str) -> str:
    from python_cost import figures, fixed_and_marginal  # bench/ is on sys.path as a script

    sizes = sorted(res["sizes"], key=int)
    variants = ["p2pkv"] + (["baseline"] if res.get("baseline") else [])
    per_block: dict[str, list[float]] = {v: [] for v in variants}
    rows = []
    for size in sizes:
        n, r = int(size), res["sizes"][size]
        for v in variants:
            fig = figures(r, v, n)
            python = fig.get("python", fig["over bare"])  # older results: over bare only
            per_block[v].append(statistics.median(python))
            rows.append(
                [f"{n:,}", v]
                + [fmt_range(fig[c]) if c in fig else "n/a" for c in ("python", "copy")]
                + [fmt_range(fig[c]) for c in ("total", "over bare", "trio threads")]
            )
    header = [
        "blocks",
        "code",
        "Python us per block",
        "its copy",
        "total CPU",
        "total minus a bare NIXL pair",
        "the two Trio threads",
    ]
    cycles = res.get("cycles")  # absent from results before 2026-12-03: one cycle a rep
    each = (
        "each rep a lone cycle"
        if not cycles
        else "each rep "
        + ", ".join(
            f"{int(c)} x {int(n):,}" for n, c in sorted(cycles.items(), key=lambda kv: int(kv[0]))
        )
        + " blocks, its cycles back to back; figures per cycle"
    )
    out = [
        f"{res['block_len'] // 1024} KiB blocks, {res['reps']} alternating reps ({each}), "
        "us per block. Python = both processes' CPU for a lookup + fetch cycle minus the CPU "
        "the producer's data plane spent inside its post calls in that cycle (NIXL's "
        "transfer(): the copy); beside it, the same total minus a bare NIXL pair's CPU for the "
        "same writes, a difference of two independent copies. Target (issue 9): <= 3 us per "
        "block at 4,096 blocks, flat from 256 to 16,384.",
        table(header, rows),
    ]
    for v in variants:
        split = fixed_and_marginal(res["sizes"], v)
        if split:
            steps = ", ".join(
                f"{k.replace('-', ' to ')}: {x:.2f}" for k, x in split.items() if "-" in k
            )
            out.append(
                f"Fixed and marginal ({v}; a least-squares line through the medians' Python "
                f"CPU per cycle): {split['fixed'] / 1000:.2f} ms per cycle + "
                f"{split['marginal']:.2f} us per block. What one more block costs, between "
                f"adjacent sizes, us: {steps}."
            )

    def lines(ax: Any) -> None:
        xs = [int(s) for s in sizes]
        for v, ys in per_block.items():
            ax.plot(xs, ys, "o-", label=v)
        ax.axhline(3.0, color="gray", linestyle=":", label="target")
        ax.set_xscale("log")
        ax.set_xlabel("blocks per fetch")
        ax.set_ylabel("Python us per block (median)")
        ax.set_title("engine Python cost per block")
        ax.legend(fontsize=8)

    out.append(plot(f"python_cost-{machine}", lines))
    return "\n\n".join(out)


def render_store_ops(res: Json, machine: str) -> str:
    """The store's engine-side ops per key (thread CPU), and a 262,144-block store's cost."""
    ops = res["ops"]["new"]["thread CPU"]
    sizes = sorted(ops, key=int)
    names = [op for op in ops[sizes[0]] if op != "cycle"] + ["cycle"]

    def cell(x: Json) -> str:
        return f"{x['median']:.0f} [{x['min']:.0f}-{x['max']:.0f}]"

    rows = [[op, *(cell(ops[n][op]) for n in sizes)] for op in names]
    out = (
        "ns per key of the calling thread's CPU, median [min-max] of the reps; `cycle` is "
        "what one lookup + fetch asks of the two stores (pin, unpin, present, reserve, "
        "commit_many).\n\n" + table(["op", *(f"{int(n):,} keys" for n in sizes)], rows)
    )
    if "old" in res["ops"]:
        old = res["ops"]["old"]["thread CPU"]
        ratios = [
            f"{int(n):,} keys: {ops[n]['cycle']['median'] / old[n]['cycle']['median']:.2f}"
            for n in sizes
        ]
        out += "\n\nCycle, new / old store in the same run: " + ", ".join(ratios) + "."
    sc = res["scale"]["new"]
    out += (
        f"\n\nA 262,144-block store opens in {sc['open_s'] * 1e3:.1f} ms (target <= 0.5 s) "
        f"and holds {sc['bytes_per_block_empty']:.0f} B of Python heap per block empty, "
        f"{sc['bytes_per_block_full']:.0f} B full (target <= 100 B; the keys' own bytes not "
        "counted)."
    )
    return out


def render_gpu(res: Json, machine: str) -> str:
    rows = []
    for bl, r in sorted(res.get("cross_process", {}).items(), key=lambda kv: -int(kv[0])):
        size = f"{int(bl) // 1024} KiB" if int(bl) < 2**20 else f"{int(bl) // 2**20} MiB"
        rows.append(
            [
                f"cross-process {size}, WRITE A->B / B->A (GB/s)",
                f"{r['a_to_b_write_GBps']:.1f} / {r['b_to_a_write_GBps']:.1f}",
                ">= 250 at 2 MiB" if int(bl) == 2**21 else "",
            ]
        )
    for bl, r in sorted(res.get("staging", {}).items(), key=lambda kv: -int(kv[0])):
        size = f"{int(bl) // 1024} KiB" if int(bl) < 2**20 else f"{int(bl) // 2**20} MiB"
        for d in ("h2d", "d2h"):
            rows.append(
                [
                    f"staging {size} {d.upper()}: p2pkv / torch CUDA graph (GB/s)",
                    f"{r[f'nixl_{d}_GBps']:.1f} / {r[f'torch_{d}_GBps']:.1f} "
                    f"({r[f'{d}_ratio']:.2f} x)",
                    ">= 0.8 x",
                ]
            )
    return (
        f"{res.get('gpu', '?')}, torch {res.get('torch', '?')}, slot order "
        f"{res.get('order', 'scattered')}; medians of the bench's repetitions.\n\n"
        + table(["what", "measured", "target"], rows)
    )


BENCHES: list[Bench] = [
    Bench(
        "cold_pull",
        "Cold pull from a busy source vs warm idle pull",
        lambda quick: ["--quick"] if quick else [],
        render_cold_pull,
    ),
    Bench(
        "dataplane",
        "Data plane: node.fetch against bare NIXL",
        lambda quick: ["--quick"] if quick else [],
        render_dataplane,
    ),
    Bench(
        "control_plane",
        "Control plane: lookup round trip",
        # 15 reps of 60 samples: the median ratio of 5 moved by +-0.3 between runs minutes
        # apart on the GPU machine (its cores are shared).
        lambda quick: ["--quick"] if quick else ["--sweep", "--reps", "15", "--samples", "900"],
        render_control_plane,
    ),
    Bench(
        "python_cost",
        "Python CPU per block of a lookup + fetch",
        lambda quick: ["--quick"] if quick else ["--reps", "9"],
        render_python_cost,
    ),
    Bench(
        "store_ops",
        "The store: engine-side ops per key, and a 262,144-block store",
        lambda quick: ["--reps", "5", "--sizes", "256", "4096"] if quick else [],
        render_store_ops,
    ),
    Bench(
        "gpu",
        "GPU regions: cross-process GPU->GPU and local staging (scattered blocks)",
        lambda quick: ["--reps", "3"] if quick else ["--reps", "20"],
        render_gpu,
        needs="gpu",
    ),
    Bench(
        "gpu_contiguous",
        "GPU regions: the same with contiguous runs (coalesced descriptors)",
        lambda quick: ["--order", "contiguous"] + (["--reps", "3"] if quick else ["--reps", "20"]),
        render_gpu,
        needs="gpu",
        file="gpu",
    ),
    Bench(
        "idle_cpu",
        "Idle engine",
        lambda quick: ["--quick"] if quick else [],
        render_idle_cpu,
    ),
    Bench(
        "idle_peers",
        "Idle engine with 64 peers connected",
        lambda quick: ["--peers", "64"] + (["--quick"] if quick else ["--seconds", "10"]),
        render_idle_cpu,
        file="idle_cpu",
    ),
    Bench(
        "vllm_tier",
        "Inside vLLM 0.33: p2pkv's tier against the built-in `p2p` tier",
        lambda quick: ["--reps", "1", "--n", "128"] if quick else ["--reps", "5"],
        render_vllm_tier,
        needs="vllm",
        timeout_s=3600.0,
    ),
]


# ---------------------------------------------------------------- machine


def machine_info() -> Json:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = ""
    if shutil.which("nvidia-smi"):
        q = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        done = subprocess.run(q, capture_output=True, text=True, check=False)
        gpu = ", ".join(sorted(set(done.stdout.split("\n")) - {""}))
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "gpu": gpu,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def default_machine_name(info: Json) -> str:
    return f"{info['cores']}core-{'gpu' if info['gpu'] else 'cpu'}"


def missing(bench: Bench) -> str | None:
    if not bench.script.exists():
        return f"bench/{bench.name}.py does not exist"
    if bench.needs == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            return "vLLM is not installed (bash scripts/setup.sh installs it)"
    if bench.needs == "gpu":
        try:
            import torch

            if not torch.cuda.is_available():
                return "no CUDA device"
        except ImportError:
            return "torch is not installed"
    return None


# ---------------------------------------------------------------- commands


def run(args: argparse.Namespace) -> int:
    info = machine_info()
    folder = RESULTS / (args.machine or default_machine_name(info))
    folder.mkdir(parents=True, exist_ok=True)
    chosen = [b for b in BENCHES if not args.only or b.name in args.only.split(",")]
    info["load_before"] = os.getloadavg()
    info["benches"] = [b.name for b in chosen]  # whose run the load average above is
    # A run of some benches keeps the skip reasons of the others (their results stay too).
    skipped: Json = {}
    kept = folder / "_skipped.json"
    if kept.exists():
        names = {b.name for b in chosen}
        skipped = {k: v for k, v in json.loads(kept.read_text()).items() if k not in names}
    failed = 0
    for bench in chosen:
        out = folder / f"{bench.name}.json"
        reason = missing(bench)
        if reason is not None:
            skipped[bench.name] = reason
            out.unlink(missing_ok=True)
            print(f"skip {bench.name}: {reason}", file=sys.stderr)
            continue
        cmd = [sys.executable, str(bench.script), *bench.argv(args.quick), "--json", str(out)]
        print(f"run  {bench.command(args.quick)}", file=sys.stderr, flush=True)
        # The JSON is the proof that this run finished: an earlier run's must not pass for
        # it (it would be published under this run's date and command).
        out.unlink(missing_ok=True)
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        with open(folder / f"{bench.name}.txt", "w") as log:
            try:
                done = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, timeout=bench.timeout_s, check=False
                )
                status = f"exit {done.returncode}"
            except subprocess.TimeoutExpired:  # killed; the other benches still run
                status = f"timed out after {bench.timeout_s:g} s"
                out.unlink(missing_ok=True)  # whatever it left half-written
        took = time.monotonic() - t0
        load_after = os.getloadavg()[0]
        if not out.exists():  # a bench exits 1 when it misses a target; no JSON is a failure
            failed += 1
            skipped[bench.name] = f"failed ({status}); see {bench.name}.txt"
            print(f"FAIL {bench.name} after {took:.0f} s", file=sys.stderr)
            continue
        result = json.loads(out.read_text())
        result["_run"] = {
            "command": bench.command(args.quick),
            "seconds": took,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            # This bench's own: _machine.json's is the last run's, which --only may not be.
            "load_before": load_before,
            "load_after": load_after,
        }
        out.write_text(json.dumps(result, indent=1))
        print(f"done {bench.name} in {took:.0f} s", file=sys.stderr)
    info["load_after"] = os.getloadavg()
    (folder / "_machine.json").write_text(json.dumps(info, indent=1))
    (folder / "_skipped.json").write_text(json.dumps(skipped, indent=1))
    return 1 if failed else 0


def describe(info: Json) -> str:
    gpu = f", {info['gpu']}" if info.get("gpu") else ", no GPU"
    out = (
        f"{info['cores']} cores ({info['cpu']}), {info['mem_gib']} GiB{gpu}; Linux "
        f"{info['kernel']}, Python {info['python']}; {info['date']}"
    )
    if "load_before" in info:
        out += (
            f"; load average {info['load_before'][0]:.2f} before, {info['load_after'][0]:.2f} after"
        )
        if info.get("benches"):  # the last run's; each section says its own bench's
            out += f" the last `run` ({', '.join(info['benches'])})"
    return out + (f"; {info['note']}" if info.get("note") else "")


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def render(args: argparse.Namespace) -> int:
    # The plots are part of the document (issue 9): without matplotlib, the doc is left as
    # it was rather than rewritten without them (it once went a day that way unnoticed).
    if not have_matplotlib():
        print(
            f"render needs matplotlib for the plots: pip install -e '.[bench]'; {DOC} is "
            "left as it was",
            file=sys.stderr,
        )
        return 2
    machines = sorted(p for p in RESULTS.iterdir() if (p / "_machine.json").exists())
    parts = [
        "# Performance",
        "",
        "Generated by `bench/report.py render` from the raw results in `bench/results/`; do not",
        "edit by hand (analysis goes in `bench/notes/<bench>.md`). These machines are shared and",
        "noisy, so the figures that matter are **ratios measured side by side in one run**",
        "(alternating paired repetitions; median [min-max]); absolute times are context. Each",
        "section names the machine it ran on and the command that reproduces it. The targets and",
        "what each script measures: [bench/README.md](../bench/README.md).",
        "",
        "Machines:",
        "",
    ]
    infos = {}
    for m in machines:
        infos[m.name] = json.loads((m / "_machine.json").read_text())
        parts.append(f"- **{m.name}**: {describe(infos[m.name])}")
    for bench in BENCHES:
        found = [(m, m / f"{bench.name}.json") for m in machines]
        found = [(m, p) for m, p in found if p.exists()]
        skipped = {
            m.name: json.loads((m / "_skipped.json").read_text()).get(bench.name)
            for m in machines
            if (m / "_skipped.json").exists()
        }
        parts += ["", f"## {bench.title}", ""]
        if not found:
            why = "; ".join(f"{k}: {v}" for k, v in skipped.items() if v) or "never run"
            parts.append(f"No results ({why}).")
        for m, path in found:
            res = json.loads(path.read_text())
            run_info = res.get("_run", {})
            load = (
                f"; load average {run_info['load_before']:.2f} before, "
                f"{run_info['load_after']:.2f} after"
                if "load_before" in run_info
                else ""  # results from before 2026-12-05 kept only the machine's
            )
            parts += [
                f"### {m.name}",
                "",
                f"`{run_info.get('command', bench.command(False))}` "
                f"(via `bench/report.py run`; {run_info.get('date', '?')}, "
                f"{run_info.get('seconds', 0):.0f} s{load})",
                "",
                bench.render(res, m.name),
                "",
            ]
        note = NOTES / f"{bench.name}.md"
        if note.exists():
            parts += ["", note.read_text().strip()]
    DOC.write_text("\n".join(parts).rstrip() + "\n")
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run the benchmarks, keep their JSON")
    p_run.add_argument("--only", help="comma-separated bench names")
    p_run.add_argument("--quick", action="store_true", help="smoke sizes (not for the doc)")
    p_run.add_argument("--machine", help="results folder name (default: <cores>core-<gpu|cpu>)")
    sub.add_parser("render", help="write docs/performance.md and docs/perf/*.png")
    args = parser.parse_args(argv)
    return run(args) if args.cmd == "run" else render(args)


if __name__ == "__main__":
    sys.exit(main())
