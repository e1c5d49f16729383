"""A Trio engine on its own thread, and the portal that foreign threads drive it through.

Theory of operation
-------------------
The host (vLLM's scheduler, or any synchronous loop stepping about once a second) must
never block on the network, and the engine must answer peers whatever the host is doing.
So the engine runs ``trio.run`` on a thread of its own, and the host reaches it three ways:

* ``call()``: a blocking round trip, for rare operations (connect, close). Each call is a
  ``concurrent.futures.Future`` that the *caller* waits on with its own timeout, plus a
  task in a portal-owned nursery under its own cancel scope (anyio's ``BlockingPortal``
  design). ``trio.from_thread.run`` is not used: it leaks ``trio.Cancelled`` into the
  foreign thread when the loop shuts down mid-call, and cannot time out when the loop is
  wedged in a blocking call.
* ``run_sync_soon()`` / ``spawn_soon()``: fire-and-forget posts for the hot path. They
  coalesce: a post appends to a deque, and only the first post after a drain pays for
  waking the loop (see ``_post``).
* a :class:`~p2pkv.tickets.TicketBoard`: the engine publishes results into it; the host
  reads them in place.

A call's future is never marked running, so ``Future.cancel()`` succeeds as long as the
call is unsettled; its done-callback cancels the task's scope. Whoever settles a future
first wins and later attempts are ignored: the task (its value or ``Exception``), the
caller (cancel on timeout), ``close()`` (``PortalClosed``), or the engine thread's final
sweep after ``trio.run`` has returned (``PortalClosed`` whose ``__cause__`` is the
engine's failure). The sweep is what guarantees that no caller waits forever: Trio runs
every ``run_sync_soon`` callback it accepted before ``trio.run`` returns, so once the
sweep has run, no unsettled future can still have a task coming for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, TypeVarTuple, Unpack, overload

import trio

from p2pkv.errors import P2PKVError, P2PKVTimeout, PortalClosed
from p2pkv.tickets import TicketBoard  # re-exported: it was born here

__all__ = ["EngineContext", "EngineThread", "TicketBoard"]

T = TypeVar("T")
V = TypeVar("V")
Ts = TypeVarTuple("Ts")

log = logging.getLogger(__name__)

# Share of close()'s timeout that main gets to finish on its own before it is cancelled.
_GRACEFUL_SHARE = 0.75
_EXIT_CLOSE_TIMEOUT = 5.0


class EngineContext(Generic[V]):
    """What ``main`` gets: the startup handshake, the close signal and the portal nursery."""

    def __init__(self, engine: EngineThread[V], nursery: trio.Nursery, closing: trio.Event):
        self._engine = engine
        self._closing = closing
        #: The portal nursery. Tasks started here die with the engine; an exception that
        #: escapes one of them kills the engine (it becomes ``EngineThread.failure``).
        self.nursery = nursery

    @overload
    def started(self: EngineContext[None]) -> None: ...
    @overload
    def started(self, value: V) -> None: ...
    def started(self, value: Any = None) -> None:
        """Release ``EngineThread.start()``, which returns with ``thread.value = value``.

        Like ``task_status.started()``: call it once the engine is ready to serve (for a
        node: listening), so that the host never sees a half-built engine.
        """
        self._engine._on_started(value)

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    async def wait_closing(self) -> None:
        """Return once ``close()`` was called: time for main to tear down and return."""
        await self._closing.wait()


class EngineThread(Generic[V]):
    """Runs ``trio.run(main)`` on a named non-daemon thread and lets foreign threads drive it.

    Non-daemon, so that an engine is never killed mid-write at interpreter exit; in
    exchange it must always end: ``close()`` joins it, and engines still running when the
    interpreter exits are closed then, once every other non-daemon thread has ended (see
    ``_close_all_at_exit``).
    """

    def __init__(self, main: Callable[[EngineContext[V]], Awaitable[object]], name: str) -> None:
        # Private: use start(). Everything below is guarded by _lock unless it says
        # "Trio thread only".
        self._main = main
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=False)
        self._started: concurrent.futures.Future[V] = concurrent.futures.Future()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closing = False  # close() was called (read unlocked on the hot path)
        self._finished = False  # trio.run has returned and the sweep ran
        self._cancel_requested = False
        self._failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # Trio thread only:
        self._nursery: trio.Nursery | None = None
        self._closing_event: trio.Event | None = None
        self._call_scopes: set[trio.CancelScope] = set()
        self._crash: BaseException | None = None
        # Hot-path posts (see _post): appended by any thread, popped by the Trio thread.
        self._posts: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._drain_scheduled = False
        self._on_finished: Callable[[BaseException | None], object] | None = None
        self._on_forked: Callable[[Callable[[], PortalClosed]], object] | None = None
        self._forked = False  # this is a child forked from the engine's process
        # Optional waker thread (see _post): a post releases _wake_lock (held while no
        # wake is pending), the waker wakes the loop. Started and joined by _thread_main.
        self._waker: threading.Thread | None = None
        self._wake_lock = threading.Lock()
        self._wake_lock.acquire()
        self._waker_stop = False
        # With a waker: False while the loop runs (it drains posts before it sleeps, see
        # _LoopWatch), True while it waits for I/O (a post must wake it).
        self._loop_idle = True

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def start(
        cls,
        main: Callable[[EngineContext[V]], Awaitable[object]],
        *,
        name: str = "p2pkv-engine",
        start_timeout: float = 10.0,
        on_finished: Callable[[BaseException | None], object] | None = None,
        on_forked: Callable[[Callable[[], PortalClosed]], object] | None = None,
        wake_thread: bool = False,
    ) -> EngineThread[V]:
        """Start the engine thread; return once ``main`` has called ``ctx.started()``.

        Raises ``PortalClosed`` (``__cause__``: what main raised) if the engine ended
        before it started, and ``P2PKVTimeout`` after ``start_timeout``: the engine is
        then cancelled, and its thread joined (up to 5 s more, for a blocking call that
        cannot be cancelled, such as registering the region, to return), so that a slow
        start leaves no thread behind; the error says if the thread outlived that bound.

        ``on_finished(failure)`` runs on the engine thread once ``trio.run`` has returned
        and ``failure`` is final (``None`` after a clean stop), before pending calls are
        swept: the place to fail results published outside the portal (a TicketBoard)
        with the engine's real failure, which main itself may only see as ``Cancelled``.

        ``on_forked(make)`` runs in a child forked from this process, on the thread that
        forked, right after the fork (the engine thread is not copied into the child: its
        calls and posts fail there at once, see ``_orphaned_by_fork``): the place to
        finish results published outside the portal, each with an error of ``make()``.

        ``wake_thread``: hot-path posts wake the loop through a helper thread instead of
        writing to Trio's wakeup socket themselves (see ``_post``): a post then never gives
        the GIL away, at the price of one more (daemon, idle) thread per engine.
        """
        self: EngineThread[V] = cls(main, name)
        self._on_finished = on_finished
        self._on_forked = on_forked
        if wake_thread:
            self._waker = threading.Thread(
                target=self._waker_main, name=f"{name}-waker", daemon=True
            )
        _register_for_exit(self)
        self._thread.start()
        try:
            self._started.result(_wait_bound(start_timeout))
        except TimeoutError:
            # Cancelled at its next checkpoint; a blocking call it is in (registering a
            # large region with NIXL) runs to its end first, and the caller may free what
            # that call reads once we return: wait for it, within a bound.
            self._request_cancel()
            self._thread.join(_EXIT_CLOSE_TIMEOUT)
            still = (
                "; its thread is still running (in a call that cannot be cancelled) and "
                "ends on its own"
                if self._thread.is_alive()
                else ""
            )
            raise P2PKVTimeout(
                f"engine did not start within {start_timeout} s{still}", op="start"
            ) from None
        except PortalClosed:
            # The engine ended before it started: its thread settles this future as its
            # very last step, so it is gone a moment later. No thread is left behind.
            self._thread.join(_EXIT_CLOSE_TIMEOUT)
            raise
        except BaseException:  # e.g. Ctrl-C while it starts: stop it as a timeout does
            self._request_cancel()
            self._thread.join(min(1.0, _wait_bound(start_timeout)))
            raise
        return self

    @property
    def value(self) -> V:
        """What main passed to ``ctx.started()``."""
        return self._started.result(0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._finished

    @property
    def failure(self) -> BaseException | None:
        """Why the engine died, if it did (``None`` after a clean stop)."""
        return self._failure

    @property
    def closing(self) -> bool:
        """``close()`` has begun (or the engine is a forked child's, which never runs):
        False after a close that could not take the lock, which asked nothing."""
        return self._closing

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine and join its thread. Idempotent.

        Pending calls fail at once with ``PortalClosed`` (settled from this thread, so this
        works even when the engine is wedged), then ``ctx.wait_closing()`` returns and
        main gets ``_GRACEFUL_SHARE`` of ``timeout`` to tear down; after that main is
        cancelled. Raises ``P2PKVTimeout`` if the thread is still alive at the end
        (wedged in a blocking call): the thread is then leaked, and a later close() may
        try again.
        """
        self._refuse_reentry("close")
        deadline = time.monotonic() + timeout
        # Bounded, unlike every other taker of this lock (each holds it for a few dict
        # operations): a close() from a signal handler may have interrupted this very
        # thread inside a call that holds it, and would wait for ever.
        if not self._lock.acquire(timeout=_wait_bound(timeout)):
            raise P2PKVTimeout(
                "close() could not take the engine's lock: is it called from a signal "
                "handler that interrupted a p2pkv call on this thread? Close it after "
                "the handler returns",
                op="close",
            )
        try:
            self._closing = True
            pending = list(self._pending)
            token = self._token
        finally:
            self._lock.release()
        for fut in pending:
            _settle_exc(fut, PortalClosed("engine closed while the call was pending", op="call"))
        # Asked by every close, not only the first: a Ctrl-C may have ended an earlier
        # one between marking the engine closing and asking (_begin_close is idempotent),
        # and main would then be cancelled after 3/4 of this timeout, never closed.
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._begin_close)
        self._thread.join(_wait_bound(max(0.0, timeout * _GRACEFUL_SHARE)))
        if self._thread.is_alive():
            self._request_cancel()
            self._thread.join(_wait_bound(max(0.0, deadline - time.monotonic())))
        if self._thread.is_alive():
            raise P2PKVTimeout(f"engine thread did not stop within {timeout} s", op="close")

    def close_soon(self) -> bool:
        """Ask a running engine to stop, and return at once (no lock, no join): for a
        finaliser, which may run on any thread, the engine's included, at any point of
        its work. True if the engine was running and has been asked to stop."""
        token = self._token
        if token is None or self._closing or self._finished or self._forked:
            return False
        try:
            token.run_sync_soon(self._begin_close)
        except trio.RunFinishedError:
            return False
        return True

    def __enter__(self) -> EngineThread[V]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- the portal

    def call(
        self,
        afn: Callable[[Unpack[Ts]], Awaitable[T]],
        *args: *Ts,
        timeout: float | None,
    ) -> T:
        """Run ``await afn(*args)`` on the engine and return its value (blocking).

        The timeout is kept by the caller, so it fires even when the engine thread is
        stuck in a blocking call; the task is then cancelled, best effort (P2PKVTimeout).
        Exceptions from afn are re-raised as they are; a stopped or dying engine gives
        ``PortalClosed``; nothing of Trio's own (``Cancelled``) ever comes out.
        """
        self._refuse_reentry("call")
        if trio.lowlevel.in_trio_run():
            # It would block that whole loop, and wait out its deadline if the work needs
            # the loop (a peer that is an open_node in it), as trio.from_thread.run
            # refuses to.
            raise P2PKVError(
                "a blocking call from inside a Trio run would block that loop: use "
                "open_node in Trio code, or trio.to_thread.run_sync(...) for this call",
                op="call",
            )
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            # Registered inside the try: a Ctrl-C as the lock is let go must find the
            # finally that takes the future back.
            with self._lock:
                if self._closing or self._finished:
                    raise self._closed_error("call")
                self._pending.add(fut)
                token = self._token
            assert token is not None  # set before started(), and start() waited for that
            try:
                token.run_sync_soon(self._spawn_call, afn, args, fut)
            except trio.RunFinishedError:
                raise self._closed_error("call") from None
            try:
                fut.exception(None if timeout is None else _wait_bound(timeout))
            except TimeoutError:
                if fut.cancel():
                    name = getattr(afn, "__qualname__", repr(afn))
                    raise P2PKVTimeout(
                        f"portal call {name} timed out after {timeout} s", op="call"
                    ) from None
                # Settled in the race with our cancel: fall through to the outcome.
            return fut.result(0)
        finally:
            # No-op once settled; if the caller is leaving early (KeyboardInterrupt in
            # the wait), this cancels the engine task instead of orphaning it.
            fut.cancel()
            with self._lock:
                self._pending.discard(fut)

    def run_sync_soon(self, fn: Callable[[], object]) -> None:
        """Post ``fn()`` to run on the Trio thread, in post order; never blocks.

        An exception from fn kills the engine with that exception as its ``failure``
        (rather than Trio's ``TrioInternalError``): a failing command is a bug that
        should stop the engine loudly, not be dropped.
        """
        self._post("run_sync_soon", fn, ())

    def spawn_soon(self, afn: Callable[[Unpack[Ts]], Awaitable[object]], *args: *Ts) -> None:
        """Post "start ``afn(*args)`` in the portal nursery"; never blocks or waits.

        Nursery semantics: an exception escaping the task kills the engine. A post that
        arrives while the engine is stopping is dropped.
        """
        self._post("spawn_soon", self._spawn_posted, (afn, args))

    def _post(self, op: str, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        # Posts coalesce: the host appends to a deque and wakes the loop only when no
        # drain is scheduled yet. A wakeup (Trio's lock + a write to its wakeup socket
        # that wakes a sleeping thread) measured p50 13 / p99 37 us on a 16-core host; a
        # burst of posts in one scheduler step pays it once, the rest cost a deque append
        # (0.4 us). _drain_posts clears the flag *before* it pops, so a post that finds
        # the flag set is seen by that drain.
        #
        # With a waker thread the host does not even pay that wakeup: the socket write
        # drops the GIL, and the loop it wakes usually takes the GIL first, so the host
        # waits for a whole loop iteration (measured on 2 cores: p50 47 us, p99 233 us,
        # max 8.7 ms). Releasing a Lock the waker blocks on is a futex wake that keeps the
        # GIL (p50 15, p99 37, max 67 us there); the waker wakes the loop once the host
        # lets go of the GIL, which is no later than the loop could have run anyway. And
        # while the loop is running (not waiting for I/O) no wake is needed at all: it
        # looks at the flag before it sleeps (_LoopWatch). Flag first, then _loop_idle
        # here; _loop_idle first, then the flag there: one of the two always sees the
        # other's write (the GIL orders them), so no post is left without a drain.
        if self._closing or self._finished:
            raise self._closed_error(op)
        self._posts.append((fn, args))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            # Between the flag and the wake, Ctrl-C (any exception raised asynchronously in
            # this thread) must not leave the flag set with nobody woken: every later post
            # would see it and wake nobody either. Such an exception lands only at a
            # call's entry or after a call returns, so the waker's release is the first
            # call after the flag (no contextlib.suppress: entering it is a call), and the
            # run_sync_soon path takes the flag back if its call is interrupted.
            if self._waker is not None:
                if self._loop_idle:
                    # Already released (posters raced past the flag): a wake is pending.
                    try:  # noqa: SIM105 (contextlib.suppress: entering it is a call)
                        self._wake_lock.release()
                    except RuntimeError:
                        pass
                return
            token = self._token
            assert token is not None  # set before started(); start() waited for it
            try:
                token.run_sync_soon(self._drain_posts)
            except trio.RunFinishedError:
                self._drain_scheduled = False  # or every later post would pass silently
                raise self._closed_error(op) from None
            except BaseException:
                self._drain_scheduled = False  # interrupted: the next post wakes the loop
                raise

    # ---------------------------------------------------------------- foreign-thread helpers

    def _refuse_reentry(self, op: str) -> None:
        if threading.get_ident() == self._thread.ident:
            raise P2PKVError(
                f"re-entrant {op}() from the engine thread would deadlock; await it instead",
                op=op,
            )

    def _closed_error(self, op: str) -> PortalClosed:
        if self._forked:
            return PortalClosed(
                "the engine runs in the process this one was forked from; start a node "
                "in this process to use p2pkv here",
                op=op,
            )
        failure = self._failure
        err = PortalClosed("engine died" if failure else "engine has stopped", op=op)
        err.__cause__ = failure
        return err

    def _orphaned_by_fork(self) -> None:
        """In a child just forked (``os.register_at_fork``): only the forking thread was
        copied, so this engine will never run here. Calls and posts fail at once, rather
        than queue to a loop that does not exist and wait out their timeouts (tickets for
        ever). Locks are new ones: a thread of the parent may have held them at the fork.
        Nothing is sent or closed: the sockets and the NIXL agent are the parent's."""
        self._lock = threading.Lock()
        self._forked = True
        self._closing = self._finished = True
        self._token = None
        self._pending = set()  # nobody here waits on them: the forking thread forked
        self._posts.clear()
        if self._on_forked is not None:
            self._on_forked(functools.partial(self._closed_error, "fork"))

    def _request_cancel(self) -> None:
        """Cancel the whole engine, main included (the hard half of close())."""
        with self._lock:
            self._cancel_requested = True
            token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._cancel_root)

    # ---------------------------------------------------------------- engine thread

    def _thread_main(self) -> None:
        failure: BaseException | None = None
        if self._waker is not None:
            self._waker.start()
        try:
            trio.run(self._root)
        except BaseException as exc:  # recorded, never re-raised: the thread must end quietly
            failure = _unwrap(exc)
        if self._waker is not None:
            self._waker_stop = True
            with contextlib.suppress(RuntimeError):
                self._wake_lock.release()
            self._waker.join(_EXIT_CLOSE_TIMEOUT)
        if failure is None:
            failure = self._crash  # a posted callback failed after the root task ended
        started = self._started.done()
        if failure is not None and started:
            # A failure to start is raised to start()'s caller (below), whose own handling
            # decides what to print: a traceback here too said it twice.
            log.error("p2pkv engine %r died", self._thread.name, exc_info=failure)
        with self._lock:
            self._failure = failure
            self._finished = True
            pending = list(self._pending)
        if self._on_finished is not None:
            try:
                self._on_finished(failure)
            except Exception:
                log.exception("on_finished hook of engine %r failed", self._thread.name)
        for fut in pending:
            err = PortalClosed(
                "engine died" if failure else "engine stopped while the call was pending",
                op="call",
            )
            err.__cause__ = failure
            _settle_exc(fut, err)
        if not started:
            cause = failure or P2PKVError("main returned before calling ctx.started()")
            # The reason in the message itself: a caller who prints str(exc) sees why
            # (e.g. "[Errno 98] Address already in use"), not only that it ended.
            err = PortalClosed(f"engine could not start: {cause}", op="start")
            err.__cause__ = cause
            _settle_exc(self._started, err)

    async def _root(self) -> None:
        closing = trio.Event()
        self._closing_event = closing
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            with self._lock:
                self._token = trio.lowlevel.current_trio_token()
                if self._waker is not None:
                    trio.lowlevel.add_instrument(_LoopWatch(self, self._token))
                if self._cancel_requested:
                    nursery.cancel_scope.cancel()
                if self._closing:  # close() raced with a start timeout
                    closing.set()
            await self._main(EngineContext(self, nursery, closing))
            # main returning ends the engine: its background tasks and calls go too.
            nursery.cancel_scope.cancel()
        if self._crash is not None:
            raise self._crash

    def _waker_main(self) -> None:
        """The waker thread: wake the loop once per release of ``_wake_lock``."""
        while True:
            self._wake_lock.acquire()
            token = self._token
            if self._waker_stop or token is None:
                return
            try:
                token.run_sync_soon(self._drain_posts)
            except trio.RunFinishedError:
                return  # the run is over: later posts raise PortalClosed (_finished)

    def _on_started(self, value: V) -> None:
        if self._started.done():
            raise RuntimeError("ctx.started() called twice")
        self._started.set_result(value)

    def _begin_close(self) -> None:
        assert self._closing_event is not None
        self._closing_event.set()
        for scope in self._call_scopes:
            scope.cancel()

    def _cancel_root(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _drain_posts(self) -> None:
        self._drain_scheduled = False
        for _ in range(len(self._posts)):  # bounded: later posts schedule their own drain
            fn, args = self._posts.popleft()
            try:
                fn(*args)
            except BaseException as exc:  # see run_sync_soon(): a failed command is fatal
                if self._crash is None:
                    self._crash = exc
                self._cancel_root()

    def _spawn_posted(self, afn: Callable[..., Awaitable[object]], args: tuple[Any, ...]) -> None:
        if self._nursery is None:
            return
        with contextlib.suppress(RuntimeError):  # nursery closed: the engine is stopping
            self._nursery.start_soon(afn, *args)

    def _spawn_call(
        self,
        afn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        fut: concurrent.futures.Future[Any],
    ) -> None:
        if fut.done() or self._nursery is None:  # timed out or closed before it began
            return
        # RuntimeError: nursery closed; the final sweep settles fut with the cause.
        with contextlib.suppress(RuntimeError):
            self._nursery.start_soon(self._run_call, afn, args, fut, name=afn)

    async def _run_call(
        self,
        afn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        fut: concurrent.futures.Future[Any],
    ) -> None:
        scope = trio.CancelScope()
        token = trio.lowlevel.current_trio_token()

        def on_done(f: concurrent.futures.Future[Any]) -> None:
            if f.cancelled():  # the caller timed out: stop the work, best effort
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(scope.cancel)

        self._call_scopes.add(scope)
        fut.add_done_callback(on_done)
        try:
            with scope:
                value = await afn(*args)
                _settle_result(fut, value)
        except Exception as exc:
            _settle_exc(fut, exc)
        # BaseExceptions (Cancelled from outside, KeyboardInterrupt) propagate and stop the
        # engine or belong to its shutdown; the final sweep settles fut with PortalClosed.
        finally:
            self._call_scopes.discard(scope)


class _LoopWatch(trio.abc.Instrument):
    """Tells hot-path posters whether the loop is running (no wake needed) or about to
    wait for I/O; drains what was posted while it ran before it sleeps. See _post."""

    def __init__(self, engine: EngineThread[Any], token: trio.lowlevel.TrioToken) -> None:
        self._engine = engine
        self._token = token

    def before_io_wait(self, timeout: float) -> None:
        engine = self._engine
        engine._loop_idle = True
        if engine._drain_scheduled:  # posted while the loop ran: nobody woke it
            self._token.run_sync_soon(engine._drain_posts)

    def after_io_wait(self, timeout: float) -> None:
        self._engine._loop_idle = False


# ---------------------------------------------------------------- helpers


def _wait_bound(seconds: float) -> float:
    """``seconds`` as a timeout threading's waits take: they raise OverflowError past
    ``threading.TIMEOUT_MAX`` (about 292 years), ``math.inf`` included, and a join
    that raised it left the thread marked stopped while it still ran."""
    return min(seconds, threading.TIMEOUT_MAX)


def _settle_result(fut: concurrent.futures.Future[T], value: T) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # settled already
        fut.set_result(value)


def _settle_exc(fut: concurrent.futures.Future[Any], exc: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        fut.set_exception(exc)


def _unwrap(exc: BaseException) -> BaseException:
    """Keep the engine's failure typed: a nursery wraps even a single error in a group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# Engines still running at interpreter exit. Python joins non-daemon threads *before*
# atexit handlers run, so a plain atexit handler would never get its turn; threading's
# private _register_atexit hook (which concurrent.futures uses for the same reason) runs
# before that join. It runs as the main thread returns, which is not the program's end
# while another non-daemon thread runs (a host's serving thread): the engines are closed
# once those have ended (see _close_all_at_exit).
_live: weakref.WeakSet[EngineThread[Any]] = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _orphan_all_in_child() -> None:
    global _exit_hook_lock
    _exit_hook_lock = threading.Lock()  # a parent thread starting an engine may have held it
    for engine in list(_live):
        engine._orphaned_by_fork()


os.register_at_fork(after_in_child=_orphan_all_in_child)


def _close_all_at_exit() -> None:
    """Threading's exit hook: close every engine still running, once the program ends.

    It runs as the main thread returns; Python then waits for the non-daemon threads. While
    one of those (other than the engines') still runs, the program goes on, and so may its
    use of a node: the engines are closed by a daemon thread once every such thread has
    ended (Python waits for them anyway), not under them."""
    if not _host_threads():
        _close_engines()
        return
    threading.Thread(target=_close_after_hosts, name="p2pkv-exit", daemon=True).start()


def _host_threads() -> list[threading.Thread]:
    """The non-daemon threads Python's exit waits for, other than the engines and this one
    (and the main thread, which has returned: it runs the hook, then waits)."""
    ours = {engine._thread for engine in list(_live)}
    ours.update((threading.main_thread(), threading.current_thread()))
    return [t for t in threading.enumerate() if not t.daemon and t not in ours]


def _close_after_hosts() -> None:
    while hosts := _host_threads():  # a host may start another before it ends
        for thread in hosts:
            thread.join()
    _close_engines()


def _close_engines() -> None:
    for engine in list(_live):
        try:
            engine.close(timeout=_EXIT_CLOSE_TIMEOUT)
        except Exception:
            log.exception("p2pkv engine %r did not stop at interpreter exit", engine)


def _register_for_exit(engine: EngineThread[Any]) -> None:
    global _exit_hook_registered
    with _exit_hook_lock:
        _live.add(engine)
        if _exit_hook_registered:
            return
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is not None:
                register(_close_all_at_exit)
            else:  # pragma: no cover - other Pythons: better late than never
                import atexit

                atexit.register(_close_all_at_exit)
        except RuntimeError:  # already shutting down
            return
        _exit_hook_registered = True
