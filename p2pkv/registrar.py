"""Peer registration off the Trio thread, with a generation guard.

Theory of operation
-------------------
Registering a peer's memory with the data plane (``add_remote_peer``: NIXL's
``add_remote_agent`` plus preparing a descriptor list over every remote block) blocks and
can be slow. It must never run on the Trio thread, and it must never leak: a peer can be
reaped (its session closed) or come back with a new epoch while its registration is still
running in a worker thread.

One executor task, owned by the node's nursery, takes jobs ``(agent name, generation)``
from a channel and runs them one at a time in a worker thread (:func:`to_thread`) on a
dedicated ``CapacityLimiter(1)``. The thread is *not* abandonable: when the executor is cancelled it
still gets the registration's result back, and Trio raises ``Cancelled`` only at the next
checkpoint. Between getting the result and that checkpoint the executor decides, with no
checkpoint in between, whether to **publish** (the job's generation is still the agent
name's current generation) or **release** (the peer was retired or re-registered
meanwhile: ``remove_remote_peer`` runs in a shielded thread call). Sessions only *wait*
for a job's outcome, so a reaped session goes away at once and the executor cleans up.

Every registration therefore ends exactly one way: published and later retired, released
as stale, or failed with nothing left registered (invariant 4).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import trio

from .errors import RegistrationFailed, SessionClosed
from .transport.base import DataTransport, RegionLayout, RemotePeer

if TYPE_CHECKING:
    import outcome  # trio's own dependency; only its type is named here

log = logging.getLogger("p2pkv.registrar")
T = TypeVar("T")


class Offload(Protocol):
    """How blocking data-plane calls leave the Trio thread (:func:`to_thread`).

    Tests on Trio's autojump clock inject a Trio-native fake instead (labelled as such),
    because virtual time jumps past real threads.
    """

    def __call__(
        self, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter
    ) -> Awaitable[T]: ...


@trio.lowlevel.enable_ki_protection
async def to_thread(fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter) -> T:
    """The real offload: ``fn(*args)`` in one of Trio's cached worker threads, holding
    ``limiter``; never abandoned on cancel. A caller cancelled while the thread runs waits
    for it, gets its result, and sees ``Cancelled`` at its next checkpoint (as with
    ``trio.to_thread.run_sync``, ``abandon_on_cancel=False``).

    Built on ``trio.lowlevel.start_thread_soon`` because ``trio.to_thread.run_sync`` takes a
    trip through the scheduler to acquire even a free limiter, and copies the context and
    names the thread on every call: a round trip to a worker thread cost the process 100 us
    of CPU that way and 59 here (2-core VM, ``docs/design.md``, "Offloads"). Nothing run
    here may call ``trio.from_thread`` (nothing does: these are blocking NIXL and store
    calls). Each call runs in a fresh, empty context (not a copy of the caller's), in a
    worker thread named "Trio thread N" whatever it runs."""
    await trio.lowlevel.checkpoint_if_cancelled()
    borrower = object()  # per call, as Trio's own: the task may hold the limiter already
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def back_in_trio(result: outcome.Outcome[T]) -> None:
        limiter.release_on_behalf_of(borrower)
        trio.lowlevel.reschedule(task, result)

    def deliver(result: outcome.Outcome[T]) -> None:  # in the worker thread
        # The run cannot have finished: the task waits for this (never abandoned).
        token.run_sync_soon(back_in_trio, result)

    # A fresh, empty context per call: the worker thread outlives the call, and what one
    # offload set in its context must not be seen by the next.
    job = functools.partial(contextvars.Context().run, fn, *args)
    try:
        trio.lowlevel.start_thread_soon(job, deliver)
    except BaseException:
        limiter.release_on_behalf_of(borrower)
        raise

    def abort(_: Any) -> trio.lowlevel.Abort:
        return trio.lowlevel.Abort.FAILED  # the thread cannot be stopped: wait for it

    result: T = await trio.lowlevel.wait_task_rescheduled(abort)
    return result


@attrs.define(eq=False)
class RegistrationJob:
    agent_name: str
    generation: int
    metadata: bytes
    layout: RegionLayout
    done: trio.Event = attrs.field(factory=trio.Event)
    peer: RemotePeer | None = None
    error: BaseException | None = None

    async def wait(self) -> RemotePeer:
        """Wait for the outcome. Cancelling the waiter never cancels the registration."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.peer is not None
        return self.peer


@attrs.frozen
class RegistrarStatistics:
    live: int  # published registrations not yet retired
    started: int
    published: int
    failed: int
    released_stale: int  # finished after their peer was retired or re-registered
    retired: int
    running: bool  # a registration thread is running now
    current: int  # agent names whose registration is queued, running or live


class Registrar:
    def __init__(self, transport: DataTransport, offload: Offload = to_thread) -> None:
        self.transport = transport
        self.limiter = trio.CapacityLimiter(1)
        self._offload = offload
        self._send, self._recv = trio.open_memory_channel[RegistrationJob](math.inf)
        # The generation in force per agent name, while a job of it is queued, running or
        # live; generations are never reused (one counter for all names), so an entry can
        # go when its job is retired and nothing is kept for peers long gone.
        self._generation: dict[str, int] = {}
        self._last_generation = 0
        self._live: dict[str, tuple[int, RemotePeer]] = {}
        # The transport that made each published registration: a reconfiguration swaps
        # ``transport``, and a registration it did not carry over (its session was
        # closing, or the peer restarted) is released by the transport that made it.
        self._made_by: weakref.WeakKeyDictionary[RemotePeer, DataTransport] = (
            weakref.WeakKeyDictionary()
        )
        self._started = self._published = self._failed = 0
        self._released_stale = self._retired = 0
        self._running = False

    def statistics(self) -> RegistrarStatistics:
        return RegistrarStatistics(
            live=len(self._live),
            started=self._started,
            published=self._published,
            failed=self._failed,
            released_stale=self._released_stale,
            retired=self._retired,
            running=self._running,
            current=len(self._generation),
        )

    def current(self, agent_name: str) -> RemotePeer | None:
        entry = self._live.get(agent_name)
        return None if entry is None else entry[1]

    def submit(self, agent_name: str, metadata: bytes, layout: RegionLayout) -> RegistrationJob:
        """Start a new generation for ``agent_name``; any older one becomes stale."""
        self._last_generation += 1
        gen = self._generation[agent_name] = self._last_generation
        job = RegistrationJob(agent_name, gen, metadata, layout)
        self._send.send_nowait(job)
        return job

    def retire(self, job: RegistrationJob) -> RemotePeer | None:
        """The job's session is gone. Invalidate its generation (so a registration still
        running will release itself) and hand back its published registration, if any,
        for the caller to :meth:`release`."""
        if self._generation.get(job.agent_name) == job.generation:
            del self._generation[job.agent_name]  # a registration still running is stale
        if not job.done.is_set():
            job.error = SessionClosed("registration retired", peer=job.agent_name)
            job.done.set()
        entry = self._live.get(job.agent_name)
        if entry is not None and entry[0] == job.generation:
            del self._live[job.agent_name]
            self._retired += 1
            return entry[1]
        return None

    def replace(self, job: RegistrationJob, peer: RemotePeer) -> bool:
        """A reconfiguration re-registered ``job``'s peer on a new transport: publish
        ``peer`` in place of the old registration (same generation). False if the job is
        no longer the live one (the caller must then release ``peer`` itself)."""
        entry = self._live.get(job.agent_name)
        if entry is None or entry[0] != job.generation:
            return False
        self._made_by.pop(entry[1], None)  # stale: its transport releases it as it closes
        self._live[job.agent_name] = (job.generation, peer)
        self._made_by[peer] = self.transport
        job.peer = peer
        return True

    async def release(self, peer: RemotePeer | None) -> None:
        """Release a registration off the Trio thread; shielded, so it always happens. On
        the transport that made it, which a reconfiguration may have replaced since (the
        new one refuses, NIXL with an error, a registration it did not make)."""
        if peer is None:
            return
        transport = self._made_by.pop(peer, None) or self.transport
        with trio.CancelScope(shield=True):
            try:
                await self._offload(transport.remove_remote_peer, peer, limiter=self.limiter)
            except Exception:
                log.exception("releasing the registration of %s failed", peer.agent_name)

    def add_remote_peer(
        self, agent_name: str, metadata: bytes, layout: RegionLayout
    ) -> tuple[DataTransport, RemotePeer]:
        """Register on the current transport; in the worker, with the limiter held. The
        transport is read only then: a reconfiguration swaps it while holding the limiter,
        and a registration that waited for the limiter meanwhile belongs on the new one,
        not on the transport being retired. Returns that transport with the registration."""
        transport = self.transport
        return transport, transport.add_remote_peer(agent_name, metadata, layout)

    async def drain(self) -> None:
        """Wait until no registration thread runs (shutdown, tests)."""
        async with self.limiter:
            pass

    async def run(self) -> None:
        """The executor task. Runs until cancelled."""
        async for job in self._recv:
            if job.done.is_set() or self._generation.get(job.agent_name) != job.generation:
                continue  # retired or superseded before it started
            self._started += 1
            self._running = True
            try:
                made_by, peer = await self._offload(
                    self.add_remote_peer,
                    job.agent_name,
                    job.metadata,
                    job.layout,
                    limiter=self.limiter,
                )
            except trio.Cancelled:
                # Only before its thread started (the thread is never abandoned): nothing
                # was registered, and the job ends here.
                self._running = False
                self._started -= 1
                if not job.done.is_set():
                    job.error = SessionClosed("registrar stopped", peer=job.agent_name)
                    job.done.set()
                raise
            except Exception as exc:
                self._running = False
                self._failed += 1
                if not job.done.is_set():
                    if isinstance(exc, RegistrationFailed):
                        job.error = exc
                    else:
                        job.error = RegistrationFailed(str(exc), peer=job.agent_name)
                        job.error.__cause__ = exc
                    job.done.set()
                continue
            self._running = False
            # No checkpoint between here and the decision: publish or release.
            if self._generation.get(job.agent_name) == job.generation and not job.done.is_set():
                old = self._live.pop(job.agent_name, None)
                self._live[job.agent_name] = (job.generation, peer)
                self._made_by[peer] = made_by
                self._published += 1
                job.peer = peer
                job.done.set()
                if old is not None:  # superseded without a retire: already stale in the
                    await self.release(old[1])  # transport (re-add drops it); free its state
            else:
                self._made_by[peer] = made_by
                await self.release(peer)
                self._released_stale += 1
                log.info(
                    "registration of %s (generation %d) finished stale; released",
                    job.agent_name,
                    job.generation,
                )

    async def aclose(self) -> None:
        """Release every published registration (shutdown)."""
        while self._live:
            _name, (_gen, peer) = self._live.popitem()
            self._retired += 1
            await self.release(peer)
