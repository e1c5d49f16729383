"""The producer half of a peer session: answering lookups (pins) and serving fetches.

Theory of operation
-------------------
A lookup pins its hits in the store for the round (owner ``(session token, request id)``),
up to the per-peer pin cap; hits beyond it are answered as misses. A fetch becomes one
task that posts the writes in chunks off the Trio thread, waits for every handle to
settle, and only then sends ``transfer_done``. Outcomes start as failed and become OK only
when the data plane reported the chunk DONE, so no exit path (error, abort, cancellation,
a bug of ours) can report bytes that never landed. When a write is cut short, its handles
get ``abort_timeout`` to settle; a handle that will not is released and the round's source
pins are held ``quarantine`` seconds longer, since the data plane may still read them.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from ..errors import TransportError
from ..transport.base import DataTransport, TransferHandle, TransferState
from ..wire import Outcome
from ._parts import SessionParts
from .protocol import (
    AbortRequested,
    FetchRequested,
    InState,
    LookupRequested,
    RoundClosed,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("p2pkv.session")

Posted = tuple[list[tuple[int, int, int]], TransferHandle, DataTransport]


def checksums(view: memoryview, block_len: int, slots: Sequence[int]) -> list[int]:
    return [zlib.crc32(view[s * block_len : (s + 1) * block_len]) for s in slots]


class ProducerSide(SessionParts):
    """Mixin of :class:`~p2pkv.session.session.PeerSession`: the producer's handlers."""

    if TYPE_CHECKING:  # provided by PeerSession
        inflight_bytes: int
        _pinned: dict[int, dict[bytes, int]]
        _writes: dict[int, trio.CancelScope]
        _write_done: dict[int, trio.Event]
        _aborting: set[int]

    def _on_lookup(self, ev: LookupRequested) -> None:
        owner = (self.token, ev.req_id)
        slots = self.node.store.pin(owner, ev.keys)
        room = self.cfg.max_pinned_blocks - self.proto.pins_held()
        pinned: dict[bytes, int] = {}
        hits: list[bool] = []
        over: list[int] = []
        for key, slot in zip(ev.keys, slots, strict=True):
            if slot is None:
                hits.append(False)
            elif key in pinned or len(pinned) < room:
                pinned[key] = slot
                hits.append(True)
            else:  # over this peer's pin cap: answer as a miss, release the pin
                over.append(slot)
                hits.append(False)
        if over:
            self.node.store.unpin_keys(owner, over)
        self._pinned[ev.req_id] = pinned
        self.proto.send_lookup_resp(ev.req_id, hits, trio.current_time(), self.cfg.lease)
        self._wake_lease.set()

    def _release_round(self, req: int) -> None:
        self._pinned.pop(req, None)
        self.node.store.unpin((self.token, req))

    def _on_round_closed(self, ev: RoundClosed) -> None:
        self._release_round(ev.req_id)

    def _on_abort(self, ev: AbortRequested) -> None:
        scope = self._writes.get(ev.req_id)
        if scope is not None:
            self._aborting.add(ev.req_id)
            scope.cancel()  # the write task drains, releases and acks
        else:
            self._release_round(ev.req_id)
            self.proto.send_abort_ack(ev.req_id)

    def _on_fetch(self, ev: FetchRequested) -> None:
        assert self._nursery is not None
        scope = trio.CancelScope()
        self._writes[ev.req_id] = scope
        self._write_done[ev.req_id] = trio.Event()
        self._nursery.start_soon(self._serve_fetch, ev, scope)

    async def _serve_fetch(self, ev: FetchRequested, scope: trio.CancelScope) -> None:
        node, bl = self.node, self.cfg.block_len
        # Pessimistic: a key is OK only once the data plane reported its write DONE, so no
        # exit path (error, cancellation, a bug) can report bytes that never landed.
        outcomes = [int(Outcome.TRANSFER_FAILED)] * len(ev.keys)
        pinned = self._pinned.get(ev.req_id, {})
        budget = max(0, (self.cfg.max_inflight_bytes - self.inflight_bytes) // bl)
        plan: list[tuple[int, int, int]] = []  # (index, local slot, remote slot)
        for i, (key, dst) in enumerate(zip(ev.keys, ev.slots, strict=True)):
            src = pinned.get(key)
            if ev.expired:
                outcomes[i] = Outcome.LEASE_EXPIRED
            elif src is None:
                outcomes[i] = Outcome.NOT_PINNED
            elif len(plan) >= budget:
                outcomes[i] = Outcome.OVER_CAP
            else:
                plan.append((i, src, dst))
        self.inflight_bytes += len(plan) * bl
        per_chunk = max(1, self.cfg.transfer_chunk_bytes // bl)
        chunks = [plan[j : j + per_chunk] for j in range(0, len(plan), per_chunk)]
        posted: list[Posted] = []
        settled: set[int] = set()
        sums: list[int] | None = None
        try:
            with scope:
                for chunk in chunks:
                    try:
                        dp, h = await node.offload(
                            self._post,
                            [c[1] for c in chunk],
                            [c[2] for c in chunk],
                            limiter=node.data_limiter,
                        )
                    except TransportError as exc:
                        log.warning("posting writes to %s failed: %s", self.peer_id, exc)
                        for c in chunk:
                            outcomes[c[0]] = Outcome.TRANSFER_FAILED
                        continue
                    posted.append((chunk, h, dp))
                for chunk, h, dp in posted:
                    state = await node.poller.wait(h, dp)
                    settled.add(id(h))
                    if state is TransferState.DONE:
                        for c in chunk:
                            outcomes[c[0]] = Outcome.OK
                if self.cfg.verify_checksums:  # sources are still pinned: bytes as sent
                    sums = [0] * len(ev.keys)
                    got = await node.offload(
                        checksums,
                        node.store.array.data,
                        bl,
                        [c[1] for c in plan],
                        limiter=node.cpu_limiter,
                    )
                    for c, crc in zip(plan, got, strict=True):
                        sums[c[0]] = crc
        finally:
            with trio.CancelScope(shield=True):
                quiet = await self._settle(posted, settled, outcomes)
                self.inflight_bytes -= len(plan) * bl
                self._writes.pop(ev.req_id, None)
                self._write_done.pop(ev.req_id).set()
                if quiet:
                    self._release_round(ev.req_id)
                else:  # the data plane may still read the sources: hold their pins a while
                    self._pinned.pop(ev.req_id, None)
                    node.defer(self.cfg.quarantine, node.store.unpin, (self.token, ev.req_id))
                if ev.req_id in self._aborting:
                    self._aborting.discard(ev.req_id)
                    if self.proto.in_state(ev.req_id) is InState.ABORTING:
                        self.proto.send_abort_ack(ev.req_id)
                elif self.proto.in_state(ev.req_id) is InState.WRITING and not scope.cancel_called:
                    self.proto.send_transfer_done(ev.req_id, [int(o) for o in outcomes], sums)
                if self.alive:
                    await self._flush()

    def _post(
        self, local: list[int], remote_slots: list[int]
    ) -> tuple[DataTransport, TransferHandle]:
        """Runs in the worker thread, holding the data-plane limiter. The transport and the
        peer's registration are read *here*: a reconfiguration swaps both while it holds
        the same limiter, so a post can never pair the old registration (already stale)
        with either transport, nor land on a transport being retired."""
        dp, remote = self.node.transport, self.remote
        if remote is None:  # pragma: no cover - the ack barrier guarantees it
            raise TransportError("peer is not registered", peer=self.peer_id)
        return dp, dp.post_write(remote, local, remote_slots)

    async def _settle(
        self,
        posted: list[tuple[list[tuple[int, int, int]], TransferHandle, DataTransport]],
        settled: set[int],
        outcomes: list[int],
    ) -> bool:
        """Wait (bounded) for unsettled handles, release all; True if everything is quiet."""
        node, quiet = self.node, True
        for chunk, h, dp in posted:
            if id(h) not in settled:
                with trio.move_on_after(self.cfg.abort_timeout):
                    await node.poller.wait(h, dp)
                    settled.add(id(h))
                for c in chunk:  # cut short: whatever landed is not reported as loaded
                    outcomes[c[0]] = Outcome.ABORTED
            if id(h) in settled:
                dp.release(h)
            else:
                quiet = False
                await node.offload(dp.release, h, limiter=node.data_limiter)
        return quiet
