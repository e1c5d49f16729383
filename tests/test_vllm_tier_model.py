"""A Hypothesis state machine plays vLLM 0.33's scheduler against two p2pkv tiers.

Two real ``TieringOffloadingManager``s in this process (as in test_vllm_tier_inproc.py),
each with its p2pkv tier and vLLM's tier-poll thread: the *source* engine stores blocks
(random bytes under keys drawn from a small pool, so stores, evictions and requests
collide), the *consumer* engine runs requests that name the source (or a source that is
gone, or none). Each step is one thing vLLM legally does: a scheduler step (every waiting
request's lookups in prefix order up to its first MISS, the ``prepare_load`` of a request
whose lookups settled, ``on_schedule_end``), a worker finishing a request's load (its
``complete_load``, then the GPU's store of the keys it computed), a request finishing
(in any state vLLM allows: waiting for lookups, or after its load), a preemption, an
idle step of either engine, the source storing blocks (which evicts others), a cache
reset on the consumer (``reset_cache``, then ``on_reset_flushed``), the source going away.

Checked after every step: every chunk the consumer's CPU tier holds ready has exactly the
bytes stored under its key (no wrong bytes, ever); each load the tier reports is one it
was given and not reported before, the keys it calls loaded hold their bytes at the
moment it reports them, and ``successful_keys`` is a subset of the job's keys; the
tier's counters (loaded/failed blocks, bytes) equal what it reported; the tier keeps
state only for loads not yet reported; no tier-poll round failed. At the end: every
request finished, every load and every source pin is reported exactly once, the tier
holds nothing for any request, the source holds no pin, and (source alive) a fresh pull
is a byte-exact hit; then both engines shut down and leave no engine thread behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

# Skips this module where vLLM 0.33 is not installed (its importorskip), as it does there.
from .test_vllm_tier_inproc import (
    CHUNK,
    Engine,
    chunk_ids,
    offloading_config,
    tier_config,
    vllm_spec,
)

with warnings.catch_warnings():  # vLLM and torch warn at import; not ours to fix
    warnings.simplefilter("ignore")
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadKey,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.tiering import manager as vllm_manager
    from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager


pytestmark = pytest.mark.vllm

CHUNKS = 8  # each engine's CPU tier: small, so stores evict and promotions find it full
POOL = [make_offload_key(hashlib.sha256(b"model%d" % i).digest(), 0) for i in range(12)]
BOUND = 8.0  # seconds: "this did not hang", never an expected duration
LEASE = 30.0  # past BOUND: a round nobody releases shows as a pin left, not a lease's end
TIMINGS = {  # short deadlines, so failures end within a step or two of the model
    "load_timeout_s": 1.0,
    "lookup_timeout_s": 1.0,
    "abort_timeout_s": 0.1,
    "landing_margin_s": 0.1,
    "serve_timeout_s": 0.3,
    "quarantine_s": 0.6,  # > abort + margin + serve
    "lease_s": LEASE,
    "max_pinned_peer_share": 1,
}
_ids = itertools.count()


def content(key: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes stored under ``key`` (by anyone: one key, one content, as in vLLM)."""
    return np.frombuffer(hashlib.sha256(b"bytes" + key).digest() * (CHUNK // 32), np.uint8)


@contextlib.contextmanager
def locked(mgr: TieringOffloadingManager) -> Iterator[None]:
    assert mgr.lock.acquire(timeout=BOUND), "vLLM's lock was not free"
    try:
        yield
    finally:
        mgr.lock.release()


class _Errors(logging.Handler):
    """Collects the tier-poll thread's failed rounds (it logs them and polls on)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@attrs.define(eq=False)
class Side(Engine):
    """One engine (:class:`Engine`'s manager and tier) and what the model saw it report."""

    submitted: dict[int, TransferJob] = attrs.field(factory=dict)  # loads given the tier
    reported: dict[int, JobResult] = attrs.field(factory=dict)  # loads it reported
    wrong: list[str] = attrs.field(factory=list)  # what the report-time checks found
    alive: bool = True

    def watch(self) -> None:
        """Record every load vLLM gives the tier and check each report as vLLM takes it
        (under vLLM's lock, on whichever thread polls), before vLLM makes it readable."""
        tier = self.tier
        submit, finished = tier.submit_load, tier.get_finished_jobs

        def submit_load(job: TransferJob) -> None:
            self.submitted[job.job_id] = job
            submit(job)

        def get_finished_jobs() -> Iterator[JobResult]:
            for res in finished():
                self._check_report(res)
                yield res

        setattr(tier, "submit_load", submit_load)  # noqa: B010 (an instance's own method)
        setattr(tier, "get_finished_jobs", get_finished_jobs)  # noqa: B010

    def _check_report(self, res: JobResult) -> None:
        if res.job_id not in self.mgr._jobs:
            self.wrong.append(f"job {res.job_id} reported but vLLM has no such job")
            return
        job = self.submitted.get(res.job_id)
        if job is None:
            return  # a store (the tier's cascades and the pins of peers' lookups)
        if res.job_id in self.reported:
            self.wrong.append(f"load {res.job_id} reported twice")
        self.reported[res.job_id] = res
        ok = list(job.keys) if res.success else list(res.successful_keys or ())
        if not set(ok) <= set(job.keys):
            self.wrong.append(f"load {res.job_id} names keys it was not given")
        chunk_of = dict(zip(job.keys, np.asarray(job.chunk_ids).tolist(), strict=True))
        view = self.view()
        for key in ok:
            if not np.array_equal(view[chunk_of[key]], content(key)):
                self.wrong.append(f"load {res.job_id} reported {key.hex()[:8]} with wrong bytes")
        del view
        if res.transfer_bytes is not None and res.transfer_bytes != len(ok) * CHUNK:
            self.wrong.append(f"load {res.job_id} reports {res.transfer_bytes} bytes moved")

    def ready_chunks(self) -> dict[bytes, int]:
        """Chunk id of every key of the pool (and the final pull's) the CPU tier holds ready."""
        out: dict[bytes, int] = {}
        policy = self.mgr.primary_tier._policy
        for key in [*POOL, *FRESH]:
            status = policy.get(OffloadKey(key))
            if status is not None and status.is_ready:
                out[key] = int(status.chunk_id)
        return out

    def step_idle(self) -> None:
        with locked(self.mgr):
            self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def store(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """The GPU's store of ``keys`` for ``ctx`` (vLLM: prepare_store when it schedules
        the store, complete_store when the worker reports it), with their bytes."""
        out = self.mgr.prepare_store(keys, ctx)
        if out is None:  # no room (everything pinned): vLLM stores nothing
            return
        view = self.view()
        for key, chunk in zip(out.keys_to_store, chunk_ids(out.store_spec), strict=True):
            view[chunk] = content(key)
        del view
        if out.keys_to_store:
            self.mgr.complete_store(out.keys_to_store, ctx)


FRESH = [make_offload_key(hashlib.sha256(b"fresh%d" % i).digest(), 0) for i in range(3)]


@attrs.define(eq=False)
class Req:
    ctx: ReqContext
    keys: list[OffloadKey]
    phase: str = "waiting"  # waiting -> loading (prepare_load done) -> ran
    loading: list[OffloadKey] = attrs.field(factory=list)
    chunks: list[int] = attrs.field(factory=list)  # where prepare_load said they are


def dead_address() -> tuple[str, int]:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return "127.0.0.1", port


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.threads_before = {t.ident for t in threading.enumerate()}
        self.errors = _Errors()
        vllm_manager.logger.addHandler(self.errors)
        self.src = self._build()
        self.dst = self._build()
        self.src_address = self.src.tier.address
        self.dead = dead_address()
        self.reqs: dict[str, Req] = {}
        self.reset_pending = False
        self.src_stored: list[OffloadKey] = []  # in the order the source last stored them

    def _build(self) -> Side:
        engine_id = f"p2pkvmodel{os.getpid()}x{next(_ids)}"
        cfg = offloading_config(tier_config(**TIMINGS), engine_id)
        extra: Any = cfg.extra_config  # a dict at run time
        extra["cpu_bytes_to_use"] = CHUNKS * CHUNK
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = vllm_spec.TieringOffloadingSpec(cfg).get_manager()
        assert isinstance(mgr, TieringOffloadingManager)
        side = Side(mgr, engine_id)
        side.watch()
        return side

    @initialize(keys=st.lists(st.sampled_from(POOL), min_size=1, max_size=6, unique=True))
    def first_store(self, keys: list[OffloadKey]) -> None:
        self.src_stores(keys)

    # ------------------------------------------------------------------ the source

    @precondition(lambda self: self.src.alive)
    @rule(keys=st.lists(st.sampled_from(POOL), min_size=1, max_size=4, unique=True))
    def src_stores(self, keys: list[OffloadKey]) -> None:
        ctx = ReqContext(req_id=f"src-{next(_ids)}")
        with locked(self.src.mgr):
            self.src.mgr.on_new_request(ctx)
            self.src.store(keys, ctx)
            self.src.mgr.on_request_finished(ctx)
        self.src_stored = [k for k in self.src_stored if k not in keys] + keys

    @precondition(lambda self: self.src.alive)
    @rule()
    def src_steps(self) -> None:
        self.src.step_idle()

    @precondition(lambda self: self.src.alive)
    @rule(really=st.integers(0, 3))
    def src_goes_away(self, really: int) -> None:
        """The source engine shuts down (drawn a quarter as often as other rules: once
        it is gone every pull misses, and the model should mostly see them work)."""
        if really:
            return
        self.src.mgr.shutdown()
        self.src.alive = False

    # ------------------------------------------------------------------ the consumer

    @rule(
        keys=st.lists(st.sampled_from(POOL), min_size=1, max_size=5, unique=True),
        source=st.sampled_from(["src", "src", "src", "dead", "none"]),
        data=st.data(),
    )
    def new_request(self, keys: list[OffloadKey], source: str, data: st.DataObject) -> None:
        from_src: bool = data.draw(st.booleans(), "keys the source stored")
        if self.src_stored and from_src:
            # Mostly keys the source stored last (some may be evicted since): hits.
            recent = self.src_stored[-CHUNKS:]
            keys = data.draw(st.lists(st.sampled_from(recent), min_size=1, max_size=5, unique=True))
        name = f"r{next(_ids)}"
        params: dict[str, Any] | None = None
        if source != "none":
            host, port = self.src_address if source == "src" else self.dead
            params = {
                "remote_kv_source": {
                    "kv_request_id": name,
                    "remote_host": host,
                    "remote_port": port,
                }
            }
        ctx = ReqContext(req_id=name, kv_transfer_params=params)
        with locked(self.dst.mgr):
            self.dst.mgr.on_new_request(ctx)
        self.reqs[name] = Req(ctx, keys)

    @rule()
    def schedule(self) -> None:
        self._schedule()

    @rule()
    def schedule_until_settled(self) -> None:
        """Scheduler steps until no request waits (or a bound of steps): the lookups'
        probes and loads take a few steps, and the model should see them end."""
        for _ in range(300):
            self._schedule()
            if not self._in("waiting"):
                return
            time.sleep(0.002)  # a scheduler step's pacing, not a synchronisation

    def _schedule(self) -> None:
        """One scheduler step: every waiting request's lookups in prefix order up to the
        first MISS; one whose answer did not defer is allocated (``prepare_load`` of its
        hits, in the same lock region, as ``update_state_after_alloc`` does)."""
        with locked(self.dst.mgr):
            for req in self.reqs.values():
                if req.phase != "waiting":
                    continue
                hits: list[OffloadKey] = []
                deferred = False
                for key in req.keys:
                    res = self.dst.mgr.lookup(key, req.ctx)
                    if res is LookupResult.MISS:
                        break
                    deferred |= res is not LookupResult.HIT
                    hits.append(key)
                if deferred:
                    continue
                req.phase = "loading"
                req.loading = hits
                event(f"settled with {len(hits)} of {len(req.keys)} hits")
                if hits:
                    req.chunks = chunk_ids(self.dst.mgr.prepare_load(hits, req.ctx))
                    view = self.dst.view()
                    for key, chunk in zip(hits, req.chunks, strict=True):
                        assert np.array_equal(view[chunk], content(key)), "HIT with wrong bytes"
                    del view
            self.dst.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def _pick(self, pick: int, *phases: str) -> Req | None:
        """The ``pick``-th request (modulo) of those in ``phases``. Which phase a request
        is in depends on timing (answers come from other threads), so it is not a rule's
        precondition: Hypothesis needs the same draws to enable the same rules."""
        names = [name for phase in phases for name in self._in(phase)]
        return self.reqs[names[pick % len(names)]] if names else None

    def _in(self, phase: str) -> list[str]:
        return sorted(name for name, req in self.reqs.items() if req.phase == phase)

    @rule(pick=st.integers(0, 7))
    def worker_done(self, pick: int) -> None:
        """The worker loaded the request's hits to the GPU (``complete_load``), computed
        the rest and stored it (``prepare_store``/``complete_store``: a cascade to p2pkv)."""
        req = self._pick(pick, "loading")
        if req is None:
            return
        with locked(self.dst.mgr):
            view = self.dst.view()
            for key, chunk in zip(req.loading, req.chunks, strict=True):
                # The bytes the worker read stayed put while the chunk was pinned.
                assert np.array_equal(view[chunk], content(key)), "pinned chunk changed"
            del view
            if req.loading:
                self.dst.mgr.complete_load(req.loading, req.ctx)
            self.dst.store(req.keys[len(req.loading) :], req.ctx)
        req.phase = "ran"
        req.loading, req.chunks = [], []

    @rule(pick=st.integers(0, 7))
    def preempt(self, pick: int) -> None:
        """vLLM preempted the request: it is looked up again from its first key."""
        req = self._pick(pick, "ran")
        if req is not None:
            req.phase = "waiting"

    @rule(pick=st.integers(0, 7))
    def finish(self, pick: int) -> None:
        """The request ends (done, or aborted while its lookups were deferred)."""
        req = self._pick(pick, "waiting", "ran")
        if req is None:
            return
        with locked(self.dst.mgr):
            self.dst.mgr.on_request_finished(req.ctx)
        del self.reqs[str(req.ctx.req_id)]

    @rule()
    def time_passes(self) -> None:
        """A model step's worth of time between two vLLM calls: peers' answers come in
        meanwhile (so a request may finish with its lookup answered but not yet loaded)."""
        time.sleep(0.03)  # time passing is the event modelled, not a synchronisation

    @rule()
    def dst_steps(self) -> None:
        self.dst.step_idle()

    @precondition(lambda self: not self.reset_pending)
    @rule()
    def reset_cache(self) -> None:
        """vLLM resets the prefix cache (no load to the GPU in flight): the tier drains
        under the lock, then promotions are held until the reset is flushed."""
        if self._in("loading"):
            return
        with locked(self.dst.mgr):
            self.dst.mgr.reset_cache()
        self.reset_pending = True

    @precondition(lambda self: self.reset_pending)
    @rule()
    def reset_flushed(self) -> None:
        with locked(self.dst.mgr):
            self.dst.mgr.on_reset_flushed()
        self.reset_pending = False

    # ------------------------------------------------------------------ checks

    @invariant()
    def nothing_wrong(self) -> None:
        for side in (self.src, self.dst):
            if not side.alive:
                continue
            with locked(side.mgr):
                assert not side.wrong, side.wrong
                view = side.view()
                for key, chunk in side.ready_chunks().items():
                    assert np.array_equal(view[chunk], content(key)), (
                        f"ready chunk {chunk} of {key.hex()[:8]} holds wrong bytes"
                    )
                del view
        assert not self.errors.records, self.errors.records
        tier = self.dst.tier
        with locked(self.dst.mgr):
            unreported = set(self.dst.submitted) - set(self.dst.reported)
            assert set(tier._loads) == unreported  # the tier forgets a load it reported
            core_jobs = {ld.job.job_id for ld in tier._core._loads.values()}
            core_jobs |= {res.job_id for _, res in tier._core._holds}
            core_jobs |= {
                ld.job.job_id for r in tier._core._requests.values() for ld in r.waiting_loads
            }
            assert core_jobs <= unreported
            ok = failed = 0
            for job_id, res in self.dst.reported.items():
                keys = self.dst.submitted[job_id].keys
                n = len(keys) if res.success else len(res.successful_keys or ())
                ok, failed = ok + n, failed + len(keys) - n
            stats = tier._stats
            assert (stats["loaded_blocks"], stats["failed_blocks"]) == (ok, failed)
            assert stats["loaded_bytes"] == ok * CHUNK

    def teardown(self) -> None:
        try:
            self._settle()
        finally:
            try:
                self._shut(self.dst)
            finally:
                self._shut(self.src)
                vllm_manager.logger.removeHandler(self.errors)
        left = [
            t.name
            for t in threading.enumerate()
            if t.ident not in self.threads_before and t.name.startswith("p2pkv-engine")
        ]
        assert not left, left

    @staticmethod
    def _shut(side: Side) -> None:
        try:
            if side.alive:
                side.alive = False
                side.mgr.shutdown()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/vllm_offload_{side.engine_id}.mmap")

    def _settle(self) -> None:
        for name in self._in("loading"):
            req = self.reqs[name]
            with locked(self.dst.mgr):
                if req.loading:
                    self.dst.mgr.complete_load(req.loading, req.ctx)
        with locked(self.dst.mgr):
            for req in self.reqs.values():
                self.dst.mgr.on_request_finished(req.ctx)
            if self.reset_pending:
                self.dst.mgr.on_reset_flushed()
        self.reqs.clear()

        def quiet() -> bool:
            with locked(self.dst.mgr):
                busy = bool(self.dst.mgr._jobs or self.dst.tier._loads)
                core = self.dst.tier._core
                busy |= bool(core._requests or core._loads or core._holds or core._lookups)
            if self.src.alive:
                with locked(self.src.mgr):
                    busy |= bool(self.src.mgr._jobs) or self.src.tier._pins.held() > 0
            return not busy

        end = time.monotonic() + BOUND
        while not quiet():
            held = self.src.tier._pins.held() if self.src.alive else 0
            assert time.monotonic() < end, (
                f"the tiers did not settle ({held} source pins held): "
                + repr(self.dst.tier._core.debug_state())
            )
            self.dst.step_idle()
            if self.src.alive:
                self.src.step_idle()
            time.sleep(0.002)  # a scheduler step's pacing, not a synchronisation
        assert set(self.dst.submitted) == set(self.dst.reported)
        for res in self.dst.reported.values():
            event(f"load {'ok' if res.success else 'partial' if res.successful_keys else 'failed'}")
        self.nothing_wrong()
        if self.src.alive:
            self._fresh_pull()

    def _fresh_pull(self) -> None:
        """After all that, the tiers still work: keys only the source holds come over
        byte-exact."""
        self.src_stores(FRESH)
        ctx = ReqContext(
            req_id=f"fresh{next(_ids)}",
            kv_transfer_params={
                "remote_kv_source": {
                    "kv_request_id": "fresh",
                    "remote_host": self.src_address[0],
                    "remote_port": self.src_address[1],
                }
            },
        )
        with locked(self.dst.mgr):
            self.dst.mgr.on_new_request(ctx)
        end = time.monotonic() + BOUND
        while True:
            with locked(self.dst.mgr):
                res = [self.dst.mgr.lookup(k, ctx) for k in FRESH]
                if res == [LookupResult.HIT] * len(FRESH):
                    spec = self.dst.mgr.prepare_load(FRESH, ctx)
                    view = self.dst.view()
                    for key, chunk in zip(FRESH, chunk_ids(spec), strict=True):
                        assert np.array_equal(view[chunk], content(key))
                    del view
                    self.dst.mgr.complete_load(FRESH, ctx)
                    self.dst.mgr.on_request_finished(ctx)
                    self.dst.mgr.on_schedule_end(
                        ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
                    )
                    return
                assert LookupResult.MISS not in res, f"a fresh pull missed: {res}"
                self.dst.mgr.on_schedule_end(
                    ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
                )
            assert time.monotonic() < end, "a fresh pull did not settle"
            time.sleep(0.002)  # a scheduler step's pacing, not a synchronisation


TestTierModel = TierMachine.TestCase
TestTierModel.settings = settings(
    max_examples=25 if os.environ.get("P2PKV_SLOW") != "1" else 250,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
