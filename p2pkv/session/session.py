"""The Trio driver around one :class:`~p2pkv.session.protocol.SessionProtocol`.

Theory of operation
-------------------
One :class:`PeerSession` per TCP connection, run as one task under the node's supervisor.
Inside it: a reader task (bytes in, events out, handlers dispatched from a table), a
keepalive task (heartbeats and the idle deadline), a lease task (producer pin leases and
consumer rounds nobody fetched), one task per producer write, and the registration wait.
Sends go through one ``StrictFIFOLock``; a send that fails or is cancelled breaks the
connection for good (its state on the wire is unknown). On a TLS connection
(:mod:`p2pkv.tls`) the session first finishes the TLS handshake, under its own
``handshake_timeout``, before its hello goes out, and holds the peer's hello to the peer's
certificate before the node sees the hello.

The registration barrier: the peer's hello only *submits* a registration job to the
node's :class:`~p2pkv.registrar.Registrar`; our ``hello_ack`` goes out when the job
publishes. The protocol refuses any request that arrives before our ack, so no write
ever targets a peer we have not finished registering. When the session ends, in its
``finally`` and shielded: producer writes are drained (or their source pins held for the
quarantine time if the data plane will not settle), pins released, consumer waiters
failed, the registration retired (released if it was ours, or released by the registrar
when it finishes later), a ``bye`` sent if the stream still works, and the stream closed.
Nothing a session owns outlives it.

Incarnations: each hello the peer sends (its first, and one per restart with a new epoch
on the same connection) opens an :class:`Incarnation`: the peer's hello, the registration
job and its result, the ``ready`` event and one cancel scope for the registration wait and
the handshake deadline. A new hello closes the previous incarnation's scope and tears its
state down (writes drained, pins released, registration retired) before the new one
registers; nothing of one incarnation is ever swapped into another.

Liveness: only complete frames count. A peer that trickles bytes without ever finishing a
frame is idle, and is closed at the idle deadline.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
from collections import deque
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .. import tls
from ..errors import (
    DuplicateSession,
    HandshakeRejected,
    P2PKVError,
    P2PKVTimeout,
    RemoteProtocolError,
    SessionClosed,
    printable,
)
from ..transport.base import RegionLayout, RemotePeer
from ..wire import AbortAck, Bye, Hello, LookupResp, Pong, TransferDone
from .consumer import (
    ACKS_OVERDUE,
    ConsumerSide,
    FetchResult,
    LookupRound,
    RequestLimits,
    _Claim,
    _Pending,
    _Round,
)
from .producer import HeldRound, HostAsk, ProducerSide, WriteScope
from .protocol import (
    AbortAcknowledged,
    AbortRequested,
    ByeReceived,
    FetchRequested,
    HelloReceived,
    LookupAnswered,
    LookupRequested,
    PongReceived,
    Ready,
    RoundClosed,
    SessionProtocol,
    TransferCompleted,
)
from .slots import RequestSlots
from .turns import Turn

if TYPE_CHECKING:
    from ..node import Node
    from ..registrar import RegistrationJob

__all__ = ["FetchResult", "LookupRound", "PeerSession"]

log = logging.getLogger("p2pkv.session")
RECEIVE_SIZE = 1 << 16
LINGER = 0.25  # seconds we wait for the peer to see our bye before closing
# Bytes that may wait behind a send in progress before a flush waits for it too (and the
# reader stops reading): a few answers' worth, far more than a live peer leaves queued.
OUTBOX_CAP = 4 << 20
TLS_PIECE = 1 << 16  # a TLS send's piece between two moves of its headway deadline
# The messages the answer lane's task takes from the peer (see PeerSession._wait_in_lane):
# answers to our requests and pongs. Anything else stays undecided for the reader.
LANE_MESSAGES: frozenset[type[Any]] = frozenset({LookupResp, TransferDone, AbortAck, Pong})


@attrs.define(eq=False)
class Incarnation:
    """One handshake of the peer (see the module docstring): everything that belongs to
    it lives here, under one cancel scope."""

    hello: Hello
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ready: trio.Event = attrs.field(factory=trio.Event)
    exited: trio.Event = attrs.field(factory=trio.Event)  # its task has ended
    job: RegistrationJob | None = None
    remote: RemotePeer | None = None


class PeerSession(ProducerSide, ConsumerSide):
    # False: every request's task waits on its event (``bench/control_plane.py --ab-lane``
    # sets it on one of two consumers, to pair the two ways sample by sample).
    answer_lane = True

    def __init__(
        self,
        node: Node,
        stream: trio.abc.Stream,
        *,
        address: tuple[str, int] | None = None,
        dialer: bool = False,
    ) -> None:
        self.node = node
        self.cfg = node.config
        self.stream = stream
        self.address = address
        self.dialer = dialer
        self.proto = SessionProtocol(node.local_info(dialer=dialer))
        self.token = object()  # pin owner of this session's rounds
        self.incarnation: Incarnation | None = None
        self._retiring: list[Incarnation] = []  # replaced, teardown not finished yet
        self._not_ready = trio.Event()  # never set: ``ready`` before any hello
        self.handshaken = trio.Event()  # set once, when the first incarnation is ready
        self.finished = trio.Event()
        self._rx = trio.lowlevel.ParkingLot()  # woken on every complete frame received
        # Lookups waiting on the host (a pin source) for their pins: a probe's time runs
        # from the last one's end (see probe).
        self.host_waits = 0
        self.close_reason: str | None = None
        self.error: BaseException | None = None
        self.inflight_bytes = 0
        self.posts_refused = 0  # the data plane refused our writes to the peer (logged once)
        self._cancel = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._requeued = False  # a cancelled send put its rest back in the outbox
        self._send_lock = trio.StrictFIFOLock()
        self._send_broken = False
        self._raw: socket.socket | None = None  # a duplicate of a plain stream's socket
        # The answer lane (see _wait_in_lane): the reader's and the lane's own duplicates.
        self._rsock: socket.socket | None = None
        self._lane_sock: socket.socket | None = None
        self._lane_p: _Pending | None = None  # the request whose task waits in the lane
        self._lane_parked = False  # that task waits for the socket now
        self._lane_reads = 0  # receives the lane's task made
        self._reader_idle = False  # the reader waits for bytes, nothing of a turn half done
        self._lane_left = False  # the lane's task left frames for the reader
        # Set once the reader has acted on a bye or hello the lane's task left (see
        # _wait_in_lane); None while no task waits for that.
        self._lane_handed: trio.Event | None = None
        self._requests = RequestSlots(self.cfg.max_open_requests)  # resized by each hello
        self._pending: dict[int, _Pending] = {}
        self._share_waits: set[trio.CancelScope] = set()
        self._rounds: dict[int, _Round] = {}
        self._claims: list[_Claim] = []  # our fetches running: the keys each brings in
        self._claim_index: dict[bytes, _Claim] | None = None  # see ConsumerSide._claimed
        self._limits_cache: tuple[object, RequestLimits] | None = None  # (hello, limits)
        self._pinned: dict[int, HeldRound] = {}  # producer round -> what it holds
        self._host_asks: dict[int, HostAsk] = {}  # producer round -> its wait on the host
        self._host_room = 0  # pins the lookups waiting on the host may still take
        self._host_queue: deque[HostAsk] = deque()  # lookups waiting for room (_ask_host)
        self._writes: dict[int, WriteScope] = {}
        self._write_done: dict[int, trio.Event] = {}
        self._last_rx = trio.current_time()
        self._quiet: trio.CancelScope | None = None  # the keepalive's sleep, while it sleeps
        self._quiet_after = 0.0  # how long a peer must be quiet before the keepalive acts
        self._wake_lease = trio.Event()
        self._timer_at = -math.inf  # the lease timer's wake-up time (not started: any)
        self._handlers: dict[type[Any], Any] = {
            HelloReceived: self._on_hello,
            Ready: self._on_ready,
            FetchRequested: self._on_fetch,
            RoundClosed: self._on_round_closed,
            AbortRequested: self._on_abort,
            LookupAnswered: self._on_answer,
            TransferCompleted: self._on_transfer_done,
            AbortAcknowledged: self._on_abort_ack,
            PongReceived: lambda ev: None,
            ByeReceived: self._on_bye,
        }

    # --- identity -----------------------------------------------------------------------

    @property
    def peer_id(self) -> str | None:
        return self.proto.peer_id

    @property
    def who(self) -> str:
        """The peer for a log line: its id once its hello is in, else its address."""
        if self.peer_id is not None:
            return self.peer_id
        if not self.address:
            return "a peer"
        host, port = self.address[:2]
        return f"the peer at {host}:{port}"

    @property
    def alive(self) -> bool:
        return not self.finished.is_set() and self.close_reason is None

    @property
    def ready(self) -> trio.Event:
        """The current incarnation's readiness (both acks through)."""
        inc = self.incarnation
        return self._not_ready if inc is None else inc.ready

    @property
    def job(self) -> RegistrationJob | None:
        inc = self.incarnation
        return None if inc is None else inc.job

    @property
    def remote(self) -> RemotePeer | None:
        inc = self.incarnation
        return None if inc is None else inc.remote

    @remote.setter
    def remote(self, peer: RemotePeer | None) -> None:
        assert self.incarnation is not None
        self.incarnation.remote = peer

    async def probe(self, within: float) -> bool:
        """Is the peer alive on this session? A ping goes out and any complete frame that
        arrives within ``within`` seconds counts as an answer."""
        if not self.alive or not self.proto.ready:
            return False
        before = self.proto.frames_received
        self.proto.send_ping()
        await self._flush(background=True)
        deadline = trio.current_time() + within
        while self.alive and self.proto.frames_received == before:
            if self.host_waits:
                # A lookup of the peer's waits for the host's pins (bounded by the pin
                # source): the peer's quiet runs from the wait's end, as when the reader
                # itself waited and an impostor could otherwise close a live session
                # whose host took longer than probe_timeout to pin (conservative now:
                # the reader decodes meanwhile). The wait's end wakes us (host_wait_over).
                await self._rx.park()
                deadline = trio.current_time() + within
                continue
            if trio.current_time() >= deadline:
                return False
            with trio.move_on_at(deadline):
                await self._rx.park()
        return self.alive

    def unused_since(self, activity: tuple[int, int]) -> bool:
        """No request made since ``proto.activity`` read ``activity``, none open either
        way, no round pinned or written, no fetch of ours running (one waiting for landing
        room has no request open)."""
        proto = self.proto
        busy = self._pinned or self._writes or self._claims
        return proto.activity == activity and proto.idle and not busy

    def host_wait_over(self) -> None:
        """The reader's wait for the host's pins ended (see :meth:`probe`)."""
        self.host_waits -= 1
        if self._rx:
            self._rx.unpark_all()

    def __repr__(self) -> str:
        return f"<PeerSession peer={self.peer_id} ready={self.ready.is_set()}>"

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        """The session's task: returns when the session is over, never raises Exception
        for the peer's faults (they end up in ``self.error``)."""
        try:
            with self._cancel:
                # Closed as the TLS handshake's wait returned (the cancel came too late):
                # the protocol is closed, and opening its handshake would raise.
                if not await self._start_tls() or not self.alive:
                    return
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self.proto.start()
                    await self._flush()
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._keepalive)
                    nursery.start_soon(self._lease_timer)
                    nursery.start_soon(self._handshake_deadline)
        finally:
            self._rx.unpark_all()
            await self._cleanup()

    async def _start_tls(self) -> bool:
        """On a TLS stream, finish the TLS handshake before our hello goes out (its own
        ``handshake_timeout``). False if it failed: the session is then over."""
        try:
            await tls.handshake(self.stream, self.cfg.handshake_timeout)
        except P2PKVError as exc:
            self.node.connection_warning("TLS handshake with %s failed: %s", self.address, exc)
            self._send_broken = True
            self._fail(exc, exc.message, "handshake")
            return False
        return True

    def close(self, reason: str, code: str = "shutdown") -> None:
        """Begin closing (sync, idempotent): bye queued, tasks cancelled, cleanup follows."""
        if self.close_reason is None:
            self.close_reason = reason
        self.proto.send_bye(code, reason)
        self._cancel.cancel()

    async def aclose(self, reason: str = "closed") -> None:
        self.close(reason)
        with trio.move_on_after(self.cfg.close_timeout):
            await self.finished.wait()

    def _fail(self, exc: BaseException, reason: str, code: str = "protocol") -> None:
        if self.error is None:
            self.error = exc
        self.close(reason, code)

    async def _cleanup(self) -> None:
        try:
            await self._close_down()
        finally:
            # Our duplicates of the descriptor, not the stream's: each forgets its epoll
            # registration (and wakes a waiter, if one were left) before it closes.
            for dup in (self._raw, self._rsock, self._lane_sock):
                if dup is not None:
                    trio.lowlevel.notify_closing(dup)
                    dup.close()
            self._raw = self._rsock = self._lane_sock = None

    async def _close_down(self) -> None:
        with trio.CancelScope(shield=True):
            # Not alive from here (ended by a cancel from outside, nothing had closed it):
            # a task woken below must not start a request on it.
            reason = self.close_reason = self.close_reason or "session ended"
            # A stranger turned away is no longer counted (max_peers of them at most): the
            # partial frame it sent must not outlive that through the flush and linger
            # below, or max_peers strangers could hold ~60 MiB against a ~5 MiB bound.
            self.proto.discard_input()
            if self._lane_handed is not None:
                self._lane_handed.set()  # the reader will not act on it now: we end
            for p in self._pending.values():
                if p.error is None and p.result is None:
                    p.error = SessionClosed(reason, peer=self.peer_id)
                self._wake_waiter(p)
            self._requests.end()  # and those that wait for a request slot
            for cs in list(self._share_waits):
                cs.cancel()
            for req in list(self._pinned):
                self._release_round(req)
            for inc in [*self._retiring, self.incarnation]:
                if inc is not None and inc.job is not None:
                    await self.node.registrar.release(self.node.registrar.retire(inc.job))
                    inc.remote = None
            if not self._send_broken:
                with trio.move_on_after(min(1.0, self.cfg.close_timeout)):
                    await self._flush(final=True)
                    await self._linger()
            with trio.move_on_after(min(1.0, self.cfg.close_timeout)) as cs:
                await self.stream.aclose()
            if cs.cancelled_caught:
                log.warning("closing the stream of %s timed out", self.peer_id)
            self.finished.set()

    # --- I/O ----------------------------------------------------------------------------

    async def _linger(self) -> None:
        """Half-close and discard what the peer still sends, briefly: closing a socket
        with unread bytes resets the connection, which can destroy our bye in flight."""
        try:
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                await self.stream.send_eof()  # TLS cannot: the peer's close ends the drain
            with trio.move_on_after(LINGER):
                while await self.stream.receive_some(RECEIVE_SIZE):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass

    async def _flush(
        self,
        *,
        final: bool = False,
        drain: bool = False,
        background: bool = False,
        until: float = math.inf,
    ) -> None:
        """Send what the protocol has queued. Once closing, only the shielded final flush
        sends: a send cut by cancellation would leave the stream undefined (and lose the
        bye), so nothing is taken from the protocol that might not go out whole.

        With nothing queued it returns at once, without a checkpoint: a flush is called
        after every event and most have nothing to send, and each checkpoint is a trip
        through the scheduler. What is queued later is sent by whoever queues it.

        Only a task of the session's own (``drain``) or the close's final flush ever waits
        for a full socket. A caller whose bytes the kernel will not take at once puts the
        rest back at the front of the outbox and leaves it to a drain task; a flush that
        finds the lock taken leaves its frames to the task sending, which hands what was
        queued meanwhile to a drain task too. So the reader goes on reading while the socket
        is full, two nodes whose big frames to each other fill both sockets at once each
        drain the other's instead of waiting for ever (or, with the send deadline, dropping
        each other), the keepalive, the lease timer and a probe never wait for the socket,
        and no caller's deadline can cut a send mid-frame. Only past ``OUTBOX_CAP`` bytes
        queued does a caller wait for the socket itself: that is the backpressure that
        makes the reader stop reading a peer that sends requests and does not read their
        answers. ``background``: the caller is a task of the session's own that keeps
        time or liveness (the keepalive, the lease timer, a probe, the registration): it
        never waits for the socket, past the cap or not, or the deadlines it keeps would
        wait for a peer that reads nothing. Over TLS, where ``_send_now`` takes nothing,
        every flush goes through a drain task (one more trip through the scheduler per
        send).

        ``until``: the caller's own deadline (a lookup's), which its wait for the socket
        past the cap does not outlast: at ``until`` it stops waiting for the send lock and
        returns, its frames left queued for the task sending. On a plain TCP stream its
        own send is cut then too (its rest goes back to the front of the outbox for a
        drain task, as :meth:`_send_rest` does on any cancel); over TLS a send once begun
        is not cut (that would end the session). No scope is entered on the usual path."""
        if not final and not self.proto.has_data_to_send():
            return
        lock = self._send_lock
        # A free lock is taken without the scheduler trip of ``acquire`` (the send yields
        # anyway); a cancelled caller still raises here, before anything is taken.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            if background or (not final and self.proto.bytes_to_send() <= OUTBOX_CAP):
                return  # the sender sends it once its own send is through
            if until < math.inf:
                with trio.move_on_at(until):
                    await lock.acquire()
                if lock.statistics().owner is not trio.lowlevel.current_task():
                    return  # past the caller's deadline: the task sending sends its frames
            else:
                await lock.acquire()
            drain = True  # past the cap: this caller waits for the socket itself
        try:
            while not (self._send_broken or (self._cancel.cancel_called and not final)):
                data = self.proto.data_to_send()
                if not data:
                    return
                try:
                    sent = self._send_now(data)
                    if sent < len(data):
                        rest = memoryview(data)[sent:]
                        if not (final or drain) and (
                            background or len(rest) + self.proto.bytes_to_send() <= OUTBOX_CAP
                        ):
                            # The socket is full: a task of the session's own waits for
                            # it, and this caller (the reader, a lookup) goes on.
                            self.proto.unsend(bytes(rest))
                            self._drain_soon()
                            return
                        # Frames queued while this waits go out in the next pass.
                        if until < math.inf and self._raw is not None:
                            with trio.move_on_at(until) as cut:
                                await self._send_rest(rest)
                            if cut.cancelled_caught:  # its rest is back in the outbox
                                self._requeued = False
                                return
                        else:
                            await self._send_rest(rest)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._send_broken = True
                    why = tls.describe_loss(self.stream, exc, heard=self._heard())
                    self._fail(exc, f"connection lost while sending: {why}", "transport")
                except BaseException as exc:
                    if isinstance(exc, trio.Cancelled) and self._requeued:
                        self._requeued = False  # the rest waits in the outbox: stream whole
                        raise
                    # A send cut otherwise (TLS) leaves the stream undefined: nothing more
                    # may go out on it, so the session cannot go on either.
                    self._send_broken = True
                    self.close("a send was cut off mid-frame", "transport")
                    raise
                if not self.proto.has_data_to_send():
                    return  # the usual case: nothing was queued while this sent
                if not (final or drain):
                    # Frames other tasks queued while this one sent: a task of the
                    # session's own sends them, so that a caller (a lookup, a write task)
                    # is not kept sending others' frames while the peer reads slowly.
                    self._drain_soon()
                    return
        finally:
            lock.release()

    def _drain_soon(self) -> None:
        """A flush in the session's own nursery sends what is queued; if the session is
        closing (its nursery takes no more tasks), the close's final flush does."""
        if self._nursery is not None:
            with contextlib.suppress(RuntimeError):
                self._nursery.start_soon(functools.partial(self._flush, drain=True))

    async def _send_rest(self, rest: memoryview) -> None:
        """What the kernel would not take at once; the session fails if the kernel takes
        none of it for ``idle_timeout``.

        A peer that keeps the connection open but stops reading would otherwise hold this
        send, and with it the send lock, for ever, with its rounds' pins. The deadline is
        for headway: each send the kernel takes part of moves it on, so a peer whose side
        keeps making room for our bytes, however slowly, keeps its session. On a plain TCP
        stream that headway counts as hearing from the peer, as its frames do: we are here
        only once its side had no room, and the kernel takes more only as the peer
        acknowledges room for it. A TLS stream's ``send_all`` reports no headway and is
        entered for every send, so there the rest goes in 64 KiB pieces with the deadline
        moved after each, and nothing counts as hearing from the peer. The scope is entered
        only here, off the usual path where the kernel takes everything in
        :meth:`_send_now`.

        Cancelled between two pieces on a plain TCP stream (a caller's deadline, an
        incarnation's end), nothing is lost and the stream stays whole: the rest goes back
        to the front of the outbox, and a flush in the session's own nursery sends it (the
        close's final flush, if the session is closing)."""
        idle = self.cfg.idle_timeout
        raw = self._raw_socket()
        try:
            with trio.CancelScope(deadline=trio.current_time() + idle) as cs:
                while rest:
                    if raw is None:
                        sent = min(len(rest), TLS_PIECE)
                        await self.stream.send_all(rest[:sent])
                        rest = rest[sent:]
                        cs.deadline = trio.current_time() + idle
                        continue
                    await trio.lowlevel.wait_writable(raw)
                    try:
                        sent = raw.send(rest)
                    except BlockingIOError:  # woken without room (rare): wait again
                        continue
                    except OSError as exc:
                        raise trio.BrokenResourceError(f"send failed: {exc}") from exc
                    if sent:
                        rest = rest[sent:]
                        self._heard_from()
                        cs.deadline = self._last_rx + idle
        except trio.Cancelled:
            if raw is not None:
                self.proto.unsend(bytes(rest))
                self._requeued = True
                self._drain_soon()
            raise
        if cs.cancelled_caught:
            # Cut mid-send: the stream is undefined now, so nothing more goes out on it.
            self._send_broken = True
            self._fail(
                P2PKVTimeout(
                    f"peer stopped reading: no send made headway for {idle:.1f} s",
                    peer=self.peer_id,
                    op="send",
                ),
                "peer stopped reading",
                "timeout",
            )

    def _send_now(self, data: bytes) -> int:
        """Hand ``data`` to the kernel without a trip through the scheduler: bytes sent.

        ``SocketStream.send_all`` yields once per send even when the kernel takes every
        byte at once, as it nearly always does for control frames; on a plain TCP stream
        we try a non-blocking send first, through :meth:`_raw_socket`, and leave only what
        the kernel would not take to ``send_all``. The caller holds the send lock, so
        nothing interleaves. TLS streams (and any other kind) always go through
        ``send_all``."""
        raw = self._raw_socket()
        if raw is None:
            return 0
        try:
            return raw.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"send failed: {exc}") from exc

    def _raw_socket(self) -> socket.socket | None:
        """A non-blocking duplicate of a plain TCP stream's descriptor, kept until the
        session ends; None for TLS (and any other kind of stream) or a closed one. Sends
        use it; the reader and the answer lane each have their own
        (:meth:`_reader_socket`, :meth:`_lane_socket`), so that a wake-up meant for one
        (``notify_closing``) never reaches a task waiting on another. Out of
        descriptors, the connection is lost to us, as for the reader's
        (``BrokenResourceError``, which every send takes as that)."""
        if self._raw is None:
            try:
                self._raw = self._dup()
            except OSError as exc:
                raise trio.BrokenResourceError(f"send failed: {exc}") from exc
        return self._raw

    def _reader_socket(self) -> socket.socket | None:
        if self._rsock is None:
            self._rsock = self._dup()
        return self._rsock

    def _lane_socket(self) -> socket.socket | None:
        if self._lane_sock is None and self.alive:
            try:
                self._lane_sock = self._dup()
            except OSError:  # out of descriptors: the request waits on its event
                return None
        return self._lane_sock

    def _dup(self) -> socket.socket | None:
        if not isinstance(self.stream, trio.SocketStream) or self.stream.socket.fileno() < 0:
            return None
        dup = socket.socket(fileno=os.dup(self.stream.socket.fileno()))
        dup.setblocking(False)
        return dup

    async def _receive(self, wait_first: bool = True) -> bytes | bytearray | None:
        """The peer's next bytes, b"" once it has closed, None if it woke without any
        (the answer lane's task took them, or left the reader work); always a checkpoint.

        On a plain TCP stream the reader reads the duplicate descriptor itself.
        ``SocketStream.receive_some`` tries a receive before it waits, so every frame that
        arrives on a quiet session costs a receive that fails, and its layers (a conflict
        check, an error translator, a partial) run each time. Here a receive that left
        bytes behind (it filled the buffer) is followed by another receive
        (``wait_first=False``); otherwise the reader waits for the descriptor first. TLS
        streams use ``receive_some``.

        The duplicate keeps the connection open on its own: closing ``self.stream`` from
        another task would no longer wake the reader, so only ``_close_down`` closes the
        stream (after the reader has ended); anything else ends a session with
        :meth:`close`."""
        try:
            raw = self._reader_socket()
        except OSError as exc:  # out of descriptors: this session cannot read on
            raise trio.BrokenResourceError(f"receive failed: {exc}") from exc
        if raw is None:
            return await self.stream.receive_some(RECEIVE_SIZE)
        self._reader_idle = True  # the answer lane's task may read until we do
        lane_reads = self._lane_reads
        try:
            if wait_first:
                try:
                    await trio.lowlevel.wait_readable(raw)
                except trio.ClosedResourceError:  # the lane's nudge: it left us work
                    return None
                if self._lane_parked:
                    # The bytes are most likely its answer: its task reads first, in this
                    # same batch, and the answer skips the hand-over through an event.
                    await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint()
        finally:
            self._reader_idle = False
        if self._lane_left or self._lane_reads != lane_reads:
            return None  # the lane's task read (more bytes, if any, wake us again)
        try:
            return raw.recv(RECEIVE_SIZE)
        except BlockingIOError:  # woken without bytes: the lane's task took them
            return None
        except OSError as exc:
            raise trio.BrokenResourceError(f"receive failed: {exc}") from exc

    async def _reader(self) -> None:
        """Bytes in, events out; at most one turn's work between yields (see
        :mod:`p2pkv.session.turns`), so no peer's backlog delays the other sessions."""
        cfg = self.cfg
        turn = Turn(cfg.max_events_per_turn, cfg.max_keys_per_turn, self._flush)
        data: bytes | bytearray | None = None
        filled = False  # the last receive filled the buffer: bytes are likely left
        proto = self.proto
        while True:
            try:
                # A receive that filled the buffer left bytes behind: read again at once.
                data = await self._receive(wait_first=not filled)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._connection_lost(exc)
                return
            filled = False
            if data is None:  # woken without bytes of our own to read
                if not self._lane_left:
                    continue  # the lane's task read them all
                self._lane_left = False  # it stopped short: the rest is ours
            elif not data:
                self._fail(
                    SessionClosed("connection closed by peer", peer=self.peer_id),
                    "connection closed by peer",
                    "transport",
                )
                return
            turn.fresh()  # receiving yielded
            frames = charged = proto.frames_received
            if data is not None:
                filled = len(data) >= RECEIVE_SIZE
                proto.receive_data(data)
                data = None
            try:
                while True:
                    event = proto.next_event(max(1, turn.max_events - turn.events))
                    # Every frame is charged, those that made no event too (a ping flood).
                    turn.charge(events=proto.frames_received - charged)
                    charged = proto.frames_received
                    if event is None:
                        if not proto.input_pending:
                            break  # more bytes needed
                    elif isinstance(event, LookupRequested):
                        await self._answer_lookup(event, turn)  # pins in slices
                    else:
                        if isinstance(event, FetchRequested):
                            turn.charge(keys=len(event.slots))
                        self._handlers[type(event)](event)
                    if (handed := self._lane_handed) is not None and proto.unread is None:
                        self._lane_handed = None  # the bye or hello the lane left is done
                        handed.set()
                    if turn.spent():
                        await turn.pause()
            except RemoteProtocolError as exc:
                self._protocol_error(exc)
            except HandshakeRejected as exc:
                # Escaped: the reason may be the peer's own bye, the id the one its hello claimed.
                who, why = printable(exc.peer or self.who), printable(exc.reason)
                self.node.connection_warning("handshake with %s rejected: %s", who, why)
                self._fail(exc, f"handshake rejected: {exc.reason}", "handshake")
            # What the events queued goes out first: the peer waits for it, and nothing
            # below is on its path.
            await self._flush()
            if self.proto.frames_received != frames:  # bytes alone are not a sign of life
                self._frames_arrived()

    def _connection_lost(self, exc: BaseException) -> None:
        why = tls.describe_loss(self.stream, exc, heard=self._heard())
        self._fail(exc, f"connection lost: {why}", "transport")

    def _heard(self) -> bool:
        """The peer sent at least one whole frame on this connection."""
        return self.proto.frames_received > 0

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        self.node.connection_warning("protocol error from %s: %s", self.who, exc)
        self._fail(exc, f"protocol error: {exc.message}")

    def _frames_arrived(self) -> None:
        """Complete frames came in (the reader's or the lane's receive): the peer lives,
        and a probe waiting for a frame has one."""
        self._heard_from()
        if self._rx:
            self._rx.unpark_all()

    # --- the answer lane --------------------------------------------------------------

    async def _wait_in_lane(self, p: _Pending) -> bool:
        """Wait for ``p``'s answer reading the socket ourselves; False if the lane is not
        for us (TLS, another request's task in it, the reader busy, the connection lost or
        closed by the peer): the caller then waits on ``p.event``.

        Through the reader, every answer takes two trips through Trio's scheduler: the
        reader's, which reads the frame and sets the request's event, and then the
        request's task's, in the next batch, after the reader has gone back to waiting.
        On a machine with idle cores that second trip was a large part of what a 1-key
        lookup costs beyond a bare round trip (``bench/trio_handoff.py``). In the lane, the
        waiting task waits for the socket itself, on a duplicate descriptor of its own
        (Trio lets one task wait per descriptor), so when the answer comes both it and
        the reader wake in the same batch. The reader, finding the lane's task waiting,
        yields once without reading, so the task reads the bytes and handles them itself
        (:meth:`_lane_take`) and returns with no second trip.

        Frames are still handled one at a time, in order, each by one task: the lane's
        task reads only while the reader waits for bytes with nothing of a turn half done
        (``_reader_idle``), and handles what it read without yielding. It takes only the
        answers to our requests and pongs (:data:`LANE_MESSAGES`; pings too are left to
        the reader, which counts them in its turns). The first frame of any other kind,
        a lookup or fetch the peer asks of us, an abort, a hello, a bye, stays decoded
        but not acted on, with everything after it, until the reader handles it: the
        protocol's state for the producer's side and the handshake changes only in the
        reader, as before the lane. The reader is woken for what is left. If the reader
        is busy when the bytes come, the task leaves the lane and waits on its event. If a
        bye or a new hello follows its answer in what it read, the task returns only once
        the reader has acted on it, so its caller sees the session as it would have seen it
        without the lane. Whoever settles ``p`` other than the task itself (the reader,
        the lease timer, a restart, the close) wakes it through :meth:`_wake_waiter`."""
        if self._lane_p is not None or not self.answer_lane:
            return False
        lane = self._lane_socket()
        if lane is None:
            return False
        self._lane_p = p
        try:
            while not p.event.is_set():
                self._lane_parked = True
                try:
                    await trio.lowlevel.wait_readable(lane)
                except trio.ClosedResourceError:  # woken by _wake_waiter, or the close
                    return p.event.is_set()
                finally:
                    self._lane_parked = False
                if p.event.is_set():
                    break
                if not self._reader_idle or self._lane_left:
                    return False  # the reader is mid-turn, or has our rest: it reads on
                try:
                    data = lane.recv(RECEIVE_SIZE)
                except BlockingIOError:  # the reader read them first
                    continue
                except OSError as exc:  # a reset: read once, so it is ours to report
                    self._connection_lost(trio.BrokenResourceError(f"receive failed: {exc}"))
                    return False
                if not data:
                    return False  # the peer closed: the reader sees it too and ends it
                self._lane_reads += 1
                self._lane_take(data)
            if isinstance(self.proto.unread, (Bye, Hello)) and self.alive:
                # The peer said bye or restarted right after our answer. The session acts
                # on that in the reader; our caller must not act before it does (its next
                # request would go to a closed or restarted peer, which refuses a request
                # before its new handshake as a protocol error). Rare: one more trip.
                handed = self._lane_handed = self._lane_handed or trio.Event()
                await handed.wait()
            return True
        finally:
            self._lane_p = None

    def _lane_take(self, data: bytes) -> None:
        """Handle ``data`` in the lane's task, as the reader would, without yielding: at
        most one turn's frames, only :data:`LANE_MESSAGES` (see :meth:`_wait_in_lane`);
        what is left is the reader's, and the reader is woken for it. None of these
        messages carries keys to count."""
        proto = self.proto
        frames = charged = proto.frames_received
        budget = self.cfg.max_events_per_turn
        used = 0
        proto.receive_data(data)
        try:
            while True:
                event = proto.next_event(max(1, budget - used), LANE_MESSAGES)
                used += proto.frames_received - charged
                charged = proto.frames_received
                if event is None:
                    self._lane_left = proto.input_pending
                    break
                self._handlers[type(event)](event)
                if used >= budget:
                    self._lane_left = True  # frames may be left: the reader's next turn
                    break
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
        if proto.has_data_to_send():
            self._drain_soon()  # e.g. the bye of a protocol error
        if proto.frames_received != frames:
            self._frames_arrived()
        if self._lane_left and self._rsock is not None:
            # Wake the reader for the rest. It is waiting for bytes (or yielding before it
            # reads): a wake-up that finds it already woken only drops the registration.
            trio.lowlevel.notify_closing(self._rsock)

    def _wake_waiter(self, p: _Pending) -> None:
        """``p`` is settled (answered, failed, past its deadline): wake its task, which
        waits on ``p.event`` or, in the answer lane, on the socket."""
        p.event.set()
        if p is self._lane_p and self._lane_parked and self._lane_sock is not None:
            trio.lowlevel.notify_closing(self._lane_sock)

    def _heard_from(self) -> None:
        """The peer showed it is alive now: a frame from it, or our send making headway
        (its side made room for what we sent)."""
        self._last_rx = trio.current_time()
        # The keepalive need not look before the peer has been quiet this long. Its
        # deadline moves only once it is within a quarter of that (moving one costs a few
        # microseconds a frame): it may then wake early, once after a burst, find the peer
        # was not quiet long enough, and sleep again.
        if (quiet := self._quiet) is not None and (
            quiet.deadline < self._last_rx + self._quiet_after * 0.75
        ):
            quiet.deadline = self._last_rx + self._quiet_after

    async def _handshake_deadline(self) -> None:
        with trio.move_on_after(self.cfg.handshake_timeout):
            await self.handshaken.wait()
            return
        self._fail(
            P2PKVTimeout("handshake timed out", peer=self.peer_id, op="handshake"),
            "handshake timed out",
            "timeout",
        )

    async def _keepalive(self) -> None:
        """Pings a quiet peer and drops a silent one. Only the side that dialed pings after
        one heartbeat interval of quiet; the other waits two, so while the dialer is alive
        its pings (and our pongs) keep both sides from ever pinging twice per interval, and
        an idle connection costs one ping and one pong per interval, not two of each."""
        hb, idle = self.cfg.heartbeat_interval, self.cfg.idle_timeout
        quiet_before_ping = hb if self.dialer else 2 * hb
        # The peer's pong lands a round trip after our ping, so one interval after the
        # ping it has been quiet for a little less than an interval: pinging anyway then
        # (instead of waking again a round trip later) is what keeps it one wake-up each.
        early = hb / 8
        last_ping = -math.inf
        while True:
            now = trio.current_time()
            quiet = now - self._last_rx
            ready = self.proto.ready
            if ready and quiet >= idle:
                self._fail(
                    P2PKVTimeout(f"peer silent for {quiet:.1f} s", peer=self.peer_id, op="idle"),
                    "idle timeout",
                    "timeout",
                )
                return
            if not ready:
                # No pings before the handshake is through, and no idle deadline either:
                # nobody sends a frame while one side registers the other, and the
                # handshake's own deadline bounds it (the session's for the first
                # incarnation, each restart's its own). Look again in a while.
                next_ping = now + hb
            elif quiet >= quiet_before_ping - early and now - last_ping >= hb - early:
                self.proto.send_ping()
                last_ping = now
                await self._flush(background=True)
                next_ping = now + hb
            else:
                next_ping = max(self._last_rx + quiet_before_ping, last_ping + hb)
            # Both wake-ups lie in the future here, so this loop never spins. Each frame
            # that arrives meanwhile pushes the wake-up back (the reader moves the scope's
            # deadline, which wakes nobody), so a live peer's frames cost this task nothing.
            self._quiet_after = min(quiet_before_ping, idle)
            wake = min(next_ping, self._last_rx + idle) if ready else next_ping
            self._quiet = trio.CancelScope(deadline=wake)
            with self._quiet:
                await trio.sleep_forever()
            self._quiet = None

    def _rearm_lease_timer(self, deadline: float) -> None:
        """A lease or round ending at ``deadline`` was added: wake the lease timer only if
        it would otherwise sleep past it (a lookup's new deadline is usually later than one
        already armed, and a wake-up is a trip through the scheduler and a scan)."""
        if deadline < self._timer_at:
            self._timer_at = deadline  # kept if the round is gone by the time it runs
            self._wake_lease.set()

    async def _lease_timer(self) -> None:
        """Expires producer leases, consumer rounds and the waits of our requests, and
        sends what other code queued from a sync context (it sets ``_wake_lease``).
        ``_timer_at`` is when its current sleep ends; a deadline added before that wakes
        it (``_rearm_lease_timer``). A request waiting past its deadline is woken with
        neither an answer nor an error: its waiter gives up (aborts) on its own."""
        while True:
            # A fresh Event before anything is sent: a wake-up during the flush is kept.
            self._wake_lease = trio.Event()
            now = trio.current_time()
            for req in self.proto.expire(now):
                self._release_round(req)
            for req in [r.req_id for r in self._rounds.values() if r.deadline <= now]:
                self._close_round(req)
            overdue = False
            for p in self._pending.values():
                if p.deadline <= now:
                    p.deadline = math.inf
                    self._wake_waiter(p)
                overdue = overdue or p.ack_by <= now
            if overdue and self._requests.waiting:
                self.close(ACKS_OVERDUE, "timeout")  # see ConsumerSide._abort
                return
            await self._flush(background=True)
            deadlines = [r.deadline for r in self._rounds.values()]
            deadlines += [p.deadline for p in self._pending.values() if p.deadline < math.inf]
            deadlines += [p.ack_by for p in self._pending.values() if now < p.ack_by < math.inf]
            d = self.proto.next_deadline()
            if d is not None:
                deadlines.append(d)
            # With nothing left to expire, keep a wake-up still ahead rather than sleep for
            # ever: a lookup's round usually ends before the timer even runs, and the next
            # one's deadline then falls after it, so it needs no wake-up of its own.
            armed = self._timer_at if self._timer_at > now else math.inf
            self._timer_at = min(deadlines, default=armed)
            with trio.move_on_at(self._timer_at):
                await self._wake_lease.wait()

    # --- handshake ----------------------------------------------------------------------

    def _on_hello(self, ev: HelloReceived) -> None:
        tls.check_peer_id(self.stream, ev.hello.peer_id)  # before the node acts on the hello
        if self.incarnation is not None:
            if not self.node.admitted(self):
                # A new hello before the node admitted the first: the id it claims may be
                # another peer's, whose live session is being probed, so spending would
                # spend that peer's budget, and not spending would let a stream of new
                # epochs hold an incarnation each. A peer restarts only on a connection
                # it was admitted on.
                why = "a new hello before the first was admitted"
                self._fail(HandshakeRejected(why, peer=ev.hello.peer_id), why, "handshake")
                return
            # A restart spends the peer's registration budget as it comes (see
            # Node.spend_restart): each one is kept until the one before is torn down.
            try:
                self.node.spend_restart(ev.hello.peer_id)
            except HandshakeRejected as exc:
                self._fail(exc, f"handshake rejected: {exc.reason}", "handshake")
                return
        self._requests.set_limit(self.proto.open_requests_limit())
        assert self._nursery is not None
        old, inc = self.incarnation, Incarnation(ev.hello)
        self.incarnation = inc
        if old is not None:
            old.scope.cancel()  # its registration wait and deadline end; teardown follows
            self._cut_host_asks()  # its lookups still with the host are answered no more
            self._retiring.append(old)
        self._nursery.start_soon(self._incarnate, inc, old, ev)

    async def _incarnate(
        self, inc: Incarnation, old: Incarnation | None, ev: HelloReceived
    ) -> None:
        try:
            if old is not None:
                await self._forget(old, ev)
            with inc.scope:
                async with trio.open_nursery() as nursery:
                    if old is not None:  # the first incarnation is timed by the session
                        nursery.start_soon(self._incarnation_deadline, inc)
                    await self._register(inc, restarted=old is not None)
        finally:
            inc.exited.set()

    async def _incarnation_deadline(self, inc: Incarnation) -> None:
        with trio.move_on_after(self.cfg.handshake_timeout):
            await inc.ready.wait()
            return
        self._fail(
            P2PKVTimeout("handshake timed out", peer=self.peer_id, op="handshake"),
            "handshake timed out",
            "timeout",
        )

    async def _register(self, inc: Incarnation, *, restarted: bool) -> None:
        # A wait below may return after the peer's next hello replaced ``inc`` (woken in
        # the batch in which the reader took that hello: the cancel of ``inc.scope`` came
        # too late). The protocol's handshake is then the new incarnation's: ``inc`` must
        # neither ack it nor fail it (its job is retired by ``_forget``). Likewise after
        # the session began closing (the peer's bye taken in that batch, a close): the
        # protocol is closed, and acking or failing it raised ``LocalProtocolError``,
        # crashing the session (its job is retired by ``_close_down``).
        h = inc.hello
        try:
            await self.node.admit(self, h, restarted=restarted)
        except HandshakeRejected as exc:
            if inc is not self.incarnation:
                return
            code = "duplicate" if isinstance(exc, DuplicateSession) else "handshake"
            self._fail(exc, f"handshake rejected: {exc.reason}", code)
            return
        if inc is not self.incarnation or not self.alive:
            return
        self.proto.lift_frame_limit()  # admitted: no longer a stranger
        inc.job = self.node.registrar.submit(
            h.agent_name, h.agent_metadata, RegionLayout(h.base_addr, h.num_blocks, h.block_len)
        )
        try:
            with trio.fail_after(self.cfg.registration_timeout):
                inc.remote = await inc.job.wait()
        except (P2PKVError, trio.TooSlowError) as exc:
            if inc is not self.incarnation or not self.alive:
                return
            reason = str(exc) or "registration timed out"
            # Without a secret a stranger is registered, so one per connection: rate-limited.
            self.node.connection_warning("registering %s failed: %s", h.peer_id, reason)
            self.error = HandshakeRejected(f"registration failed: {reason}", peer=h.peer_id)
            self.error.__cause__ = exc
            self.proto.registration_failed(reason)
            self.close(f"registration failed: {reason}", "handshake")
            return
        if inc is not self.incarnation or not self.alive:
            return
        ready = self.proto.registration_succeeded()
        if ready is not None:
            self._on_ready(ready)
        await self._flush(background=True)

    async def _forget(self, old: Incarnation, ev: HelloReceived) -> None:
        """The peer restarted (new epoch): drop everything of the old incarnation first."""
        with trio.CancelScope(shield=True):
            await old.exited.wait()  # its scope is cancelled: this is prompt
            for req in ev.failed_requests:
                p = self._pending.get(req)
                if p is not None:
                    p.error = SessionClosed("peer restarted", peer=self.peer_id)
                    self._wake_waiter(p)
                    # Nothing of the new incarnation will end it (no transfer_done or
                    # abort_ack comes for an old request): its request slot is free now.
                    self._request_ended(req)
            self._rounds.clear()
            for req in ev.dropped_rounds:
                write = self._writes.get(req)
                if write is not None:
                    write.cancel()
            for req in ev.dropped_rounds:
                done = self._write_done.get(req)
                if done is not None:
                    await done.wait()
            for req in ev.dropped_rounds:
                self._release_round(req)
            if old.job is not None:
                await self.node.registrar.release(self.node.registrar.retire(old.job))
                old.job = old.remote = None
            self._retiring.remove(old)

    def _on_ready(self, ev: Ready) -> None:
        assert self.incarnation is not None
        # The peer's quiet counts from here: while our registration of it ran, it waited
        # for our ack and had nothing to send (see _keepalive).
        self._heard_from()
        self.incarnation.ready.set()
        self.handshaken.set()
        self.node.session_ready(self)

    def _on_bye(self, ev: ByeReceived) -> None:
        exc: BaseException
        if ev.code == "duplicate":
            exc = DuplicateSession(ev.reason, peer=self.peer_id, remote=True)
        elif ev.code == "handshake":
            exc = HandshakeRejected(ev.reason, peer=self.peer_id, remote=True)
        else:
            exc = SessionClosed(f"peer said bye ({ev.code}): {ev.reason}", peer=self.peer_id)
        self._fail(exc, f"peer closed: {ev.reason}", ev.code)
