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

import pytest
import trio
import trio.testing

from p2pkv.completion import (
    EARLY,
    MAX_DELAY,
    MAX_RATES,
    MIN_DELAY,
    SLACK,
    STEPS,
    CompletionPoller,
)
from p2pkv.transport.base import RegionLayout, RemotePeer, TransferHandle, TransferState

from .helpers import FaultFactory, fill, pair

MiB = 1 << 20


PEER = "fake-peer"


def make_handle(nblocks: int = 1, block_len: int = 4096, peer_name: str = PEER) -> TransferHandle:
    """A handle of ``nblocks`` blocks of ``block_len`` bytes to ``peer_name`` (what the
    poller weighs)."""
    peer = RemotePeer(peer_name, RegionLayout(0, nblocks, block_len))
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


async def test_a_cancelled_wait_leaves_its_handle_alone_and_the_poller_parks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The handle stays the caller's: once its wait is cancelled (a fetch gave up, and
    releases it) the poller never polls it again, and with nothing else pending parks at
    once (mutation review 2026-12-05: a cancelled wait left in the poller's set survived;
    it polled a released handle for ever)."""
    transport = CountingTransport(polls_until_done=1 << 30)  # a write that never settles
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    handle = make_handle()
    async with running(poller) as steps:
        with trio.move_on_after(0.05):
            await poller.wait(handle)
        assert poller.in_flight == 0
        await trio.testing.wait_all_tasks_blocked()  # the poller has taken its last step
        polled, before = transport.polls[id(handle)], steps.steps
        await trio.sleep(1.0)
        assert transport.polls[id(handle)] == polled and steps.steps == before


class FailingTransport(CountingTransport):
    """FAKE data plane: each handle is PROC for ``polls_until_done`` polls, then ERR (a
    transfer the NIC failed after it began)."""

    def poll(self, handle: Any) -> TransferState:
        state = super().poll(handle)
        return TransferState.ERR if state is TransferState.DONE else state


async def test_a_transfer_that_fails_after_it_began_ends_its_wait_with_err(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A handle found PROC, then ERR, settles with ERR at that poll: the waiter (a fetch)
    learns of the failure at once, and the poller parks (mutation review 2026-12-05:
    settling only DONE and scheduling every other state again survived the suite, since
    every failing FAKE failed at the first poll, the wait's own; the wait then ran to the
    fetch's deadline)."""
    transport = FailingTransport(polls_until_done=3)
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        with trio.fail_after(1.0):
            assert await poller.wait(make_handle()) is TransferState.ERR
        assert poller.in_flight == 0


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


async def test_a_consumers_fetches_leave_no_demand_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch asks the poller to drive progress while it waits for the producer's writes,
    and drops that demand however it ends (loaded, or given up at its deadline): one
    left behind kept an idle node's poller waking every MAX_DELAY for ever (mutation
    review 2026-12-05: survived the suite)."""
    faults = FaultFactory()
    with trio.fail_after(60):
        async with pair(dst_kw={"fetch_timeout": 2.0}, src_transport=faults, virtual=True) as (
            src,
            dst,
        ):
            keys = fill(src.store, 2, 4096)
            peer = await dst.connect(src.address)
            assert (await dst.fetch(peer, keys[:1])).loaded == keys[:1]
            assert dst.poller._demand == 0
            faults.transport.hang = True  # the producer's next write never settles
            assert set((await dst.fetch(peer, keys[1:])).failed.values()) == {"timeout"}
            assert dst.poller._demand == 0


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
        poller.add_demand()  # two fetches wait: a hold each (each restarts its backoff)
        await trio.sleep(1.0)
        assert (transport.holds, transport.releases) == (2, 0)
        assert transport.progress_calls == 0 and steps.steps == before  # the task slept
        poller.drop_demand()
        assert transport.releases == 1
        poller.drop_demand()
        assert (transport.holds, transport.releases) == (2, 2)


async def test_a_swap_moves_the_demand_to_the_new_transport(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reconfiguration mid-fetch: the old transport's thread is let go, the new one's is
    held; a new transport without a thread gets its progress from the poller's task."""
    old, new, plain = ThreadedTransport(), ThreadedTransport(), CountingTransport(0)
    poller = CompletionPoller(old)  # type: ignore[arg-type]
    async with running(poller):
        poller.add_demand()
        poller.add_demand()
        poller.transport = new  # type: ignore[assignment]
        assert (old.holds, old.releases, new.holds, new.releases) == (2, 2, 2, 0)
        poller.drop_demand()
        assert (new.holds, new.releases) == (2, 1)
        poller.transport = plain  # type: ignore[assignment]
        assert (new.holds, new.releases) == (2, 2)
        await trio.sleep(0.05)
        driven = plain.progress_calls
        assert driven >= 3
        poller.drop_demand()
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1.0)
        assert plain.progress_calls == driven
    swapped = CompletionPoller(plain)  # type: ignore[arg-type]
    swapped.transport = old  # type: ignore[assignment]  # no demand: nothing is held
    assert old.holds == 2


async def test_a_handle_is_polled_on_the_transport_that_posted_it_across_a_swap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reconfiguration swaps the transport while writes posted on the old one are in
    flight: those are polled on the old one (whose handle they are), both the one pending
    at the swap and one waited for after it, never on the new one."""
    old, new = CountingTransport(polls_until_done=3), CountingTransport(polls_until_done=0)
    poller = CompletionPoller(old)  # type: ignore[arg-type]
    pending, later = make_handle(), make_handle()
    got: list[TransferState] = []

    async def wait_for_pending() -> None:
        got.append(await poller.wait(pending, old))  # type: ignore[arg-type]

    with trio.fail_after(60):
        async with running(poller), trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_pending)
            await trio.testing.wait_all_tasks_blocked()
            assert poller.in_flight == 1 and old.polls[id(pending)] <= 3  # still PROC
            poller.transport = new  # type: ignore[assignment]
            got.append(await poller.wait(later, old))  # type: ignore[arg-type]
    assert got == [TransferState.DONE, TransferState.DONE]
    assert old.polls == {id(pending): 4, id(later): 4}
    assert new.polls == {}


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
    on the backoff (1, 3, 7, 15 ms...: a 13 ms copy seen at 15 ms); it sets the peer's
    rate, and the next copy of that speed is looked at every MAX_DELAY at most until
    EARLY of its time, then every 1/STEPS of it: seen within that step of its end, not up
    to MAX_DELAY late, in a handful of looks."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        seen, polls = await timed_wait(poller, transport, make_handle(256, MiB), 0.013)
        assert seen >= 0.013 and len(polls) >= 4  # the backoff: no rate yet
        true_rate = 256 * MiB / 0.013
        rate = poller.rate_of(PEER)
        assert rate is not None and true_rate / 2 <= rate <= true_rate * 2
        for takes in (0.013, 0.013, 0.030):  # 30 ms: more bytes at the same speed
            nblocks = round(256 * takes / 0.013)
            rate = poller.rate_of(PEER)
            assert rate is not None
            expected = nblocks * MiB / rate
            seen, polls = await timed_wait(poller, transport, make_handle(nblocks, MiB), takes)
            first_look = min(EARLY * expected, MAX_DELAY)
            assert polls[1] >= first_look - SLACK - 1e-9
            assert takes <= seen <= takes + max(expected / STEPS, MIN_DELAY) + SLACK + 1e-6
            # One in wait(), one every MAX_DELAY up to EARLY of the expected time, then a
            # few of a twentieth each: not one every 1, 2, 4, 8, 10 ms from the start.
            assert len(polls) <= 1 + math.ceil(EARLY * expected / MAX_DELAY) + 5


async def test_a_faster_copy_raises_the_rate_at_once_a_slower_one_halfway(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    nbytes = 100 * MiB
    async with running(poller):
        await timed_wait(poller, transport, make_handle(100, MiB), 0.020)
        first = poller.rate_of(PEER)
        assert first is not None
        await timed_wait(poller, transport, make_handle(100, MiB), 0.005)
        fast = poller.rate_of(PEER)
        assert fast is not None and fast > 2 * first  # followed at once
        _, polls = await timed_wait(poller, transport, make_handle(100, MiB), 0.050)
        # The sample: its bytes over the middle of the last PROC look and the DONE one.
        sample = nbytes / ((polls[-2] + polls[-1]) / 2)
        assert sample < fast
        assert poller.rate_of(PEER) == pytest.approx((fast + sample) / 2)  # halfway


async def test_a_demand_is_driven_at_once_while_the_poller_naps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The poller naps until its next look at a handle (up to MAX_DELAY); a consumer that
    starts waiting meanwhile gets progress at once, not after the nap."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller), trio.open_nursery() as nursery:
        handle = make_handle(100, MiB)
        transport.done_at[id(handle)] = trio.current_time() + 1.0
        nursery.start_soon(poller.wait, handle)
        await trio.sleep(0.5)  # on the backoff: a look every MAX_DELAY by now
        before = transport.progress_calls
        poller.add_demand()
        await trio.sleep(0.0005)  # much less than any nap
        assert transport.progress_calls > before
        poller.drop_demand()


async def test_a_new_handle_cuts_a_nap_for_a_demand_short(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The poller drives a demand on its backoff (naps of up to MAX_DELAY); a handle of a
    peer with a known rate, due well within such a nap, is looked at when due."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        await timed_wait(poller, transport, make_handle(100, MiB), 0.020)  # sets the rate
        poller.add_demand()
        await trio.sleep(0.1)  # the demand's naps are MAX_DELAY long by now
        seen, _ = await timed_wait(poller, transport, make_handle(10, MiB), 0.002)
        assert seen <= 0.002 + MIN_DELAY + 1e-6
        poller.drop_demand()


async def test_a_peer_that_stalls_its_copies_slows_no_one_elses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Over tcp the target must progress a copy: a peer can stall its own. Its rate falls;
    another peer's schedule does not move, and even its own later copies are looked at
    least every MAX_DELAY."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        for peer in (PEER, "honest"):
            await timed_wait(poller, transport, make_handle(100, MiB, peer), 0.010)
        honest = poller.rate_of("honest")
        for _ in range(6):  # stalled: 5 s each, halving its rate every time
            await timed_wait(poller, transport, make_handle(100, MiB), 5.0)
        stalled = poller.rate_of(PEER)
        assert stalled is not None and stalled < 100 * MiB / 0.2  # 10 ms now looks >= 0.2 s
        assert poller.rate_of("honest") == honest
        for blocks in (100, 50, 200):  # the honest peer, at its speed: as before the stalls
            takes = 0.010 * blocks / 100
            handle = make_handle(blocks, MiB, "honest")
            seen, _ = await timed_wait(poller, transport, handle, takes)
            assert seen <= takes + max(takes / STEPS, MIN_DELAY) + SLACK + 1e-6
        # The staller's own: looked at every MAX_DELAY. The longer copy first, while its
        # rate still says seconds: a copy found done at its first look raises the rate at
        # once, and a schedule that waited for EARLY of a stale estimate went unseen
        # (mutation review 2026-12-05).
        for takes in (0.025, 0.010):
            seen, polls = await timed_wait(poller, transport, make_handle(100, MiB), takes)
            assert takes <= seen <= takes + MAX_DELAY + 1e-6
            assert max(b - a for a, b in itertools.pairwise(polls)) <= MAX_DELAY + 1e-6


async def test_handles_due_together_cost_one_wake_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Handles posted microseconds apart (a split post, several peers) are looked at in
    the same wake-ups, not one wake-up each."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller) as steps, trio.open_nursery() as nursery:
        await trio.testing.wait_all_tasks_blocked()
        before = steps.steps
        for i in range(32):
            handle = make_handle(1, MiB, f"peer-{i}")
            transport.done_at[id(handle)] = trio.current_time() + 0.2
            nursery.start_soon(poller.wait, handle)
            await trio.sleep(0.00002)
        await trio.sleep(0.3)
        assert poller.in_flight == 0
        # ~25 looks of the backoff up to 0.2 s, shared: not 25 for each of 32 handles.
        assert steps.steps - before <= 30


async def test_rates_are_kept_for_at_most_max_rates_peers_newest_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Peers that come and go (or one that reconnects under ever new names) cannot grow
    the poller's memory: the peer updated longest ago is forgotten first."""
    transport = TimedTransport()
    poller = CompletionPoller(transport)  # type: ignore[arg-type]
    async with running(poller):
        for i in range(MAX_RATES + 5):
            await timed_wait(poller, transport, make_handle(1, MiB, f"peer-{i}"), 0.002)
        await timed_wait(poller, transport, make_handle(1, MiB, "peer-5"), 0.002)  # renewed
        await timed_wait(poller, transport, make_handle(1, MiB, "late"), 0.002)
        assert len(poller._rates) == MAX_RATES
        assert poller.rate_of("peer-5") is not None and poller.rate_of("late") is not None
        assert poller.rate_of("peer-0") is None and poller.rate_of("peer-6") is None
