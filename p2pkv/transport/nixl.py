"""The NIXL data plane: :class:`NixlTransport`.

Theory of operation
-------------------
Every transport over a region shares that region's one NIXL agent
(:mod:`._nixl_agent`): thread sync STRICT, no progress thread, UCX error mode ``peer``.
Nothing here polls on its own, so **both ends must make progress**: the initiator through
:meth:`~NixlTransport.poll`, the *target* of writes through :meth:`~NixlTransport.progress`.
Measured: over tcp a write stays ``PROC`` for as long as the target does not progress; over
the default path (cma) the first write after a registration does (the wire-up needs the
target), later ones complete without it.

Locks, outermost first: ``NixlXfer.lock`` (one handle: a release never races a
``check_xfer_state`` on it), ``SharedAgent.call_lock`` (around every NIXL call and every
change of the remote-agent table), then ``_State.lock`` / ``SharedAgent.lock`` (bookkeeping,
microseconds). Worker threads take them blocking; ``poll``/``progress``, which the engine
calls on the Trio thread, only try them and report ``PROC`` / do nothing when busy: under
STRICT a ``transfer()`` doing a cma copy holds NIXL's lock for the whole copy (hazard 3),
and a Trio thread waiting for it would stall (measured: 0.76 s behind 256 MiB posts). The
posting thread re-checks every pending transfer after each post, so completions are seen
even while posts run back to back. The engine's thread releases a settled handle with
``release_nowait``, which tries both locks and leaves a busy release to a worker thread.
``_State.ops`` counts calls using the agent; ``close()``
waits for them, so the agent is never dropped under a caller. (With every NIXL call under
``call_lock``, STRICT is belt and braces: it still covers NIXL's own ``__del__`` releases.)

Registrations (:class:`PeerRegistration`, the ``native`` of a :class:`RemotePeer`): one
live registration per remote agent name per NIXL agent. A registration for name X reads X
from the metadata bytes before NIXL sees them and refuses metadata naming anything else, so
it never replaces, marks stale or removes another name's registration or remote agent. A
re-add makes the old registration of X stale (no new posts). If the metadata is
byte-identical (same remote incarnation) the remote agent is not removed, so the old
registration's in-flight writes (e.g. an old transport's, during a reconfiguration) still
complete; otherwise it is removed first and its dlists die (``notes/nixl.md``, hazard 5).
Every registration prepares its own dlist. A released registration's remote agent is parked
(kept loaded, unusable) for reuse by the same incarnation: NIXL leaks a socket per remove
(:mod:`._nixl_agent`).

Coalescing and copy threads (issue 9): a post names blocks by index into two prepared
dlists, one descriptor per block; ``make_prepped_xfer`` merges index pairs that are
adjacent in the list and contiguous on both sides into one descriptor, so a run of blocks
becomes one copy (UCX's cma path then makes one ``process_vm_writev`` per 512 KiB instead of
one per block; strace: 1,024 contiguous 64 KiB blocks, 132 calls instead of 1,028). Posts
order their pairs by local slot (:mod:`._runs`) so that every run is adjacent.

With K copy threads (:func:`._nixl_agent.resolve_copy_threads`; host memory only) NIXL's
UCX backend splits a transfer of at least ``split_descs`` (4 K) descriptors into K parts by
descriptor count and copies them in parallel, under the one handle: the handle is DONE only
when every part is, ERR (the whole transfer failed, its destination quarantined by the
caller as always) if any part failed. A post of at least ``split_descs`` blocks that holds
runs is posted with explicit descriptors (``initialize_xfer``) instead of NIXL's merge: its
runs cut into pieces of at most ``MAX_PIECE_BYTES`` (or one block, if larger) and at least
``split_descs`` pieces in all, so every part gets work (a merged run is one descriptor,
copied by one thread, and descriptors of 16 MiB or more stay at one thread's speed even
when split). Pieces never leave a run, and runs are made only of slots already checked
against both regions. With K = 1 nothing changes: prepared dlists, NIXL merging.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ..errors import PeerDisconnected, RegistrationFailed, TransportError
from ._nixl_agent import (
    MAX_PIECE_BYTES,
    PeerRegistration,
    SharedAgent,
    acquire_agent,
    block_descs,
    keep_in_child,
    load_nixl,
    metadata_agent_name,
    nixl_cause,
    registry_counts,
    release_ref,
    resolve_copy_threads,
)
from ._progress import TargetProgress
from ._runs import contiguous_runs, run_order, slot_indices, split_runs
from .base import (
    DataTransport,
    RegionLayout,
    RemotePeer,
    TransferHandle,
    TransferState,
    TransportStatistics,
)

__all__ = ["NixlTransport", "NixlXfer"]

_log = logging.getLogger("p2pkv.transport.nixl")
_CLOSE_WAIT_S = 30.0


@attrs.define(eq=False)
class NixlXfer:
    """``TransferHandle.native``: the NIXL handle and, once it failed, why (``cause``)."""

    xfer: Any
    registration: PeerRegistration
    owner: _State
    state: TransferState = TransferState.PROC
    cause: BaseException | None = None
    lock: threading.Lock = attrs.Factory(threading.Lock)


@attrs.define(eq=False)
class _State:
    """Everything a transport owns; the finaliser closes it without the transport object."""

    agent_name: str
    layout: RegionLayout
    shared: SharedAgent
    lock: threading.Lock = attrs.Factory(threading.Lock)
    idle: threading.Condition = attrs.field(init=False)
    closing: bool = False
    ops: int = 0
    peers: dict[PeerRegistration, RemotePeer] = attrs.Factory(dict)
    handles: dict[NixlXfer, TransferHandle] = attrs.Factory(dict)
    post_cpu: float = 0.0  # thread CPU inside transfer(); written under the agent's call_lock
    target: TargetProgress = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)
        self.target = TargetProgress(
            functools.partial(_progress, self), f"p2pkv-progress-{self.agent_name}"
        )

    def enter(self) -> bool:
        with self.lock:
            if self.closing:
                return False
            self.ops += 1
            return True

    def enter_or_raise(self, op: str, peer: str | None = None) -> SharedAgent:
        if not self.enter():
            raise TransportError("the NIXL transport is closed", peer=peer, op=op)
        return self.shared

    def exit(self) -> None:
        with self.lock:
            self.ops -= 1
            if self.closing and not self.ops:
                self.idle.notify_all()


def _region_span(region: object) -> tuple[int, int]:
    """(address, size) of a numpy array, CPU or CUDA torch tensor, array-interface or
    buffer."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(region, torch.Tensor):
        if region.device.type not in ("cpu", "cuda") or not region.is_contiguous():
            raise TransportError("the region must be a contiguous CPU or CUDA tensor", op="create")
        return int(region.data_ptr()), int(region.numel() * region.element_size())
    try:
        array = region if isinstance(region, np.ndarray) else np.asarray(region)
    except Exception as exc:
        raise TransportError(f"cannot find the address of {region!r}", op="create") from exc
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise TransportError("the region must be contiguous and writeable", op="create")
    return int(array.ctypes.data), int(array.nbytes)


def _layout_problem(layout: RegionLayout, ours: RegionLayout | None) -> str | None:
    if layout.num_blocks <= 0 or layout.block_len <= 0:
        return f"unusable layout {layout}: no blocks"
    if layout.base_addr < 0 or layout.base_addr + layout.nbytes >= 1 << 64:
        return f"unusable layout {layout}: address out of range"
    if ours is not None and layout.block_len != ours.block_len:
        return f"block_len {layout.block_len} differs from ours ({ours.block_len})"
    return None


def _run_descs(
    layout: RegionLayout, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], device: int
) -> npt.NDArray[np.uint64]:
    """One (addr, len, dev) row per run of ``lengths`` blocks from slot ``starts``."""
    descs = np.empty((starts.size, 3), dtype=np.uint64)
    descs[:, 0] = starts.astype(np.uint64) * np.uint64(layout.block_len)
    descs[:, 0] += np.uint64(layout.base_addr)
    descs[:, 1] = lengths.astype(np.uint64) * np.uint64(layout.block_len)
    descs[:, 2] = device
    return descs


def _remove_peer(st: _State, reg: PeerRegistration, peer: RemotePeer) -> bool:
    shared = st.shared
    with shared.call_lock:
        if reg.released:
            return False
        peer.released = True
        shared.drop_registration(reg, stale=False)
    with st.lock:
        st.peers.pop(reg, None)
    return True


def _check(shared: SharedAgent, native: NixlXfer) -> TransferState:
    """Ask NIXL about one transfer; caller holds ``native.lock`` and ``shared.call_lock``."""
    if native.xfer is None or native.state is not TransferState.PROC:
        return native.state
    name = native.registration.agent_name
    try:
        status = shared.agent.check_xfer_state(native.xfer)
    except Exception as exc:
        if shared.binding.is_remote_disconnect(exc):
            shared.set_dead(name, True)
            native.cause = PeerDisconnected(f"peer disconnected: {exc!r}", peer=name, op="poll")
        else:
            native.cause = TransportError(f"transfer failed: {exc!r}", peer=name, op="poll")
        native.cause.__cause__ = nixl_cause(exc)  # kept: no frames (they hold the agent)
        status = "ERR"
    if status == "DONE":
        native.state = TransferState.DONE
    elif status == "ERR":
        native.state = TransferState.ERR
        if native.cause is None:
            native.cause = TransportError("NIXL reported ERR", peer=name, op="poll")
    if native.state is not TransferState.PROC:
        with shared.lock:
            shared.pending.discard(native)
    return native.state


def _refresh_pending(shared: SharedAgent) -> None:
    """Under ``call_lock``: update every pending transfer nobody else is looking at."""
    with shared.lock:
        pending = list(shared.pending)
    for native in pending:
        if native.lock.acquire(blocking=False):
            try:
                _check(shared, native)
            finally:
                native.lock.release()


def _release_handle(st: _State, handle: TransferHandle, *, wait: bool = True) -> bool:
    """Release ``handle``; False (nothing done) if ``wait`` is off and its lock or the
    agent's ``call_lock`` is taken (a post's copy holds the latter). The locks are tried in
    their order, the handle's first."""
    native = handle.native
    shared = st.shared
    if not native.lock.acquire(blocking=wait):
        return False
    try:
        if handle.released:
            return True
        if not shared.call_lock.acquire(blocking=wait):
            return False
        try:
            handle.released = True
            xfer, native.xfer = native.xfer, None
            if native.state is TransferState.PROC:
                native.state = TransferState.ERR
                native.cause = TransportError(
                    "released before completion", peer=handle.peer.agent_name, op="release"
                )
            with shared.lock:
                shared.pending.discard(native)
            if xfer is not None:
                shared.release_xfer(xfer)
        finally:
            shared.call_lock.release()
    finally:
        native.lock.release()
    with st.lock:
        st.handles.pop(native, None)
    return True


def _progress(st: _State) -> bool:
    """Progress the agent's UCX worker (the target side of writes too) unless a thread is
    inside NIXL already (it progresses the worker itself). False once ``st`` is closing."""
    if not st.enter():
        return False
    try:
        shared = st.shared
        if not shared.call_lock.acquire(blocking=False):
            return True
        try:
            shared.agent.get_new_notifs()
        except Exception as exc:  # logged without its frames (see nixl_cause)
            _log.debug("NIXL progress failed: %r", nixl_cause(exc))
        finally:
            shared.call_lock.release()
        return True
    finally:
        st.exit()


# The thread running a garbage collection now, else None (``gc.callbacks``).
_collecting: int | None = None


def _note_collection(phase: str, _info: dict[str, int]) -> None:
    global _collecting
    _collecting = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_note_collection)


def _shutdown(st: _State) -> None:
    """Close ``st`` once: handles, then registrations, then our reference on the agent.

    Runs from ``close()`` or from ``weakref.finalize`` (garbage collection, or at exit while
    module globals still exist; finalize never runs later than that). A collection on the
    progress thread, inside one of its steps (an op it holds), hands the shutdown to a
    thread of its own: here it would wait for its own op to end. So does any collection:
    an allocation starts one anywhere, e.g. while a thread makes an agent under the agent
    registry's lock, which this shutdown takes (it waited there for its own thread).
    """
    if st.target.is_current() or _collecting == threading.get_ident():
        threading.Thread(target=_shutdown, args=(st,), name="p2pkv-close", daemon=True).start()
        return
    try:
        with st.lock:
            if st.closing:
                return
            st.closing = True
            if not st.idle.wait_for(lambda: st.ops == 0, timeout=_CLOSE_WAIT_S):
                # Dropping the agent under a running call could crash; leaking it cannot.
                _log.error("NIXL transport %s: calls still running, agent kept", st.agent_name)
                return
            handles = list(st.handles.values())
            peers = list(st.peers.items())
        st.target.stop()  # its next step would find us closing; it is not inside one now
        for handle in handles:
            _release_handle(st, handle)
        for reg, peer in peers:
            _remove_peer(st, reg, peer)
        release_ref(st.shared)
    except Exception:
        _log.exception("closing NIXL transport %s failed", st.agent_name)


def _abandon_in_child() -> None:
    """A forked child never closes the parent's transports: their agents are copies whose
    threads are not here (see ``_nixl_agent.FORKED``)."""
    for transport in list(_transports):
        if transport._finalizer.detach() is not None:  # still open in the parent
            keep_in_child(transport._state)
    _transports.clear()


class NixlTransport(DataTransport):
    """Moves blocks over NIXL. Create with :meth:`create`; see the module docstring."""

    kind = "nixl"

    def __init__(self, state: _State) -> None:
        self._state = state
        self._finalizer = weakref.finalize(self, _shutdown, state)
        _transports.add(self)

    @classmethod
    def create(
        cls,
        *,
        agent_name: str,
        region: object,
        layout: RegionLayout,
        copy_threads: int | None = None,
    ) -> NixlTransport:
        """A transport over ``region`` (``layout.base_addr`` must be its byte 0).

        Blocking (first call: NIXL import and agent creation, ~0.1-0.3 s). Takes over the
        region's existing agent if one lives in this process (it must have the same name).
        ``copy_threads``: threads copying one transfer (None: ``P2PKV_NIXL_COPY_THREADS``,
        else from the cores this process may use); used when the agent is created.
        """
        problem = _layout_problem(layout, None)
        if problem is not None:
            raise TransportError(problem, peer=agent_name, op="create")
        base, nbytes = _region_span(region)
        if base != layout.base_addr or nbytes < layout.nbytes:
            raise TransportError(
                f"region {base:#x}+{nbytes} does not hold layout {layout}",
                peer=agent_name,
                op="create",
            )
        threads = resolve_copy_threads(copy_threads)
        shared = acquire_agent(load_nixl(), agent_name, layout, region, threads)
        try:
            return cls(_State(agent_name, layout, shared))
        except BaseException:
            release_ref(shared)
            raise

    def __repr__(self) -> str:
        st = self._state
        return f"<NixlTransport {st.agent_name!r} closed={st.closing} peers={len(st.peers)}>"

    @property
    def agent_name(self) -> str:
        return self._state.agent_name

    @property
    def layout(self) -> RegionLayout:
        return self._state.layout

    def metadata(self) -> bytes:
        st = self._state
        shared = st.enter_or_raise("metadata")
        st.exit()
        return shared.metadata

    def add_remote_peer(self, agent_name: str, metadata: bytes, layout: RegionLayout) -> RemotePeer:
        st = self._state
        problem = _layout_problem(layout, st.layout)
        if problem is not None:
            raise RegistrationFailed(problem, peer=agent_name, op="add_remote_peer")
        shared = st.enter_or_raise("add_remote_peer", agent_name)
        try:
            reg = self._register(shared, agent_name, bytes(metadata), layout)
            peer = RemotePeer(agent_name=agent_name, layout=layout, native=reg)
            with st.lock:
                st.peers[reg] = peer
            return peer
        finally:
            st.exit()

    def _register(
        self,
        shared: SharedAgent,
        name: str,
        metadata: bytes,
        layout: RegionLayout,
    ) -> PeerRegistration:
        """Register ``name``; touches no other name's registration or remote agent."""
        named = metadata_agent_name(metadata)
        if named is None:
            problem = "it is not NIXL agent metadata"
        elif named != name:
            problem = f"it names agent {named!r}"
        elif name == shared.name:
            problem = "it is our own agent's"
        else:
            problem = None
        if problem is not None:
            raise RegistrationFailed(
                f"metadata refused: {problem}", peer=name, op="add_remote_peer"
            )
        with shared.call_lock:
            old = shared.live.get(name)
            reuse = shared.reusable(name, metadata)
            if not reuse:
                if old is not None:  # another incarnation: its dlist dies with the agent
                    shared.drop_registration(old, stale=True)
                    old = None
                try:
                    shared.load(name, metadata)
                except Exception as exc:
                    raise RegistrationFailed(
                        f"NIXL refused the metadata: {exc!r}", peer=name, op="add_remote_peer"
                    ) from nixl_cause(exc)
            try:
                # The peer's memory type and device: read from its metadata (VRAM or DRAM).
                mem_type, device = shared.remote_memory(name, layout) or ("DRAM", 0)
                descs = block_descs(layout.base_addr, layout.num_blocks, layout.block_len, device)
                dlist = shared.agent.prep_xfer_dlist(name, descs, mem_type)
            except Exception as exc:
                if old is None:
                    shared.unload(name)
                raise RegistrationFailed(
                    f"preparing the peer's blocks failed: {exc!r}", peer=name, op="add_remote_peer"
                ) from nixl_cause(exc)
            if old is not None:  # same incarnation: its in-flight writes still complete
                shared.drop_registration(old, stale=True)
            reg = PeerRegistration(
                name, layout, metadata, dlist, owner=self._state, mem_type=mem_type, device=device
            )
            shared.live[name] = reg
            shared.parked.pop(name, None)
            shared.set_dead(name, False)
            return reg

    def _own(self, peer: RemotePeer, op: str) -> PeerRegistration:
        reg = peer.native
        if not isinstance(reg, PeerRegistration) or reg.owner is not self._state:
            raise TransportError(
                "peer was not registered by this transport", peer=peer.agent_name, op=op
            )
        return reg

    def remove_remote_peer(self, peer: RemotePeer) -> None:
        reg = self._own(peer, "remove_remote_peer")
        st = self._state
        if peer.released or not st.enter():
            return  # already released, or close() is releasing it
        try:
            _remove_peer(st, reg, peer)
        finally:
            st.exit()

    def release_departed_peers(self, current_members: Collection[str]) -> list[str]:
        members = set(current_members)
        st = self._state
        st.enter_or_raise("release_departed_peers")
        try:
            with st.lock:
                departed = [(r, p) for r, p in st.peers.items() if r.agent_name not in members]
            names: list[str] = []
            for reg, peer in departed:
                if _remove_peer(st, reg, peer) and reg.agent_name not in names:
                    names.append(reg.agent_name)
            return names
        finally:
            st.exit()

    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        reg = self._own(peer, "post_write")
        st = self._state
        local = slot_indices(local_slots, st.layout.num_blocks, "local", "post_write")
        remote = slot_indices(remote_slots, reg.layout.num_blocks, "remote", "post_write")
        if len(local) != len(remote) or not len(local):
            raise TransportError(
                f"{len(local)} local and {len(remote)} remote slots",
                peer=peer.agent_name,
                op="post_write",
            )
        shared = st.enter_or_raise("post_write", peer.agent_name)
        try:
            if type(local_slots) is list and type(remote_slots) is list:  # ints (checked)
                handle = TransferHandle(peer, tuple(local_slots), tuple(remote_slots))
            else:
                handle = TransferHandle(peer, tuple(local.tolist()), tuple(remote.tolist()))
            ordered_local, ordered_remote = run_order(local, remote)
            native = self._post(shared, peer, reg, ordered_local, ordered_remote)
            handle.native = native
            with st.lock:
                st.handles[native] = handle
            return handle
        finally:
            st.exit()

    def _post(
        self,
        shared: SharedAgent,
        peer: RemotePeer,
        reg: PeerRegistration,
        local: npt.NDArray[np.int64],
        remote: npt.NDArray[np.int64],
    ) -> NixlXfer:
        name = reg.agent_name
        pieces = self._pieces(shared, reg, local, remote)
        with shared.call_lock:
            if peer.released or not reg.usable:
                raise TransportError(
                    "registration is stale or released", peer=name, op="post_write"
                )
            agent = shared.agent
            xfer = None
            try:
                if pieces is None:
                    xfer = agent.make_prepped_xfer(
                        "WRITE",
                        shared.local_dlist,
                        local.astype(np.int32),
                        reg.dlist,
                        remote.astype(np.int32),
                    )
                else:
                    local_descs = agent.get_xfer_descs(pieces[0], shared.mem_type)
                    remote_descs = agent.get_xfer_descs(pieces[1], reg.mem_type)
                    xfer = agent.initialize_xfer("WRITE", local_descs, remote_descs, name)
                cpu0 = time.thread_time()
                try:
                    status = agent.transfer(xfer)
                finally:
                    self._state.post_cpu += time.thread_time() - cpu0
            except Exception as exc:
                if xfer is not None:
                    shared.release_xfer(xfer)
                # This frame goes with the error to whoever catches it: not the agent.
                agent = xfer = local_descs = remote_descs = None
                if shared.binding.is_remote_disconnect(exc):
                    shared.set_dead(name, True)
                    raise PeerDisconnected(
                        f"peer disconnected: {exc!r}", peer=name, op="post_write"
                    ) from nixl_cause(exc)
                raise TransportError(
                    f"NIXL refused the write: {exc!r}", peer=name, op="post_write"
                ) from nixl_cause(exc)
            if status == "ERR":
                shared.release_xfer(xfer)
                agent = xfer = None  # as above
                raise TransportError("NIXL reported ERR at post", peer=name, op="post_write")
            if status == "DONE":
                return NixlXfer(xfer, reg, self._state, state=TransferState.DONE)
            native = NixlXfer(xfer, reg, self._state)
            with shared.lock:
                shared.pending.add(native)
            _refresh_pending(shared)  # polls on the Trio thread may have found us busy
            return native

    def _pieces(
        self,
        shared: SharedAgent,
        reg: PeerRegistration,
        local: npt.NDArray[np.int64],
        remote: npt.NDArray[np.int64],
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None:
        """Explicit (local, remote) descriptors for a post that NIXL splits between the copy
        threads and that holds runs (NIXL would merge each into one descriptor); else None."""
        split = shared.split_descs
        if shared.copy_threads < 2 or local.size < split:
            return None
        starts_l, starts_r, lengths = contiguous_runs(local, remote)
        if lengths.size == local.size:
            return None  # no run: the prepared per-block dlists serve as they are
        ours, theirs = self._state.layout, reg.layout
        max_len = max(1, min(local.size // split, MAX_PIECE_BYTES // ours.block_len))
        starts_l, starts_r, lengths = split_runs(starts_l, starts_r, lengths, max_len)
        return (
            _run_descs(ours, starts_l, lengths, shared.device),
            _run_descs(theirs, starts_r, lengths, reg.device),
        )

    def poll(self, handle: TransferHandle) -> TransferState:
        native = handle.native
        st = self._state
        if not isinstance(native, NixlXfer) or native.owner is not st:
            return TransferState.ERR
        if native.state is not TransferState.PROC:
            return native.state
        if not st.enter():
            return TransferState.ERR if handle.released else TransferState.PROC
        try:
            shared = st.shared
            if not native.lock.acquire(blocking=False):
                return TransferState.PROC  # being released
            try:
                if not shared.call_lock.acquire(blocking=False):
                    return TransferState.PROC  # another thread is inside NIXL (a copy?)
                try:
                    return _check(shared, native)
                finally:
                    shared.call_lock.release()
            finally:
                native.lock.release()
        finally:
            st.exit()

    def failure(self, handle: TransferHandle) -> BaseException | None:
        """Why ``handle`` is ``ERR`` (``PeerDisconnected`` if the peer died), else None."""
        native = handle.native
        return native.cause if isinstance(native, NixlXfer) else None

    def is_peer_dead(self, agent_name: str) -> bool:
        """True once a transfer to ``agent_name`` saw it disconnect (until it is re-added,
        or its remote agent is removed: releasing a dead peer's registration removes it)."""
        return self._state.shared.is_dead(agent_name)

    def release(self, handle: TransferHandle) -> None:
        self._release(handle, wait=True)

    def release_nowait(self, handle: TransferHandle) -> bool:
        return self._release(handle, wait=False)

    def _release(self, handle: TransferHandle, *, wait: bool) -> bool:
        native = handle.native
        st = self._state
        if handle.released:
            return True
        if not isinstance(native, NixlXfer) or native.owner is not st:
            raise TransportError("handle was not posted by this transport", op="release")
        if not st.enter():
            return True  # close() is releasing it
        try:
            return _release_handle(st, handle, wait=wait)
        finally:
            st.exit()

    def progress(self) -> None:
        _progress(self._state)

    def hold_target_progress(self) -> bool:
        """The transport's progress thread (:mod:`._progress`) drives the target side while
        held: the engine's thread sleeps through a fetch's copy instead of waking for each
        progress step."""
        return self._state.target.hold()

    def release_target_progress(self) -> None:
        self._state.target.release()

    def statistics(self) -> TransportStatistics:
        agents, regions = registry_counts()
        st = self._state
        with st.lock:
            peers = sum(1 for reg in st.peers if reg.usable)
            handles = len(st.handles)
        parked = len(st.shared.parked)  # a size read: safe without call_lock
        return TransportStatistics(
            self.kind,
            st.agent_name,
            agents,
            regions,
            peers,
            handles,
            parked,
            st.post_cpu,
            st.target.ticks,
        )

    def close(self) -> None:
        """Release this transport's handles and registrations and its share of the agent.

        Idempotent. Waits for calls still using the agent in other threads.
        """
        self._finalizer()


_transports: weakref.WeakSet[NixlTransport] = weakref.WeakSet()
os.register_at_fork(after_in_child=_abandon_in_child)
