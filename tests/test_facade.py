"""The sync facade: BlockingNode on its engine thread, driven from foreign threads.

Synchronous tests on purpose: pytest's main thread (and helper threads) play hosts, each
node's engine runs ``trio.run`` on its own thread, two nodes talk over the in-process
transport. Real threads, so the real clock: ordering is gated by ``threading.Event``s and
queues, never by sleeps; the short timeouts (0.3 s) are where the behaviour under test *is*
a timeout, and ``BOUND`` only says "this did not hang".
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import pytest
import trio

from p2pkv import (
    BlockingNode,
    FetchResult,
    NodeConfig,
    P2PKVError,
    P2PKVTimeout,
    Peer,
    PeerUnavailable,
    PortalClosed,
    facade,
    open_node,
    start_node,
)
from p2pkv.session.protocol import HelloReceived, SessionProtocol
from p2pkv.store import BlockStore
from p2pkv.transport.base import RemotePeer, TransferHandle, TransferState

from .helpers import (
    FaultFactory,
    FaultTransport,
    RawPeer,
    check_no_leaked_threads,
    config,
    fill,
    in_thread,
    interrupt_at,
    leftover_threads,
    trio_in_a_thread,
    until,
    wait_for,
)

BOUND = 10.0  # seconds: "this did not hang", never an expected duration
SHORT = 0.3  # seconds: a timeout that is the behaviour under test
BLOCK = 4096


class EngineBroke(P2PKVError):
    """A bug the tests plant in the engine."""


class GatedTransport(FaultTransport):
    """FAKE data plane (fault injection) with gates a test can wait on or hold shut:

    * ``posted`` is set once a write has been posted (the producer is serving a fetch);
    * while ``progress_gate`` is set to an unset Event, the next ``progress()`` call (made
      on the engine's Trio thread whenever a consumer waits for writes) blocks on it, so
      the whole engine is wedged in a blocking call, as a stuck data-plane call would.
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.posted = threading.Event()
        self.progress_gate: threading.Event | None = None
        self.in_progress = threading.Event()
        self.left_progress = threading.Event()

    def post_write(
        self, peer: RemotePeer, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> TransferHandle:
        handle = super().post_write(peer, local_slots, remote_slots)
        self.posted.set()
        return handle

    def progress(self) -> None:
        gate, self.progress_gate = self.progress_gate, None  # one-shot
        if gate is not None:
            self.in_progress.set()
            try:
                assert gate.wait(BOUND), "progress gate never opened"
            finally:
                self.left_progress.set()


class WritesHeldUntil(FaultTransport):
    """FAKE data plane (fault injection): its posted writes stay PROC until ``until`` is
    set, so the consumer is still waiting for them (and driving its data plane's
    progress) when the test needs it to be."""

    until: threading.Event | None = None

    def poll(self, handle: TransferHandle) -> TransferState:
        if self.until is not None and not self.until.is_set():
            return TransferState.PROC
        return super().poll(handle)


class GatedFactory:
    """FAKE data-plane factory: builds FAKE :class:`GatedTransport` s, keeps what it built."""

    def __init__(self, configure: Callable[[GatedTransport], None] | None = None) -> None:
        self.configure = configure
        self.built: list[GatedTransport] = []

    def __call__(self, cfg: NodeConfig, store: BlockStore) -> GatedTransport:
        t = GatedTransport(agent_name=cfg.peer_id, region=store.array, layout=store.layout)
        if self.configure is not None:
            self.configure(t)
        self.built.append(t)
        return t

    @property
    def transport(self) -> GatedTransport:
        return self.built[-1]


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield from check_no_leaked_threads()


def wait_ticket(node: BlockingNode, ticket: int) -> object:
    """The ticket's result (or the exception it finished with), polling like a host."""
    deadline = time.monotonic() + BOUND
    while True:
        try:
            result = node.poll(ticket)
        except Exception as exc:
            return exc
        if result is not None:
            return result
        assert time.monotonic() < deadline, "ticket never finished"
        time.sleep(0.001)


def stuck_fetch(
    nodes: Callable[..., BlockingNode],
) -> tuple[GatedFactory, BlockingNode, BlockingNode, Peer, list[bytes], int]:
    """A source whose writes never settle (FAKE transport: a stalled NIC) and a consumer
    whose fetch of its four keys is in flight on it: (the source's factory, source,
    consumer, the consumer's peer, the keys, the fetch's ticket)."""
    hanging = GatedFactory(lambda t: setattr(t, "hang", True))
    src = nodes("src", transport=hanging, close_timeout=0.5, quarantine=3.5)
    dst = nodes("dst")
    keys = fill(src.store, 4, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    in_flight = dst.submit_fetch(peer, keys)  # the producer's writes never settle
    assert hanging.transport.posted.wait(BOUND)
    return hanging, src, dst, peer, keys, in_flight


def assert_same_bytes(dst: BlockingNode, src: BlockingNode, keys: Sequence[bytes]) -> None:
    for k in keys:
        got, want = dst.store.get(k), src.store.get(k)
        assert got is not None and want is not None
        assert bytes(got) == bytes(want)


# ---------------------------------------------------------------- round trips


def test_blocking_connect_lookup_fetch_round_trip_loads_the_producers_bytes(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, dst = nodes("src"), nodes("dst")
    present = fill(src.store, 20, BLOCK)
    absent = [os.urandom(32) for _ in range(5)]
    keys = present[:10] + absent + present[10:]
    peer = dst.connect(src.address, timeout=BOUND)
    assert peer.peer_id == "src"
    assert dst.lookup(peer, keys, timeout=BOUND) == [k in set(present) for k in keys]
    result = dst.fetch(peer, keys, timeout=BOUND)
    assert sorted(result.loaded) == sorted(present)
    assert result.failed == dict.fromkeys(absent, "miss")
    assert_same_bytes(dst, src, present)
    assert all(k not in dst.store for k in absent)
    assert [p.peer_id for p in dst.peers()] == ["src"]
    assert dst.statistics().peers == 1
    assert src.statistics().pinned_slots == 0  # the fetch closed the lookup round
    dst.disconnect(peer, timeout=BOUND)
    with pytest.raises(PeerUnavailable):
        dst.lookup(peer, keys, timeout=BOUND)


def test_a_bad_address_is_refused_in_the_callers_thread(
    nodes: Callable[..., BlockingNode],
) -> None:
    dst = nodes("dst")
    host, port = nodes("src").address
    for bad in (f"{host}:{port}", (host,), (host, str(port))):
        with pytest.raises(TypeError, match="address"):
            dst.connect(bad, timeout=BOUND)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="address"):  # no ticket to poll
            dst.submit_connect(bad, timeout=BOUND)  # type: ignore[arg-type]
    assert dst.pending() == 0 and dst.peers() == []


@pytest.mark.parametrize(
    "bad", [-1.0, math.nan, "5", True, pytest.param(10**400, id="an-int-past-a-floats-range")]
)
def test_a_bad_timeout_is_refused_in_the_callers_thread_before_anything_is_posted(
    nodes: Callable[..., BlockingNode], bad: object
) -> None:
    """A negative, NaN or non-number timeout (or ``within``) is the caller's mistake: a
    TypeError or ValueError from the call itself, no ticket taken and nothing posted.
    It used to post the work: a submit's ticket then ended with Trio's own error, and a
    blocking connect dialed, "timed out" at once and hung up. An int past a float's
    range escaped as OverflowError (from ``float()``), which no caller expects."""
    dst, src = nodes("dst"), nodes("src")
    peer = dst.connect(src.address, timeout=BOUND)
    error = TypeError if isinstance(bad, str | bool) else ValueError
    with pytest.raises(error, match="timeout"):
        dst.submit_lookup(peer, [b"k"], timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="within"):
        dst.submit_fetch_into(peer, [b"k"], [0], within=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="timeout"):
        dst.connect(src.address, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="timeout"):
        dst.peers(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="start_timeout"):
        start_node(config("never"), start_timeout=bad)  # type: ignore[arg-type]
    assert dst.pending() == 0 and dst.get_finished() == []
    assert src.statistics().sessions == 1  # no second dial


def test_an_infinite_timeout_means_no_limit_of_the_callers(
    nodes: Callable[..., BlockingNode],
) -> None:
    """``math.inf`` (or a config deadline of inf, which the facade's defaults add to) is
    a number like any other. Threading's waits raise OverflowError for it: every call
    failed at once and cancelled what it had posted, and close() left the engine thread
    marked stopped while it still ran."""
    src, dst = nodes("src"), nodes("dst", lookup_timeout=math.inf)
    keys = fill(src.store, 2, BLOCK)
    peer = dst.connect(src.address, timeout=math.inf)
    assert dst.lookup(peer, keys) == [True, True]  # default: inf + a second
    ticket = dst.submit_lookup(peer, keys, timeout=math.inf)
    assert wait_ticket(dst, ticket) == [True, True]
    node = start_node(config("late"), start_timeout=math.inf)
    node.close(timeout=math.inf)
    assert not node.alive
    assert not any(t.name == "p2pkv-engine-late" for t in threading.enumerate())


def test_a_tickets_own_timeout_ends_it_and_what_it_started(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A submit's ``timeout`` is enforced by the engine: the ticket ends with
    P2PKVTimeout naming the operation once it passes, even when the node's own deadline
    for that operation is far off, and the work it started is cancelled (no session
    left half made). The peer here accepts TCP and never says a word."""
    dst = nodes("dst", handshake_timeout=600.0)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        ticket = dst.submit_connect(mute.getsockname(), timeout=SHORT)
        outcome = wait_ticket(dst, ticket)
        assert isinstance(outcome, P2PKVTimeout), outcome
        assert outcome.op == "connect" and f"after {SHORT} s" in str(outcome)
        wait_for(lambda: dst.statistics().sessions == 0)
    assert dst.pending() == 0 and dst.peers() == []


def test_a_peer_given_as_an_address_is_refused_in_the_callers_thread(
    nodes: Callable[..., BlockingNode],
) -> None:
    """connect() takes an address, every later call the Peer (or peer id) it returned;
    passing the address again gave AttributeError ('tuple' object has no attribute
    'peer_id'), from a submit only once its ticket was polled."""
    dst, src = nodes("dst"), nodes("src")
    dst.connect(src.address, timeout=BOUND)
    for call in (
        lambda p: dst.submit_lookup(p, [b"k"]),
        lambda p: dst.submit_fetch(p, [b"k"]),
        lambda p: dst.submit_fetch_into(p, [b"k"], [0]),
        lambda p: dst.lookup(p, [b"k"], timeout=BOUND),
        lambda p: dst.is_connected(p),
        lambda p: dst.disconnect(p, timeout=BOUND),
    ):
        with pytest.raises(TypeError, match="an address"):
            call(src.address)
    assert dst.pending() == 0 and dst.is_connected("src")


def test_one_key_where_a_sequence_of_keys_is_expected_is_a_type_error(
    nodes: Callable[..., BlockingNode],
) -> None:
    """``fetch(peer, key)`` took each byte of the key as a key: every one "failed" as not
    bytes, and nothing said why. Now the call itself raises, no ticket taken. Found by a
    review (2026-12-04)."""
    dst, src = nodes("dst"), nodes("src")
    peer = dst.connect(src.address, timeout=BOUND)
    key = b"k" * 32
    for call in (
        lambda k: dst.submit_lookup(peer, k),
        lambda k: dst.submit_lookup_round(peer, k),
        lambda k: dst.submit_fetch(peer, k),
        lambda k: dst.submit_fetch_into(peer, k, [0]),
        lambda k: dst.lookup(peer, k, timeout=BOUND),
        lambda k: dst.lookup_round(peer, k, timeout=BOUND),
        lambda k: dst.fetch(peer, k, timeout=BOUND),
    ):
        for one in (key, bytearray(key), memoryview(key), key.hex()):
            with pytest.raises(TypeError, match=r"a sequence of keys, got one .*\[key\]\?"):
                call(one)
    assert dst.pending() == 0
    assert dst.lookup(peer, (key,), timeout=BOUND) == [False]  # any other sequence will do


def test_a_submits_rounds_are_read_in_the_callers_thread_not_later_on_the_engine(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A submit copies its keys (and slots) before it returns, so the host may reuse its
    lists at once; its ``rounds`` were handed to the engine as they were, and read there
    whenever the task ran. A host that cleared its list of rounds after the submit (a
    scheduler reusing its buffers) had the fetch run without them: it looked its keys
    up again, and the round it named stayed pinned at the producer for the lease. Found
    by a review of the public surface (2026-12-05)."""
    src, dst = nodes("src", lease=600.0), nodes("dst")
    keys = fill(src.store, 3, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    submits: list[Callable[[list[Any]], int]] = [
        lambda rounds: dst.submit_fetch(peer, keys, rounds=rounds),
        lambda rounds: dst.submit_release(peer, rounds),
    ]
    for submit in submits:
        held = dst.lookup_round(peer, keys, timeout=BOUND)
        assert src.statistics().pinned_slots == 3
        requests = dst.session_activity(peer)
        busy, go = threading.Event(), threading.Event()

        def hold_the_engine(busy: threading.Event = busy, go: threading.Event = go) -> None:
            busy.set()
            assert go.wait(BOUND), "the test never let the engine go"

        dst._engine.run_sync_soon(hold_the_engine)  # test seam: the engine is busy
        assert busy.wait(BOUND)
        rounds = [held]
        ticket = submit(rounds)
        rounds.clear()  # the host reuses its list; the submit has returned
        go.set()
        outcome = wait_ticket(dst, ticket)
        assert not isinstance(outcome, BaseException), outcome
        # No lookup of its own: the fetch used the round the submit named.
        assert dst.session_activity(peer) == requests
        if isinstance(outcome, FetchResult):
            assert sorted(outcome.loaded) == sorted(keys)
        else:
            assert outcome == 1  # the one round the submit named was closed
        wait_for(lambda: src.statistics().pinned_slots == 0)
        for k in keys:
            dst.store.evict(k)
    assert dst.pending() == 0


def test_a_submit_fetch_into_reads_a_tensors_slots_in_the_callers_thread(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A host hands ``submit_fetch_into`` its chunk ids as a torch tensor (vLLM's are)
    and reuses the tensor once the submit has returned. The submit copied the slots with
    ``list(slots)``, which for a tensor gives 0-d *views* of its storage: the engine read
    their values only when its task ran, so the keys landed in the slots the host wrote
    there since, over blocks it had given to something else, and the result said every
    key loaded. Found by a review of the caller's side (2026-12-07)."""
    torch = pytest.importorskip("torch")
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 2, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    before = bytes(dst.store.array)
    busy, go = threading.Event(), threading.Event()

    def hold_the_engine() -> None:
        busy.set()
        assert go.wait(BOUND), "the test never let the engine go"

    dst._engine.run_sync_soon(hold_the_engine)  # test seam: the engine is busy
    assert busy.wait(BOUND)
    chunk_ids = torch.tensor([4, 5])
    ticket = dst.submit_fetch_into(peer, keys, chunk_ids)
    chunk_ids[0], chunk_ids[1] = 10, 11  # the host reuses its tensor; the submit returned
    go.set()
    outcome = wait_ticket(dst, ticket)
    assert isinstance(outcome, FetchResult), outcome
    assert outcome.loaded == keys
    changed = [
        s
        for s in range(dst.config.num_blocks)
        if dst.store.array[s * BLOCK : (s + 1) * BLOCK].tobytes()
        != before[s * BLOCK : (s + 1) * BLOCK]
    ]
    assert changed == [4, 5]
    for slot, key in zip((4, 5), keys, strict=True):
        held = src.store.get(key)
        assert held is not None
        assert dst.store.array[slot * BLOCK : (slot + 1) * BLOCK].tobytes() == bytes(held)


def test_an_activity_that_session_activity_never_returned_is_refused_at_the_submit(
    nodes: Callable[..., BlockingNode],
) -> None:
    """``submit_disconnect_idle`` compared the caller's ``activity`` with the session's
    tuple as it was: anything else (None, a string, the same two counts as a list, as a
    host that kept them in JSON has them) never equalled it, so the ticket said "in use"
    (0) for ever and the idle session was never closed. A pair of ints is taken as it
    is; anything else is a TypeError from the submit, no ticket taken."""
    dst, src = nodes("dst"), nodes("src")
    peer = dst.connect(src.address, timeout=BOUND)
    for bad in (None, "x", (1,), (1, 2, 3), (1.0, 0), (True, 0)):
        with pytest.raises(TypeError, match="activity"):
            dst.submit_disconnect_idle(peer, bad)  # type: ignore[arg-type]
    assert dst.pending() == 0 and dst.is_connected(peer)
    activity = dst.session_activity(peer)
    assert activity is not None
    ticket = dst.submit_disconnect_idle(peer, list(activity))  # type: ignore[arg-type]
    assert wait_ticket(dst, ticket) == 1
    assert not dst.is_connected(peer)


def test_a_ticket_of_another_node_is_unknown_and_leaves_that_nodes_own_alone(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Two nodes in one process (a vLLM tier and the host's own node): tickets were
    counted from 0 per node, so one node answered the other's ticket with its own of the
    same number, and its real owner then got KeyError."""
    a, b = nodes("a"), nodes("b")
    ta = a.submit_lookup("nobody", [b"k"])
    tb = b.submit_lookup("nobody-either", [b"k"])
    wait_for(lambda: a.pending() == 0 and b.pending() == 0)
    with pytest.raises(KeyError):
        b.poll(ta)
    assert isinstance(wait_ticket(b, tb), PeerUnavailable)
    assert isinstance(wait_ticket(a, ta), PeerUnavailable)


def test_submit_fetch_poll_and_get_finished_deliver_every_outcome_once(
    nodes: Callable[..., BlockingNode],
) -> None:
    src, dst = nodes("src"), nodes("dst")
    keys = fill(src.store, 12, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)

    lookup_t = dst.submit_lookup(peer, keys[:4])
    assert wait_ticket(dst, lookup_t) == [True] * 4
    with pytest.raises(KeyError):  # read once
        dst.poll(lookup_t)

    fetches = [dst.submit_fetch(peer, keys[i : i + 4]) for i in range(0, 12, 4)]
    bad = dst.submit_fetch("nobody", keys[:1])
    assert len({*fetches, bad, lookup_t}) == 5
    wait_for(lambda: dst.pending() == 0)
    finished = dict(dst.get_finished())
    assert set(finished) == {*fetches, bad}
    for ticket, i in zip(fetches, range(0, 12, 4), strict=True):
        result = finished[ticket]
        assert isinstance(result, FetchResult)
        assert sorted(result.loaded) == sorted(keys[i : i + 4]) and not result.failed
    assert isinstance(finished[bad], PeerUnavailable)
    assert dst.get_finished() == []
    assert_same_bytes(dst, src, keys)

    # A published exception is raised by poll().
    ticket = dst.submit_lookup("nobody", keys)
    with pytest.raises(PeerUnavailable):
        while dst.poll(ticket) is None:
            time.sleep(0.001)


@pytest.mark.parametrize("step", ["blocked_wait", "busy_python"])
def test_a_lookup_is_answered_while_the_producers_host_thread_is_in_a_model_step(
    nodes: Callable[..., BlockingNode], step: str
) -> None:
    """The engine answers peers whatever the host does: the producer's host thread is
    inside a "model step" (blocked, or computing in Python and holding the GIL between
    switches) that ends only when the consumer is done, and the consumer still gets its
    lookup and its blocks.
    """
    src, dst = nodes("src"), nodes("dst")
    in_step, step_over, step_done = threading.Event(), threading.Event(), threading.Event()
    keys: list[bytes] = []

    def producer_host() -> None:
        keys.extend(fill(src.store, 32, BLOCK))
        in_step.set()
        # The step lasts until the consumer is done (BOUND only ends a hung test).
        if step == "blocked_wait":
            step_over.wait(BOUND)
        else:
            end = time.monotonic() + BOUND
            while not step_over.is_set() and time.monotonic() < end:
                sum(range(1000))
        step_done.set()

    host, _ = in_thread(producer_host, name="producer-host")
    try:
        assert in_step.wait(BOUND)
        peer = dst.connect(src.address, timeout=BOUND)
        hits = dst.lookup(peer, keys, timeout=BOUND)
        result = dst.fetch(peer, keys, timeout=BOUND)
        still_in_step = not step_done.is_set()
    finally:
        step_over.set()
        host.join(BOUND)
    # How fast this is: bench/host_costs.py ("in a model step").
    assert still_in_step, "the consumer was served only once the producer's step ended"
    assert hits == [True] * len(keys)
    assert sorted(result.loaded) == sorted(keys)
    assert_same_bytes(dst, src, keys)


# ---------------------------------------------------------------- failure and close


def test_a_close_refused_on_the_engine_thread_leaves_the_node_working(
    nodes: Callable[..., BlockingNode],
) -> None:
    """close() from the engine thread would deadlock and is refused; the node stays alive,
    and so do its tickets: none fails, and a later submit is served."""
    a, b = nodes("a"), nodes("b")
    keys = fill(b.store, 2, BLOCK)
    peer = a.connect(b.address, timeout=BOUND)
    in_flight = a.submit_lookup(peer, keys)

    async def reenter() -> str:
        try:
            a.close()
        except P2PKVError as exc:
            return str(exc)
        return "no error"

    assert "re-entrant" in a._engine.call(reenter, timeout=BOUND)
    assert a.alive
    assert wait_ticket(a, in_flight) == [True, True]
    assert wait_ticket(a, a.submit_lookup(peer, keys)) == [True, True]


def test_a_close_that_cannot_take_the_engines_lock_leaves_the_node_and_its_tickets_alone(
    nodes: Callable[..., BlockingNode],
) -> None:
    """close() gives up with P2PKVTimeout when it cannot take the engine's lock (a SIGTERM
    handler that interrupted a blocking call on its own thread, which holds it). It has
    asked nothing of the engine then, yet it sealed the ticket board: a ticket in flight
    said PortalClosed ("the operation did not finish") while its operation ran on to its
    end (a fetch_into's writes landing after the quarantine its owner was told to keep),
    and every later submit was born PortalClosed while the node ran and blocking calls
    worked. The board is left as it was, as after a close refused on the engine thread."""
    a, b = nodes("a"), nodes("b")
    keys = fill(b.store, 2, BLOCK)
    peer = a.connect(b.address, timeout=BOUND)
    with socket.socket() as mute:  # accepts TCP, never says a word: the dial stays open
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        in_flight = a.submit_connect(mute.getsockname(), timeout=BOUND)
        # The lock is held by the call the handler interrupted.
        with a._engine._lock, pytest.raises(P2PKVTimeout, match="signal handler"):
            a.close(timeout=SHORT)
        assert a.alive
        assert a.poll(in_flight) is None  # its connect still runs: not "closed"
        assert wait_ticket(a, a.submit_lookup(peer, keys)) == [True, True]
    # The silent peer is gone: the ticket ends with its operation's own outcome.
    assert isinstance(wait_ticket(a, in_flight), PeerUnavailable)
    a.close(timeout=BOUND)
    assert not a.alive
    with pytest.raises(PortalClosed):
        a.poll(a.submit_lookup(peer, keys))


def test_engine_death_fails_calls_and_tickets_with_portal_closed_and_the_cause(
    nodes: Callable[..., BlockingNode],
) -> None:
    _hanging, _src, dst, peer, keys, in_flight = stuck_fetch(nodes)
    planted = EngineBroke("a bug in the engine")

    def bug() -> None:
        raise planted

    dst._engine.run_sync_soon(bug)  # test seam: a failing command kills the engine
    wait_for(lambda: not dst.alive)
    assert dst.failure is planted

    outcome = wait_ticket(dst, in_flight)
    assert isinstance(outcome, PortalClosed) and outcome.__cause__ is planted
    with pytest.raises(PortalClosed) as info:
        dst.lookup(peer, keys, timeout=BOUND)
    assert info.value.__cause__ is planted
    late = dst.submit_fetch(peer, keys)  # born finished: nothing would ever serve it
    late_outcome = wait_ticket(dst, late)
    assert isinstance(late_outcome, PortalClosed)
    dst.close(timeout=BOUND)  # closing a dead node is harmless
    dst.close(timeout=BOUND)


class BrokeOnTheWayOut(Exception):
    """What a FAKE operation raises when it is cancelled (a teardown that failed)."""


def test_a_ticket_whose_work_breaks_as_the_engine_dies_says_the_node_closed(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A ticket's work cancelled by the engine's death may raise something of its own on
    the way out (here a FAKE operation turns its cancellation into an error). The host's
    answer is still "the node closed" with the engine's failure as the cause, never that
    error (mutation review 2026-12-05: publishing whatever a cancelled task raised
    survived the suite; the engine died under a real fetch, which raises nothing but
    ``Cancelled``). ``_submit`` is the seam every ``submit_*`` goes through."""
    a = nodes("a")
    began = threading.Event()

    async def breaks_when_cancelled() -> int:
        began.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise BrokeOnTheWayOut("teardown failed") from None
        raise AssertionError("unreachable")

    ticket = a._submit(breaks_when_cancelled, (), "lookup", BOUND)
    assert began.wait(BOUND)
    planted = EngineBroke("a bug in the engine")

    def bug() -> None:
        raise planted

    a._engine.run_sync_soon(bug)  # test seam: a failing command kills the engine
    wait_for(lambda: not a.alive)
    outcome = wait_ticket(a, ticket)
    assert isinstance(outcome, PortalClosed), outcome
    assert outcome.__cause__ is planted


def test_a_ticket_whose_work_raises_a_group_of_one_gets_that_one_error(
    nodes: Callable[..., BlockingNode],
) -> None:
    """An operation that fails inside a nursery raises a group holding its one error; the
    ticket finishes with that error, typed, as the blocking call would raise it
    (mutation review 2026-12-05: publishing the group survived the suite). A FAKE
    operation through ``_submit``, the seam of every ``submit_*``."""
    a = nodes("a")

    async def fails_in_a_nursery() -> int:
        async def child() -> None:
            raise PeerUnavailable("gone", peer="p", op="lookup")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
        return 0

    outcome = wait_ticket(a, a._submit(fails_in_a_nursery, (), "lookup", BOUND))
    assert isinstance(outcome, PeerUnavailable), outcome


def test_a_node_that_cannot_start_raises_portal_closed_with_the_cause() -> None:
    refused = EngineBroke("no data plane today")

    def broken_transport(cfg: NodeConfig, store: BlockStore) -> GatedTransport:
        raise refused

    with pytest.raises(PortalClosed) as info:
        start_node(config("a"), transport=broken_transport, start_timeout=BOUND)
    assert info.value.__cause__ is refused


@pytest.mark.parametrize("bad", [None, {"peer_id": "a"}, "a"])
async def test_a_config_that_is_not_a_node_config_is_a_type_error(bad: object) -> None:
    """``start_node`` (and ``open_node``) read ``cfg.peer_id`` first: a dict of settings,
    None or a peer id passed for the config was ``AttributeError: 'dict' object has no
    attribute 'peer_id'``, naming no argument. A TypeError that names it now, and no
    engine thread is started (the autouse fixture checks)."""
    with pytest.raises(TypeError, match="NodeConfig"):
        start_node(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="NodeConfig"):
        async with open_node(bad):  # type: ignore[arg-type]
            pass


def test_a_port_in_use_says_so_once_in_the_error_itself(
    nodes: Callable[..., BlockingNode], caplog: pytest.LogCaptureFixture
) -> None:
    """start_node on a port in use raised "engine ended before it started", the reason
    only in ``__cause__``, and logged the same failure as an ERROR with a traceback
    although the caller got it (open_node raises the OSError itself)."""
    taken = nodes("a").address[1]
    with pytest.raises(PortalClosed, match=r"could not start: .*[Aa]ddress already in use") as info:
        start_node(attrs.evolve(config("b"), port=taken), start_timeout=BOUND)
    assert isinstance(info.value.__cause__, OSError)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


def test_a_host_that_cannot_be_listened_on_is_named_in_the_error() -> None:
    """ "engine could not start: [Errno -2] Name or service not known" named no host
    (review 2026-12-05). Here an address of no interface of this machine (TEST-NET-1:
    numeric, so no name lookup leaves the machine)."""
    bad = attrs.evolve(config("a"), host="192.0.2.1")
    with pytest.raises(PortalClosed, match=r"cannot listen on 192\.0\.2\.1:0: "):
        start_node(bad, start_timeout=BOUND)


def test_closing_mid_call_gives_the_caller_portal_closed_never_cancelled(
    nodes: Callable[..., BlockingNode],
) -> None:
    hanging = GatedFactory(lambda t: setattr(t, "hang", True))
    src = nodes("src", transport=hanging, close_timeout=0.5, quarantine=3.5)
    dst = nodes("dst", close_timeout=1.0)
    keys = fill(src.store, 5, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    caller, out = in_thread(lambda: dst.fetch(peer, keys[1:], timeout=BOUND))
    assert hanging.transport.posted.wait(BOUND)  # the fetch is in flight and stuck
    ticket = dst.submit_fetch(peer, keys[:1])  # another key: a transfer of its own
    wait_for(lambda: hanging.transport.posts == 2)  # the ticket's write is in flight too
    closer, closed = in_thread(lambda: dst.close(timeout=BOUND), name="closer")
    exc = out.get(timeout=BOUND)
    caller.join(BOUND)
    assert closed.get(timeout=BOUND) is None
    closer.join(BOUND)
    # The blocking call was cancelled by the close: the caller gets PortalClosed, never
    # trio.Cancelled (nor any other error).
    assert type(exc) is PortalClosed, repr(exc)
    # The ticket's fetch was in flight in a session: the closing node failed its key.
    outcome = wait_ticket(dst, ticket)
    assert type(outcome) is FetchResult, repr(outcome)
    assert outcome.loaded == [] and list(outcome.failed) == [keys[0]]
    assert outcome.failed[keys[0]].startswith("session closed"), outcome.failed
    assert not dst.alive and dst.failure is None
    with pytest.raises(PortalClosed):
        dst.connect(src.address, timeout=BOUND)


@contextlib.contextmanager
def wedged_in_a_fetch(
    nodes: Callable[..., BlockingNode], n: int
) -> Iterator[tuple[BlockingNode, BlockingNode, Peer, list[bytes], int]]:
    """src and dst connected, dst's engine (its Trio thread) stuck in a blocking call of
    a fetch of ``n`` of src's keys for the body: yields (src, dst, peer, keys, the fetch's
    ticket). Unwedged on the way out, after checking that nothing the body did waited
    for the engine (it was still stuck)."""
    wedge = threading.Event()
    wedging = GatedFactory()
    # The source's writes settle only once dst's engine is wedged: a fetch whose
    # transfer_done came before dst's first progress() call never wedged it.
    held = FaultFactory(kind=WritesHeldUntil)
    src, dst = nodes("src", transport=held), nodes("dst", transport=wedging)
    keys = fill(src.store, n, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    wedging.transport.progress_gate = wedge
    held_transport = held.transport
    assert isinstance(held_transport, WritesHeldUntil)
    held_transport.until = wedging.transport.in_progress
    try:
        fetch_t = dst.submit_fetch(peer, keys)
        assert wedging.transport.in_progress.wait(BOUND)  # the Trio thread is stuck now
        yield src, dst, peer, keys, fetch_t
        still_wedged = not wedging.transport.left_progress.is_set()
    finally:
        wedge.set()
    assert still_wedged, "the body's calls returned only once the engine was unwedged"


def test_caller_side_timeouts_fire_while_the_engine_is_wedged_in_a_blocking_call(
    nodes: Callable[..., BlockingNode],
) -> None:
    with wedged_in_a_fetch(nodes, 8) as (src, dst, peer, keys, fetch_t):
        # The engine stays wedged until the block ends (or BOUND passes): a call that
        # waited for the engine would not return before that.
        with pytest.raises(P2PKVTimeout):
            dst.lookup(peer, keys, timeout=SHORT)
        with pytest.raises(P2PKVTimeout):
            dst.statistics(timeout=SHORT)
        # The hot path does not care either: a submit is a post, poll reads in place.
        lookup_t = dst.submit_lookup(peer, keys)
        assert dst.poll(lookup_t) is None and dst.poll(fetch_t) is None
    # How fast these return: bench/host_costs.py ("wedged").
    fetched = wait_ticket(dst, fetch_t)
    assert isinstance(fetched, FetchResult) and sorted(fetched.loaded) == sorted(keys)
    assert wait_ticket(dst, lookup_t) == [True] * len(keys)
    assert_same_bytes(dst, src, keys)
    dst.close(timeout=BOUND)
    assert not dst.alive and dst.failure is None


def test_a_close_that_times_out_on_a_wedged_engine_still_finishes_its_tickets(
    nodes: Callable[..., BlockingNode],
) -> None:
    """close() gives up on an engine wedged in a blocking call (P2PKVTimeout), and neither
    main nor on_finished can seal the board then: close() seals it itself, so a host
    polling a ticket in flight hears PortalClosed instead of None for as long as the
    engine stays wedged."""
    with wedged_in_a_fetch(nodes, 4) as (_, dst, _, _, fetch_t):
        with pytest.raises(P2PKVTimeout):
            dst.close(timeout=SHORT)
        with pytest.raises(PortalClosed):
            dst.poll(fetch_t)
    dst.close(timeout=BOUND)
    assert not dst.alive


def test_blocking_calls_left_without_a_timeout_still_end_while_the_engine_is_wedged(
    nodes: Callable[..., BlockingNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``timeout=None`` is the operation's own deadline (statistics and peers: a quick
    one), never no deadline: a host calling them bare on a wedged engine gets
    P2PKVTimeout, not a wait for as long as the engine stays stuck."""
    monkeypatch.setattr(facade, "_QUICK_CALL", SHORT)  # the quick calls' default
    with wedged_in_a_fetch(nodes, 4) as (_, dst, peer, keys, _):
        with pytest.raises(P2PKVTimeout):
            dst.statistics()
        with pytest.raises(P2PKVTimeout):
            dst.peers()
        # A lookup's own deadline is lookup_timeout + a second; short here, and not the
        # node's lookup_timeout: the wedging fetch's lookup must not time out first.
        monkeypatch.setitem(dst._defaults, "lookup", SHORT)
        with pytest.raises(P2PKVTimeout):
            dst.lookup(peer, keys)


def test_close_is_idempotent_and_leaves_no_thread_or_pin(
    nodes: Callable[..., BlockingNode],
) -> None:
    before = set(threading.enumerate())
    src, dst = nodes("src"), nodes("dst")
    names = {t.name for t in leftover_threads(before)}
    assert {"p2pkv-engine-src", "p2pkv-engine-dst", "p2pkv-engine-dst-waker"} <= names
    keys = fill(src.store, 6, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    assert dst.lookup(peer, keys, timeout=BOUND) == [True] * 6  # pins at src, round open
    assert src.statistics().pinned_slots == 6
    with dst:
        pass  # __exit__ closes
    dst.close(timeout=BOUND)
    dst.close()
    assert not dst.alive
    # The consumer's bye ended the session at the producer, and its pins with it.
    wait_for(lambda: src.statistics().pinned_slots == 0 and src.statistics().sessions == 0)
    src.close(timeout=BOUND)
    src.close(timeout=BOUND)
    assert leftover_threads(before) == []


def test_a_node_nobody_can_close_any_more_warns_and_its_engine_stops() -> None:
    """A ``BlockingNode`` dropped without ``close()`` kept its engine and waker threads,
    its port and its hold on the switch interval until the interpreter's exit, silently
    (review 2026-12-05). Like an unclosed socket it warns now (``ResourceWarning``: an
    error under ``filterwarnings = error``), and its engine stops."""
    import gc
    import warnings

    before = set(threading.enumerate())
    node = start_node(config("dropped"))
    port = node.address[1]
    engine = node._engine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del node
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == [
        "unclosed p2pkv node 'dropped': call close(), or use the node as a context manager"
    ]
    engine._thread.join(BOUND)
    assert not engine.alive and engine.failure is None
    for t in leftover_threads(before):
        t.join(BOUND)
    assert leftover_threads(before) == []
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_calls_from_the_engine_thread_raise_instead_of_deadlocking(
    nodes: Callable[..., BlockingNode],
) -> None:
    node = nodes("a")

    async def reenter() -> list[str]:
        errors = []
        for call in (lambda: node.statistics(timeout=BOUND), lambda: node.close()):
            try:
                call()
            except P2PKVError as exc:
                errors.append(str(exc))
        return errors

    errors = node._engine.call(reenter, timeout=BOUND)
    assert len(errors) == 2 and all("re-entrant" in e for e in errors)
    assert node.alive


def test_a_blocking_call_from_inside_a_trio_run_is_refused_at_once(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A blocking call from a Trio task blocks that loop; one whose work needs the loop
    (the peer is an ``open_node`` in it) waited out its whole deadline and raised a
    generic ``P2PKVTimeout`` (review 2026-12-05). It is refused at once, as
    ``trio.from_thread.run`` refuses the same mistake; from a worker thread of that run
    it works. No clock: the refusal has no deadline to run on."""
    b = nodes("b")
    got: list[object] = []

    async def main() -> None:
        async with open_node(config("a")) as a:
            with pytest.raises(P2PKVError, match="inside a Trio run"):
                b.connect(a.address, timeout=BOUND)
            assert b.submit_connect(a.address) is not None  # the hot path never blocks
            got.append(await trio.to_thread.run_sync(lambda: b.connect(a.address, timeout=BOUND)))

    trio.run(main)
    assert isinstance(got[0], Peer) and got[0].peer_id == "a"


def test_submits_racing_from_many_host_threads_all_finish_exactly_once(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Posts from several threads race on the waker's flag and lock; none may be lost
    (a lost wake would leave its ticket in flight forever)."""
    node = nodes("a")
    go = threading.Event()
    tickets: queue.Queue[int] = queue.Queue()

    def host() -> None:
        assert go.wait(BOUND)
        for _ in range(200):
            tickets.put(node.submit_lookup("nobody", [b"k" * 32]))

    hosts = [in_thread(host, name=f"host-{i}")[0] for i in range(4)]
    go.set()
    for t in hosts:
        t.join(BOUND)
    issued = [tickets.get_nowait() for _ in range(800)]
    assert len(set(issued)) == 800
    wait_for(lambda: node.pending() == 0)
    finished = node.get_finished()
    assert sorted(t for t, _ in finished) == sorted(issued)
    assert all(isinstance(out, PeerUnavailable) for _, out in finished)


_FORK_SCRIPT = r"""
import os, socket, sys, time
import numpy as np
import p2pkv

silent = socket.socket()  # listens, never accepts: a connect to it waits out its timeout
silent.bind(("127.0.0.1", 0))
silent.listen(1)
SMALL = {"num_blocks": 64, "block_len": 4096}
b = p2pkv.start_node(p2pkv.NodeConfig(peer_id="b", **SMALL))
region = np.zeros(64 * 4096, np.uint8)  # private memory: the child gets its own copy
a = p2pkv.start_node(p2pkv.NodeConfig(peer_id="a", **SMALL), region=region)
peer = a.connect(b.address, timeout=10)
waiting = a.submit_connect(silent.getsockname(), timeout=30)  # in flight at the fork
pid = os.fork()
if pid == 0:
    out = [f"alive={a.alive}", f"pending={a.pending()}"]
    try:
        a.poll(waiting)
    except p2pkv.PortalClosed as e:
        out.append("inherited:PortalClosed:" + ("forked" in str(e)) * "forked")
    t0 = time.monotonic()
    try:
        a.lookup(peer, [b"k"], timeout=20)
    except p2pkv.PortalClosed:  # "at once": only "did not wait out its 20 s timeout"
        out.append(f"lookup:PortalClosed:{time.monotonic() - t0 < 10}")
    ticket = a.submit_lookup(peer, [b"k"])
    try:
        a.poll(ticket)
    except p2pkv.PortalClosed:
        out.append("ticket:PortalClosed")
    a.close()
    out.append("closed")
    # A child that wants p2pkv starts its own node, over memory of its own: the parent's
    # claim on the region does not hold here (review 2026-12-04: it was refused).
    c = p2pkv.start_node(p2pkv.NodeConfig(peer_id="c", **SMALL), region=region)
    c.close()
    out.append("own-node")
    print(" ".join(out), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("parent:", a.alive, a.lookup(peer, [b"k"], timeout=10), os.waitstatus_to_exitcode(status))
a.close()
b.close()
"""


def test_in_a_forked_child_the_parents_node_fails_at_once_and_every_ticket_finishes() -> None:
    """vLLM starts workers by fork by default. The engine thread is not copied into a
    child: calls used to wait out their timeouts and tickets stayed in flight for ever.
    Now they fail at once with ``PortalClosed`` saying why; the parent's node is
    untouched. In a subprocess: forking under pytest's own threads is unsafe. Found by a
    review (2026-12-04)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORK_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "alive=False pending=0 inherited:PortalClosed:forked lookup:PortalClosed:True "
        "ticket:PortalClosed closed own-node"
    ), done.stdout + done.stderr
    assert lines[1] == "parent: True [False] 0"


# A host's graceful shutdown calls close() from its SIGTERM handler. Python runs a handler
# in the main thread between two bytecodes, possibly inside a p2pkv call that holds a lock
# (the ticket board's, the engine's). The signal is raised from a profile hook at the moment
# the call makes a C call under that lock, so the moment is certain. A hang prints where it
# hangs and exits 1 (faulthandler).
_SIGNAL_SCRIPT = r"""
import faulthandler, signal, sys, time, p2pkv
faulthandler.dump_traceback_later(20, exit=True)
node = p2pkv.start_node(p2pkv.NodeConfig(peer_id="a", num_blocks=64, block_len=4096))
took = []
def on_term(signum, frame):
    t = time.monotonic()
    try:
        node.close(timeout=1)
        outcome = "closed"
    except p2pkv.P2PKVError as exc:
        outcome = type(exc).__name__
    took.append((outcome, time.monotonic() - t))
signal.signal(signal.SIGTERM, on_term)
WHERE = sys.argv[1]
def deliver(frame, event, arg):
    if event == "c_call" and frame.f_code.co_name == WHERE and not took:
        sys.setprofile(None)
        signal.raise_signal(signal.SIGTERM)
sys.setprofile(deliver)
if WHERE == "drain_finished":
    node.get_finished()  # the board's lock held while the handler runs
else:
    try:
        node.statistics(timeout=5)  # the engine's lock held (EngineThread.call)
    except p2pkv.P2PKVError:
        pass
sys.setprofile(None)
outcome, seconds = took[0]
node.close(timeout=10)  # the handler's close may have timed out: this one ends it
print(outcome, seconds < 5, node.alive, flush=True)
"""


@pytest.mark.parametrize("where", ["drain_finished", "call"])
def test_close_from_a_signal_handler_inside_a_p2pkv_call_keeps_its_bound(where: str) -> None:
    """``close(timeout=1)`` from a SIGTERM handler that interrupted the same thread inside
    a call holding the ticket board's or the engine's lock waited on that lock for ever
    (review 2026-12-05). It now keeps its bound: it closes, or raises ``P2PKVTimeout``
    within it, and a close after the handler returns ends the node."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_SCRIPT, where],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    outcome, bounded, alive = done.stdout.split()
    assert outcome in ("closed", "P2PKVTimeout") and bounded == "True", done.stdout
    assert alive == "False"


# No faulthandler timer here: a child forked beside its watchdog thread hangs at exit.
_NIXL_FORK_SCRIPT = r"""
import os, sys, time, p2pkv
def cfg(pid):
    return p2pkv.NodeConfig(peer_id=pid, num_blocks=64, block_len=4096, transport="nixl")
a = p2pkv.start_node(cfg("a"))
b = p2pkv.start_node(cfg("b"))
keys = [os.urandom(32) for _ in range(4)]
for k in keys:
    a.store.put(k, os.urandom(4096))
peer = b.connect(a.address, timeout=20)
assert sorted(b.fetch(peer, keys, timeout=10).loaded) == sorted(keys)
if sys.argv[1] == "after-close":  # the parent's nodes closed (their objects still alive)
    b.close()
    a.close()
pid = os.fork()
if pid == 0:
    if sys.argv[1] == "after-close":
        with p2pkv.start_node(cfg("c")) as c, p2pkv.start_node(cfg("d")) as d:
            k = os.urandom(32)
            c.store.put(k, os.urandom(4096))
            got = d.fetch(d.connect(c.address, timeout=20), [k], timeout=20).loaded
            print("FETCH", got == [k], flush=True)
    if sys.argv[1] == "own-node":
        t = time.monotonic()
        try:
            p2pkv.start_node(cfg("c")).close()
            print("STARTED", flush=True)
        except p2pkv.P2PKVError as exc:
            print("REFUSED", "spawn" in str(exc), time.monotonic() - t < 5, flush=True)
    sys.exit(0)  # a normal exit: finalizers and atexit run
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
if sys.argv[1] != "after-close":
    assert sorted(b.fetch(peer, keys, timeout=10).loaded) == sorted(keys)  # untouched
b.close()
a.close()
print("PARENT ok", flush=True)
"""


@pytest.mark.nixl
@pytest.mark.parametrize("child", ["exits", "own-node", "after-close"])
def test_a_child_forked_beside_a_live_nixl_node_exits_cleanly_or_is_told_to_spawn(
    child: str,
) -> None:
    """A child forked while the parent's NIXL node lived died of SIGSEGV at a normal
    exit: the transport's finalizer destroyed its copy of the parent's agent. A node
    of its own started, connected, and never completed a transfer (UCX is not
    fork-safe). The child now abandons the inherited agents without touching them and
    refuses a NIXL node of its own at once, naming spawn (review 2026-12-05). A child
    forked after the parent closed its nodes is not refused."""
    pytest.importorskip("nixl_cu13")
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _NIXL_FORK_SCRIPT, child],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")},
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    want = ["CHILD 0", "PARENT ok"]
    if child == "own-node":
        want.insert(0, "REFUSED True True")
    if child == "after-close":  # no live agent at the fork: the child's own NIXL works
        want.insert(0, "FETCH True")
    assert lines == want, done.stdout + done.stderr[-3000:]


# ---------------------------------------------------------------- the host thread interrupted
#
# Ctrl-C (or any exception raised asynchronously in the host thread: a signal handler's,
# PyThreadState_SetAsyncExc, pytest-timeout's thread method) lands where the interpreter
# checks for them: at a function's entry and after a call. A profile hook raises it at
# the entry (or the return) of a chosen call inside p2pkv, so the moment is certain.


def test_ctrl_c_inside_a_submit_as_it_wakes_the_engine_leaves_later_submits_served(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A submit to an idle loop flags "drain scheduled", then wakes the waker thread. A
    Ctrl-C between the two (at the entry of the contextlib.suppress the wake was made in)
    left the flag set and nobody woken: every later submit saw the flag and woke nobody
    either, so no ticket was served until something else woke the loop (review
    2026-12-05: still in flight after 5 s). The wake now makes no call between the flag
    and the release, so there is nowhere for the interrupt to land; the hook raises it at
    any call made there."""
    a = nodes("a")
    engine = a._engine
    wait_for(lambda: engine._loop_idle and not engine._drain_scheduled)
    landed: list[bool] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        back = frame.f_back
        in_post = event == "call" and back is not None and back.f_code.co_name == "_post"
        if in_post and engine._drain_scheduled and not landed:
            landed.append(True)
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(hook)
    try:
        first = a.submit_lookup("nobody", [b"k"])
    except KeyboardInterrupt:
        first = None
    finally:
        sys.setprofile(None)
    assert isinstance(wait_ticket(a, a.submit_lookup("nobody", [b"k"])), PeerUnavailable)
    if first is not None:
        assert isinstance(wait_ticket(a, first), PeerUnavailable)


def test_ctrl_c_inside_close_leaves_a_later_close_graceful(
    nodes: Callable[..., BlockingNode],
) -> None:
    """close() marks the engine closing, then asks main to tear down. A Ctrl-C between the
    two (as it let go of its lock) left the engine closing with nobody asking main
    to stop, and a later close() saw it was not the first and asked nothing either: it
    waited out three quarters of its timeout, then cancelled the engine, so main never
    closed its sessions gracefully (review 2026-12-05). A later close() asks again."""
    a = nodes("a")
    with pytest.raises(KeyboardInterrupt), interrupt_at("c_return", "release", "close"):
        a.close(timeout=BOUND)
    a.close(timeout=BOUND)  # bounded by its own timeout
    assert not a.alive
    assert not a._engine._cancel_requested, "main was cancelled instead of closing"


def test_ctrl_c_as_start_node_wraps_a_started_engine_leaves_no_engine_behind() -> None:
    """start_node started the engine, then made the BlockingNode. A Ctrl-C in between (at
    the entry of BlockingNode.__init__) left an engine listening, with its threads and
    port, that no caller could close: no node was returned, and the half-made one did
    not own the engine (review 2026-12-05; only the interpreter's exit closed it). The
    engine is closed there, as after a start that was interrupted earlier."""
    with (
        pytest.raises(KeyboardInterrupt),
        interrupt_at("call", "BlockingNode.__init__", "start_node") as landed,
    ):
        start_node(config("ctrl-c"))
    assert landed
    engines = [t for t in threading.enumerate() if t.name.startswith("p2pkv-engine-ctrl-c")]
    for t in engines:
        t.join(BOUND)
    assert not [t for t in engines if t.is_alive()], "the engine outlived the interrupted start"


@pytest.mark.parametrize(
    ("event", "name"),
    [
        ("return", "TicketBoard.new_ticket"),  # the ticket taken, nothing posted
        ("call", "EngineThread.spawn_soon"),  # the same, at the post's entry
        ("return", "EngineThread.spawn_soon"),  # posted: its work runs
    ],
)
def test_ctrl_c_inside_a_submit_leaves_no_ticket_the_host_never_got(
    nodes: Callable[..., BlockingNode], event: str, name: str
) -> None:
    """A submit takes a ticket, then posts its work. A Ctrl-C in between left the ticket
    in flight until close(): ``pending()`` counted it for ever, though nothing would ever
    finish it; one after the post left its outcome on the board for ``get_finished`` under
    a number the host never got (review 2026-12-05; design.md listed it as left). The
    interrupted submit now withdraws its ticket: not counted, and a late outcome of its
    work is dropped."""
    a = nodes("a")
    with pytest.raises(KeyboardInterrupt), interrupt_at(event, name, "_submit") as landed:
        a.submit_lookup("nobody", [b"k"])
    assert landed
    assert a.pending() == 0, "the interrupted submit's ticket is still counted in flight"
    later = a.submit_lookup("nobody", [b"k"])
    assert isinstance(wait_ticket(a, later), PeerUnavailable)
    assert a.get_finished() == []


def test_ctrl_c_inside_a_submit_on_a_closed_node_leaves_no_ticket_the_host_never_got(
    nodes: Callable[..., BlockingNode],
) -> None:
    """On a closed node the board is sealed, so a ticket is born finished (PortalClosed)
    as it is taken. A Ctrl-C landing right after that must take its outcome back too
    (mutation review 2026-12-05: ``withdraw`` that only forgot in-flight tickets survived
    the suite, and ``get_finished`` then handed the host a number it never got)."""
    a = nodes("a")
    a.close(timeout=BOUND)
    with (
        pytest.raises(KeyboardInterrupt),
        interrupt_at("return", "TicketBoard.new_ticket", "_submit") as landed,
    ):
        a.submit_lookup("nobody", [b"k"])
    assert landed
    assert a.pending() == 0
    assert a.get_finished() == [], "the interrupted submit's ticket was handed out"
    later = a.submit_lookup("nobody", [b"k"])  # born PortalClosed, as before
    assert isinstance(wait_ticket(a, later), PortalClosed)


@pytest.mark.parametrize("within", [None, 0.3])
def test_a_fetch_into_tickets_default_timeout_outlasts_its_quarantine(
    nodes: Callable[..., BlockingNode], within: float | None
) -> None:
    """A ``fetch_into`` whose writes never settle (FAKE transport: a stalled NIC) gives up
    after ``fetch_timeout`` (or ``within``) and keeps its slots ``quarantine`` seconds
    more before it answers. The ticket's own default timeout must outlast that, or the
    host gets a bare ``P2PKVTimeout`` (and must quarantine the slots itself) instead of
    the per-key result (mutation review 2026-12-05: a default counted without
    ``quarantine``, for ``within`` or without it, survived the suite). Here the ticket's
    default is the config's deadlines plus ``quarantine`` (3 s) plus a second; without
    the quarantine it would end 1.5 s before the fetch's answer."""
    hanging = GatedFactory(lambda t: setattr(t, "hang", True))
    src = nodes("src", transport=hanging, close_timeout=0.5, abort_timeout=0.5)
    dst = nodes(
        "dst",
        lookup_timeout=0.5,
        fetch_timeout=0.3,
        abort_timeout=0.5,
        landing_margin=0.5,
        quarantine=3.0,
    )
    keys = fill(src.store, 2, BLOCK)
    peer = dst.connect(src.address, timeout=BOUND)
    ticket = dst.submit_fetch_into(peer, keys, [30, 20], within=within)
    assert hanging.transport.posted.wait(BOUND)
    deadline = time.monotonic() + BOUND
    while (outcome := dst.poll(ticket)) is None:  # as wait_ticket, but an error is a failure
        assert time.monotonic() < deadline, "ticket never finished"
        time.sleep(0.001)
    assert isinstance(outcome, FetchResult)
    assert not outcome.loaded and set(outcome.failed) == set(keys)


def test_close_by_default_outlasts_a_write_draining_for_its_abort_timeout(
    nodes: Callable[..., BlockingNode],
) -> None:
    """Review 2026-12-05 (clocks): ``close()``'s default bound was ``2 * close_timeout``
    plus a second, but closing a node that writes to a peer cuts the write, waits up to
    ``abort_timeout`` for it to settle (shielded: the pins under it must stay until then)
    and only then tears the session down. With ``close_timeout`` below ``abort_timeout``
    a close during a stuck write raised ``P2PKVTimeout`` ("engine thread did not stop")
    while the engine was only keeping its own bound, and the vLLM tier's shutdown raised
    with it, before the region could safely go. The writes here never settle (FAKE
    transport) until released: the close waits out ``abort_timeout`` (2 s) and returns."""
    hanging, src, dst, _peer, _keys, in_flight = stuck_fetch(nodes)
    src.close()  # the default bound
    assert not src.alive
    assert hanging.transport.releases >= 1  # the write was cut, not left behind
    outcome = wait_ticket(dst, in_flight)
    assert isinstance(outcome, FetchResult) and not outcome.loaded


def test_a_blocking_connect_by_default_outlasts_a_lost_simultaneous_dial_and_its_winner(
    nodes: Callable[..., BlockingNode],
) -> None:
    """A connect whose dial loses a simultaneous-dial tie-break (the peer dialed us while
    ours handshook, and the dial of the smaller peer id wins) waits up to
    ``handshake_timeout`` more for the winning session and returns its peer. That wait
    comes after its own handshake, which may take up to ``handshake_timeout`` too, so the
    engine's own path is ``connect_timeout + 2 * handshake_timeout``. The facade's
    default was ``connect_timeout + handshake_timeout`` plus a second (4.2 s here): this
    call (about 5 s: the peer dials 2.5 s into our handshake and acks on its own
    connection 2.5 s later, each within ``handshake_timeout``) ended in a bare
    ``P2PKVTimeout`` while the engine kept every deadline of its own, and the peer
    connected anyway (reading review, 2026-12-06, default timeouts).

    The peer is a FAKE played by hand (two :class:`~tests.helpers.RawPeer` protocols of
    one identity, same epoch) on a Trio loop of its own in a thread; its waits are real
    seconds (the facade's waits are), the scenario itself, not a synchronisation."""
    dial_at, ack_after = 2.5, 2.5  # each 0.5 s within handshake_timeout
    dst = nodes("zz-dst", connect_timeout=0.2, handshake_timeout=3.0)
    address: list[tuple[str, int]] = []
    listening = threading.Event()

    async def play() -> None:
        raw = RawPeer("aa-src")  # the smaller id: its own dial wins the tie-break
        second = copy.copy(raw)  # the same identity and region on a second connection
        second.proto = SessionProtocol(raw.proto.local)
        second.stream = None
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        try:
            with trio.fail_after(BOUND):
                address.append(listeners[0].socket.getsockname()[:2])
                listening.set()
                raw.stream = await listeners[0].accept()
                t0 = trio.current_time()
                raw.proto.start()
                await raw.flush()  # our hello on its dial; our ack never comes
                assert isinstance(await raw.next_event(), HelloReceived)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, raw)
                    await until(lambda: dst.peer_count() == 1)  # its dial is admitted
                    await trio.sleep_until(t0 + dial_at)  # the scenario: we dial late
                    await second.connect(dst.address)
                    second.proto.start()
                    await second.flush()
                    assert isinstance(await second.next_event(), HelloReceived)
                    await trio.sleep(ack_after)  # the scenario: a slow registration
                    second.proto.registration_succeeded()
                    await second.flush()
                    await drain(second)  # until the consumer hangs up
        finally:
            await listeners[0].aclose()
            if second.stream is not None:
                await second.stream.aclose()
            await raw.aclose()

    async def drain(peer: RawPeer) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while await peer.next_event() is not None:
                pass

    # dst.close() is idempotent; it ends the FAKE peer's sessions whatever happened.
    with trio_in_a_thread(play, "simultaneous-dialer", stop=dst.close):
        assert listening.wait(BOUND)
        peer = dst.connect(address[0])  # the default timeout
        assert peer.peer_id == "aa-src" and dst.is_connected(peer)
        dst.disconnect(peer, timeout=BOUND)
