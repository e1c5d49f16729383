"""The wire codec: round trips for every message, and a corpus of malformed frames.

Every malformed frame must become a typed ``RemoteProtocolError`` and poison the decoder;
nothing unvalidated may come out of it.
"""

from __future__ import annotations

import itertools
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv import wire
from p2pkv.errors import LocalProtocolError, P2PKVError, RemoteProtocolError
from p2pkv.wire import (
    MAX_FRAME_SIZE,
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_METADATA,
    MESSAGE_TYPES,
    U64_MAX,
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
    encode_all,
)

# --- strategies ---------------------------------------------------------------------------

u64 = st.integers(0, U64_MAX)
small_keys = st.lists(st.binary(min_size=1, max_size=48), max_size=6)
outcome = st.sampled_from(list(Outcome)).map(int)


def _text(n: int) -> st.SearchStrategy[str]:
    return st.text(max_size=n)


def _fetch(keys: list[bytes]) -> st.SearchStrategy[Fetch]:
    n = len(keys)
    return st.builds(
        Fetch, req_id=u64, keys=st.just(keys), slots=st.lists(u64, min_size=n, max_size=n)
    )


def _transfer_done(outcomes: list[int]) -> st.SearchStrategy[TransferDone]:
    n = len(outcomes)
    return st.builds(
        TransferDone,
        req_id=u64,
        outcomes=st.just(outcomes),
        checksums=st.none() | st.lists(u64, min_size=n, max_size=n),
    )


STRATEGIES: dict[str, st.SearchStrategy[Any]] = {
    "hello": st.builds(
        Hello,
        version_major=u64,
        version_minor=u64,
        peer_id=_text(128),
        epoch=u64,
        agent_name=_text(256),
        agent_metadata=st.binary(max_size=256),
        base_addr=u64,
        num_blocks=u64,
        block_len=u64,
        fingerprint=_text(64),
        hash_algo=_text(64),
        hash_seed=st.binary(max_size=256),
        nonce=st.binary(max_size=64),
        max_keys_per_request=u64,
        max_key_len=u64,
        auth=st.none() | st.binary(max_size=64),
        max_open_requests=st.none() | u64,
    ),
    "challenge": st.builds(Challenge, nonce=st.binary(max_size=64)),
    "hello_ack": st.builds(
        HelloAck, peer_id=_text(128), epoch=u64, auth=st.none() | st.binary(max_size=64)
    ),
    "lookup": st.builds(Lookup, req_id=u64, keys=small_keys),
    "lookup_resp": st.builds(LookupResp, req_id=u64, hits=st.lists(st.booleans(), max_size=8)),
    "fetch": small_keys.flatmap(_fetch),
    "fetch_hits": st.builds(FetchHits, req_id=u64, slots=st.lists(u64, max_size=8)),
    "transfer_done": st.lists(outcome, max_size=8).flatmap(_transfer_done),
    "abort": st.builds(Abort, req_id=u64),
    "abort_ack": st.builds(AbortAck, req_id=u64),
    "ping": st.builds(Ping, nonce=u64),
    "pong": st.builds(Pong, nonce=u64),
    "bye": st.builds(Bye, code=_text(64), reason=_text(200)),
}
messages: st.SearchStrategy[Message] = st.one_of(*STRATEGIES.values())


def split_points(data: st.DataObject, length: int) -> list[int]:
    return sorted(data.draw(st.lists(st.integers(0, length), max_size=10), label="cuts"))


def feed_in_pieces(dec: FrameDecoder, buf: bytes, cuts: list[int]) -> list[Message]:
    """Feed ``buf`` split at ``cuts``; after each piece pull every complete message."""
    got: list[Message] = []
    bounds = [0, *cuts, len(buf)]
    for lo, hi in itertools.pairwise(bounds):
        dec.feed(memoryview(buf)[lo:hi])
        while (msg := dec.next_message()) is not None:
            got.append(msg)
    return got


# --- round trips --------------------------------------------------------------------------


def test_strategies_cover_every_message_type() -> None:
    assert set(STRATEGIES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("tag", sorted(MESSAGE_TYPES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_message_round_trips_through_any_chunking(tag: str, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[tag], label="msg")
    assert type(msg) is MESSAGE_TYPES[tag]
    frame = encode(msg)
    (length,) = struct.unpack_from(">I", frame)
    assert length == len(frame) - 4
    cuts = split_points(data, len(frame))
    dec = FrameDecoder()
    bounds = [0, *cuts, len(frame)]
    seen: list[Message] = []
    for lo, hi in itertools.pairwise(bounds):
        dec.feed(frame[lo:hi])
        got = dec.next_message()
        if hi < len(frame):
            assert got is None  # nothing comes out of an incomplete frame
        elif got is not None:
            seen.append(got)
    if not seen:  # the last piece may have been empty
        got = dec.next_message()
        assert got is not None
        seen.append(got)
    assert seen == [msg]
    assert type(seen[0]) is type(msg)
    assert dec.buffered == 0
    assert dec.next_message() is None


@settings(max_examples=60, deadline=None)
@given(msgs=st.lists(messages, max_size=12), data=st.data())
def test_coalesced_frames_decode_in_order(msgs: list[Message], data: st.DataObject) -> None:
    buf = encode_all(msgs)
    assert buf == b"".join(encode(m) for m in msgs)
    dec = FrameDecoder()
    assert feed_in_pieces(dec, buf, split_points(data, len(buf))) == msgs
    assert dec.buffered == 0


def test_unknown_fields_are_ignored_for_minor_version_compatibility() -> None:
    body = msgpack.packb({"t": "ping", "nonce": 7, "added_in_1_1": [1, "x"]}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    assert dec.next_message() == Ping(nonce=7)


def test_a_frame_of_64_fields_is_within_the_field_limit() -> None:
    """The decoder refuses a map of more than 64 fields (``map_of_65_fields`` in the
    corpus); 64, the tag and the nonce among them, still decode."""
    body = msgpack.packb({"t": "ping", "nonce": 7, **{f"x{i}": 0 for i in range(62)}})
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    assert dec.next_message() == Ping(nonce=7)


def test_fields_no_message_has_are_walked_no_further_than_max_ignored_values() -> None:
    """A 4 MB ping whose 62 fields no message has are lists of 65,536 small ints: each
    element is a step of the decoder (a skip walks them as a read does), so such a field
    once cost ~20 ms of the Trio thread per 4 MB, and a 16 MiB frame of one-byte elements
    54-86 ms, on a session that stayed up. The values inside such fields are now walked
    one by one, at most ``MAX_IGNORED_VALUES`` in a frame, past which it is refused,
    unbuilt; within it they are still ignored."""
    fields: dict[str, object] = {f"x{i}": [0] * 65536 for i in range(62)}
    body = msgpack.packb({"nonce": 1, **fields, "t": "ping"}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="nest more than 4096 values"):
            dec.next_message()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(body), f"decoding a {len(body)}-byte frame peaked at {peak} bytes"
    within = {"x0": [0] * 4000, "x1": [b"x" * 4096] * 95, "x2": "s" * 100_000}
    body = msgpack.packb({"nonce": 1, **within, "t": "ping"}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    assert dec.next_message() == Ping(nonce=1)


def test_a_frames_known_lists_hold_at_most_max_list_elements_together() -> None:
    """Fields of other messages are read as lists too (and then ignored): all of a
    frame's known lists hold at most a fetch's keys and slots."""
    assert wire.MAX_LIST_ELEMENTS == 2 * MAX_KEYS
    known = {"keys": [b"k"] * MAX_KEYS, "slots": [0] * MAX_KEYS, "hits": [True]}
    body = msgpack.packb({"nonce": 1, **known, "t": "ping"}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError, match="lists hold more than 131072 elements"):
        dec.next_message()


_PAST_NESTED = {f"k{i}": [0, [1]] for i in range(wire.MAX_IGNORED_VALUES // 4)}


@pytest.mark.parametrize(
    "value",
    [[[0] * 4096], [0, {"a": [0] * 4096}], _PAST_NESTED],
    ids=["list-in-list", "map-in-list", "map"],
)
def test_a_field_no_message_has_is_refused_past_what_a_frame_may_make_us_walk(
    value: object,
) -> None:
    """Lists and maps (a newer version's structure) are walked value by value, at every
    level, at most ``MAX_IGNORED_VALUES`` of them. A skip would walk them whole, however
    deep and long (up to a frame's bytes)."""
    body = msgpack.packb({"nonce": 1, "added": value, "t": "ping"}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError, match="nest more than 4096 values"):
        dec.next_message()


def test_a_map_no_message_has_is_walked_and_ignored_within_the_budget() -> None:
    within = {f"k{i}": [0, {"x": [1]}] for i in range(wire.MAX_IGNORED_VALUES // 8 - 1)}
    body = msgpack.packb({"nonce": 1, "added": within, "e": {}, "t": "ping"}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    assert dec.next_message() == Ping(nonce=1)


def test_the_hot_decoder_stops_at_a_field_no_hot_message_has_before_its_value() -> None:
    """The field's value announces 2**32 - 1 elements and holds none: a decoder that read
    (or skipped) it would report the frame cut short. The hot one refuses it by its name:
    it no longer looks for the tag (last) first, skipping every value before it."""
    import msgspec

    body = b"\x83" + msgpack.packb("junk") + b"\xdd\xff\xff\xff\xff"
    with pytest.raises(msgspec.ValidationError, match="unknown field `junk`"):
        wire._hot_decode(body)
    assert wire._decode_hot(body) is None


def test_a_hellos_version_is_not_looked_for_past_the_frames_list_budget() -> None:
    """A frame the general path refused is read once more for a hello's version; that
    read walks no more than the first one may (a list past the budget ends it)."""
    big = [0] * (MAX_KEYS + 1)
    body = msgpack.packb({"junk": big, "t": "hello", "version_major": 9}, use_bin_type=True)
    assert wire._hello_version(body) is None
    body = msgpack.packb({"junk": [1, 2], "t": "hello", "version_major": 9, "peer_id": "p"})
    assert wire._hello_version(body) == (9, "p")


def test_a_fetch_of_max_keys_from_a_newer_minor_decodes_at_the_list_budget() -> None:
    """A fetch of ``MAX_KEYS`` keys and slots holds exactly ``MAX_LIST_ELEMENTS`` list
    elements: within the bound, also where a field no message has (a newer minor's) sends
    it down the general path."""
    keys = [i.to_bytes(4, "big") for i in range(MAX_KEYS)]
    slots = list(range(MAX_KEYS))
    fields = {"t": "fetch", "req_id": 7, "keys": keys, "slots": slots, "added_in_1_1": 0}
    body = msgpack.packb(fields, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    assert dec.next_message() == Fetch(req_id=7, keys=keys, slots=slots)


def test_fields_no_message_has_share_one_budget_of_ignored_values() -> None:
    """``MAX_IGNORED_VALUES`` bounds the values walked in the whole frame: two fields no
    message has, each within it alone, are refused together past it (with a budget of
    their own, a frame's 64 fields would make us walk 64 times as many)."""
    half = wire.MAX_IGNORED_VALUES // 2 + 1
    body = msgpack.packb(
        {"nonce": 1, "a": [0] * half, "b": [0] * half, "t": "ping"}, use_bin_type=True
    )
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError, match="nest more than 4096 values"):
        dec.next_message()


def _refusal(fields: dict[str, Any] | bytes) -> tuple[int, str | None] | None:
    """The frame's refusal as the session sees it: a hello of version N (and the peer id
    it claims) or, ``None``, a plain protocol error."""
    body = fields if isinstance(fields, bytes) else msgpack.packb(fields, use_bin_type=True)
    dec = FrameDecoder(wire.MAX_HELLO_FRAME)
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError) as caught:
        dec.next_message()
    exc = caught.value
    if isinstance(exc, wire.UndecodedHello):
        return exc.version_major, exc.claimed_id
    return None


_HELLO_9 = {"t": "hello", "version_major": 9}  # every other field a newer major's business


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({**_HELLO_9, "peer_id": "p" * wire.MAX_PEER_ID}, (9, "p" * wire.MAX_PEER_ID)),
        ({**_HELLO_9, "peer_id": "p" * (wire.MAX_PEER_ID + 1)}, (9, None)),
        ({**_HELLO_9, "peer_id": 5}, (9, None)),
        ({"peer_id": {"a": 1}, **_HELLO_9}, (9, None)),
        ({"t": "ping", "version_major": 9, "peer_id": "p"}, None),
        ({"t": "hello", "version_major": -1, "peer_id": "p"}, None),
        ({**_HELLO_9, **{f"x{i}": 0 for i in range(63)}}, None),
        ({"a": [0] * MAX_KEYS, "b": [0] * MAX_KEYS, "c": [0], **_HELLO_9}, None),
    ],
    ids=[
        "id_of_max_length",
        "id_too_long",
        "id_not_a_str",
        "id_a_map_before_the_version",
        "not_tagged_hello",
        "version_not_a_u64",
        "map_of_65_fields",
        "lists_past_the_budget_together",
    ],
)
def test_a_refused_frame_is_a_hello_of_another_version_only_where_it_says_so(
    fields: dict[str, Any], expected: tuple[int, str | None] | None
) -> None:
    """A frame that does not decode is a hello of another major version (refused by its
    version, as a rejected handshake naming the id it claims) only where it is a map
    tagged ``hello`` with a u64 ``version_major``; the id is claimed only where it is a
    str of at most ``MAX_PEER_ID`` characters, and a map in its place is walked past. The
    version is looked for within the first read's bounds (64 fields, the frame's lists
    together at most ``MAX_LIST_ELEMENTS``), else the frame is a plain protocol error."""
    assert _refusal(fields) == expected


@pytest.mark.parametrize("element", [b"\x90", b"\x80"], ids=["empty-lists", "empty-maps"])
def test_a_hello_sized_frame_of_empty_containers_is_refused_before_it_is_built(
    element: bytes,
) -> None:
    """Every known field a list of 65,535 one-byte empty lists (or maps), in the 1 MiB a
    stranger may send before admission or any proof: each element used to become a new
    Python list or dict (a review measured a 70 MB peak and 0.4 s of the Trio thread for
    one frame). A container inside a field is now refused at the first one."""
    parts: list[bytes] = []
    room = wire.MAX_HELLO_FRAME - 64
    for name in sorted(wire._KNOWN_FIELDS - {"t"}):
        k = min(65535, room - 24)
        if k <= 0:
            break
        part = msgpack.packb(name, use_bin_type=True) + b"\xdc" + k.to_bytes(2, "big")
        parts.append(part + element * k)
        room -= len(parts[-1])
    n = len(parts) + 1
    body = (
        b"\xde"
        + n.to_bytes(2, "big")
        + b"".join(parts)
        + msgpack.packb("t")
        + msgpack.packb("hello")
    )
    assert len(body) > 1_000_000
    dec = FrameDecoder(wire.MAX_HELLO_FRAME)
    dec.feed(struct.pack(">I", len(body)) + body)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="a list or map inside a field"):
            dec.next_message()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(body), f"decoding a {len(body)}-byte frame peaked at {peak} bytes"


@pytest.mark.parametrize("what", ["tag", "field_twice"])
def test_a_peers_long_name_is_cut_short_in_the_refusal(what: str) -> None:
    """A tag or field name is whatever str the peer sends (up to a frame's size: 1 MiB
    from a stranger before its hello passed). The refusal's text goes to a WARNING line,
    the bye and the session's close reason, so it shows the start of the name only:
    the rate limit of protocol-error lines (one a second) must also bound their bytes."""
    name = "x" * 200_000
    pairs = [("t", name), ("nonce", 1)] if what == "tag" else [("t", "ping"), (name, 1), (name, 2)]
    body = bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True) for k, v in pairs
    )
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError, match=r"unknown message type|twice") as info:
        dec.next_message()
    assert "'xxxxxxxx" in str(info.value)
    assert len(str(info.value)) < 200, len(str(info.value))


@pytest.mark.parametrize("name", ["nonce", "added_in_1_1"])
def test_a_field_named_twice_is_refused(name: str) -> None:
    """msgpack maps may repeat a key; which value a peer meant is unknowable (the hot
    path already sends such frames to the general one), so the frame is refused."""
    body = bytes([0x80 | 3]) + b"".join(
        msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True)
        for k, v in [("t", "ping"), (name, 1), (name, 2)]
    )
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(RemoteProtocolError, match="twice"):
        dec.next_message()


def test_optional_fields_default_to_none_when_absent() -> None:
    body = msgpack.packb({"t": "hello_ack", "peer_id": "p", "epoch": 3}, use_bin_type=True)
    dec = FrameDecoder()
    dec.feed(struct.pack(">I", len(body)) + body)
    assert dec.next_message() == HelloAck(peer_id="p", epoch=3, auth=None)


def test_boundary_values_round_trip() -> None:
    msgs: list[Message] = [
        Ping(nonce=U64_MAX),
        Lookup(req_id=0, keys=[b"k" * MAX_KEY_LEN, b"\0"]),
        TransferDone(
            req_id=U64_MAX, outcomes=[int(o) for o in Outcome], checksums=[0, 1, 2, 3, 4, U64_MAX]
        ),
        Bye(code="c" * 64, reason="r" * wire.MAX_TEXT),
    ]
    dec = FrameDecoder()
    dec.feed(encode_all(msgs))
    assert [dec.next_message() for _ in msgs] == msgs


# --- malformed frames ---------------------------------------------------------------------


def raw_frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def packed(obj: object) -> bytes:
    return raw_frame(msgpack.packb(obj, use_bin_type=True))


def assert_poisoned(dec: FrameDecoder, first: RemoteProtocolError) -> None:
    """After an error the decoder refuses everything, even valid frames."""
    with pytest.raises(RemoteProtocolError) as again:
        dec.next_message()
    assert again.value is first
    with pytest.raises(RemoteProtocolError):
        dec.feed(encode(Ping(nonce=1)))


HELLO_OK: dict[str, Any] = {
    "t": "hello",
    "version_major": 1,
    "version_minor": 0,
    "peer_id": "p",
    "epoch": 1,
    "agent_name": "ag",
    "agent_metadata": b"md",
    "base_addr": 0,
    "num_blocks": 4,
    "block_len": 16,
    "fingerprint": "",
    "hash_algo": "sha256",
    "hash_seed": b"",
    "nonce": b"n",
    "max_keys_per_request": 8,
    "max_key_len": 8,
}


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    out.update(changes)
    return out


def _without(base: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != key}


PING_BODY = msgpack.packb({"t": "ping", "nonce": 1}, use_bin_type=True)

# Valid fields of each hot message but its request id.
HOT_FIELDS: dict[str, dict[str, Any]] = {
    "lookup": {"keys": [b"k"]},
    "lookup_resp": {"hits": [True]},
    "fetch": {"keys": [b"k"], "slots": [0]},
    "fetch_hits": {"slots": [0]},
    "transfer_done": {"outcomes": [0]},
}

MALFORMED: list[tuple[str, bytes, str]] = [
    # (id, frame bytes, regex the error message must match)
    ("not_msgpack", raw_frame(b"\xc1"), "undecodable"),
    ("truncated_msgpack_inside_frame", raw_frame(PING_BODY[:-2]), "undecodable"),
    ("not_a_map_list", packed([1, 2, 3]), "not a map"),
    ("not_a_map_str", packed("ping"), "not a map"),
    ("not_a_map_int", packed(5), "not a map"),
    ("unknown_type_tag", packed({"t": "gossip", "nonce": 1}), "unknown message type"),
    ("missing_type_tag", packed({"nonce": 1}), "unknown message type"),
    ("type_tag_is_bytes", packed({"t": b"ping", "nonce": 1}), "unknown message type"),
    ("type_tag_is_int", packed({"t": 3, "nonce": 1}), "unknown message type"),
    ("missing_field", packed({"t": "ping"}), "missing field 'nonce'"),
    ("missing_field_hello", packed(_without(HELLO_OK, "epoch")), "missing field"),
    ("none_for_int", packed({"t": "ping", "nonce": None}), "invalid ping"),
    ("str_for_bytes_key", packed({"t": "lookup", "req_id": 1, "keys": ["k"]}), "invalid lookup"),
    ("str_for_bytes_field", packed(_with(HELLO_OK, agent_metadata="md")), "expected bytes"),
    (
        "str_for_optional_bytes",
        packed({"t": "hello_ack", "peer_id": "p", "epoch": 1, "auth": "x"}),
        "expected bytes",
    ),
    ("bytes_for_str", packed({"t": "bye", "code": b"x", "reason": "r"}), "expected str"),
    ("bytes_for_str_peer_id", packed(_with(HELLO_OK, peer_id=b"p")), "expected str"),
    ("float_for_int", packed({"t": "ping", "nonce": 1.0}), "expected int"),
    (
        "float_for_int_in_list",
        packed({"t": "fetch", "req_id": 1, "keys": [b"k"], "slots": [1.0]}),
        "invalid fetch",
    ),
    ("negative_int", packed({"t": "ping", "nonce": -1}), "unsigned 64-bit"),
    # The hot messages are decoded by msgspec first: its bounds must refuse a negative id too.
    *(
        (f"negative_req_id_{tag}", packed({**fields, "t": tag, "req_id": -1}), f"invalid {tag}")
        for tag, fields in HOT_FIELDS.items()
    ),
    (
        "negative_int_in_list",
        packed({"t": "fetch", "req_id": 1, "keys": [b"k"], "slots": [-1]}),
        "invalid fetch",
    ),
    # A long list is checked in one C-level pass (min and max) before any walk: a
    # negative slot there would be a write below the consumer's region.
    (
        "negative_int_in_a_long_list",
        packed({"t": "fetch_hits", "req_id": 1, "slots": [*range(70), -1]}),
        "invalid fetch_hits",
    ),
    # msgpack has no integer above 2**64-1: a peer can only send it as a float.
    ("int_over_u64_as_float", packed({"t": "abort", "req_id": float(U64_MAX) * 2}), "expected int"),
    (
        "int_over_u64_as_bigint_ext",
        packed({"t": "abort", "req_id": msgpack.ExtType(1, b"\1" * 9)}),
        "undecodable|extension",
    ),
    ("bool_for_int", packed({"t": "ping", "nonce": True}), "expected int, got bool"),
    ("bool_for_int_req_id", packed({"t": "abort", "req_id": False}), "expected int, got bool"),
    (
        "bool_for_int_in_slots",
        packed({"t": "fetch", "req_id": 1, "keys": [b"k"], "slots": [True]}),
        "invalid fetch",
    ),
    (
        "bool_for_int_in_outcomes",
        packed({"t": "transfer_done", "req_id": 1, "outcomes": [False]}),
        "invalid transfer_done",
    ),
    ("bool_for_int_in_hello", packed(_with(HELLO_OK, num_blocks=True)), "got bool"),
    ("int_for_bool", packed({"t": "lookup_resp", "req_id": 1, "hits": [1, 0]}), "expected bools"),
    # A long list is checked in one C-level pass before any walk: ints are not bools there.
    (
        "ints_for_bools_in_a_long_list",
        packed({"t": "lookup_resp", "req_id": 1, "hits": [1, 0] * 40}),
        "expected bools",
    ),
    (
        "none_in_bool_list",
        packed({"t": "lookup_resp", "req_id": 1, "hits": [None]}),
        "expected bools",
    ),
    # No message field is a map: the decoder refuses a nested one before structuring.
    ("map_for_list", packed({"t": "lookup", "req_id": 1, "keys": {"k": 1}}), "undecodable"),
    ("scalar_for_list", packed({"t": "lookup", "req_id": 1, "keys": b"k"}), "expected a list"),
    (
        "keys_over_bound",
        packed({"t": "lookup", "req_id": 1, "keys": [b"k"] * (MAX_KEYS + 1)}),
        "undecodable",
    ),
    # A list header announcing more elements than the frame has bytes left is refused
    # before anything is read from it.
    (
        "list_longer_than_its_frame",
        raw_frame(b"\x83\xa1t\xa6lookup\xa6req_id\x01\xa4keys\xdc\x03\xe8\xc4\x01k"),
        "does not fit the frame",
    ),
    (
        "hits_over_bound",
        packed({"t": "lookup_resp", "req_id": 1, "hits": [True] * (MAX_KEYS + 1)}),
        "undecodable",
    ),
    (
        "metadata_over_bound",
        packed(_with(HELLO_OK, agent_metadata=b"m" * (MAX_METADATA + 1))),
        "undecodable",
    ),
    (
        "text_over_bound",
        packed({"t": "bye", "code": "c", "reason": "r" * (wire.MAX_TEXT + 1)}),
        "invalid bye",
    ),
    ("peer_id_over_bound", packed(_with(HELLO_OK, peer_id="p" * 129)), "invalid hello"),
    (
        "auth_over_bound",
        packed({"t": "hello_ack", "peer_id": "p", "epoch": 1, "auth": b"a" * 65}),
        "invalid hello_ack",
    ),
    (
        "key_too_long",
        packed({"t": "lookup", "req_id": 1, "keys": [b"k" * (MAX_KEY_LEN + 1)]}),
        "every key",
    ),
    ("empty_key", packed({"t": "lookup", "req_id": 1, "keys": [b"a", b""]}), "every key"),
    (
        "empty_key_in_fetch",
        packed({"t": "fetch", "req_id": 1, "keys": [b""], "slots": [0]}),
        "every key",
    ),
    (
        "fetch_keys_slots_mismatch",
        packed({"t": "fetch", "req_id": 1, "keys": [b"a", b"b"], "slots": [0]}),
        "differ in length",
    ),
    (
        "unknown_outcome_code",
        packed({"t": "transfer_done", "req_id": 1, "outcomes": [0, 6]}),
        "unknown outcome",
    ),
    (
        "negative_checksum",
        packed({"t": "transfer_done", "req_id": 1, "outcomes": [0], "checksums": [-1]}),
        "invalid transfer_done",
    ),
    (
        "checksums_length_mismatch",
        packed({"t": "transfer_done", "req_id": 1, "outcomes": [0, 0], "checksums": [1]}),
        "differ in length",
    ),
    (
        "extension_type",
        packed({"t": "ping", "nonce": msgpack.ExtType(5, b"ab")}),
        "undecodable|extension",
    ),
    (
        "empty_extension_type",
        raw_frame(b"\x82\xa1t\xa4ping\xa5nonce\xc7\x00\x05"),
        "extension type 5",
    ),
    ("timestamp", packed({"t": "ping", "nonce": msgpack.Timestamp(1, 0)}), "undecodable|extension"),
    (
        "timestamp_96",
        packed({"t": "ping", "nonce": msgpack.Timestamp(2**40, 1)}),
        "undecodable|extension",
    ),
    ("invalid_utf8_value", raw_frame(b"\x82\xa1t\xa3bye\xa4code\xa2\xff\xfe"), "undecodable"),
    ("invalid_utf8_tag", raw_frame(b"\x82\xa1t\xa4\xffing\xa5nonce\x01"), "undecodable"),
    ("invalid_utf8_map_key", raw_frame(b"\x82\xa1t\xa4ping\xa2\xff\xfe\x01"), "undecodable"),
    ("int_map_key", raw_frame(b"\x83\xa1t\xa4ping\xa5nonce\x01\x07\x01"), "undecodable"),
    ("bytes_map_key", packed({"t": "ping", "nonce": 1, b"nonce": 2}), "key"),
    (
        "map_of_65_fields",
        packed({"t": "ping", "nonce": 1, **{f"x{i}": 0 for i in range(63)}}),
        "a map of 65 fields",
    ),
    ("trailing_data_inside_frame", raw_frame(PING_BODY + b"\x00"), "undecodable"),
    # A body that opens like a hot message goes to msgspec first: its decode errors too
    # must end as the general path's refusal, not escape as msgspec's own.
    *(
        (
            f"truncated_{tag}",
            raw_frame(packed({**fields, "t": tag, "req_id": 1})[4:-1]),
            "undecodable",
        )
        for tag, fields in HOT_FIELDS.items()
    ),
    (
        "hot_frame_with_a_reserved_byte",
        raw_frame(b"\x83\xa1t\xa6lookup\xa6req_id\xc1"),
        "undecodable",
    ),
    ("two_objects_in_one_frame", raw_frame(PING_BODY + PING_BODY), "undecodable"),
]


@pytest.mark.parametrize("path", ["copy", "view"])
@pytest.mark.parametrize(("frame", "match"), [pytest.param(f, m, id=i) for i, f, m in MALFORMED])
def test_malformed_frame_is_a_remote_protocol_error_and_poisons(
    frame: bytes, match: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways a body is decoded (small bodies from a copy, others from a view of the
    buffer) refuse every frame of the corpus the same way."""
    if path == "view":
        monkeypatch.setattr(wire, "_SMALL_FRAME", 0)
    dec = FrameDecoder()
    dec.feed(encode(Pong(nonce=9)) + frame + encode(Ping(nonce=2)))
    assert dec.next_message() == Pong(nonce=9)  # frames before the bad one still decode
    with pytest.raises(RemoteProtocolError, match=match) as info:
        dec.next_message()
    assert isinstance(info.value, P2PKVError)
    assert_poisoned(dec, info.value)


BOUNDED_TEXT: list[tuple[dict[str, Any], str, str | bytes, int]] = [
    (HELLO_OK, "peer_id", "p", 128),
    (HELLO_OK, "agent_name", "a", 256),
    (HELLO_OK, "fingerprint", "f", wire.MAX_TEXT),
    (HELLO_OK, "hash_algo", "h", 64),
    (HELLO_OK, "hash_seed", b"s", 256),
    (HELLO_OK, "nonce", b"n", 64),
    (HELLO_OK, "auth", b"a", 64),
    ({"t": "hello_ack", "peer_id": "p", "epoch": 1}, "peer_id", "p", 128),
    ({"t": "challenge", "nonce": b"n"}, "nonce", b"n", 64),
    ({"t": "bye", "code": "c", "reason": "r"}, "code", "c", 64),
]


@pytest.mark.parametrize(
    ("base", "field", "unit", "bound"),
    [pytest.param(*case, id=f"{case[0]['t']}.{case[1]}") for case in BOUNDED_TEXT],
)
def test_each_bounded_str_or_bytes_field_is_taken_at_its_bound_and_refused_past_it(
    base: dict[str, Any], field: str, unit: str | bytes, bound: int
) -> None:
    """Every length bound of the handshake's and bye's fields, on both sides of it
    (mutation review, 2026-12-05: raising the bound of a hello's ``peer_id`` or
    ``nonce`` survived; the corpus's over-long ``peer_id`` hello was refused for the
    keys-per-request field it lacked, not for its ``peer_id``)."""
    msg = wire._decode_general(msgpack.packb(_with(base, **{field: unit * bound})))
    assert getattr(msg, field) == unit * bound
    over = msgpack.packb(_with(base, **{field: unit * (bound + 1)}), use_bin_type=True)
    with pytest.raises(RemoteProtocolError, match=f"^invalid {base['t']}: {field}: expected"):
        wire._decode_general(over)


def test_malformed_corpus_ids_are_unique() -> None:
    ids = [i for i, _, _ in MALFORMED]
    assert len(ids) == len(set(ids))


def test_truncated_frame_waits_then_garbage_completion_is_an_error() -> None:
    dec = FrameDecoder()
    dec.feed(b"\x00\x00")
    assert dec.next_message() is None  # half a header
    dec.feed(b"\x00\x0a" + b"\x82\xa1t")  # header says 10 bytes, 3 arrived
    assert dec.next_message() is None
    assert dec.next_message() is None
    assert dec.buffered == 7
    dec.feed(b"\xff" * 7)  # the rest of the frame is garbage
    with pytest.raises(RemoteProtocolError, match="undecodable") as info:
        dec.next_message()
    assert_poisoned(dec, info.value)


def test_truncated_frame_completed_properly_decodes() -> None:
    frame = encode(Lookup(req_id=5, keys=[b"abc"]))
    dec = FrameDecoder()
    for i in range(len(frame) - 1):
        dec.feed(frame[i : i + 1])
        assert dec.next_message() is None
    dec.feed(frame[-1:])
    assert dec.next_message() == Lookup(req_id=5, keys=[b"abc"])


def test_frames_decoded_in_place_leave_the_rest_of_the_buffer_intact() -> None:
    """Bodies are decoded from a view of the buffer (no copy): a big hot frame, a frame
    only the general path decodes, then half a frame, all in one feed."""
    keys = [i.to_bytes(32, "big") for i in range(4096)]
    big = Fetch(req_id=1, keys=keys, slots=list(range(4096)))  # 150 KB: over 128 KiB
    general = Abort(req_id=2)
    tail = encode(Lookup(req_id=3, keys=[b"k" * 40]))
    dec = FrameDecoder()
    dec.feed(encode(big) + encode(general) + tail[:10])
    assert dec.next_message() == big
    assert dec.next_message() == general
    assert dec.next_message() is None and dec.buffered == 10
    dec.feed(tail[10:])
    assert dec.next_message() == Lookup(req_id=3, keys=[b"k" * 40])
    assert dec.buffered == 0


@pytest.mark.parametrize("limit", [100, MAX_FRAME_SIZE])
def test_oversized_length_is_rejected_from_the_header_alone(limit: int) -> None:
    dec = FrameDecoder(max_frame_size=limit)
    header = struct.pack(">I", limit + 1)
    for b in header[:3]:
        dec.feed(bytes([b]))
        assert dec.next_message() is None
    dec.feed(header[3:])  # no body byte has arrived yet
    with pytest.raises(RemoteProtocolError, match="over the limit") as info:
        dec.next_message()
    assert_poisoned(dec, info.value)


def test_frame_exactly_at_the_limit_is_buffered_not_rejected() -> None:
    dec = FrameDecoder(max_frame_size=100)
    dec.feed(struct.pack(">I", 100) + b"\x00" * 50)
    assert dec.next_message() is None


def test_decoder_limit_cannot_exceed_the_protocol_limit() -> None:
    dec = FrameDecoder(max_frame_size=MAX_FRAME_SIZE * 4)
    assert dec.max_frame_size == MAX_FRAME_SIZE
    dec.feed(struct.pack(">I", MAX_FRAME_SIZE + 1))
    with pytest.raises(RemoteProtocolError, match="over the limit"):
        dec.next_message()


def test_zero_length_frame_is_an_error() -> None:
    dec = FrameDecoder()
    dec.feed(b"\x00\x00\x00\x00")
    with pytest.raises(RemoteProtocolError, match="empty frame") as info:
        dec.next_message()
    assert_poisoned(dec, info.value)


# --- building messages locally ------------------------------------------------------------


def untyped(value: object) -> Any:
    """A deliberately ill-typed argument (what a careless caller might pass)."""
    return value


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: Lookup(req_id=-1, keys=[]), id="negative_req_id"),
        pytest.param(lambda: Ping(nonce=U64_MAX + 1), id="int_over_u64"),
        pytest.param(lambda: Ping(nonce=True), id="bool_for_int"),
        pytest.param(lambda: Abort(req_id=untyped(1.0)), id="float_for_int"),
        pytest.param(lambda: Lookup(req_id=1, keys=[b""]), id="empty_key"),
        pytest.param(lambda: Lookup(req_id=1, keys=untyped(["k"])), id="str_key"),
        pytest.param(lambda: Lookup(req_id=1, keys=untyped((b"k",))), id="tuple_for_list"),
        pytest.param(lambda: Lookup(req_id=1, keys=[b"k" * (MAX_KEY_LEN + 1)]), id="long_key"),
        pytest.param(lambda: Lookup(req_id=1, keys=[b"k"] * (MAX_KEYS + 1)), id="too_many"),
        pytest.param(
            lambda: TransferDone(req_id=1, outcomes=[0] * (MAX_KEYS + 1)), id="too_many_outcomes"
        ),
        pytest.param(lambda: LookupResp(req_id=1, hits=untyped([1])), id="int_for_bool"),
        pytest.param(lambda: Fetch(req_id=1, keys=[b"a"], slots=[]), id="fetch_mismatch"),
        pytest.param(lambda: Fetch(req_id=1, keys=[b"a"], slots=[True]), id="bool_slot"),
        pytest.param(lambda: TransferDone(req_id=1, outcomes=[6]), id="unknown_outcome"),
        pytest.param(
            lambda: TransferDone(req_id=1, outcomes=[0], checksums=[]), id="checksums_mismatch"
        ),
        pytest.param(lambda: Bye(code="c" * 65, reason=""), id="long_code"),
        pytest.param(lambda: Bye(code=untyped(b"c"), reason=""), id="bytes_for_str"),
        pytest.param(lambda: HelloAck(peer_id="p", epoch=1, auth=untyped("x")), id="str_auth"),
        pytest.param(
            lambda: HelloAck(peer_id="p", epoch=1, auth=untyped(bytearray(32))),
            id="bytearray_for_bytes",
        ),
        pytest.param(lambda: LookupResp(req_id=1, hits=untyped([1, 0] * 40)), id="long_int_hits"),
    ],
)
def test_invalid_message_cannot_be_built(build: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        build()


def test_encoding_an_oversized_message_is_a_local_protocol_error() -> None:
    # 65536 keys of 1024 bytes: every field is within its bound, the frame is not.
    msg = Lookup(req_id=1, keys=[b"k" * MAX_KEY_LEN] * MAX_KEYS)
    with pytest.raises(LocalProtocolError, match="over the limit"):
        encode(msg)
    with pytest.raises(LocalProtocolError):
        encode_all([Ping(nonce=1), msg])
