"""Local GPU<->host block copies through NIXL: the process's loopback agents.

Theory of operation
-------------------
A host-tier block is staged to or from a GPU region (or between any two local regions) by
**a NIXL agent transferring to itself**: its own name is the "remote" side of every
transfer, so UCX picks cuda_copy (measured on an H200: 0.91-1.0 x torch's own block
copies). Such an agent is created with ``ucx_error_handling_mode: none``, because in mode
``peer`` a self-transfer of GPU memory falls back to emulation. Mode ``none`` has no
dead-peer detection (notes, hazard 7), so a loopback agent **never talks to another
process**: it loads no remote agent and its metadata is never handed out. Loopback agents
live beside the peer-mode agent of :mod:`p2pkv.transport._nixl_agent` (registering the same
memory in both is accepted by NIXL and needed: each agent moves only what it registered).

**Lanes.** What bounds a scattered copy of small blocks is CPU work per descriptor in
UCX cuda_copy, inside ``transfer()`` (H200, 4,096 x 64 KiB in one request: 4.1 us per block
to post, against ~4 us of GPU time per block; 0.79-0.80 x torch's CUDA graph). It is lower
when one UCX worker holds fewer descriptors at once, and it runs in parallel on separate
workers. UCX's own worker threads (``num_threads``) cannot be used: extra workers are not
"self" and break the loopback path. So the process keeps ``L`` *lanes*, each its own
loopback agent (its own UCX worker), and a copy of at least ``2 * MIN_DESCS_PER_LANE``
blocks of at most ``MAX_SPLIT_BLOCK_LEN`` bytes is cut into up to ``L`` parts
(:func:`lane_parts`: consecutive slices of the caller's pair list, so runs of adjacent
blocks stay whole except at a cut), all posted and polled at once: lane 0 by the caller,
the others by the lanes' thread pool (``L - 1`` threads, idle between copies). Measured
(``bench/notes/staging_lanes.py``, 64 KiB): 2-6 lanes 0.96-1.02 x torch both ways; one
agent posting 2/4/8 smaller requests 0.86-0.98 x. ``L``: :data:`STAGING_LANES_ENV`, else
one lane per :data:`CORES_PER_LANE` cores this process may run on, at most
:data:`MAX_AUTO_LANES` (1 on a small machine: exactly one agent, no thread).

Invariants: one set of lanes per process (created on first use, dropped with their threads
when the last region is released); a region is registered **once per lane** however many
callers stage through it (:meth:`LoopbackAgent.attach` counts references per region, keyed
by (address, size)), so a process holds ``L + 1`` agents (the lanes and the peer-mode
agent) and a staged region ``L`` staging registrations; overlapping regions are refused.
Each lane keeps two descriptor lists per attached region over all its blocks, prepared once:
the local side (a source) and the loopback side (a destination).

A host region <-> a *remote* GPU region is two legs, never one: NIXL between processes has
no fast host<->GPU path (cma is host-only and the wheel has no gdrcopy; measured 0.4-0.8
GB/s). Leg one moves VRAM to VRAM between the processes (a node over a GPU region fetches
from its peer over cuda_ipc); leg two stages those slots to or from host memory here.

:meth:`LoopbackAgent.copy` blocks until the copy is done (cuda_copy posts asynchronously;
``check_xfer_state`` both progresses and polls it): call it from a worker thread, never the
Trio thread. It returns only once every part has ended, and raises if any part failed (the
copy is one unit: the caller must treat all its destination slots as unwritten). Thread
sync is STRICT and a whole copy runs under ``lock``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from .errors import TransportError
from .region import device_bytes, host_bytes, is_device_region, region_memory
from .transport._nixl_agent import (
    FORKED,
    block_descs,
    keep_in_child,
    load_nixl,
    nixl_cause,
    refuse_if_forked,
    resolve_parallelism,
)
from .transport._runs import slot_indices

__all__ = [
    "LoopbackAgent",
    "LoopbackRegion",
    "attach_region",
    "lane_parts",
    "loopback_agent_exists",
    "resolve_lanes",
]

_log = logging.getLogger("p2pkv.staging")

STAGING_LANES_ENV = "P2PKV_STAGING_LANES"
CORES_PER_LANE = 4
MAX_AUTO_LANES = 4
# A part gets at least this many blocks: handing a part to a lane's thread costs about as
# much as posting a few blocks.
MIN_DESCS_PER_LANE = 16
# Only blocks up to this size are split: a larger block takes the GPU longer than its post
# takes the CPU (2 MiB: ~3.3 us to post, ~40 us to copy), so lanes gain nothing there and
# cost 2-3 % (H200, 256 MiB scattered: 0.95-0.96 x torch with 2-6 lanes, 0.98 with one).
MAX_SPLIT_BLOCK_LEN = 256 * 1024

Slots = npt.NDArray[np.int32]


def resolve_lanes(requested: int | None = None) -> int:
    """L, the number of loopback agents copying one staging copy (see the module doc)."""
    return resolve_parallelism(
        requested, STAGING_LANES_ENV, CORES_PER_LANE, MAX_AUTO_LANES, "staging lanes", "stage"
    )


def lane_parts(count: int, lanes: int, min_per_lane: int = MIN_DESCS_PER_LANE) -> list[slice]:
    """``count`` pairs cut into at most ``lanes`` consecutive slices of at least
    ``min_per_lane`` pairs each (one slice when there are too few), sizes differing by at
    most one, together covering ``0..count`` exactly once in order."""
    if count < 0 or lanes < 1 or min_per_lane < 1:
        raise ValueError(f"bad split: {count} pairs, {lanes} lanes, {min_per_lane} per lane")
    parts = max(1, min(lanes, count // min_per_lane))
    size, extra = divmod(count, parts)
    out = []
    start = 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out


@attrs.define(eq=False)
class _LaneRegistration:
    """A region as one lane's agent knows it."""

    reg_descs: Any = None
    local_dlist: Any = None  # the region as a source
    loop_dlist: Any = None  # the region as a destination (the lane's own name as the remote)


@attrs.define(eq=False)
class LoopbackRegion:
    """One region attached to the loopback lanes: ``num_blocks`` slots of ``block_len``."""

    agent: LoopbackAgent
    base_addr: int
    num_blocks: int
    block_len: int
    mem_type: str
    device: int
    region: object  # kept alive while registered (notes, hazard 6)
    # Its bytes, viewed in place: holds the buffer's export while registered, so the owner
    # cannot close an mmap, resize a bytearray or a CPU tensor's storage under the lanes.
    view: object = None
    lanes: list[_LaneRegistration] = attrs.Factory(list)  # one per lane, in lane order
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_len

    def release(self) -> None:
        """Drop one reference; the last one deregisters the region from every lane. Once
        that has happened, a further call does nothing, as does a call in a child forked
        from the process that attached it (the child's copy of the lanes is abandoned)."""
        self.agent.detach(self)


def _span(region: object) -> tuple[int, int, object]:
    """(base address, bytes, the view that holds them) of memory to stage, as the store
    takes a region (:mod:`p2pkv.region`): viewed in place, never copied; ValueError for
    memory that is read-only, strided or holds Python objects, TypeError for a non-buffer.
    Never through ``np.asarray``: it copies a ``bytes`` object or a list, and the lanes
    would register the copy, freed at once (writes into freed memory, segfaults)."""
    if is_device_region(region):
        tensor: Any = device_bytes(region)
        return int(tensor.data_ptr()), int(tensor.numel()), tensor
    flat = host_bytes(region)
    return int(flat.ctypes.data), int(flat.nbytes), flat


class _Lane:
    """One loopback agent (its own UCX worker): moves one part of a copy."""

    def __init__(self, api: Any, name: str) -> None:
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.agent: Any = api.nixl_agent(name, config)
        # Mode none: cuda_copy serves self-transfers; mode peer would emulate them.
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})

    def register(self, base: int, nbytes: int, reg: LoopbackRegion) -> _LaneRegistration:
        out = _LaneRegistration()
        try:
            out.reg_descs = self.agent.register_memory(
                [(base, nbytes, reg.device, "")], reg.mem_type
            )
            descs = block_descs(base, reg.num_blocks, reg.block_len, reg.device)
            out.local_dlist = self.agent.prep_xfer_dlist("", descs, reg.mem_type)
            out.loop_dlist = self.agent.prep_xfer_dlist(self.name, descs, reg.mem_type)
        except BaseException:
            self.unregister(out)
            raise
        return out

    def unregister(self, lr: _LaneRegistration) -> None:
        """Undo :meth:`register`, every step even if one fails (NIXL refusing to release
        a list or to deregister is logged): an error here would leave the steps after it,
        and the other lanes' registrations of the region, undone."""
        dlists = (lr.loop_dlist, lr.local_dlist)
        lr.loop_dlist = lr.local_dlist = None
        for dlist in dlists:
            if dlist is not None:
                try:
                    dlist.release()
                except Exception as exc:  # logged without its frames (see nixl_cause)
                    _log.warning(
                        "releasing a staging dlist of %s failed: %r", self.name, nixl_cause(exc)
                    )
        reg_descs, lr.reg_descs = lr.reg_descs, None
        if reg_descs is not None:
            try:
                self.agent.deregister_memory(reg_descs)
            except Exception as exc:
                _log.warning("staging deregistration in %s failed: %r", self.name, nixl_cause(exc))

    def write(
        self, src: _LaneRegistration, s: Slots, dst: _LaneRegistration, d: Slots, deadline: float
    ) -> None:
        """Post one WRITE of the pairs and poll it to the end."""
        agent = self.agent
        xfer = agent.make_prepped_xfer("WRITE", src.local_dlist, s, dst.loop_dlist, d)
        try:
            state = agent.transfer(xfer)
            while state == "PROC":
                if time.monotonic() > deadline:
                    # Bytes may still land: the caller must not reuse dst slots soon.
                    raise TransportError("staging copy not done in time", op="stage")
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransportError(f"staging copy ended {state}", op="stage")
        finally:
            agent.release_xfer_handle(xfer)
            agent = xfer = None  # an error raised here goes on without them (see nixl_cause)


class LoopbackAgent:
    """The process's loopback lanes (see the module docstring). Use :func:`attach_region`."""

    def __init__(self, lanes: int | None = None) -> None:
        count = resolve_lanes(lanes)
        refuse_if_forked("stage")
        api = load_nixl().api
        # The process whose lanes these are: a forked child has copies of them whose
        # loopback endpoints name this process (see _refuse_if_inherited).
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.regions: dict[tuple[int, int], LoopbackRegion] = {}
        prefix = f"p2pkv-loopback-{os.getpid()}-{next(_serial)}"
        self.lanes: list[_Lane] = []
        try:
            for i in range(count):
                self.lanes.append(_Lane(api, f"{prefix}-{i}"))
        except BaseException:
            self.lanes = []
            raise
        # Lane 0 runs in the caller's thread; lanes 1.. each in one thread of this pool.
        self._pool: ThreadPoolExecutor | None = None
        if count > 1:
            self._pool = ThreadPoolExecutor(count - 1, thread_name_prefix="p2pkv-staging")

    def attach(self, region: object, block_len: int) -> LoopbackRegion:
        """Register ``region`` (cut into ``block_len`` slots) once per lane; count a
        reference."""
        self._refuse_if_inherited()
        base, nbytes, view = _span(region)
        if block_len <= 0 or nbytes < block_len:
            raise TransportError(f"region of {nbytes} bytes has no {block_len}-byte block")
        num_blocks = nbytes // block_len
        key = (base, num_blocks * block_len)
        with self.lock:
            got = self.regions.get(key)
            if got is not None:
                if got.block_len != block_len:
                    raise TransportError(
                        f"region already staged with block_len {got.block_len}", op="stage"
                    )
                got.refs += 1
                return got
            for b, n in self.regions:
                if base < b + n and b < base + key[1]:
                    raise TransportError("region overlaps a staged region", op="stage")
            mem_type, device = region_memory(region)
            reg = LoopbackRegion(self, base, num_blocks, block_len, mem_type, device, region, view)
            try:
                for lane in self.lanes:
                    reg.lanes.append(lane.register(base, key[1], reg))
            except Exception as exc:
                self._undo(reg)
                raise TransportError(
                    f"staging registration failed: {exc!r}", op="stage"
                ) from nixl_cause(exc)
            reg.refs = 1
            self.regions[key] = reg
            return reg

    def detach(self, reg: LoopbackRegion) -> None:
        global _agent
        if self.pid != os.getpid():
            return  # a forked child's copy: abandoned, never touched (_abandon_in_child)
        with _agent_lock, self.lock:
            if reg.refs <= 0:
                # Released already: the lanes may hold the same bytes attached anew since
                # (another object under the same key), which this must not drop.
                return
            reg.refs -= 1
            if reg.refs > 0:
                return
            self.regions.pop((reg.base_addr, reg.nbytes), None)
            self._undo(reg)
            if not self.regions and _agent is self:
                _agent = None
                if self._pool is not None:
                    self._pool.shutdown(wait=True)  # no part is in flight: copy holds lock
                    self._pool = None
                self.lanes = []  # the last references: NIXL destroys the agents

    def _undo(self, reg: LoopbackRegion) -> None:
        for lane, lr in zip(self.lanes, reg.lanes, strict=False):
            lane.unregister(lr)
        reg.lanes = []
        reg.region = reg.view = None

    def copy(
        self,
        src: LoopbackRegion,
        src_slots: Sequence[int],
        dst: LoopbackRegion,
        dst_slots: Sequence[int],
        *,
        timeout: float = 30.0,
    ) -> None:
        """Copy block ``src_slots[i]`` of ``src`` into block ``dst_slots[i]`` of ``dst``;
        returns once every byte has landed. Blocking: not on the Trio thread. Within one
        region (``src is dst``) no slot may be both a source and a destination: the
        pairs are copied at once, in no order (``TransportError``)."""
        self._refuse_if_inherited()
        if src.block_len != dst.block_len:
            raise TransportError("source and destination block_len differ", op="stage")
        s = _checked(src_slots, src.num_blocks, "source")
        d = _checked(dst_slots, dst.num_blocks, "destination")
        if len(s) != len(d):
            raise TransportError(f"{len(s)} source and {len(d)} destination slots", op="stage")
        if len(np.unique(d)) != len(d):
            # Which source would land there is up to the lanes' timing.
            raise TransportError("a destination slot is named twice", op="stage")
        if src is dst and np.intersect1d(s, d).size:
            # NIXL merges adjacent pairs into overlapping descriptors and the lanes copy
            # in any order: the blocks would come out smeared (slot i -> i + 1 made every
            # block the first).
            raise TransportError("a slot is both read and written by one copy", op="stage")
        with self.lock:
            # Under the lock: a release between a check outside it and here would leave
            # the region without lanes (an IndexError below).
            if src.agent is not self or dst.agent is not self:
                raise TransportError("region is not attached to this agent", op="stage")
            if src.refs <= 0 or dst.refs <= 0:
                raise TransportError("region was released", op="stage")
            if not len(s):
                return
            deadline = time.monotonic() + timeout
            lanes = len(self.lanes) if src.block_len <= MAX_SPLIT_BLOCK_LEN else 1
            parts = lane_parts(len(s), lanes)
            jobs: list[Callable[[], None]] = [
                _job(lane, src.lanes[i], s[part], dst.lanes[i], d[part], deadline)
                for i, (lane, part) in enumerate(zip(self.lanes, parts, strict=False))
            ]
            run_parts(jobs, self._pool)

    def _refuse_if_inherited(self) -> None:
        """In a child forked from the process that made these lanes: TransportError.
        Their loopback endpoints name the parent's process: a copy here was reported done
        and its bytes landed in the parent's memory, never the child's (measured over
        host memory); and their lock may have been held by a thread the fork left behind."""
        if self.pid != os.getpid():
            raise TransportError(FORKED, op="stage")


def _job(
    lane: _Lane, src: _LaneRegistration, s: Slots, dst: _LaneRegistration, d: Slots, deadline: float
) -> Callable[[], None]:
    return lambda: lane.write(src, s, dst, d, deadline)


class _Part:
    """One job handed to the lane pool, which can be abandoned before it starts: a part
    whose ``submit`` raised may still be queued there (``ThreadPoolExecutor`` queues the
    job before it starts the thread that fails) and would run later, unwaited for."""

    def __init__(self, job: Callable[[], None]) -> None:
        self._job = job
        self._lock = threading.Lock()
        self._started = self._abandoned = False
        self._ended = threading.Event()

    def __call__(self) -> None:
        with self._lock:
            if self._abandoned:
                return
            self._started = True
        try:
            self._job()
        finally:
            self._ended.set()

    def abandon(self) -> None:
        """Make sure the job never starts; if it has, wait for it to end."""
        with self._lock:
            self._abandoned = True
            started = self._started
        if started:
            self._ended.wait()


def run_parts(jobs: Sequence[Callable[[], None]], pool: ThreadPoolExecutor | None) -> None:
    """Run ``jobs[0]`` here and the others on ``pool`` at once; return when every one has
    ended. The first error (in job order) is raised, and only then: no part is still
    running when a copy fails. A part the pool refuses (shut down, e.g. at interpreter
    exit; no thread to be had) fails the copy before ``jobs[0]`` starts, once every part
    already handed over has ended or been stopped from starting."""
    futures: list[Future[None]] = []
    if len(jobs) > 1:
        if pool is None:
            raise TransportError("several parts but no lane threads", op="stage")
        parts = [_Part(job) for job in jobs[1:]]
        try:
            for part in parts:
                futures.append(pool.submit(part))
        except Exception as exc:
            for part in parts:
                part.abandon()
            raise TransportError(
                f"staging copy failed: could not start a lane's part: {exc!r}", op="stage"
            ) from nixl_cause(exc)
    errors: list[BaseException] = []
    try:
        jobs[0]()
    except BaseException as exc:
        errors.append(exc)
    for future in futures:
        failed = future.exception()  # waits for the part to end
        if failed is not None:
            errors.append(failed)
    if not errors:
        return
    first = errors[0]
    del errors, jobs, futures  # no cycle through this frame keeps the lanes' agents
    try:
        if isinstance(first, TransportError) or not isinstance(first, Exception):
            raise first
        raise TransportError(f"staging copy failed: {first!r}", op="stage") from nixl_cause(first)
    finally:
        del first


def _checked(slots: Sequence[int], num_blocks: int, side: str) -> Slots:
    """``slots`` as int32, checked as every data plane checks them: a float, a string or
    a nested list is refused, never truncated, parsed or flattened."""
    return slot_indices(slots, num_blocks, side, "stage").astype(np.int32)


_serial = itertools.count()  # agent names stay unique when lanes are re-created
_agent_lock = threading.Lock()  # taken before LoopbackAgent.lock
_agent: LoopbackAgent | None = None


def _abandon_in_child() -> None:
    """A forked child never tears down the parent's lanes (see ``_nixl_agent.FORKED``)."""
    global _agent, _agent_lock
    _agent_lock = threading.Lock()  # another thread of the parent may have held it
    if _agent is not None:
        keep_in_child(_agent)
        _agent = None


os.register_at_fork(after_in_child=_abandon_in_child)


def loopback_agent_exists() -> bool:
    """True while the process's loopback lanes live (some region is attached)."""
    with _agent_lock:
        return _agent is not None


def attach_region(region: object, block_len: int) -> LoopbackRegion:
    """Attach ``region`` (host or GPU memory; a torch tensor, NumPy array or buffer) to the
    process's loopback lanes, creating them on first use; :meth:`LoopbackRegion.release`
    when done."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = LoopbackAgent()
        return _agent.attach(region, block_len)
