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
"""

from __future__ import annotations

import logging
import math

import trio

from .transport.base import DataTransport, TransferHandle, TransferState

log = logging.getLogger("p2pkv.completion")

MIN_DELAY = 0.001
MAX_DELAY = 0.010


class CompletionPoller:
    def __init__(self, transport: DataTransport) -> None:
        self._transport = transport
        self._pending: dict[TransferHandle, tuple[trio.Event, DataTransport]] = {}
        self._states: dict[TransferHandle, TransferState] = {}
        self._demand = 0
        # The transport's own progress thread is held for the demand (NIXL), so this task
        # need not drive progress for it.
        self._held = False
        self._wakeup = trio.Event()
        self._nap: trio.CancelScope | None = None  # the poller's sleep between two polls

    @property
    def transport(self) -> DataTransport:
        return self._transport

    @transport.setter
    def transport(self, new: DataTransport) -> None:
        """A reconfiguration's swap: a demand held on the old transport's progress thread
        moves to the new one's (or to this task), so a fetch in flight keeps progressing."""
        old, self._transport = self._transport, new
        if self._held:
            self._held = False
            old.release_target_progress()
        if self._demand > 0:
            self._hold_or_wake()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _wake(self) -> None:
        self._wakeup.set()

    def _driving(self) -> bool:
        """Whether this task must drive progress for a demand."""
        return self._demand > 0 and not self._held

    def _hold_or_wake(self) -> None:
        self._held = self._transport.hold_target_progress()
        if not self._held:
            self._wake()

    def add_demand(self) -> None:
        """A consumer waits for incoming writes: keep driving progress until the matching
        :meth:`drop_demand`. The transport's own progress thread does it where it has one
        (NIXL: :mod:`p2pkv.transport._progress`), held once for every demand together;
        else this task does."""
        self._demand += 1
        if self._demand == 1:
            self._hold_or_wake()

    def drop_demand(self) -> None:
        self._demand -= 1
        if self._demand <= 0 and self._held:
            self._held = False
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
        event = trio.Event()
        self._pending[handle] = (event, dp)
        self._wake()
        try:
            await event.wait()
        except BaseException:
            self._pending.pop(handle, None)
            self._states.pop(handle, None)
            self._idle_if_done()
            raise
        return self._states.pop(handle)

    async def run(self) -> None:
        delay = MIN_DELAY
        while True:
            if not self._pending and not self._driving():
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                delay = MIN_DELAY
                continue
            try:
                self.transport.progress()
            except Exception:
                log.exception("data-plane progress failed")
            finished = False
            for handle, (event, dp) in list(self._pending.items()):
                state = dp.poll(handle)
                if state is not TransferState.PROC:
                    self._states[handle] = state
                    del self._pending[handle]
                    event.set()
                    finished = True
            delay = MIN_DELAY if finished else min(delay * 2, MAX_DELAY)
            if not self._pending and not self._driving():
                continue  # the last handle just settled: park now, not after a nap
            with trio.move_on_after(delay) as self._nap:
                await trio.sleep_forever()
            self._nap = None
