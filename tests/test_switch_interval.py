"""The switch interval while engine threads run (p2pkv._switch, start_node).

Synchronous tests: the holds are taken and released from plain threads, as engine threads
do. Every test leaves the interpreter's interval as it found it (the ``interval`` fixture
checks that, then restores it whatever happened).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest

from p2pkv import NodeConfig, PortalClosed, _switch, start_node
from p2pkv.store import BlockStore
from p2pkv.transport.base import DataTransport

from .helpers import config, held_by_a_thread, in_fork

BOUND = 10.0  # seconds: "this did not hang"
DEFAULT = 0.005  # Python's own


@pytest.fixture
def interval() -> Iterator[float]:
    """Python's default interval for the test; afterwards it must be back."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT)
    start = sys.getswitchinterval()
    try:
        yield start
        assert sys.getswitchinterval() == start, "the interval was not restored"
        assert not _switch._wanted, "a hold was left behind"
    finally:
        _switch._wanted.clear()
        sys.setswitchinterval(before)


def test_a_hold_lowers_the_interval_and_its_release_restores_it(interval: float) -> None:
    release = _switch.hold(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    release()
    assert sys.getswitchinterval() == interval
    release()  # a second release changes nothing
    assert sys.getswitchinterval() == interval


def test_a_hold_never_raises_an_interval_already_lower(interval: float) -> None:
    sys.setswitchinterval(0.0002)
    user = sys.getswitchinterval()
    release = _switch.hold(0.001)
    assert sys.getswitchinterval() == user
    release()
    assert sys.getswitchinterval() == user
    sys.setswitchinterval(interval)


def test_holds_are_counted_and_the_lowest_wins(interval: float) -> None:
    slow = _switch.hold(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)
    fast = _switch.hold(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    fast()  # the other engine still runs: its interval, not the original
    assert sys.getswitchinterval() == pytest.approx(0.002)
    again = _switch.hold(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    slow()
    assert sys.getswitchinterval() == pytest.approx(0.001)
    again()
    assert sys.getswitchinterval() == interval


def test_an_interval_someone_else_sets_meanwhile_is_theirs(interval: float) -> None:
    first = _switch.hold(0.001)
    sys.setswitchinterval(0.003)  # the host decides
    theirs = sys.getswitchinterval()
    second = _switch.hold(0.0005)  # a hold taken after that does not override it
    assert sys.getswitchinterval() == theirs
    first()
    second()
    assert sys.getswitchinterval() == theirs  # and nothing "restores" over it
    sys.setswitchinterval(interval)
    # The next holds manage it again, from what it is now.
    release = _switch.hold(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    release()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), 1e-9])
def test_a_hold_under_a_microsecond_is_refused(interval: float, bad: float) -> None:
    """CPython keeps whole microseconds: less than one would be stored as 0."""
    with pytest.raises(ValueError, match="switch interval"):
        _switch.hold(bad)
    with pytest.raises(ValueError, match="switch_interval"):
        NodeConfig(peer_id="a", switch_interval=bad)


def test_a_hold_above_the_interval_changes_nothing(interval: float) -> None:
    release = _switch.hold(0.010)
    assert sys.getswitchinterval() == interval
    release()
    assert sys.getswitchinterval() == interval


def test_an_interval_of_odd_microseconds_comes_back_exactly(interval: float) -> None:
    """Setting what was read back would lose a microsecond to truncation each time."""
    sys.setswitchinterval(0.00102)  # 1,019 or 1,020 us, as CPython truncates it
    user = sys.getswitchinterval()
    for _ in range(5):
        release = _switch.hold(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        release()
        assert sys.getswitchinterval() == user
    # Two holds, the lower one released first: back to the other, then to the user's.
    slow, fast = _switch.hold(0.0009), _switch.hold(0.0005)
    fast()
    assert sys.getswitchinterval() == pytest.approx(0.0009)
    slow()
    assert sys.getswitchinterval() == user
    sys.setswitchinterval(interval)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_the_interval_from_before_its_parents_holds(
    interval: float,
) -> None:
    release = _switch.hold(0.001)
    try:
        read, write = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns of fork with threads; ours is checked
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: no engine thread came along
            try:
                os.close(read)
                now = sys.getswitchinterval()
                again = _switch.hold(0.002)  # the lock works; the new holds count afresh
                during = sys.getswitchinterval()
                again()
                os.write(write, f"{now!r} {during!r} {sys.getswitchinterval()!r}".encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            now, during, after = (float(v) for v in f.read().split())
        os.waitpid(pid, 0)
        assert now == interval  # given back at the fork
        assert during == pytest.approx(0.002)
        assert after == interval
        assert sys.getswitchinterval() == pytest.approx(0.001)  # the parent's hold stays
    finally:
        release()


def test_a_hold_in_fractions_of_a_microsecond_is_given_back(interval: float) -> None:
    """CPython truncates to whole microseconds: 1,234.5 us reads back as 1,234. A hold
    that remembered what it asked for, not what it set, took the interval for someone
    else's at its release and never gave it back (mutation review)."""
    release = _switch.hold(0.0012345)
    assert sys.getswitchinterval() == pytest.approx(0.001234)
    release()
    assert sys.getswitchinterval() == interval


def test_a_hold_above_the_interval_beside_a_lower_one_lets_later_holds_lower_it(
    interval: float,
) -> None:
    """Back at the interval from before while a hold above it stays on: p2pkv has set
    nothing of its own, and the next hold lowers the interval again (mutation review)."""
    above = _switch.hold(0.010)  # an engine that asks for more than the host has
    fast = _switch.hold(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    fast()
    assert sys.getswitchinterval() == interval
    again = _switch.hold(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    again()
    above()
    assert sys.getswitchinterval() == interval


def test_the_hosts_interval_wins_even_when_it_is_what_a_hold_had_set(interval: float) -> None:
    """Once the host has set the interval during the holds, p2pkv leaves it alone until
    every hold has ended, even if the host later sets the very value a hold had set
    (mutation review: the second release "restored" 5 ms over the host's 2 ms)."""
    first = _switch.hold(0.002)
    sys.setswitchinterval(0.003)  # the host decides
    second = _switch.hold(0.001)  # sees it: not ours any more
    assert sys.getswitchinterval() == pytest.approx(0.003)
    sys.setswitchinterval(0.002)  # the host again: the value the first hold had set
    theirs = sys.getswitchinterval()
    second()
    first()
    assert sys.getswitchinterval() == theirs
    sys.setswitchinterval(interval)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("given_up", [False, True])
def test_a_forked_child_keeps_an_interval_the_host_set_during_the_holds(
    interval: float, given_up: bool
) -> None:
    """The child gives back the interval from before the holds only if it is still the
    one p2pkv set: one the host set meanwhile stays, whether or not a hold or release
    has seen it yet (mutation review)."""
    first = _switch.hold(0.002)
    second: Callable[[], None] | None = None
    try:
        sys.setswitchinterval(0.003)  # the host decides
        if given_up:  # a later hold sees the host's setting; then the host sets 2 ms itself
            second = _switch.hold(0.001)
            sys.setswitchinterval(0.002)
        theirs = sys.getswitchinterval()
        said = in_fork(lambda: repr(sys.getswitchinterval()))
        assert float(said) == theirs
    finally:
        first()
        if second is not None:
            second()
    sys.setswitchinterval(interval)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_thread_was_inside_a_hold_can_hold(interval: float) -> None:
    """An engine thread of the parent may be inside ``hold`` or its release when the host
    forks; that thread is gone in the child, and the lock it held must not be: the child's
    own node takes a hold at its start (mutation review: without a new lock, it hung)."""

    def child() -> str:
        release = _switch.hold(0.002)
        during = sys.getswitchinterval()
        release()
        return f"{during!r} {sys.getswitchinterval()!r}"

    with held_by_a_thread(_switch._lock):  # as a hold or release does, for microseconds
        said = in_fork(child)
    assert said, "the child hung in hold() on the lock its parent's thread held"
    during, after = (float(v) for v in said.split())
    assert during == pytest.approx(0.002)
    assert after == interval


def test_holds_taken_and_released_from_many_threads_at_once(interval: float) -> None:
    rounds, workers = 300, 8
    barrier = threading.Barrier(workers)
    seen_above: list[float] = []

    def work(i: int) -> None:
        barrier.wait(BOUND)
        for _ in range(rounds):
            release = _switch.hold(0.001 if i % 2 else 0.0005)
            now = sys.getswitchinterval()
            if now > 0.001 + 1e-9:  # this hold is on: never above what it asked for
                seen_above.append(now)
            release()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
        assert not t.is_alive()
    assert seen_above == []
    assert sys.getswitchinterval() == interval


def test_start_node_lowers_the_interval_while_its_engine_runs(interval: float) -> None:
    with start_node(config("a"), start_timeout=BOUND) as node:
        assert sys.getswitchinterval() == pytest.approx(0.001)
        with start_node(config("b", switch_interval=0.0005), start_timeout=BOUND) as other:
            assert sys.getswitchinterval() == pytest.approx(0.0005)
            other.close(timeout=BOUND)
        assert sys.getswitchinterval() == pytest.approx(0.001)
        node.close(timeout=BOUND)
    assert sys.getswitchinterval() == interval


def test_start_node_with_no_interval_leaves_it_alone(interval: float) -> None:
    with start_node(config("a", switch_interval=None), start_timeout=BOUND) as node:
        assert sys.getswitchinterval() == interval
        node.close(timeout=BOUND)
    assert sys.getswitchinterval() == interval


def test_a_node_that_cannot_start_restores_the_interval(interval: float) -> None:
    def broken(cfg: NodeConfig, store: BlockStore) -> DataTransport:
        raise RuntimeError("no data plane today")

    with pytest.raises(PortalClosed):
        start_node(config("a"), transport=broken, start_timeout=BOUND)
    assert sys.getswitchinterval() == interval
