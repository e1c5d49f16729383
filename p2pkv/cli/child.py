"""Child processes that talk JSON lines (the demo's source node, the benches' peers).

The child process is always reaped: :class:`Child` closes its stdin (``serve
--exit-on-eof`` stops on EOF, so it also stops if this process dies), sends SIGTERM, and
kills it if it has not exited within the grace time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from ..errors import P2PKVError

log = logging.getLogger("p2pkv.cli")


class ChildFailed(P2PKVError):
    """A child process died, or did not say what we waited for in time."""


class Child:
    """A Python child process that reports JSON lines on stdout; always reaped.

    Lines that are not JSON objects (a library logging to stdout) are passed to stderr.
    Use as a context manager, or call :meth:`close` in a ``finally``.
    """

    def __init__(self, argv: Sequence[str], *, name: str = "child") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, message: dict[str, Any]) -> None:
        """One JSON line to the child's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next JSON object the child prints; raises :class:`ChildFailed` on exit/timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ChildFailed(f"{self.name} said nothing for {timeout:.0f} s") from None
            if line is None:
                self._lines.put(None)
                rc = self.proc.wait()
                raise ChildFailed(f"{self.name} exited with status {rc}")
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                message = None
            if isinstance(message, dict):
                return message
            sys.stderr.write(line)

    def close(self, grace: float = 10.0) -> int:
        """Stop the child and reap it; its exit status.

        EOF on stdin first (our children stop on it), SIGTERM if it is still running
        ``grace / 2`` seconds later, SIGKILL (logged) after ``grace``. Its stdout pipe is
        closed once the reader has seen its end, so no descriptor outlives the call.
        """
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        for step in ("eof", "sigterm", "sigkill"):
            if step == "sigterm":
                self.proc.terminate()
            elif step == "sigkill":
                log.warning("%s (pid %d) ignored SIGTERM: killing it", self.name, self.pid)
                self.proc.kill()
            try:
                rc = self.proc.wait(timeout=grace / 2)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            rc = self.proc.wait()
        self._reader.join(timeout=5.0)
        # Only once the reader is done: closing a file another thread reads is unsafe. A
        # reader still blocked (a grandchild holds the pipe open) keeps it, as a daemon.
        if not self._reader.is_alive() and self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, message: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Send one command and wait for the child's next JSON line."""
        self.send(message)
        return self.receive(timeout)


async def receive_commands() -> AsyncIterator[dict[str, Any]]:
    """JSON-line commands from stdin until EOF: the child's half of :class:`Child`."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    pending = b""
    async with stdin:
        while chunk := await stdin.receive_some():
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    try:
                        command = json.loads(line)
                    except json.JSONDecodeError:
                        log.warning("ignoring a line on stdin that is not JSON: %r", line[:80])
                        continue
                    if isinstance(command, dict):
                        yield command
                    else:
                        log.warning("ignoring a JSON line that is not an object: %r", line[:80])


def emit(message: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed (what :meth:`Child.receive` reads)."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
