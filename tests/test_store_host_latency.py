"""BlockStore: a host-thread call never waits behind more than one batch of engine work.

The bound is checked by counting, not timing: ``HostProbe`` stands in for the store's lock
during one engine-side call and, at every acquisition the engine makes, lets the host
thread start exactly one store call and waits until that call is blocked on the lock. The
host call records how much of the engine's call was done when it got in. A store that
holds its lock for a whole 65,536-key call lets the host in only at the end.

Timings live in ``bench/store_lock.py``; here nothing sleeps and nothing is timed.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import random
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv import store as store_module
from p2pkv.errors import StoreFull
from p2pkv.store import BlockStore

from .helpers import run_interleaved

N = 65_536  # keys in one big engine call: the most one message may carry
L = 16
HOST_WAIT_KEYS = 256  # a host call waits for at most this many keys of engine work (BATCH_KEYS)
WAIT = 10.0  # seconds; only a broken hand-over gets anywhere near it


def key(i: int) -> bytes:
    return b"k%08d" % i


class LockStandIn:
    """A stand-in for one of the store's locks: ``acquire`` is the subclass's, the rest
    goes to the real lock (``real``)."""

    real: Any

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        self.real.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class HostProbe(LockStandIn):
    """Stands in for ``store._lock`` while the engine (this thread) makes one call.

    At each acquisition by the engine thread, it waits until the host's last turn of store
    calls is over (``idle``), takes the real lock, lets the host thread start its next turn
    (``go``) and waits until the turn's first acquisition is about to block on the real
    lock (``arrived``). That acquisition, once it holds the lock, appends
    ``progress(store)`` to ``seen``. The counting semaphores cannot miss a wake-up, and
    every wait has a deadline.
    """

    def __init__(self, store: BlockStore, progress: Callable[[BlockStore], int]) -> None:
        self.real: Any = store._lock
        self.store = store
        self.progress = progress
        self.engine = threading.get_ident()
        self.idle = threading.Semaphore(1)
        self.go = threading.Semaphore(0)
        self.arrived = threading.Semaphore(0)
        self.seen: list[int] = []
        self.engine_acquisitions = 0
        self.turn_started = False  # written by the host thread only

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.get_ident() == self.engine:
            if not self.idle.acquire(timeout=WAIT):
                raise AssertionError("the host turn never ended")
            got: bool = self.real.acquire(blocking, timeout)
            self.engine_acquisitions += 1
            self.go.release()
            if not self.arrived.acquire(timeout=WAIT):
                raise AssertionError("the host call never reached the lock")
            return got
        if not self.turn_started:
            return bool(self.real.acquire(blocking, timeout))
        self.turn_started = False
        self.arrived.release()
        got = self.real.acquire(blocking, timeout)
        self.seen.append(self.progress(self.store))
        return got


def with_host_probe(
    store: BlockStore,
    progress: Callable[[BlockStore], int],
    engine_call: Callable[[], object],
    host_call: Callable[[], object],
) -> tuple[list[int], int]:
    """Run ``engine_call`` here with ``host_call`` made from a host thread at each of its
    lock acquisitions; returns the progress each host call saw and the final progress."""
    probe = HostProbe(store, progress)
    stop = False
    errors: list[BaseException] = []

    def host() -> None:
        try:
            while True:
                if not probe.go.acquire(timeout=WAIT):
                    raise AssertionError("the engine call never let the host go")
                if stop:
                    return
                probe.turn_started = True
                host_call()
                assert not probe.turn_started, "a host turn made no store call"
                probe.idle.release()
        except BaseException as exc:
            errors.append(exc)
            probe.arrived.release()  # unblock the engine; the error is raised below
            probe.idle.release()

    thread = threading.Thread(target=host, name="host")
    thread.start()
    store._lock = probe  # type: ignore[assignment]
    try:
        engine_call()
    finally:
        store._lock = probe.real
        stop = True
        probe.go.release()
        thread.join(timeout=WAIT)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    assert len(probe.seen) == probe.engine_acquisitions  # every host call got in
    return probe.seen, progress(store)


def steps(seen: list[int], final: int) -> list[int]:
    """Engine work done between consecutive host turns (from 0 to the end of the call)."""
    marks = [0, *seen, final]
    return [b - a for a, b in itertools.pairwise(marks)]


def pinned(store: BlockStore) -> int:
    return int(store._pin_count.sum())


def full_store(n: int, **kw: Any) -> BlockStore:
    """n blocks holding keys 0..n-1, all unpinned (filled by one reserve + commit_many)."""
    store = BlockStore(n + 8, L, **kw)
    slots = store.reserve("fill", n)
    store.commit_many("fill", slots, [key(i) for i in range(n)])
    return store


# ------------------------------------------------------------------ the bound


def test_a_big_pin_lets_the_host_in_after_at_most_one_batch() -> None:
    store = full_store(N)
    keys = [key(i) for i in range(N)]
    out: list[int | None] = []
    seen, final = with_host_probe(
        store, pinned, lambda: out.extend(store.pin("o", keys)), lambda: store.get(key(7))
    )
    assert final == N and None not in out and store.pins_of("o") == N
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)


@pytest.mark.parametrize("how", ["unpin", "unpin_keys", "release_owner"])
def test_a_big_unpin_lets_the_host_in_after_at_most_one_batch(how: str) -> None:
    store = full_store(N)
    slots = store.pin("o", [key(i) for i in range(N)])
    calls: dict[str, Callable[[], object]] = {
        "unpin": lambda: store.unpin("o"),
        "unpin_keys": lambda: store.unpin_keys("o", slots),  # type: ignore[arg-type]
        "release_owner": lambda: store.release_owner("o", quarantine_until=None),
    }
    seen, final = with_host_probe(
        store, lambda s: N - pinned(s), calls[how], lambda: store.put(key(3), bytes(L))
    )
    assert final == N and store.pins_of("o") == 0
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)
    store._check_invariants()


class CountingKeys(Sequence[bytes]):
    """A key list that counts how many keys the store has read from it."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.read = 0

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: Any) -> Any:
        out = self.keys[i]
        self.read += len(out) if isinstance(i, slice) else 1
        return out


def test_a_big_present_lets_the_host_in_after_at_most_one_batch() -> None:
    store = full_store(N)
    keys = CountingKeys([key(i) for i in range(0, 2 * N, 2)])  # every other key is absent
    out: list[bool] = []
    seen, final = with_host_probe(
        store, lambda s: keys.read, lambda: out.extend(store.present(keys)), lambda: store.get(b"x")
    )
    assert out == [i < N for i in range(0, 2 * N, 2)]
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)


def reserved(store: BlockStore) -> int:
    return store._n_reserved


def test_a_big_reserve_and_commit_let_the_host_in_after_at_most_one_batch() -> None:
    store = full_store(N)  # reserve must evict nearly every block
    slots: list[int] = []
    seen, final = with_host_probe(
        store, reserved, lambda: slots.extend(store.reserve("f", N)), lambda: store.get(key(1))
    )
    assert final == N and len(set(slots)) == N
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)

    fresh = [b"new%d" % i for i in range(N)]
    committed: list[bool] = []
    seen, final = with_host_probe(
        store,
        lambda s: N - reserved(s),
        lambda: committed.extend(store.commit_many("f", slots, fresh)),
        lambda: store.get(fresh[0]),
    )
    assert final == N and all(committed) and store.present(fresh) == [True] * N
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)
    store._check_invariants()


def test_a_host_put_between_a_big_reserves_batches_finds_the_claimed_slots_taken() -> None:
    """A reserve of every slot, in 4 batches, with a host put between each two: the slots
    the reserve promised itself count as taken, so each put is refused (StoreFull) and the
    reserve gets them all. Counting only the free ones let a put take a promised slot,
    and a later batch of the reserve evicted the block the host had just stored."""
    store = BlockStore(8, L, batch_keys=2)
    slots: list[int] = []
    refused: list[bool] = []
    n = itertools.count()

    def put() -> None:
        try:
            store.put(key(next(n)), bytes(L))
        except StoreFull:
            refused.append(True)
        else:
            refused.append(False)

    with_host_probe(store, reserved, lambda: slots.extend(store.reserve("f", 8)), put)
    assert sorted(slots) == list(range(8))
    assert refused == [True] * 4, refused
    assert store.statistics().evictions == 0 and not store.keys()
    store._check_invariants()


class Interrupted(BaseException):
    """Stands in for an interrupt (``KeyboardInterrupt``) that lands between batches."""


def test_a_reserve_interrupted_between_batches_gives_back_its_slots_and_its_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reserve of 6 slots in batches of 2, interrupted as its second batch offers the
    GIL: the 2 slots it took are free again, its claim on the other 4 is gone (every slot
    can be put again), and nothing is left reserved."""
    store = BlockStore(8, L, batch_keys=2)
    for i in range(4):
        store.put(key(i), bytes([i]) * L)
    offers: list[float] = []

    def offer(seconds: float) -> None:
        offers.append(seconds)
        if len(offers) == 2:
            raise Interrupted

    monkeypatch.setattr(store_module, "_yield_gil", offer)
    monkeypatch.setattr(store_module, "_clock", TickClock(store_module.GIL_OFFER_AFTER_S))
    with pytest.raises(Interrupted):
        store.reserve("f", 6)
    stats = store.statistics()
    assert (stats.used, stats.free, stats.reserved, stats.evictions) == (4, 4, 0, 0)
    assert store._reserved_by("f") == []
    store._check_invariants()
    for i in range(4, 12):  # 4 free slots, then evicting the 4 blocks
        store.put(key(i), bytes([i]) * L)
    assert sorted(store.keys()) == [key(i) for i in range(4, 12)]


def small_calls(store: BlockStore) -> dict[str, Callable[[], object]]:
    """One engine-side call of each kind that takes the scalar path (a few keys or slots),
    on a store that holds keys 0..3, owner "o"'s pin on key 0 and its reservation of 6
    slots: each call's arguments are valid for it, so each reaches its lock section."""
    slots = store._reserved_by("o")
    return {
        "pin": lambda: store.pin("o", [key(1), key(2)]),
        "unpin": lambda: store.unpin("o"),
        "unpin_keys": lambda: store.unpin_keys("o", [0]),
        "present": lambda: store.present([key(1), key(9)]),
        "reserve": lambda: store.reserve("r", 2),
        "commit": lambda: store.commit("o", slots[0], b"new"),
        "commit_many": lambda: store.commit_many("o", slots[:2], [b"n1", b"n2"]),
        "release_reserved": lambda: store.release_reserved("o", slots[:2]),
        "quarantine": lambda: store.quarantine("o", slots[:2], until=1.0),
    }


def small_call_store() -> BlockStore:
    store = BlockStore(12, L)
    for i in range(4):
        store.put(key(i), bytes([i]) * L)
    store.pin("o", [key(0)])
    store.reserve("o", 6)
    return store


def unlocked_state(store: BlockStore) -> object:
    """What the calls of ``small_calls`` change, read without the store's locks."""
    return (
        store._state.tobytes(),
        store._pin_count.tobytes(),
        store._owner.tobytes(),
        list(store._map.items()),
        {owner: pins.total for owner, pins in store._pins.items()},
        list(store._quarantine.items()),
        store._n_free,
    )


class TurnWatch(LockStandIn):
    """Stands in for ``store._turn``: tells when a thread other than ``host`` asks for it
    (``asked``) before it blocks on the real lock."""

    def __init__(self, real: Any, host: int) -> None:
        self.real = real
        self.host = host
        self.asked = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.get_ident() != self.host:
            self.asked.set()
        return bool(self.real.acquire(blocking, timeout))


@pytest.mark.parametrize("how", list(small_calls(BlockStore(1, L))))
def test_a_scalar_path_call_lets_a_waiting_host_call_in_before_its_lock_section(
    how: str,
) -> None:
    """A host call holds ``_turn`` while it waits for ``_lock``; an engine call of a few
    keys (one lock section, the scalar path) must wait for it before it takes ``_lock``,
    as an array-path batch does: without the hand-over the engine thread, holding the GIL,
    takes the unfair lock again before the woken host runs. Here this thread plays the
    waiting host: it holds ``_turn`` until the engine's call has asked for it, and the
    call must have done nothing by then."""
    store = small_call_store()
    call = small_calls(store)[how]
    before = unlocked_state(store)
    watch = TurnWatch(store._turn, threading.get_ident())
    store._turn = watch  # type: ignore[assignment]
    errors: list[BaseException] = []

    def engine() -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=engine, name="engine")
    with watch:  # the waiting host call
        thread.start()
        asked = watch.asked.wait(WAIT)
        unchanged = unlocked_state(store) == before
    thread.join(timeout=WAIT)
    assert not thread.is_alive() and not errors, errors
    assert asked, f"{how} of a few keys never let the waiting host call in"
    assert unchanged, f"{how} changed the store before the waiting host call got in"
    store._check_invariants()


@pytest.mark.parametrize("how", list(small_calls(BlockStore(1, L))))
def test_a_scalar_path_call_interrupted_waiting_for_the_lock_holds_no_lock(how: str) -> None:
    """An interrupt (``KeyboardInterrupt`` in the main thread) that lands while an engine
    call of a few keys waits for ``_lock`` leaves no lock held and changes nothing: the
    next engine call runs, where a ``_serial`` left held would block every later one."""
    store = small_call_store()
    call = small_calls(store)[how]
    before = repr(observe(store))
    real = store._lock

    class InterruptedLock:
        """FAKE store lock: its first acquire raises (an interrupt), then the real one."""

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            store._lock = real  # once
            raise Interrupted

        def __enter__(self) -> bool:
            return self.acquire()

        def __exit__(self, *exc: object) -> None:
            raise AssertionError("never entered")

    store._lock = InterruptedLock()  # type: ignore[assignment]
    with pytest.raises(Interrupted):
        call()
    assert not store._serial.locked(), f"{how} left _serial held"
    assert not store._turn.locked() and not real.locked()
    assert repr(observe(store)) == before
    call()  # runs: nothing is left held
    store._check_invariants()


@pytest.mark.parametrize("how", ["release_reserved", "quarantine", "release_owner"])
def test_settling_a_big_reservation_lets_the_host_in_after_at_most_one_batch(how: str) -> None:
    store = BlockStore(N + 8, L)
    slots = store.reserve("f", N)
    calls: dict[str, Callable[[], object]] = {
        "release_reserved": lambda: store.release_reserved("f", slots),
        "quarantine": lambda: store.quarantine("f", slots, until=1.0),
        "release_owner": lambda: store.release_owner("f", quarantine_until=None),
    }
    seen, final = with_host_probe(
        store, lambda s: N - reserved(s), calls[how], lambda: store.put(b"h", bytes(L))
    )
    assert final == N
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)
    store._check_invariants()


@pytest.mark.parametrize("how", ["release_quarantined", "unquarantine"])
def test_ending_a_big_quarantine_lets_the_host_in_after_at_most_one_batch(how: str) -> None:
    store = BlockStore(N + 8, L)
    slots = store.reserve("f", N)
    store.quarantine("f", slots, until=1.0)
    calls: dict[str, Callable[[], object]] = {
        "release_quarantined": lambda: store.release_quarantined(1.0),
        "unquarantine": lambda: store.unquarantine(slots),
    }
    seen, final = with_host_probe(
        store, lambda s: N - len(s._quarantine), calls[how], lambda: store.get(b"h")
    )
    assert final == N and store.statistics().free == N + 8
    assert max(steps(seen, final)) <= HOST_WAIT_KEYS, steps(seen, final)
    store._check_invariants()


def test_batch_keys_sets_the_bound() -> None:
    store = full_store(1_000, batch_keys=100)
    keys = [key(i) for i in range(1_000)]
    seen, _ = with_host_probe(store, pinned, lambda: store.pin("o", keys), lambda: store.get(b"x"))
    assert seen == list(range(100, 1_001, 100))  # one host turn after every 100 keys
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            BlockStore(4, L, batch_keys=bad)  # type: ignore[arg-type]


class TickClock:
    """A fake ``store._clock``: each reading is ``step`` seconds after the one before."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_long_engine_call_offers_the_gil_at_its_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host thread that lost the GIL to the switch interval holds no store lock, so only
    the engine dropping the GIL lets it back in before the interval ends: a call that has
    run for GIL_OFFER_AFTER_S offers it at its next batch (bench/store_lock.py shows what it
    does to the host's p99). Here every clock reading is that long after the last one."""
    store = full_store(1_000, batch_keys=100)
    offers: list[float] = []
    monkeypatch.setattr(store_module, "_yield_gil", offers.append)
    monkeypatch.setattr(store_module, "_clock", TickClock(store_module.GIL_OFFER_AFTER_S))
    keys = [key(i) for i in range(1_000)]
    store.pin("o", keys)
    assert len(offers) == 10 and set(offers) == {0}  # one per batch of 100 keys
    offers.clear()
    store.unpin("o")
    assert len(offers) == 10


def test_a_short_engine_call_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``time.sleep(0)`` sleeps ~55 us on Linux (the timer slack): a call that ends within
    GIL_OFFER_AFTER_S, however many batches it has, must not pay it. The clock here
    advances a tenth of that per reading, so 1,000 keys in 10 batches offer nothing and
    a 100-batch call offers the GIL a few times (about every 0.5 ms of its time)."""
    store = full_store(1_000, batch_keys=100)
    small = full_store(1_000, batch_keys=1)  # 1,000 batches per 1,000-key call
    offers: list[float] = []
    monkeypatch.setattr(store_module, "_yield_gil", offers.append)
    monkeypatch.setattr(store_module, "_clock", TickClock(store_module.GIL_OFFER_AFTER_S / 100))
    keys = [key(i) for i in range(1_000)]
    assert store.pin("o", keys[:100]) == list(range(100))  # one batch
    store.unpin("o")
    assert offers == []
    store.pin("o", keys)  # ten batches, each a hundredth of the offer interval
    assert offers == []
    store.unpin("o")
    small.pin("o", keys)
    assert 5 <= len(offers) <= 20  # 2,000 readings of 1/100 interval: about one per 50


# ------------------------------------------------------------------ one thread sees no batches


def observe(store: BlockStore) -> tuple[object, ...]:
    """Everything a caller can see, plus the LRU order and the pins (which pick the next
    eviction and the next unpin's order)."""
    return (
        store.statistics(),
        {k: store.slot_of(k) for k in list(store.keys())},
        store._lru_keys(),
        {o: list(p.counts().items()) for o, p in store._pins.items()},
        sorted(store._quarantine.items()),
        store.array.tobytes(),
    )


def attempt(store: BlockStore, call: tuple[str, tuple[Any, ...], dict[str, Any]]) -> object:
    name, args, kwargs = call
    try:
        out = getattr(store, name)(*args, **kwargs)
    except (ValueError, TypeError, StoreFull) as exc:
        return type(exc)
    return bytes(out) if isinstance(out, memoryview) else out


def test_unpin_returns_keys_to_the_lru_in_the_order_they_were_pinned() -> None:
    """However many batches an unpin takes, the first key pinned is the first evicted."""
    store = BlockStore(10, L, batch_keys=3)
    for i in range(10):
        store.put(key(i), bytes(L))
    order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]
    store.pin("o", [key(i) for i in order])
    store.unpin("o")
    assert store.reserve("r", 10) == order  # evicted LRU first; slot i held key i


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_batch_size_changes_nothing_a_single_thread_can_see(data: st.DataObject) -> None:
    """The same calls on stores that differ only in batch_keys (1, 2, the default) give the
    same answers and leave the same state, LRU order included: batching only adds places
    where another thread may get in."""
    n, length = 12, 8
    stores = [BlockStore(n, length, batch_keys=1), BlockStore(n, length, batch_keys=2)]
    stores.append(BlockStore(n, length))
    first = stores[0]
    keys = st.sampled_from([b"k%d" % i for i in range(10)])
    key_lists = st.lists(keys, max_size=8)
    slot_lists = st.lists(st.integers(0, n - 1), max_size=6)
    now = 0.0
    for _ in range(data.draw(st.integers(1, 40), label="calls")):
        owner = data.draw(st.sampled_from(["a", "b"]))
        mine = first._reserved_by(owner)
        # Mostly the owner's own reservations, sometimes a slot it does not hold.
        any_slot = st.integers(0, n - 1)
        settle_slots = st.lists(st.sampled_from(mine) | any_slot if mine else any_slot, max_size=6)
        op = data.draw(st.integers(0, 12))
        args: tuple[Any, ...]
        kwargs: dict[str, Any] = {}
        if op == 0:
            name, args = "put", (data.draw(keys), bytes([data.draw(st.integers(0, 255))]) * length)
        elif op <= 2:
            name, args = ("get", "evict")[op - 1], (data.draw(keys),)
        elif op == 3:
            name, args = "pin", (owner, data.draw(key_lists))
        elif op == 4:
            name, args = "unpin", (owner,)
        elif op == 5:
            name, args = "unpin_keys", (owner, data.draw(slot_lists))
        elif op == 6:
            name, args = "present", (data.draw(key_lists),)
        elif op == 7:
            name, args = "reserve", (owner, data.draw(st.integers(0, 6)))
        elif op == 8:
            slots = data.draw(settle_slots)
            for s in stores:  # the "transfer" lands the same bytes in every store
                for i, slot in enumerate(slots):
                    s.array[slot * length : (slot + 1) * length] = 100 + i
            ks = data.draw(st.lists(keys, min_size=len(slots), max_size=len(slots)))
            name, args = "commit_many", (owner, slots, ks)
        elif op == 9:
            until = now + data.draw(st.sampled_from([0.0, 1.0, 2.0]))
            slots = data.draw(settle_slots)
            name, args = ("release_reserved", (owner, slots))
            if data.draw(st.booleans()):
                name, args = "quarantine", (owner, slots, until)
        elif op == 10:
            now += data.draw(st.sampled_from([0.0, 0.5, 1.0]))
            name, args = "release_quarantined", (now,)
        elif op == 11:
            name, args = "unquarantine", (data.draw(slot_lists),)
            if data.draw(st.booleans()):
                kwargs = {"owner": owner}
        else:
            name, args = "release_owner", (owner,)
            kwargs = {"quarantine_until": data.draw(st.sampled_from([None, now + 1.0]))}
        answers = [attempt(s, (name, args, kwargs)) for s in stores]
        assert answers[1:] == answers[:1] * 2, (name, answers)
        seen = [observe(s) for s in stores]
        assert seen[1:] == seen[:1] * 2, name
        deadlines = [s.next_quarantine_deadline() for s in stores]
        assert deadlines[1:] == deadlines[:1] * 2
    for s in stores:
        s._check_invariants()


# ------------------------------------------------------------------ what happens between batches


def block(tag: int, version: int, length: int = 64) -> bytes:
    """A block that names its key (tag) and its put (version): torn bytes show."""
    return (tag.to_bytes(2, "big") + version.to_bytes(6, "big")) * (length // 8)


def tag_of(data: bytes | memoryview) -> int:
    data = bytes(data)
    assert data == data[:8] * (len(data) // 8), "torn block"
    return int.from_bytes(data[:2], "big")


def test_host_calls_between_every_batch_keep_pins_and_invariants() -> None:
    """At every batch boundary of every engine call the host puts, re-puts pinned keys,
    evicts and reads; pinned blocks never change, each pin hits its own key's block, pins
    are exact, and every internal structure agrees afterwards."""
    n, length, batch = 1_024, 64, 32
    store = BlockStore(n, length, batch_keys=batch)
    shared = [b"s%d" % i for i in range(600)]  # pinned by the engine, re-put by the host
    for i, k in enumerate(shared):
        store.put(k, block(i, 0, length))
    rng = random.Random(7)
    version = 0

    def host_turn() -> None:  # one burst of host work; StoreFull is an allowed answer
        nonlocal version
        for _ in range(4):
            version += 1
            i = rng.randrange(len(shared))
            op = rng.randrange(4)
            try:
                if op == 0:
                    store.put(shared[i], block(i, version, length))
                elif op == 1:
                    store.evict(shared[i])
                elif op == 2:
                    store.put(b"h%d" % rng.randrange(300), block(1000, version, length))
                else:
                    view = store.get(shared[i])
                    assert view is None or len(view) == length
            except StoreFull:
                pass

    def probed(call: Callable[[], object]) -> None:
        with_host_probe(store, lambda s: 0, call, host_turn)

    for rnd in range(6):
        owner: Hashable = ("session", rnd)
        keys = shared[rnd % 3 :: 1 + rnd % 2] * 2  # every key twice: two batches apart
        slots: list[int | None] = []
        probed(lambda: slots.extend(store.pin(owner, keys)))  # noqa: B023
        held = {s: bytes(store.view(s)) for s in slots if s is not None}
        for k, s in zip(keys, slots, strict=True):
            if s is not None:
                assert tag_of(held[s]) == shared.index(k), "a pin hit another key's block"
        assert store.pins_of(owner) == sum(s is not None for s in slots)

        incoming: list[int] = []
        with contextlib.suppress(StoreFull):
            probed(lambda: incoming.extend(store.reserve(owner, 200)))  # noqa: B023
        assert not set(incoming) & set(held)
        for j, s in enumerate(incoming):
            store.array[s * length : (s + 1) * length] = np.frombuffer(
                block(2000 + j, rnd, length), dtype=np.uint8
            )
        half = len(incoming) // 2
        fresh = [b"e%d.%d" % (rnd, j) for j in range(half)]
        probed(lambda: store.commit_many(owner, incoming[:half], fresh))  # noqa: B023
        probed(lambda: store.quarantine(owner, incoming[half:], until=rnd))  # noqa: B023
        probed(lambda: store.release_quarantined(float(rnd)))  # noqa: B023

        for s, data in held.items():
            assert bytes(store.view(s)) == data, "a pinned block changed"
        store._check_invariants()
        drop = [s for s in slots[: len(slots) // 2] if s is not None]
        probed(lambda: store.unpin_keys(owner, drop))  # noqa: B023
        assert store.pins_of(owner) == sum(s is not None for s in slots) - len(drop)
        probed(lambda: store.unpin(owner))  # noqa: B023
        assert store.pins_of(owner) == 0
        store._check_invariants()

    stats = store.statistics()
    assert stats.pinned == 0 and stats.reserved == 0 and stats.quarantined == 0
    assert stats.free + stats.used == n


def test_a_free_running_host_thread_never_sees_a_pinned_block_change() -> None:
    """The host puts, evicts and reads in a tight loop while the engine pins and unpins
    big batches; the engine asks for a full host pass (a queue, so no wake-up is lost)
    while it holds each round's pins."""
    n, length = 4_096, 64
    store = BlockStore(n, length, batch_keys=64)
    shared = [b"s%d" % i for i in range(2_048)]
    for i, k in enumerate(shared):
        store.put(k, block(i, 0, length))
    want: queue.Queue[int] = queue.Queue()
    done: queue.Queue[int] = queue.Queue()
    stop = threading.Event()

    def host() -> None:
        rng = random.Random(1)
        version = 0
        while not stop.is_set():
            try:
                rnd = want.get_nowait()
            except queue.Empty:
                rnd = -1
            for _ in range(64):
                version += 1
                i = rng.randrange(len(shared))
                try:
                    store.put(shared[i], block(i, version, length))
                    store.put(b"h%d" % rng.randrange(512), block(3000, version, length))
                except StoreFull:
                    pass
                store.evict(shared[rng.randrange(len(shared))])
                view = store.get(shared[rng.randrange(len(shared))])
                assert view is None or len(view) == length
            if rnd >= 0:
                done.put(rnd)

    def engine() -> None:
        for rnd in range(12):
            owner = ("session", rnd)
            slots = store.pin(owner, shared[rnd % 2 :: 1 + rnd % 3])
            held = {s: bytes(store.view(s)) for s in slots if s is not None}
            want.put(rnd)
            assert done.get(timeout=WAIT) == rnd, "host thread stalled"
            for s, data in held.items():
                assert bytes(store.view(s)) == data, "a pinned block changed"
            assert store.unpin(owner) == len([s for s in slots if s is not None])

    def engine_then_stop() -> None:
        try:
            engine()
        finally:
            stop.set()

    def wake_the_engine(_exc: BaseException) -> None:
        done.put(-1)  # an engine waiting for a host pass wakes up at once

    run_interleaved(host, engine_then_stop, on_error=wake_the_engine)
    store._check_invariants()
    stats = store.statistics()
    assert stats.pinned == 0 and stats.reserved == 0 and stats.free + stats.used == n
