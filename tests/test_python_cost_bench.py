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
