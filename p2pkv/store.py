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
re-enters as most recently used on its last unpin. So eviction never searches, and a
pinned, reserved or quarantined slot can never be evicted, reused or handed out
(DESIGN.md invariant 2): such a slot is neither on the free list nor in the LRU.

Slot arrays
-----------
What is per slot lives in NumPy arrays indexed by slot: the state, the key (an object
array; None for a free, reserved or orphaned slot), the pin count, the id of the owner
holding a reservation (0: none; each owner holding reservations has a small id, reused
once its last reservation ends; 16 bits until an id needs more) and the LRU position. The
free list is a stack, which pops slot 0 first: the slots freed after use, in an array that
grows and shrinks with them, on top of the slots never handed out, which need no entry
(slot ``_fresh`` up to the last), so a full store pays nothing per slot for its free list.
So an engine-side call does its per-key work as a few whole-batch array operations: one
C-level pass over the keys through the key map (a dict), then gathers and scatters over
slot arrays. An owner's pins are the slot arrays of its pin batches, counted per slot only
if one repeats. The LRU is a log in which a slot that leaves is only marked, and which
compacts in bounded steps (``_Lru``). The order of everything a caller sees is the per-key
order: slots leave the free list, enter the LRU and are freed in the order the call lists
them (``release_owner``: in slot order).

A call of at most :data:`SMALL_KEYS` keys or slots (a lookup of a few keys: the control
plane's common case) takes the **scalar path** instead, because NumPy's fixed cost per
whole-array operation (~1 us) would be most of it: the same state changes in the same
order, and the same refusals, made slot by slot in plain Python through memoryviews of
the same arrays (an owner's pins may then be lists of slots as well as arrays). Either
path may undo what the other did (``tests/test_store_paths.py`` holds them to the same
internal state after every call).

Who waits for whom
------------------
This store is the only state the host thread (the scheduler calling put/get) shares with
the engine's Trio thread, and a host call must never wait for more than one short batch of
engine work, however many keys the engine's call carries (up to 65,536 per message).

* ``_lock`` guards every structure. Nothing copies block bytes, calls out or waits while
  holding it. The rules of ``_check_invariants`` hold whenever it is free, except for the
  bookkeeping of the engine-side call in progress: a reserve's claim, and the pins an
  unpin has dropped but not yet taken off the owner's record (its total, which
  ``pins_of`` reads, is exact). Two reads need no lock because only engine-side calls
  write what they read, and ``_serial`` excludes those: an engine call's copy of an
  owner's pins, and the check that ``owner`` reserves every slot it names (the host
  writes other slots' owner entries meanwhile, never that owner's id; ``release_owner``
  finds the owner's slots the same way). ``put``
  reserves its destination under it, copies outside it, and publishes under it again. A
  block being written is never visible: an in-place overwrite first takes the key out of
  the map, so a reader sees a miss, never torn bytes, and nobody can pin a half-written
  block.
* Engine-side calls work in **batches** of at most ``batch_keys`` keys or slots (default
  :data:`BATCH_KEYS`) and take ``_lock`` once per batch. Checks of the caller's own input
  (key types, lengths, duplicates) run outside it. A scalar-path call is one batch (its
  size limit is never above ``batch_keys``), enters it inline with the same hand-over,
  and never offers the GIL: it is far shorter than :data:`GIL_OFFER_AFTER_S`.
* **Hand-over.** A host call holds ``_turn`` from before it asks for ``_lock`` until it
  lets go of it; an engine batch takes and drops ``_turn`` before it takes ``_lock``. So a
  host call that is waiting gets in before the engine's next batch. A plain lock does not
  give that: CPython's lock is not fair, and the engine thread, which holds the GIL, takes
  it back before the woken host thread runs. Blocking on ``_turn`` also hands the host the
  GIL at once. A host call therefore waits for at most one batch per lock section
  (``put`` has two), plus the time the engine thread needs to be scheduled to finish it.
* ``_serial`` runs engine-side calls one at a time; the host never takes it. Between two
  batches of an engine call only the host runs, and the host touches only the key map and
  LRU (put, get, evict), the free list (put, evict) and its own put reservations; never a
  pin, another owner's reservation, the quarantine or a claim.

What a host call between two batches can see and do, and the rules that keep every
guarantee:

* ``pin`` is a sequence of per-key atomic pins. A key pinned in an earlier batch cannot be
  evicted or overwritten since it is pinned (a put moves the key to a new slot and the
  pinned slot lives on as an orphan). A key of a later batch that the host puts or evicts
  meanwhile is simply a hit or a miss as of its batch; so a key listed twice may pin two
  slots if the host re-put it in between (both hold that key's block). ``present`` and
  ``commit_many`` are likewise per key, as of the key's batch.
* ``unpin``, ``unpin_keys`` and ``release_owner`` drop pins batch by batch; a slot stays
  pinned until its batch runs, and ``pins_of`` and the pinned-slot count are exact
  whenever ``_lock`` is free. Slots whose last pin drops re-enter the LRU in the order
  they were first pinned (``unpin_keys``: in the order of their last listed drop).
* All-or-nothing calls decide before their first change and cannot fail after it.
  ``commit_many``, ``release_reserved`` and ``quarantine`` check every slot's reservation
  first (only the owner's own calls change it, and ``_serial`` excludes those). ``reserve``
  checks that ``n`` slots are free or evictable and **claims** them: until it is done, a
  host ``put`` counts the claimed slots as taken and raises StoreFull if nothing else is
  left, exactly as if the reservation had completed first (it would have taken every
  free and evictable slot, the put's own key's block included).

Views returned by ``get`` and ``view`` alias the region (no copy). Their bytes are stable
only while the slot is pinned: an unpinned block may be overwritten, evicted or reused.

A **device region** (a torch CUDA tensor) keeps every rule above; only the bytes live on
the GPU. There is no host view of them: ``array``, ``get`` and ``view`` refuse with
``TypeError``, and ``get_tensor`` / ``view_tensor`` return ``uint8`` CUDA tensor views
instead. ``put`` copies on the caller's current CUDA stream and waits for that copy, so a
block is complete on the GPU before it is published (the data plane copies on its own
streams and cannot wait for ours). ``buffer`` is what the data plane registers either way.
"""

from __future__ import annotations

import heapq
import math
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from itertools import compress, islice, repeat
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from p2pkv.errors import SlotsInUse, StoreFull
from p2pkv.region import adopt_device_region, adopt_region, block_source, is_device_region
from p2pkv.transport.base import RegionLayout

__all__ = ["BATCH_KEYS", "BlockStore", "StoreStatistics"]

BATCH_KEYS: Final = 256
"""Keys (or slots) an engine-side call handles per lock section. Per key, pin costs
0.2 us, unpin 0.05 us, reserve 0.07 us (0.3 us evicting) and commit_many 0.3 us of CPU
on the 2-core development VM (``bench/store_ops.py``), so one section is 10-80 us. 1,024
would save a fifth of that CPU (NumPy's fixed cost per call) but doubled the host's
median wait in ``bench/store_lock.py`` (docs/design.md, "Store in bulk"); 64 cost engine
throughput without shortening it."""

SMALL_KEYS: Final = 32
"""An engine-side call of at most this many keys or slots (and at most ``batch_keys``)
takes the *scalar path*: one lock section of plain Python over single slots, no NumPy
array built, no GIL offer (it is far shorter than :data:`GIL_OFFER_AFTER_S`). NumPy costs
~1 us per whole-array operation, so below this size per-element work (~30 ns through a
memoryview) is cheaper; above it the array path wins (``bench/store_ops.py``)."""

_POS32_ENTRIES: Final = 2**29
"""The LRU log's slots and positions are 32-bit while the log holds fewer entries than
this (checked when it is made and each time ``_Lru._grow`` doubles it), 64-bit beyond:
far below 2**31, so no position can overflow."""

_FREE_MIN: Final = 64
"""The array of slots freed after use never shrinks below this many entries."""

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
_HOST_PUT_ID: Final = 1  # its id in BlockStore._owner (0 is no owner)
_ANY_OWNER: Final[Hashable] = object()


_yield_gil = time.sleep
_clock = time.perf_counter

GIL_OFFER_AFTER_S: Final = 0.5e-3
"""An engine-side call offers the GIL to other threads once it has run this long since it
began or last offered it (checked at each batch). ``time.sleep(0)`` is what lets a thread
that is waiting for the GIL in (``os.sched_yield`` does not), and on Linux it sleeps for
the timer slack, about 55 us; offering at every batch cost a 1,024-key lookup four of
those. A call shorter than this never sleeps; a long one sleeps ~55 us per 0.5 ms."""


def region_lent_error(op: str) -> SlotsInUse:
    return SlotsInUse(
        "this region's slots are its caller's (fetch_into was used on this node): the "
        "store may not choose slots in it; use one node for each",
        op=op,
    )


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
        # One entry per slot (module docstring, "Slot arrays").
        self._state = np.zeros(num_blocks, dtype=np.int8)
        # The region's slots are its caller's (``Node.fetch_into``): put and reserve refuse.
        self._lent = False
        self._slot_key = np.full(num_blocks, None, dtype=object)  # None: free/reserved/orphan
        self._pin_count = np.zeros(num_blocks, dtype=np.int32)
        # The id of the reserving owner (0: none); 16 bits until an id needs more (_new_id).
        self._owner: _Slots = np.zeros(num_blocks, dtype=np.int16)
        # The free list is a stack that pops slot 0 first: on top, the slots freed after
        # use, _free[:_n_freed]; below them, never handed out, slots _fresh.. in order.
        self._free: _Slots = np.empty(0, dtype=np.int32)
        self._n_freed = 0
        self._fresh = 0
        self._n_free = num_blocks  # both together
        # The same arrays as memoryviews, for the scalar path's one-slot reads and writes
        # (they give and take Python ints, twice as fast as NumPy's item access).
        self._state_at = self._state.data
        self._pin_count_at = self._pin_count.data
        self._owner_at = self._owner.data
        self._free_at = self._free.data
        self._small_keys = min(SMALL_KEYS, batch_keys)  # calls up to this take the scalar path
        self._lru = _Lru(num_blocks, min(batch_keys, num_blocks))  # the evictable slots
        self._map: dict[bytes, int] = {}
        self._pins: dict[Hashable, _Pins] = {}
        self._pinned_slots = 0
        self._n_orphans = 0  # OCCUPIED slots no key maps to (all pinned)
        host = _Holder(_HOST_PUT, _HOST_PUT_ID)
        self._holders: dict[Hashable, _Holder] = {_HOST_PUT: host}  # owners holding reservations
        self._holder_ids: dict[int, _Holder] = {_HOST_PUT_ID: host}
        self._spare_ids: list[int] = []  # ids of owners whose last reservation ended
        self._next_id = _HOST_PUT_ID + 1
        self._n_reserved = 0
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
        claimed by a :meth:`reserve` in progress count as taken). If the copy itself
        raises (a CUDA error, an interrupt), that exception propagates, the slot is free
        again and ``key`` is not stored, even if it was before: an old block overwritten in
        place is half overwritten by then.
        """
        _check_key(key)
        src: Any = (
            _device_source(data, self.block_len)
            if self.device_region
            else block_source(data, self.block_len)
        )
        with self._turn, self._lock:
            if self._lent:
                raise region_lent_error("put")
            self._check_room_locked(1, "put")
            slot = self._map.get(key)
            if slot is not None and self._pin_count_at[slot] == 0:
                # In place: unmap first, so nobody can read or pin it half-written.
                del self._map[key]
                self._lru.drop(slot)
                self._slot_key[slot] = None
            else:
                slot = self._allocate_one_locked()
            self._state_at[slot] = _RESERVED
            self._owner_at[slot] = _HOST_PUT_ID
            self._holders[_HOST_PUT].count += 1
            self._n_reserved += 1
        try:
            start = slot * self.block_len
            if self._array is not None:
                self._array[start : start + self.block_len] = src
            else:
                self._tensor[start : start + self.block_len].copy_(src)
                _torch().cuda.current_stream(self._tensor.device).synchronize()
        except BaseException:
            with self._turn, self._lock:
                self._end_host_put_locked(slot)
                self._free_one_locked(slot)
            raise
        with self._turn, self._lock:
            self._end_host_put_locked(slot)
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
        if self._tensor is None:  # refused before the LRU is touched, as get's is
            raise TypeError("a host region has no CUDA view: use get / view")
        slot = self._touch(key)
        return None if slot is None else self.view_tensor(slot)

    def view_tensor(self, slot: int) -> Any:
        """Device region: a uint8 CUDA tensor view of one slot, whatever its state."""
        if self._tensor is None:
            raise TypeError("a host region has no CUDA view: use get / view")
        start = self._check_slot(slot) * self.block_len
        return self._tensor[start : start + self.block_len]

    def _touch(self, key: bytes) -> int | None:
        with self._turn, self._lock:
            slot = self._map.get(key)
            if slot is not None and self._pin_count_at[slot] == 0:
                self._lru.drop(slot)
                self._lru.push_one(slot)
            return slot

    def _host_only(self, op: str) -> None:
        if self.device_region:
            raise TypeError(f"{op}: a device region has no host view; use {op}_tensor")

    def __contains__(self, key: object) -> bool:
        """As :meth:`get` and :meth:`slot_of` find it: a bytes-like key equal to a stored
        key (a read-only memoryview) is in; something unhashable is not."""
        with self._turn, self._lock:
            try:
                return key in self._map
            except TypeError:
                return False

    def __len__(self) -> int:
        return len(self._map)

    def slot_of(self, key: bytes) -> int | None:
        with self._turn, self._lock:
            return self._map.get(key)

    def view(self, slot: int) -> memoryview:
        """Read-only view of one slot's bytes, whatever its state."""
        self._host_only("view")
        start = self._check_slot(slot) * self.block_len
        return self._ro[start : start + self.block_len]

    def keys(self) -> list[bytes]:
        with self._turn, self._lock:
            return list(self._map)

    def evict(self, key: bytes) -> bool:
        """Drop ``key``'s block. False (nothing done) if it is absent or pinned."""
        with self._turn, self._lock:
            slot = self._map.get(key)
            if slot is None or self._pin_count_at[slot]:
                return False
            del self._map[key]
            self._lru.drop(slot)
            self._free_one_locked(slot)
            return True

    def lend_to_caller(self) -> None:
        """Hand the region's slots to the caller for good (``Node.fetch_into``: the caller
        allocates them). From then on :meth:`put` and :meth:`reserve` raise
        :class:`SlotsInUse`, since any slot they chose could be one the caller holds.
        Raises :class:`SlotsInUse` instead, changing nothing, if the store holds anything
        (a block, a reservation, a quarantine, a pin). Idempotent."""
        if self._lent:
            return
        with self._turn, self._lock:
            if self._lent:
                return
            if self._state.any():  # a block (pinned or not), a reservation, a quarantine
                raise SlotsInUse(
                    f"the store holds blocks or slots in this region ({len(self._map)} "
                    "blocks): fetch_into needs a region its caller manages, and "
                    "put/fetch one the store manages; use one node for each",
                    op="fetch_into",
                )
            self._lent = True

    @property
    def lent_to_caller(self) -> bool:
        """True once :meth:`lend_to_caller` handed the region to the caller."""
        return self._lent

    @property
    def pinned_slots(self) -> int:
        """Slots pinned now (one int read: no lock, the figure may be a moment old)."""
        return self._pinned_slots

    def pins_of(self, owner: Hashable) -> int:
        with self._turn, self._lock:
            pins = self._pins.get(owner)
            return 0 if pins is None else pins.total

    def statistics(self) -> StoreStatistics:
        with self._turn, self._lock:
            free = self._n_free
            reserved = self._n_reserved
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
        if len(keys) <= self._small_keys:
            return self._pin_small(owner, keys)
        out: list[int | None] = []
        lookup = self._map.get
        step = self.batch_keys
        it = iter(keys)
        with _Serial(self):
            for _ in range(0, len(keys), step):
                with _Batch(self):
                    found = list(map(lookup, islice(it, step), repeat(-1)))
                    out += self._pin_locked(owner, found)
        return out

    def unpin(self, owner: Hashable) -> int:
        """Release every pin ``owner`` holds; returns how many were released."""
        self._serial.acquire()  # not "with": see "scalar path" below
        try:
            return self._unpin_serial(owner)
        finally:
            self._serial.release()

    def unpin_keys(self, owner: Hashable, slots: Sequence[int]) -> int:
        """Release one of ``owner``'s pins per listed slot; returns how many were released.

        Slots ``owner`` does not pin (any more) are ignored.
        """
        released = 0
        step = self.batch_keys
        with self._serial:
            pins = self._pins.get(owner)
            if pins is None:
                return 0
            if len(slots) <= self._small_keys and pins.total <= self._small_keys:
                return self._unpin_keys_small(owner, pins, slots)
            self._offered_at = _clock()
            counts = pins.counts()  # only engine-side calls change them: read outside _lock
            # Every listed slot taken off the copy first: a bad entry (unhashable) raises
            # before any pin is dropped. (Taken batch by batch, one in a later batch would
            # leave the owner's record listing pins already dropped, and another owner's
            # pinned slot could be handed out.)
            dropped = list(_take_pins(counts, slots).items())
            for start in range(0, len(dropped), step):
                part = dropped[start : start + step]
                with _Batch(self):
                    n = len(part)
                    released += self._drop_pins_locked(
                        pins,
                        np.fromiter((slot for slot, _ in part), np.int64, n),
                        np.fromiter((drop for _, drop in part), np.int64, n),
                    )
                    if not counts and start + step >= len(dropped):
                        del self._pins[owner]
            if not dropped and not counts:  # an owner with no pins left: forget it too
                with _Batch(self):
                    self._pins.pop(owner, None)
            pins.set_counts(counts)
        return released

    def reserve(self, owner: Hashable, n: int) -> list[int]:
        """``n`` slots for incoming writes, all or nothing: free slots first, then
        evicting least recently used unpinned blocks. StoreFull, nothing changed, if the
        store cannot supply ``n`` (TypeError, nothing changed, for an unhashable owner)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        hash(owner)  # TypeError now: the owner is looked up only once its slots are taken
        if self._lent:
            raise region_lent_error("reserve")
        if n <= self._small_keys:
            return self._reserve_small(owner, n)
        out: list[int] = []
        first = True
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
                        if take:
                            slots = self._allocate_locked(take)
                            self._hold_locked(owner, slots)
                            out += slots.tolist()
            except BaseException:
                with _Batch(self):
                    self._claimed = 0
                    holder = self._holders.get(owner)
                    if out and holder is not None:
                        slots = np.array(out, dtype=np.int64)
                        self._unhold_locked(holder, slots)
                        self._free_many_locked(slots)
                raise
        return out

    def commit(self, owner: Hashable, slot: int, key: bytes) -> bool:
        """Publish a slot reserved by ``owner`` (now holding the block) as ``key``'s block.

        If ``key`` is already present the existing block is kept (keys are content hashes),
        the slot is freed and False is returned. ValueError if ``owner`` does not hold the
        reservation.
        """
        _check_key(key)
        if isinstance(slot, bool | np.bool_):  # True has __index__: never slot 1
            raise ValueError(f"a slot must be an int, not a bool (slot {slot!r})")
        self._enter_small()
        try:
            holder = self._holders.get(owner)
            if (
                holder is None
                or not isinstance(slot, int | np.integer)
                or not 0 <= slot < self.num_blocks
                or self._owner_at[slot] != holder.oid
            ):
                raise ValueError(f"slot {slot!r} is not reserved by {owner!r}")
            slot = int(slot)
            self._unhold_few_locked(holder, [slot])
            if key in self._map:
                self._free_one_locked(slot)
                return False
            self._publish_locked(slot, key)
            return True
        finally:
            self._exit_small()

    def commit_many(
        self, owner: Hashable, slots: Sequence[int], keys: Sequence[bytes]
    ) -> list[bool]:
        """:meth:`commit` for a batch (the landing of a fetch).

        All or nothing: ValueError or TypeError (nothing changed) if a key is not
        non-empty bytes, a slot is listed twice or any slot is not reserved by ``owner``.
        """
        if len(slots) != len(keys):
            raise ValueError("slots and keys differ in length")
        # A bool has __index__ (True packs as slot 1): a mask is never taken for slots.
        if (
            slots.dtype == np.bool_
            if isinstance(slots, np.ndarray)
            else bool in set(map(type, slots))
        ):
            raise ValueError(f"a slot must be an int, not a bool (slots {slots!r})")
        if type(keys) is not list:
            keys = list(keys)
        if set(map(type, keys)) - {bytes} or not all(keys):
            for key in keys:
                _check_key(key)
        if len(slots) <= self._small_keys:
            return self._commit_small(owner, self._slot_list(owner, slots), keys)
        arr = self._slot_array(owner, slots)
        ordered = arr.copy()
        ordered.sort()
        if np.count_nonzero(ordered[1:] == ordered[:-1]):
            raise ValueError("a slot is listed twice (a slot commits once)")
        return self._commit_array(owner, arr, keys)

    def _commit_reserved(self, owner: Hashable, slots: list[int], keys: list[bytes]) -> None:
        """:meth:`commit_many` for the engine's own landing: ``slots`` are what
        :meth:`reserve` gave ``owner`` (distinct, so not sorted again to find a repeat) and
        ``keys`` passed the session's key check (not walked again). That ``owner``
        reserves every slot is still checked, all or nothing."""
        if len(slots) != len(keys):
            raise ValueError("slots and keys differ in length")
        if len(slots) <= self._small_keys:
            self._commit_small(owner, self._slot_list(owner, slots), keys)
        else:
            self._commit_array(owner, self._slot_array(owner, slots), keys)

    def _commit_array(self, owner: Hashable, arr: _Slots, keys: list[bytes]) -> list[bool]:
        out: list[bool] = []
        step = self.batch_keys
        with _Serial(self):
            holder = self._check_reserved_serial(owner, arr)
            for start in range(0, len(arr), step):
                with _Batch(self):
                    batch = arr[start : start + step]
                    self._unhold_locked(holder, batch)
                    out += self._commit_locked(batch, keys[start : start + step])
        return out

    def present(self, keys: Iterable[bytes]) -> list[bool]:
        """``key in store`` for each key, as of that key's batch."""
        contains = self._map.__contains__
        if type(keys) is list and len(keys) <= self._small_keys:
            with self._serial:
                self._turn.acquire()
                self._turn.release()
                with self._lock:
                    return list(map(contains, keys))
        out: list[bool] = []
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
        """Free every quarantined slot whose deadline is ``<= now``; returns how many.
        ValueError, nothing freed, if ``now`` is not a number (NaN included: it compares
        false with every deadline, so none would count as not yet due)."""
        _check_until(now, "now")
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
                            self._free_one_locked(slot)
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
                            self._free_one_locked(int(slot))
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
        (``quarantine_until`` None) or quarantined until ``quarantine_until``, in slot
        order."""
        if quarantine_until is not None:
            _check_until(quarantine_until)
        with _Serial(self):
            self._unpin_serial(owner)
            holder = self._holders.get(owner)
            if holder is None:
                return
            # One pass, without _lock, as in _check_reserved_serial: only the owner's own
            # calls write its id, and _serial excludes them, so the list stays exact.
            mine = np.flatnonzero(self._owner == holder.oid)
            step = self.batch_keys
            for start in range(0, len(mine), step):
                with _Batch(self):
                    self._settle_locked(holder, mine[start : start + step], quarantine_until)

    def __repr__(self) -> str:
        return f"<BlockStore {self.num_blocks}x{self.block_len} keys={len(self._map)}>"

    # ------------------------------------------------------------------ scalar path
    # Engine-side calls of at most _small_keys keys or slots (SMALL_KEYS). Each is one
    # lock section, entered by _enter_small (hold _serial; let a waiting host call in
    # through _turn; hold _lock) and left by _exit_small in a finally: two "with"
    # statements cost twice as much, 0.3 us per call. Slots are read and written one at a
    # time through the arrays' memoryviews. Each makes the array path's state changes, in
    # the same order: the same slots leave the free list, enter the LRU and are freed in
    # the same order, and the same checks refuse the same input before anything changes.

    def _enter_small(self) -> None:
        """Enter a scalar-path section: hold ``_serial``, let a waiting host call in
        through ``_turn``, hold ``_lock``. The caller leaves with :meth:`_exit_small` in a
        ``finally``; if entering fails, nothing stays held."""
        self._serial.acquire()
        try:
            self._turn.acquire()
            self._turn.release()
            self._lock.acquire()
        except BaseException:
            self._serial.release()
            raise

    def _exit_small(self) -> None:
        self._lock.release()
        self._serial.release()

    def _pin_small(self, owner: Hashable, keys: Sequence[bytes]) -> list[int | None]:
        lookup = self._map.get
        self._enter_small()
        try:
            found = list(map(lookup, keys))
            listed = [slot for slot in found if slot is not None]
            if not listed:
                return found
            pins = self._pins.get(owner)
            if pins is None:
                pins = self._pins[owner] = _Pins()
            pin_count, pos_of = self._pin_count_at, self._lru.pos_of_at
            per_slot: dict[int, int] | None = None
            if len(listed) > 1 and len(set(listed)) < len(listed):
                per_slot = Counter(listed)  # a key listed twice
                pins.distinct = False
            newly = 0
            held = False  # some slot was pinned already (maybe by this owner)
            for slot, add in per_slot.items() if per_slot else zip(listed, repeat(1)):
                before = pin_count[slot]
                pin_count[slot] = before + add
                if before:
                    held = True
                else:
                    pos_of[slot] = -1  # leaves the LRU
                    newly += 1
            if held and pins.total:
                pins.distinct = False
            self._lru.count -= newly
            self._pinned_slots += newly
            pins.chunks.append(listed)
            pins.total += len(listed)
            return found
        finally:
            self._exit_small()

    def _drop_all_small_locked(self, pins: _Pins) -> int:
        """Take all of ``pins``' pins off their slots (:meth:`_drop_pins_locked`)."""
        listed = pins.listed()
        pin_count = self._pin_count_at
        done: list[int] = []  # slots whose last pin drops, in the order first pinned
        drops = zip(listed, repeat(1)) if pins.distinct else Counter(listed).items()
        for slot, drop in drops:
            left = pin_count[slot] - drop
            pin_count[slot] = left
            if not left:
                done.append(slot)
        pins.total -= len(listed)
        self._unpinned_small_locked(done)
        return len(listed)

    def _unpin_keys_small(self, owner: Hashable, pins: _Pins, slots: Sequence[int]) -> int:
        counts = pins.counts()
        dropped = _take_pins(counts, slots)
        self._turn.acquire()
        self._turn.release()
        with self._lock:
            pin_count = self._pin_count_at
            done: list[int] = []
            released = 0
            for listed_slot, drop in dropped.items():
                slot = int(listed_slot)  # 1.0 or True may name slot 1, as in a dict
                left = pin_count[slot] - drop
                pin_count[slot] = left
                released += drop
                if not left:
                    done.append(slot)
            pins.total -= released
            self._unpinned_small_locked(done)
            if counts:
                distinct = all(held == 1 for held in counts.values())
                pins.chunks = [
                    list(counts)
                    if distinct
                    else [slot for slot, held in counts.items() for _ in range(held)]
                ]
                pins.distinct = distinct
            else:
                del self._pins[owner]
        return released

    def _unpinned_small_locked(self, done: list[int]) -> None:
        """Slots whose last pin just dropped, in this order: an orphan is freed, any other
        re-enters the LRU as most recently used."""
        if not done:
            return
        self._pinned_slots -= len(done)
        if self._n_orphans:
            slot_key = self._slot_key
            keyed = []
            for slot in done:
                if slot_key[slot] is None:
                    self._n_orphans -= 1
                    self._free_one_locked(slot)
                else:
                    keyed.append(slot)
            done = keyed
        self._lru.push_few(done)

    def _reserve_small(self, owner: Hashable, n: int) -> list[int]:
        self._enter_small()
        try:
            self._check_room_locked(n, "reserve")
            if not n:
                return []
            out = self._allocate_few_locked(n)
            holder = self._holder_locked(owner)
            state, owners, oid = self._state_at, self._owner_at, holder.oid
            for slot in out:
                state[slot] = _RESERVED
                owners[slot] = oid
            holder.count += n
            self._n_reserved += n
            return out
        finally:
            self._exit_small()

    def _allocate_few_locked(self, n: int) -> list[int]:
        """:meth:`_allocate_locked` on the scalar path."""
        before = self._n_freed, self._fresh, self._n_free
        k = min(n, self._n_free)
        out = self._take_free_few_locked(k)
        if k == n:
            self._shrink_free_locked()
            return out
        victims = self._lru.take_few(n - k)
        if victims is None:  # many dead entries in the LRU log: NumPy reads them faster
            self._n_freed, self._fresh, self._n_free = before  # the popped entries are intact
            listed: list[int] = self._allocate_locked(n).tolist()
            return listed
        unmap, slot_key = self._map.__delitem__, self._slot_key
        for slot in victims:
            unmap(slot_key[slot])
            slot_key[slot] = None
        self._evictions += n - k
        self._shrink_free_locked()
        return out + victims

    def _slot_list(self, owner: Hashable, slots: Sequence[int]) -> list[int]:
        """:meth:`_slot_array` as a list of ints, without NumPy when they are ints."""
        n = self.num_blocks
        for slot in slots:
            if type(slot) is not int or not 0 <= slot < n:
                listed: list[int] = self._slot_array(owner, slots).tolist()
                return listed
        return list(slots)

    def _reserver_locked(self, owner: Hashable, slots: list[int]) -> _Holder | None:
        """:meth:`_check_reserved_serial` for a list: ``owner``'s record (None only if
        ``slots`` is empty), or ValueError for the first slot it does not reserve."""
        holder = self._holders.get(owner)
        oid = -1 if holder is None else holder.oid  # -1 matches no slot
        owners = self._owner_at
        for slot in slots:
            if owners[slot] != oid:
                raise ValueError(f"slot {slot!r} is not reserved by {owner!r}")
        return holder

    def _unhold_few_locked(self, holder: _Holder, slots: list[int]) -> None:
        owners = self._owner_at
        for slot in slots:
            owners[slot] = 0
        self._unheld_locked(holder, len(slots))

    def _commit_small(self, owner: Hashable, slots: list[int], keys: list[bytes]) -> list[bool]:
        if len(slots) > 1 and len(set(slots)) < len(slots):
            raise ValueError("a slot is listed twice (a slot commits once)")
        self._enter_small()
        try:
            holder = self._reserver_locked(owner, slots)
            if holder is None or not slots:
                return []
            self._unhold_few_locked(holder, slots)
            setdefault = self._map.setdefault
            state, slot_key = self._state_at, self._slot_key
            out: list[bool] = []
            kept: list[int] = []
            for slot, key in zip(slots, keys, strict=True):
                if setdefault(key, slot) == slot:  # the key was absent: publish
                    slot_key[slot] = key
                    state[slot] = _OCCUPIED
                    kept.append(slot)
                    out.append(True)
                else:
                    self._free_one_locked(slot)
                    out.append(False)
            self._lru.push_few(kept)
            return out
        finally:
            self._exit_small()

    def _settle_small(self, owner: Hashable, slots: list[int], until: float | None) -> None:
        self._enter_small()
        try:
            holder = self._reserver_locked(owner, slots)
            if holder is None or not slots:
                return
            if len(slots) > 1:
                slots = list(dict.fromkeys(slots))  # duplicates are harmless
            self._unhold_few_locked(holder, slots)
            if until is None:
                for slot in slots:
                    self._free_one_locked(slot)
                return
            state, heap = self._state_at, self._deadlines
            for slot in slots:
                state[slot] = _QUARANTINED
                heapq.heappush(heap, (until, slot))
            self._quarantine.update(dict.fromkeys(slots, (until, holder.owner)))
        finally:
            self._exit_small()

    # ------------------------------------------------------------------ internals

    def _check_room_locked(self, n: int, op: str) -> None:
        # Every slot is FREE, OCCUPIED-evictable (in the LRU), or untouchable, so this
        # check is exact: either all n can be found or the caller changes nothing.
        if n > self._n_free + self._lru.count - self._claimed:
            claimed = f", {self._claimed} claimed by a reserve in progress" * bool(self._claimed)
            pinned = f" ({self._pinned_slots} pinned" * bool(self._pinned_slots)
            if pinned:  # the host's remedies for pins that peers hold
                pinned += (
                    ": Node.release_unused_pins() takes back those no write is using, and "
                    "NodeConfig.max_pinned_share bounds what peers may pin)"
                )
            raise StoreFull(
                f"need {n} slots, {self._n_free} free and {self._lru.count} evictable "
                f"of {self.num_blocks}{claimed}; the rest are pinned, reserved or "
                f"quarantined{pinned}",
                op=op,
            )

    def _allocate_locked(self, n: int) -> _Slots:
        """n slots, free ones first (in the order the stack pops them), then evicting;
        the caller checked the room."""
        k = min(n, self._n_free)
        out = self._take_free_locked(k)
        if k < n:
            victims = self._lru.take(n - k)
            deque(map(self._map.__delitem__, self._slot_key[victims].tolist()), maxlen=0)
            self._slot_key[victims] = None
            self._evictions += n - k
            out = np.concatenate((out, victims))
        return out

    def _allocate_one_locked(self) -> int:
        if self._n_freed:
            self._n_free -= 1
            self._n_freed -= 1
            slot: int = self._free_at[self._n_freed]
            self._shrink_free_locked()
            return slot
        if self._n_free:  # none was freed after use: the next never handed out
            self._n_free -= 1
            slot = self._fresh
            self._fresh = slot + 1
            return slot
        return int(self._allocate_locked(1)[0])

    def _take_free_few_locked(self, k: int) -> list[int]:
        """The top ``k`` of the free list (the caller checked there are k), in the order
        it pops them. Leaves the entries it popped in ``_free`` (a caller may put them back
        by restoring the counts)."""
        top = self._n_freed
        j = min(k, top)
        out: list[int] = self._free_at[top - j : top].tolist()
        out.reverse()  # the stack pops its top first
        self._n_freed = top - j
        if j < k:  # then never handed out, in slot order
            fresh = self._fresh
            out += range(fresh, fresh + k - j)
            self._fresh = fresh + k - j
        self._n_free -= k
        return out

    def _take_free_locked(self, k: int) -> _Slots:
        """:meth:`_take_free_few_locked` as an array, for the array path."""
        top, fresh = self._n_freed, self._fresh
        j = min(k, top)
        out: _Slots
        if not j:  # the common case once freed slots are used up: no stack entry at all
            out = np.arange(fresh, fresh + k, dtype=np.int32)
        else:
            out = self._free[top - j : top][::-1].copy()
            self._n_freed = top - j
            if j < k:
                out = np.concatenate((out, np.arange(fresh, fresh + k - j, dtype=np.int32)))
        self._fresh = fresh + k - j
        self._n_free -= k
        self._shrink_free_locked()
        return out

    def _shrink_free_locked(self) -> None:
        if 4 * self._n_freed < len(self._free) > _FREE_MIN:  # a quarter used: halve it
            self._resize_free_locked(len(self._free) // 2)

    def _resize_free_locked(self, size: int) -> None:
        """The array of slots freed after use, ``size`` entries long (at most one per
        slot: no more can be free)."""
        size = max(min(size, self.num_blocks), self._n_freed)
        new: _Slots = np.empty(size, dtype=np.int32)
        new[: self._n_freed] = self._free[: self._n_freed]
        self._free, self._free_at = new, new.data

    def _hold_locked(self, owner: Hashable, slots: _Slots) -> None:
        """Free or just evicted slots -> RESERVED by ``owner``."""
        holder = self._holder_locked(owner)
        self._state[slots] = _RESERVED
        self._owner[slots] = holder.oid
        holder.count += len(slots)
        self._n_reserved += len(slots)

    def _holder_locked(self, owner: Hashable) -> _Holder:
        """``owner``'s record, made (with a free id) if it holds no reservation yet."""
        holder = self._holders.get(owner)
        if holder is None:
            oid = self._spare_ids.pop() if self._spare_ids else self._new_id()
            holder = self._holders[owner] = self._holder_ids[oid] = _Holder(owner, oid)
        return holder

    def _new_id(self) -> int:
        oid = self._next_id
        self._next_id += 1
        if oid > np.iinfo(self._owner.dtype).max:  # so many owners at once: widen the ids
            self._owner = self._owner.astype(np.int32)
            self._owner_at = self._owner.data
        return oid

    def _unhold_locked(self, holder: _Holder, slots: _Slots) -> None:
        """``holder``'s reservation of these (distinct) slots ends; the caller moves
        them on to their next state. An owner's record, and its id, go with its last
        reservation, so ids are reused: hence every call that settles slots over several
        batches stops once the owner holds none."""
        self._owner[slots] = 0
        self._unheld_locked(holder, len(slots))

    def _unheld_locked(self, holder: _Holder, n: int) -> None:
        """The counts of :meth:`_unhold_locked`, once its ``n`` slots' ids are cleared."""
        holder.count -= n
        self._n_reserved -= n
        if not holder.count and holder.owner is not _HOST_PUT:
            del self._holders[holder.owner]
            del self._holder_ids[holder.oid]
            self._spare_ids.append(holder.oid)

    def _end_host_put_locked(self, slot: int) -> None:
        self._owner_at[slot] = 0
        self._holders[_HOST_PUT].count -= 1  # the host's record is permanent
        self._n_reserved -= 1

    def _slot_array(self, owner: Hashable, slots: Sequence[int]) -> _Slots:
        """The caller's slots as an int64 array; ValueError (as for a slot not reserved by
        ``owner``) for anything but ints in range."""
        try:
            arr = _int64s(slots)
        except (TypeError, struct.error):
            arr = np.array([-1])
        if len(arr) and (arr.min() < 0 or arr.max() >= self.num_blocks):
            bad = next(
                (
                    s
                    for s in slots
                    if not isinstance(s, int | np.integer) or not 0 <= s < self.num_blocks
                ),
                slots[0],
            )
            raise ValueError(f"slot {bad!r} is not reserved by {owner!r}")
        return arr

    def _check_reserved_serial(self, owner: Hashable, slots: _Slots) -> _Holder:
        """ValueError unless ``owner`` reserves every slot; its record.

        One pass, without ``_lock``: the answer cannot change under it, nor after it,
        because only ``owner``'s own calls (which ``_serial``, held by the caller,
        excludes) create or drop its record, write its id into ``_owner`` or take it out;
        what the host writes there meanwhile is other slots' entries, never this id.
        """
        holder = self._holders.get(owner) or _Holder(owner, -1)  # -1 matches no slot
        wrong = self._owner[slots] != holder.oid
        if np.count_nonzero(wrong):
            bad = int(slots[wrong.argmax()])
            raise ValueError(f"slot {bad!r} is not reserved by {owner!r}")
        return holder

    def _settle(self, owner: Hashable, slots: Sequence[int], until: float | None) -> None:
        """Reserved -> FREE (``until`` None) or QUARANTINED; duplicates are harmless."""
        if len(slots) <= self._small_keys:
            self._settle_small(owner, self._slot_list(owner, slots), until)
            return
        arr = self._slot_array(owner, slots)
        step = self.batch_keys
        with _Serial(self):
            holder = self._check_reserved_serial(owner, arr)
            for start in range(0, len(arr), step):
                with _Batch(self):
                    if not holder.count:
                        break  # all settled; the rest are duplicates
                    batch = arr[start : start + step]
                    mine = batch[self._owner[batch] == holder.oid]  # settled ones drop out
                    if len(mine) > 1:
                        distinct = dict.fromkeys(mine.tolist())
                        if len(distinct) < len(mine):
                            mine = np.fromiter(distinct, np.int64, len(distinct))
                    self._settle_locked(holder, mine, until)

    def _settle_locked(self, holder: _Holder, slots: _Slots, until: float | None) -> None:
        owner = holder.owner
        self._unhold_locked(holder, slots)
        if until is None:
            self._free_many_locked(slots)
            return
        self._state[slots] = _QUARANTINED
        listed = slots.tolist()
        self._quarantine.update(dict.fromkeys(listed, (until, owner)))
        heap = self._deadlines
        for slot in listed:
            heapq.heappush(heap, (until, slot))

    def _commit_locked(self, slots: _Slots, keys: list[bytes]) -> list[bool]:
        """Publish reserved slots as their keys; a key already present (or listed before
        in the batch) keeps its block and the slot is freed."""
        listed = slots.tolist()
        # Each key's slot once the call is done: ours if it was absent, else the one kept.
        mapped = list(map(self._map.setdefault, keys, listed))
        if mapped == listed:
            self._publish_many_locked(slots, keys)
            return [True] * len(listed)
        kept = np.fromiter(mapped, np.int64, len(mapped)) == slots
        self._free_many_locked(slots[~kept])
        self._publish_many_locked(slots[kept], list(compress(keys, kept.tolist())))
        out: list[bool] = kept.tolist()
        return out

    def _publish_many_locked(self, slots: _Slots, keys: list[bytes]) -> None:
        """Slots the map now sends ``keys`` to become OCCUPIED and most recently used."""
        self._slot_key[slots] = np.fromiter(keys, object, len(keys))
        self._state[slots] = _OCCUPIED
        self._lru.push(slots)

    def _publish_locked(self, slot: int, key: bytes) -> None:
        old = self._map.get(key)
        if old is not None:
            if self._pin_count_at[old]:
                self._slot_key[old] = None  # orphan: freed when its last pin drops
                self._n_orphans += 1
            else:
                self._lru.drop(old)
                self._free_one_locked(old)
        self._map[key] = slot
        self._slot_key[slot] = key
        self._state_at[slot] = _OCCUPIED
        self._lru.push_one(slot)

    def _free_one_locked(self, slot: int) -> None:
        self._state_at[slot] = _FREE
        self._slot_key[slot] = None
        top = self._n_freed
        if top == len(self._free):
            self._resize_free_locked(max(2 * top, _FREE_MIN))
        self._free_at[top] = slot
        self._n_freed = top + 1
        self._n_free += 1

    def _free_many_locked(self, slots: _Slots) -> None:
        """FREE, pushed in this order (so the stack pops the last one first)."""
        self._state[slots] = _FREE
        self._slot_key[slots] = None
        top, n = self._n_freed, len(slots)
        if top + n > len(self._free):
            self._resize_free_locked(max(2 * len(self._free), top + n, _FREE_MIN))
        self._free[top : top + n] = slots
        self._n_freed = top + n
        self._n_free += n

    def _pin_locked(self, owner: Hashable, found: list[int]) -> list[int | None]:
        """One more pin of ``owner`` on each found slot (-1: the key is absent); the
        slots, None for the absent ones."""
        slots = _int64s(found)
        ordered = slots.copy()
        ordered.sort()  # (NumPy's reductions cost more than a sort of one batch)
        if not len(found) or ordered[0] >= 0:
            out: list[int | None] = found  # type: ignore[assignment]  # no None in it
            listed = found
        else:
            slots = slots[slots >= 0]
            ordered = ordered[ordered.searchsorted(0) :]
            listed = slots.tolist()
            out = [None if slot < 0 else slot for slot in found]
        if not listed:
            return out
        pins = self._pins.get(owner)
        if pins is None:
            pins = self._pins[owner] = _Pins()
        pin_count = self._pin_count
        if not np.count_nonzero(ordered[1:] == ordered[:-1]):
            before = pin_count[slots]
            pin_count[slots] = before + 1
        else:  # a key listed twice in this batch
            per_slot = Counter(listed)
            slots = np.fromiter(per_slot, np.int64, len(per_slot))
            before = pin_count[slots]
            pin_count[slots] = before + np.fromiter(per_slot.values(), np.int32, len(per_slot))
            pins.distinct = False
        if np.count_nonzero(before):
            if pins.total:
                pins.distinct = False  # one of them may be this owner's
            newly = slots[before == 0]
        else:
            newly = slots
        self._lru.drop_many(newly)
        self._pinned_slots += len(newly)
        pins.chunks.append(slots if pins.distinct else np.array(listed, dtype=np.int64))
        pins.total += len(listed)
        return out

    def _unpin_serial(self, owner: Hashable) -> int:
        """Drop every pin of ``owner`` in batches, in pin order (so keys re-enter the LRU
        in the order they were first pinned). The slots are read once, outside ``_lock``:
        only engine-side calls change them, and ``_serial`` excludes those. The owner's
        total drops batch by batch (so ``pins_of`` is exact); its entry goes with the last
        batch. The caller holds ``_serial``; up to ``_small_keys`` pins take the scalar
        path, more start the call's GIL-offer clock here."""
        pins = self._pins.get(owner)
        if pins is None:
            return 0
        if pins.total <= self._small_keys:
            self._turn.acquire()
            self._turn.release()
            self._lock.acquire()
            try:
                released = self._drop_all_small_locked(pins)
                del self._pins[owner]
                return released
            finally:
                self._lock.release()
        self._offered_at = _clock()
        drops: _Slots | None = None
        if pins.distinct:
            slots = pins.slots()
        else:
            counts = pins.counts()
            slots = np.fromiter(counts, np.int64, len(counts))
            drops = np.fromiter(counts.values(), np.int64, len(counts))
        n = len(slots)
        step = self.batch_keys
        released = 0
        for start in range(0, n, step):
            with _Batch(self):
                end = start + step
                part = None if drops is None else drops[start:end]
                released += self._drop_pins_locked(pins, slots[start:end], part)
                if end >= n:
                    del self._pins[owner]
        return released

    def _drop_pins_locked(self, pins: _Pins, slots: _Slots, drops: _Slots | None) -> int:
        """Take ``drops[i]`` (None: 1) of ``pins``' pins off each (distinct) ``slots[i]``;
        a slot whose last pin drops becomes evictable again as most recently used (in this
        order), or FREE if it is an orphan."""
        left = self._pin_count[slots] - (1 if drops is None else drops)
        self._pin_count[slots] = left
        released = len(slots) if drops is None else int(drops.sum())
        pins.total -= released
        done = slots[left == 0]
        if len(done):
            self._pinned_slots -= len(done)
            if self._n_orphans:
                keyed = self._slot_key[done].astype(bool)
                orphans = done[~keyed]
                self._n_orphans -= len(orphans)
                self._free_many_locked(orphans)  # orphans' last pins
                done = done[keyed]
            self._lru.push(done)
        return released

    def _check_slot(self, slot: int) -> int:
        """``slot`` as a Python int: a NumPy int's own arithmetic wraps (np.int32(1024) *
        2 MiB is negative: a view of another slot's bytes)."""
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise TypeError(f"slot must be an int, got {slot!r}")
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"slot {slot} out of range [0, {self.num_blocks})")
        return int(slot)

    def _lru_keys(self) -> list[bytes]:
        """Test hook: the evictable keys, least recently used first."""
        with self._turn, self._lock:
            keys: list[bytes] = self._slot_key[self._lru.live()].tolist()
            return keys

    def _reserved_by(self, owner: Hashable) -> list[int]:
        """Test hook: the slots ``owner`` reserves, in slot order."""
        with self._turn, self._lock:
            holder = self._holders.get(owner)
            if holder is None:
                return []
            slots: list[int] = np.flatnonzero(self._owner == holder.oid).tolist()
            return slots

    def _check_invariants(self) -> None:
        """Test hook: assert every internal structure agrees with every other (no
        engine-side call may be in progress, so it waits for one to end)."""
        with self._serial, self._turn, self._lock:
            n = self.num_blocks
            state, owner, slot_key = self._state, self._owner, self._slot_key
            assert self._claimed == 0
            free = self._free[: self._n_freed].tolist() + list(range(self._fresh, n))
            assert self._n_free == len(free) <= n
            assert sorted(free) == np.flatnonzero(state == _FREE).tolist()
            reserved = state == _RESERVED
            assert ((owner != 0) == reserved).all()
            assert self._n_reserved == int(reserved.sum())
            assert self._holder_ids[_HOST_PUT_ID] is self._holders[_HOST_PUT]
            assert len(self._holders) == len(self._holder_ids)
            for oid, holder in self._holder_ids.items():
                assert holder.oid == oid and self._holders[holder.owner] is holder
                assert holder.count == int((owner == oid).sum())
                assert holder.count > 0 or holder.owner is _HOST_PUT
            assert set(np.unique(owner[reserved]).tolist()) <= set(self._holder_ids)
            assert not set(self._spare_ids) & set(self._holder_ids)
            quarantined = np.flatnonzero(state == _QUARANTINED).tolist()
            assert set(self._quarantine) == set(quarantined)
            keyed = slot_key.astype(bool)
            for key, slot in self._map.items():
                assert state[slot] == _OCCUPIED and slot_key[slot] == key
            assert sorted(self._map.values()) == np.flatnonzero(keyed).tolist()
            per_slot = np.zeros(n, dtype=np.int64)
            for pins in self._pins.values():
                slots = pins.slots()
                assert pins.total == len(slots) > 0
                assert not pins.distinct or len(np.unique(slots)) == len(slots)
                per_slot += np.bincount(slots, minlength=n)
            assert (per_slot == self._pin_count).all()
            pinned = per_slot > 0
            assert self._pinned_slots == int(pinned.sum())
            assert (state[pinned] == _OCCUPIED).all()
            assert keyed[(state == _OCCUPIED) & ~pinned].all()  # unpinned orphans are freed
            assert self._n_orphans == int(((state == _OCCUPIED) & ~keyed).sum())
            evictable = keyed & ~pinned
            assert ((self._lru.pos_of >= 0) == evictable).all()
            live = self._lru.live()
            assert sorted(live.tolist()) == np.flatnonzero(evictable).tolist()
            assert self._lru.count == len(live)


_Slots = npt.NDArray[np.integer[Any]]


class _Lru:
    """The evictable slots in the order they became evictable (published, touched, or
    their last pin dropped): least recently used first. Used under ``BlockStore._lock``.

    A log of slots, appended at the tail, read from the head. An entry is live while
    ``pos_of[slot]`` is its position in the log: a slot leaves (pinned, evicted, freed,
    overwritten in place) by setting that to -1, and a later entry of the slot supersedes
    an earlier one. Dead entries are dropped by a compaction that runs in steps of
    ``5 * room`` entries, one per push (of at most ``room`` slots), so that no call does
    more than a bounded amount of it: once the tail passes three quarters of the log, live
    entries are copied, in order, from ``r`` down to ``w`` at the front (their ``pos_of``
    moves with them). The log holds ``slots[head:w]`` then ``slots[r:tail]`` (the gap
    between is garbage); outside a compaction ``w == r``.

    Why it never fills: the log has ``S = 2 * num_blocks + 20 * room`` entries. A
    compaction starts with the tail at most ``3/4 S + room`` and reads five entries for
    each one pushed meanwhile, so it ends with the tail at most 5/4 of that, ``15/16 S +
    5/4 room``, which is at most ``S`` because ``S >= 20 * room``; it leaves the tail at
    the live count, at most ``num_blocks``. So more than ``num_blocks / 2`` entries are
    pushed between compactions, and a full store's compactions read about four entries
    per push, as they did when the log had ``3 * num_blocks`` entries and compacted from
    half full (4 bytes per block more). Positions, not sequence
    numbers, mark the live entries: 4 bytes per slot and 4 per log entry, 12 bytes per
    block in all, where the slot and its 64-bit sequence number cost 12 per entry and the
    sequence 8 per slot (docs/design.md, "Store in bulk").
    """

    __slots__ = (
        "compacting",
        "count",
        "head",
        "pos_of",
        "pos_of_at",
        "r",
        "slots",
        "slots_at",
        "start",
        "step",
        "tail",
        "w",
    )

    def __init__(self, num_blocks: int, room: int) -> None:
        size = 2 * num_blocks + 20 * room  # the class docstring says why
        dtype = np.int32 if size < _POS32_ENTRIES else np.int64
        self.pos_of: _Slots = np.full(num_blocks, -1, dtype=dtype)  # per slot; -1: not evictable
        self.slots: _Slots = np.empty(size, dtype=dtype)
        # memoryviews of the two, for the scalar path (BlockStore._state_at and so on)
        self.pos_of_at = self.pos_of.data
        self.slots_at = self.slots.data
        self.head = self.w = self.r = self.tail = 0
        self.count = 0  # live entries: evictable slots
        self.step = 5 * room
        self.start = 3 * size // 4  # a compaction starts once the tail reaches this
        self.compacting = False

    def push(self, slots: _Slots) -> None:
        """Slots that just became evictable, in this order, as most recently used."""
        n = len(slots)
        if self.tail + n > len(self.slots):
            self._grow(n)
        tail = self.tail
        self.slots[tail : tail + n] = slots
        self.pos_of[slots] = np.arange(tail, tail + n)
        self.tail = tail + n
        self.count += n
        self._compact_step()

    def push_one(self, slot: int) -> None:
        if self.tail == len(self.slots):
            self._grow(1)
        tail = self.tail
        self.slots_at[tail] = slot
        self.pos_of_at[slot] = tail
        self.tail = tail + 1
        self.count += 1
        if self.compacting or self.tail >= self.start:
            self._compact_step()

    def push_few(self, slots: list[int]) -> None:
        """:meth:`push` for the scalar path: one compaction step, as for one push."""
        n = len(slots)
        if self.tail + n > len(self.slots):
            self._grow(n)
        tail = self.tail
        slots_at, pos_of_at = self.slots_at, self.pos_of_at
        for slot in slots:
            slots_at[tail] = slot
            pos_of_at[slot] = tail
            tail += 1
        self.tail = tail
        self.count += n
        if self.compacting or tail >= self.start:
            self._compact_step()

    def drop(self, slot: int) -> None:
        """An evictable slot leaves."""
        self.pos_of_at[slot] = -1
        self.count -= 1

    def drop_many(self, slots: _Slots) -> None:
        """Evictable (distinct) slots leave."""
        self.pos_of[slots] = -1
        self.count -= len(slots)

    def take(self, n: int) -> _Slots:
        """The n least recently used slots, taken out (the caller checked there are n)."""
        parts = []
        need = n
        while need:
            in_front = self.head < self.w
            lo = self.head if in_front else self.r
            hi = min(self.w if in_front else self.tail, lo + max(2 * need, 64))
            if hi == lo:  # never: count says there are n; fail rather than spin under _lock
                raise RuntimeError(f"LRU log holds fewer than {n} live entries")
            seg = self.slots[lo:hi]
            live = np.flatnonzero(self._is_live(seg, lo))[:need]
            parts.append(seg[live])
            need -= len(live)
            end = lo + int(live[-1]) + 1 if not need else hi
            if in_front:
                self.head = end
            else:
                self._front_emptied(end)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.drop_many(out)
        return out

    def take_few(self, n: int) -> list[int] | None:
        """:meth:`take` on the scalar path, with the same result and the same log state
        after it; or None, nothing taken, if more than ``n + 64`` entries would be read."""
        slots_at, pos_of_at = self.slots_at, self.pos_of_at
        budget = n + 64
        out: list[int] = []
        back = (False, self.r, self.tail)
        parts = ((True, self.head, self.w), back) if self.head < self.w else (back,)
        for in_front, lo, hi in parts:
            for pos in range(lo, hi):
                if not budget:
                    return None
                budget -= 1
                slot = slots_at[pos]
                if pos_of_at[slot] == pos:
                    out.append(slot)
                    if len(out) == n:
                        if in_front:
                            self.head = pos + 1
                        else:
                            self._front_emptied(pos + 1)
                        for slot in out:
                            pos_of_at[slot] = -1
                        self.count -= n
                        return out
        raise RuntimeError(f"LRU log holds fewer than {n} live entries")

    def _front_emptied(self, end: int) -> None:
        """A take read up to ``end`` behind the front, which is empty. Outside a compaction
        the log is ``[end, tail)``. During one, what it copied is gone too, so it goes on
        copying to the front of the log, not in place from ``end``: in place, it would end
        with the tail where it started, past where the next one starts, and the log would
        fill and grow (the bound in the class docstring needs every compaction to end with
        the tail at the live count)."""
        if self.compacting:
            self.head = self.w = 0
            self.r = end
        else:
            self.head = self.w = self.r = end

    def live(self) -> _Slots:
        """Test hook: the live entries' slots, least recently used first."""
        parts = ((self.head, self.w), (self.r, self.tail))
        segs = [(self.slots[a:b], a) for a, b in parts]
        out: _Slots = np.concatenate([seg[self._is_live(seg, a)] for seg, a in segs])
        return out

    def _is_live(self, seg: _Slots, lo: int) -> npt.NDArray[np.bool_]:
        """Which entries of ``seg`` (the log from position ``lo`` on) are live."""
        live: npt.NDArray[np.bool_] = self.pos_of[seg] == np.arange(lo, lo + len(seg))
        return live

    def _compact_step(self) -> None:
        if not self.compacting:
            if self.tail < self.start:
                return
            # Start: what is in the log lies in [head, tail), w == r; copy it to the front.
            self.compacting = True
            self.r, self.head, self.w = self.head, 0, 0
        r, w = self.r, self.w
        end = min(self.tail, r + self.step)
        seg = self.slots[r:end]
        moved = seg[self._is_live(seg, r)]
        n = len(moved)
        self.slots[w : w + n] = moved
        self.pos_of[moved] = np.arange(w, w + n)
        self.w, self.r = w + n, end
        if end == self.tail:
            self.tail = self.r = self.w
            self.compacting = False

    def _grow(self, room: int) -> None:
        # Not reached while compaction keeps up (see the class docstring); a safety net.
        # Positions keep their values, so pos_of holds; it widens if they could outgrow it.
        size = 2 * (len(self.slots) + room)
        dtype = self.slots.dtype if size < _POS32_ENTRIES else np.dtype(np.int64)
        new: _Slots = np.empty(size, dtype=dtype)
        new[: self.tail] = self.slots[: self.tail]
        self.slots, self.slots_at = new, new.data
        self.start = 3 * size // 4
        if self.pos_of.dtype != dtype:
            self.pos_of = self.pos_of.astype(dtype)
            self.pos_of_at = self.pos_of.data


class _Pins:
    """One owner's pins: the slots each pin batch pinned, in pin order (a slot once per
    pin): an array from the array path, a list of ints from the scalar path; the two mix
    freely. ``distinct`` while no slot is in them twice, so an unpin needs no counting."""

    __slots__ = ("chunks", "distinct", "total")

    def __init__(self) -> None:
        self.chunks: list[_Slots | list[int]] = []
        self.distinct = True
        self.total = 0  # pins held: the chunks' length less what an unpin has dropped

    def slots(self) -> _Slots:
        chunks = self.chunks
        if len(chunks) == 1:
            chunk = chunks[0]
            return np.array(chunk, dtype=np.int64) if isinstance(chunk, list) else chunk
        out: _Slots = np.concatenate(chunks)
        return out

    def listed(self) -> list[int]:
        """:meth:`slots` as a list (the caller must not change it)."""
        chunks = self.chunks
        if len(chunks) == 1 and isinstance(chunks[0], list):
            return chunks[0]
        out: list[int] = []
        for chunk in chunks:
            out += chunk if isinstance(chunk, list) else chunk.tolist()
        return out

    def counts(self) -> dict[int, int]:
        """slot -> pins, in the order the slots were first pinned."""
        listed = self.listed()
        return dict.fromkeys(listed, 1) if self.distinct else Counter(listed)

    def set_counts(self, counts: dict[int, int]) -> None:
        slots = np.fromiter(counts, np.int64, len(counts))
        self.chunks = [np.repeat(slots, np.fromiter(counts.values(), np.int64, len(counts)))]
        self.distinct = all(c == 1 for c in counts.values())


class _Holder:
    """An owner holding reserved slots: its id in ``BlockStore._owner`` and how many."""

    __slots__ = ("count", "oid", "owner")

    def __init__(self, owner: Hashable, oid: int) -> None:
        self.owner = owner
        self.oid = oid
        self.count = 0


_PACKERS: dict[int, struct.Struct] = {}


def _int64s(values: Sequence[int]) -> _Slots:
    """A list of ints as an int64 array: the fastest conversion there is, and strict
    (``struct`` takes only what has ``__index__``; NumPy would take floats and strings
    too). ``struct.error`` or TypeError for anything else."""
    n = len(values)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = struct.Struct(f"{n}q")
        if n <= BATCH_KEYS:
            _PACKERS[n] = packer
    return np.frombuffer(packer.pack(*values), dtype=np.int64)


def _take_pins(counts: dict[int, int], slots: Iterable[int]) -> dict[int, int]:
    """Take one pin off ``counts`` per listed slot (slots it holds no pin on are skipped):
    slot -> pins dropped, ordered by each slot's last drop (when its count can reach 0,
    i.e. when it re-enters the LRU)."""
    dropped: dict[int, int] = {}
    for slot in slots:
        held = counts.get(slot)
        if not held:
            continue
        if held == 1:
            del counts[slot]
        else:
            counts[slot] = held - 1
        dropped[slot] = dropped.pop(slot, 0) + 1
    return dropped


def _check_key(key: object) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not key:
        raise ValueError("key must not be empty")


def _check_until(until: float, name: str = "until") -> None:
    if not isinstance(until, int | float) or math.isnan(until):
        raise ValueError(f"{name} must be a number, got {until!r}")


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
