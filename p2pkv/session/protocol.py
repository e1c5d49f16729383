"""The session protocol as a pure state machine (sans-IO, in the style of h11).

Theory of operation
-------------------
Everything that affects a session's protocol state lives here. This module knows nothing
of Trio, sockets, NIXL or clocks: bytes and calls come in, events and bytes go out, and
time is an argument. The Trio driver (:mod:`p2pkv.session.session`) does the I/O, the
registration and the data plane, and tells this machine what happened.

Both sides of a session are symmetric: each may be a consumer (it sends ``lookup`` and
``fetch`` and receives blocks) and a producer (it answers and writes).

The handshake and the ack barrier
    Each side sends ``hello`` first. When the peer's hello passes the compatibility checks
    the machine emits :class:`HelloReceived`; the driver registers the peer's memory with
    the data plane and then calls :meth:`SessionProtocol.registration_succeeded`, which
    queues our ``hello_ack``. The ack therefore means "I can write into you now". Nothing
    but ``hello``/``hello_ack``/``bye`` is put on the wire before both acks are through
    (the rest is held), and any request from the peer that arrives before *our* ack
    was sent is a protocol error: so no write ever targets a peer this side has not
    finished registering (invariant 3). So is any frame but a ping or pong before the
    peer's own ack (a peer sends requests only once both acks are through): replies
    would be held until that ack, and a peer that never sent it could make us hold any
    number of them. Of the pongs held, only the latest is kept.

Requests
    Request ids are per direction and strictly increasing, so a reused id is detected in
    O(1). A consumer request goes ``LOOKUP_SENT -> OPEN -> FETCH_SENT -> done``, or to
    ``ABORT_SENT -> done`` from any of them. A producer round goes
    ``ANSWERING -> PINNED (lease) -> WRITING -> done``; ``abort`` ends it once the driver
    has drained its writes and calls :meth:`send_abort_ack`. Every request ends in exactly
    one terminal outcome, and every round's pins are released exactly once: by
    ``send_transfer_done``, ``send_abort_ack``, an empty fetch, lease expiry, or close —
    each of which tells the driver which round's pins to release.

What a peer can make us hold
    A producer round keeps counts, never key lists (the fetch repeats the keys, or, as a
    ``fetch_hits`` from a 1.2 peer, names one slot per hit of our answer, whose count the
    round keeps; the driver holds the hits), and at
    most ``max_open_requests`` rounds are open. A round whose lease ran out is no longer
    open: it leaves a tombstone (its id), and a fetch for it is answered here, every key
    (or slot) ``LEASE_EXPIRED``, with no event for the driver; an abort or an empty fetch just drops
    the tombstone. (A round fetched in time keeps its deadline, :meth:`lease_end`: the
    driver posts no write past it and answers the keys it did not post ``LEASE_EXPIRED``.)
    At most ``max_open_requests`` tombstones are kept, oldest dropped first; a round whose
    tombstone was dropped (its id at or below the highest dropped one) is treated the same
    way, so a slow consumer never turns into a protocol error.
    :meth:`SessionProtocol.keys_held` counts what the driver holds for the peer: a lookup's
    keys until it is answered, then its pins, plus a fetch's keys while it is written.

Errors
    Calling a method in the wrong state raises :class:`LocalProtocolError` and changes
    nothing. Bad input from the peer raises :class:`RemoteProtocolError` from
    :meth:`next_event`; the machine is then in the ``ERROR`` state with a ``bye`` queued
    that carries the reason. A failed compatibility check raises
    :class:`HandshakeRejected` the same way.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
from collections.abc import Sequence
from typing import Any, Final

import attrs
import msgpack

from ..config import PROTOCOL_MAJOR, PROTOCOL_MINOR
from ..errors import (
    CapacityExceeded,
    HandshakeRejected,
    LocalProtocolError,
    RemoteProtocolError,
)
from ..wire import (
    MAX_FRAME_SIZE,
    MAX_HELLO_FRAME,
    MAX_KEY_LEN,
    MAX_KEYS,
    U64_MAX,
    Abort,
    AbortAck,
    Bye,
    Challenge,
    Fetch,
    FetchHits,
    FrameDecoder,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Outcome,
    Ping,
    Pong,
    TransferDone,
    UndecodedHello,
    encode,
    key_lengths_ok,
    keys_ok,
    to_wire,
    trusted,
)

# --- what we are --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LocalInfo:
    """Everything our hello says, plus the limits we enforce on the peer."""

    peer_id: str
    epoch: int
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    block_len: int
    fingerprint: str = ""
    hash_algo: str = "sha256"
    hash_seed: bytes = b""
    nonce: bytes = b"\0" * 16
    secret: bytes | None = attrs.field(default=None, repr=False)
    max_open_requests: int = 64
    max_keys_per_request: int = 65536
    max_key_len: int = 128
    max_frame_size: int = 16 << 20
    # The largest region a peer may claim: registering it costs memory and time in
    # proportion to its blocks, so a bigger claim is refused before anything is built.
    max_peer_blocks: int = 1 << 21
    # Which side opened the connection. With a secret, the dialer proves itself first,
    # so the accepting side never reveals its hello (agent metadata) to a stranger.
    dialer: bool = False


class State(enum.Enum):
    HANDSHAKE = "handshake"  # until both hello_acks are through
    READY = "ready"
    CLOSED = "closed"  # bye sent or received
    ERROR = "error"  # the peer broke the protocol (a bye with the reason is queued)


class OutState(enum.Enum):
    LOOKUP_SENT = "lookup_sent"
    OPEN = "open"  # lookup answered; the producer holds pins for its hits
    FETCH_SENT = "fetch_sent"
    ABORT_SENT = "abort_sent"


class InState(enum.Enum):
    ANSWERING = "answering"  # lookup received, our answer not sent yet
    PINNED = "pinned"
    EXPIRED = "expired"  # a tombstone: lease ran out, pins released; a fetch gets LEASE_EXPIRED
    WRITING = "writing"
    ABORTING = "aborting"  # abort received, the driver is draining writes


@attrs.define
class _OutReq:
    state: OutState
    nkeys: int
    nfetch: int = 0
    nhits: int = 0  # hits in the peer's answer: a fetch_hits names as many slots
    # The state an abort left, so that only the reply that was really in flight when
    # we aborted (a lookup_resp after LOOKUP_SENT, a transfer_done after FETCH_SENT) is
    # swallowed; any other reply to an aborted request is still a protocol error.
    aborted_from: OutState | None = None


@attrs.define
class _InReq:
    """A producer round: counts only, so a round costs the same whatever its size."""

    state: InState
    nkeys: int  # keys of the lookup: the answer has as many hits
    pins: int = 0
    deadline: float = 0.0
    nfetch: int = 0  # keys of the fetch being written; transfer_done must match
    nhits: int = 0  # hits of the answer (pins may drop later): a fetch_hits must match

    @property
    def keys_held(self) -> int:
        return self.nkeys if self.state is InState.ANSWERING else self.pins + self.nfetch


# --- events -------------------------------------------------------------------------------


@attrs.frozen
class HelloReceived:
    """The peer's hello passed the checks: register its memory, then call
    ``registration_succeeded`` (or ``registration_failed``). If ``restarted``, the peer came
    back with a new epoch: the driver must first tear down the old registration, cancel
    ``dropped_rounds`` (releasing their pins) and fail ``failed_requests``."""

    hello: Hello
    restarted: bool = False
    dropped_rounds: tuple[int, ...] = ()
    failed_requests: tuple[int, ...] = ()


@attrs.frozen
class Ready:
    """Both acks are through: requests may flow both ways."""


@attrs.frozen
class LookupRequested:
    req_id: int
    keys: list[bytes]


@attrs.frozen
class LookupAnswered:
    req_id: int
    hits: list[bool]


@attrs.frozen
class FetchRequested:
    """Write ``keys`` into the peer's ``slots`` (a round whose lease ran out never gets
    here: the protocol answers that fetch itself). ``keys`` is None for a ``fetch_hits``:
    every hit of the round, in its lookup's order (the driver keeps them; as many as
    ``slots``, which the protocol has checked against the answer's hit count)."""

    req_id: int
    keys: list[bytes] | None
    slots: list[int]


@attrs.frozen
class RoundClosed:
    """An empty fetch closed a lookup round: release its pins. Nothing is sent back."""

    req_id: int


@attrs.frozen
class TransferCompleted:
    req_id: int
    outcomes: list[int]
    checksums: list[int] | None


@attrs.frozen
class AbortRequested:
    """Cancel or drain this round's writes, release its pins, then ``send_abort_ack``."""

    req_id: int


@attrs.frozen
class AbortAcknowledged:
    req_id: int


@attrs.frozen
class PongReceived:
    nonce: int


@attrs.frozen
class ByeReceived:
    code: str
    reason: str


Event = (
    HelloReceived
    | Ready
    | LookupRequested
    | LookupAnswered
    | FetchRequested
    | RoundClosed
    | TransferCompleted
    | AbortRequested
    | AbortAcknowledged
    | PongReceived
    | ByeReceived
)

_HANDSHAKE_MSGS: Final = (Challenge, Hello, HelloAck, Bye)
_OUTCOME_CODES: Final = frozenset(int(o) for o in Outcome)


def hello_proof(secret: bytes, hello: Hello, receiver_nonce: bytes, *, dialer: bool) -> bytes:
    """HMAC over every field of the hello but the proof itself (its canonical msgpack
    encoding: attrs field order), the sender's role, and the *receiver's* fresh nonce of
    this connection. So no field can be altered under a valid proof, and a hello recorded
    on one connection is worthless on any other (both nonces are bound)."""
    fields = to_wire(attrs.evolve(hello, auth=None))
    role = b"dialer" if dialer else b"acceptor"
    msg = b"\0".join(
        [b"p2pkv-hello-v2", role, receiver_nonce, msgpack.packb(fields, use_bin_type=True)]
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def ack_proof(secret: bytes, acker: str, nonce: bytes) -> bytes:
    """HMAC over the *receiver's* nonce: proves the acker holds the secret now (no replay)."""
    msg = b"\0".join([b"p2pkv-ack-v1", acker.encode(), nonce])
    return hmac.new(secret, msg, hashlib.sha256).digest()


MIN_NONCE = 16  # bytes of a fresh nonce when authentication is on


class SessionProtocol:
    """One side of one session. See the module docstring."""

    def __init__(self, local: LocalInfo) -> None:
        self.local = local
        self.state = State.HANDSHAKE
        self.peer: Hello | None = None
        self.close_reason: tuple[str, str] | None = None  # (code, reason) once closed
        # Until the peer's hello passes its checks, no frame over a hello's size is read.
        self._decoder = FrameDecoder(min(local.max_frame_size, MAX_HELLO_FRAME))
        self._outbox: list[bytes] = []  # may go on the wire now
        self._outbox_bytes = 0  # their length together
        self._head_unsent = False  # _outbox[0] is the rest of a frame a send began
        self._last_batch: list[bytes] = []  # what data_to_send last joined (see unsend)
        self._last_head_begun = False  # ... and whether its first entry was a begun frame
        self._held: list[Message] = []  # waiting for the peer's hello_ack
        self._hello_sent = False
        self._challenge: bytes | None = None  # the peer's nonce, once known (auth on)
        self._started = False
        self.frames_received = 0  # complete frames decoded (liveness counts only these)
        self.input_pending = False  # next_event stopped short: frames may be left
        self._unread: Message | None = None  # decoded, not dispatched (next_event's only)
        self._ack_sent = False
        self._peer_acked = False
        self._registering = False
        self._ready_emitted = False
        self._next_req_id = 1
        self._peer_last_req_id = 0
        self._out: dict[int, _OutReq] = {}
        self._in: dict[int, _InReq] = {}
        self._expired: dict[int, None] = {}  # tombstones of expired rounds, oldest first
        self._expired_dropped = 0  # highest request id whose tombstone was dropped
        self._ping_nonce = 0

    # --- introspection ----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def peer_id(self) -> str | None:
        return None if self.peer is None else self.peer.peer_id

    def pins_held(self) -> int:
        return sum(r.pins for r in self._in.values())

    def pins_released(self, req_id: int) -> None:
        """The driver gave back the pins of the peer's open round ``req_id`` before the
        round ended (the host draining its memory): they no longer count against the
        peer's caps. The round stays open; a fetch on it finds its keys not pinned."""
        r = self._in.get(req_id)
        if r is not None and r.state is InState.PINNED:
            r.pins = 0

    def keys_held(self) -> int:
        """Keys the driver holds for the peer's open rounds (see the module docstring)."""
        return sum(r.keys_held for r in self._in.values())

    def tombstones(self) -> int:
        return len(self._expired)

    def open_rounds(self) -> list[int]:
        """Producer rounds that still hold state (and maybe pins)."""
        return list(self._in)

    @property
    def activity(self) -> tuple[int, int]:
        """Requests so far, ours and the peer's (each id is used once): a session whose
        activity has not moved and that has none open has not been used meanwhile."""
        return self._next_req_id, self._peer_last_req_id

    @property
    def request_ids_left(self) -> int:
        """Lookups this session may still start: request ids are u64 on the wire and only
        go up on a session (the peer refuses one not above the last), so past ``U64_MAX``
        the session is spent and a new one (from id 1) must take over."""
        return max(U64_MAX - self._next_req_id + 1, 0)

    @property
    def idle(self) -> bool:
        """No request open, ours or the peer's (a round held for a quarantine counts)."""
        return not self._out and not self._in

    def open_requests(self) -> list[int]:
        """Consumer requests without a terminal outcome yet."""
        return list(self._out)

    def out_state(self, req_id: int) -> OutState | None:
        r = self._out.get(req_id)
        return None if r is None else r.state

    def in_state(self, req_id: int) -> InState | None:
        r = self._in.get(req_id)
        if r is None:
            return InState.EXPIRED if req_id in self._expired else None
        return r.state

    def lease_end(self, req_id: int) -> float:
        """When the lease of the round ``req_id`` (ours to serve) ends; -inf for none. A
        fetch keeps its round's deadline: the driver posts no write past it."""
        r = self._in.get(req_id)
        return -math.inf if r is None else r.deadline

    def next_deadline(self) -> float | None:
        """Earliest lease deadline of a pinned round (for the driver's timer)."""
        ds = [r.deadline for r in self._in.values() if r.state is InState.PINNED]
        return min(ds) if ds else None

    # --- output -------------------------------------------------------------------------

    def has_data_to_send(self) -> bool:
        """Whether :meth:`data_to_send` would return anything (no copy, no change)."""
        return bool(self._outbox)

    def bytes_to_send(self) -> int:
        """How many bytes :meth:`data_to_send` would return (no copy, no change)."""
        return self._outbox_bytes

    def data_to_send(self) -> bytes:
        """Every frame that may go on the wire now, coalesced; clears the outbox."""
        batch = self._outbox
        data = b"".join(batch)
        self._outbox = []
        self._outbox_bytes = 0
        self._last_batch, self._last_head_begun = batch, self._head_unsent
        self._head_unsent = False
        return data

    def unsend(self, data: bytes) -> None:
        """Bytes :meth:`data_to_send` returned that did not go out (their send was
        cancelled between two pieces): they go first in the next :meth:`data_to_send`,
        before anything queued since, so the stream stays whole."""
        if not data:
            return
        # ``data`` is the end of the last batch: split it where that batch's frames were,
        # so that only the frame a send began counts as begun (a restart drops the rest).
        batch, begun, parts = self._last_batch, True, [data]
        offset = sum(map(len, batch)) - len(data)  # bytes of the batch that went out
        pos = 0
        for i, frame in enumerate(batch):
            end = pos + len(frame)
            if end > offset:
                begun = offset > pos or (i == 0 and self._last_head_begun)
                parts = [data[: end - offset], *batch[i + 1 :]]
                break
            pos = end
        self._last_batch = []
        self._outbox[:0] = parts
        self._outbox_bytes += len(data)
        self._head_unsent = begun

    def _queue(self, frame: bytes) -> None:
        self._outbox.append(frame)
        self._outbox_bytes += len(frame)

    def _emit(self, msg: Message) -> None:
        """Queue ``msg``, or hold it until it may go out: the handshake at once; pings and
        pongs once the peer's ack is in (the peer takes them once its ack is out); the
        rest once both acks are through (the peer takes requests only then). Nothing
        overtakes what is held."""
        if isinstance(msg, _HANDSHAKE_MSGS) or (
            self._peer_acked and not self._held and (self._ack_sent or isinstance(msg, Ping | Pong))
        ):
            self._queue(encode(msg))
        else:
            self._held.append(msg)

    def _release_held(self) -> None:
        """What waited for the acks goes out, in order, up to the first that still waits."""
        held, self._held = self._held, []
        for i, msg in enumerate(held):
            self._emit(msg)
            if self._held:  # it waits still, and so does everything after it
                self._held += held[i + 1 :]
                return

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            raise LocalProtocolError(
                f"{what} not allowed in state {self.state.value}", peer=self.peer_id
            )

    def _require_open(self, what: str) -> None:
        self._require(self.state in (State.HANDSHAKE, State.READY), what)

    # --- handshake ----------------------------------------------------------------------

    def _hello(self) -> Hello:
        li = self.local
        h = Hello(
            version_major=PROTOCOL_MAJOR,
            version_minor=PROTOCOL_MINOR,
            peer_id=li.peer_id,
            epoch=li.epoch,
            agent_name=li.agent_name,
            agent_metadata=li.agent_metadata,
            base_addr=li.base_addr,
            num_blocks=li.num_blocks,
            block_len=li.block_len,
            fingerprint=li.fingerprint,
            hash_algo=li.hash_algo,
            hash_seed=li.hash_seed,
            nonce=li.nonce,
            max_keys_per_request=li.max_keys_per_request,
            max_key_len=li.max_key_len,
            max_open_requests=li.max_open_requests,
        )
        if li.secret is not None:
            assert self._challenge is not None
            proof = hello_proof(li.secret, h, self._challenge, dialer=li.dialer)
            h = attrs.evolve(h, auth=proof)
        return h

    def _send_hello(self) -> None:
        self._hello_sent = True
        self._emit(self._hello())

    def start(self) -> None:
        """Open the handshake. Must be called once, before anything else is sent.

        Without a secret both sides send their hello at once. With one, the accepting side
        sends a :class:`~p2pkv.wire.Challenge` (its fresh nonce) and keeps its hello back
        until the dialer's hello has proven the secret over that nonce; the dialer sends
        its hello when the challenge arrives."""
        self._require(not self._started and self.state is State.HANDSHAKE, "start")
        self._started = True
        if self.local.secret is None:
            self._send_hello()
        elif not self.local.dialer:
            self._emit(Challenge(nonce=self.local.nonce))

    def registration_succeeded(self) -> Ready | None:
        """The peer's memory is registered with the data plane: send our hello_ack.

        Returns :class:`Ready` if the peer's ack was already in."""
        self._require_open("registration_succeeded")
        self._require(self._registering, "registration_succeeded without a pending hello")
        # The ack must follow our hello on the wire (the peer rejects an ack first).
        self._require(self._hello_sent, "registration_succeeded before our hello")
        assert self.peer is not None
        self._registering = False
        self._ack_sent = True
        auth = None
        if self.local.secret is not None:
            auth = ack_proof(self.local.secret, self.local.peer_id, self.peer.nonce)
        self._emit(HelloAck(peer_id=self.local.peer_id, epoch=self.peer.epoch, auth=auth))
        if self._peer_acked:
            self._release_held()
        return self._maybe_ready()

    def registration_failed(self, reason: str) -> None:
        """Registering the peer failed: reject the handshake (bye, no ack)."""
        self._require_open("registration_failed")
        self._require(self._registering, "registration_failed without a pending hello")
        self._registering = False
        self._close("handshake", f"registration failed: {reason}"[:1000])

    def _check_hello(self, h: Hello) -> str | None:
        li = self.local
        if h.version_major != PROTOCOL_MAJOR:
            return f"protocol version {h.version_major} != {PROTOCOL_MAJOR}"
        if li.secret is not None:
            # Nothing the hello claims is looked at before its proof holds.
            if h.auth is None:
                return "authentication required"
            if len(h.nonce) < MIN_NONCE or h.nonce == li.nonce:
                return "authentication failed: the hello's nonce is not fresh"
            want = hello_proof(li.secret, h, li.nonce, dialer=not li.dialer)
            if not hmac.compare_digest(h.auth, want):
                return "authentication failed"
        elif h.auth is not None:
            return "peer requires authentication; no secret configured here"
        if h.peer_id == li.peer_id:
            return f"peer id {h.peer_id!r} is our own"
        if not h.peer_id:
            return "empty peer id"
        if not h.peer_id.isprintable():
            # Ids reach log lines and NIXL's agent names: a newline forged a log line, a
            # NUL cut the agent's name short.
            return f"peer id {h.peer_id!r} is not printable text"
        if h.agent_name != h.peer_id:
            # A peer's data-plane identity is its peer id: it can never name, register or
            # replace another peer's agent.
            return f"agent name {h.agent_name!r} is not the peer id {h.peer_id!r}"
        # Each side named by its peer id: the reason reaches both ends, and each must
        # tell whose value was whose.
        them, us = f"(of {h.peer_id!r})", f"(of {li.peer_id!r})"
        if h.block_len != li.block_len:
            return f"block length {h.block_len} {them} != {li.block_len} {us}"
        if h.fingerprint != li.fingerprint:
            return f"config fingerprint {h.fingerprint!r} {them} != {li.fingerprint!r} {us}"
        if h.hash_algo != li.hash_algo or h.hash_seed != li.hash_seed:
            return "hash algorithm or seed differs"
        if h.num_blocks == 0 or h.num_blocks > li.max_peer_blocks:
            return f"region of {h.num_blocks} blocks (this node accepts 1..{li.max_peer_blocks})"
        if h.base_addr + h.num_blocks * h.block_len > U64_MAX:
            return "region does not fit the address space"
        if h.max_keys_per_request == 0 or h.max_key_len == 0 or h.max_open_requests == 0:
            return "peer advertises zero request limits"
        return None

    def _on_challenge(self, c: Challenge) -> Event | None:
        li = self.local
        if li.secret is None:
            reason = "peer requires authentication; no secret configured here"
            self._close("handshake", reason)
            raise HandshakeRejected(reason, peer=self.peer_id)
        if not li.dialer or self._challenge is not None or self._hello_sent:
            raise RemoteProtocolError("unexpected challenge")
        if len(c.nonce) < MIN_NONCE or c.nonce == li.nonce:
            raise RemoteProtocolError("challenge nonce is not fresh")
        self._challenge = c.nonce
        self._send_hello()
        return None

    def _on_hello(self, h: Hello) -> Event | None:
        li = self.local
        if li.secret is not None and li.dialer and not self._hello_sent:
            # The accepting side must challenge us first; one that does not cannot
            # prove anything bound to this connection.
            why = "authentication required: the peer sent a hello, not a challenge"
            self._close("handshake", why)
            raise HandshakeRejected(why, peer=h.peer_id)
        if self.peer is not None:
            if h.epoch == self.peer.epoch:
                raise RemoteProtocolError("second hello with the same epoch")
            if h.peer_id != self.peer.peer_id:
                raise RemoteProtocolError("a restarted peer changed its peer id")
        if li.secret is not None and not li.dialer and self._challenge is None:
            self._challenge = h.nonce  # our hello's proof binds the dialer's nonce
        elif li.secret is not None and self.peer is not None and h.nonce != self.peer.nonce:
            raise RemoteProtocolError("a restarted peer changed its nonce on this connection")
        reason = self._check_hello(h)
        if reason is not None:
            self._close("handshake", reason)
            raise HandshakeRejected(reason, peer=h.peer_id)
        restarted = self.peer is not None
        dropped = tuple(self._in)
        failed = tuple(self._out)
        if restarted:
            # A new incarnation knows nothing of the old one's requests or acks.
            self._in.clear()
            self._expired.clear()
            self._expired_dropped = 0
            self._out.clear()
            self._held.clear()
            self._ack_sent = self._peer_acked = self._ready_emitted = False
            self._peer_last_req_id = 0
            self.state = State.HANDSHAKE
            # Nothing for the old incarnation goes out before our new hello, not even
            # answers queued in the same read; the rest of a frame a send began stays, or
            # the stream would break mid-frame.
            keep = self._outbox[:1] if self._head_unsent else []
            self._outbox[:] = keep
            self._outbox_bytes = sum(map(len, keep))
            self._queue(encode(self._hello()))
        elif li.secret is not None and self._started and not self._hello_sent:
            self._send_hello()  # accepting side with a secret: the dialer has proven itself
        self.peer = h
        self._registering = True
        return HelloReceived(h, restarted, dropped, failed)

    def _on_ack(self, a: HelloAck) -> Event | None:
        if self.peer is None or not self._hello_sent:
            raise RemoteProtocolError("hello_ack before hello")
        if self._peer_acked:
            raise RemoteProtocolError("duplicate hello_ack")
        if a.epoch != self.local.epoch or a.peer_id != self.peer.peer_id:
            raise RemoteProtocolError("hello_ack for another epoch or peer")
        if self.local.secret is not None and (
            a.auth is None
            or not hmac.compare_digest(
                a.auth, ack_proof(self.local.secret, a.peer_id, self.local.nonce)
            )
        ):
            self._close("handshake", "authentication failed")
            raise HandshakeRejected("authentication failed", peer=a.peer_id)
        self._peer_acked = True
        self._release_held()
        return self._maybe_ready()

    def _maybe_ready(self) -> Ready | None:
        if self._ack_sent and self._peer_acked and not self._ready_emitted:
            self._ready_emitted = True
            self.state = State.READY
            return Ready()
        return None

    # --- input --------------------------------------------------------------------------

    def discard_input(self) -> None:
        """The session ends: drop the partial frame it was reading (up to a frame's size,
        held otherwise until the socket is closed, after a final flush and linger)."""
        self._decoder.discard()

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self.state in (State.CLOSED, State.ERROR):
            return  # after a bye, further bytes are ignored
        self._decoder.feed(data)

    @property
    def unread(self) -> Message | None:
        """The frame a :meth:`next_event` with ``only`` stopped at: decoded, not acted on
        (the next call starts with it)."""
        return self._unread

    def next_event(
        self, max_silent: int = 0, only: frozenset[type[Any]] | None = None
    ) -> Event | None:
        """The next event from the peer, ``None`` when more bytes are needed.

        ``max_silent`` > 0: also ``None`` after that many frames in a row that made no
        event (pings, an abort of a finished request...), with :attr:`input_pending` set:
        complete frames may be left, and a caller that shares its thread with others lets
        them run before it calls again. Every frame counts in :attr:`frames_received`.

        ``only``: message types this caller may take. The first frame of another type is
        decoded but not acted on: ``None`` with :attr:`input_pending` set, and the next
        call (of any caller) starts with it. So a caller that handles only some events
        (the session's answer lane) never changes the state that the others belong to.

        Raises :class:`RemoteProtocolError` / :class:`HandshakeRejected` on bad input; the
        machine is then closed with a ``bye`` queued.
        """
        self.input_pending = False
        silent = 0
        while self.state in (State.HANDSHAKE, State.READY):
            try:
                msg = self._unread
                if msg is not None:
                    if only is not None and type(msg) not in only:
                        self.input_pending = True
                        return None
                    self._unread = None
                else:
                    msg = self._decoder.next_message()
                    if msg is None:
                        return None
                    self.frames_received += 1
                    if only is not None and type(msg) not in only:
                        self._unread = msg
                        self.input_pending = True
                        return None
                event = self._dispatch(msg)
            except RemoteProtocolError as exc:
                if (
                    isinstance(exc, UndecodedHello)
                    and exc.version_major != PROTOCOL_MAJOR
                    and self.peer is None
                ):
                    # A first hello of another major version may have changed any field
                    # but its version: it is refused by that, as any hello of another
                    # major is (_check_hello). (Later, a restart on this connection into
                    # another major is the peer's protocol error: no caller that reads
                    # only answers, the session's answer lane, ever meets a handshake.)
                    reason = f"protocol version {exc.version_major} != {PROTOCOL_MAJOR}"
                    self._close("handshake", reason)
                    raise HandshakeRejected(reason, peer=exc.claimed_id) from exc
                exc.peer = exc.peer or self.peer_id
                self._fail(str(exc))
                raise
            if event is not None:
                return event
            silent += 1
            if silent == max_silent:
                self.input_pending = True
                return None
        return None

    def lift_frame_limit(self) -> None:
        """The node admitted the peer: frames up to our ``max_frame_size`` from here on.
        Until then no frame over a hello's size (``MAX_HELLO_FRAME``) is read, so that a
        connection the node has not admitted can make it hold little."""
        self._decoder.max_frame_size = min(self.local.max_frame_size, MAX_FRAME_SIZE)

    def _fail(self, reason: str) -> None:
        self._queue(encode(Bye(code="protocol", reason=reason[:1000])))
        self.close_reason = ("protocol", reason)
        self.state = State.ERROR
        self._in.clear()
        self._out.clear()

    def _dispatch(self, msg: Message) -> Event | None:
        if self._peer_acked and self._ack_sent:  # both acks through: the hot ones first
            kind = type(msg)
            if kind is LookupResp:
                return self._on_lookup_resp(msg)  # type: ignore[arg-type]
            if kind is Lookup:
                return self._on_lookup(msg)  # type: ignore[arg-type]
            if kind is Fetch:
                return self._on_fetch(msg)  # type: ignore[arg-type]
            if kind is FetchHits:
                return self._on_fetch_hits(msg)  # type: ignore[arg-type]
            if kind is TransferDone:
                return self._on_transfer_done(msg)  # type: ignore[arg-type]
        if isinstance(msg, Challenge):
            return self._on_challenge(msg)
        if isinstance(msg, Hello):
            return self._on_hello(msg)
        if isinstance(msg, HelloAck):
            return self._on_ack(msg)
        if isinstance(msg, Bye):
            self.state = State.CLOSED
            self.close_reason = (msg.code, msg.reason)
            self._in.clear()
            self._out.clear()
            return ByeReceived(msg.code, msg.reason)
        if not self._ack_sent:
            raise RemoteProtocolError(f"{msg.TAG} before our hello_ack")
        if not self._peer_acked and not isinstance(msg, Ping | Pong):
            # A peer is ready (and so sends requests) only once its own ack is out, so a
            # request before it is a lie. Were it served, every reply to it would be held
            # (nothing but the handshake goes out before the peer's ack) with nothing to
            # bound how many: a peer that never acks could make us hold them for ever.
            raise RemoteProtocolError(f"{msg.TAG} before the peer's hello_ack")
        if isinstance(msg, Lookup):
            return self._on_lookup(msg)
        if isinstance(msg, Fetch):
            return self._on_fetch(msg)
        if isinstance(msg, FetchHits):
            return self._on_fetch_hits(msg)
        if isinstance(msg, Abort):
            return self._on_abort(msg)
        if isinstance(msg, Ping):
            # Held like every other reply until the peer's hello_ack is in: the ping may
            # arrive before it (the peer has our ack, we do not have its ack yet), and a
            # pong on the wire before the peer's ack was sent is a protocol error at the
            # peer. At most one pong is held (the latest): a peer that pings without
            # acking gets no other reply, so nothing else would bound what it makes us keep.
            if not self._peer_acked:
                self._held = [m for m in self._held if not isinstance(m, Pong)]
            self._emit(Pong(nonce=msg.nonce))
            return None
        if isinstance(msg, Pong):
            return PongReceived(msg.nonce)
        if isinstance(msg, LookupResp):
            return self._on_lookup_resp(msg)
        if isinstance(msg, TransferDone):
            return self._on_transfer_done(msg)
        if isinstance(msg, AbortAck):
            return self._on_abort_ack(msg)
        raise RemoteProtocolError(f"unexpected {msg.TAG}")  # pragma: no cover

    def _check_keys(self, keys: list[bytes]) -> None:
        if len(keys) > self.local.max_keys_per_request:
            raise RemoteProtocolError(
                f"{len(keys)} keys in one request (cap {self.local.max_keys_per_request})"
            )
        limit = self.local.max_key_len
        if not key_lengths_ok(keys, limit):  # the decoder saw to the type: bytes only
            raise RemoteProtocolError(f"key longer than {limit} bytes")

    def _on_lookup(self, m: Lookup) -> Event:
        if m.req_id <= self._peer_last_req_id:
            raise RemoteProtocolError(f"request id {m.req_id} reused")
        if len(self._in) >= self.local.max_open_requests:
            raise RemoteProtocolError(f"more than {self.local.max_open_requests} open requests")
        self._check_keys(m.keys)
        self._peer_last_req_id = m.req_id
        self._in[m.req_id] = _InReq(InState.ANSWERING, len(m.keys))
        return LookupRequested(m.req_id, m.keys)

    def _was_expired(self, req_id: int) -> bool:
        """The round's lease ran out (its tombstone is kept, or was dropped)."""
        return req_id in self._expired or (
            req_id <= self._expired_dropped and req_id not in self._in
        )

    def _on_fetch(self, m: Fetch) -> Event | None:
        r = self._fetched_round(m.req_id, m.TAG)
        self._check_keys(m.keys)
        self._check_slots(m.slots)
        return self._begin_write(m.req_id, r, m.keys, m.slots)

    def _on_fetch_hits(self, m: FetchHits) -> Event | None:
        """A fetch of every hit of a round: as :meth:`_on_fetch`, with the slots counted
        against the hits of our answer instead of keys checked."""
        r = self._fetched_round(m.req_id, m.TAG)
        if len(m.slots) > self.local.max_keys_per_request:
            raise RemoteProtocolError(
                f"{len(m.slots)} slots in one request (cap {self.local.max_keys_per_request})"
            )
        self._check_slots(m.slots)
        if r is not None and len(m.slots) != r.nhits:
            raise RemoteProtocolError(
                f"fetch_hits of {len(m.slots)} slots for a round of {r.nhits} hits"
            )
        return self._begin_write(m.req_id, r, None, m.slots)

    def _fetched_round(self, req_id: int, tag: str) -> _InReq | None:
        """The pinned round a fetch names; None if its lease ran out (a tombstone, or one
        dropped). Any other round, or none, is the peer's protocol error."""
        r = self._in.get(req_id)
        if self._was_expired(req_id):
            return None
        if r is None or r.state is not InState.PINNED:
            raise RemoteProtocolError(f"{tag} for request {req_id} with no open lookup")
        return r

    def _begin_write(
        self, req_id: int, r: _InReq | None, keys: list[bytes] | None, slots: list[int]
    ) -> Event | None:
        """A checked fetch of ``len(slots)`` keys: answered here if the round's lease ran
        out (``r`` None: nothing is pinned, every key ``LEASE_EXPIRED``, the round ends),
        an empty one closes the round, anything else is written by the driver."""
        n = len(slots)
        if r is None:
            self._expired.pop(req_id, None)
            if n:
                lease_expired = int(Outcome.LEASE_EXPIRED)
                self._emit(TransferDone(req_id=req_id, outcomes=[lease_expired] * n))
            return None
        if not n:
            del self._in[req_id]
            return RoundClosed(req_id)
        r.state = InState.WRITING
        r.nfetch = n
        return FetchRequested(req_id, keys, slots)

    def _check_slots(self, slots: list[int]) -> None:
        """A fetch's destination slots: inside the peer's region, each named once."""
        assert self.peer is not None
        n = self.peer.num_blocks
        if slots and max(slots) >= n:
            raise RemoteProtocolError(f"destination slot outside the peer's {n} blocks")
        if len(set(slots)) != len(slots):
            raise RemoteProtocolError("duplicate destination slot in one fetch")

    def _on_abort(self, m: Abort) -> Event | None:
        r = self._in.get(m.req_id)
        if r is None:
            if m.req_id > self._peer_last_req_id:
                raise RemoteProtocolError(f"abort for unknown request {m.req_id}")
            self._expired.pop(m.req_id, None)
            self._emit(AbortAck(req_id=m.req_id))  # finished or expired: ack at once
            return None
        if r.state is InState.ABORTING:
            return None
        r.state = InState.ABORTING
        return AbortRequested(m.req_id)

    def _on_lookup_resp(self, m: LookupResp) -> Event | None:
        r = self._out.get(m.req_id)
        if r is None or OutState.LOOKUP_SENT not in (r.state, r.aborted_from):
            raise RemoteProtocolError(f"lookup_resp for request {m.req_id} not awaiting one")
        if len(m.hits) != r.nkeys:
            raise RemoteProtocolError("lookup_resp: hit count differs from key count")
        if r.state is OutState.ABORT_SENT:
            r.aborted_from = OutState.OPEN  # a second lookup_resp is an error
            return None  # crossed our abort; the abort_ack ends it
        r.state = OutState.OPEN
        r.nhits = m.hits.count(True)
        return LookupAnswered(m.req_id, m.hits)

    def _on_transfer_done(self, m: TransferDone) -> Event | None:
        r = self._out.get(m.req_id)
        if r is None or OutState.FETCH_SENT not in (r.state, r.aborted_from):
            raise RemoteProtocolError(f"transfer_done for request {m.req_id} not fetching")
        if len(m.outcomes) != r.nfetch:
            raise RemoteProtocolError("transfer_done: outcome count differs from fetch")
        if r.state is OutState.ABORT_SENT:
            r.aborted_from = OutState.OPEN  # a second transfer_done is an error
            return None
        del self._out[m.req_id]
        return TransferCompleted(m.req_id, m.outcomes, m.checksums)

    def _on_abort_ack(self, m: AbortAck) -> Event:
        r = self._out.get(m.req_id)
        if r is None or r.state is not OutState.ABORT_SENT:
            raise RemoteProtocolError(f"abort_ack for request {m.req_id} not aborting")
        del self._out[m.req_id]
        return AbortAcknowledged(m.req_id)

    # --- consumer calls -------------------------------------------------------------------

    def request_limits(self) -> tuple[int, int]:
        """(keys per request, bytes per key) our requests must keep to: our own limits,
        and, once its hello is in, the ones the peer advertised (it enforces those)."""
        li, peer = self.local, self.peer
        max_keys, max_key_len = li.max_keys_per_request, li.max_key_len
        if peer is not None:
            max_keys = min(max_keys, peer.max_keys_per_request)
            max_key_len = min(max_key_len, peer.max_key_len)
        return max_keys, max_key_len

    def open_requests_limit(self) -> int:
        """How many of our requests may be open at once: our own limit and, once its
        hello is in, the one the peer advertised (it closes the session beyond that)."""
        limit, peer = self.local.max_open_requests, self.peer
        if peer is not None and peer.max_open_requests is not None:
            limit = min(limit, peer.max_open_requests)
        return limit

    def _check_own_keys(self, keys: Sequence[bytes], op: str) -> None:
        """Our own request, before anything is sent: the peer would close the session."""
        max_keys, max_key_len = self.request_limits()
        max_keys, max_key_len = min(max_keys, MAX_KEYS), min(max_key_len, MAX_KEY_LEN)
        if len(keys) > max_keys:
            raise LocalProtocolError(
                f"{len(keys)} keys in one request (cap {max_keys})", peer=self.peer_id, op=op
            )
        if not keys_ok(keys, max_key_len):
            raise LocalProtocolError(
                f"every key must be bytes of 1..{max_key_len}", peer=self.peer_id, op=op
            )

    def send_lookup(self, keys: Sequence[bytes], *, checked: bool = False) -> int:
        """Start a lookup round; returns its request id. ``checked``: the caller has just
        checked ``keys`` against :meth:`request_limits` (and the wire's), so they are not
        walked again."""
        self._require_open("send_lookup")
        if len(self._out) >= self.local.max_open_requests:  # the session keeps to the
            # peer's limit too (open_requests_limit): it counts a round open until it has
            # closed it, never less long than the peer does
            raise CapacityExceeded("too many open requests", peer=self.peer_id, op="lookup")
        if self._next_req_id > U64_MAX:
            raise LocalProtocolError(
                "request ids exhausted: the session must end", peer=self.peer_id, op="lookup"
            )
        if not checked:
            self._check_own_keys(keys, "lookup")
        # Checked just above against limits within the wire's: no second validation.
        msg = trusted[Lookup](req_id=self._next_req_id, keys=list(keys))
        self._next_req_id += 1
        self._out[msg.req_id] = _OutReq(OutState.LOOKUP_SENT, len(msg.keys))
        self._emit(msg)
        return msg.req_id

    def send_fetch(
        self, req_id: int, keys: Sequence[bytes], slots: Sequence[int], *, checked: bool = False
    ) -> None:
        """Fetch ``keys`` of an answered lookup into our ``slots``. An empty fetch closes the
        round (the producer releases its pins) and is the request's terminal outcome.
        ``checked``: the caller has just checked ``keys`` against :meth:`request_limits`,
        and ``slots`` are distinct ``int`` slots of our region, so neither is walked again
        (their lengths still are)."""
        self._require_open("send_fetch")
        r = self._out.get(req_id)
        self._require(
            r is not None and r.state is OutState.OPEN, f"send_fetch for request {req_id}"
        )
        assert r is not None
        if not checked:
            self._check_own_keys(keys, "fetch")
        if len(slots) != len(keys):
            raise LocalProtocolError("fetch: keys and slots differ in length")
        slots = list(slots)
        if not checked:
            self._check_own_slots(slots)
        # Keys and slots checked just above, within the wire's limits: no second validation.
        msg = trusted[Fetch](req_id=req_id, keys=list(keys), slots=slots)
        self._emit(msg)
        if not msg.keys:
            del self._out[req_id]
        else:
            r.state = OutState.FETCH_SENT
            r.nfetch = len(msg.keys)

    def _check_own_slots(self, slots: list[int]) -> None:
        """Our fetch's destination slots, before anything is sent: exactly ints, inside our
        region, each named once (the peer rejects anything else as a protocol error)."""
        if slots and not (
            list(map(type, slots)).count(int) == len(slots)  # exactly int: no bool
            and min(slots) >= 0
            and max(slots) < self.local.num_blocks
        ):
            raise LocalProtocolError("fetch slot outside our region")
        if len(set(slots)) != len(slots):
            raise LocalProtocolError("duplicate destination slot in one fetch")

    @property
    def peer_takes_fetch_hits(self) -> bool:
        """Whether the peer understands ``fetch_hits`` (it speaks protocol 1.2 or later)."""
        peer = self.peer
        return peer is not None and (peer.version_major, peer.version_minor) >= (1, 2)

    def send_fetch_hits(self, req_id: int, slots: Sequence[int], *, checked: bool = False) -> None:
        """Fetch every hit of an answered lookup, in its order, into our ``slots`` (as many
        as the answer's hits; none would close the round: use :meth:`send_fetch` with no
        keys for that). Only to a peer that takes it (:attr:`peer_takes_fetch_hits`).
        ``checked``: ``slots`` are distinct ``int`` slots of our region (not walked again)."""
        self._require_open("send_fetch_hits")
        r = self._out.get(req_id)
        self._require(
            r is not None and r.state is OutState.OPEN, f"send_fetch_hits for request {req_id}"
        )
        assert r is not None
        if not self.peer_takes_fetch_hits:
            raise LocalProtocolError("the peer does not take fetch_hits", peer=self.peer_id)
        slots = list(slots)
        if not slots or len(slots) != r.nhits:
            raise LocalProtocolError(
                f"fetch_hits of {len(slots)} slots for a round of {r.nhits} hits",
                peer=self.peer_id,
            )
        if not checked:
            self._check_own_slots(slots)
        self._emit(trusted[FetchHits](req_id=req_id, slots=slots))
        r.state = OutState.FETCH_SENT
        r.nfetch = len(slots)

    def send_abort(self, req_id: int) -> None:
        """Give up on a request; its terminal outcome is the peer's abort_ack."""
        self._require_open("send_abort")
        r = self._out.get(req_id)
        self._require(
            r is not None and r.state is not OutState.ABORT_SENT, f"send_abort for request {req_id}"
        )
        assert r is not None
        r.aborted_from = r.state
        r.state = OutState.ABORT_SENT
        self._emit(Abort(req_id=req_id))

    def send_ping(self) -> int:
        self._require_open("send_ping")
        # Echoed back, never ordered: past U64_MAX (the wire's bound) it wraps to 1.
        self._ping_nonce = self._ping_nonce % U64_MAX + 1
        self._emit(Ping(nonce=self._ping_nonce))
        return self._ping_nonce

    # --- producer calls -------------------------------------------------------------------

    def send_lookup_resp(
        self,
        req_id: int,
        hits: Sequence[bool],
        now: float,
        lease: float,
        *,
        checked: bool = False,
    ) -> None:
        """Answer a lookup; the hits are pinned by the driver until the round ends.
        ``checked``: ``hits`` is a list of bools the caller built and gives away (not
        copied, its types not walked again); its length is checked all the same."""
        self._require_open("send_lookup_resp")
        r = self._in.get(req_id)
        self._require(
            r is not None and r.state is InState.ANSWERING, f"send_lookup_resp for request {req_id}"
        )
        assert r is not None
        if not checked or type(hits) is not list:
            hits = list(hits)
            if list(map(type, hits)).count(bool) != len(hits):
                raise LocalProtocolError("hits must be bools")
        if len(hits) != r.nkeys:
            raise LocalProtocolError("hit count differs from key count")
        # Checked just above (the request id is the peer's, already checked): the
        # message is built without running its validators again.
        msg = trusted[LookupResp](req_id=req_id, hits=hits)
        r.state = InState.PINNED
        r.pins = r.nhits = hits.count(True)
        r.deadline = now + lease
        self._emit(msg)

    def expire(self, now: float) -> list[int]:
        """Rounds whose lease ran out: the driver releases their pins. Each leaves only a
        tombstone (see the module docstring)."""
        done = [i for i, r in self._in.items() if r.state is InState.PINNED and r.deadline <= now]
        for i in done:
            del self._in[i]
            self._expired[i] = None
        while len(self._expired) > self.local.max_open_requests:
            oldest = next(iter(self._expired))
            del self._expired[oldest]
            self._expired_dropped = max(self._expired_dropped, oldest)
        return done

    def send_transfer_done(
        self,
        req_id: int,
        outcomes: Sequence[int],
        checksums: Sequence[int] | None = None,
        *,
        checked: bool = False,
    ) -> None:
        """Report a fetch's per-key outcomes: only once every write has settled.
        ``checked``: ``outcomes`` is a list of Outcome codes (plain ints) the caller built
        and gives away (not copied, not walked again); its length is checked all the same."""
        self._require_open("send_transfer_done")
        r = self._in.get(req_id)
        self._require(
            r is not None and r.state is InState.WRITING, f"send_transfer_done for request {req_id}"
        )
        assert r is not None
        if len(outcomes) != r.nfetch:  # the peer rejects this as a protocol error
            raise LocalProtocolError(
                f"{len(outcomes)} outcomes for a fetch of {r.nfetch} keys", peer=self.peer_id
            )
        if not checked or type(outcomes) is not list:
            outcomes = list(outcomes)
            if not _OUTCOME_CODES.issuperset(outcomes) or bool in map(type, outcomes):
                raise LocalProtocolError("outcomes must be Outcome codes", peer=self.peer_id)
        if checksums is None:
            msg = trusted[TransferDone](req_id=req_id, outcomes=outcomes, checksums=None)
        else:  # the rare case: validated in full
            msg = TransferDone(req_id=req_id, outcomes=outcomes, checksums=list(checksums))
        del self._in[req_id]
        self._emit(msg)

    def send_abort_ack(self, req_id: int) -> None:
        """The round's writes are drained and its pins released."""
        self._require_open("send_abort_ack")
        r = self._in.get(req_id)
        self._require(
            r is not None and r.state is InState.ABORTING, f"send_abort_ack for request {req_id}"
        )
        del self._in[req_id]
        self._emit(AbortAck(req_id=req_id))

    # --- closing --------------------------------------------------------------------------

    def send_bye(self, code: str, reason: str) -> None:
        """Close gracefully. Idempotent once closed (a second bye is not sent)."""
        if self.state in (State.CLOSED, State.ERROR):
            return
        self._close(code, reason)

    def _close(self, code: str, reason: str) -> None:
        self._queue(encode(Bye(code=code[:64], reason=reason[:1000])))
        self.close_reason = (code, reason)
        self.state = State.CLOSED
        self._in.clear()
        self._out.clear()
        self._held.clear()
