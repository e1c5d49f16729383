"""The NIXL import shim and the process-wide registry of shared agents.

Theory of operation
-------------------
Invariant: **in one process, a memory region is registered with NIXL exactly once.** Every
:class:`~p2pkv.transport.nixl.NixlTransport` over a region (the one a reconfiguration builds
to replace the last one included) gets the same :class:`SharedAgent` from
:func:`acquire_agent`, keyed by the region's (base address, size). The first acquire creates
the agent, registers the region and prepares the local descriptor list over every block; the
last :meth:`SharedAgent.release_ref` deregisters it and drops the agent. References are
counted explicitly by the transports (``close()``, or a ``weakref.finalize`` at exit), never
left to ``__del__``. Overlapping regions are refused: NIXL itself would accept them (notes,
hazard 9).

The agent is made the way ``notes/nixl.md`` says it must be: thread sync STRICT (NONE
segfaults with several threads), no progress thread (the wrapper's runs with a poll delay of
0 and burns a core), UCX with error handling mode ``peer`` (dead peers surface as errors,
not hangs). NIXL is imported lazily, through :func:`load_nixl`, so ``import p2pkv`` stays
free of it (and of torch).

Remote agents are per NIXL agent, not per transport, so the table of live registrations
(``live``: agent name -> :class:`PeerRegistration`) lives here too, under ``call_lock``.

**Remote agents are parked, not removed** (notes, hazard 10). NIXL 1.5.1 never closes the
UCX socket of a removed remote agent while that agent lives: every
``add_remote_agent``/``remove_remote_agent`` cycle with a live peer left one socket open on
each side until one of the two agents was destroyed (measured: 1 fd per side per cycle over
1,000 cycles; UCX keepalive settings change nothing). So ``loaded`` mirrors NIXL's own
table of remote agents (name -> the exact metadata bytes it was loaded from), and releasing
the live registration of a name *parks* it: it stays loaded, with no registration and no
dlist (nothing can be posted to it), and a later registration of the same name with
byte-identical metadata (the same incarnation) reuses it without a NIXL call. Different
metadata (a restart) removes it first; a peer seen dead is removed, not parked. At most
``max_parked`` names are parked; beyond that the longest-parked one is removed, which costs
one socket per side for as long as that agent lives (upstream limit; a dead agent's socket
is closed by UCX once it sees the disconnect).

**GPU regions.** The region's memory type and device come from the region itself
(:func:`p2pkv.region.region_memory`: ``"VRAM"`` and the tensor's device index for a torch
CUDA tensor, ``"DRAM"`` and 0 otherwise); the same rules hold (one agent, one registration,
across reconfigurations). A remote peer's memory type and device are not in the hello: they
are read from its agent metadata once it is loaded (:meth:`SharedAgent.remote_memory` asks
NIXL which (type, device) covers the peer's whole region). Between two processes on one
GPU host, VRAM to VRAM goes over UCX cuda_ipc, zero-copy for WRITE; READ is zero-copy only
with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` (UCX turns it off without NVLink), so an agent
over VRAM sets it (``GPU_ENV_DEFAULTS``) unless the user did. Two agents in one process
never move VRAM fast (UCX emulates over tcp), so a process has one peer-mode agent per
region and local GPU<->host copies go through :mod:`p2pkv.staging`'s loopback agent.

A registration's name is read from the metadata bytes (:func:`metadata_agent_name`)
*before* NIXL sees them: ``add_remote_agent`` with metadata naming an agent that is already
loaded replaces that agent's entry, so a check after the call would come too late.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import importlib
import importlib.machinery
import importlib.util
import logging
import logging.config
import os
import sys
import threading
import weakref
from types import ModuleType
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ..errors import TransportError
from ..region import region_memory
from .base import RegionLayout

_log = logging.getLogger("p2pkv.transport.nixl")


def nixl_cause(exc: BaseException) -> BaseException:
    """``exc``, raised inside NIXL, without its traceback: what p2pkv chains or keeps.

    The traceback's frames hold the NIXL agent and its transfer handles (for the same
    reason p2pkv logs NIXL's errors through it, never with ``exc_info``: a handler may
    keep the record, its arguments and so the frames). An exception kept
    in a reference cycle (a failed transfer that records its cause, a caller that stores
    the error it caught) would keep the native agent alive after its teardown, until some
    later garbage collection destroyed it and its UCX worker at a random point: purging a
    write that was still queued to a dead peer there crashed a test run with SIGSEGV
    (docs/design.md, "The agent dies at its teardown")."""
    return exc.with_traceback(None)


# Set before the first agent exists, and only where the user has not set them (notes: env).
# Not UCX_NET_DEVICES: the environment is the whole process's, and ``lo`` there would keep
# every UCX user in it (a node talking to other hosts, vLLM's own NIXL connector) on
# loopback. Tests and the CLI choose it (``cli.set_env_defaults``: ``lo`` on loopback).
ENV_DEFAULTS = {
    "UCX_MEM_MMAP_HOOK_MODE": "none",  # first agent: 0.43 s -> 16-40 ms
    "NIXL_LOG_LEVEL": "WARN",  # nixl's Python logger prints INFO to stdout otherwise
    # UCX's debug signal: left at its default (SIGHUP), UCX's first agent puts a native
    # handler of its own on SIGHUP, in place of the host's (Python's among them), for good.
    "UCX_DEBUG_SIGNO": "0",
}
# Set before an agent over VRAM creates its UCX backend (UCX reads its environment then),
# where the user has not set them; not earlier: without CUDA, UCX warns about them.
GPU_ENV_DEFAULTS = {
    # GPU<-GPU READ over cuda_ipc is zero-copy only with this (WRITE always is).
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
}
# Extra UCX backend parameters for an agent over VRAM (e.g. {"num_threads": "4"}); empty by
# default. Never for host memory or the loopback agent (extra workers break self-transfers).
GPU_BACKEND_PARAMS: dict[str, str] = {}
# Copy threads (issue 9): UCX's cma path copies with one process_vm_writev per descriptor in
# the thread that calls transfer() (~4.5-5 GB/s). With K > 1 the UCX backend of an agent over
# host memory gets K dedicated workers (``num_threads``) and splits every transfer of at least
# ``SPLIT_DESCS_PER_THREAD * K`` descriptors into K parts copied in parallel; transfer()
# returns once every part was posted, and the one handle settles only when all parts have.
# K: the ``copy_threads`` argument, else this environment variable, else one per
# ``CORES_PER_COPY_THREAD`` cores this process may run on, at least ``MIN_AUTO_COPY_THREADS``
# where it may run on that many, at most ``MAX_AUTO_COPY_THREADS`` (measured on 16 idle
# cores: 4.2-4.9 GB/s with one thread, 10-15 with 4, 20 with 8; on 2 cores, fetch / bare
# one-thread NIXL 1.30-1.33 x at 64 KiB and 1.45-1.51 x at 2 MiB with 2, 0.82 / 0.95 with 1).
COPY_THREADS_ENV = "P2PKV_NIXL_COPY_THREADS"
CORES_PER_COPY_THREAD = 2
MIN_AUTO_COPY_THREADS = 2
MAX_AUTO_COPY_THREADS = 8
# The most workers of a kind a caller or the environment may ask for: each is an OS thread
# (copy threads) or a loopback agent with its own registrations (staging lanes), and past
# the cores there is nothing to gain, so a typo such as 1000 is refused instead of started.
MAX_PARALLELISM = 64
SPLIT_DESCS_PER_THREAD = 4
# With copy threads, runs are posted as pieces of at most this many bytes: a descriptor of
# 16 MiB or more copies at single-thread speed even when split (measured: 4-5 GB/s with 8
# threads), 1-2 MiB pieces at 11-20 GB/s.
MAX_PIECE_BYTES = 2 << 20
# Devices probed for a peer's VRAM region (its own CUDA index, which may exceed ours).
MAX_REMOTE_DEVICES = 64
# cu13, then cu12, then the meta package: bare ``import nixl`` imports torch (2 s).
_CANDIDATES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
# Departed remote agents kept loaded for reuse, per agent (the node's default peer cap).
MAX_PARKED = 64
# NIXL's serialisation (serdes): an intro, then records "tag" + size_t length (native byte
# order) + value + "|". Agent metadata opens with the record tagged "Agent": the name.
_METADATA_NAME_TAG = b"nixlSerDes|Agent"
_SIZE_T = 8


@attrs.frozen
class NixlBinding:
    """The NIXL Python API that was found, and its exception types."""

    module_name: str
    api: ModuleType
    remote_disconnect_error: type[BaseException] | None

    def is_remote_disconnect(self, exc: BaseException) -> bool:
        cls = self.remote_disconnect_error
        return cls is not None and isinstance(exc, cls)


_load_lock = threading.Lock()
_binding: NixlBinding | None = None


def load_nixl() -> NixlBinding:
    """Import NIXL once (cheapest module first) after setting the environment defaults."""
    global _binding
    with _load_lock:
        if _binding is not None:
            return _binding
        for key, value in ENV_DEFAULTS.items():
            if key not in os.environ:
                os.environ[key] = value
        # nixl's logging setup switches logging.raiseExceptions off process-wide; keep ours.
        raise_exceptions = logging.raiseExceptions
        failures: list[str] = []
        try:
            for name in _CANDIDATES:
                try:
                    _preconfigure_nixl_logging(name.partition(".")[0])
                    api = importlib.import_module(name)
                except ImportError as exc:
                    failures.append(f"{name}: {exc}")
                    continue
                bindings = getattr(api, "nixlBind", None)
                disconnect = getattr(bindings, "nixlRemoteDisconnectError", None)
                _binding = NixlBinding(name, api, disconnect)
                return _binding
        finally:
            logging.raiseExceptions = raise_exceptions
        raise TransportError(
            "NIXL is not installed (pip install nixl-cu13==1.5.1; on CPU machines install a "
            "CPU torch first or use --no-deps): " + "; ".join(failures),
            op="import",
        )


def _preconfigure_nixl_logging(package: str) -> None:
    """Do NIXL's logging set-up for it, without what it does to the host's logging.

    ``<package>.logging.setup_logging`` (run as NIXL's API module loads) configures the
    ``nixl`` logger with ``logging.config.dictConfig``, which also closes every handler the
    host already has (a log file opened with mode 'w' drops every later record, a
    MemoryHandler loses its target) and turns back on every logger the host turned off.
    So, before the package loads, its logging module is loaded here on its own, the loggers
    of its ``LOGGING_CONFIG`` are configured one by one as dictConfig would (a handler on
    stdout, no propagation), its ``set_log_level_by_env`` applies ``NIXL_LOG_LEVEL``, and
    its set-up is marked done, so it never runs. A NIXL whose logging module is not shaped
    like that (another version), or a package already loaded, is left to itself."""
    name = f"{package}.logging"
    if package in sys.modules or name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(package)  # finds the package; does not run it
        locations = None if spec is None else spec.submodule_search_locations
        sub = None if not locations else importlib.machinery.PathFinder.find_spec(name, locations)
        if sub is None or sub.loader is None:
            return
        module = importlib.util.module_from_spec(sub)
        sys.modules[name] = module
        try:
            sub.loader.exec_module(module)
            config = getattr(module, "LOGGING_CONFIG", None)
            by_env = getattr(module, "set_log_level_by_env", None)
            if getattr(module, "_logging_configured", None) is not False:
                raise LookupError("no _logging_configured flag")
            if not isinstance(config, dict) or not callable(by_env):
                raise LookupError("no LOGGING_CONFIG or set_log_level_by_env")
            conf = logging.config.DictConfigurator(copy.deepcopy(config))
            formatters: Any = conf.config.get("formatters", {})
            for key in list(formatters):
                formatters[key] = conf.configure_formatter(formatters[key])
            handlers: Any = conf.config.get("handlers", {})
            for key in list(handlers):
                handler = conf.configure_handler(handlers[key])
                handler.name = key
                handlers[key] = handler
            loggers: Any = conf.config.get("loggers", {})
            for key in list(loggers):
                conf.configure_logger(key, loggers[key])
            by_env(logging.getLogger("nixl"))
            vars(module)["_logging_configured"] = True
        except BaseException:
            sys.modules.pop(name, None)  # the package's own import loads it afresh
            raise
    except Exception as exc:  # NIXL then sets its logging up itself, as it would anyway
        _log.debug("NIXL's logging set-up left to NIXL (%s): %r", package, exc)


def resolve_parallelism(
    requested: int | None,
    env: str,
    cores_each: int,
    most: int,
    what: str,
    op: str,
    *,
    least: int = 1,
) -> int:
    """How many workers of a kind: ``requested``, else the ``env`` variable, else one per
    ``cores_each`` cores this process may run on (at least ``least`` but never more than
    those cores, at least 1, at most ``most``). TransportError for a value that is not a
    number from 1 to ``MAX_PARALLELISM``."""
    if requested is None:
        text = os.environ.get(env, "").strip()
        if text:
            try:
                requested = int(text)
            except ValueError:
                raise TransportError(f"{env}={text!r} is not a number", op=op) from None
    if requested is None:
        cores = len(os.sched_getaffinity(0))
        return max(1, min(least, cores), min(most, cores // cores_each))
    if not 1 <= requested <= MAX_PARALLELISM:
        raise TransportError(f"{what} must be 1..{MAX_PARALLELISM}, got {requested}", op=op)
    return requested


def resolve_copy_threads(requested: int | None = None) -> int:
    """K, the number of threads copying one transfer (see ``COPY_THREADS_ENV``)."""
    return resolve_parallelism(
        requested,
        COPY_THREADS_ENV,
        CORES_PER_COPY_THREAD,
        MAX_AUTO_COPY_THREADS,
        "copy threads",
        "create",
        least=MIN_AUTO_COPY_THREADS,
    )


def metadata_agent_name(metadata: bytes) -> str | None:
    """The agent name NIXL will read from ``metadata``, or None if it cannot tell.

    Follows NIXL 1.5.1's deserialiser (the intro, the "Agent" tag, a size_t length, the
    name, "|") and is stricter where that one is lenient (a length running past the end, a
    missing separator, an empty or non-UTF-8 name): anything this accepts, NIXL reads as
    the same name.
    """
    start = len(_METADATA_NAME_TAG)
    if not metadata.startswith(_METADATA_NAME_TAG) or len(metadata) < start + _SIZE_T:
        return None
    length = int.from_bytes(metadata[start : start + _SIZE_T], sys.byteorder)
    begin = start + _SIZE_T
    end = begin + length
    if not 0 < length <= len(metadata) - begin - 1 or metadata[end : end + 1] != b"|":
        return None
    try:
        return metadata[begin:end].decode("utf-8")
    except UnicodeDecodeError:
        return None


def block_descs(
    base_addr: int, num_blocks: int, block_len: int, device: int = 0
) -> npt.NDArray[np.uint64]:
    """One (addr, len, dev) row per block: the Nx3 uint64 form is 10x faster than tuples."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_len)
    descs[:, 0] += np.uint64(base_addr)
    descs[:, 1] = block_len
    descs[:, 2] = device
    return descs


@attrs.define(eq=False)
class _Registry:
    lock: threading.Lock = attrs.Factory(threading.Lock)
    agents: dict[tuple[int, int], SharedAgent] = attrs.Factory(dict)


_registry = _Registry()

# Forks. A child forked while one of its parent's NIXL agents lived has a copy of that
# agent's memory but none of its threads, and UCX is not fork-safe: destroying the copy
# (the transport's finalizer at the child's exit) crashes the child with SIGSEGV, and a
# new agent in the child connects and then never completes a transfer. So the child
# abandons every inherited agent (never destroyed: kept referenced for good) and refuses
# to create NIXL agents of its own, saying why. A child of a parent with no live agent (none
# yet, or all closed) is not affected.
_forked_live = False
# Bound in the parent: a child must not import or dlopen anything (another thread of the
# parent may have held the loader's lock at the fork).
_py_incref = ctypes.pythonapi.Py_IncRef

FORKED = (
    "this process was forked while its parent had a live NIXL agent, and UCX is not "
    "fork-safe: start worker processes with the 'spawn' (or 'forkserver') method, or "
    "start the parent's nodes after the fork"
)


def keep_in_child(obj: object) -> None:
    """In a child just forked: never let ``obj`` (a copy of a parent's NIXL object) be
    destroyed, not even at interpreter exit, and refuse new NIXL agents here."""
    global _forked_live
    _forked_live = True
    _py_incref(ctypes.py_object(obj))


def refuse_if_forked(op: str, name: str | None = None) -> None:
    if _forked_live:
        raise TransportError(FORKED, peer=name, op=op)


def _abandon_in_child() -> None:
    global _load_lock
    _registry.lock = threading.Lock()  # another thread of the parent may have held it
    _load_lock = threading.Lock()  # so may one loading NIXL (an import of up to seconds)
    for shared in _registry.agents.values():
        keep_in_child(shared)
    _registry.agents.clear()


os.register_at_fork(after_in_child=_abandon_in_child)


@attrs.define(eq=False)
class PeerRegistration:
    """One ``add_remote_peer``: a remote agent name and a remote dlist over all its blocks.

    ``stale``: a later registration of the same name replaced this one (no new posts).
    ``released``: ``remove_remote_peer`` was called. Either way the dlist is released at
    once: NIXL copies descriptors into each transfer, so in-flight writes do not need it.
    Changed only under ``SharedAgent.call_lock``.
    """

    agent_name: str
    layout: RegionLayout
    metadata: bytes
    dlist: Any
    owner: object
    mem_type: str = "DRAM"  # the peer's region: NIXL memory type and device
    device: int = 0
    stale: bool = False
    released: bool = False

    @property
    def usable(self) -> bool:
        return not (self.stale or self.released)


class SharedAgent:
    """One NIXL agent over one registered region. Create through :func:`acquire_agent`.

    ``call_lock`` is held around every NIXL call and every change of ``live``. Threads that
    may block (registration, posting, release) take it; ``poll``/``progress`` (the Trio
    thread) only *try* it, so they never wait behind a copy that ``transfer()`` is doing
    (STRICT would make them wait inside NIXL). The posting thread refreshes ``pending``
    handles itself, so completions are seen even while posts run back to back.
    """

    def __init__(
        self,
        binding: NixlBinding,
        name: str,
        layout: RegionLayout,
        region: object,
        copy_threads: int = 1,
    ):
        self.binding = binding
        self.name = name
        self.layout = layout
        self._region = region  # keep it mapped while the agent lives (notes, hazard 6)
        self.mem_type, self.device = region_memory(region)
        self._log = _log
        self.registry = _registry
        self.refs = 0
        self.registered = False
        self.call_lock = threading.RLock()
        # Guards ``dead`` and ``pending``; held for microseconds, never across NIXL calls.
        self.lock = threading.Lock()
        self.live: dict[str, PeerRegistration] = {}
        # NIXL's remote agents as loaded (name -> metadata); parked: loaded, not live, oldest
        # first. Both under ``call_lock``.
        self.loaded: dict[str, bytes] = {}
        self.parked: dict[str, None] = {}
        self.max_parked = MAX_PARKED
        self.dead: set[str] = set()  # loaded agents a transfer saw disconnect
        self.pending: set[Any] = set()  # posted transfers (NixlXfer) still PROC
        self.leaked: list[Any] = []  # xfer handles whose release failed; retried at teardown
        self.native: weakref.ref[Any] | None = None  # the native agent, once torn down
        api = binding.api
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        agent = api.nixl_agent(name, config)
        self.agent: Any = agent
        self.local_dlist: Any = None
        self._reg_descs: Any = None
        if self.mem_type == "VRAM":
            for key, value in GPU_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        params = {"ucx_error_handling_mode": "peer"}
        if self.mem_type == "VRAM":
            params.update(GPU_BACKEND_PARAMS)
        # Host memory only: VRAM moves over cuda_ipc (GPU_BACKEND_PARAMS tunes that).
        self.copy_threads = copy_threads if self.mem_type == "DRAM" else 1
        # A transfer of at least this many descriptors is split between the copy threads.
        self.split_descs = SPLIT_DESCS_PER_THREAD * self.copy_threads
        if self.copy_threads > 1:
            params["num_threads"] = str(self.copy_threads)
            params["split_batch_size"] = str(self.split_descs)
        try:
            agent.create_backend("UCX", params)
            self._reg_descs = agent.register_memory(
                [(layout.base_addr, layout.nbytes, self.device, "")], self.mem_type
            )
            self.registered = True
            descs = block_descs(layout.base_addr, layout.num_blocks, layout.block_len, self.device)
            self.local_dlist = agent.prep_xfer_dlist("", descs, self.mem_type)
            self.metadata = bytes(agent.get_agent_metadata())  # fixed: nothing else registers
        except BaseException:
            self.teardown()
            raise

    def remote_memory(self, name: str, layout: RegionLayout) -> tuple[str, int] | None:
        """(memory type, device) under which loaded remote agent ``name`` registered the
        whole of ``layout``'s region, or None. Caller holds ``call_lock``."""
        candidates = [("DRAM", 0)] + [("VRAM", d) for d in range(MAX_REMOTE_DEVICES)]
        for mem_type, device in candidates:
            descs = self.agent.get_xfer_descs([(layout.base_addr, layout.nbytes, device)], mem_type)
            if self.agent.check_remote_metadata(name, descs):
                return mem_type, device
        return None

    def is_dead(self, name: str) -> bool:
        with self.lock:
            return name in self.dead

    def set_dead(self, name: str, dead: bool) -> None:
        """Mark ``name`` seen dead (or not). Only a loaded remote agent is marked: the
        set names loaded agents only (:meth:`unload` forgets a name), so it is bounded
        by them, not by every peer id ever seen to die. Caller holds ``call_lock``."""
        with self.lock:
            if dead and name in self.loaded:
                self.dead.add(name)
            elif not dead:
                self.dead.discard(name)

    def reusable(self, name: str, metadata: bytes) -> bool:
        """True if NIXL holds remote agent ``name`` loaded from exactly ``metadata`` and no
        transfer has seen it dead. Caller holds ``call_lock``."""
        return self.loaded.get(name) == metadata and not self.is_dead(name)

    def load(self, name: str, metadata: bytes) -> None:
        """Load ``metadata`` (already checked to name ``name``) as remote agent ``name``,
        removing a different incarnation of it first. Caller holds ``call_lock``.

        Raises whatever NIXL raises; ``name`` is then not loaded.
        """
        if name in self.loaded:
            self.unload(name)
        try:
            got = self.agent.add_remote_agent(metadata)
        except Exception:
            try:  # NIXL may keep what it loaded before failing; drop it (only `name`)
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # logged without its frames (see nixl_cause)
                self._log.debug("nothing of %s was loaded: %r", name, nixl_cause(exc))
            raise
        got_name = got.decode() if isinstance(got, bytes) else str(got)
        if got_name != name:  # metadata_agent_name disagrees with this NIXL build
            self._log.error("NIXL loaded agent %r from metadata read as %r", got_name, name)
            raise ValueError(f"NIXL read the metadata as agent {got_name!r}")
        self.loaded[name] = metadata
        self.parked.pop(name, None)

    def unload(self, name: str) -> None:
        """Remove remote agent ``name`` from NIXL (its dlists die: hazard 5)."""
        with self.call_lock:
            self.loaded.pop(name, None)
            self.parked.pop(name, None)
            self.set_dead(name, False)  # a later load of the name is a new connection
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:
                self._log.warning("remove_remote_agent(%s) failed: %r", name, nixl_cause(exc))

    def park(self, name: str) -> None:
        """``name`` has no live registration any more: keep it loaded for reuse (see the
        module docstring), unless it was seen dead; evict the longest-parked beyond the cap."""
        with self.call_lock:
            if name not in self.loaded or name in self.live:
                return
            if self.is_dead(name):
                self.unload(name)
                return
            self.parked.pop(name, None)
            self.parked[name] = None
            while len(self.parked) > self.max_parked:
                self.unload(next(iter(self.parked)))

    def drop_registration(self, reg: PeerRegistration, *, stale: bool) -> None:
        """Mark ``reg`` stale or released and release its dlist; if it was the live
        registration of its name and is being released, park the remote agent."""
        with self.call_lock:
            was_live = self.live.get(reg.agent_name) is reg
            if was_live:
                del self.live[reg.agent_name]
            if stale:
                reg.stale = True
            else:
                reg.released = True
            dlist, reg.dlist = reg.dlist, None
            self.release_dlist(dlist)
            if was_live and not stale:
                self.park(reg.agent_name)

    def release_dlist(self, dlist: Any) -> None:
        if dlist is None:
            return
        with self.call_lock:
            try:
                dlist.release()
            except Exception as exc:
                self._log.warning(
                    "releasing a NIXL dlist of %s failed: %r", self.name, nixl_cause(exc)
                )

    def release_xfer(self, xfer: Any) -> None:
        """Release a NIXL transfer handle; one NIXL refuses is kept for a retry at teardown."""
        with self.call_lock:
            try:
                self.agent.release_xfer_handle(xfer)
            except Exception as exc:
                self._log.warning("releasing a NIXL transfer handle failed: %r", nixl_cause(exc))
                self.leaked.append(xfer)

    def teardown(self) -> None:
        """Undo everything in reverse order. Safe on a half-built agent and at exit."""
        with self.call_lock:
            agent, self.agent = self.agent, None
            if agent is None:
                return
            log = self._log
            for reg in list(self.live.values()):
                self.release_dlist(reg.dlist)
                reg.dlist = None
            self.live.clear()
            for name in list(self.loaded):
                try:
                    agent.remove_remote_agent(name)
                except Exception as exc:
                    log.warning("remove_remote_agent(%s) failed: %r", name, nixl_cause(exc))
            self.loaded.clear()
            self.parked.clear()
            self.release_dlist(self.local_dlist)
            self.local_dlist = None
            for handle in self.leaked:
                try:
                    handle.release()
                except Exception as exc:
                    log.warning(
                        "a leaked NIXL transfer handle stays unreleased: %r", nixl_cause(exc)
                    )
            self.leaked.clear()
            if self._reg_descs is not None and self.registered:
                try:
                    agent.deregister_memory(self._reg_descs)
                except Exception as exc:
                    log.warning("deregister_memory of %s failed: %r", self.name, nixl_cause(exc))
            self.registered = False
            self._reg_descs = None
            self._region = None
            try:  # the native agent inside NIXL's wrapper (an internal of nixl 1.5.1)
                self.native = weakref.ref(agent.agent)
            except Exception:
                self.native = None
            del agent  # the last reference: NIXL destroys the agent (and its UCX worker) here

    def outlived(self) -> bool:
        """After :meth:`teardown`: the native NIXL agent is still alive (something else
        holds it or one of its handles)."""
        native = self.native
        return native is not None and native() is not None


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def acquire_agent(
    binding: NixlBinding, name: str, layout: RegionLayout, region: object, copy_threads: int = 1
) -> SharedAgent:
    """Return the shared agent over ``layout``'s region (created on first use), ref counted.

    ``copy_threads`` applies when the agent is created; a later acquire shares it as it is.
    """
    refuse_if_forked("create", name)
    key = (layout.base_addr, layout.nbytes)
    with _registry.lock:
        shared = _registry.agents.get(key)
        if shared is not None:
            if shared.name != name:
                raise TransportError(
                    f"region {key[0]:#x}+{key[1]} already has NIXL agent {shared.name!r}; "
                    "one region, one agent, one name",
                    peer=name,
                    op="create",
                )
            if shared.layout != layout:
                raise TransportError(
                    f"region already shared with layout {shared.layout}, not {layout}",
                    peer=name,
                    op="create",
                )
            shared.refs += 1
            return shared
        for other_key, other in _registry.agents.items():
            if other.name == name:
                raise TransportError(
                    f"NIXL agent name {name!r} already used for another region",
                    peer=name,
                    op="create",
                )
            if _overlaps(key, other_key):
                raise TransportError(
                    f"region {key[0]:#x}+{key[1]} overlaps the region of agent {other.name!r}",
                    peer=name,
                    op="create",
                )
        try:
            shared = SharedAgent(binding, name, layout, region, copy_threads)
        except Exception as exc:
            raise TransportError(
                f"creating the NIXL agent failed: {exc!r}", peer=name, op="create"
            ) from nixl_cause(exc)
        shared.refs = 1
        _registry.agents[key] = shared
        return shared


def release_ref(shared: SharedAgent) -> None:
    """Drop one reference; the last one deregisters the region and drops the agent.

    Reaches the registry through ``shared`` (not a module global), so it also works from a
    finaliser late in interpreter shutdown.
    """
    registry = shared.registry
    with registry.lock:
        shared.refs -= 1
        if shared.refs > 0:
            return
        key = (shared.layout.base_addr, shared.layout.nbytes)
        if registry.agents.get(key) is shared:
            del registry.agents[key]
        # Torn down under the lock: a new transport over the region waits for it, so the
        # region is never registered twice, not even for a moment.
        shared.teardown()
    if shared.outlived():
        # Held by garbage, most likely: an exception's frames in a reference cycle (p2pkv
        # means to keep none, see nixl_cause; a caller may). Collect it now, outside the
        # lock (a collection runs finalisers, and a transport's finaliser takes it), so the
        # agent dies here, before the caller frees its region, not in some later
        # collection. (Inside a finaliser that a collection runs, a nested collection
        # does nothing: the warning below may then precede the agent's end in that same
        # collection.)
        gc.collect()
        if shared.outlived():
            shared._log.warning(
                "NIXL agent %s outlives its teardown: something still holds it or one of "
                "its transfer handles; it is destroyed when that lets go",
                shared.name,
            )


def registry_counts() -> tuple[int, int]:
    """(live agents, registered regions) of NIXL in this process."""
    with _registry.lock:
        agents = list(_registry.agents.values())
    return len(agents), sum(1 for a in agents if a.registered)
