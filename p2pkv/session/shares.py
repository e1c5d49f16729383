"""What each peer's writes hold of our store (``NodeConfig.max_landing_share``).

A fetch from a peer reserves slots of our store for its keys before the peer writes, and
if we give up on the fetch (deadline, session lost, cancelled) those slots stay
quarantined a while: a late write may still land in them. A producer that answers every
lookup "hit" and then never writes would so keep slots unusable for ``fetch_timeout +
quarantine`` per fetch, and fetches from every other peer could meet ``StoreFull``. The
ledger here caps, per peer id (across its sessions: a reconnect starts no new share), the
slots reserved for its fetches in flight plus those quarantined after fetches from it
were given up.

A round's keys past the cap are not asked for. The fetch waits for room in the peer's
queue (first come, first served: a round that finds others waiting takes nothing, so a
stream of fetches cannot starve an earlier one) and is granted what is free when its
turn comes, then looks those keys up again and fetches them, part after part. After
``fetch_timeout`` without room they fail locally. So a legitimate fetch larger than the
share still loads, in parts; a peer that never writes holds its share and no more.

Quarantined slots count until their quarantine's deadline, even if the store frees them
earlier: the count can only be too high, for at most ``quarantine`` seconds, never too low.
Trio thread only.
"""

from __future__ import annotations

import collections
import heapq

import trio

__all__ = ["Grant", "LandingShares"]


class _Share:
    __slots__ = ("quarantined", "reserved", "until", "waiters")

    def __init__(self) -> None:
        self.reserved = 0
        self.quarantined = 0
        self.until: list[tuple[float, int]] = []  # (deadline, slots): a heap
        self.waiters: collections.deque[_Waiter] = collections.deque()  # oldest first

    def idle(self) -> bool:
        return not (self.reserved or self.quarantined or self.waiters)


class _Waiter:
    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken = trio.Event()


class Grant:
    """Slots :meth:`LandingShares.wait_for_room` counted for a peer's writes ahead of a
    lookup: a reservation takes from it, and what is left when the part is done goes back
    (:meth:`LandingShares.settle`)."""

    __slots__ = ("left",)

    def __init__(self, n: int) -> None:
        self.left = n

    def use(self, n: int) -> int:
        n = min(n, self.left)
        self.left -= n
        return n


class LandingShares:
    """Slots of our store held for each peer's writes: reserved or quarantined."""

    def __init__(self) -> None:
        self._shares: dict[str, _Share] = {}
        # (deadline, peer) of every quarantine, a heap: a peer whose quarantine ended and
        # that takes nothing more is dropped at the ledger's next use (:meth:`_forget`),
        # or a fleet whose peer ids churn would leave one entry per id for good.
        self._ends: list[tuple[float, str]] = []

    def held(self, peer: str, now: float) -> int:
        """Slots ``peer``'s writes hold now."""
        self._forget(now)
        share = self._shares.get(peer)
        if share is None:
            return 0
        self._expire(share, now)
        return share.reserved + share.quarantined

    def take(self, peer: str, n: int, cap: int, now: float) -> int:
        """Reserve up to ``n`` slots for ``peer``'s writes without passing ``cap`` in all,
        and none while others wait for room; returns how many (0..n), counted as reserved
        from now on."""
        self._forget(now)
        share = self._shares.get(peer)
        if share is None:
            share = self._shares[peer] = _Share()
        else:
            self._expire(share, now)
        k = 0 if share.waiters else min(n, max(cap - share.reserved - share.quarantined, 0))
        share.reserved += k
        if share.idle():
            del self._shares[peer]
        return k

    def settle(self, peer: str, n: int) -> None:
        """``n`` slots reserved for ``peer`` were committed or freed."""
        if not n:
            return
        share = self._shares[peer]
        share.reserved -= n
        if share.waiters:
            share.waiters[0].woken.set()
        elif share.idle():
            del self._shares[peer]

    def quarantine(self, peer: str, n: int, until: float) -> None:
        """``n`` slots reserved for ``peer`` are quarantined until ``until``."""
        if not n:
            return
        share = self._shares[peer]
        share.reserved -= n
        share.quarantined += n
        heapq.heappush(share.until, (until, n))
        heapq.heappush(self._ends, (until, peer))

    async def wait_for_room(self, peer: str, n: int, cap: int, give_up_at: float) -> Grant:
        """Wait, in ``peer``'s queue, until its writes hold fewer than ``cap`` slots: a
        grant of up to ``n`` slots, counted as reserved (what a reservation does not take
        of it goes back with :meth:`settle`); an empty one at ``give_up_at`` (a time of
        Trio's clock) if no room came by then."""
        share = self._shares.get(peer)
        if share is None:
            share = self._shares[peer] = _Share()
        me = _Waiter()
        share.waiters.append(me)
        try:
            while True:
                now = trio.current_time()
                self._expire(share, now)
                first = share.waiters[0] is me
                room = cap - share.reserved - share.quarantined
                if first and room > 0:
                    k = min(n, room)
                    share.reserved += k
                    return Grant(k)
                if now >= give_up_at:
                    return Grant(0)
                # Woken when a reservation settles or the one before us leaves the queue;
                # the first in it also at the peer's next quarantine's end.
                wake = give_up_at
                if first and share.until:
                    wake = min(wake, share.until[0][0])
                me.woken = trio.Event()  # no checkpoint since the checks above
                with trio.move_on_at(wake):
                    await me.woken.wait()
        finally:
            share.waiters.remove(me)
            if share.waiters:
                share.waiters[0].woken.set()  # it may be first now, or room may be left
            elif share.idle() and self._shares.get(peer) is share:
                del self._shares[peer]

    def _forget(self, now: float) -> None:
        """Drop the entries of peers whose quarantines ended by ``now`` and that hold
        nothing else (each quarantine is looked at once, here)."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            peer = heapq.heappop(ends)[1]
            share = self._shares.get(peer)
            if share is not None:
                self._expire(share, now)
                if share.idle():
                    del self._shares[peer]

    def _expire(self, share: _Share, now: float) -> None:
        heap = share.until
        while heap and heap[0][0] <= now:
            share.quarantined -= heapq.heappop(heap)[1]
