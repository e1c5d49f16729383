"""Completion polling for posted transfers: with backoff while busy, not at all when idle.

Theory of operation
-------------------
The data plane reports completion only when asked (``poll``), and some paths also need
the *target* of a write to drive progress. One task per node polls every pending handle
and calls ``progress()``; it sleeps with exponential backoff (1 ms up to 10 ms) while
anything is pending or a consumer is waiting for incoming writes (``demand``), and parks
on an event when nothing is: an idle node never wakes up for the data plane. When the
last handle settles or the last demand drops, its sleep is cut short (the deadline of
its cancel scope moved) so it parks at once rather than waking later inside whatever the
node does next, e.g. the next lookup. A transport with a progress thread of its own takes
a consumer's demand instead (NIXL: :mod:`p2pkv.transport._progress`), so that the
engine's thread sleeps through a fetch's copy.

Handles are polled on a schedule of their own. With copy threads a post returns before
its copy is done, and the backoff alone (1, 3, 7, 15, 25, 35... ms) saw a 13 ms copy
only at 15 ms and a 40 ms one up to 10 ms late. So the poller keeps, per peer, the rate
at which recent transfers to it completed (bytes per second; a sample takes the middle
of the last PROC poll and the DONE one; a faster sample is followed at once, a slower
one halfway; a copy found done at its first look counts as having taken half the time
waited, so a rate that was too slow doubles until looks find copies running). A new
handle is looked at every ``MAX_DELAY`` at most until ``EARLY`` of the time its bytes
should take, then every ``1/STEPS`` of that time (``MIN_DELAY`` to ``MAX_DELAY``), and on
the backoff again once it is ``LATE`` x overdue; a peer without a rate yet gets the
backoff. A copy of known speed is seen within a twentieth of its time of its end, after
one look per ``MAX_DELAY`` of its time and a handful near the end. A peer that stalls
its copies slows only its own schedule, and even that no more than the backoff would.
Each wake-up polls every handle due within ``SLACK`` of it, so handles due together
cost one wake-up, not one each.
"""

from __future__ import annotations

import logging
import math

import attrs
import trio

from .transport._progress import MAX_DELAY as MAX_DELAY  # one backoff for both
from .transport._progress import MIN_DELAY as MIN_DELAY
from .transport.base import DataTransport, TransferHandle, TransferState

log = logging.getLogger("p2pkv.completion")

EARLY = 0.85  # the first poll of a handle, as a share of its expected time
STEPS = 20  # polls after that: every 1/STEPS of the expected time
LATE = 1.5  # past this share of the expected time, back to the backoff
SLACK = MIN_DELAY  # a wake-up also polls the handles due within this much after it
MAX_RATES = 1024  # peers whose rate is kept


@attrs.define(eq=False)
class _Waiter:
    event: trio.Event
    transport: DataTransport
    nbytes: int
    since: float  # when the wait began (the post had returned)
    expected: float  # seconds its bytes should take at the recent rate; 0: unknown
    due: float  # next poll
    last_proc: float  # when a poll last found it PROC
    step: float = MIN_DELAY  # the backoff's current delay
    state: TransferState = TransferState.PROC

    def schedule(self, now: float) -> None:
        """After a poll found it PROC at ``now``: when to look next. Counted from when the
        look was due, so handles looked at together (within SLACK) stay together."""
        self.last_proc = now
        base = max(now, self.due)
        early = self.since + EARLY * self.expected
        if self.expected and base < early:  # never more than MAX_DELAY between two looks
            self.due = min(early, base + MAX_DELAY)
        elif self.expected and base < self.since + LATE * self.expected:
            self.due = base + min(max(self.expected / STEPS, MIN_DELAY), MAX_DELAY)
        else:
            self.due = base + self.step
            self.step = min(self.step * 2, MAX_DELAY)


class CompletionPoller:
    def __init__(self, transport: DataTransport) -> None:
        self._transport = transport
        self._pending: dict[TransferHandle, _Waiter] = {}
        # Bytes per second of recent transfers, per peer (agent name): a peer that stalls
        # its copies slows the schedule of no one else's. Oldest first, at most MAX_RATES.
        self._rates: dict[str, float] = {}
        self._demand = 0
        # Demands the transport's own progress thread holds (NIXL); this task drives the
        # rest.
        self._held = 0
        self._demand_due = -math.inf  # when this task next drives progress for a demand
        self._demand_delay = MIN_DELAY
        self._wakeup = trio.Event()
        self._nap: trio.CancelScope | None = None  # the poller's sleep between two polls

    @property
    def transport(self) -> DataTransport:
        return self._transport

    @transport.setter
    def transport(self, new: DataTransport) -> None:
        """A reconfiguration's swap: demands held on the old transport's progress thread
        move to the new one's (or to this task), so a fetch in flight keeps progressing."""
        old, self._transport = self._transport, new
        for _ in range(self._held):
            old.release_target_progress()
        self._held = 0
        for _ in range(self._demand):
            self._hold_or_drive()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def rate_of(self, agent_name: str) -> float | None:
        """Bytes per second recent transfers to this peer ran at; None if none yet."""
        return self._rates.get(agent_name)

    def _wake(self) -> None:
        self._wakeup.set()

    def _driving(self) -> bool:
        """Whether this task must drive progress for a demand (one the transport's own
        thread does not hold)."""
        return self._demand > self._held

    def _hold_or_drive(self) -> None:
        """One demand: held by the transport's thread (each hold restarts its backoff, so
        a new fetch's wire-up is prompt), else driven by this task, now and then on its
        backoff."""
        if self._transport.hold_target_progress():
            self._held += 1
            return
        self._demand_due, self._demand_delay = -math.inf, MIN_DELAY
        self._wake()
        if self._nap is not None:
            self._nap.deadline = -math.inf  # it may nap until a later poll

    def add_demand(self) -> None:
        """A consumer waits for incoming writes: keep driving progress until the matching
        :meth:`drop_demand`. The transport's own progress thread does it where it has one
        (NIXL: :mod:`p2pkv.transport._progress`); else this task does."""
        self._demand += 1
        self._hold_or_drive()

    def drop_demand(self) -> None:
        self._demand -= 1
        if self._held > self._demand:
            self._held -= 1
            self._transport.release_target_progress()
        self._idle_if_done()

    def _idle_if_done(self) -> None:
        """Nothing pending and nobody waiting: end the poller's nap now, so that it parks
        at once instead of waking up later (inside whatever the node does next) only to
        find nothing to do. Moving the deadline wakes nobody but the poller."""
        if not self._pending and not self._driving() and self._nap is not None:
            self._nap.deadline = -math.inf

    async def wait(
        self, handle: TransferHandle, transport: DataTransport | None = None
    ) -> TransferState:
        """Until the handle is not PROC. Cancellable; the handle stays the caller's.

        ``transport`` is the one that posted the handle (it may have been replaced by a
        reconfiguration since); the current one by default."""
        dp = transport or self.transport
        state = dp.poll(handle)
        if state is not TransferState.PROC:
            return state
        now = trio.current_time()
        nbytes = handle.nblocks * handle.peer.layout.block_len
        rate = self._rates.get(handle.peer.agent_name)
        expected = nbytes / rate if rate else 0.0
        # At most MAX_DELAY to the first look, as on the backoff, whatever the rate says.
        due = now + (min(EARLY * expected, MAX_DELAY) if expected else MIN_DELAY)
        w = self._pending[handle] = _Waiter(
            trio.Event(), dp, nbytes, since=now, expected=expected, due=due, last_proc=now
        )
        self._wake()
        if self._nap is not None and due < self._nap.deadline:
            self._nap.deadline = due  # napping for a demand or a later handle
        try:
            await w.event.wait()
        except BaseException:
            self._pending.pop(handle, None)
            self._idle_if_done()
            raise
        return w.state

    def _settled(self, handle: TransferHandle, w: _Waiter, state: TransferState) -> None:
        now = trio.current_time()
        # It ended between the last poll that found it PROC and now: take the middle (a
        # copy found done at its first poll counts as taking half the time waited, so a
        # rate that was too slow doubles each time until polls find the copy running).
        took = (w.last_proc + now) / 2 - w.since
        if state is TransferState.DONE and took > 0:
            sample = w.nbytes / took
            rates, name = self._rates, handle.peer.agent_name
            rate = rates.pop(name, None)
            rates[name] = sample if rate is None or sample > rate else (rate + sample) / 2
            if len(rates) > MAX_RATES:
                del rates[next(iter(rates))]
        w.state = state
        del self._pending[handle]
        w.event.set()

    async def run(self) -> None:
        while True:
            if not self._pending and not self._driving():
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            now = trio.current_time()
            if self._driving() and now >= self._demand_due:
                try:
                    self.transport.progress()
                except Exception:
                    log.exception("data-plane progress failed")
                self._demand_due = now + self._demand_delay
                self._demand_delay = min(self._demand_delay * 2, MAX_DELAY)
            for handle, w in list(self._pending.items()):
                if w.due > now + SLACK:  # one wake-up serves handles due about now
                    continue
                state = w.transport.poll(handle)
                if state is TransferState.PROC:
                    w.schedule(now)
                else:
                    self._settled(handle, w, state)
            if not self._pending and not self._driving():
                continue  # the last handle just settled: park now, not after a nap
            wake = min((w.due for w in self._pending.values()), default=math.inf)
            if self._driving():
                wake = min(wake, self._demand_due)
            with trio.move_on_at(wake) as self._nap:
                await trio.sleep_forever()
            self._nap = None
