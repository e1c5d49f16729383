"""``bench/control_plane.py``'s order of samples, its ratios and its engine-less lookup
server (its numbers come from real runs, never from here)."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
import trio

from p2pkv import open_node
from p2pkv.wire import FrameDecoder, Lookup, LookupResp, encode

from .helpers import config, fill

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


def test_pin_cpus_names_three_sets_or_refuses() -> None:
    assert control_plane.pin_cpus("2,4+5,6") == [{2}, {4, 5}, {6}]
    with pytest.raises(SystemExit, match="three CPU sets"):
        control_plane.pin_cpus("2,4")


async def test_the_lean_server_pins_in_the_nodes_store_and_lets_go_after_its_answer() -> None:
    """``--lean``'s server does the lookup's own work (decode, pin in the node's store,
    answer) and closes each round after its answer; its client checks the answer."""
    with trio.fail_after(30):
        async with open_node(config("src")) as node, trio.open_nursery() as nursery:
            keys = fill(node.store, 2, 4096)
            host, port = await control_plane.start_lean(nursery, node.store)
            async with await trio.open_tcp_stream(host, port) as stream:
                await stream.send_all(encode(Lookup(req_id=7, keys=[*keys, b"\x01" * 32])))
                await stream.send_all(encode(Lookup(req_id=8, keys=keys[:1])))
                decoder, answers = FrameDecoder(), list[object]()
                while len(answers) < 2:
                    decoder.feed(await stream.receive_some(1 << 16))
                    while (msg := decoder.next_message()) is not None:
                        answers.append(msg)
                assert answers == [
                    LookupResp(req_id=7, hits=[True, True, False]),
                    LookupResp(req_id=8, hits=[True]),
                ]
                # Round 7 was closed before round 8 was read: nothing of it stays pinned.
                assert node.store.pins_of(("lean", 7)) == 0
                cpu: list[float] = []
                sample = control_plane.lean_client(stream, keys, cpu)
                assert await sample(2) > 0 and len(cpu) == 1
                absent = control_plane.lean_client(stream, [b"\x02" * 32], cpu)
                with pytest.raises(SystemExit, match="answered"):
                    await absent(1)
            nursery.cancel_scope.cancel()
