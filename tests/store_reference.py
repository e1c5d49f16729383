"""The reference for ``tests/test_store_model.py``: the per-key BlockStore of commit 04a7d30
(lists, dicts and an OrderedDict LRU, one key at a time), which the vectorised store in
``p2pkv/store.py`` replaced. Its rules and module docstring are the ones ``p2pkv/store.py``
states; the one change is that ``release_owner`` settles the owner's reservations in slot
order (the old code took them in set order, which nothing promised), so that the two agree
on the free list's order too.
"""

from __future__ import annotations

import heapq
import math
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from itertools import islice
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from p2pkv.errors import StoreFull
from p2pkv.region import adopt_device_region, adopt_region, block_source, is_device_region
from p2pkv.transport.base import RegionLayout

__all__ = ["BATCH_KEYS", "BlockStore", "StoreStatistics"]

BATCH_KEYS: Final = 256
"""Keys (or slots) an engine-side call handles per lock section. Per key, pin and unpin
cost 0.4-0.6 us and reserve (evicting) or commit_many 0.6-0.8 us of CPU on the 2-core
development VM, so one section is 0.1-0.2 ms; 1,024 doubled the host's median wait in
``bench/store_lock.py`` and 64 cost engine throughput without shortening it."""

_FREE: Final = 0
_OCCUPIED: Final = 1
_RESERVED: Final = 2
_QUARANTINED: Final = 3


class _HostPut:
    """Owner of the slot a host ``put`` is copying into (never visible to callers)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<host put>"


_HOST_PUT: Final = _HostPut()
_ANY_OWNER: Final[Hashable] = object()
_NO_SLOTS: Final[frozenset[int]] = frozenset()


_yield_gil = time.sleep
_clock = time.perf_counter

GIL_OFFER_AFTER_S: Final = 0.5e-3
"""An engine-side call offers the GIL to other threads once it has run this long since it
began or last offered it (checked at each batch). ``time.sleep(0)`` is what lets a thread
that is waiting for the GIL in (``os.sched_yield`` does not), and on Linux it sleeps for
the timer slack, about 55 us; offering at every batch cost a 1,024-key lookup four of
those. A call shorter than this never sleeps; a long one sleeps ~55 us per 0.5 ms."""


class _Serial:
    """``with _Serial(store):`` one engine-side call: hold ``_serial`` from start to end
    and start the call's GIL-offer clock."""

    __slots__ = ("_store",)

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        store._serial.acquire()
        store._offered_at = _clock()

    def __exit__(self, *exc: object) -> None:
        self._store._serial.release()


class _Batch:
    """``with _Batch(store):`` one engine-side lock section, inside a ``_Serial`` call:
    first, if the call has run for :data:`GIL_OFFER_AFTER_S`, drop the GIL for a moment;
    then let in a host call that is waiting (it holds ``_turn``); then hold ``_lock``.
    (A host section is simply ``with store._turn, store._lock:``.)"""

    __slots__ = ("_store",)

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        # A host thread that the interpreter's switch interval took the GIL from (it holds
        # no store lock, so _turn cannot help it) gets it back here, within about
        # GIL_OFFER_AFTER_S of engine work, instead of after the whole switch interval.
        now = _clock()
        if now - store._offered_at >= GIL_OFFER_AFTER_S:
            _yield_gil(0)
            store._offered_at = _clock()
        turn = store._turn
        turn.acquire()
        turn.release()
        store._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._store._lock.release()


@attrs.frozen
class StoreStatistics:
    num_blocks: int
    block_len: int
    used: int  # OCCUPIED slots, including orphaned pinned ones
    free: int
    pinned: int  # slots with pin count > 0
    reserved: int
    quarantined: int
    evictions: int  # blocks dropped to make room (explicit evict() is not counted)


class BlockStore:
    """``num_blocks`` slots of ``block_len`` bytes plus the map key -> slot. Thread-safe.

    ``region`` is ``None`` (a page-aligned zeroed NumPy buffer is allocated), or memory the
    host hands in: a NumPy array, a torch CPU tensor, or any writable C-contiguous buffer
    (bytearray, memoryview, mmap) of at least ``num_blocks * block_len`` bytes. It is used
    in place, never copied: ``self.array`` is a flat uint8 view over exactly the first
    ``num_blocks * block_len`` bytes, and ``self.region`` keeps the original object alive.
    A contiguous torch CUDA tensor makes a device region (``device_region``; see the module
    docstring): no ``array``, and ``buffer`` is a flat uint8 CUDA view instead.

    ``batch_keys`` bounds the keys or slots an engine-side call handles per lock section,
    hence how long a host call can wait for one (see the module docstring).
    """

    def __init__(
        self,
        num_blocks: int,
        block_len: int,
        region: object | None = None,
        *,
        batch_keys: int = BATCH_KEYS,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_len", block_len),
            ("batch_keys", batch_keys),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        nbytes = num_blocks * block_len
        self.num_blocks: int = num_blocks
        self.block_len: int = block_len
        self.batch_keys: int = batch_keys
        self.region: object
        self.device_region: bool = region is not None and is_device_region(region)
        self._array: npt.NDArray[np.uint8] | None = None
        self._tensor: Any = None
        self.buffer: object  # the flat uint8 view the data plane registers
        if self.device_region:
            self.region, self._tensor = adopt_device_region(region, nbytes)
            self.buffer = self._tensor
            self._base_addr = int(self._tensor.data_ptr())
            self._ro = memoryview(b"")
        else:
            self.region, self._array = adopt_region(region, nbytes)
            self.buffer = self._array
            self._base_addr = int(self._array.ctypes.data)
            self._ro = self._array.data.toreadonly()

        self._lock = threading.Lock()  # guards everything below
        self._turn = threading.Lock()  # held by a host call waiting for or holding _lock
        self._serial = threading.Lock()  # held by an engine-side call from start to end
        self._offered_at = 0.0  # when the engine-side call in progress began or offered the GIL
        self._state = [_FREE] * num_blocks
        self._slot_key: list[bytes | None] = [None] * num_blocks  # None: free/reserved/orphan
        self._pin_count = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack; pops slot 0 first
        self._map: dict[bytes, int] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # evictable keys, LRU first
        self._pins: dict[Hashable, dict[int, int]] = {}  # owner -> slot -> count
        self._pinned_slots = 0
        self._reserved: dict[int, Hashable] = {}  # slot -> owner
        self._reserved_by: dict[Hashable, set[int]] = {}  # owner -> slots
        self._claimed = 0  # free or evictable slots promised to a reserve() in progress
        self._quarantine: dict[int, tuple[float, Hashable]] = {}  # slot -> (until, owner)
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self._evictions = 0

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """The flat uint8 host view of the region (``TypeError`` for a device region)."""
        if self._array is None:
            raise TypeError("a device region has no host view: use get_tensor / view_tensor")
        return self._array

    @property
    def base_addr(self) -> int:
        """Address of byte 0 of the region (what the data plane registers)."""
        return self._base_addr

    @property
    def layout(self) -> RegionLayout:
        return RegionLayout(self._base_addr, self.num_blocks, self.block_len)

    # ------------------------------------------------------------------ host-facing

    def put(self, key: bytes, data: object) -> int:
        """Store ``data`` (exactly ``block_len`` bytes, any buffer) as ``key``'s block.

        Returns the slot. An unpinned existing block is overwritten in place; a pinned one
        is left untouched (its readers keep their bytes) and the key moves to a new slot.
        Raises :class:`StoreFull`, with nothing changed, if no slot can be freed (slots
        claimed by a :meth:`reserve` in progress count as taken).
        """
        _check_key(key)
        src: Any = (
            _device_source(data, self.block_len)
            if self.device_region
            else block_source(data, self.block_len)
        )
        with self._turn, self._lock:
            self._check_room_locked(1, "put")
            slot = self._map.get(key)
            if slot is not None and self._pin_count[slot] == 0:
                # In place: unmap first, so nobody can read or pin it half-written.
                del self._map[key]
                del self._lru[key]
                self._slot_key[slot] = None
            else:
                slot = self._allocate_locked(1)[0]
            self._reserve_locked(slot, _HOST_PUT)
        try:
            start = slot * self.block_len
            if self._array is not None:
                self._array[start : start + self.block_len] = src
            else:
                self._tensor[start : start + self.block_len].copy_(src)
                _torch().cuda.current_stream(self._tensor.device).synchronize()
        except BaseException:
            with self._turn, self._lock:
                self._unreserve_locked(slot)
                self._free_locked(slot)
            raise
        with self._turn, self._lock:
            self._unreserve_locked(slot)
            self._publish_locked(slot, key)
        return slot

    def get(self, key: bytes) -> memoryview | None:
        """Read-only view of ``key``'s block (no copy), or None; marks it recently used."""
        self._host_only("get")
        slot = self._touch(key)
        if slot is None:
            return None
        start = slot * self.block_len
        return self._ro[start : start + self.block_len]

    def get_tensor(self, key: bytes) -> Any | None:
        """Device region: a uint8 CUDA tensor view of ``key``'s block (no copy), or None;
        marks it recently used."""
        slot = self._touch(key)
        return None if slot is None else self.view_tensor(slot)

    def view_tensor(self, slot: int) -> Any:
        """Device region: a uint8 CUDA tensor view of one slot, whatever its state."""
        if self._tensor is None:
            raise TypeError("a host region has no CUDA view: use get / view")
        self._check_slot(slot)
        start = slot * self.block_len
        return self._tensor[start : start + self.block_len]

    def _touch(self, key: bytes) -> int | None:
        with self._turn, self._lock:
            slot = self._map.get(key)
            if slot is not None and self._pin_count[slot] == 0:
                self._lru.move_to_end(key)
            return slot

    def _host_only(self, op: str) -> None:
        if self.device_region:
            raise TypeError(f"{op}: a device region has no host view; use {op}_tensor")

    def __contains__(self, key: object) -> bool:
        with self._turn, self._lock:
            return isinstance(key, bytes) and key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def slot_of(self, key: bytes) -> int | None:
        with self._turn, self._lock:
            return self._map.get(key)

    def view(self, slot: int) -> memoryview:
        """Read-only view of one slot's bytes, whatever its state."""
        self._host_only("view")
        self._check_slot(slot)
        start = slot * self.block_len
        return self._ro[start : start + self.block_len]

    def keys(self) -> list[bytes]:
        with self._turn, self._lock:
            return list(self._map)

    def evict(self, key: bytes) -> bool:
        """Drop ``key``'s block. False (nothing done) if it is absent or pinned."""
        with self._turn, self._lock:
            slot = self._map.get(key)
            if slot is None or self._pin_count[slot]:
                return False
            del self._map[key]
            del self._lru[key]
            self._free_locked(slot)
            return True

    def pins_of(self, owner: Hashable) -> int:
        with self._turn, self._lock:
            return sum(self._pins.get(owner, {}).values())

    def statistics(self) -> StoreStatistics:
        with self._turn, self._lock:
            free = len(self._free)
            reserved = len(self._reserved)
            quarantined = len(self._quarantine)
            return StoreStatistics(
                num_blocks=self.num_blocks,
                block_len=self.block_len,
                used=self.num_blocks - free - reserved - quarantined,
                free=free,
                pinned=self._pinned_slots,
                reserved=reserved,
                quarantined=quarantined,
                evictions=self._evictions,
            )

    # ---------------------------------------------------------------- engine-facing
    # Each method holds _serial throughout and _lock once per batch (module docstring).

    def pin(self, owner: Hashable, keys: Sequence[bytes]) -> list[int | None]:
        """Pin each present key once more for ``owner``; its slot, or None if absent.

        A pinned slot is never evicted, overwritten or reused until unpinned. Each key is
        pinned atomically; the call as a whole is not (module docstring).
        """
        out: list[int | None] = []
        append = out.append
        lookup, lru, pin_count, pins = self._map.get, self._lru, self._pin_count, self._pins
        step = self.batch_keys
        it = iter(keys)
        with _Serial(self):
            for _ in range(0, len(keys), step):
                with _Batch(self):
                    counts = pins.get(owner)
                    if counts is None:
                        counts = {}
                    count = counts.get
                    newly = 0
                    try:
                        for key in islice(it, step):
                            slot = lookup(key)
                            if slot is not None:
                                held = pin_count[slot]
                                if not held:
                                    del lru[key]
                                    newly += 1
                                pin_count[slot] = held + 1
                                counts[slot] = count(slot, 0) + 1
                            append(slot)
                    finally:
                        self._pinned_slots += newly
                        if counts:
                            pins[owner] = counts
        return out

    def unpin(self, owner: Hashable) -> int:
        """Release every pin ``owner`` holds; returns how many were released."""
        with _Serial(self):
            return self._unpin_serial(owner)

    def unpin_keys(self, owner: Hashable, slots: Sequence[int]) -> int:
        """Release one of ``owner``'s pins per listed slot; returns how many were released.

        Slots ``owner`` does not pin (any more) are ignored.
        """
        released = 0
        step = self.batch_keys
        it = iter(slots)
        with _Serial(self):
            for _ in range(0, len(slots), step):
                with _Batch(self):
                    counts = self._pins.get(owner)
                    if not counts:
                        break
                    drop: list[tuple[int, int]] = []
                    for slot in islice(it, step):
                        held = counts.get(slot)
                        if not held:
                            continue
                        if held == 1:
                            del counts[slot]
                        else:
                            counts[slot] = held - 1
                        drop.append((slot, 1))
                    if not counts:
                        del self._pins[owner]
                    released += self._drop_pins_locked(drop)
        return released

    def reserve(self, owner: Hashable, n: int) -> list[int]:
        """``n`` slots for incoming writes, all or nothing: free slots first, then
        evicting least recently used unpinned blocks. StoreFull, nothing changed, if the
        store cannot supply ``n``."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        out: list[int] = []
        first = True
        state, reserved = self._state, self._reserved
        with _Serial(self):
            try:
                while first or len(out) < n:
                    with _Batch(self):
                        if first:
                            self._check_room_locked(n, "reserve")
                            self._claimed = n  # host puts now count these n as taken
                            first = False
                        take = min(n - len(out), self.batch_keys)
                        self._claimed -= take
                        slots = self._allocate_locked(take)
                        if slots:
                            for slot in slots:
                                state[slot] = _RESERVED
                            reserved.update(dict.fromkeys(slots, owner))
                            self._reserved_by.setdefault(owner, set()).update(slots)
                    out += slots
            except BaseException:
                with _Batch(self):
                    self._claimed = 0
                    for slot in out:
                        self._unreserve_locked(slot)
                        self._free_locked(slot)
                raise
        return out

    def commit(self, owner: Hashable, slot: int, key: bytes) -> bool:
        """Publish a slot reserved by ``owner`` (now holding the block) as ``key``'s block.

        If ``key`` is already present the existing block is kept (keys are content hashes),
        the slot is freed and False is returned. ValueError if ``owner`` does not hold the
        reservation.
        """
        _check_key(key)
        with _Serial(self), _Batch(self):
            if slot not in self._reserved_by.get(owner, _NO_SLOTS):
                raise ValueError(f"slot {slot!r} is not reserved by {owner!r}")
            self._unreserve_locked(slot)
            if key in self._map:
                self._free_locked(slot)
                return False
            self._publish_locked(slot, key)
            return True

    def commit_many(
        self, owner: Hashable, slots: Sequence[int], keys: Sequence[bytes]
    ) -> list[bool]:
        """:meth:`commit` for a batch (the landing of a fetch).

        All or nothing: ValueError or TypeError (nothing changed) if a key is not
        non-empty bytes, a slot is listed twice or any slot is not reserved by ``owner``.
        """
        if len(slots) != len(keys):
            raise ValueError("slots and keys differ in length")
        for key in keys:
            if not isinstance(key, bytes) or not key:
                _check_key(key)
        if len(set(slots)) != len(slots):
            raise ValueError("a slot is listed twice (a slot commits once)")
        out: list[bool] = []
        append = out.append
        key_map, slot_key, state, lru = self._map, self._slot_key, self._state, self._lru
        reserved, free = self._reserved, self._free
        step = self.batch_keys
        pairs = zip(slots, keys, strict=True)
        with _Serial(self):
            self._check_reserved_serial(owner, slots)
            for _ in range(0, len(slots), step):
                with _Batch(self):
                    mine = self._reserved_by[owner]
                    for slot, key in islice(pairs, step):
                        del reserved[slot]
                        mine.remove(slot)
                        if key in key_map:  # keys are content hashes: keep the block we have
                            state[slot] = _FREE
                            slot_key[slot] = None
                            free.append(slot)
                            append(False)
                        else:
                            key_map[key] = slot
                            slot_key[slot] = key
                            state[slot] = _OCCUPIED
                            lru[key] = None
                            append(True)
                    if not mine:
                        del self._reserved_by[owner]
        return out

    def present(self, keys: Iterable[bytes]) -> list[bool]:
        """``key in store`` for each key, as of that key's batch."""
        out: list[bool] = []
        contains = self._map.__contains__
        step = self.batch_keys
        it = iter(keys)
        with _Serial(self):
            while True:
                with _Batch(self):
                    before = len(out)
                    out += map(contains, islice(it, step))
                if len(out) - before < step:
                    return out

    def release_reserved(self, owner: Hashable, slots: Sequence[int]) -> None:
        """Reserved slots whose transfer settled without a block go back to FREE.

        All or nothing: ValueError if any slot is not reserved by ``owner``.
        """
        self._settle(owner, slots, None)

    def quarantine(self, owner: Hashable, slots: Sequence[int], until: float) -> None:
        """Reserved slots whose transfer did not settle stay unusable until ``until`` (a
        value of the caller's clock) or :meth:`unquarantine`.

        All or nothing: ValueError if any slot is not reserved by ``owner``.
        """
        _check_until(until)
        self._settle(owner, slots, until)

    def release_quarantined(self, now: float) -> int:
        """Free every quarantined slot whose deadline is ``<= now``; returns how many."""
        released = 0
        more = True
        with _Serial(self):
            while more:
                with _Batch(self):
                    heap, quarantine = self._deadlines, self._quarantine
                    for _ in range(self.batch_keys):
                        if not heap or heap[0][0] > now:
                            more = False
                            break
                        until, slot = heapq.heappop(heap)
                        entry = quarantine.get(slot)
                        if entry is not None and entry[0] == until:
                            del quarantine[slot]
                            self._free_locked(slot)
                            released += 1
        return released

    def unquarantine(self, slots: Sequence[int], *, owner: Hashable = _ANY_OWNER) -> None:
        """The data plane confirmed these slots quiescent: quarantined -> FREE.

        Slots no longer quarantined (a deadline already freed them) are ignored, so a late
        confirmation is harmless. Pass ``owner`` to free only slots it quarantined: then a
        confirmation that arrives after the slot was reused and quarantined again by
        someone else cannot cut that second quarantine short.
        """
        any_owner = owner is _ANY_OWNER
        step = self.batch_keys
        it = iter(slots)
        with _Serial(self):
            for _ in range(0, len(slots), step):
                with _Batch(self):
                    quarantine = self._quarantine
                    for slot in islice(it, step):
                        self._check_slot(slot)
                        entry = quarantine.get(slot)
                        if entry is not None and (any_owner or entry[1] == owner):
                            del quarantine[slot]
                            self._free_locked(slot)
            if len(self._deadlines) > 2 * len(self._quarantine) + 64:
                # Only engine-side calls touch these two, and _serial excludes them all.
                heap = [(u, s) for s, (u, _) in self._quarantine.items()]
                heapq.heapify(heap)
                with _Batch(self):
                    self._deadlines = heap

    def next_quarantine_deadline(self) -> float | None:
        """The earliest deadline of a quarantined slot, or None if none is quarantined."""
        with _Serial(self):
            while True:
                with _Batch(self):
                    heap, quarantine = self._deadlines, self._quarantine
                    for _ in range(self.batch_keys):
                        if not heap:
                            return None
                        until, slot = heap[0]
                        entry = quarantine.get(slot)
                        if entry is not None and entry[0] == until:
                            return until
                        heapq.heappop(heap)

    def release_owner(self, owner: Hashable, *, quarantine_until: float | None) -> None:
        """Session teardown: drop all of ``owner``'s pins; its reserved slots are freed
        (``quarantine_until`` None) or quarantined until ``quarantine_until``."""
        if quarantine_until is not None:
            _check_until(quarantine_until)
        with _Serial(self):
            self._unpin_serial(owner)
            while True:
                with _Batch(self):
                    mine = self._reserved_by.get(owner)
                    if not mine:
                        break
                    for slot in sorted(mine)[: self.batch_keys]:
                        mine.remove(slot)
                        del self._reserved[slot]
                        if quarantine_until is None:
                            self._free_locked(slot)
                        else:
                            self._quarantine_locked(slot, owner, quarantine_until)
                    if not mine:
                        del self._reserved_by[owner]

    def __repr__(self) -> str:
        return f"<BlockStore {self.num_blocks}x{self.block_len} keys={len(self._map)}>"

    # ------------------------------------------------------------------ internals

    def _check_room_locked(self, n: int, op: str) -> None:
        # Every slot is FREE, OCCUPIED-evictable (in the LRU), or untouchable, so this
        # check is exact: either all n can be found or the caller changes nothing.
        if n > len(self._free) + len(self._lru) - self._claimed:
            claimed = f", {self._claimed} claimed by a reserve in progress" * bool(self._claimed)
            raise StoreFull(
                f"need {n} slots, {len(self._free)} free and {len(self._lru)} evictable "
                f"of {self.num_blocks}{claimed}; the rest are pinned, reserved or quarantined",
                op=op,
            )

    def _allocate_locked(self, n: int) -> list[int]:
        """n slots, free ones first, then evicting; the caller checked the room."""
        free = self._free
        k = min(n, len(free))
        out = free[len(free) - k :]
        out.reverse()  # the order pop() would give
        del free[len(free) - k :]
        if k < n:
            lru, key_map, slot_key = self._lru, self._map, self._slot_key
            popitem = lru.popitem
            for _ in range(n - k):
                key, _ = popitem(last=False)
                slot = key_map.pop(key)
                slot_key[slot] = None
                out.append(slot)
            self._evictions += n - k
        return out

    def _reserve_locked(self, slot: int, owner: Hashable) -> None:
        self._state[slot] = _RESERVED
        self._reserved[slot] = owner
        self._reserved_by.setdefault(owner, set()).add(slot)

    def _unreserve_locked(self, slot: int) -> None:
        # The caller moves the slot on to its next state.
        owner = self._reserved.pop(slot)
        slots = self._reserved_by[owner]
        slots.discard(slot)
        if not slots:
            del self._reserved_by[owner]

    def _check_reserved_serial(self, owner: Hashable, slots: Sequence[int]) -> None:
        """ValueError unless ``owner`` reserves every slot. Batched; the answer stays
        true after it because only ``owner``'s own calls change that, and the caller holds
        ``_serial``."""
        it = iter(slots)
        while batch := list(islice(it, self.batch_keys)):
            with _Batch(self):
                held = self._reserved_by.get(owner, _NO_SLOTS)
                if not held.issuperset(batch):
                    bad = next(slot for slot in batch if slot not in held)
                    raise ValueError(f"slot {bad!r} is not reserved by {owner!r}")

    def _settle(self, owner: Hashable, slots: Sequence[int], until: float | None) -> None:
        """Reserved -> FREE (``until`` None) or QUARANTINED; duplicates are harmless."""
        with _Serial(self):
            self._check_reserved_serial(owner, slots)
            step = self.batch_keys
            it = iter(slots)
            for _ in range(0, len(slots), step):
                with _Batch(self):
                    mine = self._reserved_by.get(owner)
                    if mine is None:
                        break  # all settled; the rest are duplicates
                    for slot in islice(it, step):
                        if slot not in mine:
                            continue  # listed twice: already settled
                        mine.remove(slot)
                        del self._reserved[slot]
                        if until is None:
                            self._free_locked(slot)
                        else:
                            self._quarantine_locked(slot, owner, until)
                    if not mine:
                        del self._reserved_by[owner]

    def _quarantine_locked(self, slot: int, owner: Hashable, until: float) -> None:
        self._state[slot] = _QUARANTINED
        self._quarantine[slot] = (until, owner)
        heapq.heappush(self._deadlines, (until, slot))

    def _publish_locked(self, slot: int, key: bytes) -> None:
        old = self._map.get(key)
        if old is not None:
            if self._pin_count[old]:
                self._slot_key[old] = None  # orphan: freed when its last pin drops
            else:
                del self._lru[key]
                self._free_locked(old)
        self._map[key] = slot
        self._slot_key[slot] = key
        self._state[slot] = _OCCUPIED
        self._lru[key] = None

    def _free_locked(self, slot: int) -> None:
        self._state[slot] = _FREE
        self._slot_key[slot] = None
        self._free.append(slot)

    def _unpin_serial(self, owner: Hashable) -> int:
        """Drop every pin of ``owner`` in batches, in pin order (so keys re-enter the LRU
        in the order they were first pinned). One iterator walks the owner's counts from
        start to end: only engine-side calls change them, and ``_serial`` excludes those,
        so nothing but a dropped entry's count (set to 0, keeping ``pins_of`` exact) changes
        under it; the entry goes with the last batch."""
        counts = self._pins.get(owner)
        if not counts:
            return 0
        step, n = self.batch_keys, len(counts)
        items = iter(counts.items())
        released = 0
        for start in range(0, n, step):
            with _Batch(self):
                batch = list(islice(items, step))
                released += self._drop_pins_locked(batch)
                if start + step < n:
                    for slot, _ in batch:
                        counts[slot] = 0
                else:
                    del self._pins[owner]
        return released

    def _drop_pins_locked(self, drops: Iterable[tuple[int, int]]) -> int:
        """Take ``n`` pins off each ``(slot, n)``; a slot whose last pin drops becomes
        evictable again as most recently used, or FREE if it is an orphan."""
        pin_count, slot_key, lru = self._pin_count, self._slot_key, self._lru
        released = unpinned = 0
        for slot, n in drops:
            left = pin_count[slot] - n
            pin_count[slot] = left
            released += n
            if not left:
                unpinned += 1
                key = slot_key[slot]
                if key is None:
                    self._free_locked(slot)  # an orphan's last pin
                else:
                    lru[key] = None
        self._pinned_slots -= unpinned
        return released

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise TypeError(f"slot must be an int, got {slot!r}")
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"slot {slot} out of range [0, {self.num_blocks})")

    def _check_invariants(self) -> None:
        """Test hook: assert every internal structure agrees with every other (no
        engine-side call may be in progress, so it waits for one to end)."""
        with self._serial, self._turn, self._lock:
            states = self._state
            assert self._claimed == 0
            assert sorted(self._free) == [s for s, st in enumerate(states) if st == _FREE]
            assert set(self._reserved) == {s for s, st in enumerate(states) if st == _RESERVED}
            assert set(self._quarantine) == {s for s, st in enumerate(states) if st == _QUARANTINED}
            assert all(self._reserved_by.values())
            assert {s for ss in self._reserved_by.values() for s in ss} == set(self._reserved)
            for owner, slots in self._reserved_by.items():
                assert all(self._reserved[s] is owner or self._reserved[s] == owner for s in slots)
            for key, slot in self._map.items():
                assert states[slot] == _OCCUPIED and self._slot_key[slot] == key
            assert list(self._lru) == [k for k in self._lru if not self._pin_count[self._map[k]]]
            assert set(self._lru) == {k for k, s in self._map.items() if not self._pin_count[s]}
            per_slot = [0] * self.num_blocks
            for counts in self._pins.values():
                assert counts and all(c > 0 for c in counts.values())
                for slot, c in counts.items():
                    per_slot[slot] += c
            assert per_slot == self._pin_count
            assert self._pinned_slots == sum(1 for c in per_slot if c)
            for slot, c in enumerate(per_slot):
                if c:
                    assert states[slot] == _OCCUPIED
                elif states[slot] == _OCCUPIED:
                    assert self._slot_key[slot] is not None  # unpinned orphans are freed


def _check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not key:
        raise ValueError("key must not be empty")


def _check_until(until: float) -> None:
    if not isinstance(until, int | float) or math.isnan(until):
        raise ValueError(f"until must be a number, got {until!r}")


def _torch() -> Any:
    # A store over a CUDA tensor exists only once the host has imported torch.
    return sys.modules["torch"]


def _device_source(data: Any, block_len: int) -> Any:
    """``data`` (a tensor anywhere, or any buffer) as a flat uint8 tensor to copy a block
    from; host bytes reach the GPU through the caller's ``copy_``."""
    torch = _torch()
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            data = data.contiguous()
        flat = data.detach().reshape(-1).view(torch.uint8)
    else:
        host = block_source(data, block_len)
        flat = torch.from_numpy(host if host.flags.writeable else host.copy())
    if flat.numel() != block_len:
        raise ValueError(f"data is {flat.numel()} bytes, block_len is {block_len}")
    return flat
