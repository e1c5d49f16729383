"""The transport's own progress thread (``p2pkv.transport._progress``): it steps only
while held, parks when not, and ends with its transport. Real threads, no Trio; the step
is a FAKE counter except in the last tests, which run it on a real NIXL transport."""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest

from p2pkv.transport._progress import TargetProgress
from p2pkv.transport.base import RegionLayout

WAIT_S = 10.0  # generous: a bound on a hang, never a timing assertion
_HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))


class Steps:
    """FAKE step: counts calls, notes the calling thread, sets ``reached`` at ``target``."""

    def __init__(self, target: int, result: bool = True) -> None:
        self.target = target
        self.result = result
        self.calls = 0
        self.threads: set[str] = set()
        self.reached = threading.Event()

    def __call__(self) -> bool:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls >= self.target:
            self.reached.set()
        return self.result


def test_it_steps_from_its_own_thread_while_held_and_parks_when_let_go() -> None:
    steps = Steps(target=3)
    tp = TargetProgress(steps, "tp-test")
    try:
        assert tp.ticks == 0 and not steps.calls  # no thread before the first hold
        assert tp.hold()
        assert steps.reached.wait(WAIT_S)
        assert steps.threads == {"tp-test"}
        tp.release()
        assert tp.wait_parked(WAIT_S)
        assert tp.holds == 0 and tp.ticks == steps.calls
        steps.target, steps.reached = steps.calls + 2, threading.Event()
        assert tp.hold()  # and it comes back when held again
        assert steps.reached.wait(WAIT_S)
        tp.release()
    finally:
        tp.stop()


def test_release_without_a_hold_is_refused() -> None:
    tp = TargetProgress(Steps(target=1), "tp-unheld")
    with pytest.raises(RuntimeError):
        tp.release()
    tp.stop()


def test_stop_ends_a_held_thread_and_later_holds_are_refused() -> None:
    steps = Steps(target=1)
    tp = TargetProgress(steps, "tp-stop")
    assert tp.hold()
    assert steps.reached.wait(WAIT_S)
    thread = tp._thread
    assert thread is not None
    tp.stop()  # held: it must end anyway
    assert not thread.is_alive()
    assert not tp.hold()
    tp.stop()  # idempotent


def test_a_step_that_finds_its_transport_closing_ends_the_thread() -> None:
    steps = Steps(target=1, result=False)
    tp = TargetProgress(steps, "tp-closing")
    assert tp.hold()
    assert steps.reached.wait(WAIT_S)
    thread = tp._thread
    assert thread is not None
    thread.join(WAIT_S)
    assert not thread.is_alive() and steps.calls == 1
    assert not tp.hold()


needs_nixl = pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13")


@needs_nixl
def test_closing_a_nixl_transport_ends_its_progress_thread_even_while_held() -> None:
    from p2pkv.transport.nixl import NixlTransport

    array = np.zeros(8 * 4096, dtype=np.uint8)
    transport = NixlTransport.create(
        agent_name="tp-nixl", region=array, layout=RegionLayout(array.ctypes.data, 8, 4096)
    )
    target = transport._state.target
    assert transport.hold_target_progress()
    thread = target._thread
    assert thread is not None
    transport.close()
    assert not thread.is_alive()
    assert not transport.hold_target_progress()  # closed: the caller drives nothing
    assert transport.statistics().progress_ticks == target.ticks


class Naps(threading.Condition):
    """The progress thread's condition, noting each nap (a wait with a timeout) that
    ``thread`` takes; waits without a timeout (parked) and other threads' go unnoted."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None
        self.taken: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None and threading.current_thread() is self.thread:
            self.taken.append(timeout)
        return super().wait(timeout)


def test_the_backoff_doubles_to_its_cap_and_restarts_at_each_new_hold() -> None:
    """1 ms between steps, doubling to 10 ms, and back to 1 ms when held again (a new
    peer's wire-up is prompt). The naps are read off the thread's condition, not timed."""
    naps = Naps()
    left = [6]  # steps before the step that lets go
    done = threading.Event()

    def step() -> bool:
        naps.thread = threading.current_thread()
        left[0] -= 1
        if left[0] == 0:
            tp.release()  # the thread naps once more, then parks
            done.set()
        return True

    tp = TargetProgress(step, "tp-backoff")
    tp._cond = naps  # before the thread exists: it reads the attribute at every turn
    try:
        assert tp.hold()
        assert done.wait(WAIT_S) and tp.wait_parked(WAIT_S)
        assert naps.taken == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.010, 0.010])
        naps.taken.clear()
        left[0] = 2
        done = threading.Event()  # a new one: the thread is parked, step() reads it anew
        assert tp.hold()
        assert done.wait(WAIT_S) and tp.wait_parked(WAIT_S)
        assert naps.taken == pytest.approx([0.001, 0.002])
    finally:
        tp.stop()


def test_a_step_that_stops_its_own_thread_ends_it_without_waiting_for_itself() -> None:
    """The transport may close on its progress thread, inside a step: stop() from there
    must neither join the thread it runs on (a RuntimeError) nor hang; the thread ends
    once the step is over, and later holds are refused."""
    errors: list[BaseException] = []

    def step() -> bool:
        try:
            tp.stop()
        except BaseException as exc:  # what the thread would die of
            errors.append(exc)
        return True

    tp = TargetProgress(step, "tp-self-stop")
    assert tp.hold()
    thread = tp._thread
    assert thread is not None
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert errors == []
    assert tp.ticks == 1
    assert not tp.hold()


def test_a_thread_that_cannot_start_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller then drives progress itself; nothing is counted and stop() is safe."""

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    tp = TargetProgress(Steps(target=1), "tp-refused")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert not tp.hold()
    assert tp.holds == 0 and tp._thread is None
    monkeypatch.undo()
    tp.stop()


@needs_nixl
def test_a_shutdown_on_the_progress_thread_hands_itself_to_another_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collection that finalises the transport on its progress thread, inside a step
    (an op the shutdown waits for): the shutdown runs elsewhere once the step is over,
    instead of waiting 30 s for itself and leaking the agent."""
    from p2pkv.transport import nixl

    array = np.zeros(8 * 4096, dtype=np.uint8)
    transport = nixl.NixlTransport.create(
        agent_name="tp-gc", region=array, layout=RegionLayout(array.ctypes.data, 8, 4096)
    )
    st = transport._state
    target = st.target
    ran = threading.Event()

    def step() -> bool:
        if not st.enter():
            return False
        try:
            if not ran.is_set():
                ran.set()
                nixl._shutdown(st)  # as weakref.finalize would, mid-step
            return True
        finally:
            st.exit()

    target._step = step
    closers: list[threading.Thread] = []

    class Recorded(threading.Thread):
        """SPY thread class: a real thread, noted as it starts."""

        def start(self) -> None:
            closers.append(self)
            super().start()

    monkeypatch.setattr(threading, "Thread", Recorded)
    assert transport.hold_target_progress()
    assert ran.wait(WAIT_S)
    thread = target._thread
    assert thread is not None
    thread.join(WAIT_S)  # the closer stops it once the step is over
    assert not thread.is_alive() and st.closing
    assert [c.name for c in closers] == ["p2pkv-progress-tp-gc", "p2pkv-close"]
    closers[1].join(WAIT_S)
    assert not closers[1].is_alive()
    assert transport.statistics().live_agents == 0
    transport.close()  # idempotent
