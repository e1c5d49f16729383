"""What one peer can make a producer hold, and how long, and how fairly it is served.

Real TCP on loopback with a hand-driven hostile peer (:class:`~tests.helpers.RawPeer`).
Deadlines run on Trio's autojump clock with :class:`~tests.helpers.VirtualOffload` (FAKE:
inline, no real threads); the fairness tests need no clock at all: they count answers.
"""

from __future__ import annotations

import gc
import os
import threading
import tracemalloc
from collections.abc import Sequence
from typing import Any, cast

import attrs
import pytest
import trio
import trio.testing

import p2pkv.session.producer as producer_module
import p2pkv.session.session as session_module
from p2pkv import Node, StoreFull, open_node
from p2pkv.errors import TransportError
from p2pkv.session.producer import checksums
from p2pkv.session.protocol import (
    AbortAcknowledged,
    LookupAnswered,
    PongReceived,
    SessionProtocol,
    TransferCompleted,
)
from p2pkv.session.session import PeerSession
from p2pkv.session.turns import Turn
from p2pkv.store import BlockStore
from p2pkv.transport.base import TransferHandle, TransferState
from p2pkv.wire import Fetch, Lookup, LookupResp, Outcome, Ping, TransferDone, encode

from .helpers import (
    BOUND,
    FaultFactory,
    FaultTransport,
    RawPeer,
    SendGate,
    VirtualOffload,
    config,
    fill,
    inline_offload,
)
from .helpers import (
    virtual_node as node,
)

OK = int(Outcome.OK)
OVER_CAP = int(Outcome.OVER_CAP)
TRANSFER_FAILED = int(Outcome.TRANSFER_FAILED)
LEASE_EXPIRED = int(Outcome.LEASE_EXPIRED)

# Virtual seconds on the autojump clock: "this did not hang", never an expected duration;
# above every deadline and wait of the tests that use it.
VIRTUAL_BOUND = 120.0


async def connected(n: Node, **info: Any) -> tuple[RawPeer, PeerSession]:
    raw = RawPeer(**info)
    await raw.connect(n.address)
    await raw.handshake()
    return raw, n._by_peer[raw.peer_id]


async def one_fetch(
    src: Node, n: int
) -> tuple[RawPeer, PeerSession, list[bytes], TransferCompleted]:
    """A raw peer looks ``n`` fresh blocks of ``src`` up (all hits) and fetches them into
    its slots 0..n-1: the peer, its session, the keys and the fetch's reply."""
    keys = fill(src.store, n, 4096)
    raw, session = await connected(src)
    req, hits = await raw.lookup(keys)
    assert all(hits)
    raw.proto.send_fetch(req, keys, list(range(n)))
    await raw.flush()
    done = await raw.next_event()
    assert isinstance(done, TransferCompleted) and done.req_id == req
    return raw, session, keys, done


# --- item 4: abort_ack means "no write of this round can land any more" -------------------


async def test_abort_ack_waits_until_an_unsettled_write_can_no_longer_land(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # writes never settle
        async with node("src", factory=hanging, abort_timeout=1.0, quarantine=20.0) as src:
            keys = fill(src.store, 4, 4096)
            raw, _ = await connected(src)
            req, hits = await raw.lookup(keys)
            assert hits == [True] * 4
            raw.proto.send_fetch(req, keys, [0, 1, 2, 3])
            await raw.flush()
            await trio.sleep(1.0)  # virtual: the node runs until every task is blocked
            assert hanging.transport.posts == 1  # the write is in flight
            raw.proto.send_abort(req)
            await raw.flush()
            aborted_at = trio.current_time()
            # abort_timeout (1 s) for the handle to settle, then the quarantine (20 s).
            with trio.move_on_after(20.5):
                early = await raw.next_event()
                pytest.fail(f"{early!r} while the released write could still land")
            assert src.statistics().pinned_slots == 4  # the sources are still held
            ack = await raw.next_event()
            assert isinstance(ack, AbortAcknowledged) and ack.req_id == req
            assert trio.current_time() - aborted_at == pytest.approx(21.0, abs=0.25)
            assert src.statistics().pinned_slots == 0
            assert hanging.transport.releases == 1
            await raw.aclose()


def hang_and_refuse_one_release(t: FaultTransport) -> None:
    """FAULT INJECTION: writes never settle, and the data plane refuses the first release
    (``_release_all`` raises it once every handle was tried)."""
    t.hang = True
    real = t.release

    def release(handle: TransferHandle) -> None:
        if not handle.released and t.releases == 0:
            t.releases += 1
            raise TransportError("release refused by the fault script", op="release")
        real(handle)

    t.release = release  # type: ignore[method-assign]


async def test_a_cut_write_whose_release_is_refused_is_still_quarantined_and_acked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A write cut short whose handle the data plane will not release: the write task's
    end still runs whole. Its round is held for the quarantine (the write may land, its
    handle unreleased), the abort_ack comes after it, the peer's bytes in flight are given
    back and the session goes on. The refusal used to leave the shielded end half done:
    no abort_ack ever, the bytes in flight and the write's entry kept, its done event
    never set (a restart of the peer then waited for it for ever), and the error took the
    whole session down, unpinning the sources the data plane could still read."""
    with trio.fail_after(VIRTUAL_BOUND):
        refusing = FaultFactory(hang_and_refuse_one_release)
        async with node("src", factory=refusing, abort_timeout=1.0, quarantine=20.0) as src:
            keys = fill(src.store, 4, 4096)
            raw, session = await connected(src)
            req, _ = await raw.lookup(keys)
            raw.proto.send_fetch(req, keys, [0, 1, 2, 3])
            await raw.flush()
            await trio.sleep(1.0)  # virtual: the write is posted, and hangs
            assert refusing.transport.posts == 1
            raw.proto.send_abort(req)
            await raw.flush()
            aborted_at = trio.current_time()
            await trio.sleep(5.0)
            assert session.alive and not session._writes and session.inflight_bytes == 0
            assert src.statistics().pinned_slots == 4  # the sources are held
            ack = await raw.next_event()
            assert isinstance(ack, AbortAcknowledged) and ack.req_id == req
            assert trio.current_time() - aborted_at == pytest.approx(21.0, abs=0.25)
            assert src.statistics().pinned_slots == 0
            assert session.alive and src.is_connected(raw.peer_id)
            await raw.aclose()


async def test_source_pins_of_an_unsettled_write_outlive_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))
        async with node("src", factory=hanging, abort_timeout=1.0, quarantine=20.0) as src:
            keys = fill(src.store, 2, 4096)
            raw, _ = await connected(src)
            req, _ = await raw.lookup(keys)
            raw.proto.send_fetch(req, keys, [0, 1])
            await raw.flush()
            await trio.sleep(1.0)
            raw.proto.send_abort(req)
            await raw.flush()
            await trio.sleep(5.0)
            await raw.aclose()  # the consumer goes away while the round is held
            await trio.sleep(10.0)
            assert src.statistics().sessions == 0
            assert src.statistics().pinned_slots == 2
            await trio.sleep(6.5)  # 1 + 20 s after the abort
            assert src.statistics().pinned_slots == 0


CAP = 4  # max_pinned_blocks of the tests below that use it


async def hang_a_write(raw: RawPeer, keys: list[bytes]) -> None:
    """Pin ``keys`` (all hits) and fetch them over a data plane whose writes hang."""
    req, hits = await raw.lookup(keys)
    assert hits == [True] * len(keys)
    raw.proto.send_fetch(req, keys, list(range(len(keys))))
    await raw.flush()
    await trio.sleep(0.5)  # virtual: the write is posted, and hangs


async def test_pins_in_quarantine_count_against_the_peers_cap_after_its_session_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A write that did not settle keeps its round's pins for the quarantine after its
    session is gone. They were off the peer's count from then: a peer that reconnected
    under its id got a whole ``max_pinned_blocks`` more each time (three sessions in a
    row held 3 x the cap; review 2026-12-05). They count until the quarantine ends, for
    that peer id alone."""
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # writes never settle
        async with node(
            "src", factory=hanging, abort_timeout=1.0, quarantine=20.0, max_pinned_blocks=CAP
        ) as src:
            keys = fill(src.store, 3 * CAP, 4096)
            raw, _ = await connected(src, peer_id="greedy")
            await hang_a_write(raw, keys[:CAP])
            await raw.aclose()  # the write is cut: its round waits out the quarantine
            await trio.sleep(2.0)  # past abort_timeout: the session is gone
            assert src.statistics().sessions == 0
            raw, _ = await connected(src, peer_id="greedy")
            _, hits = await raw.lookup(keys[CAP : 2 * CAP])
            assert hits == [False] * CAP  # its cap is taken by the quarantine
            assert src.orphan_pins == {"greedy": CAP}
            other, _ = await connected(src, peer_id="other")
            _, hits = await other.lookup(keys[2 * CAP :])
            assert hits == [True] * CAP  # another peer's cap is its own
            assert src.statistics().pinned_slots == 2 * CAP
            await trio.sleep(20.0)  # the quarantine is over: the pins and the count go
            assert src.orphan_pins == {}
            _, hits = await raw.lookup(keys[CAP : 2 * CAP])
            assert hits == [True] * CAP
            await raw.aclose()
            await other.aclose()


async def test_closing_a_node_ends_a_quarantine_hold_and_leaves_no_pin(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A round held for its quarantine (a write that never settled) when the node closes:
    the hold ends with the node (its deferred end runs at shutdown, not only at the
    quarantine's end), so the sources are unpinned and the peer's orphan count is gone.
    Invariant 6: closing a node leaves nothing behind. Without it the pins outlived the
    node (a host's pin source never got its token back)."""
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # writes never settle
        async with node("src", factory=hanging, abort_timeout=1.0, quarantine=60.0) as src:
            keys = fill(src.store, 4, 4096)
            raw, _ = await connected(src, peer_id="held")
            req, hits = await raw.lookup(keys)
            assert hits == [True] * 4
            raw.proto.send_fetch(req, keys, [0, 1, 2, 3])
            await raw.flush()
            await trio.sleep(0.5)  # virtual: the write is posted, and hangs
            raw.proto.send_abort(req)
            await raw.flush()
            await trio.sleep(2.0)  # past abort_timeout: the round is held for 60 s
            assert src.statistics().pinned_slots == 4
            await src.aclose()  # well inside the quarantine
            assert src.statistics().pinned_slots == 0
            assert src.orphan_pins == {}
            await raw.aclose()


async def test_a_restarted_peer_does_not_get_a_fresh_cap_beside_its_old_quarantine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same over one connection: a restart (a new epoch) drops the old incarnation's
    rounds from the protocol's count while their pins wait out the quarantine."""
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))
        async with node(
            "src", factory=hanging, abort_timeout=1.0, quarantine=20.0, max_pinned_blocks=CAP
        ) as src:
            keys = fill(src.store, 2 * CAP, 4096)
            raw, session = await connected(src, peer_id="greedy")
            await hang_a_write(raw, keys[:CAP])
            raw.proto = SessionProtocol(
                attrs.evolve(raw.proto.local, epoch=raw.proto.local.epoch + 1)
            )
            await raw.handshake()  # the old round is cut and quarantined
            await trio.sleep(2.0)
            assert session.alive and session._pinned == {}
            _, hits = await raw.lookup(keys[CAP:])
            assert hits == [False] * CAP
            assert src.statistics().pinned_slots == CAP
            await trio.sleep(20.0)
            _, hits = await raw.lookup(keys[CAP:])
            assert hits == [True] * CAP and src.orphan_pins == {}
            await raw.aclose()


async def test_an_old_incarnations_quarantine_ending_leaves_the_new_round_of_its_id_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A restart on the connection while a write hangs: the old round waits out its
    quarantine. The new incarnation's request ids start again at 1, so its round being
    written when that quarantine ends has the old one's id. The quarantine's end releases
    the old round's pins and nothing else: the new round keeps its entry and its pins, and
    gets no reply (a transfer_done with the old round's outcomes would tell the peer its
    write was over while it is still in flight)."""
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # writes never settle
        async with node("src", factory=hanging, abort_timeout=1.0, quarantine=20.0) as src:
            keys = fill(src.store, 4, 4096)
            raw, session = await connected(src, peer_id="phoenix")
            await hang_a_write(raw, keys[:2])
            raw.proto = SessionProtocol(
                attrs.evolve(raw.proto.local, epoch=raw.proto.local.epoch + 1)
            )
            await raw.handshake()  # the old round is cut and quarantined
            await hang_a_write(raw, keys[2:])  # the new incarnation's round 1, hanging too
            new = session._pinned[1]
            assert src.statistics().pinned_slots == 4
            with trio.move_on_after(30.0):  # past the old round's quarantine
                early = await raw.next_event()
                pytest.fail(f"{early!r} for a round still being written")
            assert session._pinned.get(1) is new and 1 in session._writes
            assert src.statistics().pinned_slots == 2  # the old round's pins went
            await raw.aclose()


async def test_a_written_rounds_pins_go_as_its_reply_is_queued_behind_a_full_outbox(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write task released its round's pins only after a flush that, past
    ``OUTBOX_CAP`` queued, waited for the socket, while the queued reply had taken the
    round off the peer's count: a peer that reads nothing held those pins uncounted, and
    the lookups it sent behind pinned a whole cap more (review 2026-12-05). The write task
    now never waits for the socket. ``OUTBOX_CAP`` is 1 KiB here to keep the test short;
    with the real 4 MiB the same steps end the same way."""
    cap_bytes = 1024
    monkeypatch.setattr(session_module, "OUTBOX_CAP", cap_bytes)
    with trio.fail_after(VIRTUAL_BOUND):
        gate = SendGate(monkeypatch)
        async with node("src", max_pinned_blocks=CAP) as src:
            keys = fill(src.store, 2 * CAP, 4096)
            raw, s = await connected(src)
            req, hits = await raw.lookup(keys[:CAP])
            assert hits == [True] * CAP
            gate.shut(s)  # the peer reads nothing from here on
            await raw.send_raw(encode(Lookup(req_id=2, keys=[b"m"])))
            await trio.sleep(1.0)  # its answer waits in a drain task, holding the send lock
            assert s._send_lock.locked() and not s.proto.has_data_to_send()
            # A lookup whose answer leaves the outbox just under the cap, behind the
            # fetch: with the write task's reply the outbox is over it.
            reply = len(encode(TransferDone(req_id=req, outcomes=[0] * CAP)))
            n = max(
                n
                for n in range(1, 2048)
                if len(encode(LookupResp(req_id=3, hits=[False] * n))) <= cap_bytes
            )
            assert len(encode(LookupResp(req_id=3, hits=[False] * n))) + reply > cap_bytes
            fetch = Fetch(req_id=req, keys=keys[:CAP], slots=list(range(CAP)))
            await raw.send_raw(encode(fetch) + encode(Lookup(req_id=3, keys=[b"m"] * n)))
            await trio.sleep(1.0)
            assert s.proto.in_state(req) is None  # the reply is queued: the copy is over
            assert s.proto.pins_held() == 0 and src.store.pinned_slots == 0
            await raw.send_raw(encode(Lookup(req_id=4, keys=keys[CAP:])))
            await trio.sleep(1.0)
            assert s.proto.pins_held() == CAP == src.store.pinned_slots
            gate.open.set()
            await raw.aclose()


class TimedChecksums(VirtualOffload):
    """FAKE offload for the autojump clock (inline): a checksum pass costs virtual time
    in proportion to its blocks, as a real one does (zlib.crc32 at ~3.4 GB/s here)."""

    def __init__(self, per_block: float) -> None:
        super().__init__()
        self.per_block = per_block

    async def __call__(self, fn: Any, *args: Any, limiter: trio.CapacityLimiter) -> Any:
        async with limiter:
            with trio.CancelScope(shield=True):  # like a real worker thread
                if fn is checksums:
                    await trio.sleep(self.per_block * len(args[2]))
                else:
                    await trio.lowlevel.checkpoint()
            return fn(*args)


async def test_a_big_fetchs_checksums_hold_another_peers_reply_a_slice_at_most(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With ``verify_checksums``, a fetch's checksums were summed in one worker call,
    holding the node's one ``cpu_limiter`` throughout: a peer's 4,096-block fetch kept
    another peer's 1-block fetch from its reply for the whole pass (~2.5 s for 8 GiB at
    the default caps; review 2026-12-05). They are summed a slice at a time now
    (``max_keys_per_turn`` blocks here), the limiter handed over between slices."""
    per_block, big = 0.001, 4096
    with trio.fail_after(VIRTUAL_BOUND):
        async with open_node(
            config("src", num_blocks=big + 1, verify_checksums=True),
            offload=TimedChecksums(per_block),
            transport=FaultFactory(),
        ) as src:
            keys = fill(src.store, big + 1, 4096)
            hog, _ = await connected(src, num_blocks=big)
            good, _ = await connected(src)
            req, hits = await hog.lookup(keys[:big])
            assert all(hits)
            small, _ = await good.lookup(keys[big:])
            hog.proto.send_fetch(req, keys[:big], list(range(big)))
            await hog.flush()
            await trio.sleep(0.1)  # virtual: the hog's blocks are written, its sum begun
            good.proto.send_fetch(small, keys[big:], [0])
            await good.flush()
            asked = trio.current_time()
            done = await good.next_event()
            assert isinstance(done, TransferCompleted) and done.outcomes == [OK]
            waited = trio.current_time() - asked
            per_turn = src.config.max_keys_per_turn
            assert waited <= per_turn * per_block + 0.1, f"waited {waited:.2f} s"
            done = await hog.next_event()  # and the hog's sums are all there, in order
            assert isinstance(done, TransferCompleted) and done.outcomes == [OK] * big
            slots = [src.store.slot_of(k) for k in keys[:big]]
            assert None not in slots
            want = checksums(src.store.array.data, 4096, cast("list[int]", slots))
            assert done.checksums == want
            await hog.aclose()
            await good.aclose()


class CountedChecksums(VirtualOffload):
    """FAKE offload (inline): records the blocks of each checksum call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    async def __call__(self, fn: Any, *args: Any, limiter: trio.CapacityLimiter) -> Any:
        if fn is checksums:
            self.calls.append(len(args[2]))
        return await super().__call__(fn, *args, limiter=limiter)


async def test_both_ends_sum_a_fetch_in_slices(autojump_clock: trio.testing.MockClock) -> None:
    """The producer's sums and the consumer's landing check each hand the ``cpu_limiter``
    over between slices of ``max_keys_per_turn`` blocks, and every key still lands."""
    with trio.fail_after(VIRTUAL_BOUND):
        counts = {"src": CountedChecksums(), "dst": CountedChecksums()}
        cfg = {"verify_checksums": True, "max_keys_per_turn": 4}
        async with (
            open_node(config("src", **cfg), offload=counts["src"]) as src,
            open_node(config("dst", **cfg), offload=counts["dst"]) as dst,
        ):
            keys = fill(src.store, 10, 4096)
            result = await dst.fetch(await dst.connect(src.address), keys)
            assert sorted(result.loaded) == sorted(keys) and not result.failed
            assert counts["src"].calls == counts["dst"].calls == [4, 4, 2]


async def test_checksums_are_of_the_source_slots_where_they_differ_from_the_targets(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With ``verify_checksums``, the producer sums the blocks it sent (its own slots),
    not its blocks at the slot numbers the consumer landed them in: fetched keys held in
    slots 6..9 land in a fresh store's slots 0..3, and every one loads."""
    with trio.fail_after(VIRTUAL_BOUND):
        cfg = {"verify_checksums": True}
        async with (
            open_node(config("src", **cfg), offload=inline_offload) as src,
            open_node(config("dst", **cfg), offload=inline_offload) as dst,
        ):
            keys = fill(src.store, 10, 4096)[6:]
            assert [src.store.slot_of(k) for k in keys] == [6, 7, 8, 9]
            result = await dst.fetch(await dst.connect(src.address), keys)
            assert sorted(result.loaded) == sorted(keys) and not result.failed
            assert [dst.store.slot_of(k) for k in keys] == [0, 1, 2, 3]
            for k in keys:
                got, want = dst.store.get(k), src.store.get(k)
                assert got is not None and want is not None and bytes(got) == bytes(want)


class HangAfterFirst(FaultTransport):
    """FAKE: the first post of the node lands; every later one hangs until released."""

    def post_write(self, peer: Any, local_slots: Any, remote_slots: Any) -> TransferHandle:
        self.hang = self.posts >= 1
        return super().post_write(peer, local_slots, remote_slots)


@pytest.mark.parametrize("cut_while", ["summing", "writing"])
async def test_a_write_the_host_cuts_reports_no_key_ok_without_its_checksum(
    autojump_clock: trio.testing.MockClock, cut_while: str
) -> None:
    """With ``verify_checksums``, a write the host cuts (``release_unused_pins(
    cut_writes=True)``) reported its landed keys OK with checksums of 0 (cut while
    summing: the list was made before the sums) or with none (cut while a later chunk
    was in flight). A consumer that verifies then failed them as "checksum mismatch" or
    "producer sent no checksums (verify_checksums is off there?)", and quarantined their
    slots as suspect, where the cut promises ``aborted`` and slots freed at once. Now a
    key is OK only with its real checksum; the rest of a cut write is ``aborted``."""
    with trio.fail_after(VIRTUAL_BOUND):
        cfg: dict[str, Any] = {"verify_checksums": True, "max_keys_per_turn": 4}
        if cut_while == "summing":
            offload: VirtualOffload = TimedChecksums(0.01)
            factory = FaultFactory()
        else:
            offload, factory = VirtualOffload(), FaultFactory(kind=HangAfterFirst)
            cfg["transfer_chunk_bytes"] = 4 * 4096  # two chunks: the second hangs
        async with open_node(config("src", **cfg), offload=offload, transport=factory) as src:
            keys = fill(src.store, 8, 4096)
            raw, _ = await connected(src)
            req, hits = await raw.lookup(keys)
            assert all(hits)
            raw.proto.send_fetch(req, keys, list(range(8)))
            await raw.flush()
            await trio.sleep(0.02)  # virtual: in its first of two sums, or a chunk hanging
            assert await src.release_unused_pins(cut_writes=True) == 0
            done = await raw.next_event()
            assert isinstance(done, TransferCompleted) and done.req_id == req
            slots = cast("list[int]", [src.store.slot_of(k) for k in keys])
            want = checksums(src.store.array.data, 4096, slots)
            for i, o in enumerate(done.outcomes):
                if o == OK:  # vouched for: its real checksum comes with it
                    assert done.checksums is not None and done.checksums[i] == want[i], i
                else:
                    assert o == int(Outcome.ABORTED), (i, o)
            if cut_while == "writing":  # the first chunk landed; the hanging one was cut
                assert done.outcomes[4:] == [int(Outcome.ABORTED)] * 4
            await raw.aclose()


class BusyRelease(FaultTransport):
    """FAKE: every release tried without waiting finds the data plane busy (as while
    another fetch's post copies inside it); records the thread of each real release."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.release_threads: list[int] = []

    def release_nowait(self, handle: TransferHandle) -> bool:
        return False

    def release(self, handle: TransferHandle) -> None:
        self.release_threads.append(threading.get_ident())
        super().release(handle)


async def test_a_settled_writes_release_that_would_wait_leaves_the_engines_thread() -> None:
    """The producer released a settled write's handles on the engine's thread, and a NIXL
    release waits for the agent's lock, which a post holds across its copy: one fetch's
    end stalled every session for the rest of another fetch's post. A release that would
    wait is handed to a worker thread; the write is reported as usual."""
    factory = FaultFactory(kind=BusyRelease)
    async with open_node(config("src"), transport=factory) as src:
        keys = fill(src.store, 4, 4096)
        raw, _ = await connected(src)
        try:
            with trio.fail_after(BOUND):
                req, hits = await raw.lookup(keys)
                assert all(hits)
                raw.proto.send_fetch(req, keys, [0, 1, 2, 3])
                await raw.flush()
                done = await raw.next_event()
            assert isinstance(done, TransferCompleted) and done.outcomes == [OK] * 4
            released = cast("BusyRelease", factory.transport).release_threads
            assert released and threading.get_ident() not in released
        finally:
            await raw.aclose()


async def test_a_key_the_round_does_not_hold_between_two_it_does_is_not_reported_ok() -> None:
    """A fetch names a key the lookup missed between two hits: it gets NOT_PINNED, never
    OK. The hits' writes go out as one chunk whose key indices (0 and 2) are not
    contiguous: marking the chunk's keys OK must not fill the gap between them."""
    async with open_node(config("src", num_blocks=64), transport=FaultFactory()) as src:
        present = fill(src.store, 2, 4096)
        keys = [present[0], os.urandom(32), present[1]]
        raw, _ = await connected(src)
        try:
            with trio.fail_after(BOUND):
                req, hits = await raw.lookup(keys)
                assert hits == [True, False, True]
                raw.proto.send_fetch(req, keys, [0, 1, 2])
                await raw.flush()
                done = await raw.next_event()
            assert isinstance(done, TransferCompleted)
            assert done.outcomes == [OK, int(Outcome.NOT_PINNED), OK]
        finally:
            await raw.aclose()


async def test_a_quarantined_rounds_pins_outlast_an_abort_and_a_hosts_release(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A write cut before it settled (here by a host draining its pins) is released at
    ``abort_timeout`` and its round held for the ``quarantine``: the data plane may still
    read its sources. Neither the consumer's abort arriving then nor another
    ``release_unused_pins`` may unpin them early; the quarantine's end does."""
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))
        async with node("src", factory=hanging, abort_timeout=1.0, quarantine=20.0) as src:
            keys = fill(src.store, 3, 4096)
            raw, session = await connected(src)
            req, _ = await raw.lookup(keys)
            raw.proto.send_fetch(req, keys, [0, 1, 2])
            await raw.flush()
            await trio.sleep(0.5)  # virtual: the write hangs
            assert await src.release_unused_pins(cut_writes=True) == 0  # cut, not released
            await trio.sleep(2.0)  # past abort_timeout: the round is quarantined
            cut_at = trio.current_time() - 2.0
            assert session._pinned[req].quarantined and req not in session._writes
            raw.proto.send_abort(req)
            await raw.flush()
            await trio.sleep(1.0)
            assert await src.release_unused_pins() == 0
            assert src.statistics().pinned_slots == 3  # still: the quarantine runs
            ev = await raw.next_event()  # the round's answer comes at the quarantine's end
            assert isinstance(ev, AbortAcknowledged | TransferCompleted) and ev.req_id == req
            assert trio.current_time() >= cut_at + 20.0
            assert src.statistics().pinned_slots == 0
            await raw.aclose()


# --- item 7: per-peer caps, and expired rounds keep nothing -------------------------------


def check_holding(session: PeerSession, n: Node, *, keys: int, pins: int, rounds: int) -> None:
    """The session holds at most these, by every count we keep."""
    proto = session.proto
    assert proto.keys_held() <= keys
    assert proto.pins_held() <= pins
    assert len(proto.open_rounds()) <= rounds
    assert proto.tombstones() <= rounds
    assert len(session._pinned) <= rounds
    assert sum(len(h.keys) for h in session._pinned.values()) <= pins
    assert sum(n.store.pins_of(h.owner) for h in session._pinned.values()) <= pins


def check_holds_nothing(session: PeerSession, n: Node) -> None:
    proto = session.proto
    assert proto.keys_held() == proto.pins_held() == 0
    assert proto.open_rounds() == [] and session._pinned == {}
    assert n.statistics().pinned_slots == 0


async def test_a_peer_that_never_fetches_is_held_to_its_caps_and_expired_rounds_are_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_BOUND):
        caps = {"keys": 6000, "pins": 300, "rounds": 8}
        async with node(
            "src",
            lease=5.0,
            max_open_requests=caps["rounds"],
            max_keys_per_request=8192,
            max_keys_held_per_peer=caps["keys"],
            max_pinned_blocks=caps["pins"],
        ) as src:
            present = fill(src.store, 64, 4096)
            raw, session = await connected(src)
            warm, _ = await raw.lookup(present[:1])  # codec and handler paths warmed up
            raw.proto.send_fetch(warm, [], [])
            await raw.flush()
            await trio.sleep(0.5)
            gc.collect()
            tracemalloc.start()
            try:
                baseline = tracemalloc.get_traced_memory()[0]
                reqs: list[int] = []
                for _wave in range(3):  # 24 rounds in all: three times the cap on open rounds
                    pinned = 0
                    for _ in range(caps["rounds"]):
                        keys = present + [os.urandom(32) for _ in range(4096 - len(present))]
                        req, hits = await raw.lookup(keys)
                        reqs.append(req)
                        pinned += sum(hits)
                        check_holding(session, src, **caps)
                    del keys, hits
                    assert pinned == caps["pins"]  # the pin cap was reached, never passed
                    await trio.sleep(5.5)  # every lease runs out
                    check_holds_nothing(session, src)
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - baseline
            finally:
                tracemalloc.stop()
            # One wave's key lists alone are 8 x 4,096 keys of 32 bytes (over 2 MiB with their
            # objects); the expired rounds must have given all of them back.
            assert grown < 512 << 10, f"{grown} bytes still held after every lease ran out"
            # A lookup over the keys cap is answered all misses, nothing pinned; still alive.
            big = present + [os.urandom(32) for _ in range(8000 - len(present))]
            req, hits = await raw.lookup(big)
            assert not any(hits)
            assert session.proto.pins_held() == 0 and session.alive
            # A fetch for an expired round gets LEASE_EXPIRED, whether its tombstone is kept
            # (the latest round) or was dropped (the first): never a protocol error.
            for old in (reqs[0], reqs[-1]):
                raw.proto.send_fetch(old, present[:2], [0, 1])
                await raw.flush()
                done = await raw.next_event()
                assert isinstance(done, TransferCompleted) and done.req_id == old
                assert done.outcomes == [LEASE_EXPIRED] * 2
            assert not raw.array.any() and session.alive
            await raw.aclose()


@pytest.mark.parametrize("by_hits", [False, True], ids=["fetch", "fetch_hits"])
async def test_over_the_keys_cap_a_lookup_gets_misses_and_a_fetch_over_cap(
    autojump_clock: trio.testing.MockClock, by_hits: bool
) -> None:
    with trio.fail_after(VIRTUAL_BOUND):
        hanging = FaultFactory(lambda t: setattr(t, "hang", True))  # fetches stay in flight
        async with node("src", factory=hanging, max_keys_held_per_peer=200) as src:
            present = fill(src.store, 64, 4096)
            raw, session = await connected(src)

            def fetch(req: int) -> None:  # the round's hits, by their keys or by the round
                if by_hits:
                    raw.proto.send_fetch_hits(req, list(range(64)))
                else:
                    raw.proto.send_fetch(req, present, list(range(64)))

            a, hits = await raw.lookup(present)
            assert all(hits)  # held: 64 pins
            fetch(a)
            await raw.flush()
            await trio.sleep(0.5)
            assert session.proto.keys_held() == 128  # the pins and the fetch in flight
            b, hits = await raw.lookup(present)
            assert all(hits)  # 128 + 64 answering keys <= 200
            fetch(b)  # 192 + 64 > 200
            await raw.flush()
            done = await raw.next_event()
            assert isinstance(done, TransferCompleted) and done.req_id == b
            assert done.outcomes == [OVER_CAP] * 64
            c, hits = await raw.lookup(present + [os.urandom(32) for _ in range(36)])
            assert not any(hits)  # 128 + 100 > 200: every key a miss, nothing pinned
            assert session.proto.pins_held() == 64 and session.proto.keys_held() == 128
            assert hanging.transport.posts == 1 and session.alive
            raw.proto.send_fetch(c, [], [])
            await raw.flush()
            await raw.aclose()


async def test_bytes_in_flight_are_capped_within_a_fetch_and_across_fetches(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``max_inflight_bytes``: a key whose write would take the producer's bytes in
    flight to this peer past the cap is answered OVER_CAP and never posted. The cap is
    per peer, over all its fetches: a second fetch while the first one's writes are in
    flight gets only what is left, and what a finished fetch held is free again."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with node("src", factory=factory, max_inflight_bytes=3 * 4096) as src:
            keys = fill(src.store, 6, 4096)
            raw, session = await connected(src)
            req, hits = await raw.lookup(keys[:5])
            assert all(hits)
            raw.proto.send_fetch(req, keys[:5], [0, 1, 2, 3, 4])
            await raw.flush()
            done = await raw.next_event()
            assert isinstance(done, TransferCompleted) and done.req_id == req
            assert done.outcomes == [OK] * 3 + [OVER_CAP] * 2  # in the fetch's order
            assert raw.array[3 * 4096 :].any() == False  # noqa: E712 - nothing over the cap
            assert session.inflight_bytes == 0  # given back once the writes settled
            factory.transport.hang = True  # from here on, writes stay in flight
            first, _ = await raw.lookup(keys[:2])
            raw.proto.send_fetch(first, keys[:2], [10, 11])
            await raw.flush()
            await trio.sleep(0.5)  # virtual: the first fetch's two writes are posted
            assert session.inflight_bytes == 2 * 4096
            second, _ = await raw.lookup(keys[2:4])
            raw.proto.send_fetch(second, keys[2:4], [12, 13])
            await raw.flush()
            await trio.sleep(0.5)
            assert session.inflight_bytes == 3 * 4096  # one more fitted, one did not
            assert factory.transport.posts == 3  # the 5-key fetch, then one post per fetch
            await raw.aclose()


async def test_a_write_the_data_plane_reports_failed_is_never_reported_loaded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A posted write that completes with ERR (bytes may even have landed) is answered
    TRANSFER_FAILED for every key of it: only a write reported DONE makes a key OK."""

    with trio.fail_after(VIRTUAL_BOUND):

        class ErringWrites(FaultTransport):
            """FAKE data plane: writes land, but every one is reported ERR."""

            def poll(self, handle: TransferHandle) -> TransferState:
                state = super().poll(handle)
                return TransferState.ERR if state is TransferState.DONE else state

        async with node("src", factory=FaultFactory(kind=ErringWrites)) as src:
            raw, session, _, done = await one_fetch(src, 4)
            assert done.outcomes == [TRANSFER_FAILED] * 4
            assert session.alive and src.statistics().pinned_slots == 0
            await raw.aclose()


@pytest.mark.parametrize(
    ("post_after", "expired"), [(4.0, False), (6.0, True)], ids=["in_time", "past_the_lease"]
)
async def test_no_write_starts_after_its_rounds_lease_however_late_it_reaches_the_data_plane(
    autojump_clock: trio.testing.MockClock, post_after: float, expired: bool
) -> None:
    """A fetch read in time whose posts reach the data plane ``post_after`` seconds later
    (FAKE delay of the posting call; a data plane busy with others' writes, or a loop that
    stalled and read the fetch before the lease timer ran, come to the same) posts
    nothing once its round's 5 s lease has ended: every key LEASE_EXPIRED (the consumer
    may look them up again), nothing written, the round's pins released, the session
    serving. A consumer's bound on late writes counts on it (docs/design.md)."""
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with node("src", lease=5.0, factory=factory, delays={"_post_run": post_after}) as src:
            raw, session, keys, done = await one_fetch(src, 4)
            if expired:
                assert done.outcomes == [LEASE_EXPIRED] * 4
                assert factory.transport.posts == 0 and not raw.array.any()
            else:
                assert done.outcomes == [OK] * 4
                assert factory.transport.posts == 1 and raw.array.any()
            assert session.alive and src.statistics().pinned_slots == 0
            _, hits = await raw.lookup(keys[:1])  # still serving
            assert hits == [True]
            await raw.aclose()


async def test_each_chunk_of_a_write_is_posted_only_within_its_rounds_lease(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fetches of two one-key chunks each; each run of posts reaches the data plane
    3 s late (FAKE delay), and the other fetch wants the data plane, so a run posts one
    chunk and lets go: the first chunk goes at 3 s, inside the 5 s lease, and every
    later one comes past it. The chunk posted is OK, the rest LEASE_EXPIRED (which
    fetch went first is the scheduler's), only the posted key is checksummed, and
    nothing of either round is left held."""
    summed_slots: list[int] = []
    real_summed = producer_module.summed

    async def counting(n: Node, slots: Sequence[int]) -> list[int]:  # a probe, not a fake
        summed_slots.extend(slots)
        return await real_summed(n, slots)

    monkeypatch.setattr(producer_module, "summed", counting)
    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory()
        async with node(
            "src",
            lease=5.0,
            factory=factory,
            transfer_chunk_bytes=4096,
            verify_checksums=True,
            delays={"_post_run": 3.0},
        ) as src:
            keys = fill(src.store, 4, 4096)
            raw, session = await connected(src)
            ra, _ = await raw.lookup(keys[:2])
            rb, _ = await raw.lookup(keys[2:])
            raw.proto.send_fetch(ra, keys[:2], [0, 1])
            raw.proto.send_fetch(rb, keys[2:], [2, 3])
            await raw.flush()
            got: dict[int, list[int]] = {}
            while len(got) < 2:
                ev = await raw.next_event()
                assert isinstance(ev, TransferCompleted), ev
                got[ev.req_id] = list(ev.outcomes)
            assert sorted(got.values()) == [[OK, LEASE_EXPIRED], [LEASE_EXPIRED] * 2]
            assert factory.transport.posts == 1 and len(summed_slots) == 1
            assert session.inflight_bytes == 0 and src.statistics().pinned_slots == 0
            assert session._pinned == {} and session._writes == {} and session.alive
            await raw.aclose()


async def test_a_lease_ending_within_one_run_of_posts_stops_it_before_the_next_chunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One run of posts, nobody else wanting the data plane: a data plane that copies
    inside the post call (FAKE: each post takes 6 s of the 5 s lease) gets the first
    chunk, and the second is checked before its post, not only the run's first."""

    class CopiesInline(FaultTransport):
        """FAKE data plane: a post returns only once its copy took 6 s."""

        def post_write(self, *args: Any) -> TransferHandle:
            h = super().post_write(*args)
            autojump_clock.jump(6.0)
            return h

    with trio.fail_after(VIRTUAL_BOUND):
        factory = FaultFactory(kind=CopiesInline)
        async with node("src", lease=5.0, factory=factory, transfer_chunk_bytes=4096) as src:
            raw, session, _, done = await one_fetch(src, 2)
            assert done.outcomes == [OK, LEASE_EXPIRED]
            assert factory.transport.posts == 1
            assert session.inflight_bytes == 0 and src.statistics().pinned_slots == 0
            await raw.aclose()


# --- item 12: fairness between peers ------------------------------------------------------


async def test_a_flood_of_small_lookups_does_not_starve_another_peer() -> None:
    flood = 3000
    cfg = config("src", max_open_requests=flood + 10)
    async with open_node(cfg, offload=inline_offload, transport=FaultFactory()) as src:
        key = fill(src.store, 1, 4096)[0]
        flooder, _ = await connected(src, max_open_requests=flood + 10)
        good, _ = await connected(src)
        received = 0
        first = trio.Event()

        async def count_answers() -> None:
            nonlocal received
            while received < flood:
                ev = await flooder.next_event()
                assert isinstance(ev, LookupAnswered)
                received += 1
                first.set()

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(count_answers)
                for _ in range(flood):
                    flooder.proto.send_lookup([key])
                await flooder.flush()  # the whole flood in one burst
                await first.wait()  # the node is working through it
                _, hits = await good.lookup([key])
                before_good = received
        assert hits == [True]
        # Old behaviour: the good lookup waited for the whole 64 KiB read (~1,200 lookups)
        # the flooder's session was handling. Now each session handles at most
        # max_events_per_turn (64) events per turn; this bound leaves 6 turns of slack.
        assert before_good <= 400, f"the flooder got {before_good} answers first"
        await flooder.aclose()
        await good.aclose()


async def test_a_big_lookup_is_pinned_in_slices_while_another_peer_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answered: list[str | None] = []  # whose lookup the node answered, in order
    real_answer = SessionProtocol.send_lookup_resp

    def answer(self: SessionProtocol, *args: Any, **kw: Any) -> None:
        answered.append(self.peer_id)
        real_answer(self, *args, **kw)

    monkeypatch.setattr(SessionProtocol, "send_lookup_resp", answer)
    async with open_node(config("src"), offload=inline_offload, transport=FaultFactory()) as src:
        key = fill(src.store, 1, 4096)[0]
        big, _ = await connected(src)
        good, _ = await connected(src)
        pinning = trio.Event()
        real_pin = src.store.pin

        def pin(owner: object, keys: Any) -> list[int | None]:
            pinning.set()
            return real_pin(owner, keys)

        monkeypatch.setattr(src.store, "pin", pin)
        with trio.fail_after(BOUND):
            big.proto.send_lookup([key] + [os.urandom(32) for _ in range(65535)])
            await big.flush()
            await pinning.wait()  # the node has started on the big lookup
            _, hits = await good.lookup([key])
            assert hits == [True]
            ev = await big.next_event()
            assert isinstance(ev, LookupAnswered) and ev.hits[0] and sum(ev.hits) == 1
        assert answered == [good.peer_id, big.peer_id]
        await big.aclose()
        await good.aclose()


class FramesPerStep(trio.abc.Instrument):
    """The most frames a session decoded in one task step: what its reader does between
    two chances for the other sessions to run."""

    def __init__(self, proto: Any) -> None:
        self.proto = proto
        self.before = 0
        self.most = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.before = self.proto.frames_received

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.most = max(self.most, self.proto.frames_received - self.before)


async def test_a_spent_turn_sends_what_it_queued_before_it_yields() -> None:
    """A turn whose budget is spent sends what the session queued, then yields, then
    starts afresh; one with budget left does neither. Without the send, the answers of a
    whole read would wait behind every one of its requests."""
    sent: list[int] = []

    async def flush() -> None:  # no checkpoint, as a flush with the socket free
        sent.append(turn.events)

    turn = Turn(max_events=2, max_keys=8, flush=flush)
    turn.charge(events=1, keys=7)
    await turn.pause_if_spent()
    assert sent == [] and turn.room() == 1
    turn.charge(events=1)
    with trio.CancelScope() as scope:
        scope.cancel()
        await turn.pause_if_spent()  # the yield raises Cancelled: it comes after the send
    assert scope.cancelled_caught and sent == [2]
    await turn.pause_if_spent()
    assert sent == [2, 2] and (turn.events, turn.keys) == (0, 0) and turn.room() == 8


@pytest.mark.parametrize("per_turn", [8, 64])
async def test_a_flood_of_pings_is_handled_a_turn_at_a_time(per_turn: int) -> None:
    """A session handles at most ``max_events_per_turn`` of its peer's frames before
    the other sessions may run, frames that make no event too: a ping only queues a
    pong, and a whole 64 KiB read of pings (~3,400) used to be one step of the reader
    (35-45 ms on this machine), which every other peer's lookup waited behind."""
    flood = 20000
    async with open_node(config("src", max_events_per_turn=per_turn)) as src:
        flooder = RawPeer()
        try:
            with trio.fail_after(BOUND * 3):
                await flooder.connect(src.address)
                await flooder.handshake()
                steps = FramesPerStep(src._by_peer[flooder.peer_id].proto)
                trio.lowlevel.add_instrument(steps)
                try:
                    async with trio.open_nursery() as nursery:
                        # The pongs are read meanwhile: the node stops reading while
                        # its own sends are blocked.
                        nursery.start_soon(flooder.send_raw, encode(Ping(nonce=1)) * flood)
                        for _ in range(flood):
                            assert isinstance(await flooder.next_event(), PongReceived)
                finally:
                    trio.lowlevel.remove_instrument(steps)
            assert 0 < steps.most <= per_turn, f"{steps.most} frames in one step"
        finally:
            await flooder.aclose()


class KeysPerStep(trio.abc.Instrument):
    """The most keys the store was asked to pin in one task step."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.now = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.most = max(self.most, self.now)


async def test_a_lookup_after_another_in_one_turn_pins_only_what_the_turn_has_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two lookups in one read: the second's first slice is what the turn has left after
    the first (``max_keys_per_turn`` less the keys charged), not a whole turn's worth, so
    a session never pins more than ``max_keys_per_turn`` keys between two chances for the
    other sessions to run. A slice of a whole turn made it 1.6 x here, up to 2 x."""
    per_turn = 64
    async with open_node(config("src", max_keys_per_turn=per_turn)) as src:
        raw = RawPeer()
        steps = KeysPerStep()
        real_pin = src.store.pin

        def pin(owner: object, keys: Any) -> list[int | None]:
            steps.now += len(keys)
            return real_pin(owner, keys)

        monkeypatch.setattr(src.store, "pin", pin)
        try:
            with trio.fail_after(BOUND):
                await raw.connect(src.address)
                await raw.handshake()
                raw.proto.send_lookup([os.urandom(32) for _ in range(40)])
                raw.proto.send_lookup([os.urandom(32) for _ in range(200)])
                trio.lowlevel.add_instrument(steps)
                try:
                    await raw.flush()  # both in one write: read in one receive
                    for _ in range(2):
                        assert isinstance(await raw.next_event(), LookupAnswered)
                finally:
                    trio.lowlevel.remove_instrument(steps)
            assert 0 < steps.most <= per_turn, f"{steps.most} keys pinned in one step"
        finally:
            await raw.aclose()


async def pin_all(src: Node, raw: RawPeer, keys: list[bytes]) -> list[bool]:
    """``raw`` connects to ``src`` and looks ``keys`` up (never fetching): the hits."""
    await raw.connect(src.address)
    await raw.handshake()
    raw.proto.send_lookup(keys)
    await raw.flush()
    ev = await raw.next_event()
    assert isinstance(ev, LookupAnswered)
    return ev.hits


@pytest.mark.parametrize(("peer_share", "held"), [(None, [16, 16]), (1.0, [32, 0])])
async def test_peers_together_pin_at_most_their_share_of_the_store(
    peer_share: float | None, held: list[int]
) -> None:
    """Pinned slots cannot be evicted. With ``max_pinned_share``, peers together pin at
    most that share of the store (hits past it are answered as misses), so the host can
    still put while a peer sits on the pins of lookups it never fetches. One peer holds
    at most ``max_pinned_peer_share`` of that (0.5 by default): before, the first peer
    to sit on its pins held the whole share and every other peer's lookups missed; 1
    restores first come, first served."""
    kw = {} if peer_share is None else {"max_pinned_peer_share": peer_share}
    async with open_node(config("src", num_blocks=64, max_pinned_share=0.5, **kw)) as src:
        keys = fill(src.store, 64, 4096)
        first, second = RawPeer(), RawPeer()
        try:
            with trio.fail_after(BOUND):
                hits = [await pin_all(src, first, keys[:48]), await pin_all(src, second, keys[16:])]
            assert [sum(h) for h in hits] == held, hits
            assert src.store.statistics().pinned == 32
            src.store.put(os.urandom(32), os.urandom(4096))  # evicts an unpinned block
        finally:
            await first.aclose()
            await second.aclose()


@pytest.mark.parametrize(
    ("kw", "hits"),
    [
        ({"max_pinned_share": 0.5, "max_pinned_blocks": 4}, 4),  # the peer's own cap is less
        ({"max_pinned_share": 1 / 64}, 1),  # a bound of one slot: half of it is still one
    ],
    ids=["max_pinned_blocks", "one_slot"],
)
async def test_a_peers_pin_cap_under_a_node_wide_bound_is_the_least_and_at_least_one(
    kw: dict[str, Any], hits: int
) -> None:
    """Under a node-wide pin bound (``max_pinned_share`` here) a peer may pin the least
    of ``max_pinned_blocks`` and its ``max_pinned_peer_share`` of the bound, and at least
    one slot where the bound has one. Mutation pass on the session logic (2026-12-06):
    ``peer_pin_cap`` ignoring ``max_pinned_blocks`` where there is a bound (16 pins for a
    cap of 4), and without its floor of one (a one-slot bound: every lookup of every
    peer all misses), survived."""
    async with open_node(config("src", num_blocks=64, **kw)) as src:
        keys = fill(src.store, 24, 4096)
        raw = RawPeer()
        try:
            with trio.fail_after(BOUND):
                assert sum(await pin_all(src, raw, keys)) == hits
            assert src.store.statistics().pinned == hits
        finally:
            await raw.aclose()


def count_pins(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the store's ``pin`` calls from now on (one element: the count)."""
    calls = [0]
    real = BlockStore.pin

    def pin(self: BlockStore, owner: object, keys: Any) -> list[int | None]:
        calls[0] += 1
        return real(self, owner, keys)

    monkeypatch.setattr(BlockStore, "pin", pin)
    return calls


@pytest.mark.parametrize("near", ["its_own_pin_cap", "the_share_another_peer_holds"])
async def test_a_lookup_near_a_pin_cap_costs_a_store_call_per_slice_not_per_key(
    monkeypatch: pytest.MonkeyPatch, near: str
) -> None:
    """With one pin of room left, a lookup was pinned one key per store call (misses use
    no room): 65,536 calls, each taking the lock the host's thread shares, for a lookup
    of misses, ~5 x the engine's time. Under ``max_pinned_share``, one peer holding the
    share minus one put every other peer's lookups on that path."""
    kw: dict[str, Any] = {"num_blocks": 64}
    if near == "its_own_pin_cap":
        kw["max_pinned_blocks"] = 9
    else:
        kw["max_pinned_share"] = 0.5  # 32 slots for all peers together
        kw["max_pinned_peer_share"] = 1.0  # the hog may hold all of them
    async with open_node(config("src", **kw), offload=inline_offload) as src:
        present = fill(src.store, 64, 4096)
        hog, _ = await connected(src)
        victim = hog
        try:
            with trio.fail_after(BOUND):
                held = 8 if near == "its_own_pin_cap" else 31  # one short of the cap
                _, hits = await hog.lookup(present[:held])
                assert sum(hits) == held
                if near == "the_share_another_peer_holds":
                    victim, _ = await connected(src)
                calls = count_pins(monkeypatch)
                misses = [os.urandom(32) for _ in range(65535)]  # + 1: the cap per request
                # The one key that can still be pinned, far into the lookup.
                keys = [*misses[:40000], present[-1], *misses[40000:]]
                _, hits = await victim.lookup(keys)
            assert [i for i, h in enumerate(hits) if h] == [40000]
            assert src.store.statistics().pinned == held + 1
            # A call per slice of a turn's keys (1,024), not one per key.
            assert calls[0] <= 2 * (len(keys) // 1024), calls[0]
        finally:
            await hog.aclose()
            if victim is not hog:
                await victim.aclose()


async def test_near_a_pin_cap_the_first_present_keys_are_pinned_in_the_lookups_order() -> None:
    """Room for 3 more pins; the lookup holds misses and 5 present keys, interleaved:
    the first 3 present ones are hits, in order, the rest misses, and 3 pins are taken."""
    async with open_node(config("src", num_blocks=64, max_pinned_blocks=3)) as src:
        present = fill(src.store, 5, 4096)
        raw, _ = await connected(src)
        try:
            with trio.fail_after(BOUND):
                keys: list[bytes] = []
                for k in present:
                    keys += [os.urandom(32), k]
                _, hits = await raw.lookup(keys)
            assert [i for i, h in enumerate(hits) if h] == [1, 3, 5]
            assert src.store.statistics().pinned == 3
        finally:
            await raw.aclose()


@pytest.mark.parametrize("path", ["near_a_pin_cap", "slices_with_misses"])
async def test_each_key_a_lookup_pinned_is_served_from_its_own_slot(path: str) -> None:
    """A lookup records each hit's source slot by the key's index in the lookup, on the
    path for a slice with misses (past the first slice) and on the path near a pin cap.
    Mutation testing found no test that fetched, by key, what those paths pinned: a
    mix-up of keys and slots there (invariant 1: wrong bytes reported loaded) went
    unnoticed. Each key reported OK is written with the producer's bytes for it."""
    kw: dict[str, Any] = {"num_blocks": 64}
    if path == "near_a_pin_cap":
        kw["max_pinned_blocks"] = 3
    else:
        kw["max_keys_per_turn"] = 4
    async with open_node(config("src", **kw), transport=FaultFactory()) as src:
        present = fill(src.store, 5, 4096)
        keys: list[bytes] = []
        for k in present:
            keys += [os.urandom(32), k]
        with trio.fail_after(BOUND):
            raw, _ = await connected(src)
        try:
            with trio.fail_after(BOUND):
                req, hits = await raw.lookup(keys)
                hit_keys = [k for k, h in zip(keys, hits, strict=True) if h]
                n = 3 if path == "near_a_pin_cap" else 5
                assert hit_keys == present[:n]
                raw.proto.send_fetch(req, hit_keys, list(range(n)))
                await raw.flush()
                done = await raw.next_event()
            assert isinstance(done, TransferCompleted)
            assert done.outcomes == [OK] * n
            for slot, k in enumerate(hit_keys):
                landed = raw.array[slot * 4096 : (slot + 1) * 4096].tobytes()
                assert landed == bytes(src.store.get(k) or b""), f"key {slot} has other bytes"
        finally:
            await raw.aclose()


async def test_a_lookup_of_several_slices_pins_no_more_than_the_peers_pin_cap() -> None:
    """Room for 6 pins, a lookup of 8 present keys in slices of 4: the first slice is
    pinned whole and counts against the room, so the second pins 2, not 4."""
    cfg = config("src", num_blocks=64, max_pinned_blocks=6, max_keys_per_turn=4)
    async with open_node(cfg) as src:
        present = fill(src.store, 8, 4096)
        raw, _ = await connected(src)
        try:
            with trio.fail_after(BOUND):
                _, hits = await raw.lookup(present)
            assert hits == [True] * 6 + [False] * 2
            assert src.store.statistics().pinned == 6
        finally:
            await raw.aclose()


async def test_a_host_whose_every_slot_a_peer_pinned_is_told_how_to_get_them_back() -> None:
    """By default (share 1) a peer may pin a whole store, so that a full store can be
    fetched in one go; a host that puts then gets StoreFull, which names its remedies, and
    after ``release_unused_pins`` its put succeeds (the peer's fetch would then find
    those keys NOT_PINNED)."""
    async with open_node(config("src", num_blocks=64)) as src:
        keys = fill(src.store, 64, 4096)
        raw = RawPeer()
        try:
            with trio.fail_after(BOUND):
                assert all(await pin_all(src, raw, keys))
            with pytest.raises(StoreFull, match="release_unused_pins"):
                src.store.put(os.urandom(32), os.urandom(4096))
            assert await src.release_unused_pins() == 1
            src.store.put(os.urandom(32), os.urandom(4096))
        finally:
            await raw.aclose()
