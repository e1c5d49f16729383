"""The fetch path's fast paths (issue 9): each gives exactly what the general path gives,
the producer's reply goes out before its unpin, and the GC leaves start-up state alone
while a node is up. (What they cost is measured by ``bench/python_cost.py``, never here.)
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2pkv.errors import StoreFull
from p2pkv.store import BlockStore

from .helpers import fill, pair

BLOCK = 4096
BOUND = 20.0  # seconds: "this did not hang", never an expected duration


@given(
    n=st.integers(0, 40),
    picks=st.sets(st.integers(0, 39)),
    value=st.integers(0, 9),
)
def test_set_all_sets_exactly_the_listed_outcomes(n: int, picks: set[int], value: int) -> None:
    from p2pkv.session.producer import _set_all

    indices = sorted(i for i in picks if i < n)
    got = list(range(100, 100 + n))
    want = list(got)
    for i in indices:
        want[i] = value
    _set_all(got, indices, value)
    assert got == want


_HOW = ["loaded", "landed", "miss", "timeout", "undecided"]


@given(
    st.lists(st.binary(min_size=1, max_size=4), unique=True, max_size=12).flatmap(
        lambda keys: st.tuples(
            st.just(keys),
            st.lists(st.sampled_from(_HOW), min_size=len(keys), max_size=len(keys)),
            st.integers(1, 4),  # landed keys come in lists of up to this many
            st.booleans(),  # decided in a claim's outcome first, then absorbed
        )
    )
)
def test_fetch_result_keeps_the_order_of_the_keys(
    case: tuple[list[bytes], list[str], int, bool],
) -> None:
    """Keys decided in the map (None or why not), keys landed as lists (no per-key
    entry) and keys never decided ("cancelled") come out in the keys' order, each
    loaded or failed as decided; settling the rest fails only the undecided ones."""
    from p2pkv.session.consumer import _Outcome, _result

    keys, hows, per_list, via_claim = case
    outcome = _Outcome()
    target = _Outcome() if via_claim else outcome
    landed = [k for k, how in zip(keys, hows, strict=True) if how == "landed"]
    for i in range(0, len(landed), per_list):
        target.land(landed[i : i + per_list])
    for k, how in zip(keys, hows, strict=True):
        if how == "loaded":
            target[k] = None
        elif how in ("miss", "timeout"):
            target[k] = how
    if via_claim:
        outcome.absorb(target)
    want_loaded = [k for k, how in zip(keys, hows, strict=True) if how in ("loaded", "landed")]
    want_failed = {
        k: ("cancelled" if how == "undecided" else how)
        for k, how in zip(keys, hows, strict=True)
        if how not in ("loaded", "landed")
    }
    assert outcome.decided() == len(keys) - hows.count("undecided")
    result = _result(list(keys), outcome)
    assert result.loaded == want_loaded
    assert result.failed == want_failed
    assert list(result.failed) == [k for k in keys if k in want_failed]
    outcome.settle_rest(list(keys), "gone")
    assert outcome.decided() == len(keys)
    settled = _result(list(keys), outcome)
    assert settled.loaded == want_loaded
    assert settled.failed == {
        k: ("gone" if w == "cancelled" else w) for k, w in want_failed.items()
    }


def _store_with_history(ops: list[tuple[str, int]]) -> BlockStore:
    """A small store (3 keys per batch) after a scripted history of puts, pins and evicts."""
    store = BlockStore(12, 8, batch_keys=3)
    keys = [bytes([i + 1]) * 4 for i in range(16)]
    for op, i in ops:
        key = keys[i % len(keys)]
        if op == "put":
            with contextlib.suppress(StoreFull):
                store.put(key, bytes(8))
        elif op == "pin":
            store.pin(("round", i % 3), [key])
        else:
            store.evict(key)
    return store


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "pin", "evict"]), st.integers(0, 40)), max_size=30
    ),
    n=st.integers(0, 13),
)
@example(ops=[], n=12)  # exactly the room there is (the batch path: more than 3 keys)
@example(ops=[], n=13)  # one slot more
def test_reserve_of_n_is_n_reserves_of_one(ops: list[tuple[str, int]], n: int) -> None:
    """The batch reserve takes the slots one-at-a-time reserves would, in their order
    (free ones first, then least recently used), or changes nothing when they are not there."""
    batch, single = _store_with_history(ops), _store_with_history(ops)
    before = batch.statistics()
    try:
        got = batch.reserve("me", n)
    except StoreFull:
        assert batch.statistics() == before
        batch._check_invariants()
        # ... and only when they are not there. Counted from the statistics, not by the
        # store's own room check (a check refusing one slot too soon passed this test,
        # and one-at-a-time reserves go through that check too).
        assert n > before.free + before.used - before.pinned, (n, before)
        return
    want = [s for _ in range(n) for s in single.reserve("me", 1)]
    assert got == want
    assert batch.statistics() == single.statistics()
    assert batch.keys() == single.keys()
    batch._check_invariants()
    batch.commit_many("me", got, [os.urandom(6) for _ in got])
    batch._check_invariants()


async def test_the_producer_replies_before_it_unpins() -> None:
    """``transfer_done`` is on the wire before the source pins are released (the consumer
    lands while the producer unpins); the pins are released all the same."""
    with trio.fail_after(BOUND):
        async with pair() as (src, dst):
            keys = fill(src.store, 16, BLOCK)
            peer = await dst.connect(src.address)
            session: Any = src._by_peer["dst"]
            events: list[str] = []
            reply, flush, unpin = session.proto.send_transfer_done, session._flush, src.unpin

            def send_transfer_done(*args: Any, **kw: Any) -> None:
                events.append("reply")
                reply(*args, **kw)

            async def flushing(**kw: Any) -> None:
                await flush(**kw)
                if events[-1:] == ["reply"]:
                    events.append("sent")

            def unpinning(owner: object) -> None:
                events.append("unpin")
                unpin(owner)

            session.proto.send_transfer_done = send_transfer_done
            session._flush = flushing
            src.unpin = unpinning  # type: ignore[method-assign]
            assert await dst.lookup(peer, keys) == [True] * 16
            result = await dst.fetch(peer, keys)
            assert result.loaded == keys and not result.failed
            while "unpin" not in events:
                await trio.sleep(0.01)
            assert events == ["reply", "sent", "unpin"]
            assert src.statistics().pinned_slots == 0


@given(
    st.lists(
        st.tuples(st.booleans(), st.sets(st.integers(0, 30), max_size=6), st.integers(0, 5)),
        max_size=30,
    )
)
def test_the_claim_index_always_names_the_claim_of_every_key_in_flight(
    ops: list[tuple[bool, set[int], int]],
) -> None:
    """Fetches start (claiming keys no running fetch claims) and end in any order; the
    index of claimed keys, built only once two run at once, always says exactly which
    running fetch brings each key in, and is gone once none runs."""
    import types

    from p2pkv.session.consumer import ConsumerSide, _Claim

    side: Any = types.SimpleNamespace(_claims=[], _claim_index=None)
    running: list[_Claim] = []
    for start, wanted, pick in ops:
        claimed = ConsumerSide._claimed(side)
        want = {k: c for c in running for k in c.keys}
        assert (claimed is None) == (not running)
        assert (claimed or {}) == want
        if start:
            claim = _Claim([bytes([k + 1]) for k in sorted(wanted) if bytes([k + 1]) not in want])
            ConsumerSide._add_claim(side, claim)
            running.append(claim)
        elif running:
            claim = running.pop(pick % len(running))
            ConsumerSide._drop_claim(side, claim)
        if not running:  # the last one ended: the index goes with it
            assert side._claim_index is None
