"""A Hypothesis state machine: one honest sans-IO session against a peer that lies.

The victim ``v`` is a :class:`SessionProtocol` driven as the session drives it (lookups,
fetches, aborts, answers, transfer_done, abort acks, lease expiry). The peer handshakes
honestly, then sends messages of its own making: every one well formed on the wire, with
fields drawn to lie (request ids of other requests, finished ones and ones never issued;
hit and outcome counts one off; slots past its region or named twice; a second ack; a
restart on the connection; answers to requests that were aborted).

The model is an independent reading of the protocol's rules (docs/design.md, "Wire
protocol"), so it says for each message whether the victim must take it or refuse it:
- taken: exactly the event the model predicts, and exactly the automatic replies
  (a pong, ``LEASE_EXPIRED`` for a fetch of an expired round, an abort_ack for a
  finished request); requests, rounds, pins, keys held and tombstones as the model's;
- refused: :class:`RemoteProtocolError` (or :class:`HandshakeRejected` for a handshake
  message), nothing of the session left open, one ``bye`` with the reason queued, and any
  later bytes ignored.
A lie the victim must refuse is delivered to a copy of it, so one run tries many lies
against one session deep in its life. So a lie can neither slip through (an answer to a
request not awaiting one, a fetch into slots the peer does not have, a reused request id)
nor cost the victim more than the session it arrived on.
"""

from __future__ import annotations

import copy
import os

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pkv.errors import HandshakeRejected, RemoteProtocolError
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
from p2pkv.wire import (
    Abort,
    AbortAck,
    Bye,
    Challenge,
    Fetch,
    FetchHits,
    FrameDecoder,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Outcome,
    Ping,
    Pong,
    TransferDone,
    encode,
)

from .protocol_helpers import NUM_BLOCKS, ConnectionPair, make_info

CAP = 3  # open requests each way: small, so the cap is reached
MAX_KEYS = 3  # keys per request the victim takes
MAX_KEY_LEN = 4  # bytes per key the victim takes
LEASE = 10.0
KEYS = [b"k%d" % i for i in range(5)] + [b"long-key"]  # the last is over MAX_KEY_LEN
CODES = [int(o) for o in Outcome]


@attrs.define
class Out:
    """One of the victim's requests, as the rules say it stands."""

    state: OutState
    nkeys: int
    nhits: int = 0
    nfetch: int = 0
    aborted_from: OutState | None = None


@attrs.define
class Round:
    """One of the peer's rounds at the victim."""

    state: InState
    nkeys: int
    pins: int = 0
    nhits: int = 0
    nfetch: int = 0
    deadline: float = 0.0

    @property
    def keys_held(self) -> int:
        return self.nkeys if self.state is InState.ANSWERING else self.pins + self.nfetch


class Refused(Exception):
    """The model's verdict: the victim must refuse this message (closing the session)."""

    def __init__(self, code: str = "protocol") -> None:
        super().__init__(code)
        self.code = code


class HostilePeerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.broken = False  # a check failed: the invariant must not mask it with its own
        self.new_session()

    def new_session(self) -> None:
        """A fresh victim, handshaken with the peer; the model starts over."""
        pair = ConnectionPair(
            make_info(
                "v", max_open_requests=CAP, max_keys_per_request=MAX_KEYS, max_key_len=MAX_KEY_LEN
            ),
            make_info("h", max_open_requests=CAP),
        )
        pair.handshake()
        self.v = pair.a
        assert self.v.peer is not None
        self.peer_epoch = self.v.peer.epoch
        self.out: dict[int, Out] = {}
        self.rounds: dict[int, Round] = {}
        self.expired: dict[int, None] = {}  # tombstones, oldest first
        self.expired_dropped = 0
        self.peer_last = 0  # the peer's highest request id this incarnation
        self.peer_ids_ever: set[int] = set()  # every id the peer named in a lookup
        self.issued: set[int] = set()  # every id the victim used
        self.peer_acked = True
        self.held: list[Message] = []  # the victim's replies waiting for the peer's ack
        self.expect_out: list[Message] = []  # replies the message being judged must get
        self.last_lie: Message | None = None  # the peer's last message, for a replay
        self.now = 0.0
        self.closed = False
        assert self.sent() == []

    # --- plumbing ---------------------------------------------------------------------

    def sent(self, v: SessionProtocol | None = None) -> list[Message]:
        """What the victim (or a copy) has queued since the last call, decoded."""
        dec = FrameDecoder()
        dec.feed((v or self.v).data_to_send())
        msgs = []
        while (m := dec.next_message()) is not None:
            msgs.append(m)
        assert dec.buffered == 0
        return msgs

    def was_expired(self, req: int) -> bool:
        return req in self.expired or (req <= self.expired_dropped and req not in self.rounds)

    def ids(self, data: st.DataObject, known: set[int], label: str) -> int:
        """A request id to lie with: a known one, the next one, one never used, zero."""
        top = max(known, default=0)
        pool = sorted(known | {0, top + 1, top + 7})
        return data.draw(st.sampled_from(pool), label=label)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        try:
            if self.closed:
                self.poke_closed(data)
                return
            ready = self.v.state is State.READY
            actions = ["hostile"] * 6
            if ready:
                actions += ["lookup", "answer", "fetch", "done", "abort_ack", "abort", "expire"] * 2
            name = data.draw(st.sampled_from(actions), label="action")
            getattr(self, "do_" + name)(data)
        except BaseException:
            self.broken = True
            raise

    # --- the honest victim's driver -----------------------------------------------------

    def do_lookup(self, data: st.DataObject) -> None:
        if len(self.out) >= CAP:
            return
        keys = data.draw(st.lists(st.sampled_from(KEYS[:-1]), min_size=1, max_size=MAX_KEYS))
        req = self.v.send_lookup(keys)
        assert req not in self.issued
        self.issued.add(req)
        self.out[req] = Out(OutState.LOOKUP_SENT, len(keys))
        assert self.sent() == [Lookup(req_id=req, keys=keys)]

    def do_answer(self, data: st.DataObject) -> None:
        todo = sorted(i for i, r in self.rounds.items() if r.state is InState.ANSWERING)
        if not todo:
            return
        req = data.draw(st.sampled_from(todo), label="round")
        r = self.rounds[req]
        hits = data.draw(st.lists(st.booleans(), min_size=r.nkeys, max_size=r.nkeys))
        self.v.send_lookup_resp(req, hits, self.now, LEASE)
        r.state, r.pins, r.nhits = InState.PINNED, sum(hits), sum(hits)
        r.deadline = self.now + LEASE
        assert self.sent() == [LookupResp(req_id=req, hits=hits)]
        if data.draw(st.booleans(), label="host drains the pins"):
            self.v.pins_released(req)
            r.pins = 0

    def do_fetch(self, data: st.DataObject) -> None:
        todo = sorted(i for i, m in self.out.items() if m.state is OutState.OPEN)
        if not todo:
            return
        req = data.draw(st.sampled_from(todo), label="request")
        m = self.out[req]
        if m.nhits and data.draw(st.sampled_from([True, True, False]), label="fetch_hits"):
            slots = data.draw(
                st.lists(
                    st.integers(0, NUM_BLOCKS - 1), min_size=m.nhits, max_size=m.nhits, unique=True
                )
            )
            self.v.send_fetch_hits(req, slots)
            m.state, m.nfetch = OutState.FETCH_SENT, len(slots)
            assert self.sent() == [FetchHits(req_id=req, slots=slots)]
            return
        n = data.draw(st.integers(0, m.nkeys), label="keys fetched")
        keys = data.draw(st.lists(st.sampled_from(KEYS[:-1]), min_size=n, max_size=n))
        slots = data.draw(
            st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True)
        )
        self.v.send_fetch(req, keys, slots)
        if n:
            m.state, m.nfetch = OutState.FETCH_SENT, n
        else:
            del self.out[req]  # an empty fetch closes the round: its terminal outcome
        assert self.sent() == [Fetch(req_id=req, keys=keys, slots=slots)]

    def do_done(self, data: st.DataObject) -> None:
        todo = sorted(i for i, r in self.rounds.items() if r.state is InState.WRITING)
        if not todo:
            return
        req = data.draw(st.sampled_from(todo), label="round")
        n = self.rounds.pop(req).nfetch
        outcomes = data.draw(st.lists(st.sampled_from(CODES), min_size=n, max_size=n))
        self.v.send_transfer_done(req, outcomes)
        assert self.sent() == [TransferDone(req_id=req, outcomes=outcomes)]

    def do_abort(self, data: st.DataObject) -> None:
        todo = sorted(i for i, m in self.out.items() if m.state is not OutState.ABORT_SENT)
        if not todo:
            return
        req = data.draw(st.sampled_from(todo), label="request")
        m = self.out[req]
        self.v.send_abort(req)
        m.aborted_from, m.state = m.state, OutState.ABORT_SENT
        assert self.sent() == [Abort(req_id=req)]

    def do_abort_ack(self, data: st.DataObject) -> None:
        todo = sorted(i for i, r in self.rounds.items() if r.state is InState.ABORTING)
        if not todo:
            return
        req = data.draw(st.sampled_from(todo), label="round")
        del self.rounds[req]
        self.v.send_abort_ack(req)
        assert self.sent() == [AbortAck(req_id=req)]

    def do_expire(self, data: st.DataObject) -> None:
        self.now += data.draw(st.sampled_from([1.0, LEASE / 2, LEASE]), label="time passes")
        due = sorted(
            i
            for i, r in self.rounds.items()
            if r.state is InState.PINNED and r.deadline <= self.now
        )
        assert sorted(self.v.expire(self.now)) == due
        for i in due:
            del self.rounds[i]
            self.expired[i] = None
        while len(self.expired) > CAP:
            oldest = next(iter(self.expired))
            del self.expired[oldest]
            self.expired_dropped = max(self.expired_dropped, oldest)
        assert self.sent() == []

    # --- the peer's lies ----------------------------------------------------------------

    def draw_lie(self, data: st.DataObject) -> Message:
        """A message from the peer. An honest peer sends what fits now, so that runs get
        deep into the protocol. About half are lies: one field of a message that fits (the
        request id, a count, a slot or a key), or a replay of the peer's last message. A
        lie the model refuses is checked on a copy of the victim, and the run goes on with
        the session it would have ended."""
        pinned = [i for i, r in self.rounds.items() if r.state is InState.PINNED]
        hit = [i for i in pinned if self.rounds[i].nhits] + list(self.expired)

        def outs(state: OutState) -> list[int]:
            return [i for i, m in self.out.items() if state in (m.state, m.aborted_from)]

        honest = [
            k
            for k, possible in [
                ("lookup_resp", outs(OutState.LOOKUP_SENT)),
                ("transfer_done", outs(OutState.FETCH_SENT)),
                ("abort_ack", outs(OutState.ABORT_SENT)),
                ("lookup", len(self.rounds) < CAP),
                ("fetch", pinned or self.expired),
                ("fetch_hits", hit),
                ("abort", self.rounds),
            ]
            if possible
        ]
        # Middle values stand for the rare choices: Hypothesis draws the ends of a range
        # more often than the rest.
        roll = data.draw(st.integers(0, 63), label="roll")
        sorts = ["id", "count", "slot", "key", "replay"]
        lie = sorts[roll % 5] if 10 <= roll < 40 else "none"
        if lie == "replay" and self.last_lie is not None:
            return self.last_lie
        # The kinds a lie of each sort fits: a count or a key only where the message has
        # one, a slot in fetches; more requests than the cap is a lookup's count lie.
        fits = {
            "count": [k for k in honest if k not in ("abort_ack", "abort")] + ["lookup"],
            "slot": [k for k in honest if k in ("fetch", "fetch_hits")],
            "key": [k for k in honest if k in ("lookup", "fetch")],
        }
        if lie in fits and not fits[lie]:
            lie = "id"
        if roll in (40, 41, 42):
            kind = "restart"
        elif roll in (43, 44, 45, 46):
            kind = data.draw(st.sampled_from(["hello_ack", "challenge", "bye"]), label="kind")
        elif lie in fits:
            kind = data.draw(st.sampled_from(fits[lie]), label="kind")
        elif lie == "none" and honest:
            answers = [k for k in honest if k in ("lookup_resp", "transfer_done", "abort_ack")]
            kind = data.draw(st.sampled_from([*honest, *answers * 3, "ping", "pong"]))
        else:
            lie = "id"
            every = ["lookup_resp", "transfer_done", "abort_ack", "lookup", "fetch"]
            kind = data.draw(st.sampled_from([*every, "fetch_hits", "abort"]), label="kind")
        # Ids to lie with: every one either side used in this session, also those of the
        # peer's incarnations before a restart.
        mine, theirs = self.issued, self.peer_ids_ever | {self.peer_last}
        off = st.sampled_from([-1, 1]) if lie == "count" else st.just(0)

        def pick(fitting: list[int], known: set[int]) -> int:
            if fitting and lie != "id":
                return data.draw(st.sampled_from(sorted(fitting)), label="req")
            return self.ids(data, known, "req")

        def slots(n: int) -> list[int]:
            inside = st.integers(0, NUM_BLOCKS - 1)
            out = data.draw(st.lists(inside, min_size=n, max_size=n, unique=True))
            if lie == "slot" and out:
                i = data.draw(st.integers(0, n - 1), label="lying slot")
                if n > 1 and data.draw(st.booleans(), label="named twice"):
                    out[i] = out[i - 1]
                else:
                    out[i] = data.draw(st.sampled_from([NUM_BLOCKS, NUM_BLOCKS + 1, 1 << 40]))
            return out

        def keys(n: int) -> list[bytes]:
            out = data.draw(st.lists(st.sampled_from(KEYS[:-1]), min_size=n, max_size=n))
            if lie == "key" and out:
                out[data.draw(st.integers(0, n - 1), label="lying key")] = KEYS[-1]
            return out

        if kind == "lookup_resp":
            req = pick(outs(OutState.LOOKUP_SENT), mine)
            m = self.out.get(req)
            n = max(0, (m.nkeys if m else 1) + data.draw(off, label="hits off by"))
            hits = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
            return LookupResp(req_id=req, hits=hits)
        if kind == "transfer_done":
            req = pick(outs(OutState.FETCH_SENT), mine)
            m = self.out.get(req)
            n = max(0, (m.nfetch if m else 1) + data.draw(off, label="outcomes off by"))
            outcomes = data.draw(st.lists(st.sampled_from(CODES), min_size=n, max_size=n))
            sums = data.draw(st.none() | st.just([7] * n), label="checksums")
            return TransferDone(req_id=req, outcomes=outcomes, checksums=sums)
        if kind == "abort_ack":
            return AbortAck(req_id=pick(outs(OutState.ABORT_SENT), mine))
        if kind == "lookup":
            full = len(self.rounds) >= CAP
            fresh = [self.peer_last + 1] if not full or lie == "count" else []
            n = data.draw(st.integers(0, MAX_KEYS), label="keys")
            n += lie == "count" and not full  # over the cap on keys, or on open requests
            return Lookup(req_id=pick(fresh, theirs), keys=keys(n))
        if kind == "fetch":
            req = pick(pinned + list(self.expired), theirs)
            n = data.draw(st.integers(0, MAX_KEYS), label="keys") + (lie == "count")
            return Fetch(req_id=req, keys=keys(n), slots=slots(n))
        if kind == "fetch_hits":
            req = pick(hit, theirs)
            r = self.rounds.get(req)
            if r is None and lie == "count":  # a round whose lease ran out: over the cap
                n = MAX_KEYS + 1
            else:
                n = max(0, (r.nhits if r else 1) + data.draw(off, label="slots off by"))
            return FetchHits(req_id=req, slots=slots(n))
        if kind == "abort":
            return Abort(req_id=pick(list(self.rounds) + list(self.expired), theirs))
        if kind == "ping":
            return Ping(nonce=data.draw(st.integers(0, 9), label="nonce"))
        if kind == "pong":
            return Pong(nonce=data.draw(st.integers(0, 9), label="nonce"))
        if kind == "hello_ack":
            epoch = data.draw(st.sampled_from([self.v.local.epoch, self.v.local.epoch + 1]))
            who = data.draw(st.sampled_from(["h", "x"]), label="acker")
            return HelloAck(peer_id=who, epoch=epoch)
        if kind == "restart":
            assert self.v.peer is not None
            new = self.peer_epoch + 1
            epoch = data.draw(st.sampled_from([new, new, new, self.peer_epoch]), label="epoch")
            who = data.draw(st.sampled_from(["h", "h", "h", "x"]), label="restarted as")
            block_len = data.draw(st.sampled_from([self.v.local.block_len] * 3 + [8192]))
            return attrs.evolve(
                self.v.peer, epoch=epoch, peer_id=who, agent_name=who, block_len=block_len
            )
        if kind == "challenge":
            return Challenge(nonce=b"n" * 16)
        return Bye(code="shutdown", reason="lie or not, it is over")

    def do_hostile(self, data: st.DataObject) -> None:
        msg = self.last_lie = self.draw_lie(data)
        frame = encode(msg)
        cut = data.draw(st.integers(0, len(frame)), label="cut")
        try:
            expected = self.judge(msg)
        except Refused as refused:
            self.expect_out = []
            self.refuse(copy.deepcopy(self.v), msg, frame, cut, refused.code)
            return
        events = self.feed(self.v, frame, cut)
        assert events == expected, f"{msg!r}: {events} != {expected}"
        if isinstance(msg, Hello):
            assert self.v.registration_succeeded() is None  # the peer's ack is still due
        sent = self.sent()
        want, self.expect_out = self.expect_out, []
        if isinstance(msg, Hello):
            ours = sent.pop(0)
            assert isinstance(ours, Hello) and ours.epoch == self.v.local.epoch, ours
            want.pop(0)
        assert sent == want, f"{msg!r}: sent {sent}, want {want}"

    @staticmethod
    def feed(v: SessionProtocol, frame: bytes, cut: int) -> list[Event]:
        events: list[Event] = []
        for part in (frame[:cut], frame[cut:]):
            v.receive_data(part)
            while (ev := v.next_event()) is not None:
                events.append(ev)
        return events

    def refuse(self, v: SessionProtocol, msg: Message, frame: bytes, cut: int, code: str) -> None:
        """``v`` (a copy of the victim: the run goes on with the session the lie would have
        ended) refuses ``msg``: a typed error, nothing left open, a bye with the reason,
        and nothing more taken or sent after it."""
        try:
            self.feed(v, frame, cut)
        except (RemoteProtocolError, HandshakeRejected) as exc:
            kind = HandshakeRejected if code == "handshake" else RemoteProtocolError
            assert type(exc) is kind, f"{msg!r}: {exc!r}"
        else:
            raise AssertionError(f"the victim took a lie: {msg!r}")
        assert v.state in (State.ERROR, State.CLOSED)
        assert v.open_requests() == [] and v.open_rounds() == [] and v.pins_held() == 0
        last = self.sent(v)[-1]
        assert isinstance(last, Bye) and last.code == code, last
        assert self.feed(v, encode(Ping(nonce=1)), 0) == []
        assert self.sent(v) == []

    def poke_closed(self, data: st.DataObject) -> None:
        """After the peer's bye, its further bytes are ignored (no event, no reply); then
        the run goes on with a new session."""
        assert self.feed(self.v, encode(Ping(nonce=1)), 0) == []
        assert self.sent() == []
        self.new_session()

    # --- the model's verdict ------------------------------------------------------------

    def judge(self, msg: Message) -> list[Event]:
        """The events the victim must emit for ``msg`` (its replies checked here too), with
        the model updated; :class:`Refused` if it must refuse it."""
        if isinstance(msg, Challenge):
            raise Refused("handshake")  # no secret here
        if isinstance(msg, Hello):
            return self.judge_restart(msg)
        if isinstance(msg, HelloAck):
            if self.peer_acked or msg.epoch != self.v.local.epoch or msg.peer_id != "h":
                raise Refused()
            self.peer_acked = True
            self.expect_out += self.held  # what waited for the ack goes out, in order
            self.held = []
            return [Ready()]
        if isinstance(msg, Bye):
            self.closed = True
            return [ByeReceived(msg.code, msg.reason)]
        if not self.peer_acked and not isinstance(msg, Ping | Pong):
            raise Refused()  # a request before the peer's ack
        if isinstance(msg, Ping):
            if self.peer_acked:
                self.expect_out.append(Pong(nonce=msg.nonce))
            else:  # held until the ack; only the latest pong is kept
                self.held = [Pong(nonce=msg.nonce)]
            return []
        if isinstance(msg, Pong):
            return [PongReceived(msg.nonce)]
        if isinstance(msg, LookupResp):
            m = self.reply_to(msg.req_id, OutState.LOOKUP_SENT, len(msg.hits))
            if m is None:
                return []
            m.state, m.nhits = OutState.OPEN, sum(msg.hits)
            return [LookupAnswered(msg.req_id, msg.hits)]
        if isinstance(msg, TransferDone):
            if self.reply_to(msg.req_id, OutState.FETCH_SENT, len(msg.outcomes)) is None:
                return []
            del self.out[msg.req_id]
            return [TransferCompleted(msg.req_id, msg.outcomes, msg.checksums)]
        if isinstance(msg, AbortAck):
            m = self.out.get(msg.req_id)
            if m is None or m.state is not OutState.ABORT_SENT:
                raise Refused()
            del self.out[msg.req_id]
            return [AbortAcknowledged(msg.req_id)]
        if isinstance(msg, Lookup):
            if msg.req_id <= self.peer_last or len(self.rounds) >= CAP:
                raise Refused()
            if len(msg.keys) > MAX_KEYS or any(len(k) > MAX_KEY_LEN for k in msg.keys):
                raise Refused()
            self.peer_last = msg.req_id
            self.peer_ids_ever.add(msg.req_id)
            self.rounds[msg.req_id] = Round(InState.ANSWERING, len(msg.keys))
            return [LookupRequested(msg.req_id, msg.keys)]
        if isinstance(msg, Fetch | FetchHits):
            return self.judge_fetch(msg)
        assert isinstance(msg, Abort)
        r = self.rounds.get(msg.req_id)
        if r is None:
            if msg.req_id > self.peer_last:
                raise Refused()
            self.expired.pop(msg.req_id, None)
            self.expect_out.append(AbortAck(req_id=msg.req_id))
            return []
        if r.state is InState.ABORTING:
            return []
        r.state = InState.ABORTING
        return [AbortRequested(msg.req_id)]

    def reply_to(self, req: int, awaited: OutState, entries: int) -> Out | None:
        """The victim's request that a lookup_resp (``awaited`` LOOKUP_SENT) or a
        transfer_done (FETCH_SENT) of ``entries`` hits or outcomes answers; None if our
        abort crossed it (swallowed, once: a second is refused). :class:`Refused` if no
        request awaits it, or the count differs from its keys or fetch."""
        m = self.out.get(req)
        if m is None or awaited not in (m.state, m.aborted_from):
            raise Refused()
        if entries != (m.nkeys if awaited is OutState.LOOKUP_SENT else m.nfetch):
            raise Refused()
        if m.state is OutState.ABORT_SENT:
            m.aborted_from = OutState.OPEN
            return None
        return m

    def judge_fetch(self, msg: Fetch | FetchHits) -> list[Event]:
        req, slots = msg.req_id, msg.slots
        expired = self.was_expired(req)
        r = self.rounds.get(req)
        if not expired and (r is None or r.state is not InState.PINNED):
            raise Refused()
        if len(slots) > MAX_KEYS:
            raise Refused()
        if isinstance(msg, Fetch) and any(len(k) > MAX_KEY_LEN for k in msg.keys):
            raise Refused()
        if any(s >= NUM_BLOCKS for s in slots) or len(set(slots)) != len(slots):
            raise Refused()  # only inside the peer's own region, each slot once
        if isinstance(msg, FetchHits) and r is not None and not expired and len(slots) != r.nhits:
            raise Refused()
        if expired:
            self.expired.pop(req, None)
            if slots:
                lapsed = [int(Outcome.LEASE_EXPIRED)] * len(slots)
                self.expect_out.append(TransferDone(req_id=req, outcomes=lapsed))
            return []
        assert r is not None
        if not slots:
            del self.rounds[req]
            return [RoundClosed(req)]
        r.state, r.nfetch = InState.WRITING, len(slots)
        keys = msg.keys if isinstance(msg, Fetch) else None
        return [FetchRequested(req, keys, slots)]

    def judge_restart(self, msg: Hello) -> list[Event]:
        if msg.epoch == self.peer_epoch or msg.peer_id != "h":
            raise Refused()
        if msg.block_len != self.v.local.block_len:
            raise Refused("handshake")
        dropped, failed = tuple(self.rounds), tuple(self.out)
        self.rounds.clear()
        self.out.clear()
        self.expired.clear()
        self.expired_dropped = self.peer_last = 0
        self.held = []
        self.peer_acked = False
        self.peer_epoch = msg.epoch
        # The driver registers the new incarnation at once: our new hello, then our ack.
        self.expect_out += [
            attrs.evolve(msg, peer_id="v"),  # stands for our hello: compared by epoch only
            HelloAck(peer_id="v", epoch=msg.epoch),
        ]
        return [HelloReceived(msg, True, dropped, failed)]

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def model_holds(self) -> None:
        if self.broken:
            return
        try:
            self.check()
        except BaseException:
            self.broken = True
            raise

    def check(self) -> None:
        v = self.v
        if self.closed:
            assert v.state in (State.ERROR, State.CLOSED)
            return
        assert v.state is (State.READY if self.peer_acked else State.HANDSHAKE)
        assert sorted(v.open_requests()) == sorted(self.out)
        assert sorted(v.open_rounds()) == sorted(self.rounds)
        for i, m in self.out.items():
            assert v.out_state(i) is m.state
        for i, r in self.rounds.items():
            assert v.in_state(i) is r.state
        assert v.pins_held() == sum(r.pins for r in self.rounds.values()) >= 0
        assert v.keys_held() == sum(r.keys_held for r in self.rounds.values())
        assert v.tombstones() == len(self.expired)


TestHostilePeer = HostilePeerMachine.TestCase
TestHostilePeer.settings = settings(
    max_examples=150 if os.environ.get("P2PKV_SLOW") != "1" else 1500,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
