"""BlockStore: slots, LRU, pins, reservations, quarantine, adopted regions, threads."""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pkv.errors import P2PKVError, StoreFull
from p2pkv.store import SMALL_KEYS, BlockStore, StoreStatistics
from p2pkv.transport.base import RegionLayout

from .helpers import run_interleaved

L = 16  # block_len of the small stores


def blk(tag: int, length: int = L) -> bytes:
    return bytes([tag % 256]) * length


def snapshot(store: BlockStore) -> tuple[StoreStatistics, dict[bytes, int | None], bytes]:
    """Everything a caller can observe; equal snapshots mean nothing changed."""
    return (
        store.statistics(),
        {k: store.slot_of(k) for k in list(store.keys())},
        store.array.tobytes(),
    )


def filled(n: int, keys: int | None = None) -> BlockStore:
    """A store of n blocks holding keys b"k0".. b"k{keys-1}" (put in that order)."""
    store = BlockStore(n, L)
    for i in range(n if keys is None else keys):
        store.put(b"k%d" % i, blk(i))
    return store


# ------------------------------------------------------------------ put / get


def test_put_then_get_returns_the_bytes_put() -> None:
    store = BlockStore(4, L)
    slot = store.put(b"key", b"0123456789abcdef")
    view = store.get(b"key")
    assert view is not None and bytes(view) == b"0123456789abcdef"
    assert store.slot_of(b"key") == slot
    assert b"key" in store and b"other" not in store and "key" not in store
    assert len(store) == 1 and store.keys() == [b"key"]
    assert store.get(b"other") is None and store.slot_of(b"other") is None


@pytest.mark.parametrize(
    "data",
    [
        bytearray(blk(7)),
        memoryview(blk(7)),
        np.full(L, 7, dtype=np.uint8),
        np.full(L // 4, 0x07070707, dtype=np.uint32),  # multi-byte items, same bytes
        np.full(2 * L, 7, dtype=np.uint8)[::2],  # non-contiguous
    ],
    ids=["bytearray", "memoryview", "uint8", "uint32", "strided"],
)
def test_put_accepts_any_buffer_of_block_len_bytes(data: object) -> None:
    store = BlockStore(2, L)
    store.put(b"k", data)
    assert bytes(store.get(b"k") or b"") == blk(7)


def test_get_is_a_read_only_view_into_the_region() -> None:
    store = BlockStore(2, L)
    slot = store.put(b"k", blk(1))
    view = store.get(b"k")
    assert view is not None and view.readonly
    with pytest.raises(TypeError):
        view[0] = 9
    store.array[slot * L] = 42  # no copy: a write to the region shows through the view
    assert view[0] == 42
    assert bytes(store.view(slot)) == bytes(view)


@pytest.mark.parametrize("length", [0, L - 1, L + 1])
def test_put_of_the_wrong_length_raises_and_stores_nothing(length: int) -> None:
    store = BlockStore(2, L)
    with pytest.raises(ValueError, match="block_len"):
        store.put(b"k", bytes(length))
    assert b"k" not in store and store.statistics().free == 2


_PTR = ctypes.sizeof(ctypes.py_object)


@pytest.mark.parametrize(
    "data",
    [
        np.array([object()] * (L // _PTR), dtype=object),
        np.zeros(L // (_PTR + 8), dtype=[("a", "O"), ("b", "<i8")]),
        (ctypes.py_object * (L // _PTR))(),
        np.array([b"x"] * (L // _PTR), dtype=object).data,
    ],
    ids=["object-numpy", "object-field", "ctypes-objects", "object-memoryview"],
)
def test_put_of_python_objects_raises_and_stores_nothing(data: Any) -> None:
    """A buffer of object pointers has block_len bytes, but they are addresses in this
    process: stored, they were served to any peer that fetched the key."""
    assert memoryview(data).nbytes == L
    store = BlockStore(2, L)
    with pytest.raises(ValueError, match="must not hold Python objects"):
        store.put(b"k", data)
    assert b"k" not in store and store.statistics().free == 2


@pytest.mark.parametrize("pinned", [False, True])
def test_a_key_committed_while_a_host_put_copies_it_ends_as_the_puts_block(
    monkeypatch: pytest.MonkeyPatch, pinned: bool
) -> None:
    """The engine commits (and maybe pins) a key while a host ``put`` of the same key copies
    its bytes, outside the lock: the put publishes last, so the key is the put's block;
    the committed block's slot is freed at once, or, pinned, lives on unchanged as an
    orphan until its pin drops. Either way no slot is lost or handed out twice."""
    import p2pkv.store as store_module

    store = BlockStore(4, L)
    engine: list[int] = []

    class CommitsFirst:
        """FAKE block source: an engine commits the key while the put copies from it."""

        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            (slot,) = store.reserve("f", 1)
            store.array[slot * L : (slot + 1) * L] = np.frombuffer(blk(1), np.uint8)
            assert store.commit("f", slot, b"k")
            if pinned:
                assert store.pin("o", [b"k"]) == [slot]
            engine.append(slot)
            return np.frombuffer(blk(2), np.uint8)

    monkeypatch.setattr(store_module, "block_source", lambda data, n: CommitsFirst())
    slot = store.put(b"k", blk(2))
    monkeypatch.undo()
    (committed,) = engine
    assert slot != committed and store.slot_of(b"k") == slot
    assert bytes(store.get(b"k") or b"") == blk(2)
    stats = store.statistics()
    assert (stats.used, stats.free, stats.pinned) == ((2, 2, 1) if pinned else (1, 3, 0))
    store._check_invariants()
    if pinned:
        assert bytes(store.view(committed)) == blk(1)
        assert store.unpin("o") == 1
        stats = store.statistics()
        assert (stats.used, stats.free, stats.pinned) == (1, 3, 0)
        store._check_invariants()
    assert sorted(store.reserve("r", 3)) == sorted({0, 1, 2, 3} - {slot})


def test_a_put_whose_copy_raises_frees_its_slot_and_drops_the_half_written_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy raises midway (a CUDA error, an interrupt) over a block stored before: the
    key goes (its bytes are half overwritten), the slot is free again, and no reservation
    of the put is left behind."""
    import p2pkv.store as store_module

    class Interrupted(Exception):
        pass

    class FailingCopy:
        """FAKE block source whose copy raises midway."""

        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            raise Interrupted

    store = BlockStore(2, L)
    store.put(b"k", blk(1))
    monkeypatch.setattr(store_module, "block_source", lambda data, n: FailingCopy())
    with pytest.raises(Interrupted):
        store.put(b"k", blk(2))
    assert b"k" not in store
    stats = store.statistics()
    assert (stats.free, stats.used, stats.reserved) == (2, 0, 0)
    monkeypatch.undo()
    store.put(b"k", blk(3))
    assert bytes(store.get(b"k") or b"") == blk(3)


def test_put_rejects_keys_that_are_not_non_empty_bytes() -> None:
    store = BlockStore(2, L)
    with pytest.raises(TypeError):
        store.put("k", blk(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put(bytearray(b"k"), blk(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.put(b"", blk(1))
    with pytest.raises(TypeError):
        store.put(b"k", 12345)
    assert len(store) == 0 and store.statistics().free == 2


def test_put_over_an_unpinned_key_overwrites_its_slot_in_place() -> None:
    store = filled(3)
    slot = store.slot_of(b"k1")
    assert store.put(b"k1", blk(99)) == slot
    assert bytes(store.get(b"k1") or b"") == blk(99)
    assert store.statistics().used == 3 and store.statistics().evictions == 0


def test_view_rejects_slots_outside_the_region() -> None:
    store = BlockStore(2, L)
    for bad in (-1, 2):
        with pytest.raises(ValueError):
            store.view(bad)


def test_evict_drops_unpinned_keys_only() -> None:
    store = filled(3)
    store.pin("o", [b"k0"])
    assert store.evict(b"k0") is False and b"k0" in store
    assert store.evict(b"k1") is True and b"k1" not in store
    assert store.evict(b"k1") is False
    assert store.statistics().free == 1


# ------------------------------------------------------------------ LRU eviction


def test_eviction_takes_the_least_recently_used_block() -> None:
    store = filled(3)  # LRU order: k0, k1, k2
    store.get(b"k0")  # now k1, k2, k0
    store.put(b"new1", blk(10))
    assert b"k1" not in store and {b"k0", b"k2", b"new1"} == set(store.keys())
    store.put(b"k2", blk(11))  # a re-put touches too: k0, new1, k2
    store.put(b"new2", blk(12))
    assert b"k0" not in store
    assert store.statistics().evictions == 2


def test_eviction_skips_pinned_blocks() -> None:
    store = filled(3)
    assert store.pin("o", [b"k0", b"k1"]) == [0, 1]
    slot = store.put(b"new", blk(9))
    assert slot == 2 and b"k2" not in store
    assert bytes(store.get(b"k0") or b"") == blk(0)
    assert bytes(store.get(b"k1") or b"") == blk(1)


def test_an_unpinned_block_becomes_most_recently_used() -> None:
    store = filled(3)
    store.pin("o", [b"k0"])
    store.unpin("o")  # k0 is evictable again, behind k1 and k2
    store.put(b"a", blk(10))
    store.put(b"b", blk(11))
    assert set(store.keys()) == {b"k0", b"a", b"b"}


def test_store_full_when_every_slot_is_pinned_reserved_or_quarantined() -> None:
    store = filled(4, keys=2)
    store.pin("p", [b"k0", b"k1"])
    reserved = store.reserve("r", 2)
    store.quarantine("r", reserved[:1], until=5.0)
    before = snapshot(store)
    with pytest.raises(StoreFull) as info:
        store.put(b"new", blk(9))
    assert isinstance(info.value, P2PKVError)
    with pytest.raises(StoreFull):
        store.put(b"k0", blk(9))  # pinned: needs a new slot too
    with pytest.raises(StoreFull):
        store.reserve("r2", 1)
    assert snapshot(store) == before
    assert store.release_quarantined(5.0) == 1
    assert store.put(b"new", blk(9)) == reserved[0]


# ------------------------------------------------------------------ pins


def test_put_over_a_pinned_key_moves_it_and_the_old_slot_waits_for_unpin() -> None:
    store = filled(4, keys=2)
    (old,) = store.pin("o", [b"k0"])
    assert old is not None
    new = store.put(b"k0", blk(50))
    assert new != old and store.slot_of(b"k0") == new
    assert bytes(store.get(b"k0") or b"") == blk(50)
    assert bytes(store.view(old)) == blk(0)  # the pinned reader's bytes are untouched
    stats = store.statistics()
    assert (stats.used, stats.free, stats.pinned, len(store)) == (3, 1, 1, 2)
    assert store.reserve("r", 1) != [old]  # the orphan is not handed out either
    store.pin("o2", [b"k0", b"k1"])
    with pytest.raises(StoreFull):
        store.reserve("r", 1)
    assert store.unpin("o") == 1
    stats = store.statistics()
    assert (stats.used, stats.free, stats.pinned) == (2, 1, 2)
    assert store.reserve("r", 1) == [old]


def test_put_over_a_pinned_key_with_no_room_raises_and_changes_nothing() -> None:
    store = filled(2)
    store.pin("o", [b"k0", b"k1"])
    before = snapshot(store)
    with pytest.raises(StoreFull):
        store.put(b"k0", blk(9))
    assert snapshot(store) == before


def test_pin_returns_slots_or_none_and_counts_duplicates() -> None:
    store = filled(3)
    assert store.pin("o", [b"k1", b"missing", b"k1", b"k2"]) == [1, None, 1, 2]
    assert store.pins_of("o") == 3 and store.statistics().pinned == 2
    assert store.pin("o", [b"missing"]) == [None] and store.pins_of("o") == 3
    assert store.unpin("o") == 3
    assert store.pins_of("o") == 0 and store.statistics().pinned == 0
    assert store.unpin("o") == 0


def test_unpin_keys_releases_one_pin_per_listed_slot() -> None:
    store = filled(3)
    store.pin("o", [b"k0", b"k0", b"k1"])
    assert store.unpin_keys("o", [0, 2, 7]) == 1  # slot 2 and 7: not pinned by "o"
    assert store.pins_of("o") == 2 and store.evict(b"k0") is False
    assert store.unpin_keys("o", [0, 0, 1]) == 2
    assert store.pins_of("o") == 0 and store.evict(b"k0") is True
    assert store.unpin_keys("nobody", [1]) == 0


@pytest.mark.parametrize("small", [SMALL_KEYS, 0])  # scalar path; array path
def test_unpin_keys_returns_slots_to_the_lru_at_their_last_listed_drop(small: int) -> None:
    """k0 pinned twice, k1 once; ``unpin_keys`` lists k0, k1, k0: k1's count reaches 0
    first, so k1 is less recently used than k0, and the next eviction takes k1. Ordered
    by each slot's first listing instead, k0 (still pinned at its first drop) went first."""
    store = filled(4, keys=3)
    store._small_keys = small
    store.pin("o", [b"k0", b"k0", b"k1"])
    assert store.unpin_keys("o", [0, 1, 0]) == 3
    assert store._lru_keys() == [b"k2", b"k1", b"k0"]
    store.put(b"new", blk(9))  # the one free slot
    store.put(b"new2", blk(9))  # evicts k2
    store.put(b"new3", blk(9))  # evicts k1
    assert b"k1" not in store and b"k0" in store


def test_pins_are_counted_per_owner() -> None:
    store = filled(2)
    store.pin(("session", 1), [b"k0"])
    store.pin(("session", 2), [b"k0"])
    assert store.unpin(("session", 1)) == 1
    assert store.evict(b"k0") is False  # still pinned by the other owner
    assert store.pins_of(("session", 2)) == 1
    store.unpin(("session", 2))
    assert store.evict(b"k0") is True


def test_pin_of_1024_keys_pins_each_and_unpin_gives_every_one_back() -> None:
    # How long this takes: bench/host_costs.py ("store.pin").
    store = BlockStore(2048, 64)
    keys = [i.to_bytes(32, "big") for i in range(1024)]
    for key in keys:
        store.put(key, bytes(64))
    slots = store.pin("o", keys)
    assert slots == [store.slot_of(k) for k in keys] and len(set(slots)) == 1024
    assert store.statistics().pinned == 1024 and store.pins_of("o") == 1024
    assert not any(store.evict(k) for k in keys[::97])
    assert store.unpin("o") == 1024
    assert store.statistics().pinned == 0


# ------------------------------------------------------------------ reserve / commit


def test_reserve_is_all_or_nothing() -> None:
    store = filled(4, keys=3)  # 1 free, 3 evictable
    store.pin("p", [b"k0"])  # 1 free + 2 evictable = 3 available
    before = snapshot(store)
    with pytest.raises(StoreFull):
        store.reserve("r", 4)
    assert snapshot(store) == before  # in particular: nothing was evicted
    slots = store.reserve("r", 3)
    assert sorted(slots) == [1, 2, 3] and set(store.keys()) == {b"k0"}
    assert store.statistics().evictions == 2 and store.statistics().reserved == 3
    assert store.reserve("r", 0) == []
    with pytest.raises(ValueError):
        store.reserve("r", -1)


def test_reserve_takes_free_slots_before_evicting() -> None:
    store = filled(4, keys=2)
    assert sorted(store.reserve("r", 2)) == [2, 3]
    assert len(store) == 2 and store.statistics().evictions == 0


def test_the_free_list_keeps_only_slots_freed_after_use_and_pops_them_first() -> None:
    # Slots never handed out have no entry (a full store pays nothing for its free
    # list); those freed after use are popped first, last freed first, then the slots
    # never handed out, in slot order: the same order as one stack of all the slots.
    n = 4096
    store = BlockStore(n, L)
    first = store.reserve("a", 3000)
    assert first == list(range(3000)) and len(store._free) == 0
    store.release_reserved("a", first[:2000])  # freed in this order: 1999 pops first
    assert len(store._free) >= 2000
    assert store.reserve("b", 2010) == [*range(1999, -1, -1), *range(3000, 3010)]
    assert len(store._free) < 2000 / 2, "the emptied free array did not shrink"
    for slot in range(3010, 3020):  # the scalar path, one slot at a time
        assert store.reserve("c", 1) == [slot]
    store.release_reserved("b", list(range(1999, -1, -1)))
    assert store.reserve("c", 1) == [0]
    assert store.reserve("c", 3) == [1, 2, 3]
    assert len(store._free) >= 2000
    store._check_invariants()
    assert store.statistics().free == n - 3020 + 1996


@pytest.mark.parametrize("how", ["put", "small reserves"])
def test_the_free_array_shrinks_on_the_scalar_path_too(how: str) -> None:
    n = 4096
    store = BlockStore(n, L)
    store.release_reserved("a", store.reserve("a", n))  # every slot freed after use
    assert len(store._free) >= n
    if how == "put":
        for i in range(n):
            store.put(b"k%d" % i, blk(i))
    else:
        for _ in range(n // 32):
            store.reserve("b", 32)
    assert store.statistics().free == 0
    assert len(store._free) <= 64, "a full store kept its free array"
    store._check_invariants()


def test_owner_ids_widen_past_16_bits() -> None:
    owners = 2**15 + 3  # ids 2.. : the last ones do not fit in 16 bits
    store = BlockStore(owners + 1, 1)
    slots = [store.reserve(("o", i), 1)[0] for i in range(owners)]
    assert store._owner.dtype == np.int32
    assert store._reserved_by(("o", owners - 1)) == [slots[-1]]
    assert store._reserved_by(("o", 0)) == [slots[0]]
    store._check_invariants()
    for i in (0, owners - 1):
        assert store.commit(("o", i), slots[i], b"k%d" % i) is True
        with pytest.raises(ValueError):  # another owner's slot
            store.commit(("o", i), slots[i - 1], b"x")
    store._check_invariants()


def test_a_reserved_slot_is_invisible_until_committed() -> None:
    store = BlockStore(2, L)
    (slot,) = store.reserve("r", 1)
    store.array[slot * L : (slot + 1) * L] = 5  # the data plane writes the block
    assert b"k" not in store and store.pin("x", [b"k"]) == [None]
    assert store.commit("r", slot, b"k") is True
    assert store.slot_of(b"k") == slot and bytes(store.get(b"k") or b"") == blk(5)
    assert store.statistics().reserved == 0 and store.statistics().used == 1


def test_commit_of_a_present_key_keeps_the_existing_block_and_frees_the_slot() -> None:
    store = filled(3, keys=1)
    (slot,) = store.reserve("r", 1)
    store.array[slot * L : (slot + 1) * L] = 77
    assert store.commit("r", slot, b"k0") is False
    assert store.slot_of(b"k0") == 0 and bytes(store.get(b"k0") or b"") == blk(0)
    stats = store.statistics()
    assert (stats.free, stats.reserved, stats.used) == (2, 0, 1)


def test_commit_requires_a_slot_reserved_by_that_owner() -> None:
    store = filled(3, keys=1)
    (slot,) = store.reserve(("s", 1), 1)
    before = snapshot(store)
    for owner, bad_slot in [(("s", 2), slot), (("s", 1), 0), (("s", 1), 2)]:
        with pytest.raises(ValueError):
            store.commit(owner, bad_slot, b"x")
    assert snapshot(store) == before
    assert store.commit(("s", 1), slot, b"x") is True
    with pytest.raises(ValueError):
        store.commit(("s", 1), slot, b"y")  # a slot commits once


@pytest.mark.parametrize("commit", ["commit", "commit_many", "commit_many_array"])
def test_a_bool_is_never_taken_for_a_reserved_slot(commit: str) -> None:
    """True has ``__index__`` (1): a mask passed where slots go would publish keys in
    slots 1 and 0. Refused even where ``owner`` reserves those very slots."""
    store = BlockStore(2, L)
    assert sorted(store.reserve("r", 2)) == [0, 1]
    before = snapshot(store)
    with pytest.raises(ValueError, match="bool"):
        if commit == "commit":
            store.commit("r", True, b"k")
        elif commit == "commit_many":
            store.commit_many("r", [True, False], [b"k", b"l"])
        else:
            store.commit_many("r", np.array([True, False]), [b"k", b"l"])  # type: ignore[arg-type]
    assert snapshot(store) == before and store._reserved_by("r") == [0, 1]


def test_release_reserved_frees_slots_all_or_nothing() -> None:
    store = BlockStore(4, L)
    mine = store.reserve("a", 2)
    theirs = store.reserve("b", 1)
    with pytest.raises(ValueError):
        store.release_reserved("a", [*mine, *theirs])
    assert store.statistics().reserved == 3
    store.release_reserved("a", [mine[0], mine[0], mine[1]])  # duplicates are harmless
    stats = store.statistics()
    assert (stats.free, stats.reserved) == (3, 1)


# ------------------------------------------------------------------ quarantine


def test_quarantined_slots_are_not_reused_until_their_deadline() -> None:
    store = BlockStore(2, L)
    slots = store.reserve("r", 2)
    store.quarantine("r", slots[:1], until=10.0)
    store.quarantine("r", slots[1:], until=20.0)
    assert store.next_quarantine_deadline() == 10.0
    with pytest.raises(StoreFull):
        store.put(b"k", blk(1))
    assert store.release_quarantined(9.999) == 0
    with pytest.raises(StoreFull):
        store.reserve("r", 1)
    assert store.release_quarantined(10.0) == 1
    assert store.next_quarantine_deadline() == 20.0
    assert store.put(b"k", blk(1)) == slots[0]
    assert store.release_quarantined(100.0) == 1
    assert store.next_quarantine_deadline() is None
    assert store.statistics().quarantined == 0 and store.statistics().free == 1


def test_quarantine_requires_a_slot_reserved_by_that_owner() -> None:
    store = filled(3, keys=1)
    (slot,) = store.reserve("r", 1)
    for owner, bad in [("other", slot), ("r", 0), ("r", 2)]:
        with pytest.raises(ValueError):
            store.quarantine(owner, [bad], until=1.0)
    with pytest.raises(ValueError):
        store.quarantine("r", [slot], until=float("nan"))
    assert store.statistics().quarantined == 0 and store.statistics().reserved == 1


def test_unquarantine_frees_at_once_and_ignores_late_confirmations() -> None:
    store = BlockStore(1, L)
    (slot,) = store.reserve("a", 1)
    store.quarantine("a", [slot], until=10.0)
    store.unquarantine([slot])
    assert store.statistics().free == 1 and store.next_quarantine_deadline() is None
    assert store.release_quarantined(10.0) == 0  # the stale deadline frees nothing
    store.reserve("b", 1)
    store.quarantine("b", [slot], until=10.0)
    store.unquarantine([slot], owner="a")  # late, for a's quarantine: b's stays
    assert store.statistics().quarantined == 1
    assert store.next_quarantine_deadline() == 10.0
    store.unquarantine([slot], owner="b")
    assert store.statistics().free == 1
    store.unquarantine([slot])  # already free: ignored, not freed twice
    assert store.statistics().free == 1 and store.reserve("c", 1) == [slot]


def test_deadlines_outlive_the_compaction_of_stale_ones() -> None:
    """100 quarantined slots confirmed quiescent leave 100 stale deadlines behind, and
    unquarantine compacts the heap once they outnumber the live ones: the 2 slots still
    quarantined keep their deadline, and leave quarantine at it, not never."""
    store = BlockStore(128, L)
    confirmed = store.reserve("a", 100)
    store.quarantine("a", confirmed, until=10.0)
    still = store.reserve("b", 2)
    store.quarantine("b", still, until=5.0)
    store.unquarantine(confirmed)  # 102 deadlines, 2 live: compacted
    assert store.statistics().quarantined == 2
    assert store.next_quarantine_deadline() == 5.0
    assert store.release_quarantined(4.9) == 0
    assert store.release_quarantined(5.0) == 2
    assert store.statistics().quarantined == 0 and store.next_quarantine_deadline() is None
    store._check_invariants()


def _requarantined(first: float, second: float) -> BlockStore:
    """One slot quarantined until ``first``, confirmed quiescent (its heap entry stays
    behind, stale), reused and quarantined again until ``second``."""
    store = BlockStore(1, L)
    (slot,) = store.reserve("a", 1)
    store.quarantine("a", [slot], until=first)
    store.unquarantine([slot])
    assert store.reserve("b", 1) == [slot]
    store.quarantine("b", [slot], until=second)
    return store


def test_a_stale_deadline_never_ends_a_later_quarantine_of_the_same_slot() -> None:
    """A stale deadline left in the heap never ends a later quarantine of the same slot:
    the slot, quarantined again until 20, stays quarantined at the stale 10."""
    store = _requarantined(10.0, 20.0)
    assert store.release_quarantined(10.0) == 0  # the stale deadline frees nothing
    assert store.statistics().quarantined == 1
    assert store.release_quarantined(20.0) == 1
    assert store.statistics().free == 1


def test_the_next_quarantine_deadline_skips_a_stale_entry() -> None:
    """The next quarantine deadline is the live quarantine's, never that of a stale heap
    entry left behind by an earlier quarantine of the same slot."""
    store = _requarantined(10.0, 20.0)
    assert store.next_quarantine_deadline() == 20.0


def test_release_owner_drops_pins_and_frees_its_reservations() -> None:
    store = filled(4, keys=2)
    store.pin("s", [b"k0", b"k1", b"k1"])
    store.pin("other", [b"k1"])
    store.reserve("s", 1)
    store.reserve("other", 1)
    store.release_owner("s", quarantine_until=None)
    stats = store.statistics()
    assert store.pins_of("s") == 0 and store.pins_of("other") == 1
    assert (stats.pinned, stats.reserved, stats.free, stats.quarantined) == (1, 1, 1, 0)


def test_release_owner_can_quarantine_its_reservations() -> None:
    store = BlockStore(3, L)
    slots = store.reserve("s", 2)
    store.release_owner("s", quarantine_until=3.0)
    stats = store.statistics()
    assert (stats.reserved, stats.quarantined, stats.free) == (0, 2, 1)
    with pytest.raises(StoreFull):
        store.reserve("t", 2)
    assert store.release_quarantined(3.0) == 2
    assert sorted(store.reserve("t", 3)) == sorted([*slots, 2])


def test_release_owner_refuses_a_nan_deadline_and_changes_nothing() -> None:
    """A NaN deadline compares false with every time, so a slot quarantined with it would
    never be released: ``release_owner`` refuses it, as ``quarantine`` does, before it
    drops a pin or settles a slot."""
    store = BlockStore(3, L)
    store.put(b"k", blk(1))
    store.pin("s", [b"k"])
    slots = store.reserve("s", 2)
    before = snapshot(store)
    with pytest.raises(ValueError):
        store.release_owner("s", quarantine_until=float("nan"))
    assert snapshot(store) == before
    assert store.pins_of("s") == 1 and store._reserved_by("s") == sorted(slots)


@pytest.mark.parametrize("bad", [3, -1, True, 1.0, "1"])
def test_unquarantine_refuses_what_is_not_a_slot_and_frees_nothing(bad: object) -> None:
    """A confirmation names slots: an int out of range, a bool or anything not an int is
    refused (``True`` or ``1.0`` would otherwise find slot 1's quarantine entry)."""
    store = BlockStore(3, L)
    slots = store.reserve("r", 3)
    store.quarantine("r", slots, until=10.0)
    with pytest.raises((TypeError, ValueError)):
        store.unquarantine([bad])  # type: ignore[list-item]
    assert store.statistics().quarantined == 3 and store.next_quarantine_deadline() == 10.0


# ------------------------------------------------------------------ regions


def test_default_region_is_page_aligned_and_described_by_layout() -> None:
    store = BlockStore(8, 4096)
    assert store.base_addr % mmap.PAGESIZE == 0
    assert store.layout == RegionLayout(store.base_addr, 8, 4096)
    assert store.array.dtype == np.uint8 and store.array.shape == (8 * 4096,)
    assert store.array.ctypes.data == store.base_addr
    assert not store.array.any()


@pytest.mark.parametrize(
    "make",
    [
        lambda n: np.zeros(n // 4, dtype=np.float32).reshape(2, -1),
        lambda n: np.zeros(n + 100, dtype=np.uint8),  # larger than needed
        lambda n: bytearray(n),
        lambda n: memoryview(bytearray(n)),
        lambda n: mmap.mmap(-1, n),
    ],
    ids=["numpy-float32-2d", "numpy-larger", "bytearray", "memoryview", "mmap"],
)
def test_handed_in_region_is_used_without_a_copy(make: Callable[[int], object]) -> None:
    region = make(4 * L)
    store = BlockStore(4, L, region)
    assert store.region is region and store.array.nbytes == 4 * L
    slot = store.put(b"k", blk(0xAB))
    assert bytes(memoryview(region).cast("B")[slot * L : (slot + 1) * L]) == blk(0xAB)  # type: ignore[arg-type]
    memoryview(region).cast("B")[slot * L] = 1  # type: ignore[arg-type]
    assert (store.get(b"k") or b"")[0] == 1


def test_torch_cpu_tensor_region_is_used_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros((4, L // 2), dtype=torch.bfloat16)
    store = BlockStore(4, L, tensor)
    assert store.base_addr == tensor.data_ptr()
    slot = store.put(b"k", torch.full((L,), 0x3F, dtype=torch.uint8))  # tensor data too
    assert bool((tensor[slot].view(torch.uint8) == 0x3F).all())
    tensor[slot].view(torch.uint8)[0] = 7
    assert (store.get(b"k") or b"")[0] == 7
    assert store.region is tensor


def test_torch_region_must_be_contiguous_and_on_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError):
        BlockStore(2, L, torch.zeros((L, 2), dtype=torch.uint8).t())
    with pytest.raises(ValueError):
        BlockStore(2, L, torch.zeros(L, dtype=torch.uint8))  # too small
    with pytest.raises(ValueError):
        BlockStore(2, L, torch.zeros(2 * L, dtype=torch.uint8, device="meta"))
    # A conjugate or negative view reads as other values than its bytes: refused with the
    # same ValueError (it was torch's RuntimeError, from a view outside the checks).
    with pytest.raises(ValueError, match="conjugate or negative"):
        BlockStore(2, L, torch.zeros(2 * L // 8, dtype=torch.complex64).conj())
    with pytest.raises(ValueError, match="conjugate or negative"):
        BlockStore(2, L, torch._neg_view(torch.zeros(2 * L // 4, dtype=torch.float32)))


@pytest.mark.parametrize(
    "region",
    [
        bytes(4 * L),  # read-only
        bytearray(4 * L - 1),  # too small
        np.zeros((4 * L, 2), dtype=np.uint8)[:, 0],  # not contiguous
        np.frombuffer(bytes(4 * L), dtype=np.uint8),  # read-only
        np.empty(4 * L, dtype=object),
        memoryview(bytearray(8 * L))[::2],  # a buffer, but not contiguous
        # Object pointers as a plain buffer: a peer's write would overwrite them.
        (ctypes.py_object * (4 * L // ctypes.sizeof(ctypes.py_object)))(),
        np.empty(4 * L, dtype=object).data,
    ],
    ids=[
        "bytes",
        "small",
        "strided",
        "readonly-numpy",
        "object-numpy",
        "strided-buffer",
        "ctypes-objects",
        "object-memoryview",
    ],
)
def test_unusable_region_is_rejected(region: object) -> None:
    """Memory that cannot be viewed in place is refused with ValueError, a strided buffer
    that is not an array too (TypeError is for what is no buffer at all)."""
    with pytest.raises(ValueError):
        BlockStore(4, L, region)


def test_region_that_is_not_a_buffer_is_rejected() -> None:
    with pytest.raises(TypeError):
        BlockStore(4, L, [0] * (4 * L))


@pytest.mark.parametrize("args", [(0, L), (4, 0), (-1, L), (True, L), (2.0, L)])
def test_sizes_must_be_positive_ints(args: tuple[object, object]) -> None:
    with pytest.raises(ValueError):
        BlockStore(*args)  # type: ignore[arg-type]


# ------------------------------------------------------------------ model-based

N_SM = 6
KEYS = [b"key%d" % i for i in range(8)]
OWNERS: list[Hashable] = ["a", ("s", 1), ("s", 2)]
owners = st.sampled_from(OWNERS)
some_keys = st.lists(st.sampled_from(KEYS), max_size=4)


class StoreMachine(RuleBasedStateMachine):
    """Random operations against a model of what must hold, whatever LRU picks."""

    def __init__(self) -> None:
        super().__init__()
        self.store = BlockStore(N_SM, L)
        self.content: dict[bytes, bytes] = {}  # the last bytes put or committed per key
        self.mapped: dict[bytes, int] = {}  # where the key was put or committed
        self.pins: dict[Hashable, Counter[int]] = {}
        self.pinned_bytes: dict[int, bytes] = {}  # slot -> its bytes when first pinned
        self.reserved: dict[Hashable, set[int]] = {}
        self.quarantined: dict[int, tuple[float, Hashable]] = {}
        self.now = 0.0
        self.version = 0

    # -- model helpers
    def fresh(self) -> bytes:
        self.version += 1
        return self.version.to_bytes(L, "big")

    def pinned_slots(self) -> set[int]:
        return {s for c in self.pins.values() for s, n in c.items() if n > 0}

    def reserved_slots(self) -> set[int]:
        return {s for ss in self.reserved.values() for s in ss}

    def untouchable(self) -> set[int]:
        return self.pinned_slots() | self.reserved_slots() | set(self.quarantined)

    def available(self) -> int:  # free + evictable
        return N_SM - len(self.untouchable())

    def forget_unpinned(self) -> None:
        pinned = self.pinned_slots()
        self.pinned_bytes = {s: b for s, b in self.pinned_bytes.items() if s in pinned}
        self.pins = {o: c for o, c in self.pins.items() if +c}

    def write_slot(self, slot: int, data: bytes) -> None:
        self.store.array[slot * L : (slot + 1) * L] = np.frombuffer(data, dtype=np.uint8)

    # -- rules
    @rule(key=st.sampled_from(KEYS))
    def put(self, key: bytes) -> None:
        data = self.fresh()
        existing = self.store.slot_of(key)
        in_place = existing is not None and existing not in self.pinned_slots()
        if not in_place and self.available() == 0:
            before = snapshot(self.store)
            with pytest.raises(StoreFull):
                self.store.put(key, data)
            assert snapshot(self.store) == before
            return
        forbidden = self.untouchable()
        slot = self.store.put(key, data)
        assert slot not in forbidden
        if in_place:
            assert slot == existing
        self.content[key] = data
        self.mapped[key] = slot

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        view = self.store.get(key)
        if view is None:
            assert key not in self.store
        else:
            assert bytes(view) == self.content[key]

    @rule(key=st.sampled_from(KEYS))
    def evict(self, key: bytes) -> None:
        slot = self.store.slot_of(key)
        assert self.store.evict(key) == (slot is not None and slot not in self.pinned_slots())

    @rule(owner=owners, keys=some_keys)
    def pin(self, owner: Hashable, keys: list[bytes]) -> None:
        expected = [self.store.slot_of(k) for k in keys]
        assert self.store.pin(owner, keys) == expected
        for key, slot in zip(keys, expected, strict=True):
            if slot is not None:
                self.pins.setdefault(owner, Counter())[slot] += 1
                self.pinned_bytes.setdefault(slot, self.content[key])

    @rule(owner=owners)
    def unpin(self, owner: Hashable) -> None:
        assert self.store.unpin(owner) == self.pins.pop(owner, Counter()).total()
        self.forget_unpinned()

    @rule(owner=owners, slots=st.lists(st.integers(0, N_SM - 1), max_size=4))
    def unpin_keys(self, owner: Hashable, slots: list[int]) -> None:
        held = self.pins.get(owner, Counter())
        expected = 0
        for slot in slots:
            if held[slot] > 0:
                held[slot] -= 1
                expected += 1
        assert self.store.unpin_keys(owner, slots) == expected
        self.forget_unpinned()

    @rule(owner=owners, n=st.integers(0, 4))
    def reserve(self, owner: Hashable, n: int) -> None:
        forbidden = self.untouchable()
        if n > self.available():
            before = snapshot(self.store)
            with pytest.raises(StoreFull):
                self.store.reserve(owner, n)
            assert snapshot(self.store) == before
            return
        slots = self.store.reserve(owner, n)
        assert len(set(slots)) == n and not set(slots) & forbidden
        self.reserved.setdefault(owner, set()).update(slots)

    @precondition(lambda self: self.reserved_slots())
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def commit(self, data: st.DataObject, key: bytes) -> None:
        owner = data.draw(st.sampled_from([o for o, s in self.reserved.items() if s]))
        slot = data.draw(st.sampled_from(sorted(self.reserved[owner])))
        block = self.fresh()
        self.write_slot(slot, block)
        present = key in self.store
        assert self.store.commit(owner, slot, key) is (not present)
        self.reserved[owner].discard(slot)
        if not present:
            self.content[key] = block
            self.mapped[key] = slot

    @rule(owner=owners, slot=st.integers(0, N_SM - 1), key=st.sampled_from(KEYS))
    def commit_unowned(self, owner: Hashable, slot: int, key: bytes) -> None:
        if slot in self.reserved.get(owner, set()):
            return
        before = snapshot(self.store)
        with pytest.raises(ValueError):
            self.store.commit(owner, slot, key)
        assert snapshot(self.store) == before

    @precondition(lambda self: self.reserved_slots())
    @rule(data=st.data(), dt=st.floats(0, 3), settle=st.booleans())
    def settle_reserved(self, data: st.DataObject, dt: float, settle: bool) -> None:
        owner = data.draw(st.sampled_from([o for o, s in self.reserved.items() if s]))
        slots = data.draw(st.lists(st.sampled_from(sorted(self.reserved[owner])), min_size=1))
        if settle:
            self.store.release_reserved(owner, slots)
        else:
            self.store.quarantine(owner, slots, until=self.now + dt)
            self.quarantined.update((s, (self.now + dt, owner)) for s in slots)
        self.reserved[owner].difference_update(slots)

    @rule(dt=st.floats(0, 2))
    def advance_clock(self, dt: float) -> None:
        self.now += dt
        due = [s for s, (until, _) in self.quarantined.items() if until <= self.now]
        assert self.store.release_quarantined(self.now) == len(due)
        for slot in due:
            del self.quarantined[slot]

    @rule(slots=st.lists(st.integers(0, N_SM - 1), max_size=3), owner=st.none() | owners)
    def unquarantine(self, slots: list[int], owner: Hashable | None) -> None:
        if owner is None:
            self.store.unquarantine(slots)
        else:
            self.store.unquarantine(slots, owner=owner)
        for slot in slots:
            entry = self.quarantined.get(slot)
            if entry is not None and (owner is None or entry[1] == owner):
                del self.quarantined[slot]

    @rule(owner=owners, quarantine=st.booleans())
    def release_owner(self, owner: Hashable, quarantine: bool) -> None:
        until = self.now + 1.0 if quarantine else None
        self.store.release_owner(owner, quarantine_until=until)
        self.pins.pop(owner, None)
        self.forget_unpinned()
        for slot in self.reserved.pop(owner, set()):
            if until is not None:
                self.quarantined[slot] = (until, owner)

    # -- invariants
    @invariant()
    def internal_structures_agree(self) -> None:
        self.store._check_invariants()

    @invariant()
    def slot_accounting_adds_up(self) -> None:
        stats = self.store.statistics()
        assert stats.free + stats.used + stats.reserved + stats.quarantined == N_SM
        assert stats.reserved == len(self.reserved_slots())
        assert stats.quarantined == len(self.quarantined)
        pinned = self.pinned_slots()
        assert stats.pinned == len(pinned)
        keys = self.store.keys()
        mapped_now = {self.store.slot_of(k) for k in keys}
        assert stats.used == len(self.store) + len(pinned - mapped_now)  # orphans
        for owner in OWNERS:
            assert self.store.pins_of(owner) == self.pins.get(owner, Counter()).total()
        deadlines = [until for until, _ in self.quarantined.values()]
        assert self.store.next_quarantine_deadline() == (min(deadlines) if deadlines else None)

    @invariant()
    def pinned_blocks_never_change_or_vanish(self) -> None:
        for slot, data in self.pinned_bytes.items():
            assert bytes(self.store.view(slot)) == data
        pinned = self.pinned_slots()
        for key, slot in list(self.mapped.items()):
            now = self.store.slot_of(key)
            if slot in pinned:
                assert now == slot  # never evicted while pinned
            else:
                assert now in (slot, None)  # a key never moves by itself
            if now is None:
                del self.mapped[key]

    @invariant()
    def every_key_reads_its_last_bytes(self) -> None:
        untouchable = self.reserved_slots() | set(self.quarantined)
        keys = self.store.keys()
        for key in keys:
            slot = self.store.slot_of(key)
            assert slot is not None and slot not in untouchable
            assert bytes(self.store.view(slot)) == self.content[key]


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ threads


def test_pinned_blocks_never_change_while_the_host_thread_puts() -> None:
    n, length = 32, 256
    store = BlockStore(n, length)
    shared = [b"shared%d" % i for i in range(8)]  # the host re-puts these; the engine pins them
    host_keys = [b"host%d" % i for i in range(16)]

    def block(tag: int, version: int) -> bytes:
        return (tag.to_bytes(2, "big") + version.to_bytes(6, "big")) * (length // 8)

    def tag_of(data: bytes) -> int:
        assert data == data[:8] * (length // 8), "torn block"
        return int.from_bytes(data[:2], "big")

    for i, key in enumerate(shared):
        store.put(key, block(i, 0))

    barrier = threading.Barrier(2, timeout=10)
    stop = threading.Event()
    # The engine asks for a full pass of host puts while it holds its pins: one token per
    # request in a queue, one token back per pass. A token cannot be lost the way a flag
    # that is tested and then cleared can (a set() landing between the two is erased).
    pass_wanted: queue.SimpleQueue[int] = queue.SimpleQueue()
    pass_done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def host() -> None:
        barrier.wait()
        version = 0
        while not stop.is_set():
            try:
                # Taken before the pass starts, so the whole pass runs under the pins.
                wanted: int | None = pass_wanted.get_nowait()
            except queue.Empty:
                wanted = None
            version += 1
            for i, key in enumerate(shared):
                store.put(key, block(i, version))
            for j, key in enumerate(host_keys):
                store.put(key, block(100 + j, version))
                store.get(host_keys[(j * 7) % len(host_keys)])
            if wanted is not None:
                pass_done.put(wanted)

    def engine() -> None:
        barrier.wait()
        for rnd in range(200):
            owner = ("session", rnd)
            keys = shared[rnd % 3 :: 2]
            slots = store.pin(owner, keys)
            held = {s: bytes(store.view(s)) for s in slots if s is not None}
            for key, slot in zip(keys, slots, strict=True):
                if slot is not None:
                    assert tag_of(held[slot]) == shared.index(key)
            incoming = store.reserve(owner, 3)
            assert not set(incoming) & set(held)
            for k, slot in enumerate(incoming):
                store.array[slot * length : (slot + 1) * length] = np.frombuffer(
                    block(200 + k, rnd), dtype=np.uint8
                )
            store.commit(owner, incoming[0], b"engine%d" % (rnd % 5))
            store.release_reserved(owner, incoming[1:2])
            store.quarantine(owner, incoming[2:], until=float(rnd))
            store.release_quarantined(float(rnd))
            pass_wanted.put(rnd)
            try:
                assert pass_done.get(timeout=10) == rnd
            except queue.Empty:
                raise AssertionError("host thread stalled") from None
            for slot, data in held.items():
                assert bytes(store.view(slot)) == data, "a pinned block changed"
            assert store.unpin(owner) == len(held)
        stop.set()

    def wake_the_other(_exc: BaseException) -> None:
        stop.set()
        barrier.abort()

    run_interleaved(host, engine, on_error=wake_the_other)
    store._check_invariants()
    stats = store.statistics()
    assert stats.pinned == 0 and stats.reserved == 0 and stats.quarantined == 0
    assert stats.free + stats.used == n
    for i, key in enumerate(shared):
        assert tag_of(bytes(store.get(key) or b"")) == i


# The engine lands its fetches through _commit_reserved: commit_many without the checks
# of what the engine built itself (key types, repeated slots), but not of the reservation.
_COMMITS = pytest.mark.parametrize("commit", ["commit_many", "_commit_reserved"])
_PATHS = pytest.mark.parametrize("batch_keys", [256, 2])  # scalar path; array path


@_COMMITS
@_PATHS
def test_commit_many_publishes_a_batch_and_keeps_existing_keys(
    commit: str, batch_keys: int
) -> None:
    store = BlockStore(8, 16, batch_keys=batch_keys)
    store.put(b"old", b"o" * 16)
    slots = store.reserve("f", 3)
    for slot, fill_byte in zip(slots, b"abc", strict=True):
        store.array[slot * 16 : (slot + 1) * 16] = fill_byte
    out = getattr(store, commit)("f", slots, [b"k1", b"old", b"k3"])
    assert out == ([True, False, True] if commit == "commit_many" else None)
    assert bytes(store.get(b"k1") or b"") == b"a" * 16
    assert bytes(store.get(b"old") or b"") == b"o" * 16  # the existing block is kept
    assert bytes(store.get(b"k3") or b"") == b"c" * 16
    assert store.statistics().reserved == 0 and store.statistics().used == 3
    assert store.present([b"k1", b"nope", b"old"]) == [True, False, True]


@_COMMITS
@_PATHS
def test_commit_many_checks_every_reservation_before_changing_anything(
    commit: str, batch_keys: int
) -> None:
    store = BlockStore(8, 16, batch_keys=batch_keys)
    slots = store.reserve("f", 3)
    other = store.reserve("g", 1)
    before = snapshot(store)
    for wrong in ([slots[0], slots[1], 7], [slots[0], slots[1], other[0]], slots[:2]):
        with pytest.raises(ValueError):
            getattr(store, commit)("f", wrong, [b"a", b"b", b"c"])
        assert snapshot(store) == before
    assert store.statistics().reserved == 4 and len(store) == 0


@pytest.mark.parametrize("n", [1, 2, SMALL_KEYS])
@_PATHS
def test_commit_many_refuses_a_slot_listed_twice_and_changes_nothing(
    n: int, batch_keys: int
) -> None:
    """One reserved slot listed twice would publish two keys over one block: refused,
    nothing changed, at the edge sizes (2 entries; 3; one past the scalar path)."""
    store = BlockStore(64, 16, batch_keys=batch_keys)
    slots = store.reserve("f", n)
    listed = [*slots, slots[0]]
    before = snapshot(store)
    with pytest.raises(ValueError):
        store.commit_many("f", listed, [b"k%d" % i for i in range(len(listed))])
    assert snapshot(store) == before and store._reserved_by("f") == sorted(slots)


@pytest.mark.parametrize("bad", [b"", bytearray(b"k"), "k", None])
@pytest.mark.parametrize("n", [1, SMALL_KEYS + 1])  # scalar path; array path
def test_commit_many_refuses_a_key_that_is_not_non_empty_bytes_and_changes_nothing(
    n: int, bad: object
) -> None:
    store = BlockStore(64, 16)
    slots = store.reserve("f", n + 1)
    before = snapshot(store)
    with pytest.raises((TypeError, ValueError)):
        store.commit_many("f", slots, [*(b"k%d" % i for i in range(n)), bad])  # type: ignore[list-item]
    assert snapshot(store) == before and store._reserved_by("f") == sorted(slots)


@pytest.mark.parametrize("bad", [1.0, "1", None, b"\x01", -1, 8, 2**70])
@pytest.mark.parametrize("how", ["commit_many", "release_reserved", "quarantine"])
def test_a_slot_that_is_not_an_int_in_range_is_refused_and_changes_nothing(
    how: str, bad: object
) -> None:
    """A float equal to a reserved slot (1.0 == 1) names no slot: refused like any stranger."""
    store = BlockStore(8, 16)
    store.reserve("f", 2)  # slots 0 and 1
    calls: dict[str, Callable[[], object]] = {
        "commit_many": lambda: store.commit_many("f", [0, bad], [b"a", b"b"]),  # type: ignore[list-item]
        "release_reserved": lambda: store.release_reserved("f", [0, bad]),  # type: ignore[list-item]
        "quarantine": lambda: store.quarantine("f", [0, bad], until=1.0),  # type: ignore[list-item]
    }
    before = snapshot(store)
    with pytest.raises(ValueError, match="not reserved"):
        calls[how]()
    assert snapshot(store) == before and store.statistics().reserved == 2
    store._check_invariants()


# --------------------------------------- found by a review (2026-12-03); each failed before


def _filled(n: int, block_len: int) -> BlockStore:
    store = BlockStore(n, block_len)
    for i in range(n):
        store.put(b"k%d" % i, i.to_bytes(block_len, "big"))
    return store


@pytest.mark.parametrize(
    ("n", "block_len", "dtype", "slot"),
    [(256, 4, np.uint8, 200), (128, 4096, np.int16, 99), (300, 4, np.int8, 100)],
)
def test_view_of_a_numpy_int_slot_is_that_slots_bytes(
    n: int, block_len: int, dtype: type, slot: int
) -> None:
    """``view`` accepts NumPy integers (``_check_slot``), but computes the offset as
    ``slot * block_len`` in the slot's own dtype: it wraps, and another slot's bytes come
    back (in production only a RuntimeWarning says so; int32 chunk ids overflow the same
    way once the region passes 2 GiB, e.g. slot 1024 of 2 MiB blocks)."""
    store = _filled(n, block_len)
    want = bytes(store.view(slot))
    assert int.from_bytes(want, "big") == slot
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as outside pytest: a warning, not an error
        got = bytes(store.view(dtype(slot)))
    assert got == want, f"view({dtype.__name__}({slot})) gave slot {int.from_bytes(got, 'big')}"


def test_unpin_keys_that_fails_in_a_later_batch_leaves_no_pin_to_drop_twice() -> None:
    """``unpin_keys`` with more slots than one batch (``batch_keys``) and an unhashable
    entry in a later batch: the first batch's pins are taken off the slots (and off the
    owner's total), then TypeError, and ``pins.set_counts`` never runs, so the owner's
    record still lists them. The scalar path refuses the same input with nothing changed.
    The next ``unpin`` drops them again: another owner's pin goes, and its slot is
    evicted and handed to a reservation while that owner still holds the pin."""
    store = BlockStore(400, 4)
    keys = [b"k%d" % i for i in range(300)]
    for i, key in enumerate(keys):
        store.put(key, i.to_bytes(4, "big"))
    mine = store.pin("a", keys)
    theirs = store.pin("b", keys[:1])
    with pytest.raises(TypeError):
        store.unpin_keys("a", [*mine[:256], [1]])  # type: ignore[list-item]
    held = store.pins_of("a")
    assert store.unpin("a") == held, "unpin released more pins than the owner held"
    assert store.pins_of("b") == 1
    assert theirs[0] not in store.reserve("r", store.num_blocks - 1), (
        "a slot that 'b' still pins was evicted and reserved"
    )
    store._check_invariants()


def test_get_tensor_refused_on_a_host_region_leaves_the_lru_alone() -> None:
    """``get_tensor`` on a host region raised TypeError only after ``_touch`` had
    made the key most recently used: a refused call changes which block is evicted next."""
    store = BlockStore(4, 4)
    keys = [b"k%d" % i for i in range(4)]
    for key in keys:
        store.put(key, bytes(4))
    with pytest.raises(TypeError):
        store.get_tensor(keys[0])
    assert store._lru_keys() == keys
    store.put(b"new", bytes(4))  # evicts the least recently used block
    assert keys[0] not in store


def test_contains_agrees_with_get_for_a_bytes_like_key() -> None:
    """A memoryview of a stored key: ``get``, ``slot_of``, ``evict`` and ``present`` find
    the block, ``in`` says it is absent (it alone checks ``isinstance(key, bytes)``)."""
    store = BlockStore(4, 4)
    store.put(b"k", b"abcd")
    key = memoryview(b"k")
    assert store.present([key]) == [True]  # type: ignore[list-item]
    assert store.get(key) is not None  # type: ignore[arg-type]
    assert (key in store) == (store.get(key) is not None)  # type: ignore[arg-type]


# ------------------- found by a mutation review (2026-12-05); each fails on a store mutant


@pytest.mark.parametrize("number", [1.0, True, np.int64(1)])
@pytest.mark.parametrize("small", [SMALL_KEYS, 0])  # scalar path; array path
def test_unpin_keys_takes_a_number_equal_to_a_pinned_slot_as_that_slot(
    small: int, number: object
) -> None:
    """``unpin_keys`` finds the owner's pins as a dict does, so 1.0, True or np.int64(1)
    name slot 1 on both paths: the scalar path converts the entry with ``int`` before it
    indexes its arrays (a memoryview refuses a float index)."""
    store = filled(3)
    store._small_keys = small
    store.pin("o", [b"k1", b"k1"])
    assert store.unpin_keys("o", [number]) == 1  # type: ignore[list-item]
    assert store.pins_of("o") == 1 and store.statistics().pinned == 1
    assert store.unpin_keys("o", [number]) == 1  # type: ignore[list-item]
    assert store.pins_of("o") == 0 and store.evict(b"k1") is True
    store._check_invariants()


@pytest.mark.parametrize("how", ["release_reserved", "quarantine"])
def test_a_bulk_settle_whose_later_batch_only_repeats_settled_slots_ends_cleanly(
    how: str,
) -> None:
    """Four slots in batches of two (the array path): the first batch settles both of the
    owner's reservations and ends its record; the second, the same two again, must stop
    there (repeats are harmless), not settle nothing for an owner it already forgot."""
    store = BlockStore(8, L, batch_keys=2)
    slots = store.reserve("a", 2)
    if how == "release_reserved":
        store.release_reserved("a", [*slots, *slots])
    else:
        store.quarantine("a", [*slots, *slots], until=1.0)
        assert store.statistics().quarantined == 2
        assert store.release_quarantined(1.0) == 2
    stats = store.statistics()
    assert (stats.free, stats.reserved, stats.quarantined) == (8, 0, 0)
    assert store._reserved_by("a") == []
    store._check_invariants()
    assert sorted(store.reserve("b", 8)) == list(range(8))


def test_the_compacted_deadline_heap_still_gives_the_earliest_deadline_first() -> None:
    """Unquarantining 100 slots leaves 2 live deadlines among 102 and rebuilds the heap
    from the quarantine, whose order (9.0 then 5.0) is no heap order: the rebuilt heap
    must still put 5.0 first, for ``next_quarantine_deadline`` and ``release_quarantined``."""
    store = BlockStore(128, L)
    store.quarantine("a", store.reserve("a", 1), until=9.0)
    store.quarantine("b", store.reserve("b", 1), until=5.0)
    confirmed = store.reserve("c", 100)
    store.quarantine("c", confirmed, until=1.0)
    store.unquarantine(confirmed)
    assert len(store._deadlines) == 2  # rebuilt: the 100 stale entries are gone
    assert store.next_quarantine_deadline() == 5.0
    assert store.release_quarantined(5.0) == 1
    assert store.next_quarantine_deadline() == 9.0
    assert store.release_quarantined(9.0) == 1
    store._check_invariants()


def test_quarantines_confirmed_one_by_one_leave_a_bounded_deadline_heap() -> None:
    """Each quarantine that ``unquarantine`` ends early leaves its deadline in the heap;
    the heap is rebuilt once stale entries outnumber the live ones (plus 64), so 1,000
    such quarantines of one slot leave at most 65 entries, not 1,000."""
    store = BlockStore(1, L)
    for i in range(1_000):
        slots = store.reserve("a", 1)
        store.quarantine("a", slots, until=float(i))
        store.unquarantine(slots)
    assert len(store._deadlines) <= 65
    assert store.next_quarantine_deadline() is None and store.statistics().free == 1


# ------------------------- found by a reading review of states and counts (2026-12-05)


def test_release_quarantined_refuses_a_nan_time_and_frees_nothing() -> None:
    """``release_quarantined`` frees the slots whose deadline is ``<= now``; NaN compares
    false with every deadline, so the heap's "not yet" test (``deadline > now``) never
    stopped it and every quarantined slot was freed at once, for reuse while a write may
    still land in it (invariant 2). It is refused, as a NaN deadline is."""
    store = BlockStore(4, L)
    slots = store.reserve("s", 3)
    store.quarantine("s", slots, until=10.0)
    with pytest.raises(ValueError):
        store.release_quarantined(float("nan"))
    stats = store.statistics()
    assert (stats.quarantined, stats.free) == (3, 1)
    assert store.next_quarantine_deadline() == 10.0
    with pytest.raises(StoreFull):
        store.reserve("t", 2)
    assert store.release_quarantined(10.0) == 3
    store._check_invariants()


@pytest.mark.parametrize("n", [2, SMALL_KEYS + 1])
def test_reserve_for_an_unhashable_owner_raises_and_changes_nothing(n: int) -> None:
    """``reserve`` took its slots (evicting for them) before it looked the owner up; an
    owner that cannot be a dict key then raised TypeError with the slots off the free
    list and the evicted keys gone, held by nobody: lost for good, on both paths."""
    store = filled(SMALL_KEYS + 2, keys=SMALL_KEYS + 1)  # one slot free: n evicts too
    before = snapshot(store)
    with pytest.raises(TypeError):
        store.reserve(["not", "hashable"], n)  # type: ignore[arg-type]
    assert snapshot(store) == before
    store._check_invariants()
    assert len(store.reserve("s", SMALL_KEYS + 2)) == SMALL_KEYS + 2
