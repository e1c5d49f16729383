"""The completion poller: it polls while something is pending or a consumer waits, and
once neither holds it parks at once, taking no further step (a step after the fact used to
land inside whatever the node did next, e.g. the next lookup). Autojump clock, no threads:
the transport is a FAKE that reports DONE after a set number of polls."""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from p2pkv.completion import EARLY, MAX_DELAY, STEPS, CompletionPoller
from p2pkv.transport.base import RegionLayout, RemotePeer, TransferHandle, TransferState

MiB = 1 << 20


def make_handle(nblocks: int = 1, block_len: int = 4096) -> TransferHandle:
    """A handle of ``nblocks`` blocks of ``block_len`` bytes (what the poller weighs)."""
    peer = RemotePeer("fake-peer", RegionLayout(0, nblocks, block_len))
    return TransferHandle(peer, tuple(range(nblocks)), tuple(range(nblocks)))


class CountingTransport:
    """FAKE data plane: each handle is PROC for ``polls_until_done`` polls, then DONE."""

    def __init__(self, polls_until_done: int) -> None:
        self.polls_until_done = polls_until_done
        self.polls: dict[int, int] = {}
        self.progress_calls = 0

    def progress(self) -> None:
        self.progress_calls += 1

    def hold_target_progress(self) -> bool:
        return False  # no thread of its own: the poller drives progress for a demand

    def poll(self, handle: Any) -> TransferState:
        n = self.polls[id(handle)] = self.polls.get(id(handle), 0) + 1
        return TransferState.DONE if n > self.polls_until_done else TransferState.PROC


class TaskSteps(trio.abc.Instrument):
    """Counts the steps of tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


@asynccontextmanager
async def running(poller: CompletionPoller) -> AsyncIterator[TaskSteps]:
    """The poller's task, running; yields the counter of its steps."""
    steps = TaskSteps("CompletionPoller.run")
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            yield steps
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(steps)


async def test_the_poller_parks_as_soon_as_the_last_handle_settles(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = CountingTransport(polls_until_done=3)
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller) as steps:
        assert await poller.wait(make_handle()) is TransferState.DONE
        assert poller.in_flight == 0
        await trio.testing.wait_all_tasks_blocked()  # the poller has taken its last step
        before = steps.steps
        await trio.sleep(1.0)  # long past any nap of the backoff (at most 10 ms)
        assert steps.steps == before


async def test_dropping_the_last_demand_parks_the_poller_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = CountingTransport(polls_until_done=0)
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller) as steps:
        poller.add_demand()
        await trio.sleep(0.05)  # a consumer waits: the poller drives progress
        driven = transport.progress_calls
        assert driven >= 3
        poller.drop_demand()
        await trio.testing.wait_all_tasks_blocked()  # the poller has taken its last step
        before = steps.steps
        await trio.sleep(1.0)
        assert steps.steps == before and transport.progress_calls == driven
        poller.add_demand()  # and it comes back when asked
        await trio.sleep(0.05)
        assert transport.progress_calls > driven
        poller.drop_demand()


class ThreadedTransport(CountingTransport):
    """FAKE data plane with a progress thread of its own: counts holds and releases (no
    thread runs: what is checked is who the poller asks to drive progress)."""

    def __init__(self) -> None:
        super().__init__(polls_until_done=0)
        self.holds = 0
        self.releases = 0

    def hold_target_progress(self) -> bool:
        self.holds += 1
        return True

    def release_target_progress(self) -> None:
        self.releases += 1


async def test_a_transport_with_its_own_progress_thread_takes_the_demand(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = ThreadedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller) as steps:
        await trio.testing.wait_all_tasks_blocked()
        before = steps.steps
        poller.add_demand()
        poller.add_demand()  # two fetches wait: one hold serves both
        await trio.sleep(1.0)
        assert (transport.holds, transport.releases) == (1, 0)
        assert transport.progress_calls == 0 and steps.steps == before  # the task slept
        poller.drop_demand()
        assert transport.releases == 0
        poller.drop_demand()
        assert (transport.holds, transport.releases) == (1, 1)


async def test_a_swap_moves_the_demand_to_the_new_transport(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reconfiguration mid-fetch: the old transport's thread is let go, the new one's is
    held; a new transport without a thread gets its progress from the poller's task."""
    old, new, plain = ThreadedTransport(), ThreadedTransport(), CountingTransport(0)
    poller = CompletionPoller(old)  # type: ignore[arg-type]
    async with running(poller):
        poller.add_demand()
        poller.transport = new  # type: ignore[assignment]
        assert (old.holds, old.releases, new.holds, new.releases) == (1, 1, 1, 0)
        poller.transport = plain  # type: ignore[assignment]
        assert (new.holds, new.releases) == (1, 1)
        await trio.sleep(0.05)
        driven = plain.progress_calls
        assert driven >= 3
        poller.drop_demand()
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1.0)
        assert plain.progress_calls == driven
    swapped = CompletionPoller(plain)  # type: ignore[arg-type]
    swapped.transport = old  # type: ignore[assignment]  # no demand: nothing is held
    assert old.holds == 1


class TimedTransport(CountingTransport):
    """FAKE data plane: a handle is DONE from a set (Trio clock) time on; polls are noted."""

    def __init__(self) -> None:
        super().__init__(polls_until_done=0)
        self.done_at: dict[int, float] = {}
        self.poll_times: list[float] = []

    def poll(self, handle: Any) -> TransferState:
        now = trio.current_time()
        self.poll_times.append(now)
        return TransferState.DONE if now >= self.done_at[id(handle)] else TransferState.PROC


async def timed_wait(
    poller: CompletionPoller, transport: TimedTransport, handle: TransferHandle, takes: float
) -> tuple[float, list[float]]:
    """Wait for ``handle``, DONE ``takes`` seconds from now: (seen after, poll offsets)."""
    start = trio.current_time()
    transport.done_at[id(handle)] = start + takes
    transport.poll_times.clear()
    assert await poller.wait(handle) is TransferState.DONE
    return trio.current_time() - start, [t - start for t in transport.poll_times]


async def test_a_copy_of_known_speed_is_seen_done_promptly_with_few_polls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Copy threads: the post returns before the copy is done. The first handle is found
    on the backoff (1, 3, 7, 15 ms...: a 13 ms copy seen at 15 ms); it sets the rate, and
    the next copy of that speed is polled first at EARLY of its time, then every 1/STEPS of
    it: seen within that step, in a handful of polls, not up to MAX_DELAY late."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        seen, polls = await timed_wait(poller, transport, make_handle(256, MiB), 0.013)
        assert seen >= 0.013 and len(polls) >= 4  # the backoff: no rate yet
        true_rate = 256 * MiB / 0.013
        assert poller.rate is not None and true_rate / 2 <= poller.rate <= true_rate * 2
        for takes in (0.013, 0.013, 0.030):  # 30 ms: more bytes at the same speed
            nblocks = round(256 * takes / 0.013)
            expected = nblocks * MiB / poller.rate
            seen, polls = await timed_wait(poller, transport, make_handle(nblocks, MiB), takes)
            assert polls[1] >= min(EARLY * expected, MAX_DELAY) - 1e-9  # the first look
            assert takes <= seen <= takes + max(expected / STEPS, 0.001) + 1e-6
            # One in wait(), one every MAX_DELAY up to EARLY of the expected time, then a
            # few of a twentieth each: not one every 1, 2, 4, 8, 10 ms from the start.
            assert len(polls) <= 1 + math.ceil(EARLY * expected / MAX_DELAY) + 4


async def test_a_faster_copy_raises_the_rate_at_once_a_slower_one_halfway(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        await timed_wait(poller, transport, make_handle(100, MiB), 0.020)
        first = poller.rate
        assert first is not None
        await timed_wait(poller, transport, make_handle(100, MiB), 0.005)
        fast = poller.rate
        assert fast is not None and fast > 2 * first  # followed at once
        await timed_wait(poller, transport, make_handle(100, MiB), 0.050)
        slow = poller.rate
        assert slow is not None and 100 * MiB / 0.060 < slow < fast  # only part of the way
        # Much slower than expected: past LATE x its time it is still polled, at least
        # every MAX_DELAY, and seen within that of its end.
        seen, polls = await timed_wait(poller, transport, make_handle(100, MiB), 0.500)
        assert 0.500 <= seen <= 0.500 + MAX_DELAY + 1e-6
        gaps = [b - a for a, b in itertools.pairwise(polls[1:])]
        assert max(gaps) <= MAX_DELAY + 1e-6


async def test_a_demand_is_driven_at_once_while_a_distant_poll_is_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A long copy of known speed lets the poller nap until near its end; a consumer that
    starts waiting meanwhile gets progress at once, not after the nap."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    poller.rate = 100 * MiB  # a 1 s copy: the first look at 0.85 s
    async with running(poller), trio.open_nursery() as nursery:
        handle = make_handle(100, MiB)
        transport.done_at[id(handle)] = trio.current_time() + 1.0
        nursery.start_soon(poller.wait, handle)
        await trio.sleep(0.1)
        assert transport.progress_calls == 0
        poller.add_demand()
        await trio.sleep(0.002)
        assert transport.progress_calls >= 1
        poller.drop_demand()


async def test_a_rate_dragged_down_by_stalled_copies_delays_no_one_beyond_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer that stalls its copies (over tcp the target must progress them) drives the
    rate down; another peer's quick copy is still seen within MAX_DELAY of its end."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        await timed_wait(poller, transport, make_handle(100, MiB), 0.010)
        for _ in range(6):  # stalled: 5 s each, halving the rate every time
            await timed_wait(poller, transport, make_handle(100, MiB), 5.0)
        # A 10 ms copy now looks 0.2 s long or more: its first look would be far too late.
        assert poller.rate is not None and poller.rate < 100 * MiB / 0.2
        seen, polls = await timed_wait(poller, transport, make_handle(100, MiB), 0.010)
        assert 0.010 <= seen <= 0.010 + MAX_DELAY + 1e-6
        gaps = [b - a for a, b in itertools.pairwise(polls)]
        assert max(gaps) <= MAX_DELAY + 1e-6
