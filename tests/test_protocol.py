"""The sans-IO session protocol: every transition, legal and illegal.

Plain synchronous tests: two ``SessionProtocol`` machines wired by ``ConnectionPair``, or
one machine fed hand-crafted frames by a misbehaving peer. No sockets, no Trio, no clock.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.config import PROTOCOL_MAJOR
from p2pkv.errors import (
    CapacityExceeded,
    HandshakeRejected,
    LocalProtocolError,
    RemoteProtocolError,
)
from p2pkv.session.protocol import (
    MIN_NONCE,
    AbortAcknowledged,
    AbortRequested,
    ByeReceived,
    Event,
    FetchRequested,
    HelloReceived,
    InState,
    LocalInfo,
    LookupAnswered,
    LookupRequested,
    OutState,
    PongReceived,
    Ready,
    RoundClosed,
    SessionProtocol,
    State,
    TransferCompleted,
    ack_proof,
    hello_proof,
)
from p2pkv.wire import (
    MAX_KEY_LEN,
    MAX_KEYS,
    U64_MAX,
    Abort,
    AbortAck,
    Bye,
    Challenge,
    Fetch,
    FetchHits,
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
    to_wire,
)

from .protocol_helpers import (
    BLOCK_LEN,
    NUM_BLOCKS,
    ConnectionPair,
    assert_refused,
    decode_frames,
    make_info,
    ready_pair,
    snapshot,
)

OK = int(Outcome.OK)
K1, K2, K3 = b"key-1", b"key-2", b"key-3"
SECRET = b"correct horse battery staple"


def hello_for(info: LocalInfo, *, to: bytes = b"", **changes: Any) -> Hello:
    """The hello a machine with ``info`` sends (optionally altered after the fact). With a
    secret, its proof is bound to the receiver's nonce ``to``."""
    p = SessionProtocol(attrs.evolve(info, secret=None))
    p.start()
    (h,) = decode_frames(p.data_to_send())
    assert isinstance(h, Hello)
    if info.secret is not None:
        h = attrs.evolve(h, auth=hello_proof(info.secret, h, to, dialer=info.dialer))
    return attrs.evolve(h, **changes)


def sent(p: SessionProtocol) -> list[Message]:
    return decode_frames(p.data_to_send())


def events_of(p: SessionProtocol, data: bytes) -> list[Event]:
    p.receive_data(data)
    out: list[Event] = []
    while (ev := p.next_event()) is not None:
        out.append(ev)
    return out


def half_open(
    a_info: LocalInfo | None = None, b_info: LocalInfo | None = None
) -> tuple[SessionProtocol, Hello]:
    """``a`` (the accepting side) started and holding b's hello, registration pending: our
    ack not sent yet. With a secret, b's hello carries a proof over a's nonce."""
    a = SessionProtocol(a_info or make_info("a"))
    a.start()
    a.data_to_send()
    b_info = attrs.evolve(b_info or make_info("b"), dialer=True)
    hb = hello_for(b_info, to=a.local.nonce)
    assert events_of(a, encode(hb)) == [HelloReceived(hb)]
    return a, hb


def assert_protocol_error(p: SessionProtocol, data: bytes, match: str) -> RemoteProtocolError:
    """Feeding ``data`` to ``p`` is the peer's fault: RemoteProtocolError, State.ERROR, a
    ``bye(code="protocol")`` with the reason queued, every request and round gone."""
    p.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=match) as info:
        while p.next_event() is not None:
            pass
    exc = info.value
    reason = str(exc)
    assert p.state is State.ERROR
    assert not p.ready
    assert p.close_reason == ("protocol", reason)
    byes = [m for m in sent(p) if isinstance(m, Bye)]
    assert byes == [Bye(code="protocol", reason=reason)]
    assert p.open_requests() == [] and p.open_rounds() == [] and p.pins_held() == 0
    # Dead: more input is ignored, nothing more is emitted, a bye is not sent twice.
    p.receive_data(encode(Ping(nonce=1)))
    assert p.next_event() is None
    p.send_bye("shutdown", "again")
    assert p.data_to_send() == b""
    return exc


# --- handshake ----------------------------------------------------------------------------


@pytest.mark.parametrize("a_registers_first", [True, False])
def test_handshake_emits_hello_received_then_ready_exactly_once_per_side(
    a_registers_first: bool,
) -> None:
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    pair.exchange()
    assert pair.log[a] == [HelloReceived(hello_for(b.local))]
    assert pair.log[b] == [HelloReceived(hello_for(a.local))]
    assert a.peer_id == "b" and b.peer_id == "a"
    assert a.state is State.HANDSHAKE and not a.ready
    first, second = (a, b) if a_registers_first else (b, a)
    assert pair.register(first) is None  # the peer's ack is not in yet
    data = first.data_to_send()
    assert [type(m) for m in decode_frames(data)] == [HelloAck]
    assert pair.feed(second, data) == []  # second's own ack is not sent yet: not ready
    assert not second.ready and not first.ready
    assert pair.register(second) == Ready()  # the peer's ack was already in
    assert pair.deliver(second) == [Ready()]
    pair.exchange()
    for p in (a, b):
        assert p.state is State.READY and p.ready
        assert [type(e) for e in pair.log[p]] == [HelloReceived, Ready]


def sent_types(p: SessionProtocol) -> list[type[Message]]:
    return [type(m) for m in sent(p)]


def test_hello_ack_acknowledges_the_peers_epoch() -> None:
    a, hb = half_open()
    a.registration_succeeded()
    assert sent(a) == [HelloAck(peer_id="a", epoch=hb.epoch)]


def test_requests_are_held_until_the_peers_ack() -> None:
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    req = a.send_lookup([K1])
    nonce = a.send_ping()
    assert sent_types(a) == [Hello]  # nothing but the hello goes out
    b.start()
    pair.deliver(b)
    pair.feed(b, encode(hello_for(a.local)))
    pair.register(a)
    assert sent_types(a) == [HelloAck]  # our ack may go; the lookup still may not
    a.send_abort(req)  # also held, behind the lookup
    assert a.data_to_send() == b""
    pair.register(b)
    pair.deliver(b)  # b's ack reaches a: the held messages follow, in order
    assert sent(a) == [Lookup(req_id=req, keys=[K1]), Ping(nonce=nonce), Abort(req_id=req)]


def test_a_request_made_before_our_own_ack_waits_for_it() -> None:
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    pair.exchange()
    pair.register(b)
    pair.deliver(b)  # a has b's ack; a has not registered b yet, so its ack is not out
    req = a.send_lookup([K1, K2])
    nonce = a.send_ping()  # behind the lookup: nothing overtakes what is held
    assert a.data_to_send() == b""  # b would refuse a request before a's ack
    assert pair.register(a) == Ready()  # a's ack goes out, then what waited for it
    assert pair.deliver(a) == [Ready(), LookupRequested(req, [K1, K2])]
    b.send_lookup_resp(req, [True, False], 0.0, 10.0)
    assert sent(b) == [Pong(nonce=nonce), LookupResp(req_id=req, hits=[True, False])]


@pytest.mark.parametrize(
    "msg",
    [
        Lookup(req_id=1, keys=[K1]),
        Fetch(req_id=1, keys=[K1], slots=[0]),
        FetchHits(req_id=1, slots=[0]),
        Abort(req_id=1),
        LookupResp(req_id=1, hits=[True]),
        TransferDone(req_id=1, outcomes=[OK]),
        AbortAck(req_id=1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_anything_but_ping_before_the_peers_ack_is_a_protocol_error(msg: Message) -> None:
    # Our ack is out, the peer's is not: a peer is ready (and asks) only once its ack is
    # out, and a reply to a request it made before would be held until that ack, which
    # a peer that never acks would never send (found by a review: 50,000 aborts of one
    # round made us hold 50,000 acks).
    a, _ = half_open()
    a.registration_succeeded()
    a.data_to_send()
    assert_protocol_error(a, encode(msg), "before the peer's hello_ack")


@pytest.mark.parametrize(
    "msg",
    [
        Lookup(req_id=1, keys=[K1]),
        Fetch(req_id=1, keys=[K1], slots=[0]),
        Abort(req_id=1),
        Ping(nonce=1),
        Pong(nonce=1),
        LookupResp(req_id=1, hits=[True]),
        TransferDone(req_id=1, outcomes=[OK]),
        AbortAck(req_id=1),
    ],
    ids=lambda m: type(m).__name__,
)
@pytest.mark.parametrize("stage", ["before_any_hello", "before_our_ack", "after_the_peers_ack"])
def test_anything_but_handshake_before_our_ack_is_a_protocol_error(
    msg: Message, stage: str
) -> None:
    if stage == "before_any_hello":
        a = SessionProtocol(make_info("a"))
        a.start()
        a.data_to_send()
    else:
        a, _ = half_open()  # the peer's hello is in, our registration is still running
    if stage == "after_the_peers_ack":
        # The peer registered us first and acked: its requests still wait for our ack
        # (invariant 3: a fetch served now would write to a peer not registered yet).
        # Mutation testing: dropping the check of our own ack from the hot dispatch path
        # went unnoticed without this stage.
        assert events_of(a, encode(HelloAck(peer_id="b", epoch=a.local.epoch))) == []
    assert_protocol_error(a, encode(msg), "before our hello_ack")


def test_peers_ack_before_its_hello_is_a_protocol_error() -> None:
    a = SessionProtocol(make_info("a"))
    a.start()
    a.data_to_send()
    assert_protocol_error(
        a, encode(HelloAck(peer_id="b", epoch=a.local.epoch)), "hello_ack before hello"
    )


def test_duplicate_hello_ack_is_a_protocol_error() -> None:
    pair = ready_pair()
    ack = HelloAck(peer_id="b", epoch=pair.a.local.epoch)
    assert_protocol_error(pair.a, encode(ack), "duplicate hello_ack")


@pytest.mark.parametrize("changes", [{"epoch": 12345}, {"peer_id": "c"}], ids=["epoch", "peer"])
def test_hello_ack_for_another_epoch_or_peer_is_a_protocol_error(changes: dict[str, Any]) -> None:
    a, _ = half_open()
    ack = attrs.evolve(HelloAck(peer_id="b", epoch=a.local.epoch), **changes)
    assert_protocol_error(a, encode(ack), "another epoch or peer")


INCOMPATIBLE: list[tuple[str, dict[str, Any], str]] = [
    ("major_version", {"version_major": PROTOCOL_MAJOR + 1}, "protocol version"),
    ("block_len", {"block_len": 8192}, "block length"),
    ("fingerprint", {"fingerprint": "model-y/fp8"}, "fingerprint"),
    ("hash_algo", {"hash_algo": "xxh3"}, "hash algorithm or seed"),
    ("hash_seed", {"hash_seed": b"other seed"}, "hash algorithm or seed"),
    ("own_peer_id", {"peer_id": "a"}, "is our own"),
    ("empty_peer_id", {"peer_id": "", "agent_name": ""}, "empty peer id"),
    ("zero_blocks", {"num_blocks": 0}, "region of 0 blocks"),
    ("too_many_blocks", {"num_blocks": (1 << 21) + 1}, "this node accepts 1..2097152"),
    ("region_past_u64", {"base_addr": (1 << 64) - 4096}, "does not fit the address space"),
    # Its end address must fit in 64 bits too: base + length would wrap to 0 in a C u64.
    (
        "region_ending_at_2_64",
        {"base_addr": (1 << 64) - NUM_BLOCKS * BLOCK_LEN},
        "does not fit the address space",
    ),
    ("other_agent", {"agent_name": "victim"}, "is not the peer id"),
    ("zero_key_limit", {"max_key_len": 0}, "zero request limits"),
    ("zero_keys_per_request", {"max_keys_per_request": 0}, "zero request limits"),
    ("zero_open_requests", {"max_open_requests": 0}, "zero request limits"),
]


def assert_rejected_both_ways(pair: ConnectionPair, hello_a: bytes, reason: str) -> None:
    """``pair.a`` rejected ``pair.b``'s hello for ``reason``: a closed, having sent its
    ``handshake`` bye; fed a's hello and that bye, b learns why and closes too."""
    a, b = pair.a, pair.b
    assert a.state is State.CLOSED
    assert a.close_reason == ("handshake", reason)
    assert sent(a) == [Bye(code="handshake", reason=reason)]
    assert a.next_event() is None
    pair.feed(b, hello_a + encode(Bye(code="handshake", reason=reason)))
    assert pair.log[b] == [HelloReceived(hello_for(a.local)), ByeReceived("handshake", reason)]
    assert b.state is State.CLOSED
    assert b.close_reason == ("handshake", reason)


@pytest.mark.parametrize(
    ("changes", "match"), [pytest.param(c, m, id=i) for i, c, m in INCOMPATIBLE]
)
def test_incompatible_hello_rejects_the_handshake(changes: dict[str, Any], match: str) -> None:
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    hello_a = a.data_to_send()
    bad = hello_for(b.local, **changes)
    a.receive_data(encode(bad))
    with pytest.raises(HandshakeRejected, match=match) as info:
        a.next_event()
    assert not info.value.remote
    assert_rejected_both_ways(pair, hello_a, info.value.reason)


def test_a_region_whose_last_byte_is_the_top_of_the_address_space_is_accepted() -> None:
    """The other side of ``region_ending_at_2_64``: a region that fits is not refused."""
    top = (1 << 64) - 1 - NUM_BLOCKS * BLOCK_LEN
    pair = ready_pair(make_info("a"), make_info("b", base_addr=top))
    assert pair.a.ready and pair.a.peer is not None and pair.a.peer.base_addr == top


def _hello_of_another_shape(info: LocalInfo, major: int, change: str) -> bytes:
    """The frame of ``info``'s hello as a node of protocol ``major`` might send it: a
    field gone, retyped or nested, and one added (a new major may change any of them)."""
    body = to_wire(hello_for(info, version_major=major))
    body["new_field"] = {"nested": [1, 2]}
    if change == "missing":
        del body["hash_seed"]
    elif change == "retyped":
        body["num_blocks"] = str(body["num_blocks"])
    elif change == "nested":
        body["fingerprint"] = {"model": "x", "dtype": "fp8"}
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(data)) + data


@pytest.mark.parametrize("change", ["missing", "retyped", "nested"])
def test_a_hello_of_another_major_version_is_refused_by_its_version_whatever_its_fields(
    change: str,
) -> None:
    """A new major version may drop, retype or restructure hello fields. Its hello was
    refused as a generic protocol error ("invalid hello: missing field ..."): the peer got
    a ``protocol`` bye and no ``HandshakeRejected``, and neither side was told that the
    versions differ. The version a hello names is read even when the rest does not decode
    as ours, and a different major is a rejected handshake, with the same reason as any
    other hello of another major."""
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    hello_a = a.data_to_send()
    a.receive_data(_hello_of_another_shape(b.local, PROTOCOL_MAJOR + 1, change))
    with pytest.raises(HandshakeRejected) as info:
        a.next_event()
    reason = info.value.reason
    assert reason == f"protocol version {PROTOCOL_MAJOR + 1} != {PROTOCOL_MAJOR}"
    assert info.value.peer == "b" and not info.value.remote
    assert_rejected_both_ways(pair, hello_a, reason)


def test_a_ready_peer_restarting_into_another_major_on_its_connection_is_a_protocol_error() -> None:
    """Only a first hello is refused by its version alone: a restart on a ready session's
    connection that does not decode is the peer's protocol error, as before (the session's
    answer lane, which reads only answers, must never meet a handshake rejection)."""
    pair = ready_pair()
    frame = _hello_of_another_shape(
        attrs.evolve(pair.b.local, epoch=pair.b.local.epoch + 1), PROTOCOL_MAJOR + 1, "missing"
    )
    assert_protocol_error(pair.a, frame, "invalid hello: missing field 'hash_seed'")


@pytest.mark.parametrize("change", ["missing", "retyped", "nested"])
def test_a_malformed_hello_of_our_own_major_version_is_still_a_protocol_error(
    change: str,
) -> None:
    """The other side of the test above: a hello naming our major whose fields do not
    decode is the peer's protocol error, worded as before."""
    a = SessionProtocol(make_info("a"))
    a.start()
    a.data_to_send()
    assert_protocol_error(
        a,
        _hello_of_another_shape(make_info("b"), PROTOCOL_MAJOR, change),
        "invalid hello|undecodable",
    )


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        pytest.param({"max_peer_blocks": NUM_BLOCKS}, {}, id="region_of_max_peer_blocks"),
        pytest.param(
            {}, {"max_keys_per_request": 1, "max_key_len": 1, "max_open_requests": 1}, id="ones"
        ),
        pytest.param(
            {},
            {"max_keys_per_request": U64_MAX, "max_key_len": U64_MAX, "max_open_requests": U64_MAX},
            id="u64_max_limits",
        ),
        pytest.param({}, {"epoch": U64_MAX}, id="u64_max_epoch"),
        pytest.param({}, {"epoch": 0}, id="zero_epoch"),
    ],
)
def test_a_hello_at_each_numeric_edge_the_handshake_allows_is_accepted(
    ours: dict[str, Any], theirs: dict[str, Any]
) -> None:
    """The other side of the refusals above: each number of a hello at the edge of what
    is allowed completes the handshake (a bound one step too tight would refuse a peer
    that works), and the peer's advertised limits only ever lower ours, never raise them
    (a peer's U64_MAX leaves our own limits; its 1s become ours)."""
    pair = ready_pair(make_info("a", **ours), make_info("b", **theirs))
    a = pair.a
    assert a.ready and a.peer is not None
    assert a.peer.epoch == theirs.get("epoch", a.peer.epoch)
    li, peer = a.local, a.peer
    assert a.request_limits() == (
        min(li.max_keys_per_request, peer.max_keys_per_request),
        min(li.max_key_len, peer.max_key_len),
    )
    assert a.open_requests_limit() == min(li.max_open_requests, peer.max_open_requests or 1 << 64)


def test_mismatched_configs_reject_on_both_sides_and_the_bye_carries_the_reason() -> None:
    pair = ConnectionPair(make_info("a"), make_info("b", block_len=8192))
    pair.a.start()
    pair.b.start()
    # Each side named: the reason reaches both ends.
    reason = "block length 8192 (of 'b') != 4096 (of 'a')"
    with pytest.raises(HandshakeRejected, match=re.escape(reason)):
        pair.deliver(pair.b)
    bye = sent(pair.a)[-1]
    assert bye == Bye(code="handshake", reason=reason)


def test_the_same_secret_on_both_sides_authenticates() -> None:
    pair = ready_pair(make_info("a", secret=SECRET), make_info("b", secret=SECRET))
    (hello_b, _) = pair.log[pair.a]
    assert isinstance(hello_b, HelloReceived)
    unsigned = attrs.evolve(hello_b.hello, auth=None)
    assert hello_b.hello.auth == hello_proof(SECRET, unsigned, pair.a.local.nonce, dialer=False)


@pytest.mark.parametrize(
    ("a_secret", "b_secret", "match"),
    [
        (SECRET, b"another secret", "authentication failed"),
        (SECRET, None, "authentication required"),
        (None, SECRET, "authentication required|no secret configured here"),
    ],
    ids=["different_secret", "missing_proof", "proof_without_local_secret"],
)
def test_authentication_mismatch_rejects_the_handshake(
    a_secret: bytes | None, b_secret: bytes | None, match: str
) -> None:
    pair = ConnectionPair(make_info("a", secret=a_secret), make_info("b", secret=b_secret))
    pair.a.start()
    pair.b.start()
    with pytest.raises(HandshakeRejected, match=match) as info:
        pair.exchange()
    (rejecter,) = [p for p in (pair.a, pair.b) if p.state is State.CLOSED]
    assert sent(rejecter)[-1] == Bye(code="handshake", reason=info.value.reason)
    assert Ready() not in pair.log[pair.a] + pair.log[pair.b]


def test_a_hello_with_a_proof_is_rejected_by_a_side_without_a_secret() -> None:
    """A peer that proves a secret expects one: a side with none refuses its hello rather
    than ignore the proof (honest peers never get here: a dialer with a secret waits for
    a challenge, and one without refuses a challenge)."""
    a = SessionProtocol(make_info("a"))
    a.start()
    a.data_to_send()
    hb = hello_for(make_info("b", secret=SECRET, dialer=True), to=a.local.nonce)
    with pytest.raises(HandshakeRejected, match="no secret configured here"):
        events_of(a, encode(hb))
    assert a.peer is None
    assert sent(a) == [
        Bye(code="handshake", reason="peer requires authentication; no secret configured here")
    ]


def test_hello_altered_under_a_valid_proof_is_rejected() -> None:
    a = SessionProtocol(make_info("a", secret=SECRET))
    a.start()
    b = make_info("b", secret=SECRET, dialer=True)
    forged = hello_for(b, to=a.local.nonce, epoch=999)  # proof is over the old epoch
    with pytest.raises(HandshakeRejected, match="authentication failed"):
        events_of(a, encode(forged))


def test_a_hello_recorded_on_another_connection_is_rejected() -> None:
    """Replay: a valid hello of b, captured on b's connection to another node (bound to
    that node's nonce), proves nothing on a's connection: a acts on nothing."""
    b = make_info("b", secret=SECRET, dialer=True)
    other = SessionProtocol(make_info("c", secret=SECRET))
    other.start()
    challenge = other.data_to_send()
    recorded = hello_for(b, to=other.local.nonce)
    assert events_of(other, encode(recorded)) == [HelloReceived(recorded)]  # valid there
    a = SessionProtocol(make_info("a", secret=SECRET))
    a.start()
    assert decode_frames(a.data_to_send()) == [Challenge(nonce=a.local.nonce)]
    assert decode_frames(challenge) != [Challenge(nonce=a.local.nonce)]
    with pytest.raises(HandshakeRejected, match="authentication failed"):
        events_of(a, encode(recorded))
    assert a.peer is None  # nothing of the hello was taken in
    assert decode_frames(a.data_to_send()) == [
        Bye(code="handshake", reason="authentication failed")
    ]


def test_a_hello_carrying_our_own_nonce_is_rejected_even_with_a_valid_proof() -> None:
    """A hello whose nonce is our own is rejected as not fresh, even under a valid proof:
    a peer echoing our nonce back must not be taken in."""
    a = SessionProtocol(make_info("a", secret=SECRET))
    a.start()
    a.data_to_send()
    b_info = make_info("b", secret=SECRET, dialer=True, nonce=a.local.nonce)
    hb = hello_for(b_info, to=a.local.nonce)  # a valid proof, over our own nonce
    with pytest.raises(HandshakeRejected, match="nonce is not fresh"):
        events_of(a, encode(hb))
    assert a.peer is None


@pytest.mark.parametrize("nonce", [b"", b"n" * (MIN_NONCE - 1)], ids=["empty", "one_short"])
def test_a_hello_whose_nonce_is_too_short_is_rejected_even_with_a_valid_proof(
    nonce: bytes,
) -> None:
    """Our hello's proof and our ack's are bound to the dialer's nonce: one shorter than
    ``MIN_NONCE`` (a fixed or guessable one) would make them replayable, so the hello is
    rejected before anything of ours (our hello, our agent metadata) is sent."""
    a = SessionProtocol(make_info("a", secret=SECRET))
    a.start()
    a.data_to_send()
    b_info = make_info("b", secret=SECRET, dialer=True, nonce=nonce)
    hb = hello_for(b_info, to=a.local.nonce)  # a valid proof over a's nonce
    with pytest.raises(HandshakeRejected, match="nonce is not fresh"):
        events_of(a, encode(hb))
    assert a.peer is None
    assert [type(m) for m in decode_frames(a.data_to_send())] == [Bye]  # no hello of ours


def test_the_accepting_side_reveals_its_hello_only_to_a_proven_dialer() -> None:
    a = SessionProtocol(make_info("a", secret=SECRET))
    a.start()
    assert [type(m) for m in decode_frames(a.data_to_send())] == [Challenge]
    unproven = hello_for(make_info("b", secret=b"not the secret", dialer=True), to=a.local.nonce)
    with pytest.raises(HandshakeRejected):
        events_of(a, encode(unproven))
    assert [type(m) for m in decode_frames(a.data_to_send())] == [Bye]  # no hello of ours


def test_a_dialer_with_a_secret_waits_for_the_challenge() -> None:
    b = SessionProtocol(make_info("b", secret=SECRET, dialer=True))
    b.start()
    assert b.data_to_send() == b""
    nonce = b"c" * 16
    assert events_of(b, encode(Challenge(nonce=nonce))) == []
    (hello,) = decode_frames(b.data_to_send())
    assert isinstance(hello, Hello)
    assert hello.auth == hello_proof(SECRET, attrs.evolve(hello, auth=None), nonce, dialer=True)


@pytest.mark.parametrize("which", ["ours", "short"])
def test_a_challenge_whose_nonce_is_not_fresh_is_a_protocol_error(which: str) -> None:
    """A challenge carrying our own nonce or one shorter than ``MIN_NONCE`` is the peer's
    protocol error: a dialer must never prove itself over a nonce it did not get fresh."""
    b = SessionProtocol(make_info("b", secret=SECRET, dialer=True))
    b.start()
    nonce = b.local.nonce if which == "ours" else b"x"
    with pytest.raises(RemoteProtocolError, match="challenge nonce is not fresh"):
        events_of(b, encode(Challenge(nonce=nonce)))


@pytest.mark.parametrize("which", ["second", "to_the_acceptor"])
def test_a_challenge_out_of_place_is_a_protocol_error(which: str) -> None:
    """Only a dialer gets a challenge, and only one, before its hello: a second would have
    it prove itself again, over a nonce of the peer's choosing, on the same connection."""
    if which == "second":
        p = SessionProtocol(make_info("b", secret=SECRET, dialer=True))
        p.start()
        assert events_of(p, encode(Challenge(nonce=b"c" * 16))) == []
        assert [type(m) for m in sent(p)] == [Hello]
    else:
        p = SessionProtocol(make_info("a", secret=SECRET))
        p.start()
        assert [type(m) for m in sent(p)] == [Challenge]
    with pytest.raises(RemoteProtocolError, match="unexpected challenge"):
        events_of(p, encode(Challenge(nonce=b"d" * 16)))
    assert [type(m) for m in sent(p)] == [Bye]  # no second hello


def test_a_dialer_refuses_a_hello_sent_in_place_of_the_challenge() -> None:
    """With a secret the accepting side challenges first; a hello instead is refused as
    such, even one proven over the dialer's nonce, and the dialer sends no hello."""
    b = SessionProtocol(make_info("b", secret=SECRET, dialer=True))
    b.start()
    assert b.data_to_send() == b""
    ha = hello_for(make_info("a", secret=SECRET), to=b.local.nonce)
    with pytest.raises(HandshakeRejected, match="sent a hello, not a challenge"):
        events_of(b, encode(ha))
    assert b.peer is None
    assert [type(m) for m in sent(b)] == [Bye]


@pytest.mark.parametrize(
    "auth",
    [
        pytest.param(lambda a: ack_proof(SECRET, "b", b"another nonce"), id="replayed"),
        pytest.param(lambda a: ack_proof(b"wrong", "b", a.local.nonce), id="wrong_secret"),
        pytest.param(lambda a: None, id="missing"),
        pytest.param(lambda a: ack_proof(SECRET, "a", a.local.nonce), id="reflected"),
    ],
)
def test_hello_ack_without_a_fresh_proof_is_rejected(
    auth: Callable[[SessionProtocol], bytes | None],
) -> None:
    a2, _ = half_open(make_info("a", secret=SECRET), make_info("b", secret=SECRET))
    a2.registration_succeeded()
    a2.data_to_send()
    with pytest.raises(HandshakeRejected, match="authentication failed"):
        events_of(a2, encode(HelloAck(peer_id="b", epoch=a2.local.epoch, auth=auth(a2))))
    assert a2.state is State.CLOSED and not a2.ready
    assert sent(a2) == [Bye(code="handshake", reason="authentication failed")]


def test_hello_ack_with_a_fresh_proof_completes_the_handshake() -> None:
    a = SessionProtocol(make_info("a", secret=SECRET))
    a.start()
    hb = hello_for(make_info("b", secret=SECRET, dialer=True), to=a.local.nonce)
    events_of(a, encode(hb))
    a.registration_succeeded()
    (ack,) = sent(a)[2:]  # after our challenge and our hello
    assert ack == HelloAck(peer_id="a", epoch=hb.epoch, auth=ack_proof(SECRET, "a", hb.nonce))
    good = HelloAck(peer_id="b", epoch=a.local.epoch, auth=ack_proof(SECRET, "b", a.local.nonce))
    assert events_of(a, encode(good)) == [Ready()]


def test_failed_registration_sends_bye_and_no_ack() -> None:
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    pair.exchange()
    pair.register(b)
    pair.deliver(b)
    a.registration_failed("NIXL refused the metadata")
    reason = "registration failed: NIXL refused the metadata"
    assert a.state is State.CLOSED and a.close_reason == ("handshake", reason)
    assert sent(a) == [Bye(code="handshake", reason=reason)]  # no hello_ack
    pair.feed(b, encode(Bye(code="handshake", reason=reason)))
    assert pair.log[b] == [HelloReceived(hello_for(a.local)), ByeReceived("handshake", reason)]
    assert Ready() not in pair.log[a] + pair.log[b]


def test_second_hello_with_the_same_epoch_during_the_handshake_is_a_protocol_error() -> None:
    a, hb = half_open()
    assert_protocol_error(a, encode(hb), "second hello with the same epoch")


def test_second_hello_with_the_same_epoch_on_a_ready_session_is_a_protocol_error() -> None:
    pair = ready_pair()
    assert_protocol_error(pair.a, encode(hello_for(pair.b.local)), "same epoch")


def test_hello_with_a_new_epoch_restarts_the_session() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    out_req = pair.lookup([K1, K2], [True, True])  # a's request, pinned at b
    in_req = b.send_lookup([K3])
    pair.deliver(b)
    a.send_lookup_resp(in_req, [True], 0.0, 10.0)  # a's round for b, one pin
    assert a.pins_held() == 1
    # b crashes and comes back with a new epoch, on the same stream.
    b2 = SessionProtocol(make_info("b", epoch=b.local.epoch + 1))
    b2.start()
    a.data_to_send()
    (ev,) = events_of(a, b2.data_to_send())
    assert ev == HelloReceived(
        hello_for(b2.local), restarted=True, dropped_rounds=(in_req,), failed_requests=(out_req,)
    )
    assert a.state is State.HANDSHAKE and not a.ready
    assert a.open_requests() == [] and a.open_rounds() == [] and a.pins_held() == 0
    assert a.out_state(out_req) is None and a.in_state(in_req) is None
    assert sent(a) == [hello_for(a.local)]  # the new incarnation gets our hello
    # Requests wait for the new incarnation's ack; the old one's ids are not reused.
    req = a.send_lookup([K1])
    assert req > out_req
    assert a.data_to_send() == b""
    a.registration_succeeded()
    (ack,) = sent(a)
    assert ack == HelloAck(peer_id="a", epoch=b2.local.epoch)
    assert events_of(b2, encode(hello_for(a.local))) == [HelloReceived(hello_for(a.local))]
    assert b2.registration_succeeded() is None
    assert events_of(b2, encode(ack)) == [Ready()]
    ack_b2 = b2.data_to_send()
    assert events_of(a, ack_b2) == [Ready()]
    # The new incarnation counts its request ids from 1 again.
    assert sent(a) == [Lookup(req_id=req, keys=[K1])]
    assert events_of(a, encode(Lookup(req_id=1, keys=[K2]))) == [LookupRequested(1, [K2])]


def restart_of(a: SessionProtocol, b: SessionProtocol) -> SessionProtocol:
    """``a``'s next incarnation (a new epoch), through its handshake with ``b`` to ready
    on both sides; ``b`` sees the hello as a restart."""
    a2 = SessionProtocol(make_info(a.local.peer_id, epoch=a.local.epoch + 1))
    a2.start()
    b.data_to_send()
    (ev,) = events_of(b, a2.data_to_send())
    assert isinstance(ev, HelloReceived) and ev.restarted
    b.registration_succeeded()
    assert [type(e) for e in events_of(a2, b.data_to_send())] == [HelloReceived]
    assert a2.registration_succeeded() == Ready()
    assert events_of(b, a2.data_to_send()) == [Ready()]
    return a2


def test_the_old_incarnations_tombstones_do_not_answer_the_new_ones_fetches() -> None:
    """A restarted peer counts its request ids from 1 again: the ids of its old rounds
    whose leases ran out (a tombstone kept, or one dropped) are its new rounds' ids, and a
    fetch on those is written, not answered lease_expired."""
    cap = 2
    pair = ready_pair(make_info("a"), make_info("b", max_open_requests=cap))
    a, b = pair.a, pair.b
    old = []
    for t in range(cap + 1):
        old.append(pair.lookup([K1], [True], now=t, lease=0.5))
        assert b.expire(t + 0.5) == old[-1:]
    assert old == [1, 2, 3] and b.tombstones() == cap  # 1 dropped, 2 and 3 kept
    a2 = restart_of(a, b)  # a comes back
    new = [a2.send_lookup([K2]) for _ in range(cap)]
    assert new == old[:cap]
    assert events_of(b, a2.data_to_send()) == [LookupRequested(r, [K2]) for r in new]
    for r in new:
        b.send_lookup_resp(r, [True], 10.0, 10.0)
    assert events_of(a2, b.data_to_send()) == [LookupAnswered(r, [True]) for r in new]
    for slot, r in enumerate(new):
        a2.send_fetch(r, [K2], [slot])
    assert events_of(b, a2.data_to_send()) == [
        FetchRequested(r, [K2], [slot]) for slot, r in enumerate(new)
    ]


def test_a_restarted_peers_fetch_on_a_round_it_never_opened_is_a_protocol_error() -> None:
    """The old incarnation's dropped tombstones go with it: a new incarnation counts its
    ids from 1 again, so a fetch of the new one on a round it never looked up is its
    protocol error, not a round of the old one answered lease_expired (mutation review,
    2026-12-05: keeping the highest dropped id across the restart survived)."""
    cap = 2
    pair = ready_pair(make_info("a"), make_info("b", max_open_requests=cap))
    a, b = pair.a, pair.b
    for t in range(cap + 2):
        req = pair.lookup([K1], [True], now=t, lease=0.5)
        assert b.expire(t + 0.5) == [req]
    assert b.in_state(1) is None and b.in_state(2) is None  # 1 and 2 dropped
    restart_of(a, b)  # a comes back
    assert_protocol_error(b, encode(Fetch(req_id=2, keys=[K1], slots=[1])), "no open lookup")


def test_a_request_held_for_the_old_incarnations_ack_is_not_sent_to_the_new_one() -> None:
    """A lookup made before the peer's ack is held; the peer restarts instead of acking.
    The lookup fails with the old incarnation (``failed_requests``) and is never sent to
    the new one, which would answer a request we no longer track: its answer would be our
    protocol error and close the session."""
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    pair.exchange()
    pair.register(a)  # our ack is out; b's is not
    req = a.send_lookup([K1])
    assert [type(m) for m in sent(a)] == [HelloAck]  # the lookup waits for b's ack
    b2 = SessionProtocol(make_info("b", epoch=b.local.epoch + 1))
    b2.start()
    (ev,) = events_of(a, b2.data_to_send())
    assert isinstance(ev, HelloReceived) and ev.failed_requests == (req,)
    assert a.registration_succeeded() is None
    assert [type(m) for m in sent(a)] == [Hello, HelloAck]
    events_of(b2, encode(hello_for(a.local)))
    b2.registration_succeeded()
    assert events_of(a, b2.data_to_send()) == [Ready()]
    assert sent(a) == []  # nothing for the old incarnation
    assert a.open_requests() == []


def test_nothing_for_the_old_incarnation_goes_out_before_the_restarts_hello() -> None:
    """An answer queued for b's old incarnation, not sent yet when b's restart hello
    comes in: the restarted b must see our hello first (it refuses anything else), so
    the answer is dropped with the round it answered. Found by a review (2026-12-04)."""
    pair = ready_pair()
    a, b = pair.a, pair.b
    in_req = b.send_lookup([K3])
    pair.deliver(b)
    a.send_lookup_resp(in_req, [True], 0.0, 10.0)  # queued, not sent
    b2 = SessionProtocol(make_info("b", epoch=b.local.epoch + 1))
    b2.start()
    events_of(a, b2.data_to_send())
    assert sent(a) == [hello_for(a.local)]


def test_bytes_a_send_began_still_go_out_first_after_a_restart() -> None:
    """The other side of the test above: bytes :meth:`unsend` put back may be the tail of
    a frame half on the wire; dropping them would break the stream mid-frame."""
    pair = ready_pair()
    a, b = pair.a, pair.b
    in_req = b.send_lookup([K3])
    pair.deliver(b)
    a.send_lookup_resp(in_req, [True], 0.0, 10.0)
    data = a.data_to_send()
    a.unsend(data[5:])  # a send wrote 5 bytes, then was cancelled
    b2 = SessionProtocol(make_info("b", epoch=b.local.epoch + 1))
    b2.start()
    events_of(a, b2.data_to_send())
    assert a.data_to_send() == data[5:] + encode(hello_for(a.local))


def _two_answers_taken_to_send() -> tuple[SessionProtocol, SessionProtocol, bytes]:
    """a answered two lookups of b's (two frames of one size), and a send took both."""
    pair = ready_pair()
    a, b = pair.a, pair.b
    r1, r2 = b.send_lookup([K3]), b.send_lookup([K3])
    pair.deliver(b)
    a.send_lookup_resp(r1, [True], 0.0, 10.0)
    a.send_lookup_resp(r2, [True], 0.0, 10.0)
    return a, b, a.data_to_send()


def _restart(a: SessionProtocol, b: SessionProtocol) -> None:
    """b comes back with a new epoch on the same stream; a reads its hello."""
    b2 = SessionProtocol(make_info("b", epoch=b.local.epoch + 1))
    b2.start()
    events_of(a, b2.data_to_send())


def test_after_a_restart_only_the_begun_frame_goes_before_the_hello() -> None:
    """A flush joins every queued frame; when the socket takes part of them, the rest
    went back as one piece, the frames never begun with it, and a restart kept them all
    ahead of our new hello. Now only the rest of the begun frame stays (found by a
    review, 2026-12-04), also when a later send wrote none of that rest."""
    a, b, data = _two_answers_taken_to_send()
    first = len(data) // 2  # two frames of one size
    a.unsend(data[5:])  # a send wrote 5 bytes of the first frame
    again = a.data_to_send()
    assert again == data[5:]
    a.unsend(again)  # the next send wrote nothing: the first frame is still begun
    _restart(a, b)
    assert a.data_to_send() == data[5:first] + encode(hello_for(a.local))


def test_after_a_restart_frames_a_send_stopped_in_front_of_are_dropped() -> None:
    """The send wrote the first frame whole and stopped at the second: nothing is begun,
    so the second, an answer to the old incarnation, goes no more."""
    a, b, data = _two_answers_taken_to_send()
    a.unsend(data[len(data) // 2 :])
    _restart(a, b)
    assert a.data_to_send() == encode(hello_for(a.local))


def test_restart_with_another_peer_id_is_a_protocol_error() -> None:
    pair = ready_pair()
    c = hello_for(make_info("c"))
    assert_protocol_error(pair.a, encode(c), "changed its peer id")


@pytest.mark.parametrize("nonce", ["kept", "changed"])
def test_an_authenticated_restart_on_the_connection_keeps_its_nonce(nonce: str) -> None:
    """With a secret, each side's fresh nonce is bound to the connection: a peer that
    restarts on it (a new epoch) keeps the nonce our hello's proof and our ack were bound
    to. A restart hello with a nonce of its own, even one validly proven over ours, is
    the peer's protocol error; with the nonce kept it is a restart."""
    pair = ready_pair(make_info("a", secret=SECRET), make_info("b", secret=SECRET))
    b = pair.b.local
    fresh = b.nonce if nonce == "kept" else hashlib.sha256(b"another nonce").digest()[:16]
    restarted = attrs.evolve(b, epoch=b.epoch + 1, nonce=fresh)
    hello = hello_for(restarted, to=pair.a.local.nonce)
    if nonce == "kept":
        (ev,) = events_of(pair.a, encode(hello))
        assert isinstance(ev, HelloReceived) and ev.restarted
    else:
        assert_protocol_error(pair.a, encode(hello), "changed its nonce")


# --- requests -----------------------------------------------------------------------------


def test_lookup_fetch_transfer_done_round_trip() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = a.send_lookup([K1, K2, K3])
    assert a.out_state(req) is OutState.LOOKUP_SENT
    assert pair.deliver(a) == [LookupRequested(req, [K1, K2, K3])]
    assert b.in_state(req) is InState.ANSWERING and b.pins_held() == 0
    b.send_lookup_resp(req, [True, False, True], now=100.0, lease=5.0)
    assert b.in_state(req) is InState.PINNED and b.pins_held() == 2
    assert b.next_deadline() == 105.0
    assert pair.deliver(b) == [LookupAnswered(req, [True, False, True])]
    assert a.out_state(req) is OutState.OPEN
    a.send_fetch(req, [K1, K3], [3, 7])
    assert a.out_state(req) is OutState.FETCH_SENT
    assert pair.deliver(a) == [FetchRequested(req, [K1, K3], [3, 7])]
    assert b.in_state(req) is InState.WRITING and b.pins_held() == 2
    assert b.next_deadline() is None  # a writing round has no lease
    assert b.expire(1e9) == []
    b.send_transfer_done(req, [OK, int(Outcome.TRANSFER_FAILED)], [11, 22])
    assert b.open_rounds() == [] and b.pins_held() == 0
    assert a.open_requests() == [req]  # not terminal until the peer says so
    assert pair.deliver(b) == [TransferCompleted(req, [OK, 3], [11, 22])]
    assert a.open_requests() == [] and a.out_state(req) is None


def test_request_ids_are_strictly_increasing_and_never_reused() -> None:
    pair = ready_pair()
    ids = []
    for _ in range(3):
        req = pair.a.send_lookup([K1])
        pair.deliver(pair.a)
        pair.b.send_lookup_resp(req, [False], 0.0, 1.0)
        pair.deliver(pair.b)
        pair.a.send_fetch(req, [], [])
        pair.deliver(pair.a)
        ids.append(req)
    assert ids == sorted(set(ids))
    assert pair.a.send_lookup([K1]) > ids[-1]


def test_a_session_that_used_every_request_id_refuses_the_next_lookup_unchanged() -> None:
    """Request ids are u64 on the wire and only go up on a session (the peer refuses one
    not above the last), so U64_MAX is a session's last. The lookup after it raised an
    untyped ``OverflowError`` from the encoder with the request already counted open (an
    open-request slot gone per try): a typed refusal now, nothing changed, nothing sent."""
    pair = ready_pair()
    a = pair.a
    a._next_req_id = U64_MAX - 1  # as after 2**64 - 2 lookups
    assert a.request_ids_left == 2
    for want in (U64_MAX - 1, U64_MAX):  # the last two ids work as any other
        req = pair.lookup([K1], [True])
        assert req == want
        a.send_fetch(req, [], [])
        pair.deliver(a)
        assert a.open_requests() == [] and pair.b.open_rounds() == []
    assert a.request_ids_left == 0
    assert_refused(a, lambda: a.send_lookup([K1]), match="request ids")
    assert a.open_requests() == [] and a.state is State.READY


@pytest.mark.parametrize("second", [5, 3], ids=["reused", "smaller"])
def test_reused_or_smaller_request_id_from_the_peer_is_a_protocol_error(second: int) -> None:
    pair = ready_pair()
    a = pair.a
    assert events_of(a, encode(Lookup(req_id=5, keys=[K1]))) == [LookupRequested(5, [K1])]
    assert_protocol_error(a, encode(Lookup(req_id=second, keys=[K2])), f"{second} reused")


def test_request_ids_may_skip_but_not_go_back() -> None:
    pair = ready_pair()
    assert events_of(pair.a, encode(Lookup(req_id=7, keys=[K1])))
    assert events_of(pair.a, encode(Lookup(req_id=100, keys=[K1])))
    assert sorted(pair.a.open_rounds()) == [7, 100]


@pytest.mark.parametrize("hits", [[True], [True, True, True]], ids=["fewer", "more"])
def test_lookup_resp_with_the_wrong_hit_count_is_a_protocol_error(hits: list[bool]) -> None:
    """Fewer hits than keys, or more: a surplus True would count as a pinned hit the
    round does not hold (its fetch_hits must name one slot per hit), and the caller's
    hit flags would no longer line up with its keys."""
    pair = ready_pair()
    req = pair.a.send_lookup([K1, K2])
    pair.a.data_to_send()
    assert_protocol_error(pair.a, encode(LookupResp(req_id=req, hits=hits)), "hit count")


@pytest.mark.parametrize("stage", ["unknown", "open", "fetch_sent"])
def test_lookup_resp_not_awaited_is_a_protocol_error(stage: str) -> None:
    pair = ready_pair()
    req = 99
    if stage != "unknown":
        req = pair.lookup([K1], [True])
        if stage == "fetch_sent":
            pair.a.send_fetch(req, [K1], [0])
    pair.a.data_to_send()
    assert_protocol_error(pair.a, encode(LookupResp(req_id=req, hits=[True])), "not awaiting")


def test_empty_fetch_closes_the_round_and_ends_the_request() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = pair.lookup([K1, K2], [True, True])
    assert b.pins_held() == 2
    a.send_fetch(req, [], [])
    assert a.open_requests() == [] and a.out_state(req) is None  # terminal at once
    assert pair.deliver(a) == [RoundClosed(req)]
    assert b.open_rounds() == [] and b.pins_held() == 0
    assert b.data_to_send() == b""  # nothing is sent back
    assert_refused(a, lambda: a.send_abort(req), [req])


def test_empty_fetch_closes_an_expired_round_too() -> None:
    pair = ready_pair()
    req = pair.lookup([K1], [True], now=0.0, lease=1.0)
    assert pair.b.expire(1.0) == [req]
    pair.a.send_fetch(req, [], [])
    assert pair.deliver(pair.a) == []  # its pins went with the lease: nothing to release
    assert pair.b.open_rounds() == [] and pair.b.in_state(req) is None


def _pinned_at_a(hits: list[bool]) -> tuple[ConnectionPair, int]:
    """b looked a up: a holds the round (and its pins), b's request is OPEN."""
    pair = ready_pair()
    req = pair.b.send_lookup([K1, K2, K3][: len(hits)])
    pair.deliver(pair.b)
    pair.a.send_lookup_resp(req, hits, 0.0, 10.0)
    pair.deliver(pair.a)
    return pair, req


@pytest.mark.parametrize(
    ("fetch", "match"),
    [
        pytest.param(
            lambda r: Fetch(req_id=r, keys=[K1], slots=[NUM_BLOCKS]),
            "outside",
            id="slot_outside_region",
        ),
        pytest.param(
            lambda r: Fetch(req_id=r, keys=[K1], slots=[2**64 - 1]), "outside", id="huge_slot"
        ),
        pytest.param(
            lambda r: Fetch(req_id=r, keys=[K1, K2], slots=[4, 4]),
            "duplicate",
            id="duplicate_slots",
        ),
        pytest.param(
            lambda r: Fetch(req_id=r + 1, keys=[K1], slots=[0]),
            "no open lookup",
            id="without_lookup",
        ),
    ],
)
def test_bad_fetch_is_a_protocol_error(fetch: Callable[[int], Fetch], match: str) -> None:
    pair, req = _pinned_at_a([True, True])
    assert_protocol_error(pair.a, encode(fetch(req)), match)


@pytest.mark.parametrize("by_hits", [False, True], ids=["fetch", "fetch_hits"])
def test_a_fetchs_slots_are_bounded_by_the_fetching_peers_region_not_ours(by_hits: bool) -> None:
    """Regions of two sizes: b's fetch names slots of b's region, so a bounds them by b's
    size, not its own (mutation review, 2026-12-05: bounding them by a's own region
    survived, every other test giving both sides one size; a peer whose region is smaller
    than ours could then have a write land past its region's end, and one whose region is
    larger was closed for naming a slot of its own)."""
    small, large = NUM_BLOCKS // 2, NUM_BLOCKS * 2
    for b_blocks, slot in ((large, large - 1), (small, small)):
        pair = ready_pair(make_info("a"), make_info("b", num_blocks=b_blocks))
        a, b = pair.a, pair.b
        req = b.send_lookup([K1])
        pair.deliver(b)
        a.send_lookup_resp(req, [True], 0.0, 10.0)
        pair.deliver(a)
        msg: Fetch | FetchHits = (
            FetchHits(req_id=req, slots=[slot])
            if by_hits
            else Fetch(req_id=req, keys=[K1], slots=[slot])
        )
        if slot < b_blocks:  # past a's region, inside b's: written
            assert events_of(a, encode(msg)) == [
                FetchRequested(req, None if by_hits else [K1], [slot])
            ]
        else:  # inside a's region, past b's: refused
            assert_protocol_error(a, encode(msg), f"outside the peer's {b_blocks} blocks")


@pytest.mark.parametrize("by_hits", [False, True], ids=["fetch", "fetch_hits"])
@pytest.mark.parametrize("stage", ["answering", "writing", "closed_by_empty_fetch", "done"])
def test_fetch_outside_an_open_round_is_a_protocol_error(stage: str, by_hits: bool) -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = b.send_lookup([K1])
    pair.deliver(b)
    if stage != "answering":
        a.send_lookup_resp(req, [True], 0.0, 10.0)
        pair.deliver(a)
        if stage == "closed_by_empty_fetch":
            b.send_fetch(req, [], [])
            pair.deliver(b)
        else:
            if by_hits:
                b.send_fetch_hits(req, [0])
            else:
                b.send_fetch(req, [K1], [0])
            pair.deliver(b)
            if stage == "done":
                a.send_transfer_done(req, [OK])
                pair.deliver(a)
    a.data_to_send()
    late = FetchHits(req_id=req, slots=[1]) if by_hits else Fetch(req_id=req, keys=[K1], slots=[1])
    assert_protocol_error(a, encode(late), "no open lookup")


# --- fetch_hits (protocol 1.2): a fetch of every hit of a round, by the round ------------


def _pair_with_b_at_minor(minor: int, monkeypatch: pytest.MonkeyPatch) -> ConnectionPair:
    """A ready pair whose ``b`` sent the hello of a peer speaking protocol 1.``minor``."""
    from p2pkv.session import protocol

    pair = ConnectionPair()
    pair.a.start()
    with monkeypatch.context() as m:
        m.setattr(protocol, "PROTOCOL_MINOR", minor)
        pair.b.start()
    pair.exchange()
    pair.register(pair.a)
    pair.register(pair.b)
    pair.exchange()
    assert pair.a.state is State.READY and pair.b.state is State.READY
    return pair


def test_fetch_hits_round_trip() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    assert a.peer_takes_fetch_hits and b.peer_takes_fetch_hits
    req = pair.lookup([K1, K2, K3], [True, False, True])
    a.send_fetch_hits(req, [3, 7])
    assert a.out_state(req) is OutState.FETCH_SENT
    wire = a.data_to_send()
    assert decode_frames(wire) == [FetchHits(req_id=req, slots=[3, 7])]
    assert pair.feed(b, wire) == [FetchRequested(req, None, [3, 7])]
    assert b.in_state(req) is InState.WRITING and b.pins_held() == 2
    b.send_transfer_done(req, [OK, int(Outcome.NOT_PINNED)])
    assert pair.deliver(b) == [TransferCompleted(req, [OK, int(Outcome.NOT_PINNED)], None)]
    assert a.open_requests() == [] and b.open_rounds() == []


def test_fetch_hits_after_the_pins_were_released_still_counts_the_answers_hits() -> None:
    """The host took the round's pins back (``pins_released``): the fetch still names one
    slot per hit of the answer, and the driver finds none of them pinned."""
    pair = ready_pair()
    req = pair.lookup([K1, K2], [True, True])
    pair.b.pins_released(req)
    assert pair.b.pins_held() == 0
    pair.a.send_fetch_hits(req, [0, 1])
    assert pair.deliver(pair.a) == [FetchRequested(req, None, [0, 1])]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda a, r: a.send_fetch_hits(r, [0]), "1 slots for a round of 2", id="few"),
        pytest.param(
            lambda a, r: a.send_fetch_hits(r, [0, 1, 2]), "3 slots for a round of 2", id="many"
        ),
        pytest.param(lambda a, r: a.send_fetch_hits(r, []), "0 slots", id="none"),
        pytest.param(lambda a, r: a.send_fetch_hits(r, [0, NUM_BLOCKS]), "outside", id="outside"),
        pytest.param(lambda a, r: a.send_fetch_hits(r, [0, True]), "outside", id="bool_slot"),
        pytest.param(lambda a, r: a.send_fetch_hits(r, [4, 4]), "duplicate", id="duplicate"),
        pytest.param(lambda a, r: a.send_fetch_hits(r + 1, [0, 1]), "request", id="unknown"),
    ],
)
def test_send_fetch_hits_refuses_what_the_peer_would_close_the_session_for(
    call: Callable[[SessionProtocol, int], None], match: str
) -> None:
    pair = ready_pair()
    req = pair.lookup([K1, K2, K3], [True, True, False])
    assert_refused(pair.a, lambda: call(pair.a, req), [req], match=match)
    assert pair.a.out_state(req) is OutState.OPEN  # the round may still be fetched


def test_send_fetch_hits_is_refused_once_the_round_is_fetched() -> None:
    pair = ready_pair()
    req = pair.lookup([K1], [True])
    pair.a.send_fetch_hits(req, [0])
    assert_refused(pair.a, lambda: pair.a.send_fetch_hits(req, [1]), [req], match="request")


def test_a_1_1_peer_is_sent_no_fetch_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = _pair_with_b_at_minor(1, monkeypatch)
    assert not pair.a.peer_takes_fetch_hits
    req = pair.lookup([K1], [True])
    assert_refused(pair.a, lambda: pair.a.send_fetch_hits(req, [0]), [req], match="does not take")
    pair.a.send_fetch(req, [K1], [0])  # the keys are named instead, as before
    assert pair.deliver(pair.a) == [FetchRequested(req, [K1], [0])]


@pytest.mark.parametrize(
    ("fetch", "match"),
    [
        pytest.param(
            lambda r: FetchHits(req_id=r, slots=[0]), "1 slots for a round of 2", id="few"
        ),
        pytest.param(
            lambda r: FetchHits(req_id=r, slots=[0, 1, 2]), "3 slots for a round of 2", id="many"
        ),
        pytest.param(lambda r: FetchHits(req_id=r, slots=[]), "0 slots", id="none"),
        pytest.param(lambda r: FetchHits(req_id=r, slots=[0, NUM_BLOCKS]), "outside", id="outside"),
        pytest.param(lambda r: FetchHits(req_id=r, slots=[4, 4]), "duplicate", id="duplicate"),
        pytest.param(
            lambda r: FetchHits(req_id=r + 1, slots=[0, 1]), "no open lookup", id="no_lookup"
        ),
    ],
)
def test_bad_fetch_hits_is_a_protocol_error(fetch: Callable[[int], FetchHits], match: str) -> None:
    pair, req = _pinned_at_a([True, False, True])
    assert_protocol_error(pair.a, encode(fetch(req)), match)


@pytest.mark.parametrize("expired", [False, True])
def test_fetch_hits_over_the_key_limit_is_a_protocol_error(expired: bool) -> None:
    """Checked first, so an expired round (whose hit count went with it) is bounded too."""
    pair = ready_pair(make_info("a", max_keys_per_request=8))
    req = pair.b.send_lookup([K1, K2])
    pair.deliver(pair.b)
    pair.a.send_lookup_resp(req, [True, True], 0.0, 10.0)
    pair.deliver(pair.a)
    if expired:
        assert pair.a.expire(1e9) == [req]
    over = 9
    fetch = FetchHits(req_id=req, slots=list(range(over)))
    assert_protocol_error(pair.a, encode(fetch), f"{over} slots in one request")


def test_fetch_hits_on_an_expired_round_is_answered_lease_expired_per_slot() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = pair.lookup([K1, K2, K3], [True, True, False], now=0.0, lease=1.0)
    assert b.expire(1.0) == [req]
    a.send_fetch_hits(req, [5, 6])
    assert pair.deliver(a) == []  # answered by the protocol: nothing for the driver
    assert b.in_state(req) is None and b.tombstones() == 0
    lease_expired = int(Outcome.LEASE_EXPIRED)
    assert pair.deliver(b) == [TransferCompleted(req, [lease_expired] * 2, None)]


def test_lease_expiry_releases_pins_and_the_protocol_answers_a_later_fetch() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    r1 = pair.lookup([K1, K2], [True, True], now=10.0, lease=5.0)
    r2 = pair.lookup([K3], [True], now=12.0, lease=5.0)
    assert b.pins_held() == 3 and b.next_deadline() == 15.0
    assert b.expire(14.999) == []
    assert b.pins_held() == 3
    assert b.expire(15.0) == [r1]  # the deadline itself is expired
    assert b.in_state(r1) is InState.EXPIRED and b.pins_held() == 1
    assert b.next_deadline() == 17.0
    assert b.expire(16.0) == []  # not twice
    # Only a tombstone is left: the round is no longer open and holds nothing.
    assert b.open_rounds() == [r2] and b.tombstones() == 1 and b.keys_held() == 1
    a.send_fetch(r1, [K1, K2], [0, 1])
    assert pair.deliver(a) == []  # answered by the protocol: nothing for the driver
    assert b.in_state(r1) is None and b.tombstones() == 0
    lease_expired = int(Outcome.LEASE_EXPIRED)
    assert pair.deliver(b) == [TransferCompleted(r1, [lease_expired] * 2, None)]
    assert a.open_requests() == [r2]
    assert b.expire(100.0) == [r2] and b.pins_held() == 0


def test_tombstones_are_bounded_and_a_dropped_one_still_answers_lease_expired() -> None:
    cap = 3
    pair = ready_pair(make_info("a"), make_info("b", max_open_requests=cap))
    a, b = pair.a, pair.b
    reqs = [pair.lookup([K1, K2], [True, False], now=0.0, lease=1.0) for _ in range(cap)]
    assert b.expire(1.0) == reqs
    more = [pair.lookup([K1, K2], [True, False], now=1.0, lease=1.0) for _ in range(cap)]
    assert b.expire(2.0) == more  # expired rounds do not count as open
    assert b.tombstones() == cap and b.open_rounds() == [] and b.keys_held() == 0
    assert [b.in_state(r) for r in reqs] == [None] * cap  # the oldest were dropped
    assert [b.in_state(r) for r in more] == [InState.EXPIRED] * cap
    lease_expired = int(Outcome.LEASE_EXPIRED)
    for req in (reqs[0], more[-1]):  # a dropped tombstone and a kept one
        a.send_fetch(req, [K1], [0])
        assert pair.deliver(a) == []
        assert pair.deliver(b) == [TransferCompleted(req, [lease_expired], None)]
    a.send_fetch(reqs[1], [], [])  # an empty fetch closes it, nothing comes back
    a.send_abort(more[0])
    assert pair.deliver(a) == []
    assert pair.deliver(b) == [AbortAcknowledged(more[0])]
    assert b.tombstones() == cap - 2
    # A fetch for a round that never was is still the peer's protocol error.
    assert_protocol_error(b, encode(Fetch(req_id=99, keys=[K1], slots=[1])), "no open lookup")


def test_a_fetch_on_the_highest_dropped_tombstone_is_answered_lease_expired() -> None:
    """A fetch on the newest dropped tombstone is still answered ``lease_expired``, not
    taken as a protocol error: the boundary of the dropped range is inclusive, so a slow
    consumer is never cut off."""
    cap = 3
    pair = ready_pair(make_info("a"), make_info("b", max_open_requests=cap))
    a, b = pair.a, pair.b
    reqs = [pair.lookup([K1], [True], now=0.0, lease=1.0) for _ in range(cap)]
    assert b.expire(1.0) == reqs
    more = [pair.lookup([K1], [True], now=1.0, lease=1.0) for _ in range(cap)]
    assert b.expire(2.0) == more  # every one of reqs is dropped; reqs[-1] the highest
    a.send_fetch(reqs[-1], [K1], [0])
    assert pair.deliver(a) == []
    lease_expired = int(Outcome.LEASE_EXPIRED)
    assert pair.deliver(b) == [TransferCompleted(reqs[-1], [lease_expired], None)]


def test_a_round_still_open_is_written_after_later_rounds_tombstones_were_dropped() -> None:
    """A round answered late (the host pinned slowly) or leased long may still be open
    when rounds after it expire and their tombstones are dropped: its id is then below
    the highest dropped one, yet a fetch on it is written, not answered lease_expired
    (which would leave its pins held with nobody to fetch them)."""
    cap = 2
    pair = ready_pair(make_info("a"), make_info("b", max_open_requests=cap))
    a, b = pair.a, pair.b
    slow = a.send_lookup([K1, K2])
    pair.deliver(a)  # b: ANSWERING, its host still pinning
    later = []
    for t in range(cap + 1):  # one at a time: the slow round holds an open slot
        later.append(pair.lookup([K3], [True], now=t, lease=0.5))
        assert b.expire(t + 0.5) == later[-1:]
    # cap + 1 tombstones: the oldest was dropped, and its id is above the slow round's
    assert b.tombstones() == cap and b.in_state(later[0]) is None
    b.send_lookup_resp(slow, [True, True], cap + 1.0, 10.0)
    pair.deliver(b)
    a.send_fetch(slow, [K1, K2], [0, 1])
    assert pair.deliver(a) == [FetchRequested(slow, [K1, K2], [0, 1])]
    assert b.in_state(slow) is InState.WRITING
    b.send_transfer_done(slow, [OK, OK])
    assert pair.deliver(b) == [TransferCompleted(slow, [OK, OK], None)]
    assert b.open_rounds() == [] and b.pins_held() == 0


def test_tombstones_dropped_out_of_id_order_still_answer_lease_expired() -> None:
    """Leases end in the order rounds were answered, not in id order: a round leased long
    outlives later ones, so its tombstone is dropped after theirs. The highest dropped id
    must stay the highest (mutation review, 2026-12-05: keeping the id of the last
    tombstone dropped instead lowered it, and a slow consumer's fetch on a round dropped
    before was taken for a protocol error and closed the session)."""
    cap = 2
    pair = ready_pair(make_info("a"), make_info("b", max_open_requests=cap))
    a, b = pair.a, pair.b
    slow = pair.lookup([K1], [True], now=0.0, lease=10.0)
    r2 = pair.lookup([K1], [True], now=0.0, lease=1.0)
    assert b.expire(1.0) == [r2]
    r3 = pair.lookup([K1], [True], now=1.0, lease=1.0)
    assert b.expire(2.0) == [r3]
    assert b.expire(10.0) == [slow]  # tombstones 2, 3, 1: 2 is dropped
    r4 = pair.lookup([K1], [True], now=10.0, lease=1.0)
    assert b.expire(11.0) == [r4]  # 3, 1, 4: 3 is dropped
    r5 = pair.lookup([K1], [True], now=11.0, lease=1.0)
    assert b.expire(12.0) == [r5]  # 1, 4, 5: 1 is dropped, below 3
    assert b.tombstones() == cap
    assert [b.in_state(r) for r in (r2, r3, slow)] == [None] * 3
    lease_expired = int(Outcome.LEASE_EXPIRED)
    for req in (r2, r3, slow):
        a.send_fetch(req, [K1], [0])
        assert pair.deliver(a) == []
        assert pair.deliver(b) == [TransferCompleted(req, [lease_expired], None)]
    assert b.state is State.READY


def test_keys_held_counts_answering_keys_then_pins_then_the_fetch() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = a.send_lookup([K1, K2, K3])
    pair.deliver(a)
    assert b.keys_held() == 3  # the driver holds the lookup's keys until it answers
    b.send_lookup_resp(req, [True, False, False], now=0.0, lease=5.0)
    assert b.keys_held() == 1  # then only the pinned hit
    pair.deliver(b)
    a.send_fetch(req, [K1, K2], [0, 1])
    pair.deliver(a)
    assert b.keys_held() == 3  # the pin and the fetch's two keys
    b.send_transfer_done(req, [OK, int(Outcome.NOT_PINNED)])
    assert b.keys_held() == 0


def test_expire_leaves_unanswered_and_writing_rounds_alone() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    writing = pair.lookup([K1], [True], now=0.0, lease=1.0)
    a.send_fetch(writing, [K1], [0])
    pair.deliver(a)
    answering = a.send_lookup([K2])
    pair.deliver(a)
    assert b.expire(1e9) == []
    assert b.in_state(writing) is InState.WRITING and b.in_state(answering) is InState.ANSWERING
    assert b.pins_held() == 1


# --- aborts -------------------------------------------------------------------------------


# (An expired round is acked by the protocol at once: see the tombstone test above.)
@pytest.mark.parametrize("stage", ["held", "lookup_sent", "open", "fetch_sent"])
def test_abort_in_every_consumer_state_ends_with_the_abort_ack(stage: str) -> None:
    if stage == "held":
        pair = ConnectionPair()
        pair.a.start()
        pair.b.start()
        pair.exchange()
        req = pair.a.send_lookup([K1])
        pair.a.send_abort(req)
        pair.register(pair.a)
        pair.register(pair.b)
        pair.exchange()  # both held messages go out after b's ack; b acks the abort
        assert pair.log[pair.b][-2:] == [LookupRequested(req, [K1]), AbortRequested(req)]
    else:
        pair = ready_pair()
        req = pair.a.send_lookup([K1, K2])
        if stage == "lookup_sent":
            pair.deliver(pair.a)
        else:
            pair.deliver(pair.a)
            pair.b.send_lookup_resp(req, [True, True], 0.0, 10.0)
            pair.deliver(pair.b)
            if stage == "fetch_sent":
                pair.a.send_fetch(req, [K1, K2], [0, 1])
                pair.deliver(pair.a)
        before = pair.a.out_state(req)
        assert before is not None
        pair.a.send_abort(req)
        assert pair.a.out_state(req) is OutState.ABORT_SENT
        assert pair.deliver(pair.a) == [AbortRequested(req)]
    a, b = pair.a, pair.b
    pins = {"held": 0, "lookup_sent": 0, "open": 2, "fetch_sent": 2}[stage]
    assert b.in_state(req) is InState.ABORTING
    assert b.pins_held() == pins  # held until the writes are drained and the ack is sent
    # While aborting the round takes nothing but the abort_ack.
    assert_refused(b, lambda: b.send_lookup_resp(req, [True, True], 0.0, 1.0), [req])
    assert_refused(b, lambda: b.send_transfer_done(req, [OK, OK]), [req])
    assert b.expire(1e9) == []
    # A duplicate abort from the peer is harmless.
    assert events_of(b, encode(Abort(req_id=req))) == []
    b.send_abort_ack(req)
    assert b.open_rounds() == [] and b.pins_held() == 0
    assert pair.deliver(b) == [AbortAcknowledged(req)]
    assert a.open_requests() == [] and a.out_state(req) is None
    terminal = [e for e in pair.log[a] if isinstance(e, TransferCompleted | AbortAcknowledged)]
    assert terminal == [AbortAcknowledged(req)]


def test_lookup_resp_crossing_an_abort_is_swallowed() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = a.send_lookup([K1])
    pair.deliver(a)
    b.send_lookup_resp(req, [True], 0.0, 10.0)  # in flight ...
    a.send_abort(req)  # ... while a gives up
    assert pair.deliver(b) == []  # no LookupAnswered for an aborted request
    assert a.out_state(req) is OutState.ABORT_SENT
    assert pair.deliver(a) == [AbortRequested(req)]
    b.send_abort_ack(req)
    assert pair.deliver(b) == [AbortAcknowledged(req)]
    assert b.pins_held() == 0 and a.open_requests() == []


def test_transfer_done_crossing_an_abort_is_swallowed_and_the_ack_is_terminal() -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    req = pair.lookup([K1], [True])
    a.send_fetch(req, [K1], [5])
    pair.deliver(a)
    b.send_transfer_done(req, [OK])  # finished and released ...
    a.send_abort(req)  # ... while a gives up
    assert pair.deliver(b) == []  # the transfer_done is swallowed
    assert pair.deliver(a) == []  # the round is gone: b acks at once, no event
    data = b.data_to_send()
    assert decode_frames(data) == [AbortAck(req_id=req)]
    assert pair.feed(a, data) == [AbortAcknowledged(req)]
    assert [e for e in pair.log[a] if isinstance(e, TransferCompleted)] == []
    assert a.open_requests() == [] and b.open_rounds() == []


@pytest.mark.parametrize("reply", ["lookup_resp", "transfer_done"])
def test_only_the_reply_in_flight_at_the_abort_is_swallowed(reply: str) -> None:
    pair = ready_pair()
    a = pair.a
    if reply == "lookup_resp":  # aborted while LOOKUP_SENT: one lookup_resp, not two
        req = a.send_lookup([K1])
        pair.deliver(a)
        a.send_abort(req)
        a.data_to_send()
        msg: Message = LookupResp(req_id=req, hits=[True])
        assert events_of(a, encode(msg)) == []
    else:  # aborted while OPEN: no fetch was sent, so no transfer_done can be due
        req = pair.lookup([K1], [True])
        a.send_abort(req)
        a.data_to_send()
        msg = TransferDone(req_id=req, outcomes=[])
    assert_protocol_error(a, encode(msg), "not awaiting|not fetching")


@pytest.mark.parametrize("reply", ["lookup_resp", "transfer_done"])
def test_a_second_reply_crossing_an_abort_is_a_protocol_error(reply: str) -> None:
    """The one reply in flight when we aborted is swallowed; a peer that sends it again
    (a replay, or a bug) has broken the protocol, and is told so, rather than having a
    second answer swallowed as well."""
    pair = ready_pair()
    a = pair.a
    msg: Message
    if reply == "lookup_resp":
        req = a.send_lookup([K1])
        msg = LookupResp(req_id=req, hits=[True])
    else:
        req = pair.lookup([K1], [True])
        a.send_fetch(req, [K1], [5])
        msg = TransferDone(req_id=req, outcomes=[OK])
    pair.deliver(a)
    a.send_abort(req)
    a.data_to_send()
    assert events_of(a, encode(msg)) == []  # the one in flight: swallowed
    assert a.out_state(req) is OutState.ABORT_SENT
    assert_protocol_error(a, encode(msg), "not awaiting|not fetching")


def test_abort_of_a_finished_request_is_acked_at_once() -> None:
    pair, req = _pinned_at_a([True])
    a, b = pair.a, pair.b
    b.send_fetch(req, [], [])
    pair.deliver(b)
    assert a.open_rounds() == []
    assert events_of(a, encode(Abort(req_id=req))) == []  # e.g. crossed a transfer_done
    assert sent(a) == [AbortAck(req_id=req)]


def test_abort_for_a_never_seen_request_is_a_protocol_error() -> None:
    pair = ready_pair()
    assert_protocol_error(pair.a, encode(Abort(req_id=1)), "abort for unknown request")


@pytest.mark.parametrize("stage", ["unknown", "lookup_sent", "open", "fetch_sent"])
def test_abort_ack_for_a_request_not_aborting_is_a_protocol_error(stage: str) -> None:
    pair = ready_pair()
    req = 42
    if stage == "lookup_sent":
        req = pair.a.send_lookup([K1])
    elif stage != "unknown":
        req = pair.lookup([K1], [True])
        if stage == "fetch_sent":
            pair.a.send_fetch(req, [K1], [0])
    pair.a.data_to_send()
    assert_protocol_error(pair.a, encode(AbortAck(req_id=req)), "not aborting")


@pytest.mark.parametrize(
    "stage", ["unknown", "lookup_sent", "open", "done", "wrong_count", "surplus_count"]
)
def test_transfer_done_out_of_place_is_a_protocol_error(stage: str) -> None:
    pair = ready_pair()
    a = pair.a
    req, outcomes, match = 42, [OK], "not fetching"
    if stage == "lookup_sent":
        req = a.send_lookup([K1])
    elif stage != "unknown":
        req = pair.lookup([K1, K2], [True, True])
        if stage in ("done", "wrong_count", "surplus_count"):
            a.send_fetch(req, [K1, K2], [0, 1])
            pair.deliver(a)
            if stage == "done":
                pair.b.send_transfer_done(req, [OK, OK])
                pair.deliver(pair.b)
            else:
                match = "outcome count"
                if stage == "surplus_count":  # more outcomes than keys fetched, not fewer
                    outcomes = [OK, OK, OK]
    a.data_to_send()
    assert_protocol_error(a, encode(TransferDone(req_id=req, outcomes=outcomes)), match)


# --- liveness and closing -----------------------------------------------------------------


def test_ping_is_answered_with_a_pong_automatically() -> None:
    pair = ready_pair()
    n1 = pair.a.send_ping()
    n2 = pair.a.send_ping()
    assert n2 > n1
    assert pair.deliver(pair.a) == []  # nothing for the host to do
    data = pair.b.data_to_send()
    assert decode_frames(data) == [Pong(nonce=n1), Pong(nonce=n2)]
    assert pair.feed(pair.a, data) == [PongReceived(n1), PongReceived(n2)]


def test_ping_nonces_wrap_past_u64_max() -> None:
    """A ping's nonce is u64 on the wire and only echoed back, never ordered: past
    U64_MAX it wraps to 1. It went on counting, and the keepalive's next ping raised a
    bare ``ValueError`` from the message's validator (the keepalive task died of it)."""
    pair = ready_pair()
    pair.a._ping_nonce = U64_MAX - 1  # as after 2**64 - 2 pings
    nonces = [pair.a.send_ping() for _ in range(3)]
    assert nonces == [U64_MAX, 1, 2]
    assert pair.deliver(pair.a) == []
    assert pair.deliver(pair.b) == [PongReceived(n) for n in nonces]


def half_acked() -> tuple[ConnectionPair, SessionProtocol, SessionProtocol]:
    """a registered fast, b slowly: b has a's ack and may ping, but a has not got b's ack
    yet. The pair and its two sides."""
    pair = ConnectionPair()
    a, b = pair.a, pair.b
    a.start()
    b.start()
    pair.exchange()
    pair.register(a)
    pair.deliver(a)
    return pair, a, b


def test_pong_waits_for_the_peers_ack() -> None:
    pair, a, b = half_acked()
    nonce = b.send_ping()
    data = b.data_to_send()
    assert decode_frames(data) == [Ping(nonce=nonce)]  # b has a's ack: the ping may go
    assert pair.feed(a, data) == []
    assert a.data_to_send() == b""  # a pong now would reach b before b's own ack
    assert pair.register(b) == Ready()
    assert pair.deliver(b) == [Ready()]
    assert pair.deliver(a) == [PongReceived(nonce)]


def test_a_peer_pinging_before_its_ack_gets_only_its_latest_pong_held() -> None:
    """A peer that pings without acking gets nothing else back, so nothing but this rule
    bounds what it makes us hold: one pong, the latest, sent once its ack is in."""
    pair, a, b = half_acked()
    nonces = [b.send_ping() for _ in range(5)]
    assert pair.deliver(b) == []
    assert a.data_to_send() == b""
    assert pair.register(b) == Ready()
    assert pair.deliver(b) == [Ready()]
    assert decode_frames(a.data_to_send()) == [Pong(nonce=nonces[-1])]


@pytest.mark.parametrize("closer", ["a", "b"])
def test_bye_closes_both_sides_and_releases_everything(closer: str) -> None:
    pair = ready_pair()
    a, b = pair.a, pair.b
    pair.lookup([K1, K2], [True, True])  # a -> b, pinned at b
    rb = b.send_lookup([K3])
    pair.deliver(b)
    a.send_lookup_resp(rb, [True], 0.0, 10.0)  # b -> a, pinned at a
    pair.deliver(a)
    p = a if closer == "a" else b
    q = pair.other(p)
    p.send_bye("shutdown", "node closing")
    assert p.state is State.CLOSED and not p.ready
    assert p.close_reason == ("shutdown", "node closing")
    assert p.open_requests() == [] and p.open_rounds() == [] and p.pins_held() == 0
    data = p.data_to_send()
    assert decode_frames(data) == [Bye(code="shutdown", reason="node closing")]
    p.send_bye("shutdown", "twice")  # idempotent: no second bye
    assert p.data_to_send() == b""
    assert pair.feed(q, data) == [ByeReceived("shutdown", "node closing")]
    assert q.state is State.CLOSED and q.close_reason == ("shutdown", "node closing")
    assert q.open_requests() == [] and q.open_rounds() == [] and q.pins_held() == 0
    q.send_bye("shutdown", "reply")  # a bye is not answered with a bye
    assert q.data_to_send() == b""
    assert events_of(q, encode(Ping(nonce=5))) == []  # later bytes are ignored
    assert q.expire(1e9) == []


def test_byes_crossing_close_both_sides_once() -> None:
    pair = ready_pair()
    pair.a.send_bye("shutdown", "a")
    pair.b.send_bye("shutdown", "b")
    assert pair.exchange() == ([], [])  # each is closed when the other's bye arrives
    assert pair.a.close_reason == ("shutdown", "a") and pair.b.close_reason == ("shutdown", "b")


def test_bye_during_the_handshake_closes_the_session() -> None:
    pair = ConnectionPair()
    pair.a.start()
    pair.b.start()
    req = pair.a.send_lookup([K1])
    pair.a.send_bye("shutdown", "changed my mind")
    assert sent_types(pair.a) == [Hello, Bye]  # the held lookup is dropped
    assert pair.a.out_state(req) is None
    assert events_of(
        pair.b,
        encode(hello_for(pair.a.local)) + encode(Bye(code="shutdown", reason="changed my mind")),
    ) == [HelloReceived(hello_for(pair.a.local)), ByeReceived("shutdown", "changed my mind")]


# --- caps and limits ----------------------------------------------------------------------


def test_local_cap_on_open_requests_raises_capacity_exceeded_and_changes_nothing() -> None:
    pair = ready_pair(make_info("a", max_open_requests=2))
    a = pair.a
    r1 = a.send_lookup([K1])
    a.send_lookup([K2])
    queued = a.data_to_send()
    before = snapshot(a, [r1, r1 + 1, r1 + 2])
    with pytest.raises(CapacityExceeded):
        a.send_lookup([K3])
    assert snapshot(a, [r1, r1 + 1, r1 + 2]) == before
    assert a.data_to_send() == b""
    # Room again once a request is terminal; the refused call used no id.
    pair.feed(pair.b, queued)
    pair.b.send_lookup_resp(r1, [False], 0.0, 1.0)
    pair.deliver(pair.b)
    a.send_fetch(r1, [], [])
    assert a.send_lookup([K3]) == r1 + 2


def test_peer_over_the_open_request_cap_is_a_protocol_error() -> None:
    pair = ready_pair(make_info("a", max_open_requests=2))
    a = pair.a
    events_of(a, encode(Lookup(req_id=1, keys=[K1])) + encode(Lookup(req_id=2, keys=[K1])))
    assert_protocol_error(a, encode(Lookup(req_id=3, keys=[K1])), "more than 2 open requests")


LIMITED = make_info("a", max_key_len=8, max_keys_per_request=2)


@pytest.mark.parametrize(
    ("keys", "match"),
    [([b"k" * 9], "key longer than 8"), ([K1, K2, K3], "3 keys in one request")],
    ids=["key_too_long", "too_many_keys"],
)
def test_lookup_over_the_key_limits_is_a_protocol_error(keys: list[bytes], match: str) -> None:
    pair = ready_pair(LIMITED)
    assert_protocol_error(pair.a, encode(Lookup(req_id=1, keys=keys)), match)


@pytest.mark.parametrize(
    ("keys", "match"),
    [([b"k" * 9], "key longer than 8"), ([K1, K2, K3], "3 keys in one request")],
    ids=["key_too_long", "too_many_keys"],
)
def test_fetch_over_the_key_limits_is_a_protocol_error(keys: list[bytes], match: str) -> None:
    pair = ready_pair(LIMITED)
    a = pair.a
    assert events_of(a, encode(Lookup(req_id=1, keys=[K1])))
    a.send_lookup_resp(1, [True], 0.0, 10.0)
    a.data_to_send()
    fetch = Fetch(req_id=1, keys=keys, slots=list(range(len(keys))))
    assert_protocol_error(a, encode(fetch), match)


def test_key_limits_admit_the_limit_itself() -> None:
    pair = ready_pair(LIMITED)
    keys = [b"k" * 8, b"j" * 8]
    assert events_of(pair.a, encode(Lookup(req_id=1, keys=keys))) == [LookupRequested(1, keys)]


def test_frame_over_the_local_frame_limit_is_a_protocol_error() -> None:
    pair = ready_pair(make_info("a", max_frame_size=400))  # room for a hello, not more
    big = Lookup(req_id=1, keys=[b"k" * 100] * 4)
    assert_protocol_error(pair.a, encode(big), "over the limit of 400")


def test_before_admission_no_frame_over_the_documented_1_mib_is_read() -> None:
    """The README promises that a connection not yet admitted holds at most a hello's
    frame, 1 MiB: a header announcing one byte more is refused before its body is read,
    whatever our own ``max_frame_size`` (mutation review, 2026-12-05: raising
    ``MAX_HELLO_FRAME`` survived, every test reading the limit from the constant)."""
    mib = 1 << 20
    a = SessionProtocol(make_info("a"))
    a.start()
    a.receive_data(struct.pack(">I", mib))  # at the limit: buffered, waiting for its body
    assert a.next_event() is None and a.state is State.HANDSHAKE
    b = SessionProtocol(make_info("a"))
    b.start()
    b.data_to_send()
    assert_protocol_error(b, struct.pack(">I", mib + 1), f"over the limit of {mib}")


def test_once_admitted_the_peer_is_held_to_our_frame_limit_not_the_protocols() -> None:
    """Admission lifts the stranger's hello-sized limit up to our own ``max_frame_size``
    (2 MiB here), never to the protocol's 64 MiB: a header announcing one byte more is
    refused before any of the body is buffered."""
    limit = 2 << 20
    pair = ready_pair(make_info("a", max_frame_size=limit))
    a = pair.a
    a.lift_frame_limit()
    a.receive_data(struct.pack(">I", limit))  # at the limit: buffered, waiting for its body
    assert a.next_event() is None and a.state is State.READY
    b = ready_pair(make_info("a", max_frame_size=limit)).a
    b.lift_frame_limit()
    assert_protocol_error(b, struct.pack(">I", limit + 1), f"over the limit of {limit}")


def test_undecodable_bytes_are_a_protocol_error_the_peer_hears_about() -> None:
    pair = ready_pair()
    exc = assert_protocol_error(pair.a, b"\x00\x00\x00\x01\xc1", "undecodable")
    assert exc.peer == "b"
    pair.feed(pair.b, encode(Bye(code="protocol", reason=str(exc))))
    assert pair.log[pair.b][-1] == ByeReceived("protocol", str(exc))
    assert pair.b.state is State.CLOSED


def test_invalid_lookup_keys_raise_before_anything_changes() -> None:
    pair = ready_pair()
    a = pair.a
    before = snapshot(a)
    with pytest.raises(LocalProtocolError):
        a.send_lookup([b""])
    assert snapshot(a) == before and a.data_to_send() == b""
    assert a.send_lookup([K1]) == 1  # the id was not consumed


@pytest.mark.parametrize(
    "bad",
    [b"", b"k" * 129, "k", bytearray(b"k")],
    ids=["empty", "over_the_key_limit", "str", "bytearray"],
)
@pytest.mark.parametrize("op", ["lookup", "fetch"])
def test_a_long_request_with_one_bad_key_is_refused_before_it_is_sent(op: str, bad: Any) -> None:
    """A request of at least wire._BULK keys is checked in C-level passes, not walked: one
    bad key among them (last, where a walk would come to it last) is still refused here.
    Were it sent, the peer would close the session for it."""
    n = 80
    pair = ready_pair(make_info("a", num_blocks=n))  # max_key_len 128 both sides
    a = pair.a
    good = [b"k%d" % i for i in range(n)]
    if op == "lookup":
        call: Callable[[], object] = functools.partial(a.send_lookup, [*good[:-1], bad])
    else:
        req = pair.lookup(good, [True] * n)
        call = functools.partial(a.send_fetch, req, [*good[:-1], bad], list(range(n)))
    assert_refused(a, call, match="every key must be bytes")


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("slots", [[0], [0, 1, 2]], ids=["fewer", "more"])
def test_a_fetch_whose_slots_do_not_match_its_keys_is_refused_before_it_is_sent(
    slots: list[int], checked: bool
) -> None:
    """``checked`` skips the walks, never the count: a fetch of two keys into one slot (or
    three) is a frame the peer refuses, and the session would close for it."""
    pair = ready_pair()
    req = pair.lookup([K1, K2], [True, True])
    call = functools.partial(pair.a.send_fetch, req, [K1, K2], slots, checked=checked)
    assert_refused(pair.a, call, [req], match="differ in length")
    pair.a.send_fetch(req, [K1, K2], [0, 1], checked=checked)  # the round is still open
    assert pair.deliver(pair.a) == [FetchRequested(req, [K1, K2], [0, 1])]


@pytest.mark.parametrize("over", ["keys", "key_len"])
def test_our_requests_keep_to_the_wire_limits_whatever_both_sides_configured(over: str) -> None:
    """Limits in ``LocalInfo`` (ours and the peer's advertised ones) above the wire's hard
    limits do not let a request past them: the peer's decoder would refuse the frame and
    close the session, so it is refused here and nothing is sent."""
    limits = {"max_keys_per_request": MAX_KEYS + 8, "max_key_len": MAX_KEY_LEN + 8}
    pair = ready_pair(make_info("a", **limits), make_info("b", **limits))
    assert pair.a.request_limits() == (MAX_KEYS + 8, MAX_KEY_LEN + 8)
    if over == "keys":
        keys, match = [b"%d" % i for i in range(MAX_KEYS + 1)], f"cap {MAX_KEYS}"
    else:
        keys, match = [b"k" * (MAX_KEY_LEN + 1)], f"1..{MAX_KEY_LEN}"
    assert_refused(pair.a, functools.partial(pair.a.send_lookup, keys), match=match)


# --- illegal local calls ------------------------------------------------------------------


def _answering_at_b(pair: ConnectionPair) -> int:
    """a's lookup is at b, unanswered (a: LOOKUP_SENT, b: ANSWERING)."""
    req = pair.a.send_lookup([K1, K2])
    pair.deliver(pair.a)
    return req


def _open_at_b(pair: ConnectionPair) -> int:
    """a's request answered by b (a: OPEN, b: PINNED with two pins)."""
    return pair.lookup([K1, K2], [True, True])


def _writing_at_b(pair: ConnectionPair) -> int:
    """a fetched both keys (a: FETCH_SENT, b: WRITING)."""
    req = _open_at_b(pair)
    pair.a.send_fetch(req, [K1, K2], [0, 1])
    pair.deliver(pair.a)
    return req


def _aborting_at_b(pair: ConnectionPair) -> int:
    """a aborted an answered request (a: ABORT_SENT, b: ABORTING)."""
    req = _open_at_b(pair)
    pair.a.send_abort(req)
    pair.deliver(pair.a)
    return req


def _expired_at_b(pair: ConnectionPair) -> int:
    """b's lease ran out (a: OPEN, b: EXPIRED)."""
    req = _open_at_b(pair)
    assert pair.b.expire(1e9) == [req]
    return req


REQ = object()  # stands for the request id the setup returned
Setup = Callable[[ConnectionPair], int] | None

ILLEGAL: list[tuple[str, Setup, str, str, tuple[object, ...]]] = [
    # (id, setup, side, method, args)
    ("send_fetch_unknown", None, "a", "send_fetch", (99, [K1], [0])),
    ("send_fetch_not_answered", _answering_at_b, "a", "send_fetch", (REQ, [K1], [0])),
    ("send_fetch_twice", _writing_at_b, "a", "send_fetch", (REQ, [K1], [2])),
    ("send_empty_fetch_while_fetching", _writing_at_b, "a", "send_fetch", (REQ, [], [])),
    ("send_fetch_after_abort", _aborting_at_b, "a", "send_fetch", (REQ, [K1], [0])),
    ("send_fetch_slot_outside_region", _open_at_b, "a", "send_fetch", (REQ, [K1], [NUM_BLOCKS])),
    ("send_fetch_negative_slot", _open_at_b, "a", "send_fetch", (REQ, [K1], [-1])),
    ("send_fetch_duplicate_slots", _open_at_b, "a", "send_fetch", (REQ, [K1, K2], [3, 3])),
    ("send_abort_unknown", None, "a", "send_abort", (7,)),
    ("send_abort_twice", _aborting_at_b, "a", "send_abort", (REQ,)),
    ("send_abort_of_a_peer_round", _answering_at_b, "b", "send_abort", (REQ,)),
    ("send_lookup_resp_unknown", None, "b", "send_lookup_resp", (5, [True], 0.0, 1.0)),
    ("send_lookup_resp_twice", _open_at_b, "b", "send_lookup_resp", (REQ, [True] * 2, 0.0, 1.0)),
    (
        "send_lookup_resp_too_few_hits",
        _answering_at_b,
        "b",
        "send_lookup_resp",
        (REQ, [True], 0.0, 1.0),
    ),
    (
        "send_lookup_resp_too_many_hits",
        _answering_at_b,
        "b",
        "send_lookup_resp",
        (REQ, [True] * 3, 0.0, 1.0),
    ),
    (
        "send_lookup_resp_while_writing",
        _writing_at_b,
        "b",
        "send_lookup_resp",
        (REQ, [True] * 2, 0.0, 1.0),
    ),
    (
        "send_lookup_resp_for_own_request",
        _answering_at_b,
        "a",
        "send_lookup_resp",
        (REQ, [True] * 2, 0.0, 1.0),
    ),
    (
        "send_lookup_resp_hits_not_bools",
        _answering_at_b,
        "b",
        "send_lookup_resp",
        (REQ, [1, 0], 0.0, 1.0),
    ),
    ("send_transfer_done_unknown", None, "b", "send_transfer_done", (3, [OK])),
    (
        "send_transfer_done_unknown_outcome_code",
        _writing_at_b,
        "b",
        "send_transfer_done",
        (REQ, [OK, 99]),
    ),
    (
        "send_transfer_done_bool_outcome",
        _writing_at_b,
        "b",
        "send_transfer_done",
        (REQ, [OK, True]),
    ),
    ("send_transfer_done_answering", _answering_at_b, "b", "send_transfer_done", (REQ, [OK] * 2)),
    ("send_transfer_done_pinned", _open_at_b, "b", "send_transfer_done", (REQ, [OK] * 2)),
    ("send_transfer_done_expired", _expired_at_b, "b", "send_transfer_done", (REQ, [OK] * 2)),
    ("send_transfer_done_aborting", _aborting_at_b, "b", "send_transfer_done", (REQ, [OK] * 2)),
    (
        "send_transfer_done_wrong_outcome_count",
        _writing_at_b,
        "b",
        "send_transfer_done",
        (REQ, [OK]),
    ),
    ("send_abort_ack_unknown", None, "b", "send_abort_ack", (9,)),
    ("send_abort_ack_answering", _answering_at_b, "b", "send_abort_ack", (REQ,)),
    ("send_abort_ack_pinned", _open_at_b, "b", "send_abort_ack", (REQ,)),
    ("send_abort_ack_writing", _writing_at_b, "b", "send_abort_ack", (REQ,)),
    ("registration_succeeded_when_ready", None, "a", "registration_succeeded", ()),
    ("registration_failed_when_ready", None, "a", "registration_failed", ("late",)),
    ("start_twice", None, "a", "start", ()),
]


@pytest.mark.parametrize(
    ("setup", "side", "method", "args"), [pytest.param(*c[1:], id=c[0]) for c in ILLEGAL]
)
def test_illegal_local_call_raises_and_changes_nothing(
    setup: Setup, side: str, method: str, args: tuple[object, ...]
) -> None:
    pair = ready_pair()
    req = setup(pair) if setup is not None else 0
    p = pair.a if side == "a" else pair.b
    args = tuple(req if x is REQ else x for x in args)
    ids = [req, *(x for x in args[:1] if type(x) is int)]
    queued = assert_refused(p, functools.partial(getattr(p, method), *args), ids)
    # Still usable: deliver what was queued before, then run a whole round.
    pair.feed(pair.other(p), queued)
    pair.exchange()
    assert pair.a.state is State.READY and pair.b.state is State.READY
    new = pair.a.send_lookup([K3])
    assert new > req
    pair.deliver(pair.a)
    pair.b.send_lookup_resp(new, [True], 0.0, 1.0)
    pair.deliver(pair.b)
    pair.a.send_fetch(new, [K3], [NUM_BLOCKS - 1])
    pair.deliver(pair.a)
    pair.b.send_transfer_done(new, [OK])
    assert pair.deliver(pair.b) == [TransferCompleted(new, [OK], None)]


def test_illegal_handshake_calls_raise_and_change_nothing() -> None:
    a = SessionProtocol(make_info("a"))
    assert_refused(a, a.registration_succeeded)  # no hello yet, not even started
    assert_refused(a, lambda: a.registration_failed("x"))
    a.start()
    assert_refused(a, a.start)
    assert_refused(a, a.registration_succeeded)  # started, but no pending hello
    hb = hello_for(make_info("b"))
    events_of(a, encode(hb))
    a.registration_succeeded()
    assert_refused(a, a.registration_succeeded)  # the hello is acked already
    assert_refused(a, lambda: a.registration_failed("x"))


def test_registration_cannot_be_acked_before_our_hello_is_sent() -> None:
    a = SessionProtocol(make_info("a"))
    hb = hello_for(make_info("b"))
    assert events_of(a, encode(hb)) == [HelloReceived(hb)]  # not started yet
    assert_refused(a, a.registration_succeeded)
    a.start()
    a.registration_succeeded()
    assert sent_types(a) == [Hello, HelloAck]


def _close_by_bye_sent(pair: ConnectionPair) -> None:
    pair.a.send_bye("shutdown", "done")


def _close_by_bye_received(pair: ConnectionPair) -> None:
    pair.feed(pair.a, encode(Bye(code="shutdown", reason="peer done")))


def _close_by_protocol_error(pair: ConnectionPair) -> None:
    with pytest.raises(RemoteProtocolError):
        pair.feed(pair.a, b"\x00\x00\x00\x00")


@pytest.mark.parametrize(
    "close",
    [_close_by_bye_sent, _close_by_bye_received, _close_by_protocol_error],
    ids=["bye_sent", "bye_received", "protocol_error"],
)
def test_every_call_after_close_raises_and_changes_nothing(
    close: Callable[[ConnectionPair], None],
) -> None:
    pair = ready_pair()
    a = pair.a
    out_req = pair.lookup([K1], [True])
    in_req = pair.b.send_lookup([K2])
    pair.deliver(pair.b)
    close(pair)
    assert a.state in (State.CLOSED, State.ERROR)
    ids = [out_req, in_req]
    for call in (
        a.start,
        lambda: a.send_lookup([K1]),
        lambda: a.send_fetch(out_req, [K1], [0]),
        lambda: a.send_fetch(out_req, [], []),
        lambda: a.send_abort(out_req),
        a.send_ping,
        lambda: a.send_lookup_resp(in_req, [True], 0.0, 1.0),
        lambda: a.send_transfer_done(in_req, [OK]),
        lambda: a.send_abort_ack(in_req),
        a.registration_succeeded,
        lambda: a.registration_failed("late"),
    ):
        assert_refused(a, call, ids)


def test_every_call_after_a_rejected_handshake_raises() -> None:
    a, _ = half_open(make_info("a", secret=SECRET), make_info("b", secret=SECRET))
    a.registration_succeeded()
    a.data_to_send()
    with pytest.raises(HandshakeRejected):
        events_of(a, encode(HelloAck(peer_id="b", epoch=a.local.epoch, auth=b"x" * 32)))
    assert a.state is State.CLOSED
    for call in (
        a.start,
        lambda: a.send_lookup([K1]),
        a.send_ping,
        a.registration_succeeded,
        lambda: a.registration_failed("late"),
    ):
        assert_refused(a, call)


def test_hello_proof_covers_every_field() -> None:
    """Tampering with any hello field (here the region layout and the metadata) breaks
    the HMAC, so an on-path attacker cannot redirect writes under a valid proof."""
    import attrs

    from p2pkv.session.protocol import hello_proof
    from p2pkv.wire import Hello

    h = Hello(
        version_major=1,
        version_minor=0,
        peer_id="a",
        epoch=1,
        agent_name="a",
        agent_metadata=b"meta",
        base_addr=4096,
        num_blocks=8,
        block_len=4096,
        fingerprint="",
        hash_algo="sha256",
        hash_seed=b"",
        nonce=b"n" * 16,
        max_keys_per_request=64,
        max_key_len=128,
    )
    mine = b"m" * 16
    proof = hello_proof(b"k", h, mine, dialer=True)
    for change in (
        {"base_addr": 8192},
        {"num_blocks": 9},
        {"agent_metadata": b"evil"},
        {"hash_seed": b"x"},
        {"version_minor": 1},
    ):
        assert hello_proof(b"k", attrs.evolve(h, **change), mine, dialer=True) != proof
    assert hello_proof(b"k", attrs.evolve(h, auth=b"anything"), mine, dialer=True) == proof
    # Bound to the receiver's nonce of this connection and to the sender's role.
    assert hello_proof(b"k", h, b"o" * 16, dialer=True) != proof
    assert hello_proof(b"k", h, mine, dialer=False) != proof


# --- the engine's checked answers --------------------------------------------------------


def _writing_at_b_with(pair: ConnectionPair, keys: list[bytes]) -> int:
    req = pair.lookup(keys, [True] * len(keys))
    pair.a.send_fetch(req, keys, list(range(len(keys))))
    pair.deliver(pair.a)
    return req


@pytest.mark.parametrize("checked", [False, True])
def test_checked_answers_put_the_same_frames_on_the_wire(checked: bool) -> None:
    """The producer's own hit lists and outcome lists skip the type walk (``checked``);
    the frames are byte for byte those of the checked-in-full path."""
    frames = []
    for skip in (False, checked):
        pair = ready_pair()
        req = pair.a.send_lookup([K1, K2, K3])
        pair.deliver(pair.a)
        pair.b.send_lookup_resp(req, [True, False, True], 0.0, 10.0, checked=skip)
        resp = pair.b.data_to_send()
        pair.feed(pair.a, resp)
        pair.a.send_fetch(req, [K1, K3], [0, 1])
        pair.deliver(pair.a)
        pair.b.send_transfer_done(req, [OK, int(Outcome.NOT_PINNED)], checked=skip)
        frames.append((resp, pair.b.data_to_send()))
    assert frames[0] == frames[1]


@pytest.mark.parametrize(
    ("call", "bad"),
    [
        ("lookup_resp", [True, 1]),  # an int is not a bool
        ("lookup_resp", [True]),  # one hit for two keys
        ("lookup_resp", (True, False, True)),  # not a list: walked in full, then too long
        ("transfer_done", [OK, True]),  # a bool is not a code
        ("transfer_done", [OK]),  # one outcome for two keys
        ("transfer_done", (OK, 99)),  # not a list: walked in full, 99 is no code
    ],
)
def test_checked_answers_still_refuse_what_the_wire_would_not_carry(
    call: str, bad: list[Any] | tuple[Any, ...]
) -> None:
    """``checked`` skips the type walk only for a list; the count is always checked, and
    anything that is not a list is walked in full. What the unchecked path refuses as a
    wrong count, the checked one refuses too; nothing is queued either way."""
    pair = ready_pair()
    if call == "lookup_resp":
        req = pair.a.send_lookup([K1, K2])
        pair.deliver(pair.a)
        before = snapshot(pair.b)
        send = functools.partial(pair.b.send_lookup_resp, req, bad, 0.0, 10.0)
    else:
        req = _writing_at_b_with(pair, [K1, K2])
        before = snapshot(pair.b)
        send = functools.partial(pair.b.send_transfer_done, req, bad)
    with pytest.raises(LocalProtocolError):
        send()
    miscounted = len(bad) != 2
    if miscounted or type(bad) is not list:
        with pytest.raises(LocalProtocolError):
            send(checked=True)
    assert snapshot(pair.b) == before and pair.b.data_to_send() == b""


def test_the_open_requests_limit_is_the_smaller_of_ours_and_the_peers_advertised() -> None:
    pair = ready_pair(make_info("a", max_open_requests=8), make_info("b", max_open_requests=3))
    assert pair.a.open_requests_limit() == 3
    assert pair.b.open_requests_limit() == 3
    lone = SessionProtocol(make_info("c", max_open_requests=5))
    assert lone.open_requests_limit() == 5  # no hello yet: our own


def drain(p: SessionProtocol, data: bytes, max_silent: int) -> tuple[list[Event], int]:
    """Feed ``data`` and take every event, as the session's reader does with its turn's
    ``max_silent``: going on while ``input_pending``. Also the number of stops."""
    p.receive_data(data)
    events: list[Event] = []
    stops = 0
    while True:
        ev = p.next_event(max_silent)
        if ev is not None:
            events.append(ev)
        elif p.input_pending:
            stops += 1
        else:
            return events, stops


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["ping", "lookup"]), max_size=60),
    max_silent=st.integers(min_value=0, max_value=5),
)
def test_bounded_draining_yields_every_event_in_order(kinds: list[str], max_silent: int) -> None:
    """The reader drains with ``max_silent`` (what is left of its turn): it must see the
    very events, in order, that an unbounded drain sees, however pings (no event) are
    mixed with lookups; and it stops once per ``max_silent`` pings in a row."""
    runs = []
    for bound in (0, max_silent):
        pair = ready_pair()
        src = pair.b
        frames: list[bytes] = []
        req = 0
        for kind in kinds:
            if kind == "ping":
                frames.append(encode(Ping(nonce=len(frames) + 1)))
            else:
                req += 1
                frames.append(encode(Lookup(req_id=req, keys=[b"k" * 32])))
        events, stops = drain(src, b"".join(frames), bound)
        # One stop per ``bound`` pings in a row (an event starts the count afresh).
        runs_of_pings = "".join("p" if k == "ping" else " " for k in kinds).split()
        assert stops == (sum(len(r) // bound for r in runs_of_pings) if bound else 0)
        runs.append([(type(e).__name__, getattr(e, "req_id", None)) for e in events])
    assert runs[0] == runs[1]


@settings(max_examples=100, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["resp", "lookup", "ping", "pong"]), min_size=1, max_size=12),
    max_silent=st.integers(0, 3),
)
def test_next_event_only_leaves_the_first_other_frame_undispatched(
    kinds: list[str], max_silent: int
) -> None:
    """``next_event(only=...)`` takes frames of the given types in order and stops at the
    first other one without acting on it (no round opened, no pong queued); the next call
    of any caller starts with that frame. Interleaving the two kinds of caller gives
    exactly the events, the state and the frame count that plain calls give (the answer
    lane and the reader)."""
    only = frozenset({LookupResp, Pong})
    results = []
    for mixed in (False, True):
        pair = ready_pair()
        a, b = pair.a, pair.b
        reqs = [a.send_lookup([b"k%d" % i]) for i in range(kinds.count("resp"))]
        b.receive_data(a.data_to_send())
        while b.next_event() is not None:
            pass
        frames = b""
        for kind in kinds:
            if kind == "resp":
                req = reqs.pop(0)
                b.send_lookup_resp(req, [True], 0.0, 100.0)
                frames += b.data_to_send()
            elif kind == "lookup":
                frames += encode(Lookup(req_id=1000 + len(frames), keys=[b"x"]))
            elif kind == "ping":
                frames += encode(Ping(nonce=len(frames)))
            else:
                frames += encode(Pong(nonce=len(frames)))
        base = a.frames_received
        a.receive_data(frames)
        events: list[Event] = []
        while True:
            if mixed:
                queued = a.bytes_to_send()
                ev = a.next_event(max_silent, only)
                assert ev is None or type(ev) in (LookupAnswered, PongReceived)
                assert a.bytes_to_send() == queued  # answers and pongs queue nothing
                if ev is None and a.input_pending:
                    left = a.unread
                    assert left is not None and type(left) not in only
                    if isinstance(left, Lookup):
                        assert a.in_state(left.req_id) is None  # not acted on
                    ev = a.next_event(max_silent)  # the other caller takes it, and on
            else:
                ev = a.next_event(max_silent)
            if ev is None:
                if a.input_pending:
                    continue  # max_silent frames in a row made no event: call again
                break
            events.append(ev)
        results.append((events, a.frames_received - base, snapshot(a), a.data_to_send()))
    assert results[0] == results[1]
    assert results[0][1] == len(kinds)  # each frame counted once
