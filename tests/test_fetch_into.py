"""``fetch_into``: keys land in slots the caller names (vLLM owns the memory).

Two nodes in one process (in-process transport, real TCP control), or a consumer node and
a producer played by hand (FAKE :class:`~tests.helpers.HandProducer`) where a test must see exactly
what was sent or must hold the producer's reply. Deadlines run on the autojump clock with
:class:`~tests.helpers.VirtualOffload`, and every time is read from ``trio.current_time()``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any
from unittest import mock

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from p2pkv import BlockingNode, FetchResult, LocalProtocolError, Node, SlotsInUse, open_node
from p2pkv.config import PROTOCOL_MINOR
from p2pkv.session import protocol
from p2pkv.session.protocol import FetchRequested, LookupRequested

from .helpers import (
    FaultFactory,
    HandProducer,
    RawPeer,
    VirtualOffload,
    config,
    fill,
    pair,
    wait_for,
)

BLOCK = 4096
BOUND = 20.0  # seconds: "this did not hang", never an expected duration
VIRTUAL_BOUND = 120.0  # the same on the autojump clock (virtual seconds)


def junk_region(node: Node) -> bytes:
    """Fill the node's whole region with random bytes; returns a copy to compare with."""
    node.store.array[:] = np.frombuffer(os.urandom(node.store.array.nbytes), np.uint8)
    return bytes(node.store.array)


def slot_bytes(node: Node, slot: int) -> bytes:
    return bytes(node.store.array[slot * BLOCK : (slot + 1) * BLOCK])


def assert_only_slots_changed(node: Node, before: bytes, slots: Sequence[int]) -> None:
    """Every slot outside ``slots`` still holds what it held before."""
    now = bytes(node.store.array)
    for s in range(node.config.num_blocks):
        if s not in slots:
            assert now[s * BLOCK : (s + 1) * BLOCK] == before[s * BLOCK : (s + 1) * BLOCK], (
                f"slot {s} was written"
            )


def assert_left_no_trace(dst: Node) -> None:
    """A fetch_into is over: nothing in the store's key map, no reservation, no
    quarantine, no slot still marked in use."""
    st = dst.statistics()
    assert len(dst.store) == 0, "fetch_into touched the store's key map"
    assert st.reserved_slots == 0 and st.quarantined_slots == 0
    assert dst.caller_slots == set()


async def wait_unpinned(src: Node) -> None:
    with trio.fail_after(BOUND):
        while src.statistics().pinned_slots:
            await trio.sleep(0.01)


# ---------------------------------------------------------------- a producer played by hand


@asynccontextmanager
async def hand_served(
    dst_kw: dict[str, Any] | None = None,
    *,
    n_blocks: int = 4,
    virtual: bool = False,
    minor: int = PROTOCOL_MINOR,
    max_keys_per_request: int | None = None,
    **producer_kw: Any,
) -> AsyncIterator[tuple[Node, HandProducer]]:
    """A consumer node ``dst`` connected to a :class:`HandProducer` holding ``n_blocks``
    random blocks; the producer runs for the duration of the block. ``minor``: the
    protocol version 1.``minor`` its hello claims; ``max_keys_per_request``: the keys per
    request it takes (a longer lookup is split into rounds)."""
    raw_info: dict[str, Any] = {}
    if max_keys_per_request is not None:
        raw_info["max_keys_per_request"] = max_keys_per_request
    raw = RawPeer(**raw_info)
    blocks = {os.urandom(32): os.urandom(BLOCK) for _ in range(n_blocks)}
    offload = VirtualOffload() if virtual else None
    async with open_node(config("dst", **(dst_kw or {})), offload=offload) as dst:
        await raw.connect(dst.address)
        with mock.patch.object(protocol, "PROTOCOL_MINOR", minor):
            await raw.handshake()
        producer = HandProducer(raw, dst, blocks, **producer_kw)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.run)
                yield dst, producer
                nursery.cancel_scope.cancel()
        finally:
            await raw.aclose()


# ---------------------------------------------------------------- fetch_hits


async def test_a_fetch_of_a_rounds_hits_names_the_round_and_a_fetch_of_part_names_keys() -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=4) as (dst, producer):
            peer = producer.raw.peer_id
            k0, k1, k2, k3 = producer.blocks
            absent = os.urandom(32)
            # A fetch that looks its keys up itself: the round's hits are the keys fetched.
            r = await dst.fetch(peer, [k0, absent, k1])
            assert sorted(r.loaded) == sorted([k0, k1]) and r.failed == {absent: "miss"}
            [first] = producer.sent(FetchRequested)
            assert producer.by_hits == [first.req_id] and first.keys == [k0, k1]
            for k in (k0, k1):
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]
            # Part of a round's hits: the keys are named.
            rnd = await dst.lookup_round(peer, [k2, k3])
            r = await dst.fetch(peer, [k3], rounds=rnd)
            assert r.loaded == [k3] and bytes(dst.store.get(k3) or b"") == producer.blocks[k3]
            second = producer.sent(FetchRequested)[-1]
            assert second.keys == [k3] and second.req_id not in producer.by_hits
            st = dst.statistics()
            assert len(dst.store) == 3 and st.reserved_slots == st.quarantined_slots == 0


async def test_a_held_round_fetched_in_its_order_is_named_and_in_another_order_is_keyed() -> None:
    """The producer writes a fetch_hits' slots in its round's order: a fetch of the same
    keys in another order must name them, or every block would land under another key."""
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=4) as (dst, producer):
            peer = producer.raw.peer_id
            keys = list(producer.blocks)
            rnd = await dst.lookup_round(peer, keys[:2])
            r = await dst.fetch(peer, keys[:2], rounds=rnd)
            assert sorted(r.loaded) == sorted(keys[:2])
            assert producer.by_hits == [rnd.req_ids[0]]
            rnd = await dst.lookup_round(peer, keys[2:])
            r = await dst.fetch(peer, keys[:1:-1], rounds=rnd)  # reversed
            assert sorted(r.loaded) == sorted(keys[2:])
            last = producer.sent(FetchRequested)[-1]
            assert last.keys == keys[:1:-1] and last.req_id not in producer.by_hits
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]


async def test_fetch_into_a_held_round_in_another_order_names_its_keys() -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=2) as (dst, producer):
            peer = producer.raw.peer_id
            k0, k1 = producer.blocks
            rnd = await dst.lookup_round(peer, [k0, k1])
            r = await dst.fetch_into(peer, [k1, k0], [9, 3], rounds=rnd)
            assert sorted(r.loaded) == sorted([k0, k1])
            [fetch] = producer.sent(FetchRequested)
            assert fetch.keys == [k1, k0] and producer.by_hits == []
            assert slot_bytes(dst, 9) == producer.blocks[k1]
            assert slot_bytes(dst, 3) == producer.blocks[k0]


async def test_a_lookup_split_into_rounds_fetches_each_round_by_hits_when_in_its_order() -> None:
    """Two rounds (the producer takes two keys per request): the one fetched in its order
    goes by hits, the one fetched in another order names its keys."""
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=4, max_keys_per_request=2) as (dst, producer):
            peer = producer.raw.peer_id
            k0, k1, k2, k3 = producer.blocks
            rnd = await dst.lookup_round(peer, [k0, k1, k2, k3])
            assert len(rnd.req_ids) == 2
            r = await dst.fetch(peer, [k1, k0, k2, k3], rounds=rnd)
            assert sorted(r.loaded) == sorted([k0, k1, k2, k3])
            fetches = {ev.req_id: ev.keys for ev in producer.sent(FetchRequested)}
            first, second = rnd.req_ids
            assert fetches == {first: [k1, k0], second: [k2, k3]}
            assert producer.by_hits == [second]
            for k in (k0, k1, k2, k3):
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]


async def test_a_third_fetch_of_the_keys_a_second_one_brings_in_waits_for_it() -> None:
    """Three fetches, each started once the one before has claimed its keys: X's keys,
    then Y's, then Z's, the same as Y's. Z waits for Y's transfer: every key is asked for
    once (mutation review 2026-12-06: a claim made once the claim index existed, left out
    of it, survived, since every test's sharing fetch shared the keys of the fetch that
    ran first; Z then fetched Y's keys a second time)."""
    with trio.fail_after(BOUND):
        hold = trio.Event()
        async with hand_served(n_blocks=4, hold=hold) as (dst, producer):
            peer = producer.raw.peer_id
            keys = list(producer.blocks)
            asked = {"x": keys[:2], "y": keys[2:], "z": keys[2:]}
            results: dict[str, FetchResult] = {}

            async def fetch(name: str) -> None:
                results[name] = await dst.fetch(peer, asked[name])

            async with trio.open_nursery() as nursery:
                for name in asked:
                    nursery.start_soon(fetch, name)
                    await trio.testing.wait_all_tasks_blocked()  # its claim is made
                hold.set()
            for name, ks in asked.items():
                assert results[name].loaded == ks and not results[name].failed
            fetched = [k for f in producer.sent(FetchRequested) for k in f.keys]
            assert sorted(fetched) == sorted(keys), "a key was fetched twice"
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]


async def test_a_producer_speaking_protocol_1_1_is_sent_the_keys() -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=2, minor=1) as (dst, producer):
            keys = list(producer.blocks)
            r = await dst.fetch(producer.raw.peer_id, keys)
            assert sorted(r.loaded) == sorted(keys)
            [fetch] = producer.sent(FetchRequested)
            assert producer.by_hits == [] and fetch.keys == keys
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]


# ---------------------------------------------------------------- landing


async def test_fetch_into_lands_the_producers_bytes_in_exactly_the_named_slots() -> None:
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            keys = fill(src.store, 5, BLOCK)
            slots = [9, 3, 63, 0, 40]  # scattered, out of order, both ends of the region
            before = junk_region(dst)
            peer = await dst.connect(src.address)
            r = await dst.fetch_into(peer, keys, slots)
            assert r.loaded == keys and r.failed == {}
            for k, s in zip(keys, slots, strict=True):
                want = src.store.get(k)
                assert want is not None and slot_bytes(dst, s) == bytes(want)
            assert_only_slots_changed(dst, before, slots)
            assert_left_no_trace(dst)
            await wait_unpinned(src)  # the producer closed the round


async def test_fetch_into_verifies_checksums_on_the_named_slots() -> None:
    """A block that lands with one bit flipped is a per-key failure, the others load. Its
    slot is suspect (the producer said its write settled, the bytes say otherwise), so the
    call returns only ``quarantine`` after the ``transfer_done``, not at once: the caller
    reuses its slots when it has the result (docs/design.md, "Withheld results")."""
    factory = FaultFactory()
    with trio.fail_after(BOUND):
        async with pair(
            {"verify_checksums": True}, {"verify_checksums": True}, src_transport=factory
        ) as (src, dst):
            keys = fill(src.store, 3, BLOCK)
            bad = src.store.slot_of(keys[1])
            assert bad is not None
            factory.transport.flip_bits = {bad: 77}
            peer = await dst.connect(src.address)
            start = trio.current_time()
            r = await dst.fetch_into(peer, keys, [7, 8, 9])
            assert trio.current_time() >= start + dst.config.quarantine
            assert r.loaded == [keys[0], keys[2]]
            assert r.failed == {keys[1]: "checksum mismatch"}
            for k, s in ((keys[0], 7), (keys[2], 9)):
                assert slot_bytes(dst, s) == bytes(src.store.get(k) or b"")
            assert_left_no_trace(dst)


async def test_fetch_into_looks_up_the_keys_no_round_holds_and_a_miss_fails_that_key() -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=3) as (dst, producer):
            k0, k1, k2 = producer.blocks
            absent = os.urandom(32)
            before = junk_region(dst)
            rnd = await dst.lookup_round(producer.raw.peer_id, [k0, k1])
            keys, slots = [k0, k1, k2, absent], [5, 6, 7, 8]
            r = await dst.fetch_into(producer.raw.peer_id, keys, slots, rounds=rnd)
            assert r.loaded == [k0, k1, k2]
            assert r.failed == {absent: "miss"}
            for k, s in zip(keys[:3], slots[:3], strict=True):
                assert slot_bytes(dst, s) == producer.blocks[k]
            assert_only_slots_changed(dst, before, slots[:3])  # the miss's slot untouched
            lookups = producer.sent(LookupRequested)
            assert [sorted(ev.keys) for ev in lookups] == [sorted([k0, k1]), sorted([k2, absent])]
            fetches = {ev.req_id: ev for ev in producer.sent(FetchRequested) if ev.keys}
            held = fetches[lookups[0].req_id]  # the held round served its own keys
            assert dict(zip(held.keys, held.slots, strict=True)) == {k0: 5, k1: 6}
            looked = fetches[lookups[1].req_id]  # the round looked up for the rest: the hit
            assert dict(zip(looked.keys, looked.slots, strict=True)) == {k2: 7}
            assert len(fetches) == 2
            assert await dst.release(producer.raw.peer_id, rnd) == 0  # the fetch used it
            assert_left_no_trace(dst)


# ---------------------------------------------------------------- refused before sending

_K = [b"k" * 32, b"l" * 32]


def _torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("make_call", "why"),
    [
        (lambda k: (k, [1]), "2 keys but 1 slots"),
        (lambda k: (k, [1, 64]), "in 0..63"),  # 64 is past the 64-block region
        (lambda k: (k, [-1, 1]), "in 0..63"),
        (lambda k: (k, [1, 1]), "slots distinct"),
        (lambda k: ([k[0], k[0]], [1, 2]), "keys must be distinct"),
        (lambda k: ([[1], [2]], [1, 2]), "keys must be bytes"),  # unhashable keys
        (lambda k: (k, [1.5, 2]), "slots must be integers"),  # never truncated to slot 1
        (lambda k: (k, ["1", 2]), "slots must be integers"),
        # A mask passed for slots: True, False landed the keys in slots 1 and 0.
        (lambda k: (k, [True, False]), "slots must be integers"),
        (lambda k: (k, np.array([True, False])), "slots must be integers"),
        # A torch bool tensor's elements are 0-d tensors, not bools, and their
        # ``__index__`` gives 1 and 0: the keys landed in slots 1 and 0 (review, 2026-12-07).
        (lambda k: (k, _torch().tensor([True, False])), "slots must be integers"),
        (lambda k: (k, _torch().tensor([1.0, 2.0])), "slots must be integers"),
    ],
    ids=[
        "lengths",
        "past_the_region",
        "negative",
        "slot_twice",
        "key_twice",
        "unhashable",
        "float_slot",
        "str_slot",
        "bool_slots",
        "numpy_bool_slots",
        "torch_bool_slots",
        "torch_float_slots",
    ],
)
async def test_bad_fetch_into_is_refused_before_anything_is_sent(
    make_call: Callable[[list[bytes]], tuple[list[Any], list[int]]], why: str
) -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=2) as (dst, producer):
            keys = list(producer.blocks)
            peer = producer.raw.peer_id
            bad_keys, bad_slots = make_call(keys)
            before = junk_region(dst)
            with pytest.raises(LocalProtocolError, match=why):
                await dst.fetch_into(peer, bad_keys, bad_slots)
            assert dst.caller_slots == set()  # a refused call keeps no slot
            assert_only_slots_changed(dst, before, [])
            # The session is usable, and the producer's first message is this fetch's
            # lookup: nothing was sent for the refused one.
            r = await dst.fetch_into(peer, keys, [1, 2])
            assert r.loaded == keys
            assert [type(ev) for ev in producer.log] == [LookupRequested, FetchRequested]
            assert producer.sent(LookupRequested)[0].keys == keys
            assert slot_bytes(dst, 1) == producer.blocks[keys[0]]
            assert slot_bytes(dst, 2) == producer.blocks[keys[1]]
            assert_left_no_trace(dst)


async def test_a_fetch_into_naming_a_slot_another_fetch_into_lands_in_is_refused() -> None:
    hold = trio.Event()
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=4, hold=hold) as (dst, producer):
            keys = list(producer.blocks)
            peer = producer.raw.peer_id
            results: list[FetchResult] = []

            async def first() -> None:
                results.append(await dst.fetch_into(peer, keys[:2], [4, 5]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await producer.fetched.wait()  # the first one's writes are under way
                assert dst.caller_slots == {4, 5}
                with pytest.raises(LocalProtocolError, match="free"):
                    await dst.fetch_into(peer, keys[2:], [5, 6])
                assert dst.caller_slots == {4, 5}  # the refusal freed nothing of the first
                hold.set()
            assert results[0].loaded == keys[:2]
            assert slot_bytes(dst, 5) == producer.blocks[keys[1]]
            # Nothing went out for the refused call: only the first one's lookup and fetch.
            assert [type(ev) for ev in producer.log] == [LookupRequested, FetchRequested]
            assert [ev.keys for ev in producer.sent(LookupRequested)] == [keys[:2]]
            assert [ev.keys for ev in producer.sent(FetchRequested)] == [keys[:2]]
            # Once the first one returned, the slot is free again.
            r = await dst.fetch_into(peer, keys[2:], [5, 6])
            assert r.loaded == keys[2:]
            assert slot_bytes(dst, 5) == producer.blocks[keys[2]]
            assert_left_no_trace(dst)


async def test_a_cancelled_fetch_into_keeps_its_slots_in_use_until_no_write_can_land(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller cancelled while the producer's writes are under way: its slots stay in use
    until the quarantine's end, so a second ``fetch_into`` naming them is refused meanwhile
    (a late write of the first would land over what the second reported loaded)."""
    hold = trio.Event()
    with trio.fail_after(VIRTUAL_BOUND):
        async with hand_served({"quarantine": 6.0}, virtual=True, hold=hold) as (dst, producer):
            keys = list(producer.blocks)
            peer = producer.raw.peer_id
            with trio.CancelScope() as scope:

                async def first() -> None:
                    await dst.fetch_into(peer, keys[:2], [1, 2])

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(first)
                    await producer.fetched.wait()  # its writes are under way: they may land
                    cut = trio.current_time()
                    scope.cancel()
            assert dst.caller_slots == {1, 2}
            with pytest.raises(LocalProtocolError, match="free"):
                await dst.fetch_into(peer, keys[2:], [2, 3])
            while dst.caller_slots:
                await trio.sleep(0.5)
            # Given back at the quarantine's end, not before.
            assert trio.current_time() >= cut + 6.0
            hold.set()
            r = await dst.fetch_into(peer, keys[2:], [2, 3])
            assert r.loaded == keys[2:]
            assert slot_bytes(dst, 2) == producer.blocks[keys[2]]


# ---------------------------------------------------------------- held until no write can land


async def test_fetch_into_from_a_producer_whose_writes_never_settle_returns_after_the_quarantine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))
    with trio.fail_after(VIRTUAL_BOUND):
        async with pair(
            {"abort_timeout": 1.0, "quarantine": 20.0},
            {"fetch_timeout": 4.0, "quarantine": 20.0},
            src_transport=hanging,
            virtual=True,
        ) as (src, dst):
            keys = fill(src.store, 4, BLOCK)
            peer = await dst.connect(src.address)
            start = trio.current_time()
            r = await dst.fetch_into(peer, keys, [10, 11, 12, 13])
            # Given up at the fetch deadline; returned only when the quarantine is over.
            assert trio.current_time() - start == pytest.approx(4.0 + 20.0, abs=0.1)
            assert r.loaded == [] and r.failed == dict.fromkeys(keys, "timeout")
            assert hanging.transport.posts == 1
            assert_left_no_trace(dst)


@pytest.mark.parametrize("how", ["producer_vanishes", "we_disconnect"])
async def test_fetch_into_cut_short_by_the_session_ending_returns_after_the_quarantine(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    vanish = how == "producer_vanishes"
    with trio.fail_after(VIRTUAL_BOUND):
        async with hand_served(
            {"fetch_timeout": 30.0, "quarantine": 6.0},
            virtual=True,
            vanish=vanish,
            hold=trio.Event(),
        ) as (dst, producer):
            keys = list(producer.blocks)
            peer = producer.raw.peer_id
            results: list[tuple[float, FetchResult]] = []

            async def fetch() -> None:
                r = await dst.fetch_into(peer, keys, [1, 2, 3, 4])
                results.append((trio.current_time(), r))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                await producer.fetched.wait()
                ending = trio.current_time()
                if not vanish:
                    await dst.disconnect(peer)
                while dst.statistics().sessions:
                    await trio.sleep(0.001)
                ended = trio.current_time()  # the fetch gave up between ending and ended
                assert results == []
            returned, r = results[0]
            # Not at the fetch deadline (30 s): the quarantine after the session's end.
            assert ending + 6.0 <= returned <= ended + 6.0 + 0.01
            assert r.loaded == [] and set(r.failed) == set(keys)
            assert_left_no_trace(dst)


# ---------------------------------------------------------------- the caller's deadline


async def test_fetch_into_within_gives_up_on_a_lookup_that_is_never_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Keys no round holds are looked up first; ``within`` bounds that lookup too (the
    lookup's own deadline, 60 s, would come much later). Nothing was posted, so nothing
    can land: the result comes at the give-up itself. ``within`` counts from the call,
    not from the clock's origin (mutation review 2026-12-05: taking it for a time on
    Trio's clock survived, the tests calling near virtual time 0)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with hand_served(
            {"lookup_timeout": 60.0, "fetch_timeout": 60.0, "quarantine": 6.0},
            virtual=True,
            lookups_answered=0,
        ) as (dst, producer):
            keys = list(producer.blocks)
            await trio.sleep(5.0)  # the call comes well past virtual time ``within``
            start = trio.current_time()
            r = await dst.fetch_into(producer.raw.peer_id, keys, [1, 2, 3, 4], within=3.0)
            assert trio.current_time() - start == pytest.approx(3.0, abs=0.1)
            assert r.loaded == [] and r.failed == dict.fromkeys(keys, "timed out")
            assert producer.asked.is_set() and producer.sent(FetchRequested) == []
            assert_left_no_trace(dst)


async def test_fetch_into_within_still_reports_loaded_the_keys_that_landed_before_the_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One key lands on a held round at once; the other's lookup is never answered and
    is cut at ``within``. The landed key is reported loaded (its slot holds its bytes),
    only the other "timed out", and a key failed before the cut keeps its own reason
    (mutation review 2026-12-06: the cut's "cancelled" for the undecided keys also
    overwrote the keys already loaded, and "timed out" every failure, and both survived:
    every ``within`` test cut every key)."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with hand_served(
            {"lookup_timeout": 60.0, "fetch_timeout": 60.0, "quarantine": 6.0},
            n_blocks=2,
            virtual=True,
        ) as (dst, producer):
            peer = producer.raw.peer_id
            k0, k1 = producer.blocks
            rnd = await dst.lookup_round(peer, [k0])
            producer.lookups_answered = 0  # k1's lookup is never answered
            start = trio.current_time()
            r = await dst.fetch_into(peer, [k0, b"", k1], [5, 6, 7], rounds=rnd, within=3.0)
            assert trio.current_time() - start == pytest.approx(3.0, abs=0.1)
            assert r.loaded == [k0] and r.failed == {b"": "empty key", k1: "timed out"}
            assert slot_bytes(dst, 5) == producer.blocks[k0]
            assert [f.keys for f in producer.sent(FetchRequested)] == [[k0]]
            assert_left_no_trace(dst)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "3"])
async def test_fetch_into_refuses_a_bad_within_before_anything_is_sent(bad: object) -> None:
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=1) as (dst, producer):
            with pytest.raises((ValueError, TypeError), match="within"):
                await dst.fetch_into(producer.raw.peer_id, list(producer.blocks), [1], within=bad)  # type: ignore[arg-type]
            assert producer.log == [] and dst.caller_slots == set()
            with pytest.raises(TypeError, match="an address"):
                await dst.fetch_into(dst.address, list(producer.blocks), [1])  # type: ignore[arg-type]


async def test_fetch_into_within_cuts_a_fetch_after_a_lookup_and_returns_a_quarantine_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The lookup took part of ``within``; the fetch after it is cut at ``within``, not at
    its own deadline, and the result waits out the quarantine of its slots."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with hand_served(
            {"fetch_timeout": 60.0, "quarantine": 6.0}, virtual=True, hold=trio.Event()
        ) as (dst, producer):
            keys = list(producer.blocks)
            start = trio.current_time()
            r = await dst.fetch_into(producer.raw.peer_id, keys, [1, 2, 3, 4], within=3.0)
            assert producer.fetched.is_set()
            assert trio.current_time() - start == pytest.approx(3.0 + 6.0, abs=0.1)
            assert r.loaded == [] and r.failed == dict.fromkeys(keys, "timed out")
            assert_left_no_trace(dst)


def test_the_facade_submits_fetch_into_and_releases_unused_pins(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 3, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    ticket = dst.submit_fetch_into(peer, keys[:2], [30, 20])
    wait_for(lambda: dst.pending() == 0)
    [(done, result)] = dst.get_finished()
    assert done == ticket and isinstance(result, FetchResult)
    assert result.loaded == keys[:2] and not result.failed
    for k, s in ((keys[0], 30), (keys[1], 20)):
        assert bytes(dst.store.array[s * BLOCK : (s + 1) * BLOCK]) == bytes(src.store.get(k) or b"")
    assert len(dst.store) == 0
    rnd = dst.lookup_round(peer, keys[2:], timeout=BOUND)
    assert rnd.hits == [True]
    assert src.release_unused_pins(timeout=BOUND) == 1
    assert src.statistics().pinned_slots == 0
    ticket = dst.submit_fetch_into(peer, keys[2:], [7], rounds=rnd)
    wait_for(lambda: dst.pending() == 0)
    [(done, result)] = dst.get_finished()
    assert done == ticket and isinstance(result, FetchResult)
    assert result.failed == {keys[2]: "not_pinned"}
    with pytest.raises(SlotsInUse):  # the region is the caller's now: the store's fetch
        dst.fetch(peer, keys[2:], timeout=BOUND)  # may not choose slots in it


# --- the region is the store's or the caller's, never both (2026-12-04) ------------------


async def test_fetch_into_refuses_a_region_whose_store_holds_a_block() -> None:
    """``fetch_into`` refused only slots another ``fetch_into`` used: one naming a slot
    where the node's own store kept a block overwrote it (found by a review). The store
    cannot know which slots a caller holds, so a node's region is one side's alone."""
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            peer = await dst.connect(src.address)
            (k,) = fill(src.store, 1, BLOCK)
            mine, data = os.urandom(32), os.urandom(BLOCK)
            slot = dst.store.put(mine, data)
            with pytest.raises(SlotsInUse, match="store holds"):
                await dst.fetch_into(peer, [k], [slot])
            assert bytes(dst.store.get(mine) or b"") == data
            assert src.statistics().pinned_slots == 0  # refused before anything was sent
            assert not dst.store.lent_to_caller


async def test_fetch_into_refuses_a_region_with_slots_in_quarantine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A store ``fetch`` gave up on writes that never settled: its slots (here the whole
    region) are quarantined, and a ``fetch_into`` naming one of them could report bytes
    loaded that the late write then overwrites (invariant 2). Found by a review."""
    hanging = FaultFactory(lambda t: setattr(t, "hang", True))
    with trio.fail_after(VIRTUAL_BOUND):
        async with pair(
            {"abort_timeout": 1.0, "quarantine": 20.0},
            # Both slots are the one peer's to quarantine.
            {"num_blocks": 2, "fetch_timeout": 4.0, "quarantine": 20.0, "max_landing_share": 1.0},
            src_transport=hanging,
            virtual=True,
        ) as (src, dst):
            keys = fill(src.store, 2, BLOCK)
            peer = await dst.connect(src.address)
            r = await dst.fetch(peer, keys)
            assert set(r.failed.values()) == {"timeout"}
            assert dst.statistics().quarantined_slots == 2
            hanging.transport.hang = False
            with pytest.raises(SlotsInUse):
                await dst.fetch_into(peer, keys[:1], [0])


async def test_once_fetch_into_has_the_region_the_store_chooses_no_slot_in_it() -> None:
    """After a ``fetch_into`` the caller holds slots the store knows nothing of: the
    store's ``put``, ``reserve`` and a store ``fetch`` refuse (they would choose slots),
    before anything is sent; reading and ``fetch_into`` go on."""
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            peer = await dst.connect(src.address)
            keys = fill(src.store, 2, BLOCK)
            r = await dst.fetch_into(peer, keys[:1], [9])
            assert r.loaded == keys[:1] and dst.store.lent_to_caller
            with pytest.raises(SlotsInUse):
                dst.store.put(os.urandom(32), os.urandom(BLOCK))
            with pytest.raises(SlotsInUse):
                dst.store.reserve(object(), 1)
            with pytest.raises(SlotsInUse):
                await dst.fetch(peer, keys[1:])
            assert src.statistics().pinned_slots == 0  # the fetch sent no lookup
            assert len(dst.store) == 0 and dst.statistics().reserved_slots == 0
            r = await dst.fetch_into(peer, keys[1:], [9])  # the caller reuses its slot
            assert r.loaded == keys[1:]
            want = bytes(src.store.get(keys[1]) or b"")
            assert bytes(dst.store.array[9 * BLOCK : 10 * BLOCK]) == want


# --- racing other uses of the region (review 2026-12-06, "fetch_into racing") -------------


@asynccontextmanager
async def second_producer(
    dst: Node,
    blocks: dict[bytes, bytes],
    peer_id: str | None = None,
    **producer_kw: Any,
) -> AsyncIterator[HandProducer]:
    """One more :class:`HandProducer` (FAKE, as that one) connected to ``dst``, serving
    ``blocks``; ``peer_id``: the id its hello claims (a restart of a peer reuses it)."""
    raw = RawPeer(peer_id)
    await raw.connect(dst.address)
    await raw.handshake()
    producer = HandProducer(raw, dst, blocks, **producer_kw)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.run)
            yield producer
            nursery.cancel_scope.cancel()
    finally:
        await raw.aclose()


@attrs.define
class UnderWay:
    """A ``fetch_into`` of producer ``a``'s first two keys whose writes are under way and
    held (:func:`a_fetch_into_under_way`); ``b`` serves the same blocks."""

    dst: Node
    a: HandProducer
    b: HandProducer
    keys: list[bytes]
    hold: trio.Event
    done: trio.Event
    results: list[FetchResult] = attrs.field(factory=list)

    async def finish(self) -> FetchResult:
        """Let the writes settle; the first call's result once it returned."""
        self.hold.set()
        await self.done.wait()
        return self.results[0]


@asynccontextmanager
async def a_fetch_into_under_way(slots: list[int]) -> AsyncIterator[UnderWay]:
    """Three keys at producer ``a`` (a second producer ``b`` serving them too) and a
    ``fetch_into`` of the first two into ``slots``, yielded once ``a`` has its request
    and is writing; the writes settle when the body calls :meth:`UnderWay.finish`."""
    hold = trio.Event()
    async with (
        hand_served(n_blocks=3, hold=hold) as (dst, a),
        second_producer(dst, dict(a.blocks)) as b,
    ):
        w = UnderWay(dst, a, b, list(a.blocks), hold, trio.Event())

        async def first() -> None:
            w.results.append(await dst.fetch_into(a.raw.peer_id, w.keys[:2], slots))
            w.done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await a.fetched.wait()  # a's writes are under way
            yield w
            await w.finish()


async def test_a_first_fetch_into_while_a_store_fetch_awaits_its_producer_is_refused() -> None:
    """A store ``fetch`` has reserved its slots and sent its request; the producer has not
    answered. The first ``fetch_into`` of the node, naming those very slots or others, is
    ``SlotsInUse`` before anything is sent: lent now, the store fetch's write and the
    caller's would both own a slot. The store fetch then lands as if nothing happened."""
    hold = trio.Event()
    with trio.fail_after(BOUND):
        async with hand_served(n_blocks=4, hold=hold) as (dst, producer):
            keys = list(producer.blocks)
            peer = producer.raw.peer_id
            results: list[FetchResult] = []

            async def store_fetch() -> None:
                results.append(await dst.fetch(peer, keys[:2]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(store_fetch)
                await producer.fetched.wait()  # reserved, sent, not answered
                (sent,) = producer.sent(FetchRequested)
                reserved = [int(s) for s in sent.slots]
                assert dst.statistics().reserved_slots == 2
                others = [s for s in range(dst.config.num_blocks) if s not in reserved][:2]
                for slots in (reserved, others, [reserved[0], others[0]]):
                    with pytest.raises(SlotsInUse, match="store holds"):
                        await dst.fetch_into(peer, keys[2:], slots)
                    assert dst.caller_slots == set() and not dst.store.lent_to_caller
                hold.set()
            assert results[0].loaded == keys[:2]
            for k in keys[:2]:
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]
            # Nothing went out for the refused calls.
            assert [type(ev) for ev in producer.log] == [LookupRequested, FetchRequested]
            # The store holds blocks now: still the store's region.
            with pytest.raises(SlotsInUse, match="store holds"):
                await dst.fetch_into(peer, keys[2:], others)


async def test_a_fetch_into_naming_a_slot_another_peers_fetch_into_lands_in_is_refused() -> None:
    """Two sessions, the same key named in both, overlapping slots: the slots in use are
    the node's, not the session's, so the second call is refused before anything goes to
    its peer, and the first one's bytes are what its slot holds."""
    with trio.fail_after(BOUND):
        async with a_fetch_into_under_way([4, 5]) as w:
            dst, a, b, keys = w.dst, w.a, w.b, w.keys
            with pytest.raises(LocalProtocolError, match="free"):
                await dst.fetch_into(b.raw.peer_id, [keys[1], keys[2]], [5, 6])
            assert b.log == []  # nothing was sent to b
            assert dst.caller_slots == {4, 5}
            assert (await w.finish()).loaded == keys[:2]
            assert slot_bytes(dst, 5) == a.blocks[keys[1]]
            r = await dst.fetch_into(b.raw.peer_id, [keys[2], keys[1]], [5, 6])
            assert r.loaded == [keys[2], keys[1]]
            assert slot_bytes(dst, 5) == b.blocks[keys[2]]
            assert slot_bytes(dst, 6) == b.blocks[keys[1]]
            assert_left_no_trace(dst)


@pytest.mark.parametrize("who", ["the_same_peer_back", "another_peer"])
async def test_slots_of_a_fetch_into_whose_session_died_mid_landing_stay_in_use_for_every_session(
    autojump_clock: trio.testing.MockClock, who: str
) -> None:
    """The producer's process dies after our fetch request went out (its writes may still
    land until the quarantine's end). A ``fetch_into`` naming those slots on another
    session, the same peer id reconnected or another peer, is refused until then, and
    lands once they are free."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with hand_served(
            {"fetch_timeout": 30.0, "quarantine": 6.0}, virtual=True, vanish=True
        ) as (dst, producer):
            keys = list(producer.blocks)
            results: list[FetchResult] = []

            async def first() -> None:
                results.append(await dst.fetch_into(producer.raw.peer_id, keys[:2], [1, 2]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await producer.fetched.wait()
                while dst.statistics().sessions:
                    await trio.sleep(0.001)
                assert producer.vanished_at is not None
                peer_id = producer.raw.peer_id if who == "the_same_peer_back" else None
                async with second_producer(dst, dict(producer.blocks), peer_id) as b:
                    assert dst.is_connected(b.raw.peer_id)
                    assert dst.caller_slots == {1, 2}
                    with pytest.raises(LocalProtocolError, match="free"):
                        await dst.fetch_into(b.raw.peer_id, keys[2:], [2, 3])
                    assert b.log == []
                    while dst.caller_slots:
                        await trio.sleep(0.5)
                    assert trio.current_time() >= producer.vanished_at + 6.0
                    assert results and results[0].loaded == []
                    r = await dst.fetch_into(b.raw.peer_id, keys[2:], [2, 3])
                    assert r.loaded == keys[2:]
                    assert slot_bytes(dst, 2) == b.blocks[keys[2]]
                    assert_left_no_trace(dst)


async def test_while_a_fetch_into_lands_the_store_chooses_no_slot_in_the_region() -> None:
    """A ``fetch_into`` into slots 0 and 1 (the first the store would hand out) is under
    way: the host's ``put``, an engine ``reserve`` and a store ``fetch`` from another peer
    are ``SlotsInUse`` and change nothing; the caller's slots get the producer's bytes."""
    with trio.fail_after(BOUND):
        async with a_fetch_into_under_way([0, 1]) as w:
            dst, a, b, keys = w.dst, w.a, w.b, w.keys
            with pytest.raises(SlotsInUse):
                await trio.to_thread.run_sync(dst.store.put, os.urandom(32), os.urandom(BLOCK))
            with pytest.raises(SlotsInUse):
                dst.store.reserve(object(), 1)
            with pytest.raises(SlotsInUse):
                await dst.fetch(b.raw.peer_id, keys[2:])
            assert b.log == []
            assert dst.store.evict(keys[0]) is False  # the store maps nothing
            assert (await w.finish()).loaded == keys[:2]
            assert slot_bytes(dst, 0) == a.blocks[keys[0]]
            assert slot_bytes(dst, 1) == a.blocks[keys[1]]
            assert_left_no_trace(dst)
