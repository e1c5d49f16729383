"""A model-based test of whole nodes over the REAL NIXL data plane (skipped without NIXL).

``tests/test_node_model.py`` drives nodes over the FAKE in-process data plane; here the
bytes move through NIXL between two processes, so the consumer's landing, the coalescing
of consecutive slots (``transport/_runs.py``, design "Coalescing"), scattered slots and
the checksums (``verify_checksums`` on both sides) run for real. NIXL takes one agent per
process, so: the source is one child process (``tests/node_proc.py``, driven over its
control socket by :class:`~tests.node_proc.BlockingNodeProcess`), the consumer one
``start_node`` facade node in this process. Both are started once for the test function;
every Hypothesis example starts from a clean slate (no session, both stores empty) and
connects anew.

The source's host puts keys of a small pool (so they collide), in one ``put`` a range in
order (consecutive slots: coalesced runs) or keys in any order, each put with a new
generation's bytes (:func:`~tests.node_proc.gen_bytes`), over a block the source holds
(pinned or not) or after evicting it; it evicts and takes its unused pins back
(``release_unused_pins``), and disconnects the consumer. The consumer looks keys up
(anonymous rounds, and held rounds that a later fetch names or a release gives back),
fetches a range in order or keys shuffled, keeps two fetches of overlapping keys in flight
at once (``submit_fetch``, the source's host putting or evicting one of them meanwhile),
evicts, scatters its free slots (filler blocks, every other one evicted, so a fetch lands
in holes between blocks), and disconnects and reconnects. ``copy_threads=2`` on the
source: a post of 8 blocks or more that holds runs goes out as explicit run descriptors,
a smaller one as prepared per-block dlists that NIXL merges.

Checked after every step: every key the consumer holds holds exactly the bytes of a
generation the source held for it when a lookup (or fetch) of the consumer pinned it (a
held round's fetch: exactly what that round pinned; nothing raced: exactly the source's
current generation); a block the consumer held is never touched, and neither is a filler
block (a write landing in the wrong slot shows there); outcomes split the keys given and,
where nothing raced, are loaded or ``miss`` exactly; once no round is open the source
holds no pin, reservation or write in flight, and the consumer no reservation,
quarantine or orphan.

A defect that makes a landing fail its checksum shows as its assertion ("checksum
mismatch" in ``failed``, or quarantined slots left); Hypothesis may then add
``FlakyStrategyDefinition``, since the failed landing's quarantine outlives the example
and its replay takes other slots. Read the first error.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import threading
from pathlib import Path
from typing import ClassVar

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from p2pkv import BlockingNode, FetchResult, LookupRound, NodeConfig, start_node
from p2pkv.transport import _nixl_agent

from .helpers import leftover_threads, wait_for
from .node_proc import BlockingNodeProcess, block_key, gen_bytes

_HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13 (or nixl-cu12)"),
]

BOUND = 10.0  # seconds: "this did not hang", never an expected duration
SLOW = os.environ.get("P2PKV_SLOW") == "1"
BLOCK = 16 * 1024
SEED = 41  # the keys of the pool
FILLER_SEED = 42  # the consumer's filler blocks
N_KEYS = 20  # >= 16: a post of 16 blocks with runs keeps pieces of 2 (copy_threads=2)
N_FILLER = 16
SRC_BLOCKS = 256  # 4 MiB: room for orphans of pinned blocks put again
DST_BLOCKS = 64  # 1 MiB
KEYS = [block_key(SEED, i) for i in range(N_KEYS)]
FILLER = [block_key(FILLER_SEED, i) for i in range(N_FILLER)]
SRC_ID, DST_ID = "nm-src", "nm-dst"
# Every example connects anew (and reconnects): far more than the default rate a node lets
# one peer register at.
REGISTRATIONS = 1_000_000

indexes = st.integers(0, N_KEYS - 1)
some = st.lists(indexes, min_size=1, max_size=N_KEYS, unique=True)


def keys_of(idx: list[int]) -> list[bytes]:
    return [KEYS[i] for i in idx]


def filler_bytes(i: int) -> bytes:
    return gen_bytes(FILLER_SEED, i, 0, BLOCK)


def check_partition(keys: list[bytes], result: FetchResult) -> None:
    """Every key given is loaded or failed, once; nothing else is either. No fetch here
    races a disconnect or a deadline, and every byte moved is the source's: a key fails
    only for want of a block ("miss") or of a held round's pins ("not_pinned"), never
    a checksum, a transfer error or a timeout."""
    assert isinstance(result, FetchResult), result
    assert len(result.loaded) == len(set(result.loaded))
    assert set(result.loaded) | set(result.failed) == set(keys)
    assert not set(result.loaded) & set(result.failed)
    assert set(result.failed.values()) <= {"miss", "not_pinned"}, result.failed


@attrs.define
class World:
    """What lives for the whole test function: the source child and the consumer node."""

    child: BlockingNodeProcess
    node: BlockingNode
    gens: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))


@attrs.define
class Held:
    """A held round (``lookup_round``) as the model knows it."""

    handle: LookupRound
    idx: list[int]
    pinned: dict[int, int]  # key index -> the generation its lookup pinned (hits)
    cut: bool = False  # the source's host took its pins back since


class NixlNodeModel(RuleBasedStateMachine):
    world: ClassVar[World | None] = None

    def __init__(self) -> None:
        super().__init__()
        assert self.world is not None
        self.child = self.world.child
        self.node = self.world.node
        self.src: dict[int, int] = {}  # what the source holds: key index -> generation
        self.has: dict[int, int] = {}  # what the consumer's store holds
        # Generations an anonymous round of the consumer may pin (its lookups' hits): a
        # fetch may load them from that round, or look the key up anew.
        self.anon: dict[int, set[int]] = {}
        self.held: list[Held] = []
        self.filler: set[int] = set()  # filler blocks the consumer holds
        self.connected = False

    # ------------------------------------------------------------ set-up

    @initialize(scatter=st.integers(0, 3), start=indexes, n=st.integers(0, N_KEYS))
    def clean_slate(self, scatter: int, start: int, n: int) -> None:
        """Both stores empty, no session (the last example's teardown), then connect."""
        assert self.child.call("evict_all")["kept"] == 0
        assert len(self.node.store) == 0, self.node.store.keys()
        self.connect()
        if scatter:
            self.scatter(scatter, ascending=True)
        if n:
            self.put_range(start, n)

    def teardown(self) -> None:
        """Back to a clean slate for the next example (checked by its ``clean_slate``)."""
        if self.node.is_connected(SRC_ID):
            self.node.disconnect(SRC_ID, timeout=BOUND)
        wait_for(lambda: self.child.call("stats")["stats"]["peers"] == 0)
        wait_for(lambda: self.child.call("stats")["stats"]["pinned_slots"] == 0)
        self.child.call("evict_all")
        for key in list(self.node.store.keys()):
            assert self.node.store.evict(key), key

    def connect(self) -> None:
        peer = self.node.connect(self.child.address, timeout=BOUND)
        assert peer.peer_id == SRC_ID
        self.connected = True

    def gen(self) -> int:
        assert self.world is not None
        return next(self.world.gens)

    # ------------------------------------------------------------ the source's host

    def src_put(self, idx: list[int]) -> None:
        gen = self.gen()
        self.child.call("put", seed=SEED, indexes=idx, gen=gen)
        for i in idx:
            self.src[i] = gen

    @rule(start=indexes, n=st.integers(1, N_KEYS))
    def put_range(self, start: int, n: int) -> None:
        """A range of keys in order: fresh slots in a row at the source (runs)."""
        self.src_put(list(range(start, min(start + n, N_KEYS))))

    @rule(idx=some)
    def put_some(self, idx: list[int]) -> None:
        self.src_put(idx)

    def pinned_now(self, i: int) -> bool:
        """A held round surely pins the block the source holds for key ``i``."""
        return any(not h.cut and h.pinned.get(i) == self.src.get(i) for h in self.held)

    def may_be_pinned(self, i: int) -> bool:
        return self.pinned_now(i) or self.src.get(i) in self.anon.get(i, set())

    def src_evict(self, idx: list[int]) -> None:
        """Evict at the source. A block no round of the model pins may still be pinned
        a moment after the consumer's call that let its round go returned (a release,
        or a round's close, is sent without waiting for the source): such a block is
        evicted again until it goes (a pin that never goes fails ``wait_for``'s bound)."""
        dropped = set(self.child.call("evict", seed=SEED, indexes=idx)["dropped"])
        late = [i for i in idx if i not in dropped and i in self.src and not self.may_be_pinned(i)]
        if late:

            def gone() -> bool:
                again = self.child.call("evict", seed=SEED, indexes=late)["dropped"]
                dropped.update(again)
                return set(late) <= dropped

            wait_for(gone)
        for i in idx:
            if i in dropped:
                assert i in self.src and not self.pinned_now(i), (i, "a pinned block evicted")
                del self.src[i]

    @rule(idx=some)
    def evict_at_source(self, idx: list[int]) -> None:
        self.src_evict(idx)

    @rule(idx=some)
    def evict_and_put_again(self, idx: list[int]) -> None:
        """Evict keys and put them again with a new generation's bytes."""
        self.src_evict(idx)
        self.src_put(idx)

    @rule()
    def source_releases_unused_pins(self) -> None:
        self.child.call("release_unused_pins")
        self.anon.clear()  # a fetch on those rounds looks its keys up again
        for h in self.held:
            h.pinned.clear()
            h.cut = True

    # ------------------------------------------------------------ the consumer

    @rule(idx=some)
    def evict_at_consumer(self, idx: list[int]) -> None:
        for i in idx:
            assert self.node.store.evict(KEYS[i]) == (i in self.has), i
            self.has.pop(i, None)

    @rule(width=st.integers(1, 3), ascending=st.booleans())
    def scatter(self, width: int, ascending: bool) -> None:
        """Filler blocks in free slots, then holes among them: ``width`` evicted in a row,
        then one kept (a block on each side of every hole). Freed slots are handed out
        last freed first: evicted from the last, a fetch's slots ascend through each
        hole (runs of ``width`` on this side), else they descend (no run)."""
        for i in range(N_FILLER):
            if i not in self.filler:
                self.node.store.put(FILLER[i], filler_bytes(i))
                self.filler.add(i)
        holes = [i for i in range(N_FILLER) if i % (width + 1) != width]
        for i in reversed(holes) if ascending else holes:
            assert self.node.store.evict(FILLER[i])
            self.filler.discard(i)

    @precondition(lambda self: self.connected)
    @rule(idx=some)
    def lookup(self, idx: list[int]) -> None:
        hits = self.node.lookup(SRC_ID, keys_of(idx), timeout=BOUND)
        assert hits == [i in self.src for i in idx]
        for i, hit in zip(idx, hits, strict=True):
            if hit:
                self.anon.setdefault(i, set()).add(self.src[i])

    @precondition(lambda self: self.connected)
    @rule(idx=some)
    def lookup_round(self, idx: list[int]) -> None:
        handle = self.node.lookup_round(SRC_ID, keys_of(idx), timeout=BOUND)
        assert handle.hits == [i in self.src for i in idx]
        self.held.append(Held(handle, idx, {i: self.src[i] for i in idx if i in self.src}))

    @precondition(lambda self: self.connected)
    @rule(start=indexes, n=st.integers(1, N_KEYS), shuffle=st.randoms(use_true_random=False))
    def fetch_range(self, start: int, n: int, shuffle: random.Random) -> None:
        """A range of keys, in order or shuffled (``run_order`` must pair them again)."""
        idx = list(range(start, min(start + n, N_KEYS)))
        if shuffle.random() < 0.5:
            shuffle.shuffle(idx)
        self.fetch(idx, None)

    @precondition(lambda self: self.connected)
    @rule(idx=some)
    def fetch_some(self, idx: list[int]) -> None:
        self.fetch(idx, None)

    @precondition(lambda self: self.connected and bool(self.held))
    @rule(pick=st.integers(0, 7), mask=st.lists(st.booleans(), min_size=N_KEYS, max_size=N_KEYS))
    def fetch_round(self, pick: int, mask: list[bool]) -> None:
        """All of a held round's keys or a part, naming the round."""
        held = self.held.pop(pick % len(self.held))
        idx = [i for n, i in enumerate(held.idx) if mask[n]] or held.idx[:1]
        self.fetch(idx, held)

    def allowed(self, i: int, held: Held | None) -> set[int]:
        """Generations a fetch (that nothing raced) may load for key ``i``."""
        if held is not None and i in held.pinned:
            return {held.pinned[i]}
        gens = set(self.anon.get(i, set()))
        if i in self.src:
            gens.add(self.src[i])
        return gens

    def expect(self, i: int, result: FetchResult, held: Held | None) -> None:
        """Key ``i``'s outcome in a fetch (naming ``held``) that nothing raced."""
        key = KEYS[i]
        if i in self.has or (held is not None and i in held.pinned):
            assert key in result.loaded, (i, result.failed.get(key))
        elif held is not None and i in held.idx and held.handle.hits[held.idx.index(i)]:
            # a hit whose pins the source's host took back: documented outcome
            assert key in result.loaded or result.failed[key] == "not_pinned", (i, result)
        elif self.anon.get(i, set()) - {self.src.get(i)}:
            pass  # an anonymous round's pinned bytes, or looked up anew: bytes checked
        elif i in self.src:
            assert key in result.loaded, (i, result.failed.get(key))
        else:
            assert result.failed.get(key) == "miss", (i, result.failed.get(key))

    def landed(
        self, idx: list[int], result: FetchResult, had: dict[int, int], allowed: dict[int, set[int]]
    ) -> None:
        """What a fetch reported loaded is in the consumer's store, with the bytes of a
        generation allowed (a block it held already: unchanged)."""
        for i in idx:
            if KEYS[i] not in result.loaded:
                continue
            got = self.read(i)
            if i in had:
                assert got == gen_bytes(SEED, i, had[i], BLOCK), (i, "a held block changed")
                continue
            gen = next((g for g in allowed[i] if got == gen_bytes(SEED, i, g, BLOCK)), None)
            assert gen is not None, (i, "loaded bytes of no generation allowed", allowed[i])
            self.has[i] = gen

    def fetch(self, idx: list[int], held: Held | None) -> None:
        keys = keys_of(idx)
        allowed = {i: self.allowed(i, held) for i in idx}
        had = dict(self.has)
        result = self.node.fetch(
            SRC_ID, keys, rounds=None if held is None else held.handle, timeout=BOUND
        )
        check_partition(keys, result)
        for i in idx:
            self.expect(i, result, held)
        self.landed(idx, result, had, allowed)
        if held is not None:
            hits = {i for i, hit in zip(held.idx, held.handle.hits, strict=True) if hit}
            if not hits & (set(idx) - set(had)):
                self.held.append(held)  # took none of its rounds: still open, still held

    @precondition(lambda self: self.connected and bool(self.held))
    @rule(pick=st.integers(0, 7))
    def release_round(self, pick: int) -> None:
        held = self.held.pop(pick % len(self.held))
        closed = self.node.release(SRC_ID, held.handle, timeout=BOUND)
        assert closed == (1 if any(held.handle.hits) else 0) or held.cut, (closed, held)

    @precondition(lambda self: self.connected)
    @rule(
        first=some,
        second=some,
        churn=st.sampled_from(["none", "put", "evict"]),
        victim=indexes,
    )
    def two_fetches_at_once(
        self, first: list[int], second: list[int], churn: str, victim: int
    ) -> None:
        """Two fetches in flight at once, keys overlapping as drawn; the source's host
        puts a new generation of one key, or evicts it, while they run."""
        allowed = {i: self.allowed(i, None) for i in {*first, *second}}
        had = dict(self.has)
        src_before = dict(self.src)
        tickets = [
            self.node.submit_fetch(SRC_ID, keys_of(idx), timeout=BOUND) for idx in (first, second)
        ]
        churned: set[int] = set()
        if churn == "put":
            self.src_put([victim])
            churned.add(victim)
        elif churn == "evict" and victim in self.src:
            dropped = self.child.call("evict", seed=SEED, indexes=[victim])["dropped"]
            if dropped:  # else pinned (by these fetches, or a round)
                del self.src[victim]
                churned.add(victim)
        if victim in allowed and victim in self.src:
            allowed[victim].add(self.src[victim])
        wait_for(lambda: self.node.pending() == 0)
        outcomes = dict(self.node.get_finished())
        assert sorted(outcomes) == sorted(tickets)
        for ticket, idx in zip(tickets, (first, second), strict=True):
            result = outcomes[ticket]
            assert isinstance(result, FetchResult), result
            check_partition(keys_of(idx), result)
            for i in idx:
                key = KEYS[i]
                if i in had:
                    assert key in result.loaded, (i, result.failed.get(key))
                elif i in churned or self.anon.get(i, set()) - {src_before.get(i)}:
                    pass  # loaded or failed: what loaded is checked below
                elif i in src_before:
                    assert key in result.loaded, (i, result.failed.get(key))
                else:
                    assert result.failed.get(key) == "miss", (i, result.failed.get(key))
        for ticket, idx in zip(tickets, (first, second), strict=True):
            result = outcomes[ticket]
            assert isinstance(result, FetchResult)
            self.landed(idx, result, had, allowed)

    # ------------------------------------------------------------ sessions

    @precondition(lambda self: self.connected)
    @rule(by_source=st.booleans())
    def disconnect(self, by_source: bool) -> None:
        """Either side closes the session: every round goes with it, and both sides
        are left with no pin, reservation or write in flight."""
        if by_source:
            self.child.call("disconnect", peer=DST_ID)
        else:
            self.node.disconnect(SRC_ID, timeout=BOUND)
        wait_for(lambda: not self.node.is_connected(SRC_ID))
        self.connected = False
        self.anon.clear()
        self.held.clear()
        self.check_idle()

    @precondition(lambda self: not self.connected)
    @rule()
    def reconnect(self) -> None:
        self.connect()

    # ------------------------------------------------------------ invariants

    def read(self, i: int) -> bytes:
        got = self.node.store.get(KEYS[i])
        assert got is not None, i
        return bytes(got)

    @invariant()
    def stores_hold_what_the_model_says(self) -> None:
        want = {KEYS[i] for i in self.has} | {FILLER[i] for i in self.filler}
        assert set(self.node.store.keys()) == want
        for i, gen in self.has.items():
            assert self.read(i) == gen_bytes(SEED, i, gen, BLOCK), (i, gen)
        for i in self.filler:  # a write into the wrong slot lands on one of these, or a key
            got = self.node.store.get(FILLER[i])
            assert got is not None and bytes(got) == filler_bytes(i), ("filler", i)

    @invariant()
    def idle_means_no_pins(self) -> None:
        if not self.held and not self.anon:
            self.check_idle()

    def check_idle(self) -> None:
        """No round open: the source holds no pin, reservation or write in flight (it
        lets go a moment after the consumer's fetch returns); the consumer no
        reservation, quarantine, write in flight or orphan."""

        def source_idle() -> bool:
            s = self.child.call("stats")["stats"]
            return (s["pinned_slots"], s["reserved_slots"], s["inflight_transfers"]) == (0, 0, 0)

        wait_for(source_idle)
        stats = self.node.statistics(timeout=BOUND)
        assert (stats.reserved_slots, stats.quarantined_slots, stats.inflight_transfers) == (
            0,
            0,
            0,
        ), stats
        store = self.node.store.statistics()
        assert store.pinned == 0 and store.used == len(self.node.store), store


def test_nixl_nodes_follow_the_model(tmp_path: Path, no_agent_left: None) -> None:
    before = set(threading.enumerate())
    child = BlockingNodeProcess.start(
        SRC_ID,
        num_blocks=SRC_BLOCKS,
        block_len=BLOCK,
        log_dir=tmp_path,
        config={
            "verify_checksums": True,
            "lease": 600.0,
            "nixl_copy_threads": 2,
            "max_peer_registrations": REGISTRATIONS,
        },
    )
    try:
        cfg = NodeConfig(
            peer_id=DST_ID,
            transport="nixl",
            num_blocks=DST_BLOCKS,
            block_len=BLOCK,
            verify_checksums=True,
            lease=600.0,  # no lease ends during an example (a timed outcome)
            max_peer_registrations=REGISTRATIONS,
        )
        with start_node(cfg) as node:
            NixlNodeModel.world = World(child, node)
            try:
                run_state_machine_as_test(
                    NixlNodeModel,
                    settings=settings(
                        max_examples=300 if SLOW else 100,
                        stateful_step_count=50 if SLOW else 40,
                        deadline=None,
                        suppress_health_check=[HealthCheck.too_slow],
                    ),
                )
            finally:
                NixlNodeModel.world = None
            assert node.failure is None
        assert not node.alive
    finally:
        child.close()
    assert child.proc.returncode == 0, child.log_tail()
    for t in leftover_threads(before):
        t.join(BOUND)
    assert leftover_threads(before) == []
    assert _nixl_agent.registry_counts() == (0, 0)
