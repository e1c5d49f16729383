"""An autojump clock that waits for the kernel's loopback TCP before it jumps.

Trio's ``MockClock(autojump_threshold=0)`` jumps virtual time to the next deadline as
soon as every task is blocked and one zero-timeout I/O poll finds nothing. Over real
loopback TCP that is not the same as "nothing more can happen": a frame larger than the
receiver's window (64 KiB by default here) goes out in parts, and the next part waits for
the receiver's kernel to acknowledge the last one, which it may delay by 40 ms of *real*
time. Both tasks then wait on their sockets, the poll finds nothing, and the clock jumps,
again and again, through leases, probes and the idle timeout, within those 40 ms. A test
that sent one 4,096-key lookup then saw its session end with "idle timeout" at virtual
time 30 s (found 2026-12-04: 24 of 40 runs of one test, alone on this VM).

So before it jumps, this clock looks for a receiver in this process that has read
everything it got while its sender still has bytes queued to it (``SIOCINQ`` zero on one
end, ``SIOCOUTQ`` above zero on the other): that pair waits for nothing but the kernel.
It has the receiver acknowledge at once (``TCP_QUICKACK``), lets the run loop poll I/O
again, and jumps only once no pair waits so, or nothing has changed for ``SETTLE`` of
real time since the nudge. A peer that stopped reading has unread bytes, so tests of one
still jump to their timeouts at once. The hold is bounded (``HOLD_LIMIT`` of real time
per jump): past it, the clock jumps anyway.

Built on ``MockClock._autojump``, which Trio's run loop calls when it would jump (a
private hook: MockClock is final, and the public threshold is read before the I/O poll,
too early to take the sockets' state into account).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import NamedTuple

import trio
import trio.lowlevel
import trio.testing

_FIONREAD = 0x541B  # SIOCINQ: bytes received, not yet read
_TIOCOUTQ = 0x5411  # SIOCOUTQ: bytes in the send queue (not yet acknowledged)
_SIOCOUTQNSD = 0x894B  # bytes in the send queue not yet sent
HOLD_LIMIT = 1.0  # seconds of real time one jump may be held back
SETTLE = 0.005  # seconds of real time with nothing changing after a nudge: jump
_PAUSE = 0.0002  # seconds of real time between looks at the sockets


class _Tcp(NamedTuple):
    local: object
    peer: object
    fd: int
    unread: int  # received, not yet read
    queued: int  # in the send queue: unsent, or sent and not yet acknowledged


def _ioctl_int(fd: int, request: int) -> int:
    value: int = struct.unpack("i", fcntl.ioctl(fd, request, b"\0\0\0\0"))[0]
    return value


def _tcp_sockets() -> list[_Tcp]:
    """Every connected TCP socket this process holds a descriptor of."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            with contextlib.closing(socket.socket(fileno=os.dup(fd))) as s:
                if s.type != socket.SOCK_STREAM or s.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                local, peer = s.getsockname(), s.getpeername()
            found.append(
                _Tcp(local, peer, fd, _ioctl_int(fd, _FIONREAD), _ioctl_int(fd, _TIOCOUTQ))
            )
        except OSError:  # gone meanwhile, not connected, or a listener
            continue
    return found


def _stalled_on_the_kernel(sockets: list[_Tcp]) -> list[_Tcp]:
    """Receivers in this process that read everything they got while their sender still
    has bytes queued to them: only their kernel's acknowledgement (which opens the window
    or frees the sender's buffer) is missing. A receiver with unread bytes is a reader
    that stopped or is busy: what comes next is up to a task, not the kernel."""
    senders = {t.peer for t in sockets if t.queued > 0}
    return [t for t in sockets if t.unread == 0 and t.local in senders]


def _ack_now(receivers: list[_Tcp]) -> None:
    """``TCP_QUICKACK`` on a socket with an acknowledgement scheduled sends it now."""
    for t in receivers:
        with (
            contextlib.suppress(OSError),
            contextlib.closing(socket.socket(fileno=os.dup(t.fd))) as s,
        ):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


class _Held:
    """One jump being held back: since when, and the state last seen."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.since = math.inf
        self.changed = math.inf
        self.last: list[_Tcp] | None = None


@contextlib.contextmanager
def kernel_paced(real: float = 1.0) -> Iterator[None]:
    """A phase in which only the kernel moves bytes (a peer draining a backlog of
    megabytes): the clock jumps only once every task has been blocked for ``real``
    seconds of real time, not at the first moment they all are.

    Such a phase needs no virtual time, but each jump in it moves virtual time to the
    next deadline, and a VM whose kernel stalls past ``SETTLE`` makes one jump per stall:
    enough of them run through the idle timeout, or the test's own bound, before the
    bytes are through (found 2026-12-07 by pacing loopback with a ``tbf`` qdisc;
    docs/design.md, "Testing"). A phase that really hangs still ends, at the test's
    bound, a second of real time per jump."""
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock), "for tests on the autojump clock"
    before = clock.autojump_threshold
    clock.autojump_threshold = real
    try:
        yield
    finally:
        clock.autojump_threshold = before


def loopback_autojump_clock() -> trio.testing.MockClock:
    """A ``MockClock(autojump_threshold=0)`` whose jumps wait for loopback TCP.

    When the run loop would jump while a receiver here waits only for its kernel, the
    clock has that receiver acknowledge now and looks again (the run loop polls I/O in
    between). It jumps once no receiver waits so, once nothing changed for ``SETTLE`` of
    real time after a nudge, or after ``HOLD_LIMIT`` in all."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    jump = clock._autojump
    held = _Held()

    def autojump() -> None:
        now = time.monotonic()
        sockets = _tcp_sockets()
        stalled = _stalled_on_the_kernel(sockets)
        if stalled and now - held.since < HOLD_LIMIT:
            if sockets != held.last:
                held.last, held.changed = sockets, now
                held.since = min(held.since, now)
                _ack_now(stalled)
                return  # the run loop polls I/O again before the next look
            if now - held.changed < SETTLE:
                time.sleep(_PAUSE)
                return
        held.reset()
        jump()

    clock._autojump = autojump  # type: ignore[method-assign]
    return clock
