"""Registration off the Trio thread: the ack barrier and the generation guard.

These use real worker threads and the real clock; blocking registrations are gated with
``threading.Event``s, never timed with sleeps.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import attrs
import pytest
import trio
import trio.testing

from p2pkv import HandshakeRejected, PeerUnavailable, SessionClosed, open_node
from p2pkv.registrar import Registrar
from p2pkv.session.protocol import ByeReceived, SessionProtocol
from p2pkv.transport.base import RegionLayout
from p2pkv.wire import Fetch, Lookup, encode

from .helpers import (
    FaultFactory,
    FaultTransport,
    RawPeer,
    config,
    fill,
    rejected_registration,
    until_sessions,
)


async def wait_until(predicate: object, within: float = 5.0) -> None:
    assert callable(predicate)
    with trio.fail_after(within):
        while not predicate():
            await trio.sleep(0.005)


async def test_ack_waits_for_registration() -> None:
    """connect() cannot return, and nothing is written, until the producer has
    registered the consumer: the producer's hello_ack is the barrier."""
    gate = threading.Event()
    factory = FaultFactory(lambda t: setattr(t, "registration_gate", gate))
    with trio.fail_after(20):
        async with (
            open_node(config("src"), transport=factory) as src,
            open_node(config("dst")) as dst,
        ):
            keys = fill(src.store, 4, 4096)
            connected = trio.Event()

            async def connect() -> None:
                await dst.connect(src.address)
                connected.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(connect)
                await trio.to_thread.run_sync(factory.transport.registration_entered.wait, 5)
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert not connected.is_set()
                assert src.statistics().registrations.running
                assert dst.statistics().peers == 0
                gate.set()
            assert connected.is_set()
            result = await dst.fetch("src", keys)
            assert sorted(result.loaded) == sorted(keys)


async def test_requests_before_our_ack_are_a_protocol_error_and_write_nothing() -> None:
    """A peer that skips the barrier (lookup and fetch right after its hello) is cut off
    with a reason; no write is ever posted towards it."""
    gate = threading.Event()
    factory = FaultFactory(lambda t: setattr(t, "registration_gate", gate))
    raw = RawPeer()
    with trio.fail_after(20):
        async with open_node(config("src"), transport=factory) as src:
            keys = fill(src.store, 2, 4096)
            await raw.connect(src.address)
            raw.proto.start()
            await raw.flush()
            await raw.send_raw(
                encode(Lookup(req_id=1, keys=keys))
                + encode(Fetch(req_id=1, keys=keys, slots=[0, 1]))
            )
            bye = await raw.expect_close()
            assert isinstance(bye, ByeReceived)
            assert bye.code == "protocol" and "before our hello_ack" in bye.reason
            gate.set()
            await wait_until(lambda: src.statistics().sessions == 0)
            await src.registrar.drain()
            t = factory.transport
            assert t.posts == 0
            assert t.adds == t.removes and not t.live  # the late registration was released
        await raw.aclose()


async def test_registration_of_a_reaped_peer_is_released_not_published() -> None:
    """The generation guard: the peer goes away while its registration runs in a thread;
    when the thread finishes, the registration is released (counted: zero leaks)."""
    gate = threading.Event()
    factory = FaultFactory(lambda t: setattr(t, "registration_gate", gate))
    raw = RawPeer()  # its region stays registered-able after its connection is gone
    with trio.fail_after(20):
        async with open_node(config("src"), transport=factory) as src:
            await raw.connect(src.address)
            raw.proto.start()
            await raw.flush()
            await trio.to_thread.run_sync(factory.transport.registration_entered.wait, 5)
            assert raw.stream is not None
            await raw.stream.aclose()
            # The session is reaped while its registration still blocks in the thread.
            await wait_until(lambda: src.statistics().sessions == 0)
            assert src.statistics().registrations.running
            gate.set()
            await src.registrar.drain()
            await wait_until(lambda: src.statistics().registrations.released_stale == 1)
            st = src.statistics().registrations
            assert st.live == 0 and st.published == 0
            t = factory.transport
            assert t.adds == 1 and t.removes == 1 and not t.live
        raw.transport.close()


async def test_a_failed_registration_rejects_the_handshake_and_leaves_nothing() -> None:
    factory = FaultFactory(lambda t: setattr(t, "registration_error", rejected_registration()))
    with trio.fail_after(20):
        async with (
            open_node(config("src"), transport=factory) as src,
            open_node(config("dst")) as dst,
        ):
            with pytest.raises(HandshakeRejected, match="registration failed"):
                await dst.connect(src.address)
            await wait_until(lambda: src.statistics().sessions == 0)
            st = src.statistics().registrations
            assert st.failed == 1 and st.live == 0
            assert not factory.transport.live


async def test_shutdown_waits_for_a_running_registration_and_releases_it() -> None:
    """Closing the node mid-registration neither abandons the thread nor leaks it."""
    gate = threading.Event()
    factory = FaultFactory(lambda t: setattr(t, "registration_gate", gate))
    with trio.fail_after(20):
        async with open_node(config("dst")) as dst:
            async with (
                open_node(config("src"), transport=factory) as src,
                trio.open_nursery() as nursery,
            ):

                async def doomed_connect() -> None:
                    with pytest.raises(PeerUnavailable, match="shutting down"):
                        await dst.connect(src.address)

                nursery.start_soon(doomed_connect)
                await trio.to_thread.run_sync(factory.transport.registration_entered.wait, 5)
                # Open the gate only once the node is closing and has nothing else to do.
                nursery.start_soon(src.aclose)
                await trio.testing.wait_all_tasks_blocked(0.05)
                assert src.statistics().registrations.running
                gate.set()
                await src.aclose()
            t = factory.transport
            assert gate.is_set()
            assert t.adds == t.removes and not t.live
            assert t.statistics().remote_peers == 0


async def test_peer_restart_on_the_same_connection_reregisters() -> None:
    """A hello with a new epoch on a live session: the old registration is torn down
    before the new one is made; the peer is served again."""
    factory = FaultFactory()
    raw = RawPeer("phoenix")
    with trio.fail_after(20):
        async with open_node(config("src"), transport=factory) as src:
            await raw.connect(src.address)
            await raw.handshake()
            await wait_until(lambda: factory.transport.adds == 1)
            # Re-hello with a new epoch, as a restarted engine would.
            raw.proto = SessionProtocol(
                attrs.evolve(raw.proto.local, epoch=raw.proto.local.epoch + 1)
            )
            await raw.handshake()
            await wait_until(lambda: factory.transport.adds == 2)
            t = factory.transport
            assert t.removes == 1 and len(t.live) == 1
            assert src.statistics().registrations.live == 1
            assert src.statistics().peers == 1
        await raw.aclose()


async def test_a_registrar_stopped_before_its_thread_starts_leaves_no_count_behind() -> None:
    """The executor is cancelled (the node closes) while its next job waits for the
    limiter: nothing was registered, so nothing counts as started or running, and the
    job's waiter gets an answer instead of waiting out its deadline."""
    peer = RawPeer("r")
    reg = Registrar(peer.transport)
    layout = RegionLayout(peer.array.ctypes.data, 64, 4096)
    with trio.fail_after(10), contextlib.closing(peer.transport):
        # The limiter held: the job waits for it, and its thread never starts.
        async with trio.open_nursery() as nursery, reg.limiter:
            nursery.start_soon(reg.run)
            job = reg.submit("other", peer.transport.metadata(), layout)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        stats = reg.statistics()
        assert (stats.started, stats.running, stats.live) == (0, False, 0)
        with pytest.raises(SessionClosed):
            await job.wait()


async def test_departed_peers_leave_nothing_in_the_registrar() -> None:
    """Without a secret peer ids cost nothing: every connection under a new id used to
    leave its agent name's generation in the registrar for good. Once a peer's session is
    gone, nothing of it is kept (generations come from one counter, so none is reused)."""
    with trio.fail_after(20):
        async with open_node(config("src")) as src:
            for _ in range(20):
                raw = RawPeer()
                try:
                    await raw.connect(src.address)
                    await raw.handshake()
                    assert src.statistics().registrations.current == 1
                finally:
                    await raw.aclose()
            await until_sessions(src, lambda: src.statistics().sessions == 0)
            stats = src.statistics().registrations
            assert (stats.current, stats.live, stats.published) == (0, 0, 20)


async def test_a_registration_superseded_while_it_runs_is_released_and_the_new_one_kept() -> None:
    """The generation guard on its own: a peer's registration is still running in its
    thread when a new one for the same agent name is submitted (a restarted peer admitted
    before its old session is reaped). The old one's thread finishes first; it must be
    released as stale, not published over the new one, and a job superseded while still
    queued never starts at all."""
    src = RawPeer("src")  # whose transport registers the others
    gated = FaultTransport(
        agent_name="src", region=src.array, layout=RegionLayout(src.array.ctypes.data, 64, 4096)
    )
    gate = threading.Event()
    gated.registration_gate = gate
    x, y = RawPeer("x"), RawPeer("y")

    def layout(p: RawPeer) -> RegionLayout:
        return RegionLayout(p.array.ctypes.data, 64, 4096)

    reg = Registrar(gated)
    with trio.fail_after(10), contextlib.closing(gated), contextlib.closing(x.transport):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reg.run)
            old = reg.submit("x", x.transport.metadata(), layout(x))
            await trio.to_thread.run_sync(gated.registration_entered.wait, 5)
            new = reg.submit("x", x.transport.metadata(), layout(x))  # supersedes `old`
            queued = reg.submit("y", y.transport.metadata(), layout(y))
            latest = reg.submit("y", y.transport.metadata(), layout(y))  # `queued` never runs
            gate.set()
            registered = await new.wait()
            assert await latest.wait() is reg.current("y")
            await reg.drain()
            stats = reg.statistics()
            assert (stats.started, stats.published, stats.released_stale) == (3, 2, 1)
            assert reg.current("x") is registered and stats.live == 2
            assert gated.adds == 3 and gated.removes == 1  # the stale one, and only it
            assert not old.done.is_set() and not queued.done.is_set()
            # Their sessions go: nothing of theirs is live, and their waiters get an answer.
            assert reg.retire(old) is None and reg.retire(queued) is None
            for gone in (old, queued):
                with pytest.raises(SessionClosed):
                    await gone.wait()
            assert reg.current("x") is registered
            await reg.release(reg.retire(new))
            await reg.release(reg.retire(latest))
            assert gated.removes == 3 and not gated.live
            nursery.cancel_scope.cancel()
    y.transport.close()
    src.transport.close()


async def test_a_published_registration_superseded_without_a_retire_is_released() -> None:
    """A published registration superseded by a new generation of the same agent name,
    with no retire of the old one, is released: the old remote peer does not leak in the
    transport."""
    src, x = RawPeer("src"), RawPeer("x")
    t = FaultTransport(
        agent_name="src", region=src.array, layout=RegionLayout(src.array.ctypes.data, 64, 4096)
    )
    layout = RegionLayout(x.array.ctypes.data, 64, 4096)
    reg = Registrar(t)
    with trio.fail_after(10), contextlib.closing(t), contextlib.closing(x.transport):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reg.run)
            first = reg.submit("x", x.transport.metadata(), layout)
            await first.wait()
            second = reg.submit("x", x.transport.metadata(), layout)  # no retire of first
            newest = await second.wait()
            await reg.drain()
            assert reg.current("x") is newest
            assert (t.adds, t.removes, len(t.live)) == (2, 1, 1)
            await reg.release(reg.retire(second))
            assert not t.live
            nursery.cancel_scope.cancel()
    src.transport.close()


async def test_a_session_closed_as_its_registration_publishes_ends_without_crashing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The registration publishes, and before the waiting task runs again the reader takes
    the peer's bye (both woken in one scheduler batch: the wait returns, the cancel of the
    session's scope comes too late). The task must not ack a handshake the bye closed:
    ``registration_succeeded`` on the closed protocol raised ``LocalProtocolError`` and
    crashed the session (logged as a crash). Nothing is left: the registration is
    released with the session."""
    from p2pkv.registrar import RegistrationJob

    real_wait = RegistrationJob.wait
    published, bye_taken = trio.Event(), trio.Event()

    async def late_wait(job: RegistrationJob) -> object:
        """FAULT INJECTION: the waiter returns only after the reader took the peer's bye,
        as when both were woken in one batch in that order."""
        peer = await real_wait(job)
        published.set()
        with trio.CancelScope(shield=True):
            await bye_taken.wait()
        return peer

    monkeypatch.setattr(RegistrationJob, "wait", late_wait)
    factory = FaultFactory()
    raw = RawPeer("r")
    with trio.fail_after(20):
        async with open_node(config("a"), transport=factory) as a:
            await raw.connect(a.address)
            raw.proto.start()
            await raw.flush()
            await published.wait()
            session = a._by_peer["r"]
            on_bye = session._handlers[ByeReceived]

            def took(ev: ByeReceived) -> None:
                on_bye(ev)
                bye_taken.set()

            session._handlers[ByeReceived] = took
            raw.proto.send_bye("shutdown", "going away")
            await raw.flush()
            with trio.fail_after(5):
                await session.finished.wait()
            await wait_until(lambda: a.statistics().sessions == 0)
            assert not [r for r in caplog.records if "crashed" in r.getMessage()]
            st = a.statistics().registrations
            assert st.live == 0 and st.published == 1 and st.retired == 1
            t = factory.transport
            assert t.adds == 1 and t.removes == 1 and not t.live
        await raw.aclose()
    raw.transport.close()


async def test_peers_whose_registration_fails_cannot_log_a_warning_per_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a secret anyone who connects is registered, so a stranger whose hello
    carries metadata the data plane refuses, reconnecting under a new id each time (each
    id has a budget of its own), made one "registering ... failed" WARNING per connection.
    Like the other per-connection warnings it is at most one line a second now, the next
    saying how many were left out."""
    caplog.set_level(logging.WARNING, logger="p2pkv")
    factory = FaultFactory(lambda t: setattr(t, "registration_error", rejected_registration()))
    n = 12
    with trio.fail_after(30):
        async with open_node(config("src"), transport=factory) as src:
            t0 = trio.current_time()
            for i in range(n):
                raw = RawPeer(f"stranger{i}")
                try:
                    await raw.connect(src.address)
                    raw.proto.start()
                    await raw.flush()
                    await raw.expect_close()
                finally:
                    await raw.aclose()
                    raw.transport.close()
            await wait_until(lambda: src.statistics().sessions == 0)
            elapsed = trio.current_time() - t0
            assert src.statistics().registrations.failed == n  # each one was tried
    lines = [r.getMessage() for r in caplog.records if "registering" in r.getMessage()]
    assert lines, "the first one is still logged"
    assert len(lines) <= 1 + elapsed, lines
