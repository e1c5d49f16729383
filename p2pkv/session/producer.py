"""The producer half of a peer session: answering lookups (pins) and serving fetches.

Theory of operation
-------------------
A lookup pins its hits in the store for the round (one pin owner per round, never
reused), in slices of at most one turn's keys (:mod:`p2pkv.session.turns`), and up to the
per-peer pin cap: hits beyond it are answered as misses. A node whose host owns the
blocks (``Node.pin_source``, e.g. :class:`~p2pkv.pins.HostPins` for vLLM) asks the host
instead, in one request bounded by the host's answer deadline; releases go to the same
place (``Node.unpin``). A lookup that would take the
peer over ``max_keys_held_per_peer`` is answered all misses without touching the store,
and a fetch that would is answered ``OVER_CAP`` for every key at once; the session stays
up. A round keeps only its hits and their source slots, as two lists in the lookup's
order (the fetch repeats the keys): a fetch of exactly those keys, the usual case, takes
the slots as they are; any other fetch looks its keys up in a map built on first use.

A fetch becomes one task that posts the writes in chunks off the Trio thread (one worker
thread posts chunk after chunk until another task wants the data plane), waits for
every handle to settle, and only then replies; it releases the round's source pins after
the reply is sent, so the consumer lands while the producer unpins. Outcomes start as
failed and become OK only when the data plane reported the chunk DONE, so no exit path
(error, abort, cancellation, a bug of ours) can report bytes that never landed. When a
write is cut short, its handles get ``abort_timeout`` to settle; a handle that will not is
released, and since the data plane may keep reading the sources and writing the peer's
slots for a while after that, the round is held open ``quarantine`` seconds more: its
source pins stay, and its reply (``abort_ack``, or ``transfer_done``) is sent only then.
Either reply therefore means "no write of this round can land any more". The pins are
released at the quarantine's end even if the session is gone by then.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections import deque
from collections.abc import Sequence
from itertools import compress
from typing import TYPE_CHECKING, cast

import attrs
import trio

from ..errors import TransportError
from ..pins import HostPins, PinSource
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
from .turns import Turn

if TYPE_CHECKING:
    from ..config import NodeConfig
    from ..node import Node

log = logging.getLogger("p2pkv.session")

Posted = tuple[list[int], TransferHandle, DataTransport]
"""A posted chunk: the fetch's key indices it writes, its handle, the transport."""

_OK = int(Outcome.OK)
_ABORTED = int(Outcome.ABORTED)
_NOT_PINNED = int(Outcome.NOT_PINNED)
_OVER_CAP = int(Outcome.OVER_CAP)
_LEASE_EXPIRED = int(Outcome.LEASE_EXPIRED)


def checksums(view: memoryview, block_len: int, slots: Sequence[int]) -> list[int]:
    return [zlib.crc32(view[s * block_len : (s + 1) * block_len]) for s in slots]


def peer_pin_cap(cfg: NodeConfig, bound: int | None) -> int:
    """What one peer's rounds may hold pinned: ``max_pinned_blocks``, and where pins
    have a node-wide ``bound`` (None: none), at most its ``max_pinned_peer_share`` of it
    (at least one slot where the bound has one)."""
    cap, share = cfg.max_pinned_blocks, cfg.max_pinned_peer_share
    if bound is None:
        return cap
    return min(cap, bound if share >= 1 else min(bound, max(1, int(bound * share))))


async def summed(node: Node, slots: Sequence[int]) -> list[int]:
    """The CRC32 of each of ``slots``' blocks, in worker threads, a slice at a time: at
    most ``max_keys_per_turn`` blocks and ``transfer_chunk_bytes`` a slice, the node's
    ``cpu_limiter`` handed over between slices (Trio's limiter is FIFO), so one peer's
    big fetch holds every other peer's checksummed reply, and our own landing checks, for
    one slice at a time (~75 ms at the defaults) instead of its whole pass (~2.5 s for 8
    GiB at 3.4 GB/s)."""
    cfg, view = node.config, node.store.array.data
    bl = cfg.block_len
    per = max(1, min(cfg.max_keys_per_turn, cfg.transfer_chunk_bytes // bl))
    sums: list[int] = []
    for i in range(0, len(slots), per):
        part = slots[i : i + per]
        sums += await node.offload(checksums, view, bl, part, limiter=node.cpu_limiter)
    return sums


@attrs.define(eq=False)
class HeldRound:
    """What the producer holds for one round of the peer's."""

    owner: object = attrs.field(factory=object)  # its pins' owner in the store
    keys: list[bytes] = attrs.field(factory=list)  # the hits, in the lookup's order
    slots: list[int] = attrs.field(factory=list)  # keys[i]'s pinned source slot
    _by_key: dict[bytes, int] | None = None  # keys -> slots, built on first use
    # A write did not settle: the pins and the reply wait for the quarantine's end.
    quarantined: bool = False
    # How many pins the quarantine holds; counted in the node's ``orphan_pins`` for the
    # peer once the round has left its session (``orphaned``) until the quarantine ends.
    quarantined_pins: int = 0
    orphaned: bool = False

    def add(self, key: bytes, slot: int) -> None:
        self.keys.append(key)
        self.slots.append(slot)

    def sources(self, keys: list[bytes]) -> list[int | None]:
        """The pinned source slot of each of ``keys``; None for a key this round holds not."""
        if keys == self.keys:
            return list(self.slots)
        if self._by_key is None:
            self._by_key = dict(zip(self.keys, self.slots, strict=True))
        return list(map(self._by_key.get, keys))

    def hit_sources(self, n: int) -> list[int | None]:
        """For a ``fetch_hits`` of ``n`` slots: the source slot of every hit, in the
        lookup's order; n Nones if the round holds its hits no more (the host took its pins
        back: a fresh, empty round), as a fetch naming the keys would find them."""
        return list(self.slots) if len(self.slots) == n else [None] * n

    def forget(self) -> None:
        """No fetch may use these sources any more (their writes did not settle)."""
        self.keys, self.slots, self._by_key = [], [], None


class ProducerSide(SessionParts):
    """Mixin of :class:`~p2pkv.session.session.PeerSession`: the producer's handlers."""

    if TYPE_CHECKING:  # provided by PeerSession
        inflight_bytes: int
        posts_refused: int
        _pinned: dict[int, HeldRound]
        _writes: dict[int, WriteScope]
        _host_asks: dict[int, HostAsk]
        _host_room: int
        _host_queue: deque[HostAsk]
        _write_done: dict[int, trio.Event]

    async def _answer_lookup(self, ev: LookupRequested, turn: Turn) -> None:
        """The reader's part of a lookup. Where a pin source answers (the host), the lookup
        is handed to a task of its own (:meth:`_ask_host`) and the reader reads on: it
        never waits for the host, so a fetch or an abort behind the lookup is acted on as
        it arrives, however many lookups wait on the host ahead of it (see docs/design.md,
        "The producer's reader never waits for the host"). Otherwise the store pins, in
        slices between which the other sessions run."""
        cfg, store, keys = self.cfg, self.node.store, ev.keys
        pins = self.node.pin_source
        within = self.proto.keys_held() <= cfg.max_keys_held_per_peer  # else: all misses
        if pins is not None and within:
            self._ask_host(ev, pins)
            return
        held = self._pinned[ev.req_id] = HeldRound()
        hits = [False] * len(keys)
        if pins is None and within:
            # All peers together (a share of 1: no bound; pinned slots count once however
            # many rounds pin them, so below 1 a slot pinned again takes room too).
            share = cfg.max_pinned_share
            shared = int(store.num_blocks * share) if share < 1 else 1 << 62
            room = peer_pin_cap(cfg, shared if share < 1 else None) - self._pins_counted()
            i = 0
            while i < len(keys) and (room := min(room, shared - store.pinned_slots)) > 0:
                n = min(turn.room(), len(keys) - i)
                if room >= n:  # the usual case: the caps leave room for the whole slice
                    part = keys[i : i + n]
                    got = store.pin(held.owner, part)
                    if None not in got:  # every key a hit
                        hits[i : i + n] = [True] * n
                        held.keys += part
                        held.slots += cast("list[int]", got)
                        room -= n
                    else:
                        for j, slot in enumerate(got, i):
                            if slot is not None:
                                hits[j] = True
                                held.add(keys[j], slot)
                                room -= 1
                    i += n
                else:
                    # Near a cap: pin only present keys, at most `room` of them, so the
                    # pins never exceed either cap. Slicing by `room` instead made a
                    # lookup of misses one store call per key once room was down to one
                    # (a peer holding the store-wide share minus one did that to all).
                    here = list(compress(range(i, i + n), store.present(keys[i : i + n])))
                    tried = here[:room]
                    got = store.pin(held.owner, [keys[j] for j in tried])
                    for j, slot in zip(tried, got, strict=True):
                        if slot is not None:
                            hits[j] = True
                            held.add(keys[j], slot)
                            room -= 1
                    # Present keys past the room were not tried: if a pin failed (evicted
                    # meanwhile) and left room, the next slice starts after the last tried.
                    i = tried[-1] + 1 if len(here) > len(tried) else i + n
                turn.charge(keys=n)
                if i < len(keys) and room > 0:  # more to pin: let the other sessions run
                    await turn.pause_if_spent()
                    if self._pinned.get(ev.req_id) is not held:
                        # Released meanwhile (release_unused_pins, the session's end):
                        # its pins are gone, and no later slice may pin for nobody.
                        self.node.unpin(held.owner)
                        hits = [False] * len(keys)
                        break
                # else the answer goes out first: the reader pauses after this event
        self._send_answer(ev.req_id, hits)

    def _send_answer(self, req: int, hits: list[bool]) -> None:
        if self.proto.in_state(req) is InState.ANSWERING:
            now = trio.current_time()
            self.proto.send_lookup_resp(req, hits, now, self.cfg.lease, checked=True)
            self._rearm_lease_timer(now + self.cfg.lease)

    def _ask_host(self, ev: LookupRequested, pins: PinSource) -> None:
        """Hand a lookup to the host in a task of its own, under a cancel scope that the
        peer's abort of the lookup, a restart of the peer or the session's end cancels.
        Lookups waiting on the host are bounded by the keys they hold: each is an open
        round counted in ``keys_held`` (``max_keys_held_per_peer``), past which the reader
        answers misses at once.

        Lookups with the host side by side may together pin no more than what is left of
        the peer's cap, so each takes its keys' worth of room (``_host_room``) until the
        host answers. One whose keys that room cannot hold whole, while others are with
        the host, queues (``_host_queue``): at the queue's head, it goes once the room
        left holds its keys, or, with none left with the host, takes what is left. Most
        keys miss, so most of the room comes back with each answer. (Asked at once, it
        was cut to what the others' keys left: a peer's lookups arriving together then
        missed keys that, one after another, would all have hit.) While one queues, those
        after it queue too: the room goes in the order the lookups came. With
        :class:`HostPins`, its time in the queue is bounded by the host's
        ``answer_within`` from its arrival (all misses past it), its wait for the host by
        another: each lookup is answered within two of them, and so is a probe of the
        peer, which waits for every host wait. Another pin source bounds its own waits,
        and its queue has no deadline here."""
        assert self._nursery is not None and self.incarnation is not None
        held = self._pinned[ev.req_id] = HeldRound()
        ask = HostAsk(ev, held, self.incarnation, 0)
        room = self._host_room_left(pins)
        if self._host_asks and (self._host_queue or room < len(ev.keys)):
            ask.queued = True
            self._host_queue.append(ask)
            if isinstance(pins, HostPins):
                # Unbounded, behind a stalled host the n-th queued lookup waited n host
                # waits, and so did a probe of the peer: a reconnect's admission, up to
                # max_open_requests of them (found by a review, 2026-12-07).
                ask.scope.deadline = trio.current_time() + pins.answer_within
        else:
            ask.room = min(room, len(ev.keys))
            self._host_room += ask.room
        self._host_asks[ev.req_id] = ask
        self._nursery.start_soon(self._host_answer, ask, pins)

    def _host_room_left(self, pins: PinSource) -> int:
        """What is left of this peer's part of the host's bound (another pin source bounds
        itself) for a lookup to ask the host for: less its answered rounds' pins and
        those left in quarantine, and less the room of the lookups with the host now,
        whose pins are counted only once they are answered."""
        bound = pins.max_blocks if isinstance(pins, HostPins) else None
        cap = peer_pin_cap(self.cfg, bound)
        return max(cap - self._pins_counted() - self._host_room, 0)

    def _unqueue(self, ask: HostAsk) -> None:
        """Take ``ask`` out of the queue if it is in it; the caller wakes the new head."""
        if ask.queued:
            ask.queued = False
            self._host_queue.remove(ask)

    def wake_host_queue(self) -> None:
        """Room may have come back (an answer, a cut, a round's pins released) or the
        queue moved: its head, alone, looks again (one wake, however long the queue)."""
        if self._host_queue:
            self._host_queue[0].turn.set()

    async def _host_answer(self, ask: HostAsk, pins: PinSource) -> None:
        """One lookup's wait for the host (at most its ``answer_within``; a queued lookup's
        in the queue first, at most another, see :meth:`_ask_host`), then its answer:
        every key the host pinned a hit, and all misses if the wait was cut (the round
        aborted, the peer restarted) or the round released meanwhile. Only the
        incarnation that asked is answered: a restarted peer may reuse the id."""
        ev, held, req = ask.ev, ask.held, ask.ev.req_id
        keys = ev.keys
        got: list[int | None] = []
        self.host_waits += 1  # a probe meanwhile waits for the wait's end
        try:
            with ask.scope:
                if ask.queued:  # too little room was left: its turn first
                    await self._queue_turn(ask, pins)
                got = await pins.pin(held.owner, keys[: ask.room])
            if ask.scope.cancelled_caught:  # an answer that came as it was cut included
                self.node.unpin(held.owner)
                got = []
        except BaseException:
            self.node.unpin(held.owner)  # whatever the host pinned for nobody
            raise
        finally:
            # From here to the answer no checkpoint: the room goes back as the answer's
            # pins are counted (the protocol counts them when the answer is sent). Once:
            # a cut gave it back already (_end_ask).
            self._host_room -= ask.room
            ask.room = 0
            self._unqueue(ask)
            self.host_wait_over()
            if self._host_asks.get(req) is ask:
                del self._host_asks[req]
            # The queue's head looks at its next turn, after this answer is sent below
            # (no checkpoint before it): its pins are counted by then.
            self.wake_host_queue()
        if self._pinned.get(req) is not held:  # released meanwhile
            self.node.unpin(held.owner)
            got = []
        if self.incarnation is not ask.incarnation:
            return  # the peer restarted: the round went with its incarnation
        hits = [False] * len(keys)
        for j, slot in enumerate(got):
            if slot is not None:
                hits[j] = True
                held.add(keys[j], slot)
        self._send_answer(req, hits)
        # Never waits for the socket: a task held here past the outbox's cap would keep
        # its lookup's keys alive (up to max_open_requests of them, for a peer that reads
        # nothing). The answer is a bitmap, and the reader's own flush is the backpressure.
        await self._flush(background=True)

    async def _queue_turn(self, ask: HostAsk, pins: PinSource) -> None:
        """A queued lookup's wait for its turn (:meth:`_ask_host`), inside its scope: at
        the queue's head, once the room left holds its keys, none is left with the host
        (no more room comes back to wait for) or its round was released (it needs no
        room). It then leaves the queue and takes its room, reckoned and taken with no
        checkpoint between, so no other lookup's reckoning comes between; the host gets
        its whole ``answer_within``; and the next head looks at what is left."""
        req, held, n = ask.ev.req_id, ask.held, len(ask.ev.keys)
        while True:
            # A cut that came after this task was woken (its cancel is not delivered at
            # the wait) has taken it out of the queue: it must not read the head.
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._host_queue[0] is ask and (
                self._host_room_left(pins) >= n
                or len(self._host_asks) == len(self._host_queue)
                or self._pinned.get(req) is not held
            ):
                break
            ask.turn = trio.Event()  # no checkpoint since the look: no wake lost
            await ask.turn.wait()
        self._unqueue(ask)
        ask.scope.deadline = math.inf
        if self._pinned.get(req) is held:  # else released meanwhile: no pins
            ask.room = min(self._host_room_left(pins), n)
            self._host_room += ask.room
        self.wake_host_queue()

    def _cut_host_asks(self) -> None:
        """Every lookup still waiting on the host is answered no more (a restart)."""
        for ask in self._host_asks.values():
            self._end_ask(ask)
        self._host_asks.clear()

    def _end_ask(self, ask: HostAsk) -> None:
        """Cut a lookup's wait on the host. Its room goes back now, not when its task next
        runs: a lookup the reader acts on in the same turn may take it (its pins, if the
        host answered meanwhile, are released with the round)."""
        ask.scope.cancel()
        self._host_room -= ask.room
        ask.room = 0
        self._unqueue(ask)
        # A guard: each caller also releases the round, or cuts every ask, and so wakes
        # the head itself (a review found no test that fails without this one).
        self.wake_host_queue()

    def _pins_counted(self) -> int:
        """The pins counted against this peer's ``max_pinned_blocks``: its open rounds'
        and those its earlier sessions or incarnations left in quarantine."""
        held = self.proto.pins_held()
        orphans = self.node.orphan_pins
        return held + orphans.get(self.peer_id or "", 0) if orphans else held

    def _release_round(self, req: int) -> None:
        held = self._pinned.pop(req, None)
        if held is None:
            return
        self.wake_host_queue()  # its pins leave the peer's count (the protocol's, or below)
        if not held.quarantined:
            self.node.unpin(held.owner)
        elif not held.orphaned and self.peer_id is not None:
            # The quarantine's end unpins. Until then its pins count against the peer's
            # cap in the node's ledger: the round leaves the protocol's count here (the
            # session ends, or the peer restarts), and without the ledger a peer that
            # reconnected or restarted would get a whole cap more each time.
            held.orphaned = True
            self.node.orphan_pins[self.peer_id] += held.quarantined_pins

    def release_unused_pins(self, *, cut_writes: bool = False) -> int:
        """Release the pins of every round no write is using (a host draining its
        memory); a fetch on such a round later gets NOT_PINNED. ``cut_writes``: cut
        every write too, as the peer's abort would (each settles within
        ``abort_timeout``, or its round waits out a quarantine, then gives its pins
        back). Returns how many rounds were released at once."""
        if cut_writes:
            for write in list(self._writes.values()):
                write.cancel()
        idle = [r for r, h in self._pinned.items() if r not in self._writes and not h.quarantined]
        for req in idle:
            self._release_round(req)
            self.proto.pins_released(req)  # nor do they count against the peer's pin cap
        return len(idle)

    def _on_round_closed(self, ev: RoundClosed) -> None:
        self._release_round(ev.req_id)

    def _on_abort(self, ev: AbortRequested) -> None:
        ask = self._host_asks.pop(ev.req_id, None)
        if ask is not None:  # still with the host: its wait ends, unanswered
            self._end_ask(ask)
        write = self._writes.get(ev.req_id)
        held = self._pinned.get(ev.req_id)
        if write is not None:
            write.cancel()  # the write task drains, releases and replies
        elif held is None or not held.quarantined:
            self._release_round(ev.req_id)
            self.proto.send_abort_ack(ev.req_id)
        # else: the round waits for its quarantine; its reply will be the abort_ack

    def _on_fetch(self, ev: FetchRequested) -> None:
        if self.proto.keys_held() > self.cfg.max_keys_held_per_peer:
            self._release_round(ev.req_id)
            self.proto.send_transfer_done(ev.req_id, [int(Outcome.OVER_CAP)] * len(ev.slots))
            return
        assert self._nursery is not None
        write = WriteScope()
        self._writes[ev.req_id] = write
        self._write_done[ev.req_id] = trio.Event()
        self._nursery.start_soon(self._serve_fetch, ev, write)

    def _reply(self, req: int, outcomes: list[int], sums: list[int] | None) -> None:
        """No write of the round can land any more: send its terminal reply."""
        state = self.proto.in_state(req)
        self.wake_host_queue()  # the reply ends the round: its pins leave the peer's count
        if state is InState.ABORTING:
            self.proto.send_abort_ack(req)
        elif state is InState.WRITING:
            # Built here from Outcome codes, one per key of the fetch, and not kept.
            self.proto.send_transfer_done(req, outcomes, sums, checked=True)

    def _quarantine_over(
        self, req: int, held: HeldRound, outcomes: list[int], sums: list[int] | None
    ) -> None:
        """Runs ``quarantine`` seconds after a write was released unsettled (or at shutdown)."""
        self.node.unpin(held.owner)
        if held.orphaned and self.peer_id is not None:
            held.orphaned = False
            ledger = self.node.orphan_pins
            ledger[self.peer_id] -= held.quarantined_pins
            if ledger[self.peer_id] <= 0:
                del ledger[self.peer_id]
            self.node.pins_back(self.peer_id)  # to its session now, maybe not this one
        if self._pinned.get(req) is not held:
            return  # the round is gone with its session or the peer's old incarnation
        del self._pinned[req]
        self._reply(req, outcomes, sums)
        self._wake_lease.set()  # the lease timer sends it

    async def _serve_fetch(self, ev: FetchRequested, write: WriteScope) -> None:
        node, cfg, bl, req = self.node, self.cfg, self.cfg.block_len, ev.req_id
        # Pessimistic: a key is OK only once the data plane reported its write DONE, so no
        # exit path (error, cancellation, a bug) can report bytes that never landed.
        n = len(ev.slots)
        outcomes = [int(Outcome.TRANSFER_FAILED)] * n
        held = self._pinned.setdefault(req, HeldRound())
        # The plan, as parallel lists: key index, local (source) slot, remote slot.
        plan_idx: list[int] = []
        plan_src: list[int] = []
        plan_dst: list[int] = []
        posted: list[Posted] = []
        parts: list[slice] = []  # of plan_idx: the chunks not yet posted (or refused)
        settled: set[int] = set()
        sums: list[int] | None = None
        expired = False  # the round's lease ended before every chunk was posted
        # Fixed once the round was answered; read here, on the Trio thread.
        lease_end = self.proto.lease_end(req)
        clock = trio.lowlevel.current_clock()
        try:
            with write.scope:
                per_turn = cfg.max_keys_per_turn
                sources = held.sources(ev.keys) if ev.keys is not None else held.hit_sources(n)
                for start in range(0, n, per_turn):
                    if start:
                        await trio.lowlevel.checkpoint()  # bounded work per turn
                    stop = min(start + per_turn, n)
                    srcs = sources[start:stop]
                    room = max((cfg.max_inflight_bytes - self.inflight_bytes) // bl, 0)
                    if None not in srcs and len(srcs) <= room:  # the usual case
                        plan_idx += range(start, stop)
                        plan_src += cast("list[int]", srcs)
                        plan_dst += ev.slots[start:stop]
                        self.inflight_bytes += len(srcs) * bl
                        continue
                    for i, src in enumerate(srcs, start):
                        if src is None:
                            outcomes[i] = _NOT_PINNED
                        elif self.inflight_bytes + bl > cfg.max_inflight_bytes:
                            outcomes[i] = _OVER_CAP
                        else:
                            plan_idx.append(i)
                            plan_src.append(src)
                            plan_dst.append(ev.slots[i])
                            self.inflight_bytes += bl
                per_chunk = max(1, cfg.transfer_chunk_bytes // bl)
                parts += [slice(j, j + per_chunk) for j in range(0, len(plan_idx), per_chunk)]
                while parts:
                    run = await node.offload_data(
                        self._post_run, plan_src, plan_dst, parts, req, write, lease_end, clock
                    )
                    for part, dp, h in run.posted:
                        posted.append((plan_idx[part], h, dp))
                    for exc in run.refused:  # each fetch of the peer's may: once a WARNING
                        level = logging.DEBUG if self.posts_refused else logging.WARNING
                        self.posts_refused += 1
                        log.log(level, "posting writes to %s failed: %s", self.peer_id, exc)
                    if run.error is not None:
                        raise run.error
                    del parts[: run.tried]
                    if run.ended:
                        expired = run.expired
                        break  # nothing more of this write is posted (see _post_run)
                for chunk, h, dp in posted:
                    # The poller answers a handle already done without a checkpoint: a
                    # cut that came while the posts ran (their thread is never abandoned)
                    # must still win over a handle that landed after it.
                    await trio.lowlevel.checkpoint_if_cancelled()
                    state = await node.poller.wait(h, dp)
                    if h.released and state is not TransferState.DONE:
                        continue  # cut by its transport's close: it may still land
                    settled.add(id(h))
                    if state is TransferState.DONE:
                        _set_all(outcomes, chunk, _OK)
                if cfg.verify_checksums:  # sources are still pinned: bytes as sent
                    # Of the chunks tried only (those never posted, past the lease, are
                    # no one's OK): ``parts`` is what is left of the plan, from its end.
                    upto = parts[0].start if parts else len(plan_idx)
                    got = await summed(node, plan_src[:upto])
                    sums = [0] * n  # only once every sum is made (a cut one has none)
                    for i, crc in zip(plan_idx[:upto], got, strict=True):
                        sums[i] = crc
        finally:
            quiet = False
            with trio.CancelScope(shield=True):
                try:
                    quiet = await self._settle(posted, settled, outcomes)
                except Exception:
                    # The data plane refused a release (or a bug): a handle may still be
                    # in flight, so the round is held as an unsettled one, and the rest of
                    # this end runs all the same (the reply, the bytes in flight, the done
                    # event a restart of the peer waits for).
                    log.exception("settling the writes of round %d to %s failed", req, self.peer_id)
                if write.stopped:
                    # Cut (the peer's abort, the host's cut, a restart): the chunks never
                    # posted are aborted too, as a cut promises, not failed.
                    for part in parts:
                        _set_all(outcomes, plan_idx[part], _ABORTED)
                elif expired:
                    # Never posted: the consumer may look them up again (a new round).
                    for part in parts:
                        _set_all(outcomes, plan_idx[part], _LEASE_EXPIRED)
                if cfg.verify_checksums and sums is None and _OK in outcomes:
                    # Cut (or failed) before its sums were made: a consumer that verifies
                    # would fail a landed key OK without its sum as suspect and quarantine
                    # its slot. Cut short, it is aborted, as the cut promises.
                    outcomes[:] = [_ABORTED if o == _OK else o for o in outcomes]
                self.inflight_bytes -= len(plan_idx) * bl
                self._writes.pop(req, None)
                self._write_done.pop(req).set()
                if quiet:
                    # The reply first: the consumer lands while we unpin (the sources are
                    # read no more, so the order does not matter to anyone else).
                    self._reply(req, outcomes, sums)
                else:  # the data plane may still read the sources and write the peer
                    held.quarantined = True
                    held.quarantined_pins = len(held.slots)
                    held.forget()
                    node.defer(cfg.quarantine, self._quarantine_over, req, held, outcomes, sums)
            try:
                if self.alive:
                    # Never waits for the socket (``background``): past OUTBOX_CAP a plain
                    # flush would wait for a peer that reads nothing, while its round, off
                    # the peer's pin count since the reply was queued, kept its pins. The
                    # reader's flush is the backpressure, not this one.
                    await self._flush(background=True)
            finally:
                if quiet:
                    # By identity: a restart of the peer may have dropped the round
                    # meanwhile, and its new incarnation reused the id (unpin is
                    # idempotent: pins already released are not released again).
                    if self._pinned.get(req) is held:
                        del self._pinned[req]
                    node.unpin(held.owner)

    def _post_run(
        self,
        src: list[int],
        dst: list[int],
        parts: list[slice],
        req: int,
        write: WriteScope,
        lease_end: float,
        clock: trio.abc.Clock,
    ) -> _PostRun:
        """Runs in the worker thread, holding the data-plane limiter: posts the chunks of
        ``parts`` one after another. It lets go after a chunk once another task wants the
        data plane (``Node.data_wanted``; the rest are for the next run), and stops for
        good (``ended``), checking before each chunk, once the write was cancelled
        (``write.stopped``), the session is closing (a node's close closes each), the
        request is no longer being written (aborted, or dropped with a restarted peer), the
        peer has no registration (it restarted), or the round's lease has ended
        (``expired``: no post is called past ``lease_end``, on the Trio clock's time, which
        a consumer's bound on late writes counts on; see docs/design.md, "The producer's
        reader never waits for the host"). It reads plain attributes and dict
        entries that the Trio thread sets: a cancel scope's ``cancel_called`` may not be
        read from another thread.

        A chunk that went back to the Trio thread and out again would wait for the GIL
        twice, each time up to a switch interval with a busy host (docs/design.md, "A busy
        host and the GIL"). Between the chunks of one fetch, nothing needs the Trio thread.
        """
        run = _PostRun()
        node = self.node
        for part in parts:
            # Read *here*, in this thread, holding the data-plane limiter: a
            # reconfiguration swaps both while it holds the same limiter, so a post can
            # never pair the old registration (already stale) with either transport, nor
            # land on a transport being retired.
            dp, remote = node.transport, self.remote
            if (
                # A guard: never a post to no registration. A restart drops the round (its
                # state, below) in the step that swaps in the new incarnation, which is
                # registered only once this write has ended (_forget).
                remote is None
                or write.stopped
                or self.close_reason is not None
                or self.proto.in_state(req) is not InState.WRITING
            ):
                # Checked before each chunk, the first too: a cut that came before this
                # thread reached it posts nothing (the thread itself is never abandoned).
                run.ended = True
                break
            if clock.current_time() >= lease_end:
                # However late the write got here (a stalled loop read the fetch after
                # the lease timer should have run, the data plane was busy), no post.
                run.ended = run.expired = True
                break
            if run.tried and node.data_wanted > 1:
                break  # at least one chunk a run, so a fetch is never starved
            run.tried += 1
            try:
                h = dp.post_write(remote, src[part], dst[part])
            except TransportError as exc:
                run.refused.append(exc)
            except Exception as exc:  # a bug: what was posted must still be settled
                run.error = exc
                break
            else:
                run.posted.append((part, dp, h))
        return run

    async def _settle(self, posted: list[Posted], settled: set[int], outcomes: list[int]) -> bool:
        """Wait (bounded) for unsettled handles, release all; True if everything is quiet.

        One deadline, ``abort_timeout`` from now, for all of them together, then every
        one still unsettled is released at once: the consumer frees its slots
        ``quarantine`` after it gave up (more than ``abort_timeout + landing_margin``),
        and a wait per handle in turn would keep the k-th in flight k times as long. A
        handle its transport released under us (a close) is never settled: the write may
        still land, and the round is held for the quarantine."""
        node, quiet = self.node, True
        deadline = trio.current_time() + self.cfg.abort_timeout
        unsettled: list[tuple[DataTransport, TransferHandle]] = []
        for chunk, h, dp in posted:
            if id(h) not in settled:
                if not h.released:
                    with trio.move_on_at(deadline):
                        await node.poller.wait(h, dp)
                        if not h.released:
                            settled.add(id(h))
                # Cut short: whatever landed is not reported as loaded.
                _set_all(outcomes, chunk, _ABORTED)
            if id(h) in settled:
                if not dp.release_nowait(h):
                    # A post's copy holds the data plane (another fetch's): the engine's
                    # thread must not wait for it, so a worker thread releases this one.
                    unsettled.append((dp, h))
            else:
                quiet = False
                unsettled.append((dp, h))
        if unsettled:
            # Not through data_limiter: a reconfiguration holds it while it re-registers
            # every peer, and the consumer frees these slots ``quarantine`` after it gave
            # up, whatever we wait for. Each handle carries its transport, whose calls
            # into the agent are serialised by the transport itself.
            await node.offload(_release_all, unsettled, limiter=trio.CapacityLimiter(1))
        return quiet


@attrs.define(eq=False)
class HostAsk:
    """A lookup waiting on the host (:meth:`ProducerSide._ask_host`)."""

    ev: LookupRequested
    held: HeldRound
    incarnation: object  # the peer's incarnation that asked
    room: int  # the most keys the host is asked to pin (the peer's cap, what is left)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    queued: bool = False  # in the session's _host_queue: its room not taken yet
    turn: trio.Event = attrs.Factory(trio.Event)  # set: at the queue's head, look again


@attrs.define(eq=False)
class WriteScope:
    """The cancel scope of a fetch's write task, and a flag a worker thread may read.

    Cancel it through :meth:`cancel` only: a run of posts in a worker thread reads
    ``stopped``, never the scope (whose ``cancel_called`` may not be read off the Trio
    thread)."""

    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    stopped: bool = False

    def cancel(self) -> None:
        self.stopped = True
        self.scope.cancel()


@attrs.define
class _PostRun:
    """What one run of posts did (:meth:`ProducerSide._post_run`)."""

    tried: int = 0  # chunks taken from the front of the list, posted or refused
    ended: bool = False  # stopped for good (see _post_run): no run follows this one
    expired: bool = False  # ended because the round's lease had ended
    posted: list[tuple[slice, DataTransport, TransferHandle]] = attrs.Factory(list)
    refused: list[TransportError] = attrs.Factory(list)  # their keys stay failed
    error: Exception | None = None  # a bug: raised on the Trio thread once posted is kept


def _release_all(handles: list[tuple[DataTransport, TransferHandle]]) -> None:
    """Release every handle (in a worker thread), the first failure raised after all."""
    error: BaseException | None = None
    for dp, h in handles:
        try:
            dp.release(h)
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


def _set_all(outcomes: list[int], indices: list[int], value: int) -> None:
    """``outcomes[i] = value`` for each of ``indices`` (ascending key indices)."""
    if indices and indices[-1] - indices[0] == len(indices) - 1:  # a contiguous run
        outcomes[indices[0] : indices[-1] + 1] = [value] * len(indices)
    else:
        for i in indices:
            outcomes[i] = value
