"""The answer lane (``PeerSession._wait_in_lane``): a request's task reads its own answer.

What must hold whatever arrives with the answer or instead of it: frames are handled once,
in order, each by one task; the first frame that is not an answer or a pong (the peer's
own lookup, a ping, a bye, a new hello) is not acted on by the lane at all, and it and the
rest go to the reader, which is woken for them, as does the rest of a turn's frames; what
the caller sees after such a frame is what it saw before the lane; a waiter the lane
cannot serve (the reader mid-turn) still gets its answer through its event; the lease
timer, the session's end, a reset, a malformed frame and a cancelled caller each end a
wait in the lane as they end any other, and leave the lane free for the next request.

The peer is a :class:`RawPeer` driven by the test over real TCP (loopback), so the test
decides exactly which bytes arrive in one write. Real clock unless said; every wait is
bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from p2pkv import Node, open_node
from p2pkv.errors import P2PKVError, P2PKVTimeout, PeerUnavailable, SessionClosed
from p2pkv.session.protocol import (
    ByeReceived,
    HelloReceived,
    LookupAnswered,
    LookupRequested,
    PongReceived,
    SessionProtocol,
)
from p2pkv.session.session import PeerSession
from p2pkv.wire import FrameDecoder, Lookup, LookupResp, Pong, encode

from .helpers import RawPeer, VirtualOffload, config, fill

BOUND = 20.0  # seconds: "this did not hang", never an expected duration


@asynccontextmanager
async def raw_peer_of(node: Node, **info: Any) -> AsyncIterator[tuple[RawPeer, PeerSession]]:
    """A hand-driven peer connected to ``node``, and ``node``'s session with it."""
    raw = RawPeer(**info)
    try:
        await raw.connect(node.address)
        await raw.handshake()
        while not node.is_connected(raw.peer_id):
            await trio.sleep(0.001)
        (session,) = [s for s in node._sessions if s.peer_id == raw.peer_id]
        assert isinstance(session, PeerSession)
        yield raw, session
    finally:
        await raw.aclose()


async def next_lookup(raw: RawPeer, skip: int | None = None) -> LookupRequested:
    """The peer's next lookup request, passing over other events and request ``skip``
    (one the test gave up on: its abort comes too)."""
    while True:
        ev = await raw.next_event()
        assert ev is not None
        if isinstance(ev, LookupRequested) and ev.req_id != skip:
            return ev


async def lookup_in_background(
    nursery: trio.Nursery,
    node: Node,
    raw: RawPeer,
    keys: list[bytes] | None = None,
    skip: int | None = None,
) -> tuple[list[object], LookupRequested]:
    """Start ``node.lookup`` of ``keys`` (one random key) at ``raw`` in ``nursery``; once
    the peer has the request and every task waits, return the list the lookup's result
    (or its ``P2PKVError``) lands in, and the request."""
    got: list[object] = []

    async def lookup() -> None:
        try:
            got.append(await node.lookup(raw.peer_id, keys or [os.urandom(32)]))
        except P2PKVError as exc:
            got.append(exc)

    nursery.start_soon(lookup)
    ev = await next_lookup(raw, skip)
    await trio.testing.wait_all_tasks_blocked()
    return got, ev


def answer(raw: RawPeer, ev: LookupRequested) -> None:
    """Queue an all-hit answer to ``ev`` (sent by the next flush)."""
    raw.proto.send_lookup_resp(ev.req_id, [True] * len(ev.keys), trio.current_time(), 100)


class LaneSpy:
    """Counts what the lane's task handled (wraps ``_lane_take``)."""

    def __init__(self, session: PeerSession, monkeypatch: pytest.MonkeyPatch) -> None:
        self.takes = 0
        self.left: list[bool] = []  # per take: whether it left work for the reader
        take = session._lane_take

        def spy(data: bytes) -> None:
            self.takes += 1
            take(data)
            self.left.append(session._lane_left)

        monkeypatch.setattr(session, "_lane_take", spy)


@asynccontextmanager
async def small_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[Node, RawPeer, PeerSession, LaneSpy]]:
    """A node whose turns take 8 frames, a hand-driven peer, their session, a spy on its
    lane."""
    async with (
        open_node(config("n", max_events_per_turn=8)) as node,
        raw_peer_of(node) as (raw, session),
    ):
        yield node, raw, session, LaneSpy(session, monkeypatch)


async def test_our_answer_and_the_peers_own_lookup_in_one_receive_are_both_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lane's task reads our answer and, behind it in the same bytes, the peer's own
    lookup. It returns with its answer and leaves the lookup to the reader, which pins
    and answers it."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            ours = fill(node.store, 3, 4096)
            spy = LaneSpy(session, monkeypatch)
            theirs = [os.urandom(32) for _ in range(2)]
            async with trio.open_nursery() as nursery:
                got, ev = await lookup_in_background(nursery, node, raw, theirs)
                assert session._lane_parked  # the lookup's task waits in the lane
                answer(raw, ev)
                req = raw.proto.send_lookup(ours)
                await raw.flush()  # one write: our answer, then the peer's lookup
            assert got == [[True, True]]
            assert spy.takes == 1 and spy.left == [True]  # the lookup was left to the reader
            resp = await raw.next_event()
            assert isinstance(resp, LookupAnswered) and resp.req_id == req
            assert resp.hits == [True] * 3
            assert session.alive and session.proto._unread is None and not session._lane_left


async def test_pings_before_the_answer_go_to_the_reader_with_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pings are the reader's (its turns count them): the lane's task stops at the first,
    and the reader answers every ping, once, then reaches our answer and wakes the task."""
    with trio.fail_after(BOUND):
        async with small_turns(monkeypatch) as (node, raw, session, spy):
            async with trio.open_nursery() as nursery:
                got, ev = await lookup_in_background(nursery, node, raw)
                assert session._lane_parked
                pings = [raw.proto.send_ping() for _ in range(30)]
                answer(raw, ev)
                await raw.flush()
            assert got == [[True]]
            assert spy.takes == 1 and spy.left == [True]
            pongs: list[int] = []
            while len(pongs) < len(pings):
                pong = await raw.next_event()
                assert isinstance(pong, PongReceived)
                pongs.append(pong.nonce)
            assert sorted(pongs) == sorted(pings)
            assert session.alive


async def test_a_waiter_whose_answer_comes_while_the_reader_is_mid_turn_gets_it_by_its_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader is inside a turn (answering the peer's lookup, held there by the test:
    FAKE, a handler that waits on an event) when our answer arrives: the lane's task must
    not read under it, so it leaves the lane and waits on its event; the reader reads the
    answer once it is through its turn."""
    with trio.fail_after(BOUND):
        async with (
            open_node(config("n")) as node,
            raw_peer_of(node) as (raw, session),
        ):
            spy = LaneSpy(session, monkeypatch)
            entered, hold = trio.Event(), trio.Event()
            answer_lookup = session._answer_lookup

            async def held(ev: Any, turn: Any) -> None:
                entered.set()
                await hold.wait()
                await answer_lookup(ev, turn)

            monkeypatch.setattr(session, "_answer_lookup", held)
            their_req = raw.proto.send_lookup([os.urandom(32)])
            await raw.flush()
            await entered.wait()  # the reader is mid-turn now
            async with trio.open_nursery() as nursery:
                got: list[list[bool]] = []

                async def lookup() -> None:
                    got.append(await node.lookup(raw.peer_id, [os.urandom(32)]))

                nursery.start_soon(lookup)
                ev = await next_lookup(raw)
                answer(raw, ev)
                await raw.flush()
                while session._lane_p is not None:  # it woke, saw the reader busy, left
                    await trio.sleep(0.001)
                assert got == [] and spy.takes == 0
                hold.set()  # the reader goes on: their lookup (a miss), then our answer
            assert got == [[True]]
            assert spy.takes == 0  # the reader read our answer
            resp = await raw.next_event()
            assert isinstance(resp, LookupAnswered) and resp.req_id == their_req
            assert resp.hits == [False]


async def test_a_lookup_that_times_out_in_the_lane_frees_it_for_the_next(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No answer comes: the lease timer ends the wait at the lookup's deadline (it wakes
    the task out of the lane), the lookup raises a timeout, and the next lookup waits in
    the lane and gets its answer there."""
    with trio.fail_after(120):
        async with (
            open_node(config("n", lookup_timeout=5.0), offload=VirtualOffload()) as node,
            raw_peer_of(node) as (raw, session),
        ):
            spy = LaneSpy(session, monkeypatch)
            start = trio.current_time()
            with pytest.raises(P2PKVTimeout):
                await node.lookup(raw.peer_id, [os.urandom(32)])
            assert 5.0 <= trio.current_time() - start < 6.0
            assert session._lane_p is None and not session._lane_parked
            ignored = await next_lookup(raw)
            async with trio.open_nursery() as nursery:
                got, ev = await lookup_in_background(nursery, node, raw, skip=ignored.req_id)
                assert session._lane_parked
                answer(raw, ev)
                await raw.flush()
            assert got == [[True]] and spy.takes >= 1
            assert session.alive


async def test_a_cancelled_waiter_leaves_the_lane_free() -> None:
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            with trio.move_on_after(0.2) as cs:
                await node.lookup(raw.peer_id, [os.urandom(32)])
            assert cs.cancelled_caught
            assert session._lane_p is None and not session._lane_parked
            first = await next_lookup(raw)
            async with trio.open_nursery() as nursery:
                got, ev = await lookup_in_background(nursery, node, raw, skip=first.req_id)
                assert session._lane_parked  # the next request's task took the lane
                answer(raw, ev)
                await raw.flush()
            assert got == [[True]]


async def test_two_waiters_one_in_the_lane_both_answered_by_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only one task waits in the lane; the other waits on its event. One write answers
    both (the other's answer first): the lane's task wakes the other and then returns
    with its own."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            got: dict[int, list[bool]] = {}
            spy = LaneSpy(session, monkeypatch)
            async with trio.open_nursery() as nursery:

                async def lookup(i: int, n: int) -> None:
                    got[i] = await node.lookup(raw.peer_id, [os.urandom(32) for _ in range(n)])

                nursery.start_soon(lookup, 0, 1)
                first = await next_lookup(raw)
                await trio.testing.wait_all_tasks_blocked()
                in_lane = session._lane_p
                assert in_lane is not None and in_lane.req_id == first.req_id
                nursery.start_soon(lookup, 1, 2)
                second = await next_lookup(raw)
                await trio.testing.wait_all_tasks_blocked()
                assert session._lane_p is in_lane  # the second waits on its event
                answer(raw, second)
                answer(raw, first)
                await raw.flush()
            assert got == {0: [True], 1: [True, True]}
            assert session._lane_p is None
            assert spy.takes == 1 and spy.left == [False]  # the lane's task read both


async def test_the_peer_closing_while_we_wait_in_the_lane_ends_the_lookup_not_the_node() -> None:
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node:
            async with raw_peer_of(node) as (raw, session):
                async with trio.open_nursery() as nursery:
                    got, _ = await lookup_in_background(nursery, node, raw)
                    assert session._lane_parked
                    assert raw.stream is not None
                    await raw.stream.aclose()
                assert len(got) == 1 and isinstance(got[0], SessionClosed)
                await session.finished.wait()
            # The node serves another peer as before.
            async with raw_peer_of(node) as (other, _):
                async with trio.open_nursery() as nursery:
                    served, ev = await lookup_in_background(nursery, node, other)
                    answer(other, ev)
                    await other.flush()
                assert served == [[True]]


async def test_a_malformed_frame_read_in_the_lane_closes_that_session_with_a_reason() -> None:
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            async with trio.open_nursery() as nursery:
                got, _ = await lookup_in_background(nursery, node, raw)
                assert session._lane_parked
                await raw.send_raw(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # 0xc1: never valid
            assert len(got) == 1 and isinstance(got[0], SessionClosed)
            await session.finished.wait()
            assert session.close_reason is not None
            assert session.close_reason.startswith("protocol error")
            assert node.statistics().peers == 0


async def test_work_the_lane_leaves_wakes_a_reader_that_is_waiting_for_bytes() -> None:
    """The lane's task may take bytes after the reader went back to waiting in the same
    batch (so the reader is not woken by them). What it leaves (here: pings, which the
    lane's task stops at, more of them than the reader's turn, then the peer's lookup)
    must wake the reader, with no more bytes to come."""
    with trio.fail_after(BOUND):
        async with (
            open_node(config("n", max_events_per_turn=4)) as node,
            raw_peer_of(node) as (raw, session),
        ):
            keys = fill(node.store, 2, 4096)
            await trio.testing.wait_all_tasks_blocked()
            assert session._reader_idle  # parked, and nothing on the socket to wake it
            pings = [raw.proto.send_ping() for _ in range(10)]
            req = raw.proto.send_lookup(keys)
            session._lane_take(raw.proto.data_to_send())  # as the lane's task would
            assert session._lane_left
            pongs: list[int] = []
            while len(pongs) < len(pings):
                ev = await raw.next_event()
                if isinstance(ev, PongReceived):
                    pongs.append(ev.nonce)
                else:
                    assert isinstance(ev, LookupAnswered) and ev.req_id == req
                    assert ev.hits == [True, True]
                    req = -1
            assert sorted(pongs) == sorted(pings)
            if req != -1:
                resp = await raw.next_event()
                assert isinstance(resp, LookupAnswered) and resp.req_id == req
            assert not session._lane_left and session.proto._unread is None


async def test_a_turns_worth_of_answers_and_pongs_then_the_reader_takes_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More lane frames in one receive than a turn (pongs, then the answer): the lane's
    task handles a turn's worth and wakes the reader for the rest, which reaches the
    answer and wakes the task."""
    with trio.fail_after(BOUND):
        async with small_turns(monkeypatch) as (node, raw, session, spy):
            async with trio.open_nursery() as nursery:
                got, ev = await lookup_in_background(nursery, node, raw)
                assert session._lane_parked
                before = session.proto.frames_received
                pongs = b"".join(encode(Pong(nonce=i)) for i in range(30))
                answer(raw, ev)
                await raw.send_raw(pongs + raw.proto.data_to_send())
            assert got == [[True]]
            assert spy.takes == 1 and spy.left == [True]  # it stopped at its budget
            assert session.proto.frames_received - before == 31 and session.alive


async def test_what_the_lane_leaves_is_not_acted_on_until_the_reader_takes_it() -> None:
    """The lane's task stops at the peer's lookup without dispatching it: the protocol
    has not opened that round when the task's receive is handled; the reader then answers
    it."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            keys = fill(node.store, 1, 4096)
            await trio.testing.wait_all_tasks_blocked()
            req = raw.proto.send_lookup(keys)
            session._lane_take(raw.proto.data_to_send())  # as the lane's task would
            assert session._lane_left and isinstance(session.proto._unread, Lookup)
            assert session.proto.in_state(req) is None  # not acted on
            resp = await raw.next_event()
            assert isinstance(resp, LookupAnswered) and resp.req_id == req
            assert resp.hits == [True]
            assert session.proto._unread is None


async def _answer_then(
    raw: RawPeer, session: PeerSession, node: Node, lane: bool, rest: Any
) -> list[object]:
    """A lookup answered in one write with whatever ``rest(raw)`` returns after it, then a
    second lookup made with no checkpoint between: what each gave."""
    session.answer_lane = lane
    got: list[object] = []
    async with trio.open_nursery() as nursery:

        async def lookups() -> None:
            got.append(await node.lookup(raw.peer_id, [os.urandom(32)]))
            try:
                await node.lookup(raw.peer_id, [os.urandom(32)])
            except PeerUnavailable as exc:
                got.append(exc)

        nursery.start_soon(lookups)
        ev = await next_lookup(raw)
        await trio.testing.wait_all_tasks_blocked()
        assert session._lane_parked is lane
        answer(raw, ev)
        await raw.send_raw(raw.proto.data_to_send() + rest(raw))
    return got


def _bye(raw: RawPeer) -> bytes:
    raw.proto.send_bye("shutdown", "bye")
    return raw.proto.data_to_send()


def _restart(raw: RawPeer) -> bytes:
    """The peer's hello of a new epoch (it restarted)."""
    raw.proto = SessionProtocol(attrs.evolve(raw.proto.local, epoch=raw.proto.local.epoch + 1))
    raw.proto.start()
    return raw.proto.data_to_send()


async def _sent_until_closed(raw: RawPeer) -> list[str]:
    """The kinds of the frames the node sends until it closes the connection."""
    assert raw.stream is not None
    decoder, kinds = FrameDecoder(), []
    while True:
        try:
            data = await raw.stream.receive_some(65536)
        except trio.BrokenResourceError:
            break
        if not data:
            break
        decoder.feed(data)
        while (msg := decoder.next_message()) is not None:
            kinds.append(type(msg).__name__)
    return kinds


async def _new_handshake(raw: RawPeer) -> None:
    """The restarted peer's side of its new handshake: every frame the node sends until
    both acks are through goes through the new protocol (which refuses a request before
    its handshake as a protocol error)."""
    while not raw.proto.ready:
        ev = await raw.next_event()
        assert ev is not None and not isinstance(ev, LookupRequested), ev
        if isinstance(ev, HelloReceived):
            raw.proto.registration_succeeded()
            await raw.flush()


@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("rest", [_bye, _restart], ids=["bye", "restart"])
async def test_answer_then_a_bye_or_a_new_hello_in_one_write_a_next_lookup_is_refused(
    lane: bool, rest: Any
) -> None:
    """The answer and then a bye, or the hello of the peer's new epoch, in one write: the
    lookup returns its answer, and a lookup made right after (no checkpoint between) is
    refused before anything is sent, exactly as with the lane off: nothing goes to the
    peer that said bye, and the restarted peer's new handshake sees no request before
    it."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            got = await _answer_then(raw, session, node, lane, rest)
            assert got[0] == [True]
            assert type(got[1]) is PeerUnavailable, got
            if rest is _bye:
                assert "Lookup" not in await _sent_until_closed(raw)
            else:
                await _new_handshake(raw)
                assert session.alive


async def test_a_reset_read_by_the_lane_is_reported_as_a_reset() -> None:
    """A reset is reported once, to whichever receive comes first: read by the lane's
    task, it still ends the session as a lost connection (not as a close)."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            async with trio.open_nursery() as nursery:
                got, _ = await lookup_in_background(nursery, node, raw)
                assert session._lane_parked
                assert raw.stream is not None
                raw.stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                raw.stream.socket.close()  # a reset
            assert len(got) == 1 and isinstance(got[0], SessionClosed)
            await session.finished.wait()
            assert session.close_reason is not None
            assert session.close_reason.startswith("connection lost: receive failed")


async def test_two_lookups_of_the_same_keys_and_a_replayed_answer_read_in_the_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two lookups of the same keys at once, one in the lane and one on its event; the
    peer answers each (the second first) and then replays the first's answer, all in one
    write. Each lookup gets its own round's answer, and the replay, a lie, closes that
    session with a protocol error; the node lives on."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            spy = LaneSpy(session, monkeypatch)
            keys = [os.urandom(32) for _ in range(2)]
            async with trio.open_nursery() as nursery:
                first, ev1 = await lookup_in_background(nursery, node, raw, keys)
                assert session._lane_p is not None and session._lane_p.req_id == ev1.req_id
                second, ev2 = await lookup_in_background(nursery, node, raw, keys)
                now = trio.current_time()
                raw.proto.send_lookup_resp(ev2.req_id, [False, True], now, 100)
                raw.proto.send_lookup_resp(ev1.req_id, [True, False], now, 100)
                replay = encode(LookupResp(req_id=ev1.req_id, hits=[True, False]))
                await raw.send_raw(raw.proto.data_to_send() + replay)
            assert first == [[True, False]] and second == [[False, True]]
            assert spy.takes == 1  # the lane's task read all three
            await session.finished.wait()
            assert session.close_reason is not None
            assert session.close_reason.startswith("protocol error")
            assert node.statistics().peers == 0


async def test_an_answer_then_a_hello_the_reader_refuses_ends_the_wait_in_the_lane() -> None:
    """The answer, then the peer's hello again with the same epoch (a protocol error), in
    one write: the lane's task takes the answer and waits for the reader to act on the
    hello. The reader refuses it and the session ends, the hello never acted on: the
    session's end ends that wait (nothing else would), and the lookup returns its
    answer."""
    with trio.fail_after(BOUND):
        async with open_node(config("n")) as node, raw_peer_of(node) as (raw, session):
            got: list[object] = []
            async with trio.open_nursery() as nursery:

                async def lookup() -> None:
                    got.append(await node.lookup(raw.peer_id, [os.urandom(32)]))

                nursery.start_soon(lookup)
                ev = await next_lookup(raw)
                await trio.testing.wait_all_tasks_blocked()
                assert session._lane_parked
                answer(raw, ev)
                again = SessionProtocol(raw.proto.local)  # the same epoch
                again.start()
                await raw.send_raw(raw.proto.data_to_send() + again.data_to_send())
            assert session._lane_reads == 1  # the lane's task read both frames
            assert got == [[True]]
            assert not session.alive and "same epoch" in (session.close_reason or "")


async def test_a_peer_that_half_closes_while_we_wait_ends_its_lookup_only() -> None:
    """A peer that shuts down its sending side (SHUT_WR) but keeps reading: our lookup
    waiting on it in the lane ends at once with SessionClosed (not at its deadline), its
    session ends and says bye to the side still reading, and another peer connected
    meanwhile is served throughout."""
    with trio.fail_after(BOUND):
        async with (
            open_node(config("n", lookup_timeout=60.0)) as node,
            raw_peer_of(node) as (other, _),
        ):
            async with raw_peer_of(node) as (raw, session):
                async with trio.open_nursery() as nursery:
                    got, _ = await lookup_in_background(nursery, node, raw)
                    assert session._lane_parked
                    assert raw.stream is not None
                    await raw.stream.send_eof()
                assert len(got) == 1 and isinstance(got[0], SessionClosed), got
                await session.finished.wait()
                while (ev := await raw.next_event()) is not None:  # it still reads
                    if isinstance(ev, ByeReceived):
                        break
                assert isinstance(ev, ByeReceived), ev
            async with trio.open_nursery() as nursery:
                served, ev2 = await lookup_in_background(nursery, node, other)
                answer(other, ev2)
                await other.flush()
            assert served == [[True]]
