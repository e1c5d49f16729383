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
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_wanted: list[float] = []  # the interval each current hold asks for
_before = 0.0  # the interval before the first current hold
_ours: float | None = None  # what we set (as read back), None while we set nothing
_given_up = False  # someone else changed the interval during the current holds


def _apply_locked() -> None:
    global _ours, _given_up
    now = sys.getswitchinterval()
    if _given_up or now != (_before if _ours is None else _ours):
        _given_up = True  # not ours to touch any more
        return
    want = min(_before, *_wanted) if _wanted else _before
    if want != now:
        sys.setswitchinterval(want)
    _ours = None if want == _before else sys.getswitchinterval()


def hold(interval: float) -> Callable[[], None]:
    """Keep the switch interval at most ``interval`` seconds until the returned function
    is called (it may be called more than once, from any thread)."""
    if not interval > 0:
        raise ValueError(f"switch interval must be > 0, got {interval!r}")
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
