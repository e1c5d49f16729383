"""The data-plane contract every transport implements.

Theory of operation
-------------------
A transport owns one registered memory region (the node's :class:`~p2pkv.store.BlockStore`
region: ``num_blocks`` slots of ``block_len`` bytes) and moves blocks from local slots into
slots of a *registered* remote peer's region (the producer WRITEs into slots the consumer
named). It knows nothing of Trio: every method is an ordinary, thread-safe call.

Which thread calls what (the engine keeps to this; implementations may rely on it):

* ``add_remote_peer``, ``remove_remote_peer``, ``post_write``, ``release`` and ``close`` may
  block (NIXL wire-up, descriptor preparation, a copy done inside ``transfer()``, releasing
  a busy handle). The engine runs them in one of Trio's worker threads
  (``p2pkv.registrar.to_thread``) on a dedicated ``CapacityLimiter``; never on the Trio
  thread.
* ``poll``, ``progress`` and ``statistics`` must return in microseconds; the engine calls
  them on the Trio thread, only while transfers are in flight (never when idle).

Handles are single-use: ``post_write`` returns a :class:`TransferHandle`; the caller polls
it until it is not ``PROC`` and then ``release``s it exactly once. Releasing a handle that
is still ``PROC`` returns at once but the data plane may keep writing into the destination
for a while (NIXL: up to ~1 s): the caller must quarantine those destination slots.

A :class:`RemotePeer` is what one successful ``add_remote_peer`` built. Each call returns a
new object; ``remove_remote_peer`` releases exactly that registration (the generation guard
in :mod:`p2pkv.registrar` relies on this identity). Descriptor lists prepared for an older
registration of the same agent name are never reused.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Collection, Sequence
from typing import Any

import attrs


@attrs.frozen
class RegionLayout:
    """Where a node's block region lives and how it is cut into slots."""

    base_addr: int
    num_blocks: int
    block_len: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_len


class TransferState(enum.Enum):
    PROC = "proc"
    DONE = "done"
    ERR = "err"


@attrs.define(eq=False)
class RemotePeer:
    """One registration of a remote peer's region. ``native`` is the transport's own state."""

    agent_name: str
    layout: RegionLayout
    native: Any = None
    released: bool = False


@attrs.define(eq=False)
class TransferHandle:
    """One posted batch of writes. ``native`` is the transport's own handle."""

    peer: RemotePeer
    local_slots: tuple[int, ...]
    remote_slots: tuple[int, ...]
    native: Any = None
    released: bool = False

    @property
    def nblocks(self) -> int:
        return len(self.local_slots)


@attrs.frozen
class TransportStatistics:
    kind: str
    agent_name: str
    live_agents: int  # in this process, for this transport kind
    registered_regions: int  # in this process, for this transport kind
    remote_peers: int  # live registrations held by this transport
    live_handles: int  # posted and not yet released
    parked_peers: int = 0  # departed peers kept loaded by the data plane for reuse (NIXL)
    # CPU seconds the posting threads spent inside the data plane's post call (NIXL's
    # transfer(): over UCX cma on host memory with one copy thread, the copy itself).
    post_cpu_s: float = 0.0
    # Progress steps taken as the target of writes by the transport's own thread (NIXL).
    progress_ticks: int = 0


class DataTransport(abc.ABC):
    """Moves blocks between registered regions. See the module docstring for threading."""

    kind: str = "abstract"

    @property
    @abc.abstractmethod
    def agent_name(self) -> str: ...

    @property
    @abc.abstractmethod
    def layout(self) -> RegionLayout: ...

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer needs to register us (sent in our hello)."""

    @abc.abstractmethod
    def add_remote_peer(self, agent_name: str, metadata: bytes, layout: RegionLayout) -> RemotePeer:
        """Register a peer's region so we can write into it. Blocking; may be slow.

        Raises :class:`~p2pkv.errors.RegistrationFailed` if the metadata is refused or the
        layout is unusable. Re-adding a known agent name first drops the old registration.
        """

    @abc.abstractmethod
    def remove_remote_peer(self, peer: RemotePeer) -> None:
        """Release one registration (idempotent). Only if it is still the live registration
        for its agent name is the agent-level peer removed."""

    @abc.abstractmethod
    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        """Post writes of our ``local_slots`` into the peer's ``remote_slots`` (pairwise).

        Blocking (the copy may happen in this call). Raises
        :class:`~p2pkv.errors.TransportError` if the post fails; nothing is then in flight.
        """

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking completion check. Errors are reported as ``ERR``, never raised."""

    @abc.abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Release a handle (idempotent). See the module docstring about in-flight release."""

    def release_nowait(self, handle: TransferHandle) -> bool:
        """:meth:`release`, unless that would wait for another thread (one inside the data
        plane, a post's copy): then nothing is done and False comes back. For the engine's
        thread, which hands a busy release to a worker thread instead of stalling."""
        self.release(handle)
        return True

    def progress(self) -> None:  # noqa: B027 (optional hook: most transports need none)
        """Drive the data plane's progress (e.g. as the target of a write). Cheap."""

    def hold_target_progress(self) -> bool:
        """Progress as the target of writes from a thread of the transport's own, until
        :meth:`release_target_progress`. False if this transport has no such thread: the
        caller then drives :meth:`progress` itself (the completion poller does)."""
        return False

    def release_target_progress(self) -> None:  # noqa: B027 (pairs with the hook above)
        """Undo one :meth:`hold_target_progress` that returned True."""

    def release_departed_peers(self, current_members: Collection[str]) -> list[str]:
        """Release every registration whose agent name is not in ``current_members``.

        Returns the agent names released. Called once a reconfiguration is live.
        """
        return []

    @abc.abstractmethod
    def statistics(self) -> TransportStatistics: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release every registration and handle and let go of the agent. Idempotent."""
