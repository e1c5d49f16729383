"""A model-based test of four whole nodes: one source, three consumers, driven through the
synchronous facade (``start_node`` / ``BlockingNode``) by Hypothesis's stateful testing.

The control plane is real (loopback TCP, the real sessions, both engines' threads); the
data plane is the in-process transport, ``p2pkv.transport.local``, a FAKE data plane (a
memory copy between the regions of one process, no NIXL), which every facade test uses.

The source's host puts blocks (key -> bytes; a few keys, so they collide) and evicts them,
puts a key again with *other* bytes (while a round pins the old ones, or after an
eviction) and releases the pins it holds (``release_unused_pins``). The consumers look
keys up (anonymous rounds, and held rounds a later fetch names or a release gives back),
fetch (all of a round's keys or a part; a plain fetch; naming one held round or more, in
an order drawn, beside anonymous rounds of the same keys opened after the host put some
of them again), and keep fetches in flight with
``submit_fetch`` (two at once, of overlapping keys, from both consumers or from one),
collected later with ``poll`` or ``get_finished``; a consumer disconnects and reconnects,
and the source disconnects a consumer. The third consumer, c3, is vLLM's kind: it fetches
into slots of its region it names (``submit_fetch_into``, plain or naming a held round,
two at once into disjoint slots, beside a store fetch of another consumer), and its
region, lent to those callers, refuses the store's own fetch (``SlotsInUse``), as a
store that holds blocks refuses ``fetch_into``. Lookups, held lookups and releases are
also submitted as tickets, collected with the fetches; either side may close an idle
session (``submit_disconnect_idle``, with the activity read just before or before a
lookup; a consumer it closed connects again at once). Every facade call carries a
timeout.

The model, checked after every step:

* a key a consumer holds holds bytes the source held for that key while a lookup or a
  fetch of it by that consumer could have pinned them (invariant 1); a fetch that used a
  held round loads exactly the bytes its lookup pinned, and a key the consumer held
  already keeps its bytes ("or were there already", ``FetchResult``); a fetch naming held
  rounds takes each key from the first of them that holds it, never from an anonymous
  round that holds them all, and a named round it took from is closed (``release``: 0);
* a fetch's ``loaded`` and ``failed`` split exactly the keys it was given; where nothing
  raced it (no put or evict of the key, no disconnect, no pins released by the source) a
  key loads if and only if the source or the consumer held it, and fails "miss" otherwise
  (a fetch on an anonymous round whose pins the source's host took back,
  ``release_unused_pins``, looks its keys up again; only a held round's hits fail
  "not_pinned" then);
* the source's and consumers' stores hold what the model says, each store's slot states
  add up to its statistics, and once no round, lookup or fetch is outstanding the source
  holds no pin and no store holds a reservation or a pinned orphan;
* every counter of ``statistics()`` that only counts never goes back;
* a fetch_into's loaded keys are in exactly the slots named for them, with the bytes the
  source held (a held round: exactly those it pinned), and no slot it did not name
  changes (c3's region starts as junk of its own); its outcomes split its keys and are
  exact where nothing raced; once none is in flight the node holds none of its slots; bad
  arguments (a slot or key named twice) are ``LocalProtocolError`` and lend nothing;
* every ticket finishes exactly once with its documented type (``list[bool]``,
  ``LookupRound``, ``FetchResult``, ``int``; a P2PKVError where a disconnect cut it), and
  a lookup's hits are exact where nothing raced;
* ``disconnect_idle`` gives 0 for a session with a held round open or a request made
  since the activity was read, 1 for one with nothing ever open; ``statistics().peers``
  on every node counts the sessions the model says are up.

At the end every node is closed (``alive`` false) and no thread is left.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet

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
    P2PKVError,
    Peer,
    SlotsInUse,
    start_node,
)
from p2pkv.node import NodeStatistics

from .helpers import SHRINK_ROOM, config, leftover_threads, wait_for

BOUND = 10.0  # seconds: "this did not hang", never an expected duration
BLOCK = 4096
NUM_BLOCKS = 64
KEYS = [f"key-{i}".encode().ljust(32, b".") for i in range(8)]
SLOW = os.environ.get("P2PKV_SLOW") == "1"

some_keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)
INTO_SLOTS = 16  # c3 names slots of these: few, so that slots are named again and again


# What a consumer holds, which rounds it keeps, whether its store holds a block: these
# follow from outcomes that real concurrency decides (a fetch a put or a disconnect
# raced). A draw shaped by them (from a list of its rounds, its keys), or made only when
# they allow, or a precondition that reads them, makes Hypothesis's replay of the same
# choices draw differently (FlakyStrategyDefinition). So every draw below has a fixed
# shape, is made whether it is used or not, and is mapped onto the state afterwards; and
# rules whose use depends on such state check it in their body (doing nothing if unfit).
def pick(data: st.DataObject, n: int) -> int:
    """An index below ``n`` (n > 0)."""
    return data.draw(st.integers(0, 7), label="pick") % max(n, 1)


def chooser(data: st.DataObject) -> Callable[[list[bytes]], list[bytes]]:
    """Draws a choice of a non-empty part of any list of keys (of at most 8)."""
    mask = data.draw(st.lists(st.booleans(), min_size=8, max_size=8), label="mask")
    index = pick(data, 8)
    return lambda keys: [k for i, k in enumerate(keys) if mask[i % 8]] or [keys[index % len(keys)]]


def junk(slot: int) -> bytes:
    """What slot ``slot`` of c3's region holds before anything lands there."""
    return hashlib.sha256(b"junk" + slot.to_bytes(8, "little")).digest() * (BLOCK // 32)


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
    # Hits whose pinned bytes the model cannot tell (a submit_lookup_round that a put or
    # evict raced): they load bytes the source held while it was out, checked as such.
    unsure: set[bytes] = attrs.field(factory=set)

    @property
    def hits(self) -> set[bytes]:
        return {k for k, hit in zip(self.keys, self.handle.hits, strict=True) if hit}


def owners(named: list[Held], keys: list[bytes], had: AbstractSet[bytes]) -> dict[bytes, Held]:
    """The round each key of a fetch naming ``named`` (in that order) takes: the first
    that holds it as a hit, before any anonymous round (docs/design.md, "Held rounds");
    a key the consumer held already takes none, nor does a key no named round holds."""
    return {
        k: next(h for h in named if k in h.hits)
        for k in keys
        if k not in had and any(k in h.hits for h in named)
    }


@attrs.define
class Ticket:
    """A submit in flight as the model knows it: ``kind`` "fetch" (``submit_fetch``),
    "into" (``submit_fetch_into``), "lookup", "round" (``submit_lookup_round``),
    "release" (``submit_release``) or "refused" (a store fetch on a lent region)."""

    keys: list[bytes]
    had: set[bytes]  # keys the consumer held at the submit
    src_had: set[bytes]  # keys the source held at the submit
    churned: set[bytes] = attrs.field(factory=set)  # put or evicted at the source since
    disrupted: bool = False  # a disconnect or a pin release since
    kind: str = "fetch"
    slots: list[int] = attrs.field(factory=list)  # "into": keys[i] lands in slots[i]
    held: Held | None = None  # "release"'s round
    named: list[Held] = attrs.field(factory=list)  # "into": the held rounds it names
    gen: int = 0  # the consumer's session generation at the submit
    then: dict[bytes, bytes] = attrs.field(factory=dict)  # "round": the source's bytes


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
    # The fetch_into consumer (the third): its region is the caller's once lent, and
    # ``region`` is what the model knows each slot holds (None: a failed key's slot).
    into: bool = False
    region: dict[int, bytes | None] = attrs.field(factory=dict)
    gen: int = 0  # counts its sessions: a ticket of an earlier one got its rounds closed
    # A lookup of this session had hits: an anonymous round may still be open on it (a
    # fetch that took none of its keys, or the source's host took its pins back).
    maybe_open: bool = False


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
        node = start_node(config(peer_id, num_blocks=NUM_BLOCKS, block_len=BLOCK, lease=600.0))
        self.nodes.append(node)
        return node

    @initialize()
    def start_three(self) -> None:
        self.src = self.start("src")
        for key in KEYS[::2]:
            self.src.store.put(key, content(key, 0))
            self.current[key] = content(key, 0)
        for name in ("c1", "c2", "c3"):
            c = Consumer(self.start(name), into=name == "c3")
            c.peer = c.node.connect(self.src.address, timeout=BOUND)
            self.consumers.append(c)
        # c3 fetches into slots it names (fetch_into): its region starts as junk of its
        # own, so that a key landing in a slot it did not name shows.
        into = self.consumers[2]
        for slot in range(NUM_BLOCKS):
            into.region[slot] = junk(slot)
            into.node.store.array[slot * BLOCK : (slot + 1) * BLOCK] = np.frombuffer(
                junk(slot), np.uint8
            )

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

    @rule(data=st.data())
    def put_other_bytes_under_a_round(self, data: st.DataObject) -> None:
        """Put other bytes for a key a held round pins: the round's fetch must still load
        the bytes its lookup pinned (the pinned block lives on as an orphan)."""
        index = pick(data, 8)
        pinned = sorted({k for c in self.consumers for h in c.held for k in h.pinned})
        if pinned:
            self.put([pinned[index % len(pinned)]], fresh=True)

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
    @rule(which=st.integers(0, 2), keys=some_keys)
    def lookup(self, which: int, keys: list[bytes]) -> None:
        c = self.idle_consumer(which, any_kind=True)
        assert c.peer is not None
        hits = c.node.lookup(c.peer, keys, timeout=BOUND)
        self.lookup_expect(c, keys, hits)
        self.opened_anonymous(c, keys, hits)

    def opened_anonymous(
        self,
        c: Consumer,
        keys: list[bytes],
        hits: list[bool],
        churned: AbstractSet[bytes] = frozenset(),
    ) -> None:
        """An anonymous lookup of ``c`` answered ``hits``: its round may pin them."""
        hit = {k for k, h in zip(keys, hits, strict=True) if h}
        c.anon = c.anon or bool(hit)
        c.maybe_open = c.maybe_open or bool(hit)
        c.anon_keys.update(hit)
        c.anon_churned.update(hit & churned)

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 2), keys=some_keys)
    def lookup_round(self, which: int, keys: list[bytes]) -> None:
        c = self.idle_consumer(which, any_kind=True)
        assert c.peer is not None
        handle = c.node.lookup_round(c.peer, keys, timeout=BOUND)
        self.lookup_expect(c, keys, handle.hits)
        pinned = {k: self.current[k] for k, hit in zip(keys, handle.hits, strict=True) if hit}
        c.held.append(Held(handle, keys, pinned))

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.stores))
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

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.stores))
    @rule(which=st.integers(0, 1), data=st.data())
    def fetch_round(self, which: int, data: st.DataObject) -> None:
        """Fetch all of a held round's keys or a part, naming the round (and, as drawn,
        another held round after it)."""
        index, other, choose = pick(data, 8), pick(data, 8), chooser(data)
        two = data.draw(st.booleans(), label="name two")
        if not any(c.held and c.peer and not c.tickets for c in self.stores):
            return
        c = self.idle_consumer(which, with_rounds=True)
        assert c.peer is not None
        named = [c.held.pop(index % len(c.held))]
        if two and c.held:
            named.append(c.held.pop(other % len(c.held)))
        self.fetch_held(c, named, choose(named[0].keys))

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 2), keys=some_keys, data=st.data())
    def round_with_other_bytes_put_under_it(
        self, which: int, keys: list[bytes], data: st.DataObject
    ) -> None:
        """A held round; the source's host puts other bytes for some of its keys (a
        hit: the round keeps the bytes it pinned; a miss: there now), evicts some (a
        hit: refused, it is pinned) and (``fill``) puts those of ``every`` it lacks; the
        consumer looks ``every`` up again, as drawn: anonymously, or
        holding a second round; the host puts some keys again. Then a fetch of some of
        ``every`` (c3: a fetch_into) naming some of the held rounds in an order drawn: a
        key a named round holds loads from the first that does, the bytes it pinned,
        never from an anonymous round that holds every key (other bytes, put since)."""
        c = self.idle_consumer(which, any_kind=True)
        at = self.consumers.index(c)
        more = data.draw(st.lists(st.sampled_from(KEYS), max_size=2, unique=True), label="more")
        every = list(dict.fromkeys(keys + more))
        fresh = data.draw(st.lists(st.booleans(), min_size=8, max_size=8), label="fresh")
        gone = data.draw(st.lists(st.sampled_from(keys), max_size=2), label="evicted")
        fill = data.draw(st.booleans(), label="fill")
        again = data.draw(st.sampled_from(["lookup", "round", ""]), label="again")
        then = data.draw(st.lists(st.sampled_from(every), max_size=2), label="put since")
        wanted = data.draw(st.lists(st.sampled_from(every), min_size=1, unique=True))
        order = data.draw(st.permutations(range(2)), label="order")
        mask = data.draw(st.lists(st.booleans(), min_size=2, max_size=2), label="named")
        self.lookup_round(at, keys)
        rounds = [c.held[-1]]  # kept in c.held until the fetch: they pin (``evict``)
        self.put([k for i, k in enumerate(keys) if fresh[i]], fresh=True)
        for k in gone:
            self.evict(k)
        if fill:
            self.put([k for k in every if k not in self.current], fresh=False)
        if again == "lookup":
            self.lookup(at, every)
        elif again == "round":
            self.lookup_round(at, every)
            rounds.append(c.held[-1])
        self.put(then, fresh=True)
        ordered = [rounds[i] for i in order if i < len(rounds)]
        named = [h for h, name in zip(ordered, mask, strict=False) if name] or ordered[:1]
        for h in named:
            c.held.remove(h)
        if c.into:
            self.submit_into(c, wanted, named, data)
            self.collect_from(c, data.draw(st.booleans(), label="by_poll"))
        else:
            self.fetch_held(c, named, wanted)

    def fetch_held(self, c: Consumer, named: list[Held], keys: list[bytes]) -> None:
        """Fetch ``keys`` naming the held rounds ``named`` (in that order); check each
        key: one a named round holds loads the bytes the first that does pinned."""
        assert c.peer is not None
        had = set(c.has)
        owner = owners(named, keys, had)
        for k in keys:
            h = owner.get(k)
            if (h is None or k not in h.pinned) and k in self.current:  # looked up again
                c.allowed.setdefault(k, set()).add(self.current[k])
        before = dict(c.has)
        handles = [h.handle for h in named]
        rounds = handles[0] if len(handles) == 1 else handles
        result = c.node.fetch(c.peer, keys, rounds=rounds, timeout=BOUND)
        check_partition(keys, result)
        for k in keys:
            h = owner.get(k)
            self.expect_key(c, k, result, had, h)
            if h is not None and k in h.pinned:
                # exactly the bytes the round pinned, whatever the source's host did since
                assert bytes(self.bytes_of(c, k)) == h.pinned[k], k
        self.landed(c, result, had)
        for k, v in before.items():
            assert c.has[k] == v
        self.keep_if_untaken(c, named, owner)

    @staticmethod
    def keep_if_untaken(c: Consumer, named: list[Held], owner: dict[bytes, Held]) -> None:
        for held in named:
            if all(h is not held for h in owner.values()):
                # The fetch took no key from this round (it wanted no hit of it, or an
                # earlier named round held them): the round stays open, its pins the
                # holder's, until a release or a fetch that takes from it.
                c.held.append(held)
            elif c.peer is not None:
                # It took some: the round is used, nothing of it is left to release.
                assert c.node.release(c.peer, held.handle, timeout=BOUND) == 0, held

    def expect_key(
        self, c: Consumer, k: bytes, result: FetchResult, had: set[bytes], held: Held | None
    ) -> None:
        """Key ``k``'s outcome in a fetch of ``c`` that nothing raced (naming ``held``)."""
        pinned = held.pinned if held is not None else {}
        if k in had:
            assert k in result.loaded, (k, result)
        elif k not in pinned and k in c.anon_churned:
            return  # an anonymous round's pinned bytes, or looked up anew
        elif k in pinned:
            assert k in result.loaded, (k, result)
        elif held is not None and k in held.unsure:
            return  # bytes the source held while the lookup was out, or a miss
        elif held is not None and k in held.keys and held.handle.hits[held.keys.index(k)]:
            # a hit whose pins the source's host released since: documented outcome
            assert k in result.loaded or result.failed[k] == "not_pinned", (k, result)
        elif k in self.current:
            assert k in result.loaded, (k, result)
        else:
            assert result.failed.get(k) == "miss", (k, result)

    @precondition(lambda self: any(c.peer for c in self.consumers))
    @rule(which=st.integers(0, 2), data=st.data())
    def release_round(self, which: int, data: st.DataObject) -> None:
        index = pick(data, 8)
        fit = [c for c in self.consumers[which:] + self.consumers[:which] if c.held and c.peer]
        if not fit:
            return
        c = fit[0]
        assert c.peer is not None
        held = c.held.pop(index % len(c.held))
        closed = c.node.release(c.peer, held.handle, timeout=BOUND)
        # A round with no hit holds nothing at the source and is not kept open.
        assert closed == (1 if any(held.handle.hits) else 0) or held.cut, (closed, held)

    # ------------------------------------------------------------ fetch_into (c3)

    @property
    def into(self) -> Consumer:
        return self.consumers[2]

    @staticmethod
    def busy_slots(c: Consumer) -> set[int]:
        return {s for t in c.tickets.values() for s in t.slots}

    def submit(self, c: Consumer, kind: str, keys: list[bytes], data: st.DataObject) -> None:
        """Submit one ticket of ``kind`` on ``c`` ("fetch" on c3: a ``submit_fetch_into``
        into free slots it draws, naming a held round or not)."""
        assert c.peer is not None
        for k in keys:
            if k in self.current:
                c.allowed.setdefault(k, set()).add(self.current[k])
        src_had = set(self.current) & set(keys)
        name_one = data.draw(st.booleans(), label="name a held round")
        index, choose = pick(data, len(c.held)), chooser(data)
        if kind == "fetch" and c.into:
            named = [c.held.pop(index)] if c.held and name_one else []
            self.submit_into(c, choose(named[0].keys) if named else keys, named, data)
            return
        if kind == "fetch":
            ticket = c.node.submit_fetch(c.peer, keys, timeout=BOUND)
            t = Ticket(keys, set(c.has) | self.fetching(c), src_had, gen=c.gen)
        elif kind == "refused":  # a store fetch on a region lent to fetch_into callers
            ticket = c.node.submit_fetch(c.peer, keys, timeout=BOUND)
            t = Ticket(keys, set(), src_had, kind="refused", gen=c.gen)
        elif kind == "lookup":
            ticket = c.node.submit_lookup(c.peer, keys, timeout=BOUND)
            t = Ticket(keys, set(), src_had, kind="lookup", gen=c.gen)
        elif kind == "round":
            ticket = c.node.submit_lookup_round(c.peer, keys, timeout=BOUND)
            then = {k: self.current[k] for k in src_had}
            t = Ticket(keys, set(), src_had, kind="round", gen=c.gen, then=then)
        else:
            assert kind == "release" and c.held
            held = c.held.pop(index)
            ticket = c.node.submit_release(c.peer, held.handle, timeout=BOUND)
            t = Ticket([], set(), set(), kind="release", held=held, gen=c.gen)
        assert ticket not in c.tickets
        c.tickets[ticket] = t

    def submit_into(
        self, c: Consumer, keys: list[bytes], named: list[Held], data: st.DataObject
    ) -> None:
        """``submit_fetch_into`` of ``keys`` on c3 into free slots drawn (naming the held
        rounds ``named``, in that order)."""
        assert c.peer is not None
        for k in keys:
            if k in self.current:
                c.allowed.setdefault(k, set()).add(self.current[k])
        busy = self.busy_slots(c)
        order = data.draw(st.permutations(range(INTO_SLOTS)), label="slots")
        slots = [s for s in order if s not in busy][: len(keys)]
        if len(slots) < len(keys):  # the slots are all named by fetches in flight
            c.held.extend(named)
            return
        rounds = [h.handle for h in named] or None
        ticket = c.node.submit_fetch_into(c.peer, keys, slots, rounds=rounds, timeout=BOUND)
        assert ticket not in c.tickets
        src_had = set(self.current) & set(keys)
        c.tickets[ticket] = Ticket(
            keys, set(), src_had, kind="into", slots=slots, named=named, gen=c.gen
        )

    @precondition(lambda self: self.into.peer is not None and not self.into.tickets)
    @rule(keys=some_keys, data=st.data())
    def fetch_into(self, keys: list[bytes], data: st.DataObject) -> None:
        """One ``submit_fetch_into`` on c3 (a plain one or naming a held round), collected
        at once: nothing races it, so each key's outcome is exact."""
        c = self.into
        self.submit(c, "fetch", keys, data)
        self.collect_from(c, data.draw(st.booleans(), label="by_poll"))

    @precondition(
        lambda self: (
            any(c.peer and not c.tickets for c in self.consumers)
            and any(c.peer for c in self.stores)
        )
    )
    @rule(
        which=st.integers(0, 2),
        ops=st.lists(
            st.tuples(st.sampled_from(["fetch", "lookup", "round", "release"]), some_keys),
            min_size=1,
            max_size=4,
        ),
        other=some_keys,
        data=st.data(),
    )
    def submit_batch(
        self,
        which: int,
        ops: list[tuple[str, list[bytes]]],
        other: list[bytes],
        data: st.DataObject,
    ) -> None:
        """Fetches (store fetches, or fetch_into on c3), lookups, held lookups and
        releases in flight at once on one consumer, a store fetch of a store consumer
        beside them; collected by ``collect``. On c3 once its region is lent, a store
        fetch is refused (``SlotsInUse``)."""
        c = self.idle_consumer(which, any_kind=True)
        for kind, keys in ops:
            if kind == "release" and not c.held:
                kind = "lookup"
            lent = c.into and c.node.store.lent_to_caller
            store_fetch = data.draw(st.booleans(), label="store fetch")
            if kind == "fetch" and lent and store_fetch:
                kind = "refused"  # a store fetch on the region lent to fetch_into callers
            self.submit(c, kind, keys, data)
        beside = next(s for s in self.stores if s.peer)
        self.submit(beside, "fetch", other, data)

    @precondition(
        lambda self: (
            self.into.peer is not None
            and not self.into.tickets
            and self.into.node.store.lent_to_caller
        )
    )
    @rule(keys=some_keys, data=st.data())
    def store_fetch_on_the_lent_region(self, keys: list[bytes], data: st.DataObject) -> None:
        """The store's own fetch on c3, whose region is its callers': ``SlotsInUse``,
        before anything is sent: a held round it names stays its holder's."""
        c = self.into
        assert c.peer is not None
        index = pick(data, len(c.held))
        named = c.held[index] if c.held else None
        try:
            c.node.fetch(c.peer, keys, rounds=named.handle if named else None, timeout=BOUND)
        except SlotsInUse:
            pass
        else:
            raise AssertionError("a store fetch on a region lent to fetch_into callers")
        assert len(c.node.store) == 0

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.stores))
    @rule(which=st.integers(0, 1), keys=some_keys)
    def fetch_into_a_store(self, which: int, keys: list[bytes]) -> None:
        """fetch_into on a consumer whose store holds blocks: ``SlotsInUse``, the region
        stays the store's and its blocks stay."""
        fit = [
            c
            for c in self.stores[which:] + self.stores[:which]
            if c.has and c.peer and not c.tickets
        ]
        if not fit:
            return
        c = fit[0]
        assert c.peer is not None
        ticket = c.node.submit_fetch_into(c.peer, keys, list(range(len(keys))), timeout=BOUND)
        wait_for(lambda: c.node.pending() == 0)
        outcome = self.poll_outcome(c.node, ticket)
        assert isinstance(outcome, SlotsInUse), outcome
        assert not c.node.store.lent_to_caller

    @precondition(lambda self: self.into.peer is not None and not self.into.tickets)
    @rule(keys=some_keys, repeat_key=st.booleans())
    def fetch_into_bad_arguments(self, keys: list[bytes], repeat_key: bool) -> None:
        """A slot named twice, or a key: ``LocalProtocolError`` before anything is sent;
        the region is not written (checked after the step) nor lent by it."""
        c = self.into
        assert c.peer is not None
        slots = list(range(len(keys)))
        if repeat_key:
            keys, slots = [*keys, keys[0]], [*slots, len(keys)]
        else:
            keys, slots = [*keys, KEYS[0] if KEYS[0] not in keys else KEYS[1]], [*slots, 0]
            if len(set(keys)) < len(keys):  # both KEYS[0] and KEYS[1] were there
                keys = keys[:-1] + [k for k in KEYS if k not in keys][:1]
        lent = c.node.store.lent_to_caller
        ticket = c.node.submit_fetch_into(c.peer, keys, slots, timeout=BOUND)
        wait_for(lambda: c.node.pending() == 0)
        outcome = self.poll_outcome(c.node, ticket)
        assert isinstance(outcome, LocalProtocolError), outcome
        assert c.node.store.lent_to_caller == lent

    @staticmethod
    def poll_outcome(node: BlockingNode, ticket: int) -> object:
        try:
            return node.poll(ticket)
        except Exception as exc:
            return exc

    # ------------------------------------------------------------ disconnect_idle

    @precondition(lambda self: any(c.peer and not c.tickets for c in self.consumers))
    @rule(which=st.integers(0, 2), by_source=st.booleans(), stale=st.booleans(), keys=some_keys)
    def disconnect_idle(self, which: int, by_source: bool, stale: bool, keys: list[bytes]) -> None:
        """``submit_disconnect_idle`` from either side, with the activity read just
        before (``stale``: a lookup made since). Closes the session only if nothing is
        open on it and nothing was asked since; 1 then, 0 if in use."""
        c = self.idle_consumer(which, any_kind=True)
        node, peer = (self.source, c.node.peer_id) if by_source else (c.node, "src")
        activity = node.session_activity(peer)
        assert activity is not None
        if stale:
            self.lookup(self.consumers.index(c), keys)  # a request since: in use
        # A held round with hits is open on the consumer's side until fetched or
        # released (on the source's, until its pins were taken back); an anonymous
        # round may be open or not.
        busy = any(any(h.handle.hits) and not (by_source and h.cut) for h in c.held)
        maybe = bool(c.held) or c.maybe_open
        assert node.pending() == 0
        ticket = node.submit_disconnect_idle(peer, activity, timeout=BOUND)
        wait_for(lambda: node.pending() == 0)
        closed = node.poll(ticket)
        assert closed in (0, 1), closed
        if stale or busy:
            assert closed == 0, (stale, busy)
        elif not maybe:
            assert closed == 1
        if closed:
            self.session_gone(c)
            # Connected again at once: whether an anonymous round was still open is up
            # to timing, and a precondition must not read what timing decided.
            c.peer = c.node.connect(self.source.address, timeout=BOUND)

    # ------------------------------------------------------------ fetches in flight

    @precondition(lambda self: all(c.peer for c in self.stores))
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
            had = set(c.has) | self.fetching(c)
            c.tickets[ticket] = Ticket(keys, had, set(self.current) & set(keys), gen=c.gen)

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
            outcomes = [(t, self.poll_outcome(c.node, t)) for t in sorted(c.tickets)]
            for number in c.tickets:  # each ticket finishes once: read, it is forgotten
                try:
                    c.node.poll(number)
                except KeyError:
                    pass
                else:
                    raise AssertionError(f"ticket {number} read twice")
        else:
            outcomes = list(c.node.get_finished())
            assert sorted(t for t, _ in outcomes) == sorted(c.tickets)
        assert c.node.get_finished() == []
        tickets, c.tickets = c.tickets, {}
        before = dict(c.has)
        for number, outcome in outcomes:
            t = tickets[number]
            if t.kind != "fetch":
                self.collected(c, t, outcome)
                continue
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

    def collected(self, c: Consumer, t: Ticket, outcome: object) -> None:
        """A ticket other than a store fetch finished with ``outcome``: check it."""
        same = t.gen == c.gen  # the session it ran on is still up
        if t.kind == "refused":
            assert isinstance(outcome, SlotsInUse), outcome
        elif t.kind == "into":
            self.collected_into(c, t, outcome)
        elif t.kind == "release":
            assert t.held is not None
            if t.disrupted:
                assert outcome in (0, 1) or isinstance(outcome, P2PKVError), outcome
            else:
                hit = any(t.held.handle.hits)
                assert outcome == (1 if hit else 0) or (t.held.cut and outcome == 0), outcome
        elif t.disrupted and isinstance(outcome, P2PKVError):
            pass  # a lookup cut by a disconnect
        else:
            if t.kind == "round":
                assert isinstance(outcome, LookupRound), outcome
                hits = outcome.hits
            else:
                assert isinstance(outcome, list), outcome
                hits = outcome
            assert len(hits) == len(t.keys) and all(isinstance(h, bool) for h in hits), outcome
            for k, hit in zip(t.keys, hits, strict=True):
                if not t.disrupted and k not in t.churned:
                    assert hit == (k in t.src_had), (k, hit, t)
            if not same:
                return  # its rounds went with the session
            if t.kind == "lookup":
                self.opened_anonymous(c, t.keys, hits, t.churned)
                return
            assert isinstance(outcome, LookupRound)
            found = {k for k, h in zip(t.keys, hits, strict=True) if h}
            unsure = found & t.churned
            pinned = {k: t.then[k] for k in found - unsure}
            if t.disrupted:  # the source's host took pins back: maybe this round's
                c.held.append(Held(outcome, t.keys, {}, cut=True, unsure=found))
            else:
                c.held.append(Held(outcome, t.keys, pinned, unsure=unsure))

    def collected_into(self, c: Consumer, t: Ticket, outcome: object) -> None:
        """A fetch_into finished: each key loaded is in the slot named for it, with bytes
        the source held (exactly those the named round it took it from pinned); a failed
        key's slot holds what the model cannot tell; no other slot was written
        (``region_as_modelled``)."""
        assert isinstance(outcome, FetchResult), outcome
        check_partition(t.keys, outcome)
        assert c.node.store.lent_to_caller and len(c.node.store) == 0
        owner = owners(t.named, t.keys, set())
        for k in t.keys:
            if not (t.disrupted or k in t.churned):
                self.expect_key(c, k, outcome, set(), owner.get(k))
        region = c.node.store.array
        for k, slot in zip(t.keys, t.slots, strict=True):
            if k in outcome.loaded:
                got = bytes(region[slot * BLOCK : (slot + 1) * BLOCK])
                if (held := owner.get(k)) is not None and k in held.pinned:
                    assert got == held.pinned[k], (k, slot)
                else:
                    assert got in c.allowed.get(k, set()), (k, slot, "bytes the source never held")
                c.region[slot] = got
            else:
                c.region[slot] = None  # a write may have landed there, or not
        if t.named and t.gen == c.gen:
            if t.disrupted:
                for held in t.named:
                    held.pinned.clear()
                    held.cut = True
            self.keep_if_untaken(c, t.named, owner)

    # ------------------------------------------------------------ sessions

    @precondition(lambda self: any(c.peer for c in self.consumers))
    @rule(which=st.integers(0, 2), by_source=st.booleans())
    def disconnect(self, which: int, by_source: bool) -> None:
        """The consumer disconnects, or the source disconnects the consumer."""
        c = next(c for c in self.consumers[which:] + self.consumers[:which] if c.peer)
        assert c.peer is not None
        if by_source:
            self.source.disconnect(c.node.peer_id, timeout=BOUND)
        else:
            c.node.disconnect(c.peer, timeout=BOUND)
        self.session_gone(c)

    def session_gone(self, c: Consumer) -> None:
        """``c``'s session with the source is over (either side closed it)."""
        wait_for(lambda: not c.node.is_connected("src"))
        c.peer = None
        c.gen += 1
        c.maybe_open = False
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

    @property
    def stores(self) -> list[Consumer]:
        """The consumers that fetch into their store (c3 fetches into slots it names)."""
        return self.consumers[:2]

    def idle_consumer(
        self, which: int, *, with_rounds: bool = False, any_kind: bool = False
    ) -> Consumer:
        """Consumer ``which``, or another if that one is not fit for a blocking call (of
        the store consumers, unless ``any_kind``)."""
        pool = self.consumers if any_kind else self.stores
        for c in pool[which % len(pool) :] + pool[: which % len(pool)]:
            if c.peer and not c.tickets and (c.held or not with_rounds):
                return c
        raise AssertionError("precondition let an unfit draw through")

    @staticmethod
    def fetching(c: Consumer) -> set[bytes]:
        """Keys a store fetch of ``c`` in flight is bringing into its store."""
        return {k for t in c.tickets.values() if t.kind == "fetch" for k in t.keys}

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

            def drained(node: BlockingNode = node) -> bool:
                n = node.statistics(timeout=BOUND)
                return n.inflight_transfers == 0 and n.inflight_bytes == 0

            wait_for(drained)  # the source counts a write until it saw it complete
        for c in self.consumers:
            if not c.disrupted:
                assert c.node.store.statistics().quarantined == 0

    @invariant()
    def region_as_modelled(self) -> None:
        """c3's slots that no fetch_into in flight names hold what the model says (a key
        landed in a slot not named for it shows here), and once none is in flight the
        node holds none of its slots."""
        if not self.consumers:
            return
        c = self.into
        busy = self.busy_slots(c)
        region = c.node.store.array
        for slot, want in c.region.items():
            if want is not None and slot not in busy:
                got = bytes(region[slot * BLOCK : (slot + 1) * BLOCK])
                assert got == want, f"slot {slot} of c3 was written by no fetch naming it"
        if not busy:
            assert c.node._node.caller_slots == set()  # test seam: the slots it holds

    @invariant()
    def sessions_add_up(self) -> None:
        """``statistics()`` counts the sessions the model says are up (a side that did
        not close one notices the close a moment later)."""
        if self.src is None:
            return
        up = sum(c.peer is not None for c in self.consumers)
        wait_for(lambda: self.source.statistics(timeout=BOUND).peers == up)
        for c in self.consumers:
            want = 0 if c.peer is None else 1

            def settled(node: BlockingNode = c.node, want: int = want) -> bool:
                # peer_count: a closed session counts until it is torn down
                return node.statistics(timeout=BOUND).peers == want == node.peer_count()

            wait_for(settled)

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


@pytest.mark.timeout(SHRINK_ROOM)
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
