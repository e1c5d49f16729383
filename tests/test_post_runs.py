"""A fetch's posts: one worker thread posts chunk after chunk, and lets anyone else who
wants the data plane in at the next chunk (ProducerSide._post_run, Node.data_wanted).

Two nodes in one process over the FAKE (fault-injection) transport. The first source
transport's first post blocks on a gate (a ``threading.Event``), so a test can line up
what happens while a run of posts is in its worker thread. Real worker threads, so the
real clock: ``fail_after`` only says "this did not hang".
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from p2pkv import FetchResult, NodeConfig, TransportError, open_node
from p2pkv.node import Node
from p2pkv.registrar import to_thread
from p2pkv.session.producer import ProducerSide
from p2pkv.session.protocol import AbortAcknowledged, AbortRequested, TransferCompleted
from p2pkv.store import BlockStore
from p2pkv.transport.base import RemotePeer, TransferHandle
from p2pkv.wire import Outcome

from .helpers import FaultTransport, RawPeer, config, fetch_at_once, fill, until
from .test_handshake_trust import restart_on_same_connection

T = TypeVar("T")
BOUND = 20.0  # seconds: "this did not hang"
BLOCK = 4096
CHUNK = 4  # blocks per chunk: a 16-block fetch is 4 chunks


class GatedPosts(FaultTransport):
    """FAKE data plane (fault injection): while ``gated``, the next post waits for
    ``gate``; ``entered`` is set once it does. With ``fail_second`` set, the second post
    raises it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.gated = False
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail_second: Exception | None = None  # the second post raises this
        self.failed_slots: list[int] = []  # the local slots of the post that raised

    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        if self.fail_second is not None and self.posts == 1:
            self.posts += 1
            self.failed_slots = list(local_slots)
            raise self.fail_second
        if self.gated:
            self.gated = False
            self.entered.set()
            assert self.gate.wait(BOUND), "the post gate never opened"
        return super().post_write(peer, local_slots, remote_slots)


class Factory:
    """Builds GatedPosts transports; the first one's first post is gated."""

    def __init__(self) -> None:
        self.built: list[GatedPosts] = []

    def __call__(self, cfg: NodeConfig, store: BlockStore) -> GatedPosts:
        t = GatedPosts(agent_name=cfg.peer_id, region=store.array, layout=store.layout)
        t.gated = not self.built
        self.built.append(t)
        return t


class CountingOffload:
    """The real offload (worker threads), counting calls by function name."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(
        self, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter
    ) -> Awaitable[T]:
        name = getattr(fn, "__name__", repr(fn))
        self.calls[name] = self.calls.get(name, 0) + 1
        return to_thread(fn, *args, limiter=limiter)


def src_config() -> NodeConfig:
    return config("src", num_blocks=64, block_len=BLOCK, transfer_chunk_bytes=CHUNK * BLOCK)


@asynccontextmanager
async def source_and_consumer(
    factory: Factory, offload: CountingOffload | None = None
) -> AsyncIterator[tuple[Node, Node]]:
    """The source over ``factory``'s transports, and a consumer, both open."""
    async with (
        open_node(src_config(), transport=factory, offload=offload) as src,
        open_node(config("dst", num_blocks=64, block_len=BLOCK)) as dst,
    ):
        yield src, dst


async def entered(t: GatedPosts) -> None:
    assert await trio.to_thread.run_sync(t.entered.wait, BOUND)


async def test_the_chunks_of_a_fetch_go_out_in_one_worker_thread_trip() -> None:
    factory, offload = Factory(), CountingOffload()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory, offload) as (src, dst):
            factory.built[0].gated = False
            keys = fill(src.store, 16, BLOCK)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert sorted(result.loaded) == sorted(keys)
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"x")
            assert factory.built[0].posts == 16 // CHUNK
            assert offload.calls.get("_post_run") == 1
            assert src.data_wanted == 0


async def test_a_reconfiguration_gets_the_data_plane_at_the_next_chunk() -> None:
    """The run stops after the chunk in hand; the swap goes in; the rest of the chunks are
    posted on the new transport, and every byte lands."""
    factory = Factory()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            keys = fill(src.store, 16, BLOCK)
            peer = await dst.connect(src.address)
            got: list[Any] = []
            swapped = trio.Event()

            async def fetch() -> None:
                got.append(await dst.fetch(peer, keys))

            async def reconfigure() -> None:
                assert await src.reconfigure(["dst"]) == []
                swapped.set()

            first = factory.built[0]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                await entered(first)  # the run is in its first post
                nursery.start_soon(reconfigure)
                await trio.testing.wait_all_tasks_blocked()
                assert src.data_wanted == 2  # the fetch's run and the waiting swap
                first.gate.set()
                await swapped.wait()
            assert first.posts == 1  # the run stopped after the chunk in hand
            assert factory.built[1].posts == 16 // CHUNK - 1  # the rest, after the swap
            assert sorted(got[0].loaded) == sorted(keys)
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"x")
            assert src.data_wanted == 0


async def test_an_aborted_fetch_posts_no_more_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = Factory()
    aborted = trio.Event()
    on_abort = ProducerSide._on_abort

    def abort_seen(self: ProducerSide, ev: AbortRequested) -> None:
        on_abort(self, ev)
        aborted.set()

    monkeypatch.setattr(ProducerSide, "_on_abort", abort_seen)
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            keys = fill(src.store, 16, BLOCK)
            peer = await dst.connect(src.address)
            first = factory.built[0]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dst.fetch, peer, keys)
                await entered(first)
                nursery.cancel_scope.cancel()  # the consumer gives up: it sends an abort
            await aborted.wait()  # the source has cancelled the fetch's scope
            first.gate.set()
            with trio.move_on_after(BOUND / 2):  # inside fail_after: the assert reports
                while src.statistics().pinned_slots:  # the round ends with its abort_ack
                    await trio.sleep(0.01)
            assert first.posts == 1
            assert src.statistics().pinned_slots == 0
            assert src.data_wanted == 0


@asynccontextmanager
async def fetch_in_its_first_post(
    src: Node, dst: Node, first: GatedPosts
) -> AsyncIterator[tuple[list[bytes], list[FetchResult]]]:
    """dst fetches 16 of src's blocks in the background; the body runs while src's run
    of posts is in its first (gated) post. Yields the keys and the list the fetch's
    result is in once the block has ended."""
    keys = fill(src.store, 16, BLOCK)
    peer = await dst.connect(src.address)
    got: list[FetchResult] = []

    async def fetch() -> None:
        got.append(await dst.fetch(peer, keys))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        await entered(first)  # the run is in its first post
        yield keys, got


async def test_a_write_the_host_cuts_posts_no_more_chunks() -> None:
    """``release_unused_pins(cut_writes=True)`` while a run of posts is in its first
    chunk: the run stops after the chunk in hand (the round is still being written as
    far as the protocol knows: only the write's flag says stop), the fetch's keys fail,
    and the pins come back."""
    factory = Factory()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            first = factory.built[0]
            async with fetch_in_its_first_post(src, dst, first) as (keys, got):
                assert await src.release_unused_pins(cut_writes=True) == 0
                first.gate.set()
            assert first.posts == 1
            assert not got[0].loaded and set(got[0].failed) == set(keys)
            assert set(got[0].failed.values()) == {"aborted"}  # posted or not
            await until(lambda: src.statistics().pinned_slots == 0)  # unpinned after the reply
            assert src.data_wanted == 0


async def test_another_peers_fetch_gets_the_data_plane_at_the_next_chunk() -> None:
    """Two consumers' fetches share the source's data plane chunk by chunk."""
    factory = Factory()
    order: list[str] = []
    with trio.fail_after(BOUND):
        async with (
            open_node(src_config(), transport=factory) as src,
            open_node(config("c1", num_blocks=64, block_len=BLOCK)) as c1,
            open_node(config("c2", num_blocks=64, block_len=BLOCK)) as c2,
        ):
            first = factory.built[0]
            post = first.post_write

            def recorded(
                peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
            ) -> TransferHandle:
                order.append(peer.agent_name)
                return post(peer, local_slots, remote_slots)

            first.post_write = recorded  # type: ignore[method-assign]
            keys = fill(src.store, 32, BLOCK)
            p1, p2 = await c1.connect(src.address), await c2.connect(src.address)
            results: dict[str, Any] = {}

            async def fetch(name: str, node: Any, peer: Any, ks: list[bytes]) -> None:
                results[name] = await node.fetch(peer, ks)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch, "c1", c1, p1, keys[:16])
                await entered(first)  # c1's run is in its first post
                nursery.start_soon(fetch, "c2", c2, p2, keys[16:])
                await trio.testing.wait_all_tasks_blocked()
                assert src.data_wanted == 2
                first.gate.set()
            assert order[:2] == ["c1", "c2"]  # c2 got in at c1's next chunk
            assert sorted(order) == ["c1"] * 4 + ["c2"] * 4
            assert sorted(results["c1"].loaded) == sorted(keys[:16])
            assert sorted(results["c2"].loaded) == sorted(keys[16:])
            for node, ks in ((c1, keys[:16]), (c2, keys[16:])):
                for k in ks:
                    assert bytes(node.store.get(k) or b"") == bytes(src.store.get(k) or b"x")
            assert src.data_wanted == 0


async def fetch_with_a_failing_second_post(
    src: Node, dst: Node, first: GatedPosts, error: Exception
) -> tuple[list[bytes], FetchResult]:
    """Fetch 16 blocks (4 chunks) from ``src`` while its second post raises ``error``."""
    first.gated = False
    first.fail_second = error
    keys = fill(src.store, 16, BLOCK)
    peer = await dst.connect(src.address)
    return keys, await dst.fetch(peer, keys)


async def test_a_bug_in_a_later_post_still_settles_the_chunks_already_posted() -> None:
    factory = Factory()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            first = factory.built[0]
            bug = RuntimeError("a bug in the data plane")
            _, result = await fetch_with_a_failing_second_post(src, dst, first, bug)
            assert result.loaded == []
            assert first.posts == 2  # the chunk before the bug, then the bug
            assert first.statistics().live_handles == 0  # the posted chunk was settled
            assert src.statistics().pinned_slots == 0
            assert src.data_wanted == 0


async def test_a_closing_session_posts_no_more_chunks() -> None:
    factory = Factory()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            first = factory.built[0]
            async with fetch_in_its_first_post(src, dst, first) as (_, got):
                session = src._by_peer["dst"]
                session.close("closed by the test")
                first.gate.set()
                await session.finished.wait()
            assert first.posts == 1
            assert got[0].loaded == []  # the session ended before any reply
            assert src.data_wanted == 0


async def test_a_refused_chunk_fails_its_keys_and_the_run_goes_on() -> None:
    factory = Factory()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            first = factory.built[0]
            refusal = TransportError("refused by the test")
            keys, result = await fetch_with_a_failing_second_post(src, dst, first, refusal)
            lost = {k for k in keys if src.store.slot_of(k) in set(first.failed_slots)}
            assert len(lost) == CHUNK
            assert set(result.failed) == lost
            assert set(result.failed.values()) == {"transfer_failed"}
            assert sorted(result.loaded) == sorted(set(keys) - lost)
            for k in result.loaded:
                assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"x")
            assert first.posts == 16 // CHUNK
            assert src.data_wanted == 0


async def test_two_fetches_at_once_of_the_same_keys_while_chunks_are_posted() -> None:
    """The second fetch of keys whose chunks are being posted shares their writes: each
    block is written once, both results load it, and nothing is left counted."""
    factory = Factory()
    with trio.fail_after(BOUND):
        async with source_and_consumer(factory) as (src, dst):
            first = factory.built[0]
            first.gated = False
            keys = fill(src.store, 16, BLOCK)
            peer = await dst.connect(src.address)
            results = await fetch_at_once(dst, peer, keys, keys[4:12])
            assert sorted(len(r.loaded) for r in results) == [8, 16]
            assert all(r.failed == {} for r in results)
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"x")
            assert first.posts == 16 // CHUNK  # every chunk once
            assert src.data_wanted == 0
            assert dst.statistics().reserved_slots == 0


class GatedRuns:
    """The real offload (worker threads), except that while ``gated`` the next run of
    posts waits in its worker thread, holding the data-plane limiter, for ``gate``
    before it begins (``entered`` is set once it does): a thread already started when
    the write is cut. A FAKE for the timing only: the run itself is the real one."""

    def __init__(self) -> None:
        self.gated = True
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.runs = 0  # runs of posts asked for

    def __call__(
        self, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter
    ) -> Awaitable[T]:
        if getattr(fn, "__name__", "") == "_post_run":
            self.runs += 1
        if self.gated and getattr(fn, "__name__", "") == "_post_run":
            self.gated = False

            def held(*a: Any) -> T:
                self.entered.set()
                assert self.gate.wait(BOUND), "the run gate never opened"
                return fn(*a)

            return to_thread(held, *args, limiter=limiter)
        return to_thread(fn, *args, limiter=limiter)


@pytest.mark.parametrize("cut", ["abort", "host_cut", "close", "restart"])
async def test_a_write_cut_before_its_run_of_posts_began_posts_nothing(cut: str) -> None:
    """The fetch's run of posts is in its worker thread, not yet at its first chunk, when
    the write is cut: the consumer aborts, the host cuts writes, the session closes, or
    the consumer restarts on the connection (the round is dropped with its incarnation,
    and the new one has no registration until the write has ended). The run posts
    nothing and no other run follows: no byte reaches the consumer's region, a host's cut
    reports every key ``aborted``, and a restart is not logged as a refused post. Before,
    the first chunk of a run went out unchecked (and, after a restart, was refused for
    want of a registration, with a WARNING), and keys never posted were reported
    ``transfer_failed``."""
    factory, runs = Factory(), GatedRuns()
    with trio.fail_after(BOUND):
        async with open_node(src_config(), transport=factory, offload=runs) as src:
            first = factory.built[0]
            first.gated = False
            keys = fill(src.store, 16, BLOCK)
            raw = RawPeer("r", num_blocks=64, block_len=BLOCK)
            await raw.connect(src.address)
            await raw.handshake()
            req, hits = await raw.lookup(keys)
            assert all(hits)
            raw.proto.send_fetch(req, keys, list(range(16)))
            await raw.flush()
            assert await trio.to_thread.run_sync(runs.entered.wait, BOUND)
            session = src._by_peer["r"]
            write = session._writes[req]
            async with trio.open_nursery() as nursery:
                if cut == "abort":
                    raw.proto.send_abort(req)
                    await raw.flush()
                elif cut == "host_cut":
                    assert await src.release_unused_pins(cut_writes=True) == 0
                elif cut == "close":
                    session.close("closed by the test")
                else:
                    nursery.start_soon(restart_on_same_connection, raw, 99)
                if cut != "close":  # a close stops the run by the session's close_reason
                    await until(lambda: write.stopped)
                runs.gate.set()
            if cut == "abort":
                while not isinstance(ev := await raw.next_event(), AbortAcknowledged):
                    assert ev is not None, "the session ended before the abort_ack"
            elif cut == "host_cut":
                ev = await raw.next_event()
                assert isinstance(ev, TransferCompleted) and ev.req_id == req, ev
                assert set(ev.outcomes) == {Outcome.ABORTED}  # as the cut promises
            elif cut == "close":
                await raw.expect_close()
            else:
                _, again = await raw.lookup(keys)  # the new incarnation serves
                assert all(again)
            assert first.posts == 0
            assert runs.runs == 1  # the run that saw the cut was the last
            assert session.posts_refused == 0
            assert not raw.array.any()  # not one byte written into the consumer's region
            if cut != "restart":  # (the new incarnation's lookup holds its own pins)
                await until(lambda: src.statistics().pinned_slots == 0)
            assert src.data_wanted == 0
            await raw.aclose()
