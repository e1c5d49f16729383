"""A Hypothesis state machine drives two connected sans-IO sessions against a model.

Both sides are consumer and producer at once. Each step takes one action a well-behaved
driver may take (registration after the peer's hello, lookups, answers with random hits,
fetches of random keys into random distinct slots, empty fetches, transfer_done, aborts,
abort acks, lease expiry on an advancing clock, pings, bye from one or both sides) or
delivers bytes in flight in random amounts and chunkings, so that replies cross aborts and
frames arrive in pieces.

After every step: no protocol error between two well-behaved peers; pins are never
negative and equal the model's pins of live rounds; request and round states match the
model; no request reaches two terminal outcomes; request ids are never reused; whenever
the wire is quiet, each consumer request and its producer round are in matching states
(nothing waits for a message that will never come). When both drivers have finished their
work ("settle"), every request has exactly one terminal outcome from the protocol itself
(transfer_done, abort_ack or an empty fetch) and every ping its pong (or, for a ping sent
before the peer had our ack, a later ping's: the peer holds only its latest pong until
then); after the bye
nothing is left on either side.
"""

from __future__ import annotations

import itertools
import os

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from p2pkv.errors import CapacityExceeded
from p2pkv.session.protocol import (
    AbortAcknowledged,
    AbortRequested,
    ByeReceived,
    Event,
    FetchRequested,
    HelloReceived,
    InState,
    LookupAnswered,
    LookupRequested,
    OutState,
    PongReceived,
    Ready,
    RoundClosed,
    SessionProtocol,
    State,
    TransferCompleted,
)
from p2pkv.wire import Lookup, Outcome, Ping, encode

from .protocol_helpers import NUM_BLOCKS, make_info, snapshot

SIDES = ("x", "y")
KEYS = [b"k%d" % i for i in range(6)]
CAP = 4  # open requests per side: small, so the cap is reached
LEASE = 10.0
MIN_STEPS_BEFORE_BYE = 40
OUTCOMES = [int(Outcome.OK), int(Outcome.NOT_PINNED), int(Outcome.TRANSFER_FAILED)]


@attrs.define
class OutModel:
    """A consumer request as the model sees it."""

    state: OutState
    keys: list[bytes]
    nfetch: int = 0
    hits: int = 0  # in the peer's answer: what a fetch_hits names a slot for


@attrs.define
class InModel:
    """A producer round as the model sees it."""

    state: InState
    keys: list[bytes]
    pins: int = 0
    deadline: float = 0.0
    nfetch: int = 0

    @property
    def keys_held(self) -> int:
        return len(self.keys) if self.state is InState.ANSWERING else self.pins + self.nfetch


def other(s: str) -> str:
    return "y" if s == "x" else "x"


class SessionPairMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.proto = {s: SessionProtocol(make_info(s, max_open_requests=CAP)) for s in SIDES}
        self.pipe = {s: bytearray() for s in SIDES}  # sent by s, not yet delivered
        self.out: dict[str, dict[int, OutModel]] = {s: {} for s in SIDES}
        self.rounds: dict[str, dict[int, InModel]] = {s: {} for s in SIDES}
        # Rounds whose lease ran out (a tombstone at most) while the consumer's request lives.
        self.expired: dict[str, set[int]] = {s: set() for s in SIDES}
        # Rounds expired at a side when it closed: a fetch it answered from their
        # tombstones before its bye may still be on the wire to the other side.
        self.expired_at_close: dict[str, set[int]] = {s: set() for s in SIDES}
        self.terminal: dict[str, dict[int, list[str]]] = {s: {} for s in SIDES}
        self.issued: dict[str, list[int]] = {s: [] for s in SIDES}
        self.seen_ids: dict[str, list[int]] = {s: [] for s in SIDES}  # peer ids, in order
        self.sent_outcomes: dict[str, dict[int, list[int]]] = {s: {} for s in SIDES}
        self.pings: dict[str, set[int]] = {s: set() for s in SIDES}
        # Pings sent while the other side did not have our ack yet: it may hold their
        # pongs, and keeps only the latest, so a later pong may answer them.
        self.early_pings: dict[str, set[int]] = {s: set() for s in SIDES}
        self.hello_seen = dict.fromkeys(SIDES, False)
        self.registered = dict.fromkeys(SIDES, False)
        self.ready_count = dict.fromkeys(SIDES, 0)
        self.now = 0.0
        self.closed = False
        self.steps = 0
        self.broken = False

    # --- plumbing ---------------------------------------------------------------------

    def flush(self, s: str) -> None:
        self.pipe[s] += self.proto[s].data_to_send()

    def end(self, s: str, req: int, how: str) -> None:
        self.terminal[s][req].append(how)
        assert len(self.terminal[s][req]) == 1, f"{s}:{req} ended twice: {self.terminal[s][req]}"

    def handle(self, s: str, ev: Event) -> None:
        """Side ``s`` emitted ``ev``: check it against the model, then update the model."""
        if isinstance(ev, HelloReceived):
            assert not ev.restarted and not self.hello_seen[s]
            assert ev.hello.peer_id == other(s)
            self.hello_seen[s] = True
        elif isinstance(ev, Ready):
            self.ready_count[s] += 1
            assert self.ready_count[s] == 1, "Ready emitted twice"
            assert self.registered[s]
        elif isinstance(ev, LookupRequested):
            assert ev.req_id not in self.rounds[s]
            assert ev.req_id in self.issued[other(s)]
            assert all(ev.req_id > i for i in self.seen_ids[s]), "request id reused"
            self.seen_ids[s].append(ev.req_id)
            self.rounds[s][ev.req_id] = InModel(InState.ANSWERING, ev.keys)
        elif isinstance(ev, LookupAnswered):
            m = self.out[s][ev.req_id]
            assert m.state is OutState.LOOKUP_SENT
            assert len(ev.hits) == len(m.keys)
            m.state, m.hits = OutState.OPEN, sum(ev.hits)
        elif isinstance(ev, FetchRequested):
            r = self.rounds[s][ev.req_id]
            assert r.state is InState.PINNED
            n = len(ev.slots)
            assert n and len(set(ev.slots)) == n
            if ev.keys is None:  # a fetch_hits: one slot per hit of the answer
                assert n == r.pins
            else:
                assert len(ev.keys) == n
            r.state, r.nfetch = InState.WRITING, n
        elif isinstance(ev, RoundClosed):
            r = self.rounds[s].pop(ev.req_id)
            assert r.state is InState.PINNED
        elif isinstance(ev, AbortRequested):
            r = self.rounds[s][ev.req_id]
            assert r.state is not InState.ABORTING
            r.state = InState.ABORTING
        elif isinstance(ev, TransferCompleted):
            m = self.out[s].pop(ev.req_id)
            assert m.state is OutState.FETCH_SENT, "transfer_done after an abort leaked out"
            sent = self.sent_outcomes[other(s)].pop(ev.req_id, None)
            if sent is None:  # the protocol answered a fetch of an expired round itself
                assert ev.req_id in self.expired[other(s)] | self.expired_at_close[other(s)]
                sent = [int(Outcome.LEASE_EXPIRED)] * m.nfetch
            assert ev.outcomes == sent
            assert len(ev.outcomes) == m.nfetch
            self.expired[other(s)].discard(ev.req_id)
            self.end(s, ev.req_id, "transfer_done")
        elif isinstance(ev, AbortAcknowledged):
            m = self.out[s].pop(ev.req_id)
            assert m.state is OutState.ABORT_SENT
            self.expired[other(s)].discard(ev.req_id)
            self.end(s, ev.req_id, "abort_ack")
        elif isinstance(ev, PongReceived):
            assert ev.nonce in self.pings[s]
            self.pings[s].discard(ev.nonce)
            # It answers the earlier pings the other side may have held for our ack too
            # (it keeps the latest pong only); every other ping gets its own.
            answered = {n for n in self.early_pings[s] if n < ev.nonce}
            self.pings[s] -= answered
            self.early_pings[s] -= answered | {ev.nonce}
        else:
            assert isinstance(ev, ByeReceived)
            self.close_model(s)

    def deliver_bytes(self, s: str, n: int, cuts: list[int]) -> None:
        """Deliver the first ``n`` bytes that ``s`` sent to its peer, split at ``cuts``."""
        dst = other(s)
        data, self.pipe[s] = bytes(self.pipe[s][:n]), self.pipe[s][n:]
        bounds = [0, *sorted(c for c in cuts if 0 < c < n), n]
        for lo, hi in itertools.pairwise(bounds):
            self.proto[dst].receive_data(data[lo:hi])
            while (ev := self.proto[dst].next_event()) is not None:
                self.handle(dst, ev)
            self.flush(dst)  # automatic replies (pong, abort_ack of a finished request)

    def close_model(self, s: str) -> None:
        """Session closed at ``s``: every open request ends, every round is gone."""
        for req in list(self.out[s]):
            self.end(s, req, "closed")
        self.out[s].clear()
        self.rounds[s].clear()
        self.expired_at_close[s] |= self.expired[s]
        self.expired[s].clear()

    # --- rules ------------------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        for s in SIDES:
            self.proto[s].start()
            self.flush(s)

    # One rule picks among the actions that make sense now. (Separate rules would be cut
    # down by Hypothesis' swarm testing, which disables random rules per example: without
    # "register" or "deliver" no run would ever leave the handshake.)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        actions = [name for name, enabled in self.actions() if enabled]
        name = data.draw(st.sampled_from(actions), label="action")
        try:
            getattr(self, "do_" + name)(data)
        except BaseException:
            self.broken = True  # teardown must not mask this with an error of its own
            raise

    def actions(self) -> list[tuple[str, bool]]:
        """(action, enabled now); an action listed twice is drawn twice as often."""
        live = not self.closed
        registrable = any(self.hello_seen[s] and not self.registered[s] for s in SIDES)
        return [
            *[("deliver", live and any(self.pipe.values()))] * 3,
            *[("register", live and registrable)] * 2,
            ("send_lookup", live),
            *[("answer", live and bool(self.ins(InState.ANSWERING)))] * 3,
            *[("send_fetch", live and bool(self.fetchable()))] * 3,
            *[("send_fetch_hits", live and bool(self.fetchable_by_hits()))] * 2,
            ("empty_fetch", live and bool(self.outs(OutState.OPEN))),
            *[("transfer_done", live and bool(self.ins(InState.WRITING)))] * 3,
            ("abort", live and bool(self.abortable())),
            # aborting while a transfer_done may be in flight: the crossing case
            ("abort_fetching", live and bool(self.outs(OutState.FETCH_SENT))),
            *[("abort_ack", live and bool(self.ins(InState.ABORTING)))] * 2,
            ("expire", live),
            ("ping", live),
            ("bye", live and self.steps >= MIN_STEPS_BEFORE_BYE),  # let most runs get far
            ("poke_closed", self.closed),
        ]

    def pick(self, data: st.DataObject, items: list[tuple[str, int]]) -> tuple[str, int]:
        return data.draw(st.sampled_from(sorted(items)), label="request")

    def side(self, data: st.DataObject, sides: list[str] | tuple[str, ...] = SIDES) -> str:
        return data.draw(st.sampled_from(sides), label="side")

    def outs(self, *states: OutState) -> list[tuple[str, int]]:
        return [(s, i) for s in SIDES for i, m in self.out[s].items() if m.state in states]

    def ins(self, *states: InState) -> list[tuple[str, int]]:
        return [(s, i) for s in SIDES for i, r in self.rounds[s].items() if r.state in states]

    def fetchable(self) -> list[tuple[str, int]]:
        return [(s, i) for s, i in self.outs(OutState.OPEN) if self.out[s][i].keys]

    def fetchable_by_hits(self) -> list[tuple[str, int]]:
        return [(s, i) for s, i in self.outs(OutState.OPEN) if self.out[s][i].hits]

    def abortable(self) -> list[tuple[str, int]]:
        return self.outs(OutState.LOOKUP_SENT, OutState.OPEN, OutState.FETCH_SENT)

    # --- actions ----------------------------------------------------------------------

    def do_deliver(self, data: st.DataObject) -> None:
        """Some of the bytes in flight arrive, in random pieces."""
        s = self.side(data, [s for s in SIDES if self.pipe[s]])
        size = len(self.pipe[s])
        # Byte counts drawn plainly shrink towards one byte a step: no run would get far.
        how = data.draw(st.sampled_from(["all", "in_pieces", "prefix"]), label="how")
        n = size if how != "prefix" else data.draw(st.integers(1, size), label="bytes")
        cuts = [] if how == "all" else data.draw(st.lists(st.integers(1, n), max_size=4))
        self.deliver_bytes(s, n, cuts)

    def do_register(self, data: st.DataObject) -> None:
        """The driver's registration of the peer finished (only once its hello is in)."""
        s = self.side(data, [s for s in SIDES if self.hello_seen[s] and not self.registered[s]])
        self.registered[s] = True
        ready = self.proto[s].registration_succeeded()
        if ready is not None:
            self.handle(s, ready)
        self.flush(s)

    def do_send_lookup(self, data: st.DataObject) -> None:
        s = self.side(data)
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True), label="keys")
        p = self.proto[s]
        if len(self.out[s]) >= CAP:
            before = snapshot(p, self.out[s])
            try:
                p.send_lookup(keys)
            except CapacityExceeded:
                pass
            else:
                raise AssertionError("the cap on open requests was not enforced")
            assert snapshot(p, self.out[s]) == before
            return
        req = p.send_lookup(keys)
        assert all(req > i for i in self.issued[s]), "request id reused"
        self.issued[s].append(req)
        self.out[s][req] = OutModel(OutState.LOOKUP_SENT, keys)
        self.terminal[s][req] = []
        self.flush(s)

    def do_answer(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.ins(InState.ANSWERING))
        r = self.rounds[s][req]
        n = len(r.keys)
        hits = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="hits")
        self.proto[s].send_lookup_resp(req, hits, self.now, LEASE)
        r.state, r.pins, r.deadline = InState.PINNED, sum(hits), self.now + LEASE
        self.flush(s)
        self.maybe_cross(data, other(s), req)

    def do_send_fetch(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.fetchable())
        m = self.out[s][req]
        keys = data.draw(st.lists(st.sampled_from(m.keys), min_size=1, unique=True), label="keys")
        n = len(keys)
        slots = data.draw(
            st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True),
            label="slots",
        )
        self.proto[s].send_fetch(req, keys, slots)
        m.state, m.nfetch = OutState.FETCH_SENT, n
        self.flush(s)

    def do_send_fetch_hits(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.fetchable_by_hits())
        m = self.out[s][req]
        slots = data.draw(
            st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=m.hits, max_size=m.hits, unique=True),
            label="slots",
        )
        self.proto[s].send_fetch_hits(req, slots)
        m.state, m.nfetch = OutState.FETCH_SENT, m.hits
        self.flush(s)

    def do_empty_fetch(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.outs(OutState.OPEN))
        self.proto[s].send_fetch(req, [], [])
        del self.out[s][req]
        self.expired[other(s)].discard(req)
        self.end(s, req, "empty_fetch")
        self.flush(s)

    def do_transfer_done(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.ins(InState.WRITING))
        r = self.rounds[s].pop(req)
        n = r.nfetch
        outcomes = data.draw(
            st.lists(st.sampled_from(OUTCOMES), min_size=n, max_size=n), label="outcomes"
        )
        sums = data.draw(
            st.none() | st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n),
            label="checksums",
        )
        self.proto[s].send_transfer_done(req, outcomes, sums)
        self.sent_outcomes[s][req] = outcomes
        self.flush(s)
        self.maybe_cross(data, other(s), req)

    def maybe_cross(self, data: st.DataObject, consumer: str, req: int) -> None:
        """Sometimes the consumer gives up while the producer's reply is on the wire."""
        m = self.out[consumer].get(req)
        if m is None or m.state is OutState.ABORT_SENT:
            return
        if data.draw(st.integers(0, 3), label="consumer aborts meanwhile") == 0:
            self.proto[consumer].send_abort(req)
            m.state = OutState.ABORT_SENT
            self.flush(consumer)

    def do_abort(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.abortable())
        self.proto[s].send_abort(req)
        self.out[s][req].state = OutState.ABORT_SENT
        self.flush(s)

    def do_abort_fetching(self, data: st.DataObject) -> None:
        s, req = self.pick(data, self.outs(OutState.FETCH_SENT))
        self.proto[s].send_abort(req)
        self.out[s][req].state = OutState.ABORT_SENT
        self.flush(s)

    def do_abort_ack(self, data: st.DataObject) -> None:
        """The producer drained the aborted round's writes and released its pins."""
        s, req = self.pick(data, self.ins(InState.ABORTING))
        self.proto[s].send_abort_ack(req)
        del self.rounds[s][req]
        self.flush(s)

    def do_expire(self, data: st.DataObject) -> None:
        """Time passes (it is an argument: the machine has no clock)."""
        s = self.side(data)
        self.now += data.draw(st.sampled_from([0.0, 1.0, 4.0, LEASE]), label="dt")
        due = sorted(
            i
            for i, r in self.rounds[s].items()
            if r.state is InState.PINNED and r.deadline <= self.now
        )
        assert sorted(self.proto[s].expire(self.now)) == due
        for i in due:
            del self.rounds[s][i]
            # A round whose consumer already closed it with an empty fetch (still on the
            # wire) loses its tombstone when that fetch arrives; only open requests keep one.
            if i in self.out[other(s)]:
                self.expired[s].add(i)

    def do_ping(self, data: st.DataObject) -> None:
        s = self.side(data)
        nonce = self.proto[s].send_ping()
        self.pings[s].add(nonce)
        if not self.proto[other(s)]._peer_acked:
            self.early_pings[s].add(nonce)
        self.flush(s)

    def do_bye(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="graceful"):
            self.settle()  # both drivers finish their work first
        self.close(self.side(data), data.draw(st.booleans(), label="both"))

    def do_poke_closed(self, data: st.DataObject) -> None:
        """A closed session ignores input, emits nothing and holds nothing."""
        p = self.proto[self.side(data)]
        nonce = data.draw(st.integers(0, 2**64 - 1), label="nonce")
        p.receive_data(encode(Ping(nonce=nonce)) + encode(Lookup(req_id=nonce, keys=[KEYS[0]])))
        assert p.next_event() is None
        assert p.expire(self.now + 1e9) == []
        p.send_bye("shutdown", "again")
        assert p.data_to_send() == b""

    def close(self, s: str, both: bool) -> None:
        for closer in (s, other(s)) if both else (s,):
            self.proto[closer].send_bye("shutdown", f"{closer} is done")
            self.close_model(closer)
            self.flush(closer)
        # Everything in flight arrives; the side that did not close sees the bye.
        for src in (s, other(s)):
            self.deliver_bytes(src, len(self.pipe[src]), [])
        self.closed = True
        for p in self.proto.values():
            assert p.state is State.CLOSED

    def signature(self) -> object:
        """What settling changes: request and round states, terminal outcomes so far."""
        return [
            (
                sorted((i, m.state.value) for i, m in self.out[s].items()),
                sorted((i, r.state.value) for i, r in self.rounds[s].items()),
                sum(len(e) for e in self.terminal[s].values()),
            )
            for s in SIDES
        ]

    def settle(self) -> None:
        """Let both drivers finish every piece of work they own, until nothing moves.

        Afterwards every request must have its terminal outcome from the protocol itself
        (transfer_done, abort_ack or an empty fetch), not merely from closing the session.
        """
        while True:
            before = self.signature()
            moved = any(self.pipe.values())
            for s in SIDES:
                self.deliver_bytes(s, len(self.pipe[s]), [])
                if self.hello_seen[s] and not self.registered[s]:
                    self.registered[s] = moved = True
                    if (ready := self.proto[s].registration_succeeded()) is not None:
                        self.handle(s, ready)
            for s, req in self.ins(InState.ANSWERING):
                self.proto[s].send_lookup_resp(
                    req, [False] * len(self.rounds[s][req].keys), self.now, LEASE
                )
                self.rounds[s][req].state = InState.PINNED
            for s, req in self.outs(OutState.OPEN):
                self.proto[s].send_fetch(req, [], [])
                del self.out[s][req]
                self.expired[other(s)].discard(req)
                self.end(s, req, "empty_fetch")
            for s, req in self.ins(InState.WRITING):
                r = self.rounds[s].pop(req)
                outcomes = [int(Outcome.ABORTED)] * r.nfetch
                self.proto[s].send_transfer_done(req, outcomes)
                self.sent_outcomes[s][req] = outcomes
            for s, req in self.ins(InState.ABORTING):
                self.proto[s].send_abort_ack(req)
                del self.rounds[s][req]
            for s in SIDES:
                self.flush(s)
            self.check_model()
            if not moved and not any(self.pipe.values()) and before == self.signature():
                break
        # Liveness: with both drivers done, every request ended through the protocol.
        for s in SIDES:
            assert self.ready_count[s] == 1, "the handshake did not complete"
            assert self.out[s] == {} and self.proto[s].open_requests() == []
            assert self.rounds[s] == {} and self.proto[s].pins_held() == 0
            assert self.pings[s] == set(), "a ping was never answered"
            for req, ends in self.terminal[s].items():
                assert len(ends) == 1 and ends[0] != "closed", f"{s}:{req} ended {ends}"

    def teardown(self) -> None:
        if self.broken:
            return
        if not self.closed:
            self.settle()
            self.close("x", both=False)
        self.check_model()
        for s in SIDES:
            p = self.proto[s]
            assert p.pins_held() == 0 and p.open_rounds() == [] and p.open_requests() == []
            for req, ends in self.terminal[s].items():
                assert len(ends) == 1, f"{s}:{req} ended {ends}"

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def model_holds(self) -> None:
        self.steps += 1
        try:
            self.check_model()
        except BaseException:
            self.broken = True
            raise

    def check_model(self) -> None:
        self.check_sides_agree()
        for s in SIDES:
            p = self.proto[s]
            assert p.state is not State.ERROR, p.close_reason
            pins = p.pins_held()
            assert pins >= 0
            assert pins == sum(r.pins for r in self.rounds[s].values())
            assert sorted(p.open_rounds()) == sorted(self.rounds[s])
            assert sorted(p.open_requests()) == sorted(self.out[s])
            assert p.keys_held() == sum(r.keys_held for r in self.rounds[s].values())
            for i, r in self.rounds[s].items():
                assert p.in_state(i) is r.state
            for i in self.expired[s]:  # its tombstone is kept or dropped, never more
                assert p.in_state(i) in (InState.EXPIRED, None)
            assert p.tombstones() <= CAP
            for i, m in self.out[s].items():
                assert p.out_state(i) is m.state
            for req, ends in self.terminal[s].items():
                assert len(ends) <= 1
                assert (req in self.out[s]) == (not ends)
            assert self.ready_count[s] <= 1
            if self.ready_count[s]:
                assert p.ready or self.closed

    def check_sides_agree(self) -> None:
        """With both sides ready and nothing on the wire, each consumer request and the
        producer's round for it are in matching states (or both gone): nothing is stuck
        waiting for a message that will never come."""
        if self.closed or any(self.pipe.values()) or min(self.ready_count.values()) < 1:
            return
        for s in SIDES:
            rounds = self.rounds[other(s)]
            theirs = {i: r.state for i, r in rounds.items()}
            theirs.update(dict.fromkeys(self.expired[other(s)], InState.EXPIRED))
            mine = {i: PRODUCER_STATES[m.state] for i, m in self.out[s].items()}
            assert set(theirs) == set(mine), f"{s}: requests {mine} vs rounds {theirs}"
            for i, st_ in theirs.items():
                assert st_ in mine[i], f"{s}:{i} consumer {self.out[s][i].state}, producer {st_}"


# What the producer's round may be doing while the consumer's request is in a state and the
# wire is quiet (the drivers may not have acted yet).
PRODUCER_STATES = {
    OutState.LOOKUP_SENT: (InState.ANSWERING,),
    OutState.OPEN: (InState.PINNED, InState.EXPIRED),
    OutState.FETCH_SENT: (InState.WRITING,),
    OutState.ABORT_SENT: (InState.ABORTING,),
}

TestSessionPair = SessionPairMachine.TestCase
TestSessionPair.settings = settings(
    max_examples=80 if os.environ.get("P2PKV_SLOW") != "1" else 800,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
