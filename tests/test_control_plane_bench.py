"""``bench/control_plane.py``'s order of samples and its ratios (its numbers come from
real runs, never from here)."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import control_plane  # bench/ is a folder of scripts, not a package


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("start", [0, 1, 5, 20])
def test_every_kind_runs_in_every_place_equally_often(k: int, start: int) -> None:
    """Over any 2k samples in a row, each of k kinds runs in each place twice: none always
    runs first, right after the previous sample's untimed fetch (with two kinds the order
    once never flipped, and the bare round trip always went first)."""
    kinds = [chr(ord("a") + j) for j in range(k)]
    orders = [control_plane.sample_order(kinds, i) for i in range(start, start + 2 * k)]
    for order in orders:
        assert sorted(order) == kinds
    for place in range(k):
        assert Counter(order[place] for order in orders) == dict.fromkeys(kinds, 2)


def test_two_kinds_alternate_which_follows_the_other() -> None:
    orders = [control_plane.sample_order(["p2pkv", "bare"], i) for i in range(8)]
    firsts = [order[0] for order in orders]
    assert firsts.count("bare") == firsts.count("p2pkv") == 4


def _args(keys: int) -> argparse.Namespace:
    return argparse.Namespace(target_ms=None, keys=keys, reps=2, close="fetch")


def test_the_target_is_the_ratio_to_the_bare_round_trip_between_the_same_processes() -> None:
    """The 1-key target divides by ``bare`` (answered in the source's process), not by
    ``bare_own``; both ratios are reported, each the median of the reps' ratios."""
    us = 1e-6
    samples = {
        "p2pkv": {8: [[800 * us] * 3, [900 * us] * 3], 1: [[200 * us] * 3, [300 * us] * 3]},
        "bare": {8: [[100 * us] * 3] * 2, 1: [[100 * us] * 3, [100 * us] * 3]},
        "bare_own": {8: [[200 * us] * 3] * 2, 1: [[200 * us] * 3, [200 * us] * 3]},
        "p2pkv_cpu": {8: [[50 * us] * 3] * 2, 1: [[40 * us] * 3] * 2},
        "bare_cpu": {8: [[20 * us] * 3] * 2, 1: [[10 * us] * 3] * 2},
    }
    out = control_plane.report(_args(8), samples, [0.0, 0.0])
    assert out["ratio"]["1"]["per_rep"] == pytest.approx([2.0, 3.0])
    assert out["ratio_own"]["1"]["per_rep"] == pytest.approx([1.0, 1.5])
    target = out["targets"]["lookup_1_over_bare"]
    assert target["got"] == pytest.approx(statistics.median([2.0, 3.0]))
    assert target["pass"] is False
    assert out["bare_client_cpu_s"]["1"]["p50"] == pytest.approx(10 * us)
    assert out["consumer_cpu_s"]["8"]["p50"] == pytest.approx(50 * us)
