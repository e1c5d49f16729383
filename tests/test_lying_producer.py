"""A buggy or lying producer against an honest consumer (found by a review, 2026-12-04).

The producer is played by hand (:class:`~tests.helpers.RawPeer`) and sends exactly what
each test scripts. Each test failed on the code before its fix: what the consumer took on
the producer's word alone, a resource it never got back, a deadline that did not hold.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from p2pkv import Node, P2PKVTimeout, SessionClosed, StoreFull, open_node
from p2pkv.session.consumer import abort_ack_bound
from p2pkv.session.protocol import AbortRequested, FetchRequested, LookupRequested, RoundClosed
from p2pkv.wire import LookupResp, Outcome, TransferDone, encode

from .helpers import FaultFactory, RawPeer, VirtualOffload, config, fill, pair, until

BLOCK = 4096
BOUND = 20.0


async def _next_event(raw: RawPeer) -> Any:
    """:meth:`RawPeer.next_event`, but what the protocol queued by itself (pongs) goes out
    before each wait for bytes, so the consumer's keepalive finds the peer alive."""
    assert raw.stream is not None
    while True:
        ev = raw.proto.next_event()
        if ev is not None:
            return ev
        await raw.flush()
        data = await raw.stream.receive_some(65536)
        if not data:
            return None
        raw.proto.receive_data(data)


async def _serve_lookups_and(raw: RawPeer, on_fetch: Any) -> None:
    """Answer every lookup all hits; hand every fetch to ``on_fetch(ev)``."""
    while (ev := await _next_event(raw)) is not None:
        if isinstance(ev, LookupRequested):
            raw.proto.send_lookup_resp(ev.req_id, [True] * len(ev.keys), trio.current_time(), 60)
        elif isinstance(ev, FetchRequested) and ev.slots:
            await on_fetch(ev)
        await raw.flush()


@asynccontextmanager
async def never_acking(**cfg_kw: Any) -> AsyncIterator[tuple[Node, str]]:
    """A consumer node (fetch_timeout 2 s, quarantine 5 s and ``cfg_kw``) and the id of a
    producer that answers every lookup all hits, never writes and never acks an abort."""
    raw = RawPeer()
    cfg = config("dst", fetch_timeout=2.0, quarantine=5.0, **cfg_kw)
    try:
        async with open_node(cfg, offload=VirtualOffload()) as dst:
            await raw.connect(dst.address)
            await raw.handshake()

            async def never_write_never_ack(ev: FetchRequested) -> None:
                pass  # the abort that follows is read and ignored

            async with trio.open_nursery() as nursery:
                nursery.start_soon(_serve_lookups_and, raw, never_write_never_ack)
                yield dst, raw.peer_id
                nursery.cancel_scope.cancel()
    finally:
        await raw.aclose()


@asynccontextmanager
async def one_key_per_request_producer() -> AsyncIterator[tuple[RawPeer, Node]]:
    """A node (lookup_timeout 5 s) and a raw producer, handshaken, that takes one key per
    request, so the node splits each lookup into one round per key."""
    raw = RawPeer(max_keys_per_request=1)
    try:
        async with open_node(config("dst", lookup_timeout=5.0), offload=VirtualOffload()) as dst:
            await raw.connect(dst.address)
            await raw.handshake()
            yield raw, dst
    finally:
        await raw.aclose()


async def test_a_lookup_split_into_rounds_ends_within_lookup_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lookup split into rounds (the producer takes one key per request) ends within one
    lookup_timeout, however the producer paces its answers. Each round had a
    lookup_timeout of its own: answering each just in time held a 4-key lookup ~4 x as
    long (and the facade's default timeout, lookup_timeout + 1 s, then failed it)."""
    with trio.fail_after(600):
        async with one_key_per_request_producer() as (raw, dst):

            async def slow_answers() -> None:
                while (ev := await raw.next_event()) is not None:
                    if isinstance(ev, LookupRequested):
                        await trio.sleep(4.5)  # within the consumer's 5 s
                        raw.proto.send_lookup_resp(
                            ev.req_id, [True] * len(ev.keys), trio.current_time(), 60
                        )
                    await raw.flush()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow_answers)
                keys = [os.urandom(32) for _ in range(4)]
                start = trio.current_time()
                with pytest.raises(P2PKVTimeout):
                    await dst.lookup(raw.peer_id, keys)
                took = trio.current_time() - start
                nursery.cancel_scope.cancel()
            assert took <= 5.0 + 0.5, f"a lookup with lookup_timeout 5 s took {took:.1f} s"


async def test_a_split_lookup_that_fails_midway_gives_back_the_rounds_already_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lookup split into rounds whose second round is never answered: the caller gets
    its timeout, and the round already answered is closed at once (a partial answer is
    no answer): the producer unpins its hits, and its request slot comes back. Left
    open, it was nobody's: no fetch could claim it, the lease timer never saw it, and its
    request slot was lost for the session's life. The rounds go out together, so the
    third, sent but not answered yet, is aborted too."""
    with trio.fail_after(600):
        async with one_key_per_request_producer() as (raw, dst):
            keys = [os.urandom(32) for _ in range(3)]
            seen: list[Any] = []

            async def answer_the_first_round_only() -> None:
                while (ev := await raw.next_event()) is not None:
                    seen.append(ev)
                    if isinstance(ev, LookupRequested) and len(seen) == 1:
                        raw.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60)
                    elif isinstance(ev, AbortRequested):
                        raw.proto.send_abort_ack(ev.req_id)
                    await raw.flush()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_the_first_round_only)
                with pytest.raises(P2PKVTimeout):
                    await dst.lookup(raw.peer_id, keys)
                # The close and the abort reach the peer (or the bound fails the test).
                await until(lambda: {type(e) for e in seen} >= {RoundClosed, AbortRequested})
                nursery.cancel_scope.cancel()
            first, second, third = (e.req_id for e in seen[:3])
            assert RoundClosed(first) in seen, f"the answered round stayed open: {seen}"
            assert AbortRequested(second) in seen and AbortRequested(third) in seen
            requests = dst._by_peer[raw.peer_id]._requests
            assert requests.free == requests.limit


async def test_a_split_lookup_sends_every_round_before_it_waits_for_an_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lookup split into rounds (one key per request) puts every round on the wire
    before it waits for the first answer: one round trip, not one per round. The
    producer here answers nothing until it has all four, then answers them last first;
    each key's hit still comes back in the key's own place. (Round by round, the first
    answer never came and the lookup timed out.)"""
    with trio.fail_after(600):
        async with one_key_per_request_producer() as (raw, dst):
            keys = [os.urandom(32) for _ in range(4)]
            present = {keys[0], keys[2], keys[3]}
            asked: list[LookupRequested] = []

            async def answer_when_all_are_in() -> None:
                while (ev := await _next_event(raw)) is not None:
                    if isinstance(ev, LookupRequested):
                        asked.append(ev)
                        if len(asked) == len(keys):
                            for req in reversed(asked):
                                hits = [k in present for k in req.keys]
                                raw.proto.send_lookup_resp(
                                    req.req_id, hits, trio.current_time(), 60
                                )
                    await raw.flush()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_when_all_are_in)
                start = trio.current_time()
                rnd = await dst.lookup_round(raw.peer_id, keys)
                took = trio.current_time() - start
                nursery.cancel_scope.cancel()
            assert rnd.hits == [True, False, True, True]
            assert [ev.keys for ev in asked] == [[k] for k in keys]
            assert took < 1.0, f"the lookup waited {took:.1f} s for answers sent at once"


@pytest.mark.parametrize("ending", ["timeout", "cancel"])
async def test_a_split_lookup_whose_middle_round_is_never_answered_leaves_no_round_open(
    autojump_clock: trio.testing.MockClock, ending: str
) -> None:
    """The rounds of a split lookup go out together, so a later round can be answered
    while an earlier one never is. Whether the lookup then times out or its caller
    cancels it, no round stays open: those answered (the first and, out of turn, the
    third) are closed, so the producer unpins their hits, the one never answered is
    aborted, and every request slot comes back."""
    with trio.fail_after(600):
        async with one_key_per_request_producer() as (raw, dst):
            keys = [os.urandom(32) for _ in range(3)]
            seen: list[Any] = []
            session = dst._by_peer[raw.peer_id]
            third_answered = trio.Event()

            async def skip_the_second_round() -> None:
                while (ev := await _next_event(raw)) is not None:
                    seen.append(ev)
                    if isinstance(ev, LookupRequested) and ev.keys != [keys[1]]:
                        raw.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60)
                        if ev.keys == [keys[2]]:
                            await raw.flush()
                            third_answered.set()
                    elif isinstance(ev, AbortRequested):
                        raw.proto.send_abort_ack(ev.req_id)
                    await raw.flush()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(skip_the_second_round)
                if ending == "timeout":
                    with pytest.raises(P2PKVTimeout):
                        await dst.lookup(raw.peer_id, keys)
                else:
                    with trio.CancelScope() as scope:

                        async def cancel_once_the_third_is_in() -> None:
                            await third_answered.wait()
                            third = seen[2].req_id
                            # The consumer has read the third round's answer.
                            await until(lambda: session._pending[third].result is not None)
                            scope.cancel()

                        nursery.start_soon(cancel_once_the_third_is_in)
                        await dst.lookup(raw.peer_id, keys)
                    assert scope.cancelled_caught
                first, second, third = (e.req_id for e in seen[:3])
                await until(lambda: RoundClosed(third) in seen and AbortRequested(second) in seen)
                await until(lambda: session._requests.free == session._requests.limit)
                nursery.cancel_scope.cancel()
            assert RoundClosed(first) in seen, f"the first round stayed open: {seen}"
            assert not session._rounds


async def test_a_producer_answering_a_round_of_a_split_lookup_twice_is_cut_off_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With every round of a split lookup in flight, the producer answers the first round
    twice (the second answer could pass for a later round's) and no other. The second
    answer is a protocol error: the session ends with that reason, the lookup fails at
    once with a typed error instead of waiting out its deadline, and the node lives on,
    open to the same peer again."""
    with trio.fail_after(600):
        async with one_key_per_request_producer() as (raw, dst):
            keys = [os.urandom(32) for _ in range(3)]

            async def answer_the_first_twice() -> None:
                while (ev := await _next_event(raw)) is not None:
                    if isinstance(ev, LookupRequested) and ev.keys == [keys[0]]:
                        raw.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60)
                        await raw.flush()  # and the same answer again, past our protocol:
                        await raw.send_raw(encode(LookupResp(req_id=ev.req_id, hits=[True])))
                    await raw.flush()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_the_first_twice)
                start = trio.current_time()
                with pytest.raises(SessionClosed) as caught:
                    await dst.lookup(raw.peer_id, keys)
                took = trio.current_time() - start
                nursery.cancel_scope.cancel()
            assert took < dst.config.lookup_timeout / 2, f"failed only after {took:.1f} s"
            assert "protocol" in str(caught.value).lower(), caught.value
            assert not dst.is_connected(raw.peer_id)
            again = RawPeer(raw.peer_id, epoch=8)
            try:
                await again.connect(dst.address)
                await again.handshake()
                assert dst.is_connected(again.peer_id)
            finally:
                await again.aclose()


async def test_a_producer_that_never_acks_an_abort_does_not_hold_request_slots_for_ever(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The producer answers lookups but never writes and never answers an abort. A fetch
    we give up on holds its request slot until the abort_ack; with no deadline on the
    ack (the peer's pongs keep the session up), max_open_requests such fetches made
    every later request to the peer wait out its deadline and fail, for the session's
    whole life. An honest producer acks within abort_timeout + quarantine, so once an
    ack is past ``abort_ack_bound`` (twice that and a little), a request waiting for a
    slot ends the session at that moment, not at the request's own deadline."""
    with trio.fail_after(2000):
        async with never_acking(lookup_timeout=3.0, max_open_requests=2) as (dst, peer):
            first_abort = trio.current_time() + dst.config.fetch_timeout
            for _ in range(2):
                r = await dst.fetch(peer, [os.urandom(32)])
                assert set(r.failed.values()) == {"timeout"}
            overdue = first_abort + abort_ack_bound(dst.config)
            await trio.sleep_until(overdue - 1.0)  # an honest peer's time to ack
            assert dst.is_connected(peer)
            with pytest.raises(SessionClosed, match="never acknowledged"):
                await dst.lookup(peer, [os.urandom(32)])  # waits for a slot
            assert trio.current_time() == pytest.approx(overdue)
            assert not dst.is_connected(peer)


async def test_a_request_needing_a_slot_that_overdue_aborts_hold_ends_the_session_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Overdue acks cost nothing while request slots are left (the session stays); a
    request that finds none free because aborts the peer never acknowledged hold them
    ends the session at once instead of waiting out its deadline for a slot."""
    with trio.fail_after(2000):
        async with never_acking(lookup_timeout=1.0, max_open_requests=3) as (dst, peer):
            for _ in range(2):
                r = await dst.fetch(peer, [os.urandom(32)])
                assert set(r.failed.values()) == {"timeout"}
            await trio.sleep(abort_ack_bound(dst.config) + 1.0)
            assert dst.is_connected(peer)  # one slot is left
            held = await dst.lookup_round(peer, [os.urandom(32)])
            assert held.hits == [True]  # its round holds the last slot
            start = trio.current_time()
            with pytest.raises(SessionClosed, match="never acknowledged"):
                await dst.lookup(peer, [os.urandom(32)])
            assert trio.current_time() == start
            assert not dst.is_connected(peer)


async def test_an_honest_producer_with_a_longer_quarantine_keeps_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An honest producer acks an abort of an unsettled write after its own abort_timeout
    and quarantine, which the hello does not tell us: one whose quarantine is over twice
    ours acks past ``abort_ack_bound``. With request slots left, the session stays (a
    review found it closed, failing everything else in flight on it)."""
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))
    with trio.fail_after(300):
        async with pair(
            {"abort_timeout": 2.0, "quarantine": 30.0},
            {"fetch_timeout": 4.0, "abort_timeout": 2.0, "quarantine": 5.0},
            src_transport=hanging,
            virtual=True,
        ) as (src, dst):
            keys = fill(src.store, 2, BLOCK)
            peer = await dst.connect(src.address)
            r = await dst.fetch(peer, keys)
            assert r.loaded == [] and set(r.failed.values()) == {"timeout"}
            assert abort_ack_bound(dst.config) < 2.0 + 30.0  # the ack comes after the bound
            await trio.sleep(2.0 + 30.0 + 2.0)
            assert dst.is_connected(peer.peer_id)
            assert dst.statistics().store.quarantined == 0  # ours ended long ago
            assert await dst.lookup(peer, keys) == [True, True]  # and the session works


async def test_a_request_waiting_for_a_slot_an_honest_producers_abort_holds_gets_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An honest producer acks an abort of an unsettled write after its own abort_timeout
    and quarantine, which the hello does not tell us, so an ack is overdue only past
    twice ours and a close_timeout (``abort_ack_bound``: 19 s here). This producer's
    quarantine is 14 s to our 5: it acks 16 s after the abort, past once ours and a
    close_timeout (12 s). A lookup that must wait for the slot that abort holds, at 13 s,
    gets it at the ack and the session stays (mutation review 2026-12-05: a bound of
    once ours closed it under an honest producer, and survived the suite)."""
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))
    with trio.fail_after(300):
        async with pair(
            {"abort_timeout": 2.0, "quarantine": 14.0},
            {
                "fetch_timeout": 4.0,
                "abort_timeout": 2.0,
                "quarantine": 5.0,
                "max_open_requests": 1,
                "lookup_timeout": 10.0,
            },
            src_transport=hanging,
            virtual=True,
        ) as (src, dst):
            keys = fill(src.store, 1, BLOCK)
            peer = await dst.connect(src.address)
            r = await dst.fetch(peer, keys)
            assert set(r.failed.values()) == {"timeout"}
            aborted = trio.current_time()
            await trio.sleep_until(aborted + 13.0)  # the abort still holds the one slot
            assert await dst.lookup(peer, keys) == [True]
            assert trio.current_time() >= aborted + 2.0 + 14.0  # it waited for the ack
            assert dst.is_connected(peer.peer_id)


async def test_a_slot_whose_bytes_fail_their_checksum_is_quarantined() -> None:
    """A producer says OK with the right checksum before its write has landed: the bytes
    fail the checksum, so its word that the write settled is in doubt too, and the slot
    is quarantined, never freed on that word (invariants 2 and 10). The host's next
    block cannot take it; it was freed at once, and the late write landed on the host's
    block. (A producer that says TRANSFER_FAILED before its write settles is believed,
    as one that says OK is with checksums off: docs/design.md.)"""
    with trio.fail_after(BOUND):
        raw = RawPeer()
        cfg = config("dst", num_blocks=1, max_landing_share=1.0, verify_checksums=True)
        try:
            async with open_node(cfg) as dst:
                await raw.connect(dst.address)
                await raw.handshake()
                b, b_bytes = os.urandom(32), os.urandom(BLOCK)
                write_now = trio.Event()
                written = trio.Event()

                async def reply_then_write(ev: FetchRequested) -> None:
                    [slot] = ev.slots
                    crc = zlib.crc32(b_bytes)
                    raw.proto.send_transfer_done(ev.req_id, [int(Outcome.OK)], [crc])
                    await raw.flush()

                    async def late_write() -> None:  # the write the reply did not wait for
                        await write_now.wait()
                        region = dst.store.array
                        region[slot * BLOCK : (slot + 1) * BLOCK] = np.frombuffer(b_bytes, np.uint8)
                        written.set()

                    nursery.start_soon(late_write)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_serve_lookups_and, raw, reply_then_write)
                    r = await dst.fetch(raw.peer_id, [b])
                    assert r.loaded == [] and b in r.failed
                    # Freed at once, the only slot takes the host's next block (quarantined,
                    # the store has no room for it: StoreFull).
                    c, c_bytes = os.urandom(32), os.urandom(BLOCK)
                    put_at: int | None = None
                    with contextlib.suppress(StoreFull):
                        put_at = dst.store.put(c, c_bytes)
                    write_now.set()
                    await written.wait()
                    nursery.cancel_scope.cancel()
                assert put_at is None or bytes(dst.store.get(c) or b"") == c_bytes, (
                    "the host's block was overwritten by a write into a slot freed on the "
                    "producer's word"
                )
        finally:
            await raw.aclose()


async def test_a_transfer_done_with_more_outcomes_than_keys_loads_nothing() -> None:
    """A ``transfer_done`` must carry one outcome per key fetched (wire protocol: list
    lengths bounded, validated before any handler). A producer that fails the first of two
    keys and appends a surplus OK has as many OKs as keys: taken as "every key landed",
    the failed key's slot, never written, was committed and reported loaded (invariant 1).
    It is the peer's protocol error: the session ends and no key is loaded."""
    with trio.fail_after(BOUND):
        raw = RawPeer()
        try:
            async with open_node(config("dst")) as dst:
                await raw.connect(dst.address)
                await raw.handshake()
                keys = [os.urandom(32) for _ in range(2)]

                async def one_outcome_too_many(ev: FetchRequested) -> None:
                    outcomes = [int(Outcome.TRANSFER_FAILED), int(Outcome.OK), int(Outcome.OK)]
                    await raw.send_raw(encode(TransferDone(req_id=ev.req_id, outcomes=outcomes)))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_serve_lookups_and, raw, one_outcome_too_many)
                    r = await dst.fetch(raw.peer_id, keys)
                    nursery.cancel_scope.cancel()
                assert r.loaded == [], f"keys loaded on a malformed transfer_done: {r}"
                assert set(r.failed) == set(keys)
                assert all("outcome count" in why for why in r.failed.values()), r.failed
                assert dst.store.get(keys[0]) is None and dst.store.get(keys[1]) is None
        finally:
            await raw.aclose()


@pytest.mark.parametrize("verify", [False, True], ids=["unchecked", "checksummed"])
async def test_a_key_the_producer_reports_failed_beside_an_ok_one_is_not_loaded(
    verify: bool,
) -> None:
    """A ``transfer_done`` that says TRANSFER_FAILED for one key and OK for the other
    commits only the OK key: the failed key's slot was never written (the integrity rule:
    a key is committed only on its own OK), and it is reported with the producer's
    reason; its slot, and its room in the peer's share of our store, are free again at
    once. With checksums on, the OK key's bytes are checked against its own checksum
    (mutation review, 2026-12-05, each survived the suite: a fast path taken when *any*
    outcome was OK committed both; a release that kept the share's room shrank the
    peer's share for good; summing the first slots instead of the OK keys' failed a
    good key that followed a failed one)."""
    with trio.fail_after(BOUND):
        raw = RawPeer()
        try:
            async with open_node(config("dst", verify_checksums=verify)) as dst:
                await raw.connect(dst.address)
                await raw.handshake()
                keys = [os.urandom(32) for _ in range(2)]
                second = os.urandom(BLOCK)

                async def fail_first_write_second(ev: FetchRequested) -> None:
                    slot = ev.slots[1]
                    region = dst.store.array
                    region[slot * BLOCK : (slot + 1) * BLOCK] = np.frombuffer(second, np.uint8)
                    outcomes = [int(Outcome.TRANSFER_FAILED), int(Outcome.OK)]
                    crcs = [0, zlib.crc32(second)] if verify else None
                    raw.proto.send_transfer_done(ev.req_id, outcomes, crcs)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_serve_lookups_and, raw, fail_first_write_second)
                    r = await dst.fetch(raw.peer_id, keys)
                    nursery.cancel_scope.cancel()
                assert r.loaded == [keys[1]], f"only the key reported OK loads: {r}"
                assert r.failed == {keys[0]: "transfer_failed"}
                assert bytes(dst.store.get(keys[1]) or b"") == second
                assert dst.store.get(keys[0]) is None
                # The failed key's slot is free again, and its room in the peer's share.
                st = dst.statistics().store
                assert st.reserved == 0 and st.quarantined == 0
                assert dst.landing_shares.held(raw.peer_id, trio.current_time()) == 0
        finally:
            await raw.aclose()


async def test_a_producers_write_into_another_producers_landing_slot_loads_no_wrong_bytes() -> None:
    """Two producers serve one consumer at once. The liar is honest on its control
    channel, but its data plane also writes into the slot the consumer named to the
    *honest* producer for a key of its own fetch, after the honest write landed and
    before its ``transfer_done``. The consumer never sees the data plane (anyone holding
    its agent metadata can write into its region), so what the integrity rule promises is
    per key: with checksums on, no key is committed with bytes other than those its own
    producer summed. The honest producer's overwritten key fails "checksum mismatch" and
    its slot is quarantined, never loaded with the liar's bytes; its other key and the
    liar's own key load byte-exact (reading review, 2026-12-05: no test had two
    producers' writes in one region)."""
    with trio.fail_after(BOUND):
        honest, liar = RawPeer("honest"), RawPeer("liar")
        cfg = config("dst", verify_checksums=True)
        try:
            async with open_node(cfg) as dst:
                for raw in (honest, liar):
                    await raw.connect(dst.address)
                    await raw.handshake()
                region = dst.store.array
                h_keys = [os.urandom(32) for _ in range(2)]
                h_bytes = [os.urandom(BLOCK) for _ in range(2)]
                l_key, l_bytes, junk = os.urandom(32), os.urandom(BLOCK), os.urandom(BLOCK)
                victim_slot: list[int] = []
                honest_wrote, liar_done = trio.Event(), trio.Event()

                def land(slot: int, data: bytes) -> None:
                    region[slot * BLOCK : (slot + 1) * BLOCK] = np.frombuffer(data, np.uint8)

                async def write_then_wait_for_the_liar(ev: FetchRequested) -> None:
                    for slot, data in zip(ev.slots, h_bytes, strict=True):
                        land(slot, data)
                    victim_slot.append(ev.slots[0])
                    honest_wrote.set()
                    await liar_done.wait()
                    crcs = [zlib.crc32(b) for b in h_bytes]
                    honest.proto.send_transfer_done(ev.req_id, [int(Outcome.OK)] * 2, crcs)

                async def write_own_and_the_victims(ev: FetchRequested) -> None:
                    await honest_wrote.wait()
                    [slot] = ev.slots
                    land(slot, l_bytes)
                    land(victim_slot[0], junk)  # not a slot it was asked to write
                    liar.proto.send_transfer_done(
                        ev.req_id, [int(Outcome.OK)], [zlib.crc32(l_bytes)]
                    )
                    await liar.flush()
                    liar_done.set()

                results: dict[str, Any] = {}

                async def fetch(name: str, keys: list[bytes]) -> None:
                    results[name] = await dst.fetch(name, keys)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_serve_lookups_and, honest, write_then_wait_for_the_liar)
                    nursery.start_soon(_serve_lookups_and, liar, write_own_and_the_victims)
                    async with trio.open_nursery() as fetches:
                        fetches.start_soon(fetch, "honest", h_keys)
                        fetches.start_soon(fetch, "liar", [l_key])
                    nursery.cancel_scope.cancel()
                h, lr = results["honest"], results["liar"]
                assert h.loaded == [h_keys[1]], h
                assert h.failed == {h_keys[0]: "checksum mismatch"}
                assert dst.store.get(h_keys[0]) is None
                assert bytes(dst.store.get(h_keys[1]) or b"") == h_bytes[1]
                assert lr.loaded == [l_key] and bytes(dst.store.get(l_key) or b"") == l_bytes
                assert dst.statistics().store.quarantined == 1  # the overwritten slot
        finally:
            await honest.aclose()
            await liar.aclose()
