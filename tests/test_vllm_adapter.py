"""The vLLM-shaped tier, driven the way vLLM's tiering manager drives a secondary tier.

A :class:`Scheduler` thread plays vLLM's scheduler: it steps every 5 ms, asks ``lookup``
per key per request until the answer is not None, submits one load for the hits,
ends the step (``step()``, where vLLM calls ``on_schedule_end``) and collects
``get_finished_jobs()``. Every tier call happens on that one thread; the test thread only
feeds it requests and commands through a queue and reads what it reports from another.
Sources are BlockingNodes in this process (in-process transport, real TCP control).
Ordering is gated by events and queues; the 5 ms step is vLLM's pacing, not a sync point.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import trio

from p2pkv import BlockingNode, P2PKVTimeout, Peer
from p2pkv.integrations import vllm as vllm_module
from p2pkv.integrations.vllm import JobResult, LoadJob, P2PTier, RequestInfo, SourceSpec
from p2pkv.session.protocol import SessionProtocol

from .helpers import FaultFactory, config, count_calls, fill, wait_for

BOUND = 10.0  # seconds: "this did not hang", never an expected duration
STEP = 0.005  # the scheduler's step period
BLOCK = 4096


def source_params(node: BlockingNode, request_id: str = "r-src") -> dict[str, Any]:
    host, port = node.address
    return {"remote_kv_source": {"host": host, "port": port, "request_id": request_id}}


@attrs.define(eq=False)
class _Req:
    info: RequestInfo
    keys: list[bytes]
    load_gate: threading.Event | None
    answers: dict[bytes, bool] = attrs.field(factory=dict)
    first_ask: float | None = None
    asked_reported: bool = False
    resolved_reported: bool = False
    load_submitted: bool = False


@attrs.frozen
class Resolved:
    request_id: str
    answers: dict[bytes, bool]
    after_s: float  # since the first lookup() of the request


@attrs.frozen
class Asked:
    request_id: str  # lookup() said None and a step has passed: the batch is out


@attrs.frozen
class Finished:
    result: JobResult
    after_s: float  # since submit_load


class Scheduler:
    """FAKE vLLM scheduler thread, reduced to what a secondary tier sees (module
    docstring)."""

    def __init__(self, tier: P2PTier) -> None:
        self.tier = tier
        self.inbox: queue.Queue[_Req | Callable[[], object]] = queue.Queue()
        self.events: queue.Queue[Resolved | Asked | Finished] = queue.Queue()
        self.slowest_call = 0.0  # seconds: the longest single step's tier calls took
        self._reqs: dict[str, _Req] = {}
        self._submitted: dict[int, float] = {}
        self._jobs = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-scheduler")
        self._error: BaseException | None = None

    def __enter__(self) -> Scheduler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(BOUND)
        assert not self._thread.is_alive()
        if self._error is not None:
            raise self._error

    def add(
        self,
        request_id: str,
        keys: Sequence[bytes],
        params: dict[str, Any] | None,
        *,
        load_gate: threading.Event | None = None,
    ) -> None:
        self.inbox.put(_Req(RequestInfo(request_id, params), list(keys), load_gate))

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the scheduler thread (tier calls belong there); its result."""
        done: queue.Queue[object] = queue.Queue()

        def wrapped() -> None:
            try:
                done.put(fn())
            except BaseException as exc:
                done.put(exc)

        self.inbox.put(wrapped)
        out = done.get(timeout=BOUND)
        if isinstance(out, BaseException):
            raise out
        return out

    def next_event(self, kind: type[Any], request_id: str | None = None) -> Any:
        """The next event of ``kind`` (for ``request_id``), skipping others (kept)."""
        deadline = time.monotonic() + BOUND
        skipped = []
        try:
            while True:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
                rid = ev.result.job_id if isinstance(ev, Finished) else ev.request_id
                if isinstance(ev, kind) and request_id in (None, rid):
                    return ev
                skipped.append(ev)
        finally:
            for ev in skipped:
                self.events.put(ev)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
                time.sleep(STEP)
        except BaseException as exc:
            self._error = exc

    def _step(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Req):
                self._reqs[item.info.request_id] = item
            else:
                item()
        t0 = time.perf_counter()
        now = time.monotonic()
        pending_asks = []
        for req in list(self._reqs.values()):
            for key in req.keys:
                if key in req.answers:
                    continue
                if req.first_ask is None:
                    req.first_ask = now
                hit = self.tier.lookup(key, req.info)
                if hit is not None:
                    req.answers[key] = hit
            done = len(req.answers) == len(req.keys)
            if not done and not req.asked_reported:
                pending_asks.append(req)
            if done and not req.resolved_reported:
                assert req.first_ask is not None
                req.resolved_reported = True
                self.events.put(
                    Resolved(req.info.request_id, dict(req.answers), now - req.first_ask)
                )
            if done and not req.load_submitted:
                hits = [k for k in req.keys if req.answers[k]]
                if not hits:
                    req.load_submitted = True  # misses fall back: no job at all
                elif req.load_gate is None or req.load_gate.is_set():
                    req.load_submitted = True
                    job = LoadJob(next(self._jobs), req.info.request_id, hits)
                    self._submitted[job.job_id] = time.monotonic()
                    self.tier.submit_load(job)
        self.tier.step()
        finished = self.tier.get_finished_jobs()
        self.slowest_call = max(self.slowest_call, time.perf_counter() - t0)
        for req in pending_asks:
            req.asked_reported = True
            self.events.put(Asked(req.info.request_id))
        for result in finished:
            self.events.put(Finished(result, time.monotonic() - self._submitted[result.job_id]))


class SpyNode(BlockingNode):
    """The consumer's BlockingNode, recording the batches the tier submits."""

    def __init__(self, node: BlockingNode) -> None:
        super().__init__(node._engine, node._board)
        self.lookups: list[list[bytes]] = []

    def submit_lookup_round(
        self, peer: Peer | str, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> int:
        self.lookups.append(list(keys))
        return super().submit_lookup_round(peer, keys, timeout=timeout)


def wedge(node: BlockingNode) -> threading.Event:
    """Hang the node's engine (its Trio thread blocks, as in a hung process); set the
    returned event to let it go. Test seam: posts a blocking callable to the engine."""
    entered, release = threading.Event(), threading.Event()

    def hang() -> None:
        entered.set()
        release.wait(BOUND)

    node._engine.run_sync_soon(hang)
    assert entered.wait(BOUND)
    return release


def crash_connections(node: BlockingNode) -> None:
    """FAKE crash (test seam): shut the node's TCP connections down as the kernel does
    for a process that died, while its engine is wedged and cannot answer anything."""
    for session in list(node._node._sessions):
        stream = session.stream
        assert isinstance(stream, trio.SocketStream)
        stream.socket.shutdown(socket.SHUT_RDWR)


def drain(q: queue.Queue[Any]) -> list[Any]:
    out = []
    with contextlib.suppress(queue.Empty):
        while True:
            out.append(q.get_nowait())
    return out


def engine_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("p2pkv-engine-")}


# ---------------------------------------------------------------- tests


def test_source_spec_accepts_both_spellings_and_rejects_junk() -> None:
    ours = {"remote_kv_source": {"host": "h", "port": 7, "request_id": "x", "peer_id": "p"}}
    vllm = {"remote_kv_source": {"remote_host": "h", "remote_port": "7", "kv_request_id": "x"}}
    assert SourceSpec.from_params(ours) == SourceSpec("h", 7, "x", "p")
    assert SourceSpec.from_params(vllm) == SourceSpec("h", 7, "x", None)
    for junk in (
        None,
        {},
        {"remote_kv_source": "h:7"},
        {"remote_kv_source": {"host": "h"}},
        {"remote_kv_source": {"port": 7}},
        {"remote_kv_source": {"host": "h", "port": 0}},
        {"remote_kv_source": {"host": "h", "port": 65536}},
        {"remote_kv_source": {"host": "h", "port": True}},
        {"remote_kv_source": {"host": "", "port": 7}},
        {"remote_kv_source": {"remote_host": "", "remote_port": "7"}},
    ):
        assert SourceSpec.from_params(junk) is None
    top = {"remote_kv_source": {"host": "h", "port": 65535}}
    assert SourceSpec.from_params(top) == SourceSpec("h", 65535)


@pytest.mark.parametrize(
    "name",
    [
        "lookup_timeout",
        "load_timeout",
        "connect_timeout",
        "reconnect_backoff",
        "idle_source_timeout",
    ],
)
@pytest.mark.parametrize(
    ("value", "error"),
    [(math.nan, ValueError), (-1.0, ValueError), ("5", TypeError), (True, TypeError)],
    ids=["nan", "negative", "str", "bool"],
)
def test_a_bad_deadline_is_refused_by_the_tiers_constructor_naming_it(
    nodes: Callable[..., BlockingNode], name: str, value: object, error: type[Exception]
) -> None:
    """``P2PTier``'s seconds were taken as given: a NaN ``load_timeout`` came out of the
    first ``submit_load`` as the facade's "timeout must be >= 0 seconds" (into the host's
    scheduler, naming no setting of the tier), a string as a TypeError out of ``step``,
    a NaN ``idle_source_timeout`` forgot no idle source ever (review 2026-12-05)."""
    dst = nodes("dst")
    with pytest.raises(error, match=name):
        P2PTier(dst, **{name: value})  # type: ignore[arg-type]


def test_a_bad_drain_timeout_is_refused_before_anything_is_drained(
    nodes: Callable[..., BlockingNode],
) -> None:
    """``drain(nan)`` slept 2 ms at a time for ever while a load was in flight (``left <=
    0`` is never true of NaN), and so did ``shutdown(drain_timeout=nan)``."""
    tier = P2PTier(nodes("dst"), lookup_timeout=BOUND, load_timeout=BOUND)
    with pytest.raises(ValueError, match="timeout"):
        tier.drain(math.nan)
    with pytest.raises(TypeError, match="drain_timeout"):
        tier.shutdown(drain_timeout="1")  # type: ignore[arg-type]
    tier.shutdown()


def test_a_port_string_int_refuses_leaves_the_request_without_a_source(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A port that is a string of digits ``int`` cannot read (a superscript digit, which
    ``str.isdigit`` admits; more digits than Python converts) comes from the request, not
    from us: the request has no source and misses, never a ``ValueError`` out of the
    tier's lookup into vLLM's scheduler."""
    dst = nodes("dst")
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    for i, port in enumerate(("\u00b2", "7\u00b3", "9" * 5000)):
        params = {"remote_kv_source": {"host": "h", "port": port}}
        assert SourceSpec.from_params(params) is None, port[:8]
        req = RequestInfo(f"r{i}", params)
        tier.prepare(req)
        assert tier.lookup(os.urandom(32), req) is False, port[:8]
    tier.step()
    assert not tier.has_pending_work()
    tier.shutdown()


def test_a_peer_id_no_peer_can_have_leaves_the_request_without_a_source(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer_id, when given, must match the peer that answers. One that is not a
    non-empty string matches no peer: the request misses and nothing is dialed, instead
    of the check being skipped and whatever answers at the address trusted. JSON's null
    is absent, as elsewhere."""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    host, port = src.address
    spec = {"host": host, "port": port}
    absent = {"remote_kv_source": {**spec, "peer_id": None}}
    assert SourceSpec.from_params(absent) == SourceSpec(host, port)
    dials = count_calls(monkeypatch, BlockingNode, "submit_connect")
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    for i, bad in enumerate(("", 7, True, ["src"], {"id": "src"})):
        params = {"remote_kv_source": {**spec, "peer_id": bad}}
        assert SourceSpec.from_params(params) is None, bad
        req = RequestInfo(f"r{i}", params)
        tier.prepare(req)
        assert [tier.lookup(k, req) for k in keys] == [False, False], bad
    tier.step()
    assert dials() == 0 and not tier.has_pending_work()
    tier.shutdown()


def test_hits_load_the_sources_bytes_and_misses_fall_back(
    nodes: Callable[..., BlockingNode],
) -> None:
    src = nodes("src")
    spy = SpyNode(nodes("dst"))
    present = fill(src.store, 12, BLOCK)
    absent = [os.urandom(32) for _ in range(4)]
    keys = present[:6] + absent + present[6:]
    dead_port = _unused_port()
    tier = P2PTier(spy, lookup_timeout=2.0, load_timeout=5.0)
    with Scheduler(tier) as sched:
        sched.add("r1", keys, source_params(src))
        sched.add("no-source", present[:3], None)
        sched.add(
            "unreachable",
            present[:3],
            {"remote_kv_source": {"host": "127.0.0.1", "port": dead_port}},
        )

        r1 = sched.next_event(Resolved, "r1")
        assert r1.answers == {k: k in set(present) for k in keys}
        job = sched.next_event(Finished).result
        assert job.success and sorted(job.loaded) == sorted(present) and not job.failed
        for k in present:
            assert bytes(spy.store.get(k) or b"") == bytes(src.store.get(k) or b"?")
        assert all(k not in spy.store for k in absent)

        assert sched.next_event(Resolved, "no-source").answers == dict.fromkeys(present[:3], False)
        assert sched.next_event(Resolved, "unreachable").answers == dict.fromkeys(
            present[:3], False
        )
        # One batched lookup for all of r1's keys, asked in one step; none for the others.
        assert spy.lookups == [keys]
        sched.call(tier.shutdown)
    # The misses started no job: the one load above is the only one.
    assert not [ev for ev in drain(sched.events) if isinstance(ev, Finished)]
    assert src.statistics().pinned_slots == 0  # the load closed the lookup round


def test_a_source_that_dies_mid_request_turns_lookups_into_misses_and_loads_into_failures(
    nodes: Callable[..., BlockingNode],
) -> None:
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # writes never settle
    src = nodes("src", transport=hanging, close_timeout=0.5, quarantine=3.5)
    dst = nodes("dst")
    keys = fill(src.store, 8, BLOCK)
    more = fill(src.store, 4, BLOCK)
    # Deadlines longer than BOUND: next_event() gives up after BOUND, so what ends the
    # waits below must be the death, not a deadline.
    tier = P2PTier(dst, lookup_timeout=3 * BOUND, load_timeout=3 * BOUND, reconnect_backoff=60.0)
    with Scheduler(tier) as sched:
        sched.add("r1", keys, source_params(src))
        assert sched.next_event(Resolved, "r1").answers == dict.fromkeys(keys, True)
        wait_for(lambda: hanging.transport.posts > 0)  # r1's load is in flight, stuck
        release = wedge(src)  # the source hangs...
        try:
            sched.add("r2", more, source_params(src))
            sched.next_event(Asked, "r2")  # ...with r2's lookup sent and unanswered...
            crash_connections(src)  # ...and dies: its connections go down, unanswered.

            r2 = sched.next_event(Resolved, "r2")
            assert r2.answers == dict.fromkeys(more, False)
            failed = sched.next_event(Finished)
            assert not failed.result.success and failed.result.loaded == []
            assert set(failed.result.failed) == set(keys)
        finally:
            release.set()

        # A session that was up and ended (the source died or restarted) is dialed again
        # by the next request at once, with no backoff: the source answers again now.
        sched.add("r3", keys, source_params(src))
        r3 = sched.next_event(Resolved, "r3")
        assert r3.answers == dict.fromkeys(keys, True)
        # Only "did not hang": how long tier calls take is bench/facade_latency.py's job.
        assert sched.slowest_call < BOUND / 2, "a tier call blocked the scheduler"
        sched.call(tier.shutdown)
    assert all(k not in dst.store for k in keys + more)


def test_closing_the_source_mid_request_fails_its_load_and_its_next_lookups_miss(
    nodes: Callable[..., BlockingNode],
) -> None:
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # writes never settle
    src = nodes("src", transport=hanging, close_timeout=0.5, quarantine=3.5)
    dst = nodes("dst")
    keys = fill(src.store, 6, BLOCK)
    later = fill(src.store, 3, BLOCK)
    # Deadlines longer than BOUND: what ends the waits below is the close, not a deadline.
    tier = P2PTier(dst, lookup_timeout=3 * BOUND, load_timeout=3 * BOUND)
    with Scheduler(tier) as sched:
        sched.add("r1", keys, source_params(src))
        assert sched.next_event(Resolved, "r1").answers == dict.fromkeys(keys, True)
        wait_for(lambda: hanging.transport.posts > 0)  # r1's load is in flight, stuck
        src.close(timeout=BOUND)  # the source goes away (bye) with the load in flight
        failed = sched.next_event(Finished)
        assert not failed.result.success and set(failed.result.failed) == set(keys)
        sched.add("r1", later, source_params(src))  # the same request asks for more
        r1_more = sched.next_event(Resolved, "r1")
        assert r1_more.answers == dict.fromkeys(later, False)
        sched.call(tier.shutdown)
    assert all(k not in dst.store for k in keys + later)


def test_a_hung_source_costs_the_scheduler_nothing_and_its_requests_end_by_the_deadline(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 6, BLOCK)
    more = fill(src.store, 3, BLOCK)
    # Deadlines well above the scheduler's slowest call on a busy machine (see below).
    tier = P2PTier(dst, lookup_timeout=2.0, load_timeout=2.5)
    gate = threading.Event()
    with Scheduler(tier) as sched:
        sched.add("r1", keys, source_params(src), load_gate=gate)
        assert sched.next_event(Resolved, "r1").answers == dict.fromkeys(keys, True)
        release = wedge(src)  # hung until released (or BOUND): only a deadline ends a wait
        try:
            sched.add("r2", more, source_params(src))
            gate.set()  # r1's load goes to the hung source
            r2 = sched.next_event(Resolved, "r2")
            assert r2.answers == dict.fromkeys(more, False)
            assert 2.0 <= r2.after_s < BOUND / 2  # the lookup deadline ended it
            job = sched.next_event(Finished)
            assert not job.result.success and set(job.result.failed) == set(keys)
            assert 2.5 <= job.after_s < BOUND / 2  # the load deadline ended it
            # A tier call that waited on the network would have waited at least the lookup
            # deadline (2 s); how long the calls take is bench/facade_latency.py's business.
            assert sched.slowest_call < 1.0, "a tier call blocked the scheduler"
        finally:
            release.set()
        sched.call(tier.shutdown)


def test_shutdown_leaves_no_thread_agent_or_pin_behind(
    nodes: Callable[..., BlockingNode],
) -> None:
    src = nodes("src")
    keys = fill(src.store, 5, BLOCK)
    before = engine_threads()
    tier = P2PTier.start(config("dst"), lookup_timeout=2.0)
    assert engine_threads() - before == {"p2pkv-engine-dst", "p2pkv-engine-dst-waker"}
    assert src.statistics().transport.live_agents == 2  # src and dst in this process
    never = threading.Event()
    with Scheduler(tier) as sched:
        sched.add("r1", keys, source_params(src), load_gate=never)
        assert sched.next_event(Resolved, "r1").answers == dict.fromkeys(keys, True)
        assert src.statistics().pinned_slots == 5  # the lookup round holds pins
        sched.call(tier.shutdown)
        sched.call(tier.shutdown)  # idempotent
        assert sched.call(lambda: tier.lookup(keys[0], RequestInfo("r1"))) is False
    assert engine_threads() == before
    assert not tier.node.alive and tier.node.failure is None
    wait_for(lambda: src.statistics().sessions == 0)
    st = src.statistics()
    assert st.pinned_slots == 0 and st.registrations.live == 0
    assert st.transport.live_agents == 1 and st.transport.remote_peers == 0


def finished_jobs(tier: P2PTier, what: str = "no job was reported") -> list[JobResult]:
    """The first jobs ``tier`` reports, polled as vLLM's tier-poll thread does, within
    BOUND of now (else fails saying ``what``)."""
    deadline = time.monotonic() + BOUND
    while not (done := tier.get_finished_jobs()):
        assert time.monotonic() < deadline, what
        time.sleep(STEP)  # vLLM's pacing between steps, not a sync point
    return done


def hanging_slot_load(nodes: Callable[..., BlockingNode]) -> tuple[P2PTier, BlockingNode]:
    """A tier on a node it does not own (dst), with one slot load (job 1) whose writes
    the source has posted and never settle: the fetch gives up at its deadline (0.5 s)
    and then waits out the quarantine (0.4 s)."""
    dst = nodes("dst", fetch_timeout=0.5, abort_timeout=0.2, landing_margin=0.1, quarantine=0.4)
    tier = P2PTier(dst, load_timeout=0.5)
    post_a_hanging_slot_load(tier, nodes)
    return tier, dst


def post_a_hanging_slot_load(tier: P2PTier, nodes: Callable[..., BlockingNode]) -> None:
    """Job 1 on ``tier``: two blocks of a new source (src) into slots 3 and 5, returning
    once the source has posted their writes, which never settle."""
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))
    src = nodes("src", transport=hanging)
    keys = fill(src.store, 2, BLOCK)
    info = RequestInfo("r1", source_params(src))

    def answered() -> bool:
        tier.step()
        return all(tier.lookup(k, info) is not None for k in keys)

    wait_for(answered)
    assert [tier.lookup(k, info) for k in keys] == [True, True]
    tier.submit_load(LoadJob(1, "r1", keys, slots=[3, 5]))

    def posted() -> bool:
        tier.step()
        return hanging.transport.posts >= 1

    wait_for(posted)


def test_shutdown_on_a_node_it_does_not_own_waits_for_its_slot_loads_to_end(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The node goes on after the tier's shutdown, so nothing cuts a slot load's
    fetch_into short: shutdown returns only once it has ended (its writes settled or
    quarantined out), whatever ``drain_timeout`` says."""
    tier, dst = hanging_slot_load(nodes)
    tier.shutdown(drain_timeout=0.0)
    assert dst._board.pending() == 0  # its fetch_into has ended: nothing can land now
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]  # reported, once


def test_shutdown_on_a_node_it_does_not_own_waits_a_quarantine_for_a_slot_load_that_raised(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot load's ticket that ends in an exception (its deadline cut the fetch, the
    node closed) says nothing of its writes: shutdown then waits out a quarantine before
    it returns, as for a load it cut short itself."""
    tier, dst = hanging_slot_load(nodes)
    real_poll, slept = dst.poll, list[float]()

    def poll(ticket: int) -> object:
        if ticket in tier._loads:  # the slot load's ticket: cut by its own deadline
            raise P2PKVTimeout("fetch_into did not finish in time", op="fetch_into")
        return real_poll(ticket)

    monkeypatch.setattr(dst, "poll", poll)
    monkeypatch.setattr(tier, "_drain", lambda *a, **kw: False)  # straight to the wait
    clock = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)  # sleeps recorded
    monkeypatch.setattr(vllm_module, "time", clock)
    tier.shutdown(drain_timeout=0.0)
    assert slept == [dst.config.quarantine]
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]


def test_a_request_finished_while_its_load_waits_for_the_connection_reports_the_load(
    nodes: Callable[..., BlockingNode],
) -> None:
    """vLLM may finish (abort) a request whose load still waits for its source's dial:
    the load is reported failed at once, since nothing of the finished request is
    looked at again (no deadline, no shutdown would ever report it)."""
    dst = nodes("dst")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # never accepted: the dial waits out connect_timeout
        host, port = silent.getsockname()
        req = RequestInfo("r1", {"remote_kv_source": {"host": host, "port": port}})
        tier = P2PTier(dst, connect_timeout=BOUND, load_timeout=BOUND)
        tier.submit_load(LoadJob(1, "r1", [os.urandom(32)], request=req, slots=[2]))
        assert tier.get_finished_jobs() == []  # waiting for the connection
        tier.on_request_finished(req)
        done = tier.get_finished_jobs()
        assert [(r.job_id, r.success) for r in done] == [(1, False)]
        tier.shutdown()


def test_a_slot_load_past_its_deadline_is_reported_only_once_no_write_can_land(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A slot load whose writes hang passes its deadline (0.5 s) first, and only a
    quarantine (0.4 s) later does its fetch_into end: vLLM reuses a failed chunk at once,
    so the job must not be reported in between (the source may still be writing)."""
    tier, dst = hanging_slot_load(nodes)
    done = finished_jobs(tier)
    assert dst._board.pending() == 0, "reported while a write could still land"
    assert [r.job_id for r in done] == [1] and not done[0].success
    tier.shutdown()


def test_a_request_whose_load_failed_misses_its_keys_from_then_on(
    nodes: Callable[..., BlockingNode],
) -> None:
    """vLLM frees the chunks of a failed load and asks the tier about their keys again:
    the source still holds them, so an answer other than a miss would start the same
    load again, and the request would loop."""
    tier, _dst = hanging_slot_load(nodes)
    done = finished_jobs(tier)
    keys = list(done[0].failed)
    assert not done[0].success and len(keys) == 2
    again = RequestInfo("r1")  # the same request, asking again
    for _ in range(3):
        assert [tier.lookup(k, again) for k in keys] == [False, False]
        tier.step()
    # A load of it fails at once too, without a fetch (nothing may land in its slots).
    tier.submit_load(LoadJob(2, "r1", keys, slots=[7, 9]))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, False)]
    tier.shutdown()


def test_a_slot_load_whose_ticket_raised_is_reported_only_a_quarantine_later(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot load's ticket that ends in an exception (its deadline cut the fetch, the
    node closed) says nothing of its writes: the job is held a quarantine before vLLM,
    which reuses a failed chunk at once, hears of it. The tier's clock is stepped by
    hand, so "not yet" and "now" are exact."""
    tier, dst = hanging_slot_load(nodes)
    real_poll = dst.poll

    def poll(ticket: int) -> object:
        if ticket in tier._loads:  # the slot load's ticket: cut by its own deadline
            raise P2PKVTimeout("fetch_into did not finish in time", op="fetch_into")
        return real_poll(ticket)

    now = [time.monotonic()]
    monkeypatch.setattr(dst, "poll", poll)
    monkeypatch.setattr(vllm_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    assert tier.get_finished_jobs() == []  # the ticket raised: held, not reported
    assert tier.has_pending_work()  # the host keeps stepping until it is
    now[0] += 0.99 * dst.config.quarantine
    assert tier.get_finished_jobs() == []
    now[0] += 0.02 * dst.config.quarantine
    done = tier.get_finished_jobs()
    assert [r.job_id for r in done] == [1] and not done[0].success
    monkeypatch.undo()
    tier.shutdown()


def test_shutdown_closing_its_own_node_waits_a_quarantine_for_a_slot_load_it_cut(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier that owns its node cuts a slot load's fetch_into short by closing the node,
    so nothing said its writes settled: shutdown waits out a quarantine before it returns
    (the host may free the memory next)."""
    tier = P2PTier.start(config("dst", quarantine=0.4, abort_timeout=0.2, landing_margin=0.1))
    post_a_hanging_slot_load(tier, nodes)
    slept = list[float]()
    clock = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)  # sleeps recorded
    monkeypatch.setattr(vllm_module, "time", clock)
    tier.shutdown(drain_timeout=0.0)
    assert slept == [tier.quarantine]
    assert not tier.node.alive
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]


def test_a_load_waiting_for_its_sources_connection_fails_by_the_load_deadline(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A source that accepts the TCP connection and never answers the handshake: the dial
    would wait out connect_timeout (long here), but a load submitted meanwhile ends by
    its own deadline, as every load does."""
    dst = nodes("dst")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # never accepted: the handshake gets no answer
        host, port = silent.getsockname()
        params = {"remote_kv_source": {"host": host, "port": port}}
        tier = P2PTier(dst, connect_timeout=3 * BOUND, load_timeout=0.3)
        keys = [os.urandom(32) for _ in range(2)]
        tier.submit_load(LoadJob(1, "r1", keys, request=RequestInfo("r1", params)))
        done = finished_jobs(tier, "the load outlived its deadline")
        assert [r.job_id for r in done] == [1] and not done[0].success
        assert set(done[0].failed) == set(keys)
        tier.shutdown()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_source_whose_dial_failed_is_not_dialed_again_within_the_backoff(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source that refused the dial is down for reconnect_backoff: the next request
    naming it misses at its first step, with no new dial (one per step per request would
    hammer a dead address)."""
    tier, params, _, dials = refused_source(nodes, monkeypatch)
    key = os.urandom(32)
    second = RequestInfo("r2", params)
    assert tier.lookup(key, second) is None
    tier.step()
    assert tier.lookup(key, second) is False
    assert dials() == 1
    tier.shutdown()


def test_a_load_waiting_for_a_source_that_is_not_the_named_peer_fails_alone(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A load submitted before the tier has seen its request (``LoadJob.request``) waits
    for the source's connection; if the peer that answers is not the ``peer_id`` the
    request named, the load fails: nothing of that peer's lands as the request's."""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 3, BLOCK)
    params = source_params(src)
    params["remote_kv_source"]["peer_id"] = "not-src"
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=3 * BOUND)
    tier.submit_load(LoadJob(1, "r1", keys, request=RequestInfo("r1", params)))
    done = finished_jobs(tier)  # when the dial is read, far inside load_timeout
    assert [r.job_id for r in done] == [1] and not done[0].success and not done[0].loaded
    assert all(k not in dst.store for k in keys)
    tier.shutdown()


def answered_by(
    tier: P2PTier, req: RequestInfo, keys: list[bytes], start: float, what: str
) -> list[bool | None]:
    """Step ``tier`` as vLLM's scheduler does until every key of ``req`` has an answer,
    which must come within BOUND / 2 of ``start`` (``what``'s deadline is far shorter)."""
    while True:
        answers = [tier.lookup(k, req) for k in keys]
        if None not in answers:
            return answers
        assert time.monotonic() - start < BOUND / 2, f"{what} outlived its deadline"
        time.sleep(STEP)  # vLLM's pacing between steps, not a sync point
        tier.step()


def test_a_lookup_ends_by_its_deadline_even_while_this_nodes_engine_is_wedged(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The lookup deadline is kept on the host's clock: with this node's own engine hung
    (so no ticket of it can end, not even by its own timeout) the request's keys still
    miss once lookup_timeout has passed, and the scheduler is never blocked."""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 3, BLOCK)
    tier = P2PTier(dst, lookup_timeout=0.3, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    tier.prepare(req)
    wait_for(lambda: dst.pending() == 0)  # connected: step() reads the dial's ticket
    tier.step()
    release = wedge(dst)
    try:
        start = time.monotonic()
        assert [tier.lookup(k, req) for k in keys] == [None] * 3
        assert answered_by(tier, req, keys, start, "the lookup") == [False] * 3
        assert dst.pending() > 0  # the engine never ran the lookup: the host's clock ended it
    finally:
        release.set()
    tier.shutdown()


def test_a_source_restarted_on_its_address_is_dialed_again_by_the_next_request(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The session to a source ended (it restarted on the same address): the next
    request's batch notices before it is sent and dials again, instead of sending on
    the dead session and failing."""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 3, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)

    def answers(req: RequestInfo) -> list[bool | None]:
        def answered() -> bool:
            tier.step()
            return None not in [tier.lookup(k, req) for k in keys]

        wait_for(answered)
        return [tier.lookup(k, req) for k in keys]

    assert answers(RequestInfo("r1", source_params(src))) == [True] * 3
    address, old_id = src.address, src.peer_id
    src.close(timeout=BOUND)
    wait_for(lambda: not dst.is_connected(old_id))
    again = nodes("src-again", port=address[1])  # the same address, a new process
    for k in keys:
        again.store.put(k, bytes(BLOCK))
    assert answers(RequestInfo("r2", source_params(again))) == [True] * 3
    tier.shutdown()


def test_a_dial_ends_by_its_deadline_even_while_this_nodes_engine_is_wedged(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The connect deadline is kept on the host's clock too: with this node's own engine
    hung the dial's ticket never ends, yet the request waiting on it misses once
    connect_timeout has passed (its lookup deadline is far later)."""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, connect_timeout=0.3, lookup_timeout=3 * BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    release = wedge(dst)
    try:
        start = time.monotonic()
        tier.prepare(req)  # the dial is posted to the hung engine
        assert [tier.lookup(k, req) for k in keys] == [None] * 2
        assert answered_by(tier, req, keys, start, "the dial") == [False] * 2
    finally:
        release.set()
    wait_for(lambda: dst.pending() == 0)  # the dial the engine now runs has ended
    tier.shutdown()


def test_a_finished_request_gives_its_unloaded_hits_back_at_once(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Hits looked up but never loaded are released when the request finishes, instead
    of staying pinned at the source for the whole lease (an hour here: only the finish
    can release them within wait_for's BOUND)."""
    src = nodes("src", lease=3600.0)
    dst = nodes("dst", lease=3600.0)
    keys = fill(src.store, 5, BLOCK)
    tier = P2PTier(dst, lookup_timeout=2.0, load_timeout=5.0)
    req = RequestInfo("r-unloaded", source_params(src))
    answers: dict[bytes, bool | None] = dict.fromkeys(keys)
    deadline = time.monotonic() + BOUND
    while None in answers.values():  # this thread plays the scheduler, stepping
        assert time.monotonic() < deadline
        for k in keys:
            answers[k] = tier.lookup(k, req)
        tier.step()
        time.sleep(STEP)  # vLLM's pacing between steps, not a sync point
    assert answers == dict.fromkeys(keys, True)
    assert src.statistics().pinned_slots == 5
    tier.on_request_finished(req)
    wait_for(lambda: src.statistics().pinned_slots == 0)
    tier.shutdown()


def test_a_request_finished_with_its_lookup_in_flight_gives_the_answers_pins_back(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A request that finishes (vLLM aborts it) while its batch is still unanswered: the
    answer, when it comes, pins hits nobody will fetch, and they are released at once
    instead of staying pinned at the source for the whole lease (an hour here)."""
    src = nodes("src", lease=3600.0)
    dst = nodes("dst", lease=3600.0)
    keys = fill(src.store, 4, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r-aborted", source_params(src))
    tier.prepare(req)
    wait_for(lambda: dst.pending() == 0)  # the dial's ticket is out: step() will read it
    assert [tier.lookup(k, req) for k in keys] == [None] * 4
    release = wedge(src)  # the source cannot answer until released
    try:
        tier.step()  # the batch goes out...
        assert tier._lookups
        tier.on_request_finished(req)  # ...and the request ends before its answer
    finally:
        release.set()

    def answered() -> bool:
        tier.step()
        return not tier.has_pending_work() and not tier._orphans

    wait_for(answered)
    wait_for(lambda: src.statistics().pinned_slots == 0)
    tier.shutdown()


def test_a_request_finished_right_after_its_load_leaves_the_load_its_rounds(
    nodes: Callable[..., BlockingNode],
) -> None:
    """vLLM finishing (aborting) a request just after it submitted the request's load:
    the rounds the load was given are not released from under it. Both posts used to
    reach the engine in one batch (its thread busy: here, wedged), which Trio starts in
    either order: one time in two the release went first and closed the round, and the
    fetch looked its keys up again (a round trip, or a failed load had the source
    evicted them meanwhile). Eight requests: the old code passes once in 256 runs. A
    round the load was given and did not use is released once the load has ended."""
    src = nodes("src", lease=3600.0)
    dst = nodes("dst", lease=3600.0)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    connected(tier, dst, RequestInfo("r-dial", source_params(src)))
    peer = tier._sources[src.address].peer
    assert peer is not None
    for i in range(8):
        keys = fill(src.store, 3, BLOCK)
        req = RequestInfo(f"r{i}", source_params(src))
        hits(tier, req, keys[:2])
        hits(tier, req, keys[2:])  # a second round, which the load does not use
        activity = dst.session_activity(peer)
        release = wedge(dst)  # the engine takes both posts in one batch
        try:
            tier.submit_load(LoadJob(i, req.request_id, keys[:2]))
            tier.on_request_finished(req)
        finally:
            release.set()
        done = finished_jobs(tier)
        assert [(r.job_id, r.success) for r in done] == [(i, True)]
        assert dst.session_activity(peer) == activity, f"request {i}: looked up again"
        wait_for(lambda: src.statistics().pinned_slots == 0)  # an hour's lease otherwise
    tier.shutdown()


def test_an_answer_that_comes_in_mid_scan_is_seen_by_the_whole_batch_next_step(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks ``lookup`` key by key. If the batch's answer came in between two of those
    calls and the later keys saw it, vLLM would promote them in this step and the earlier
    ones in the next: two load jobs, and the first one's fetch closes the round the second
    one needs (it looks its keys up again). The source's engine is wedged so that the
    answer is out of reach at the scan's first key and in before its second."""
    lookups_sent = count_calls(monkeypatch, SessionProtocol, "send_lookup")  # by any engine
    src = nodes("src")
    spy = SpyNode(nodes("dst"))
    keys = fill(src.store, 4, BLOCK)
    tier = P2PTier(spy, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r-scan", source_params(src))
    tier.prepare(req)
    wait_for(lambda: spy.pending() == 0)  # the dial's ticket is out: step() will read it
    assert [tier.lookup(k, req) for k in keys] == [None] * 4
    release = wedge(src)  # the source cannot answer until released
    tier.step()  # the batch goes out
    assert spy.lookups == [keys]
    # The next step's scan: its first key finds no answer...
    assert tier.lookup(keys[0], req) is None
    release.set()
    wait_for(lambda: spy.pending() == 0)  # ...then the answer is in, unread
    # ...and the rest of the same scan does not see it either.
    assert [tier.lookup(k, req) for k in keys[1:]] == [None] * 3
    tier.step()
    assert [tier.lookup(k, req) for k in keys] == [True] * 4
    tier.submit_load(LoadJob(1, "r-scan", keys))  # one job: vLLM promotes them together
    done = finished_jobs(tier)
    assert done[0].success and sorted(done[0].loaded) == sorted(keys)
    assert lookups_sent() == 1  # the load fetched on the batch's round: no lookup of its own
    tier.shutdown()


def connected(tier: P2PTier, node: BlockingNode, req: RequestInfo) -> None:
    """Dial ``req``'s source through ``tier`` (on ``node``) and let a step read the dial."""
    tier.prepare(req)
    wait_for(lambda: node.pending() == 0)
    tier.step()


def spied_and_connected(
    nodes: Callable[..., BlockingNode], n: int
) -> tuple[BlockingNode, SpyNode, list[bytes], P2PTier, RequestInfo]:
    """A source holding ``n`` keys, and a tier on a spied node whose request r1 names it,
    its source dialed."""
    src, spy = nodes("src"), SpyNode(nodes("dst"))
    keys = fill(src.store, n, BLOCK)
    tier = P2PTier(spy, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    connected(tier, spy, req)
    return src, spy, keys, tier, req


def hits(tier: P2PTier, req: RequestInfo, keys: list[bytes]) -> None:
    """Step ``tier`` until every key of ``req`` is answered; they must all be hits."""

    def answered() -> bool:
        tier.step()
        return None not in [tier.lookup(k, req) for k in keys]

    wait_for(answered)
    assert [tier.lookup(k, req) for k in keys] == [True] * len(keys)


def test_after_shutdown_a_request_naming_a_live_source_misses_and_its_load_fails_at_once(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    dials = count_calls(monkeypatch, BlockingNode, "submit_connect")
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    tier.shutdown()
    req = RequestInfo("r1", source_params(src))
    tier.prepare(req)
    assert [tier.lookup(k, req) for k in keys] == [False, False]
    tier.submit_load(LoadJob(1, "r1", keys, request=req))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
    assert dials() == 0 and all(k not in dst.store for k in keys)


def test_a_lookup_for_another_request_sends_the_batch_of_the_request_asked_before(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, spy = nodes("src"), SpyNode(nodes("dst"))
    keys = fill(src.store, 3, BLOCK)
    tier = P2PTier(spy, lookup_timeout=BOUND, load_timeout=BOUND)
    first, second = (RequestInfo(r, source_params(src)) for r in ("r1", "r2"))
    connected(tier, spy, first)
    assert [tier.lookup(k, first) for k in keys[:2]] == [None, None]
    assert spy.lookups == []  # the batch stays open while its request is being asked
    assert tier.lookup(keys[2], second) is None
    assert spy.lookups == [keys[:2]]  # first's batch went out, in one round
    tier.step()
    assert spy.lookups == [keys[:2], keys[2:]]
    tier.shutdown()


def test_a_key_misses_by_its_lookup_deadline_though_its_request_asks_new_keys_every_step(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Keys asked while the source is still being dialed wait in one open batch; keys
    that join it later do not move the deadline of those asked first."""
    src, dst = nodes("src"), nodes("dst")
    key = fill(src.store, 1, BLOCK)[0]
    tier = P2PTier(dst, connect_timeout=3 * BOUND, lookup_timeout=0.3, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    release = wedge(dst)  # the dial never ends: the batch never goes out
    try:
        start = time.monotonic()
        assert tier.lookup(key, req) is None
        while tier.lookup(key, req) is None:
            assert time.monotonic() - start < BOUND / 2, "the first key outlived its deadline"
            tier.lookup(os.urandom(32), req)  # a new key joins the open batch
            time.sleep(STEP)  # vLLM's pacing between steps, not a sync point
            tier.step()
        assert tier.lookup(key, req) is False
    finally:
        release.set()
    wait_for(lambda: dst.pending() == 0)
    tier.shutdown()


def test_a_slot_load_naming_a_key_or_a_slot_twice_a_slot_short_or_out_of_range_fails_at_once(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Nothing is posted for such a job, so no write can land: it is reported at once,
    and the request's other loads are untouched. (A slot named twice, or one outside the
    region, used to reach fetch_into, whose refusal the tier held for a quarantine, 5 s,
    and then failed the whole request; found by reviews, 2026-12-05.)"""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    tier.submit_load(LoadJob(1, "r1", [keys[0], keys[1], keys[0]], request=req, slots=[1, 2, 3]))
    tier.submit_load(LoadJob(2, "r1", keys, request=req, slots=[1]))
    tier.submit_load(LoadJob(3, "r1", keys, request=req, slots=[4, 4]))
    past = dst.config.num_blocks
    tier.submit_load(LoadJob(5, "r1", keys, request=req, slots=[4, past]))
    tier.submit_load(LoadJob(6, "r1", keys, request=req, slots=[-1, 4]))
    done = tier.get_finished_jobs()
    assert [(r.job_id, r.success, r.loaded) for r in done] == [
        (1, False, []),
        (2, False, []),
        (3, False, []),
        (5, False, []),
        (6, False, []),
    ]
    tier.submit_load(LoadJob(4, "r1", keys, request=req, slots=[4, 5]))
    assert [(r.job_id, r.success) for r in finished_jobs(tier)] == [(4, True)]
    tier.shutdown()


def test_a_slot_load_whose_slots_are_not_integers_fails_at_once_and_lands_nothing(
    nodes: Callable[..., BlockingNode],
) -> None:
    """``submit_load`` took each slot through ``int()``, so a mask passed for the slots
    (``[True, False]``) landed the keys in slots 1 and 0, a float chunk id was truncated
    and a string parsed, where ``fetch_into`` refuses all three (found by the slots
    review, 2026-12-05). Such a job fails at once, nothing is sent, the region is
    untouched; NumPy integers are still slots."""
    np = pytest.importorskip("numpy")
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    before = bytes(dst.store.array)
    bad: list[Sequence[Any]] = [[True, False], [1.0, 2.0], [1.7, 2.2], ["1", "2"]]
    for job_id, slots in enumerate(bad, 1):
        tier.submit_load(LoadJob(job_id, "r1", keys, request=req, slots=slots))
    done = tier.get_finished_jobs()
    assert [(r.job_id, r.success, r.loaded) for r in done] == [
        (i, False, []) for i in range(1, len(bad) + 1)
    ]
    assert all(set(r.failed.values()) == {"slots must be integers"} for r in done)
    assert dst.pending() == 0  # nothing was submitted to the engine
    assert bytes(dst.store.array) == before
    tier.submit_load(LoadJob(9, "r1", keys, request=req, slots=np.array([4, 5])))
    assert [(r.job_id, r.success) for r in finished_jobs(tier)] == [(9, True)]
    for k, s in zip(keys, (4, 5), strict=True):
        assert bytes(dst.store.array[s * BLOCK : (s + 1) * BLOCK]) == bytes(src.store.get(k) or b"")
    tier.shutdown()


def test_a_load_of_no_keys_is_reported_done_at_once(nodes: Callable[..., BlockingNode]) -> None:
    src, dst = nodes("src"), nodes("dst")
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    tier.submit_load(LoadJob(1, "r1", [], request=RequestInfo("r1", source_params(src))))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    tier.shutdown()


def test_a_loaded_key_is_asked_about_again_not_answered_from_the_old_probe(
    nodes: Callable[..., BlockingNode],
) -> None:
    """After the fetch the source may evict the key: a later lookup asks it again."""
    src, spy = nodes("src"), SpyNode(nodes("dst"))
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(spy, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    hits(tier, req, keys)
    tier.submit_load(LoadJob(1, "r1", keys))
    assert finished_jobs(tier)[0].success
    assert [tier.lookup(k, req) for k in keys] == [None, None]
    tier.step()
    assert spy.lookups == [keys, keys]
    tier.shutdown()


def test_a_load_of_keys_still_in_the_open_batch_takes_them_out_of_it(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The load looks up what it needs itself: its keys are not also sent as a lookup
    round (whose pins nobody would fetch)."""
    _, spy, keys, tier, req = spied_and_connected(nodes, 3)
    assert [tier.lookup(k, req) for k in keys] == [None] * 3
    tier.submit_load(LoadJob(1, "r1", keys[:2]))
    assert spy.lookups == [keys[2:]]  # the rest of the batch went out, alone
    done = finished_jobs(tier)
    assert done[0].success and sorted(done[0].loaded) == sorted(keys[:2])
    tier.shutdown()


def test_a_load_naming_a_wrong_peer_id_fails_alone_on_an_established_session(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    hits(tier, RequestInfo("good", source_params(src)), keys)  # the session is up
    params = source_params(src)
    params["remote_kv_source"]["peer_id"] = "not-src"
    tier.submit_load(LoadJob(1, "bad", keys, request=RequestInfo("bad", params)))
    done = tier.get_finished_jobs()
    assert [(r.job_id, r.success, r.loaded) for r in done] == [(1, False, [])]
    assert all(k not in dst.store for k in keys)
    tier.submit_load(LoadJob(2, "good", keys))  # the source still serves the others
    done = finished_jobs(tier)
    assert [(r.job_id, r.success) for r in done] == [(2, True)]
    tier.shutdown()


def test_a_load_after_its_source_restarted_dials_again_instead_of_failing(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    hits(tier, RequestInfo("r1", source_params(src)), keys)
    address, old_id = src.address, src.peer_id
    src.close(timeout=BOUND)
    wait_for(lambda: not dst.is_connected(old_id))
    again = nodes("src-again", port=address[1])  # the same address, a new process
    for k in keys:
        again.store.put(k, bytes(BLOCK))
    req = RequestInfo("r2", source_params(again))
    tier.submit_load(LoadJob(1, "r2", keys, request=req))
    done = finished_jobs(tier)
    assert [(r.job_id, r.success) for r in done] == [(1, True)]
    tier.shutdown()


def test_an_open_batch_or_a_dial_in_flight_is_pending_work(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A host steps while the tier has pending work: an open batch goes out only at a
    step, and a dial is read only by one."""
    src, dst = nodes("src"), nodes("dst")
    key = fill(src.store, 1, BLOCK)[0]
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    assert not tier.has_pending_work()
    asked = RequestInfo("r1", source_params(src))
    assert tier.lookup(key, asked) is None  # open, not sent, no dial yet
    assert tier.has_pending_work()
    tier.on_request_finished(asked)
    assert not tier.has_pending_work()
    tier.prepare(RequestInfo("r2", source_params(src)))  # the dial is out
    assert tier.has_pending_work()
    tier.shutdown()


def refused_source(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> tuple[P2PTier, dict[str, Any], list[float], Callable[[], int]]:
    """A tier on the host clock ``now`` (a list: tests move it by hand) whose request r1
    found its source down (the dial was refused, backoff 60 s); its params, and the
    count of dials so far."""
    dst = nodes("dst")
    dials = count_calls(monkeypatch, BlockingNode, "submit_connect")
    now = [time.monotonic()]
    monkeypatch.setattr(vllm_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    params = {"remote_kv_source": {"host": "127.0.0.1", "port": _unused_port()}}
    tier = P2PTier(dst, lookup_timeout=BOUND, connect_timeout=BOUND, reconnect_backoff=60.0)
    key = os.urandom(32)
    first = RequestInfo("r1", params)
    assert tier.lookup(key, first) is None

    def missed() -> bool:
        tier.step()
        return tier.lookup(key, first) is False

    wait_for(missed)  # the dial was refused
    assert dials() == 1
    return tier, params, now, dials


def test_a_source_whose_dial_failed_stays_down_for_its_backoff_once_no_request_names_it(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, params, now, dials = refused_source(nodes, monkeypatch)
    tier.on_request_finished(RequestInfo("r1", params))
    for _ in range(3):  # idle sources are looked for every second at most
        now[0] += 1.0
        tier.step()
    second = RequestInfo("r2", params)
    assert tier.lookup(os.urandom(32), second) is None
    tier.step()
    assert tier.lookup(os.urandom(32), second) is False
    assert dials() == 1
    tier.shutdown()


def test_a_source_marked_down_is_dialed_again_after_its_backoff(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, params, now, dials = refused_source(nodes, monkeypatch)  # r1 still names it
    now[0] += 60.0
    assert tier.lookup(os.urandom(32), RequestInfo("r2", params)) is None
    tier.step()
    assert dials() == 2
    tier.shutdown()


def test_a_request_finished_with_its_batch_still_open_sends_no_lookup(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Its open batch is dropped: no round pins blocks at the source for nobody."""
    _, spy, keys, tier, req = spied_and_connected(nodes, 3)
    assert [tier.lookup(k, req) for k in keys] == [None] * 3
    tier.on_request_finished(req)
    tier.step()
    assert spy.lookups == [] and not tier.has_pending_work()
    tier.shutdown()


def test_an_answer_that_comes_in_after_a_load_took_its_keys_does_not_answer_them_again(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The load consumed the keys' probes while their batch was out: its answer, when it
    comes, is not kept for them (the fetch may have made the source evict them)."""
    src, spy, keys, tier, req = spied_and_connected(nodes, 2)
    assert [tier.lookup(k, req) for k in keys] == [None, None]
    release = wedge(src)  # the source cannot answer until released
    try:
        tier.step()  # the batch goes out
        tier.submit_load(LoadJob(1, "r1", keys))
    finally:
        release.set()
    done = finished_jobs(tier)
    assert [(r.job_id, r.success) for r in done] == [(1, True)]
    wait_for(lambda: spy.pending() == 0)  # the batch's answer is in too
    tier.step()
    assert [tier.lookup(k, req) for k in keys] == [None, None]  # asked again
    tier.shutdown()


def test_a_batch_that_waited_for_its_dial_keeps_the_deadline_of_its_first_key(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup deadline runs from the first ask, not from when the dial let the batch
    go out. The tier's clock is moved by hand, so "by then" is exact."""
    src, dst = nodes("src"), nodes("dst")
    key = fill(src.store, 1, BLOCK)[0]
    now = [time.monotonic()]
    monkeypatch.setattr(vllm_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    tier = P2PTier(dst, lookup_timeout=BOUND, connect_timeout=3 * BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    tier.prepare(req)
    assert tier.lookup(key, req) is None  # asked while the dial is out
    wait_for(lambda: dst.pending() == 0)
    now[0] += 0.9 * BOUND
    release = wedge(src)  # the source cannot answer until released
    try:
        tier.step()  # the dial is read: the batch goes out
        assert tier.lookup(key, req) is None
        now[0] += 0.2 * BOUND
        tier.step()
        assert tier.lookup(key, req) is False
    finally:
        release.set()
    monkeypatch.undo()
    tier.shutdown()


def test_a_load_waiting_for_a_dial_that_is_refused_fails_with_the_dial(
    nodes: Callable[..., BlockingNode],
) -> None:
    dst = nodes("dst")
    params = {"remote_kv_source": {"host": "127.0.0.1", "port": _unused_port()}}
    tier = P2PTier(dst, connect_timeout=3 * BOUND, load_timeout=3 * BOUND)
    keys = [os.urandom(32) for _ in range(2)]
    tier.submit_load(LoadJob(1, "r1", keys, request=RequestInfo("r1", params)))
    done = finished_jobs(tier, "the load outlived its refused dial")  # far inside its deadline
    assert [(r.job_id, r.success) for r in done] == [(1, False)]
    assert set(done[0].failed) == set(keys)
    tier.shutdown()


def test_a_source_lost_under_one_request_fails_only_the_requests_waiting_on_it(
    nodes: Callable[..., BlockingNode],
) -> None:
    """r2's lookup is out when the source's connections go down: r2 misses. r1, whose
    answers were in, waits on nothing then: its load dials the source again (a session
    that ended is dialed again at once) and loads."""
    src, dst = nodes("src"), nodes("dst")
    keys, more = fill(src.store, 2, BLOCK), fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=3 * BOUND, load_timeout=BOUND, reconnect_backoff=60.0)
    first, second = (RequestInfo(r, source_params(src)) for r in ("r1", "r2"))
    hits(tier, first, keys)
    assert [tier.lookup(k, second) for k in more] == [None, None]
    release = wedge(src)  # the source hangs...
    try:
        tier.step()  # ...with r2's lookup sent and unanswered...
        crash_connections(src)  # ...and its connections go down

        def lost() -> bool:
            tier.step()
            return [tier.lookup(k, second) for k in more] == [False, False]

        wait_for(lost)
    finally:
        release.set()
    tier.submit_load(LoadJob(1, "r1", keys))
    done = finished_jobs(tier)
    assert [(r.job_id, r.success) for r in done] == [(1, True)]
    tier.shutdown()


def test_a_request_naming_a_wrong_peer_id_sends_no_lookup_on_an_established_session(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Its keys miss without being asked: the peer that answers is not the one named."""
    src, spy = nodes("src"), SpyNode(nodes("dst"))
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(spy, lookup_timeout=BOUND, load_timeout=BOUND)
    hits(tier, RequestInfo("good", source_params(src)), keys)  # the session is up
    params = source_params(src)
    params["remote_kv_source"]["peer_id"] = "not-src"
    bad = RequestInfo("bad", params)
    assert [tier.lookup(k, bad) for k in keys] == [None, None]
    tier.step()
    assert [tier.lookup(k, bad) for k in keys] == [False, False]
    assert spy.lookups == [keys]  # the good request's only
    tier.shutdown()


def test_a_request_failed_by_its_load_gives_back_the_pins_of_its_lookup_in_flight(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its batch still out when the load fails is nobody's any more: once answered, its
    hits are released at once instead of staying pinned for the lease (an hour here)."""
    src = nodes("src", lease=3600.0)
    dst = nodes("dst", lease=3600.0)
    keys, more = fill(src.store, 2, BLOCK), fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    hits(tier, req, keys)
    assert [tier.lookup(k, req) for k in more] == [None, None]
    real_poll = dst.poll

    def poll(ticket: int) -> object:
        if ticket in tier._loads:  # the load's ticket ends in an error
            raise P2PKVTimeout("fetch did not finish in time", op="fetch")
        return real_poll(ticket)

    release = wedge(src)  # the source cannot answer until released
    try:
        tier.step()  # the second batch goes out
        tier.submit_load(LoadJob(1, "r1", keys))
        monkeypatch.setattr(dst, "poll", poll)
        done = tier.get_finished_jobs()  # the load fails, failing its request
        assert [(r.job_id, r.success) for r in done] == [(1, False)]
        monkeypatch.undo()
    finally:
        release.set()
    assert [tier.lookup(k, req) for k in more] == [False, False]

    def released() -> bool:
        tier.step()
        return src.statistics().pinned_slots == 0

    wait_for(released)
    tier.shutdown()


def test_a_load_of_which_one_key_is_missing_fails_and_lists_the_keys_that_landed(
    nodes: Callable[..., BlockingNode],
) -> None:
    """``success`` holds iff every key of the job landed: a partial load is a failure."""
    src, dst = nodes("src"), nodes("dst")
    present, absent = fill(src.store, 2, BLOCK), os.urandom(32)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    req = RequestInfo("r1", source_params(src))
    connected(tier, dst, req)
    tier.submit_load(LoadJob(1, "r1", [*present, absent]))
    done = finished_jobs(tier)
    assert [(r.job_id, r.success) for r in done] == [(1, False)]
    assert sorted(done[0].loaded) == sorted(present) and list(done[0].failed) == [absent]
    tier.shutdown()


def test_a_load_ends_by_its_deadline_even_while_this_nodes_engine_is_wedged(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The load deadline is kept on the host's clock, as the lookup's is: with this
    node's engine hung (no ticket of it can end) the load fails once load_timeout has
    passed."""
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=0.3)
    req = RequestInfo("r1", source_params(src))
    connected(tier, dst, req)
    release = wedge(dst)
    try:
        tier.submit_load(LoadJob(1, "r1", keys))
        done = finished_jobs(tier, "the load outlived its deadline")
        assert [(r.job_id, r.success) for r in done] == [(1, False)]
        assert dst.pending() > 0  # the engine never ran the fetch: the host's clock ended it
    finally:
        release.set()
    tier.shutdown()


def test_at_max_peers_a_source_a_live_request_names_is_never_the_one_closed(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The source unused longest makes room, among those no live request names: the
    request named first, still live, keeps its session and loads its hits over it."""
    dst = nodes("dst", max_peers=2)
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    keys = {n.peer_id: fill(n.store, 2, BLOCK) for n in (a, b, c)}
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND)
    live = RequestInfo("ra", source_params(a))
    hits(tier, live, keys["a"])  # named first, and still live
    done = RequestInfo("rb", source_params(b))
    hits(tier, done, keys["b"])
    tier.on_request_finished(done)
    hits(tier, RequestInfo("rc", source_params(c)), keys["c"])  # at the cap: b makes room
    assert dst.is_connected(a.peer_id) and not dst.is_connected(b.peer_id)
    tier.submit_load(LoadJob(1, "ra", keys["a"]))
    assert [(r.job_id, r.success) for r in finished_jobs(tier)] == [(1, True)]
    tier.shutdown()


def test_at_max_peers_a_source_found_in_use_when_making_room_is_looked_at_again(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making room, the tier finds the idle source's session in use: here a round of ours
    is open on it, as a finished request's rounds are until their release runs (posted
    just before the disconnect, the engine may start it after). The tier looks again
    instead of dialing into the cap's refusal; once the round is released, the session
    closes and the new source's request gets its hits. (The test above failed now and
    then on a slow machine, its dial refused at the cap.)"""
    dst = nodes("dst", max_peers=2)
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    keys = {n.peer_id: fill(n.store, 2, BLOCK) for n in (a, b, c)}
    tier = P2PTier(dst, lookup_timeout=BOUND, load_timeout=BOUND, connect_timeout=BOUND)
    hits(tier, RequestInfo("ra", source_params(a)), keys["a"])
    done = RequestInfo("rb", source_params(b))
    hits(tier, done, keys["b"])
    tier.on_request_finished(done)
    held = dst.lookup_round(b.peer_id, keys["b"])  # ours, open on b's session
    looks = count_calls(monkeypatch, BlockingNode, "submit_disconnect_idle")
    rc = RequestInfo("rc", source_params(c))
    assert [tier.lookup(k, rc) for k in keys["c"]] == [None, None]

    def looked_again() -> bool:  # the first look found b's session in use
        tier.step()
        return looks() >= 2

    wait_for(looked_again)
    assert [tier.lookup(k, rc) for k in keys["c"]] == [None, None]  # no dial refused yet
    assert dst.is_connected(b.peer_id)
    dst.release(b.peer_id, held)
    hits(tier, rc, keys["c"])
    assert not dst.is_connected(b.peer_id) and dst.is_connected(c.peer_id)
    tier.shutdown()


def test_a_slot_load_held_for_its_quarantine_at_shutdown_is_reported_once_it_is_over(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown reports every job: one held back (its ticket raised, so nothing said its
    writes settled) is reported, after shutdown has waited out a quarantine."""
    tier, dst = hanging_slot_load(nodes)
    real_poll, slept = dst.poll, list[float]()

    def poll(ticket: int) -> object:
        if ticket in tier._loads:  # the slot load's ticket: cut by its own deadline
            raise P2PKVTimeout("fetch_into did not finish in time", op="fetch_into")
        return real_poll(ticket)

    monkeypatch.setattr(dst, "poll", poll)
    clock = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)  # sleeps recorded
    monkeypatch.setattr(vllm_module, "time", clock)
    assert tier.get_finished_jobs() == []  # held
    tier.shutdown(drain_timeout=0.0)
    assert slept == [dst.config.quarantine]
    done = tier.get_finished_jobs()
    assert [(r.job_id, r.success) for r in done] == [(1, False)]
