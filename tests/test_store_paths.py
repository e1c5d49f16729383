"""The BlockStore's scalar path (calls of at most ``SMALL_KEYS`` keys or slots) against its
array path: the same calls must leave exactly the same internal state.

One store only ever takes the scalar path, one only the array path, and a third switches
between them at the real threshold (and, with a ``batch_keys`` below it, splits the bigger
calls into several batches). After every call all three must agree on each answer or
error, and on every internal structure: slot states, keys, pin counts, reservation owners
and their ids, the free list in stack order, the LRU in eviction order, each owner's pins
in pin order, the quarantine and its deadline heap, and every counter. Call sizes sit at
the threshold (one less, equal, one more) and at a few keys, on the same owners and
slots, so that pins taken by one path are dropped by the other and the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from p2pkv.errors import P2PKVError
from p2pkv.store import SMALL_KEYS, BlockStore

from .store_reference import BlockStore as ReferenceStore

N = 48
L = 4
T = SMALL_KEYS
KEYS = [b"key%d" % i for i in range(60)]
OWNERS: list[Hashable] = ["a", ("s", 1), ("s", 2)]
SIZES = st.sampled_from([0, 1, 2, 3, 4, T - 1, T, T + 1])
owners = st.sampled_from(OWNERS)


def scalar_only(n: int = N) -> BlockStore:
    store = BlockStore(n, L, batch_keys=4 * T)
    store._small_keys = 4 * T
    return store


def array_only(n: int = N) -> BlockStore:
    store = BlockStore(n, L, batch_keys=4 * T)
    store._small_keys = 0
    return store


def internals(store: BlockStore, *, same_batches: bool) -> dict[str, object]:
    """Every structure of the store (nothing may be running in it). ``distinct`` (an
    owner's pins hold no slot twice) is a conservative flag whose value depends on how a
    call was cut into batches, and so does the layout of the LRU log (one compaction step
    per batch), so these are compared only between stores that cut alike."""
    lru = store._lru
    return {
        "state": store._state.tolist(),
        "slot_key": store._slot_key.tolist(),
        "pin_count": store._pin_count.tolist(),
        "owner": store._owner.tolist(),
        "free": (store._free[: store._n_freed].tolist(), store._fresh),
        "lru": lru.live().tolist(),
        "lru_log": (lru.head, lru.w, lru.r, lru.tail, lru.compacting) if same_batches else None,
        "lru_count": lru.count,
        "map": list(store._map.items()),
        "pins": {
            owner: (pins.total, pins.listed(), pins.distinct if same_batches else None)
            for owner, pins in store._pins.items()
        },
        "holders": {o: (h.oid, h.count) for o, h in store._holders.items() if o in OWNERS},
        "holder_ids": sorted(store._holder_ids),
        "spare_ids": list(store._spare_ids),
        "next_id": store._next_id,
        "counters": (
            store._n_free,
            store._n_reserved,
            store._claimed,
            store._pinned_slots,
            store._n_orphans,
            store._evictions,
        ),
        "quarantine": list(store._quarantine.items()),
        "deadlines": list(store._deadlines),
    }


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        result = call()
    except (P2PKVError, ValueError, TypeError, LookupError) as exc:
        return ("raised", type(exc).__name__)
    return ("returned", bytes(result) if isinstance(result, memoryview) else result)


class ScalarAgainstArray(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scalar = scalar_only()
        self.array = array_only()
        self.mixed = BlockStore(N, L)
        self.now = 0.0
        self.version = 0

    @initialize(
        batch=st.sampled_from([T - 1, T, T + 1, 256]),
        keys=st.permutations(KEYS).map(lambda keys: keys[: N - 4]),
    )
    def open_stores(self, batch: int, keys: list[bytes]) -> None:
        """Most slots hold a block from the start, so that most pins find one."""
        self.mixed = BlockStore(N, L, batch_keys=batch)
        for key in keys:
            self.put(key)

    def all(self, name: str, *args: Any, **kwargs: Any) -> Any:
        stores = (self.scalar, self.array, self.mixed)
        got = [outcome(partial(getattr(store, name), *args, **kwargs)) for store in stores]
        assert got[0] == got[1] == got[2], (name, args, kwargs, got)
        return got[0][1]

    def reserved_by(self, owner: Hashable) -> list[int]:
        return self.scalar._reserved_by(owner)

    def held_by(self, owner: Hashable) -> list[int]:
        pins = self.scalar._pins.get(owner)
        return [] if pins is None else sorted(set(pins.listed()))

    # -- host-side
    @rule(key=st.sampled_from(KEYS))
    def put(self, key: bytes) -> None:
        self.version += 1
        self.all("put", key, (self.version % 2**32).to_bytes(L, "big"))

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        self.all("get", key)

    @rule(key=st.sampled_from(KEYS))
    def evict(self, key: bytes) -> None:
        self.all("evict", key)

    # -- engine-side, at sizes around the threshold
    @rule(owner=owners, data=st.data())
    def pin(self, owner: Hashable, data: st.DataObject) -> None:
        n = data.draw(SIZES)
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n))
        self.all("pin", owner, keys)

    @rule(owner=owners)
    def unpin(self, owner: Hashable) -> None:
        self.all("unpin", owner)

    @rule(owner=owners, data=st.data())
    def unpin_keys(self, owner: Hashable, data: st.DataObject) -> None:
        n = data.draw(SIZES)
        held = self.held_by(owner)
        pick = st.sampled_from(held) | st.integers(0, N - 1) if held else st.integers(0, N - 1)
        self.all("unpin_keys", owner, data.draw(st.lists(pick, min_size=n, max_size=n)))

    @rule(data=st.data())
    def present(self, data: st.DataObject) -> None:
        n = data.draw(SIZES)
        self.all("present", data.draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n)))

    @rule(owner=owners, n=SIZES)
    def reserve(self, owner: Hashable, n: int) -> None:
        self.all("reserve", owner, n)

    @rule(data=st.data(), owner=owners, key=st.sampled_from(KEYS))
    def commit(self, data: st.DataObject, owner: Hashable, key: bytes) -> None:
        mine = self.reserved_by(owner)
        self.all("commit", owner, data.draw(st.sampled_from(mine or [0])), key)

    @rule(data=st.data(), owner=owners)
    def commit_many(self, data: st.DataObject, owner: Hashable) -> None:
        n = data.draw(SIZES)
        mine = data.draw(st.permutations(self.reserved_by(owner)))
        slots = (
            mine[:n]
            if data.draw(st.booleans())
            else data.draw(st.lists(st.integers(0, N - 1), max_size=3))
        )
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=len(slots), max_size=len(slots)))
        self.all("commit_many", owner, slots, keys)

    @rule(data=st.data(), owner=owners, until=st.sampled_from([None, 0.0, 1.0]))
    def settle(self, data: st.DataObject, owner: Hashable, until: float | None) -> None:
        n = data.draw(SIZES)
        mine = self.reserved_by(owner)
        pick = st.sampled_from(mine) | st.integers(0, N - 1) if mine else st.integers(0, N - 1)
        slots = data.draw(st.lists(pick, min_size=n, max_size=n))  # repeats allowed
        if until is None:
            self.all("release_reserved", owner, slots)
        else:
            self.all("quarantine", owner, slots, self.now + until)

    @rule(dt=st.sampled_from([0.0, 1.0]))
    def release_quarantined(self, dt: float) -> None:
        self.now += dt
        self.all("release_quarantined", self.now)

    @rule(slots=st.lists(st.integers(0, N - 1), max_size=4))
    def unquarantine(self, slots: list[int]) -> None:
        self.all("unquarantine", slots)

    @rule(owner=owners, quarantine=st.booleans())
    def release_owner(self, owner: Hashable, quarantine: bool) -> None:
        self.all("release_owner", owner, quarantine_until=self.now + 1.0 if quarantine else None)

    @invariant()
    def every_structure_agrees(self) -> None:
        want = internals(self.scalar, same_batches=True)
        assert internals(self.array, same_batches=True) == want
        mixed = internals(self.mixed, same_batches=False)
        assert mixed == internals(self.scalar, same_batches=False)
        for store in (self.scalar, self.array, self.mixed):
            store._check_invariants()


TestScalarAgainstArray = ScalarAgainstArray.TestCase
TestScalarAgainstArray.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


# Each call of these scenarios takes the scalar path in one store and the array path in
# the other, except the default store, which takes the path its size picks: so the pins
# and reservations one path made are dropped or settled by the other.
SWITCHES = [(1, T + 1), (T + 1, 1), (T - 1, T), (T, T + 1), (3, 2 * T)]


class Lockstep:
    """The same calls on a default store, a scalar-only, an array-only and the reference
    store; after each, the same answers, the same internals and the same LRU."""

    def __init__(self, n: int) -> None:
        self.stores = [BlockStore(n, L), scalar_only(n), array_only(n)]
        self.ref = ReferenceStore(n, L)

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        stores = (*self.stores, self.ref)
        got = [outcome(partial(getattr(s, name), *args, **kwargs)) for s in stores]
        assert got[1:] == got[:-1], (name, args, got)
        want = internals(self.stores[1], same_batches=True)
        for store in self.stores:
            assert internals(store, same_batches=True) == want
            assert store._lru_keys() == list(self.ref._lru)
            store._check_invariants()
        return got[0][1]


@pytest.mark.parametrize("drop", ["unpin", "unpin_keys", "release_owner"])
@pytest.mark.parametrize(("first", "then"), SWITCHES)
def test_pins_taken_by_one_path_are_dropped_by_the_other(first: int, then: int, drop: str) -> None:
    n = 3 * T
    both = Lockstep(n)
    keys = [b"k%d" % i for i in range(n)]
    for i in (7 * j % n for j in range(n)):  # slots in an order unlike the keys'
        both("put", keys[i], bytes([i]) * L)
    both("pin", "other", keys[5:9])  # some slots are held by another owner too
    slots = both("pin", "o", keys[::-3][:first])
    slots += both("pin", "o", keys[::2][:then] + keys[::-3][:2])  # overlaps: counts of 2
    both("put", keys[2], bytes(L))  # a pinned key moves: its old slot is an orphan
    if drop == "unpin_keys":
        both("unpin_keys", "o", slots[::2][::-1])  # half the pins drop, in another order
        both("unpin_keys", "o", [*slots[1::2], 0, 0])  # the rest, a few strangers
    elif drop == "unpin":
        both("unpin", "o")
    else:
        both("release_owner", "o", quarantine_until=None)
    assert both("pins_of", "o") == 0
    both("unpin", "other")
    assert len(both("reserve", "f", n - 1)) == n - 1  # evicts in the LRU's order


@pytest.mark.parametrize("settle", ["release_reserved", "quarantine", "release_owner"])
@pytest.mark.parametrize(("first", "then"), SWITCHES)
def test_reservations_made_by_one_path_are_settled_by_the_other(
    first: int, then: int, settle: str
) -> None:
    n = 4 * T
    both = Lockstep(n)
    for i in range(T):  # some keys, which a commit may find present
        both("put", b"k%d" % i, bytes([i]) * L)
    mine = both("reserve", "f", first) + both("reserve", "f", then)
    theirs = both("reserve", "g", 2)
    refused = both("commit_many", "f", [*mine[:2], theirs[0]], [b"x", b"y", b"z"])
    assert refused == "ValueError"
    committed = mine[::-2][:then]
    both("commit_many", "f", committed, [b"k%d" % (3 * i) for i in range(len(committed))])
    rest = [slot for slot in mine if slot not in committed]
    if settle == "release_reserved":
        both("release_reserved", "f", rest + rest[:2])  # repeats are harmless
    elif settle == "quarantine":
        both("quarantine", "f", rest + rest[:2], 5.0)
        both("release_quarantined", 5.0)
    else:
        both("release_owner", "f", quarantine_until=1.0)
        both("unquarantine", rest[::-1])
    both("release_reserved", "g", theirs)
    assert len(both("reserve", "h", n)) == n  # every slot: the free list's order, then the LRU's


def test_a_small_reserve_behind_many_dead_lru_entries_evicts_like_the_array_path() -> None:
    """The scalar path reads at most ``n + 64`` LRU log entries, then leaves the search to
    NumPy: either way the same slots are evicted and the log is left the same."""
    n = 3 * T
    both = Lockstep(n)
    keys = [b"k%d" % i for i in range(n)]
    for i, key in enumerate(keys):
        both("put", key, bytes([i]) * L)
    both("pin", "o", keys[: 2 * T + 10])  # the oldest entries of the log are dead now
    for store in both.stores:
        assert store._lru.take_few(1) is None  # too far to read: nothing taken
    assert both("reserve", "f", 1) == [2 * T + 10]
    assert len(both("reserve", "f", 3)) == 3  # now close to the head: read in Python
    both("unpin", "o")
    assert both("reserve", "f", T) == list(range(2 * T + 14, n)) + list(range(T - (n - 2 * T - 14)))
