"""The Trio driver around one :class:`~p2pkv.session.protocol.SessionProtocol`.

Theory of operation
-------------------
One :class:`PeerSession` per TCP connection, run as one task under the node's supervisor.
Inside it: a reader task (bytes in, events out, handlers dispatched from a table), a
keepalive task (heartbeats and the idle deadline), a lease task (producer pin leases and
consumer rounds nobody fetched), one task per producer write, and the registration wait.
Sends go through one ``StrictFIFOLock``; a send that fails or is cancelled breaks the
connection for good (its state on the wire is unknown).

The registration barrier: the peer's hello only *submits* a registration job to the
node's :class:`~p2pkv.registrar.Registrar`; our ``hello_ack`` goes out when the job
publishes. The protocol refuses any request that arrives before our ack, so no write
ever targets a peer we have not finished registering. When the session ends, in its
``finally`` and shielded: producer writes are drained (or their source pins held for the
quarantine time if the data plane will not settle), pins released, consumer waiters
failed, the registration retired (released if it was ours, or released by the registrar
when it finishes later), a ``bye`` sent if the stream still works, and the stream closed.
Nothing a session owns outlives it.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..errors import (
    HandshakeRejected,
    P2PKVError,
    P2PKVTimeout,
    RemoteProtocolError,
    SessionClosed,
    StoreFull,
    TransportError,
)
from ..transport.base import (
    DataTransport,
    RegionLayout,
    RemotePeer,
    TransferHandle,
    TransferState,
)
from ..wire import Outcome
from .protocol import (
    AbortAcknowledged,
    AbortRequested,
    ByeReceived,
    FetchRequested,
    HelloReceived,
    InState,
    LookupAnswered,
    LookupRequested,
    PongReceived,
    Ready,
    RoundClosed,
    SessionProtocol,
    TransferCompleted,
)

if TYPE_CHECKING:
    from ..node import Node
    from ..registrar import RegistrationJob

log = logging.getLogger("p2pkv.session")
RECEIVE_SIZE = 1 << 16
LINGER = 0.25  # seconds we wait for the peer to see our bye before closing


@attrs.define(eq=False)
class FetchResult:
    """What a fetch did: ``loaded`` keys are in the local store with the producer's bytes;
    every other requested key is in ``failed`` with a reason."""

    loaded: list[bytes] = attrs.field(factory=list)
    failed: dict[bytes, str] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Pending:
    """A consumer request waiting for the peer."""

    req_id: int
    event: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None
    error: BaseException | None = None
    slots: list[int] = attrs.field(factory=list)  # reserved destination slots
    aborted: bool = False

    def arm(self) -> None:
        self.event = trio.Event()
        self.result = None


@attrs.define(eq=False)
class _Round:
    """A consumer lookup round still open at the producer (its hits are pinned there)."""

    req_id: int
    hits: set[bytes]
    deadline: float


def checksums(view: memoryview, block_len: int, slots: Sequence[int]) -> list[int]:
    return [zlib.crc32(view[s * block_len : (s + 1) * block_len]) for s in slots]


class PeerSession:
    def __init__(
        self, node: Node, stream: trio.abc.Stream, *, address: tuple[str, int] | None = None
    ) -> None:
        self.node = node
        self.cfg = node.config
        self.stream = stream
        self.address = address
        self.proto = SessionProtocol(node.local_info())
        self.token = object()  # pin owner of this session's rounds
        self.ready = trio.Event()
        self.finished = trio.Event()
        self.close_reason: str | None = None
        self.error: BaseException | None = None
        self.inflight_bytes = 0
        self._cancel = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._send_lock = trio.StrictFIFOLock()
        self._send_broken = False
        self._requests = trio.Semaphore(self.cfg.max_open_requests)
        self._pending: dict[int, _Pending] = {}
        self._rounds: dict[int, _Round] = {}
        self._pinned: dict[int, dict[bytes, int]] = {}  # producer round -> key -> slot
        self._writes: dict[int, trio.CancelScope] = {}
        self._write_done: dict[int, trio.Event] = {}
        self._aborting: set[int] = set()
        self.job: RegistrationJob | None = None
        self.remote: RemotePeer | None = None
        self._last_rx = trio.current_time()
        self._wake_lease = trio.Event()
        self._handlers: dict[type[Any], Any] = {
            HelloReceived: self._on_hello,
            Ready: self._on_ready,
            LookupRequested: self._on_lookup,
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
    def alive(self) -> bool:
        return not self.finished.is_set() and self.close_reason is None

    def __repr__(self) -> str:
        return f"<PeerSession peer={self.peer_id} ready={self.ready.is_set()}>"

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        """The session's task: returns when the session is over, never raises Exception
        for the peer's faults (they end up in ``self.error``)."""
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self.proto.start()
                    await self._flush()
                    nursery.start_soon(self._reader)
                    nursery.start_soon(self._keepalive)
                    nursery.start_soon(self._lease_timer)
                    nursery.start_soon(self._handshake_deadline)
        finally:
            await self._cleanup()

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
        with trio.CancelScope(shield=True):
            reason = self.close_reason or "session ended"
            for p in self._pending.values():
                if p.error is None and p.result is None:
                    p.error = SessionClosed(reason, peer=self.peer_id)
                p.event.set()
            for req in list(self._pinned):
                self._release_round(req)
            if self.job is not None:
                await self.node.registrar.release(self.node.registrar.retire(self.job))
                self.remote = None
            if not self._send_broken:
                with trio.move_on_after(min(1.0, self.cfg.close_timeout)):
                    await self._flush(final=True)
                    await self._linger()
            with trio.move_on_after(min(1.0, self.cfg.close_timeout)) as cs:
                await self.stream.aclose()
            if cs.cancelled_caught:
                log.warning("closing the stream of %s timed out", self.peer_id)
            self.finished.set()
            self.node.session_gone(self)

    # --- I/O ----------------------------------------------------------------------------

    async def _linger(self) -> None:
        """Half-close and discard what the peer still sends, briefly: closing a socket
        with unread bytes resets the connection, which can destroy our bye in flight."""
        if not isinstance(self.stream, trio.abc.HalfCloseableStream):
            return
        try:
            await self.stream.send_eof()
            with trio.move_on_after(LINGER):
                while await self.stream.receive_some(RECEIVE_SIZE):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass

    async def _flush(self, *, final: bool = False) -> None:
        """Send what the protocol has queued. Once closing, only the shielded final flush
        sends: a send cut by cancellation would leave the stream undefined (and lose the
        bye), so nothing is taken from the protocol that might not go out whole."""
        async with self._send_lock:
            if self._send_broken or (self._cancel.cancel_called and not final):
                return
            data = self.proto.data_to_send()
            if not data:
                return
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._send_broken = True
                self._fail(exc, f"connection lost while sending: {exc}", "transport")
            except BaseException:
                self._send_broken = True  # a cancelled send leaves the stream undefined
                raise

    async def _reader(self) -> None:
        while True:
            try:
                data = await self.stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._fail(exc, f"connection lost: {exc}", "transport")
                return
            if not data:
                self._fail(
                    SessionClosed("connection closed by peer", peer=self.peer_id),
                    "connection closed by peer",
                    "transport",
                )
                return
            self._last_rx = trio.current_time()
            self.proto.receive_data(data)
            try:
                while (event := self.proto.next_event()) is not None:
                    self._handlers[type(event)](event)
            except RemoteProtocolError as exc:
                log.warning("protocol error from %s: %s", self.peer_id, exc)
                self._fail(exc, f"protocol error: {exc.message}")
            except HandshakeRejected as exc:
                log.warning("handshake with %s rejected: %s", exc.peer, exc.reason)
                self._fail(exc, f"handshake rejected: {exc.reason}", "handshake")
            await self._flush()

    async def _handshake_deadline(self) -> None:
        with trio.move_on_after(self.cfg.handshake_timeout):
            await self.ready.wait()
            return
        self._fail(
            P2PKVTimeout("handshake timed out", peer=self.peer_id, op="handshake"),
            "handshake timed out",
            "timeout",
        )

    async def _keepalive(self) -> None:
        hb, idle = self.cfg.heartbeat_interval, self.cfg.idle_timeout
        last_ping = -math.inf
        while True:
            now = trio.current_time()
            quiet = now - self._last_rx
            if quiet >= idle:
                self._fail(
                    P2PKVTimeout(f"peer silent for {quiet:.1f} s", peer=self.peer_id, op="idle"),
                    "idle timeout",
                    "timeout",
                )
                return
            if not self.proto.ready:
                # No pings before the handshake is through: look again in a while.
                next_ping = now + hb
            elif quiet >= hb and now - last_ping >= hb:
                self.proto.send_ping()
                last_ping = now
                await self._flush()
                next_ping = now + hb
            else:
                next_ping = max(self._last_rx, last_ping) + hb
            # Both wake-ups lie in the future here, so this loop never spins.
            await trio.sleep_until(min(next_ping, self._last_rx + idle))

    async def _lease_timer(self) -> None:
        while True:
            now = trio.current_time()
            for req in self.proto.expire(now):
                self._release_round(req)
            for req in [r.req_id for r in self._rounds.values() if r.deadline <= now]:
                self._close_round(req)
            await self._flush()
            deadlines = [r.deadline for r in self._rounds.values()]
            d = self.proto.next_deadline()
            if d is not None:
                deadlines.append(d)
            self._wake_lease = trio.Event()
            with trio.move_on_at(min(deadlines, default=math.inf)):
                await self._wake_lease.wait()

    # --- handshake ----------------------------------------------------------------------

    def _on_hello(self, ev: HelloReceived) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._register, ev)

    async def _register(self, ev: HelloReceived) -> None:
        h = ev.hello
        if ev.restarted:
            await self._forget_incarnation(ev)
        try:
            await self.node.admit(self, h)
        except HandshakeRejected as exc:
            self._fail(exc, f"handshake rejected: {exc.reason}", "handshake")
            return
        self.job = self.node.registrar.submit(
            h.agent_name, h.agent_metadata, RegionLayout(h.base_addr, h.num_blocks, h.block_len)
        )
        try:
            with trio.fail_after(self.cfg.registration_timeout):
                self.remote = await self.job.wait()
        except (P2PKVError, trio.TooSlowError) as exc:
            reason = str(exc) or "registration timed out"
            log.warning("registering %s failed: %s", h.peer_id, reason)
            self.error = HandshakeRejected(f"registration failed: {reason}", peer=h.peer_id)
            self.error.__cause__ = exc
            self.proto.registration_failed(reason)
            self.close(f"registration failed: {reason}", "handshake")
            return
        ready = self.proto.registration_succeeded()
        if ready is not None:
            self._on_ready(ready)
        await self._flush()

    async def _forget_incarnation(self, ev: HelloReceived) -> None:
        """The peer restarted (new epoch): drop everything of the old incarnation first."""
        self.ready = trio.Event()
        for req in ev.failed_requests:
            p = self._pending.get(req)
            if p is not None:
                p.error = SessionClosed("peer restarted", peer=self.peer_id)
                p.event.set()
        self._rounds.clear()
        for req in ev.dropped_rounds:
            scope = self._writes.get(req)
            if scope is not None:
                scope.cancel()
        for req in ev.dropped_rounds:
            done = self._write_done.get(req)
            if done is not None:
                await done.wait()
        for req in ev.dropped_rounds:
            self._release_round(req)
        if self.job is not None:
            await self.node.registrar.release(self.node.registrar.retire(self.job))
            self.job = self.remote = None

    def _on_ready(self, ev: Ready) -> None:
        self.ready.set()

    def _on_bye(self, ev: ByeReceived) -> None:
        exc: BaseException
        if ev.code == "handshake":
            exc = HandshakeRejected(ev.reason, peer=self.peer_id, remote=True)
        else:
            exc = SessionClosed(f"peer said bye ({ev.code}): {ev.reason}", peer=self.peer_id)
        self._fail(exc, f"peer closed: {ev.reason}", ev.code)

    # --- producer -----------------------------------------------------------------------

    def _on_lookup(self, ev: LookupRequested) -> None:
        owner = (self.token, ev.req_id)
        slots = self.node.store.pin(owner, ev.keys)
        room = self.cfg.max_pinned_blocks - self.proto.pins_held()
        pinned: dict[bytes, int] = {}
        hits: list[bool] = []
        over: list[int] = []
        for key, slot in zip(ev.keys, slots, strict=True):
            if slot is None:
                hits.append(False)
            elif key in pinned or len(pinned) < room:
                pinned[key] = slot
                hits.append(True)
            else:  # over this peer's pin cap: answer as a miss, release the pin
                over.append(slot)
                hits.append(False)
        if over:
            self.node.store.unpin_keys(owner, over)
        self._pinned[ev.req_id] = pinned
        self.proto.send_lookup_resp(ev.req_id, hits, trio.current_time(), self.cfg.lease)
        self._wake_lease.set()

    def _release_round(self, req: int) -> None:
        self._pinned.pop(req, None)
        self.node.store.unpin((self.token, req))

    def _on_round_closed(self, ev: RoundClosed) -> None:
        self._release_round(ev.req_id)

    def _on_abort(self, ev: AbortRequested) -> None:
        scope = self._writes.get(ev.req_id)
        if scope is not None:
            self._aborting.add(ev.req_id)
            scope.cancel()  # the write task drains, releases and acks
        else:
            self._release_round(ev.req_id)
            self.proto.send_abort_ack(ev.req_id)

    def _on_fetch(self, ev: FetchRequested) -> None:
        assert self._nursery is not None
        scope = trio.CancelScope()
        self._writes[ev.req_id] = scope
        self._write_done[ev.req_id] = trio.Event()
        self._nursery.start_soon(self._serve_fetch, ev, scope)

    async def _serve_fetch(self, ev: FetchRequested, scope: trio.CancelScope) -> None:
        node, bl = self.node, self.cfg.block_len
        # Pessimistic: a key is OK only once the data plane reported its write DONE, so no
        # exit path (error, cancellation, a bug) can report bytes that never landed.
        outcomes = [int(Outcome.TRANSFER_FAILED)] * len(ev.keys)
        pinned = self._pinned.get(ev.req_id, {})
        budget = max(0, (self.cfg.max_inflight_bytes - self.inflight_bytes) // bl)
        plan: list[tuple[int, int, int]] = []  # (index, local slot, remote slot)
        for i, (key, dst) in enumerate(zip(ev.keys, ev.slots, strict=True)):
            src = pinned.get(key)
            if ev.expired:
                outcomes[i] = Outcome.LEASE_EXPIRED
            elif src is None:
                outcomes[i] = Outcome.NOT_PINNED
            elif len(plan) >= budget:
                outcomes[i] = Outcome.OVER_CAP
            else:
                plan.append((i, src, dst))
        self.inflight_bytes += len(plan) * bl
        per_chunk = max(1, self.cfg.transfer_chunk_bytes // bl)
        chunks = [plan[j : j + per_chunk] for j in range(0, len(plan), per_chunk)]
        posted: list[tuple[list[tuple[int, int, int]], TransferHandle, DataTransport]] = []
        settled: set[int] = set()
        sums: list[int] | None = None
        try:
            with scope:
                for chunk in chunks:
                    # Read both per chunk: a reconfiguration swaps them together.
                    dp, remote = node.transport, self.remote
                    assert remote is not None  # the ack barrier guarantees it
                    try:
                        h = await node.offload(
                            dp.post_write,
                            remote,
                            [c[1] for c in chunk],
                            [c[2] for c in chunk],
                            limiter=node.data_limiter,
                        )
                    except TransportError as exc:
                        log.warning("posting writes to %s failed: %s", self.peer_id, exc)
                        for c in chunk:
                            outcomes[c[0]] = Outcome.TRANSFER_FAILED
                        continue
                    posted.append((chunk, h, dp))
                for chunk, h, dp in posted:
                    state = await node.poller.wait(h, dp)
                    settled.add(id(h))
                    if state is TransferState.DONE:
                        for c in chunk:
                            outcomes[c[0]] = Outcome.OK
                if self.cfg.verify_checksums:  # sources are still pinned: bytes as sent
                    sums = [0] * len(ev.keys)
                    got = await node.offload(
                        checksums,
                        node.store.array.data,
                        bl,
                        [c[1] for c in plan],
                        limiter=node.cpu_limiter,
                    )
                    for c, crc in zip(plan, got, strict=True):
                        sums[c[0]] = crc
        finally:
            with trio.CancelScope(shield=True):
                quiet = await self._settle(posted, settled, outcomes)
                self.inflight_bytes -= len(plan) * bl
                self._writes.pop(ev.req_id, None)
                self._write_done.pop(ev.req_id).set()
                if quiet:
                    self._release_round(ev.req_id)
                else:  # the data plane may still read the sources: hold their pins a while
                    self._pinned.pop(ev.req_id, None)
                    node.defer(self.cfg.quarantine, node.store.unpin, (self.token, ev.req_id))
                if ev.req_id in self._aborting:
                    self._aborting.discard(ev.req_id)
                    if self.proto.in_state(ev.req_id) is InState.ABORTING:
                        self.proto.send_abort_ack(ev.req_id)
                elif self.proto.in_state(ev.req_id) is InState.WRITING and not scope.cancel_called:
                    self.proto.send_transfer_done(ev.req_id, [int(o) for o in outcomes], sums)
                if self.alive:
                    await self._flush()

    async def _settle(
        self,
        posted: list[tuple[list[tuple[int, int, int]], TransferHandle, DataTransport]],
        settled: set[int],
        outcomes: list[int],
    ) -> bool:
        """Wait (bounded) for unsettled handles, release all; True if everything is quiet."""
        node, quiet = self.node, True
        for chunk, h, dp in posted:
            if id(h) not in settled:
                with trio.move_on_after(self.cfg.abort_timeout):
                    await node.poller.wait(h, dp)
                    settled.add(id(h))
                for c in chunk:  # cut short: whatever landed is not reported as loaded
                    outcomes[c[0]] = Outcome.ABORTED
            if id(h) in settled:
                dp.release(h)
            else:
                quiet = False
                await node.offload(dp.release, h, limiter=node.data_limiter)
        return quiet

    # --- consumer -----------------------------------------------------------------------

    def _on_answer(self, ev: LookupAnswered) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None:
            p.result = ev
            p.event.set()

    def _on_transfer_done(self, ev: TransferCompleted) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None:
            p.result = ev
            p.event.set()
        self._request_ended(ev.req_id)

    def _on_abort_ack(self, ev: AbortAcknowledged) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None and p.slots:
            # The producer drained its writes: the quarantined slots are quiescent.
            self.node.store.unquarantine(p.slots)
            p.slots = []
        self._request_ended(ev.req_id)

    def _request_ended(self, req: int) -> None:
        if self._pending.pop(req, None) is not None:
            self._requests.release()

    def _check_usable(self, op: str) -> None:
        if not self.alive:
            raise SessionClosed(self.close_reason or "session ended", peer=self.peer_id, op=op)
        if not self.ready.is_set():
            raise P2PKVError(
                "session is not ready (handshake in progress)", peer=self.peer_id, op=op
            )

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[bool]]:
        """One lookup round. The round stays open (the producer pins the hits for a lease)
        until :meth:`fetch` uses it or the lease runs out."""
        self._check_usable("lookup")
        await self._requests.acquire()
        try:
            req = self.proto.send_lookup(keys)
        except BaseException:
            self._requests.release()
            raise
        p = self._pending[req] = _Pending(req)
        await self._flush()
        try:
            with trio.fail_after(self.cfg.lookup_timeout):
                await p.event.wait()
        except trio.TooSlowError:
            self._abort(p)
            raise P2PKVTimeout("lookup timed out", peer=self.peer_id, op="lookup") from None
        except BaseException:
            self._abort(p)
            raise
        if p.error is not None:
            raise p.error
        hits: list[bool] = p.result.hits
        self._rounds[req] = _Round(
            req,
            {k for k, h in zip(keys, hits, strict=True) if h},
            trio.current_time() + self.cfg.lease * 0.9,
        )
        self._wake_lease.set()
        return req, hits

    def _abort(self, p: _Pending) -> None:
        """Give up on a request; the slots it named stay quarantined until the abort_ack."""
        self._rounds.pop(p.req_id, None)
        if p.aborted or self.proto.out_state(p.req_id) is None:
            return
        p.aborted = True
        if self.alive:
            self.proto.send_abort(p.req_id)
            if self._nursery is not None:
                self._nursery.start_soon(self._flush)

    def _close_round(self, req: int) -> None:
        """Close a round nobody fetched (empty fetch): the producer releases its pins."""
        self._rounds.pop(req, None)
        if self.alive and self.proto.out_state(req) is not None:
            self.proto.send_fetch(req, [], [])
            self._request_ended(req)

    async def fetch(self, keys: Sequence[bytes]) -> FetchResult:
        """Fetch ``keys`` into the local store, reusing open lookup rounds where they cover
        a key and looking the rest up first. Never raises for per-key failures."""
        result = FetchResult()
        wanted = list(dict.fromkeys(keys))
        store = self.node.store
        todo = [k for k in wanted if k not in store]
        result.loaded.extend(k for k in wanted if k in store)
        groups: dict[int, list[bytes]] = {}
        uncovered: list[bytes] = []
        for key in todo:
            rnd = next((r for r in self._rounds.values() if key in r.hits), None)
            if rnd is None:
                uncovered.append(key)
            else:
                groups.setdefault(rnd.req_id, []).append(key)
        try:
            if uncovered:
                req, hits = await self.lookup(uncovered)
                groups[req] = [k for k, h in zip(uncovered, hits, strict=True) if h]
                result.failed.update(
                    (k, "miss") for k, h in zip(uncovered, hits, strict=True) if not h
                )
        except P2PKVError as exc:
            for k in uncovered:
                result.failed[k] = f"lookup failed: {exc}"
        async with trio.open_nursery() as nursery:
            for req, ks in groups.items():
                nursery.start_soon(self._fetch_round, req, ks, result)
        return result

    async def _fetch_round(self, req: int, keys: list[bytes], result: FetchResult) -> None:
        self._rounds.pop(req, None)
        p = self._pending.get(req)
        if p is None or not self.alive or self.proto.out_state(req) is None:
            result.failed.update((k, "session closed") for k in keys)
            return
        store, owner = self.node.store, (self.token, "dst", req)
        try:
            slots = store.reserve(owner, len(keys)) if keys else []
        except StoreFull as exc:
            self._close_round(req)
            result.failed.update((k, f"store full: {exc}") for k in keys)
            return
        if not keys:
            self._close_round(req)
            await self._flush()
            return
        p.arm()
        p.slots = slots
        self.proto.send_fetch(req, keys, slots)
        self.node.poller.add_demand()
        try:
            await self._flush()
            with trio.fail_after(self.cfg.fetch_timeout):
                await p.event.wait()
        except trio.TooSlowError:
            self._give_up(p, owner, keys, result, "timeout")
            return
        except BaseException:
            self._give_up(p, owner, keys, result, "cancelled")
            raise
        finally:
            self.node.poller.drop_demand()
        if p.error is not None:
            self._give_up(p, owner, keys, result, str(p.error))
            return
        await self._land(p, owner, keys, p.result, result)

    def _give_up(
        self, p: _Pending, owner: object, keys: list[bytes], result: FetchResult, reason: str
    ) -> None:
        """The writes into ``p.slots`` are unsettled: quarantine them, abort the request."""
        self.node.store.quarantine(owner, p.slots, until=trio.current_time() + self.cfg.quarantine)
        self.node.wake_quarantine()
        self._abort(p)
        result.failed.update((k, reason) for k in keys)

    async def _land(
        self,
        p: _Pending,
        owner: object,
        keys: list[bytes],
        done: TransferCompleted,
        result: FetchResult,
    ) -> None:
        store, bl = self.node.store, self.cfg.block_len
        ok = [i for i, o in enumerate(done.outcomes) if o == Outcome.OK]
        good = set(ok)
        reason_bad = ""
        if self.cfg.verify_checksums:
            if done.checksums is None:
                good = set()
                reason_bad = "producer sent no checksums"
            else:
                local = await self.node.offload(
                    checksums,
                    store.array.data,
                    bl,
                    [p.slots[i] for i in ok],
                    limiter=self.node.cpu_limiter,
                )
                good = {i for i, c in zip(ok, local, strict=True) if c == done.checksums[i]}
                reason_bad = "checksum mismatch"
        release: list[int] = []
        for i, (key, slot) in enumerate(zip(keys, p.slots, strict=True)):
            if i in good:
                store.commit(owner, slot, key)
                result.loaded.append(key)
            else:
                release.append(slot)
                o = done.outcomes[i]
                result.failed[key] = reason_bad if o == Outcome.OK else Outcome(o).name.lower()
        store.release_reserved(owner, release)
        p.slots = []
