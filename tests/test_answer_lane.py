"""The answer lane (``PeerSession._await_answer``): a request's waiter reads the socket
itself, and hands every frame it may not handle to the reader, in order. What the lane
saves is measured by ``bench/control_plane.py``, never here."""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio
import trio.testing

from p2pkv import Node, P2PKVError, open_node
from p2pkv.session.protocol import (
    AbortRequested,
    LookupAnswered,
    LookupRequested,
    PongReceived,
)

from .helpers import FaultFactory, RawPeer, VirtualOffload, config

BOUND = 20.0  # seconds: "this did not hang", never an expected duration
KEY = b"k" * 32


def session_of(node: Node, raw: RawPeer) -> Any:
    return node._by_peer[raw.peer_id]


async def connected_raw(node: Node, **info: Any) -> RawPeer:
    raw = RawPeer(**info)
    await raw.connect(node.address)
    await raw.handshake()
    return raw


async def next_lookup(raw: RawPeer) -> LookupRequested:
    ev = await raw.next_event()
    while isinstance(ev, PongReceived):
        ev = await raw.next_event()
    assert isinstance(ev, LookupRequested), ev
    return ev


async def test_lookups_read_their_own_answers_and_the_reader_serves_the_peer_between() -> None:
    """Each lookup rides the lane; between them the reader reads again (a lookup from the
    peer is answered)."""
    with trio.fail_after(BOUND):
        async with open_node(config("dst")) as dst:
            raw = await connected_raw(dst)
            session = session_of(dst, raw)
            async with trio.open_nursery() as nursery:

                async def lookup_twice() -> None:
                    for _ in range(2):
                        assert await dst.lookup(raw.peer_id, [KEY]) == [True]

                nursery.start_soon(lookup_twice)
                for _ in range(2):
                    ev = await next_lookup(raw)
                    raw.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60.0)
                    await raw.flush()
            assert session.lane_rides == 2
            # Nobody waits now: the reader has the socket and answers the peer's lookup.
            raw.proto.send_lookup([KEY])
            await raw.flush()
            ev2 = await raw.next_event()
            assert isinstance(ev2, LookupAnswered) and ev2.hits == [False]
            assert session.lane_rides == 2
            await raw.aclose()


async def test_a_peer_lookup_read_in_the_lane_is_answered_by_the_reader_in_order() -> None:
    """The peer's own lookup and the answer to ours arrive in one segment: the lane
    leaves the lookup (it pins, and may yield) and what follows to the reader, which
    handles both in order; our lookup gets its answer, the peer gets one too."""
    with trio.fail_after(BOUND):
        async with open_node(config("dst")) as dst:
            dst.store.put(KEY, bytes(4096))
            raw = await connected_raw(dst)
            session = session_of(dst, raw)
            async with trio.open_nursery() as nursery:
                results: list[list[bool]] = []

                async def lookup() -> None:
                    results.append(await dst.lookup(raw.peer_id, [KEY, b"x" * 32]))

                nursery.start_soon(lookup)
                ev = await next_lookup(raw)
                theirs = raw.proto.send_lookup([KEY])
                raw.proto.send_lookup_resp(ev.req_id, [False, True], trio.current_time(), 60.0)
                await raw.flush()  # one send: both frames
                answer = await raw.next_event()
                assert isinstance(answer, LookupAnswered)
                assert answer.req_id == theirs and answer.hits == [True]
            assert results == [[False, True]]
            assert session.lane_rides == 1
            assert not session._undrained and session._lane is None
            await raw.aclose()


async def test_a_burst_over_a_turn_in_the_lane_is_drained_by_the_reader() -> None:
    """More frames than a turn's worth arrive with our answer behind them: the lane
    handles a turn's worth, the reader the rest (every ping gets its pong), and the
    answer still reaches the lookup."""
    with trio.fail_after(BOUND):
        async with open_node(config("dst", max_events_per_turn=4)) as dst:
            raw = await connected_raw(dst)
            session = session_of(dst, raw)
            async with trio.open_nursery() as nursery:
                results: list[list[bool]] = []

                async def lookup() -> None:
                    results.append(await dst.lookup(raw.peer_id, [KEY]))

                nursery.start_soon(lookup)
                ev = await next_lookup(raw)
                nonces = [raw.proto.send_ping() for _ in range(11)]
                raw.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60.0)
                await raw.flush()
                pongs = []
                while len(pongs) < len(nonces):
                    pong = await raw.next_event()
                    assert isinstance(pong, PongReceived)
                    pongs.append(pong.nonce)
                assert pongs == nonces
            assert results == [[True]]
            assert session.lane_rides == 1
            await raw.aclose()


async def test_a_malformed_frame_in_the_lane_fails_the_lookup_and_the_node_lives_on() -> None:
    with trio.fail_after(BOUND):
        async with open_node(config("dst")) as dst:
            raw = await connected_raw(dst)
            async with trio.open_nursery() as nursery:
                errors: list[BaseException] = []

                async def lookup() -> None:
                    try:
                        await dst.lookup(raw.peer_id, [KEY])
                    except P2PKVError as exc:
                        errors.append(exc)

                nursery.start_soon(lookup)
                await next_lookup(raw)
                await raw.send_raw(b"\x00\x00\x00\x01\xc1")  # undecodable
                bye = await raw.expect_close()
                assert bye is not None and bye.code == "protocol"
            assert len(errors) == 1 and "protocol error" in str(errors[0])
            await raw.aclose()
            again = await connected_raw(dst)  # the node serves the next peer
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dst.lookup, again.peer_id, [KEY])
                ev = await next_lookup(again)
                again.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60.0)
                await again.flush()
            await again.aclose()


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
async def test_a_lookup_that_stops_waiting_in_the_lane_gives_the_socket_back(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """A lookup cancelled (or past its deadline) while it reads the socket aborts its
    request and gives the socket back: the reader reads the abort_ack, and the next
    lookup rides the lane again and gets its answer."""
    async with open_node(
        config("dst", lookup_timeout=5.0), offload=VirtualOffload(), transport=FaultFactory()
    ) as dst:
        raw = await connected_raw(dst)
        session = session_of(dst, raw)
        if how == "cancelled":
            with trio.move_on_after(2.0) as scope:
                await dst.lookup(raw.peer_id, [KEY])
            assert scope.cancelled_caught
        else:
            with pytest.raises(P2PKVError, match="timed out"):
                await dst.lookup(raw.peer_id, [KEY])
        assert session._lane is None and session.lane_rides == 1
        ev = await next_lookup(raw)
        abort = await raw.next_event()
        assert isinstance(abort, AbortRequested) and abort.req_id == ev.req_id
        raw.proto.send_abort_ack(ev.req_id)
        await raw.flush()
        async with trio.open_nursery() as nursery:
            results: list[list[bool]] = []

            async def lookup() -> None:
                results.append(await dst.lookup(raw.peer_id, [KEY]))

            nursery.start_soon(lookup)
            ev = await next_lookup(raw)
            raw.proto.send_lookup_resp(ev.req_id, [True], trio.current_time(), 60.0)
            await raw.flush()
        assert results == [[True]] and session.lane_rides == 2
        assert dst.statistics().peers == 1
        await raw.aclose()


async def test_the_peer_closing_while_a_lookup_reads_fails_it_as_a_closed_session() -> None:
    with trio.fail_after(BOUND):
        async with open_node(config("dst")) as dst:
            raw = await connected_raw(dst)
            async with trio.open_nursery() as nursery:
                errors: list[BaseException] = []

                async def lookup() -> None:
                    try:
                        await dst.lookup(raw.peer_id, [os.urandom(32)])
                    except P2PKVError as exc:
                        errors.append(exc)

                nursery.start_soon(lookup)
                await next_lookup(raw)
                await raw.aclose()
            assert len(errors) == 1 and "closed by peer" in str(errors[0])
