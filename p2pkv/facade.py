"""The synchronous facade: a node on its own engine thread, driven from a host thread.

Theory of operation
-------------------
The host (vLLM's scheduler, a plain synchronous loop) must never block on the network,
and peers must be answered whatever the host is doing, even while it sits in a 2 s model
step. So :func:`start_node` runs :func:`~p2pkv.node.open_node` inside ``trio.run`` on an
:class:`~p2pkv.portal.EngineThread` of its own, and :class:`BlockingNode` reaches it two
ways, chosen by how often the host calls:

* **Blocking calls** for rare operations (``connect``, ``lookup``, ``lookup_round``,
  ``fetch``, ``release``, ``disconnect``, ``statistics``, ``close``) are portal round trips
  (:meth:`EngineThread.call`): the *caller* keeps the timeout, so it fires even when the
  engine thread is wedged in a blocking call; a stopped or dead engine gives
  :class:`~p2pkv.errors.PortalClosed` with the engine's failure as ``__cause__``; Trio's
  ``Cancelled`` never reaches the caller; a call from the engine thread itself raises
  instead of deadlocking. A round trip costs 70-160 us, far too much for a scheduler
  that calls every step, hence:
* **Hot-path calls** (``submit_connect``, ``submit_lookup``, ``submit_lookup_round``,
  ``submit_fetch``, ``submit_release``, ``poll``, ``get_finished``) never wait for the
  engine. A submit takes a ticket on a :class:`~p2pkv.tickets.TicketBoard` and posts "start
  this task" with :meth:`EngineThread.spawn_soon`: a deque append; if the loop is waiting
  for I/O and no wake is pending yet, also the release of a lock that the engine's waker
  thread waits on, and the waker wakes the loop (``TrioToken.run_sync_soon``); a loop that
  is running picks the posts up before it next waits. The host never writes to the loop's
  wakeup socket itself: that write drops the GIL, the woken loop grabs it, and the host
  would wait out a whole loop iteration (p99 233 us, max 8.7 ms measured on 2 cores,
  against 37 us / 67 us with the waker). The task publishes its value or exception on the
  board; ``poll`` and ``get_finished`` read the board under one short lock. Every
  submitted task runs under a deadline on the engine, so every ticket finishes.

Every ticket finishes, even when the engine does not: the engine's ``main`` fails every
in-flight ticket with ``PortalClosed`` in its ``finally`` and seals the board (a ticket
taken later is born failed). When main is cancelled instead (the engine died of something
else, or close() had to cancel it) it cannot see why, so the engine thread's
``on_finished`` hook does it once ``trio.run`` has returned, with the real failure as
``__cause__``; and ``close()`` seals the board itself when the engine thread is wedged and
neither ever runs. A submit that finds the engine stopping publishes the ``PortalClosed``
on its own ticket.

The :class:`~p2pkv.store.BlockStore` (``node.store``) is the one object both threads use
directly; its lock is held for microseconds. ``address`` and ``config`` are fixed once the
node listens, so reading them needs no hop either.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeVar, overload

import trio

from . import _switch
from .config import NodeConfig, check_seconds
from .errors import P2PKVError, P2PKVTimeout, PortalClosed
from .node import (
    Node,
    NodeStatistics,
    Peer,
    TransportFactory,
    check_activity,
    check_address,
    check_config,
    check_keys,
    check_peer,
    check_pin_source,
    open_node,
)
from .pins import PinSource
from .portal import EngineContext, EngineThread
from .registrar import Offload
from .session.consumer import read_caller_slots
from .session.session import FetchResult, LookupRound
from .store import BlockStore
from .tickets import TicketBoard

__all__ = ["BlockingNode", "TicketOutcome", "TicketResult", "start_node"]

T = TypeVar("T")
log = logging.getLogger("p2pkv.facade")

#: What a ticket resolves to: ``submit_connect`` -> Peer, ``submit_lookup`` -> list[bool],
#: ``submit_lookup_round`` -> LookupRound, ``submit_fetch`` -> FetchResult,
#: ``submit_release`` -> int.
TicketResult: TypeAlias = Peer | list[bool] | LookupRound | FetchResult | int
#: An entry of :meth:`BlockingNode.get_finished`: the result, or the exception it raised.
TicketOutcome: TypeAlias = TicketResult | BaseException

# Added to the config's own deadline for an operation, so that the engine's typed error
# (P2PKVTimeout with the peer and op) normally wins over the caller's generic one.
_MARGIN = 1.0
_QUICK_CALL = 10.0  # statistics, peers: no network, only a hop
_SEAL_WAIT = 0.1  # close(): the most it waits for the ticket board's lock (see close)


def start_node(
    cfg: NodeConfig,
    *,
    region: object | None = None,
    transport: TransportFactory | None = None,
    offload: Offload | None = None,
    pin_source: PinSource | None = None,
    start_timeout: float = 30.0,
) -> BlockingNode:
    """Run a node on a background engine thread; return once it listens.

    The arguments are :func:`~p2pkv.node.open_node`'s. Raises ``PortalClosed``
    (``__cause__``: why) if the node fails to start, ``P2PKVTimeout`` if it takes longer
    than ``start_timeout``. No thread is left behind either way: after a timeout the
    engine is cancelled and its thread joined, up to 5 s more for a call that cannot be
    cancelled (registering the region) to return; the error says if it outlived that.
    Close the node (or use it as a context manager) to stop the thread; one still
    running at interpreter exit is closed then.
    """
    check_config(cfg)
    check_pin_source(pin_source, cfg)
    start_timeout = check_seconds(start_timeout, "start_timeout")
    board: TicketBoard[TicketResult] = TicketBoard()

    async def main(ctx: EngineContext[Node]) -> None:
        failure: BaseException | None = None
        # Until the engine ends, however it ends: a host thread busy in Python gives the
        # engine the GIL within this interval (p2pkv._switch).
        interval = cfg.switch_interval
        release_interval = _switch.hold(interval) if interval is not None else None
        try:
            async with open_node(
                cfg, region=region, transport=transport, offload=offload, pin_source=pin_source
            ) as node:
                ctx.started(node)
                await ctx.wait_closing()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if release_interval is not None:
                release_interval()
            if failure is None:
                board.fail_all(_not_finished)
            elif not _is_cancellation(failure):
                board.fail_all(functools.partial(_closed, "node died", failure))
            # Cancelled: main cannot tell why; on_finished seals the board with the cause.

    def on_finished(failure: BaseException | None) -> None:
        board.fail_all(
            functools.partial(_closed, "node died", failure)
            if failure is not None
            else _not_finished
        )

    engine = EngineThread.start(
        main,
        name=f"p2pkv-engine-{cfg.peer_id}",
        start_timeout=start_timeout,
        on_finished=on_finished,
        on_forked=board.fail_all_in_forked_child,
        wake_thread=True,  # a submit never gives the GIL away (see EngineThread._post)
    )
    try:
        node = BlockingNode(engine, board)
        node._owns_engine = True  # the one facade whose loss stops the engine (see __del__)
    except BaseException:
        # Ctrl-C (any asynchronous exception) before the caller has a node to close: stop
        # the engine here, as EngineThread.start does when interrupted earlier.
        with contextlib.suppress(P2PKVError):
            engine.close(_close_bound(cfg) + _MARGIN)
        raise
    return node


class BlockingNode:
    """A node running on its own engine thread; every method may be called from any thread.

    Get one from :func:`start_node`. See the module docstring for which calls block.
    ``timeout=None`` means the node's configured deadline for that operation plus a
    second; every wait has a deadline. A connect's counts a dial that loses a
    simultaneous-dial tie-break and then waits for the winning session:
    ``connect_timeout + 2 * handshake_timeout``, and ``handshake_timeout`` more with TLS
    (its handshake has a deadline of its own). A fetch's counts its one more try (a
    lookup and a fetch again for keys answered ``lease_expired``, or ``not_pinned`` on
    the engine's own round): ``2 * (lookup_timeout + fetch_timeout)``, and ``quarantine`` more for
    ``fetch_into``. A fetch split into parts by the peer's landing share waits for room
    up to ``fetch_timeout`` per part, which no default counts: give such calls a
    ``timeout`` (or ``within``) of your own.
    """

    def __init__(self, engine: EngineThread[Node], board: TicketBoard[TicketResult]) -> None:
        # Private: use start_node().
        self._owns_engine = False
        self._engine = engine
        self._board = board
        self._node: Node = engine.value
        c = self._node.config
        # Computed once: a submit on the hot path should touch as little as it can.
        self._defaults = {
            op: base + _MARGIN
            for op, base in (
                # A dial that loses a simultaneous-dial tie-break waits for the winner up
                # to handshake_timeout after its own handshake; TLS has one of its own.
                (
                    "connect",
                    c.connect_timeout + (3 if c.tls_cert is not None else 2) * c.handshake_timeout,
                ),
                ("lookup", c.lookup_timeout),
                # A fetch may look its keys up and fetch them once more in the same
                # call (lease_expired, or not_pinned on the engine's own round).
                ("fetch", 2 * (c.lookup_timeout + c.fetch_timeout)),
                ("fetch_into", 2 * (c.lookup_timeout + c.fetch_timeout) + c.quarantine),
                ("disconnect", c.close_timeout),
                ("release", c.close_timeout),
                ("close", _close_bound(c)),
            )
        }

    # ---------------------------------------------------------------- read in place

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the node listens on."""
        return self._node.address

    @property
    def store(self) -> BlockStore:
        """The node's block store: the same object the engine uses (it is thread-safe)."""
        return self._node.store

    @property
    def config(self) -> NodeConfig:
        return self._node.config

    @property
    def peer_id(self) -> str:
        return self._node.config.peer_id

    @property
    def alive(self) -> bool:
        """False once the engine has stopped or died."""
        return self._engine.alive

    @property
    def failure(self) -> BaseException | None:
        """Why the engine died, if it did (``None`` while running and after a clean stop)."""
        return self._engine.failure

    # ---------------------------------------------------------------- blocking calls

    def connect(self, address: tuple[str, int], *, timeout: float | None = None) -> Peer:
        """Dial a peer; returns once both sides have registered each other."""
        return self._engine.call(
            self._node.connect, check_address(address), timeout=self._timeout("connect", timeout)
        )

    def lookup(
        self, peer: Peer | str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bool]:
        """Which ``keys`` the peer holds (hits stay pinned there for the lease)."""
        return self._engine.call(
            self._node.lookup,
            check_peer(peer),
            check_keys(keys),
            timeout=self._timeout("lookup", timeout),
        )

    def lookup_round(
        self, peer: Peer | str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> LookupRound:
        """:meth:`Node.lookup_round`: a lookup whose rounds stay the caller's (pass the
        handle to :meth:`fetch` or :meth:`release`)."""
        return self._engine.call(
            self._node.lookup_round,
            check_peer(peer),
            check_keys(keys),
            timeout=self._timeout("lookup", timeout),
        )

    def fetch(
        self,
        peer: Peer | str,
        keys: Sequence[bytes],
        *,
        rounds: LookupRound | Sequence[LookupRound] | None = None,
        timeout: float | None = None,
    ) -> FetchResult:
        """Pull ``keys`` into :attr:`store`; per-key failures are in ``result.failed``.
        ``rounds``: handles from :meth:`lookup_round` this fetch may use."""
        return self._engine.call(
            self._node.fetch,
            check_peer(peer),
            check_keys(keys),
            _own_rounds(rounds),
            timeout=self._timeout("fetch", timeout),
        )

    def release(
        self,
        peer: Peer | str,
        rounds: LookupRound | Sequence[LookupRound],
        *,
        timeout: float | None = None,
    ) -> int:
        """:meth:`Node.release`: give back the pins of the handles' unfetched rounds."""
        return self._engine.call(
            self._node.release,
            check_peer(peer),
            _own_rounds(rounds),
            timeout=self._timeout("release", timeout),
        )

    def release_unused_pins(self, *, cut_writes: bool = False, timeout: float | None = None) -> int:
        """Blocking :meth:`Node.release_unused_pins`."""
        return self._engine.call(
            functools.partial(self._node.release_unused_pins, cut_writes=cut_writes),
            timeout=self._timeout("release", timeout),
        )

    def disconnect(self, peer: Peer | str, *, timeout: float | None = None) -> None:
        self._engine.call(
            self._node.disconnect, check_peer(peer), timeout=self._timeout("disconnect", timeout)
        )

    def peers(self, *, timeout: float | None = None) -> list[Peer]:
        return self._engine.call(_call_sync, self._node.peers, timeout=self._quick(timeout))

    def statistics(self, *, timeout: float | None = None) -> NodeStatistics:
        return self._engine.call(_call_sync, self._node.statistics, timeout=self._quick(timeout))

    def close(self, *, timeout: float | None = None) -> None:
        """Close every session and stop the engine thread. Idempotent.

        Pending blocking calls get ``PortalClosed`` at once. In-flight tickets finish with
        what their operation makes of the node's close (a fetch: a ``FetchResult`` whose
        keys failed "session closed"; a connect in its handshake: ``PeerUnavailable``), or
        with ``PortalClosed`` if the engine stopped first; either way every one finishes,
        and a ticket taken after the close is born ``PortalClosed``. Raises
        ``P2PKVTimeout`` if the engine thread is wedged in a blocking call and does not end
        in time (a later close() may try again). ``timeout=None``: ``2 * close_timeout +
        abort_timeout`` plus a second (a write the close cuts may take ``abort_timeout``
        to settle before its session's teardown).
        """
        # Refused on the engine thread before anything is sealed: the node stays usable.
        self._engine._refuse_reentry("close")
        try:
            self._engine.close(self._timeout("close", timeout))
        finally:
            # Normally sealed already (by main or on_finished); this covers a wedged engine.
            # Not when the close never began (it could not take the engine's lock): the
            # engine runs on, and so does the work of every ticket in flight.
            # Bounded: a signal handler's close() may have interrupted this thread inside
            # a board call, holding its lock (the engine seals it once that call is over).
            if self._engine.closing:
                self._board.fail_all(_not_finished, within=_SEAL_WAIT)

    def __del__(self) -> None:
        # Like an unclosed socket or event loop: a node nobody can close any more warns
        # (an error in a test suite with filterwarnings = error) and its engine is asked
        # to stop, without waiting. Otherwise it would keep its threads, its port and its
        # hold on the switch interval until the interpreter's exit, silently.
        engine = self.__dict__.get("_engine")
        if not self.__dict__.get("_owns_engine"):  # a second view of another's engine
            return
        try:
            stopping = engine is not None and engine.close_soon()
        except Exception:  # at interpreter exit modules may be half torn down
            return
        if stopping:  # an error raised here is the interpreter's "unraisable" report
            warnings.warn(
                f"unclosed p2pkv node {self._node.config.peer_id!r}: call close(), or use "
                "the node as a context manager",
                ResourceWarning,
                source=self,
                stacklevel=2,
            )

    def __enter__(self) -> BlockingNode:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- hot path

    def is_connected(self, peer: Peer | str) -> bool:
        """Whether a session with ``peer`` is established right now: a snapshot read in
        place (no hop, never blocks), stale by the time the caller acts on it. For a host
        that keeps a :class:`Peer` across requests and must notice the session ended."""
        return self._node.is_connected(check_peer(peer))

    def submit_release(
        self,
        peer: Peer | str,
        rounds: LookupRound | Sequence[LookupRound],
        *,
        timeout: float | None = None,
    ) -> int:
        """Start :meth:`Node.release` (give back the pins of the handles' unfetched
        rounds); returns a ticket (result: the number of rounds closed)."""
        args = (check_peer(peer), _own_rounds(rounds))
        return self._submit(self._node.release, args, "release", timeout)

    def peer_count(self) -> int:
        """Sessions counted against ``max_peers`` right now, both directions: a snapshot
        read in place (no hop, never blocks)."""
        return self._node.peer_count()

    def session_activity(self, peer: Peer | str) -> tuple[int, int] | None:
        """:meth:`Node.session_activity`: read in place (no hop, never blocks)."""
        return self._node.session_activity(check_peer(peer))

    def submit_disconnect_idle(
        self, peer: Peer | str, activity: tuple[int, int], *, timeout: float | None = None
    ) -> int:
        """Start :meth:`Node.disconnect_idle` on the engine; returns a ticket (result: 1
        if the session was closed or gone, 0 if it was in use)."""
        args = (self._node, check_peer(peer), check_activity(activity))
        return self._submit(_disconnect_idle, args, "disconnect", timeout)

    def submit_connect(self, address: tuple[str, int], *, timeout: float | None = None) -> int:
        """Start :meth:`connect` on the engine; returns a ticket (result: Peer)."""
        return self._submit(self._node.connect, (check_address(address),), "connect", timeout)

    def submit_lookup(
        self, peer: Peer | str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> int:
        """Start :meth:`lookup` on the engine; returns a ticket (result: list[bool])."""
        return self._submit(
            self._node.lookup, (check_peer(peer), check_keys(keys)), "lookup", timeout
        )

    def submit_lookup_round(
        self, peer: Peer | str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> int:
        """Start :meth:`Node.lookup_round`; returns a ticket (result: LookupRound)."""
        args = (check_peer(peer), check_keys(keys))
        return self._submit(self._node.lookup_round, args, "lookup", timeout)

    def submit_fetch(
        self,
        peer: Peer | str,
        keys: Sequence[bytes],
        *,
        rounds: LookupRound | Sequence[LookupRound] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Start :meth:`fetch` on the engine; returns a ticket (result: FetchResult)."""
        args = (check_peer(peer), check_keys(keys), _own_rounds(rounds))
        return self._submit(self._node.fetch, args, "fetch", timeout)

    def submit_fetch_into(
        self,
        peer: Peer | str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        rounds: LookupRound | Sequence[LookupRound] | None = None,
        within: float | None = None,
        timeout: float | None = None,
    ) -> int:
        """Start :meth:`Node.fetch_into` (land ``keys[i]`` in region slot ``slots[i]``);
        returns a ticket (result: FetchResult, published only once no write into the
        slots can land any more). ``within``: the engine gives up that many seconds from
        now, lookups included (the ticket's ``timeout`` then defaults to ``within`` +
        ``config.quarantine`` + a second, which it never cuts). If the ticket ends in an
        exception instead (its timeout, node closed), the slots must be kept
        ``config.quarantine`` seconds more."""
        if within is not None:
            within = check_seconds(within, "within")
            if timeout is None:
                timeout = within + self._node.config.quarantine + _MARGIN
        args = (check_peer(peer), check_keys(keys), read_caller_slots(slots), _own_rounds(rounds))
        afn = self._node.fetch_into
        if within is not None:
            afn = functools.partial(afn, within=within)
        return self._submit(afn, args, "fetch_into", timeout)

    def poll(self, ticket: int) -> TicketResult | None:
        """None while the ticket is in flight; then its result, once (raising the
        exception it finished with, e.g. ``PeerUnavailable`` or ``PortalClosed``).

        KeyError for an unknown ticket or one already read (by poll or get_finished).
        """
        return self._board.poll(ticket)

    def get_finished(self) -> list[tuple[int, TicketOutcome]]:
        """Every finished ticket not read yet, in the order they finished, forgetting them.

        Drains the whole board: do not mix with :meth:`poll` from another component.
        """
        return self._board.drain_finished()

    def pending(self) -> int:
        """How many tickets are still in flight."""
        return self._board.pending()

    # ---------------------------------------------------------------- internals

    def _submit(
        self,
        afn: Callable[..., Awaitable[TicketResult]],
        args: tuple[Any, ...],
        op: str,
        timeout: float | None,
    ) -> int:
        limit = self._timeout(op, timeout)  # refused before a ticket is taken
        # The number first, then the ticket inside the try: a Ctrl-C (any exception raised
        # asynchronously in this thread) lands at a call's entry or after it returns, and
        # one after the ticket was taken must find the handler that withdraws it, or the
        # ticket the caller never gets stays in flight (pending()) until close().
        ticket = self._board.number()
        try:
            self._board.new_ticket(ticket)
            self._engine.spawn_soon(_serve_ticket, self._board, ticket, afn, args, op, limit)
        except PortalClosed as exc:
            self._board.publish(ticket, exc)
        except BaseException:
            self._board.withdraw(ticket)
            raise
        return ticket

    def _timeout(self, op: str, timeout: float | None) -> float:
        return self._defaults[op] if timeout is None else check_seconds(timeout, "timeout")

    @staticmethod
    def _quick(timeout: float | None) -> float:
        return _QUICK_CALL if timeout is None else check_seconds(timeout, "timeout")


@overload
def _own_rounds(rounds: None) -> None: ...
@overload
def _own_rounds(
    rounds: LookupRound | Iterable[LookupRound],
) -> LookupRound | list[LookupRound]: ...
def _own_rounds(
    rounds: LookupRound | Iterable[LookupRound] | None,
) -> LookupRound | list[LookupRound] | None:
    """The caller's ``rounds`` as a list of our own, read in the caller's thread as its
    keys are: the engine reads them later, while the host may already be reusing (or
    clearing) its list, and a generator would run on the engine's thread. Each item is
    checked there (LocalProtocolError), as a whole."""
    if rounds is None or isinstance(rounds, LookupRound):
        return rounds
    try:
        return list(rounds)
    except TypeError:
        raise TypeError(
            f"rounds must be a LookupRound or an iterable of them, got {rounds!r}"
        ) from None


async def _disconnect_idle(node: Node, peer: str, activity: tuple[int, int]) -> int:
    return int(await node.disconnect_idle(peer, activity))


async def _serve_ticket(
    board: TicketBoard[TicketResult],
    ticket: int,
    afn: Callable[..., Awaitable[TicketResult]],
    args: tuple[Any, ...],
    op: str,
    limit: float,
) -> None:
    """The engine side of a submit: run under a deadline, publish whatever comes out.

    Every ``Exception`` is published, never raised: one failed operation must not kill the
    engine. ``Cancelled`` (engine stopping) propagates; main's ``finally`` or the
    ``on_finished`` hook fails the ticket instead. So does an exception raised while the
    engine is stopping (this task already cancelled): whatever broke on the way out, the
    caller's answer is "the node closed", with the engine's failure as the cause.
    """
    outcome: TicketOutcome
    try:
        with trio.fail_after(limit):
            outcome = await afn(*args)
    except trio.TooSlowError:
        outcome = P2PKVTimeout(f"{op} timed out after {limit} s", op=op)
    except Exception as exc:
        if trio.current_effective_deadline() == -math.inf:
            log.debug("%s failed while the engine was stopping", op, exc_info=exc)
            return
        outcome = _unwrap(exc)
    board.publish(ticket, outcome)


async def _call_sync(fn: Callable[[], T]) -> T:
    """Run a sync engine-side method on the Trio thread (it touches engine-only state)."""
    return fn()


def _unwrap(exc: Exception) -> Exception:
    """A group with a single error in it (a nursery's way of raising one) is that error."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _close_bound(cfg: NodeConfig) -> float:
    """How long the engine may take to close: the sessions' close (``close_timeout``),
    a write each cuts and waits up to ``abort_timeout`` to settle (shielded: its pins
    and the region stay until then), then the session's bye and stream (a second each at
    most, ``close_timeout`` if less). ``2 * close_timeout`` alone was short of it wherever
    ``close_timeout`` is below ``abort_timeout`` + 2 s."""
    return 2 * cfg.close_timeout + cfg.abort_timeout


def _not_finished() -> PortalClosed:
    return PortalClosed("node is closed (the operation did not finish)", op="ticket")


def _closed(message: str, cause: BaseException | None) -> PortalClosed:
    err = PortalClosed(message, op="ticket")
    err.__cause__ = cause
    return err


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _match, rest = exc.split(trio.Cancelled)
        return rest is None
    return False
