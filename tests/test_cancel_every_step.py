"""A caller's cancel at every step of every public async operation loses nothing.

Structured concurrency lets a caller wrap any call in a cancel scope and cancel it at
any checkpoint. Each sweep here runs one operation over and over, its caller's scope
cancelled after the run loop's k-th task step (k = 1, 2, 3, ...: a PROBE instrument
counts them: the caller's own checkpoints, and every point between them where another
task's work falls), until a run completes uncut. After every run the pair is let
settle (quarantines end, aborts are acknowledged; every lease is far longer than that,
so a pin left to its lease fails the sweep), and then everything must be back where it
was: the store's counts on both sides, the session's request slots, open requests,
rounds, claims, share waits and write scopes, the landing shares, the poller's demand,
the data plane's handles and registrations, the tasks each session runs, the caller's
slots of ``fetch_into``, this process's descriptors (the answer lane reads on a
duplicate of the socket's), and a fresh fetch of the same keys must load the
producer's bytes. Where another caller runs beside the one cut, it must get all it
asked for.

Two nodes in this process over real loopback TCP, the in-process data plane, blocking
work inline on the autojump clock (FAKE offload: no threads), so that the runs are
deterministic and the quarantines pass in virtual time; each sweep runs as configured
by default, verifying checksums, without the answer lane, and over mutual TLS. One
sweep runs over real NIXL, its blocking calls in worker threads, on the real clock.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from p2pkv import LookupRound, Node, Peer
from p2pkv.session.session import PeerSession

from .helpers import fill, pair, until
from .test_tls import PKI

BLOCK = 4096
MAX_STEPS = 1_000  # no operation here takes this many steps uncut: the sweep must end
SETTLE = 20.0  # virtual seconds: past every quarantine and abort, far short of a lease
# Short quarantines (so the settling is quick), leases far past SETTLE.
TIMES: dict[str, Any] = {
    "lease": 600.0,
    "abort_timeout": 0.5,
    "landing_margin": 0.1,
    "quarantine": 1.0,
    "heartbeat_interval": 60.0,
    "idle_timeout": 600.0,
    "max_peer_registrations": 10_000,  # the connect sweeps connect hundreds of times
}


class CancelAtStep(trio.abc.Instrument):
    """PROBE: cancels ``scope`` once the run loop has run ``k`` task steps (any task's:
    the caller's, the tasks it starts, the nodes' own) since the instrument was added.
    A step of the caller's own task ending in a wait is cancelled at that checkpoint,
    as a caller's cancel arriving while it waits there would; a step of another task
    puts the cancel between two of the caller's steps, wherever that task's work falls
    (a reply read, a write done, a task of the caller's done)."""

    def __init__(self, k: int, scope: trio.CancelScope) -> None:
        self.k, self.scope, self.steps = k, scope, 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1
        if self.steps == self.k:
            self.scope.cancel()


async def cut_at(k: int, op: Callable[[], Awaitable[object]]) -> bool:
    """Run ``op`` in this task, its scope cancelled after the run loop's ``k``-th task
    step; True if the cancel cut it (False: it completed first)."""
    with trio.CancelScope() as scope:
        probe = CancelAtStep(k, scope)
        trio.lowlevel.add_instrument(probe)
        try:
            await op()
        finally:
            trio.lowlevel.remove_instrument(probe)
    return scope.cancelled_caught


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def session_state(s: PeerSession | None) -> dict[str, Any]:
    if s is None:
        return {"session": None}
    nursery = s._nursery
    return {
        "alive": s.alive,
        "ready": s.ready.is_set(),
        "request_slots": (s._requests.free, s._requests.limit, s._requests.waiting),
        "pending": sorted(s._pending),
        "rounds": sorted(s._rounds),
        "claims": len(s._claims),
        "share_waits": len(s._share_waits),
        "pinned": sorted(s._pinned),
        "writes": sorted(s._writes),
        "write_done": sorted(s._write_done),
        "lane": (s._lane_p, s._lane_parked, s._lane_handed),
        "inflight_bytes": s.inflight_bytes,
        "tasks": sorted(t.name for t in nursery.child_tasks) if nursery is not None else None,
    }


def node_state(node: Node, other: str) -> dict[str, Any]:
    st = node.statistics()
    return {
        "store": st.store,
        "keys": len(node.store),
        "inflight": st.inflight_transfers,
        "live_handles": st.transport.live_handles,
        "remote_peers": st.transport.remote_peers,
        "parked_peers": st.transport.parked_peers,
        "demand": node.poller._demand,
        "shares": node.landing_shares.held(other, trio.current_time()),
        "caller_slots": sorted(node.caller_slots),
        "orphan_pins": dict(node.orphan_pins),
        "data_wanted": node.data_wanted,
        "dialing": sorted(node._dialing),
        "retired": len(node._retired_transports),
        "sessions": len(node._sessions),
        "session": session_state(node._by_peer.get(other)),
    }


def state(src: Node, dst: Node) -> dict[str, Any]:
    return {"src": node_state(src, "dst"), "dst": node_state(dst, "src"), "fds": fds()}


def differences(now: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in now.items():
        if isinstance(v, dict):
            if sub := differences(v, base[k]):
                out[k] = sub
        elif v != base[k]:
            out[k] = (v, base[k])
    return out


async def settled(src: Node, dst: Node, base: dict[str, Any], k: int) -> None:
    """Wait (at most SETTLE seconds) until both nodes are back at ``base``."""
    with trio.move_on_after(SETTLE):
        await until(lambda: state(src, dst) == base, poll=0.05)
    assert state(src, dst) == base, f"cancelled at step {k}: {differences(state(src, dst), base)}"


def forget(dst: Node, src: Node, keys: list[bytes]) -> None:
    """Keys a run loaded hold the producer's bytes; they are evicted again."""
    for key in keys:
        got = dst.store.get(key)
        if got is not None:
            assert bytes(got) == bytes(src.store.get(key) or b""), "loaded with other bytes"
            assert dst.store.evict(key)


async def fetch_right_bytes(src: Node, dst: Node, peer: Peer | str, keys: list[bytes]) -> None:
    r = await dst.fetch(peer, keys)
    assert r.failed == {} and sorted(r.loaded) == sorted(keys)
    forget(dst, src, keys)


def refetch(
    src: Node, dst: Node, peer: Peer | str, keys: list[bytes]
) -> Callable[[bool], Awaitable[None]]:
    """An ``after`` for :func:`sweep`: what a run loaded is evicted (its bytes checked),
    and a fresh fetch of the same keys loads the producer's bytes."""

    async def after(cut: bool) -> None:
        forget(dst, src, keys)
        await fetch_right_bytes(src, dst, peer, keys)

    return after


async def sweep(
    src: Node,
    dst: Node,
    op: Callable[[], Awaitable[object]],
    *,
    before: Callable[[], Awaitable[object]] | None = None,
    after: Callable[[bool], Awaitable[object]] | None = None,
    run: Callable[[int, Callable[[], Awaitable[object]]], Awaitable[bool]] = cut_at,
) -> int:
    """Cut ``op`` at step 1, 2, ... until a run completes; after each run (and ``after``,
    told whether it was cut), both nodes must settle back to where they were before it
    (``before``, run uncut first, sets each run up). ``run``: how one run is made
    (:func:`cut_at`, or a wrapper that runs something uncut beside it). Returns the
    steps it took uncut."""
    for k in range(1, MAX_STEPS):
        base = state(src, dst)
        if before is not None:
            await before()
        cut = await run(k, op)
        if after is not None:
            await after(cut)
        await settled(src, dst, base, k)
        if not cut:
            return k
    raise AssertionError(f"still cut after {MAX_STEPS} steps")


Mode = tuple[dict[str, Any], dict[str, Any]]  # settings of src, of dst


@pytest.fixture(params=["plain", "checksums", "no_lane", "tls"])
def mode(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Mode:
    """How the pair runs: as configured by default; verifying checksums (the landing
    waits for them); every answer through the reader (no answer lane: each request's
    task waits on its event); mutual TLS (every send through a drain task)."""
    if request.param == "checksums":
        return {"verify_checksums": True}, {"verify_checksums": True}
    if request.param == "no_lane":
        monkeypatch.setattr(PeerSession, "answer_lane", False)
    if request.param == "tls":
        pki = PKI(tmp_path)
        return pki.tls("src"), pki.tls("dst")
    return {}, {}


def settings(mode: Mode, src_kw: dict[str, Any] | None, dst_kw: dict[str, Any] | None) -> Mode:
    return {**TIMES, **mode[0], **(src_kw or {})}, {**TIMES, **mode[1], **(dst_kw or {})}


@asynccontextmanager
async def connected(
    mode: Mode,
    src_kw: dict[str, Any] | None = None,
    dst_kw: dict[str, Any] | None = None,
    n: int = 3,
) -> AsyncIterator[tuple[Node, Node, Peer, list[bytes]]]:
    async with pair(*settings(mode, src_kw, dst_kw), virtual=True) as (src, dst):
        keys = fill(src.store, n, BLOCK)
        peer = await dst.connect(src.address)
        await fetch_right_bytes(src, dst, peer, keys)  # every lazy part is built: the lane
        yield src, dst, peer, keys


# ---------------------------------------------------------------- lookups


@pytest.mark.parametrize(
    ("dst_kw", "n"),
    [
        pytest.param(None, 3, id="one_round"),
        pytest.param({"max_keys_per_request": 2}, 5, id="three_rounds"),  # taken, sent together
    ],
)
async def test_a_lookup_cancelled_at_any_step_loses_nothing(
    dst_kw: dict[str, Any] | None, n: int, mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """Three keys in one round, or five at two per request (three rounds)."""
    with trio.fail_after(3_000):
        async with connected(mode, dst_kw=dst_kw, n=n) as (src, dst, peer, keys):

            async def after(cut: bool) -> None:
                if not cut:  # its round is open, its hits pinned: a fetch uses it
                    await fetch_right_bytes(src, dst, peer, keys)

            await sweep(src, dst, lambda: dst.lookup(peer, keys), after=after)


async def test_a_release_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(3_000):
        async with connected(mode) as (src, dst, peer, keys):
            handle: list[Any] = []

            async def before() -> None:
                handle[:] = [await dst.lookup_round(peer, keys)]

            await sweep(src, dst, lambda: dst.release(peer, handle[0]), before=before)
            await fetch_right_bytes(src, dst, peer, keys)


# ---------------------------------------------------------------- fetches


async def test_a_fetch_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(3_000):
        async with connected(mode) as (src, dst, peer, keys):
            after = refetch(src, dst, peer, keys)
            await sweep(src, dst, lambda: dst.fetch(peer, keys), after=after)


async def test_a_fetch_of_a_looked_up_round_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """The fetch claims the open round of a lookup before (anonymous, then held)."""
    with trio.fail_after(3_000):
        async with connected(mode) as (src, dst, peer, keys):
            handle: list[Any] = []

            async def after(cut: bool) -> None:
                await dst.release(peer, handle)
                forget(dst, src, keys)
                await fetch_right_bytes(src, dst, peer, keys)

            async def anonymous() -> None:
                handle.clear()
                assert await dst.lookup(peer, keys) == [True] * len(keys)

            await sweep(src, dst, lambda: dst.fetch(peer, keys), before=anonymous, after=after)

            async def held() -> None:
                handle[:] = [await dst.lookup_round(peer, keys)]

            await sweep(src, dst, lambda: dst.fetch(peer, keys, handle), before=held, after=after)


@pytest.mark.parametrize(
    "dst_kw",
    [
        pytest.param({"max_keys_per_request": 2}, id="rounds"),  # three, a task each
        pytest.param({"max_landing_share": 2 / 64}, id="parts"),  # our share: two slots
    ],
)
async def test_a_fetch_of_several_rounds_or_parts_cancelled_at_any_step_loses_nothing(
    dst_kw: dict[str, Any], mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """Five keys at two per request (three rounds, each in a task of its own), or with
    the peer's share of our store two slots (fetched in parts)."""
    with trio.fail_after(3_000):
        async with connected(mode, dst_kw=dst_kw, n=5) as (src, dst, peer, keys):
            after = refetch(src, dst, peer, keys)
            await sweep(src, dst, lambda: dst.fetch(peer, keys), after=after)


async def test_a_fetch_into_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """The caller's slots come back to it (at once, or once no write can land), and the
    next fetch_into of the same keys into the same slots loads the producer's bytes."""
    with trio.fail_after(3_000):
        async with pair(*settings(mode, None, None), virtual=True) as (src, dst):
            keys = fill(src.store, 3, BLOCK)
            slots = [7, 9, 11]
            peer = await dst.connect(src.address)

            async def into_right_bytes() -> None:
                r = await dst.fetch_into(peer, keys, slots)
                assert r.failed == {} and r.loaded == keys
                for key, slot in zip(keys, slots, strict=True):
                    assert bytes(dst.store.view(slot)) == bytes(src.store.get(key) or b"")
                dst.store.array[:] = 0  # the next run must write them again

            await into_right_bytes()

            async def after(cut: bool) -> None:
                await until(lambda: not dst.caller_slots, poll=0.05)
                await into_right_bytes()

            await sweep(src, dst, lambda: dst.fetch_into(peer, keys, slots), after=after)


# ---------------------------------------------------------------- the session's life


async def test_a_connect_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """Whether the session it began stays (it was done) or not, a connect after it
    returns a working session, and once that is closed nothing is left on either side."""
    with trio.fail_after(3_000):
        async with pair(*settings(mode, None, None), virtual=True) as (src, dst):
            keys = fill(src.store, 3, BLOCK)

            async def after(cut: bool) -> None:
                peer = await dst.connect(src.address)
                await fetch_right_bytes(src, dst, peer, keys)
                await dst.disconnect(peer)
                await until(lambda: not src._sessions and not dst._sessions, poll=0.05)

            await sweep(src, dst, lambda: dst.connect(src.address), after=after)


async def test_a_disconnect_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(3_000):
        async with pair(*settings(mode, None, None), virtual=True) as (src, dst):
            keys = fill(src.store, 3, BLOCK)

            async def before() -> None:
                peer = await dst.connect(src.address)
                await fetch_right_bytes(src, dst, peer, keys)

            async def after(cut: bool) -> None:
                await until(lambda: not src._sessions and not dst._sessions, poll=0.05)

            await sweep(src, dst, lambda: dst.disconnect("src"), before=before, after=after)
            activity: list[tuple[int, int]] = []

            async def idle() -> None:
                await before()
                activity[:] = [dst.session_activity("src") or (0, 0)]

            await sweep(
                src,
                dst,
                lambda: dst.disconnect_idle("src", activity[0]),
                before=idle,
                after=after,
            )
            peer = await dst.connect(src.address)
            await fetch_right_bytes(src, dst, peer, keys)


async def test_a_reconfigure_cancelled_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """The peer stays a member: whether the new data plane went live or not, the session
    fetches the producer's bytes, and every replaced data plane is closed."""
    with trio.fail_after(3_000):
        async with connected(mode) as (src, dst, peer, keys):

            async def after(cut: bool) -> None:
                await fetch_right_bytes(src, dst, peer, keys)

            await sweep(src, dst, lambda: dst.reconfigure([peer]), after=after)


# ---------------------------------------------------------------- beside another caller


def beside(
    other: Callable[[], Awaitable[object]], *, other_first: bool
) -> Callable[[int, Callable[[], Awaitable[object]]], Awaitable[bool]]:
    """A ``run`` for :func:`sweep`: ``other`` runs uncut in a task of its own while the
    swept operation is cut; ``other_first``: it starts (and claims what it claims before
    its first checkpoint) before the swept operation does."""

    async def run(k: int, op: Callable[[], Awaitable[object]]) -> bool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            if other_first:
                await trio.lowlevel.checkpoint()
            return await cut_at(k, op)

    return run


def fetch_beside(
    src: Node, dst: Node, peer: Peer, keys: list[bytes], theirs: list[bytes]
) -> tuple[Callable[[], Awaitable[None]], Callable[[bool], Awaitable[None]]]:
    """An uncut fetch of ``theirs`` to run beside the swept one, and the ``after`` that
    checks it loaded all of them, then refetches ``keys`` (:func:`refetch`)."""
    results: list[Any] = []

    async def other() -> None:
        results.append(await dst.fetch(peer, theirs))

    async def after(cut: bool) -> None:
        (r,) = results
        results.clear()
        assert r.failed == {} and sorted(r.loaded) == sorted(theirs)
        await refetch(src, dst, peer, keys)(cut)

    return other, after


@pytest.mark.parametrize("other_first", [True, False], ids=["sharer_cut", "first_cut"])
@pytest.mark.parametrize("one_slot", [False, True], ids=["same_keys", "one_request_slot"])
async def test_a_fetch_beside_another_cut_at_any_step_fails_the_other_nothing(
    one_slot: bool, other_first: bool, mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """Two fetches, one cut at every step, the other uncut, whichever began first. Of the
    same keys: the other loads every key with the producer's bytes (a key the cut one gave
    up on it fetches itself). With one request open at the peer at a time, of other keys:
    the swept fetch waits for the slot the other holds, or holds it while the other waits,
    and the other loads all of its keys."""
    with trio.fail_after(3_000):
        kw = {"max_open_requests": 1} if one_slot else None
        async with connected(mode, dst_kw=kw, n=6 if one_slot else 3) as (src, dst, peer, keys):
            mine, theirs = (keys[:3], keys[3:]) if one_slot else (keys, keys)
            other, after = fetch_beside(src, dst, peer, keys, theirs)
            run = beside(other, other_first=other_first)
            await sweep(src, dst, lambda: dst.fetch(peer, mine), after=after, run=run)


async def test_a_fetch_retrying_keys_whose_lease_ended_cut_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """The producer's lease is shorter than ours: the fetch of a round looked up before
    finds its keys ``lease_expired`` and looks them up and fetches them again."""
    with trio.fail_after(3_000):
        async with connected(mode, src_kw={"lease": 2.0}) as (src, dst, peer, keys):

            async def before() -> None:
                assert await dst.lookup(peer, keys) == [True] * len(keys)
                await until(lambda: src.statistics().pinned_slots == 0, poll=0.05)

            after = refetch(src, dst, peer, keys)
            await sweep(src, dst, lambda: dst.fetch(peer, keys), before=before, after=after)


async def test_a_lookup_of_several_rounds_beside_another_cut_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """Two lookups of three rounds each where three requests may be open: one holds every
    request slot while the other waits for all three, and either may be the one cut.
    (Held rounds, each released once its lookup is in: an open round holds its slot.)"""
    with trio.fail_after(3_000):
        async with connected(
            mode, dst_kw={"max_keys_per_request": 2, "max_open_requests": 3}, n=5
        ) as (src, dst, peer, keys):
            handles: list[LookupRound] = []

            async def other() -> None:
                handle = await dst.lookup_round(peer, keys)
                assert handle.hits == [True] * len(keys)
                assert await dst.release(peer, handle) == 3

            async def op() -> None:  # as other(), its handle kept if the release is cut
                handles.append(await dst.lookup_round(peer, keys))
                await dst.release(peer, handles)

            async def after(cut: bool) -> None:
                await dst.release(peer, handles)
                handles.clear()
                await fetch_right_bytes(src, dst, peer, keys)

            for other_first in (True, False):
                await sweep(src, dst, op, after=after, run=beside(other, other_first=other_first))


async def test_a_connect_beside_another_to_the_same_address_cut_at_any_step_loses_nothing(
    mode: Mode, autojump_clock: trio.testing.MockClock
) -> None:
    """Two connects to one address share one dial; one is cut at every step. The other,
    uncut, returns a working session (it dials again if the cut one's dial was the one
    under way), whichever began first."""
    with trio.fail_after(3_000):
        async with pair(*settings(mode, None, None), virtual=True) as (src, dst):
            keys = fill(src.store, 3, BLOCK)
            peers: list[Peer] = []

            async def other() -> None:
                peers.append(await dst.connect(src.address))

            async def after(cut: bool) -> None:
                (peer,) = peers
                peers.clear()
                await fetch_right_bytes(src, dst, peer, keys)
                await dst.disconnect(peer)
                await until(lambda: not src._sessions and not dst._sessions, poll=0.05)

            for other_first in (True, False):
                await sweep(
                    src,
                    dst,
                    lambda: dst.connect(src.address),
                    after=after,
                    run=beside(other, other_first=other_first),
                )


# ---------------------------------------------------------------- over NIXL


_HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
# Real threads, so the real clock: quarantines short enough for many runs.
REAL_TIMES = {**TIMES, "abort_timeout": 0.05, "landing_margin": 0.05, "quarantine": 0.2}


@pytest.mark.nixl
@pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL")
async def test_over_nixl_a_fetch_cancelled_at_any_step_loses_nothing(no_agent_left: None) -> None:
    """The real data plane, its blocking calls in worker threads: no transfer handle, no
    registration and no descriptor outlives a cut fetch (the steps a run takes vary with
    the threads; every run, cut or not, must settle)."""
    nixl = {**REAL_TIMES, "transport": "nixl"}
    with trio.fail_after(120):
        async with pair(nixl, nixl) as (src, dst):
            keys = fill(src.store, 3, BLOCK)
            peer = await dst.connect(src.address)
            await fetch_right_bytes(src, dst, peer, keys)

            after = refetch(src, dst, peer, keys)
            await sweep(src, dst, lambda: dst.fetch(peer, keys), after=after)
            await sweep(src, dst, lambda: dst.fetch_into(peer, keys, [40, 41, 42]))
