"""What each peer's writes hold of our store (``NodeConfig.max_landing_share``).

A fetch from a peer reserves slots of our store for its keys before the peer writes, and
if we give up on the fetch (deadline, session lost, cancelled) those slots stay
quarantined a while: a late write may still land in them. A producer that answers every
lookup "hit" and then never writes would so keep slots unusable for ``fetch_timeout +
quarantine`` per fetch, and fetches from every other peer could meet ``StoreFull``. The
ledger here caps, per peer id (across its sessions: a reconnect starts no new share), the
slots reserved for its fetches in flight plus those quarantined after fetches from it
were given up. A round's keys past the cap are not asked for: once the peer's writes
hold less (its earlier keys landed, a quarantine ended) they are looked up and fetched
again, and after ``fetch_timeout`` without room they fail locally. So a legitimate fetch
larger than the share still loads, in parts; a peer that never writes holds its share
and no more.

Quarantined slots count until their quarantine's deadline, even if the store frees them
earlier: the count can only be too high, for at most ``quarantine`` seconds, never too low.
Trio thread only.
"""

from __future__ import annotations

import heapq
import math

import trio

__all__ = ["LandingShares"]


class _Share:
    __slots__ = ("quarantined", "reserved", "until")

    def __init__(self) -> None:
        self.reserved = 0
        self.quarantined = 0
        self.until: list[tuple[float, int]] = []  # (deadline, slots): a heap


class LandingShares:
    """Slots of our store held for each peer's writes: reserved or quarantined."""

    def __init__(self) -> None:
        self._shares: dict[str, _Share] = {}
        self._room = trio.lowlevel.ParkingLot()  # someone's reserved slots were settled

    def held(self, peer: str, now: float) -> int:
        """Slots ``peer``'s writes hold now."""
        share = self._shares.get(peer)
        if share is None:
            return 0
        self._expire(peer, share, now)
        return share.reserved + share.quarantined

    def take(self, peer: str, n: int, cap: int, now: float) -> int:
        """Reserve up to ``n`` slots for ``peer``'s writes without passing ``cap`` in all;
        returns how many it may reserve (0..n), counted as reserved from now on."""
        share = self._shares.get(peer)
        if share is None:
            share = self._shares[peer] = _Share()
        else:
            self._expire(peer, share, now)
        room = max(cap - share.reserved - share.quarantined, 0)
        k = min(n, room)
        share.reserved += k
        if not share.reserved and not share.quarantined:
            del self._shares[peer]
        return k

    def settle(self, peer: str, n: int) -> None:
        """``n`` slots reserved for ``peer`` were committed or freed."""
        if not n:
            return
        share = self._shares[peer]
        share.reserved -= n
        if not share.reserved and not share.quarantined:
            del self._shares[peer]
        if self._room:
            self._room.unpark_all()

    def quarantine(self, peer: str, n: int, until: float) -> None:
        """``n`` slots reserved for ``peer`` are quarantined until ``until``."""
        if not n:
            return
        share = self._shares[peer]
        share.reserved -= n
        share.quarantined += n
        heapq.heappush(share.until, (until, n))

    async def wait_for_room(self, peer: str, cap: int, give_up_at: float) -> bool:
        """Wait until ``peer``'s writes hold fewer than ``cap`` slots: True, or False at
        ``give_up_at`` (a time of Trio's clock) if they still hold as many."""
        while True:
            now = trio.current_time()
            share = self._shares.get(peer)
            if share is None:
                return cap > 0
            self._expire(peer, share, now)
            if share.reserved + share.quarantined < cap:
                return True
            if now >= give_up_at:
                return False
            # Woken when any reservation settles, or at the peer's next quarantine's end.
            wake = min(give_up_at, share.until[0][0] if share.until else math.inf)
            with trio.move_on_at(wake):
                await self._room.park()

    def _expire(self, peer: str, share: _Share, now: float) -> None:
        heap = share.until
        while heap and heap[0][0] <= now:
            share.quarantined -= heapq.heappop(heap)[1]
