"""A model-based test of three whole nodes: one source, two consumers, driven through the
synchronous facade (``start_node`` / ``BlockingNode``) by Hypothesis's stateful testing.

The control plane is real (loopback TCP, the real sessions, both engines' threads); the
data plane is the in-process transport, ``p2pkv.transport.local``, a FAKE data plane (a
memory copy between the regions of one process, no NIXL), which every facade test uses.

The source's host puts blocks (key -> bytes; a few keys, so they collide) and evicts them,
puts a key again with *other* bytes (while a round pins the old ones, or after an
eviction) and releases the pins it holds (``release_unused_pins``). The consumers look
keys up (anonymous rounds, and held rounds a later fetch names or a release gives back),
fetch (all of a round's keys or a part; a plain fetch), and keep fetches in flight with
``submit_fetch`` (two at once, of overlapping keys, from both consumers or from one),
collected later with ``poll`` or ``get_finished``; a consumer disconnects and reconnects,
and the source disconnects a consumer. Every facade call carries a timeout.

The model, checked after every step:

* a key a consumer holds holds bytes the source held for that key while a lookup or a
  fetch of it by that consumer could have pinned them (invariant 1); a fetch that used a
  held round loads exactly the bytes its lookup pinned, and a key the consumer held
  already keeps its bytes ("or were there already", ``FetchResult``);
* a fetch's ``loaded`` and ``failed`` split exactly the keys it was given; where nothing
  raced it (no put or evict of the key, no disconnect, no pins released by the source) a
  key loads if and only if the source or the consumer held it, and fails "miss" otherwise
  (a fetch on an anonymous round whose pins the source's host took back,
  ``release_unused_pins``, looks its keys up again; only a held round's hits fail
  "not_pinned" then);
* the source's and consumers' stores hold what the model says, each store's slot states
  add up to its statistics, and once no round, lookup or fetch is outstanding the source
  holds no pin and no store holds a reservation or a pinned orphan;
* every counter of ``statistics()`` that only counts never goes back.

At the end every node is closed (``alive`` false) and no thread is left.
"""

from __future__ import annotations

import hashlib
import os
import threading

import attrs
import numpy as np
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

from p2pkv import BlockingNode, FetchResult, LookupRound, Peer, start_node
from p2pkv.node import NodeStatistics

from .helpers import config, leftover_threads, wait_for

BOUND = 10.0  # seconds: "this did not hang", never an expected duration
BLOCK = 4096
KEYS = [f"key-{i}".encode().ljust(32, b".") for i in range(8)]
SLOW = os.environ.get("P2PKV_SLOW") == "1"

some_keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)


def content(key: bytes, version: int) -> bytes:
    """The block of ``key``'s ``version``: distinct for every (key, version)."""
    seed = hashlib.sha256(key + version.to_bytes(8, "little")).digest()
    return seed * (BLOCK // len(seed))


@attrs.define
class Held:
    """A held round (``lookup_round``) as the model knows it."""

    handle: LookupRound
    keys: list[bytes]
    # key -> the bytes its lookup pinned at the source (hits only)
    pinned: dict[bytes, bytes]
    cut: bool = False  # the source's host released its pins since


@attrs.define
class Ticket:
    """A ``submit_fetch`` in flight as the model knows it."""

    keys: list[bytes]
    had: set[bytes]  # keys the consumer held at the submit
    src_had: set[bytes]  # keys the source held at the submit
    churned: set[bytes] = attrs.field(factory=set)  # put or evicted at the source since
    disrupted: bool = False  # a disconnect or a pin release since


@attrs.define
class Consumer:
    node: BlockingNode
    peer: Peer | None = None
    held: list[Held] = attrs.field(factory=list)
    anon: bool = False  # an anonymous lookup may still hold pins at the source
    anon_keys: set[bytes] = attrs.field(factory=set)  # the hits of those lookups
    # Of those, keys the source's host put or evicted since: a fetch may load them from
    # the round's pins (the bytes its lookup pinned) or look them up anew.
    anon_churned: set[bytes] = attrs.field(factory=set)
    has: dict[bytes, bytes] = attrs.field(factory=dict)  # what its store holds
    allowed: dict[bytes, set[bytes]] = attrs.field(factory=dict)
    tickets: dict[int, Ticket] = attrs.field(factory=dict)
    disrupted: bool = False  # a fetch was cut: its slots may sit in quarantine


# Counters of NodeStatistics that only ever count up.
def counters(s: NodeStatistics) -> dict[str, float]:
    r = s.registrations
    return {
        "store.evictions": s.store.evictions,
        "registrations.started": r.started,
        "registrations.published": r.published,
        "registrations.failed": r.failed,
        "registrations.released_stale": r.released_stale,
        "registrations.retired": r.retired,
        "transport.post_cpu_s": s.transport.post_cpu_s,
        "transport.progress_ticks": s.transport.progress_ticks,
    }


def check_partition(keys: list[bytes], result: FetchResult) -> None:
    """Every key given is loaded or failed, once; nothing else is either."""
    assert isinstance(result, FetchResult), result
    assert len(result.loaded) == len(set(result.loaded))
    assert set(result.loaded) | set(result.failed) == set(keys)
    assert not set(result.loaded) & set(result.failed)
    for why in result.failed.values():
        assert isinstance(why, str) and why


class NodeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[BlockingNode] = []
        self.src: BlockingNode | None = None
        self.consumers: list[Consumer] = []
        self.current: dict[bytes, bytes] = {}  # what the source's store holds
        self.version = 0
        self.seen: dict[int, dict[str, float]] = {}

    def start(self, peer_id: str) -> BlockingNode:
        # lease: long enough that no lease ends during an example (a timed outcome).
        node = start_node(config(peer_id, num_blocks=64, block_len=BLOCK, lease=600.0))
        self.nodes.append(node)
        return node

    @initialize()
    def start_three(self) -> None:
        self.src = self.start("src")
        for key in KEYS[::2]:
            self.src.store.put(key, content(key, 0))
            self.current[key] = content(key, 0)
        for name in ("c1", "c2"):
            c = Consumer(self.start(name))
            c.peer = c.node.connect(self.src.address, timeout=BOUND)
            self.consumers.append(c)

    def teardown(self) -> None:
        for node in reversed(self.nodes):
            node.close(timeout=BOUND)
            assert not node.alive
            assert node.failure is None

    @property
    def source(self) -> BlockingNode:
        assert self.src is not None
        return self.src

    # ------------------------------------------------------------ the source's host

    def churn(self, key: bytes) -> None:
        """The source's block of ``key`` changed: fetches in flight may see either."""
        for c in self.consumers:
            if key in c.anon_keys:
                c.anon_churned.add(key)
            for t in c.tickets.values():
                if key in t.keys:
                    t.churned.add(key)
                    if key in self.current:
                        c.allowed.setdefault(key, set()).add(self.current[key])

    @rule(keys=some_keys, fresh=st.booleans())
    def put(self, keys: list[bytes], fresh: bool) -> None:
        """Put the keys' usual blocks, or (``fresh``) bytes they never had."""
        for key in keys:
            if fresh:
                self.version += 1
            data = content(key, self.version if fresh else 0)
            self.source.store.put(key, data)
            self.current[key] = data
            self.churn(key)

    @precondition(lambda self: any(h.pinned for c in self.consumers for h in c.held))
    @rule(data=st.data())
    def put_other_bytes_under_a_round(self, data: st.DataObject) -> None:
        """Put other bytes for a key a held round pins: the round's fetch must still load
        the bytes its lookup pinned (the pinned block lives on as an orphan)."""
        pinned = sorted({k for c in self.consumers for h in c.held for k in h.pinned})
        self.put([data.draw(st.sampled_from(pinned))], fresh=True)

    @rule(key=st.sampled_from(KEYS))
    def evict(self, key: bytes) -> None:
        dropped = self.source.store.evict(key)
        if key not in self.current:
            assert not dropped
            return
        if not dropped:  # pinned: by a round or a fetch the model knows of
            assert self.outstanding(), "an unpinned block was not evicted"
            return
        del self.current[key]
        self.churn(key)

    @precondition(lambda self: self.outstanding())
    @rule()
    def source_releases_unused_pins(self) -> None:
        self.source.release_unused_pins(timeout=BOUND)
        for c in self.consumers:
            c.anon = False
            c.anon_keys.clear()  # a fetch on those rounds looks the keys up again
            c.anon_churned.clear()
            for h in c.held:  # a fetch of it now gets NOT_PINNED for its hits
                h.pinned.clear()
                h.cut = True
            for t in c.tickets.values():
                t.disrupted = True

    # ------------------------------------------------------------ a consumer, blocking

    def lookup_expect(self, c: Consumer, keys: list[bytes], hits: list[bool]) -> None:
        assert hits == [k in self.current for k in keys]
        for k, hit in zip(keys, hits, strict=True):
            if hit:
                c.allowed.setdefault(k, set()).add(self.current[k])

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 1), keys=some_keys)
    def lookup(self, which: int, keys: list[bytes]) -> None:
        c = self.idle_consumer(which)
        assert c.peer is not None
        hits = c.node.lookup(c.peer, keys, timeout=BOUND)
        self.lookup_expect(c, keys, hits)
        c.anon = c.anon or any(hits)
        c.anon_keys.update(k for k, hit in zip(keys, hits, strict=True) if hit)

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 1), keys=some_keys)
    def lookup_round(self, which: int, keys: list[bytes]) -> None:
        c = self.idle_consumer(which)
        assert c.peer is not None
        handle = c.node.lookup_round(c.peer, keys, timeout=BOUND)
        self.lookup_expect(c, keys, handle.hits)
        pinned = {k: self.current[k] for k, hit in zip(keys, handle.hits, strict=True) if hit}
        c.held.append(Held(handle, keys, pinned))

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 1), keys=some_keys)
    def fetch(self, which: int, keys: list[bytes]) -> None:
        c = self.idle_consumer(which)
        assert c.peer is not None
        for k in keys:
            if k in self.current:
                c.allowed.setdefault(k, set()).add(self.current[k])
        had = set(c.has)
        result = c.node.fetch(c.peer, keys, timeout=BOUND)
        check_partition(keys, result)
        for k in keys:
            if k in had:
                assert k in result.loaded, (k, result)
            elif k in c.anon_churned:
                continue  # its round's pinned bytes, or looked up anew: bytes checked below
            elif k in self.current:
                assert k in result.loaded, (k, result)
            else:
                assert result.failed.get(k) == "miss", (k, result)
        self.landed(c, result, had)

    @precondition(lambda self: any(c.held and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 1), data=st.data())
    def fetch_round(self, which: int, data: st.DataObject) -> None:
        """Fetch all of a held round's keys or a part, naming the round."""
        c = self.idle_consumer(which, with_rounds=True)
        assert c.peer is not None
        held = c.held.pop(data.draw(st.integers(0, len(c.held) - 1)))
        keys = data.draw(st.lists(st.sampled_from(held.keys), min_size=1, unique=True))
        self.fetch_held(c, held, keys)

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 1), keys=some_keys, data=st.data())
    def round_with_other_bytes_put_under_it(
        self, which: int, keys: list[bytes], data: st.DataObject
    ) -> None:
        """A held round; the source's host puts other bytes for some of its hits (or
        evicts them: refused, they are pinned); the round's fetch of some of its keys
        loads the bytes its lookup pinned."""
        c = self.idle_consumer(which)
        self.lookup_round(self.consumers.index(c), keys)
        held = c.held[-1]
        for k in data.draw(st.lists(st.sampled_from(keys), unique=True)):
            if data.draw(st.booleans()):
                self.put([k], fresh=True)
            else:
                self.evict(k)
        wanted = data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))
        c.held.remove(held)
        self.fetch_held(c, held, wanted)

    def fetch_held(self, c: Consumer, held: Held, keys: list[bytes]) -> None:
        """Fetch ``keys`` (of the held round ``held``) naming the round; check each key."""
        assert c.peer is not None
        for k in keys:
            if k not in held.pinned and k in self.current:  # looked up again by the fetch
                c.allowed.setdefault(k, set()).add(self.current[k])
        had = set(c.has)
        before = dict(c.has)
        result = c.node.fetch(c.peer, keys, rounds=held.handle, timeout=BOUND)
        check_partition(keys, result)
        for k in keys:
            if k in had:
                assert k in result.loaded, (k, result)
            elif k not in held.pinned and k in c.anon_churned:
                continue  # an anonymous round's pinned bytes, or looked up anew
            elif k in held.pinned:
                assert k in result.loaded, (k, result)
                # exactly the bytes the round pinned, whatever the source's host did since
                assert bytes(self.bytes_of(c, k)) == held.pinned[k], k
            elif held.handle.hits[held.keys.index(k)]:
                # a hit whose pins the source's host released since: documented outcome
                assert k in result.loaded or result.failed[k] == "not_pinned", (k, result)
            elif k in self.current:
                assert k in result.loaded, (k, result)
            else:
                assert result.failed.get(k) == "miss", (k, result)
        self.landed(c, result, had)
        for k, v in before.items():
            assert c.has[k] == v
        hits = {k for k, hit in zip(held.keys, held.handle.hits, strict=True) if hit}
        if not hits & (set(keys) - had):
            # The fetch took no round of the handle (it wanted no hit of it): the round
            # stays open, its pins the holder's, until a release or a fetch that does.
            c.held.append(held)

    @precondition(lambda self: any(c.held and c.peer for c in self.consumers))
    @rule(which=st.integers(0, 1), data=st.data())
    def release_round(self, which: int, data: st.DataObject) -> None:
        c = self.consumers[which]
        if not (c.held and c.peer):
            c = self.consumers[1 - which]
        assert c.peer is not None
        held = c.held.pop(data.draw(st.integers(0, len(c.held) - 1)))
        closed = c.node.release(c.peer, held.handle, timeout=BOUND)
        # A round with no hit holds nothing at the source and is not kept open.
        assert closed == (1 if any(held.handle.hits) else 0) or held.cut, (closed, held)

    # ------------------------------------------------------------ fetches in flight

    @precondition(lambda self: all(c.peer for c in self.consumers))
    @rule(
        who=st.sampled_from([(0, 1), (0, 0), (1, 1)]),
        first=some_keys,
        second=some_keys,
    )
    def submit_two(self, who: tuple[int, int], first: list[bytes], second: list[bytes]) -> None:
        """Two fetches in flight at once (both consumers, or two from one), their keys
        overlapping as the draw has it; collected by ``collect``."""
        for which, keys in zip(who, (first, second), strict=True):
            c = self.consumers[which]
            assert c.peer is not None
            for k in keys:
                if k in self.current:
                    c.allowed.setdefault(k, set()).add(self.current[k])
            ticket = c.node.submit_fetch(c.peer, keys, timeout=BOUND)
            # A key another ticket of this consumer is bringing in counts as held: this
            # one waits for it and loads it (or fails with it).
            had = set(c.has) | {k for t in c.tickets.values() for k in t.keys}
            c.tickets[ticket] = Ticket(keys, had, set(self.current) & set(keys))

    @precondition(lambda self: any(c.tickets for c in self.consumers))
    @rule(by_poll=st.booleans())
    def collect(self, by_poll: bool) -> None:
        for c in self.consumers:
            self.collect_from(c, by_poll)

    def collect_from(self, c: Consumer, by_poll: bool) -> None:
        if not c.tickets:
            return
        wait_for(lambda: c.node.pending() == 0)
        outcomes: list[tuple[int, object]]
        if by_poll:
            outcomes = [(t, c.node.poll(t)) for t in sorted(c.tickets)]
        else:
            outcomes = list(c.node.get_finished())
            assert sorted(t for t, _ in outcomes) == sorted(c.tickets)
        tickets, c.tickets = c.tickets, {}
        before = dict(c.has)
        for number, outcome in outcomes:
            t = tickets[number]
            assert isinstance(outcome, FetchResult), outcome
            check_partition(t.keys, outcome)
            for k in t.keys:
                if t.disrupted or k in t.churned or k in c.anon_churned:
                    continue  # loaded or failed; what loaded is checked below
                if k in before or k in t.src_had:
                    assert k in outcome.loaded, (k, outcome, t)
                elif k not in t.had:
                    assert outcome.failed.get(k) == "miss", (k, outcome, t)
            self.landed(c, outcome, set(before))
        for k, v in before.items():
            assert c.has[k] == v

    # ------------------------------------------------------------ sessions

    @precondition(lambda self: any(c.peer for c in self.consumers))
    @rule(which=st.integers(0, 1), by_source=st.booleans())
    def disconnect(self, which: int, by_source: bool) -> None:
        """The consumer disconnects, or the source disconnects the consumer."""
        c = self.consumers[which] if self.consumers[which].peer else self.consumers[1 - which]
        assert c.peer is not None
        if by_source:
            self.source.disconnect(c.node.peer_id, timeout=BOUND)
            wait_for(lambda: not c.node.is_connected("src"))
        else:
            c.node.disconnect(c.peer, timeout=BOUND)
        c.peer = None
        c.held.clear()
        c.anon = False
        c.anon_keys.clear()
        c.anon_churned.clear()
        for t in c.tickets.values():
            t.disrupted = True
            c.disrupted = True

    @precondition(lambda self: any(c.peer is None for c in self.consumers))
    @rule()
    def reconnect(self) -> None:
        for c in self.consumers:
            if c.peer is None:
                c.peer = c.node.connect(self.source.address, timeout=BOUND)

    # ------------------------------------------------------------ helpers

    def idle_consumer(self, which: int, *, with_rounds: bool = False) -> Consumer:
        """Consumer ``which``, or the other if that one is not fit for a blocking call."""
        for c in (self.consumers[which], self.consumers[1 - which]):
            if c.peer and not c.tickets and (c.held or not with_rounds):
                return c
        raise AssertionError("precondition let an unfit draw through")

    def bytes_of(self, c: Consumer, key: bytes) -> memoryview:
        got = c.node.store.get(key)
        assert got is not None, key
        return got

    def landed(self, c: Consumer, result: FetchResult, had: set[bytes]) -> None:
        """What a fetch reported loaded is in the consumer's store with allowed bytes."""
        for k in result.loaded:
            got = bytes(self.bytes_of(c, k))
            if k in had:
                assert got == c.has[k], f"{k!r}: a block the consumer held changed"
            else:
                assert got in c.allowed.get(k, set()), f"{k!r}: bytes the source never held"
                c.has[k] = got

    def outstanding(self) -> bool:
        return any(c.held or c.anon or c.tickets for c in self.consumers)

    # ------------------------------------------------------------ invariants

    @invariant()
    def stores_hold_what_the_model_says(self) -> None:
        if self.src is None:
            return
        assert set(self.source.store.keys()) == set(self.current)
        for k, v in self.current.items():
            assert bytes(self.bytes_of_node(self.source, k)) == v
        for c in self.consumers:
            keys = set(c.node.store.keys())
            in_flight = {k for t in c.tickets.values() for k in t.keys}
            assert set(c.has) <= keys <= set(c.has) | in_flight
            for k in keys:
                got = bytes(self.bytes_of(c, k))
                if k in c.has:
                    assert got == c.has[k]
                else:  # landed by a fetch still in flight
                    assert got in c.allowed.get(k, set())

    @staticmethod
    def bytes_of_node(node: BlockingNode, key: bytes) -> memoryview:
        got = node.store.get(key)
        assert got is not None, key
        return got

    @invariant()
    def slots_add_up(self) -> None:
        """Each store's slot states, counted, are its statistics' free, reserved and
        quarantined slots (read under the store's lock: one consistent look)."""
        for node in self.nodes:
            store = node.store
            with store._turn, store._lock:  # test seam: the counters beside the states
                states = np.bincount(store._state, minlength=4)
                counted = (store._n_free, store._n_reserved, len(store._quarantine))
            free, occupied, reserved, quarantined = (int(n) for n in states[:4])
            assert counted == (free, reserved, quarantined), (node.peer_id, counted, states)
            assert free + occupied + reserved + quarantined == store.num_blocks

    @invariant()
    def idle_means_no_pins(self) -> None:
        if self.src is None or self.outstanding():
            return
        wait_for(lambda: self.source.statistics(timeout=BOUND).pinned_slots == 0)
        for node in self.nodes:
            stats = node.store.statistics()
            assert stats.pinned == 0 and stats.reserved == 0, (node.peer_id, stats)
            assert stats.used == len(node.store), (node.peer_id, stats)  # no orphan
        for c in self.consumers:
            if not c.disrupted:
                assert c.node.store.statistics().quarantined == 0

    @invariant()
    def counters_never_go_back(self) -> None:
        for i, node in enumerate(self.nodes):
            now = counters(node.statistics(timeout=BOUND))
            before = self.seen.get(i, now)
            for name, value in now.items():
                assert value >= before[name], (node.peer_id, name, before[name], value)
            self.seen[i] = now


def no_threads_left(before: set[threading.Thread]) -> None:
    for t in leftover_threads(before):
        t.join(BOUND)
    assert leftover_threads(before) == []


def test_three_nodes_follow_the_model() -> None:
    before = set(threading.enumerate())
    run_state_machine_as_test(
        NodeModel,
        settings=settings(
            max_examples=300 if SLOW else 40,
            stateful_step_count=40 if SLOW else 25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    no_threads_left(before)
