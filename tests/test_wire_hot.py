"""The hot-message codec (msgspec) against the general one (cattrs + msgpack).

The hot path is an accelerator for ``lookup``, ``lookup_resp``, ``fetch``, ``fetch_hits``
and ``transfer_done``; the general path stays the definition of the protocol. These tests hold
the two together: the same bytes out for every valid message, the same message in for
every valid frame, and for any other frame the hot path declines, so that the refusal (its
type and its words) is the general path's.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2pkv import wire
from p2pkv.errors import RemoteProtocolError
from p2pkv.wire import (
    HEADER,
    MAX_KEY_LEN,
    MAX_KEYS,
    U64_MAX,
    Fetch,
    FetchHits,
    FrameDecoder,
    Lookup,
    LookupResp,
    Message,
    Outcome,
    TransferDone,
    encode,
    to_wire,
)

from .test_wire import MALFORMED, STRATEGIES

HOT = ("lookup", "lookup_resp", "fetch", "fetch_hits", "transfer_done")

u64 = st.integers(0, U64_MAX)
keys = st.binary(min_size=1, max_size=40) | st.sampled_from([b"k" * MAX_KEY_LEN, b"\0"])
outcome = st.sampled_from(list(Outcome)).map(int)
# Lists on both sides of wire._BULK: short lists take the element walk, long ones the
# C-level check.
sizes = st.integers(0, 3) | st.integers(wire._BULK - 1, wire._BULK + 40)


@st.composite
def hot_messages(draw: st.DrawFn) -> Message:
    tag = draw(st.sampled_from(HOT))
    n = draw(sizes)
    req_id = draw(u64)
    if tag == "lookup":
        return Lookup(req_id=req_id, keys=draw(st.lists(keys, min_size=n, max_size=n)))
    if tag == "lookup_resp":
        return LookupResp(req_id=req_id, hits=draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if tag == "fetch":
        return Fetch(
            req_id=req_id,
            keys=draw(st.lists(keys, min_size=n, max_size=n)),
            slots=draw(st.lists(u64, min_size=n, max_size=n)),
        )
    if tag == "fetch_hits":
        return FetchHits(req_id=req_id, slots=draw(st.lists(u64, min_size=n, max_size=n)))
    checksums = draw(st.none() | st.lists(u64, min_size=n, max_size=n))
    outcomes = draw(st.lists(outcome, min_size=n, max_size=n))
    return TransferDone(req_id=req_id, outcomes=outcomes, checksums=checksums)


def general_body(msg: Message) -> bytes:
    body: bytes = msgpack.packb(to_wire(msg), use_bin_type=True)
    return body


def general_outcome(body: bytes) -> Message | tuple[type[BaseException], str]:
    try:
        return wire._decode_general(body)
    except RemoteProtocolError as exc:
        return type(exc), str(exc)


def decoder_outcome(body: bytes) -> Message | tuple[type[BaseException], str]:
    dec = FrameDecoder()
    dec.feed(HEADER.pack(len(body)) + body)
    try:
        msg = dec.next_message()
    except RemoteProtocolError as exc:
        return type(exc), str(exc)
    assert msg is not None
    return msg


def assert_same_types(a: Message, b: Message) -> None:
    """Equal is not enough: a field must hold a list of exactly the same element types."""
    assert type(a) is type(b)
    for name in attrs_names(a):
        x, y = getattr(a, name), getattr(b, name)
        assert type(x) is type(y), name
        if type(x) is list:
            assert [type(e) for e in x] == [type(e) for e in y], name


def attrs_names(msg: Message) -> list[str]:
    return [f.name for f in type(msg).__attrs_attrs__]


# --- valid messages: same bytes, same message ------------------------------------------


@settings(max_examples=300, deadline=None)
@given(msg=hot_messages())
def test_hot_encoding_is_byte_for_byte_the_general_encoding(msg: Message) -> None:
    body = general_body(msg)
    assert encode(msg) == HEADER.pack(len(body)) + body


@settings(max_examples=300, deadline=None)
@given(msg=hot_messages())
def test_hot_decoding_builds_the_message_the_general_path_builds(msg: Message) -> None:
    body = general_body(msg)
    hot = wire._decode_hot(body)
    assert hot is not None  # every valid hot message takes the hot path
    general = wire._decode_general(body)
    assert hot == general == msg
    assert_same_types(hot, general)


@pytest.mark.parametrize("tag", sorted(set(STRATEGIES) - set(HOT)))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_other_messages_are_left_to_the_general_path(tag: str, data: st.DataObject) -> None:
    body = encode(data.draw(STRATEGIES[tag]))[HEADER.size :]
    assert wire._decode_hot(body) is None


# --- anything else: the general path decides ---------------------------------------------

packable = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64_MAX)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
values = packable | st.lists(packable, max_size=4) | st.dictionaries(st.text(max_size=3), packable)


@st.composite
def hot_maps(draw: st.DrawFn) -> dict[str, Any]:
    """A valid hot message's map, then a few of the changes a hostile or newer peer makes."""
    fields: dict[str, Any] = to_wire(draw(hot_messages()))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["retype", "element", "drop", "add", "retag", "resize"]))
        name = draw(st.sampled_from(sorted(fields))) if fields else "t"
        if kind == "retype":
            fields[name] = draw(values)
        elif kind == "element" and type(fields.get(name)) is list and fields[name]:
            i = draw(st.integers(0, len(fields[name]) - 1))
            fields[name] = [*fields[name]]
            fields[name][i] = draw(packable | st.just(b"") | st.just(b"k" * (MAX_KEY_LEN + 1)))
        elif kind == "drop":
            fields.pop(name, None)
        elif kind == "add":
            fields[draw(st.sampled_from(["x", "checksums", "slots", "hits", "keys"]))] = draw(
                values
            )
        elif kind == "retag":
            fields["t"] = draw(st.sampled_from([*HOT, "ping", "abort"]) | packable)
        elif kind == "resize" and type(fields.get(name)) is list:
            fields[name] = fields[name][: draw(st.integers(0, len(fields[name])))]
    return fields


@settings(max_examples=600, deadline=None)
@given(fields=hot_maps())
def test_a_changed_hot_frame_decodes_exactly_as_the_general_path_says(
    fields: dict[str, Any],
) -> None:
    body = msgpack.packb(fields, use_bin_type=True)
    expected = general_outcome(body)
    got = decoder_outcome(body)
    assert got == expected
    if not isinstance(expected, tuple):
        assert not isinstance(got, tuple)
        assert_same_types(got, expected)
    else:
        assert wire._decode_hot(body) is None  # a refusal is always the general path's


def fixmap(*pairs: tuple[str, Any]) -> bytes:
    """A map with the given entries in order, duplicates kept (a dict cannot hold them)."""
    assert len(pairs) <= 15
    return bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in pairs
    )


# Frames msgspec alone would take (it ignores unknown fields, and a later duplicate wins)
# that must still be the general path's call.
HOT_EDGE: list[tuple[str, bytes]] = [
    ("unknown_nested_map", fixmap(("t", "lookup"), ("req_id", 1), ("keys", []), ("x", {"a": 1}))),
    ("unknown_nested_list", fixmap(("t", "lookup"), ("req_id", 1), ("keys", []), ("x", [[1]]))),
    (
        "unknown_field_in_place_of_checksums",
        fixmap(("t", "transfer_done"), ("req_id", 1), ("outcomes", [0]), ("x", [[1]])),
    ),
    ("duplicate_tag", fixmap(("t", "lookup_resp"), ("req_id", 1), ("hits", []), ("t", "x"))),
    (
        "duplicate_field_in_place_of_checksums",
        fixmap(("t", "transfer_done"), ("req_id", 1), ("outcomes", [0]), ("req_id", 2)),
    ),
    ("duplicate_field", fixmap(("t", "lookup"), ("req_id", 1), ("req_id", 2))),
    (
        "lookup_keys_twice",  # msgspec keeps the last; the general path refuses the frame
        fixmap(("t", "lookup"), ("req_id", 1), ("keys", [b"a"]), ("keys", [b"b"])),
    ),
    (
        "lookup_resp_hits_twice",  # which answer the peer meant is unknowable
        fixmap(("t", "lookup_resp"), ("req_id", 1), ("hits", [True]), ("hits", [False])),
    ),
    (
        "deep_unknown",
        b"\x84\xa1t\xa6lookup\xa6req_id\x01\xa4keys\x90\xa1x" + b"\x91" * 5000 + b"\xc0",
    ),
    ("deep_array_headers", b"\x84\xa1t\xa6lookup\xa1x" + b"\xdc\xff\xff" * 1000),
    (
        "keys_over_bound",
        msgpack.packb({"t": "lookup", "req_id": 1, "keys": [b"k"] * (MAX_KEYS + 1)}),
    ),
    ("list_header_over_bound", b"\x83\xa1t\xa6lookup\xa6req_id\x01\xa4keys\xdd\xff\xff\xff\xff"),
    (
        "checksums_length_mismatch",
        fixmap(("t", "transfer_done"), ("req_id", 1), ("outcomes", [0]), ("checksums", [])),
    ),
    (
        "fetch_length_mismatch",
        fixmap(("t", "fetch"), ("req_id", 1), ("keys", [b"a"]), ("slots", [])),
    ),
    (
        "fetch_hits_with_keys",
        fixmap(("t", "fetch_hits"), ("req_id", 1), ("slots", [0]), ("keys", [b"a"])),
    ),
    ("fetch_hits_without_slots", fixmap(("t", "fetch_hits"), ("req_id", 1))),
    (
        "fetch_hits_hits_in_place_of_slots",  # msgspec sets hits; slots is left unset
        fixmap(("t", "fetch_hits"), ("req_id", 1), ("hits", [True])),
    ),
    (
        "fetch_keys_twice_without_slots",  # four entries, and slots never among them
        fixmap(("t", "fetch"), ("req_id", 1), ("keys", []), ("keys", [])),
    ),
    ("fetch_hits_bool_slot", fixmap(("t", "fetch_hits"), ("req_id", 1), ("slots", [True]))),
    (
        "fetch_hits_slots_over_bound",
        msgpack.packb({"t": "fetch_hits", "req_id": 1, "slots": [0] * (MAX_KEYS + 1)}),
    ),
    ("outcome_past_the_codes", fixmap(("t", "transfer_done"), ("req_id", 1), ("outcomes", [6]))),
    ("tag_as_bytes", fixmap(("t", b"lookup"), ("req_id", 1), ("keys", []))),
    ("map16_header", b"\xde\x00\x03" + fixmap(("t", "lookup"), ("req_id", 1), ("keys", []))[1:]),
]


@pytest.mark.parametrize("body", [pytest.param(b, id=i) for i, b in HOT_EDGE])
def test_a_frame_msgspec_alone_might_take_is_the_general_paths_call(body: bytes) -> None:
    expected = general_outcome(body)
    hot = wire._decode_hot(body)
    assert hot is None if isinstance(expected, tuple) else hot in (None, expected)
    assert decoder_outcome(body) == expected


@pytest.mark.parametrize(("frame", "match"), [pytest.param(f, m, id=i) for i, f, m in MALFORMED])
def test_the_hot_path_accepts_no_frame_of_the_malformed_corpus(frame: bytes, match: str) -> None:
    body = frame[HEADER.size :]
    assert wire._decode_hot(body) is None
    got = decoder_outcome(body)
    assert isinstance(got, tuple) and issubclass(got[0], RemoteProtocolError)
    assert got == general_outcome(body)


# --- the list validators: the C-level check and the walk agree ---------------------------


class Code(enum.IntEnum):
    OK = 0


class Bytes(bytes):
    pass


def walk_keys(value: list[Any]) -> bool:
    return all(type(k) is bytes and 0 < len(k) <= MAX_KEY_LEN for k in value)


def walk_u64s(value: list[Any]) -> bool:
    return all(type(i) is int and 0 <= i <= U64_MAX for i in value)


odd_keys = st.sampled_from(
    [b"", b"k" * (MAX_KEY_LEN + 1), bytearray(b"k"), Bytes(b"k"), "k", 1, None, memoryview(b"k")]
)
odd_ints = st.sampled_from([-1, U64_MAX + 1, True, False, Code.OK, 1.0, None, b"1"])


@st.composite
def long_lists(
    draw: st.DrawFn, good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]
) -> list[Any]:
    """A list on either side of wire._BULK, sometimes with one odd element in it."""
    n = draw(sizes)
    items: list[Any] = draw(st.lists(good, min_size=n, max_size=n))
    spoil = draw(st.booleans())
    if items and spoil:
        items[draw(st.integers(0, n - 1))] = draw(odd)
    return items


@settings(max_examples=300, deadline=None)
@given(value=long_lists(keys, odd_keys))
def test_key_list_check_refuses_exactly_what_the_walk_refuses(value: list[Any]) -> None:
    if walk_keys(value):
        assert Lookup(req_id=1, keys=value).keys is value
    else:
        with pytest.raises(ValueError, match="every key must be"):
            Lookup(req_id=1, keys=value)


@settings(max_examples=300, deadline=None)
@given(value=long_lists(u64, odd_ints))
def test_u64_list_check_refuses_exactly_what_the_walk_refuses(value: list[Any]) -> None:
    keys_ = [b"k%d" % i for i in range(len(value))]
    if walk_u64s(value):
        assert Fetch(req_id=1, keys=keys_, slots=value).slots is value
    else:
        with pytest.raises(ValueError, match="slots: expected unsigned ints"):
            Fetch(req_id=1, keys=keys_, slots=value)


@settings(max_examples=300, deadline=None)
@given(value=long_lists(outcome, odd_ints | st.sampled_from([6, 7, U64_MAX])))
def test_outcome_list_check_refuses_exactly_what_the_walk_refuses(value: list[Any]) -> None:
    if not walk_u64s(value):
        with pytest.raises(ValueError, match="outcomes: expected unsigned ints"):
            TransferDone(req_id=1, outcomes=value)
    elif not {int(o) for o in Outcome}.issuperset(value):
        with pytest.raises(ValueError, match="unknown outcome code"):
            TransferDone(req_id=1, outcomes=value)
    else:
        assert TransferDone(req_id=1, outcomes=value).outcomes is value


@settings(max_examples=200, deadline=None)
@given(value=long_lists(st.booleans(), st.sampled_from([0, 1, None, Code.OK])))
def test_bool_list_check_refuses_exactly_what_the_walk_refuses(value: list[Any]) -> None:
    bad = [e for e in value if type(e) is not bool]
    if not bad:
        assert LookupResp(req_id=1, hits=value).hits is value
    else:
        with pytest.raises(ValueError, match=f"expected bools, got {type(bad[0]).__name__}$"):
            LookupResp(req_id=1, hits=value)


@settings(max_examples=300, deadline=None)
@given(value=long_lists(keys, odd_keys), limit=st.sampled_from([1, 8, 32, 128, MAX_KEY_LEN]))
@example(value=[b"k"] * wire._BULK + [b""], limit=128)  # the C-level pass must bound both ends
def test_keys_ok_answers_exactly_what_the_walk_answers(value: list[Any], limit: int) -> None:
    """The bulk key check our own requests go through (lookup, fetch) agrees with the plain
    walk for every list, on either side of wire._BULK, for any length limit."""
    walk = all(type(k) is bytes and 0 < len(k) <= limit for k in value)
    assert wire.keys_ok(value, limit) is walk


def test_a_trusted_message_is_the_validated_one_and_needs_every_field() -> None:
    """``trusted`` skips the validators, nothing else: the message equals and encodes like
    the validated one, and a missing or unknown field is refused."""
    ks = [b"k%d" % i for i in range(100)]
    slots = list(range(100))
    assert wire.trusted[Lookup](req_id=7, keys=ks) == Lookup(req_id=7, keys=ks)
    fetch = wire.trusted[Fetch](req_id=7, keys=ks, slots=slots)
    assert fetch == Fetch(req_id=7, keys=ks, slots=slots)
    assert encode(fetch) == encode(Fetch(req_id=7, keys=ks, slots=slots))
    with pytest.raises(TypeError, match=r"trusted_.*(missing|unexpected)"):
        wire.trusted[Fetch](req_id=7, keys=ks)
    with pytest.raises(TypeError, match=r"trusted_.*(missing|unexpected)"):
        wire.trusted[Lookup](req_id=7, keys=ks, slots=slots)


@settings(max_examples=200, deadline=None)
@given(
    value=st.lists(st.binary(min_size=1, max_size=40), max_size=200),
    limit=st.sampled_from([1, 8, 32, 40]),
)
@example(value=[b"k", b""], limit=8)  # the short walk bounds both ends too
@example(value=[b"k"] * wire._BULK + [b""], limit=8)
def test_key_lengths_ok_answers_exactly_what_the_walk_answers(
    value: list[bytes], limit: int
) -> None:
    """The receive-side bound on decoded keys (bytes already) agrees with the plain walk."""
    assert wire.key_lengths_ok(value, limit) is all(0 < len(k) <= limit for k in value)


# --- the bytes themselves: every msgpack spelling of a field, hostile ones too -----------
# ``msgpack.packb`` writes one spelling of each value (the shortest); a peer may write any.
# These frames spell a hot message's map by hand, each int, str, bin, list and map header
# in any width msgpack allows, and spoil some of them with what a hostile peer sends
# (another type, an ext or timestamp, NaN, invalid UTF-8, a field twice or unknown, a
# missing one, trailing or missing bytes). Both decoders must give one verdict: the hot
# path takes a frame only where the general path builds the equal message of the same
# element types, and the frame decoder (small frames copied, large ones decoded in place)
# answers what the general path answers.


@st.composite
def spelled_int(draw: st.DrawFn, v: int) -> bytes:
    forms: list[bytes] = []
    if 0 <= v < 0x80 or -32 <= v < 0:
        forms.append(struct.pack(">b" if v < 0 else ">B", v))
    for code, fmt, lo, hi in (
        (0xCC, ">B", 0, 1 << 8),
        (0xCD, ">H", 0, 1 << 16),
        (0xCE, ">I", 0, 1 << 32),
        (0xCF, ">Q", 0, 1 << 64),
        (0xD0, ">b", -(1 << 7), 1 << 7),
        (0xD1, ">h", -(1 << 15), 1 << 15),
        (0xD2, ">i", -(1 << 31), 1 << 31),
        (0xD3, ">q", -(1 << 63), 1 << 63),
    ):
        if lo <= v < hi:
            forms.append(bytes([code]) + struct.pack(fmt, v))
    return draw(st.sampled_from(forms))


@st.composite
def spelled_str(draw: st.DrawFn, raw: bytes) -> bytes:
    n = len(raw)
    forms = [b"\xdb" + struct.pack(">I", n), b"\xda" + struct.pack(">H", n)] if n < 1 << 16 else []
    forms += [b"\xd9" + bytes([n])] if n < 256 else []
    forms += [bytes([0xA0 | n])] if n < 32 else []
    return draw(st.sampled_from(forms or [b"\xdb" + struct.pack(">I", n)])) + raw


@st.composite
def spelled_bin(draw: st.DrawFn, raw: bytes) -> bytes:
    n = len(raw)
    forms = [b"\xc6" + struct.pack(">I", n), b"\xc5" + struct.pack(">H", n)]
    forms += [b"\xc4" + bytes([n])] if n < 256 else []
    return draw(st.sampled_from(forms)) + raw


def container_header(draw: st.DrawFn, n: int, fix: int, h16: int, h32: int) -> bytes:
    """Mostly the short form (the hot path reads only a fixmap), any other sometimes."""
    if n < 16 and draw(st.integers(0, 3)):
        return bytes([fix | n])
    return draw(
        st.sampled_from([bytes([h32]) + struct.pack(">I", n), bytes([h16]) + struct.pack(">H", n)])
    )


# What a hostile peer puts where a value belongs (one msgpack object each).
hostile_scalars = st.sampled_from(
    [
        b"\xc0",  # nil
        b"\xc2",  # false
        b"\xc3",  # true
        b"\xff",  # -1
        b"\xd3" + struct.pack(">q", -(1 << 63)),
        b"\xca" + struct.pack(">f", float("nan")),
        b"\xcb" + struct.pack(">d", float("nan")),
        b"\xcb" + struct.pack(">d", 1.0),
        b"\xa1k",  # a str where bytes belong
        b"\xa2\xc3\x28",  # a str of invalid UTF-8
        b"\xc4\x00",  # empty bin
        b"\xc5\x04\x01" + b"k" * (MAX_KEY_LEN + 1),  # one byte over the key limit
        b"\xd4\x01\x00",  # fixext 1
        b"\xd6\xff\x00\x00\x00\x01",  # a timestamp (ext -1)
        b"\xc7\x00\x05",  # empty ext 8
        b"\x90",  # empty list
        b"\x91\x01",  # a list
        b"\x80",  # empty map
        b"\x81\xa1a\x01",  # a map
        b"\xc1",  # never used
    ]
)


@st.composite
def spelled_value(draw: st.DrawFn, v: Any) -> bytes:
    if v is None:
        return b"\xc0"
    if type(v) is bool:
        return b"\xc3" if v else b"\xc2"
    if type(v) is int:
        return draw(spelled_int(v))
    if type(v) is str:
        return draw(spelled_str(v.encode()))
    if type(v) is bytes:
        return draw(spelled_bin(v))
    assert type(v) is list
    return spelled_list(draw, [draw(spelled_value(e)) for e in v])


def spelled_list(draw: st.DrawFn, items: list[bytes]) -> bytes:
    return container_header(draw, len(items), 0x90, 0xDC, 0xDD) + b"".join(items)


@st.composite
def near_miss(draw: st.DrawFn, v: Any) -> bytes:
    """``v`` as another type a lenient decoder would take for it (an int as a float or a
    bool, a bool as an int, bytes as a str or an ext, a str as bin), or any hostile
    value."""
    forms: list[bytes] = [draw(hostile_scalars)]
    if type(v) is bool:
        forms.append(draw(spelled_int(int(v))))
    elif type(v) is int:
        forms += [b"\xcb" + struct.pack(">d", float(v)), b"\xca" + struct.pack(">f", float(v))]
        forms += [b"\xc3" if v else b"\xc2"] if v in (0, 1) else []
    elif type(v) is bytes:
        forms.append(b"\xc7" + struct.pack(">Bb", len(v), 1) + v if len(v) < 256 else b"\xc1")
        forms += [draw(spelled_str(v))] if v.isascii() else []
    elif type(v) is str:
        forms.append(draw(spelled_bin(v.encode())))
    return draw(st.sampled_from(forms))


SPOILS = ["value", "element", "length", "twice", "unknown", "drop", "bin_name", "bad_name"]


@st.composite
def spelled_hot_frames(draw: st.DrawFn) -> bytes:
    """A valid hot message spelled in any widths, in any field order; or the same with
    one thing spoiled as a hostile peer would."""
    fields = list(to_wire(draw(hot_messages())).items())
    if ("checksums", None) in fields and draw(st.booleans()):  # absent: None as well
        fields.remove(("checksums", None))
    if draw(st.booleans()):  # the order of a map's fields is the sender's
        fields = draw(st.permutations(fields))
    pairs = [(draw(spelled_str(k.encode())), draw(spelled_value(v))) for k, v in fields]
    spoil = draw(st.sampled_from(["none", *SPOILS, "more", "less"]))
    i = draw(st.integers(0, len(pairs) - 1))
    name, value = fields[i]
    if spoil == "value":
        pairs[i] = (pairs[i][0], draw(near_miss(value)))
    elif spoil in ("element", "length") and type(value) is list and value:
        items = [draw(spelled_value(e)) for e in value]
        if spoil == "element":
            j = draw(st.integers(0, len(items) - 1))
            items[j] = draw(near_miss(value[j]))
        else:  # one element too few or too many
            items = items[:-1] if draw(st.booleans()) else [*items, items[0]]
        pairs[i] = (pairs[i][0], spelled_list(draw, items))
    elif spoil == "twice":
        pairs.insert(draw(st.integers(0, len(pairs))), (pairs[i][0], draw(spelled_value(value))))
    elif spoil == "unknown":
        extra = draw(st.sampled_from([b"x", b"slots", b"hits", b"checksums", b"t\x00"]))
        pairs.insert(i, (draw(spelled_str(extra)), draw(hostile_scalars)))
    elif spoil == "drop":
        del pairs[i]
    elif spoil == "bin_name":  # a field's name as bin, not str
        pairs[i] = (draw(spelled_bin(name.encode())), pairs[i][1])
    elif spoil == "bad_name":  # a name of invalid UTF-8
        pairs[i] = (b"\xa2\xc3\x28", pairs[i][1])
    header = container_header(draw, len(pairs), 0x80, 0xDE, 0xDF)
    body = header + b"".join(k + v for k, v in pairs)
    if spoil == "more":
        body += draw(hostile_scalars)
    elif spoil == "less":
        body = body[: draw(st.integers(1, len(body) - 1))]
    return body


@settings(max_examples=200, deadline=None)
@given(body=spelled_hot_frames())
def test_every_spelling_of_a_hot_frame_gets_one_verdict_from_both_decoders(body: bytes) -> None:
    expected = general_outcome(body)
    hot = wire._decode_hot(body)
    if hot is not None:
        assert not isinstance(expected, tuple), expected
        assert hot == expected
        assert_same_types(hot, expected)
    got = decoder_outcome(body)
    assert got == expected
    if not isinstance(expected, tuple):
        assert not isinstance(got, tuple)
        assert_same_types(got, expected)
