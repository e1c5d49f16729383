"""A fetch's reply stuck in a full send buffer: while the peer restarts on the same
connection and reuses the round's request id (the old round's pins are still released,
once, and the new round is not), and while the node closes (it does not wait forever).

Real TCP on loopback with a hand-driven peer; the session's sends are held by a gate
(FAKE: a full socket send buffer: ``_send_now`` takes nothing and ``send_all`` waits).
Autojump clock with VirtualOffload (inline, no real threads).
"""

from __future__ import annotations

import socket
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from p2pkv.session.protocol import SessionProtocol
from p2pkv.session.session import PeerSession
from p2pkv.wire import Lookup, encode

from .helpers import fill
from .test_producer_caps import connected, looked_up, node


class SendGate:
    """FAKE full send buffer for one session: while shut, nothing the session sends
    reaches the kernel (every flush parks in ``send_all``, holding the send lock)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.session: PeerSession | None = None
        self.open = trio.Event()
        self.open.set()
        real_send_now = PeerSession._send_now
        real_send_all = trio.SocketStream.send_all
        gate = self

        def send_now(s: PeerSession, data: bytes) -> int:
            if s is gate.session and not gate.open.is_set():
                return 0
            return real_send_now(s, data)

        async def send_all(stream: trio.SocketStream, data: Any) -> None:
            if gate.session is not None and stream is gate.session.stream:
                await gate.open.wait()
            await real_send_all(stream, data)

        monkeypatch.setattr(PeerSession, "_send_now", send_now)
        monkeypatch.setattr(trio.SocketStream, "send_all", send_all)

    def shut(self, session: PeerSession) -> None:
        self.session, self.open = session, trio.Event()


async def test_reply_stuck_in_send_while_peer_restarts_and_reuses_the_request_id(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SendGate(monkeypatch)
    async with node("src") as src:
        keys_a = fill(src.store, 4, 4096)
        keys_b = fill(src.store, 4, 4096)
        raw, s = await connected(src)
        req, hits = await looked_up(raw, keys_a)
        assert req == 1 and hits == [True] * 4
        old = s._pinned[req]

        # The fetch is written and settles; its transfer_done is queued, and the flush
        # that sends it parks in send_all (holding the send lock).
        gate.shut(s)
        raw.proto.send_fetch(req, keys_a, [0, 1, 2, 3])
        await raw.flush()
        await trio.sleep(1.0)
        assert s.proto.in_state(req) is None  # the reply took the round out of `_in`
        assert s._write_done == {} and s._writes == {}
        assert s._pinned.get(req) is old and src.store.pinned_slots == 4
        assert s._send_lock.locked()

        # The peer restarts on this connection (new epoch) without reading anything.
        raw.proto = SessionProtocol(attrs.evolve(raw.proto.local, epoch=raw.proto.local.epoch + 1))
        raw.proto.start()
        await raw.flush()
        await trio.sleep(1.0)
        # The old round was not among the dropped ones (its reply was queued first), so
        # `_forget` left it; the new incarnation is registered and our ack is queued.
        assert s._pinned.get(req) is old
        assert s.proto._ack_sent
        # Both the registration's flush and the reader's (after the hello: our own
        # hello is queued on a restart) wait behind the write task's flush.
        assert s._send_lock.statistics().tasks_waiting >= 2

        # The new incarnation's first lookup, with the old round's request id.
        await raw.send_raw(encode(Lookup(req_id=req, keys=keys_b)))
        await trio.sleep(1.0)
        # The reader is still parked in its flush: the lookup has not been read.
        assert s._pinned.get(req) is old
        assert src.store.pinned_slots == 4

        gate.open.set()
        await trio.sleep(5.0)
        # The write task's flush returned first (FIFO lock) and released the old round;
        # only then did the reader take the lookup, which pinned keys_b.
        new = s._pinned.get(req)
        assert new is not None and new is not old
        assert src.store.unpin(old.owner) == 0
        assert src.store.pinned_slots == 4
        await raw.aclose()
        with trio.fail_after(30):
            while src.statistics().sessions:
                await trio.sleep(0.1)
        assert src.store.pinned_slots == 0


async def test_a_reply_stuck_in_a_full_socket_does_not_hold_the_node_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A peer that keeps the connection but never reads again (small socket buffers, a
    transfer_done too big for them): the write task's reply is stuck in send_all. The
    node's close must still end the session and release the round's pins."""
    n = 65536
    async with node(
        "src",
        block_len=64,
        verify_checksums=True,
        max_keys_held_per_peer=1 << 20,
        close_timeout=2.0,
    ) as src:
        keys = fill(src.store, 4, 64)
        raw, s = await connected(src, num_blocks=n, block_len=64)
        miss = [bytes([i & 255, i >> 8]) * 16 for i in range(n - 4)]
        req, hits = await looked_up(raw, keys + miss)
        assert sum(hits) == 4
        # Only the direction the node sends in (the fetch must get through whole).
        assert isinstance(s.stream, trio.SocketStream) and raw.stream is not None
        s.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.proto.send_fetch(req, keys + miss, list(range(n)))
        await raw.flush()
        await trio.sleep(1.0)
        assert s._send_lock.locked() and s._write_done == {}  # the write task is in its flush
        assert src.store.pinned_slots == 4
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
