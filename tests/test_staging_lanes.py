"""Staging lanes (issue 10): a local staging copy cut over several loopback agents.

The split (:func:`p2pkv.staging.lane_parts`) and the fan-out (:func:`run_parts`) are pure and
checked here exhaustively; one test runs a real split copy over host memory through NIXL
(the GPU variant, byte-exact both ways, is in ``test_gpu.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import pytest

from p2pkv import staging
from p2pkv.errors import TransportError
from p2pkv.staging import lane_parts, run_parts

from .helpers import failing_lane, record_lane_parts
from .node_proc import child_pythonpath

_HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
BLOCK = 4096


def test_lane_parts_cover_every_pair_once_in_order_with_even_sizes() -> None:
    for lanes in range(1, 7):
        for min_per_lane in (1, 3, 16):
            for count in range(0, 130):
                parts = lane_parts(count, lanes, min_per_lane)
                covered = [i for p in parts for i in range(count)[p]]
                assert covered == list(range(count)), (count, lanes, min_per_lane)
                sizes = [p.stop - p.start for p in parts]
                assert max(sizes) - min(sizes) <= 1
                assert len(parts) == max(1, min(lanes, count // min_per_lane))
                if len(parts) > 1:
                    assert min(sizes) >= min_per_lane
    assert [(p.start, p.stop) for p in lane_parts(101, 3, 16)] == [(0, 34), (34, 68), (68, 101)]
    assert len(lane_parts(47, 3, 16)) == 2  # too few pairs for three parts of 16
    for bad in ((-1, 2, 1), (4, 0, 1), (4, 2, 0)):
        with pytest.raises(ValueError):
            lane_parts(*bad)


class _GatedFuture(Future[None]):
    """A part that can only end once run_parts has asked for its outcome."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.gate.set()
        return super().exception(timeout)


class _GatedPool:
    """FAKE thread pool for the staging lanes: each job runs on a thread of its own, and
    only once run_parts has asked for its future's outcome."""

    def __init__(self) -> None:
        self.futures: list[_GatedFuture] = []
        self.threads: list[threading.Thread] = []

    def submit(self, job: Callable[[], None]) -> _GatedFuture:
        future = _GatedFuture(threading.Event())

        def run() -> None:
            future.gate.wait()
            try:
                job()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

        thread = threading.Thread(target=run)
        self.futures.append(future)
        self.threads.append(thread)
        thread.start()
        return future

    def close(self) -> None:
        for future in self.futures:
            future.gate.set()
        for thread in self.threads:
            thread.join()


def test_a_failed_part_fails_the_copy_only_after_every_part_has_ended() -> None:
    ran: list[int] = []
    pool = _GatedPool()

    def part(i: int, error: BaseException | None = None) -> Callable[[], None]:
        def job() -> None:
            ran.append(i)
            if error is not None:
                raise error

        return job

    try:
        jobs = [part(0), part(1, TransportError("lane 1 broke", op="stage")), part(2)]
        with pytest.raises(TransportError, match="lane 1 broke"):
            run_parts(jobs, cast(Any, pool))
        assert all(f.done() for f in pool.futures)  # nothing still running
        assert sorted(ran) == [0, 1, 2]

        # The first failure in part order wins; a foreign error becomes a TransportError.
        ran.clear()
        jobs = [part(0, KeyError("x")), part(1, TransportError("later", op="stage"))]
        with pytest.raises(TransportError, match="KeyError") as info:
            run_parts(jobs, cast(Any, pool))
        assert isinstance(info.value.__cause__, KeyError)
        assert all(f.done() for f in pool.futures) and sorted(ran) == [0, 1]

        run_parts([part(0)], None)  # one part needs no pool
        with pytest.raises(TransportError):
            run_parts([part(0), part(1)], None)
    finally:
        pool.close()


class _RefusingPool(_GatedPool):
    """FAKE lane pool that takes one part, then refuses the next as a shut-down executor
    does. ``queued``: as ``ThreadPoolExecutor`` does when it cannot start a thread, with the
    part already queued (to run once a thread is free); ``running``: the part it took
    starts at once, and the refusal lets it go on (so that it runs on past the refusal)."""

    def __init__(self, *, queued: bool = False, running: bool = False) -> None:
        super().__init__()
        self.queued, self.running = queued, running
        self.go = threading.Event()

    def submit(self, job: Callable[[], None]) -> _GatedFuture:
        if not self.futures:
            future = super().submit(job)
            if self.running:
                future.gate.set()
            return future
        self.go.set()
        if self.queued:
            super().submit(job)
            raise RuntimeError("can't start new thread")
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")


@pytest.mark.parametrize("mode", ["refused", "queued", "running"])
def test_a_part_the_pool_refuses_fails_the_copy_with_no_part_left_to_run(mode: str) -> None:
    ran: list[int] = []
    pool = _RefusingPool(queued=mode == "queued", running=mode == "running")

    def part(i: int) -> Callable[[], None]:
        def job() -> None:
            pool.go.wait()
            ran.append(i)

        return job

    try:
        with pytest.raises(TransportError, match="could not start") as info:
            run_parts([part(i) for i in range(4)], cast(Any, pool))
        assert isinstance(info.value.__cause__, RuntimeError)
        # What was handed to the pool has ended or never starts: nothing writes into the
        # copy's destination once run_parts has raised; the caller's own part never ran.
        done = list(ran)
    finally:
        pool.close()
    assert ran == done and 0 not in ran

    real = ThreadPoolExecutor(1)
    real.shutdown()
    with pytest.raises(TransportError, match="after shutdown"):
        run_parts([part(0), part(1)], real)


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_host_copy_split_over_three_lanes_is_byte_exact_and_fails_as_a_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(staging.STAGING_LANES_ENV, "3")
    parts = record_lane_parts(monkeypatch)
    n = 101  # three parts of 34, 34, 33
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, n * BLOCK, dtype=np.uint8)
    b = np.zeros(n * BLOCK, dtype=np.uint8)
    src = staging.attach_region(a, BLOCK)
    dst = staging.attach_region(b, BLOCK)
    try:
        agent = src.agent
        assert len(agent.lanes) == 3 and len(src.lanes) == len(dst.lanes) == 3
        s, d = rng.permutation(n).tolist(), rng.permutation(n).tolist()
        agent.copy(src, s, dst, d)
        assert sorted(size for _, size in parts) == [33, 34, 34]
        assert len({name for name, _ in parts}) == 3
        for i in range(n):
            want = a[s[i] * BLOCK : (s[i] + 1) * BLOCK]
            assert np.array_equal(b[d[i] * BLOCK : (d[i] + 1) * BLOCK], want), i

        with failing_lane(agent, 1), pytest.raises(TransportError, match="ERR"):
            agent.copy(dst, d, src, s)
        b[:] = 0
        agent.copy(src, s, dst, d)  # the lanes still work after a failed copy
        assert np.array_equal(b.reshape(n, BLOCK)[d], a.reshape(n, BLOCK)[s])

        # Blocks above MAX_SPLIT_BLOCK_LEN go in one part: splitting them gains nothing.
        big_len, m = 2 * staging.MAX_SPLIT_BLOCK_LEN, 3 * staging.MIN_DESCS_PER_LANE
        big_a = rng.integers(0, 256, m * big_len, dtype=np.uint8)
        big_b = np.zeros_like(big_a)
        big_src, big_dst = (staging.attach_region(x, big_len) for x in (big_a, big_b))
        try:
            parts.clear()
            order = rng.permutation(m).tolist()
            agent.copy(big_src, order, big_dst, list(range(m)))
            assert [size for _, size in parts] == [m]
            assert np.array_equal(big_b.reshape(m, big_len), big_a.reshape(m, big_len)[order])
        finally:
            big_src.release()
            big_dst.release()
    finally:
        src.release()
        dst.release()
    assert not staging.loopback_agent_exists()
    assert not any(t.name.startswith("p2pkv-staging") for t in threading.enumerate())


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_staging_refuses_out_of_range_slots_overlapping_and_released_regions() -> None:
    """Staging refuses a copy to or from a slot one past the region's last block, a region
    that starts below a staged one and reaches into it, and a copy into a released
    region."""
    a = np.zeros(4 * BLOCK, np.uint8)
    buf = np.zeros(8 * BLOCK, np.uint8)
    src = staging.attach_region(a, BLOCK)
    upper = staging.attach_region(buf[4 * BLOCK :], BLOCK)
    try:
        agent = src.agent
        with pytest.raises(TransportError, match="destination slot out of range"):
            agent.copy(src, [0], upper, [4])
        with pytest.raises(TransportError, match="source slot out of range"):
            agent.copy(src, [4], upper, [0])
        with pytest.raises(TransportError, match="overlaps"):
            staging.attach_region(buf[: 6 * BLOCK], BLOCK)  # starts below, reaches into it
        gone = staging.attach_region(buf[: 2 * BLOCK], BLOCK)
        gone.release()
        with pytest.raises(TransportError, match="region was released"):
            agent.copy(src, [0], gone, [0])
    finally:
        upper.release()
        src.release()
    assert not staging.loopback_agent_exists()


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_a_region_attached_twice_is_one_registration_released_by_its_last_user() -> None:
    """Two callers staging through one region share its registration, counted: the first
    to release leaves it attached and copying for the other, and only the last release
    drops the lanes. The same bytes attached with another block length are refused (the
    shared registration's blocks would not be the caller's: every slot another offset)."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, 4 * BLOCK, dtype=np.uint8)
    b = np.zeros(8 * BLOCK, np.uint8)
    src = staging.attach_region(a, BLOCK)
    first = staging.attach_region(b, BLOCK)
    try:
        second = staging.attach_region(b, BLOCK)
        assert second is first
        with pytest.raises(TransportError, match="block_len 4096"):
            staging.attach_region(b, 2 * BLOCK)  # same bytes, cut into 4 slots, not 8
        second.release()
        src.agent.copy(src, [3, 1], first, [7, 0])  # still attached for the first user
        assert np.array_equal(b[7 * BLOCK :], a[3 * BLOCK :])
        assert np.array_equal(b[:BLOCK], a[BLOCK : 2 * BLOCK])
    finally:
        first.release()
        src.release()
    assert not staging.loopback_agent_exists()


class _RefusedRelease:
    """FAKE: a NIXL object (a lane's agent, or one of its dlists) that does what it is
    asked to release or deregister, then raises as NIXL does when it refuses; the calls
    are noted in ``calls``."""

    def __init__(self, real: Any, calls: list[str]) -> None:
        self._real, self._calls = real, calls

    def release(self) -> None:
        self._calls.append("release")
        self._real.release()
        raise RuntimeError("FAKE: NIXL refused to release the dlist")

    def deregister_memory(self, descs: Any) -> None:
        self._calls.append("deregister")
        self._real.deregister_memory(descs)
        raise RuntimeError("FAKE: NIXL refused to deregister")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_a_refused_staging_release_still_undoes_every_lane_and_drops_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NIXL refusing to release lane 0's dlists or to deregister its memory (FAKE) is
    logged, and every other step of the release still runs: lane 0's other list and its
    deregistration, lane 1's whole release, then the lanes and their thread go."""
    monkeypatch.setenv(staging.STAGING_LANES_ENV, "2")
    n = 2 * staging.MIN_DESCS_PER_LANE
    a = np.random.default_rng(7).integers(0, 256, 2 * n * BLOCK, dtype=np.uint8)
    reg = staging.attach_region(a, BLOCK)
    agent = reg.agent
    calls: list[list[str]] = [[], []]
    try:
        agent.copy(reg, list(range(n)), reg, list(range(n, 2 * n)))  # both lanes at work
        assert np.array_equal(a[n * BLOCK :], a[: n * BLOCK])
        assert any(t.name.startswith("p2pkv-staging") for t in threading.enumerate())
        lane0, lane1 = reg.lanes
        lane0.loop_dlist = _RefusedRelease(lane0.loop_dlist, calls[0])
        lane0.local_dlist = _RefusedRelease(lane0.local_dlist, calls[0])
        agent.lanes[0].agent = _RefusedRelease(agent.lanes[0].agent, calls[0])
        lane1.loop_dlist = _RefusedRelease(lane1.loop_dlist, calls[1])
    finally:
        with caplog.at_level(logging.WARNING, logger="p2pkv.staging"):
            reg.release()
    assert calls == [["release", "release", "deregister"], ["release"]]
    assert reg.lanes == [] and not lane1.local_dlist and not lane1.reg_descs
    assert caplog.text.count("FAKE: NIXL refused") == 4
    assert not staging.loopback_agent_exists() and agent.lanes == []
    assert not any(t.name.startswith("p2pkv-staging") for t in threading.enumerate())


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_a_staging_copy_that_never_completes_fails_at_its_timeout() -> None:
    """A copy still in progress at its ``timeout`` raises ("not done in time"; the caller
    must not reuse its destination slots soon), instead of polling for ever in the caller's
    thread. The FAKE lane stays in progress for 5 s, then fails: a copy that ignored its
    timeout would report that failure instead, 5 s late."""
    b = np.zeros(4 * BLOCK, np.uint8)
    src = staging.attach_region(np.ones(4 * BLOCK, np.uint8), BLOCK)
    dst = staging.attach_region(b, BLOCK)
    try:
        agent = src.agent
        with failing_lane(agent, 0, stuck=5.0), pytest.raises(TransportError, match="in time"):
            agent.copy(src, [0], dst, [0], timeout=0.05)
        agent.copy(src, [1], dst, [1])  # the lane copies again afterwards
        assert b[BLOCK : 2 * BLOCK].all() and not b[:BLOCK].any()
    finally:
        dst.release()
        src.release()
    assert not staging.loopback_agent_exists()


# What the child does with each kind of memory (run in a child: the defects it guards
# against wrote into freed memory and crashed the interpreter). It attaches a source, then
# ``case``'s region; prints REFUSED if staging refused the region, PROTECTED if the owner
# could not free or move its memory while staged, else what a copy into it did.
_ADOPT_CHILD = r"""
import mmap, sys, tempfile
import numpy as np
from p2pkv import staging
from p2pkv.errors import TransportError
B = 4096
case = sys.argv[1]
src = staging.attach_region(np.full(4 * B, 7, np.uint8), B)
if case == "bytes":
    region = bytes(4 * B)
elif case == "list":
    region = [0] * (4 * B // 8)
elif case == "readonly-numpy":
    region = np.frombuffer(bytes(4 * B), np.uint8)
elif case == "object-numpy":
    region = np.empty(4 * B // 8, dtype=object)
elif case == "readonly-mmap":
    f = tempfile.TemporaryFile(); f.write(bytes(4 * B)); f.flush()
    region = mmap.mmap(f.fileno(), 4 * B, access=mmap.ACCESS_READ)
elif case == "mmap-closed":
    region = mmap.mmap(-1, 4 * B)
elif case == "bytearray-resized":
    region = bytearray(4 * B)
else:
    import torch
    region = torch.zeros(4 * B, dtype=torch.uint8)
try:
    dst = staging.attach_region(region, B)
except (ValueError, TypeError) as exc:
    print("REFUSED", repr(exc), flush=True)
    sys.exit(0)
try:  # the owner frees or moves the memory while it is staged
    if case == "mmap-closed":
        region.close()
    elif case == "bytearray-resized":
        region.extend(bytes(1 << 22))
    elif case == "torch-resized":
        region.resize_(1 << 24)
except (BufferError, RuntimeError) as exc:
    print("PROTECTED", repr(exc), flush=True)
    dst.release()
    src.release()
    sys.exit(0)
src.agent.copy(src, [0, 1], dst, [0, 1])
print("copied into it", flush=True)
"""


@pytest.mark.parametrize(
    "case",
    [
        "bytes",  # read-only; np.asarray copied it and the lanes registered the freed copy
        "list",  # not a buffer: copied likewise
        "readonly-numpy",  # a read-only view of a bytes object, written through
        "object-numpy",  # PyObject pointers, overwritten by the copy (a crash)
        "readonly-mmap",  # PROT_READ pages
        "mmap-closed",  # vLLM's CPU tier is an mmap; unmapped while staged
        "bytearray-resized",  # reallocated while staged
        "torch-resized",  # tensor.resize_ reallocates while staged
    ],
)
@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_staging_takes_memory_as_the_store_does_refused_or_held(case: str) -> None:
    """Staging views memory in place as the store does: what the store refuses
    (read-only, not a buffer, Python objects) is refused, and memory it holds cannot be
    closed or reallocated under the lanes (review 2026-12-04: it registered whatever
    ``np.asarray`` returned, a freed copy included, and held nothing)."""
    if case == "torch-resized":
        pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    result = subprocess.run(
        [sys.executable, "-c", _ADOPT_CHILD, case],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    verdicts = [ln.split(" ")[0] for ln in result.stdout.splitlines() if ln]
    expected = "PROTECTED" if case.endswith(("closed", "resized")) else "REFUSED"
    assert result.returncode == 0 and verdicts == [expected], (
        f"{case}: exit code {result.returncode}, stdout {result.stdout!r}, "
        f"stderr {result.stderr[-2000:]!r}"
    )


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_a_copy_racing_the_release_of_its_region_raises_region_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release between a copy's checks of its arguments and its taking the lanes' lock
    gives the documented TransportError (it was an IndexError: the region's lanes were
    gone). The copy is held at its slot check until the release is done."""
    src = staging.attach_region(np.ones(4 * BLOCK, np.uint8), BLOCK)
    dst = staging.attach_region(np.zeros(4 * BLOCK, np.uint8), BLOCK)
    agent = src.agent
    checking = threading.Event()
    released = threading.Event()
    checked = staging._checked

    def held_check(slots: Any, num_blocks: int, side: str) -> Any:
        if side == "destination":
            checking.set()
            assert released.wait(10)
        return checked(slots, num_blocks, side)

    monkeypatch.setattr(staging, "_checked", held_check)
    outcome: list[BaseException | None] = []

    def copy() -> None:
        try:
            agent.copy(src, [0], dst, [0])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=copy)
    try:
        thread.start()
        assert checking.wait(10)
        dst.release()
        released.set()
        thread.join(10)
    finally:
        released.set()
        src.release()
    assert len(outcome) == 1
    assert isinstance(outcome[0], TransportError), repr(outcome[0])
    assert "released" in str(outcome[0])
    assert not staging.loopback_agent_exists()


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
@pytest.mark.parametrize(
    ("dst_block", "src_slots", "dst_slots", "match"),
    [
        (BLOCK, [1.7], [0], "source slots must be integers"),  # was truncated to slot 1
        (BLOCK, [1], ["2"], "destination slots must be integers"),  # was parsed
        (BLOCK, [[0, 1]], [2, 3], "source slots must be integers"),  # was flattened
        (BLOCK, np.array([0.5]), [1], "flat sequence of integers"),
        (BLOCK, [0, 1, 2], [3, 3, 3], "named twice"),  # which source landed was up to the lanes
        (BLOCK // 2, [1], [0], "block_len differ"),  # a block would spill into the next slot
        (BLOCK, [0, 1], [2], "2 source and 1 destination"),
    ],
    ids=["float", "str", "nested", "float-array", "repeated-destination", "block_len", "lengths"],
)
def test_staging_refuses_slot_lists_the_data_plane_refuses(
    dst_block: int, src_slots: Any, dst_slots: Any, match: str
) -> None:
    """A copy the data plane must not make (slots that are not integers, a destination
    named twice, regions of different block lengths, more source than destination slots)
    is refused before any byte moves."""
    a = np.repeat(np.arange(1, 5, dtype=np.uint8), BLOCK)
    b = np.zeros(4 * BLOCK, np.uint8)
    src = staging.attach_region(a, BLOCK)
    dst = staging.attach_region(b, dst_block)
    try:
        with pytest.raises(TransportError, match=match):
            src.agent.copy(src, src_slots, dst, dst_slots)
        assert not b.any(), "a refused copy wrote"
    finally:
        dst.release()
        src.release()
    assert not staging.loopback_agent_exists()


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_a_copy_within_one_region_that_reads_a_slot_it_writes_is_refused() -> None:
    """A copy from a region into itself whose destination slots include one of its
    source slots is refused before any byte moves: NIXL merges the pairs into
    overlapping descriptors and copies them in any order, so the blocks came out smeared
    (8 blocks shifted up by one slot all landed as the first; over lanes, a mix). A copy
    within one region over disjoint slots is made, byte-exact."""
    n = 8
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, (n + 1) * BLOCK, dtype=np.uint8)
    before = a.copy()
    region = staging.attach_region(a, BLOCK)
    try:
        chain = list(range(n)), list(range(1, n + 1))  # slot i -> i + 1
        for src_slots, dst_slots in (chain, chain[::-1], ([0], [0])):
            with pytest.raises(TransportError, match="both read and written"):
                region.agent.copy(region, src_slots, region, dst_slots)
            assert np.array_equal(a, before), "a refused copy wrote"
        region.agent.copy(region, [0, 1], region, [5, 4])  # disjoint: made
        blocks, old = a.reshape(n + 1, BLOCK), before.reshape(n + 1, BLOCK)
        assert np.array_equal(blocks[5], old[0]) and np.array_equal(blocks[4], old[1])
        assert np.array_equal(blocks[:4], old[:4]) and np.array_equal(blocks[6:], old[6:])
    finally:
        region.release()
    assert not staging.loopback_agent_exists()


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_releasing_a_released_region_again_leaves_its_next_attachment_alone() -> None:
    """A second ``release`` of a region whose last reference is gone does nothing. It
    used to take the count below zero and drop the lanes' entry for the same memory
    attached anew since: a third attach then registered those bytes a second time in
    every lane, and without one the lanes were dropped under the live attachment."""
    rng = np.random.default_rng(13)
    a = rng.integers(0, 256, 4 * BLOCK, dtype=np.uint8)
    b = np.zeros(4 * BLOCK, np.uint8)
    other = staging.attach_region(b, BLOCK)  # keeps the lanes alive
    stale = staging.attach_region(a, BLOCK)
    stale.release()
    live = staging.attach_region(a, BLOCK)
    try:
        stale.release()  # the caller's bug: released twice
        again = staging.attach_region(a, BLOCK)
        assert again is live, "the same bytes were registered a second time"
        again.release()
        other.release()
        assert staging.loopback_agent_exists(), "the lanes went under a live attachment"
        live.agent.copy(live, [3, 0], live, [1, 2])
        assert np.array_equal(a[BLOCK : 2 * BLOCK], a[3 * BLOCK :])
    finally:
        live.release()
    assert not staging.loopback_agent_exists()


# A child forked while staging lanes live copies and releases through them (run in a
# child of the test: it forks with NIXL live).
_FORK_CHILD = r"""
import os, sys, warnings
import numpy as np
from p2pkv import staging
from p2pkv.errors import TransportError
B = 4096
a, b = np.full(4 * B, 7, np.uint8), np.zeros(4 * B, np.uint8)
src, dst = staging.attach_region(a, B), staging.attach_region(b, B)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    pid = os.fork()
if pid == 0:
    try:
        src.agent.copy(src, [0], dst, [0], timeout=5)
        print("CHILD copied", int(b[0]), flush=True)
    except TransportError as exc:
        print("CHILD REFUSED", "spawn" in str(exc), flush=True)
    dst.release()
    src.release()
    print("CHILD released", flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
print("PARENT untouched", not b.any(), flush=True)
src.agent.copy(src, [1], dst, [1])
dst.release()
src.release()
print("PARENT ok", int(b[B]), staging.loopback_agent_exists(), flush=True)
"""


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")
def test_a_forked_child_cannot_copy_through_its_parents_lanes() -> None:
    """A child forked while staging lanes lived copied through its copy of them: the copy
    reported done, the child's memory stayed as it was, and the bytes landed in the
    parent's memory (the loopback endpoint names the parent's process). The child now
    refuses such a copy (``TransportError`` naming spawn), its release of an inherited
    region touches nothing, and the parent's lanes work on, its memory untouched."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    result = subprocess.run(
        [sys.executable, "-c", _FORK_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    want = ["CHILD REFUSED True", "CHILD released", "CHILD 0", "PARENT untouched True"]
    want.append("PARENT ok 7 False")
    assert result.stdout.splitlines() == want, result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
