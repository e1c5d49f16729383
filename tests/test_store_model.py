"""The vectorised BlockStore against the per-key one it replaced (``tests/store_reference.py``).

Both stores get the same random calls; after every call everything a caller can observe
must agree: each call's answer or error type, the statistics, the key map in its order,
every pin count, the quarantine, the region's bytes, and the order in which blocks will be
evicted (which decides every later ``put`` and ``reserve``). Both stores' internal checks
run after every step too. The vectorised store runs with several ``batch_keys`` and a tiny
region, so that eviction, StoreFull, orphans and its LRU log's compaction come up often,
and with several thresholds for its scalar path, so that both paths and the switch
between them are driven (``tests/test_store_paths.py`` holds the two paths to the same
internal state).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2pkv.errors import P2PKVError
from p2pkv.store import SMALL_KEYS, BlockStore

from .store_reference import BlockStore as ReferenceStore

N = 8
L = 8
KEYS = [b"key%d" % i for i in range(12)]
OWNERS: list[Hashable] = ["a", ("s", 1), ("s", 2)]
owners = st.sampled_from(OWNERS)
keys = st.sampled_from(KEYS)
key_lists = st.lists(keys, max_size=6)
any_slots = st.lists(st.integers(0, N - 1), max_size=5)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a caller sees: the answer, or the error's type."""
    try:
        result = call()
    except (P2PKVError, ValueError, TypeError, LookupError) as exc:
        return ("raised", type(exc).__name__)
    if isinstance(result, memoryview):
        result = bytes(result)
    return ("returned", result)


def observe(store: Any, lru: list[bytes], pins: dict[Hashable, list[tuple[int, int]]]) -> object:
    return (
        attrs.astuple(store.statistics()),
        [(k, store.slot_of(k)) for k in list(store.keys())],
        lru,
        pins,
        [store.pins_of(o) for o in OWNERS],
        sorted(store._quarantine.items()),
        store.next_quarantine_deadline(),
        store.array.tobytes(),
    )


class AgainstReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.new = BlockStore(N, L)
        self.ref = ReferenceStore(N, L)
        self.now = 0.0
        self.version = 0

    @initialize(batch=st.sampled_from([1, 2, 3, 256]), small=st.sampled_from([0, 2, 3, SMALL_KEYS]))
    def open_stores(self, batch: int, small: int) -> None:
        """``small``: the most keys a call may have to take the scalar path (0: never; the
        calls here have up to 6, so the thresholds 2 and 3 put calls of one less, equal and
        one more on both sides of the switch, on the same owners and slots)."""
        self.new = BlockStore(N, L, batch_keys=batch)
        self.new._small_keys = min(small, batch)

    def both(self, name: str, *args: Any, **kwargs: Any) -> Any:
        got = outcome(lambda: getattr(self.new, name)(*args, **kwargs))
        want = outcome(lambda: getattr(self.ref, name)(*args, **kwargs))
        assert got == want, (name, args, kwargs)
        return got[1]

    def reserved_by(self, owner: Hashable) -> list[int]:
        return sorted(self.ref._reserved_by.get(owner, ()))

    def land(self, slots: list[int]) -> None:
        """The transfer writes the same fresh bytes into both regions."""
        for slot in slots:
            self.version += 1
            data = self.version.to_bytes(L, "big")
            for store in (self.new, self.ref):
                store.array[slot * L : (slot + 1) * L] = list(data)

    # -- host-side
    @rule(key=keys)
    def put(self, key: bytes) -> None:
        self.version += 1
        self.both("put", key, self.version.to_bytes(L, "big"))

    @rule(key=keys)
    def get(self, key: bytes) -> None:
        self.both("get", key)

    @rule(key=keys)
    def evict(self, key: bytes) -> None:
        self.both("evict", key)

    # -- engine-side
    @rule(owner=owners, ks=key_lists)
    def pin(self, owner: Hashable, ks: list[bytes]) -> None:
        self.both("pin", owner, ks)

    @rule(owner=owners)
    def unpin(self, owner: Hashable) -> None:
        self.both("unpin", owner)

    @rule(owner=owners, data=st.data())
    def unpin_keys(self, owner: Hashable, data: st.DataObject) -> None:
        held = sorted(self.ref._pins.get(owner, {}))
        pick = st.sampled_from(held) | st.integers(0, N - 1) if held else st.integers(0, N - 1)
        slots = data.draw(st.lists(pick, max_size=6))
        self.both("unpin_keys", owner, slots)

    @rule(ks=key_lists)
    def present(self, ks: list[bytes]) -> None:
        self.both("present", ks)

    @rule(owner=owners, n=st.integers(0, 5))
    def reserve(self, owner: Hashable, n: int) -> None:
        self.both("reserve", owner, n)

    @precondition(lambda self: self.ref._reserved)
    @rule(data=st.data(), key=keys)
    def commit(self, data: st.DataObject, key: bytes) -> None:
        owner = data.draw(owners)
        mine = self.reserved_by(owner)
        slot = data.draw(st.sampled_from(mine) if mine else st.integers(0, N - 1))
        self.land([slot])
        self.both("commit", owner, slot, key)

    @rule(data=st.data(), owner=owners)
    def commit_many(self, data: st.DataObject, owner: Hashable) -> None:
        mine = self.reserved_by(owner)
        # Mostly a set of the owner's own slots; sometimes a stranger's slot or a repeat.
        own = st.lists(st.sampled_from(mine), unique=True) if mine else st.just([])
        slots = data.draw(own | st.lists(st.integers(0, N - 1), max_size=4))
        ks = data.draw(st.lists(keys, min_size=len(slots), max_size=len(slots)))
        self.land(slots)
        self.both("commit_many", owner, slots, ks)

    @rule(data=st.data(), owner=owners, until=st.sampled_from([None, 0.0, 1.0, 2.0]))
    def settle(self, data: st.DataObject, owner: Hashable, until: float | None) -> None:
        mine = self.reserved_by(owner)
        pick = st.sampled_from(mine) | st.integers(0, N - 1) if mine else st.integers(0, N - 1)
        slots = data.draw(st.lists(pick, max_size=5))  # repeats are allowed here
        if until is None:
            self.both("release_reserved", owner, slots)
        else:
            self.both("quarantine", owner, slots, self.now + until)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0]))
    def release_quarantined(self, dt: float) -> None:
        self.now += dt
        self.both("release_quarantined", self.now)

    @rule(slots=any_slots, owner=st.none() | owners)
    def unquarantine(self, slots: list[int], owner: Hashable | None) -> None:
        if owner is None:
            self.both("unquarantine", slots)
        else:
            self.both("unquarantine", slots, owner=owner)

    @rule(owner=owners, quarantine=st.booleans())
    def release_owner(self, owner: Hashable, quarantine: bool) -> None:
        self.both("release_owner", owner, quarantine_until=self.now + 1.0 if quarantine else None)

    # -- after every step
    @invariant()
    def everything_observable_agrees(self) -> None:
        new, ref = self.new, self.ref
        new_pins = {o: list(p.counts().items()) for o, p in new._pins.items()}
        ref_pins = {o: list(c.items()) for o, c in ref._pins.items()}
        assert observe(new, new._lru_keys(), new_pins) == observe(ref, list(ref._lru), ref_pins)
        for owner in OWNERS:
            assert new._reserved_by(owner) == self.reserved_by(owner)
        new._check_invariants()
        ref._check_invariants()


TestAgainstReference = AgainstReference.TestCase
TestAgainstReference.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_a_long_run_of_pins_and_unpins_keeps_the_lru_exact() -> None:
    """Many more LRU entries than the log holds (so it compacts again and again, in
    steps, while evictions read it): the eviction order stays exactly the reference's."""
    n = 64
    new, ref = BlockStore(n, L, batch_keys=5), ReferenceStore(n, L, batch_keys=5)
    names = [b"k%d" % i for i in range(n)]
    for store in (new, ref):
        for i, key in enumerate(names):
            store.put(key, bytes([i]) * L)
    for rnd in range(400):
        picked = names[(rnd * 7) % n :: 3][:20]
        touched = names[(rnd * 13) % n]
        answers: list[object] = []
        for store in (new, ref):
            answers.append(store.pin(("o", rnd % 3), picked))
            store.get(touched)
            if rnd % 3 == 2:
                for owner in range(3):
                    store.unpin(("o", owner))
            if rnd % 50 == 49:  # evict through a reserve, give the slots back, put again
                slots = store.reserve("r", 5)
                store.release_reserved("r", slots)
                answers.append(slots)
                for i, key in enumerate(names):
                    if key not in store:
                        answers.append(store.put(key, bytes([i]) * L))
        assert answers[: len(answers) // 2] == answers[len(answers) // 2 :]
        assert new._lru_keys() == list(ref._lru)
        assert new.keys() == ref.keys()
    assert new.statistics().evictions == ref.statistics().evictions == 40
    new._check_invariants()
