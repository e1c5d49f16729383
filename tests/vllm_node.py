"""One vLLM node process of the two-process harness (the child side of tests/vllm_harness.py).

Theory of operation. The process builds vLLM's real ``TieringOffloadingSpec(...).get_manager()``
with one secondary tier (whatever ``tier_config`` names) and drives it the way vLLM's
``OffloadingConnectorScheduler`` does, from a *scheduler thread*:

* one step = ``with mgr.lock:`` lookups in prefix order for every active request (stop the
  prefix at MISS, keep scanning on RETRY, a HIT_PENDING or RETRY defers the request), then
  ``mgr.on_schedule_end(...)`` as the last call of the region; then the "model step" outside
  the lock: nothing, a sleep or a Python spin of ``step_s`` seconds. With ``step_s == 0`` an
  engine with nothing to do waits for work, like vLLM's engine core; with work (an active
  request or ``has_pending_work()``) it ticks every millisecond.
* the lock-held time of every step is recorded, minus the time a test deliberately holds a
  step at a *gate* (see below), so a test can assert that no tier call blocked.
* a request is done when its scan is no longer deferred: every key up to the first MISS is a
  HIT. Its HIT keys are then read back (``prepare_load`` -> compare every byte with the
  expected bytes -> ``complete_load``) and, unless told otherwise, the request is finished.
* a *gate* makes a step stop, still holding the lock, after the lookups that started the
  request's first promotion and before ``on_schedule_end`` submits it. The parent can then
  freeze or kill the source and know that the load is issued to a peer that cannot serve it.

The main thread answers commands from the parent over a Pipe (see ``_Node.serve``). Keys are
made in the parent with :func:`tests.vllm_harness.make_key`; this process checks once that it
matches vLLM's ``make_offload_key``. The expected bytes of ``(key, seed)``: a random row drawn
from ``seed`` plus a 64-bit offset derived from the key, so a chunk landing in the wrong slot
or from the wrong key cannot compare equal.
"""

from __future__ import annotations

import glob
import hashlib
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import numpy as np

SCHEDULER_THREAD = "harness-scheduler"
POLL_THREAD = "vllm_offload_tier_poll"
IDLE_TICK_S = 0.001


def shm_paths(engine_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*")


def key_offset(key: bytes, seed: int) -> np.uint64:
    digest = hashlib.sha256(key + seed.to_bytes(8, "little")).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def base_row(seed: int, chunk_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, chunk_bytes // 8, dtype=np.uint64)


@dataclass(eq=False)
class _Request:
    req_id: str
    ctx: Any
    keys: list[bytes]
    seed: int
    deadline: float
    finish: bool
    gate: bool
    started: float = field(default_factory=time.perf_counter)
    pending: list[bool] = field(default_factory=list)
    submits: list[int] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    first_step: int = -1
    gate_reached: threading.Event = field(default_factory=threading.Event)
    gate_open: threading.Event = field(default_factory=threading.Event)
    gate_passed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.keys)
        self.pending, self.submits, self.failed = [False] * n, [0] * n, [False] * n


class _Node:
    def __init__(self, params: dict[str, Any]) -> None:
        from vllm.v1.kv_offload import base as kv_base
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.kv = kv_base
        probe = hashlib.sha256(b"probe").digest()
        from tests.vllm_harness import make_key_from_hash

        assert kv_base.make_offload_key(probe, 0) == make_key_from_hash(probe), "key layout"
        self.engine_id: str = params["engine_id"]
        self.chunk_bytes: int = params["chunk_bytes"]
        self.step_s: float = params["step_s"]
        self.step_mode: str = params["step_mode"]
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("l0",), 0),),
            worker_kv_bytes_per_block=self.chunk_bytes,
            enable_kv_cache_events=False,
            extra_config={
                "cpu_bytes_to_use": params["num_chunks"] * self.chunk_bytes,
                "tier_poll_interval_s": params["poll_interval_s"],
                "secondary_tiers": [dict(params["tier_config"])],
            },
            engine_id=self.engine_id,
            model=OffloadingModelConfig("p2pkv-harness", "float16"),
            cache=OffloadingCacheConfig(16, 1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        )
        t0 = time.perf_counter()
        self.spec = TieringOffloadingSpec(config)
        # Any: the harness reaches into the manager's internals (primary_tier, _jobs) and
        # passes plain bytes as keys, as vLLM's own scheduler code does.
        self.mgr: Any = cast(Any, self.spec.get_manager())
        self.build_s = time.perf_counter() - t0
        view = self.mgr.primary_tier.get_kv_memoryview()
        assert view.strides[0] == self.chunk_bytes, (view.strides, self.chunk_bytes)
        self.rows: np.ndarray | None = np.frombuffer(view, np.uint64).reshape(view.shape[0], -1)
        self.num_chunks = int(view.shape[0])
        self._bases: dict[int, np.ndarray] = {}
        self._cond = threading.Condition()
        self._generation = 0
        self._new: list[_Request] = []
        self._requests: dict[str, _Request] = {}  # active: scanned every step
        self._all: dict[str, _Request] = {}  # every request ever started, for the results
        self._stop = False
        self.steps: list[float] = []  # lock-held seconds per step, gate time excluded
        self._fills = 0
        self._posted = 0  # keys of the fetches p2pkv posted in this process (_probe_fetches)
        self._posted_cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=SCHEDULER_THREAD, daemon=True)
        self._thread.start()

    # -- bytes ------------------------------------------------------------------------------

    def _base(self, seed: int) -> np.ndarray:
        if seed not in self._bases:
            self._bases[seed] = base_row(seed, self.chunk_bytes)
        return self._bases[seed]

    def _rows(self) -> np.ndarray:
        assert self.rows is not None, "node is shut down"
        return self.rows

    # -- the scheduler thread ---------------------------------------------------------------

    def _run(self) -> None:
        step_no = 0
        while True:
            with self._cond:
                if self._stop:
                    return
                active = list(self._requests.values())
                new, self._new = self._new, []
                # Read with the snapshot: a request added during the step below bumps it,
                # so the wait after the step returns at once instead of missing the wake-up.
                seen = self._generation
            gate_wait = 0.0
            with self.mgr.lock:
                t0 = time.perf_counter()
                for req in active:
                    gate_wait += self._scan(req, step_no)
                self.mgr.on_schedule_end(
                    self.kv.ScheduleEndContext(
                        new_req_ids=[r.req_id for r in new], preempted_req_ids=()
                    )
                )
                busy = self.mgr.has_pending_work()
                self.steps.append(time.perf_counter() - t0 - gate_wait)
            step_no += 1
            for req in active:
                if req.gate_reached.is_set():
                    req.gate_passed.set()  # the step that held it has submitted its load
                if req.done.is_set():
                    continue
                if "outcome" in req.result:
                    self._read_back(req)
            self._model_step(busy or bool(active), seen)

    def _model_step(self, busy: bool, seen: int) -> None:
        if self.step_s > 0 and self.step_mode == "spin":
            end = time.perf_counter() + self.step_s
            while time.perf_counter() < end and not self._stop:
                sum(range(1000))
            return
        with self._cond:
            timeout = self.step_s if self.step_s > 0 else (IDLE_TICK_S if busy else None)
            self._cond.wait_for(lambda: self._stop or self._generation != seen, timeout=timeout)

    def _scan(self, req: _Request, step_no: int) -> float:
        """One prefix scan of ``req``; returns the seconds spent held at its gate."""
        lr = self.kv.LookupResult
        deferred, end, promoted = False, len(req.keys), False
        for i, key in enumerate(req.keys):
            result = self.mgr.lookup(key, req.ctx)
            if result is lr.HIT_PENDING:
                deferred = True
                if not req.pending[i]:
                    req.pending[i], promoted = True, True
                    req.submits[i] += 1
                continue
            if req.pending[i] and result is not lr.HIT:
                req.pending[i], req.failed[i] = False, True  # the load failed and was freed
            if result is lr.RETRY:
                deferred = True
            elif result is lr.MISS:
                end = i
                break
        if req.first_step < 0:
            req.first_step = step_no
        waited = 0.0
        if promoted and req.gate and not req.gate_reached.is_set():
            t0 = time.perf_counter()
            req.gate_reached.set()
            req.gate_open.wait(timeout=60.0)
            waited = time.perf_counter() - t0
        timed_out = time.perf_counter() > req.deadline
        if deferred and not timed_out:
            return waited
        outcome = []
        for i in range(len(req.keys)):
            if req.failed[i]:
                outcome.append("failed")  # promoted, then freed: its load failed
            elif i == end:
                outcome.append("miss")
            elif i > end:
                outcome.append("dropped" if req.pending[i] else "unscanned")
            elif deferred:
                outcome.append("timeout")
            else:
                outcome.append("loaded" if req.submits[i] else "local")
        req.result.update(
            outcome=outcome,
            elapsed_s=time.perf_counter() - req.started,
            timed_out=deferred,
            submits=list(req.submits),
            scans=step_no - req.first_step + 1,
        )
        return waited

    def _read_back(self, req: _Request) -> None:
        with self._cond:
            self._requests.pop(req.req_id, None)
        hit = [
            k
            for k, o in zip(req.keys, req.result["outcome"], strict=True)
            if o in ("loaded", "local")
        ]
        matched = [False] * len(req.keys)
        t0 = time.perf_counter()
        if hit:
            with self.mgr.lock:
                spec = self.mgr.prepare_load(hit, req.ctx)
            chunk_ids = [int(c) for c in spec.chunk_ids]
            base, rows = self._base(req.seed), self._rows()
            good = {
                k: bool(np.array_equal(rows[c] - key_offset(k, req.seed), base))
                for k, c in zip(hit, chunk_ids, strict=True)
            }
            matched = [good.get(k, False) for k in req.keys]
            with self.mgr.lock:
                self.mgr.complete_load(hit, req.ctx)
        if req.finish:
            with self.mgr.lock:
                self.mgr.on_request_finished(req.ctx)
        req.result.update(matched=matched, verify_s=time.perf_counter() - t0)
        req.done.set()

    # -- commands (main thread) -------------------------------------------------------------

    def fill(self, keys: list[bytes], seed: int) -> dict[str, Any]:
        """Store ``keys`` in the primary tier the way a GPU store does; bytes from ``seed``."""
        self._fills += 1
        ctx = self.kv.ReqContext(req_id=f"fill-{self._fills}")
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
            out = self.mgr.prepare_store(keys, ctx)
        assert out is not None, "primary tier full"
        base, rows = self._base(seed), self._rows()
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            np.add(base, key_offset(k, seed), out=rows[int(c)])
        with self.mgr.lock:
            self.mgr.complete_store(out.keys_to_store, ctx)
            self.mgr.on_request_finished(ctx)
        return {"stored": len(out.keys_to_store)}

    def start_pull(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """Add requests; all of them are scanned in the same (next) step."""
        reqs = []
        with self.mgr.lock:
            for r in requests:
                host, port = r["source"]
                params = {
                    "remote_kv_source": {
                        "kv_request_id": r["kv_request_id"],
                        "remote_host": host,
                        "remote_port": port,
                    }
                }
                ctx = self.kv.ReqContext(req_id=r["req_id"], kv_transfer_params=params)
                self.mgr.on_new_request(ctx)
                reqs.append(
                    _Request(
                        req_id=r["req_id"],
                        ctx=ctx,
                        keys=list(r["keys"]),
                        seed=r["seed"],
                        deadline=time.perf_counter() + r["timeout_s"],
                        finish=r["finish"],
                        gate=r["gate"],
                    )
                )
        with self._cond:
            for req in reqs:
                self._requests[req.req_id] = req
            self._new.extend(reqs)
            self._generation += 1
            self._cond.notify_all()
            self._all.update((r.req_id, r) for r in reqs)
        return {"steps_before": len(self.steps)}

    def wait_pull(self, req_ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        out = []
        for req_id in req_ids:
            req = self._all[req_id]
            if not req.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"request {req_id} not done after {timeout_s} s\n{self._diagnosis(req)}"
                )
            out.append(dict(req.result, req_id=req_id))
        return out

    def _diagnosis(self, req: _Request) -> str:
        """What a test that timed out needs to tell a stuck step from a request that never
        ends: the request's scan state, the steps taken, and every thread's stack."""
        import sys

        lines = [
            f"result so far: {req.result}",
            f"keys in fetches p2pkv posted (counted once a test asks): {self._posted}",
            f"pending {sum(req.pending)} failed {sum(req.failed)} submits {sum(req.submits)}",
            f"steps {len(self.steps)}, max step {max(self.steps, default=0.0):.4f} s",
        ]
        core = getattr(self.mgr.secondary_tiers[0], "_core", None)  # p2pkv's P2PTier
        if core is not None:
            lines.append(f"tier: {core.debug_state()}")
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines.append(f"--- thread {names.get(ident, ident)}")
            lines.extend(line.rstrip() for line in traceback.format_stack(frame)[-8:])
        return "\n".join(lines)

    def wait_gate(self, req_id: str, timeout_s: float) -> bool:
        return self._all[req_id].gate_reached.wait(timeout_s)

    def open_gate(self, req_id: str, timeout_s: float, posted_keys: int = 0) -> bool:
        """Let the gated step go on; returns once it has called ``on_schedule_end`` and, when
        ``posted_keys`` > 0, once p2pkv has posted fetches for that many more keys: their
        writes may land from then on, so p2pkv must quarantine them if it gives up."""
        req = self._all[req_id]
        deadline = time.monotonic() + timeout_s
        if posted_keys:
            self._probe_fetches()
        with self._posted_cond:
            want = self._posted + posted_keys  # nothing of this load is posted before the gate
        req.gate_open.set()
        if not req.gate_passed.wait(timeout_s):
            return False
        with self._posted_cond:
            return self._posted_cond.wait_for(
                lambda: self._posted >= want, max(0.0, deadline - time.monotonic())
            )

    def _probe_fetches(self) -> None:
        """A test probe (installed once): count the keys of every fetch that p2pkv's
        sessions in this process post, wrapped around ``SessionProtocol.send_fetch`` and
        ``send_fetch_hits`` (a fetch of a round's hits: one key per slot). Once that
        returns, the consumer treats the fetch's writes as possibly landing."""
        from p2pkv.session.protocol import SessionProtocol

        original = SessionProtocol.send_fetch
        original_hits = SessionProtocol.send_fetch_hits
        if getattr(original, "harness_probe", False):
            return

        def posted(n: int) -> None:
            with self._posted_cond:
                self._posted += n
                self._posted_cond.notify_all()

        def send_fetch(proto: Any, req_id: int, keys: Any, slots: Any, **kw: Any) -> None:
            original(proto, req_id, keys, slots, **kw)
            posted(len(keys))

        def send_fetch_hits(proto: Any, req_id: int, slots: Any, **kw: Any) -> None:
            original_hits(proto, req_id, slots, **kw)
            posted(len(slots))

        send_fetch.harness_probe = True  # type: ignore[attr-defined]
        SessionProtocol.send_fetch = send_fetch  # type: ignore[method-assign,assignment]
        SessionProtocol.send_fetch_hits = send_fetch_hits  # type: ignore[method-assign,assignment]

    def finish(self, req_id: str) -> None:
        with self.mgr.lock:
            self.mgr.on_request_finished(self._all[req_id].ctx)

    def reset_cache(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.mgr.lock:
            self.mgr.reset_cache()
            self.mgr.on_reset_flushed()
            jobs = len(self.mgr._jobs)
        return {"reset_s": time.perf_counter() - t0, "jobs": jobs}

    def set_step(self, step_s: float, step_mode: str) -> None:
        with self._cond:
            self.step_s, self.step_mode = step_s, step_mode
            self._generation += 1
            self._cond.notify_all()

    def stats(self, since: int = 0) -> dict[str, Any]:
        with self.mgr.lock:
            jobs = len(self.mgr._jobs)
            pending = self.mgr.has_pending_work()
        steps = self.steps[since:]
        return {
            "steps": len(self.steps),
            "max_step_s": max(steps, default=0.0),
            "jobs": jobs,
            "pending_work": pending,
            "threads": sorted(t.name for t in threading.enumerate()),
            "build_s": self.build_s,
            "num_chunks": self.num_chunks,
        }

    def shutdown(self) -> dict[str, Any]:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.rows = None
        self._bases.clear()
        t0 = time.perf_counter()
        self.mgr.shutdown()
        # Trio's cached idle workers ("Trio thread N", daemons that exit on their own after
        # 10 s idle) belong to no one; every other thread must be gone.
        threads = sorted(
            t.name
            for t in threading.enumerate()
            if t is not threading.main_thread()
            and not (t.daemon and t.name.startswith("Trio thread "))
        )
        return {
            "shutdown_s": time.perf_counter() - t0,
            "threads_left": threads,
            "shm_left": shm_paths(self.engine_id),
        }

    def poll_round_cost(self, rounds: int = 20000) -> dict[str, float]:
        """Microseconds per call of what vLLM's tier-poll thread asks of the secondary tier
        each round (``get_finished_jobs``, ``serve_external_requests``), idle, under the lock."""
        from vllm.v1.kv_offload.tiering.manager import _SecondaryTierFacingParent

        tier = self.mgr.secondary_tiers[0]
        parent = _SecondaryTierFacingParent(self.mgr, 0)
        out: dict[str, float] = {}
        with self.mgr.lock:
            for name, fn in (
                ("get_finished_jobs", tier.get_finished_jobs),
                ("serve_external_requests", lambda: tier.serve_external_requests(parent)),
            ):
                t0 = time.perf_counter()
                for _ in range(rounds):
                    fn()
                out[name] = (time.perf_counter() - t0) / rounds * 1e6
        return out

    def serve(self, conn: Connection) -> None:
        commands: dict[str, Callable[..., Any]] = {
            "fill": self.fill,
            "start_pull": self.start_pull,
            "wait_pull": self.wait_pull,
            "wait_gate": self.wait_gate,
            "open_gate": self.open_gate,
            "diagnose": lambda req_id: self._diagnosis(self._all[req_id]),
            "finish": self.finish,
            "reset_cache": self.reset_cache,
            "set_step": self.set_step,
            "stats": self.stats,
            "thread_cpu": thread_cpu,
            "poll_round_cost": self.poll_round_cost,
        }
        while True:
            try:
                name, kwargs = conn.recv()
            except EOFError:  # the parent is gone: leave nothing behind
                self.shutdown()
                return
            if name == "shutdown":
                conn.send(("ok", self.shutdown()))
                return
            try:
                conn.send(("ok", commands[name](**kwargs)))
            except Exception:
                conn.send(("error", traceback.format_exc()))


def thread_cpu() -> list[dict[str, Any]]:
    """CPU seconds of every thread of this process, from /proc/self/task/*/stat.

    Python thread names are used where the thread is a Python thread (matched by native
    id); other threads (NIXL, UCX, ZMQ) carry the kernel's ``comm``.
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        tid = int(task)
        out.append(
            {
                "tid": tid,
                "name": names.get(tid, comm),
                "python": tid in names,
                "cpu_s": (int(fields[11]) + int(fields[12])) / tick,
            }
        )
    return out


def node_main(conn: Connection, params: dict[str, Any]) -> None:
    """Process entry point: build the node, report, then serve commands until shutdown.
    ``P2PKV_HARNESS_LOG=DEBUG`` (any level name) logs p2pkv to stderr, with thread names."""
    if level := os.environ.get("P2PKV_HARNESS_LOG"):
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(
                "%(relativeCreated)8.1f %(process)d %(threadName)s %(name)s: %(message)s"
            )
        )
        logger = logging.getLogger("p2pkv")
        logger.addHandler(handler)
        logger.setLevel(level)
    try:
        node = _Node(params)
    except Exception:
        for path in shm_paths(params["engine_id"]):
            os.unlink(path)
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid(), "num_chunks": node.num_chunks, "build_s": node.build_s}))
    node.serve(conn)
