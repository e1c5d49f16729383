"""Two operations at once on the same keys or slots: the pairs a review of such pairs
(2026-12-04) found untested. Others live with their subject (test_consumer_races.py,
test_landing_share.py, test_fetch_into.py, test_slots.py).

Each test sets its race up with events (a producer played by hand, or the autojump clock
with the FAKE data plane of tests/helpers.py), never with sleeps that guess an order.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from p2pkv import FetchResult, SlotsInUse, open_node
from p2pkv.node import Node
from p2pkv.session.protocol import Event, FetchRequested, LookupRequested, RoundClosed
from p2pkv.wire import Outcome

from .helpers import FaultFactory, RawPeer, config, fill, pair
from .test_fetch_into import hand_served

BLOCK = 4096
BOUND = 20.0  # seconds: "this did not hang", never an expected duration


class Recorder:
    """A producer played by hand: it records every event and answers nothing by itself;
    the test answers (``answer_lookup``) when its race needs it."""

    def __init__(self, raw: RawPeer) -> None:
        self.raw = raw
        self.events: list[Event] = []
        self._lot = trio.lowlevel.ParkingLot()

    async def run(self) -> None:
        while (ev := await self.raw.next_event()) is not None:
            self.events.append(ev)
            self._lot.unpark_all()

    async def wait_for(self, kind: type[Any], n: int = 1) -> list[Any]:
        while len(got := [e for e in self.events if isinstance(e, kind)]) < n:
            await self._lot.park()
        return got

    async def answer_lookup(self, ev: LookupRequested, hits: list[bool]) -> None:
        self.raw.proto.send_lookup_resp(ev.req_id, hits, trio.current_time(), 60.0)
        await self.raw.flush()


@asynccontextmanager
async def recorded() -> AsyncIterator[tuple[Node, RawPeer, Recorder, trio.Nursery]]:
    """A consumer node ``dst`` and a :class:`Recorder` producer connected to it; the
    nursery is the test's to start its callers in."""
    raw = RawPeer("p")
    try:
        async with open_node(config("dst")) as dst, trio.open_nursery() as nursery:
            await raw.connect(dst.address)
            await raw.handshake()
            prod = Recorder(raw)
            nursery.start_soon(prod.run)
            yield dst, raw, prod, nursery
            nursery.cancel_scope.cancel()
    finally:
        await raw.aclose()


async def test_a_fetch_whose_region_a_fetch_into_takes_meanwhile_closes_its_round() -> None:
    """fetch and fetch_into at once on one node. ``fetch`` checks ``lent_to_caller`` once,
    before its lookup; a ``fetch_into`` that starts while that lookup is out lends the
    (still empty) region to its caller. When the lookup's answer comes, the fetch's keys
    fail "region lent" and the round it looked up is closed, its request slot given back.
    (Its reservation's ``SlotsInUse`` used to escape the round, left open for good: enough
    of those and every lookup to that peer waited out its deadline for a slot.)"""
    keys = [os.urandom(32) for _ in range(2)]
    with trio.fail_after(BOUND):
        async with recorded() as (dst, raw, prod, nursery):
            session = dst._by_peer[raw.peer_id]
            limit = session._requests.limit
            fetched: list[object] = []
            both_done = trio.Event()

            def done(what: object) -> None:
                fetched.append(what)
                if len(fetched) == 2:
                    both_done.set()

            async def fetch() -> None:
                try:
                    done(await dst.fetch(raw.peer_id, keys[:1]))
                except SlotsInUse as exc:  # documented for fetch; the leak is the defect
                    done(exc)

            async def fetch_into() -> None:
                done(await dst.fetch_into(raw.peer_id, keys[1:], [3]))

            nursery.start_soon(fetch)
            (look_a,) = await prod.wait_for(LookupRequested)  # the fetch's lookup is out
            nursery.start_soon(fetch_into)  # lends the region at once
            _, look_b = await prod.wait_for(LookupRequested, 2)
            assert dst.store.lent_to_caller
            await prod.answer_lookup(look_a, [True])  # the fetch goes on to reserve
            await prod.answer_lookup(look_b, [False])  # fetch_into: a miss, it ends
            await both_done.wait()
            # Whatever the fetch reported, the round it looked up must be closed and
            # its request slot free again.
            assert session.proto.open_requests() == [], (
                f"round {look_a.req_id} left open; the fetch ended with {fetched[0]!r}"
            )
            assert session._requests.free == limit
            (mine,) = [r for r in fetched if isinstance(r, FetchResult) and keys[0] in r.failed]
            assert mine.failed[keys[0]].startswith("region lent"), mine.failed
            closed = await prod.wait_for(RoundClosed, 2)  # fetch_into's miss, and ours
            assert look_a.req_id in {e.req_id for e in closed}


async def test_a_fetch_waiting_for_room_fails_at_once_when_its_session_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch from a peer whose share of our store is full waits in the peer's queue
    (``LandingShares.wait_for_room``). The session ends meanwhile (a disconnect here; a
    node close or a reconfiguration that drops the peer alike): the wait ends at once and
    the keys fail "session closed", as the waits for request slots do. (Nothing woke it:
    it sat out ``fetch_timeout`` and then blamed the peer's share.)"""
    hang = FaultFactory(lambda t: setattr(t, "hang", True))
    with trio.fail_after(BOUND):
        async with pair(
            {"abort_timeout": 1.0, "quarantine": 600.0},
            {
                "num_blocks": 8,
                "max_landing_share": 0.5,
                "fetch_timeout": 300.0,
                "quarantine": 600.0,
            },
            src_transport=hang,
            virtual=True,
        ) as (src, dst):
            keys = fill(src.store, 8, BLOCK)
            peer = await dst.connect(src.address)
            results: dict[str, FetchResult] = {}
            b_done = trio.Event()

            async def fetch(name: str, ks: list[bytes]) -> None:
                results[name] = await dst.fetch(peer, ks)
                if name == "b":
                    b_done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, "a", keys[:4])  # holds the whole share; never lands
                await trio.testing.wait_all_tasks_blocked()
                assert hang.transport.posts == 1
                nursery.start_soon(fetch, "b", keys[4:])  # waits for room
                await trio.testing.wait_all_tasks_blocked()
                assert "b" not in results
                closed_at = trio.current_time()
                await dst.disconnect(peer)
                with trio.move_on_after(10.0):  # virtual seconds: far past any close
                    await b_done.wait()
                waited = trio.current_time() - closed_at
                nursery.cancel_scope.cancel()
            assert "b" in results, "the fetch waiting for room outlived its session by 10 s+"
            assert waited < 10.0
            assert set(results["b"].failed) == set(keys[4:])
            assert all("over the peer's share" not in why for why in results["b"].failed.values())


async def test_disconnect_idle_leaves_a_session_a_fetch_waits_on_for_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fetch waiting for room in the peer's landing share has no request open, yet the
    session is in use: ``disconnect_idle`` leaves it (the vLLM tier closes sources' idle
    sessions through it)."""
    hang = FaultFactory(lambda t: setattr(t, "hang", True))
    async with pair(
        {"abort_timeout": 1.0, "quarantine": 3.0},
        {"num_blocks": 8, "max_landing_share": 0.5, "fetch_timeout": 10.0, "quarantine": 60.0},
        src_transport=hang,
        virtual=True,
    ) as (src, dst):
        keys = fill(src.store, 8, BLOCK)
        peer = await dst.connect(src.address)
        first = await dst.fetch(peer, keys[:4])  # gives up: its 4 slots stay quarantined
        assert set(first.failed.values()) == {"timeout"}
        session = dst._by_peer["src"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dst.fetch, peer, keys[4:])  # waits for room in the share
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(30):
                while not session.proto.idle:  # the abort's ack (src: 1 s + 3 s)
                    await trio.sleep(0.5)
            assert session._claims  # the second fetch waits, with no request open
            activity = dst.session_activity("src")
            assert activity is not None
            assert not await dst.disconnect_idle("src", activity)
            assert dst.is_connected("src")
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- pairs that held


async def test_a_key_listed_twice_in_a_lookup_and_a_fetch_loads_once_and_unpins_all() -> None:
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            (k,) = fill(src.store, 1, BLOCK)
            peer = await dst.connect(src.address)
            assert await dst.lookup(peer, [k, k]) == [True, True]
            assert src.statistics().pinned_slots == 1  # one slot, pinned twice
            r = await dst.fetch(peer, [k, k])
            assert r.loaded == [k] and not r.failed
            assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"")
            st = dst.statistics()
            assert st.reserved_slots == 0 and st.store.used == 1
            # A round trip after the fetch: the producer has released the round by then.
            assert await dst.lookup(peer, [os.urandom(32)]) == [False]
            assert src.statistics().pinned_slots == 0


async def test_one_key_fetched_from_two_peers_at_once_is_loaded_once() -> None:
    with trio.fail_after(BOUND):
        async with (
            open_node(config("p1")) as p1,
            open_node(config("p2")) as p2,
            open_node(config("dst")) as dst,
        ):
            k, block = os.urandom(32), os.urandom(BLOCK)
            p1.store.put(k, block)
            p2.store.put(k, block)
            a, b = await dst.connect(p1.address), await dst.connect(p2.address)
            results: list[FetchResult] = []

            async def fetch(peer: Any) -> None:
                results.append(await dst.fetch(peer, [k]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, a)
                nursery.start_soon(fetch, b)
            assert [r.loaded for r in results] == [[k], [k]]
            assert bytes(dst.store.get(k) or b"") == block
            st = dst.statistics()
            assert st.reserved_slots == 0 and st.quarantined_slots == 0
            assert st.store.used == 1  # the second landing's slot went back


async def test_a_key_put_locally_while_a_fetch_brings_it_in_is_loaded_at_once_and_kept() -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=1, hold=trio.Event()) as (dst, producer):
            (k,) = producer.blocks
            async with trio.open_nursery() as nursery:
                got: list[FetchResult] = []

                async def a() -> None:
                    got.append(await dst.fetch(producer.raw.peer_id, [k]))

                nursery.start_soon(a)
                await producer.fetched.wait()  # A's write is held at the producer
                dst.store.put(k, producer.blocks[k])  # the host has the block meanwhile
                b = await dst.fetch(producer.raw.peer_id, [k])  # no wait for A
                assert b.loaded == [k] and not got
                assert producer.hold is not None
                producer.hold.set()
            assert got[0].loaded == [k]
            assert bytes(dst.store.get(k) or b"") == producer.blocks[k]
            st = dst.statistics()
            assert st.reserved_slots == 0 and st.store.used == 1


async def test_a_fetch_cancelled_during_its_lookup_leaves_the_shared_keys_to_the_other() -> None:
    """Fetch B shares fetch A's keys; A's caller cancels A while A's lookup is out (the
    await point the existing test does not cover): B looks them up itself and loads."""
    blocks = {os.urandom(32): os.urandom(BLOCK) for _ in range(2)}
    keys = list(blocks)
    with trio.fail_after(BOUND):
        async with recorded() as (dst, raw, prod, nursery):
            a_scope = trio.CancelScope()
            got: list[FetchResult] = []
            b_done = trio.Event()

            async def a() -> None:
                with a_scope:
                    await dst.fetch(raw.peer_id, keys)

            async def b() -> None:
                got.append(await dst.fetch(raw.peer_id, keys))
                b_done.set()

            nursery.start_soon(a)
            await prod.wait_for(LookupRequested)
            nursery.start_soon(b)
            await trio.testing.wait_all_tasks_blocked()  # B waits for A's claim
            a_scope.cancel()
            _, look_b = await prod.wait_for(LookupRequested, 2)
            await prod.answer_lookup(look_b, [True, True])
            (fetch_b,) = await prod.wait_for(FetchRequested)
            assert fetch_b.req_id == look_b.req_id
            region = dst.store.array
            for kk, s in zip(keys, fetch_b.slots, strict=True):
                region[s * BLOCK : (s + 1) * BLOCK] = np.frombuffer(blocks[kk], np.uint8)
            raw.proto.send_transfer_done(fetch_b.req_id, [int(Outcome.OK)] * 2)
            await raw.flush()
            await b_done.wait()
            assert a_scope.cancelled_caught
            assert sorted(got[0].loaded) == sorted(keys) and not got[0].failed
            for kk in keys:
                assert bytes(dst.store.get(kk) or b"") == blocks[kk]
            assert dst.statistics().reserved_slots == 0


async def test_a_key_the_host_puts_again_loads_as_its_round_pinned_it() -> None:
    """Two consumers' rounds pin one key at the producer; the first releases its round,
    then the producer's host puts the key again with new bytes. The second round's pin
    still holds the block its lookup found: its fetch loads exactly those bytes (neither
    the new ones nor a mix), the host's key has the new bytes, a fresh fetch gets them,
    and the old block is freed once the last pin on it goes."""
    k, old, new = os.urandom(32), os.urandom(BLOCK), os.urandom(BLOCK)
    with trio.fail_after(BOUND):
        async with (
            open_node(config("src")) as src,
            open_node(config("c1")) as c1,
            open_node(config("c2")) as c2,
        ):
            src.store.put(k, old)
            p1, p2 = await c1.connect(src.address), await c2.connect(src.address)
            r1 = await c1.lookup_round(p1, [k])
            r2 = await c2.lookup_round(p2, [k])
            assert r1.hits == r2.hits == [True]
            assert src.statistics().pinned_slots == 1  # one slot, a pin per round
            assert await c1.release(p1, r1) == 1
            # A round trip: the producer has handled the release by then.
            assert await c1.lookup(p1, [os.urandom(32)]) == [False]
            assert src.statistics().pinned_slots == 1  # c2's pin is still there
            assert not src.store.evict(k)  # pinned: not evicted
            src.store.put(k, new)  # the host, meanwhile: the key moves, the block stays
            assert bytes(src.store.get(k) or b"") == new
            # More puts: a slot freed by mistake would be the next one handed out.
            others = fill(src.store, 2, BLOCK)
            got = await c2.fetch(p2, [k], r2)
            assert got.loaded == [k] and not got.failed
            assert bytes(c2.store.get(k) or b"") == old
            fresh = await c1.fetch(p1, [k])
            assert fresh.loaded == [k] and not fresh.failed
            assert bytes(c1.store.get(k) or b"") == new
            assert await c2.lookup(p2, [os.urandom(32)]) == [False]
            st = src.statistics()
            assert st.pinned_slots == 0 and st.store.used == 3  # the old block was freed
            assert bytes(src.store.get(k) or b"") == new
            assert all(k2 in src.store for k2 in others)


def loaded_bytes(dst: Node, mode: str, key: bytes, slot: int) -> bytes:
    """What ``dst`` holds for ``key``: its store's block, or the region slot a
    ``fetch_into`` named."""
    if mode == "fetch":
        return bytes(dst.store.get(key) or b"")
    return bytes(dst.store.array[slot * BLOCK : (slot + 1) * BLOCK])


async def fetch_as(dst: Node, mode: str, peer: Any, keys: list[bytes], rounds: Any) -> FetchResult:
    """``fetch`` or ``fetch_into`` (slots 0, 1, ...) of ``keys`` naming ``rounds``."""
    if mode == "fetch":
        return await dst.fetch(peer, keys, rounds)
    return await dst.fetch_into(peer, keys, list(range(len(keys))), rounds)


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
async def test_a_fetch_naming_a_held_round_loads_its_keys_from_it_beside_an_anonymous_round(
    mode: str,
) -> None:
    """A held round pins one key of two (the other missed); the producer's host then puts
    the first again with new bytes and the second, and a plain ``lookup`` of both opens
    an anonymous round that pins the new ones. A fetch of both naming the held round
    takes the held round's key from it (the handle's rounds first, as documented): the
    bytes its lookup pinned, and the other key from the anonymous round. It used to take
    the anonymous round whole, because it alone held every key, and loaded the new bytes
    for the key the named round held (found by the NIXL node model, 2026-12-06).
    ``fetch_into`` claims its rounds the same way (pinned by a reading review)."""
    k0, k1 = os.urandom(32), os.urandom(32)
    old, new, other = os.urandom(BLOCK), os.urandom(BLOCK), os.urandom(BLOCK)
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            src.store.put(k0, old)
            peer = await dst.connect(src.address)
            held = await dst.lookup_round(peer, [k0, k1])
            assert held.hits == [True, False]
            src.store.put(k0, new)  # pinned: the key moves, the held round keeps the block
            src.store.put(k1, other)
            assert await dst.lookup(peer, [k0, k1]) == [True, True]  # anonymous
            got = await fetch_as(dst, mode, peer, [k0, k1], held)
            assert sorted(got.loaded) == sorted([k0, k1]) and not got.failed
            assert loaded_bytes(dst, mode, k0, 0) == old
            assert loaded_bytes(dst, mode, k1, 1) == other
            # Every round was used: a round trip later the producer pins nothing.
            assert await dst.lookup(peer, [os.urandom(32)]) == [False]
            assert src.statistics().pinned_slots == 0


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
@pytest.mark.parametrize("first", ["old", "new"])
async def test_two_handles_holding_one_key_the_first_named_wins_the_other_stays_its_holders(
    mode: str, first: str
) -> None:
    """Two held rounds of one caller pin one key: the first before the producer's host put
    it again, the second after. A fetch naming both (one of them twice) takes the key
    from the first named round that holds it, as documented ("Held rounds"): its bytes,
    one transfer. The other round is untouched: still open and pinned, closed only by its
    holder's release. Pinned by a reading review (2026-12-06)."""
    k, old, new = os.urandom(32), os.urandom(BLOCK), os.urandom(BLOCK)
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            src.store.put(k, old)
            peer = await dst.connect(src.address)
            h_old = await dst.lookup_round(peer, [k])
            src.store.put(k, new)  # pinned: the key moves, h_old keeps the old block
            h_new = await dst.lookup_round(peer, [k])
            assert h_old.hits == h_new.hits == [True]
            assert src.statistics().pinned_slots == 2
            named, other = (h_old, h_new) if first == "old" else (h_new, h_old)
            got = await fetch_as(dst, mode, peer, [k], [named, named, other])
            assert got.loaded == [k] and not got.failed
            assert loaded_bytes(dst, mode, k, 0) == (old if first == "old" else new)
            assert await dst.release(peer, named) == 0  # the fetch used it
            assert await dst.release(peer, other) == 1  # the fetch left it alone
            assert await dst.lookup(peer, [os.urandom(32)]) == [False]  # a round trip
            assert src.statistics().pinned_slots == 0


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
async def test_a_handle_of_another_peer_names_nothing_there_and_its_round_stays_pinned(
    mode: str,
) -> None:
    """A handle is bound to its session: named in a fetch from another peer, it names
    nothing there (the key is looked up at that peer and loads that peer's bytes), and
    its own round, at its own peer, stays open and pinned for its holder; a release of it
    through the other peer closes nothing. Pinned by a reading review (2026-12-06)."""
    k, bytes_a, bytes_b = os.urandom(32), os.urandom(BLOCK), os.urandom(BLOCK)
    with trio.fail_after(BOUND):
        async with (
            open_node(config("a")) as a,
            open_node(config("b")) as b,
            open_node(config("dst")) as dst,
        ):
            a.store.put(k, bytes_a)
            b.store.put(k, bytes_b)
            pa, pb = await dst.connect(a.address), await dst.connect(b.address)
            held = await dst.lookup_round(pa, [k])
            assert held.hits == [True] and a.statistics().pinned_slots == 1
            got = await fetch_as(dst, mode, pb, [k], held)
            assert got.loaded == [k] and not got.failed
            assert loaded_bytes(dst, mode, k, 0) == bytes_b
            assert await dst.release(pb, held) == 0
            assert a.statistics().pinned_slots == 1  # a's round is still its holder's
            assert await dst.release(pa, held) == 1
            assert await dst.lookup(pa, [os.urandom(32)]) == [False]  # a round trip
            assert a.statistics().pinned_slots == 0


async def test_a_held_rounds_key_another_fetch_is_bringing_in_is_that_fetchs_copy() -> None:
    """The store holds one block per key: a ``fetch`` naming a held round, of a key a
    plain fetch is bringing in at that moment, waits for that fetch and reports its
    outcome (one transfer), as "A key is fetched once" says; the held round is not sent
    on and stays open, pinned, for its holder's release. The "Held rounds" bullet
    promised the holder its round's bytes without saying so (reading review,
    2026-12-06)."""
    hold = trio.Event()
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=1, hold=hold) as (dst, producer):
            peer = producer.raw.peer_id
            (k,) = producer.blocks
            held = await dst.lookup_round(peer, [k])
            results: dict[str, FetchResult] = {}

            async def fetch(name: str, rounds: Any) -> None:
                results[name] = await dst.fetch(peer, [k], rounds)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, "plain", None)
                await producer.fetched.wait()  # its claim is made, its answer held
                nursery.start_soon(fetch, "holder", held)
                await trio.testing.wait_all_tasks_blocked()  # the holder waits on it
                hold.set()
            for r in results.values():
                assert r.loaded == [k] and not r.failed
            [only] = producer.sent(FetchRequested)
            assert only.req_id not in held.req_ids
            assert bytes(dst.store.get(k) or b"") == producer.blocks[k]
            assert await dst.release(peer, held) == 1  # open and pinned till now


async def test_one_key_from_two_peers_at_once_one_copy_corrupt_keeps_the_good_bytes() -> None:
    """One key fetched from two peers at once, checksums on; one peer's data plane writes
    other bytes and reports DONE. Whichever lands first, that fetch fails "checksum
    mismatch" with its slot quarantined, the other loads, and the store holds the good
    block: a bad copy is never committed over or beside the good one."""
    corrupting = FaultFactory(lambda t: setattr(t, "corrupt", True))
    k, block = os.urandom(32), os.urandom(BLOCK)
    with trio.fail_after(BOUND):
        async with (
            open_node(config("bad", verify_checksums=True), transport=corrupting) as bad,
            open_node(config("good", verify_checksums=True)) as good,
            open_node(config("dst", verify_checksums=True)) as dst,
        ):
            bad.store.put(k, block)
            good.store.put(k, block)
            a, b = await dst.connect(bad.address), await dst.connect(good.address)
            results: dict[str, FetchResult] = {}

            async def fetch(name: str, peer: Any) -> None:
                results[name] = await dst.fetch(peer, [k])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, "bad", a)
                nursery.start_soon(fetch, "good", b)
            assert results["good"].loaded == [k] and not results["good"].failed
            assert results["bad"].loaded == [] and results["bad"].failed == {k: "checksum mismatch"}
            assert bytes(dst.store.get(k) or b"") == block
            st = dst.statistics()
            assert st.reserved_slots == 0 and st.quarantined_slots == 1
            assert st.store.used == 1
