"""Staging lanes (issue 10): a local staging copy cut over several loopback agents.

The split (:func:`p2pkv.staging.lane_parts`) and the fan-out (:func:`run_parts`) are pure and
checked here exhaustively; one test runs a real split copy over host memory through NIXL
(the GPU variant, byte-exact both ways, is in ``test_gpu.py``).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import numpy as np
import pytest

from p2pkv import staging
from p2pkv.errors import TransportError
from p2pkv.staging import lane_parts, run_parts

from .helpers import failing_lane, record_lane_parts

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
