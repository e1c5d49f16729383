"""The fetch path's fast paths (issue 9): each gives exactly what the general path gives,
the producer's reply goes out before its unpin, and the GC leaves start-up state alone
while a node is up. (What they cost is measured by ``bench/python_cost.py``, never here.)
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import trio
from hypothesis import given, settings
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


@given(
    st.lists(st.binary(min_size=1, max_size=4), unique=True, max_size=12).flatmap(
        lambda keys: st.tuples(
            st.just(keys),
            st.lists(
                st.sampled_from([None, "miss", "timeout"]), min_size=len(keys), max_size=len(keys)
            ),
        )
    )
)
def test_fetch_result_keeps_the_order_of_the_keys(
    case: tuple[list[bytes], list[str | None]],
) -> None:
    from p2pkv.session.consumer import _result

    keys, whys = case
    outcome = dict(zip(keys, whys, strict=True))
    result = _result(list(keys), outcome)
    assert result.loaded == [k for k, why in zip(keys, whys, strict=True) if why is None]
    assert result.failed == {k: why for k, why in outcome.items() if why is not None}
    assert list(result.failed) == [k for k in keys if outcome[k] is not None]


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
