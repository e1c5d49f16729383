"""A peer that is hostile, broken or crashing costs the others nothing.

Each malformed frame closes only its own session, with a typed reason in the bye, while
the node keeps serving a sibling peer whose transfer is in flight at that very moment.
"""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import trio

from p2pkv import Node, open_node
from p2pkv.session.protocol import LookupAnswered, TransferCompleted
from p2pkv.transport.base import RemotePeer, TransferHandle
from p2pkv.wire import FetchHits, Outcome, encode

from .helpers import FaultFactory, FaultTransport, RawPeer, config, fill, until_sessions


def frame(obj: object) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


K = os.urandom(32)
CORPUS: dict[str, bytes] = {
    "oversized": struct.pack(">I", 0xFFFFFFF0),
    "zero length": struct.pack(">I", 0),
    "not msgpack": struct.pack(">I", 1) + b"\xc1",
    "not a map": frame([1, 2, 3]),
    "unknown type": frame({"t": "teleport", "req_id": 1}),
    "missing field": frame({"t": "lookup", "req_id": 1}),
    "str for int": frame({"t": "lookup", "req_id": "1", "keys": [K]}),
    "bool for int": frame({"t": "lookup", "req_id": True, "keys": [K]}),
    "int for bool": frame({"t": "lookup_resp", "req_id": 1, "hits": [1]}),
    "str key": frame({"t": "lookup", "req_id": 1, "keys": ["text"]}),
    "negative id": frame({"t": "lookup", "req_id": -5, "keys": [K]}),
    "too many keys": frame({"t": "lookup", "req_id": 1, "keys": [K] * 70000}),
    "key too long": frame({"t": "lookup", "req_id": 1, "keys": [b"k" * 2000]}),
    "length mismatch": frame({"t": "fetch", "req_id": 1, "keys": [K, K], "slots": [1]}),
    "extension type": struct.pack(">I", 3) + b"\xd4\x05\x00",
    "answer to nothing": frame({"t": "lookup_resp", "req_id": 99, "hits": [True]}),
    "fetch without lookup": frame({"t": "fetch", "req_id": 1, "keys": [K], "slots": [0]}),
}


class SlowTransport(FaultTransport):
    """FAKE: completions are reported late, so a transfer stays in flight for a while."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.late_polls = 8


def slow_factory() -> FaultFactory:
    return FaultFactory(lambda t: setattr(t, "late_polls", 8))


async def sibling_fetch(node: Node, src: Node, keys: Sequence[bytes]) -> None:
    result = await node.fetch("src", keys)
    assert sorted(result.loaded) == sorted(keys), result.failed
    for k in keys:
        assert bytes(node.store.get(k) or b"") == bytes(src.store.get(k) or b"x")


@asynccontextmanager
async def hostile_beside_a_sibling(**raw_info: Any) -> AsyncIterator[tuple[Node, Node, RawPeer]]:
    """A node ``src`` (slow writes) serving a well-behaved sibling node ``dst``, and a
    hand-driven peer connected to ``src``, handshake done."""
    async with (
        open_node(config("src"), transport=slow_factory()) as src,
        open_node(config("dst")) as dst,
    ):
        await dst.connect(src.address)
        raw = RawPeer(**raw_info)
        await raw.connect(src.address)
        await raw.handshake()
        yield src, dst, raw


@pytest.mark.parametrize("name", sorted(CORPUS))
async def test_malformed_frame_closes_only_its_session(name: str) -> None:
    with trio.fail_after(20):
        async with hostile_beside_a_sibling() as (src, dst, raw):
            keys = fill(src.store, 16, 4096)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sibling_fetch, dst, src, keys)
                await raw.send_raw(CORPUS[name])
                bye = await raw.expect_close()
            assert bye is not None and bye.code == "protocol", bye
            assert bye.reason  # says why
            await raw.aclose()
            # The node keeps serving: the sibling again, and a new peer.
            more = fill(src.store, 4, 4096)
            await sibling_fetch(dst, src, more)
            assert src.statistics().peers == 1


async def test_fetch_into_slots_outside_the_region_is_refused() -> None:
    with trio.fail_after(20):
        async with open_node(config("src")) as src:
            keys = fill(src.store, 2, 4096)
            raw = RawPeer(num_blocks=8)
            await raw.connect(src.address)
            await raw.handshake()
            req, hits = await raw.lookup(keys)
            assert hits == [True, True]
            await raw.send_raw(
                frame({"t": "fetch", "req_id": req, "keys": keys, "slots": [1, 8]})
            )  # 8 is past the 8-block region
            bye = await raw.expect_close()
            assert bye is not None and bye.code == "protocol" and "slot" in bye.reason
            await raw.aclose()
            assert src.statistics().pinned_slots == 0  # the round's pins went with it


async def test_truncated_frame_then_disconnect_is_harmless() -> None:
    with trio.fail_after(20):
        async with open_node(config("src")) as src, open_node(config("dst")) as dst:
            raw = RawPeer()
            await raw.connect(src.address)
            await raw.handshake()
            assert src.statistics().sessions == 1
            await raw.send_raw(struct.pack(">I", 100) + b"\x81" * 10)
            await raw.aclose()
            # Its session ends (the frame never completes) and leaves nothing behind.
            await until_sessions(src, lambda: src.statistics().sessions == 0)
            assert src.statistics().pinned_slots == 0 and src.statistics().peers == 0
            keys = fill(src.store, 2, 4096)
            await dst.connect(src.address)
            await sibling_fetch(dst, src, keys)
            assert [p.peer_id for p in src.peers()] == ["dst"]


class CrashingTransport(FaultTransport):
    """FAKE: a bug of ours (not a transport error) while serving one particular peer."""

    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        if peer.agent_name == "victim":
            raise RuntimeError("simulated bug while serving victim")
        return super().post_write(peer, local_slots, remote_slots)


async def test_a_crashing_session_does_not_cancel_its_siblings() -> None:
    def factory(cfg: object, store: object) -> CrashingTransport:
        from p2pkv.store import BlockStore

        assert isinstance(store, BlockStore)
        t = CrashingTransport(agent_name="src", region=store.array, layout=store.layout)
        t.late_polls = 8
        return t

    with trio.fail_after(20):
        async with (
            open_node(config("src"), transport=factory) as src,
            open_node(config("dst")) as dst,
            open_node(config("victim")) as victim,
        ):
            keys = fill(src.store, 16, 4096)
            await dst.connect(src.address)
            await victim.connect(src.address)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sibling_fetch, dst, src, keys)
                result = await victim.fetch("src", keys[:2])
            assert result.loaded == []  # the victim's session died with the bug
            assert result.failed == dict.fromkeys(keys[:2], "transfer_failed")
            assert src.statistics().peers == 1  # dst only
            await sibling_fetch(dst, src, fill(src.store, 2, 4096))


async def test_a_fetch_hits_lands_the_rounds_hits_in_order_in_the_named_slots() -> None:
    """A hand-driven consumer fetches a round by its hits: the producer writes the i-th hit
    of its answer into ``slots[i]`` (the misses take no slot)."""
    with trio.fail_after(20):
        async with open_node(config("src")) as src:
            keys = fill(src.store, 3, 4096)
            absent = os.urandom(32)
            raw = RawPeer(num_blocks=8)
            await raw.connect(src.address)
            await raw.handshake()
            req = raw.proto.send_lookup([keys[2], absent, keys[0], keys[1]])
            await raw.flush()
            ev = await raw.next_event()
            assert isinstance(ev, LookupAnswered) and ev.hits == [True, False, True, True]
            raw.proto.send_fetch_hits(req, [6, 1, 4])
            await raw.flush()
            done = await raw.next_event()
            assert isinstance(done, TransferCompleted) and done.outcomes == [int(Outcome.OK)] * 3
            for key, slot in ((keys[2], 6), (keys[0], 1), (keys[1], 4)):
                landed = bytes(raw.array[slot * 4096 : (slot + 1) * 4096])
                assert landed == bytes(src.store.get(key) or b"")
            assert src.statistics().pinned_slots == 0
            await raw.aclose()


@pytest.mark.parametrize(
    ("slots", "match"), [([0], "1 slots for a round of 2"), ([3, 3], "duplicate")]
)
async def test_a_lying_fetch_hits_closes_only_its_session(slots: list[int], match: str) -> None:
    with trio.fail_after(20):
        async with hostile_beside_a_sibling(num_blocks=8) as (src, dst, raw):
            keys = fill(src.store, 2, 4096)
            req = raw.proto.send_lookup(keys)
            await raw.flush()
            assert isinstance(await raw.next_event(), LookupAnswered)
            assert src.statistics().pinned_slots == 2
            await raw.send_raw(encode(FetchHits(req_id=req, slots=slots)))
            bye = await raw.expect_close()
            assert bye is not None and bye.code == "protocol" and match in bye.reason, bye
            await raw.aclose()
            assert src.statistics().pinned_slots == 0  # the liar's round went with it
            more = fill(src.store, 4, 4096)
            await sibling_fetch(dst, src, more)  # the node keeps serving
            assert src.statistics().peers == 1
