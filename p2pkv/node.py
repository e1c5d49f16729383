"""The node: listener, dialer, supervisor of peer sessions, and the public async API.

Theory of operation
-------------------
Everything a node runs lives in one nursery opened by :func:`open_node`: the TCP
listener (its connections, and those the node dials, wrapped in TLS when configured: see
:mod:`p2pkv.tls`), one supervised task per peer session, the registration executor, the
completion poller and the quarantine timer. The supervisor catches ``Exception`` around
each session's task (outside the session's own cancel scope), so one peer's failure or
hostile input never cancels a sibling; ``BaseException`` passes through.

At most one live session per peer id, decided by :meth:`Node.admit` (one decision at a
time per peer id). A hello naming a peer id that already has a live session:

* If that session is established, it is probed (a ping; any complete frame within
  ``probe_timeout`` is an answer). A live session is never replaced: the newcomer is
  refused as a duplicate, so nobody can take over a connected peer's identity by
  claiming it. A session that stays silent is taken to be dead (the peer restarted and
  its old connection has not noticed yet): it is closed and fully torn down *before* the
  newcomer registers.
* If it is still handshaking and the epochs match, both sides dialed each other at once:
  when the two connections were dialed by different sides, the one dialed by the smaller
  peer id wins, on both sides, so they agree without talking; when one side dialed both,
  the older connection stays. A different epoch supersedes it (the peer restarted).

``connect`` to an address this node already has an established session with returns that
peer; a refused duplicate dial also returns the live peer.

Closing is idempotent: sessions say bye and drain, the nursery is cancelled, every
registration still published is released, and the transport is closed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import ipaddress
import itertools
import logging
import math
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeVar

import attrs
import trio

from . import tls
from .completion import CompletionPoller
from .config import NodeConfig, check_seconds
from .errors import (
    ConfigError,
    DuplicateSession,
    HandshakeRejected,
    P2PKVError,
    P2PKVTimeout,
    PeerUnavailable,
    SessionClosed,
    TransportError,
)
from .pins import HostPins, PinSource
from .registrar import Offload, Registrar, RegistrarStatistics, RegistrationJob, to_thread
from .session.consumer import FRAME_OVERHEAD, KEY_OVERHEAD, check_rounds
from .session.protocol import LocalInfo
from .session.session import FetchResult, LookupRound, PeerSession
from .session.shares import LandingShares
from .store import BlockStore, StoreStatistics
from .transport.base import DataTransport, RegionLayout, RemotePeer, TransportStatistics
from .wire import MAX_FRAME_SIZE, Hello

T = TypeVar("T")
log = logging.getLogger("p2pkv.node")
_REGISTRATION_IDS = 4096  # peer ids whose recent registrations a node remembers


def _source(host: object) -> object:
    """Where a connection comes from, for turning strangers away: its IPv4 address (also
    when mapped into IPv6), or the /64 of its IPv6 one (any IPv6 host holds a /64)."""
    if isinstance(host, str) and ":" in host:
        with contextlib.suppress(ValueError):
            addr = ipaddress.IPv6Address(host.split("%")[0])
            if addr.ipv4_mapped is not None:  # an IPv4 peer on a dual-stack socket
                return str(addr.ipv4_mapped)
            return ipaddress.IPv6Network((addr, 64), strict=False)
    return host


TransportFactory = Callable[[NodeConfig, BlockStore], DataTransport]


@attrs.frozen
class Peer:
    """A connected peer, as the public API names it."""

    peer_id: str
    address: tuple[str, int] | None = None


@attrs.define(eq=False)
class _Dialing:
    """A connect in progress to one address, which concurrent connects join."""

    done: trio.Event = attrs.Factory(trio.Event)
    error: P2PKVError | None = None  # why it failed, once done


def _joined_error(err: P2PKVError) -> P2PKVError:
    """An error of the kind ``err`` is, for a connect that joined the dial ``err`` ended:
    each caller raises its own (one exception object raised in several tasks would gather
    all their tracebacks)."""
    new: P2PKVError
    if isinstance(err, HandshakeRejected):
        new = type(err)(err.reason, peer=err.peer, remote=err.remote)
    elif isinstance(err, SessionClosed):
        new = type(err)(err.reason, peer=err.peer, op=err.op)
    else:
        new = type(err)(err.message, peer=err.peer, op=err.op)
    new.__cause__ = err
    return new


def check_address(address: object) -> tuple[str, int]:
    """``address`` as the ``(host, port)`` pair :meth:`Node.connect` dials; TypeError or
    ValueError naming what is wrong. A ``"host:port"`` string is refused, not indexed as
    a pair (it would dial host ``"1"``, port 2)."""
    if isinstance(address, str | bytes) or not isinstance(address, Sequence) or len(address) != 2:
        raise TypeError(f"address must be a (host, port) pair, got {address!r}")
    host, port = address
    if not isinstance(host, str) or not host:
        raise TypeError(f"address: host must be a non-empty str, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"address: port must be an int, got {port!r}")
    if not 0 < port < 65536:
        raise ValueError(f"address: port must be 1..65535, got {port}")
    return host, int(port)


def check_peer(peer: object) -> str:
    """The peer id ``peer`` names: a :class:`Peer` or a peer id (str). TypeError for
    anything else, the address :meth:`Node.connect` takes included (an easy slip)."""
    if isinstance(peer, Peer):
        return peer.peer_id
    if isinstance(peer, str):
        return peer
    hint = " (an address? connect() takes those; later calls take its Peer)"
    raise TypeError(
        f"peer must be a Peer or a peer id (str), got {peer!r}"
        + (hint if isinstance(peer, tuple) else "")
    )


def check_members(members: Iterable[Peer | str]) -> set[str]:
    """The peer ids ``members`` names (:meth:`Node.reconfigure`), each item checked as
    :func:`check_peer` does. TypeError for one peer id passed where a collection of them
    is expected: its characters would be the members, and every session would close."""
    if isinstance(members, str | bytes | bytearray | memoryview):
        raise TypeError(
            f"members must be a collection of peer ids, got one {type(members).__name__}: [id]?"
        )
    return {check_peer(m) for m in members}


def check_keys(keys: Iterable[bytes]) -> list[bytes]:
    """``keys`` as a list. TypeError for one key passed where a sequence of them is
    expected (an easy slip: ``fetch(peer, key)`` took each byte as a key, and every
    key "failed" as not bytes)."""
    if isinstance(keys, bytes | bytearray | memoryview | str):
        raise TypeError(f"keys must be a sequence of keys, got one {type(keys).__name__}: [key]?")
    return list(keys)


def check_config(config: object) -> NodeConfig:
    """``config`` if it is a :class:`NodeConfig`; TypeError naming the argument for
    anything else (a dict of settings was ``AttributeError`` on ``peer_id``)."""
    if not isinstance(config, NodeConfig):
        raise TypeError(f"config must be a NodeConfig, got {type(config).__name__}")
    return config


def check_pin_source(pin_source: PinSource | None, config: NodeConfig) -> None:
    """A :class:`HostPins` checks the host's answers against its ``num_blocks``: that must
    be the node's region, or the host may answer a slot past it (the key failing only at
    the write) or have its answers for the region's last slots refused (every such key a
    miss). ConfigError naming both."""
    if isinstance(pin_source, HostPins) and pin_source.num_blocks != config.num_blocks:
        raise ConfigError(
            f"pin_source's num_blocks ({pin_source.num_blocks}) is not the node's "
            f"num_blocks ({config.num_blocks}): the host's answers are slots of the region"
        )


def check_activity(activity: object) -> tuple[int, int]:
    """``activity`` as the pair :meth:`Node.session_activity` returns: two ints (a list
    of them is taken too, as JSON keeps them). TypeError for anything else, which could
    never equal the session's and would keep it "in use" for ever."""
    if isinstance(activity, str | bytes) or not isinstance(activity, Sequence):
        raise TypeError(f"activity must be what session_activity() returned, got {activity!r}")
    if len(activity) != 2 or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in activity
    ):
        raise TypeError(
            f"activity must be a pair of ints from session_activity(), got {activity!r}"
        )
    return int(activity[0]), int(activity[1])


class _OncePerSecond:
    """A log line that anyone who can connect may cause as often as they like: at most one
    a second goes out, saying how many there were.

    An event held back is counted by a later line: the next event's, or, if none comes
    within the second, the one :meth:`Node._count_later` sends with :meth:`held_back`
    once the second is over (a flood that stopped was otherwise never counted)."""

    def __init__(self) -> None:
        self._last = -math.inf
        self._count = 0
        self.later = False  # a line for the events held back is due (Node._count_later)

    def tick(self) -> int | None:
        """One more event: the events since the last line went out, this one included, if
        a line may go out now (the count starts again); else None."""
        self._count += 1
        now = trio.current_time()
        if now < self._last + 1.0:
            return None
        count, self._last, self._count = self._count, now, 0
        return count

    def next_line_at(self) -> float:
        """When a line may go out next (Trio's clock)."""
        return self._last + 1.0

    def held_back(self) -> int:
        """The events held back since the last line, for a line going out now (the count
        starts again; 0: none, and no line)."""
        count, self._count = self._count, 0
        if count:
            self._last = trio.current_time()
        return count


@attrs.frozen
class NodeStatistics:
    peer_id: str
    peers: int  # sessions that finished their handshake
    sessions: int  # including those still handshaking
    pinned_slots: int
    reserved_slots: int
    quarantined_slots: int
    inflight_transfers: int
    inflight_bytes: int
    registrations: RegistrarStatistics
    store: StoreStatistics
    transport: TransportStatistics


def make_transport(cfg: NodeConfig, store: BlockStore) -> DataTransport:
    if store.device_region and (cfg.transport != "nixl" or cfg.verify_checksums):
        # Checksums and the local transport read the region through a host view.
        raise P2PKVError("a GPU region needs transport='nixl' and verify_checksums=False")
    if cfg.transport == "nixl":
        from .transport.nixl import NixlTransport

        return NixlTransport.create(
            agent_name=cfg.peer_id,
            region=store.buffer,
            layout=store.layout,
            copy_threads=cfg.nixl_copy_threads,
        )
    from .transport.local import LocalTransport

    return LocalTransport.create(agent_name=cfg.peer_id, region=store.array, layout=store.layout)


class Node:
    """A running node. Get one from :func:`open_node`."""

    def __init__(
        self,
        config: NodeConfig,
        store: BlockStore,
        transport: DataTransport,
        offload: Offload,
        transport_factory: TransportFactory = make_transport,
    ) -> None:
        self.config = config
        self.store = store
        self.transport = transport
        self._transport_factory = transport_factory
        self._retired_transports: list[DataTransport] = []
        self._reconfigure_lock = trio.Lock()
        self.offload = offload
        self.epoch = secrets.randbits(63)
        self.registrar = Registrar(transport, offload)
        self.poller = CompletionPoller(transport)
        self.data_limiter = trio.CapacityLimiter(1)
        # Tasks that wait for or hold data_limiter, changed on the Trio thread only: take
        # the limiter through _data_plane() or offload_data(), which count the task. A
        # fetch's posts run in one worker thread, chunk after chunk, while no other task
        # is counted; the thread reads this between chunks (an int, under the GIL), so any
        # other task that wants the data plane gets in at the next chunk.
        self.data_wanted = 0
        self.cpu_limiter = trio.CapacityLimiter(1)
        # Per peer id: pins held by quarantines of rounds that left their session (it
        # ended, or the peer restarted). They count against the peer's max_pinned_blocks
        # until each quarantine ends (session/producer.py, ``_pins_counted``).
        self.orphan_pins: collections.Counter[str] = collections.Counter()
        self.address: tuple[str, int] = (config.host, config.port)
        self._nursery: trio.Nursery | None = None
        self._tls: tls.TLSContexts | None = None  # loaded when the node starts
        self._sessions: set[PeerSession] = set()
        self._by_peer: dict[str, PeerSession] = {}
        self._dialed: set[PeerSession] = set()
        # Sessions accepted whose peer is not admitted yet, oldest first (a dict as an
        # ordered set); what a flood of them cost is logged once a second.
        self._strangers: dict[PeerSession, None] = {}
        self._turned_away = _OncePerSecond()
        self._connection_warnings = _OncePerSecond()  # see connection_warning
        self._admitting: dict[str, trio.Lock] = {}  # one admit decision at a time per peer
        # When each peer id started its recent registrations (oldest first): the budget of
        # max_peer_registrations per peer_registration_window. At most _REGISTRATION_IDS ids
        # are remembered; an id forgotten early only gets a fresh budget.
        self._registered_at: dict[str, collections.deque[float]] = {}
        self._dialing: dict[tuple[str, int], _Dialing] = {}  # connects in progress
        self._peers_changed = trio.lowlevel.ParkingLot()  # a session became ready or ended
        self._closing = False
        self._closed = trio.Event()
        self._stopped = trio.Event()
        self._wake_quarantine = trio.Event()
        # Region slots a fetch_into is landing in now (the caller owns them otherwise).
        self.caller_slots: set[int] = set()
        # Who pins for a lookup of ours when the host owns presence and pins (vLLM's
        # primary tier); None: the store does.
        self.pin_source: PinSource | None = None
        # The slots of our store each peer's writes hold (NodeConfig.max_landing_share).
        self.landing_shares = LandingShares()

    # --- what sessions need -------------------------------------------------------------

    def _advertised_max_keys(self) -> int:
        """The keys per request our hello lets a peer send: ``max_keys_per_request``, at
        most what fits one of our frames at the longest key we take. The hello carries
        no frame size (a field more breaks authenticated handshakes with older peers),
        so without this bound a peer would size its requests by its own frame only, and
        one with larger frames would be cut off for a lookup ours could not hold."""
        cfg = self.config
        room = min(cfg.max_frame_size, MAX_FRAME_SIZE) - FRAME_OVERHEAD
        return max(min(cfg.max_keys_per_request, room // (cfg.max_key_len + KEY_OVERHEAD)), 1)

    def local_info(self, *, dialer: bool = False) -> LocalInfo:
        cfg, layout = self.config, self.store.layout
        return LocalInfo(
            peer_id=cfg.peer_id,
            epoch=self.epoch,
            agent_name=self.transport.agent_name,
            agent_metadata=self.transport.metadata(),
            base_addr=layout.base_addr,
            num_blocks=layout.num_blocks,
            block_len=layout.block_len,
            fingerprint=cfg.fingerprint,
            hash_algo=cfg.hash_algo,
            hash_seed=cfg.hash_seed,
            nonce=secrets.token_bytes(16),
            secret=cfg.secret,
            max_open_requests=cfg.max_open_requests,
            max_keys_per_request=self._advertised_max_keys(),
            max_key_len=cfg.max_key_len,
            max_frame_size=cfg.max_frame_size,
            max_peer_blocks=cfg.max_peer_blocks,
            dialer=dialer,
        )

    def _registrations_in_window(self, pid: str) -> collections.deque[float]:
        """When ``pid`` started the registrations still in the budget's window (oldest
        first); ids with none are forgotten."""
        times = self._registered_at.get(pid)
        if times is None:
            return collections.deque()
        horizon = trio.current_time() - self.config.peer_registration_window
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._registered_at[pid]
        return times

    def _check_registration_budget(self, pid: str) -> None:
        """Raises :class:`HandshakeRejected` once ``pid`` has spent its
        ``max_peer_registrations`` in the window: a peer in a restart or reconnect loop."""
        cfg, times = self.config, self._registrations_in_window(pid)
        if len(times) >= cfg.max_peer_registrations:
            back_in = times[0] + cfg.peer_registration_window - trio.current_time()
            raise HandshakeRejected(
                f"peer {pid!r} registered {len(times)} times within "
                f"{cfg.peer_registration_window:g} s (max_peer_registrations): it may "
                f"register again in {back_in:.1f} s",
                peer=pid,
            )

    def _spend_registration(self, pid: str) -> None:
        """``pid`` was admitted: one more registration in its window. The least recently
        registered ids are forgotten first once more than ``_REGISTRATION_IDS`` are held."""
        times = self._registrations_in_window(pid)
        times.append(trio.current_time())
        self._registered_at.pop(pid, None)
        self._registered_at[pid] = times  # the most recent last
        if len(self._registered_at) > _REGISTRATION_IDS:
            for old in list(self._registered_at)[: len(self._registered_at) // 4]:
                del self._registered_at[old]

    def spend_restart(self, pid: str) -> None:
        """A restart hello (a new epoch) came on an admitted session of ``pid``: one
        registration of its budget, spent as the hello arrives, or
        :class:`HandshakeRejected` past the budget. Not at admit: a restart that the next
        one replaces before it gets there would spend nothing, and a peer sending new
        epochs faster than they are torn down kept the session holding every one."""
        self._check_registration_budget(pid)
        self._spend_registration(pid)

    async def admit(self, session: PeerSession, hello: Hello, *, restarted: bool = False) -> None:
        """Make ``session`` the one live session of its peer id, or reject it (see the
        module docstring). Called only once the hello passed every check (including
        authentication), so nothing unproven can replace a session or count against
        ``max_peers``.

        The peer's registration budget is checked first and spent once admitted, for a
        session the peer dialed; its ``restarted`` hello on any session spent it already
        as it came (:meth:`spend_restart`). Our own dials are ours to make and spend
        nothing."""
        pid = hello.peer_id
        budgeted = not restarted and session not in self._dialed
        lock = self._admitting.setdefault(pid, trio.Lock())
        try:
            async with lock:
                if budgeted:
                    self._check_registration_budget(pid)
                await self._admit_locked(session, hello)
                self._strangers.pop(session, None)
                if budgeted:
                    self._spend_registration(pid)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._admitting.pop(pid, None)

    async def _admit_locked(self, session: PeerSession, hello: Hello) -> None:
        pid = hello.peer_id
        while True:
            if self._closing:
                raise HandshakeRejected("node is shutting down", peer=pid)
            old = self._by_peer.get(pid)
            if old is None or old is session:
                break
            if not old.alive:
                # Closing (its bye, an error, an idle timeout, a disconnect): its writes
                # drain and its registration is released before the peer's next one
                # starts: a reconnect must not re-register while the old session's write
                # is still in flight.
                if not old.finished.is_set():
                    await self._wait_torn_down(old, pid)
                break
            old_hello = old.proto.peer
            if old.proto.ready:
                if await old.probe(self.config.probe_timeout):
                    raise DuplicateSession("peer id already has a live session", peer=pid)
                reason = "superseded: the old session did not answer"
            elif old_hello is not None and old_hello.epoch == hello.epoch:
                # Both sides dialed at once: keep the connection the smaller peer id
                # dialed; if one side dialed both, keep the older one.
                dialer_small = min(self.config.peer_id, pid) == self.config.peer_id
                new_dialed, old_dialed = session in self._dialed, old in self._dialed
                if new_dialed == old_dialed or new_dialed != dialer_small:
                    raise DuplicateSession("duplicate connection", peer=pid)
                reason = "duplicate connection"
            else:
                reason = "superseded: the peer restarted"
            if reason == "duplicate connection":
                # Typed, as the peer's bye would make it: our dial that lost here waits for
                # the winner and returns it (a bare close would make it raise).
                old._fail(DuplicateSession(reason, peer=pid), reason, "duplicate")
            else:
                old.close(reason, "superseded")
            await self._wait_torn_down(old, pid)
        if pid not in self._by_peer and len(self._by_peer) >= self.config.max_peers:
            raise HandshakeRejected(
                f"node is at its cap of {self.config.max_peers} peers", peer=pid
            )
        self._by_peer[pid] = session

    async def _wait_torn_down(self, old: PeerSession, pid: str) -> None:
        """Wait for ``old``, closing, to be torn down: its writes get ``abort_timeout`` to
        settle, then its bye and its stream up to a second each. Past that bound (plus
        ``close_timeout``, its own slack) the newcomer is refused. Not ``close_timeout``
        alone: a peer whose old session still drains a write would be refused when it
        comes back (``tests/test_vllm_adapter.py``, a source that dies mid-request)."""
        cfg = self.config
        with trio.move_on_after(cfg.abort_timeout + cfg.close_timeout):
            await old.finished.wait()
        if not old.finished.is_set():
            raise HandshakeRejected("the previous session of this peer did not close", peer=pid)

    def admitted(self, session: PeerSession) -> bool:
        """``session`` is the one live session of its peer id: the node admitted it."""
        pid = session.peer_id
        return pid is not None and self._by_peer.get(pid) is session

    def pins_back(self, peer_id: str) -> None:
        """Pins counted against ``peer_id``'s cap came back (a quarantine's end, maybe of
        an earlier session's round): its session's lookups queued for the host's pins
        look again."""
        session = self._by_peer.get(peer_id)
        if session is not None:
            session.wake_host_queue()

    def session_ready(self, session: PeerSession) -> None:
        self._peers_changed.unpark_all()

    def session_gone(self, session: PeerSession) -> None:
        self._sessions.discard(session)
        self._dialed.discard(session)
        pid = session.peer_id
        if pid is not None and self._by_peer.get(pid) is session:
            del self._by_peer[pid]
        self._peers_changed.unpark_all()

    def defer(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` after ``delay`` seconds (or at shutdown, whichever first)."""

        async def later() -> None:
            try:
                await trio.sleep(delay)
            finally:
                fn(*args)

        assert self._nursery is not None
        self._nursery.start_soon(later)

    def connection_warning(self, msg: str, *args: object) -> None:
        """Log a WARNING about one connection (a failed TLS or p2pkv handshake, a protocol
        error): anyone who can connect can cause one per connection, as fast as they
        reconnect, so a flood of them is one line a second, the next saying how many were
        left out."""
        count = self._connection_warnings.tick()
        if count is None:
            self._count_later(
                self._connection_warnings,
                "%d such lines left out since the last (failed or refused handshakes, "
                "protocol errors, refused registrations)",
            )
            return
        if left_out := count - 1:
            msg += " (%d such lines left out since the last)"
            args = (*args, left_out)
        log.warning(msg, *args)

    def _count_later(self, limit: _OncePerSecond, msg: str, *args: object) -> None:
        """An event ``limit`` held back: unless a line is due already, one goes out once
        the second is over (or at the node's close), counting every event held back by
        then (``msg``'s first argument), if the next event's line has not."""
        if limit.later:
            return
        limit.later = True

        def count() -> None:
            limit.later = False
            if held := limit.held_back():
                log.warning(msg, held, *args)

        try:
            self.defer(max(limit.next_line_at() - trio.current_time(), 0.0), count)
        except RuntimeError:  # the node's nursery is closed: it is going away
            count()

    def wake_quarantine(self) -> None:
        self._wake_quarantine.set()

    # --- background tasks -----------------------------------------------------------------

    async def _supervise(self, session: PeerSession) -> None:
        self._sessions.add(session)
        try:
            await session.run()
        except Exception:  # outside the session's cancel scope; see the module docstring
            log.exception("session with %s crashed", session.who)
        finally:
            self.session_gone(session)

    async def _accept(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
        except OSError:
            peer = None
        secured = tls.wrap(stream, self._tls, server_side=True)
        session = PeerSession(self, secured, address=peer)
        if len(self._strangers) >= self.config.max_peers:
            # A connection is a stranger until the node admits its peer; each may make
            # us hold a frame of up to MAX_HELLO_FRAME for handshake_timeout. Past
            # max_peers of them one is turned away: the oldest of the address that has
            # the most. Turning away the newcomer instead would let a few idle sockets
            # keep every honest peer out, a secret fleet's too; the oldest of all, that
            # one address flooding could turn away every other address's newcomers.
            oldest = self._stranger_to_turn_away(None if peer is None else peer[0])
            del self._strangers[oldest]
            oldest.close(
                f"turned away: {self.config.max_peers} connections (max_peers) are handshaking",
                "busy",
            )
            # A flood of them is one line a second.
            if (count := self._turned_away.tick()) is not None:
                log.warning(
                    "turned away %d connections still handshaking (max_peers: %d)",
                    count,
                    self.config.max_peers,
                )
            else:
                self._count_later(
                    self._turned_away,
                    "turned away %d connections still handshaking (max_peers: %d)",
                    self.config.max_peers,
                )
        self._strangers[session] = None
        try:
            await self._supervise(session)
        finally:
            self._strangers.pop(session, None)

    def _stranger_to_turn_away(self, newcomer: object) -> PeerSession:
        """The oldest stranger of the source address with the most strangers, counting
        the ``newcomer``'s address (so a flood turns away its own); strangers are kept in
        arrival order."""
        count: dict[object, int] = {_source(newcomer): 1}
        first: dict[object, PeerSession] = {}
        for s in self._strangers:
            addr = _source(None if s.address is None else s.address[0])
            count[addr] = count.get(addr, 0) + 1
            first.setdefault(addr, s)
        most = max(count[a] for a in first)
        return next(s for a, s in first.items() if count[a] == most)

    async def _quarantine_timer(self) -> None:
        while True:
            self.store.release_quarantined(trio.current_time())
            deadline = self.store.next_quarantine_deadline()
            self._wake_quarantine = trio.Event()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._wake_quarantine.wait()

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Own every background task in a nursery of its own, so that :meth:`aclose` can
        cancel them without touching the user's code in the ``async with`` body."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._tls = tls.load_contexts(self.config)
                host, port = self.config.host, self.config.port
                try:
                    listeners = await trio.open_tcp_listeners(port, host=host)
                except (OSError, UnicodeError) as exc:  # naming what it tried (a bad host
                    # was not named). UnicodeError: a name IDNA cannot encode (a label over
                    # 63 characters), which the resolver refuses before asking.
                    if isinstance(exc, OSError):
                        code, why = exc.errno, exc.strerror or str(exc)
                    else:
                        code, why = errno.EINVAL, str(exc)
                    raise OSError(code, f"cannot listen on {host}:{port}: {why}") from exc
                sockname = listeners[0].socket.getsockname()
                self.address = (str(sockname[0]), int(sockname[1]))
                await nursery.start(trio.serve_listeners, self._accept, listeners)
                nursery.start_soon(self.registrar.run)
                nursery.start_soon(self.poller.run)
                nursery.start_soon(self._quarantine_timer)
                task_status.started()
        finally:
            self._stopped.set()

    # --- public API -------------------------------------------------------------------------

    def _session(self, peer: Peer | str, op: str) -> PeerSession:
        pid = check_peer(peer)
        session = self._by_peer.get(pid)
        if session is None or not session.alive:
            raise PeerUnavailable("not connected", peer=pid, op=op)
        return session

    def _established(self, address: tuple[str, int]) -> PeerSession | None:
        for s in self._by_peer.values():
            if s.address == address and s in self._dialed and s.alive and s.ready.is_set():
                return s
        return None

    async def connect(self, address: tuple[str, int]) -> Peer:
        """Dial a peer; returns once both sides have registered each other (both acks).
        Connecting to a peer that is already connected returns it (the live session is
        never replaced); concurrent connects to one address share one dial, and its
        outcome: if it fails, they fail with it (each with an error of its own, the same
        kind, caused by the dial's), rather than each dialing again in turn (three
        connects to a silent address would fail at 10, 20 and 30 s)."""
        address = check_address(address)
        if self._closing or self._nursery is None:
            raise PeerUnavailable("node is closed", op="connect")
        while (dialing := self._dialing.get(address)) is not None:
            await dialing.done.wait()
            if dialing.error is not None:
                raise _joined_error(dialing.error)
            # It connected (the check below returns that peer), or its caller was cancelled.
        existing = self._established(address)
        if existing is not None:
            assert existing.peer_id is not None
            return Peer(existing.peer_id, address)
        dialing = self._dialing[address] = _Dialing()
        try:
            return await self._dial(address)
        except P2PKVError as exc:
            dialing.error = exc
            raise
        finally:
            del self._dialing[address]
            dialing.done.set()

    async def _dial(self, address: tuple[str, int]) -> Peer:
        host, port = address
        try:
            with trio.fail_after(self.config.connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, UnicodeError, trio.TooSlowError) as exc:
            # UnicodeError: a name IDNA cannot encode (a label over 63 characters, an empty
            # one), which the resolver refuses before asking: no such host, as a failed
            # lookup is.
            raise PeerUnavailable(f"cannot connect to {host}:{port}: {exc}", op="connect") from exc
        if self._closing or self._nursery is None:
            # The node closed while the dial was on its way: no session can start on it.
            await trio.aclose_forcefully(stream)
            raise PeerUnavailable("node is closed", op="connect")
        secured = tls.wrap(stream, self._tls, server_side=False)
        session = PeerSession(self, secured, address=address, dialer=True)
        self._dialed.add(session)
        self._nursery_or_raise().start_soon(self._supervise, session)
        try:
            await _wait_either(session.handshaken, session.finished)
        except BaseException:
            # The caller gave up (cancelled, or its deadline passed) before the handshake
            # was done: nobody waits for this session any more, and it would otherwise
            # hold its socket (and a dial to the address) until handshake_timeout.
            if not (session.handshaken.is_set() and session.alive):
                session.close("connect cancelled", "shutdown")
            raise
        if session.handshaken.is_set() and session.alive:
            assert session.peer_id is not None
            return Peer(session.peer_id, address)
        err = session.error
        if isinstance(err, DuplicateSession) and session.peer_id is not None:
            # The peer already has a live session with us (or the other connection of a
            # simultaneous dial won): that one is the answer.
            pid = session.peer_id
            with trio.move_on_after(self.config.handshake_timeout):
                while True:
                    winner = self._by_peer.get(pid)
                    if winner is not None and winner.alive and winner.ready.is_set():
                        return Peer(pid, winner.address)
                    await self._peers_changed.park()
        if isinstance(err, HandshakeRejected):
            raise err
        if isinstance(err, P2PKVTimeout):
            raise P2PKVTimeout(
                f"connecting to {host}:{port}: {err.message}", peer=session.peer_id, op="connect"
            ) from err
        raise PeerUnavailable(
            f"connecting to {host}:{port} failed: {session.close_reason or 'session ended'}",
            peer=session.peer_id,
            op="connect",
        ) from err

    async def lookup(self, peer: Peer | str, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` the peer holds. Hits stay pinned there for the lease, so a
        :meth:`fetch` of them soon after reuses this round (any fetch may: to keep a round
        for one caller, use :meth:`lookup_round`). Raises ``LocalProtocolError`` for a key
        this node could not send (not bytes, empty, over ``max_key_len``)."""
        return (await self._session(peer, "lookup").lookup(check_keys(keys))).hits

    async def lookup_round(self, peer: Peer | str, keys: Sequence[bytes]) -> LookupRound:
        """:meth:`lookup`, keeping the round(s) for the caller: the result's ``hits`` are
        pinned at the peer until a :meth:`fetch` that names the handle uses them, a
        :meth:`release` of the handle, or the lease's end. No other fetch or release
        touches them, so one request finishing never unpins another's hits."""
        return await self._session(peer, "lookup").lookup(check_keys(keys), held=True)

    async def fetch(
        self,
        peer: Peer | str,
        keys: Sequence[bytes],
        rounds: LookupRound | Iterable[LookupRound] | None = None,
    ) -> FetchResult:
        """Pull ``keys`` into :attr:`store`. Per-key failures (misses, timeouts, a peer that
        died, an invalid key) are in ``result.failed``; raises only if the peer is not
        connected (``PeerUnavailable``), a key is unhashable or an item of ``rounds`` is
        not a :class:`LookupRound` (``LocalProtocolError``, before anything is sent), or
        :meth:`fetch_into` has handed the region to its callers (``SlotsInUse``).
        ``rounds``: handles from :meth:`lookup_round` whose rounds this fetch
        may use (besides anonymous rounds from :meth:`lookup`)."""
        return await self._session(peer, "fetch").fetch(check_keys(keys), self._handles(rounds))

    async def fetch_into(
        self,
        peer: Peer | str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        rounds: LookupRound | Iterable[LookupRound] | None = None,
        *,
        within: float | None = None,
    ) -> FetchResult:
        """Pull ``keys[i]`` into region slot ``slots[i]``, bypassing :attr:`store`'s key
        map: for a host that owns allocation and presence itself (vLLM's primary tier).
        Returns only once no write into ``slots`` can land any more (after a give-up, or
        a key reported OK that fails its checksum, ``quarantine`` seconds later).
        ``within``: give up that many seconds from now, lookups included, so the result
        comes by ``within + quarantine`` (keys cut short fail "timed out"); None: each
        request keeps the configured deadlines. Per-key failures are in
        ``result.failed``; raises ``PeerUnavailable`` if the peer is not connected and
        ``LocalProtocolError`` for bad arguments (see
        :meth:`~p2pkv.session.session.PeerSession.fetch_into`)."""
        if within is not None:
            within = check_seconds(within, "within")
        session = self._session(peer, "fetch")
        return await session.fetch_into(check_keys(keys), slots, self._handles(rounds), within)

    def session_activity(self, peer: Peer | str) -> tuple[int, int] | None:
        """What the session with ``peer`` has been used for so far, both ways (see
        :meth:`disconnect_idle`); None if there is no live session. Safe to read from
        another thread: a dict lookup and attribute reads, each atomic."""
        session = self._by_peer.get(check_peer(peer))
        if session is None or not session.alive:
            return None
        return session.proto.activity

    async def disconnect_idle(self, peer: Peer | str, activity: tuple[int, int]) -> bool:
        """Close the session with ``peer`` only if it is idle both ways: no request
        open, ours or the peer's, and none made since :meth:`session_activity` read
        ``activity``. True if it was closed (or there was none), False if it was in use:
        a peer that fetches from us over the session we no longer need keeps it.
        TypeError for an ``activity`` that is not such a pair of ints."""
        activity = check_activity(activity)
        session = self._by_peer.get(check_peer(peer))
        if session is None:
            return True
        if not session.unused_since(activity):
            return False
        await session.aclose("idle")
        return True

    def peer_count(self) -> int:
        """Sessions counted against ``max_peers`` now, both directions (safe to read from
        another thread: one ``len``)."""
        return len(self._by_peer)

    def is_connected(self, peer: Peer | str) -> bool:
        """A session with ``peer`` is established (safe to read from another thread:
        one dict lookup and two attribute reads, each atomic)."""
        session = self._by_peer.get(check_peer(peer))
        return session is not None and session.alive and session.ready.is_set()

    def unpin(self, owner: object) -> None:
        """Release the pins ``owner`` (a producer round) holds, wherever they are held."""
        if self.pin_source is not None:
            self.pin_source.unpin(owner)
        else:
            self.store.unpin(owner)

    async def release_unused_pins(self, *, cut_writes: bool = False) -> int:
        """Release every pin held for a peer's round that no write is using, in every
        session (a host that must get its memory back, e.g. vLLM's ``reset_cache``). A
        peer that fetches such a round later gets ``NOT_PINNED`` for its keys (a p2pkv
        consumer then looks them up once more, unless a ``LookupRound`` handle holds the
        round: its holder gets ``not_pinned``). Pins under
        a write stay until it settles or its quarantine ends. ``cut_writes``: cut every
        write in flight too, as its peer's abort would, so that every pin is back
        within ``abort_timeout + quarantine`` whatever the peers do (their keys fail
        ``aborted``; nothing they were told is loaded is untrue). Returns how many
        rounds were released at once."""
        return sum(s.release_unused_pins(cut_writes=cut_writes) for s in list(self._sessions))

    async def release(self, peer: Peer | str, rounds: LookupRound | Iterable[LookupRound]) -> int:
        """Give back the pins of the rounds of ``rounds`` (from :meth:`lookup_round`) that
        no fetch used, e.g. when the request that looked them up is finished. Returns how
        many rounds were closed; 0 if the peer's session is gone (its rounds went with it).
        ``LocalProtocolError``, with no round closed, if an item is not a
        :class:`LookupRound`.
        """
        pid = check_peer(peer)
        handles = check_rounds(self._handles(rounds), pid, "release")
        session = self._by_peer.get(pid)
        if session is None or not session.alive:
            return 0
        return await session.release(handles)

    @staticmethod
    def _handles(rounds: LookupRound | Iterable[LookupRound] | None) -> Iterable[LookupRound]:
        """One handle as a list of one; anything else as given, for the session to check
        (``check_rounds``: LocalProtocolError for what is not an iterable of handles)."""
        if rounds is None:
            return []
        if isinstance(rounds, LookupRound):
            return [rounds]
        return rounds

    async def disconnect(self, peer: Peer | str) -> None:
        """Close the session with ``peer``; returns once it is torn down (its writes
        drained, its registration released), waiting at most ``close_timeout``. A session
        already closing (another disconnect, the peer's bye) is waited for the same way:
        "not connected" while it still holds the peer's registration would tell the
        caller it is gone too early. ``PeerUnavailable`` if there is none."""
        pid = check_peer(peer)
        session = self._by_peer.get(pid)
        if session is None or session.finished.is_set():
            raise PeerUnavailable("not connected", peer=pid, op="disconnect")
        await session.aclose("disconnected")

    async def reconfigure(self, members: Collection[Peer | str]) -> list[str]:
        """The membership changed: keep only the peers in ``members`` (peer ids, or
        :class:`Peer` handles as :meth:`peers` returns them). TypeError, before anything
        is closed or built, for a lone peer id (``"b"`` for ``["b"]``) or an item that is
        neither.

        Sessions of peers that left are closed (their writes drained, registrations
        released). Then the data plane is rebuilt over the same region: the new transport
        takes over this process's shared agent (NIXL: no second agent, no second memory
        registration), the surviving peers are re-registered on it and swapped in with no
        checkpoint in between, and once that configuration is live the peers that are no
        longer members are released by agent name. The old transport is closed when its
        in-flight writes have settled. Returns the agent names released. Raises
        ``PeerUnavailable`` on a node that is closing or closed (a membership controller
        racing shutdown): nothing is built then, and a data plane built while the node
        began closing is closed again, never swapped in.
        """
        keep = check_members(members)
        async with self._reconfigure_lock:
            self._refuse_reconfigure_if_closing()
            leaving = [s for pid, s in self._by_peer.items() if pid not in keep]
            for session in leaving:
                session.close("left the membership", "reconfigure")
            with trio.move_on_after(self.config.close_timeout):
                for session in leaving:
                    await session.finished.wait()
            oneoff = trio.CapacityLimiter(1)
            # No registration and no post runs from here to the end of the swap: a post
            # reads the transport and the peer's registration while holding data_limiter.
            # All or nothing, so shielded: re-registering a peer on the new transport may
            # invalidate its registration on the old one (NIXL: one agent per process), so a
            # reconfiguration cut short would leave the survivors' writes failing and the
            # new transport open. A cancel lands once it is through (its calls are threads,
            # which no cancel interrupts anyway); an error closes what it built.
            async with self.registrar.limiter, self._data_plane():
                with trio.CancelScope(shield=True):
                    self._refuse_reconfigure_if_closing()  # it may have begun while we waited
                    new = await self.offload(
                        self._transport_factory, self.config, self.store, limiter=oneoff
                    )
                    swaps: list[tuple[PeerSession, RegistrationJob, RemotePeer]] = []
                    try:
                        await self._reregister(new, swaps, oneoff)
                        # The node began closing meanwhile: its close releases the data
                        # plane it has, so this one must never become it.
                        self._refuse_reconfigure_if_closing()
                    except BaseException:
                        for session, _job, _rp in swaps:
                            session.close("reconfiguration failed", "reconfigure")
                        await self.offload(new.close, limiter=oneoff)
                        raise
                    # Go live: no checkpoint from the check above to the end of the swap.
                    nursery = self._nursery_or_raise()
                    old = self.transport
                    self.transport = self.registrar.transport = self.poller.transport = new
                    self._retired_transports.append(old)
                    nursery.start_soon(self._retire_transport, old)
                    stale: list[RemotePeer] = []
                    for session, job, rp in swaps:
                        # The incarnation it was built for: a peer that restarted on its
                        # connection meanwhile has a new one (whose job registers on the
                        # new transport once we let go of the limiter), and the old one's
                        # registration is stale. (Not read here afresh: it may be None,
                        # and the swap must not stop half done.)
                        if session.alive and session.job is job and self.registrar.replace(job, rp):
                            session.remote = rp
                        else:
                            stale.append(rp)
                    for rp in stale:
                        # Each one, whatever the one before raised: the swap is live, and
                        # an error here would leave the rest registered on it for good.
                        try:
                            await self.offload(new.remove_remote_peer, rp, limiter=oneoff)
                        except Exception:
                            log.exception("releasing %s's stale registration failed", rp.agent_name)
            live_agents = {
                s.proto.peer.agent_name
                for s in self._by_peer.values()
                if s.proto.peer is not None and s.alive
            }
            gone = {s.proto.peer.agent_name for s in leaving if s.proto.peer is not None}
            gone.update(new.release_departed_peers(live_agents))
            return sorted(gone - live_agents)

    async def _reregister(
        self,
        new: DataTransport,
        swaps: list[tuple[PeerSession, RegistrationJob, RemotePeer]],
        limiter: trio.CapacityLimiter,
    ) -> None:
        """Register every live, registered peer on ``new``; each one into ``swaps`` as it
        is done. A peer whose registration fails is closed (it may dial again)."""
        for session in list(self._by_peer.values()):
            h, job = session.proto.peer, session.job
            # Published (job.peer), whether or not its session has woken to take it yet:
            # the swap hands it the new registration either way.
            if h is None or job is None or job.peer is None or not session.alive:
                continue
            try:
                rp = await self.offload(
                    new.add_remote_peer,
                    h.agent_name,
                    h.agent_metadata,
                    RegionLayout(h.base_addr, h.num_blocks, h.block_len),
                    limiter=limiter,
                )
            except Exception as exc:
                # Any error, typed or not (a bug, the library underneath): this peer's, as
                # the registrar takes it. Raised, it failed the whole reconfiguration and
                # closed every peer re-registered before this one.
                if not isinstance(exc, P2PKVError):
                    log.exception("re-registering %r failed", h.agent_name)
                session.close(f"re-registration failed: {exc}", "reconfigure")
                continue
            swaps.append((session, job, rp))

    @asynccontextmanager
    async def _data_plane(self) -> AsyncIterator[None]:
        """Hold ``data_limiter``, counted in :attr:`data_wanted` from before it is taken."""
        self.data_wanted += 1
        try:
            async with self.data_limiter:
                yield
        finally:
            self.data_wanted -= 1

    async def offload_data(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread holding ``data_limiter`` (counted, as above)."""
        self.data_wanted += 1
        try:
            return await self.offload(fn, *args, limiter=self.data_limiter)
        finally:
            self.data_wanted -= 1

    async def _retire_transport(self, old: DataTransport) -> None:
        """Close a replaced transport once no write it posted is in flight."""
        with trio.move_on_after(self.config.fetch_timeout + self.config.abort_timeout):
            # Rare (once per reconfiguration) and the contract has no completion event.
            while old.statistics().live_handles:  # noqa: ASYNC110
                await trio.sleep(0.01)
        try:
            with trio.CancelScope(shield=True):
                await self.offload(old.close, limiter=trio.CapacityLimiter(1))
        except Exception:
            # A task of the node's nursery: raising would take the whole node down for
            # a data plane it no longer uses. Tried once; the node's close does not again.
            log.exception("closing a replaced data plane failed")
        finally:
            if old in self._retired_transports:
                self._retired_transports.remove(old)

    def _refuse_reconfigure_if_closing(self) -> None:
        if self._closing or self._closed.is_set():
            raise PeerUnavailable("node is closed", op="reconfigure")

    def _nursery_or_raise(self) -> trio.Nursery:
        if self._nursery is None:
            raise PeerUnavailable("node is not running", op="reconfigure")
        return self._nursery

    def peers(self) -> list[Peer]:
        return [
            Peer(pid, s.address) for pid, s in self._by_peer.items() if s.ready.is_set() and s.alive
        ]

    def statistics(self) -> NodeStatistics:
        st = self.store.statistics()
        return NodeStatistics(
            peer_id=self.config.peer_id,
            peers=sum(1 for s in self._by_peer.values() if s.ready.is_set() and s.alive),
            sessions=len(self._sessions),
            pinned_slots=st.pinned,
            reserved_slots=st.reserved,
            quarantined_slots=st.quarantined,
            inflight_transfers=self.poller.in_flight,
            inflight_bytes=sum(s.inflight_bytes for s in self._sessions),
            registrations=self.registrar.statistics(),
            store=st,
            transport=self.transport.statistics(),
        )

    async def aclose(self) -> None:
        """Close every session (bye, writes drained), stop the node's tasks, release every
        registration and the data plane. Idempotent; shielded and bounded by
        ``close_timeout`` per stage, so it completes even when called while cancelled."""
        with trio.CancelScope(shield=True):
            if self._closing:
                await self._closed.wait()
                return
            self._closing = True
            for session in list(self._sessions):
                session.close("node shutting down")
            with trio.move_on_after(self.config.close_timeout):
                for session in list(self._sessions):
                    await session.finished.wait()
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
                await self._stopped.wait()
            await self._final_cleanup()

    async def _final_cleanup(self) -> None:
        with trio.CancelScope(shield=True):
            await self.registrar.aclose()
            await self.registrar.drain()
            # Each transport is closed whatever the one before raised (a close that
            # raised must not leave the rest, the live one included, open); the first
            # error is raised once all were tried, the others logged.
            first: Exception | None = None
            try:
                for t in [*self._retired_transports, self.transport]:
                    try:
                        t.close()
                    except Exception as exc:
                        if first is None:
                            first = exc
                        else:
                            log.exception("closing a data plane failed")
                self._retired_transports.clear()
            finally:
                self._closed.set()
            if first is not None:
                raise first


async def _wait_either(a: trio.Event, b: trio.Event) -> None:
    async with trio.open_nursery() as nursery:

        async def wait(ev: trio.Event) -> None:
            await ev.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(wait, a)
        nursery.start_soon(wait, b)


@asynccontextmanager
async def open_node(
    config: NodeConfig,
    *,
    region: object | None = None,
    transport: TransportFactory | None = None,
    offload: Offload | None = None,
    pin_source: PinSource | None = None,
) -> AsyncIterator[Node]:
    """Run a node for the duration of the ``async with`` block; listening when entered.

    ``region``: memory the host hands in for the block store (NumPy array, torch CPU
    tensor, writable buffer, or a torch CUDA tensor with ``transport="nixl"``); allocated
    if omitted. ``pin_source``: the host owns which
    blocks exist and pins them for peers (:class:`~p2pkv.pins.HostPins`); the store's key
    map is then unused. ``transport`` and ``offload`` are for tests (a fault-injecting
    transport; a Trio-native offload on the autojump clock).
    """
    check_config(config)
    check_pin_source(pin_source, config)
    store = BlockStore(config.num_blocks, config.block_len, region)
    span = _claim_region(store)
    try:
        dp = (transport or make_transport)(config, store)
    except BaseException:
        _release_region(span)
        raise
    node = Node(config, store, dp, offload or to_thread, transport or make_transport)
    node.pin_source = pin_source
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(node._serve)
            try:
                yield node
            finally:
                await node.aclose()
    except BaseExceptionGroup as group:
        leaf = _unwrap(group)
        if leaf is group:
            raise
        _raise_as_itself(leaf)
    finally:
        try:
            if not node._closed.is_set():  # the node failed to start, or its tasks crashed
                await node._final_cleanup()
        finally:
            _release_region(span)


# The memory of every live node's store in this process: (start, end, device) per node.
# Two stores over the same bytes would each hand out every slot, one's blocks overwriting
# the other's (NIXL refuses it only for nodes of different peer ids, the in-process
# transport never). Device regions are CUDA addresses (one address space with host
# memory under UVA; the device is kept for clarity of the message).
_regions_lock = threading.Lock()
_live_regions: dict[int, tuple[int, int, str]] = {}
_region_ids = itertools.count()


def _claim_region(store: BlockStore) -> int:
    start = store.base_addr
    end = start + store.num_blocks * store.block_len
    where = "GPU" if store.device_region else "host"
    with _regions_lock:
        for s, e, w in _live_regions.values():
            if start < e and s < end:
                raise TransportError(
                    f"the {where} region [{start:#x}, {end:#x}) overlaps the {w} region "
                    f"[{s:#x}, {e:#x}) of another live node in this process: both stores "
                    "would hand out the same bytes",
                    op="open_node",
                )
        key = next(_region_ids)
        _live_regions[key] = (start, end, where)
    return key


def _release_region(key: int) -> None:
    with _regions_lock:
        _live_regions.pop(key, None)


def _forget_regions_in_child() -> None:
    """A forked child has no live node (their engines are the parent's): none of the
    parent's claims holds there, and the lock may have been held at the fork."""
    global _regions_lock
    _regions_lock = threading.Lock()
    _live_regions.clear()


os.register_at_fork(after_in_child=_forget_regions_in_child)


def _unwrap(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """One error out of the nursery is raised as itself, not as a one-element group."""
    leaves: list[BaseException] = []

    def walk(g: BaseExceptionGroup[BaseException]) -> None:
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            elif not isinstance(e, trio.Cancelled):
                leaves.append(e)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


def _raise_as_itself(exc: BaseException) -> NoReturn:
    """Raise ``exc`` (taken out of a nursery's group) with its chain as it was: its
    ``__cause__`` (a TransportError's why, a host's ``raise ... from``) and
    ``__context__``. ``raise exc from None`` cleared the cause; a plain ``raise`` in the
    group's handler made the group, which holds ``exc`` itself, its context."""
    chain = exc.__cause__, exc.__context__, exc.__suppress_context__
    try:
        raise exc
    finally:
        exc.__cause__, exc.__context__, exc.__suppress_context__ = chain


__all__ = [
    "FetchResult",
    "LookupRound",
    "Node",
    "NodeStatistics",
    "P2PKVError",
    "Peer",
    "open_node",
]
