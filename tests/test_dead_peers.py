"""A dead or stalled peer costs only its own requests, and churn leaves nothing behind.

Found by a review (2026-12-03); each test but the last failed before its fix:

- a probe, the keepalive, the lease timer and the registration flushed like a caller
  and, past ``OUTBOX_CAP`` queued to a peer that stopped reading, waited for the socket:
  a restarted peer could not get back in, and later request deadlines were not kept,
  until ``idle_timeout`` ended the stuck session;
- our dial that lost a simultaneous-dial tie-break *here* raised instead of returning
  the peer through the winning connection;
- a lookup waiting for a request slot of a session that died waited out its deadline
  and then reported "no request slot free";
- concurrent connects to a silent address failed one after another (10, 20, 30 s).

Real TCP on loopback; FAKE offload and transport (``tests.helpers``), autojump clock.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from p2pkv import P2PKVError, SessionClosed
from p2pkv.session import session as session_mod
from p2pkv.session.protocol import (
    AbortRequested,
    ByeReceived,
    HelloReceived,
    LookupAnswered,
    LookupRequested,
    Ready,
    SessionProtocol,
)
from p2pkv.session.session import PeerSession

from ._clock import kernel_paced
from .helpers import RawPeer, SendGate, fill, until
from .helpers import virtual_node as node
from .test_producer_caps import connected

# Virtual seconds on the autojump clock: "this did not hang", never an expected duration;
# above every deadline and wait of the tests that use it.
VIRTUAL_BOUND = 120.0


def big_keys(tag: int, n: int = 8192) -> list[bytes]:
    """n keys of 128 bytes (a ~1.1 MiB lookup frame)."""
    return [tag.to_bytes(2, "big") + i.to_bytes(4, "big") + bytes(122) for i in range(n)]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_probe_of_a_session_past_the_outbox_cap_answers_within_probe_timeout(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our lookups to a peer that died without a reset (stopped reading) fill the outbox
    past OUTBOX_CAP. The peer restarts and dials again: the node probes the old session,
    which should answer "silent" within probe_timeout (docs: "Neither the keepalive, the
    lease timer nor a probe ... waits for [a full socket]"), so that the restarted peer's
    handshake completes well within handshake_timeout."""
    with trio.fail_after(VIRTUAL_BOUND):
        gate = SendGate(monkeypatch)
        async with node("n", probe_timeout=2.0, handshake_timeout=10.0, idle_timeout=30.0) as n:
            raw, s = await connected(n)
            gate.shut(s)  # the peer's host is gone: nothing we send is taken any more
            failures: list[BaseException] = []

            async def look(tag: int) -> None:
                try:
                    await n.lookup(raw.peer_id, big_keys(tag))
                except P2PKVError as exc:
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                for tag in range(12):
                    nursery.start_soon(look, tag)
                await trio.sleep(0.1)
                assert s._send_lock.locked()
                assert s.proto.bytes_to_send() > session_mod.OUTBOX_CAP

                # The peer restarted (new epoch) and dials in again.
                raw2 = RawPeer(raw.peer_id, epoch=raw.proto.local.epoch + 1)
                await raw2.connect(n.address)
                t0 = trio.current_time()
                raw2.proto.start()
                await raw2.flush()
                outcome: Any = None
                with trio.move_on_after(60):
                    while True:
                        ev = await raw2.next_event()
                        if ev is None or isinstance(ev, (ByeReceived, Ready)):
                            outcome = ev
                            break
                        if isinstance(ev, HelloReceived) and raw2.proto.registration_succeeded():
                            await raw2.flush()
                            outcome = "ready"
                            break
                        await raw2.flush()
                took = trio.current_time() - t0
                nursery.cancel_scope.cancel()
            await raw.aclose()
            await raw2.aclose()
        # Expected: probe (2 s) + the old session's close (~1.25 s), then admitted.
        assert not isinstance(outcome, ByeReceived), (outcome, took)
        assert took < 10.0, took


async def test_lookup_deadlines_are_kept_while_the_outbox_is_past_its_cap(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 1-key lookups are sent to a peer that has stopped reading (0 s and 0.5 s), then
    bigger lookups fill the outbox past OUTBOX_CAP. The lease timer wakes the first at its
    deadline (5 s); the second must time out at its own (5.5 s) with P2PKVTimeout, not
    wait until the session dies of the send deadline (idle_timeout)."""
    with trio.fail_after(VIRTUAL_BOUND):
        gate = SendGate(monkeypatch)
        async with node("n", lookup_timeout=5.0, idle_timeout=30.0) as n:
            raw, s = await connected(n)
            gate.shut(s)
            t0 = trio.current_time()
            ended: dict[str, tuple[float, BaseException]] = {}

            async def look(name: str, keys: list[bytes]) -> None:
                try:
                    await n.lookup(raw.peer_id, keys)
                except P2PKVError as exc:
                    ended[name] = (trio.current_time() - t0, exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(look, "a", [b"a" * 32])
                await trio.sleep(0.5)
                nursery.start_soon(look, "d", [b"d" * 32])
                await trio.sleep(0.5)
                for tag in range(12):
                    nursery.start_soon(look, f"big{tag}", big_keys(tag))
                await trio.sleep(0.1)
                assert s.proto.bytes_to_send() > session_mod.OUTBOX_CAP
                await trio.sleep(10.0)
                nursery.cancel_scope.cancel()
            await raw.aclose()
        assert "a" in ended and ended["a"][0] == pytest.approx(5.0, abs=0.1), ended.get("a")
        assert "d" in ended, f"still waiting at 11 s (deadline 5.5 s); {s.close_reason=}"
        when, exc = ended["d"]
        assert when == pytest.approx(5.5, abs=0.1) and "timed out" in str(exc), (when, exc)


async def test_connect_returns_the_peer_when_our_dial_loses_the_tie_break_here(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Simultaneous dials between "a" and "b" (same epochs). b dialed a (S1), a's hello
    came back, and a's ack is not in yet (a is still registering b). a's own dial (S2)
    then reaches b: by the tie-break (the connection the smaller id dialed wins) b closes
    S1 itself. b.connect() must return the peer (docs: "a refused duplicate dial also
    returns the live peer"; test_simultaneous_dials_settle_on_one_session), not raise
    because S1 was closed by b's own decision rather than by a's bye."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with node("b") as b:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            addr = listeners[0].socket.getsockname()[:2]
            a2 = RawPeer("a", epoch=99)  # a's own dial, same incarnation (region: a1's)
            a1 = RawPeer("a", epoch=99)  # a's accepted side of b's dial
            a2.proto = SessionProtocol(attrs.evolve(a1.proto.local, dialer=True))
            got: list[Any] = []

            async def dial() -> None:
                try:
                    got.append(await b.connect(addr))
                except P2PKVError as exc:
                    got.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(dial)
                a1.stream = await listeners[0].accept()
                a1.proto.start()
                await a1.flush()  # a's hello on S1; a never acks on S1 (still registering b)
                with trio.fail_after(5):
                    await until(lambda: "a" in b._by_peer)
                s1 = b._by_peer["a"]
                assert s1 in b._dialed and not s1.ready.is_set()
                await a2.connect(b.address)
                with trio.fail_after(5):
                    await a2.handshake()  # b admits S2 (the one "a" dialed) and it is ready
            assert b.is_connected("a") and b._by_peer["a"] is not s1
            await a1.aclose()
            await a2.aclose()
            for lst in listeners:
                await lst.aclose()
        assert len(got) == 1 and not isinstance(got[0], BaseException), got


async def test_a_dial_refused_as_a_duplicate_returns_only_once_the_winner_is_ready(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Simultaneous dials between "z" and "r" (same epochs): r's dial (S1) reached z first
    and is still handshaking (r has not acked). z's own dial (S2) then gets r's hello: by
    the tie-break S1, dialed by the smaller id, wins, and z refuses S2 itself. z.connect()
    returns the peer through S1, but only once S1 is established: connect() promises
    that both sides have registered each other, so the peer it returns is connected."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with node("z") as z:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            addr = listeners[0].socket.getsockname()[:2]
            r1 = RawPeer("r", epoch=5)  # r's own dial into z (region: r2's)
            r2 = RawPeer("r", epoch=5)  # r's accepted side of z's dial
            r1.proto = SessionProtocol(attrs.evolve(r2.proto.local, dialer=True))
            got: list[tuple[Any, bool]] = []

            async def dial() -> None:
                peer = await z.connect(addr)
                got.append((peer, z.is_connected(peer.peer_id)))

            await r1.connect(z.address)
            r1.proto.start()
            await r1.flush()
            assert isinstance(await r1.next_event(), HelloReceived)  # z's; r does not ack yet
            with trio.fail_after(5):
                await until(lambda: "r" in z._by_peer)
            s1 = z._by_peer["r"]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dial)
                r2.stream = await listeners[0].accept()
                r2.proto.start()
                await r2.flush()
                bye = await r2.expect_close()  # z refuses its own dial
                assert bye is not None and bye.code == "duplicate", bye
                with trio.fail_after(5):
                    await until(lambda: z.statistics().sessions == 1)  # the dial's has ended
                await trio.testing.wait_all_tasks_blocked()  # and connect() has seen it
                assert not got, "connect returned before the winning session was established"
                r1.proto.registration_succeeded()
                await r1.flush()
            assert [(p.peer_id, connected) for p, connected in got] == [("r", True)]
            assert z._by_peer["r"] is s1
            await r1.aclose()
            await r2.aclose()
            for lst in listeners:
                await lst.aclose()


async def test_a_lookup_waiting_for_a_request_slot_learns_at_once_that_the_session_died(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One request slot (max_open_requests=1): lookup A holds it, lookup B waits for it.
    The peer's connection then dies (it closes). A fails at once with SessionClosed; B,
    whose session is just as dead, should too, not wait out lookup_timeout for a slot of
    a session that no longer exists and then report "no request slot free"."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with node("n", max_open_requests=1, lookup_timeout=5.0) as n:
            raw, s = await connected(n)
            t0 = trio.current_time()
            ended: dict[str, tuple[float, BaseException]] = {}

            async def look(name: str) -> None:
                try:
                    await n.lookup(raw.peer_id, [name.encode() * 8])
                except P2PKVError as exc:
                    ended[name] = (trio.current_time() - t0, exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(look, "a")
                await trio.sleep(0.1)
                nursery.start_soon(look, "b")
                await trio.sleep(0.1)
                assert s._requests.free == 0
                await raw.aclose()  # the peer is gone
                await trio.sleep(1.0)
                snapshot = dict(ended)
        assert snapshot.get("a") is not None and snapshot["a"][0] < 0.5, snapshot
        assert snapshot.get("b") is not None, f"b still waiting 1 s after the session died; {ended}"
        # Typed as the session's end, as A's: handed the slot by the session's end, B must
        # not go on to send (mutation review 2026-12-06: without the check after the wait,
        # B's send on the closed session raised LocalProtocolError, a caller's mistake).
        for name in ("a", "b"):
            assert isinstance(snapshot[name][1], SessionClosed), snapshot


async def test_concurrent_connects_to_a_silent_address_share_one_dials_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three tasks connect() to one address at once; the host there accepts TCP and
    never says anything (a hung process). Concurrent connects share one dial (docs), so
    each should fail by about handshake_timeout (10 s, plus the close's linger), not
    one after another, the k-th after k handshake timeouts."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with node("n", handshake_timeout=10.0, connect_timeout=10.0) as n:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            addr = listeners[0].socket.getsockname()[:2]
            held: list[trio.SocketStream] = []
            ended: list[tuple[float, str]] = []

            async def accept_and_hang() -> None:
                while True:
                    held.append(await listeners[0].accept())

            async def dial() -> None:
                try:
                    await n.connect(addr)
                    ended.append((trio.current_time() - t0, "connected?"))
                except P2PKVError as exc:
                    ended.append((trio.current_time() - t0, type(exc).__name__))

            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_and_hang)
                async with trio.open_nursery() as dials:
                    for _ in range(3):
                        dials.start_soon(dial)
                nursery.cancel_scope.cancel()
            for st in held:
                await st.aclose()
            for lst in listeners:
                await lst.aclose()
        assert len(ended) == 3
        assert max(t for t, _ in ended) < 12.0, ended


async def test_a_connect_its_caller_gave_up_on_leaves_no_session_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The caller of connect() is cancelled (its own deadline) while the peer there has
    accepted TCP and says nothing. The half-made session used to stay, with its socket,
    until handshake_timeout, though nobody waited for it any more (found 2026-12-04);
    it is closed with the dial now, and the node keeps no record of it (its set of
    dialed sessions held every session ever dialed). A second connect afterwards dials
    afresh."""
    with trio.fail_after(1200):  # virtual: past its 600 s handshake_timeout
        async with node("n", handshake_timeout=600.0) as n:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            addr = listeners[0].socket.getsockname()[:2]
            held: list[trio.SocketStream] = []

            async def accept_and_hang() -> None:
                while True:
                    held.append(await listeners[0].accept())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_and_hang)
                for attempt in range(1, 3):
                    with trio.move_on_after(1.0) as cs:
                        await n.connect(addr)
                    assert cs.cancelled_caught
                    with trio.fail_after(5.0):  # virtual: well short of handshake_timeout
                        while n.statistics().sessions:
                            await trio.sleep(0.01)
                    assert len(held) == attempt and not n._dialing and not n._dialed
                nursery.cancel_scope.cancel()
            for st in held:
                await st.aclose()
            for lst in listeners:
                await lst.aclose()


async def test_a_reconnect_storm_leaves_everything_at_baseline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same peer id connects, looks up (pins held), and dies (reset, or silence then
    a restart that supersedes it), 40 times; everything returns to baseline."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with node("n", max_peer_registrations=1000, probe_timeout=0.5) as n:
            keys = fill(n.store, 4, 4096)
            await trio.sleep(0.1)
            fds0 = _fds()
            prev: RawPeer | None = None
            for i in range(40):
                raw = RawPeer("storm", epoch=1000 + i)
                await raw.connect(n.address)
                with trio.fail_after(30):
                    await raw.handshake()
                req = raw.proto.send_lookup(keys)
                await raw.flush()
                ev = await raw.next_event()
                assert isinstance(ev, LookupAnswered) and ev.req_id == req
                assert ev.hits == [True] * 4
                if prev is not None:
                    await prev.aclose()
                if i % 2:
                    await raw.aclose()  # reset / close
                    prev = None
                else:
                    prev = raw  # silent; the next one supersedes it
            if prev is not None:
                await prev.aclose()
            with trio.fail_after(60):
                await until(lambda: not n._sessions)
            st = n.statistics()
            assert (st.sessions, st.peers, st.pinned_slots, st.reserved_slots) == (0, 0, 0, 0), st
            assert st.registrations.live == 0 and st.registrations.current == 0, st.registrations
            assert n._by_peer == {} and n._strangers == {} and n._admitting == {}
            assert n._dialing == {} and n._dialed == set()
            assert n.transport.live == set()  # type: ignore[attr-defined]
            assert _fds() == fds0, (_fds(), fds0)


async def test_a_lookup_that_finds_the_outbox_past_its_cap_ends_at_its_own_deadline(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past OUTBOX_CAP a caller waits for the socket itself (the backpressure), but a
    lookup has one deadline, ``lookup_timeout``, for all of it (docs: "One deadline for the
    whole lookup"). Lookups made once the outbox is past the cap, to a peer that has stopped
    reading, must each end by their own deadline with P2PKVTimeout, not wait for the send
    lock until the stuck send's ``idle_timeout`` ends the session (review 2026-12-05: they
    ended at 30 s with lookup_timeout 5 s). Nothing sent is lost: the session stays up, and
    its frames stay queued, until the send deadline."""
    with trio.fail_after(VIRTUAL_BOUND):
        gate = SendGate(monkeypatch)
        async with node("n", lookup_timeout=5.0, idle_timeout=30.0) as n:
            raw, s = await connected(n)
            gate.shut(s)
            ended: dict[str, tuple[float, BaseException]] = {}
            started: dict[str, float] = {}

            async def look(name: str, keys: list[bytes]) -> None:
                started[name] = trio.current_time()
                try:
                    await n.lookup(raw.peer_id, keys)
                except P2PKVError as exc:
                    ended[name] = (trio.current_time() - started[name], exc)

            async with trio.open_nursery() as nursery:
                for tag in range(12):
                    nursery.start_soon(look, f"big{tag}", big_keys(tag))
                await trio.sleep(0.1)
                assert s.proto.bytes_to_send() > session_mod.OUTBOX_CAP
                await trio.sleep(1.0)
                for tag in range(12, 15):  # made later, past the cap too
                    nursery.start_soon(look, f"late{tag}", big_keys(tag))
                await trio.sleep(12.0)
                assert s.alive  # only the send deadline (idle_timeout) may end it
                nursery.cancel_scope.cancel()
            # The peer reads again: every lookup and its abort arrive whole, in a stream
            # that a cut send (a lookup's own, at its deadline) left intact.
            gate.open.set()
            raw.proto.lift_frame_limit()  # a RawPeer never admits: its frames are big
            asked: set[int] = set()
            aborted: set[int] = set()
            with kernel_paced():  # ~17 MB to read: no virtual time needed
                while len(asked) < 15 or len(aborted) < 15:
                    ev = await raw.next_event()
                    assert ev is not None and not isinstance(ev, ByeReceived), ev
                    if isinstance(ev, LookupRequested):
                        asked.add(ev.req_id)
                    elif isinstance(ev, AbortRequested):
                        aborted.add(ev.req_id)
            assert aborted == asked and s.alive
            await raw.aclose()
        assert len(ended) == 15, f"still waiting 12 s in: {sorted(set(started) - set(ended))}"
        for name, (took, exc) in ended.items():
            assert took <= 5.0 + 0.1, (name, took, exc)
            assert isinstance(exc, P2PKVError) and "timed out" in str(exc), (name, exc)


async def test_a_lookup_whose_own_frame_is_past_the_cap_is_cut_at_its_deadline_losing_nothing(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup whose own frame is over OUTBOX_CAP sends it itself (the lock is free) to a
    peer that has stopped reading. At the lookup's deadline its send is cut (plain TCP):
    the lookup raises P2PKVTimeout then, not at the send deadline (``idle_timeout``), and
    the rest of its frame goes back to the front of the outbox, so once the peer reads
    again it gets the lookup and its abort whole and the session stays up."""
    with trio.fail_after(VIRTUAL_BOUND):
        gate = SendGate(monkeypatch)
        async with node("n", lookup_timeout=5.0, idle_timeout=30.0) as n:
            raw, s = await connected(n)
            gate.shut(s)
            t0 = trio.current_time()
            with pytest.raises(P2PKVError, match="timed out"):
                await n.lookup(raw.peer_id, big_keys(1, 40000))  # a ~5.4 MB frame
            assert trio.current_time() - t0 == pytest.approx(5.0, abs=0.1)
            assert s.alive
            gate.open.set()
            raw.proto.lift_frame_limit()  # a RawPeer never admits: its frames are big
            seen: list[Any] = []
            with kernel_paced():  # ~5.4 MB to read: no virtual time needed
                while len(seen) < 2:
                    ev = await raw.next_event()
                    assert ev is not None and not isinstance(ev, ByeReceived), ev
                    if isinstance(ev, (LookupRequested, AbortRequested)):
                        seen.append(ev)
            assert isinstance(seen[0], LookupRequested) and len(seen[0].keys) == 40000
            assert isinstance(seen[1], AbortRequested) and seen[1].req_id == seen[0].req_id
            assert s.alive
            await raw.aclose()


@pytest.mark.parametrize("closed_first", [False, True], ids=["first-send", "closed-first"])
async def test_a_session_out_of_descriptors_ends_typed_and_closes_its_socket(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    closed_first: bool,
) -> None:
    """The process is out of descriptors (EMFILE) as a session takes the duplicate its
    sends use, at its first send (its hello), or at its final flush when it was closed
    before it sent anything (a stranger turned away, a connect given up at once, the
    node closing). The reader's and the answer lane's duplicates took that as a lost
    connection; the sends' raised the OSError: the session was logged as crashed, and
    closed before its first send it never closed its socket nor set ``finished``."""

    def no_descriptor(self: PeerSession) -> socket.socket | None:
        """FAKE: no descriptor left for the duplicate."""
        raise OSError(errno.EMFILE, "Too many open files")

    with trio.fail_after(VIRTUAL_BOUND):
        async with node("n") as n:
            ours, theirs = trio.socket.socketpair()
            other = trio.SocketStream(theirs)
            session = PeerSession(n, trio.SocketStream(ours))
            if closed_first:
                session.close("turned away", "busy")
            with monkeypatch.context() as m:
                m.setattr(PeerSession, "_dup", no_descriptor)
                await n._supervise(session)  # as the node runs each session
            assert session.finished.is_set() and not n._sessions
            assert isinstance(session.error, trio.BrokenResourceError)
            assert "crashed" not in caplog.text
            with trio.fail_after(5):  # its socket is closed: the other end reads its end
                while await other.receive_some(1 << 16):
                    pass
            await other.aclose()
