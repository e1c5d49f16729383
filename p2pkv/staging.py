"""Local GPU<->host block copies through NIXL: the process's one loopback agent.

Theory of operation
-------------------
A host-tier block is staged to or from a GPU region (or between any two local regions) by
**one NIXL agent transferring to itself**: its own name is the "remote" side of every
transfer, so UCX picks cuda_copy (measured on an H200: 0.91-1.0 x torch's own block
copies). That agent is created with ``ucx_error_handling_mode: none``, because in mode
``peer`` a self-transfer of GPU memory falls back to emulation. Mode ``none`` has no
dead-peer detection (notes, hazard 7), so this agent **never talks to another process**:
it loads no remote agent and its metadata is never handed out. It lives beside the
peer-mode agent of :mod:`p2pkv.transport._nixl_agent` (registering the same memory in both
is accepted by NIXL and needed: each agent moves only what it registered itself).

Invariants, as for the peer-mode agent: one loopback agent per process (created on first
use, dropped when its last region is released); a region is registered with it exactly
once however many callers stage through it (:meth:`LoopbackAgent.attach` counts references
per region, keyed by (address, size)); overlapping regions are refused. Each attached region
carries two descriptor lists over all its blocks, prepared once: the local side (a source)
and the loopback side (a destination).

A host region <-> a *remote* GPU region is two legs, never one: NIXL between processes has
no fast host<->GPU path (cma is host-only and the wheel has no gdrcopy; measured 0.4-0.8
GB/s). Leg one moves VRAM to VRAM between the processes (a node over a GPU region fetches
from its peer over cuda_ipc); leg two stages those slots to or from host memory here.

:meth:`LoopbackAgent.copy` blocks until the copy is done (cuda_copy posts asynchronously;
``check_xfer_state`` both progresses and polls it): call it from a worker thread, never the
Trio thread. Thread sync is STRICT and every call is also under ``lock``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from .errors import TransportError
from .region import region_memory
from .transport._nixl_agent import block_descs, load_nixl

__all__ = ["LoopbackAgent", "LoopbackRegion", "attach_region", "loopback_agent_exists"]


@attrs.define(eq=False)
class LoopbackRegion:
    """One region attached to the loopback agent: ``num_blocks`` slots of ``block_len``."""

    agent: LoopbackAgent
    base_addr: int
    num_blocks: int
    block_len: int
    mem_type: str
    device: int
    region: object  # kept alive while registered (notes, hazard 6)
    reg_descs: Any = None
    local_dlist: Any = None  # this region as a source
    loop_dlist: Any = None  # this region as a destination (our own name as the remote)
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_len

    def release(self) -> None:
        """Drop one reference; the last one deregisters the region."""
        self.agent.detach(self)


def _span(region: object) -> tuple[int, int]:
    if hasattr(region, "data_ptr"):
        tensor: Any = region
        if not tensor.is_contiguous():
            raise TransportError("a staged region must be contiguous", op="stage")
        return int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size())
    array = region if isinstance(region, np.ndarray) else np.asarray(region)
    if not array.flags.c_contiguous:
        raise TransportError("a staged region must be contiguous", op="stage")
    return int(array.ctypes.data), int(array.nbytes)


class LoopbackAgent:
    """The process's loopback agent (see the module docstring). Use :func:`attach_region`."""

    def __init__(self) -> None:
        binding = load_nixl()
        api = binding.api
        self.lock = threading.RLock()
        self.regions: dict[tuple[int, int], LoopbackRegion] = {}
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = f"p2pkv-loopback-{os.getpid()}"
        self.agent: Any = api.nixl_agent(self.name, config)
        try:
            # Mode none: cuda_copy serves self-transfers; mode peer would emulate them.
            self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        except BaseException:
            self.agent = None
            raise

    def attach(self, region: object, block_len: int) -> LoopbackRegion:
        """Register ``region`` (cut into ``block_len`` slots) once; count a reference."""
        base, nbytes = _span(region)
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
            reg = LoopbackRegion(self, base, num_blocks, block_len, mem_type, device, region)
            agent = self.agent
            try:
                reg.reg_descs = agent.register_memory([(base, key[1], device, "")], mem_type)
                descs = block_descs(base, num_blocks, block_len, device)
                reg.local_dlist = agent.prep_xfer_dlist("", descs, mem_type)
                reg.loop_dlist = agent.prep_xfer_dlist(self.name, descs, mem_type)
            except Exception as exc:
                self._undo(reg)
                raise TransportError(f"staging registration failed: {exc!r}", op="stage") from exc
            reg.refs = 1
            self.regions[key] = reg
            return reg

    def detach(self, reg: LoopbackRegion) -> None:
        global _agent
        with _agent_lock, self.lock:
            reg.refs -= 1
            if reg.refs > 0:
                return
            self.regions.pop((reg.base_addr, reg.nbytes), None)
            self._undo(reg)
            if not self.regions and _agent is self:
                _agent = None
                self.agent = None  # the last reference: NIXL destroys the agent

    def _undo(self, reg: LoopbackRegion) -> None:
        for dlist in (reg.loop_dlist, reg.local_dlist):
            if dlist is not None:
                dlist.release()
        reg.loop_dlist = reg.local_dlist = None
        if reg.reg_descs is not None:
            self.agent.deregister_memory(reg.reg_descs)
            reg.reg_descs = None
        reg.region = None

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
        returns once every byte has landed. Blocking: not on the Trio thread."""
        if src.agent is not self or dst.agent is not self:
            raise TransportError("region is not attached to this agent", op="stage")
        if src.block_len != dst.block_len:
            raise TransportError("source and destination block_len differ", op="stage")
        if src.refs <= 0 or dst.refs <= 0:
            raise TransportError("region was released", op="stage")
        s = _checked(src_slots, src.num_blocks, "source")
        d = _checked(dst_slots, dst.num_blocks, "destination")
        if len(s) != len(d):
            raise TransportError(f"{len(s)} source and {len(d)} destination slots", op="stage")
        if not len(s):
            return
        with self.lock:
            agent = self.agent
            xfer = agent.make_prepped_xfer("WRITE", src.local_dlist, s, dst.loop_dlist, d)
            try:
                state = agent.transfer(xfer)
                deadline = time.monotonic() + timeout
                while state == "PROC":
                    if time.monotonic() > deadline:
                        # Bytes may still land: the caller must not reuse dst slots soon.
                        raise TransportError(f"staging copy not done in {timeout} s", op="stage")
                    state = agent.check_xfer_state(xfer)
                if state != "DONE":
                    raise TransportError(f"staging copy ended {state}", op="stage")
            finally:
                agent.release_xfer_handle(xfer)


def _checked(slots: Sequence[int], num_blocks: int, side: str) -> Any:
    array = np.asarray(slots, dtype=np.int64).reshape(-1)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= num_blocks):
        raise TransportError(f"{side} slot out of range 0..{num_blocks - 1}", op="stage")
    return array.astype(np.int32)


_agent_lock = threading.Lock()  # taken before LoopbackAgent.lock
_agent: LoopbackAgent | None = None


def loopback_agent_exists() -> bool:
    """True while the process's loopback agent lives (some region is attached)."""
    with _agent_lock:
        return _agent is not None


def attach_region(region: object, block_len: int) -> LoopbackRegion:
    """Attach ``region`` (host or GPU memory; a torch tensor, NumPy array or buffer) to the
    process's loopback agent, creating it on first use; :meth:`LoopbackRegion.release`
    when done."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = LoopbackAgent()
        return _agent.attach(region, block_len)
