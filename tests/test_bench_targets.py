"""The benches' PASS/FAIL lines judge against DESIGN.md's performance targets (the
numbers come from real runs, never from here)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import cold_pull  # bench/ is a folder of scripts, not a package
import dataplane
import facade_latency
import python_cost


def test_cold_pull_fails_a_busy_cold_pull_over_1_2_x_warm_idle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DESIGN.md: a cold pull from a busy source <= 1.2 x the warm idle pull. The bench
    said 1.3 (and cited DESIGN.md for it), so 1.25 x passed."""
    args = argparse.Namespace(blocks=4, block_len=1024, reps=1, interval_us=1000.0, json=None)
    times = {
        ("warm", "idle"): [1.0],
        ("cold", "spin"): [1.25],
        ("cold", "sleep"): [1.0],
    }
    assert cold_pull.report(args, times, {"spin": [0.1], "sleep": [0.1]}, []) == 1
    assert "FAIL: cold pull ratio 1.25 (target <= 1.2)" in capsys.readouterr().out
    times["cold", "spin"] = [1.2]
    assert cold_pull.report(args, times, {"spin": [0.1], "sleep": [0.1]}, []) == 0


def test_the_data_planes_python_work_line_has_python_costs_target() -> None:
    """DESIGN.md and bench/README.md: Python work <= 3 us per block; dataplane.py judged
    its estimate against 5 (the first round's figure)."""
    assert dataplane.WORK_TARGET_US == python_cost.TARGET_US == 3.0


def test_facade_latency_judges_host_calls_at_design_mds_p99() -> None:
    """DESIGN.md: host-thread calls p99 <= 30 us (host_costs.py too); facade_latency.py
    judged them at 50 (issue 4's figure), so a p99 of 45 us passed."""
    assert facade_latency.P99_TARGET_US == 30.0
