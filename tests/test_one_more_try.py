"""The consumer's one more try (reading review, 2026-12-06): keys a producer answers
``lease_expired``, or ``not_pinned`` on a round no :class:`~p2pkv.LookupRound` handle
holds, are looked up and fetched once more in the same call (``_fetch_reserved``), and
never a third time; a held round's ``not_pinned`` stands.

The producer is a FAKE played by hand (:class:`~tests.helpers.HandProducer` over
:class:`~tests.helpers.RawPeer`, with ``answer`` and ``ack_aborts``): it answers every
lookup all hits and each fetch with the outcomes a test scripts, writing the block of
each key it says OK into the slot the consumer named (as the in-process data plane
would). Tests that need a deadline run on the autojump clock with
:class:`~tests.helpers.VirtualOffload`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from p2pkv import BlockingNode, FetchResult, LocalProtocolError, Node, open_node
from p2pkv.session.protocol import FetchRequested, LookupRequested
from p2pkv.wire import Outcome

from .helpers import Answer, HandProducer, RawPeer, VirtualOffload, config, trio_in_a_thread

BLOCK = 4096
BOUND = 20.0  # seconds: "this did not hang", never an expected duration
VIRTUAL_BOUND = 120.0  # the same on the autojump clock (virtual seconds)
OK, NP, LE = int(Outcome.OK), int(Outcome.NOT_PINNED), int(Outcome.LEASE_EXPIRED)
TF = int(Outcome.TRANSFER_FAILED)


@asynccontextmanager
async def scripted(answer: Answer, **dst_kw: Any) -> AsyncIterator[tuple[Node, HandProducer]]:
    """A consumer node (``config("dst", **dst_kw)``, inline offload for the autojump
    clock) connected to a :class:`HandProducer` answering fetches by ``answer``."""
    raw = RawPeer()
    try:
        async with open_node(config("dst", **dst_kw), offload=VirtualOffload()) as dst:
            await raw.connect(dst.address)
            await raw.handshake()
            producer = HandProducer(raw, dst, answer=answer, ack_aborts=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.run)
                yield dst, producer
                nursery.cancel_scope.cancel()
    finally:
        await raw.aclose()


def answering(*per_fetch: list[int]) -> Answer:
    """Fetch ``n`` is answered ``per_fetch[n]``, the last list for every fetch after."""

    async def answer(n: int, keys: list[bytes]) -> list[int]:
        await trio.lowlevel.checkpoint()
        return per_fetch[min(n, len(per_fetch) - 1)]

    return answer


def assert_nothing_held(dst: Node, peer: str) -> None:
    """No reservation, quarantine, room of the peer's share, caller slot, open round or
    request slot is left once a fetch returned."""
    st = dst.statistics()
    assert st.reserved_slots == 0 and st.quarantined_slots == 0
    assert dst.landing_shares.held(peer, trio.current_time()) == 0
    assert dst.caller_slots == set()
    session = dst._by_peer[peer]
    assert session._rounds == {}
    assert session._requests.free == session._requests.limit


def assert_partition(keys: list[bytes], r: FetchResult) -> None:
    """Every key once: loaded or failed, never both, never twice."""
    assert len(r.loaded) == len(set(r.loaded))
    assert sorted(r.loaded + list(r.failed)) == sorted(keys)


# The first answer, the retry's, and the reasons the keys fail with.
MIX = {
    "not_pinned": ([NP] * 4, [NP] * 4, ["not_pinned"] * 4),
    "lease_expired": ([LE] * 4, [LE] * 4, ["lease_expired"] * 4),
    "mix": (
        [NP, LE, LE, NP],
        [LE, NP, LE, NP],
        ["lease_expired", "not_pinned", "lease_expired", "not_pinned"],
    ),
}


@pytest.mark.parametrize("mode", ["fetch", "fetch_after_lookup", "fetch_into"])
@pytest.mark.parametrize("answers", list(MIX))
async def test_a_producer_failing_every_fetch_costs_one_more_lookup_and_fetch_per_call(
    mode: str, answers: str
) -> None:
    """A producer that answers every fetch ``not_pinned``, ``lease_expired`` or a mix of
    the two: each fetch call makes exactly two lookups and two fetches (a plain
    ``lookup`` before it counts as the first lookup: the fetch sends on its round), then
    each key fails with the second answer's reason. Nothing is loaded, nothing held, and
    a second call starts afresh (two more of each). ``fetch_into``'s retry names the
    caller's slots again."""
    first, second, want = MIX[answers]
    with trio.fail_after(BOUND):
        async with scripted(answering(first, second, first, second)) as (dst, producer):
            peer = producer.raw.peer_id
            keys = [os.urandom(32) for _ in range(4)]
            slots = [9, 3, 17, 5]
            for call in (1, 2):
                if mode == "fetch_after_lookup":
                    assert await dst.lookup(peer, keys) == [True] * 4
                if mode == "fetch_into":
                    r = await dst.fetch_into(peer, keys, slots)
                else:
                    r = await dst.fetch(peer, keys)
                assert r.loaded == [] and r.failed == dict(zip(keys, want, strict=True)), r
                assert len(producer.sent(LookupRequested)) == 2 * call
                fetches = producer.sent(FetchRequested)
                assert len(fetches) == 2 * call
                # The retry asks for exactly the keys answered so, in the named slots.
                assert sorted(fetches[-1].keys) == sorted(keys)
                if mode == "fetch_into":
                    for ev in fetches[-2:]:
                        assert dict(zip(ev.keys, ev.slots, strict=True)) == dict(
                            zip(keys, slots, strict=True)
                        )
                assert len(dst.store) == 0
                assert_nothing_held(dst, peer)


async def test_only_the_keys_answered_not_pinned_or_lease_expired_are_asked_again() -> None:
    """One fetch answered OK, ``not_pinned``, ``lease_expired`` and ``transfer_failed``:
    only the second and third keys are looked up and fetched again, never the one that
    loaded nor the one whose transfer failed; the retry's answer decides them (one loads,
    the other's ``not_pinned`` stands), and each key is reported once, with the bytes
    the producer wrote for it."""
    keys = [os.urandom(32) for _ in range(4)]

    async def answer(n: int, asked: list[bytes]) -> list[int]:
        await trio.lowlevel.checkpoint()
        if n == 0:
            return [OK, NP, LE, TF]
        return [OK if k == keys[1] else NP for k in asked]

    with trio.fail_after(BOUND):
        async with scripted(answer) as (dst, producer):
            peer = producer.raw.peer_id
            r = await dst.fetch(peer, keys)
            assert_partition(keys, r)
            assert sorted(r.loaded) == sorted(keys[:2])
            assert r.failed == {keys[2]: "not_pinned", keys[3]: "transfer_failed"}
            looked = producer.sent(LookupRequested)
            assert [ev.keys for ev in looked] == [keys, keys[1:3]]
            assert [ev.keys for ev in producer.sent(FetchRequested)] == [keys, keys[1:3]]
            for k in keys[:2]:
                assert bytes(dst.store.get(k) or b"") == producer.blocks[k]
            assert keys[2] not in dst.store and keys[3] not in dst.store
            assert_nothing_held(dst, peer)


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
async def test_a_retry_answered_with_one_outcome_too_many_loads_nothing(
    autojump_clock: trio.testing.MockClock, mode: str
) -> None:
    """The first fetch is answered ``not_pinned`` for every key; the retry's
    ``transfer_done`` carries an OK for each key and one more (a liar: as many OKs as
    keys would pass for "every key landed" were the count not checked). The session ends
    on the peer's protocol error and no key is reported loaded; the caller's slots come
    back after the quarantine."""
    with trio.fail_after(VIRTUAL_BOUND):
        async with scripted(answering([NP] * 3, [OK] * 4), quarantine=6.0) as (dst, producer):
            peer = producer.raw.peer_id
            keys = [os.urandom(32) for _ in range(3)]
            if mode == "fetch_into":
                r = await dst.fetch_into(peer, keys, [1, 2, 3])
            else:
                r = await dst.fetch(peer, keys)
            assert r.loaded == [] and set(r.failed) == set(keys), r
            assert all("outcome count" in why for why in r.failed.values()), r.failed
            assert len(dst.store) == 0 and dst.caller_slots == set()
            assert len(producer.sent(LookupRequested)) == 2


async def test_fetch_into_retries_in_the_named_slots_which_stay_in_use_until_it_ends() -> None:
    """``fetch_into`` answered ``not_pinned`` on the caller's own round: the retry writes
    into exactly the slots the caller named (every other slot keeps its bytes), and the
    named slots stay in use while the retry is out (a second ``fetch_into`` naming one
    is refused), free once it returned, and given back once only (a third call may take
    them at once)."""
    retry_asked, release = trio.Event(), trio.Event()

    async def answer(n: int, keys: list[bytes]) -> list[int]:
        if n == 1:
            retry_asked.set()
            await release.wait()
        else:
            await trio.lowlevel.checkpoint()
        return [NP if n == 0 else OK] * len(keys)

    with trio.fail_after(BOUND):
        async with scripted(answer) as (dst, producer):
            peer = producer.raw.peer_id
            dst.store.array[:] = np.frombuffer(os.urandom(dst.store.array.nbytes), np.uint8)
            before = bytes(dst.store.array)
            keys, slots = [os.urandom(32) for _ in range(3)], [40, 2, 33]
            got: list[FetchResult] = []

            async def first() -> None:
                got.append(await dst.fetch_into(peer, keys, slots))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await retry_asked.wait()
                assert dst.caller_slots == set(slots)
                with pytest.raises(LocalProtocolError, match="free"):
                    await dst.fetch_into(peer, [os.urandom(32)], [2])
                assert dst.caller_slots == set(slots)
                release.set()
            (r,) = got
            assert r.loaded == keys and not r.failed
            now = bytes(dst.store.array)
            for s in range(dst.config.num_blocks):
                piece = now[s * BLOCK : (s + 1) * BLOCK]
                if s in slots:
                    assert piece == producer.blocks[keys[slots.index(s)]], s
                else:
                    assert piece == before[s * BLOCK : (s + 1) * BLOCK], f"slot {s} written"
            retry = producer.sent(FetchRequested)[1]
            assert dict(zip(retry.keys, retry.slots, strict=True)) == dict(
                zip(keys, slots, strict=True)
            )
            assert_nothing_held(dst, peer)
            # Free once: another call takes them and they are free again after it.
            r = await dst.fetch_into(peer, keys[:1], slots[:1])
            assert r.loaded == keys[:1]
            assert dst.caller_slots == set()


@pytest.mark.parametrize("stuck", ["lookup", "fetch"])
async def test_fetch_into_within_bounds_the_retry_too(
    autojump_clock: trio.testing.MockClock, stuck: str
) -> None:
    """``within`` counts the retry: the first fetch is answered ``not_pinned`` after 2 s,
    and the retry's lookup is never answered (its keys fail "timed out" at ``within``,
    at once: nothing was posted) or its fetch never is (at ``within`` plus the
    quarantine of its slots). The retry's own deadlines (60 s) would come much later."""
    never = trio.Event()

    async def answer(n: int, keys: list[bytes]) -> list[int]:
        if n == 0:
            await trio.sleep(2.0)
        else:
            await never.wait()
        return [NP] * len(keys)

    with trio.fail_after(VIRTUAL_BOUND):
        async with scripted(answer, lookup_timeout=60.0, fetch_timeout=60.0, quarantine=6.0) as (
            dst,
            producer,
        ):
            peer = producer.raw.peer_id
            keys = [os.urandom(32) for _ in range(2)]
            mute = stuck == "lookup"
            if mute:  # the fetch's own lookup is answered, the retry's never
                producer.lookups_answered = 1
            start = trio.current_time()
            r = await dst.fetch_into(peer, keys, [7, 8], within=5.0)
            took = trio.current_time() - start
            assert took == pytest.approx(5.0 if mute else 5.0 + 6.0, abs=0.1)
            assert r.loaded == [] and r.failed == dict.fromkeys(keys, "timed out")
            assert len(producer.sent(LookupRequested)) == 2
            assert len(producer.sent(FetchRequested)) == (1 if mute else 2)
            assert dst.caller_slots == set()


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
@pytest.mark.parametrize("answer", ["not_pinned", "lease_expired"])
async def test_a_held_round_keeps_not_pinned_and_retries_lease_expired(
    mode: str, answer: str
) -> None:
    """A round a ``LookupRound`` handle holds (the vLLM tier's): a fetch naming it that is
    answered ``not_pinned`` reports ``not_pinned`` with no lookup again (its holder asked
    for the bytes that round pinned); ``lease_expired`` is still looked up once more."""
    code = NP if answer == "not_pinned" else LE
    with trio.fail_after(BOUND):
        async with scripted(answering([code] * 2, [OK] * 2)) as (dst, producer):
            peer = producer.raw.peer_id
            keys = [os.urandom(32) for _ in range(2)]
            rnd = await dst.lookup_round(peer, keys)
            if mode == "fetch_into":
                r = await dst.fetch_into(peer, keys, [4, 5], rounds=rnd)
            else:
                r = await dst.fetch(peer, keys, rounds=rnd)
            assert_partition(keys, r)
            if answer == "not_pinned":
                assert r.loaded == [] and r.failed == dict.fromkeys(keys, "not_pinned")
                assert len(producer.sent(LookupRequested)) == 1
                assert len(producer.sent(FetchRequested)) == 1
            else:
                assert sorted(r.loaded) == sorted(keys) and not r.failed
                assert len(producer.sent(LookupRequested)) == 2
                for i, k in enumerate(keys):
                    if mode == "fetch":
                        got = bytes(dst.store.get(k) or b"")
                    else:
                        got = bytes(dst.store.array[(4 + i) * BLOCK : (5 + i) * BLOCK])
                    assert got == producer.blocks[k]
            assert_nothing_held(dst, peer)


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
async def test_a_held_round_keeps_not_pinned_where_the_fetch_asks_for_more_than_it_holds(
    mode: str,
) -> None:
    """A fetch naming a held round and asking for a key that round lacks too takes the
    round's keys from it and looks the other up: the held round's ``not_pinned`` still
    stands (no lookup again for its keys) while the other key loads. Mutation pass on the
    session logic (2026-12-06): ``_claim_rounds`` dropping the held flag of a round it
    takes only some keys from, or the fetch of several rounds at once not passing it on,
    survived (every held-round test fetched exactly the round's keys, one round)."""
    held_keys = [os.urandom(32) for _ in range(2)]
    extra = os.urandom(32)

    async def answer(n: int, asked: list[bytes]) -> list[int]:
        await trio.lowlevel.checkpoint()
        return [NP if k in held_keys else OK for k in asked]

    with trio.fail_after(BOUND):
        async with scripted(answer) as (dst, producer):
            peer = producer.raw.peer_id
            rnd = await dst.lookup_round(peer, held_keys)
            keys = [*held_keys, extra]
            if mode == "fetch_into":
                r = await dst.fetch_into(peer, keys, [4, 5, 6], rounds=rnd)
                got = bytes(dst.store.array[6 * BLOCK : 7 * BLOCK])
            else:
                r = await dst.fetch(peer, keys, rounds=rnd)
                got = bytes(dst.store.get(extra) or b"")
            assert_partition(keys, r)
            assert r.loaded == [extra] and r.failed == dict.fromkeys(held_keys, "not_pinned")
            assert got == producer.blocks[extra]
            # The held round's lookup and the other key's: none again for the round's keys.
            assert len(producer.sent(LookupRequested)) == 2
            assert len(producer.sent(FetchRequested)) == 2
            assert_nothing_held(dst, peer)


@pytest.mark.parametrize("mode", ["fetch", "fetch_into"])
async def test_a_held_rounds_keys_answered_not_pinned_beside_lease_expired_ones_stay_failed(
    mode: str,
) -> None:
    """A fetch on a held round answered ``not_pinned`` for one key and ``lease_expired``
    for the other looks up and fetches only the second again; the first keeps
    ``not_pinned``. Mutation pass on the session logic (2026-12-06): the retry taking a
    held round's ``not_pinned`` keys along with its ``lease_expired`` ones survived
    (every held-round test answered all its keys alike)."""

    async def answer(n: int, asked: list[bytes]) -> list[int]:
        await trio.lowlevel.checkpoint()
        return [NP, LE] if n == 0 else [OK] * len(asked)

    with trio.fail_after(BOUND):
        async with scripted(answer) as (dst, producer):
            peer = producer.raw.peer_id
            keys = [os.urandom(32) for _ in range(2)]
            rnd = await dst.lookup_round(peer, keys)
            if mode == "fetch_into":
                r = await dst.fetch_into(peer, keys, [4, 5], rounds=rnd)
                got = bytes(dst.store.array[5 * BLOCK : 6 * BLOCK])
            else:
                r = await dst.fetch(peer, keys, rounds=rnd)
                got = bytes(dst.store.get(keys[1]) or b"")
            assert_partition(keys, r)
            assert r.loaded == [keys[1]] and r.failed == {keys[0]: "not_pinned"}
            assert got == producer.blocks[keys[1]]
            assert [ev.keys for ev in producer.sent(LookupRequested)] == [keys, keys[1:]]
            assert len(producer.sent(FetchRequested)) == 2
            assert_nothing_held(dst, peer)


def test_a_blocking_fetch_by_default_outlasts_a_late_answer_and_its_one_more_try(
    nodes: Callable[..., BlockingNode],
) -> None:
    """The facade's default ``timeout`` counts the one more try: a fetch whose first
    answer comes late (within ``fetch_timeout``) and says ``not_pinned``, then looked up
    and fetched again, answered as late, returns its per-key result. The default used to
    be one lookup and one fetch plus a second (5.5 s here), so this call (about 6.4 s,
    each fetch answered 3.2 s after it was sent) ended in ``P2PKVTimeout``, the fetch cut
    and its slots quarantined, where the engine kept every deadline of its own (reading
    review, 2026-12-06). The producer runs on a Trio loop of its own in a thread; its
    waits are real seconds (the facade's waits are), the scenario itself, not a
    synchronisation."""
    late = 3.2  # below fetch_timeout by 0.8 s; twice it exceeds the old default by 0.9 s
    dst = nodes("dst", lookup_timeout=0.5, fetch_timeout=4.0)
    keys = [os.urandom(32) for _ in range(2)]
    peer: list[str] = []
    producers: list[HandProducer] = []
    connected = threading.Event()

    async def answer(n: int, asked: list[bytes]) -> list[int]:
        await trio.sleep(late)
        return [NP] * len(asked) if n == 0 else [OK] * len(asked)

    async def produce() -> None:
        raw = RawPeer()
        try:
            with trio.fail_after(BOUND):
                await raw.connect(dst.address)
                await raw.handshake()
                producer = HandProducer(raw, dst, answer=answer, ack_aborts=True)
                producers.append(producer)
                peer.append(raw.peer_id)
                connected.set()
                await producer.run()  # until the consumer hangs up
        finally:
            await raw.aclose()

    # dst.close() is idempotent; it ends the producer's session whatever happened.
    with trio_in_a_thread(produce, "scripted-producer", stop=dst.close):
        assert connected.wait(BOUND)
        r = dst.fetch(peer[0], keys)  # the default timeout
        assert sorted(r.loaded) == sorted(keys) and not r.failed, r
        for k in keys:
            got = dst.store.get(k)
            assert got is not None and bytes(got) == producers[0].blocks[k]
        dst.disconnect(peer[0], timeout=BOUND)
