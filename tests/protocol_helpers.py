"""Drive two sans-IO :class:`SessionProtocol` machines against each other, h11 style.

No sockets, no Trio, no clock: :class:`ConnectionPair` moves ``data_to_send()`` of one side
into ``receive_data()`` of the other (optionally in chosen chunks) and collects the events.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import pytest

from p2pkv.errors import LocalProtocolError
from p2pkv.session.protocol import (
    Event,
    HelloReceived,
    InState,
    LocalInfo,
    OutState,
    Ready,
    SessionProtocol,
    State,
)
from p2pkv.wire import FrameDecoder, Message, encode, encode_all

NUM_BLOCKS = 16
BLOCK_LEN = 4096


def make_info(peer_id: str = "a", **overrides: Any) -> LocalInfo:
    """A compatible ``LocalInfo`` for ``peer_id``; epochs and nonces differ per peer id."""
    info = LocalInfo(
        peer_id=peer_id,
        epoch=zlib.crc32(peer_id.encode()) + 1,
        agent_name=peer_id,
        agent_metadata=b"nixl-md-" + peer_id.encode(),
        base_addr=0x7F00_0000_0000,
        num_blocks=NUM_BLOCKS,
        block_len=BLOCK_LEN,
        fingerprint="model-x/bf16/layout-1",
        hash_algo="sha256",
        hash_seed=b"seed",
        nonce=hashlib.sha256(b"nonce-" + peer_id.encode()).digest()[:16],
    )
    return attrs.evolve(info, **overrides)


def decode_frames(data: bytes) -> list[Message]:
    """Every message in ``data``, which must hold whole frames only."""
    dec = FrameDecoder()
    dec.feed(data)
    out: list[Message] = []
    while (msg := dec.next_message()) is not None:
        out.append(msg)
    assert dec.buffered == 0, "trailing partial frame"
    return out


def frames(*msgs: Message) -> bytes:
    """Hand-crafted wire bytes (for peers that misbehave)."""
    return encode_all(msgs) if len(msgs) != 1 else encode(msgs[0])


class ConnectionPair:
    """Two connected protocol machines ``a`` and ``b`` with an event log per side."""

    def __init__(self, a: LocalInfo | None = None, b: LocalInfo | None = None) -> None:
        a = a if a is not None else make_info("a")
        b = b if b is not None else make_info("b")
        if not a.dialer and not b.dialer:
            a = attrs.evolve(a, dialer=True)  # ``a`` opened the connection
        self.a = SessionProtocol(a)
        self.b = SessionProtocol(b)
        self.log: dict[SessionProtocol, list[Event]] = {self.a: [], self.b: []}

    def other(self, p: SessionProtocol) -> SessionProtocol:
        return self.b if p is self.a else self.a

    def feed(self, dst: SessionProtocol, data: bytes, chunks: Sequence[int] = ()) -> list[Event]:
        """Feed ``data`` to ``dst`` (split at the ``chunks`` offsets); ``dst``'s events."""
        events: list[Event] = []
        cuts = [0, *sorted(c for c in chunks if 0 < c < len(data)), len(data)]
        try:
            for lo, hi in itertools.pairwise(cuts):
                dst.receive_data(data[lo:hi])
                while (ev := dst.next_event()) is not None:
                    events.append(ev)
        finally:
            self.log[dst].extend(events)
        return events

    def deliver(self, src: SessionProtocol, chunks: Sequence[int] = ()) -> list[Event]:
        """Move everything ``src`` may send now into its peer; the peer's events."""
        return self.feed(self.other(src), src.data_to_send(), chunks)

    def exchange(self) -> tuple[list[Event], list[Event]]:
        """Deliver both ways until neither side has anything to send: (a's, b's) events."""
        ea: list[Event] = []
        eb: list[Event] = []
        while True:
            data_a, data_b = self.a.data_to_send(), self.b.data_to_send()
            if not data_a and not data_b:
                return ea, eb
            eb += self.feed(self.b, data_a)
            ea += self.feed(self.a, data_b)

    def register(self, p: SessionProtocol) -> Ready | None:
        """The driver's registration finished: ``registration_succeeded`` (logged)."""
        ready = p.registration_succeeded()
        if ready is not None:
            self.log[p].append(ready)
        return ready

    def handshake(self) -> None:
        """Full handshake; both sides READY."""
        self.a.start()
        self.b.start()
        ea, eb = self.exchange()
        assert [type(e) for e in ea] == [HelloReceived]
        assert [type(e) for e in eb] == [HelloReceived]
        self.register(self.a)
        self.register(self.b)
        self.exchange()
        assert self.a.state is State.READY and self.b.state is State.READY

    def lookup(
        self, keys: Sequence[bytes], hits: Sequence[bool], *, now: float = 0.0, lease: float = 10.0
    ) -> int:
        """``a`` looks up ``keys`` at ``b``, ``b`` answers ``hits``; the request id."""
        req = self.a.send_lookup(keys)
        self.deliver(self.a)
        self.b.send_lookup_resp(req, hits, now, lease)
        self.deliver(self.b)
        assert self.a.out_state(req) is OutState.OPEN
        assert self.b.in_state(req) is InState.PINNED
        return req


def ready_pair(a: LocalInfo | None = None, b: LocalInfo | None = None) -> ConnectionPair:
    pair = ConnectionPair(a, b)
    pair.handshake()
    return pair


@attrs.frozen
class Snapshot:
    """Everything a caller can observe of one machine (outbox aside)."""

    state: State
    ready: bool
    peer_id: str | None
    close_reason: tuple[str, str] | None
    open_requests: list[int]
    open_rounds: list[int]
    out_states: dict[int, OutState | None]
    in_states: dict[int, InState | None]
    pins: int
    next_deadline: float | None


def snapshot(p: SessionProtocol, ids: Iterable[int] = ()) -> Snapshot:
    ids = list(ids)
    return Snapshot(
        state=p.state,
        ready=p.ready,
        peer_id=p.peer_id,
        close_reason=p.close_reason,
        open_requests=sorted(p.open_requests()),
        open_rounds=sorted(p.open_rounds()),
        out_states={i: p.out_state(i) for i in ids},
        in_states={i: p.in_state(i) for i in ids},
        pins=p.pins_held(),
        next_deadline=p.next_deadline(),
    )


def assert_refused(
    p: SessionProtocol,
    call: Callable[[], object],
    ids: Iterable[int] = (),
    match: str | None = None,
) -> bytes:
    """``call`` raises LocalProtocolError and changes nothing observable, and puts nothing on
    the wire. Returns what ``p`` had queued before (the caller may still deliver it)."""
    ids = list(ids)
    queued = p.data_to_send()
    before = snapshot(p, ids)
    with pytest.raises(LocalProtocolError, match=match):
        call()
    assert snapshot(p, ids) == before
    assert p.data_to_send() == b""
    return queued
