"""What one producer's writes may hold of our store (``NodeConfig.max_landing_share``).

A producer that answers "hit" and never writes keeps the slots of our fetches from it
reserved until the fetch's deadline and quarantined after it. Its share caps that, per
peer id, so fetches from other peers still find room; a legitimate fetch larger than the
share loads in parts.

Autojump clock, real TCP on loopback; writes that never complete come from
:class:`~tests.helpers.FaultTransport` (FAKE: ``hang``), and blocking data-plane calls run
inline through :class:`~tests.helpers.VirtualOffload` (FAKE), as in test_timeouts.py.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from p2pkv import Node, Peer, open_node
from p2pkv.session.shares import LandingShares
from p2pkv.transport.base import RemotePeer, TransferHandle, TransferState

from .helpers import FaultFactory, FaultTransport, VirtualOffload, config, fill
from .helpers import virtual_node as node

OVER_SHARE = "over the peer's share of our store (max_landing_share)"

# Virtual seconds on the autojump clock: "this did not hang", never an expected duration;
# above every deadline and wait of the tests that use it.
VIRTUAL_BOUND = 120.0


def hanging() -> FaultFactory:
    return FaultFactory(lambda t: setattr(t, "hang", True))


@contextlib.asynccontextmanager
async def share_quarantined() -> AsyncIterator[tuple[FaultFactory, Node, Node, Peer, list[bytes]]]:
    """A peer "bad" whose writes never settle, and a node "dst" (16 blocks, half of them
    its landing share for a peer) whose first fetch of 8 of bad's 12 keys timed out and
    left the whole share quarantined for 30 s: (bad's transport, bad, dst, dst's peer
    handle of bad, the 12 keys)."""
    bad_transport = hanging()
    async with (
        node("bad", factory=bad_transport, abort_timeout=1.0, quarantine=30.0) as bad,
        node(
            "dst", num_blocks=16, max_landing_share=0.5, fetch_timeout=4.0, quarantine=30.0
        ) as dst,
    ):
        keys = fill(bad.store, 12, 4096)
        peer = await dst.connect(bad.address)
        first = await dst.fetch(peer, keys[:8])
        assert first.failed == dict.fromkeys(keys[:8], "timeout")  # the share is full
        yield bad_transport, bad, dst, peer, keys


async def test_a_producer_that_never_writes_holds_only_its_share_and_others_still_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_BOUND):
        bad_transport = hanging()
        async with (
            node("bad", factory=bad_transport, abort_timeout=1.0, quarantine=20.0) as bad,
            node("good") as good,
            node(
                "dst", num_blocks=16, max_landing_share=0.5, fetch_timeout=4.0, quarantine=20.0
            ) as dst,
        ):
            bad_keys = fill(bad.store, 16, 4096)
            good_keys = fill(good.store, 8, 4096)
            bad_peer = await dst.connect(bad.address)
            good_peer = await dst.connect(good.address)
            results = {}

            async def from_bad() -> None:
                results["bad"] = await dst.fetch(bad_peer, bad_keys)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(from_bad)
                await trio.sleep(1.0)  # the bad fetch holds its slots, its write hangs
                assert dst.statistics().store.reserved == 8  # its share, not all 16
                assert bad_transport.transport.posts == 1
                # Without the share the bad fetch would hold all 16 slots: StoreFull here.
                got = await dst.fetch(good_peer, good_keys)
                assert got.loaded == good_keys and not got.failed
            bad_result = results["bad"]
            assert bad_result.loaded == []
            # The first 8 timed out; the rest were never asked for and fail as they did.
            assert bad_result.failed == dict.fromkeys(bad_keys, "timeout")
            assert bad_transport.transport.posts == 1
            assert dst.statistics().quarantined_slots == 8


@pytest.mark.parametrize(
    ("share", "n", "parts"),
    [
        pytest.param(0.25, 16, 4, id="four_parts_of_four"),
        # Under one block of a small store: the share is one block, never none (mutation
        # review 2026-12-06: the cap without its floor of one survived, and with it every
        # fetch from every peer failed "over the peer's share").
        pytest.param(0.05, 3, 3, id="under_one_block"),
    ],
)
async def test_a_fetch_larger_than_the_share_loads_in_parts(
    share: float, n: int, parts: int, autojump_clock: trio.testing.MockClock
) -> None:
    """A fetch past the peer's share of a 16-slot store loads in parts, one after another,
    each within the share; the producer's pins and our reservations are all given back."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with (
            node("src", num_blocks=64, factory=factory) as src,
            node("dst", num_blocks=16, max_landing_share=share) as dst,
        ):
            keys = fill(src.store, n, 4096)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.loaded == keys and not result.failed
            assert all(dst.store.get(k) == src.store.get(k) for k in keys)
            assert factory.transport.posts == parts
            assert dst.statistics().store.reserved == 0
            assert src.statistics().pinned_slots == 0


class HangsAfterTheFirstPost(FaultTransport):
    """FAKE: the first posted write settles; every later one stays PROC (never settles)."""

    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        h = super().post_write(peer, local_slots, remote_slots)
        if self.posts > 1:
            h.native = TransferState.PROC
        return h


async def test_keys_after_a_part_that_fails_fail_as_it_did_not_as_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch of three shares' worth: the first part loads, the second's write never
    settles (timeout), and the third, never asked for, fails as the second did. Nobody
    cancelled anything, so no key may say "cancelled" (mutation review 2026-12-06:
    dropping the reason given to the keys not asked for survived, since every test's
    failing part was its fetch's first)."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory(kind=HangsAfterTheFirstPost)
        async with (
            node("src", num_blocks=64, factory=factory, abort_timeout=1.0, quarantine=20.0) as src,
            node(
                "dst", num_blocks=16, max_landing_share=0.25, fetch_timeout=4.0, quarantine=20.0
            ) as dst,
        ):
            keys = fill(src.store, 12, 4096)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.loaded == keys[:4]
            assert all(dst.store.get(k) == src.store.get(k) for k in keys[:4])
            assert result.failed == dict.fromkeys(keys[4:], "timeout")
            assert factory.transport.posts == 2  # the third part was never asked for
            st = dst.statistics()
            assert st.store.reserved == 0 and st.quarantined_slots == 4


async def test_after_a_give_up_the_peers_quarantined_slots_keep_its_next_fetch_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Quarantined slots count against the share until the quarantine ends, across a
    reconnect: the next fetch from that peer waits for room, and gives up after
    ``fetch_timeout`` with nothing written (its lookup was answered; no fetch was sent)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with share_quarantined() as (bad_transport, bad, dst, peer, keys):
            assert dst.statistics().quarantined_slots == 8
            await dst.disconnect(peer)
            peer = await dst.connect(bad.address)  # a new session: the same peer id's share
            start = trio.current_time()
            second = await dst.fetch(peer, keys[8:])
            assert trio.current_time() - start == pytest.approx(4.0, abs=0.5)
            assert second.failed == dict.fromkeys(keys[8:], OVER_SHARE)
            assert bad_transport.transport.posts == 1  # nothing more was written
            assert dst.statistics().store.reserved == 0


async def test_keys_past_the_share_of_a_session_that_just_ended_fail_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The peer's share is full of quarantined slots, so a fetch's round gets no room and
    its keys are to wait in the peer's queue; the session ends as that round is closed.
    The keys fail "session closed" at once: a wait begun after the session's end is
    woken by nothing (the end cancels only the waits it finds), and sat out
    ``fetch_timeout`` (mutation review 2026-12-05: survived the suite)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with share_quarantined() as (_, _, dst, peer, keys):
            session = dst._by_peer["bad"]
            close_round, flush = session._close_round, session._flush
            closed: list[int] = []

            def close_round_noted(req: int) -> None:
                close_round(req)
                closed.append(req)

            async def flush_then_lose_the_peer(*args: Any, **kw: Any) -> None:
                # FAKE: the peer dies as the round without room is closed, and the session
                # has ended by the time its fetch goes on.
                await flush(*args, **kw)
                if closed and session.alive:
                    session.close("the peer is gone")
                    await session.finished.wait()

            session._close_round = close_round_noted  # type: ignore[method-assign]
            session._flush = flush_then_lose_the_peer  # type: ignore[method-assign]
            start = trio.current_time()
            second = await dst.fetch(peer, keys[8:])
            # The session's close (its flush and linger) and no wait for room: not 4 s.
            assert trio.current_time() - start < 1.0
            assert second.failed == dict.fromkeys(keys[8:], "session closed: the peer is gone")


@asynccontextmanager
async def waiting_for_room(dst: Node, peer: Peer, keys: list[bytes]) -> AsyncIterator[list[Any]]:
    """A fetch of ``keys`` started and left waiting for room in the peer's share (0.5
    virtual seconds, far short of the wait's 4 s); the block runs while it waits, and its
    result is in the list yielded once the block is over."""
    got: list[Any] = []

    async def fetch() -> None:
        got.append(await dst.fetch(peer, keys))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        await trio.sleep(0.5)
        assert dst._by_peer[peer.peer_id]._share_waits, "the fetch does not wait for room"
        yield got


async def test_a_fetch_waiting_for_room_ends_when_its_session_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch waits for room in the peer's share (full of quarantined slots), and the
    session ends meanwhile: the session's end cancels the wait, and the keys fail "session
    closed" at once, not when the wait would have given up, ``fetch_timeout`` later, as
    over the share (removing that cancel survived the suite: the session review)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with share_quarantined() as (_, _, dst, peer, keys):
            session = dst._by_peer["bad"]
            async with waiting_for_room(dst, peer, keys[8:]) as got:
                closed_at = trio.current_time()
                session.close("the peer is gone")
            assert trio.current_time() - closed_at < 1.0
            [second] = got
            assert second.failed == dict.fromkeys(keys[8:], "session closed: the peer is gone")


async def test_a_fetch_waiting_for_room_goes_on_when_the_quarantine_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The wait ends at the peer's quarantine's end (no other wake-up comes)."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory(lambda t: setattr(t, "hang", True))
        async with (
            node("src", factory=factory, abort_timeout=1.0, quarantine=6.0) as src,
            node(
                "dst", num_blocks=8, max_landing_share=0.5, fetch_timeout=3.0, quarantine=6.0
            ) as dst,
        ):
            keys = fill(src.store, 8, 4096)
            peer = await dst.connect(src.address)
            first = await dst.fetch(peer, keys[:4])
            gave_up = trio.current_time()
            assert set(first.failed.values()) == {"timeout"}
            factory.transport.hang = False  # the producer recovers
            second_at: list[float] = []

            async def second_fetch() -> None:
                result = await dst.fetch(peer, keys[4:])
                second_at.append(trio.current_time())
                assert result.loaded == keys[4:]

            # Started 2 s before the quarantine's end, within its 3 s fetch_timeout: room comes
            # at that end, and nothing but the end's own timer can tell the waiter.
            await trio.sleep(gave_up + 6.0 - trio.current_time() - 2.0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(second_fetch)
            assert second_at and second_at[0] == pytest.approx(gave_up + 6.0, abs=0.5)


async def test_a_fetch_waiting_for_room_goes_on_when_another_fetch_from_the_peer_lands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two fetches from one peer at once, each the size of its share: the second waits
    and is woken when the first's slots are committed, long before its own deadline."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with (
            open_node(
                config("src"), offload=VirtualOffload({"_post_run": 1.0}), transport=FaultFactory()
            ) as src,
            node("dst", num_blocks=16, max_landing_share=0.5, fetch_timeout=20.0) as dst,
        ):
            keys = fill(src.store, 16, 4096)
            peer = await dst.connect(src.address)
            done: dict[str, float] = {}

            async def fetch(name: str, ks: list[bytes]) -> None:
                result = await dst.fetch(peer, ks)
                assert result.loaded == ks and not result.failed
                done[name] = trio.current_time()

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, "a", keys[:8])
                await trio.sleep(0.1)
                nursery.start_soon(fetch, "b", keys[8:])
            # Each write takes a virtual second: b's starts when a's slots count no more.
            assert done["a"] - start == pytest.approx(1.0, abs=0.2)
            assert done["b"] - start == pytest.approx(2.0, abs=0.2)


async def test_a_fetch_of_hundreds_of_parts_loads_them_one_after_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Parts are a loop: each used to be fetched by a call nested in the previous part's,
    and a fetch of ~300 parts raised RecursionError (review 2026-12-04). 400 keys that
    fit the store, a share of one slot: 400 parts."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with (
            node("src", num_blocks=512, factory=factory) as src,
            node("dst", num_blocks=512, max_landing_share=1 / 512) as dst,
        ):
            keys = fill(src.store, 400, 4096)
            missing = [os.urandom(32) for _ in range(4)]  # parts that find nothing give back
            wanted = keys[:100] + missing + keys[100:]  # the room they were granted
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, wanted)
            assert result.loaded == keys and result.failed == dict.fromkeys(missing, "miss")
            assert factory.transport.posts == 400
            assert dst.landing_shares.held("src", trio.current_time()) == 0


async def test_a_fetch_waiting_for_room_is_not_starved_by_later_fetches_from_the_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Fetch A waits for the share, which B's fetches hold one after another, each
    looked up ahead (the lookup_round-then-fetch pattern). A used to be woken, look its
    keys up again, and find that B's next fetch, its round already in, had taken the room:
    it waited again, each time with a fresh deadline, for as long as B went on. The queue
    is first come, first served: B's next fetch takes nothing while A waits. Found by a
    review (2026-12-04)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with (
            open_node(
                config("src", num_blocks=256),
                offload=VirtualOffload({"_post_run": 1.0}),  # each write: 1 virtual second
                transport=FaultFactory(),
            ) as src,
            node("dst", num_blocks=16, max_landing_share=0.25, fetch_timeout=3.0) as dst,
        ):
            keys = fill(src.store, 4 * 21 + 4, 4096)
            a_keys, b_batches = keys[:4], [keys[4 + 4 * i : 8 + 4 * i] for i in range(21)]
            peer = await dst.connect(src.address)
            done: dict[str, Any] = {}

            async def b() -> None:
                await dst.lookup(peer, b_batches[0])
                for i in range(20):
                    async with trio.open_nursery() as n:
                        n.start_soon(dst.lookup, peer, b_batches[i + 1])  # ahead, as a host does
                        assert not (await dst.fetch(peer, b_batches[i])).failed
                done["b"] = trio.current_time()

            async def a() -> None:
                r = await dst.fetch(peer, a_keys)
                done["a"] = trio.current_time()
                done["a_failed"] = r.failed

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(b)
                await trio.sleep(0.1)
                nursery.start_soon(a)
            # A's turn comes once B's fetch in flight lands: its own write a second later.
            assert not done["a_failed"], done
            assert done["a"] - start <= 3.5, done
            assert done["b"] - start >= 21.0, done  # B went on, one fetch a second, A among them


def test_the_ledger_counts_reserved_and_quarantined_until_the_deadline() -> None:
    shares = LandingShares()
    assert shares.take("p", 5, cap=8, now=0.0) == 5
    assert shares.take("p", 5, cap=8, now=0.0) == 3  # 8 in all
    assert shares.take("q", 5, cap=8, now=0.0) == 5  # per peer
    shares.settle("p", 3)
    shares.quarantine("p", 5, until=10.0)
    assert shares.held("p", now=9.9) == 5
    assert shares.take("p", 8, cap=8, now=9.9) == 3
    assert shares.held("p", now=10.0) == 3  # the quarantine ended
    shares.settle("p", 3)
    assert shares.held("p", now=10.0) == 0
    shares.settle("q", 5)
    assert shares.held("q", now=0.0) == 0
    assert shares.take("r", 0, cap=8, now=0.0) == 0  # a round with no keys to land
    assert not shares._shares  # nothing kept for peers that hold nothing


def test_the_ledger_forgets_peers_whose_quarantine_ended() -> None:
    """A peer's entry went only at its next take, so every peer id a fetch ever gave up
    on stayed for good once its quarantine ended: a fleet whose ids churn (a worker per
    process start) grew the ledger by one entry per id, for as long as the node ran. Now
    the ledger's next use drops each whose quarantine has ended and holds nothing else."""
    shares = LandingShares()
    for i in range(200):
        peer = f"gone{i}"  # one fetch given up on, then never seen again
        assert shares.take(peer, 2, cap=8, now=float(i)) == 2
        shares.quarantine(peer, 2, until=i + 5.0)
        assert len(shares._shares) <= 6, len(shares._shares)  # those still quarantined
    assert shares.held("gone199", now=203.0) == 2
    assert shares.take("new", 1, cap=8, now=300.0) == 1
    assert set(shares._shares) == {"new"}
    shares.settle("new", 1)
    assert not shares._shares


async def test_a_grant_gives_a_reservation_no_more_than_it_holds() -> None:
    """A part's reservation takes from the room granted to it, never more: the rest of
    its keys are not asked for, and the share is not passed."""
    shares = LandingShares()
    with trio.fail_after(5):
        grant = await shares.wait_for_room("p", 5, 3, math.inf)
    assert grant.left == 3 and shares.held("p", trio.current_time()) == 3
    assert grant.use(5) == 3 and grant.left == 0
    assert grant.use(1) == 0


async def test_the_queue_is_first_come_first_served() -> None:
    """Room that frees up goes to the oldest waiter: a round that finds others waiting
    takes nothing, however soon it asks; a waiter that leaves wakes the next."""
    shares = LandingShares()
    now = trio.current_time
    assert shares.take("p", 4, cap=4, now=now()) == 4
    got: list[tuple[str, int]] = []

    async def waiter(name: str, n: int) -> None:
        got.append((name, (await shares.wait_for_room("p", n, 4, math.inf)).left))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "a", 1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(waiter, "b", 2)
            await trio.testing.wait_all_tasks_blocked()
            shares.settle("p", 4)
            assert shares.take("p", 4, cap=4, now=now()) == 0  # a and b wait: not now
        # a took 1 and left; b, woken by that, took 2 of the 3 left.
        assert got == [("a", 1), ("b", 2)]
        assert shares.held("p", now()) == 3
        assert shares.take("p", 4, cap=4, now=now()) == 1  # nobody waits any more


async def test_room_granted_for_keys_the_peer_no_longer_has_goes_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A part is granted room before its lookup; keys that miss there (evicted at the
    source since the first lookup) take none of it, and what is left goes back: kept, it
    would hold the share for good and every later part would fail after fetch_timeout."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with (
            node("src", num_blocks=64) as src,
            node("dst", num_blocks=64, max_landing_share=1 / 64, fetch_timeout=3.0) as dst,
        ):
            keys = fill(src.store, 12, 4096)
            gone = set(keys[4:8])
            pin, asked = src.store.pin, dict.fromkeys(keys, 0)

            def pin_then_lose(owner: object, ks: Sequence[bytes]) -> list[int | None]:
                got = pin(owner, ks)
                for i, k in enumerate(ks):
                    asked[k] += 1
                    slot = got[i]
                    if k in gone and asked[k] > 1 and slot is not None:  # its part's lookup:
                        src.store.unpin_keys(owner, [slot])  # as if evicted since the first
                        got[i] = None
                return got

            src.store.pin = pin_then_lose  # type: ignore[method-assign,assignment]
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.loaded == keys[:4] + keys[8:]
            assert result.failed == dict.fromkeys(keys[4:8], "miss")
            assert dst.landing_shares.held("src", trio.current_time()) == 0


async def test_a_fetch_that_finds_the_store_full_gives_its_room_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A round whose reservation meets StoreFull (the host pins every block) fails its
    keys "store full" and gives the room of the peer's share it took back: kept, each such
    fetch shrank the share for good, and once it was gone every later fetch from the peer
    waited out fetch_timeout and failed (mutation review 2026-12-05: survived)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with node("src") as src, node("dst", num_blocks=4) as dst:
            keys = fill(src.store, 2, 4096)
            dst.store.pin("host", fill(dst.store, 4, 4096))
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.loaded == [] and set(result.failed) == set(keys)
            assert all(why.startswith("store full") for why in result.failed.values())
            assert dst.landing_shares.held("src", trio.current_time()) == 0
            dst.store.unpin("host")
            assert sorted((await dst.fetch(peer, keys)).loaded) == sorted(keys)


async def test_two_fetches_of_the_same_keys_past_the_share_load_them_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two fetches at once of the same 16 keys, with room for 4 at a time: the second
    waits for the keys the first brings in (or fetches those the first has not claimed),
    every key is written once, both report every key loaded, and the share is empty
    after."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with (
            node("src", num_blocks=64, factory=factory) as src,
            node("dst", num_blocks=16, max_landing_share=0.25) as dst,
        ):
            keys = fill(src.store, 16, 4096)
            peer = await dst.connect(src.address)
            results: list[Any] = []

            async def fetch() -> None:
                results.append(await dst.fetch(peer, keys))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                nursery.start_soon(fetch)
            assert [r.loaded for r in results] == [keys, keys]
            assert all(not r.failed for r in results)
            assert factory.transport.posts == 4  # four parts of four, each written once
            assert all(dst.store.get(k) == src.store.get(k) for k in keys)
            assert dst.landing_shares.held("src", trio.current_time()) == 0


async def test_a_round_that_queues_behind_a_woken_waiter_does_not_take_its_room() -> None:
    """Room frees up and wakes the oldest waiter; a round that enters the queue before
    that waiter runs again is behind it, not first: it takes nothing (here it gives up at
    once), and the room goes to the waiter."""
    shares = LandingShares()
    now = trio.current_time
    assert shares.take("p", 2, cap=2, now=now()) == 2
    got: list[int] = []

    async def waiter() -> None:
        got.append((await shares.wait_for_room("p", 2, 2, math.inf)).left)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            shares.settle("p", 2)  # wakes the waiter; no checkpoint until the next line's
            late = await shares.wait_for_room("p", 1, 2, give_up_at=now())
            assert late.left == 0  # queued behind the waiter: nothing, however soon it asked
    assert got == [2]
    assert shares.held("p", now()) == 2


async def test_a_peers_bye_reason_in_a_waiting_fetchs_failures_is_escaped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch waits for room in the peer's share, and the peer ends the session with a
    bye whose reason forges a log line and drives a terminal. Every other failure reason
    that carries a peer's words comes through its error's escaped text; this one was the
    session's raw close reason, printed as it was by ``p2pkv fetch``'s FAILED line (errors
    review 2026-12-05)."""
    forged = "gone\n2026-12-05 p2pkv.node ERROR forged line\r\x1b[2J"
    with trio.fail_after(VIRTUAL_BOUND):
        async with share_quarantined() as (_, bad, dst, peer, keys):
            async with waiting_for_room(dst, peer, keys[8:]) as got:
                # FAKE hostile peer: its bye's reason is its own text, any characters.
                bad._by_peer["dst"].close(forged, "shutdown")
            [second] = got
            reasons = set(second.failed.values())
            assert len(reasons) == 1 and all(r.isprintable() for r in reasons), reasons
            assert r"gone\n2026-12-05 p2pkv.node ERROR forged line\r\x1b[2J" in reasons.pop()


async def test_a_held_rounds_keys_past_the_share_are_looked_up_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch naming a held round of 6 keys, with room for 4 at a time: the first part
    goes on the held round and loads the bytes it pinned (key 1 put again at the source
    since); a round is fetched once, so the keys past the share are looked up again on
    rounds of their own and load the source's bytes of that moment (key 5 put again
    since: its new bytes). Decided and documented ("Held rounds"); every pin is given
    back."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with (
            node("src", num_blocks=64, factory=factory) as src,
            node("dst", num_blocks=8, max_landing_share=0.5) as dst,
        ):
            keys = fill(src.store, 6, 4096)
            pinned = {k: bytes(src.store.get(k) or b"") for k in keys}  # copies
            peer = await dst.connect(src.address)
            rnd = await dst.lookup_round(peer, keys)
            assert rnd.hits == [True] * 6
            again = {k: os.urandom(4096) for k in (keys[1], keys[5])}
            for k, data in again.items():
                src.store.put(k, data)
            result = await dst.fetch(peer, keys, rounds=rnd)
            assert result.loaded == keys and not result.failed
            got = {k: bytes(dst.store.get(k) or b"") for k in keys}
            assert [got[k] for k in keys[:5]] == [pinned[k] for k in keys[:5]]
            assert got[keys[5]] == again[keys[5]] != pinned[keys[5]]
            assert factory.transport.posts == 2  # 4 on the held round, then 2
            assert src.statistics().pinned_slots == 0
