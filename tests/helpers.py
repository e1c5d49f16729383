"""Test doubles for the engine, each labelled for what it fakes.

* :class:`FaultTransport` — FAKE data plane for fault injection: the in-process transport
  with scripted failures of the kinds notes/nixl.md lists (slow or failing registration,
  refused posts, writes that never settle, late completion, corrupted bytes, single bit
  flips in chosen blocks) and counters
  that prove what happened (registrations added and released, posts, releases).
* :func:`inline_offload` / :class:`VirtualOffload` — FAKE offload for Trio's autojump
  clock: blocking work runs inline, and its "slowness" is ``trio.sleep`` on virtual time
  (real threads and autojump do not mix: virtual time jumps past them).
* :class:`RawPeer` — a hand-driven peer: real TCP and our own sans-IO protocol, so tests
  can send what a real node never would.
* :class:`HandProducer` — a producer played by hand over a :class:`RawPeer`, with a FAKE
  data plane that writes each block it answers OK straight into the consumer's region.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import queue
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np
import pytest
import trio
import trio.lowlevel

from p2pkv import FetchResult, Node, NodeConfig, open_node, staging
from p2pkv.errors import RegistrationFailed, TransportError
from p2pkv.session.protocol import (
    AbortRequested,
    ByeReceived,
    Event,
    FetchRequested,
    LocalInfo,
    LookupRequested,
    SessionProtocol,
)
from p2pkv.session.session import PeerSession
from p2pkv.store import BlockStore
from p2pkv.transport.base import RegionLayout, RemotePeer, TransferHandle, TransferState
from p2pkv.transport.local import LocalTransport
from p2pkv.wire import Hello, Outcome, TransferDone, encode

if TYPE_CHECKING:
    from p2pkv.facade import BlockingNode

T = TypeVar("T")
_ids = itertools.count()


def config(peer_id: str, **kw: Any) -> NodeConfig:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_len", 4096)
    return NodeConfig(peer_id=peer_id, **kw)


def fill(store: BlockStore, n: int, block_len: int) -> list[bytes]:
    """Put ``n`` random blocks; returns their keys."""
    keys = [os.urandom(32) for _ in range(n)]
    for k in keys:
        store.put(k, os.urandom(block_len))
    return keys


class FaultTransport(LocalTransport):
    """FAKE (fault injection) over :class:`LocalTransport`. See the module docstring."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.registration_gate: threading.Event | None = None
        self.registration_entered = threading.Event()
        self.registration_error: Exception | None = None
        self.post_error: Exception | None = None
        self.hang = False  # posted writes stay PROC until released
        self.late_polls = 0  # report PROC for this many polls, then the real state
        self.corrupt = False  # write wrong bytes but report DONE
        # source slot -> bit index: that block lands with this one bit flipped, reported DONE
        self.flip_bits: dict[int, int] = {}
        self.adds = 0
        self.removes = 0
        self.posts = 0
        self.releases = 0
        self.live: set[int] = set()  # ids of RemotePeers added and not removed
        self._polls: dict[int, int] = {}

    def add_remote_peer(self, agent_name: str, metadata: bytes, layout: RegionLayout) -> RemotePeer:
        self.registration_entered.set()
        if self.registration_gate is not None:
            assert self.registration_gate.wait(30), "registration gate never opened"
        if self.registration_error is not None:
            raise self.registration_error
        peer = super().add_remote_peer(agent_name, metadata, layout)
        self.adds += 1
        self.live.add(id(peer))
        return peer

    def remove_remote_peer(self, peer: RemotePeer) -> None:
        if id(peer) in self.live:
            self.live.discard(id(peer))
            self.removes += 1
        super().remove_remote_peer(peer)

    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        self.posts += 1
        if self.post_error is not None:
            raise self.post_error
        if self.corrupt:
            bl = self.layout.block_len
            dst: np.ndarray = peer.native
            for d in remote_slots:
                dst[d * bl : (d + 1) * bl] = 0xAB
            return TransferHandle(
                peer, tuple(local_slots), tuple(remote_slots), native=TransferState.DONE
            )
        h = super().post_write(peer, local_slots, remote_slots)
        if self.flip_bits:
            bl = self.layout.block_len
            landed: np.ndarray = peer.native
            for s, d in zip(local_slots, remote_slots, strict=True):
                bit = self.flip_bits.get(s)
                if bit is not None:
                    landed[d * bl + bit // 8] ^= 1 << (bit % 8)
        if self.hang:
            h.native = TransferState.PROC
        return h

    def poll(self, handle: TransferHandle) -> TransferState:
        n = self._polls.get(id(handle), 0)
        if n < self.late_polls:
            self._polls[id(handle)] = n + 1
            return TransferState.PROC
        return super().poll(handle)

    def release(self, handle: TransferHandle) -> None:
        if not handle.released:
            self.releases += 1
        super().release(handle)


class FaultFactory:
    """FAKE data-plane factory for ``open_node(transport=...)``: builds FAKE
    :class:`FaultTransport` s and keeps what it built (``kind``: a subclass of
    FaultTransport with faults of its own)."""

    def __init__(
        self,
        configure: Callable[[FaultTransport], None] | None = None,
        kind: type[FaultTransport] = FaultTransport,
    ) -> None:
        self.configure = configure
        self.kind = kind
        self.built: list[FaultTransport] = []

    def __call__(self, cfg: NodeConfig, store: BlockStore) -> FaultTransport:
        t = self.kind(agent_name=cfg.peer_id, region=store.array, layout=store.layout)
        if self.configure is not None:
            self.configure(t)
        self.built.append(t)
        return t

    @property
    def transport(self) -> FaultTransport:
        return self.built[-1]


async def inline_offload(fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter) -> T:
    """FAKE offload (deterministic timing): runs blocking work inline on the Trio thread."""
    async with limiter:
        await trio.lowlevel.checkpoint()
        return fn(*args)


class VirtualOffload:
    """FAKE offload for the autojump clock: inline, after a virtual-time delay per call name
    (e.g. ``{"add_remote_peer": 60.0}`` makes registration slow)."""

    def __init__(self, delays: dict[str, float] | None = None) -> None:
        self.delays = delays or {}

    async def __call__(self, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter) -> T:
        async with limiter:
            # Not cancellable, like a real worker thread: a cancel lands after it returns.
            with trio.CancelScope(shield=True):
                await trio.sleep(self.delays.get(getattr(fn, "__name__", ""), 0.0))
            return fn(*args)


@asynccontextmanager
async def virtual_node(
    peer_id: str,
    *,
    delays: dict[str, float] | None = None,
    factory: FaultFactory | None = None,
    **kw: Any,
) -> AsyncIterator[Node]:
    """A node for the autojump clock: blocking calls inline through the FAKE
    :class:`VirtualOffload` (``delays`` by call name), its data plane a
    :class:`FaultFactory`'s (``factory``, to inject faults), ``config(peer_id, **kw)``."""
    async with open_node(
        config(peer_id, **kw), offload=VirtualOffload(delays), transport=factory or FaultFactory()
    ) as n:
        yield n


class RawPeer:
    """A hand-driven peer over real TCP (see the module docstring). Its region is a real
    :class:`LocalTransport` region, so a node in this process can register it.

    One a test leaves open (it failed before its ``aclose``) is closed at the test's
    teardown (:func:`close_leftover_raw_peers`), so its socket and agent do not fail the
    tests after it."""

    def __init__(
        self,
        peer_id: str | None = None,
        *,
        num_blocks: int = 64,
        block_len: int = 4096,
        epoch: int = 7,
        **info: Any,
    ) -> None:
        self.peer_id = peer_id or f"raw{next(_ids)}"
        self.array = np.zeros(num_blocks * block_len, np.uint8)
        layout = RegionLayout(self.array.ctypes.data, num_blocks, block_len)
        self.transport = LocalTransport(agent_name=self.peer_id, region=self.array, layout=layout)
        self.proto = SessionProtocol(
            LocalInfo(
                peer_id=self.peer_id,
                epoch=epoch,
                agent_name=self.peer_id,
                agent_metadata=self.transport.metadata(),
                base_addr=layout.base_addr,
                num_blocks=num_blocks,
                block_len=block_len,
                **info,
            )
        )
        self.stream: trio.SocketStream | None = None
        self.peer_hello: Hello | None = None
        _open_raw_peers.add(self)

    async def connect(self, address: tuple[str, int]) -> None:
        self.stream = await trio.open_tcp_stream(*address)

    async def send_raw(self, data: bytes) -> None:
        assert self.stream is not None
        await self.stream.send_all(data)

    async def flush(self) -> None:
        data = self.proto.data_to_send()
        if data:
            await self.send_raw(data)

    async def next_event(self) -> Event | None:
        """The next protocol event; ``None`` on EOF."""
        assert self.stream is not None
        while True:
            ev = self.proto.next_event()
            if ev is not None:
                # Automatic replies (pongs); the node may have closed the connection
                # already, and then the event still counts.
                with contextlib.suppress(trio.BrokenResourceError):
                    await self.flush()
                return ev
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            if not data:
                return None
            self.proto.receive_data(data)

    async def handshake(self) -> None:
        """Full handshake: we "register" the node at once and ack."""
        from p2pkv.session.protocol import HelloReceived, Ready

        self.proto.start()
        await self.flush()
        while True:
            ev = await self.next_event()
            if isinstance(ev, HelloReceived):
                self.peer_hello = ev.hello
                if self.proto.registration_succeeded() is not None:
                    await self.flush()
                    return
                await self.flush()
            elif isinstance(ev, Ready):
                return
            else:
                raise AssertionError(f"unexpected event during handshake: {ev!r}")

    async def lookup(self, keys: list[bytes]) -> tuple[int, list[bool]]:
        """Look ``keys`` up and read the answer (the next event must be it): its request
        id and hits."""
        from p2pkv.session.protocol import LookupAnswered

        req = self.proto.send_lookup(keys)
        await self.flush()
        ev = await self.next_event()
        assert isinstance(ev, LookupAnswered) and ev.req_id == req, ev
        return req, ev.hits

    async def expect_close(self) -> ByeReceived | None:
        """Read until the node says bye (returned) or the connection ends without one
        (``None``: EOF or reset). Anything else the read raises (our protocol rejecting
        what the node sent, a bug) propagates and fails the test."""
        while True:
            ev = await self.next_event()
            if ev is None:
                return None
            if isinstance(ev, ByeReceived):
                return ev

    async def aclose(self) -> None:
        _open_raw_peers.discard(self)
        if self.stream is not None:
            await self.stream.aclose()
        self.transport.close()


_open_raw_peers: set[RawPeer] = set()


def close_leftover_raw_peers() -> int:
    """Close, outside Trio, every :class:`RawPeer` not closed by its test; how many.

    A failed assertion skips the test's ``aclose``: its socket would be collected during a
    later test (a ResourceWarning, an error under ``filterwarnings = error``) and its
    agent counted by a later test's leak check, one failure reported as several. The
    socket is detached from Trio and closed by its descriptor: Trio's own close needs a
    run."""
    left = list(_open_raw_peers)
    _open_raw_peers.clear()
    for raw in left:
        if raw.stream is not None:
            with contextlib.suppress(OSError):
                fd = raw.stream.socket.detach()
                if fd >= 0:
                    os.close(fd)
        raw.transport.close()
    return len(left)


# answer(n, keys) -> the outcomes of the n-th fetch (0-based) of ``keys``; may wait.
Answer = Callable[[int, list[bytes]], Awaitable[list[int]]]


class HandProducer:
    """A producer played by hand over :class:`RawPeer` (FAKE: its "data plane" writes each
    block it answers OK straight into the consumer's region, as the in-process transport
    would). ``log`` keeps every event it receives, a ``fetch_hits`` (no keys) with the
    round's hits (``hit_keys``) as its keys and its request id in ``by_hits``; ``asked``
    and ``fetched`` are set by the first lookup and the first fetch.

    ``blocks``: the hits are the keys of ``blocks``, whose bytes a fetch writes; None:
    every key is a hit, its block made up (random, then kept in ``blocks``) when first
    written. ``answer``: fetch number ``n`` (0-based, closes not counted) is answered
    ``answer(n, keys)``, an outcome count other than the keys' sent raw, past the
    protocol's own checks (a liar); None: every key OK. ``hold``: a fetch is answered
    only once it is set. ``lookups_answered``: only that many lookups are answered, the
    rest never (0: mute); None: all. ``vanish``: on the first fetch the producer closes
    its connection instead of answering (its process died; the time in ``vanished_at``).
    ``ack_aborts``: every abort is acknowledged; else it is only logged."""

    def __init__(
        self,
        raw: RawPeer,
        dst: Node | BlockingNode,
        blocks: dict[bytes, bytes] | None = None,
        *,
        answer: Answer | None = None,
        hold: trio.Event | None = None,
        lookups_answered: int | None = None,
        vanish: bool = False,
        ack_aborts: bool = False,
    ) -> None:
        self.raw, self.dst, self.answer, self.hold = raw, dst, answer, hold
        self.all_hits, self.blocks = blocks is None, {} if blocks is None else blocks
        self.lookups_answered, self.vanish, self.ack_aborts = lookups_answered, vanish, ack_aborts
        self.asked = trio.Event()  # the first lookup is in
        self.fetched = trio.Event()  # the first fetch message is in
        self.log: list[Event] = []
        self.vanished_at: float | None = None
        self.hit_keys: dict[int, list[bytes]] = {}  # request id -> the round's hits
        self.by_hits: list[int] = []  # request ids fetched by fetch_hits
        self.fetches = 0

    async def run(self) -> None:
        raw, ok = self.raw, int(Outcome.OK)
        while (ev := await raw.next_event()) is not None:
            if isinstance(ev, FetchRequested) and ev.keys is None:
                self.by_hits.append(ev.req_id)
                ev = attrs.evolve(ev, keys=self.hit_keys[ev.req_id])
            self.log.append(ev)
            if isinstance(ev, LookupRequested):
                self.asked.set()
                if self.lookups_answered is not None:
                    if not self.lookups_answered:
                        continue
                    self.lookups_answered -= 1
                hits = [self.all_hits or k in self.blocks for k in ev.keys]
                self.hit_keys[ev.req_id] = list(itertools.compress(ev.keys, hits))
                raw.proto.send_lookup_resp(ev.req_id, hits, trio.current_time(), 60.0)
            elif isinstance(ev, FetchRequested):  # never empty: an empty one is a close
                assert ev.keys is not None
                self.fetched.set()
                if self.vanish:
                    self.vanished_at = trio.current_time()
                    assert raw.stream is not None
                    await raw.stream.aclose()
                    return
                if self.hold is not None:
                    await self.hold.wait()
                n, self.fetches = self.fetches, self.fetches + 1
                if self.answer is None:
                    outcomes = [ok] * len(ev.keys)
                else:
                    outcomes = await self.answer(n, list(ev.keys))
                size, region = self.dst.store.block_len, self.dst.store.array
                for k, s, o in zip(ev.keys, ev.slots, outcomes, strict=False):
                    if o == ok:
                        if self.all_hits:
                            self.blocks.setdefault(k, os.urandom(size))
                        region[s * size : (s + 1) * size] = np.frombuffer(self.blocks[k], np.uint8)
                if len(outcomes) == len(ev.slots):
                    raw.proto.send_transfer_done(ev.req_id, outcomes)
                else:  # a liar's outcome count: past the protocol's own checks
                    await raw.send_raw(encode(TransferDone(req_id=ev.req_id, outcomes=outcomes)))
            elif isinstance(ev, AbortRequested) and self.ack_aborts:
                raw.proto.send_abort_ack(ev.req_id)
            await raw.flush()

    def sent(self, kind: type[Any]) -> list[Any]:
        return [ev for ev in self.log if isinstance(ev, kind)]


def rejected_registration() -> Exception:
    return RegistrationFailed("refused by the fault script")


def post_failure() -> Exception:
    return TransportError("post refused by the fault script")


def blocking_nodes(bound: float = 10.0) -> Iterator[Callable[..., BlockingNode]]:
    """Body of the ``nodes`` fixture: start BlockingNodes (sync facade); every one is
    closed at the end, whatever happened."""
    from p2pkv import P2PKVError, start_node

    started: list[BlockingNode] = []

    def start(peer_id: str, **kw: Any) -> BlockingNode:
        transport = kw.pop("transport", None)
        node = start_node(config(peer_id, **kw), transport=transport)
        started.append(node)
        return node

    yield start
    for node in reversed(started):
        with contextlib.suppress(P2PKVError):
            node.close(timeout=bound)


BOUND = 10.0  # seconds: "this did not hang", never an expected duration
# seconds, a model test's pytest timeout: room for Hypothesis to shrink a failing example
# (it stops shrinking after 300 s) and report it, where the suite's 300 s would cut it off
SHRINK_ROOM = 900


def in_thread(
    fn: Callable[[], object], name: str = "test-host"
) -> tuple[threading.Thread, queue.Queue[object]]:
    """Run fn on a helper thread (a foreign thread, as a host's scheduler would be); its
    return value or exception lands in the queue."""
    out: queue.Queue[object] = queue.Queue()

    def body() -> None:
        try:
            out.put(fn())
        except BaseException as exc:
            out.put(exc)

    t = threading.Thread(target=body, name=name)
    t.start()
    return t, out


def is_trio_cache_thread(thread: threading.Thread) -> bool:
    """Trio's cached worker threads ("Trio thread N", daemon) belong to no test: any run
    reuses them, and an idle one exits on its own some seconds later, so they come and go
    whatever the code under test does. A worker running a job carries the job's name
    instead, so a job left running is still seen."""
    return thread.daemon and thread.name.startswith("Trio thread ")


def leftover_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads alive now that were not in ``before``, Trio's worker cache aside."""
    return [t for t in threading.enumerate() if t not in before and not is_trio_cache_thread(t)]


def check_no_leaked_threads() -> Iterator[None]:
    """Body of a ``no_leaked_threads`` fixture: every thread the test started has ended."""
    before = set(threading.enumerate())
    yield
    for t in leftover_threads(before):  # one may still be ending: give it time, then look
        t.join(BOUND)
    extra = leftover_threads(before)
    assert extra == [], f"threads left behind: {extra}"


@contextlib.contextmanager
def held_by_a_thread(lock: Any) -> Iterator[None]:
    """``lock`` held, for the block, by another thread of this process: as a thread inside
    a call that takes it holds it when the host forks (see :func:`in_fork`)."""
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            inside.set()
            leave.wait(BOUND)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(BOUND)
        yield
    finally:
        leave.set()
        thread.join(BOUND)


def in_fork(child: Callable[[], str], bound: float = BOUND) -> str:
    """What ``child()`` returns in a child forked from this process ("" if it raised); the
    child exits at once after it (``os._exit``). One that is silent for ``bound`` seconds
    (it hangs) is killed, and "" comes back."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns of fork with threads; ours is checked
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.write(write, child().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        ready, _, _ = select.select([pipe], [], [], bound)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        said = pipe.read().decode() if ready else ""
    os.waitpid(pid, 0)
    return said


async def until(condition: Callable[[], bool], poll: float = 0.005) -> None:
    """Wait on the Trio clock until condition holds: a gate on state that no event exposes
    (statistics of another node). Callers bound it with ``trio.fail_after``."""
    while not condition():
        await trio.sleep(poll)


async def until_sessions(node: Node, condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds, checked again each time a session of ``node``
    becomes ready or ends (the node's own wake-up: no polling). Callers bound it with
    ``trio.fail_after``."""
    while not condition():
        await node._peers_changed.park()


def run_interleaved(
    *targets: Callable[[], None],
    on_error: Callable[[BaseException], None],
    bound: float = 60.0,
) -> None:
    """Run ``targets`` on threads of their own, with the interpreter switching between
    threads as finely as it can, so that every interleaving gets a chance. ``on_error``
    runs in the failing thread (to wake the others); the first error is raised here."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                errors.append(exc)
                on_error(exc)

        return run

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=guarded(t)) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=bound)
    finally:
        sys.setswitchinterval(old_interval)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def count_calls(monkeypatch: pytest.MonkeyPatch, cls: type[Any], name: str) -> Callable[[], int]:
    """PROBE: count the calls of ``cls.name`` (from any thread) for the rest of the test."""
    calls = 0
    original = getattr(cls, name)

    def counted(self: Any, *args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(self, *args, **kw)

    monkeypatch.setattr(cls, name, counted)
    return lambda: calls


HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
#: ``pytestmark`` of a module whose every test runs real NIXL: marked, skipped without it.
NIXL_ONLY = [
    pytest.mark.nixl,
    pytest.mark.skipif(not HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13 (or nixl-cu12)"),
]


@contextlib.contextmanager
def trio_in_a_thread(
    afn: Callable[[], Awaitable[None]], name: str, *, stop: Callable[[], None]
) -> Iterator[None]:
    """Run ``afn`` on a Trio loop of its own (:func:`in_thread`: a FAKE peer beside a
    facade node, whose waits are real seconds) for the body; then ``stop()`` whatever
    happened in the body (it must make ``afn`` end, e.g. close the node it talks to), join
    the thread and raise what ``afn`` raised."""
    t, out = in_thread(lambda: trio.run(afn), name)
    try:
        yield
    finally:
        stop()
        t.join(BOUND)
    assert not t.is_alive(), f"{name} did not end"
    result = out.get_nowait()
    if isinstance(result, BaseException):
        raise result


def wait_for(condition: Callable[[], bool], bound: float = BOUND) -> None:
    """Yield the GIL until condition holds: a gate on state that no event exposes."""
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.001)


@asynccontextmanager
async def pair(
    src_kw: dict[str, Any] | None = None,
    dst_kw: dict[str, Any] | None = None,
    *,
    src_transport: FaultFactory | None = None,
    virtual: bool = False,
) -> AsyncIterator[tuple[Node, Node]]:
    """A producer ``src`` and a consumer ``dst``; with ``virtual``, blocking data-plane work
    runs inline on Trio's clock (for the autojump clock)."""
    offload = VirtualOffload() if virtual else None
    async with (
        open_node(config("src", **(src_kw or {})), transport=src_transport, offload=offload) as src,
        open_node(config("dst", **(dst_kw or {})), offload=offload) as dst,
    ):
        yield src, dst


async def fetch_at_once(node: Node, peer: Any, *key_lists: list[bytes]) -> list[FetchResult]:
    """One ``node.fetch(peer, keys)`` per list, all started together; the results in the
    order they finished."""
    results: list[FetchResult] = []

    async def fetch(keys: list[bytes]) -> None:
        results.append(await node.fetch(peer, keys))

    async with trio.open_nursery() as nursery:
        for keys in key_lists:
            nursery.start_soon(fetch, keys)
    return results


def record_lane_parts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """From now on, each part a staging copy posts, as (lane name, blocks), in the order
    the lanes post them (they post from several threads: ``list.append`` is atomic)."""
    parts: list[tuple[str, int]] = []
    write = staging._Lane.write

    def counted(lane: Any, src: Any, s: Any, dst: Any, d: Any, deadline: float) -> None:
        parts.append((lane.name, len(s)))
        write(lane, src, s, dst, d, deadline)

    monkeypatch.setattr(staging._Lane, "write", counted)
    return parts


class FailingTransferAgent:
    """FAKE: a (lane's) NIXL agent whose transfers all end in error (``stuck``: stay in
    progress, then end in error once ``stuck`` seconds have passed: "never done", bounded
    so that a copy missing its own deadline fails instead of hanging); anything else goes
    to the real agent. Nothing is posted."""

    def __init__(self, agent: Any, stuck: float = 0.0) -> None:
        self._agent = agent
        self._stuck = stuck
        self._since = time.monotonic()

    def transfer(self, xfer: Any) -> str:
        self._since = time.monotonic()
        return self.check_xfer_state(xfer)

    def check_xfer_state(self, xfer: Any) -> str:
        return "PROC" if time.monotonic() - self._since < self._stuck else "ERR"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


@contextlib.contextmanager
def failing_lane(agent: Any, index: int, stuck: float = 0.0) -> Iterator[None]:
    """Within: lane ``index`` of a staging ``agent`` fails every transfer
    (:class:`FailingTransferAgent`, ``stuck`` as there); its real agent is back
    afterwards."""
    lane = agent.lanes[index]
    real = lane.agent
    lane.agent = FailingTransferAgent(real, stuck)
    try:
        yield
    finally:
        lane.agent = real


class SendGate:
    """FAKE full send buffer for one session: while shut, the kernel takes nothing the
    session sends (``_send_now`` takes nothing, and waiting for the socket to be writable
    waits for the gate), so every flush parks in ``_send_rest``, holding the send lock, under
    its real deadline. A real socket's buffers make no such promise: loopback may take a
    whole reply into a peer's receive queue, whatever buffer sizes the test sets."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.session: PeerSession | None = None
        self.open = trio.Event()
        self.open.set()
        real_send_now = PeerSession._send_now
        real_wait_writable = trio.lowlevel.wait_writable
        gate = self

        def send_now(s: PeerSession, data: bytes) -> int:
            if s is gate.session and not gate.open.is_set():
                return 0
            return real_send_now(s, data)

        async def wait_writable(sock: Any) -> None:
            if gate.session is not None and sock is gate.session._raw:
                await gate.open.wait()
            await real_wait_writable(sock)

        monkeypatch.setattr(PeerSession, "_send_now", send_now)
        monkeypatch.setattr(trio.lowlevel, "wait_writable", wait_writable)

    def shut(self, session: PeerSession) -> None:
        self.session, self.open = session, trio.Event()


# Slot lists every data plane's post_write refuses, for regions of 32 blocks on both sides:
# (local, remote, the error's words). A float was truncated to a slot, a 2-D array
# flattened, a uint64 beyond int64 wrapped (``p2pkv.transport._runs.slot_indices``).
BAD_SLOTS: list[Any] = [
    pytest.param([0, 1.0], [0, 1], "local slots must be integers", id="float-in-list"),
    pytest.param([0, 1], [0, "1"], "remote slots must be integers", id="str-in-list"),
    pytest.param([0, 32], [0, 1], "local slot out of range", id="past-the-end"),
    # One slot alone is bounded too (a bound checked only from two on wrote past the end).
    pytest.param([32], [0], "local slot out of range", id="one-slot-past-the-end"),
    pytest.param([0], [32], "remote slot out of range", id="one-remote-slot-past-the-end"),
    pytest.param([0, 1], [-1, 1], "remote slot out of range", id="negative"),
    pytest.param((0, 1), (2**63, 1), "remote slots must be integers", id="past-int64"),
    pytest.param(
        np.array([0.0, 1.7]),
        [0, 1],
        "local slots must be a flat sequence of integers",
        id="float-array",
    ),
    pytest.param(
        [0, 1],
        np.array([[0], [1]]),
        "remote slots must be a flat sequence of integers",
        id="2d-array",
    ),
    pytest.param(
        [0, 1],
        np.array([0, 2**64 - 1], dtype=np.uint64),
        "remote slot out of range",
        id="uint64-that-would-wrap",
    ),
]


@contextlib.contextmanager
def interrupt_at(event: str, name: str, caller: str) -> Iterator[list[bool]]:
    """Raise KeyboardInterrupt in this thread at the first ``event`` ("call", "return"
    or "c_return") of a function ``name`` (qualified, for "call" and "return") made from
    a function ``caller``; yields a list
    that holds True once it has."""
    landed: list[bool] = []

    def hook(frame: Any, ev: str, arg: Any) -> None:
        if landed or ev != event:
            return
        if event in ("call", "return"):
            here, code_name = frame.f_back, frame.f_code.co_qualname
        else:
            here, code_name = frame, getattr(arg, "__name__", "")
        if code_name == name and here is not None and here.f_code.co_name == caller:
            landed.append(True)
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(hook)
    try:
        yield landed
    finally:
        sys.setprofile(None)
