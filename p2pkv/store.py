"""The host-memory tier of one node: block slots, the key map, pins and quarantine.

Theory of operation
-------------------
The region is ``num_blocks`` slots of ``block_len`` bytes. Keys are block hashes. Every
slot is in exactly one state:

FREE
    On the free list; holds nothing.
OCCUPIED
    Holds a block: normally the block of a key (``key -> slot`` in the map). A slot may
    also be an *orphan*: its key was put again while the slot was pinned, so the key now
    maps to a new slot and the old one lives on, unmapped and unchanged, until its last
    pin drops; then it is freed.
RESERVED
    The destination of a write in progress, owned by an ``owner``: an incoming transfer
    (:meth:`BlockStore.reserve`) or the copy of a host :meth:`BlockStore.put`. Invisible
    to get and pin. It becomes OCCUPIED on ``commit`` or FREE on ``release_reserved``.
QUARANTINED
    A transfer into it failed or was abandoned, so the data plane may still write into it.
    It becomes FREE when the caller's deadline passes (``release_quarantined``) or the data
    plane confirms it is quiescent (``unquarantine``).

Pins are per-owner reference counts on OCCUPIED slots. The LRU holds exactly the
*evictable* blocks, i.e. mapped and unpinned ones: a key leaves it on its first pin and
re-enters as most recently used on its last unpin. So eviction is O(1), and a pinned,
reserved or quarantined slot can never be evicted, reused or handed out (DESIGN.md
invariant 2): such a slot is neither on the free list nor in the LRU.

Why the lock is short
---------------------
This store is the only state the host thread (the scheduler calling put/get) shares with
the engine's Trio thread. Every method takes one ``threading.Lock`` for dictionary work
only: nothing copies block bytes, calls out or waits while holding it, so neither thread
can stall the other for more than microseconds. ``put`` reserves its destination under the
lock, copies outside it, and publishes under it again. A block being written is never
visible: an in-place overwrite first takes the key out of the map, so a concurrent reader
sees a miss, never torn bytes, and the engine can never pin a half-written block.

Views returned by ``get`` and ``view`` alias the region (no copy). Their bytes are stable
only while the slot is pinned: an unpinned block may be overwritten, evicted or reused.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from p2pkv.errors import StoreFull
from p2pkv.region import adopt_region, block_source
from p2pkv.transport.base import RegionLayout

__all__ = ["BlockStore", "StoreStatistics"]

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
    """

    def __init__(self, num_blocks: int, block_len: int, region: object | None = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_len", block_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        nbytes = num_blocks * block_len
        self.num_blocks: int = num_blocks
        self.block_len: int = block_len
        self.region: object
        self.array: npt.NDArray[np.uint8]
        self.region, self.array = adopt_region(region, nbytes)
        self._base_addr = int(self.array.ctypes.data)
        self._ro = self.array.data.toreadonly()

        self._lock = threading.Lock()
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
        self._quarantine: dict[int, tuple[float, Hashable]] = {}  # slot -> (until, owner)
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self._evictions = 0

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
        Raises :class:`StoreFull`, with nothing changed, if no slot can be freed.
        """
        _check_key(key)
        src = block_source(data, self.block_len)
        with self._lock:
            slot = self._map.get(key)
            if slot is not None and self._pin_count[slot] == 0:
                # In place: unmap first, so nobody can read or pin it half-written.
                del self._map[key]
                del self._lru[key]
                self._slot_key[slot] = None
            else:
                slot = self._allocate_locked(1, "put")[0]
            self._reserve_locked(slot, _HOST_PUT)
        try:
            start = slot * self.block_len
            self.array[start : start + self.block_len] = src
        except BaseException:
            with self._lock:
                self._unreserve_locked(slot)
                self._free_locked(slot)
            raise
        with self._lock:
            self._unreserve_locked(slot)
            self._publish_locked(slot, key)
        return slot

    def get(self, key: bytes) -> memoryview | None:
        """Read-only view of ``key``'s block (no copy), or None; marks it recently used."""
        with self._lock:
            slot = self._map.get(key)
            if slot is None:
                return None
            if self._pin_count[slot] == 0:
                self._lru.move_to_end(key)
        start = slot * self.block_len
        return self._ro[start : start + self.block_len]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return isinstance(key, bytes) and key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def slot_of(self, key: bytes) -> int | None:
        with self._lock:
            return self._map.get(key)

    def view(self, slot: int) -> memoryview:
        """Read-only view of one slot's bytes, whatever its state."""
        self._check_slot(slot)
        start = slot * self.block_len
        return self._ro[start : start + self.block_len]

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._map)

    def evict(self, key: bytes) -> bool:
        """Drop ``key``'s block. False (nothing done) if it is absent or pinned."""
        with self._lock:
            slot = self._map.get(key)
            if slot is None or self._pin_count[slot]:
                return False
            del self._map[key]
            del self._lru[key]
            self._free_locked(slot)
            return True

    # ---------------------------------------------------------------- engine-facing

    def pin(self, owner: Hashable, keys: Sequence[bytes]) -> list[int | None]:
        """Pin each present key once more for ``owner``; its slot, or None if absent.

        A pinned slot is never evicted, overwritten or reused until unpinned.
        """
        out: list[int | None] = []
        with self._lock:
            counts = self._pins.setdefault(owner, {})
            key_map, lru, pin_count = self._map, self._lru, self._pin_count
            try:
                for key in keys:
                    slot = key_map.get(key)
                    if slot is not None:
                        if not pin_count[slot]:
                            del lru[key]
                            self._pinned_slots += 1
                        pin_count[slot] += 1
                        counts[slot] = counts.get(slot, 0) + 1
                    out.append(slot)
            finally:
                if not counts:
                    del self._pins[owner]
        return out

    def unpin(self, owner: Hashable) -> int:
        """Release every pin ``owner`` holds; returns how many were released."""
        with self._lock:
            return self._unpin_locked(owner)

    def unpin_keys(self, owner: Hashable, slots: Sequence[int]) -> int:
        """Release one of ``owner``'s pins per listed slot; returns how many were released.

        Slots ``owner`` does not pin (any more) are ignored.
        """
        with self._lock:
            counts = self._pins.get(owner)
            if not counts:
                return 0
            released = 0
            for slot in slots:
                held = counts.get(slot)
                if not held:
                    continue
                if held == 1:
                    del counts[slot]
                else:
                    counts[slot] = held - 1
                self._drop_pins_locked(slot, 1)
                released += 1
            if not counts:
                del self._pins[owner]
            return released

    def pins_of(self, owner: Hashable) -> int:
        with self._lock:
            return sum(self._pins.get(owner, {}).values())

    def reserve(self, owner: Hashable, n: int) -> list[int]:
        """``n`` slots for incoming writes, all or nothing: free slots first, then
        evicting least recently used unpinned blocks. StoreFull, nothing changed, if the
        store cannot supply ``n``."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        with self._lock:
            slots = self._allocate_locked(n, "reserve")
            for slot in slots:
                self._reserve_locked(slot, owner)
            return slots

    def commit(self, owner: Hashable, slot: int, key: bytes) -> bool:
        """Publish a slot reserved by ``owner`` (now holding the block) as ``key``'s block.

        If ``key`` is already present the existing block is kept (keys are content hashes),
        the slot is freed and False is returned. ValueError if ``owner`` does not hold the
        reservation.
        """
        _check_key(key)
        with self._lock:
            self._check_reserved_locked(owner, (slot,))
            self._unreserve_locked(slot)
            if key in self._map:
                self._free_locked(slot)
                return False
            self._publish_locked(slot, key)
            return True

    def commit_many(
        self, owner: Hashable, slots: Sequence[int], keys: Sequence[bytes]
    ) -> list[bool]:
        """:meth:`commit` for a batch, under one lock acquisition (the landing of a fetch).

        All or nothing for the reservation check: ValueError (nothing changed) if any slot
        is not reserved by ``owner``."""
        if len(slots) != len(keys):
            raise ValueError("slots and keys differ in length")
        for key in keys:
            _check_key(key)
        out: list[bool] = []
        with self._lock:
            self._check_reserved_locked(owner, slots)
            for slot, key in zip(slots, keys, strict=True):
                self._unreserve_locked(slot)
                if key in self._map:
                    self._free_locked(slot)
                    out.append(False)
                else:
                    self._publish_locked(slot, key)
                    out.append(True)
        return out

    def present(self, keys: Iterable[bytes]) -> list[bool]:
        """``key in store`` for a batch, under one lock acquisition."""
        with self._lock:
            m = self._map
            return [k in m for k in keys]

    def release_reserved(self, owner: Hashable, slots: Sequence[int]) -> None:
        """Reserved slots whose transfer settled without a block go back to FREE.

        All or nothing: ValueError if any slot is not reserved by ``owner``.
        """
        with self._lock:
            unique = self._check_reserved_locked(owner, slots)
            for slot in unique:
                self._unreserve_locked(slot)
                self._free_locked(slot)

    def quarantine(self, owner: Hashable, slots: Sequence[int], until: float) -> None:
        """Reserved slots whose transfer did not settle stay unusable until ``until`` (a
        value of the caller's clock) or :meth:`unquarantine`.

        All or nothing: ValueError if any slot is not reserved by ``owner``.
        """
        _check_until(until)
        with self._lock:
            unique = self._check_reserved_locked(owner, slots)
            for slot in unique:
                self._unreserve_locked(slot)
                self._quarantine_locked(slot, owner, until)

    def release_quarantined(self, now: float) -> int:
        """Free every quarantined slot whose deadline is ``<= now``; returns how many."""
        released = 0
        with self._lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                until, slot = heapq.heappop(heap)
                entry = self._quarantine.get(slot)
                if entry is not None and entry[0] == until:
                    del self._quarantine[slot]
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
        with self._lock:
            for slot in slots:
                self._check_slot(slot)
                entry = self._quarantine.get(slot)
                if entry is not None and (any_owner or entry[1] == owner):
                    del self._quarantine[slot]
                    self._free_locked(slot)
            if len(self._deadlines) > 2 * len(self._quarantine) + 64:
                self._deadlines = [(u, s) for s, (u, _) in self._quarantine.items()]
                heapq.heapify(self._deadlines)

    def next_quarantine_deadline(self) -> float | None:
        """The earliest deadline of a quarantined slot, or None if none is quarantined."""
        with self._lock:
            heap = self._deadlines
            while heap:
                until, slot = heap[0]
                entry = self._quarantine.get(slot)
                if entry is not None and entry[0] == until:
                    return until
                heapq.heappop(heap)
            return None

    def release_owner(self, owner: Hashable, *, quarantine_until: float | None) -> None:
        """Session teardown: drop all of ``owner``'s pins; its reserved slots are freed
        (``quarantine_until`` None) or quarantined until ``quarantine_until``."""
        if quarantine_until is not None:
            _check_until(quarantine_until)
        with self._lock:
            self._unpin_locked(owner)
            for slot in list(self._reserved_by.get(owner, ())):
                self._unreserve_locked(slot)
                if quarantine_until is None:
                    self._free_locked(slot)
                else:
                    self._quarantine_locked(slot, owner, quarantine_until)

    def statistics(self) -> StoreStatistics:
        with self._lock:
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

    def __repr__(self) -> str:
        return f"<BlockStore {self.num_blocks}x{self.block_len} keys={len(self._map)}>"

    # ------------------------------------------------------------------ internals

    def _allocate_locked(self, n: int, op: str) -> list[int]:
        # Every slot is FREE, OCCUPIED-evictable (in the LRU), or untouchable, so this
        # check is exact: either all n are found or nothing changes.
        if n > len(self._free) + len(self._lru):
            raise StoreFull(
                f"need {n} slots, {len(self._free)} free and {len(self._lru)} evictable "
                f"of {self.num_blocks}; the rest are pinned, reserved or quarantined",
                op=op,
            )
        out: list[int] = []
        while len(out) < n:
            if self._free:
                out.append(self._free.pop())
            else:
                key, _ = self._lru.popitem(last=False)
                slot = self._map.pop(key)
                self._slot_key[slot] = None
                self._evictions += 1
                out.append(slot)
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

    def _check_reserved_locked(self, owner: Hashable, slots: Iterable[int]) -> list[int]:
        unique = list(dict.fromkeys(slots))
        held = self._reserved_by.get(owner, set())
        for slot in unique:
            if slot not in held:
                raise ValueError(f"slot {slot!r} is not reserved by {owner!r}")
        return unique

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

    def _unpin_locked(self, owner: Hashable) -> int:
        counts = self._pins.pop(owner, None)
        if not counts:
            return 0
        for slot, held in counts.items():
            self._drop_pins_locked(slot, held)
        return sum(counts.values())

    def _drop_pins_locked(self, slot: int, n: int) -> None:
        left = self._pin_count[slot] - n
        self._pin_count[slot] = left
        if left:
            return
        self._pinned_slots -= 1
        key = self._slot_key[slot]
        if key is None:
            self._free_locked(slot)  # an orphan's last pin
        else:
            self._lru[key] = None  # evictable again, as most recently used

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise TypeError(f"slot must be an int, got {slot!r}")
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"slot {slot} out of range [0, {self.num_blocks})")

    def _check_invariants(self) -> None:
        """Test hook: assert every internal structure agrees with every other."""
        with self._lock:
            states = self._state
            assert sorted(self._free) == [s for s, st in enumerate(states) if st == _FREE]
            assert set(self._reserved) == {s for s, st in enumerate(states) if st == _RESERVED}
            assert set(self._quarantine) == {s for s, st in enumerate(states) if st == _QUARANTINED}
            assert {s for ss in self._reserved_by.values() for s in ss} == set(self._reserved)
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
