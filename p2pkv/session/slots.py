"""Request slots: how many of our requests may be open at a peer at once.

A semaphore whose size can change: the limit is the smaller of our ``max_open_requests``
and the one the peer advertises in its hello, which comes after the session exists and
may change when the peer restarts. A lookup split into several requests takes the slots
of all its requests at once (:meth:`RequestSlots.take`), so two such lookups can never
each hold part of what the other waits for.
"""

from __future__ import annotations

import trio

__all__ = ["RequestSlots"]


class RequestSlots:
    """At most ``limit`` slots taken at a time. Trio thread only."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._lot = trio.lowlevel.ParkingLot()

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def free(self) -> int:
        return max(self._limit - self._used, 0)

    def set_limit(self, limit: int) -> None:
        """A new limit; slots taken stay taken (over a lowered limit, until given back)."""
        self._limit = limit
        self._lot.unpark_all()

    def take_nowait(self, n: int = 1) -> bool:
        """Take ``n`` slots if they are free now (no checkpoint either way)."""
        if self._used + n <= self._limit:
            self._used += n
            return True
        return False

    async def take(self, n: int = 1) -> None:
        """Take ``n`` slots together, waiting until that many are free. The caller makes
        sure ``n`` is within the limit (more would never be free). A checkpoint only when
        it waits."""
        while not self.take_nowait(n):
            await self._lot.park()

    def give_back(self, n: int = 1) -> None:
        if n > self._used:
            raise RuntimeError(f"giving back {n} request slots of {self._used} taken")
        self._used -= n
        if self._lot:
            self._lot.unpark_all()  # each waiter looks again: a small count, rarely many
