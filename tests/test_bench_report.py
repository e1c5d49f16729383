"""bench/report.py: the generated docs/performance.md says what the raw results say.

The renderers turn each bench's JSON into tables; a renderer that reads the wrong field or
computes a ratio upside down would publish wrong numbers, so these check medians, ranges,
ratios and the machine line against hand-made results. No benchmark runs here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    mod: Any = load_report()
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(mod, "NOTES", tmp_path / "notes")
    monkeypatch.setattr(mod, "DOC", tmp_path / "performance.md")
    monkeypatch.setattr(mod, "IMG", tmp_path / "perf")
    # Tables only: plots are matplotlib's business and it need not be installed here.
    monkeypatch.setattr(mod, "plot", lambda name, draw, size=None: f"[plot {name}]")
    monkeypatch.setattr(mod, "have_matplotlib", lambda: True)
    return mod


def write_machine(report: Any, name: str, results: dict[str, Any], **info: Any) -> None:
    folder = report.RESULTS / name
    folder.mkdir(parents=True)
    machine = {
        "cores": 2,
        "cpu": "Test CPU",
        "gpu": "",
        "mem_gib": 24,
        "kernel": "6.0",
        "python": "3.11",
        "date": "2026-12-01 10:00 UTC",
        "load_before": [1.5, 1.0, 1.0],
        "load_after": [2.5, 1.0, 1.0],
        **info,
    }
    (folder / "_machine.json").write_text(json.dumps(machine))
    (folder / "_skipped.json").write_text(json.dumps({"idle_cpu": "vLLM is not installed"}))
    for bench, res in results.items():
        (folder / f"{bench}.json").write_text(json.dumps(res))


def test_render_without_matplotlib_leaves_the_doc_as_it_was(
    report: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The plots are part of the document: a render without them must not replace it.
    write_machine(report, "2core-cpu", {})
    report.DOC.write_text("the doc with its plots\n")
    monkeypatch.setattr(report, "have_matplotlib", lambda: False)
    assert report.main(["render"]) != 0
    assert report.DOC.read_text() == "the doc with its plots\n"
    assert "pip install -e '.[bench]'" in capsys.readouterr().err


def test_cold_pull_table_reports_medians_ranges_and_ratios(report: Any) -> None:
    res = {
        "args": {"blocks": 1024, "block_len": 2 << 20, "reps": 3},
        "times_s": {"warm, idle": [0.5, 0.4, 0.6], "cold, sleep": [0.4, 0.44, 0.9]},
        "connect_s": {"sleep": [0.02, 0.03, 0.04]},
        "_run": {"command": "python bench/cold_pull.py", "seconds": 60, "date": "today"},
    }
    write_machine(report, "2core-cpu", {"cold_pull": res})
    assert report.main(["render"]) == 0
    doc = report.DOC.read_text()
    assert "| warm, idle | 500 [400-600] ms | 1.00 x |  |" in doc
    assert "| cold, sleep | 440 [400-900] ms | 0.88 x | 30 [20-40] ms |" in doc
    assert "warm idle 4.29 GB/s" in doc  # 2 GiB in the median 0.5 s
    assert "`python bench/cold_pull.py`" in doc
    assert "**2core-cpu**: 2 cores (Test CPU), 24 GiB, no GPU" in doc
    assert "load average 1.50 before, 2.50 after" in doc
    assert "No results (2core-cpu: vLLM is not installed)" in doc  # idle_cpu was skipped


def test_vllm_table_ratio_is_builtin_over_p2pkv_per_machine(report: Any) -> None:
    def rep(warm: float, cold: float) -> dict[str, float]:
        return {
            "warm_idle_s": warm,
            "cold_sleeping_s": cold,
            "cold_over_warm": cold / warm,
            "idle_consumer_tier_pct": 80.0 if warm > 1 else 0.0,
            "idle_source_tier_pct": 80.0 if warm > 1 else 0.0,
            "idle_poll_round_us": 40.0 if warm > 1 else 1.0,
        }

    res = {
        "args": {"n": 1024, "chunk_mib": 2.0},
        "runs": {
            "built-in p2p": [rep(1.2, 1.8), rep(1.0, 1.5), rep(1.4, 2.0)],
            "p2pkv": [rep(0.6, 0.6), rep(0.4, 0.5), rep(0.8, 0.9)],
        },
    }
    write_machine(report, "16core-gpu", {"vllm_tier": res}, cores=16, gpu="H200")
    assert report.main(["render"]) == 0
    doc = report.DOC.read_text()
    assert "| warm-idle pull (s) | 1.2 [1-1.4] | 0.6 [0.4-0.8] | 2.00 |" in doc
    assert "[plot vllm_tier-16core-gpu]" in doc
    assert "**16core-gpu**: 16 cores (Test CPU), 24 GiB, H200" in doc


def test_notes_are_pasted_under_their_bench(report: Any) -> None:
    write_machine(report, "m", {})
    report.NOTES.mkdir()
    (report.NOTES / "cold_pull.md").write_text("Why the cold pull is what it is.\n")
    assert report.main(["render"]) == 0
    doc = report.DOC.read_text()
    section = doc.split("## Cold pull")[1].split("\n## ")[0]
    assert "Why the cold pull is what it is." in section


def test_store_ops_table_reads_thread_cpu_and_the_scale(report: Any) -> None:
    def cell(median: float) -> dict[str, float]:
        return {"median": median, "min": median - 1, "max": median + 1}

    ops = ("pin", "unpin", "present", "reserve", "commit_many")
    new = {
        "4096": {**{op: cell(100.0) for op in ops}, "cycle": cell(500.0)},
        "256": {**{op: cell(200.0) for op in ops}, "cycle": cell(1000.0)},
    }
    old = {"4096": {"cycle": cell(1000.0)}, "256": {"cycle": cell(1250.0)}}
    scale = {"open_s": 0.0037, "bytes_per_block_empty": 65.2, "bytes_per_block_full": 137.4}
    res = {
        "ops": {"new": {"thread CPU": new, "wall clock": {}}, "old": {"thread CPU": old}},
        "scale": {"new": scale},
    }
    out = report.render_store_ops(res, "vm")
    assert "| op | 256 keys | 4,096 keys |" in out
    assert "| cycle | 1000 [999-1001] | 500 [499-501] |" in out
    assert "256 keys: 0.80, 4,096 keys: 0.50" in out
    assert "opens in 3.7 ms" in out and "65 B" in out and "137 B full" in out


def test_python_cost_table_takes_each_cycles_own_copy_out(
    report: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python per block is the pair's CPU minus its own post calls' CPU in the same rep;
    the bare pair's difference stands beside it; results of code without the copy figure
    show "n/a" there, never a number from the other method."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # report imports python_cost
    ms = 1e-3  # CPU seconds of a 1,000-block cycle: 1 ms is 1 us per block
    size = {
        "p2pkv_cpu": [20 * ms, 21 * ms, 19 * ms],
        "p2pkv_copy": [15 * ms, 16 * ms, 15 * ms],
        "p2pkv_trio": [3 * ms, 4 * ms, 3 * ms],
        "p2pkv_gc": [0.0, 0.0, 0.0],
        "bare_cpu": [16 * ms, 14 * ms, 17 * ms],
        "baseline_cpu": [22 * ms, 23 * ms, 21 * ms],
        "baseline_trio": [5 * ms, 5 * ms, 5 * ms],
        "baseline_gc": [0.0, 0.0, 0.0],
    }
    res = {"block_len": 65536, "reps": 3, "baseline": "/old", "sizes": {"1000": size}}
    out = report.render_python_cost(res, "vm")
    rows = [line for line in out.splitlines() if line.startswith("| 1,000")]
    # p2pkv: python 5, 5, 4 -> 5 [4-5]; copy 15 [15-16]; total 20 [19-21];
    # over bare 4, 7, 2 -> 4 [2-7]; Trio threads 3 [3-4].
    assert rows[0] == "| 1,000 | p2pkv | 5 [4-5] | 15 [15-16] | 20 [19-21] | 4 [2-7] | 3 [3-4] |"
    assert rows[1] == "| 1,000 | baseline | n/a | n/a | 22 [21-23] | 6 [4-9] | 5 [5-5] |"
    assert "each rep a lone cycle" in out  # results from before reps ran cycles back to back
    res["cycles"] = {"1000": 4}
    out = report.render_python_cost(res, "vm")
    assert "each rep 4 x 1,000 blocks, its cycles back to back; figures per cycle" in out


def test_a_run_of_some_benches_keeps_the_skip_reasons_of_the_others(
    report: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run --only`` rewrites ``_skipped.json``: a bench it did not run keeps its reason
    (the GPU machine's "vLLM cannot be carried" must survive a re-run of one bench)."""
    write_machine(report, "m", {})
    (report.RESULTS / "m" / "_skipped.json").write_text(
        json.dumps({"vllm_tier": "cannot be carried", "gpu": "stale reason"})
    )
    monkeypatch.setattr(report, "missing", lambda bench: "no CUDA device")
    args = report.argparse.Namespace(only="gpu", machine="m", quick=True)
    assert report.run(args) == 0
    skipped = json.loads((report.RESULTS / "m" / "_skipped.json").read_text())
    assert skipped == {"vllm_tier": "cannot be carried", "gpu": "no CUDA device"}


def fake_bench(
    report: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: str, **kw: Any
) -> None:
    """``report.BENCHES`` is one FAKE bench, ``bench/fake.py`` under ``tmp_path``, whose
    body is ``code`` (``path`` is the ``--json`` argument)."""
    (tmp_path / "bench").mkdir()
    script = "import sys\npath = sys.argv[sys.argv.index('--json') + 1]\n" + code
    (tmp_path / "bench" / "fake.py").write_text(script)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    bench = report.Bench("fake", "Fake", lambda quick: [], lambda res, machine: "table", **kw)
    monkeypatch.setattr(report, "BENCHES", [bench])


def test_a_bench_that_fails_leaves_no_earlier_result_behind(
    report: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bench that dies before writing its JSON is a failure of this run: the JSON of an
    earlier run must not pass for it (it was kept and stamped with the new date and
    command, so the document published old figures as new)."""
    fake_bench(report, monkeypatch, tmp_path, "sys.exit(1)\n")
    write_machine(report, "m", {"fake": {"stale": True, "_run": {"date": "last week"}}})
    args = report.argparse.Namespace(only=None, machine="m", quick=False)
    assert report.run(args) == 1
    assert not (report.RESULTS / "m" / "fake.json").exists()
    skipped = json.loads((report.RESULTS / "m" / "_skipped.json").read_text())
    assert skipped["fake"] == "failed (exit 1); see fake.txt"
    assert report.main(["render"]) == 0
    assert "No results (m: failed (exit 1); see fake.txt)" in report.DOC.read_text()


def test_a_bench_that_times_out_is_a_failure_and_the_run_goes_on(
    report: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bench past its time limit is killed and counts as failed, even with a JSON written
    before it hung; the run still writes the machine and the skip reasons (the timeout
    used to end the whole run there)."""
    code = "open(path, 'w').write('{}')\nimport threading\nthreading.Event().wait()\n"
    fake_bench(report, monkeypatch, tmp_path, code, timeout_s=0.5)
    write_machine(report, "m", {})
    (report.RESULTS / "m" / "_machine.json").unlink()
    args = report.argparse.Namespace(only=None, machine="m", quick=False)
    assert report.run(args) == 1
    assert not (report.RESULTS / "m" / "fake.json").exists()
    assert (report.RESULTS / "m" / "_machine.json").exists()
    skipped = json.loads((report.RESULTS / "m" / "_skipped.json").read_text())
    assert skipped["fake"] == "failed (timed out after 0.5 s); see fake.txt"


def test_each_section_says_the_load_average_its_own_bench_ran_under(
    report: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``run --only`` rewrites ``_machine.json``, so the machine line's load average is the
    last run's, not that of the sections kept from runs before: each bench's result keeps
    the load average around its own run, and its section prints it; the machine line says
    which benches its figure belongs to."""
    fake_bench(report, monkeypatch, tmp_path, "open(path, 'w').write('{}')\n")
    loads = iter([(0.25, 0, 0), (1.25, 0, 0), (2.5, 0, 0), (3.75, 0, 0)])
    monkeypatch.setattr(report.os, "getloadavg", lambda: next(loads))
    write_machine(report, "m", {})
    assert report.run(report.argparse.Namespace(only=None, machine="m", quick=False)) == 0
    run_info = json.loads((report.RESULTS / "m" / "fake.json").read_text())["_run"]
    assert run_info["load_before"] == 1.25 and run_info["load_after"] == 2.5
    assert report.main(["render"]) == 0
    doc = report.DOC.read_text()
    section = doc.split("## Fake")[1]
    assert "s; load average 1.25 before, 2.50 after)" in section
    assert "load average 0.25 before, 3.75 after the last `run` (fake)" in doc
