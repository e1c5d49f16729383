"""The store's LRU log (``p2pkv.store._Lru``) on its own, against an ordered dict: every
push, drop and take in random order, with pushes larger than its compaction step, so that
it compacts in steps, grows, and widens its positions from 32 to 64 bits."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from p2pkv import store as store_mod
from p2pkv.store import _Lru


def run(lru: _Lru, n: int, seed: int, ops: int = 1500) -> None:
    rng = random.Random(seed)
    ref: OrderedDict[int, None] = OrderedDict()  # evictable slots, least recently used first
    for _ in range(ops):
        op = rng.random()
        outside = [s for s in range(n) if s not in ref]
        if op < 0.45 and outside:
            picked = rng.sample(outside, rng.randint(1, len(outside)))
            how = rng.random()
            if how < 0.4:
                lru.push(np.array(picked, dtype=np.int64))
            elif how < 0.8:
                lru.push_few(picked)
            else:
                for slot in picked:
                    lru.push_one(slot)
            ref.update(dict.fromkeys(picked))
        elif op < 0.7 and ref:
            picked = rng.sample(list(ref), rng.randint(1, len(ref)))
            if rng.random() < 0.5:
                lru.drop_many(np.array(picked, dtype=np.int64))
            else:
                for slot in picked:
                    lru.drop(slot)
            for slot in picked:
                del ref[slot]
        elif ref:
            k = rng.randint(1, len(ref))
            want = list(ref)[:k]
            if rng.random() < 0.5:
                got = lru.take(k).tolist()
            else:
                few = lru.take_few(k)
                got = lru.take(k).tolist() if few is None else few
            assert got == want
            for slot in want:
                del ref[slot]
        assert lru.live().tolist() == list(ref)
        assert lru.count == len(ref)
        assert ((lru.pos_of >= 0) == np.isin(np.arange(n), list(ref))).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_log_keeps_lru_order_through_compactions_and_growth(seed: int) -> None:
    lru = _Lru(24, 2)
    size = len(lru.slots)
    run(lru, 24, seed)
    assert len(lru.slots) > size, "the test never made the log grow"
    assert lru.pos_of.dtype == np.int32


@pytest.mark.parametrize("seed", range(2))
def test_positions_widen_to_64_bits_when_the_log_outgrows_32(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "_POS32_ENTRIES", 100)  # a stand-in for 2**29
    lru = _Lru(24, 2)  # 78 entries: 32-bit
    assert lru.pos_of.dtype == lru.slots.dtype == np.int32
    run(lru, 24, seed)
    assert lru.pos_of.dtype == lru.slots.dtype == np.int64


@pytest.mark.parametrize(("n", "room"), [(200, 4), (64, 16), (1000, 1)])
def test_the_log_never_grows_while_pushes_are_at_most_room(n: int, room: int) -> None:
    # The bound in the class docstring, at its worst: every slot evictable (the live
    # count at num_blocks, so each compaction leaves the most behind), and pushes of
    # room slots at a time (blocks touched: dropped, pushed again), with a take now and
    # then.
    lru = _Lru(n, room)
    size, compactions = len(lru.slots), 0
    rng = random.Random(n)
    live: set[int] = set()
    for _ in range(10_000):
        was = lru.compacting
        if rng.random() < 0.02 and live:
            live.difference_update(lru.take(rng.randint(1, room)).tolist())
            continue
        k = rng.randint(1, room)
        outside = [s for s in range(n) if s not in live][:k]
        picked = outside or rng.sample(sorted(live), k)
        for slot in picked:
            if slot in live:
                lru.drop(slot)
        if rng.random() < 0.5:
            lru.push(np.array(picked, dtype=np.int64))
        else:
            lru.push_few(picked)
        live.update(picked)
        compactions += lru.compacting and not was
        assert len(lru.slots) == size
    assert sorted(lru.live().tolist()) == sorted(live)
    assert compactions >= 10, "the test did not make the log compact often enough"


@pytest.mark.parametrize(("n", "room"), [(1000, 1), (200, 4), (4096, 16)])
def test_the_log_never_grows_when_takes_empty_the_front_during_a_compaction(
    n: int, room: int
) -> None:
    # An eviction while a compaction runs and its copied front is empty: the compaction
    # must go on copying to the front (it once went on in place and ended with the tail
    # past where the next one starts, so the log filled and doubled, again and again).
    lru = _Lru(n, room)
    size = len(lru.slots)
    for start in range(0, n, room):
        lru.push(np.arange(start, min(n, start + room)))
    takes = 0
    for _ in range(20_000):
        if lru.compacting and lru.head == lru.w:
            lru.push(lru.take(1))  # evicted, then committed again
            takes += 1
            continue
        if lru.compacting and lru.w > lru.head:  # touch entries the compaction copied
            cand = lru.slots[max(lru.head, lru.w - 4 * room) : lru.w]
            cand = cand[lru.pos_of[cand] == np.arange(lru.w - len(cand), lru.w)][-room:]
        else:
            cand = lru.live()[:room]
        pick = np.unique(cand)[:room]
        lru.drop_many(pick)
        lru.push(pick)
        assert len(lru.slots) == size
    assert takes >= 10, "the test never took from an empty front during a compaction"
    assert sorted(lru.live().tolist()) == list(range(n))


@pytest.mark.parametrize("push", ["push", "push_few", "push_one"])
def test_each_kind_of_push_starts_the_compactions_on_its_own(push: str) -> None:
    """A store whose calls are all small pushes only through ``push_few`` (scalar-path
    unpins and commits) or ``push_one`` (host puts): each push must start a compaction
    once the tail passes three quarters of the log, or the log grows without bound."""
    n, room = 64, 4
    lru = _Lru(n, room)
    size = len(lru.slots)
    for i in range(20 * size):
        slot = i % n
        if lru.pos_of[slot] >= 0:
            lru.drop(slot)
        if push == "push":
            lru.push(np.array([slot], dtype=np.int64))
        elif push == "push_few":
            lru.push_few([slot])
        else:
            lru.push_one(slot)
        assert len(lru.slots) == size, f"the log grew after {i + 1} pushes"
    assert lru.live().tolist() == [(20 * size - n + j) % n for j in range(n)]
