"""Progress as the target of writes, from a thread of the transport's own.

A consumer waiting for a fetch's writes must keep the data plane progressing as their
target (NIXL: the first write after a registration needs it for the wire-up, every write
over tcp needs it throughout). Driven from the Trio thread, each progress step is a wake-up
of the whole engine: the epoll wait returning, a cancel scope's deadline firing, the
scheduler's batch, the completion poller's loop; measured per step ~380 us of Trio-thread
CPU on the 2-core VM and ~250 us on the GPU machine, against ~60 us for the progress call
itself, eight steps in a 64 ms fetch. A plain thread that only calls ``progress`` wakes for
a fraction of that, and the engine's thread sleeps through the copy.

:class:`TargetProgress` runs one such thread, started at the first :meth:`~TargetProgress.
hold`: while held it calls ``step`` with the completion poller's backoff (1 ms, doubling up
to 10 ms, back to 1 ms at each new hold, so a new peer's wire-up is prompt); with no hold it
waits on a condition and costs nothing; :meth:`~TargetProgress.stop` ends it (a ``step`` that
returns False ends it too: its transport is closing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_log = logging.getLogger("p2pkv.transport.nixl")

MIN_DELAY = 0.001  # the backoff, here and in the completion poller: 1 ms doubling to 10
MAX_DELAY = 0.010
JOIN_TIMEOUT_S = 5.0


class TargetProgress:
    def __init__(self, step: Callable[[], bool], name: str) -> None:
        self._step = step
        self._name = name
        self._cond = threading.Condition()
        self._holds = 0
        self._fresh = False  # a hold arrived since the last step: restart the backoff
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.ticks = 0  # steps taken (read without the lock: a counter for statistics)
        self.parked = False  # waiting for a hold (tests)

    @property
    def holds(self) -> int:
        return self._holds

    def hold(self) -> bool:
        """One more waiter for incoming writes: progress until it lets go. False (nothing
        held: the caller drives progress itself) once stopped, or if the thread cannot
        start. While the transport closes it may return True for a thread about to end;
        the step it would take does nothing then anyway."""
        with self._cond:
            if self._stopped:
                return False
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # e.g. at interpreter shutdown, or out of threads
                    _log.warning("no progress thread for %s", self._name, exc_info=True)
                    return False
                self._thread = thread
            self._holds += 1
            self._fresh = True
            self._cond.notify_all()
            return True

    def is_current(self) -> bool:
        """Whether the caller runs on this progress thread."""
        return self._thread is threading.current_thread()

    def release(self) -> None:
        """Undo one :meth:`hold` that returned True."""
        with self._cond:
            if self._holds <= 0:
                raise RuntimeError("release() without a hold")
            self._holds -= 1

    def stop(self) -> None:
        """End the thread (idempotent); waits for a step in progress unless called from
        the thread itself."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)

    def wait_parked(self, timeout: float) -> bool:
        """Until the thread waits for a hold (True), or ``timeout`` seconds pass."""
        with self._cond:
            return self._cond.wait_for(lambda: self.parked or self._stopped, timeout)

    def _run(self) -> None:
        cond = self._cond
        delay = MIN_DELAY
        while True:
            with cond:
                while self._holds <= 0 and not self._stopped:
                    self.parked = True
                    cond.notify_all()
                    cond.wait()
                self.parked = False
                if self._stopped:
                    return
                if self._fresh:
                    self._fresh = False
                    delay = MIN_DELAY
            if not self._step():
                with cond:
                    self._stopped = True
                    cond.notify_all()
                return
            self.ticks += 1
            with cond:
                if self._stopped:
                    return
                if not self._fresh:  # a new hold cuts the nap short (its wire-up)
                    cond.wait(delay)
            delay = min(delay * 2, MAX_DELAY)
