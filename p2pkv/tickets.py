"""The ticket board: results the engine publishes and the host thread reads in place.

The sync facade's hot path (``submit_*`` then ``poll`` every scheduler step) must never
wait on the engine. So a submit takes a ticket here, the engine publishes the outcome under
that ticket when the work ends, and the host reads it under one short lock, with no thread
hop and no Trio call. When the engine stops, :meth:`TicketBoard.fail_all` finishes every
ticket still in flight and seals the board, so no ticket waits forever.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["TicketBoard"]

T = TypeVar("T")

# One count for every board in the process: a ticket of one node asked of another is
# unknown there (KeyError), never that node's own ticket of the same number.
_numbers = itertools.count()


class TicketBoard(Generic[T]):
    """Results the engine publishes and the host reads in place, without a thread hop.

    Every method takes one ``threading.Lock`` for a few dict operations and makes no Trio
    call, so the host's hot path (``poll`` every scheduler step) costs microseconds
    whatever the engine is doing. ``None`` means "in flight", so ``T`` should not
    include ``None``.

    After ``fail_all(make)`` the board is sealed: the engine is gone, so a ticket handed
    out later is born finished with an exception of ``make()`` instead of waiting forever.
    Each ticket gets an exception of its own: one instance raised again and again (by
    every poll of a host that keeps trying) would carry every raiser's frames in its
    traceback, and keep them alive. A publish for a ticket that ``fail_all`` finished
    first (the engine stopping) is ignored; a ticket this board never handed out is
    unknown (KeyError) everywhere: ticket numbers are unique in the process, so one
    node's ticket asked of another never reads that node's own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        # Handed out here and not published yet (whether or not fail_all finished them):
        # what tells a late publish of ours (ignored) from a ticket that is not ours.
        self._unpublished: set[int] = set()
        self._finished: dict[int, T | BaseException] = {}
        self._sealed: Callable[[], BaseException] | None = None

    @staticmethod
    def number() -> int:
        """A ticket number for :meth:`new_ticket`, unique in the process. Nothing is held
        for it: a caller interrupted before it took the ticket has nothing to undo."""
        return next(_numbers)

    def new_ticket(self, ticket: int | None = None) -> int:
        """Hand out a ticket (``ticket``, from :meth:`number`, or a new number)."""
        with self._lock:
            if ticket is None:
                ticket = next(_numbers)
            self._unpublished.add(ticket)
            if self._sealed is not None:
                self._finished[ticket] = self._sealed()
            else:
                self._in_flight.add(ticket)
            return ticket

    def publish(self, ticket: int, outcome: T | BaseException) -> bool:
        """Finish ``ticket``. False if ``fail_all`` finished it first (that outcome
        stands); KeyError for a ticket not ours or published already."""
        with self._lock:
            if ticket in self._in_flight:
                self._in_flight.remove(ticket)
                self._unpublished.discard(ticket)
                self._finished[ticket] = outcome
                return True
            if ticket in self._unpublished:
                self._unpublished.discard(ticket)
                return False
        raise KeyError(ticket)

    def withdraw(self, ticket: int) -> None:
        """Forget a ticket whose submit was interrupted (Ctrl-C) before the caller got it:
        no longer in flight, its outcome (if any) gone, a later publish ignored. Its work
        may have been posted and still run; nobody can read its outcome."""
        with self._lock:
            self._in_flight.discard(ticket)
            self._finished.pop(ticket, None)
            # Unpublished, it stays so: a publish may still come (ignored), or none (the
            # post never happened) and the number stays there, never counted or read.

    def poll(self, ticket: int) -> T | None:
        """None while in flight; then the result (or raise the published exception), once."""
        with self._lock:
            if ticket in self._in_flight:
                return None
            outcome = self._finished.pop(ticket)  # KeyError: unknown or already read
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def drain_finished(self) -> list[tuple[int, T | BaseException]]:
        """Every finished ticket in the order it finished, forgetting them."""
        with self._lock:
            done = list(self._finished.items())
            self._finished.clear()
        return done

    def fail_all(self, make: Callable[[], BaseException], *, within: float | None = None) -> bool:
        """Finish every in-flight ticket with an exception of ``make()`` (a fresh one
        each) and seal the board (engine stopping). The first seal's ``make`` stands.

        ``within``: wait at most that long for the lock, and give up (False) past it. For
        a host thread's ``close()``, which may run in a signal handler that interrupted
        this very thread inside a board call, holding the lock (an unbounded wait would
        never end); the engine seals the board itself as it stops."""
        if not self._lock.acquire(timeout=-1 if within is None else within):
            return False
        try:
            for ticket in self._in_flight:
                self._finished[ticket] = make()
            self._in_flight.clear()
            if self._sealed is None:
                self._sealed = make
        finally:
            self._lock.release()
        return True

    def fail_all_in_forked_child(self, make: Callable[[], BaseException]) -> None:
        """:meth:`fail_all` in a process just forked: the lock is a new one (another
        thread of the parent may have held it at the fork, and no thread here ever lets
        it go)."""
        self._lock = threading.Lock()
        self.fail_all(make)

    def pending(self) -> int:
        """How many tickets are still in flight (finished but unread ones do not count)."""
        with self._lock:
            return len(self._in_flight)
