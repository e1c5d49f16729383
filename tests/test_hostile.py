"""The fault-and-hostility suite: peers that die, freeze or lie, bytes that flip, frames
made of garbage, and connection churn. Each test names the guarantee it holds.

Fast by default (the whole file well under a minute on 2 cores). ``P2PKV_SLOW=1`` runs
every loop, repetition and Hypothesis example count 10 times over.

* Processes (marked ``nixl``: the real NIXL data plane, one node per process). A source
  child is SIGKILLed, or SIGSTOPped then SIGCONTed, while the node under test (in this
  process) has a lookup or a fetch out to it; a consumer child is SIGKILLed while this
  node's writes into it are in flight. To be *mid*-call for sure, the source is stopped
  before the request reaches it (a stopped process reads nothing) and the request is
  sent; then it is killed or continued.
* Bit flips: FAKE data plane (:class:`~tests.helpers.FaultTransport` ``flip_bits``) that
  lands chosen blocks with one bit flipped and reports them DONE.
* Decoder fuzzing: Hypothesis, against :class:`p2pkv.wire.FrameDecoder` alone.
* Churn: connect/disconnect cycles over the in-process transport, resources measured.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import os
import signal
import struct
import threading
import tracemalloc
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pkv import NodeConfig, P2PKVError, P2PKVTimeout, SessionClosed, open_node
from p2pkv.errors import RemoteProtocolError
from p2pkv.node import Node
from p2pkv.wire import HEADER, MAX_FRAME_SIZE, MESSAGE_TYPES, FrameDecoder, Message, encode

from .helpers import FaultFactory, config, fill, is_trio_cache_thread, until
from .node_proc import UCX_TCP, Children, NodeProcess, block_bytes, block_crc, block_key
from .test_wire import messages

SLOW = 10 if os.environ.get("P2PKV_SLOW") == "1" else 1
HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
requires_nixl = pytest.mark.skipif(
    not HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13 (or nixl-cu12)"
)
BLOCK = 64 * 1024
SETTLE = 10.0  # seconds: a bound for state to settle after an event, never an expectation


# ================================================================ processes (real NIXL)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` ("T": stopped, "Z": zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def freeze(child: NodeProcess) -> None:
    child.proc.send_signal(signal.SIGSTOP)
    await until(lambda: process_state(child.proc.pid) == "T")


async def thaw(child: NodeProcess) -> None:
    child.proc.send_signal(signal.SIGCONT)
    await until(lambda: process_state(child.proc.pid) != "T")


# Short settle times: a quarantine (and the abort deadline and landing margin it must
# exceed) that the tests can wait out.
SHORT_SETTLE = {"quarantine": 0.5, "abort_timeout": 0.2, "landing_margin": 0.2}


def hub_config(peer_id: str, num_blocks: int, **kw: Any) -> NodeConfig:
    return NodeConfig(
        peer_id=peer_id,
        transport="nixl",
        num_blocks=num_blocks,
        block_len=BLOCK,
        **(SHORT_SETTLE | kw),
    )


def clean(node: Node, *, peers: int) -> bool:
    """Nothing of a departed peer is left: sessions, registrations, handles, slots."""
    st = node.statistics()
    return (
        st.peers == st.sessions == st.registrations.live == st.transport.remote_peers == peers
        and st.transport.live_handles == st.inflight_transfers == 0
        and st.pinned_slots == st.reserved_slots == st.quarantined_slots == 0
    )


async def check_child_fetch(child: NodeProcess, peer: str, seed: int, start: int, n: int) -> None:
    """``child`` fetches blocks ``start..start+n`` of ``seed``: all load, byte-exact."""
    got = await child.call("fetch", peer=peer, seed=seed, start=start, count=n, shuffle=True)
    assert got["failed"] == {} and got["loaded"] == n, got["failed"]
    assert got["mismatched"] == []
    assert got["crcs"] == [block_crc(seed, i, BLOCK) for i in got["indexes"]]


def assert_loaded_byte_exact(node: Node, seed: int, keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        assert bytes(node.store.get(key) or b"") == block_bytes(seed, i, BLOCK), i


async def calls_in_flight(
    hub: Node, peer: str, keys: list[bytes], phase: str, results: dict[str, Any]
) -> None:
    """Start the calls the test interrupts: a fetch, plus (mid-lookup) a plain lookup;
    return once they wait for the peer. Outcomes (or errors) land in ``results``."""

    async def fetch() -> None:
        results["fetch"] = await hub.fetch(peer, keys)

    async def lookup() -> None:
        try:
            results["lookup"] = await hub.lookup(peer, keys)
        except P2PKVError as exc:
            results["lookup"] = exc

    nursery = results["nursery"]
    nursery.start_soon(fetch)
    if phase == "lookup":
        nursery.start_soon(lookup)
    if phase == "fetch":  # the fetch reuses the open round: its slots are reserved
        await until(lambda: hub.statistics().reserved_slots == len(keys))
    await trio.testing.wait_all_tasks_blocked()  # every request is out, waiting


@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("rep", range(SLOW))
@pytest.mark.parametrize("phase", ["lookup", "fetch"])
async def test_a_source_killed_mid_call_fails_its_keys_at_once_and_leaks_nothing(
    children: Children, phase: str, rep: int
) -> None:
    seed, n = 101 + rep, 32
    with trio.fail_after(60):
        src = await children.start("k-src", num_blocks=64, block_len=BLOCK, seed=seed, count=n)
        # Deadlines far past SETTLE: only the death can end the calls in time.
        cfg = hub_config(
            "k-hub",
            128,
            lookup_timeout=600,
            fetch_timeout=600,
        )
        async with open_node(cfg) as hub:
            peer = await hub.connect(src.address)
            keys = [block_key(seed, i) for i in range(n)]
            if phase == "fetch":
                assert await hub.lookup(peer, keys) == [True] * n
            await freeze(src)
            results: dict[str, Any] = {}
            with trio.fail_after(SETTLE):
                async with trio.open_nursery() as nursery:
                    results["nursery"] = nursery
                    await calls_in_flight(hub, "k-src", keys, phase, results)
                    src.kill()
            assert await src.proc.wait() == -signal.SIGKILL

            result = results["fetch"]
            assert result.loaded == [] and sorted(result.failed) == sorted(keys)
            reasons = set(result.failed.values())
            assert len(reasons) == 1, reasons
            if phase == "lookup":
                assert isinstance(results["lookup"], SessionClosed), results["lookup"]
                assert reasons.pop().startswith("lookup failed: session closed")
            else:
                assert reasons.pop().startswith("session closed")
            assert not any(k in hub.store for k in keys)
            # The fetch's slots sit out their quarantine (a write could still land), then
            # everything of the dead peer is gone and the store is as empty as before.
            with trio.fail_after(SETTLE):
                await until(lambda: clean(hub, peers=0))
            assert hub.statistics().store.free == 128


@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("rep", range(SLOW))
@pytest.mark.parametrize("phase", ["lookup", "fetch"])
async def test_a_source_stopped_mid_call_fails_its_keys_by_the_deadline_then_is_served_again(
    children: Children, phase: str, rep: int
) -> None:
    """While stopped, the source answers nothing: the calls end at their deadlines with
    per-key failures. Stopped for less than the idle timeout, it is *served again* after
    SIGCONT on the same session (the code's choice): the late answers to the aborted
    requests are dropped, the pins they made at the source are released, and a new fetch
    loads byte-exact."""
    seed, n, deadline = 201 + rep, 32, 1.0
    with trio.fail_after(60):
        src = await children.start("s-src", num_blocks=64, block_len=BLOCK, seed=seed, count=n)
        cfg = hub_config(
            "s-hub",
            128,
            lookup_timeout=deadline,
            fetch_timeout=deadline,
            idle_timeout=600,
            heartbeat_interval=300,
        )
        async with open_node(cfg) as hub:
            peer = await hub.connect(src.address)
            keys = [block_key(seed, i) for i in range(n)]
            if phase == "fetch":
                assert await hub.lookup(peer, keys) == [True] * n
            await freeze(src)
            results: dict[str, Any] = {}
            start = trio.current_time()
            with trio.fail_after(deadline + SETTLE):
                async with trio.open_nursery() as nursery:
                    results["nursery"] = nursery
                    await calls_in_flight(hub, "s-src", keys, phase, results)
            assert trio.current_time() - start >= deadline  # the deadline ended them

            result = results["fetch"]
            assert result.loaded == [] and sorted(result.failed) == sorted(keys)
            if phase == "lookup":
                assert isinstance(results["lookup"], P2PKVTimeout), results["lookup"]
                want = "lookup failed: lookup timed out"
                assert all(r.startswith(want) for r in result.failed.values()), result.failed
            else:
                assert set(result.failed.values()) == {"timeout"}
            assert not any(k in hub.store for k in keys)
            assert hub.statistics().reserved_slots == 0

            await thaw(src)
            with trio.fail_after(SETTLE):
                await until(lambda: clean(hub, peers=1))
                while (await src.call("stats"))["stats"]["pinned_slots"]:
                    await trio.sleep(0.01)
            assert [p.peer_id for p in hub.peers()] == ["s-src"]
            assert hub.statistics().registrations.started == 1  # the same session
            again = await hub.fetch(peer, keys)
            assert again.failed == {} and sorted(again.loaded) == sorted(keys)
            assert_loaded_byte_exact(hub, seed, keys)
            remote = await src.call("stats")
            assert remote["peers"] == ["s-hub"] and remote["stats"]["pinned_slots"] == 0


@pytest.mark.nixl
@requires_nixl
async def test_a_source_stopped_past_the_idle_timeout_is_dropped_cleanly_and_can_rejoin(
    children: Children,
) -> None:
    """Stopped for longer than the idle timeout, the source is *dropped* (the code's
    choice): the fetch fails, nothing of it stays here, and after SIGCONT it finds its
    session closed and can dial again."""
    seed, n = 301, 16
    with trio.fail_after(60):
        src = await children.start("d-src", num_blocks=64, block_len=BLOCK, seed=seed, count=n)
        cfg = hub_config(
            "d-hub",
            64,
            fetch_timeout=600,
            idle_timeout=1.0,
            heartbeat_interval=0.2,
        )
        async with open_node(cfg) as hub:
            peer = await hub.connect(src.address)
            keys = [block_key(seed, i) for i in range(n)]
            assert await hub.lookup(peer, keys) == [True] * n
            await freeze(src)
            with trio.fail_after(SETTLE):  # the idle timeout, not the fetch deadline
                result = await hub.fetch(peer, keys)
            assert result.loaded == [] and sorted(result.failed) == sorted(keys)
            with trio.fail_after(SETTLE):
                await until(lambda: clean(hub, peers=0))
            await thaw(src)
            # The source reads the fetch and then the end of its session; its pins go
            # at once, or after its quarantine if it had started writing.
            with trio.fail_after(SETTLE):
                while (remote := await src.call("stats"))["peers"] or remote["stats"][
                    "pinned_slots"
                ]:
                    await trio.sleep(0.01)
            assert (await src.call("connect", address=list(hub.address)))["peer"] == "d-hub"
            # The dialer's connect() returns once it has our ack; ours is ready once its
            # ack arrives, a moment later.
            with trio.fail_after(SETTLE):
                await until(lambda: [p.peer_id for p in hub.peers()] == ["d-src"])
            again = await hub.fetch("d-src", keys)
            assert again.failed == {}
            assert_loaded_byte_exact(hub, seed, keys)


@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("rep", range(SLOW))
async def test_a_consumer_killed_mid_write_costs_the_producer_only_that_peer(
    children: Children, monkeypatch: pytest.MonkeyPatch, rep: int
) -> None:
    # tcp: a write into a stopped process stalls (the socket buffers fill), so the
    # producer's writes are surely in flight when the consumer dies.
    tcp = {"UCX_TLS": UCX_TCP}
    monkeypatch.setenv("UCX_TLS", UCX_TCP)
    seed, n = 401 + rep, 512  # 32 MiB: far more than the socket buffers hold
    with trio.fail_after(90):
        victim = await children.start("w-victim", num_blocks=n, block_len=BLOCK, env=tcp)
        other = await children.start("w-other", num_blocks=64, block_len=BLOCK, env=tcp)
        async with open_node(hub_config("w-hub", n)) as hub:
            for i in range(n):
                hub.store.put(block_key(seed, i), block_bytes(seed, i, BLOCK))
            for child in (victim, other):
                assert (await child.call("connect", address=list(hub.address)))["peer"] == "w-hub"
            await check_child_fetch(other, "w-hub", seed, 0, 8)

            # Hold the producer's first post until the victim is stopped.
            entered, gate = threading.Event(), threading.Event()
            real_post = hub.transport.post_write

            def gated_post(*args: Any) -> Any:
                entered.set()
                assert gate.wait(60), "gate never opened"
                return real_post(*args)

            monkeypatch.setattr(hub.transport, "post_write", gated_post)
            try:
                await victim.channel.send(
                    {"op": "fetch", "peer": "w-hub", "seed": seed, "start": 0, "count": n}
                )
                assert await trio.to_thread.run_sync(entered.wait, SETTLE)
                await freeze(victim)
            finally:
                gate.set()
            with trio.fail_after(SETTLE):
                await until(lambda: hub.statistics().inflight_transfers >= 1)
            assert hub.statistics().pinned_slots == n  # still serving the victim
            victim.kill()
            assert await victim.proc.wait() == -signal.SIGKILL

            # The victim's pins (held for the quarantine if the writes did not settle),
            # registration and handles go; the other consumer keeps its session.
            with trio.fail_after(SETTLE):
                await until(lambda: clean(hub, peers=1))
            assert [p.peer_id for p in hub.peers()] == ["w-other"]
            await check_child_fetch(other, "w-hub", seed, 8, 64)
            remote = await other.call("stats")
            assert remote["peers"] == ["w-hub"]
            assert remote["stats"]["registrations"]["started"] == 1


# ================================================================ bit flips (FAKE data plane)

N_BLOCKS = 12
BIT = st.integers(0, 4096 * 8 - 1)


@settings(max_examples=15 * SLOW, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flips=st.dictionaries(st.integers(0, N_BLOCKS - 1), BIT, max_size=N_BLOCKS))
async def test_a_flipped_bit_is_a_failed_key_never_a_loaded_block(flips: dict[int, int]) -> None:
    """Invariant 1 with checksums on: every block that landed with a flipped bit is
    reported "checksum mismatch", is not in the store, and its slot went back; every
    other block loads byte-exact."""
    factory = FaultFactory()
    with trio.fail_after(20):
        async with (
            open_node(config("src", verify_checksums=True), transport=factory) as src,
            open_node(config("dst", verify_checksums=True)) as dst,
        ):
            keys = fill(src.store, N_BLOCKS, 4096)
            flipped = {keys[i] for i in flips}
            factory.transport.flip_bits = {
                src.store.slot_of(keys[i]) or 0: bit for i, bit in flips.items()
            }
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.failed == dict.fromkeys(flipped, "checksum mismatch")
            assert sorted(result.loaded) == sorted(set(keys) - flipped)
            for k in keys:
                if k in flipped:
                    assert k not in dst.store and dst.store.slot_of(k) is None
                else:
                    assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"?")
            st_ = dst.statistics()
            # The flipped keys' slots are quarantined, never freed on the producer's word.
            assert st_.reserved_slots == 0 and st_.quarantined_slots == len(flipped)
            assert st_.store.used == N_BLOCKS - len(flipped)
            assert st_.store.free == dst.config.num_blocks - st_.store.used - len(flipped)


async def test_the_bit_flip_fake_really_corrupts_what_it_lands() -> None:
    """Control for the test above: with checksums off, a flipped block *loads*, with
    exactly one bit different from the source's."""
    factory = FaultFactory()
    with trio.fail_after(20):
        async with (
            open_node(config("src"), transport=factory) as src,
            open_node(config("dst")) as dst,
        ):
            keys = fill(src.store, 2, 4096)
            factory.transport.flip_bits = {src.store.slot_of(keys[0]) or 0: 12345}
            result = await dst.fetch(await dst.connect(src.address), keys)
            assert sorted(result.loaded) == sorted(keys)
            got, want = bytes(dst.store.get(keys[0]) or b""), bytes(src.store.get(keys[0]) or b"")
            diff = int.from_bytes(got, "big") ^ int.from_bytes(want, "big")
            assert diff.bit_count() == 1


# ================================================================ decoder fuzzing

ALLOC_FACTOR, ALLOC_SLACK = 16, 1 << 20  # a frame may cost 16x its size in objects, +1 MiB


def decode_all(dec: FrameDecoder, data: bytes, cuts: list[int], peak: list[int]) -> list[Message]:
    """Feed ``data`` in pieces, pulling every message after each; ``peak[0]`` becomes the
    most bytes one ``next_message`` call allocated (also when it raises)."""
    got: list[Message] = []
    bounds = [0, *sorted(cuts), len(data)]
    for lo, hi in itertools.pairwise(bounds):
        dec.feed(data[lo:hi])
        while True:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                msg = dec.next_message()
            finally:
                peak[0] = max(peak[0], tracemalloc.get_traced_memory()[1] - base)
            if msg is None:
                break
            got.append(msg)
        # What stays buffered is at most one incomplete frame.
        assert dec.buffered < HEADER.size + dec.max_frame_size
    return got


def check_decoding(data: bytes, cuts: list[int], max_frame: int) -> None:
    """Only a validated message or the project's typed ``RemoteProtocolError`` may come
    out (any other exception fails the test as it is); after the error the decoder stays
    poisoned; no frame costs more than ALLOC_FACTOR times its size to decode."""
    dec = FrameDecoder(max_frame_size=max_frame)
    peak = [0]
    error: RemoteProtocolError | None = None
    msgs: list[Message] = []
    tracemalloc.start()
    try:
        msgs = decode_all(dec, data, cuts, peak)
    except RemoteProtocolError as exc:
        error = exc
    finally:
        tracemalloc.stop()
    assert peak[0] <= ALLOC_FACTOR * len(data) + ALLOC_SLACK, (peak[0], len(data))
    if error is not None:
        with pytest.raises(RemoteProtocolError) as again:
            dec.next_message()
        assert again.value is error
        with pytest.raises(RemoteProtocolError):
            dec.feed(b"\x00")
    for msg in msgs:  # anything that came out is a validated message
        assert type(msg) in MESSAGE_TYPES.values()
        redecoded = FrameDecoder()
        redecoded.feed(encode(msg))
        assert redecoded.next_message() == msg


cut_lists = st.lists(st.integers(0, 1 << 16), max_size=6)
frame_limits = st.sampled_from([16, 256, 4096, MAX_FRAME_SIZE])


@settings(max_examples=200 * SLOW, deadline=None)
@given(data=st.binary(max_size=4096), cuts=cut_lists, max_frame=frame_limits)
def test_random_bytes_decode_or_raise_the_typed_protocol_error(
    data: bytes, cuts: list[int], max_frame: int
) -> None:
    check_decoding(data, [c % (len(data) + 1) for c in cuts], max_frame)


packable_ints = st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack can carry


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame (or a few), then one mutation of the kinds a hostile peer sends."""
    frames = [encode(m) for m in draw(st.lists(messages, min_size=1, max_size=3))]
    data = b"".join(frames)
    kind = draw(
        st.sampled_from(["truncate", "flip", "insert", "delete", "retag", "retype", "length"])
    )
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind in ("flip", "insert", "delete"):
        i = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        if kind == "insert":
            return data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
        return data[:i] + data[i + draw(st.integers(1, 8)) :]
    body = msgpack.unpackb(frames[0][HEADER.size :], raw=False)
    if kind == "retag":
        body["t"] = draw(st.sampled_from([*MESSAGE_TYPES, "", "x" * 300]) | packable_ints)
    elif kind == "retype":
        field = draw(st.sampled_from(sorted(body)))
        body[field] = draw(
            st.none()
            | st.booleans()
            | packable_ints
            | st.floats()
            | st.text(max_size=20)
            | st.binary(max_size=20)
            | st.lists(packable_ints | st.binary(max_size=4) | st.booleans(), max_size=5)
            | st.dictionaries(st.text(max_size=4), packable_ints, max_size=3)
        )
    else:  # "length": the header lies about the body's size
        n = draw(st.integers(0, (1 << 32) - 1))
        return struct.pack(">I", n) + frames[0][HEADER.size :] + b"".join(frames[1:])
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed + b"".join(frames[1:])


@settings(max_examples=300 * SLOW, deadline=None)
@given(data=mutated_frames(), cuts=cut_lists, max_frame=frame_limits)
def test_mutated_frames_decode_or_raise_the_typed_protocol_error(
    data: bytes, cuts: list[int], max_frame: int
) -> None:
    check_decoding(data, [c % (len(data) + 1) for c in cuts], max_frame)


def test_a_small_frame_cannot_make_the_decoder_allocate_megabytes() -> None:
    """Issue 7 item 7: msgpack preallocates every list a header announces; a 3 KB frame
    of nested list headers cost ~80 MB before it was refused. Nothing nests any more."""
    body = b"\x81\xa1t" + b"\xdc\xff\xff" * 1000  # {"t": [[[... 65535-element arrays
    check_decoding(struct.pack(">I", len(body)) + body, [], MAX_FRAME_SIZE)


# ================================================================ connect/disconnect churn

CYCLES = 1000 * SLOW
WARM_UP = 50
RSS_SLACK = 8 << 20  # bytes: allocator and Trio bookkeeping noise, measured < 1.2 MiB


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not is_trio_cache_thread(t)}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_connect_disconnect_cycles_leave_fds_threads_and_memory_at_baseline() -> None:
    """1,000 cycles (10,000 with P2PKV_SLOW=1) of connect, lookup, disconnect between two
    nodes over the in-process transport: ~3 ms a cycle here. After them, open fds and the
    threads (Trio's worker cache aside) are exactly as before, and RSS within 8 MiB."""
    async with (
        open_node(config("a", transport="local")) as a,
        # Each of a's connections is a registration a asked b for: a far larger budget.
        open_node(config("b", transport="local", max_peer_registrations=1 << 20)) as b,
    ):
        keys = fill(b.store, 4, 4096)

        async def cycle() -> None:
            peer = await a.connect(b.address)
            assert await a.lookup(peer, keys) == [True] * 4
            await a.disconnect(peer)
            await until(lambda: not (a.statistics().sessions or b.statistics().sessions), 0.001)

        with trio.fail_after(30 * SLOW):
            for _ in range(WARM_UP):
                await cycle()
            gc.collect()
            fds, threads, mem = open_fds(), our_threads(), rss()
            for _ in range(CYCLES):
                await cycle()
            gc.collect()
        assert open_fds() == fds
        assert our_threads() == threads
        assert rss() - mem <= RSS_SLACK, f"RSS grew by {(rss() - mem) / 2**20:.1f} MiB"
        for node in (a, b):
            st_ = node.statistics()
            assert st_.registrations.live == st_.transport.remote_peers == 0
            assert st_.pinned_slots == st_.reserved_slots == 0
