"""Two nodes in one process over the in-process transport: the public API end to end."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import re
import threading
from collections.abc import Callable
from typing import Any, Literal

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import p2pkv
from p2pkv import BlockStore, HandshakeRejected, Node, PeerUnavailable, open_node
from p2pkv.errors import SessionClosed
from p2pkv.transport.base import RegionLayout, RemotePeer, TransportStatistics
from p2pkv.wire import U64_MAX

from .helpers import (
    FaultFactory,
    FaultTransport,
    RawPeer,
    VirtualOffload,
    config,
    fill,
    pair,
    until,
)


async def test_fetched_bytes_equal_source_and_misses_never_load() -> None:
    with trio.fail_after(20):
        async with open_node(config("src")) as src, open_node(config("dst")) as dst:
            present = fill(src.store, 40, 4096)
            absent = [os.urandom(32) for _ in range(10)]
            keys = present + absent
            random.shuffle(keys)
            peer = await dst.connect(src.address)
            assert peer.peer_id == "src"
            hits = await dst.lookup(peer, keys)
            assert hits == [k in set(present) for k in keys]
            result = await dst.fetch(peer, keys)
            assert sorted(result.loaded) == sorted(present)
            assert set(result.failed) == set(absent)
            assert set(result.failed.values()) == {"miss"}
            for k in present:
                got, want = dst.store.get(k), src.store.get(k)
                assert got is not None and want is not None
                assert bytes(got) == bytes(want)
            for k in absent:
                assert k not in dst.store


async def test_lookup_pins_hits_until_the_fetch_closes_the_round() -> None:
    with trio.fail_after(20):
        async with open_node(config("src")) as src, open_node(config("dst")) as dst:
            keys = fill(src.store, 8, 4096)
            peer = await dst.connect(src.address)
            await dst.lookup(peer, keys[:5])
            assert src.statistics().pinned_slots == 5
            # An evicting put pressure cannot take a pinned slot.
            assert all(src.store.evict(k) is False for k in keys[:5])
            result = await dst.fetch(peer, keys[:3])  # reuses the open round, closes it
            assert sorted(result.loaded) == sorted(keys[:3])
            assert src.statistics().pinned_slots == 0
            assert dst.statistics().reserved_slots == 0


async def test_fetch_scattered_destination_slots_large_batch() -> None:
    with trio.fail_after(30):
        cfg_s = config("src", num_blocks=512, block_len=8192)
        cfg_d = config("dst", num_blocks=512, block_len=8192, transfer_chunk_bytes=64 * 8192)
        async with open_node(cfg_s) as src, open_node(cfg_d) as dst:
            # Occupy destination slots in a scattered pattern first.
            filler = fill(dst.store, 200, 8192)
            for k in filler[::2]:
                dst.store.evict(k)
            keys = fill(src.store, 300, 8192)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert not result.failed
            slots = [dst.store.slot_of(k) for k in keys]
            assert None not in slots
            assert slots != sorted(s for s in slots if s is not None)  # really scattered
            for k in keys:
                assert bytes(dst.store.get(k) or b"") == bytes(src.store.get(k) or b"x")


async def test_checksums_reject_bytes_that_differ_from_the_producer() -> None:
    """Invariant 1: a data plane that reports DONE but wrote other bytes loads nothing."""
    corrupting = FaultFactory(lambda t: setattr(t, "corrupt", True))
    with trio.fail_after(20):
        async with (
            open_node(config("src", verify_checksums=True), transport=corrupting) as src,
            open_node(config("dst", verify_checksums=True)) as dst,
        ):
            keys = fill(src.store, 6, 4096)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.loaded == []
            assert set(result.failed.values()) == {"checksum mismatch"}
            assert all(k not in dst.store for k in keys)
            # Not freed on the producer's word: its write may not have settled.
            st = dst.statistics()
            assert st.quarantined_slots == len(keys) and st.reserved_slots == 0
            assert st.store.free == dst.config.num_blocks - len(keys)


async def test_checksums_accept_correct_bytes() -> None:
    with trio.fail_after(20):
        async with (
            open_node(config("src", verify_checksums=True)) as src,
            open_node(config("dst", verify_checksums=True)) as dst,
        ):
            keys = fill(src.store, 6, 4096)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert sorted(result.loaded) == sorted(keys)


async def test_a_consumer_that_verifies_loads_nothing_a_producer_sent_without_checksums() -> None:
    """Checksums on here and off at the producer (or a producer that leaves them out):
    the bytes may well be right, but nothing vouches for them, so nothing is committed,
    and the reason says what to change."""
    with trio.fail_after(20):
        async with (
            open_node(config("src")) as src,
            open_node(config("dst", verify_checksums=True)) as dst,
        ):
            keys = fill(src.store, 4, 4096)
            peer = await dst.connect(src.address)
            result = await dst.fetch(peer, keys)
            assert result.loaded == []
            reasons = set(result.failed.values())
            assert len(reasons) == 1 and "producer sent no checksums" in reasons.pop()
            assert all(k not in dst.store for k in keys)
            st = dst.statistics()
            assert st.quarantined_slots == len(keys) and st.reserved_slots == 0
            assert st.store.free == dst.config.num_blocks - len(keys)


async def test_failed_posts_are_per_key_failures_and_slots_are_freed() -> None:
    failing = FaultFactory()
    with trio.fail_after(20):
        async with (
            open_node(config("src"), transport=failing) as src,
            open_node(config("dst")) as dst,
        ):
            keys = fill(src.store, 4, 4096)
            peer = await dst.connect(src.address)
            failing.transport.post_error = p2pkv.TransportError("refused")
            result = await dst.fetch(peer, keys)
            assert result.loaded == []
            assert set(result.failed.values()) == {"transfer_failed"}
            assert dst.statistics().reserved_slots == 0
            # Its transfer_done says the writes settled (failed): the slots are free at
            # once, and a fetch_into would return at once (docs/design.md).
            assert dst.statistics().quarantined_slots == 0
            assert src.statistics().pinned_slots == 0


async def test_a_peer_whose_writes_the_data_plane_refuses_is_warned_of_once_a_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every fetch the peer sent whose writes the data plane refused (a peer whose data
    plane metadata NIXL cannot write to, say) logged a WARNING, one a chunk: a peer
    could make us log at its request rate. The first of a session is a WARNING, the
    rest are DEBUG. Found by a review (2026-12-05)."""
    caplog.set_level(logging.DEBUG, logger="p2pkv")
    failing = FaultFactory()
    with trio.fail_after(20):
        async with (
            open_node(config("src"), transport=failing) as src,
            open_node(config("dst")) as dst,
        ):
            keys = fill(src.store, 4, 4096)
            peer = await dst.connect(src.address)
            failing.transport.post_error = p2pkv.TransportError("refused")
            for _ in range(10):
                result = await dst.fetch(peer, keys)
                assert set(result.failed.values()) == {"transfer_failed"}
    posts = [r for r in caplog.records if "posting writes" in r.getMessage()]
    assert len(posts) >= 10, posts
    assert [r.levelno for r in posts if r.levelno > logging.DEBUG] == [logging.WARNING]


async def test_connect_refused_is_peer_unavailable() -> None:
    with trio.fail_after(10):
        async with open_node(config("a")) as a:
            listener = trio.socket.socket()
            await listener.bind(("127.0.0.1", 0))
            port = listener.getsockname()[1]
            listener.close()  # nothing listens there now
            with pytest.raises(PeerUnavailable):
                await a.connect(("127.0.0.1", port))


@pytest.mark.parametrize(
    "host", ["a" * 64, "x..y", "\udcff"], ids=["long-label", "empty", "surrogate"]
)
async def test_a_host_no_name_can_have_is_peer_unavailable_naming_it(host: str) -> None:
    """A host name IDNA cannot encode (a label over 63 characters, an empty one, a lone
    surrogate) made ``connect`` raise the resolver's bare ``UnicodeError`` ("encoding with
    'idna' codec failed"), naming no host, where any other name that resolves to nothing
    is ``PeerUnavailable``; ``p2pkv fetch HOST:PORT`` printed it as a traceback (errors
    review 2026-12-05). A node configured to listen on such a name raised it too, where
    any other is the ``OSError`` "cannot listen on HOST:PORT" (a config refuses the lone
    surrogate already)."""
    with trio.fail_after(10):
        async with open_node(config("a")) as a:
            with pytest.raises(PeerUnavailable, match="cannot connect to") as info:
                await a.connect((host, 5710))
            assert isinstance(info.value.__cause__, UnicodeError)
            assert a.statistics().sessions == 0
        if host.isprintable():
            with pytest.raises(OSError, match=f"cannot listen on {re.escape(host)}:0: ") as listen:
                async with open_node(attrs.evolve(config("b"), host=host)):
                    pass
            # An invalid argument, as for any OSError a caller may sort by its errno (it was
            # None, "[Errno None]" in its text: mutation pass 2026-12-06).
            assert listen.value.errno == errno.EINVAL


BAD_ADDRESSES = [
    ("127.0.0.1:5710", TypeError),  # was indexed as a pair: host "1", port 2
    (b"127.0.0.1:5710", TypeError),
    (("127.0.0.1",), TypeError),
    (("127.0.0.1", 5710, 0), TypeError),
    (None, TypeError),
    (("", 5710), TypeError),
    ((5710, "127.0.0.1"), TypeError),
    (("127.0.0.1", "5710"), TypeError),
    (("127.0.0.1", 5710.0), TypeError),
    (("127.0.0.1", True), TypeError),
    (("127.0.0.1", 0), ValueError),
    (("127.0.0.1", 65536), ValueError),
]


@pytest.mark.parametrize(("address", "error"), BAD_ADDRESSES, ids=repr)
async def test_connect_refuses_what_is_not_a_host_port_pair(
    address: object, error: type[Exception]
) -> None:
    with trio.fail_after(10):
        async with open_node(config("a")) as a:
            with pytest.raises(error, match="address"):
                await a.connect(address)  # type: ignore[arg-type]
            assert a.statistics().sessions == 0  # nothing was dialed


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("fingerprint", "other-model", "fingerprint"),
        ("hash_seed", b"x", "hash"),
        ("block_len", 8192, "block length"),
    ],
)
async def test_incompatible_peers_are_rejected_with_the_reason(
    field: str, value: object, reason: str
) -> None:
    with trio.fail_after(10):
        async with open_node(config("a")) as a, open_node(config("b", **{field: value})) as b:
            with pytest.raises(HandshakeRejected) as info:
                await b.connect(a.address)
            assert reason in info.value.reason
            assert a.statistics().peers == 0 and b.statistics().peers == 0
            assert a.statistics().registrations.live == 0


async def test_authentication_with_a_shared_secret() -> None:
    with trio.fail_after(10):
        async with (
            open_node(config("a", secret=b"s3cret")) as a,
            open_node(config("b", secret=b"s3cret")) as b,
            open_node(config("c", secret=b"wrong")) as c,
            open_node(config("d")) as d,
        ):
            keys = fill(a.store, 2, 4096)
            peer = await b.connect(a.address)
            assert (await b.fetch(peer, keys)).loaded
            with pytest.raises(HandshakeRejected, match="authentication"):
                await c.connect(a.address)
            with pytest.raises(HandshakeRejected, match="authentication"):
                await d.connect(a.address)
            assert a.statistics().peers == 1


async def test_close_is_idempotent_and_leaves_nothing_behind() -> None:
    """Closing leaves nothing behind, and so does each of several closes, concurrent ones
    too: a close that finds another under way returns only once that one is done."""
    factory = FaultFactory()
    with trio.fail_after(20):
        async with open_node(config("b")) as b:
            async with open_node(config("a"), transport=factory) as a:
                keys = fill(a.store, 4, 4096)
                peer = await b.connect(a.address)
                await b.lookup(peer, keys)  # leaves pins at a
                assert a.statistics().pinned_slots == 4
                left: list[tuple[int, int]] = []

                async def close() -> None:
                    await a.aclose()
                    st = a.statistics()
                    left.append((st.sessions, st.pinned_slots))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(close)
                    nursery.start_soon(close)
                await close()
                assert left == [(0, 0)] * 3
            t = factory.transport
            assert t.adds == t.removes == 1 and not t.live
            assert t.statistics().remote_peers == 0 and t.statistics().live_handles == 0
            with trio.fail_after(5):
                while b.statistics().peers:
                    await trio.sleep(0.01)
            with pytest.raises(PeerUnavailable):
                await b.lookup(peer, keys)


async def test_a_session_out_of_request_ids_ends_and_a_new_one_starts_afresh() -> None:
    """A session's request ids only go up (u64 on the wire), so a session that used
    U64_MAX has none left. The lookup after it raised a bare ``OverflowError`` from the
    encoder, counting the request open and keeping its request slot: every later lookup
    the same, and the session stayed up, stuck. Now that lookup ends the session
    (``SessionClosed``), and a new session starts again from request id 1."""
    with trio.fail_after(20):
        async with pair() as (src, dst):
            keys = fill(src.store, 3, 4096)
            peer = await dst.connect(src.address)
            session = dst._by_peer["src"]
            session.proto._next_req_id = U64_MAX - 1  # as after 2**64 - 2 requests
            for key in keys[:2]:  # the last two ids work as any other
                assert (await dst.fetch(peer, [key])).loaded == [key]
            with pytest.raises(SessionClosed, match="request ids"):
                await dst.lookup(peer, keys[2:])
            await session.finished.wait()
            assert not dst.is_connected("src")
            peer = await dst.connect(src.address)
            assert dst._by_peer["src"].proto.activity[0] == 1
            assert (await dst.fetch(peer, keys[2:])).loaded == keys[2:]


async def test_a_split_lookup_with_fewer_request_ids_left_than_rounds_ends_the_session() -> None:
    """A lookup split into rounds takes a request id per round. With fewer left than it
    needs, the session ends (``SessionClosed``) before any round is sent, as for a lookup
    of one round, and a new session serves the keys. Mutation pass on the session logic
    (2026-12-06): the split lookup's own check of the ids left, or one counting a single
    round, survived: its first round took the last id and the second raised
    ``LocalProtocolError``, the session staying up with no id left."""
    with trio.fail_after(20):
        async with pair({"max_keys_per_request": 2}) as (src, dst):
            keys = fill(src.store, 3, 4096)  # two rounds at this peer
            peer = await dst.connect(src.address)
            session = dst._by_peer["src"]
            session.proto._next_req_id = U64_MAX  # one id left, as after 2**64 - 2 requests
            with pytest.raises(SessionClosed, match="request ids"):
                await dst.lookup(peer, keys)
            await session.finished.wait()
            assert not dst.is_connected("src")
            peer = await dst.connect(src.address)
            assert (await dst.fetch(peer, keys)).loaded == keys


async def test_disconnect_returns_once_the_session_is_torn_down() -> None:
    """``disconnect`` returns with the session torn down, not merely asked to close: its
    registration of the peer is released by then (a disconnect that returned at once
    left it registered behind the caller's back; mutation review 2026-12-05)."""
    with trio.fail_after(20):
        async with pair() as (src, dst):
            keys = fill(src.store, 2, 4096)
            peer = await dst.connect(src.address)
            assert len((await dst.fetch(peer, keys)).loaded) == 2
            assert dst.statistics().registrations.live == 1
            await dst.disconnect(peer)
            st = dst.statistics()
            assert not dst.is_connected("src") and st.registrations.live == 0, st


async def test_concurrent_disconnects_each_return_once_the_session_is_torn_down() -> None:
    """Two disconnects of one peer at once: both return with the session torn down and
    its registration released (the second raised "not connected" at once, while the
    first was still tearing it down and the peer was still registered)."""
    with trio.fail_after(20):
        async with pair() as (src, dst):
            peer = await dst.connect(src.address)
            assert dst.statistics().registrations.live == 1
            live_after: list[int] = []

            async def disconnect() -> None:
                await dst.disconnect(peer)
                live_after.append(dst.statistics().registrations.live)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(disconnect)
                nursery.start_soon(disconnect)
            assert live_after == [0, 0]
            with pytest.raises(PeerUnavailable, match="not connected"):
                await dst.disconnect(peer)


async def test_restarted_peer_with_the_same_id_is_served_again() -> None:
    with trio.fail_after(20):
        async with open_node(config("b")) as b:
            async with open_node(config("a")) as a1:
                peer = await b.connect(a1.address)
                keys = fill(a1.store, 3, 4096)
                assert len((await b.fetch(peer, keys)).loaded) == 3
            async with open_node(config("a")) as a2:
                keys2 = fill(a2.store, 3, 4096)
                peer2 = await b.connect(a2.address)
                assert peer2.peer_id == "a"
                assert sorted((await b.fetch(peer2, keys2)).loaded) == sorted(keys2)
                assert b.statistics().peers == 1
                assert b.statistics().registrations.live == 1


async def test_a_restarted_peer_supersedes_its_silent_old_session() -> None:
    """A new epoch from a known peer id replaces the old session (torn down first) when
    the old one no longer answers: the peer restarted and its old connection is dead but
    not yet closed."""
    with trio.fail_after(20):
        async with open_node(config("a", probe_timeout=0.2)) as a:
            old = RawPeer("b")
            await old.connect(a.address)
            await old.handshake()  # then silent: it never reads or answers again
            async with open_node(config("b")) as b2:
                keys = fill(a.store, 2, 4096)
                peer = await b2.connect(a.address)
                assert sorted((await b2.fetch(peer, keys)).loaded) == sorted(keys)
                assert a.statistics().peers == 1
                assert a.statistics().registrations.live == 1
            await old.aclose()


async def test_a_live_peer_id_cannot_be_taken_over_by_a_newcomer() -> None:
    """Issue 7 item 2: a hello claiming the id of a connected, answering peer (with a new
    epoch, or replaying its epoch) is refused; the live session and its registration are
    untouched and keep serving byte-exact."""
    with trio.fail_after(20):
        async with open_node(config("a")) as a, open_node(config("b")) as b:
            peer = await b.connect(a.address)
            registrations = a.statistics().registrations
            for epoch in (b.epoch + 1, b.epoch):
                impostor = RawPeer("b", epoch=epoch)
                await impostor.connect(a.address)
                impostor.proto.start()
                await impostor.flush()
                bye = await impostor.expect_close()
                await impostor.aclose()
                assert bye is not None and bye.code == "duplicate", bye
                assert a.statistics().registrations == registrations  # nothing registered
            keys = fill(a.store, 3, 4096)
            assert sorted((await b.fetch(peer, keys)).loaded) == sorted(keys)
            for k in keys:
                assert b.store.get(k) == a.store.get(k)
            assert a.statistics().peers == 1


async def test_a_node_admits_at_most_max_peers_peers() -> None:
    """A node admits at most ``max_peers`` peers: with one admitted, the next is refused
    at the cap, not let in one over it (the stranger-cap tests use the same setting but
    never held admitted peers to it)."""
    with trio.fail_after(20):
        async with (
            open_node(config("a", max_peers=1)) as a,
            open_node(config("b")) as b,
            open_node(config("c")) as c,
        ):
            await b.connect(a.address)
            with pytest.raises(HandshakeRejected, match="cap of 1 peers"):
                await c.connect(a.address)
            assert [p.peer_id for p in a.peers()] == ["b"]


async def test_disconnect_idle_closes_only_a_session_unused_both_ways_since_it_looked() -> None:
    """``disconnect_idle`` closes the session only if no request is open either way and
    none was made since ``session_activity`` was read: the peer's own lookups keep it."""
    with trio.fail_after(20):
        async with pair() as (src, dst):
            keys = fill(src.store, 2, 4096)
            peer = await dst.connect(src.address)
            before = src.session_activity("dst")
            assert before is not None
            proto = src._by_peer["dst"].proto
            await dst.lookup(peer, [os.urandom(32)])  # a miss: its round ends at once
            await until(lambda: proto.idle)  # the round's close is in
            assert not await src.disconnect_idle("dst", before)  # used since it looked
            held = await dst.lookup_round(peer, keys)  # dst's round, open at src
            now = src.session_activity("dst")
            assert now is not None and now != before
            assert not await src.disconnect_idle("dst", now)  # the peer's round is open
            await dst.release(peer, held)
            await until(lambda: proto.idle)  # the release is in
            idle = src.session_activity("dst")
            assert idle == now
            theirs = fill(dst.store, 1, 4096)
            mine = await src.lookup_round("dst", theirs)  # src's own round, open at dst
            assert mine.hits == [True]
            assert not await src.disconnect_idle("dst", src.session_activity("dst") or idle)
            await src.release("dst", mine)
            idle = src.session_activity("dst")
            assert idle is not None
            assert src.is_connected("dst")
            assert await src.disconnect_idle("dst", idle)
            assert src.session_activity("dst") is None
            assert await src.disconnect_idle("dst", idle)  # gone: nothing to close


@pytest.mark.parametrize(
    ("transport", "same_id", "offset_blocks"),
    [
        pytest.param("nixl", True, 0, marks=pytest.mark.nixl, id="nixl-same-id"),
        pytest.param("nixl", False, 4, marks=pytest.mark.nixl, id="nixl-overlapping"),
        pytest.param("local", False, 0, id="local-same-memory"),
        pytest.param("local", True, 4, id="local-overlapping"),
    ],
)
async def test_a_second_live_node_over_a_live_nodes_memory_is_refused(
    transport: str, same_id: bool, offset_blocks: int
) -> None:
    """Two live nodes over the same bytes would each hand out every slot, one's put
    landing in the other's blocks. NIXL refused it only for different peer ids, the
    in-process transport never (review 2026-12-04); the memory is free again once the
    first node has closed."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu13")
    buf = np.zeros(16 * 4096, np.uint8)

    def cfg(peer_id: str) -> p2pkv.NodeConfig:
        return config(peer_id, num_blocks=8, block_len=4096, transport=transport)

    with trio.fail_after(30):
        async with open_node(cfg("a"), region=buf) as a:
            a.store.put(b"k", b"\x01" * 4096)
            with pytest.raises(p2pkv.TransportError, match="overlaps"):
                async with open_node(
                    cfg("a" if same_id else "b"), region=buf[offset_blocks * 4096 :]
                ) as b:
                    b.store.put(b"other", b"\x02" * 4096)
            assert bytes(a.store.get(b"k") or b"") == b"\x01" * 4096
        async with open_node(cfg("b"), region=buf) as b:  # a has closed: free again
            b.store.put(b"k", b"\x03" * 4096)


async def test_the_claim_on_a_nodes_memory_is_exactly_its_bytes_while_it_lives() -> None:
    """Only overlapping memory is refused: a host may cut one buffer into adjacent regions
    for several live nodes. And a node that failed to start (its data plane refused)
    leaves no claim: the memory is free for the next node at once."""

    def refused(cfg: p2pkv.NodeConfig, store: BlockStore) -> Any:
        raise p2pkv.TransportError("FAKE: the data plane refused to start", op="open_node")

    buf = np.zeros(16 * 4096, np.uint8)
    cfg = config("a", num_blocks=8, block_len=4096)
    with trio.fail_after(30):
        async with open_node(cfg, region=buf[: 8 * 4096]), open_node(cfg, region=buf[8 * 4096 :]):
            pass
        with pytest.raises(p2pkv.TransportError, match="FAKE"):
            async with open_node(cfg, region=buf, transport=refused):
                pass
        async with open_node(cfg, region=buf) as a:
            a.store.put(b"k", b"\x01" * 4096)


def test_two_threads_claiming_one_region_at_once_get_one_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two nodes opened at once from two threads over the same bytes: one claim wins. The
    check and the claim are one step: a claims table whose scan waits for the other
    thread to scan too (at most a second: it must not, under the lock) lets both through
    when the scan and the insert are not done under one lock."""
    import p2pkv.node as node_mod

    scanning = threading.Barrier(2)

    class MeetingTable(dict[int, tuple[int, int, str]]):
        """FAKE live-region table whose scan waits (up to 1 s) for a second scan."""

        def values(self) -> Any:
            seen = list(super().values())  # what this scan sees
            with contextlib.suppress(threading.BrokenBarrierError):
                scanning.wait(timeout=1.0)
            return seen

    monkeypatch.setattr(node_mod, "_live_regions", MeetingTable())
    buf = np.zeros(8 * 4096, np.uint8)
    stores = [
        BlockStore(num_blocks=8, block_len=4096, region=buf),
        BlockStore(num_blocks=4, block_len=4096, region=buf[4 * 4096 :]),
    ]
    claimed: list[int] = []
    refused: list[BaseException] = []

    def claim(store: BlockStore) -> None:
        try:
            claimed.append(node_mod._claim_region(store))
        except p2pkv.TransportError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert len(claimed) == 1 and len(refused) == 1, (claimed, refused)
    assert "overlaps" in str(refused[0])
    node_mod._release_region(claimed[0])
    assert not node_mod._live_regions


async def test_connect_to_a_connected_peer_returns_the_live_session() -> None:
    """Issue 7 item 6: a second connect() (same address, another name for it, or
    concurrent) returns the peer; the live session and a fetch in flight are untouched.
    The dialing side has the smaller peer id: the dial-race tie-break must not fire when
    this side dialed both connections."""
    with trio.fail_after(20):
        async with open_node(config("a")) as a, open_node(config("b")) as b:
            peer = await a.connect(b.address)
            keys = fill(b.store, 8, 4096)
            results: list[Any] = []

            async def fetch() -> None:
                results.append(await a.fetch(peer, keys))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                again = await a.connect(b.address)
                both = await _gather(a.connect(b.address), a.connect(("localhost", b.address[1])))
            assert again == peer and all(p.peer_id == "b" for p in both)
            assert sorted(results[0].loaded) == sorted(keys) and not results[0].failed
            assert a.statistics().sessions == 1 and b.statistics().sessions == 1
            assert a.statistics().quarantined_slots == 0


async def _gather(*aws: Any) -> list[Any]:
    out: list[Any] = [None] * len(aws)

    async def one(i: int, aw: Any) -> None:
        out[i] = await aw

    async with trio.open_nursery() as nursery:
        for i, aw in enumerate(aws):
            nursery.start_soon(one, i, aw)
    return out


async def test_simultaneous_dials_settle_on_one_session() -> None:
    """Both sides dial at once: each connect() returns the peer (no duplicate-connection
    error), and both sides keep the *same* connection, the one the smaller id ("a")
    dialed, and close the other."""
    with trio.fail_after(20):
        async with open_node(config("a")) as a, open_node(config("b")) as b:
            peers: dict[str, p2pkv.Peer] = {}

            async def dial(x: p2pkv.Node, y: p2pkv.Node) -> None:
                peers[x.config.peer_id] = await x.connect(y.address)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dial, a, b)
                nursery.start_soon(dial, b, a)
            assert peers["a"].peer_id == "b" and peers["b"].peer_id == "a"
            # The losing connection's sessions end on both sides.
            with trio.fail_after(5):
                while a.statistics().sessions + b.statistics().sessions > 2:
                    await trio.sleep(0.01)
            for node in (a, b):
                st = node.statistics()
                assert (st.sessions, st.peers, st.registrations.live) == (1, 1, 1), st
            # A peer's address is the one dialed (a listening address) on the side that
            # dialed the surviving connection, and the remote's ephemeral port on the
            # other. So the sides agree exactly when one of them sees a listening address.
            [b_seen_by_a] = a.peers()
            [a_seen_by_b] = b.peers()
            assert b_seen_by_a.address == b.address, "a does not hold the connection it dialed"
            assert a_seen_by_b.address != a.address, "b holds a connection it dialed as well"
            keys = fill(a.store, 2, 4096)
            assert len((await b.fetch(peers["b"], keys)).loaded) == 2
            keys = fill(b.store, 2, 4096)
            assert len((await a.fetch(peers["a"], keys)).loaded) == 2


async def test_region_handed_in_by_the_host_is_used_in_place() -> None:
    import numpy as np

    region = np.zeros(64 * 4096, np.uint8)
    with trio.fail_after(20):
        async with open_node(config("src")) as src, open_node(config("dst"), region=region) as dst:
            keys = fill(src.store, 3, 4096)
            peer = await dst.connect(src.address)
            await dst.fetch(peer, keys)
            for k in keys:
                slot = dst.store.slot_of(k)
                assert slot is not None
                got = bytes(region[slot * 4096 : (slot + 1) * 4096])
                assert got == bytes(src.store.get(k) or b"")


async def test_reconfiguration_swaps_the_data_plane_and_drops_departed_peers() -> None:
    """Three successive reconfigurations of a producer: each builds a new transport over
    the same region, re-registers the peers that stay, releases the ones that left, and
    the stayers keep fetching through the new data plane."""
    factory = FaultFactory()
    with trio.fail_after(30):
        async with (
            open_node(config("hub"), transport=factory) as hub,
            open_node(config("p1")) as p1,
            open_node(config("p2")) as p2,
            open_node(config("p3")) as p3,
        ):
            spokes = {"p1": p1, "p2": p2, "p3": p3}
            for spoke in spokes.values():
                await spoke.connect(hub.address)
            for members in (["p1", "p2", "p3"], ["p1", "p2"], ["p1"]):
                before = factory.transport
                await hub.reconfigure(members)
                assert factory.transport is not before
                assert hub.transport is factory.transport
                assert sorted(p.peer_id for p in hub.peers()) == members
                assert hub.statistics().registrations.live == len(members)
                assert factory.transport.statistics().remote_peers == len(members)
                for name, spoke in spokes.items():
                    keys = fill(hub.store, 2, 4096)
                    if name in members:
                        result = await spoke.fetch("hub", keys)
                        assert sorted(result.loaded) == sorted(keys)
                    else:
                        with trio.fail_after(5):
                            while spoke.statistics().peers:
                                await trio.sleep(0.01)
            # Replaced transports are closed once idle; only the live one holds peers.
            with trio.fail_after(5):
                while hub._retired_transports:
                    await trio.sleep(0.01)
            assert all(t.statistics().remote_peers == 0 for t in factory.built[:-1])
            assert len(factory.built) == 4


async def test_both_sides_reconfiguring_in_turn_keep_each_other_on_the_local_transport(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reconfiguration builds a new transport over the same region; its metadata must
    stay what the peers were told in the hello (as a NIXL agent's does), or a peer that
    reconfigures after us re-registers us from stale metadata, is refused, and drops us.
    (The in-process transport minted a new token per transport and so did exactly that.)"""
    with trio.fail_after(60):
        async with (
            open_node(config("hub"), offload=VirtualOffload(), transport=FaultFactory()) as hub,
            open_node(config("p1"), offload=VirtualOffload(), transport=FaultFactory()) as p1,
        ):
            keys = fill(hub.store, 2, 4096)
            await p1.connect(hub.address)
            metadata = hub.transport.metadata()
            await hub.reconfigure(["p1"])
            assert hub.transport.metadata() == metadata
            await p1.reconfigure(["hub"])
            assert [p.peer_id for p in p1.peers()] == ["hub"]
            result = await p1.fetch("hub", keys)
            assert sorted(result.loaded) == sorted(keys)


async def test_a_new_node_under_an_old_name_gets_new_local_metadata() -> None:
    """Metadata of a node that closed never reaches the memory of a new node that took
    its name: the region differs, and so does the token."""
    with trio.fail_after(20):
        async with open_node(config("name")) as first:
            stale = first.transport.metadata()
        async with open_node(config("name")) as second, open_node(config("other")) as other:
            assert second.transport.metadata() != stale
            with pytest.raises(p2pkv.RegistrationFailed, match="no such live region"):
                other.transport.add_remote_peer("name", stale, second.transport.layout)


async def test_reconfigure_on_a_closed_node_builds_nothing_and_raises_a_typed_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A membership controller racing shutdown: reconfigure after close refuses, as every
    call on a closed node does, and builds no data plane (NIXL: an agent with the region
    registered again, after the node released everything)."""
    factory = FaultFactory()
    with trio.fail_after(10):
        async with open_node(config("hub"), offload=VirtualOffload(), transport=factory) as hub:
            pass
        with pytest.raises(PeerUnavailable, match="node is closed"):
            await hub.reconfigure([])
    assert len(factory.built) == 1 and factory.built[0]._closed


class GatedBuild:
    """FAKE offload, inline: a transport factory's second call (the reconfiguration's
    build) says it started and waits for ``gate``, uncancellable like a worker thread."""

    def __init__(self) -> None:
        self.building, self.gate = trio.Event(), trio.Event()

    async def __call__(self, fn: Any, *args: Any, limiter: trio.CapacityLimiter) -> Any:
        async with limiter:
            if isinstance(fn, FaultFactory) and fn.built:
                self.building.set()
                with trio.CancelScope(shield=True):
                    await self.gate.wait()
            return fn(*args)


async def test_reconfigure_racing_close_raises_a_typed_error_and_leaves_nothing_open() -> None:
    """The node begins closing while reconfigure builds its transport: the new transport
    is closed, never swapped in, and reconfigure raises PeerUnavailable (it used to be
    Trio's "Nursery is closed to new arrivals")."""
    factory, offload = FaultFactory(), GatedBuild()
    errors: list[Exception] = []
    with trio.fail_after(20):
        async with open_node(config("hub"), offload=offload, transport=factory) as hub:

            async def reconfigure() -> None:
                try:
                    await hub.reconfigure([])
                except Exception as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reconfigure)
                await offload.building.wait()
                nursery.start_soon(hub.aclose)
                await trio.testing.wait_all_tasks_blocked()  # the close has begun
                offload.gate.set()
    assert len(errors) == 1 and isinstance(errors[0], PeerUnavailable), errors
    assert len(factory.built) == 2 and all(t._closed for t in factory.built)


class StuckTransport(FaultTransport):
    """FAKE (fault injection): a write of it stays in flight while ``stuck``, so a
    transport that a reconfiguration replaced stays retired until then (or until its node
    closes), and its close() raises ``close_error`` once that is set (a close that
    failed)."""

    close_error: Exception | None = None
    stuck = True

    def statistics(self) -> TransportStatistics:
        st = super().statistics()
        return attrs.evolve(st, live_handles=st.live_handles + self.stuck)

    def close(self) -> None:
        if self.close_error is not None:
            raise self.close_error
        super().close()


async def test_a_close_that_raises_leaves_no_other_data_plane_open() -> None:
    """The node's close closes every retired transport and the live one even when one
    of them raises, then raises that error (a raise in the loop used to leave the
    transports after it, the live one included, open for good)."""
    factory = FaultFactory(kind=StuckTransport)
    with trio.fail_after(20):
        with pytest.raises(p2pkv.TransportError, match="the close failed"):
            async with open_node(config("hub"), transport=factory) as hub:
                await hub.reconfigure([])
                await hub.reconfigure([])
                assert hub._retired_transports == factory.built[:2]
                first = factory.built[0]
                assert isinstance(first, StuckTransport)
                first.close_error = p2pkv.TransportError("the close failed")
    assert len(factory.built) == 3
    assert not factory.built[0]._closed and all(t._closed for t in factory.built[1:])
    assert hub._closed.is_set() and not hub._retired_transports


async def test_a_close_after_one_that_raised_does_nothing_again() -> None:
    """Closing is idempotent after a close that raised too: the data plane's close raised
    once, to the first caller; the closes after it (the caller's next, ``open_node``'s own
    at the block's end) neither close it again nor raise that error a second time."""
    factory = FaultFactory(kind=CountingClose)
    with trio.fail_after(20):
        async with open_node(config("a"), transport=factory) as a:
            t = factory.transport
            assert isinstance(t, CountingClose)
            t.close_error = p2pkv.TransportError("the close failed")
            with pytest.raises(p2pkv.TransportError, match="the close failed"):
                await a.aclose()
            await a.aclose()
    assert t.closes == 1 and a._closed.is_set()


class CountingClose(FaultTransport):
    """FAKE (fault injection): counts its close() calls, and close() raises
    ``close_error`` once that is set (a close that failed)."""

    close_error: Exception | None = None
    closes = 0

    def close(self) -> None:
        self.closes += 1
        if self.close_error is not None:
            raise self.close_error
        super().close()


async def test_a_replaced_data_plane_whose_close_raises_leaves_the_node_running() -> None:
    """A retired transport's close raising, once its writes settled, is logged: the node
    and its peers go on (it was raised in the node's nursery and took the node down)."""
    factory = FaultFactory(kind=StuckTransport)
    with trio.fail_after(20):
        async with (
            open_node(config("hub"), transport=factory) as hub,
            open_node(config("p1")) as p1,
        ):
            peer = await p1.connect(hub.address)
            await hub.reconfigure(["p1"])
            first = factory.built[0]
            assert isinstance(first, StuckTransport) and hub._retired_transports == [first]
            first.close_error = p2pkv.TransportError("the close failed")
            first.stuck = False
            await until(lambda: not hub._retired_transports)
            keys = fill(hub.store, 2, 4096)
            assert sorted((await p1.fetch(peer, keys)).loaded) == sorted(keys)
        assert not first._closed and factory.built[1]._closed


class ReregisterFaults(FaultTransport):
    """FAKE (fault injection): ``on_add(agent_name)`` runs after each registration (a
    test ends that peer's session there, while a reconfiguration re-registers it), and
    remove_remote_peer raises ``remove_error`` once."""

    on_add: Callable[[str], None] | None = None
    remove_error: Exception | None = None

    def add_remote_peer(self, agent_name: str, metadata: bytes, layout: RegionLayout) -> RemotePeer:
        peer = super().add_remote_peer(agent_name, metadata, layout)
        if self.on_add is not None:
            self.on_add(agent_name)
        return peer

    def remove_remote_peer(self, peer: RemotePeer) -> None:
        err, self.remove_error = self.remove_error, None
        if err is not None:
            raise err
        super().remove_remote_peer(peer)


async def test_a_stale_registration_that_fails_to_release_costs_the_others_nothing() -> None:
    """Two peers' sessions end while a reconfiguration re-registers them: both new
    registrations are stale, and each is released though the first release raises (the
    raise skipped the rest, left them registered on the live transport, and failed a
    reconfiguration that had gone live)."""
    nodes: dict[str, Node] = {}

    def arm(t: FaultTransport) -> None:
        if factory.built and isinstance(t, ReregisterFaults):  # the reconfiguration's
            t.on_add = lambda name: nodes["hub"]._by_peer[name].close("left meanwhile")
            t.remove_error = p2pkv.TransportError("the release failed")

    factory = FaultFactory(arm, kind=ReregisterFaults)
    with trio.fail_after(20):
        async with (
            open_node(config("hub"), transport=factory, offload=VirtualOffload()) as hub,
            open_node(config("p1")) as p1,
            open_node(config("p2")) as p2,
        ):
            nodes["hub"] = hub
            await p1.connect(hub.address)
            await p2.connect(hub.address)
            await hub.reconfigure(["p1", "p2"])
            new = factory.transport
            assert new.adds == 2 and new.removes == 1 and len(new.live) == 1
            assert hub.peers() == []


class ReregisterBug(FaultTransport):
    """FAKE (fault injection): ``add_remote_peer`` raises ``error`` (an untyped one, as a
    bug or a library's own exception would) for the agent named ``broken``."""

    broken: str | None = None
    error: Exception = KeyError("a bug in the data plane")

    def add_remote_peer(self, agent_name: str, metadata: bytes, layout: RegionLayout) -> RemotePeer:
        if agent_name == self.broken:
            raise self.error
        return super().add_remote_peer(agent_name, metadata, layout)


async def test_a_peer_whose_re_registration_raises_untyped_costs_the_others_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reconfiguration whose re-registration of one peer raises something other than a
    P2PKVError (a bug, an exception from the library underneath) closes that peer's
    session, logged with its traceback, and swaps the others in, as a typed refusal does.
    It failed the whole reconfiguration instead, closing every peer re-registered before
    that one."""

    def arm(t: FaultTransport) -> None:
        if factory.built and isinstance(t, ReregisterBug):  # the reconfiguration's
            t.broken = "p2"

    factory = FaultFactory(arm, kind=ReregisterBug)
    with trio.fail_after(20):
        async with (
            open_node(config("hub"), transport=factory, offload=VirtualOffload()) as hub,
            open_node(config("p1")) as p1,
            open_node(config("p2")) as p2,
            open_node(config("p3")) as p3,
        ):
            for spoke in (p1, p2, p3):
                await spoke.connect(hub.address)
            await hub.reconfigure(["p1", "p2", "p3"])
            assert hub.transport is factory.transport
            assert sorted(p.peer_id for p in hub.peers()) == ["p1", "p3"]
            assert "re-registering 'p2' failed" in caplog.text and "KeyError" in caplog.text
            for spoke in (p1, p3):
                keys = fill(hub.store, 2, 4096)
                assert sorted((await spoke.fetch("hub", keys)).loaded) == sorted(keys)


async def test_release_gives_back_pins_of_an_unfetched_round() -> None:
    with trio.fail_after(20):
        async with open_node(config("src")) as src, open_node(config("dst")) as dst:
            keys = fill(src.store, 4, 4096)
            peer = await dst.connect(src.address)
            first = await dst.lookup_round(peer, keys[:2])
            second = await dst.lookup_round(peer, keys[2:])
            assert src.statistics().pinned_slots == 4
            assert await dst.release(peer, first) == 1
            with trio.fail_after(5):
                while src.statistics().pinned_slots != 2:
                    await trio.sleep(0.01)
            assert await dst.release(peer, [first, second]) == 1  # first is closed already
            with trio.fail_after(5):
                while src.statistics().pinned_slots:
                    await trio.sleep(0.01)
            # Released keys are looked up afresh by a later fetch, even one naming them.
            result = await dst.fetch(peer, keys, rounds=[first, second])
            assert sorted(result.loaded) == sorted(keys)


@pytest.mark.parametrize(
    ("transport", "verify_checksums"), [("local", False), ("local", True), ("nixl", True)]
)
def test_a_gpu_region_is_refused_where_only_a_host_view_would_work(
    transport: Literal["local", "nixl"], verify_checksums: bool
) -> None:
    """The local transport and checksums read blocks through a host view, which a GPU
    region does not have: the node refuses that combination before building a transport.
    (A real CUDA tensor is only on the GPU machine; the store is marked as one here.)"""
    from p2pkv.node import make_transport
    from p2pkv.store import BlockStore

    store = BlockStore(4, 4096)
    store.device_region = True
    cfg = p2pkv.NodeConfig(
        peer_id="gpu",
        num_blocks=4,
        block_len=4096,
        transport=transport,
        verify_checksums=verify_checksums,
    )
    with pytest.raises(p2pkv.P2PKVError, match="GPU region needs transport='nixl'"):
        make_transport(cfg, store)


async def test_a_peer_with_smaller_frames_is_sent_requests_that_fit_them() -> None:
    """``max_frame_size`` is not in the hello, so a consumer sized its requests by its own
    frames: a 50,000-key lookup (under ``max_keys_per_request``) from a node with 16 MiB
    frames closed the session of a producer with 1 MiB ones. The producer now advertises
    only as many keys per request as fit its frames. Found by a review (2026-12-04)."""
    with trio.fail_after(30):
        async with (
            open_node(config("prod", max_frame_size=1 << 20)) as prod,
            open_node(config("cons")) as cons,
            open_node(config("tiny", max_frame_size=4096)) as tiny,
        ):
            keys = fill(prod.store, 8, 4096)
            peer = await cons.connect(prod.address)
            many = [os.urandom(32) for _ in range(50_000)] + keys
            hits = await cons.lookup(peer, many)
            assert hits == [False] * 50_000 + [True] * 8
            assert cons.is_connected("prod") and cons.statistics().peers == 1
            # Frames with no room beyond the overhead still take one key per request.
            own = fill(tiny.store, 3, 4096)
            assert await cons.lookup(await cons.connect(tiny.address), own) == [True] * 3


async def test_the_async_node_refuses_one_key_where_keys_are_expected() -> None:
    with trio.fail_after(30):
        async with open_node(config("src")) as src, open_node(config("dst")) as dst:
            peer = await dst.connect(src.address)
            for call in (dst.lookup, dst.lookup_round, dst.fetch):
                with pytest.raises(TypeError, match="a sequence of keys"):
                    await call(peer, b"k" * 32)  # type: ignore[arg-type]  # the slip
            with pytest.raises(TypeError, match="a sequence of keys"):
                await dst.fetch_into(peer, b"k" * 32, [0])  # type: ignore[arg-type]


async def test_a_dial_that_connects_as_its_node_closes_closes_its_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connect whose TCP dial completed just as its node closed started a session on
    the closed node's nursery: a ``RuntimeError`` for the caller, the socket left open
    (a ``ResourceWarning`` at exit; mutation review 2026-12-05). It is refused as a
    closed node's connect is, and the socket is closed."""
    real_open = trio.open_tcp_stream
    opened: list[trio.SocketStream] = []
    dialed, node_closed = trio.Event(), trio.Event()

    async def open_late(host: str | bytes, port: int, **kw: Any) -> trio.SocketStream:
        stream = await real_open(host, port, **kw)
        opened.append(stream)
        dialed.set()
        await node_closed.wait()
        return stream

    errors: list[BaseException] = []

    async def dial(node: p2pkv.Node, address: tuple[str, int]) -> None:
        try:
            await node.connect(address)
        except PeerUnavailable as exc:
            errors.append(exc)

    with trio.fail_after(10):
        async with open_node(config("src")) as src, trio.open_nursery() as nursery:
            async with open_node(config("dst")) as dst:
                monkeypatch.setattr(trio, "open_tcp_stream", open_late)
                nursery.start_soon(dial, dst, src.address)
                await dialed.wait()
            node_closed.set()
    assert len(errors) == 1 and "closed" in str(errors[0]), errors
    assert opened[0].socket.fileno() == -1, "the dialed socket was left open"


async def test_an_error_out_of_open_node_keeps_its_cause() -> None:
    """``open_node`` raises one error out of its nursery as itself, not as a group of
    one, but raised it ``from None``: that replaced the error's own ``__cause__`` (a
    TransportError's "why", the OSError behind "cannot listen on", a host's own
    ``raise ... from``) with None (errors review 2026-12-05)."""

    class HostError(Exception):
        pass

    root = KeyError("the host's reason")
    with trio.fail_after(10):
        with pytest.raises(HostError) as info:
            async with open_node(config("a")):
                raise HostError("raised in the body") from root
        assert info.value.__cause__ is root
        # Nor given a context it did not have: the group that carried it out of the nursery
        # (a traceback then printed that group first; mutation pass 2026-12-06).
        with pytest.raises(HostError) as plain:
            async with open_node(config("c")):
                raise HostError("raised in the body, no cause")
        assert plain.value.__cause__ is None and plain.value.__context__ is None
        bad = attrs.evolve(config("b"), host="192.0.2.1")  # TEST-NET-1: no interface has it
        with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1:0") as listen:
            async with open_node(bad):
                pass
        assert isinstance(listen.value.__cause__, OSError), listen.value.__cause__


async def test_reconfigure_keeps_members_named_by_peer_and_refuses_a_lone_peer_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every other call names a peer by its :class:`Peer` or its id; ``reconfigure`` took
    ``set(members)`` as given, so members passed as the ``Peer`` handles ``connect`` and
    ``peers()`` return matched no peer id, and a lone id (``"p1"`` for ``["p1"]``) was
    its characters: either way every session was closed as "left the membership",
    silently (errors review 2026-12-05). A Peer counts as its id now; a lone id, or an
    item that names no peer, is a TypeError before anything is closed or built."""
    factory = FaultFactory()
    with trio.fail_after(60):
        async with (
            open_node(config("hub"), offload=VirtualOffload(), transport=factory) as hub,
            open_node(config("p1"), offload=VirtualOffload()) as p1,
        ):
            await p1.connect(hub.address)
            await until(lambda: bool(hub.peers()))
            for lone in ("p1", b"p1"):
                with pytest.raises(TypeError, match="members"):
                    await hub.reconfigure(lone)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="peer"):
                await hub.reconfigure([3])  # type: ignore[list-item]
            assert len(factory.built) == 1  # nothing was built
            await hub.reconfigure(hub.peers())
            assert [p.peer_id for p in hub.peers()] == ["p1"]
            assert len(factory.built) == 2
