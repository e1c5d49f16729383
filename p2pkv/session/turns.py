"""Bounded work per session per scheduler turn: fairness between peers.

Theory of operation
-------------------
Every session of a node runs on the one Trio thread. A reader that handles everything
its peer sent before it yields makes every other peer wait behind that backlog: one peer
flooding small lookups once moved another pair's lookup p99 from 6 ms to over a second.
So a session's reader charges each event (and each key it pins or plans) to a
:class:`Turn`; once the turn's budget is spent it sends what it has queued and yields
with a checkpoint. Trio runs every runnable task once per batch, so each session gets a
turn of bounded work per batch, and a big lookup is pinned in slices of at most one
turn's keys. Receiving from the socket yields as well, so it starts a fresh turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio


@attrs.define(eq=False)
class Turn:
    max_events: int
    max_keys: int
    flush: Callable[[], Awaitable[None]]  # sends what the session has queued
    events: int = 0
    keys: int = 0

    def room(self) -> int:
        """Keys that may still be handled in this turn (at least one)."""
        return max(1, self.max_keys - self.keys)

    def charge(self, *, events: int = 0, keys: int = 0) -> None:
        self.events += events
        self.keys += keys

    def fresh(self) -> None:
        """The task just yielded anyway (e.g. to receive): a new turn starts."""
        self.events = self.keys = 0

    def spent(self) -> bool:
        return self.events >= self.max_events or self.keys >= self.max_keys

    async def pause(self) -> None:
        """Send what is queued, let the other tasks run once; a new turn starts."""
        await self.flush()
        await trio.lowlevel.checkpoint()
        self.fresh()

    async def pause_if_spent(self) -> None:
        """If the budget is spent: :meth:`pause`. (The reader checks :meth:`spent` first
        itself, so an event that leaves budget costs it no coroutine.)"""
        if self.spent():
            await self.pause()
