"""Pins held by the host: peers' lookups answered by the host's own block index.

Theory of operation
-------------------
Normally the node's :class:`~p2pkv.store.BlockStore` knows which blocks exist and pins
them for a peer's lookup round. When the host owns that knowledge instead (vLLM's primary
tier, behind vLLM's own lock and thread), the node is given a :class:`HostPins`
(``Node.pin_source``) and the two threads meet here:

* The engine's producer, answering a lookup, calls :meth:`HostPins.pin` (async): it posts
  a :class:`PinRequest` to the inbox and waits, at most ``answer_within`` seconds, for the
  host's answer. No answer in time: every key is a miss, and the request is *abandoned*.
  Each lookup waits in a task of its own session's, beside the others; the session's
  reader never waits (``ProducerSide._ask_host``), and an abort of the lookup cuts the
  wait (the request is then abandoned).
* The host, on its own thread and under its own lock, takes requests
  (:meth:`HostPins.take`), pins what it holds and answers each with the source slot per key
  and a *token* for those pins (vLLM: the store job's id), or None if it pinned nothing
  (:meth:`HostPins.answer`). An answer to an abandoned request releases its token at once.
* The engine releases a round's pins with :meth:`HostPins.unpin` (the producer's release,
  lease expiry and quarantine paths all end there). The token comes back to the host through
  :meth:`HostPins.released`.

Every token the host hands in comes back through :meth:`released` exactly once: the
owner -> token map under one lock is the single record, and a token leaves it once.
:meth:`release_all` hands back what is still held when the node is gone.

The host must never block in here: every host-side method takes one short lock, and the
engine is woken with ``TrioToken.run_sync_soon``.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

__all__ = ["HostPins", "PinRequest", "PinSource"]


class PinSource(Protocol):
    """Who pins blocks for a peer's lookup round when the store does not.

    ``unpin`` must not raise: the engine calls it once per round, in loops that release
    many at once (a session's end, the lease timer), and one that raised would leave the
    rounds after it pinned. :class:`HostPins` never raises there."""

    async def pin(self, owner: object, keys: Sequence[bytes]) -> list[int | None]: ...

    def unpin(self, owner: object) -> None: ...


class _State(enum.Enum):
    PENDING = "pending"  # in the inbox
    TAKEN = "taken"  # the host is working on it
    ANSWERED = "answered"
    ABANDONED = "abandoned"  # the engine stopped waiting


class PinRequest:
    """A peer's lookup, as the host sees it: pin what you hold of ``keys``.

    ``deadline`` (``time.monotonic`` clock) is when the engine stops waiting; the host may
    keep asking its own index until then (e.g. for blocks still being written)."""

    __slots__ = ("_owner", "_slots", "_state", "_wake", "deadline", "keys")

    def __init__(
        self, owner: object, keys: list[bytes], deadline: float, wake: Callable[[], None]
    ) -> None:
        self.keys = keys
        self.deadline = deadline
        self._owner = owner
        self._wake = wake
        self._state = _State.PENDING
        self._slots: list[int | None] = []

    @property
    def abandoned(self) -> bool:
        """The engine no longer waits (answering it only releases the pins)."""
        return self._state is _State.ABANDONED


class HostPins:
    """The meeting point of the engine's producer and a host that owns pins (module doc)."""

    def __init__(
        self, num_blocks: int, *, answer_within: float, max_blocks: int | None = None
    ) -> None:
        """``max_blocks``: the most blocks all peers' rounds together may hold pinned
        (None: no bound but the per-peer one); a lookup past it gets misses for the
        keys over it, counted pessimistically (a request's keys count until the host
        answers, then its hits, until the round's pins are released)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            # The range the host's answers are checked against (a str made every answer
            # a bare TypeError on the host's thread).
            raise TypeError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if not answer_within > 0:  # NaN too: Trio's deadline refuses it at a peer's lookup
            raise ValueError("answer_within must be positive")
        if max_blocks is not None and max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.answer_within = answer_within
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._inbox: deque[PinRequest] = deque()
        self._held: dict[object, object] = {}  # owner -> the host's token for its pins
        self._counted: dict[object, int] = {}  # owner -> blocks counted against max_blocks
        self._total = 0  # sum of _counted
        self._released: list[object] = []
        self._closed = False  # release_all ran: every answer's token goes straight back

    # --- the engine's side ----------------------------------------------------------------

    async def pin(self, owner: object, keys: Sequence[bytes]) -> list[int | None]:
        """Ask the host to pin ``keys`` for ``owner``; the source slot per key (None: not
        held). Waits at most ``answer_within`` seconds, then answers all misses."""
        asked = len(keys)
        if self.max_blocks is not None:
            with self._lock:
                room = max(self.max_blocks - self._total, 0)
                keys = keys[:room]  # those past the room: misses
                if keys:
                    self._count(owner, len(keys))
        if not keys:
            return [None] * asked
        token = trio.lowlevel.current_trio_token()
        answered = trio.Event()

        def wake() -> None:
            # RunFinishedError: the engine is gone; release_all hands the token back.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(answered.set)

        req = PinRequest(owner, list(keys), time.monotonic() + self.answer_within, wake)
        with self._lock:
            self._inbox.append(req)  # it leaves when taken, or when we stop waiting
        try:
            with trio.move_on_after(self.answer_within):
                await answered.wait()
        finally:
            with self._lock:
                if req._state is _State.PENDING:
                    # Never taken: out of the inbox now, keys and all, so a stalled host
                    # holds only the requests the engine still waits for. (Abandoned ones
                    # used to leave from the front only: a peer that looked up and
                    # aborted piled them up behind one lookup that waited.)
                    self._inbox.remove(req)
                if req._state is not _State.ANSWERED:
                    req._state = _State.ABANDONED
                if self.max_blocks is not None:  # from the keys asked to what is held
                    held = owner in self._held and req._state is _State.ANSWERED
                    self._count(owner, sum(s is not None for s in req._slots) if held else 0)
        out: list[int | None] = (
            list(req._slots) if req._state is _State.ANSWERED else [None] * len(keys)
        )
        return out + [None] * (asked - len(out))

    def _count(self, owner: object, n: int) -> None:
        """``owner`` now counts ``n`` blocks against ``max_blocks`` (the lock held)."""
        self._total += n - self._counted.pop(owner, 0)
        if n:
            self._counted[owner] = n

    def pinned_blocks(self) -> int:
        """Blocks counted against ``max_blocks`` now (0 without a bound)."""
        return self._total

    def unpin(self, owner: object) -> None:
        """Release ``owner``'s pins: its token goes to :meth:`released` (once)."""
        with self._lock:
            tok = self._held.pop(owner, _NONE)
            if tok is not _NONE:
                self._released.append(tok)
            if owner in self._counted:
                self._count(owner, 0)

    # --- the host's side ------------------------------------------------------------------

    def take(self, limit: int = 1 << 30) -> list[PinRequest]:
        """Up to ``limit`` requests to answer, oldest first (abandoned ones are skipped)."""
        out: list[PinRequest] = []
        with self._lock:
            while self._inbox and len(out) < limit:
                req = self._inbox.popleft()
                if req._state is _State.PENDING:
                    req._state = _State.TAKEN
                    out.append(req)
        return out

    def answer(self, req: PinRequest, slots: Sequence[int | None], token: object | None) -> None:
        """Answer a taken request: the slot per key (None: not held) and the token of the
        pins taken for it (None: nothing pinned). If the engine stopped waiting, the token
        is released at once. ValueError for a malformed answer (the request is then
        answered all misses and the token released): not one slot (0..num_blocks-1) or
        None per key, or one slot for two different keys (the peer would be sent one
        block's bytes as another's; a key the lookup names twice may have its slot twice)."""
        answer = list(slots)
        why = None
        if len(answer) != len(req.keys) or any(
            s is not None and not (type(s) is int and 0 <= s < self.num_blocks) for s in answer
        ):
            why = f"answer must hold one slot (0..{self.num_blocks - 1}) or None per key"
        else:
            given = [s for s in answer if s is not None]
            if len(set(given)) != len(given):  # rare: only then is each key looked at
                first: dict[int, bytes] = {}
                for key, s in zip(req.keys, answer, strict=True):
                    if s is not None and first.setdefault(s, key) != key:
                        why = f"one slot ({s}) answered for two different keys"
                        break
        bad = why is not None
        with self._lock:
            if req._state is not _State.TAKEN and req._state is not _State.ABANDONED:
                raise ValueError(f"request is {req._state.value}, not taken")
            if self._closed and req._state is _State.TAKEN:
                req._state = _State.ABANDONED
            if bad or req._state is _State.ABANDONED:
                if token is not None:
                    self._released.append(token)
                if req._state is _State.TAKEN:
                    req._slots = [None] * len(req.keys)
                    req._state = _State.ANSWERED
                    wake = req._wake
                else:
                    wake = None
            else:
                if token is not None:
                    if req._owner in self._held:
                        self._released.append(token)  # pragma: no cover - one pin per owner
                        answer = [None] * len(req.keys)
                    else:
                        self._held[req._owner] = token
                req._slots = answer
                req._state = _State.ANSWERED
                wake = req._wake
        if wake is not None:
            wake()
        if why is not None:
            raise ValueError(why)

    def any_waiting(self) -> bool:
        """Cheap hint, without the lock: requests may be waiting for :meth:`take`."""
        return bool(self._inbox)

    def any_released(self) -> bool:
        """Cheap hint, without the lock: :meth:`released` may have tokens."""
        return bool(self._released)

    def released(self) -> list[object]:
        """Tokens whose pins the engine released since the last call, each exactly once."""
        with self._lock:
            out, self._released = self._released, []
        return out

    def held(self) -> int:
        """How many tokens the engine still holds."""
        with self._lock:
            return len(self._held)

    def release_all(self) -> None:
        """The node is gone: every token still held is released, and every request not
        answered yet is abandoned, taken or not (its answer releases its token)."""
        with self._lock:
            self._closed = True
            self._released.extend(self._held.values())
            self._held.clear()
            self._counted.clear()
            self._total = 0
            for req in self._inbox:
                if req._state is _State.PENDING:
                    req._state = _State.ABANDONED
            self._inbox.clear()


_NONE = object()
