"""``bench/python_cost.py``'s own arithmetic and bookkeeping (its numbers come from real
runs, never from here)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import python_cost  # bench/ is a folder of scripts, not a package


def test_summary_is_the_median_and_the_range() -> None:
    assert python_cost.summary([3.0, 1.0, 2.0]).split() == ["2.00", "[1.00-3.00]"]


def test_pythonpath_is_set_for_the_children_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old checkout goes in front; what was on the path (a machine's dependencies)
    stays behind it; the path is restored afterwards."""
    monkeypatch.setenv("PYTHONPATH", "/ours")
    with python_cost.pythonpath("/old/checkout"):
        assert os.environ["PYTHONPATH"] == os.pathsep.join(["/old/checkout", "/ours"])
    assert os.environ["PYTHONPATH"] == "/ours"
    monkeypatch.delenv("PYTHONPATH")
    with python_cost.pythonpath(None):
        assert "PYTHONPATH" not in os.environ
    with python_cost.pythonpath("/old/checkout"):
        assert os.environ["PYTHONPATH"] == "/old/checkout"
    assert "PYTHONPATH" not in os.environ


def test_gc_clock_counts_each_collection() -> None:
    clock = python_cost.GcClock()
    try:
        gc.collect()
        gc.collect(0)
        assert clock.count == 2 and clock.cpu >= 0.0
    finally:
        gc.callbacks.remove(clock._callback)


def test_a_rep_is_as_many_cycles_as_make_the_target_block_count() -> None:
    """Back to back, so the per-cycle figure is a steady one; ``--cycles`` overrides."""

    def cycles(blocks: int, given: int | None = None) -> int:
        ns = argparse.Namespace(blocks=blocks, cycles=given)
        return python_cost.cycles_per_rep(ns)

    assert [cycles(n) for n in (1, 16, 256, 1024, 4096, 16384)] == [4096, 256, 16, 4, 1, 1]
    assert cycles(3000) == 1 and cycles(256, given=1) == 1 and cycles(4096, given=3) == 3


def test_fixed_and_marginal_recovers_a_line_and_shows_where_it_bends() -> None:
    """Per-cycle Python CPU of 500 us + 2 us a block (``copy`` taken out of ``total``):
    the fit gives both back, and so does every step between sizes; a size whose cycles
    cost 1 us a block more moves its steps, not the others."""

    def result(us_per_cycle: float, n: int) -> dict[str, list[float]]:
        total = (us_per_cycle + 10.0 * n) * 1e-6  # 10 us a block of copy on top
        return {
            "p2pkv_cpu": [total] * 3,
            "p2pkv_copy": [10.0 * n * 1e-6] * 3,
            "bare_cpu": [0.0] * 3,
            "p2pkv_trio": [0.0] * 3,
            "p2pkv_gc": [0.0] * 3,
        }

    sizes = {str(n): result(500.0 + 2.0 * n, n) for n in (256, 1024, 4096)}
    split = python_cost.fixed_and_marginal(sizes, "p2pkv")
    assert split["fixed"] == pytest.approx(500.0)
    assert split["marginal"] == pytest.approx(2.0)
    assert split["256-1024"] == pytest.approx(2.0) and split["1024-4096"] == pytest.approx(2.0)
    sizes["4096"] = result(500.0 + 3.0 * 4096, 4096)
    split = python_cost.fixed_and_marginal(sizes, "p2pkv")
    assert split["256-1024"] == pytest.approx(2.0)
    assert split["1024-4096"] == pytest.approx((500 + 3.0 * 4096 - 500 - 2.0 * 1024) / 3072)
    assert python_cost.fixed_and_marginal({"256": sizes["256"]}, "p2pkv") == {}
