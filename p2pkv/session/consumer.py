"""The consumer half of a peer session: lookup rounds and fetches into our store.

Theory of operation
-------------------
``lookup`` opens a round (the producer pins its hits for a lease) and keeps it open so a
``fetch`` soon after reuses it; rounds nobody fetched are closed with an empty fetch at
0.9 x lease. ``fetch`` reserves destination slots, names them in the ``fetch`` message and
waits for ``transfer_done``; only keys reported OK (and, with checksums on, whose landed
bytes match the producer's CRC32) are committed to the store. Every other key is a
per-key failure with a reason: ``fetch`` never raises for those. A fetch that ends without
``transfer_done`` (deadline, cancellation, the session dying) quarantines its slots, since
writes may still land; the producer's ``abort_ack`` frees them early.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..errors import P2PKVError, P2PKVTimeout, SessionClosed, StoreFull
from ..wire import Outcome
from ._parts import SessionParts
from .producer import checksums
from .protocol import (
    AbortAcknowledged,
    LookupAnswered,
    TransferCompleted,
)

if TYPE_CHECKING:
    pass


@attrs.define(eq=False)
class FetchResult:
    """What a fetch did: ``loaded`` keys are in the local store with the producer's bytes;
    every other requested key is in ``failed`` with a reason."""

    loaded: list[bytes] = attrs.field(factory=list)
    failed: dict[bytes, str] = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Pending:
    """A consumer request waiting for the peer."""

    req_id: int
    event: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None
    error: BaseException | None = None
    slots: list[int] = attrs.field(factory=list)  # reserved destination slots
    aborted: bool = False

    def arm(self) -> None:
        self.event = trio.Event()
        self.result = None


@attrs.define(eq=False)
class _Round:
    """A consumer lookup round still open at the producer (its hits are pinned there)."""

    req_id: int
    hits: set[bytes]
    deadline: float


class ConsumerSide(SessionParts):
    """Mixin of :class:`~p2pkv.session.session.PeerSession`: the consumer's calls."""

    if TYPE_CHECKING:  # provided by PeerSession
        _requests: trio.Semaphore
        _pending: dict[int, _Pending]
        _rounds: dict[int, _Round]

    def _on_answer(self, ev: LookupAnswered) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None:
            p.result = ev
            p.event.set()

    def _on_transfer_done(self, ev: TransferCompleted) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None:
            p.result = ev
            p.event.set()
        self._request_ended(ev.req_id)

    def _on_abort_ack(self, ev: AbortAcknowledged) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None and p.slots:
            # The producer drained its writes: the quarantined slots are quiescent.
            self.node.store.unquarantine(p.slots)
            p.slots = []
        self._request_ended(ev.req_id)

    def _request_ended(self, req: int) -> None:
        if self._pending.pop(req, None) is not None:
            self._requests.release()

    def _check_usable(self, op: str) -> None:
        if not self.alive:
            raise SessionClosed(self.close_reason or "session ended", peer=self.peer_id, op=op)
        if not self.ready.is_set():
            raise P2PKVError(
                "session is not ready (handshake in progress)", peer=self.peer_id, op=op
            )

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[bool]]:
        """One lookup round. The round stays open (the producer pins the hits for a lease)
        until :meth:`fetch` uses it or the lease runs out."""
        self._check_usable("lookup")
        try:  # waiting for a request slot is part of the lookup's deadline
            with trio.fail_after(self.cfg.lookup_timeout):
                await self._requests.acquire()
        except trio.TooSlowError:
            raise P2PKVTimeout(
                f"no request slot free within the lookup deadline "
                f"({self.cfg.max_open_requests} open)",
                peer=self.peer_id,
                op="lookup",
            ) from None
        try:
            req = self.proto.send_lookup(keys)
        except BaseException:
            self._requests.release()
            raise
        p = self._pending[req] = _Pending(req)
        await self._flush()
        try:
            with trio.fail_after(self.cfg.lookup_timeout):
                await p.event.wait()
        except trio.TooSlowError:
            self._abort(p)
            raise P2PKVTimeout("lookup timed out", peer=self.peer_id, op="lookup") from None
        except BaseException:
            self._abort(p)
            raise
        if p.error is not None:
            raise p.error
        hits: list[bool] = p.result.hits
        self._rounds[req] = _Round(
            req,
            {k for k, h in zip(keys, hits, strict=True) if h},
            trio.current_time() + self.cfg.lease * 0.9,
        )
        self._wake_lease.set()
        return req, hits

    def _abort(self, p: _Pending) -> None:
        """Give up on a request; the slots it named stay quarantined until the abort_ack."""
        self._rounds.pop(p.req_id, None)
        if p.aborted or self.proto.out_state(p.req_id) is None:
            return
        p.aborted = True
        if self.alive:
            self.proto.send_abort(p.req_id)
            self._flush_soon()

    def _flush_soon(self) -> None:
        """Send what is queued from a sync context. If the session is already winding
        down (its nursery closed), the final flush sends it instead."""
        if self._nursery is not None:
            # RuntimeError: the nursery is closed to new arrivals (the session is closing).
            with contextlib.suppress(RuntimeError):
                self._nursery.start_soon(self._flush)

    async def release(self, keys: Sequence[bytes] | None = None) -> int:
        """Close open lookup rounds that hold any of ``keys`` (all rounds if ``None``) without
        fetching: the producer releases their pins now instead of at the lease's end.
        Returns how many rounds were closed."""
        wanted = None if keys is None else set(keys)
        rounds = [
            r.req_id
            for r in self._rounds.values()
            if wanted is None or not wanted.isdisjoint(r.hits)
        ]
        for req in rounds:
            self._close_round(req)
        await self._flush()
        return len(rounds)

    def _close_round(self, req: int) -> None:
        """Close a round nobody fetched (empty fetch): the producer releases its pins."""
        self._rounds.pop(req, None)
        if self.alive and self.proto.out_state(req) is not None:
            self.proto.send_fetch(req, [], [])
            self._request_ended(req)

    async def fetch(self, keys: Sequence[bytes]) -> FetchResult:
        """Fetch ``keys`` into the local store, reusing open lookup rounds where they cover
        a key and looking the rest up first. Never raises for per-key failures."""
        result = FetchResult()
        wanted = list(dict.fromkeys(keys))
        store = self.node.store
        here = store.present(wanted)
        todo = [k for k, h in zip(wanted, here, strict=True) if not h]
        result.loaded.extend(k for k, h in zip(wanted, here, strict=True) if h)
        groups: dict[int, list[bytes]] = {}
        uncovered: list[bytes] = []
        for key in todo:
            rnd = next((r for r in self._rounds.values() if key in r.hits), None)
            if rnd is None:
                uncovered.append(key)
            else:
                groups.setdefault(rnd.req_id, []).append(key)
        try:
            if uncovered:
                req, hits = await self.lookup(uncovered)
                groups[req] = [k for k, h in zip(uncovered, hits, strict=True) if h]
                result.failed.update(
                    (k, "miss") for k, h in zip(uncovered, hits, strict=True) if not h
                )
        except P2PKVError as exc:
            for k in uncovered:
                result.failed[k] = f"lookup failed: {exc}"
        async with trio.open_nursery() as nursery:
            for req, ks in groups.items():
                nursery.start_soon(self._fetch_round, req, ks, result)
        return result

    async def _fetch_round(self, req: int, keys: list[bytes], result: FetchResult) -> None:
        self._rounds.pop(req, None)
        p = self._pending.get(req)
        if p is None or not self.alive or self.proto.out_state(req) is None:
            result.failed.update((k, "session closed") for k in keys)
            return
        store, owner = self.node.store, (self.token, "dst", req)
        try:
            slots = store.reserve(owner, len(keys)) if keys else []
        except StoreFull as exc:
            self._close_round(req)
            result.failed.update((k, f"store full: {exc}") for k in keys)
            return
        if not keys:
            self._close_round(req)
            await self._flush()
            return
        p.arm()
        p.slots = slots
        self.proto.send_fetch(req, keys, slots)
        self.node.poller.add_demand()
        try:
            await self._flush()
            with trio.fail_after(self.cfg.fetch_timeout):
                await p.event.wait()
        except trio.TooSlowError:
            self._give_up(p, owner, keys, result, "timeout")
            return
        except BaseException:
            self._give_up(p, owner, keys, result, "cancelled")
            raise
        finally:
            self.node.poller.drop_demand()
        if p.error is not None:
            self._give_up(p, owner, keys, result, str(p.error))
            return
        await self._land(p, owner, keys, p.result, result)

    def _give_up(
        self, p: _Pending, owner: object, keys: list[bytes], result: FetchResult, reason: str
    ) -> None:
        """The writes into ``p.slots`` are unsettled: quarantine them, abort the request."""
        self.node.store.quarantine(owner, p.slots, until=trio.current_time() + self.cfg.quarantine)
        self.node.wake_quarantine()
        self._abort(p)
        result.failed.update((k, reason) for k in keys)

    async def _land(
        self,
        p: _Pending,
        owner: object,
        keys: list[bytes],
        done: TransferCompleted,
        result: FetchResult,
    ) -> None:
        store, bl = self.node.store, self.cfg.block_len
        ok = [i for i, o in enumerate(done.outcomes) if o == Outcome.OK]
        good = set(ok)
        reason_bad = ""
        if self.cfg.verify_checksums:
            if done.checksums is None:
                good = set()
                reason_bad = "producer sent no checksums"
            else:
                local = await self.node.offload(
                    checksums,
                    store.array.data,
                    bl,
                    [p.slots[i] for i in ok],
                    limiter=self.node.cpu_limiter,
                )
                good = {i for i, c in zip(ok, local, strict=True) if c == done.checksums[i]}
                reason_bad = "checksum mismatch"
        release: list[int] = []
        commit_slots: list[int] = []
        commit_keys: list[bytes] = []
        for i, (key, slot) in enumerate(zip(keys, p.slots, strict=True)):
            if i in good:
                commit_slots.append(slot)
                commit_keys.append(key)
            else:
                release.append(slot)
                o = done.outcomes[i]
                result.failed[key] = reason_bad if o == Outcome.OK else Outcome(o).name.lower()
        store.commit_many(owner, commit_slots, commit_keys)
        result.loaded.extend(commit_keys)
        store.release_reserved(owner, release)
        p.slots = []
