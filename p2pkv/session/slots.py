"""Request slots: how many of our requests may be open at a peer at once.

A semaphore whose size can change: the limit is the smaller of our ``max_open_requests``
and the one the peer advertises in its hello, which comes after the session exists and
may change when the peer restarts. A lookup split into several requests takes the slots
of all its requests at once (:meth:`RequestSlots.take`), so two such lookups can never
each hold part of what the other waits for. Waiters are served first come, first
served: slots given back go to the oldest waiter, and nobody takes a slot past one, so a
lookup that needs several slots is not starved by a stream of single ones. A waiter
for more slots than a lowered limit allows is refused at once: it could never be served,
and at the head of the queue it would hold everyone behind it until its deadline.
"""

from __future__ import annotations

import collections

import trio

__all__ = ["RequestSlots"]


class _Waiter:
    __slots__ = ("n", "refused", "taken")

    def __init__(self, n: int) -> None:
        self.n = n
        self.taken = trio.Event()  # set once its slots are handed over, or it is refused
        self.refused = False  # the limit fell below n: it takes nothing


class RequestSlots:
    """At most ``limit`` slots taken at a time. Trio thread only."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._ended = False

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def free(self) -> int:
        return max(self._limit - self._used, 0)

    @property
    def waiting(self) -> bool:
        """Someone waits for slots."""
        return bool(self._waiters)

    def set_limit(self, limit: int) -> None:
        """A new limit; slots taken stay taken (over a lowered limit, until given back).
        A waiter for more than ``limit`` slots is refused (see :meth:`take`)."""
        self._limit = limit
        kept: collections.deque[_Waiter] = collections.deque()
        for w in self._waiters:
            if w.n > limit:
                w.refused = True
                w.taken.set()
            else:
                kept.append(w)
        self._waiters = kept
        self._hand_over()

    def take_nowait(self, n: int = 1) -> bool:
        """Take ``n`` slots if they are free now and nobody waits (no checkpoint); at once
        once the session has ended (see :meth:`end`)."""
        if self._ended:
            self._used += n
            return True
        if self._waiters or self._used + n > self._limit:
            return False
        self._used += n
        return True

    async def take(self, n: int = 1) -> bool:
        """Take ``n`` slots together, after those who wait already. The caller makes sure
        ``n`` is within the limit (more would never be free). A checkpoint only when it
        waits; cancelled while waiting, it takes nothing. False, taking nothing, if the
        limit is lowered below ``n`` meanwhile (:meth:`set_limit`)."""
        if self.take_nowait(n):
            return True
        me = _Waiter(n)
        self._waiters.append(me)
        try:
            await me.taken.wait()
        except BaseException:
            if me.refused:
                pass  # it took nothing, and is out of the queue
            elif me.taken.is_set():  # handed over as we were cancelled: give them back
                self._used -= n
            else:
                self._waiters.remove(me)
            self._hand_over()  # whoever waited behind us may fit now
            raise
        return not me.refused

    def end(self) -> None:
        """The session has ended: every waiter gets its slots at once, and so does every
        later taker, whatever the limit. Each finds the session closed, fails with that,
        and gives them back: no waiter waits for a slot of a dead session until its
        deadline, then reports that no slot was free."""
        self._ended = True
        while self._waiters:
            w = self._waiters.popleft()
            self._used += w.n
            w.taken.set()

    def give_back(self, n: int = 1) -> None:
        if n > self._used:
            raise RuntimeError(f"giving back {n} request slots of {self._used} taken")
        self._used -= n
        self._hand_over()

    def _hand_over(self) -> None:
        """Free slots to the waiters, oldest first, while the oldest fits."""
        while self._waiters and self._used + self._waiters[0].n <= self._limit:
            w = self._waiters.popleft()
            self._used += w.n
            w.taken.set()
