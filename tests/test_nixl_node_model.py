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

A second machine (:class:`NixlIntoModel`, its own source child and consumer node) lands
keys only in slots the consumer names (``submit_fetch_into``; the first one lends the
region for good, the store holds nothing): a range into slots in a row in key order (runs
on both sides) or scattered, pairs shuffled or not, plain or naming a held round (also
looked up in the same step), with ``within`` of 0 (every key "timed out") or generous;
two at once into disjoint slots with overlapping keys, the source's host putting or
evicting one meanwhile; one naming a slot another in flight lands in, refused
(``LocalProtocolError``) while the source is stopped (SIGSTOP) so that the first cannot
finish first; a store ``put`` and ``fetch`` on the lent region (``SlotsInUse``). Every
example starts with every slot holding junk the model knows; checked after every step:
each key loaded holds an allowed generation's bytes in exactly its named slot, every other
slot keeps what it held (a key that failed ``miss`` or ``not_pinned`` was not written),
outcomes split the keys, and with no fetch in flight the node holds no caller slot.

A defect that makes a landing fail its checksum shows as its assertion ("checksum
mismatch" in ``failed``, or quarantined slots left); Hypothesis may then add
``FlakyStrategyDefinition``, since the failed landing's quarantine outlives the example
and its replay takes other slots. Read the first error.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import numpy as np
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

from p2pkv import (
    BlockingNode,
    FetchResult,
    LocalProtocolError,
    LookupRound,
    NodeConfig,
    SlotsInUse,
    start_node,
)
from p2pkv.transport import _nixl_agent

from .helpers import NIXL_ONLY, SHRINK_ROOM, leftover_threads, wait_for
from .node_proc import BlockingNodeProcess, block_key, gen_bytes

pytestmark = NIXL_ONLY

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


class SourceAndRounds(RuleBasedStateMachine):
    """What both machines share: the source child and its host (puts, evicts, pins taken
    back), the consumer's lookups and held rounds, sessions, and the idle check. Each
    machine adds its consumer's fetches and what it checks of them."""

    world: ClassVar[World | None] = None

    def __init__(self) -> None:
        super().__init__()
        assert self.world is not None
        self.child = self.world.child
        self.node = self.world.node
        self.src: dict[int, int] = {}  # what the source holds: key index -> generation
        # Generations an anonymous round of the consumer may pin (its lookups' hits): a
        # fetch may load them from that round, or look the key up anew.
        self.anon: dict[int, set[int]] = {}
        self.held: list[Held] = []
        self.connected = False

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

    def expect_outcome(
        self, i: int, result: FetchResult, held: Held | None, *, held_already: bool = False
    ) -> None:
        """Key ``i``'s outcome in a fetch or fetch_into (naming ``held``) that nothing
        raced; ``held_already``: the consumer's store holds the key (it loads as is)."""
        key = KEYS[i]
        if held_already or (held is not None and i in held.pinned):
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

    def churn_meanwhile(self, churn: str, victim: int, allowed: dict[int, set[int]]) -> set[int]:
        """While two fetches run: the source's host puts a new generation of ``victim``
        (``churn == "put"``) or evicts it (``"evict"``; a pinned block stays). Adds the
        generation it holds now to what may load; returns the keys churned."""
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
        return churned

    def expect_raced(
        self,
        i: int,
        result: FetchResult,
        src_before: dict[int, int],
        churned: set[int],
        *,
        held_already: bool = False,
    ) -> None:
        """Key ``i``'s outcome in one of two fetches that ran at once beside churn."""
        key = KEYS[i]
        if held_already:
            assert key in result.loaded, (i, result.failed.get(key))
        elif i in churned or self.anon.get(i, set()) - {src_before.get(i)}:
            pass  # loaded or failed: what loaded is checked by the caller
        elif i in src_before:
            assert key in result.loaded, (i, result.failed.get(key))
        else:
            assert result.failed.get(key) == "miss", (i, result.failed.get(key))

    def teardown(self) -> None:
        """Back to a clean slate for the next example (checked by its ``clean_slate``):
        no session, and the source holds no pin and no block."""
        if self.node.is_connected(SRC_ID):
            self.node.disconnect(SRC_ID, timeout=BOUND)
        wait_for(lambda: self.child.call("stats")["stats"]["peers"] == 0)
        wait_for(lambda: self.child.call("stats")["stats"]["pinned_slots"] == 0)
        self.child.call("evict_all")

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

    # ------------------------------------------------------------ the consumer's rounds

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

    def allowed(self, i: int, held: Held | None) -> set[int]:
        """Generations a fetch (that nothing raced) may load for key ``i``."""
        if held is not None and i in held.pinned:
            return {held.pinned[i]}
        gens = set(self.anon.get(i, set()))
        if i in self.src:
            gens.add(self.src[i])
        return gens

    @precondition(lambda self: self.connected and bool(self.held))
    @rule(pick=st.integers(0, 7))
    def release_round(self, pick: int) -> None:
        held = self.held.pop(pick % len(self.held))
        closed = self.node.release(SRC_ID, held.handle, timeout=BOUND)
        assert closed == (1 if any(held.handle.hits) else 0) or held.cut, (closed, held)

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


class NixlNodeModel(SourceAndRounds):
    def __init__(self) -> None:
        super().__init__()
        self.has: dict[int, int] = {}  # what the consumer's store holds
        self.filler: set[int] = set()  # filler blocks the consumer holds

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
        super().teardown()
        for key in list(self.node.store.keys()):
            assert self.node.store.evict(key), key

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

    def expect(self, i: int, result: FetchResult, held: Held | None) -> None:
        """Key ``i``'s outcome in a fetch (naming ``held``) that nothing raced."""
        self.expect_outcome(i, result, held, held_already=i in self.has)

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
        churned = self.churn_meanwhile(churn, victim, allowed)
        wait_for(lambda: self.node.pending() == 0)
        outcomes = dict(self.node.get_finished())
        assert sorted(outcomes) == sorted(tickets)
        for ticket, idx in zip(tickets, (first, second), strict=True):
            result = outcomes[ticket]
            assert isinstance(result, FetchResult), result
            check_partition(keys_of(idx), result)
            for i in idx:
                self.expect_raced(i, result, src_before, churned, held_already=i in had)
        for ticket, idx in zip(tickets, (first, second), strict=True):
            result = outcomes[ticket]
            assert isinstance(result, FetchResult)
            self.landed(idx, result, had, allowed)

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


def run_model(
    machine: type[SourceAndRounds],
    tmp_path: Path,
    *,
    examples: int,
    steps: int,
    check: Callable[[BlockingNode], None] = lambda node: None,
    **node_kw: Any,
) -> None:
    """Start the source child and a real-NIXL consumer (``node_kw`` over the shared
    config), run ``machine`` against them, ``check(node)`` after, then see both gone with
    no thread or NIXL agent left. Leases never end during an example (a timed outcome)."""
    before = set(threading.enumerate())
    common = {
        "verify_checksums": True,
        "lease": 600.0,
        "max_peer_registrations": REGISTRATIONS,
    }
    child = BlockingNodeProcess.start(
        SRC_ID,
        num_blocks=SRC_BLOCKS,
        block_len=BLOCK,
        log_dir=tmp_path,
        config={**common, "nixl_copy_threads": 2},
    )
    try:
        cfg = NodeConfig(peer_id=DST_ID, transport="nixl", block_len=BLOCK, **{**common, **node_kw})
        with start_node(cfg) as node:
            machine.world = World(child, node)
            try:
                run_state_machine_as_test(
                    machine,
                    settings=settings(
                        max_examples=examples,
                        stateful_step_count=steps,
                        deadline=None,
                        suppress_health_check=[HealthCheck.too_slow],
                    ),
                )
            finally:
                machine.world = None
            check(node)
            assert node.failure is None
        assert not node.alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.proc.pid, signal.SIGCONT)  # a stopped child would sit out close
        child.close()
    assert child.proc.returncode == 0, child.log_tail()
    for t in leftover_threads(before):
        t.join(BOUND)
    assert leftover_threads(before) == []
    assert _nixl_agent.registry_counts() == (0, 0)


@pytest.mark.timeout(SHRINK_ROOM)
def test_nixl_nodes_follow_the_model(tmp_path: Path, no_agent_left: None) -> None:
    run_model(
        NixlNodeModel,
        tmp_path,
        examples=300 if SLOW else 100,
        steps=50 if SLOW else 40,
        num_blocks=DST_BLOCKS,
    )


# ================================================================ fetch_into (caller's slots)

INTO_BLOCKS = 64  # the fetch_into consumer's region: room for two fetches of every key
JUNK_SEED = 43  # what its slots hold before anything lands there
FAILED_INTO = {"miss", "not_pinned", "timed out"}  # what a fetch_into here may fail with

slot_base = st.integers(0, INTO_BLOCKS - 1)
layouts = st.sampled_from(["run", "scattered"])
# ``within=0`` gives up at once: on a held round the fetch request goes out first, so the
# call returns a quarantine later (half a second): drawn less often there.
withins = st.sampled_from([None, 60.0, 0.0])
held_withins = st.sampled_from([None, 60.0] * 4 + [0.0])


def junk(example: int, slot: int) -> bytes:
    """What slot ``slot`` of the fetch_into consumer's region holds from the start of
    example ``example`` until something lands there."""
    return gen_bytes(JUNK_SEED, slot, example, BLOCK)


def lay_out(n: int, free: list[int], layout: str, base: int, rnd: random.Random) -> list[int]:
    """``n`` distinct slots of ``free`` (sorted): "run", ``n`` in a row from a place
    ``base`` picks (consecutive slots where ``free`` has no gap: runs); "scattered", any
    ``n`` in any order."""
    assert n <= len(free)
    if layout == "run":
        at = base % (len(free) - n + 1)
        return free[at : at + n]
    return rnd.sample(free, n)


def stopped(pid: int) -> bool:
    """The kernel says ``pid`` is stopped (SIGSTOP took)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


class NixlIntoModel(SourceAndRounds):
    """The source's host and the consumer's rounds as in :class:`NixlNodeModel`, but the
    consumer lands keys only in slots it names (``submit_fetch_into``): its region is the
    caller's (the first ``fetch_into`` lent it for good; the store holds nothing). Every
    example starts with every slot holding junk the model knows, so a write landing in a
    slot no loaded key names shows."""

    def __init__(self) -> None:
        super().__init__()
        self.example = self.gen()  # a fresh junk pattern for every example
        # What each slot of the region holds (None: a write given up on may have landed).
        self.slots: list[bytes | None] = [junk(self.example, s) for s in range(INTO_BLOCKS)]

    # ------------------------------------------------------------ set-up

    @initialize(start=indexes, n=st.integers(0, N_KEYS))
    def clean_slate(self, start: int, n: int) -> None:
        """No session, the source's store empty, no caller slot in use, every slot junk;
        then connect."""
        assert self.child.call("evict_all")["kept"] == 0
        assert len(self.node.store) == 0, self.node.store.keys()
        assert not self.node._node.caller_slots  # test seam: the slots fetch_into holds
        region = self.node.store.array
        for s, want in enumerate(self.slots):
            assert want is not None
            region[s * BLOCK : (s + 1) * BLOCK] = np.frombuffer(want, np.uint8)
        self.connect()
        if n:
            self.put_range(start, n)

    # ------------------------------------------------------------ fetch_into

    def submit(
        self, idx: list[int], slots: list[int], held: Held | None, within: float | None
    ) -> int:
        return self.node.submit_fetch_into(
            SRC_ID,
            keys_of(idx),
            slots,
            rounds=None if held is None else held.handle,
            within=within,
            timeout=BOUND,
        )

    def collect(self, tickets: list[int]) -> list[FetchResult]:
        """Wait for every ticket in flight (each is one of ``tickets``) and read them."""
        wait_for(lambda: self.node.pending() == 0)
        outcomes = dict(self.node.get_finished())
        assert sorted(outcomes) == sorted(tickets)
        results = [outcomes[t] for t in tickets]
        for result in results:
            assert isinstance(result, FetchResult), result
        return results  # type: ignore[return-value]

    def into(
        self, idx: list[int], slots: list[int], held: Held | None, within: float | None
    ) -> None:
        """One fetch_into that nothing races: each key's outcome is exact."""
        allowed = {i: self.allowed(i, held) for i in idx}
        (result,) = self.collect([self.submit(idx, slots, held, within)])
        self.partition(idx, result)
        for i in idx:
            self.expect(i, result, held, cut=within == 0.0)
        self.landed(idx, slots, result, allowed)
        if held is not None:
            hits = {i for i, hit in zip(held.idx, held.handle.hits, strict=True) if hit}
            if not hits & set(idx):
                self.held.append(held)  # took none of its rounds: still open, still held

    @staticmethod
    def partition(idx: list[int], result: FetchResult) -> None:
        keys = keys_of(idx)
        assert len(result.loaded) == len(set(result.loaded))
        assert set(result.loaded) | set(result.failed) == set(keys)
        assert not set(result.loaded) & set(result.failed)
        assert set(result.failed.values()) <= FAILED_INTO, result.failed

    def expect(self, i: int, result: FetchResult, held: Held | None, *, cut: bool) -> None:
        """Key ``i``'s outcome in a fetch_into (naming ``held``) that nothing raced; cut:
        ``within=0``, which gives up before any answer can come."""
        if cut:
            assert result.failed.get(KEYS[i]) == "timed out", (i, result.failed.get(KEYS[i]))
        else:
            self.expect_outcome(i, result, held)

    def landed(
        self, idx: list[int], slots: list[int], result: FetchResult, allowed: dict[int, set[int]]
    ) -> None:
        """Each key reported loaded is in exactly the slot named for it, with the bytes of
        a generation allowed; a key that failed for want of a block was never written
        (its slot keeps what it held: ``region_as_modelled``); one given up on may have
        been."""
        region = self.node.store.array
        for i, slot in zip(idx, slots, strict=True):
            key = KEYS[i]
            if key in result.loaded:
                got = bytes(region[slot * BLOCK : (slot + 1) * BLOCK])
                gen = next((g for g in allowed[i] if got == gen_bytes(SEED, i, g, BLOCK)), None)
                assert gen is not None, (i, slot, "loaded bytes of no generation allowed")
                self.slots[slot] = got
            elif result.failed[key] not in ("miss", "not_pinned"):
                self.slots[slot] = None

    @precondition(lambda self: self.connected)
    @rule(
        start=indexes,
        n=st.integers(1, N_KEYS),
        layout=layouts,
        base=slot_base,
        within=withins,
        rnd=st.randoms(use_true_random=False),
    )
    def fetch_into_range(
        self,
        start: int,
        n: int,
        layout: str,
        base: int,
        within: float | None,
        rnd: random.Random,
    ) -> None:
        """A range of keys into slots in a row in key order (runs on both sides when the
        source put them in a row), or scattered; the pairs shuffled or not."""
        idx = list(range(start, min(start + n, N_KEYS)))
        slots = lay_out(len(idx), list(range(INTO_BLOCKS)), layout, base, rnd)
        if rnd.random() < 0.5:
            pairs = list(zip(idx, slots, strict=True))
            rnd.shuffle(pairs)
            idx, slots = [p[0] for p in pairs], [p[1] for p in pairs]
        self.into(idx, slots, None, within)

    @precondition(lambda self: self.connected)
    @rule(idx=some, layout=layouts, base=slot_base, rnd=st.randoms(use_true_random=False))
    def fetch_into_some(self, idx: list[int], layout: str, base: int, rnd: random.Random) -> None:
        self.into(idx, lay_out(len(idx), list(range(INTO_BLOCKS)), layout, base, rnd), None, None)

    @precondition(lambda self: self.connected and bool(self.held))
    @rule(
        pick=st.integers(0, 7),
        mask=st.lists(st.booleans(), min_size=N_KEYS, max_size=N_KEYS),
        layout=layouts,
        base=slot_base,
        within=held_withins,
        rnd=st.randoms(use_true_random=False),
    )
    def fetch_into_round(
        self,
        pick: int,
        mask: list[bool],
        layout: str,
        base: int,
        within: float | None,
        rnd: random.Random,
    ) -> None:
        """All of a held round's keys or a part, naming the round."""
        held = self.held.pop(pick % len(self.held))
        idx = [i for n, i in enumerate(held.idx) if mask[n]] or held.idx[:1]
        slots = lay_out(len(idx), list(range(INTO_BLOCKS)), layout, base, rnd)
        self.into(idx, slots, held, within)

    @precondition(lambda self: self.connected)
    @rule(
        idx=some,
        mask=st.lists(st.booleans(), min_size=N_KEYS, max_size=N_KEYS),
        layout=layouts,
        base=slot_base,
        within=held_withins,
        rnd=st.randoms(use_true_random=False),
    )
    def lookup_round_then_fetch_into(
        self,
        idx: list[int],
        mask: list[bool],
        layout: str,
        base: int,
        within: float | None,
        rnd: random.Random,
    ) -> None:
        """A held round looked up and then fetched into, in whole or in part, naming it
        (one step: the two rules apart meet only now and then)."""
        self.lookup_round(idx)
        self.fetch_into_round(len(self.held) - 1, mask, layout, base, within, rnd)

    @precondition(lambda self: self.connected)
    @rule(
        first=some,
        second=some,
        layout=layouts,
        base=slot_base,
        rnd=st.randoms(use_true_random=False),
        churn=st.sampled_from(["none", "put", "evict"]),
        victim=indexes,
    )
    def two_fetch_into_at_once(
        self,
        first: list[int],
        second: list[int],
        layout: str,
        base: int,
        rnd: random.Random,
        churn: str,
        victim: int,
    ) -> None:
        """Two fetch_into in flight at once, into disjoint slots, keys overlapping as
        drawn; the source's host puts a new generation of one key, or evicts it,
        meanwhile."""
        slots1 = lay_out(len(first), list(range(INTO_BLOCKS)), layout, base, rnd)
        rest = sorted(set(range(INTO_BLOCKS)) - set(slots1))
        slots2 = lay_out(len(second), rest, layout, base // 2, rnd)
        allowed = {i: self.allowed(i, None) for i in {*first, *second}}
        src_before = dict(self.src)
        tickets = [self.submit(first, slots1, None, None), self.submit(second, slots2, None, None)]
        churned = self.churn_meanwhile(churn, victim, allowed)
        results = self.collect(tickets)
        for idx, slots, result in zip((first, second), (slots1, slots2), results, strict=True):
            self.partition(idx, result)
            assert "timed out" not in result.failed.values(), result.failed
            for i in idx:
                self.expect_raced(i, result, src_before, churned)
            self.landed(idx, slots, result, allowed)

    @precondition(lambda self: self.connected)
    @rule(
        first=some,
        second=some,
        base=slot_base,
        rnd=st.randoms(use_true_random=False),
    )
    def fetch_into_a_slot_in_use(
        self, first: list[int], second: list[int], base: int, rnd: random.Random
    ) -> None:
        """A fetch_into naming a slot another fetch_into in flight lands in is refused
        (``LocalProtocolError``, nothing sent, no slot taken). The source is stopped
        (SIGSTOP) meanwhile, so the first cannot finish before the second is refused."""
        slots1 = lay_out(len(first), list(range(INTO_BLOCKS)), "scattered", base, rnd)
        rest = sorted(set(range(INTO_BLOCKS)) - set(slots1))
        slots2 = lay_out(len(second) - 1, rest, "scattered", base, rnd)
        slots2.insert(base % len(second), slots1[base % len(slots1)])
        allowed = {i: self.allowed(i, None) for i in first}
        pid = self.child.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: stopped(pid))
            ticket = self.submit(first, slots1, None, None)
            wait_for(lambda: set(slots1) <= self.node._node.caller_slots)  # test seam
            refused = self.submit(second, slots2, None, None)
            with pytest.raises(LocalProtocolError):
                wait_for(lambda: self.node.poll(refused) is not None)
            assert self.node._node.caller_slots == set(slots1)
        finally:
            os.kill(pid, signal.SIGCONT)
        (result,) = self.collect([ticket])
        self.partition(first, result)
        for i in first:
            self.expect(i, result, None, cut=False)
        self.landed(first, slots1, result, allowed)

    @rule(idx=some)
    def the_store_refuses(self, idx: list[int]) -> None:
        """Once lent (after the first fetch_into), the region is the caller's: a store
        put and a store fetch are ``SlotsInUse``, and change nothing."""
        if not self.node.store.lent_to_caller:
            return
        with pytest.raises(SlotsInUse):
            self.node.store.put(KEYS[idx[0]], gen_bytes(SEED, idx[0], 0, BLOCK))
        if self.connected:
            with pytest.raises(SlotsInUse):
                self.node.fetch(SRC_ID, keys_of(idx), timeout=BOUND)

    # ------------------------------------------------------------ invariants

    @invariant()
    def region_as_modelled(self) -> None:
        """Every slot holds what the model says (a write into a slot no loaded key names
        shows), the store holds nothing, and with no fetch_into in flight the node holds
        none of the caller's slots."""
        region = self.node.store.array
        for s, want in enumerate(self.slots):
            if want is not None:
                got = bytes(region[s * BLOCK : (s + 1) * BLOCK])
                assert got == want, f"slot {s} was written by no fetch_into loading a key there"
        assert len(self.node.store) == 0
        assert not self.node._node.caller_slots  # test seam: the slots fetch_into holds


@pytest.mark.timeout(SHRINK_ROOM)
def test_nixl_fetch_into_follows_the_model(tmp_path: Path, no_agent_left: None) -> None:
    def lent(node: BlockingNode) -> None:
        assert node.store.lent_to_caller

    run_model(
        NixlIntoModel,
        tmp_path,
        examples=150 if SLOW else 60,
        steps=50 if SLOW else 30,
        check=lent,
        num_blocks=INTO_BLOCKS,
        quarantine=0.5,
        abort_timeout=0.2,
        landing_margin=0.2,
    )
