"""The consumer half of a peer session: lookup rounds and fetches into our store.

Theory of operation
-------------------
Rounds. ``lookup`` opens one round per request it sends (the producer pins the hits for a
lease) and keeps it open so that a ``fetch`` soon after reuses it; rounds nobody fetched
are closed with an empty fetch at 0.9 x lease. A round opened through a
:class:`LookupRound` handle is *held*: only a fetch or a release that names the handle
uses or closes it, so one request finishing never unpins another request's hits
(release is per round, never per key). Plain ``lookup`` rounds are anonymous: any fetch
may use them.

One round, one fetch. A fetch *claims* every round it uses by taking it out of the open
rounds, in the same step in which it found it (no checkpoint in between), so no two
fetches ever send on one round. Keys a round holds that its claimant does not fetch are
looked up again by whoever needs them.

One key, one transfer. A fetch registers the keys it brings in (its claim) before its
first checkpoint. A concurrent fetch of one of those keys does not fetch it again: it
waits for the claim and reports that fetch's outcome for the key (loaded only if that
fetch committed it).

Landing. ``fetch`` reserves destination slots, names them in the ``fetch`` message and
waits for ``transfer_done``; only keys reported OK (and, with checksums on, whose landed
bytes match the producer's CRC32) are committed to the store. Every other key is a
per-key failure with a reason: ``fetch`` never raises for those, and every reservation
ends committed, released or quarantined, whatever happens to the caller.

Quarantine (DESIGN invariant 10). A fetch that ends without ``transfer_done`` (deadline,
cancellation, the session dying) aborts its request and quarantines its slots, since the
producer may still be writing into them. The producer writes into *our* memory, so our
data plane cannot see its writes stop: the slots stay quarantined until a deadline,
``quarantine`` seconds after we gave up, which the config keeps past the producer's abort
deadline plus the time a released write may still land. The producer's ``abort_ack`` only
ends the request (its request slot is free again); it never frees a slot.

Our own limits. Keys and requests are checked against the limits (:meth:`_limits`) before
anything is sent: ``lookup`` raises :class:`~p2pkv.errors.LocalProtocolError` for a bad key,
``fetch`` reports it as a per-key failure, and requests over the key or frame cap are
split into several rounds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
from collections.abc import Iterable, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..errors import (
    LocalProtocolError,
    P2PKVError,
    P2PKVTimeout,
    PeerUnavailable,
    SessionClosed,
    SlotsInUse,
    StoreFull,
    printable,
)
from ..store import region_lent_error
from ..wire import MAX_FRAME_SIZE, MAX_KEY_LEN, MAX_KEYS, Outcome, keys_ok
from ._parts import SessionParts
from .producer import summed
from .protocol import (
    AbortAcknowledged,
    LookupAnswered,
    OutState,
    TransferCompleted,
)
from .shares import Grant

if TYPE_CHECKING:
    from ..config import NodeConfig
    from .slots import RequestSlots

log = logging.getLogger("p2pkv.session")

#: Bytes a key may cost in a lookup or fetch frame beyond its own length (msgpack header
#: of the key, a destination slot index), and what a frame needs besides its keys.
KEY_OVERHEAD = 16
FRAME_OVERHEAD = 4096

_OK = int(Outcome.OK)
#: Why a session ends when a request must wait for a slot while aborts the peer has not
#: acknowledged within :func:`abort_ack_bound` hold slots.
ACKS_OVERDUE = "request slots held by aborts the peer never acknowledged"
IDS_EXHAUSTED = "request ids exhausted: the session used every one the wire carries"
_LEASE_EXPIRED = int(Outcome.LEASE_EXPIRED)
_NOT_PINNED = int(Outcome.NOT_PINNED)
# Why a key failed that a fetch in store mode did not ask the peer for: the slots its
# writes hold (reserved, or quarantined after we gave up on a fetch) stayed at
# max_landing_share of our store for fetch_timeout (p2pkv/session/shares.py).
_OVER_SHARE = "over the peer's share of our store (max_landing_share)"


@attrs.define(eq=False)
class FetchResult:
    """What a fetch did: ``loaded`` keys were put in the local store with the producer's
    bytes (or were there already); every other requested key is in ``failed`` with a
    reason. Like any block of the store, a loaded one may be evicted after that, by the
    same fetch's reservations too when it asks for more blocks than the store holds
    (``fetch_into``: the caller's slots, which nothing but the caller reuses)."""

    loaded: list[bytes] = attrs.field(factory=list)
    failed: dict[bytes, str] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class LookupRound:
    """A handle on the lookup round(s) of one :meth:`~p2pkv.node.Node.lookup_round`.

    ``hits`` holds one flag per key asked. While the handle is held, its rounds and the
    producer's pins for their hits belong to its holder: only a fetch or a release that
    names it uses or closes them. The rest is opaque: the session that opened the
    rounds and their request ids (a request larger than the key cap is several rounds).
    """

    peer_id: str
    hits: list[bool]
    session_token: object = attrs.field(repr=False)
    req_ids: tuple[int, ...] = attrs.field(repr=False)


@attrs.frozen
class RequestLimits:
    """What one request may hold: keys, bytes per key, and key bytes per frame."""

    max_keys: int
    max_key_len: int
    max_bytes: int


def request_chunks(keys: Sequence[bytes], *, max_keys: int, max_bytes: int) -> list[list[bytes]]:
    """``keys`` in order, cut into requests of at most ``max_keys`` keys whose keys cost at
    most ``max_bytes`` (each key its length plus :data:`KEY_OVERHEAD`)."""
    if len(keys) <= max_keys and len(keys) * (MAX_KEY_LEN + KEY_OVERHEAD) <= max_bytes:
        return [list(keys)] if keys else []  # the usual case: no key can overflow a frame
    chunks: list[list[bytes]] = []
    cur: list[bytes] = []
    size = 0
    for k in keys:
        cost = len(k) + KEY_OVERHEAD
        if cur and (len(cur) >= max_keys or size + cost > max_bytes):
            chunks.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += cost
    if cur:
        chunks.append(cur)
    return chunks


@attrs.define(eq=False)
class _Pending:
    """A consumer request waiting for the peer. Exactly one task (the lookup, then the
    fetch that claimed the round) waits on it at a time."""

    req_id: int
    event: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None
    error: BaseException | None = None
    slots: list[int] = attrs.field(factory=list)  # reserved destination slots
    aborted: bool = False
    # Once aborted: when the peer's abort_ack is overdue (see ConsumerSide._abort).
    ack_by: float = math.inf
    # While a task waits: when the lease timer ends its wait (``event`` set, with neither
    # ``result`` nor ``error``). Otherwise infinite.
    deadline: float = math.inf

    def arm(self) -> None:
        self.event = trio.Event()
        self.result = None


@attrs.define(eq=False)
class _Round:
    """A consumer lookup round still open at the producer (its hits are pinned there)."""

    req_id: int
    keys: list[bytes]  # the hits, in the lookup's order
    deadline: float
    held: bool = False  # a LookupRound handle names it: only its holder may use it
    _set: set[bytes] | None = None

    @property
    def hits(self) -> set[bytes]:
        """The hits as a set (built on first use: a fetch of exactly :attr:`keys`, the
        usual case, never needs it)."""
        if self._set is None:
            self._set = set(self.keys)
        return self._set


class _Outcome(dict[bytes, "str | None"]):
    """What became of each key of a fetch: key -> None (loaded) or why not. Keys that
    land together are kept as the list they landed in (:meth:`land`), so the usual fetch,
    where every key lands, does no per-key work to say so. A key is decided once: it is
    in the map or in a landed list, never both."""

    __slots__ = ("_landed_set", "landed", "n_landed")

    def __init__(self) -> None:
        super().__init__()
        self.landed: list[list[bytes]] = []
        self.n_landed = 0
        self._landed_set: set[bytes] | None = None

    def land(self, keys: list[bytes]) -> None:
        """``keys`` (none of them decided yet) were committed: loaded."""
        self.landed.append(keys)
        self.n_landed += len(keys)
        self._landed_set = None

    def absorb(self, other: _Outcome) -> None:
        """Take over ``other``'s decisions (about keys this one has not decided)."""
        self.update(other)
        self.landed += other.landed
        self.n_landed += other.n_landed
        self._landed_set = None

    def decided(self) -> int:
        """How many keys are decided (each key counts once)."""
        return len(self) + self.n_landed

    def _landed(self) -> set[bytes]:
        if self._landed_set is None:
            self._landed_set = {k for ks in self.landed for k in ks}
        return self._landed_set

    def why(self, key: bytes) -> str | None:
        """None if ``key`` loaded, else why not; "cancelled" if it was never decided."""
        if key in self:
            return self[key]
        if self.n_landed and key in self._landed():
            return None
        return "cancelled"

    def settle_rest(self, keys: list[bytes], reason: str) -> None:
        """Each of ``keys`` not decided yet fails with ``reason``."""
        landed = self._landed()
        for k in keys:
            if k not in self and k not in landed:
                self[k] = reason


@attrs.define(eq=False)
class _Claim:
    """The keys one fetch is bringing in, and what became of each."""

    keys: list[bytes]
    done: trio.Event = attrs.field(factory=trio.Event)
    outcome: _Outcome = attrs.field(factory=_Outcome)


class _StoreLanding:
    """Where a :meth:`ConsumerSide.fetch` lands: slots reserved in the node's store, the
    good keys committed, the rest released, unsettled slots quarantined in the store."""

    def __init__(self, session: ConsumerSide) -> None:
        node = session.node
        self.store = node.store
        self.shares = node.landing_shares
        self.session = session
        # The peer's share is counted under its id, across its sessions (see shares.py).
        self.peer = session.who

    def owner(self, req: int) -> object:
        return (self.session.token, "dst", req)

    def reserve(self, req: int, keys: list[bytes], grant: Grant | None = None) -> list[int]:
        """Slots for the first keys, as many as the peer's share leaves room for, or as
        ``grant`` holds (the rest are not asked for); StoreFull if the store has too few."""
        if grant is None:
            n = self.shares.take(self.peer, len(keys), self.cap(), trio.current_time())
        else:
            n = grant.use(len(keys))
        if not n:
            return []
        try:
            return self.store.reserve(self.owner(req), n)
        except BaseException:
            self.shares.settle(self.peer, n)
            raise

    def cap(self) -> int:
        """The slots the peer's writes may hold: its share of the store, at least one."""
        return max(int(self.session.cfg.max_landing_share * self.store.num_blocks), 1)

    async def wait_for_room(self, n: int, give_up_at: float) -> Grant:
        return await self.shares.wait_for_room(self.peer, n, self.cap(), give_up_at)

    def return_grant(self, grant: Grant) -> None:
        self.shares.settle(self.peer, grant.use(grant.left))

    def commit(self, req: int, slots: list[int], keys: list[bytes]) -> None:
        # The slots are this request's reservation; the keys passed _sendable's check.
        self.store._commit_reserved(self.owner(req), slots, keys)
        self.shares.settle(self.peer, len(slots))

    def release(self, req: int, slots: list[int]) -> None:
        self.store.release_reserved(self.owner(req), slots)
        self.shares.settle(self.peer, len(slots))

    def quarantine(self, req: int, slots: list[int], until: float) -> None:
        self.store.quarantine(self.owner(req), slots, until=until)
        self.shares.quarantine(self.peer, len(slots), until)
        self.session.node.wake_quarantine()


class _CallerSlots:
    """Where a :meth:`ConsumerSide.fetch_into` lands: the slots the caller named. Nothing
    is reserved or committed (the caller owns the slots); an unsettled write only pushes
    back the moment the fetch may return (``settle_at``)."""

    def __init__(self, dst: dict[bytes, int]) -> None:
        self.dst = dst
        self.settle_at = -math.inf

    def reserve(self, req: int, keys: list[bytes], grant: Grant | None = None) -> list[int]:
        return [self.dst[k] for k in keys]

    async def wait_for_room(self, n: int, give_up_at: float) -> Grant:  # pragma: no cover
        return Grant(n)  # reserve never falls short: the caller named every slot

    def return_grant(self, grant: Grant) -> None:  # pragma: no cover
        pass

    def commit(self, req: int, slots: list[int], keys: list[bytes]) -> None:
        pass

    def release(self, req: int, slots: list[int]) -> None:
        pass

    def quarantine(self, req: int, slots: list[int], until: float) -> None:
        self.settle_at = max(self.settle_at, until)


_Landing = _StoreLanding | _CallerSlots
# Claimed rounds: request id -> (the keys to fetch on it, whether they are every hit of
# the round in its order, which a fetch_hits may stand for, whether a LookupRound handle
# holds the round).
_Groups = dict[int, tuple[list[bytes], bool, bool]]


def check_rounds(rounds: Iterable[LookupRound], peer_id: str | None, op: str) -> list[LookupRound]:
    """``rounds`` as a list, every item a :class:`LookupRound`, else
    :class:`LocalProtocolError` (naming the first item that is not)."""
    try:
        handles = rounds if type(rounds) is list else list(rounds)
    except TypeError:
        raise LocalProtocolError(
            "rounds must be an iterable of LookupRound", peer=peer_id, op=op
        ) from None
    for i, h in enumerate(handles):
        if not isinstance(h, LookupRound):
            raise LocalProtocolError(
                f"rounds[{i}] is a {type(h).__name__}, not a LookupRound", peer=peer_id, op=op
            )
    return handles


class ConsumerSide(SessionParts):
    """Mixin of :class:`~p2pkv.session.session.PeerSession`: the consumer's calls."""

    if TYPE_CHECKING:  # provided by PeerSession
        _requests: RequestSlots
        _pending: dict[int, _Pending]
        _rounds: dict[int, _Round]
        _claims: list[_Claim]
        _claim_index: dict[bytes, _Claim] | None
        _limits_cache: tuple[object, RequestLimits] | None
        _share_waits: set[trio.CancelScope]

    # --- events from the peer -------------------------------------------------------------

    def _on_answer(self, ev: LookupAnswered) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None:
            p.result = ev
            self._wake_waiter(p)

    def _on_transfer_done(self, ev: TransferCompleted) -> None:
        p = self._pending.get(ev.req_id)
        if p is not None:
            p.result = ev
            self._wake_waiter(p)
        self._request_ended(ev.req_id)

    def _on_abort_ack(self, ev: AbortAcknowledged) -> None:
        # The request is over, so its request slot is free. Its slots stay quarantined:
        # the peer's word never frees them, only their deadline does (invariant 10).
        self._request_ended(ev.req_id)

    def _request_ended(self, req: int) -> None:
        if self._pending.pop(req, None) is not None:
            self._requests.give_back()

    # --- limits ---------------------------------------------------------------------------

    def _limits(self) -> RequestLimits:
        """What one of our requests may hold: never more than the wire allows, our own
        config, or what the peer advertised in its hello (so it never has to cut us off).
        Computed once per hello (the only input that changes)."""
        cached = self._limits_cache
        if cached is not None and cached[0] is self.proto.peer:
            return cached[1]
        frame = min(self.cfg.max_frame_size, MAX_FRAME_SIZE)
        max_keys, max_key_len = self.proto.request_limits()
        limits = RequestLimits(
            max_keys=min(max_keys, MAX_KEYS),
            max_key_len=min(max_key_len, MAX_KEY_LEN),
            max_bytes=max(frame - FRAME_OVERHEAD, MAX_KEY_LEN + KEY_OVERHEAD),
        )
        self._limits_cache = (self.proto.peer, limits)
        return limits

    def _chunks(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        lim = self._limits()
        return request_chunks(keys, max_keys=lim.max_keys, max_bytes=lim.max_bytes)

    @staticmethod
    def _key_problem(key: object, max_len: int) -> str | None:
        if type(key) is not bytes:
            return "key is not bytes"
        if not key:
            return "empty key"
        if len(key) > max_len:
            return "key too long"
        return None

    def _sendable(
        self, keys: list[bytes], outcome: dict[bytes, str | None]
    ) -> tuple[list[bytes], RequestLimits]:
        """The keys we could send, and the limits they were checked against; each other
        key's problem goes into ``outcome``."""
        lim = self._limits()
        max_len = lim.max_key_len
        if keys_ok(keys, max_len):
            return keys, lim  # the usual case, without a Python loop per key
        valid = []
        for k in keys:
            problem = self._key_problem(k, max_len)
            if problem is None:
                valid.append(k)
            else:
                outcome[k] = problem
        return valid, lim

    def _check_keys(self, keys: Sequence[bytes], op: str) -> RequestLimits:
        """Raises for the first key we could not send; the limits the keys were checked
        against. While :meth:`_limits` still returns that very object (no new hello came
        in), the protocol need not walk the keys again (its ``checked``)."""
        lim = self._limits()
        max_len = lim.max_key_len
        if keys_ok(keys, max_len):
            return lim  # the usual case, without a Python loop per key
        for i, k in enumerate(keys):
            problem = self._key_problem(k, max_len)
            if problem is not None:
                raise LocalProtocolError(
                    f"key {i}: {problem} (keys are 1..{max_len} bytes)", peer=self.peer_id, op=op
                )
        return lim

    # --- lookup ---------------------------------------------------------------------------

    def _check_usable(self, op: str) -> None:
        if not self.alive:
            raise SessionClosed(self.close_reason or "session ended", peer=self.peer_id, op=op)
        if not self.ready.is_set():
            raise PeerUnavailable(
                "session is not ready (handshake in progress)", peer=self.peer_id, op=op
            )

    async def lookup(self, keys: Sequence[bytes], *, held: bool = False) -> LookupRound:
        """Which ``keys`` the peer holds; the rounds stay open (the producer pins the hits
        for a lease) until a fetch uses them, a release closes them or the lease runs out.

        ``held``: the rounds belong to the returned handle's holder (see
        :class:`LookupRound`); otherwise any fetch may use them. A request over the key
        cap is sent as several rounds, whose request slots it takes together. Raises
        :class:`LocalProtocolError` for a key we could not send, or for more rounds than
        may be open at this peer at once, before anything is sent."""
        keys = list(keys)
        lim = self._check_keys(keys, "lookup")
        chunks = request_chunks(keys, max_keys=lim.max_keys, max_bytes=lim.max_bytes)
        # One deadline for the whole lookup, however many rounds it takes: with one per
        # round, a peer advertising one key per request and answering each just in time
        # would hold a caller for rounds x lookup_timeout.
        end = trio.current_time() + self.cfg.lookup_timeout
        if len(chunks) == 1:  # the usual case
            req, one = await self._lookup_round(chunks[0], lim, end)
            answered = [(req, chunks[0], one, trio.current_time())]
        else:
            answered = await self._lookup_rounds(chunks, lim, end) if chunks else []
        rounds: list[_Round] = []
        hits: list[bool] = []
        for req, chunk, chunk_hits, at in answered:
            hits += chunk_hits
            found = chunk if all(chunk_hits) else list(compress(chunk, chunk_hits))
            rounds.append(_Round(req, found, at + self.cfg.lease * 0.9, held=held))
        # Published together, with no checkpoint since the last answer. A round without
        # hits pins nothing and no fetch could use it: it is closed at once.
        empty = False
        for rnd in rounds:
            if rnd.keys:
                self._rounds[rnd.req_id] = rnd
                self._rearm_lease_timer(rnd.deadline)
            else:
                self._close_round(rnd.req_id)
                empty = True
        if empty:
            self._flush_soon()
        return LookupRound(self.peer_id or "", hits, self.token, tuple(r.req_id for r in rounds))

    async def _lookup_rounds(
        self, chunks: list[list[bytes]], lim: RequestLimits, end: float
    ) -> list[tuple[int, list[bytes], list[bool], float]]:
        """A lookup of several rounds (keys already checked against ``lim``, each chunk
        within it), every one answered by ``end`` or all given up: per round its request
        id, its keys, its hits and when its answer was seen (its lease counts from then).

        Every round stays open until all are answered, so the rounds take their request
        slots together first: two such lookups could otherwise each hold part of what the
        other waits for, or one all it has and wait for itself. Then they are sent
        together, before the first answer is waited for: one round trip for the lookup,
        not one per round. A partial answer is no answer: if any round fails, is not
        answered in time or the caller cancels, the rounds answered are closed (the
        producer unpins their hits) and the rest aborted."""
        await self._take_request_slots(len(chunks), end)
        sent: list[_Pending] = []
        try:
            self._check_usable("lookup")
            self._check_request_ids(len(chunks))
            checked = lim is self._limits()
            for chunk in chunks:
                req = self.proto.send_lookup(chunk, checked=checked)
                p = self._pending[req] = _Pending(req)
                sent.append(p)  # the slot is the request's from here on
            await self._flush(until=end)
            answered = []
            for p, chunk in zip(sent, chunks, strict=True):
                await self._wait_for_answer(p, end - trio.current_time())
                if p.error is not None:
                    raise p.error
                if p.result is None:  # its deadline passed first
                    raise P2PKVTimeout("lookup timed out", peer=self.peer_id, op="lookup")
                answered.append((p.req_id, chunk, p.result.hits, trio.current_time()))
            return answered
        except BaseException:
            self._requests.give_back(len(chunks) - len(sent))
            for p in sent:
                if p.result is not None and p.error is None:
                    self._close_round(p.req_id)  # answered: its round is open
                else:
                    self._abort(p)
            self._flush_soon()
            raise

    async def _lookup_round(
        self, keys: list[bytes], lim: RequestLimits, end: float
    ) -> tuple[int, list[bool]]:
        """One lookup request (keys already checked against ``lim`` and within it), answered
        by ``end`` (Trio's clock) or given up. The round is the caller's: it is not among
        the open rounds until the caller puts it there."""
        self._check_usable("lookup")
        # Waiting for a request slot is part of the lookup's deadline; the usual case, a
        # slot free, takes no checkpoint (and nothing can have changed since the check).
        waited = False
        if not self._requests.take_nowait():
            await self._take_request_slots(1, end)
            waited = True
        try:
            if waited:
                self._check_usable("lookup")
            self._check_request_ids(1)
            req = self.proto.send_lookup(keys, checked=lim is self._limits())
        except BaseException:
            self._requests.give_back()
            raise
        p = self._pending[req] = _Pending(req)
        try:
            await self._flush(until=end)
            await self._wait_for_answer(p, end - trio.current_time())
        except BaseException:
            self._abort(p)
            raise
        if p.error is not None:
            raise p.error
        if p.result is None:  # its deadline passed first
            self._abort(p)
            raise P2PKVTimeout("lookup timed out", peer=self.peer_id, op="lookup")
        hits: list[bool] = p.result.hits
        return req, hits

    def _check_request_ids(self, n: int) -> None:
        """Room for ``n`` more request ids on this session. A session that used the last
        (``U64_MAX``: ids only go up, see ``SessionProtocol.request_ids_left``) ends here,
        so that the next connect starts a new one from id 1, rather than stay up refusing
        every lookup."""
        if self.proto.request_ids_left < n:
            self.close(IDS_EXHAUSTED)
            raise SessionClosed(IDS_EXHAUSTED, peer=self.peer_id, op="lookup")

    async def _wait_for_answer(self, p: _Pending, seconds: float) -> None:
        """Until the peer answers ``p`` (``p.result``), the session fails (``p.error``) or
        ``seconds`` pass (neither). The deadline is the lease timer's to keep, not
        a cancel scope's: entering and leaving a scope with a deadline costs more than the
        rest of a small lookup's own work, and the timer rarely wakes (see
        :meth:`~p2pkv.session.session.PeerSession._lease_timer`)."""
        p.deadline = trio.current_time() + seconds
        self._rearm_lease_timer(p.deadline)
        try:
            if not await self._wait_in_lane(p):
                await p.event.wait()
        finally:
            p.deadline = math.inf

    async def _take_request_slots(self, n: int, end: float) -> None:
        """``n`` request slots together, by the lookup's deadline ``end``. A lookup that
        needs more than may ever be open at this peer is refused at once."""
        if (self._requests.free < n or self._requests.waiting) and self._acks_overdue():
            self.close(ACKS_OVERDUE, "timeout")
            raise SessionClosed(ACKS_OVERDUE, peer=self.peer_id, op="lookup")
        if n <= self._requests.limit:
            try:
                with trio.fail_at(end):
                    if await self._requests.take(n):
                        return
            except trio.TooSlowError:
                raise P2PKVTimeout(
                    f"no request slot free within the lookup deadline "
                    f"({self._requests.limit} open)",
                    peer=self.peer_id,
                    op="lookup",
                ) from None
        # Refused at once, or while it waited: the peer's new hello lowered the limit.
        raise LocalProtocolError(
            f"a lookup of {n} requests (split by the key limits) is more than the "
            f"{self._requests.limit} that may be open at this peer",
            peer=self.peer_id,
            op="lookup",
        )

    def _acks_overdue(self) -> bool:
        now = trio.current_time()
        return any(p.ack_by <= now for p in self._pending.values())

    def _abort(self, p: _Pending) -> None:
        """Give up on a request; it ends with the peer's abort_ack."""
        self._rounds.pop(p.req_id, None)
        if p.aborted or self.proto.out_state(p.req_id) is None:
            return
        p.aborted = True
        if self.alive:
            self.proto.send_abort(p.req_id)
            # Its request slot comes back only with the ack, so a peer that never sends it
            # could hold the slot for the session's life. Past a bound an honest peer
            # keeps (abort_ack_bound), an overdue ack ends the session once a request has
            # to wait for a slot (the lease timer, _take_request_slots): a peer whose
            # quarantine is longer than the bound assumes costs nothing until then.
            p.ack_by = trio.current_time() + abort_ack_bound(self.cfg)
            self._rearm_lease_timer(p.ack_by)
            self._flush_soon()

    def _flush_soon(self) -> None:
        """Send what is queued from a sync context. If the session is already winding
        down (its nursery closed), the final flush sends it instead."""
        if self._nursery is not None:
            # RuntimeError: the nursery is closed to new arrivals (the session is closing).
            with contextlib.suppress(RuntimeError):
                self._nursery.start_soon(self._flush)

    # --- release --------------------------------------------------------------------------

    async def release(self, rounds: Iterable[LookupRound]) -> int:
        """Close the open rounds of ``rounds`` without fetching: the producer releases
        their pins now instead of at the lease's end. Rounds a fetch already used (or
        that ended otherwise), and handles of another session, are skipped. Returns how
        many rounds were closed. Raises :class:`LocalProtocolError`, before any round is
        closed, if an item is not a :class:`LookupRound`."""
        closed = 0
        for handle in self._handles(rounds, "release"):
            if handle.session_token is not self.token:
                continue
            for req in handle.req_ids:
                if req in self._rounds:
                    self._close_round(req)
                    closed += 1
        if closed:
            await self._send_closes()
        return closed

    def _handles(self, rounds: Iterable[LookupRound], op: str) -> list[LookupRound]:
        """``rounds`` as a list, every item checked before anything is done with any: a
        caller's mistake is refused as a whole (:class:`LocalProtocolError`), never
        after the rounds before it were closed or claimed."""
        return check_rounds(rounds, self.peer_id, op)

    async def _send_closes(self) -> None:
        """Send the empty fetches just queued (:meth:`_close_round`). A caller cancelled
        before they went out leaves them to a session task: the producer holds the
        rounds' pins until it hears, and nothing else may be sent for a heartbeat."""
        try:
            await self._flush()
        except BaseException:
            self._flush_soon()
            raise

    def _close_round(self, req: int) -> None:
        """Close a round nobody fetched (empty fetch): the producer releases its pins."""
        self._rounds.pop(req, None)
        if self.alive and self.proto.out_state(req) is OutState.OPEN:
            self.proto.send_fetch(req, [], [])
            self._request_ended(req)

    # --- fetch ----------------------------------------------------------------------------

    async def fetch(
        self, keys: Sequence[bytes], rounds: Iterable[LookupRound] = (), *, again: bool = True
    ) -> FetchResult:
        """Fetch ``keys`` into the local store. Uses the open rounds of the handles in
        ``rounds`` and the anonymous open rounds where they hold a key, waits for keys
        another fetch is bringing in right now, and looks the rest up first. Never raises
        for per-key failures (:class:`LocalProtocolError` only for an unhashable key or an
        item of ``rounds`` that is not a :class:`LookupRound`).
        A key the other fetch gave up on because its caller cancelled it is fetched here
        (``again``: once), so one caller's cancel never fails another's keys.
        :class:`SlotsInUse` if ``fetch_into`` handed the region to the caller."""
        try:
            wanted = list(dict.fromkeys(keys))
        except TypeError:
            raise LocalProtocolError("keys must be bytes", peer=self.peer_id, op="fetch") from None
        rounds = self._handles(rounds, "fetch")  # read twice if a shared key comes back
        if self.node.store.lent_to_caller:  # before anything is sent
            raise region_lent_error("fetch")
        outcome = _Outcome()
        valid, lim = self._sendable(wanted, outcome)
        here = self.node.store.present(valid)
        claimed = self._claimed()
        mine: list[bytes] = valid  # the usual case: nothing here, nobody else fetching
        shared: dict[_Claim, list[bytes]] = {}
        if claimed is not None or any(here):
            mine = []
            for k, is_here in zip(valid, here, strict=True):
                if is_here:
                    outcome[k] = None
                elif claimed is not None and (other := claimed.get(k)) is not None:
                    shared.setdefault(other, []).append(k)
                else:
                    mine.append(k)
        # From here to the first checkpoint: claim the keys and the rounds.
        claim = _Claim(mine)
        self._add_claim(claim)
        try:
            groups, uncovered = self._claim_rounds(mine, rounds)
            await self._fetch_all(groups, uncovered, claim.outcome, _StoreLanding(self), lim)
        finally:
            if claim.outcome.decided() < len(mine):  # its keys all come from mine
                claim.outcome.settle_rest(mine, "cancelled")
            self._drop_claim(claim)
            claim.done.set()
        outcome.absorb(claim.outcome)
        orphaned: list[bytes] = []
        for other, ks in shared.items():
            await other.done.wait()  # bounded: that fetch has its own deadlines
            for k in ks:
                why = other.outcome.why(k)
                if why == "cancelled" and again:
                    orphaned.append(k)  # its caller cancelled it, not ours
                else:
                    outcome[k] = why
        if orphaned:
            result = await self.fetch(orphaned, rounds, again=False)
            for k in orphaned:
                outcome[k] = result.failed.get(k)  # None: loaded
        return _result(wanted, outcome)

    def _claimed(self) -> dict[bytes, _Claim] | None:
        """Key -> the claim of the fetch bringing it in; None while no fetch is running.
        The map is built when a fetch first starts beside another and kept up to date
        until none runs: fetches one after another never build it."""
        if not self._claims:
            return None
        if self._claim_index is None:
            index: dict[bytes, _Claim] = {}
            for c in self._claims:
                index.update(dict.fromkeys(c.keys, c))
            self._claim_index = index
        return self._claim_index

    def _add_claim(self, claim: _Claim) -> None:
        self._claims.append(claim)
        if self._claim_index is not None:
            self._claim_index.update(dict.fromkeys(claim.keys, claim))

    def _drop_claim(self, claim: _Claim) -> None:
        self._claims.remove(claim)
        index = self._claim_index
        if index is None:
            return
        if not self._claims:
            self._claim_index = None
            return
        for k in claim.keys:
            if index.get(k) is claim:
                del index[k]

    async def fetch_into(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        rounds: Iterable[LookupRound] = (),
        within: float | None = None,
    ) -> FetchResult:
        """Fetch ``keys[i]`` into the caller's slot ``slots[i]`` of the region, bypassing the
        store's key map (the caller owns presence, allocation and pins: vLLM's primary
        tier). Rounds as in :meth:`fetch`; no sharing with other fetches (the caller does
        not ask twice for a key it is already bringing in).

        Returns only once no write into ``slots`` can land any more: at once when the
        producer's ``transfer_done`` is in; after a give-up (deadline, session lost), or
        when a key it reported OK fails its checksum (or comes without one, with
        ``verify_checksums`` on: its word that the write settled is in doubt too), only
        ``quarantine`` seconds later. So whatever the result says, the caller may reuse
        every slot when it has it. Cancelled before that, the caller must keep the slots
        ``quarantine`` seconds (the node keeps them in use for its other ``fetch_into``
        calls until no write can land). ``within``: give up (lookups, waits for
        a request slot and the fetch itself) that many seconds from now, so the result
        comes by ``within + quarantine`` at the latest, whatever had to be looked up
        again; the keys cut short fail "timed out". Raises :class:`LocalProtocolError`,
        before anything is sent, for mismatched lengths, a slot that is not an integer or
        out of the region, a slot named twice or in use by another ``fetch_into``, a
        repeated key, or an item of ``rounds`` that is not a :class:`LookupRound`;
        :class:`SlotsInUse` if the node's store holds anything (the region is
        the store's or the caller's, never both: the first ``fetch_into`` hands it to the
        caller, and the store's ``put`` and ``fetch`` refuse from then on)."""
        keys = list(keys)
        rounds = self._handles(rounds, "fetch")
        n = self.cfg.num_blocks
        dst = check_caller_slots(keys, slots, n, peer_id=self.peer_id)
        dst_slots = list(dst.values())
        taken = self.node.caller_slots
        if not taken.isdisjoint(dst_slots):
            raise LocalProtocolError(
                f"keys must be distinct and slots distinct, free and in 0..{n - 1}",
                peer=self.peer_id,
                op="fetch",
            )
        self.node.store.lend_to_caller()  # SlotsInUse if the store holds anything
        give_up_at = math.inf if within is None else trio.current_time() + max(within, 0.0)
        outcome = _Outcome()
        valid, lim = self._sendable(keys, outcome)
        landing = _CallerSlots(dst)
        taken.update(dst_slots)
        try:
            # No checkpoint between finding the rounds and claiming them.
            groups, uncovered = self._claim_rounds(valid, rounds)
            # The give-up cancels whatever runs (a request waiting for its answer
            # quarantines its slots on the way out: ``_give_up``); the quarantine's
            # wait below is outside it.
            with trio.move_on_at(give_up_at) as cut:
                try:
                    await self._fetch_all(groups, uncovered, outcome, landing, lim)
                finally:
                    if outcome.decided() < len(keys):  # keys are distinct, each decided once
                        outcome.settle_rest(valid, "cancelled")
            if cut.cancelled_caught:
                for k, why in outcome.items():
                    if why == "cancelled":
                        outcome[k] = "timed out"
            # A write we gave up on may still land until the quarantine's end.
            await trio.sleep_until(landing.settle_at)
        finally:
            self._give_back_slots(dst_slots, landing.settle_at)
        return _result(keys, outcome)

    def _give_back_slots(self, dst_slots: list[int], settle_at: float) -> None:
        """``fetch_into``'s slots are free again for another ``fetch_into``: now, or, if it
        was cancelled before a write it gave up on could no longer land, at the
        quarantine's end. Freed at once, a second call naming them would be taken and a
        late write of the first land over what the second reported loaded."""
        taken = self.node.caller_slots
        left = settle_at - trio.current_time()
        if left > 0:
            try:
                self.node.defer(left, taken.difference_update, dst_slots)
                return
            except RuntimeError:  # the node's nursery is closed: the node is going away
                pass
        taken.difference_update(dst_slots)

    async def _fetch_all(
        self,
        groups: _Groups,
        uncovered: list[bytes],
        outcome: _Outcome,
        landing: _Landing,
        lim: RequestLimits,
    ) -> None:
        """Fetch each claimed round's keys and look up and fetch the ``uncovered`` ones,
        all at once. One job alone (the usual case: one round holds every key) runs in
        this task: a nursery and a task of its own would cost more than the job's own
        scheduling."""
        chunks = self._chunks(uncovered)
        if len(groups) + len(chunks) == 1:
            if groups:
                ((req, (ks, whole, held)),) = groups.items()
                await self._fetch_round(req, ks, outcome, landing, lim, whole=whole, held=held)
            else:
                await self._lookup_and_fetch(chunks[0], outcome, landing, lim)
            return
        async with trio.open_nursery() as nursery:
            for req, (ks, whole, held) in groups.items():
                nursery.start_soon(
                    functools.partial(
                        self._fetch_round, req, ks, outcome, landing, lim, whole=whole, held=held
                    )
                )
            for chunk in chunks:
                nursery.start_soon(self._lookup_and_fetch, chunk, outcome, landing, lim)

    def _claim_rounds(
        self, keys: list[bytes], handles: Iterable[LookupRound]
    ) -> tuple[_Groups, list[bytes]]:
        """Take the open rounds that hold ``keys`` out of the open rounds (sync: nobody
        else can claim them meanwhile). The handles' rounds first, then anonymous ones;
        another holder's rounds never. Returns (request id -> (its keys, whether they are
        all the round's hits in its order), keys no round holds)."""
        if not keys:  # nothing to fetch: no round is taken (nor closed, another's)
            return {}, []
        named = [req for h in handles if h.session_token is self.token for req in h.req_ids]
        candidates = [self._rounds[r] for r in named if r in self._rounds]
        candidates += [r for r in self._rounds.values() if not r.held]
        # A round past its own deadline (the engine stalled before the lease timer closed
        # it) is the lease timer's: its keys are looked up again. Sent on, it got every
        # key LEASE_EXPIRED from a producer that still holds them.
        now = trio.current_time()
        candidates = [r for r in candidates if r.deadline > now]
        for rnd in candidates:  # the usual case: one round holds every key (no set built)
            whole = rnd.keys == keys
            if whole or (len(rnd.keys) >= len(keys) and rnd.hits.issuperset(keys)):
                del self._rounds[rnd.req_id]
                return {rnd.req_id: (keys, whole, rnd.held)}, []
            if rnd.held and not rnd.hits.isdisjoint(keys):
                # A named round holds some of the keys: they are its (below), never an
                # anonymous round's that holds them all (other bytes, if re-put since).
                break
        left = set(keys)
        taken: list[tuple[int, set[bytes]]] = []
        for rnd in candidates:
            if not left:
                break
            if got := left & rnd.hits:
                taken.append((rnd.req_id, got))
                left -= got
        lists: dict[int, list[bytes]] = {}
        uncovered: list[bytes] = []
        if not taken:
            uncovered = keys
        else:
            owner: dict[bytes, int] = {}
            for req, got in taken:
                owner.update(dict.fromkeys(got, req))
            for k in keys:
                holder = owner.get(k)
                if holder is None:
                    uncovered.append(k)
                else:
                    lists.setdefault(holder, []).append(k)
        groups: _Groups = {}
        for req, ks in lists.items():
            rnd = self._rounds.pop(req)
            groups[req] = (ks, ks == rnd.keys, rnd.held)
        return groups, uncovered

    async def _lookup_and_fetch(
        self,
        keys: list[bytes],
        outcome: _Outcome,
        landing: _Landing,
        lim: RequestLimits,
        *,
        again: bool = True,
        grant: Grant | None = None,
    ) -> bool:
        """Look ``keys`` up on a round of their own and fetch the hits; False if the
        lookup or the transfer failed (see :meth:`_fetch_round`). ``grant``: room of the
        peer's share counted for these keys already (what is left goes back)."""
        try:
            try:
                end = trio.current_time() + self.cfg.lookup_timeout
                req, hits = await self._lookup_round(keys, lim, end)
            except P2PKVError as exc:
                outcome.update((k, f"lookup failed: {exc}") for k in keys)
                return False
            # No checkpoint since the answer: the round is still this fetch's alone.
            if all(hits):
                hit_keys = keys
            else:
                outcome.update((k, "miss") for k, h in zip(keys, hits, strict=True) if not h)
                hit_keys = list(compress(keys, hits))
            # The round's hits, all of them in its order: the peer may be asked for them by
            # the round alone.
            return await self._fetch_round(
                req, hit_keys, outcome, landing, lim, whole=True, again=again, grant=grant
            )
        finally:
            if grant is not None:
                landing.return_grant(grant)

    async def _fetch_round(
        self,
        req: int,
        keys: list[bytes],
        outcome: _Outcome,
        landing: _Landing,
        lim: RequestLimits,
        *,
        whole: bool = False,
        again: bool = True,
        grant: Grant | None = None,
        held: bool = False,
    ) -> bool:
        """Fetch ``keys`` (checked against ``lim``) on the round ``req`` this task has
        claimed; an empty ``keys`` closes the round. Its slots come from ``landing``:
        distinct slots of our region, from the store or checked by ``fetch_into``.
        ``whole``: ``keys`` are every hit of the round, in its order; a peer that takes
        ``fetch_hits`` is then sent the slots alone (it holds the hits itself).
        ``again``: keys the producer answers ``lease_expired`` are looked up and fetched
        once more (its lease may be shorter than ours: each node has its own, and the
        hello does not carry it); nothing was written for them. So are keys it answers
        ``not_pinned`` (its host took the round's pins back: ``release_unused_pins``)
        unless ``held``, a round a :class:`LookupRound` handle holds, whose holder gets
        ``not_pinned`` for them as documented. ``grant``: room of the
        peer's share counted for these keys already (from :meth:`_fetch_in_parts`).

        Keys past the peer's share of our store (``max_landing_share``) are fetched in
        parts, one after another (:meth:`_fetch_in_parts`). False if a transfer failed
        (deadline, session lost, the store full): its keys, and those not asked for yet,
        are decided then."""
        p = self._pending.get(req)
        if p is None or p.error is not None or not self.alive:
            reason = str(p.error) if p is not None and p.error is not None else "session closed"
            outcome.update((k, reason) for k in keys)
            return False
        if self.proto.out_state(req) is not OutState.OPEN:  # e.g. the peer restarted
            outcome.update((k, "round closed") for k in keys)
            return False
        if not keys:
            self._close_round(req)
            await self._send_closes()
            return True
        try:
            slots = landing.reserve(req, keys, grant)
        except (StoreFull, SlotsInUse) as exc:
            # SlotsInUse: a fetch_into took the region while our lookup was out. The round
            # is closed either way, or its request slot would be lost for good.
            self._close_round(req)
            why = f"store full: {exc}" if isinstance(exc, StoreFull) else f"region lent: {exc}"
            outcome.update((k, why) for k in keys)
            await self._send_closes()
            return False
        rest: list[bytes] = []
        if len(slots) < len(keys):  # past the peer's share of our store (shares.py)
            keys, rest, whole = keys[: len(slots)], keys[len(slots) :], False
            if not keys:
                self._close_round(req)
                await self._send_closes()
                return await self._fetch_in_parts(rest, outcome, landing, lim, again=again)
        if not await self._fetch_reserved(
            p, keys, slots, outcome, landing, lim, whole, again, held
        ):
            # The first part failed: the rest, never asked for, fails as it did.
            outcome.update((k, outcome.get(keys[0])) for k in rest)
            return False
        if rest:  # the first part is in, and its slots count no more
            return await self._fetch_in_parts(rest, outcome, landing, lim, again=again)
        return True

    async def _fetch_reserved(
        self,
        p: _Pending,
        keys: list[bytes],
        slots: list[int],
        outcome: _Outcome,
        landing: _Landing,
        lim: RequestLimits,
        whole: bool,
        again: bool,
        held: bool,
    ) -> bool:
        """:meth:`_fetch_round` once ``slots`` are reserved for ``keys``: send, wait, land.
        True if ``transfer_done`` came (each key then decided by its outcome)."""
        req = p.req_id
        try:
            if whole and self.proto.peer_takes_fetch_hits:
                self.proto.send_fetch_hits(req, slots, checked=True)
            else:
                self.proto.send_fetch(req, keys, slots, checked=lim is self._limits())
        except LocalProtocolError as exc:  # pragma: no cover - checked above; never leak
            log.warning("fetch on round %d refused locally: %s", req, exc)
            landing.release(req, slots)
            outcome.update((k, f"refused locally: {exc.message}") for k in keys)
            return False
        p.arm()
        p.slots = slots
        self.node.poller.add_demand()
        try:
            await self._flush()
            await self._wait_for_answer(p, self.cfg.fetch_timeout)
        except BaseException:
            self._give_up(p, landing, keys, outcome, "cancelled")
            raise
        finally:
            self.node.poller.drop_demand()
        if p.error is not None:
            self._give_up(p, landing, keys, outcome, str(p.error))
            return False
        if p.result is None:
            self._give_up(p, landing, keys, outcome, "timeout")
            return False
        await self._land(p, landing, keys, p.result, outcome)
        if again and (
            _LEASE_EXPIRED in p.result.outcomes or (not held and _NOT_PINNED in p.result.outcomes)
        ):
            retry = ("lease_expired",) if held else ("lease_expired", "not_pinned")
            expired = [k for k in keys if outcome.get(k) in retry]
            for k in expired:
                del outcome[k]  # undecided again: the new round decides them
            await self._lookup_and_fetch(expired, outcome, landing, lim, again=False)
        return True

    async def _fetch_in_parts(
        self,
        keys: list[bytes],
        outcome: _Outcome,
        landing: _Landing,
        lim: RequestLimits,
        *,
        again: bool,
    ) -> bool:
        """Keys a round could not take within the peer's share, fetched part after part:
        wait in the peer's queue for room (at most ``fetch_timeout`` each time), then look
        the part it grants up on a round of its own and fetch it. A loop, not a chain of
        calls: a level per part would raise RecursionError at ~300 parts. Each part takes
        at least one key, and a part that fails ends the loop, its reason given to the
        keys not asked for."""
        while keys:
            # The session's end cancels the wait (_close_down): nothing else would wake
            # it before fetch_timeout.
            grant: Grant | None = None
            if self.alive:
                with trio.CancelScope() as waiting:
                    self._share_waits.add(waiting)
                    try:
                        grant = await landing.wait_for_room(
                            len(keys), trio.current_time() + self.cfg.fetch_timeout
                        )
                    finally:
                        self._share_waits.discard(waiting)
            if grant is None:  # the session ended before or during the wait
                # The close reason may be the peer's bye, its own text: escaped, as every
                # other reason that carries it is (through its error's str).
                reason = printable(f"session closed: {self.close_reason or 'session ended'}")
                outcome.update((k, reason) for k in keys)
                return False
            if not grant.left:
                outcome.update((k, _OVER_SHARE) for k in keys)
                return False
            part, keys = keys[: grant.left], keys[grant.left :]
            if not await self._lookup_and_fetch(
                part, outcome, landing, lim, again=again, grant=grant
            ):
                reasons = [outcome.get(k) for k in part]
                reason = next((r for r in reasons if r not in (None, "miss")), "part failed")
                outcome.update((k, reason) for k in keys)
                return False
        return True

    def _give_up(
        self,
        p: _Pending,
        landing: _Landing,
        keys: list[bytes],
        outcome: _Outcome,
        reason: str,
    ) -> None:
        """The writes into ``p.slots`` are unsettled: quarantine them until the deadline
        (see the module docstring), abort the request."""
        landing.quarantine(p.req_id, p.slots, trio.current_time() + self.cfg.quarantine)
        p.slots = []
        self._abort(p)
        outcome.update((k, reason) for k in keys)

    async def _land(
        self,
        p: _Pending,
        landing: _Landing,
        keys: list[bytes],
        done: TransferCompleted,
        outcome: _Outcome,
    ) -> None:
        """``transfer_done`` is in, so, on the producer's word, every write has settled:
        commit the good keys, free the slots of those it reports failed. A key it reports
        OK whose bytes fail their checksum (or come without one, with ours on) shows its
        word in doubt: that slot is quarantined, not freed, so a late write cannot land in
        a block reused meanwhile. If cancelled while checking, every slot is quarantined."""
        req = p.req_id
        outcomes = done.outcomes
        if not self.cfg.verify_checksums and outcomes.count(_OK) == len(keys):
            # The usual case: every key landed. No per-key work but the store's.
            landing.commit(req, p.slots, keys)
            outcome.land(keys)
            p.slots = []
            return
        ok = [i for i, o in enumerate(outcomes) if o == Outcome.OK]
        good = set(ok)
        reason_bad = ""
        try:
            if self.cfg.verify_checksums:
                if done.checksums is None:
                    good = set()
                    # Its verify_checksums is off (both sides need it), or it lies.
                    reason_bad = "producer sent no checksums (verify_checksums is off there?)"
                else:
                    local = await summed(self.node, [p.slots[i] for i in ok])
                    good = {i for i, c in zip(ok, local, strict=True) if c == done.checksums[i]}
                    reason_bad = "checksum mismatch"
        except BaseException:
            # Whether their bytes are the producer's is not known: not freed on its word.
            landing.quarantine(req, p.slots, trio.current_time() + self.cfg.quarantine)
            p.slots = []
            outcome.update((k, "cancelled") for k in keys)
            raise
        release: list[int] = []
        suspect: list[int] = []  # the producer said OK, the bytes say otherwise
        commit_slots: list[int] = []
        commit_keys: list[bytes] = []
        for i, (key, slot) in enumerate(zip(keys, p.slots, strict=True)):
            if i in good:
                commit_slots.append(slot)
                commit_keys.append(key)
            else:
                o = done.outcomes[i]
                (suspect if o == _OK else release).append(slot)
                outcome[key] = reason_bad if o == Outcome.OK else Outcome(o).name.lower()
        landing.commit(req, commit_slots, commit_keys)
        outcome.land(commit_keys)
        landing.release(req, release)
        if suspect:  # its word that the write settled is in doubt too (invariant 10)
            landing.quarantine(req, suspect, trio.current_time() + self.cfg.quarantine)
        p.slots = []


def check_caller_slots(
    keys: list[bytes], slots: Iterable[object], num_blocks: int, *, peer_id: str | None = None
) -> dict[bytes, int]:
    """``keys[i]`` -> ``slots[i]`` for a load into slots its caller chose (``fetch_into``,
    the vLLM tier's slot loads), or :class:`LocalProtocolError` (op "fetch") for what
    could not be loaded so: a slot that is not an integer (NumPy's and 0-d torch
    tensors' are; a float or a string is never rounded to a slot, and a bool is refused,
    a NumPy or torch one too: a mask passed for slots landed True, False in slots 1 and
    0), lengths that differ, an unhashable key, a key or a slot named twice, a slot
    outside ``0..num_blocks - 1``."""
    try:
        dst_slots = [_slot_index(s) for s in slots]
    except TypeError:
        raise LocalProtocolError("slots must be integers", peer=peer_id, op="fetch") from None
    if len(keys) != len(dst_slots):
        raise LocalProtocolError(
            f"{len(keys)} keys but {len(dst_slots)} slots", peer=peer_id, op="fetch"
        )
    try:
        dst = dict(zip(keys, dst_slots, strict=True))
    except TypeError:
        raise LocalProtocolError("keys must be bytes", peer=peer_id, op="fetch") from None
    if (
        len(dst) != len(keys)
        or len(set(dst_slots)) != len(dst_slots)
        or (dst_slots and (min(dst_slots) < 0 or max(dst_slots) >= num_blocks))
    ):
        raise LocalProtocolError(
            f"keys must be distinct and slots distinct, free and in 0..{num_blocks - 1}",
            peer=peer_id,
            op="fetch",
        )
    return dst


def read_caller_slots(slots: Iterable[object]) -> list[object]:
    """The caller's ``slots`` read now, each integer as a Python int: what the engine
    checks later is then the values the caller passed, not whatever its container holds
    by then. A torch tensor's elements are views of its storage, so ``list(tensor)``
    alone would let a host that reuses its tensor after submitting redirect the writes
    into the slots it wrote there since. What is not an integer is kept as it is, for
    :func:`check_caller_slots` to refuse (whatever its value: a type or a dtype decides)."""
    items = list(slots)
    if set(map(type, items)) <= {int}:  # the usual case: already a list of ints
        return items
    out: list[object] = []
    for slot in items:
        try:
            out.append(_slot_index(slot))
        except TypeError:
            out.append(slot)
    return out


# A bool's dtype, NumPy's and torch's: a bool tensor's element is a 0-d tensor, not a
# ``bool``, and its ``__index__`` gives 1 or 0.
_BOOL_DTYPES = frozenset({"bool", "torch.bool"})


def _slot_index(slot: object) -> int:
    """A caller's slot as an int: TypeError for what is not an integer, a bool included
    (Python's, NumPy's, or an element of a torch bool tensor)."""
    if type(slot) is int:
        return slot
    if isinstance(slot, bool) or str(getattr(slot, "dtype", "")) in _BOOL_DTYPES:
        raise TypeError(f"slot must be an int, got {slot!r}")
    return operator.index(slot)  # type: ignore[arg-type]  # TypeError: not an integer


def abort_ack_bound(cfg: NodeConfig) -> float:
    """How long after our abort the peer's abort_ack may come. An honest producer sends
    it once the round's writes have settled (``abort_timeout``) or, if they did not, once
    it has held the round for its quarantine: twice our own of each (the hello does not
    carry the peer's), and a close's worth of slack for the round trip."""
    return 2 * (cfg.abort_timeout + cfg.quarantine) + cfg.close_timeout


def _result(keys: list[bytes], outcome: _Outcome) -> FetchResult:
    """``keys`` (distinct) in order, each loaded or failed as ``outcome`` (which decided
    every key) says."""
    if outcome.decided() == len(keys) and list(outcome.values()).count(None) == len(outcome):
        return FetchResult(loaded=keys)  # the usual case: every key loaded
    result = FetchResult()
    for k in keys:
        why = outcome.why(k)
        if why is None:
            result.loaded.append(k)
        else:
            result.failed[k] = why
    return result
