"""The interpreter's switch interval while engine threads run beside a host.

A host thread busy in Python keeps the GIL until the interpreter's switch interval forces
it to let go (5 ms by default). The engine thread of :func:`~p2pkv.start_node` gives the
GIL away at every blocking call (each receive, each wait, each NIXL call that releases it)
and must then wait up to that interval to get it back: a 2 GiB pull from a source whose
host spins took ~4.8 x its time from an idle source on the GPU machine, almost all of it
such waits (``bench/notes/busy_source_probe.py``; ``docs/design.md``, "A busy host and
the GIL"). So while an engine runs, the interval is lowered to what its config asks for.

The interval is the whole process's. Holds are counted: it stays at the lowest interval
any running engine asks for, never above what it was before the first hold, and goes back
to that when the last hold ends. If anything else changes it meanwhile, that setting wins:
p2pkv stops touching the interval until every hold has ended.

CPython keeps the interval in whole microseconds, truncating what it is given; every value
set here is set so that it reads back as the microseconds meant (``_set``), and compared
as read back. A forked child has none of its parent's engine threads: it drops their holds
and gets the interval from before them back.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

MIN_INTERVAL = 1e-6
"""The smallest interval a hold may ask for: CPython would store a smaller one as 0."""

_lock = threading.Lock()
_wanted: list[float] = []  # the interval each current hold asks for
_before = 0.0  # the interval before the first current hold (as read back)
_ours: float | None = None  # what we set (as read back), None while we set nothing
_given_up = False  # someone else changed the interval during the current holds


def _set(interval: float) -> float:
    """Set ``interval`` (seconds) as whole microseconds; return it as read back."""
    sys.setswitchinterval((round(interval * 1e6) + 0.5) * 1e-6)
    return sys.getswitchinterval()


def _apply_locked() -> None:
    global _ours, _given_up
    now = sys.getswitchinterval()
    if _given_up or now != (_before if _ours is None else _ours):
        _given_up = True  # not ours to touch any more
        return
    want = min(_before, *_wanted) if _wanted else _before
    if want == _before:
        if _ours is not None:
            _set(_before)
        _ours = None
    elif want != _ours:
        _ours = _set(want)


def hold(interval: float) -> Callable[[], None]:
    """Keep the switch interval at most ``interval`` seconds until the returned function
    is called (it may be called more than once, from any thread)."""
    if not interval >= MIN_INTERVAL:
        raise ValueError(f"switch interval must be >= {MIN_INTERVAL} s, got {interval!r}")
    global _before, _ours, _given_up
    with _lock:
        if not _wanted:
            _before, _ours, _given_up = sys.getswitchinterval(), None, False
        _wanted.append(interval)
        _apply_locked()
    released = False

    def release() -> None:
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _wanted.remove(interval)
            _apply_locked()

    return release


def _after_fork_in_child() -> None:
    """The engines holding the interval did not come along: give it back, start afresh."""
    global _lock, _ours, _given_up
    _lock = threading.Lock()  # the parent's may have been held by a thread now gone
    if _wanted and not _given_up and _ours is not None and sys.getswitchinterval() == _ours:
        _set(_before)
    _wanted.clear()
    _ours, _given_up = None, False


os.register_at_fork(after_in_child=_after_fork_in_child)
