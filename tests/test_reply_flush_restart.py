"""A fetch's reply stuck in a full send buffer: while the peer restarts on the same
connection and reuses the round's request id (the old round's pins are still released,
once, and the new round is not), and while the node closes (it does not wait forever).

Real TCP on loopback with a hand-driven peer; the session's sends are held by a gate
(FAKE: a full socket send buffer: ``_send_now`` takes nothing and ``_send_rest`` waits).
Autojump clock with VirtualOffload (inline, no real threads).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from p2pkv import Node, open_node
from p2pkv.session.protocol import (
    InState,
    LookupAnswered,
    LookupRequested,
    SessionProtocol,
    TransferCompleted,
)
from p2pkv.session.session import PeerSession
from p2pkv.wire import HelloAck, Lookup, Outcome, encode

from ._clock import kernel_paced
from .helpers import FaultFactory, RawPeer, SendGate, VirtualOffload, config, fill
from .helpers import virtual_node as node
from .test_producer_caps import connected

N = 65536  # keys of a fetch whose transfer_done (with checksums, ~130 KB) fills small buffers


@asynccontextmanager
async def big_reply_node(**kw: Any) -> AsyncIterator[tuple[Node, list[bytes]]]:
    """A node whose replies carry checksums, and 4 keys it holds. Its leases outlast every
    test here: a fetch of N keys is ~2 MB over real loopback, and the clock may jump
    virtual time past a stall of the kernel's (``tests/_clock.py``, ``SETTLE``); a lease
    run out first would make the fetch's reply N LEASE_EXPIRED outcomes, not the reply
    these tests are about (seen once on a slow VM, 2026-12-07)."""
    cfg: dict[str, Any] = {"block_len": 64, "verify_checksums": True, "lease": 3600.0}
    async with node("src", max_keys_held_per_peer=1 << 20, **cfg, **kw) as src:
        yield src, fill(src.store, 4, 64)


async def fetch_with_a_big_reply(
    raw: RawPeer, s: PeerSession, keys: list[bytes], *, shrink_peer: bool = True
) -> int:
    """``raw`` looks up ``keys`` and N - 4 misses, then fetches them all, through a 4 KiB
    send buffer on the node's side (and a 4 KiB receive buffer on the peer's, unless
    ``shrink_peer`` is off): the reply is N outcomes with their checksums. Returns once
    the node has read the fetch; its request id.

    None of it needs virtual time, so the clock jumps only after a second of real time
    with every task blocked (``kernel_paced``): a jump to the next deadline per stall of
    the kernel could otherwise end a session as idle while the ~300 KB of lookup and fetch
    cross loopback."""
    miss = [bytes([i & 255, i >> 8]) * 16 for i in range(N - len(keys))]
    with kernel_paced():
        req, hits = await raw.lookup(keys + miss)
        assert sum(hits) == len(keys)
        # Only the direction the node sends in (the fetch must get through whole).
        assert isinstance(s.stream, trio.SocketStream) and raw.stream is not None
        s.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        if shrink_peer:
            raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.proto.send_fetch(req, keys + miss, list(range(N)))
        await raw.flush()
        # Until the node has read the fetch, no virtual time passes: a task that only
        # checkpoints is never blocked, so the clock does not jump.
        while s.alive and s.proto.in_state(req) is InState.PINNED:
            await trio.lowlevel.checkpoint()
    return req


async def stuck_lookup_setup(src: Node) -> tuple[RawPeer, PeerSession, Any, list[bytes]]:
    """A hand-driven peer with 4 KiB buffers between it and ``src``, and a lookup of 4,096
    keys (~150 KB) for ``src`` to send it: the frame sticks until the peer reads."""
    raw, s = await connected(src, num_blocks=16, block_len=64)
    assert isinstance(s.stream, trio.SocketStream) and raw.stream is not None
    s.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    (peer,) = src.peers()
    return raw, s, peer, [i.to_bytes(4, "big") * 8 for i in range(4096)]


async def connected_small(n: Node, rcvbuf: int, **info: Any) -> tuple[RawPeer, PeerSession]:
    """A hand-driven peer whose receive buffer is ``rcvbuf`` bytes from before it connects:
    the window it offers is agreed at the connection, and shrinking the buffer later
    leaves a window of loopback's default (128 KiB) that a whole reply can slip into."""
    raw = RawPeer(**info)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(n.address)
    raw.stream = trio.SocketStream(sock)
    await raw.handshake()
    return raw, n._by_peer[raw.peer_id]


async def test_reply_stuck_in_send_while_peer_restarts_and_reuses_the_request_id(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(60):
        gate = SendGate(monkeypatch)
        async with node("src") as src:
            keys_a = fill(src.store, 4, 4096)
            keys_b = fill(src.store, 4, 4096)
            raw, s = await connected(src)
            req, hits = await raw.lookup(keys_a)
            assert req == 1 and hits == [True] * 4
            old = s._pinned[req]

            # The fetch is written and settles; its transfer_done is queued. The socket takes
            # none of it: the write task leaves it to a drain task (which waits for the socket,
            # holding the send lock) and ends, releasing the round's pins at once: the copy is
            # over, and the reply's place in our outbox or the kernel changes nothing for them.
            gate.shut(s)
            raw.proto.send_fetch(req, keys_a, [0, 1, 2, 3])
            await raw.flush()
            await trio.sleep(1.0)
            assert s.proto.in_state(req) is None  # the reply took the round out of `_in`
            assert s._write_done == {} and s._writes == {}
            assert s._pinned.get(req) is None and src.store.pinned_slots == 0
            assert src.store.unpin(old.owner) == 0
            assert s._send_lock.locked()

            # The peer restarts on this connection (new epoch) without reading anything.
            raw.proto = SessionProtocol(
                attrs.evolve(raw.proto.local, epoch=raw.proto.local.epoch + 1)
            )
            raw.proto.start()
            await raw.flush()
            await trio.sleep(1.0)
            # The new incarnation is registered and our ack is queued; nobody waits behind the
            # stuck send (the registration's flush and the reader's left their frames to it).
            assert s.proto._ack_sent
            assert s._send_lock.statistics().tasks_waiting == 0
            assert s.proto.has_data_to_send()

            # The new incarnation's ack (by hand: this peer reads nothing, so its protocol has
            # not seen our new hello; a request before the ack would be a protocol error),
            # then its first lookup, with the old round's request id.
            ack = HelloAck(peer_id=raw.proto.local.peer_id, epoch=s.proto.local.epoch)
            await raw.send_raw(encode(ack) + encode(Lookup(req_id=req, keys=keys_b)))
            await trio.sleep(1.0)
            # The reader went on reading: the lookup pinned keys_b under the same id.
            new = s._pinned.get(req)
            assert new is not None and new is not old
            assert src.store.pinned_slots == 4

            gate.open.set()
            await trio.sleep(5.0)
            # The drain task sent everything in order (the old reply, our hello and ack, the
            # new answer); the new round keeps its pins.
            assert s._pinned.get(req) is new
            assert src.store.pinned_slots == 4
            assert not s.proto.has_data_to_send() and not s._send_lock.locked()
            await raw.aclose()
            with trio.fail_after(30):
                while src.statistics().sessions:
                    await trio.sleep(0.1)
            assert src.store.pinned_slots == 0


async def test_a_reply_stuck_in_a_full_socket_does_not_hold_the_node_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer that keeps the connection but never reads again (small socket buffers, a
    transfer_done too big for them): the write task's reply is stuck in its send. The
    node's close must still end the session and release the round's pins."""
    with trio.fail_after(1200):  # virtual: well past the 600 s it waits with the reply stuck
        async with big_reply_node(close_timeout=2.0) as (src, keys):
            raw, s = await connected(src, num_blocks=N, block_len=64)
            await fetch_with_a_big_reply(raw, s, keys)
            await trio.sleep(1.0)
            # The write task ended, its pins released; a drain task holds the stuck reply.
            assert s._send_lock.locked() and s._write_done == {}
            assert src.store.pinned_slots == 0
            closed = trio.Event()

            async def close() -> None:
                await src.aclose()
                closed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close)
                await trio.sleep(600.0)
                state = (closed.is_set(), src.store.pinned_slots)
                await raw.aclose()  # in any case: the send then fails and everything ends
            # A node's close ends each session within close_timeout (2 s) a stage.
            assert state == (True, 0)


@pytest.mark.parametrize("pinging", [False, True], ids=["silent", "pinging"])
async def test_a_peer_that_stops_reading_is_dropped_alone_after_idle_timeout(
    autojump_clock: trio.testing.MockClock, pinging: bool
) -> None:
    """A peer that keeps the connection but stops reading (small socket buffers, a
    transfer_done too big for them) leaves the write task's reply stuck in its send,
    holding the send lock: the keepalive's ping and the reader's pong then wait behind it.
    Silent or still pinging us, such a peer must lose its session once our send has made
    no headway for ``idle_timeout``, with its pins released, while another peer is served
    throughout."""
    with trio.fail_after(120):
        async with big_reply_node(idle_timeout=30.0, heartbeat_interval=5.0) as (src, keys):
            raw, s = await connected(src, num_blocks=N, block_len=64)
            other, _ = await connected(src, num_blocks=16, block_len=64)
            req = await fetch_with_a_big_reply(raw, s, keys)
            await trio.sleep(1.0)
            assert s._send_lock.locked() and s._write_done == {}  # the reply is stuck
            assert req not in s._pinned and src.store.pinned_slots == 0  # the copy is over
            stuck_at = trio.current_time() - 1.0

            async def ping_forever() -> None:
                while True:
                    raw.proto.send_ping()
                    await raw.flush()
                    await trio.sleep(1.0)

            async with trio.open_nursery() as nursery:
                if pinging:
                    nursery.start_soon(ping_forever)
                # The other peer is served while the stuck one waits out its timeout.
                for _ in range(5):
                    _, other_hits = await other.lookup(keys)
                    assert other_hits == [True] * 4
                    await trio.sleep(5.0)
                with trio.fail_after(60):
                    await s.finished.wait()
                dropped_after = trio.current_time() - stuck_at
                nursery.cancel_scope.cancel()
            # No headway for idle_timeout from the stuck send's start (within the second
            # after the fetch went out), then the close, which sends nothing more. A silent
            # peer may meet the idle deadline first (nothing heard since its fetch): the
            # keepalive no longer waits behind the stuck send either.
            assert 29.0 <= dropped_after <= 32.0, dropped_after
            reasons = {"peer stopped reading"} | ({"idle timeout"} if not pinging else set())
            assert s.close_reason in reasons, s.close_reason
            assert s._pinned == {}  # (the other peer's rounds may pin the same keys)
            _, other_hits = await other.lookup(keys)
            assert other_hits == [True] * 4
            await raw.aclose()
            await other.aclose()


async def test_a_slow_reader_that_makes_headway_keeps_its_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The send deadline is for headway, not for the whole reply: a peer that reads a
    little of a big transfer_done every 10 s (a third of ``idle_timeout``) for far longer
    than ``idle_timeout`` in all keeps its session and gets the whole reply."""
    with trio.fail_after(7200):  # virtual: past the 3600 s bound of its read loop
        async with big_reply_node(idle_timeout=30.0, heartbeat_interval=5.0) as (src, keys):
            # Small from before the connection, so the node's reply stays mostly in its own
            # send path, paced by our reads.
            raw, s = await connected_small(src, 16384, num_blocks=N, block_len=64)
            req = await fetch_with_a_big_reply(raw, s, keys, shrink_peer=False)
            assert raw.stream is not None
            start = trio.current_time()
            done: TransferCompleted | None = None
            got = 0
            with trio.fail_after(3600):
                while done is None:
                    await trio.sleep(10.0)
                    raw.proto.send_ping()  # as the side that dialed does: the node hears from us
                    await raw.flush()
                    data = await raw.stream.receive_some(16384)
                    got += len(data)
                    assert data, s.close_reason
                    raw.proto.receive_data(data)
                    while (ev := raw.proto.next_event()) is not None:
                        if isinstance(ev, TransferCompleted):
                            done = ev
            assert trio.current_time() - start > 2 * 30.0  # far longer than the timeout
            assert got > 100_000  # the reply, whole (its checksums make it ~130 KB)
            assert done.req_id == req and done.outcomes[:4] == [int(Outcome.OK)] * 4
            assert s.alive and s.close_reason is None
            await raw.aclose()


async def test_the_reader_goes_on_reading_while_its_own_send_is_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node's lookup of 4,096 keys to a peer is stuck in a full socket (the peer reads
    nothing yet). The peer's own lookups still get read and answered (pinned, the answers
    queued behind the stuck send): a reader that waited behind that send to flush the
    first answer would read no second one, and two nodes doing this to each other would
    wait for each other for ever (each reader stuck behind its node's send, each send
    waiting for the other's reader). Once the peer reads, everything arrives in order.
    Real clock: once the peer reads, real TCP timers pace the frame, which an autojump
    clock would outrun; the waits below are for conditions, bounded by ``fail_after``.
    The answers queued behind the stuck frame go out from a task of the session's own,
    not from the lookup's task, which returns once its own frame is out."""
    senders: list[str] = []
    real_send_now = PeerSession._send_now

    def send_now(session: PeerSession, data: bytes) -> int:
        senders.append(trio.lowlevel.current_task().name)
        return real_send_now(session, data)

    monkeypatch.setattr(PeerSession, "_send_now", send_now)

    async def until(ok: Callable[[], bool]) -> None:
        while not ok():
            await trio.sleep(0.005)

    # Deadlines far off: this peer pings nobody and answers late, on purpose.
    long: dict[str, Any] = {
        "idle_timeout": 600.0,
        "heartbeat_interval": 100.0,
        "lookup_timeout": 600.0,
    }
    with trio.fail_after(60):
        async with node("src", block_len=64, max_keys_held_per_peer=1 << 20, **long) as src:
            keys = fill(src.store, 8, 64)
            raw, s, peer, big = await stuck_lookup_setup(src)
            got: list[list[bool]] = []

            async def look() -> None:
                got.append(await src.lookup(peer, big))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(look)
                await until(lambda: s._send_lock.locked())  # the lookup's frame is stuck
                r1 = raw.proto.send_lookup(keys[:4])
                await raw.flush()
                await until(lambda: r1 in s._pinned)
                r2 = raw.proto.send_lookup(keys[4:])
                await raw.flush()
                await until(lambda: r2 in s._pinned)  # read behind the stuck send
                assert s._send_lock.locked() and s._send_lock.statistics().tasks_waiting == 0
                assert src.store.pinned_slots == 8 and not got
                # The peer reads at last: the node's lookup (answered: no hits), our answers.
                answers: dict[int, list[bool]] = {}
                while len(answers) < 2:
                    ev = await raw.next_event()
                    if isinstance(ev, LookupRequested):
                        hits = [False] * len(ev.keys)
                        raw.proto.send_lookup_resp(ev.req_id, hits, trio.current_time(), 30.0)
                        await raw.flush()
                    elif isinstance(ev, LookupAnswered):
                        answers[ev.req_id] = ev.hits
                    else:
                        assert ev is not None
            assert answers == {r1: [True] * 4, r2: [True] * 4}
            # The lookup's task sent its own frame and nothing queued after it.
            assert sum(name.endswith(".look") for name in senders) == 1, senders
            assert got == [[False] * 4096] and s.alive
            await raw.aclose()


async def test_a_probe_does_not_wait_behind_a_stuck_send_and_a_cut_send_loses_nothing() -> None:
    """While the node's lookup frame is stuck in a peer's full socket: a probe of that
    session (a reconnecting peer's claim on its id) answers "silent" within its own time,
    not the send's deadline (600 s here); and the caller cutting that send off
    between two pieces loses nothing: the rest goes out first once the peer reads, the
    frame arrives whole (a frame cut short would be a protocol error that ends the
    session) and the session lives on. Real clock: once the peer reads, real TCP timers
    pace the frame, which an autojump clock would outrun."""
    # This peer pings nobody: the idle deadline far off, so that only the cut is tested;
    # the lookup's own deadline far off too, so that only the test's cut ends it.
    long: dict[str, Any] = {
        "idle_timeout": 600.0,
        "heartbeat_interval": 100.0,
        "lookup_timeout": 600.0,
    }
    with trio.fail_after(60):
        async with node("src", block_len=64, max_keys_held_per_peer=1 << 20, **long) as src:
            raw, s, peer, big = await stuck_lookup_setup(src)
            cut = False
            # The caller's cut, made by this test once the probe has answered: the probe
            # must answer while the send is still stuck (a probe that waited behind it
            # would wait for ever here, not only until a timed cut freed it).
            cs = trio.CancelScope()

            async def look() -> None:
                nonlocal cut
                with cs:
                    await src.lookup(peer, big)
                cut = cs.cancelled_caught

            async with trio.open_nursery() as nursery:
                nursery.start_soon(look)
                while not s._send_lock.locked():
                    await trio.sleep(0.005)
                # Only "did not hang" (the send's own deadline is 600 s): not a speed target.
                with trio.fail_after(5.0):
                    assert await s.probe(0.5) is False
                assert s._send_lock.locked() and not cut  # the send is still stuck
                cs.cancel()
            assert cut and s.alive and not s._send_broken
            # The peer reads at last: the whole lookup frame (then the abort of its round).
            ev = await raw.next_event()
            assert isinstance(ev, LookupRequested) and ev.keys == big
            while s.proto.has_data_to_send() or s._send_lock.locked():
                await trio.sleep(0.005)
            assert s.alive and s.close_reason is None
            await raw.aclose()


async def test_a_restart_while_the_registration_flush_is_stuck_loses_nothing(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registration task's flush (our hello_ack) is stuck in a full socket when the
    peer restarts again: ending the old incarnation cancels that flush between two pieces,
    which must neither break the stream nor end the session (found by a review)."""
    with trio.fail_after(60):
        gate = SendGate(monkeypatch)
        offload = VirtualOffload({"add_remote_peer": 2.0})
        async with open_node(config("src"), offload=offload, transport=FaultFactory()) as src:
            raw, s = await connected(src)
            local = raw.proto.local
            raw.proto = SessionProtocol(attrs.evolve(local, epoch=local.epoch + 1))
            raw.proto.start()
            await raw.flush()
            await trio.sleep(0.5)
            gate.shut(s)  # the registration (2 s) ends behind a shut gate
            await trio.sleep(3.0)
            assert s._send_lock.locked() and s.alive
            raw.proto = SessionProtocol(attrs.evolve(local, epoch=local.epoch + 2))
            raw.proto.start()
            await raw.flush()
            await trio.sleep(0.5)
            assert s.alive and not s._send_broken and s.close_reason is None
            gate.open.set()
            await trio.sleep(5.0)
            assert s.alive and not s._send_broken and not s.proto.has_data_to_send()
            await raw.aclose()


async def test_the_reader_that_meets_a_full_socket_itself_goes_on_reading() -> None:
    """The reader's own answer (to a lookup of 65,536 keys) does not fit the socket, and
    no other task is sending: a task of the session's own waits for the socket, and the
    reader reads the peer's next lookup and pins it. A reader that waited for the socket
    itself would read nothing more until the peer read (found by a review). Real clock:
    once the peer reads, real TCP timers pace the frame."""
    long: dict[str, Any] = {"idle_timeout": 600.0, "heartbeat_interval": 100.0}
    senders: list[str] = []
    with trio.fail_after(60):
        async with node("src", block_len=64, max_keys_held_per_peer=1 << 20, **long) as src:
            keys = fill(src.store, 4, 64)
            raw, s = await connected(src, num_blocks=16, block_len=64)
            assert isinstance(s.stream, trio.SocketStream) and raw.stream is not None
            s.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            miss = [bytes([i & 255, i >> 8]) * 16 for i in range(N)]
            r1 = raw.proto.send_lookup(miss)
            await raw.flush()
            while not s._send_lock.locked():  # the answer's rest waits for the socket
                await trio.sleep(0.005)
            senders.append(s._send_lock.statistics().owner.name)  # type: ignore[union-attr]
            r2 = raw.proto.send_lookup(keys)
            await raw.flush()
            while r2 not in s._pinned:  # read while the socket is still full
                await trio.sleep(0.005)
            assert s._send_lock.locked()
            answers: dict[int, list[bool]] = {}
            while len(answers) < 2:
                ev = await raw.next_event()
                assert ev is not None
                if isinstance(ev, LookupAnswered):
                    answers[ev.req_id] = ev.hits
            assert answers == {r1: [False] * N, r2: [True] * 4}
            assert senders[0].endswith("PeerSession._flush")  # a drain task, not the reader
            assert s.alive
            await raw.aclose()
