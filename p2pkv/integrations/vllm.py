"""The tier's consumer logic over a :class:`~p2pkv.facade.BlockingNode`, without vLLM.

:mod:`p2pkv.integrations.vllm_tier` binds it to vLLM 0.33's ``SecondaryTierManager``; a host
with a scheduler of its own can drive it directly.

vLLM's tiering manager drives a secondary tier from its scheduler thread, every step:
``lookup(key, request)`` per block key until it stops answering None, ``submit_load`` for
the hits, ``get_finished_jobs`` to collect loads, ``on_request_finished`` when a request
ends, ``shutdown`` at exit. Every one of these must return in microseconds. This module
gives p2pkv that shape without importing vLLM: the request is anything with a
``request_id`` and vLLM's ``kv_transfer_params`` dict (see :class:`RequestInfo`).

Theory of operation
-------------------
Nothing here waits. All peer I/O runs on the node's engine thread; the adapter only
*submits* work (``submit_connect`` / ``submit_lookup_round`` / ``submit_fetch``: a ticket
and a post, no thread hop) and *polls* tickets, so a slow, dead or wedged source costs the
scheduler nothing, and the source's own host thread being busy in a model step does not
matter either (its engine answers).

The source. A consumer request names the peer that holds its prefix the way vLLM does:
``kv_transfer_params["remote_kv_source"] = {"host", "port", "request_id"}`` (vLLM's own
spellings ``remote_host``, ``remote_port``, ``kv_request_id`` are accepted too), with an
optional ``peer_id`` that, when given, must match the peer that answers (checked per
request: a request whose ``peer_id`` does not match fails alone, and the source at that
address goes on serving the others; it comes from a client, not the fleet; one that is
not a non-empty string matches no peer, and leaves the request without a source). The source's
``request_id`` is informational: p2pkv addresses blocks by hash. A source is connected
lazily, by the first request that needs it, through ``submit_connect``; its keys wait
(still answering None) until the connection is up. One connection per source address is
shared by every request. A source that fails (refused, handshake rejected, session
closed) is marked down for ``reconnect_backoff`` seconds: requests that need it meanwhile
miss at once instead of dialing it again every step; after that the next request dials
again.

Batching rule. ``lookup`` answers a key it has seen before from the request's probe
cache (True / False, or None while in flight). A key it has not seen joins the request's
*open batch* and the call returns None. The open batch of a request goes out as ONE
``submit_lookup_round`` (one lookup round, one wire message) at the first of:

* a ``lookup`` call for a key of a *different* request (vLLM asks request by request, so
  this closes the batch of the request it has just finished asking about),
* :meth:`P2PTier.step` (call it at the end of the scheduler step, where vLLM calls
  ``on_schedule_end``) or :meth:`P2PTier.get_finished_jobs`,
* a ``submit_load`` of the same request (the load's keys leave the batch; the fetch
  looks up whatever it needs itself).

A request that asks more keys in a later step gets another batch (another round).

Deadlines. A key resolves to False at the first :meth:`P2PTier.step` (or
``get_finished_jobs``) at least ``lookup_timeout`` after it was first asked, whatever the
source does (no answer, no connection, dead, wedged): the deadline is kept on this side,
on the host's clock, and also given to the engine so the work is cancelled there. The host
must step between its scans: ``lookup`` looks for answers only at a request's first key in
flight after each step. A load finishes (``success=False`` if not everything arrived) at the
latest ``load_timeout`` after ``submit_load``. A request whose lookup or connection
failed is *failed*: every key it asks afterwards misses at once (vLLM then recomputes).

What True means. True: the source held the block when asked and keeps it pinned for its
lease (``NodeConfig.lease``), so a ``submit_load`` soon after reuses that lookup round.
Rounds are per request: every batch is a ``submit_lookup_round`` whose handle the request
keeps, its loads fetch through its own handles only, and ``on_request_finished`` releases
its own rounds only, so one request finishing never unpins another request's hits on
a shared prefix block. ``submit_load`` consumes the probe cache for its keys (after the
fetch the source may evict them; a later ``lookup`` asks again).

Where blocks land. A :class:`LoadJob` without ``slots`` lands in the node's
:class:`~p2pkv.store.BlockStore`, and a :class:`JobResult` lists the keys that landed, with
the producer's bytes. With ``slots`` (vLLM's chunk ids; the host owns that memory:
:mod:`p2pkv.integrations.vllm_tier`), ``keys[i]`` lands in region slot ``slots[i]``
(``fetch_into``) and the job is reported only once no write of it can land any more: at
once if the source said every write settled, else ``quarantine`` seconds after the give-up
(or after the checksum check, with ``verify_checksums``, where a key the source reported
OK failed it: the source's word is in doubt then), since the host reuses a failed slot at
once. The give-up comes by the load's deadline, a
lookup the fetch had to make first included (``fetch_into``'s ``within``). A failed load
fails its request: every later key of it misses (a host that frees failed slots asks
again, and must not loop).

Threading and ownership. A :class:`P2PTier` is not thread-safe: one host thread (the
scheduler) makes every call. The node may be shared with other code, but the tier polls
only its own tickets, so nobody else may drain the node with ``get_finished()``.
``shutdown()`` closes the node only if the tier owns it: :meth:`P2PTier.start` creates an
owned node, the constructor takes ``owns_node`` (default False: the caller closes it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from ..config import NodeConfig, check_seconds
from ..errors import LocalProtocolError, PeerUnavailable, PortalClosed
from ..facade import BlockingNode, start_node
from ..node import Peer
from ..session.consumer import check_caller_slots
from ..session.session import FetchResult, LookupRound

__all__ = ["JobResult", "LoadJob", "P2PTier", "RequestInfo", "RequestLike", "SourceSpec"]

log = logging.getLogger("p2pkv.vllm")

_UNSEEN: Any = object()


class RequestLike(Protocol):
    """What the tier needs of a request: vLLM's request id and ``kv_transfer_params``."""

    @property
    def request_id(self) -> str: ...

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...


@attrs.frozen
class RequestInfo:
    """A request as vLLM hands it to a tier (any :class:`RequestLike` works too)."""

    request_id: str
    kv_transfer_params: Mapping[str, Any] | None = None


@attrs.frozen
class LoadJob:
    """Load ``keys`` of request ``request_id`` from its source.

    Without ``slots`` the keys land in the node's store. With ``slots`` (vLLM's chunk ids:
    the host owns the memory), ``keys[i]`` lands in region slot ``slots[i]`` and the job is
    reported only once no write into those slots can land any more. ``request`` is only
    needed when the tier has not seen the request through ``lookup``.
    """

    job_id: int
    request_id: str
    keys: Sequence[bytes]
    request: RequestLike | None = None
    slots: Sequence[int] | None = None


@attrs.frozen
class JobResult:
    """How a load ended: ``success`` iff every key of the job is in the node's store."""

    job_id: int
    success: bool
    loaded: list[bytes] = attrs.field(factory=list)
    failed: dict[bytes, str] = attrs.field(factory=dict)


@attrs.frozen
class SourceSpec:
    """The peer a request pulls from, as parsed from ``remote_kv_source``."""

    host: str
    port: int
    request_id: str | None = None
    peer_id: str | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> SourceSpec | None:
        """Parse vLLM's ``kv_transfer_params``; None if there is no usable source."""
        if not params:
            return None
        src = params.get("remote_kv_source")
        if not isinstance(src, Mapping):
            return None
        host = src.get("host", src.get("remote_host"))
        port = src.get("port", src.get("remote_port"))
        if isinstance(port, str) and port.isdigit():
            try:
                port = int(port)
            except ValueError:  # "²" is a digit to isdigit; 4,301+ digits int refuses
                return None
        if not isinstance(host, str) or not host or isinstance(port, bool):
            return None
        if not isinstance(port, int) or not 0 < port < 65536:
            return None
        request_id = src.get("request_id", src.get("kv_request_id"))
        peer_id = src.get("peer_id")  # null: absent
        if peer_id is not None and (not isinstance(peer_id, str) or not peer_id):
            return None  # it must match the peer that answers, and no peer has this id
        return cls(host, port, str(request_id) if request_id is not None else None, peer_id)


@attrs.define(eq=False)
class _Source:
    address: tuple[str, int]
    peer: Peer | None = None
    connect_ticket: int | None = None
    connect_deadline: float = 0.0
    retry_at: float = 0.0  # after a failure: no new dial before this (host clock)
    error: str = ""
    used_at: float = 0.0  # when it was last seen in use (host clock; see _reap_sources)
    activity: tuple[int, int] | None = None  # its session's, when last looked at


@attrs.define(eq=False)
class _Load:
    job: LoadJob
    request: _Request  # its request's state (an id may be reused once it finished)
    keys: list[bytes]
    deadline: float
    rounds: tuple[LookupRound, ...] = ()  # the request's rounds when it was submitted
    slots: list[int] | None = None  # caller-owned destinations (job.slots, deduplicated)


@attrs.define(eq=False)
class _Request:
    request_id: str
    source: _Source | None
    # The identity its params promised for the source, if any: checked per request (a
    # client's wrong peer_id fails its own request, never the source for the others).
    expect_peer: str | None = None
    probes: dict[bytes, bool | None] = attrs.field(factory=dict)
    unsent: list[bytes] = attrs.field(factory=list)  # the open batch
    unsent_since: float = 0.0
    lookups: set[int] = attrs.field(factory=set)  # tickets of batches in flight
    rounds: list[LookupRound] = attrs.field(factory=list)  # its answered batches
    waiting_loads: list[_Load] = attrs.field(factory=list)  # source still connecting
    failed: str | None = None
    polled_at: int = -1  # the step in which a lookup() last polled its batches


@attrs.define(eq=False)
class _Batch:
    request: _Request
    keys: list[bytes]
    deadline: float


class P2PTier:
    """A p2pkv-backed secondary tier with vLLM's interface. See the module docstring."""

    def __init__(
        self,
        node: BlockingNode,
        *,
        lookup_timeout: float = 2.0,
        load_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        reconnect_backoff: float = 5.0,
        idle_source_timeout: float = 300.0,
        owns_node: bool = False,
    ) -> None:
        # Slot loads that ended without the engine's word that their writes settled:
        # reported only this many seconds later (the producer may still be writing).
        self.quarantine = node.config.quarantine
        self.node = node
        # Checked here, naming the setting (TypeError, ValueError): taken as given, a NaN
        # came out of a later submit_load as the facade's "timeout" into the host's
        # scheduler, and a NaN idle_source_timeout or drain deadline never came at all.
        self.lookup_timeout = check_seconds(lookup_timeout, "lookup_timeout")
        self.load_timeout = check_seconds(load_timeout, "load_timeout")
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        self.reconnect_backoff = check_seconds(reconnect_backoff, "reconnect_backoff")
        self.idle_source_timeout = check_seconds(idle_source_timeout, "idle_source_timeout")
        self.owns_node = owns_node
        self._sources: dict[tuple[str, int], _Source] = {}
        self._requests: dict[str, _Request] = {}
        self._open: dict[str, _Request] = {}  # requests with an open (unsent) batch
        self._batching: _Request | None = None  # the request whose keys are arriving
        self._connecting: dict[int, _Source] = {}
        # Disconnect tickets of sessions closed to make room under max_peers -> the source
        # whose dial waits for that, with the address and peer being closed (_connect).
        self._evicting: dict[int, tuple[_Source, tuple[str, int], Peer]] = {}
        self._reap_at = 0.0  # host clock: the next look for sources nobody uses
        self._lookups: dict[int, _Batch] = {}
        self._loads: dict[int, _Load] = {}
        self._orphans: set[int] = set()  # tickets whose outcome nobody needs any more
        self._finished: list[JobResult] = []
        self._holds: list[tuple[float, JobResult]] = []  # (report at, result)
        self._steps = 0  # step() calls so far: lookup() polls a request once per step
        self._closed = False

    @classmethod
    def start(cls, cfg: NodeConfig, *, region: object | None = None, **kw: Any) -> P2PTier:
        """Start a node for this tier alone; :meth:`shutdown` closes it."""
        return cls(start_node(cfg, region=region), owns_node=True, **kw)

    # ---------------------------------------------------------------- vLLM's interface

    def lookup(self, key: bytes, request: RequestLike) -> bool | None:
        """True: the source holds ``key`` (pinned there); False: miss, no source, source
        unreachable or too slow; None: asked, answer not in yet (ask again after the next
        :meth:`step`: answers are looked for at most once per request between steps)."""
        if self._closed:
            return False
        st = self._request(request)
        if st.source is None or st.failed is not None:
            return False
        known = st.probes.get(key, _UNSEEN)
        if known is None:  # in flight: maybe the answer is in by now
            # Once between two step() calls, at the request's first key still in flight:
            # an answer that comes in while vLLM scans the request's keys reaches all of
            # them after the next step(), not the keys after it alone. Otherwise vLLM loads
            # the batch as two jobs, and the first one's fetch closes the round the second
            # needs. (step() polls every batch itself: vLLM must not run it, through
            # get_finished_jobs, in the middle of a scan; its manager's lock keeps it out.)
            if st.polled_at != self._steps:
                st.polled_at = self._steps
                self._advance(st, time.monotonic())
            return False if st.failed is not None else st.probes.get(key)
        if known is not _UNSEEN:
            return bool(known)
        if self._batching is not st:
            self._flush(time.monotonic())  # a new request: the last one's batch goes out
            self._batching = st
        if not st.unsent:
            st.unsent_since = time.monotonic()
            self._open[st.request_id] = st
        st.probes[key] = None
        st.unsent.append(key)
        return None

    def prepare(self, request: RequestLike) -> None:
        """A new request (vLLM's ``on_new_request``): start connecting its source now, so
        its first lookups need not wait for the dial. Never blocks."""
        if self._closed:
            return
        st = self._request(request)
        if st.source is not None and st.failed is None:
            self._connect(st.source, time.monotonic())

    def submit_load(self, job: LoadJob) -> None:
        """Start loading ``job.keys`` from the request's source; never blocks. The outcome
        comes out of :meth:`get_finished_jobs` as a :class:`JobResult`."""
        now = time.monotonic()
        keys = list(dict.fromkeys(job.keys))
        slots = None
        if job.slots is not None:
            # fetch_into's own check, here: its refusal (nothing sent) would otherwise be
            # held for a quarantine like a failed load's, and fail the whole request.
            try:
                slots = list(
                    check_caller_slots(
                        list(job.keys), job.slots, self.node.config.num_blocks
                    ).values()
                )
            except LocalProtocolError as exc:
                self._fail_job(job, keys, exc.message)
                return
        if self._closed:
            self._fail_job(job, keys, "tier shut down")
            return
        if not keys:
            self._finished.append(JobResult(job.job_id, True))
            return
        st = self._requests.get(job.request_id)
        if st is None and job.request is not None:
            st = self._request(job.request)
        if st is None or st.source is None:
            self._fail_job(job, keys, "request has no remote_kv_source")
            return
        if st.failed is not None:
            self._fail_job(job, keys, st.failed)
            return
        wanted = set(keys)
        for key in keys:  # the fetch consumes the probes (and uses the request's rounds)
            st.probes.pop(key, None)
        if st.unsent:
            st.unsent = [k for k in st.unsent if k not in wanted]
            self._flush_request(st, now)
            if st.failed is not None:  # its source is down (backing off) or not its own
                self._fail_job(job, keys, st.failed)
                return
        load = _Load(job, st, keys, now + self.load_timeout, tuple(st.rounds), slots)
        src = st.source
        if src.peer is not None and not self.node.is_connected(src.peer):
            src.peer = None  # the session ended since: the load waits for a new one
        if src.peer is not None:
            if self._not_its_source(st, src.peer):
                self._fail_job(job, keys, str(st.failed))
                return
            self._start_load(src.peer, load, now)
        else:
            st.waiting_loads.append(load)
            self._connect(src, now)  # fails the load at once if the source is down

    def step(self) -> None:
        """End of a scheduler step: send open batches, collect answers, apply deadlines."""
        if self._closed:
            return
        now = time.monotonic()
        self._steps += 1
        self._poll_connects(now)
        self._poll_evictions(now)
        self._flush(now)
        self._batching = None
        self._poll_lookups(now)
        self._poll_loads(now)
        self._release_holds(now)
        self._expire_unsent(now)
        if now >= self._reap_at:
            self._reap_sources(now)
        self._poll_orphans()

    def idle(self) -> bool:
        """Nothing in flight, nothing to report, no source due a look for disuse:
        :meth:`step` would do nothing. (A host stops stepping a tier with no pending
        work, vLLM an engine with no request; its poll of an idle tier still steps it
        about once a second while it knows sources, so their sessions close in time.)"""
        return not (
            self._finished
            or self._orphans
            or self.has_pending_work()
            or (self._sources and time.monotonic() >= self._reap_at)
        )

    def get_finished_jobs(self) -> list[JobResult]:
        """Loads that finished since the last call (runs :meth:`step` first). The list is
        the caller's: they are not reported again, whatever becomes of it."""
        self.step()
        done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        """True while anything is in flight (keep stepping)."""
        return bool(
            self._open
            or self._connecting
            or self._evicting
            or self._lookups
            or self._loads
            or self._holds
            or any(st.waiting_loads for st in self._requests.values())
        )

    def on_request_finished(self, request: RequestLike) -> None:
        """Forget the request: its open batch is dropped, its lookups in flight are
        ignored, loads still waiting for a connection fail. Loads already submitted
        still report. The request's own lookup rounds that no load was given are given
        back to the source at once (``submit_release``) instead of staying pinned there
        until the lease ends; so are the rounds of its lookups still in flight, once they
        answer, and those its loads in flight were given, once the last of them ends
        (its fetch may not have claimed them yet). Other requests' rounds are untouched,
        even where they hold the same keys."""
        st = self._requests.pop(request.request_id, None)
        if st is None:
            return
        if st.source is not None:
            st.source.used_at = time.monotonic()
        # A load's fetch claims the rounds it uses when the engine starts it, which may
        # be after this release: both posts can reach the engine in one batch, which Trio
        # starts in either order, and a round released first made the fetch look its
        # keys up again. So rounds a load in flight was given wait for it (_end_load).
        lent = {id(r) for ld in self._loads.values() if ld.request is st for r in ld.rounds}
        self._release_rounds(st, [r for r in st.rounds if id(r) not in lent])
        st.rounds = [r for r in st.rounds if id(r) in lent]
        if self._batching is st:
            self._batching = None
        self._open.pop(st.request_id, None)
        st.unsent = []
        for ticket in st.lookups:
            self._lookups.pop(ticket, None)
            self._orphans.add(ticket)
        st.lookups.clear()
        for load in st.waiting_loads:
            self._fail_job(load.job, load.keys, "request finished")
        st.waiting_loads.clear()

    def _release_rounds(self, st: _Request, rounds: list[LookupRound]) -> None:
        if rounds and st.source is not None and st.source.peer is not None:
            self._orphans.add(self.node.submit_release(st.source.peer, rounds))

    def _end_load(self, ticket: int, load: _Load) -> None:
        """Take ``load`` out of ``_loads``; if its request is finished and this was its
        last load in flight, give back the rounds its loads were given (those their
        fetches used are closed already; the rest would stay pinned at the source)."""
        del self._loads[ticket]
        st = load.request
        if not st.rounds or self._requests.get(st.request_id) is st:
            return  # none kept, or the request goes on (its own finish releases them)
        if any(ld.request is st for ld in self._loads.values()):
            return
        rounds, st.rounds = st.rounds, []
        self._release_rounds(st, rounds)

    def drain(self, timeout: float) -> bool:
        """Block (the only call that does) until every load submitted so far is reported
        by :meth:`get_finished_jobs`, at most ``timeout`` seconds; loads still waiting for
        a connection fail at once. True if nothing is left in flight. The engine thread
        does the work, so this needs nothing from the calling thread."""
        return self._drain(check_seconds(timeout, "timeout"), slot_loads_only=False)

    def _drain(self, timeout: float, *, slot_loads_only: bool) -> bool:
        end = time.monotonic() + timeout
        for st in self._requests.values():
            for load in st.waiting_loads:
                self._fail_job(load.job, load.keys, "drained")
            st.waiting_loads.clear()
        while True:
            self.step()
            busy = any(ld.slots is not None or not slot_loads_only for ld in self._loads.values())
            if not (busy or self._holds):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.002, left))  # the engine publishes; we only read the board

    def shutdown(self, *, drain_timeout: float | None = None) -> None:
        """Stop; idempotent. Waits for the slot loads in flight (as :meth:`drain` does, at
        most ``drain_timeout``, default ``load_timeout + quarantine + 1 s``; loads into the
        store are not waited for: the store quarantines its own slots), then fails what
        is left and, if the tier owns the node, closes it: no engine thread, data-plane
        agent or pin at a source is left behind (closing the node ends its sessions, and
        the sources release their pins with them). A slot load cut short by the close
        makes shutdown wait out its quarantine; on a node it does not own (nothing closes
        it), shutdown waits for each slot load's ``fetch_into`` to end instead (within its
        deadline and quarantines). Either way no write can land in the host's memory
        after this returns."""
        if drain_timeout is not None:
            drain_timeout = check_seconds(drain_timeout, "drain_timeout")
        if self._closed:
            return
        limit = self.load_timeout + self.quarantine + 1.0
        self._drain(limit if drain_timeout is None else drain_timeout, slot_loads_only=True)
        self._closed = True
        if self.owns_node:  # closed below: whatever it cuts short waits out a quarantine
            cut_short = any(load.slots is not None for load in self._loads.values())
        else:
            cut_short = not self._await_slot_loads()
        for load in self._loads.values():
            self._fail_job(load.job, load.keys, "tier shut down")
        for st in self._requests.values():
            for load in st.waiting_loads:
                self._fail_job(load.job, load.keys, "tier shut down")
        for _, result in self._holds:
            self._finished.append(result)
        if self._holds:
            cut_short = True
        self._holds.clear()
        self._loads.clear()
        self._lookups.clear()
        self._connecting.clear()
        self._requests.clear()
        self._open.clear()
        self._orphans.clear()
        self._batching = None
        if self.owns_node:
            self.node.close()
        if cut_short:
            time.sleep(self.quarantine)

    def _await_slot_loads(self) -> bool:
        """The node goes on (another owner's), so a slot load's ``fetch_into`` is not cut
        by a close: only its own end says that no write into its slots can land any more.
        Wait for that end, within the bound the engine keeps to (its load deadline, then a
        quarantine, for the ticket and for the engine each, and a second); the results are
        dropped (shutdown fails the loads next). False if one is still running then, or
        ended in an exception (the ticket's deadline cut it, the node closed: no word that
        its writes settled, so shutdown waits out a quarantine)."""
        running = [t for t, ld in self._loads.items() if ld.slots is not None]
        if not running:
            return True
        end = max(self._loads[t].deadline for t in running) + 2 * self.quarantine + 1.0
        settled = True
        while True:
            still = []
            for ticket in running:
                try:
                    if self.node.poll(ticket) is None:
                        still.append(ticket)
                except Exception:
                    settled = False
            running = still
            if not running or time.monotonic() >= end:
                break
            time.sleep(0.002)
        if running:
            log.warning("%d slot loads still running at shutdown", len(running))
        return settled and not running

    def debug_state(self) -> dict[str, Any]:
        """A summary of what is in flight, for diagnosing a request that never ends."""
        now = time.monotonic()
        return {
            "closed": self._closed,
            "sources": {
                f"{h}:{p}": {
                    "peer": None if s.peer is None else s.peer.peer_id,
                    "connected": s.peer is not None and self.node.is_connected(s.peer),
                    "connecting": s.connect_ticket is not None,
                    "retry_in_s": round(s.retry_at - now, 3),
                    "error": s.error,
                }
                for (h, p), s in self._sources.items()
            },
            "requests": {
                rid: {
                    "failed": st.failed,
                    "probes": sum(1 for v in st.probes.values() if v is None),
                    "unsent": len(st.unsent),
                    "lookups": len(st.lookups),
                    "waiting_loads": len(st.waiting_loads),
                }
                for rid, st in self._requests.items()
            },
            "lookups": len(self._lookups),
            "loads": len(self._loads),
            "holds": len(self._holds),
            "orphans": len(self._orphans),
            "batching": None if self._batching is None else self._batching.request_id,
        }

    # ---------------------------------------------------------------- requests and sources

    def _request(self, request: RequestLike) -> _Request:
        st = self._requests.get(request.request_id)
        if st is None:
            spec = SourceSpec.from_params(request.kv_transfer_params)
            src = None
            if spec is not None:
                src = self._sources.get(spec.address)
                if src is None:
                    src = self._sources[spec.address] = _Source(spec.address)
                src.used_at = time.monotonic()
            st = _Request(request.request_id, src, None if spec is None else spec.peer_id)
            self._requests[request.request_id] = st
        return st

    def _connect(self, src: _Source, now: float, *, make_room: bool = True) -> None:
        """Make sure a connection to ``src`` is up or on its way; if the source is down
        (backing off), fail every request waiting for it."""
        if src.peer is not None or src.connect_ticket is not None:
            return
        if now < src.retry_at:
            self._source_down(src, src.error, now, backoff=False)
            return
        src.connect_deadline = now + self.connect_timeout
        if make_room and self.node.peer_count() >= self.node.config.max_peers:
            # At the cap of peers, the dial would be refused: close the session to the
            # source unused longest, if there is one, and dial once it is gone.
            victim = self._idle_source(but=src)
            if victim is not None:
                log.info("p2p source %s:%d dropped to make room for a new one", *victim.address)
                peer = victim.peer
                assert peer is not None
                src.connect_ticket = self._drop_source(victim)
                self._evicting[src.connect_ticket] = (src, victim.address, peer)
                return
        src.connect_ticket = self.node.submit_connect(src.address, timeout=self.connect_timeout)
        self._connecting[src.connect_ticket] = src

    def _poll_evictions(self, now: float) -> None:
        for ticket, (src, address, victim) in list(self._evicting.items()):
            try:
                closed = self.node.poll(ticket)
                if closed is None:
                    continue
            except Exception:  # the session was gone already: room either way
                closed = 1
            del self._evicting[ticket]
            src.connect_ticket = None
            activity = None if closed else self.node.session_activity(victim)
            if (
                activity is not None
                and now < src.connect_deadline
                and self.node.peer_count() >= self.node.config.max_peers
                and address not in self._sources
            ):
                # In use when the engine looked. Often by us: the release of a finished
                # request's rounds there, posted just before, which the engine may start
                # after the disconnect. Look again (until the dial's deadline, and while
                # no new request names that source) rather than dial into the cap's
                # refusal.
                src.connect_ticket = self.node.submit_disconnect_idle(victim, activity)
                self._evicting[src.connect_ticket] = (src, address, victim)
                continue
            # Dial now, closed or not: a session its peer still used stays (room or not),
            # and closing the next idle one and the next would only churn.
            self._connect(src, now, make_room=False)

    def _sources_in_use(self) -> set[_Source]:
        """Sources a live request names, or a load or lookup in flight or a dial needs."""
        used = {st.source for st in self._requests.values() if st.source is not None}
        used.update(ld.request.source for ld in self._loads.values() if ld.request.source)
        used.update(b.request.source for b in self._lookups.values() if b.request.source)
        used.update(self._connecting.values())
        used.update(src for src, _, _ in self._evicting.values())
        return used

    def _idle_source(self, *, but: _Source) -> _Source | None:
        """The source with a session that no request has named for longest, if any."""
        used = self._sources_in_use()
        idle = [
            s
            for s in self._sources.values()
            if s.peer is not None and s not in used and s is not but
        ]
        return min(idle, key=lambda s: s.used_at, default=None)

    def _reap_sources(self, now: float) -> None:
        """Forget the sources no request names any more. Kept for good, one per address
        any request ever named, they and their sessions would count against ``max_peers``
        at both ends until a fleet's engine could reach no new source. One whose dial
        failed goes once its backoff is over; one with a session once no request has
        named it for ``idle_source_timeout`` seconds, its session closed."""
        self._reap_at = now + min(self.idle_source_timeout / 4, 1.0)
        used = self._sources_in_use()
        for src in list(self._sources.values()):
            if src in used:
                src.used_at = now
            elif src.peer is None:
                if now >= src.retry_at:
                    del self._sources[src.address]
            elif (activity := self.node.session_activity(src.peer)) != src.activity:
                src.activity, src.used_at = activity, now  # used since (by either side)
            elif now - src.used_at >= self.idle_source_timeout:
                self._orphans.add(self._drop_source(src, activity))

    def _drop_source(self, src: _Source, activity: tuple[int, int] | None = None) -> int:
        """Forget ``src`` and close its session if it is idle both ways (the source may
        be fetching from us over it: then it stays, and a later request that names the
        source finds it again); returns the ticket of that."""
        del self._sources[src.address]
        peer, src.peer = src.peer, None
        assert peer is not None
        if activity is None:  # not read yet (making room at the cap)
            activity = self.node.session_activity(peer) or (0, 0)
        return self.node.submit_disconnect_idle(peer, activity)

    def _poll_connects(self, now: float) -> None:
        for ticket, src in list(self._connecting.items()):
            try:
                peer = self.node.poll(ticket)
            except Exception as exc:
                del self._connecting[ticket]
                src.connect_ticket = None
                self._source_down(src, f"connect failed: {exc}", now)
                continue
            if peer is None:
                if now >= src.connect_deadline:
                    del self._connecting[ticket]
                    self._orphans.add(ticket)
                    src.connect_ticket = None
                    self._source_down(src, "connect timed out", now)
                continue
            del self._connecting[ticket]
            src.connect_ticket = None
            assert isinstance(peer, Peer)
            src.peer = peer
            for st in list(self._requests.values()):  # loads that waited for this connection
                if st.source is src and st.waiting_loads:
                    if self._not_its_source(st, peer):
                        continue
                    loads, st.waiting_loads = st.waiting_loads, []
                    for load in loads:
                        self._start_load(peer, load, now)

    def _not_its_source(self, st: _Request, peer: Peer) -> bool:
        """The peer at the request's source address is not the one its params named:
        fail that request (its lookups and loads) alone."""
        if st.expect_peer is None or peer.peer_id == st.expect_peer:
            return False
        assert st.source is not None
        host, port = st.source.address
        self._fail_request(
            st, f"source at {host}:{port} is {peer.peer_id!r}, not {st.expect_peer!r}"
        )
        return True

    def _source_down(
        self, src: _Source, reason: str, now: float, *, backoff: bool = True, lost: bool = False
    ) -> None:
        """The source is unusable: fail every request that still waits on it. A failed
        dial backs off (``backoff``); a session that was up and ended (``lost``: the source
        died or restarted) may be dialed again by the next request at once."""
        if backoff or lost:
            log.warning("p2p source %s:%d down: %s", *src.address, reason)
            src.peer = None
            src.error = reason
        if backoff and not lost:
            src.retry_at = now + self.reconnect_backoff
        for st in list(self._requests.values()):
            if (
                st.source is src
                and st.failed is None
                and (st.unsent or st.lookups or st.waiting_loads)
            ):
                self._fail_request(st, reason)

    def _fail_request(self, st: _Request, reason: str) -> None:
        """Every key the request still waits for misses; later keys miss at once."""
        st.failed = reason
        for key, hit in st.probes.items():
            if hit is None:
                st.probes[key] = False
        st.unsent = []
        self._open.pop(st.request_id, None)
        for ticket in st.lookups:
            if self._lookups.pop(ticket, None) is not None:
                self._orphans.add(ticket)
        st.lookups.clear()
        for load in st.waiting_loads:
            self._fail_job(load.job, load.keys, reason)
        st.waiting_loads.clear()

    # ---------------------------------------------------------------- lookups

    def _flush(self, now: float) -> None:
        for st in list(self._open.values()):
            self._flush_request(st, now)

    def _flush_request(self, st: _Request, now: float) -> None:
        """Send the request's open batch as one lookup, if its source is connected."""
        src = st.source
        if not st.unsent or src is None:
            self._open.pop(st.request_id, None)
            return
        if src.peer is not None and not self.node.is_connected(src.peer):
            src.peer = None  # the session ended since (the source died or restarted)
        if src.peer is None:
            self._connect(src, now)  # the batch waits for the connection (or fails)
            return
        if self._not_its_source(st, src.peer):
            return
        deadline = st.unsent_since + self.lookup_timeout
        keys, st.unsent = st.unsent, []
        self._open.pop(st.request_id, None)
        ticket = self.node.submit_lookup_round(src.peer, keys, timeout=max(deadline - now, 0.001))
        self._lookups[ticket] = _Batch(st, keys, deadline)
        st.lookups.add(ticket)

    def _advance(self, st: _Request, now: float) -> None:
        """Poll one request's lookups (a lookup() of a key still in flight)."""
        for ticket in list(st.lookups):
            batch = self._lookups.get(ticket)
            if batch is not None:
                self._poll_lookup(ticket, batch, now)
        if st.unsent and st is not self._batching and now >= st.unsent_since + self.lookup_timeout:
            self._fail_request(st, "lookup timed out before it could be sent")

    def _poll_lookups(self, now: float) -> None:
        for ticket, batch in list(self._lookups.items()):
            self._poll_lookup(ticket, batch, now)

    def _poll_lookup(self, ticket: int, batch: _Batch, now: float) -> None:
        st = batch.request
        try:
            hits = self.node.poll(ticket)
        except Exception as exc:
            self._lookups.pop(ticket, None)
            st.lookups.discard(ticket)
            self._lookup_failed(st, exc, now)
            return
        if hits is None:
            if now >= batch.deadline:
                self._lookups.pop(ticket, None)
                st.lookups.discard(ticket)
                self._orphans.add(ticket)
                self._fail_request(st, "lookup timed out")
            return
        self._lookups.pop(ticket, None)
        st.lookups.discard(ticket)
        assert isinstance(hits, LookupRound)
        st.rounds.append(hits)
        for key, hit in zip(batch.keys, hits.hits, strict=True):
            if key in st.probes:  # not consumed by a load meanwhile
                st.probes[key] = hit

    def _lookup_failed(self, st: _Request, exc: Exception, now: float) -> None:
        if isinstance(exc, PeerUnavailable | PortalClosed) and st.source is not None:
            self._source_down(st.source, f"lookup failed: {exc}", now, lost=True)
        self._fail_request(st, f"lookup failed: {exc}")

    def _expire_unsent(self, now: float) -> None:
        """Batches held back (source still connecting) miss once their deadline passed."""
        for st in list(self._open.values()):
            if now >= st.unsent_since + self.lookup_timeout:
                self._fail_request(st, "source not connected in time")
        for st in list(self._requests.values()):
            if st.waiting_loads:
                expired = [ld for ld in st.waiting_loads if now >= ld.deadline]
                if expired:
                    st.waiting_loads = [ld for ld in st.waiting_loads if now < ld.deadline]
                    for load in expired:
                        self._fail_job(load.job, load.keys, "source not connected in time")

    # ---------------------------------------------------------------- loads

    def _start_load(self, peer: Peer, load: _Load, now: float) -> None:
        limit = max(load.deadline - now, 0.001)
        if load.slots is None:
            ticket = self.node.submit_fetch(peer, load.keys, rounds=load.rounds, timeout=limit)
        else:  # the engine withholds the result until no write can land
            # The engine gives up at the load's deadline, a lookup of keys whose round
            # expired included, and returns a quarantine later: the ticket's own deadline
            # must not cut that short (a cut means another quarantine).
            ticket = self.node.submit_fetch_into(
                peer,
                load.keys,
                load.slots,
                rounds=load.rounds,
                within=limit,
                timeout=limit + self.quarantine + 1.0,
            )
        self._loads[ticket] = load

    def _poll_loads(self, now: float) -> None:
        for ticket, load in list(self._loads.items()):
            try:
                outcome = self.node.poll(ticket)
            except Exception as exc:
                self._end_load(ticket, load)
                st = self._live(load)
                reason = str(exc) or type(exc).__name__
                src = load.request.source
                if isinstance(exc, PeerUnavailable | PortalClosed) and src is not None:
                    self._source_down(src, f"load failed: {exc}", now, lost=True)
                if st is not None and st.failed is None:
                    self._fail_request(st, f"load failed: {reason}")
                if load.slots is None:
                    self._fail_job(load.job, load.keys, reason)
                else:  # no word from the engine that the writes settled: wait them out
                    failed = dict.fromkeys(load.keys, reason)
                    result = JobResult(load.job.job_id, False, [], failed)
                    self._holds.append((now + self.quarantine, result))
                continue
            if outcome is None:
                if load.slots is None and now >= load.deadline:
                    self._end_load(ticket, load)
                    self._orphans.add(ticket)
                    self._fail_job(load.job, load.keys, "load timed out")
                continue
            self._end_load(ticket, load)
            assert isinstance(outcome, FetchResult)
            loaded = set(outcome.loaded)
            failed = {k: outcome.failed.get(k, "not loaded") for k in load.keys if k not in loaded}
            st = self._live(load)
            if failed and st is not None and st.failed is None:
                self._fail_request(st, "load failed")  # or vLLM asks for the keys again
            self._finished.append(
                JobResult(
                    load.job.job_id, not failed, [k for k in load.keys if k in loaded], failed
                )
            )

    def _live(self, load: _Load) -> _Request | None:
        """The load's request, if it is still the one under its id: a finished request's
        id may be reused by a new request, which the old load's outcome must not fail."""
        st = self._requests.get(load.job.request_id)
        return st if st is load.request else None

    def _release_holds(self, now: float) -> None:
        if self._holds and self._holds[0][0] <= now:
            due = [h for h in self._holds if h[0] <= now]
            self._holds = [h for h in self._holds if h[0] > now]
            self._finished.extend(result for _, result in due)

    def _fail_job(self, job: LoadJob, keys: list[bytes], reason: str) -> None:
        self._finished.append(JobResult(job.job_id, False, [], dict.fromkeys(keys, reason)))

    def _poll_orphans(self) -> None:
        """Read (and drop) outcomes nobody waits for, so the node's board stays small. A
        lookup whose request is gone answered with rounds nobody will fetch: release them."""
        for ticket in list(self._orphans):
            try:
                outcome = self.node.poll(ticket)
                if outcome is None:
                    continue
                if isinstance(outcome, LookupRound) and any(outcome.hits):
                    self._orphans.add(self.node.submit_release(outcome.peer_id, outcome))
            except Exception:  # its failure (or KeyError: read elsewhere) is nobody's concern
                pass
            self._orphans.discard(ticket)
