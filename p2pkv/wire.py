"""The wire codec: typed control messages, msgpack bodies, length-prefixed frames.

Theory of operation
-------------------
A frame is a 4-byte big-endian length followed by that many bytes of msgpack: a map with
a type tag ``"t"`` and the message's fields. Decoding never trusts the peer: the length is
checked against the frame limit *before* the body is buffered, msgpack is unpacked with
its own size limits and no extension types, and the map is structured by cattrs into an
attrs message class with **exact** type hooks (a bool is not an int, a str is not bytes,
an int out of range is an error) and bounded lists. Anything else is a
:class:`~p2pkv.errors.RemoteProtocolError`; no handler ever sees an unvalidated value.

Bounds here are the protocol's hard limits. Per-node limits (the configured key length,
keys per request, the peer's region for slot indexes) are checked one layer up, in the
session protocol, which knows the peer's hello.

Unknown fields are ignored so that a peer with a newer *minor* version can add fields;
a missing field is an error. No code-executing codec (pickle) is ever used.

The five hot messages (``lookup``, ``lookup_resp``, ``fetch``, ``fetch_hits``,
``transfer_done``: their lists grow with the keys of a request) also have a msgspec codec
that does the same job in C. It is an accelerator, never a second definition of the
protocol: it encodes exactly the bytes the general path encodes (same field order, tag
last), and it decodes a frame only
when the general path would accept that frame and build an equal message; any frame it
is not sure of (a map of another size, an unknown field, a duplicate field, any error at
all) goes to the general path, which decides and words the error. The constraints msgspec
checks are the same bounds written once more as msgspec types; the property tests in
``tests/test_wire_hot.py`` hold the two paths to agreement.
"""

from __future__ import annotations

import enum
import functools
import itertools
import struct
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Final, TypeVar

import attrs
import cattrs
import msgpack
import msgspec

from .errors import LocalProtocolError, RemoteProtocolError

U64_MAX: Final = (1 << 64) - 1
HEADER = struct.Struct(">I")
#: Hard protocol limits (the configuration may only tighten them).
MAX_FRAME_SIZE: Final = 64 << 20
MAX_KEYS: Final = 1 << 16
MAX_KEY_LEN: Final = 1024
MAX_TEXT: Final = 1024
MAX_PEER_ID: Final = 128  # characters of a peer id (hello, hello_ack)
MAX_METADATA: Final = 4 << 20
# The largest frame a node reads before the peer's hello has passed its checks: a
# stranger can make it hold no more per connection. A hello is a few KB (NIXL's metadata
# is ~300 B plus ~44 B per registered region), so this is far above any real one.
MAX_HELLO_FRAME: Final = 1 << 20
# The list elements one frame may hold, all its lists together: a fetch's keys and slots,
# a transfer_done's outcomes and checksums. Each is a step of the decoder, and a frame of
# one-byte elements would otherwise make it take one per byte.
MAX_LIST_ELEMENTS: Final = 2 * MAX_KEYS
# The values inside a frame's fields that no message has (a newer version's) may hold,
# those of every list and map at every level together; they are walked one by one.
MAX_IGNORED_VALUES: Final = 4096


class Outcome(enum.IntEnum):
    """Per-key outcome in ``transfer_done``."""

    OK = 0
    NOT_PINNED = 1  # the key was not a hit of this request's lookup
    # The producer's pin lease ran out before the fetch arrived, or before this key's
    # write was posted (nothing written; a fetch's other keys may be OK).
    LEASE_EXPIRED = 2
    TRANSFER_FAILED = 3  # the data plane reported an error for this block
    ABORTED = 4  # the producer cancelled the write (shutdown or abort)
    OVER_CAP = 5  # the request would exceed the producer's per-peer caps


# --- validators ------------------------------------------------------------------------


def _u64(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise ValueError(f"{attr.name}: expected an unsigned 64-bit int, got {value!r}")


def _text(limit: int) -> Callable[[object, attrs.Attribute[str], str], None]:
    def check(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
        if type(value) is not str or len(value) > limit:
            raise ValueError(f"{attr.name}: expected a str of at most {limit} characters")

    return check


def _blob(limit: int) -> Callable[[object, attrs.Attribute[bytes], bytes], None]:
    def check(_inst: object, attr: attrs.Attribute[bytes], value: bytes) -> None:
        if type(value) is not bytes or len(value) > limit:
            raise ValueError(f"{attr.name}: expected bytes of at most {limit} bytes")

    return check


def _opt_u64(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _u64(inst, attr, value)


def _opt_blob(limit: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    inner = _blob(limit)

    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            inner(inst, attr, value)

    return check


# The list validators run once per message we build, over every key of a request. A long
# list is first asked one C-level question (every element of the exact type and in bounds);
# a short one, or one where the answer is no, is walked element by element, and that walk
# names what is wrong.

_BULK: Final = 64  # below this many elements the plain walk is the faster check
# msgpack carries no integer above U64_MAX (and msgspec bounds only fit an int64).
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_LEN)]
_Keys = Annotated[list[_Key], msgspec.Meta(max_length=MAX_KEYS)]


def _all(value: list[Any], tp: type[Any]) -> bool:
    """Every element's type is exactly ``tp`` (a subclass, bool for int, is not)."""
    return list(map(type, value)).count(tp) == len(value)


def _key_lengths_ok(keys: list[bytes]) -> bool:
    try:
        msgspec.convert(keys, _Keys)  # bytes-likes pass too: exactness is _all's
    except msgspec.ValidationError:
        return False
    return True


@functools.cache
def _key_list_type(max_key_len: int) -> Any:
    return list[Annotated[bytes, msgspec.Meta(min_length=1, max_length=max_key_len)]]


def keys_ok(keys: Sequence[object], max_key_len: int) -> bool:
    """Every key is exactly ``bytes`` of 1..``max_key_len`` bytes. A long list is asked in
    two C-level passes (types; then lengths, by msgspec), about 30 ns a key where
    ``min``/``max`` over ``map(len, ...)`` took 80."""
    if len(keys) < _BULK:
        return all(type(k) is bytes and 0 < len(k) <= max_key_len for k in keys)
    if list(map(type, keys)).count(bytes) != len(keys):
        return False
    return key_lengths_ok(keys, max_key_len)  # type: ignore[arg-type]


def key_lengths_ok(keys: Sequence[bytes], max_key_len: int) -> bool:
    """Every key of a list of ``bytes`` (a decoded message's) is 1..``max_key_len`` bytes
    long: one msgspec pass, ~15 ns a key, where ``max(map(len, keys))`` takes ~30. A short
    list is walked instead (msgspec's fixed cost is a few microseconds)."""
    if len(keys) < _BULK:
        return all(0 < len(k) <= max_key_len for k in keys)
    try:
        msgspec.convert(keys, _key_list_type(max_key_len))
    except msgspec.ValidationError:
        return False
    return True


def _keys(_inst: object, attr: attrs.Attribute[list[bytes]], value: list[bytes]) -> None:
    if type(value) is not list or len(value) > MAX_KEYS:
        raise ValueError(f"{attr.name}: expected a list of at most {MAX_KEYS} keys")
    if len(value) >= _BULK and _all(value, bytes) and _key_lengths_ok(value):
        return
    for k in value:
        if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_LEN:
            raise ValueError(f"{attr.name}: every key must be 1..{MAX_KEY_LEN} bytes")


def _bools(_inst: object, attr: attrs.Attribute[list[bool]], value: list[bool]) -> None:
    if type(value) is not list or len(value) > MAX_KEYS:
        raise ValueError(f"{attr.name}: expected a list of at most {MAX_KEYS} bools")
    if len(value) >= _BULK and _all(value, bool):
        return
    for b in value:
        if type(b) is not bool:
            raise ValueError(f"{attr.name}: expected bools, got {type(b).__name__}")


def _u64s(_inst: object, attr: attrs.Attribute[list[int]], value: list[int]) -> None:
    if type(value) is not list or len(value) > MAX_KEYS:
        raise ValueError(f"{attr.name}: expected a list of at most {MAX_KEYS} ints")
    if len(value) >= _BULK and _all(value, int) and min(value) >= 0 and max(value) <= U64_MAX:
        return
    for i in value:
        if type(i) is not int or not 0 <= i <= U64_MAX:
            raise ValueError(f"{attr.name}: expected unsigned ints")


def _outcomes(inst: object, attr: attrs.Attribute[list[int]], value: list[int]) -> None:
    # Known codes are small ints, so a long list of known codes needs no range check.
    if (
        type(value) is list
        and _BULK <= len(value) <= MAX_KEYS
        and _all(value, int)
        and _OUTCOMES.issuperset(value)
    ):
        return
    _u64s(inst, attr, value)  # the codes themselves: TransferDone.__attrs_post_init__


def _opt_u64s(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _u64s(inst, attr, value)


# --- messages ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hello:
    TAG = "hello"
    version_major: int = attrs.field(validator=_u64)
    version_minor: int = attrs.field(validator=_u64)
    peer_id: str = attrs.field(validator=_text(MAX_PEER_ID))
    epoch: int = attrs.field(validator=_u64)
    agent_name: str = attrs.field(validator=_text(256))
    agent_metadata: bytes = attrs.field(validator=_blob(MAX_METADATA))
    base_addr: int = attrs.field(validator=_u64)
    num_blocks: int = attrs.field(validator=_u64)
    block_len: int = attrs.field(validator=_u64)
    fingerprint: str = attrs.field(validator=_text(MAX_TEXT))
    hash_algo: str = attrs.field(validator=_text(64))
    hash_seed: bytes = attrs.field(validator=_blob(256))
    nonce: bytes = attrs.field(validator=_blob(64))
    # The limits this side enforces on requests it receives: a consumer splits its
    # requests and refuses over-long keys locally instead of being closed for them.
    max_keys_per_request: int = attrs.field(validator=_u64)
    max_key_len: int = attrs.field(validator=_u64)
    auth: bytes | None = attrs.field(default=None, validator=_opt_blob(64))
    # How many of the peer's requests this side lets be open at once (protocol 1.1; None:
    # not advertised, as from a 1.0 peer): the consumer keeps to the smaller of its own.
    max_open_requests: int | None = attrs.field(default=None, validator=_opt_u64)


@attrs.frozen(kw_only=True)
class Challenge:
    """With authentication on, the accepting side's first frame: its fresh nonce. The
    dialer's hello must carry a proof over it, so a hello recorded on another connection
    can never be replayed into this one."""

    TAG = "challenge"
    nonce: bytes = attrs.field(validator=_blob(64))


@attrs.frozen(kw_only=True)
class HelloAck:
    TAG = "hello_ack"
    peer_id: str = attrs.field(validator=_text(MAX_PEER_ID))
    epoch: int = attrs.field(validator=_u64)  # the epoch being acknowledged (the peer's)
    auth: bytes | None = attrs.field(default=None, validator=_opt_blob(64))


@attrs.frozen(kw_only=True)
class Lookup:
    TAG = "lookup"
    req_id: int = attrs.field(validator=_u64)
    keys: list[bytes] = attrs.field(validator=_keys)


@attrs.frozen(kw_only=True)
class LookupResp:
    TAG = "lookup_resp"
    req_id: int = attrs.field(validator=_u64)
    hits: list[bool] = attrs.field(validator=_bools)


@attrs.frozen(kw_only=True)
class Fetch:
    TAG = "fetch"
    req_id: int = attrs.field(validator=_u64)
    keys: list[bytes] = attrs.field(validator=_keys)
    slots: list[int] = attrs.field(validator=_u64s)

    def __attrs_post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError("fetch: keys and slots differ in length")


@attrs.frozen(kw_only=True)
class FetchHits:
    """A fetch of every hit of the round ``req_id``, in its lookup's order, into ``slots``
    (protocol 1.2): the consumer fetches what the round holds, so the producer, which keeps
    the round's hits itself, needs only the slots. ``slots[i]`` takes the i-th hit."""

    TAG = "fetch_hits"
    req_id: int = attrs.field(validator=_u64)
    slots: list[int] = attrs.field(validator=_u64s)


@attrs.frozen(kw_only=True)
class TransferDone:
    TAG = "transfer_done"
    req_id: int = attrs.field(validator=_u64)
    outcomes: list[int] = attrs.field(validator=_outcomes)
    checksums: list[int] | None = attrs.field(default=None, validator=_opt_u64s)

    def __attrs_post_init__(self) -> None:
        if not _OUTCOMES.issuperset(self.outcomes):
            raise ValueError("transfer_done: unknown outcome code")
        if self.checksums is not None and len(self.checksums) != len(self.outcomes):
            raise ValueError("transfer_done: checksums and outcomes differ in length")


_OUTCOMES = frozenset(int(o) for o in Outcome)


@attrs.frozen(kw_only=True)
class Abort:
    TAG = "abort"
    req_id: int = attrs.field(validator=_u64)


@attrs.frozen(kw_only=True)
class AbortAck:
    TAG = "abort_ack"
    req_id: int = attrs.field(validator=_u64)


@attrs.frozen(kw_only=True)
class Ping:
    TAG = "ping"
    nonce: int = attrs.field(validator=_u64)


@attrs.frozen(kw_only=True)
class Pong:
    TAG = "pong"
    nonce: int = attrs.field(validator=_u64)


@attrs.frozen(kw_only=True)
class Bye:
    TAG = "bye"
    code: str = attrs.field(validator=_text(64))  # "shutdown", "handshake", "protocol", ...
    reason: str = attrs.field(validator=_text(MAX_TEXT))


Message = (
    Challenge
    | Hello
    | HelloAck
    | Lookup
    | LookupResp
    | Fetch
    | FetchHits
    | TransferDone
    | Abort
    | AbortAck
    | Ping
    | Pong
    | Bye
)
MESSAGE_TYPES: Final[dict[str, type[Any]]] = {
    cls.TAG: cls
    for cls in (
        Challenge,
        Hello,
        HelloAck,
        Lookup,
        LookupResp,
        Fetch,
        FetchHits,
        TransferDone,
        Abort,
        AbortAck,
        Ping,
        Pong,
        Bye,
    )
}

# --- cattrs with exact types --------------------------------------------------------------

_T = TypeVar("_T")


def _exact(tp: type[_T]) -> Callable[[object, type[Any]], _T]:
    def hook(value: object, _t: type[Any]) -> _T:
        if type(value) is not tp:
            raise TypeError(f"expected {tp.__name__}, got {type(value).__name__}")
        return value

    return hook


def _exact_list(value: object, _t: type[Any]) -> list[Any]:
    # Element types and bounds are checked by the message's validators (one pass).
    if type(value) is not list:
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


_converter = cattrs.Converter(detailed_validation=False, forbid_extra_keys=False)
for _tp in (int, bool, str, bytes):
    _converter.register_structure_hook(_tp, _exact(_tp))
_converter.register_structure_hook_func(
    lambda t: t in (list[bytes], list[bool], list[int]), _exact_list
)


def to_wire(msg: Message) -> dict[str, Any]:
    body: dict[str, Any] = _converter.unstructure(msg)
    body["t"] = msg.TAG
    return body


def from_wire(obj: object) -> Message:
    """Structure one unpacked msgpack object into a validated message."""
    if type(obj) is not dict:
        raise RemoteProtocolError(f"frame is not a map but {type(obj).__name__}")
    # Field names are str; any other key (msgpack's strict_map_key admits bytes) is malformed.
    if any(type(k) is not str for k in obj):
        raise RemoteProtocolError("frame map has a key that is not a str")
    tag = obj.get("t")
    cls = MESSAGE_TYPES.get(tag) if type(tag) is str else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {_shown(tag)}")
    try:
        msg: Message = _converter.structure(obj, cls)
    except (TypeError, ValueError, KeyError, cattrs.BaseValidationError) as exc:
        raise RemoteProtocolError(f"invalid {tag}: {_describe(exc)}") from exc
    return msg


_SHOWN: Final = 64  # characters of a peer's value an error message shows


def _shown(value: object) -> str:
    """A value the peer sent (a tag, a field name), as an error message shows it: its
    repr, cut short. Such a str may be as long as the frame (megabytes), and the message
    becomes a WARNING line, the bye and the session's close reason: the rate limit of
    those lines (one a second) must bound their bytes too."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return str(exc)


_M = TypeVar("_M")


class _Trusted:
    """``trusted[cls](**fields)``: a message of fields that this process built and has
    just checked itself, made without running the validators a second time (the hot
    messages: a 1,024-key lookup spent more time validating its keys again than encoding
    them). Every field must be given, as a keyword; a missing or unknown one is a
    ``TypeError``. The hot decoder builds what it decoded the same way: msgspec has
    checked every bound and type the validators would.

    Each class gets its builder once, a function that writes each slot through the
    slot's own descriptor: a 1-key lookup's message is made in about 0.5 us on the VM,
    against 1.1 us through a generic function that checked the names and set each field
    in a loop."""

    def __init__(self) -> None:
        self._builders: dict[type[Any], Callable[..., Any]] = {}

    def __getitem__(self, cls: type[_M]) -> Callable[..., _M]:
        build = self._builders.get(cls)
        if build is None:
            build = self._builders[cls] = self._make(cls)
        return build

    @staticmethod
    def _make(cls: type[Any]) -> Callable[..., Any]:
        names = [a.name for a in attrs.fields(cls)]
        env: dict[str, Any] = {"new": object.__new__, "cls": cls}
        for name in names:
            env[f"set_{name}"] = cls.__dict__[name].__set__
        body = "".join(f"    set_{name}(msg, {name})\n" for name in names)
        fn = f"trusted_{cls.__name__}"
        src = f"def {fn}(*, {', '.join(names)}):\n    msg = new(cls)\n{body}    return msg\n"
        exec(compile(src, f"<{fn}>", "exec"), env)
        build: Callable[..., Any] = env[fn]
        return build


trusted: Final = _Trusted()


def encode(msg: Message) -> bytes:
    """One message as one frame (header + body)."""
    hot = _HOT_FIELDS.get(type(msg))
    if hot is not None:
        body = _hot_encode(hot(msg))
    else:
        body = msgpack.packb(to_wire(msg), use_bin_type=True)
    if len(body) > MAX_FRAME_SIZE:
        raise LocalProtocolError(f"{msg.TAG} frame of {len(body)} bytes is over the limit")
    return HEADER.pack(len(body)) + body


def encode_all(msgs: Iterable[Message]) -> bytes:
    """Several messages coalesced into one buffer (one ``send_all``)."""
    return b"".join(encode(m) for m in msgs)


_MAP_HEADERS: Final = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARRAY_HEADERS: Final = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])


# Every field name of any message (and the tag's): the general decoder builds only these.
_KNOWN_FIELDS: Final = frozenset(
    {"t"}.union(*({a.name for a in attrs.fields(cls)} for cls in MESSAGE_TYPES.values()))
)


def _scalar_unpacker(body: bytes) -> msgpack.Unpacker:
    """An unpacker of ``body`` that builds scalars only (strings and blobs up to
    ``MAX_METADATA``): a container or an ext is refused as it is met, so a caller reads
    the top map's header itself and each value one by one, or skips it unbuilt."""
    u = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_buffer_size=max(len(body), 1),
        max_str_len=MAX_METADATA,
        max_bin_len=MAX_METADATA,
        max_array_len=0,
        max_map_len=0,
        max_ext_len=0,
        ext_hook=_reject_ext,
        list_hook=_reject_nested,
        object_hook=_reject_nested,
    )
    u.feed(body)
    return u


def _unpack_body(body: bytes) -> object:
    """Unpack one frame body of the only shape a message has: a map of scalars and
    lists of scalars.

    msgpack allocates a list as long as its header announces before reading a single
    element, so nested array headers (3 bytes each, announcing 65,535 elements) would make
    a 3 KB frame cost tens of megabytes. Here the top-level map and its lists are walked
    by hand, each list bounded by the bytes that remain (an element takes at least one),
    and every element is unpacked by an unpacker that accepts no container at all: its
    length limits refuse a non-empty one, and its hooks an empty one (each a byte on the
    wire and a new Python list or dict: a 1 MiB hello of them would cost 70 MB and
    0.4 s of the Trio thread, before the frame's type or proof was looked at). Nothing
    nests, and nothing is allocated that the frame does not pay for.

    A field no message has (a newer minor's, or junk) is ignored unbuilt: a scalar is
    skipped at once; a list or map is walked value by value, at most
    ``MAX_IGNORED_VALUES`` of them in the frame (past that the frame is refused). The
    lists of known fields hold at most ``MAX_LIST_ELEMENTS`` together. So the values the
    decoder walks are bounded by those, not by the frame's bytes: skipping 16 MiB of
    one-byte elements (a valid ping with a field no message has) once cost 54-86 ms of
    the Trio thread per frame, on a session that stayed up. A field named twice is
    refused.
    """
    u = _scalar_unpacker(body)
    if body[0] in _ARRAY_HEADERS:
        raise RemoteProtocolError("frame is not a map but list")
    if body[0] not in _MAP_HEADERS:
        obj: object = u.unpack()  # a scalar: from_wire names its type
    else:
        n = u.read_map_header()
        if n > 64:
            raise RemoteProtocolError(f"undecodable frame: a map of {n} fields (limit 64)")
        fields: dict[object, object] = {}
        budget, nested = MAX_LIST_ELEMENTS, MAX_IGNORED_VALUES
        for _ in range(n):
            key = u.unpack()
            if type(key) is not str:
                raise RemoteProtocolError("undecodable frame: a map key is not a str")
            if key in fields:
                raise RemoteProtocolError(f"undecodable frame: field {_shown(key)} twice")
            known = key in _KNOWN_FIELDS
            pos = u.tell()
            head = body[pos] if pos < len(body) else None
            if not known:
                nested = _walk(u, body, nested)  # a scalar is skipped at once
                fields[key] = None  # only to catch it twice; from_wire ignores it
            elif head in _ARRAY_HEADERS:
                items = _read_list(u, len(body), budget)
                budget -= len(items)
                fields[key] = items
            else:
                fields[key] = u.unpack()
        obj = fields
    if u.tell() != len(body):
        raise RemoteProtocolError("undecodable frame: extra bytes after its message")
    return obj


def _read_list(u: msgpack.Unpacker, size: int, budget: int) -> list[Any]:
    """The list of scalars at ``u``'s position in a body of ``size`` bytes, of at most
    ``MAX_KEYS`` elements and at most ``budget`` (what the frame's other lists left of
    ``MAX_LIST_ELEMENTS``); each element takes a byte at least, and a container inside it
    is refused by ``u`` at the first one."""
    m = u.read_array_header()
    if m > MAX_KEYS or m > size - u.tell():
        raise RemoteProtocolError(
            f"undecodable frame: a list of {m} elements does not fit the frame"
        )
    if m > budget:
        raise RemoteProtocolError(
            f"undecodable frame: its lists hold more than {MAX_LIST_ELEMENTS} elements"
        )
    items = list(itertools.islice(u, m))
    if len(items) != m:
        raise RemoteProtocolError("undecodable frame: it ends inside a list")
    return items


def _walk(u: msgpack.Unpacker, body: bytes, budget: int) -> int:
    """Skip the value at ``u``'s position, a map's or a list's values one by one (never
    ``u.skip()`` on a container: it walks whatever nests inside, up to a frame's bytes);
    returns what is left of ``budget``, the values that may still be walked."""
    left = 1  # values still to skip
    while left:
        pos = u.tell()
        head = body[pos] if pos < len(body) else None
        if head in _ARRAY_HEADERS:
            n = u.read_array_header()
        elif head in _MAP_HEADERS:
            n = 2 * u.read_map_header()
        else:
            u.skip()
            left -= 1
            continue
        budget -= n
        if budget < 0:
            raise RemoteProtocolError(
                f"undecodable frame: fields no message has nest more than "
                f"{MAX_IGNORED_VALUES} values"
            )
        left += n - 1
    return budget


def _reject_nested(_obj: object) -> object:
    raise RemoteProtocolError("undecodable frame: a list or map inside a field")


def _reject_ext(code: int, data: bytes) -> object:
    raise RemoteProtocolError(f"msgpack extension type {code} is not allowed")


_SMALL_FRAME: Final = 4096  # bodies up to this size are decoded from a copy


class FrameDecoder:
    """Incremental frame decoder. Feed bytes, pull messages. After an error it is poisoned."""

    def __init__(self, max_frame_size: int = MAX_FRAME_SIZE) -> None:
        self.max_frame_size = min(max_frame_size, MAX_FRAME_SIZE)
        self._buf = bytearray()
        self._error: RemoteProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def discard(self) -> None:
        """Drop what is buffered (a session that ends reads no more frames)."""
        self._buf = bytearray()

    def next_message(self) -> Message | None:
        """The next complete message, ``None`` if more bytes are needed."""
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def _next(self) -> Message | None:
        if len(self._buf) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buf)
        if length > self.max_frame_size:
            head = bytes(self._buf[: HEADER.size])
            # A header of printable text is another protocol's (an HTTP request, a
            # banner): say so, rather than only that the "frame" is huge.
            hint = (
                f" (it begins {head!r}: not a p2pkv peer?)"
                if head.isascii() and (head.decode().isprintable())
                else ""
            )
            raise RemoteProtocolError(
                f"frame of {length} bytes is over the limit of {self.max_frame_size}{hint}"
            )
        if length == 0:
            raise RemoteProtocolError("empty frame")
        end = HEADER.size + length
        buf = self._buf
        if len(buf) < end:
            return None
        if length <= _SMALL_FRAME:
            # A small body is copied: cheaper than the two views below (0.5 us of a
            # 1-key answer's 2.2 us on the VM).
            small = buf[HEADER.size : end]
            msg = _decode_hot(small)
            if msg is None:
                msg = _decode_general(bytes(small))
            del buf[:end]
            return msg
        # Decoded in place: a copy of a body over 128 KiB (a 4,096-key fetch is 150 KB)
        # is a fresh mapping, page-faulted in on every frame. The view is gone before the
        # buffer shrinks; the general path (rare) gets a copy of its own.
        with memoryview(buf) as view, view[HEADER.size : end] as body:
            msg = _decode_hot(body)
            if msg is None:
                msg = _decode_general(bytes(body))
        del buf[:end]
        return msg


def _decode_general(body: bytes) -> Message:
    """Any frame body: the message, or the :class:`RemoteProtocolError` that refuses it
    (an :class:`UndecodedHello` for a hello that names its version)."""
    try:
        try:
            obj = _unpack_body(body)
        except RemoteProtocolError:
            raise
        except Exception as exc:  # msgpack raises a zoo: ValueError, ExtraData, Unicode...
            raise RemoteProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
        return from_wire(obj)
    except RemoteProtocolError as exc:
        # What the failed decode built (its unpacker's copy of the body) goes now, not
        # with the error: the frame is read once more below.
        cause: BaseException | None = exc
        for _ in range(4):  # the error, and what it was raised from
            if cause is None:
                break
            traceback.clear_frames(cause.__traceback__)
            cause = cause.__cause__ or cause.__context__
        version = _hello_version(body)
        if version is None:
            raise
        raise UndecodedHello(exc.message, version_major=version[0], peer_id=version[1]) from exc


class UndecodedHello(RemoteProtocolError):
    """A frame tagged ``hello`` that does not decode as this version's hello, though it
    names its protocol major version (``version_major``, a u64) and maybe its
    ``peer_id``. A peer of another major version may have changed any other field: the
    session protocol refuses it by its version, as a rejected handshake; a hello of our
    own major is the peer's protocol error, with this message."""

    def __init__(self, message: str, *, version_major: int, peer_id: str | None) -> None:
        super().__init__(message)
        self.version_major = version_major
        self.claimed_id = peer_id


def _hello_version(body: bytes) -> tuple[int, str | None] | None:
    """``(version_major, peer_id or None)`` of a frame body that is a map tagged
    ``hello`` with a u64 ``version_major``, whatever its other fields hold; else ``None``.
    Only those three fields are unpacked (each a scalar); a list is read and a map walked
    within the bounds :func:`_unpack_body` keeps to (``MAX_LIST_ELEMENTS``,
    ``MAX_IGNORED_VALUES``), past which the version is not looked for: it costs no
    more than that did."""
    u = _scalar_unpacker(body)
    wanted = {"t", "version_major", "peer_id"}
    found: dict[str, object] = {}
    budget, nested = MAX_LIST_ELEMENTS, MAX_IGNORED_VALUES
    try:
        if not body or body[0] not in _MAP_HEADERS:
            return None
        n = u.read_map_header()
        if n > 64:
            return None
        for _ in range(n):
            key = u.unpack()
            pos = u.tell()
            head = body[pos] if pos < len(body) else None
            if head in _ARRAY_HEADERS:
                # Not skipped (a skip walks whatever nests inside, up to a frame's
                # bytes): read as _unpack_body reads one, within the same bounds.
                budget -= len(_read_list(u, len(body), budget))
            elif type(key) is str and key in wanted and key not in found and head is not None:
                if head in _MAP_HEADERS:
                    nested = _walk(u, body, nested)
                else:
                    found[key] = u.unpack()
            else:
                nested = _walk(u, body, nested)
    except Exception:  # msgpack's zoo, or a nested container: whatever it read counts
        pass
    major, peer_id = found.get("version_major"), found.get("peer_id")
    if found.get("t") != "hello" or type(major) is not int or not 0 <= major <= U64_MAX:
        return None
    if type(peer_id) is not str or len(peer_id) > MAX_PEER_ID:
        peer_id = None
    return major, peer_id


# --- the hot-message codec (msgspec) -------------------------------------------------------
# Field order and the tag's place (last) are those of ``to_wire``: the bytes are identical.

_HOT_FIELDS: Final[dict[type[Any], Callable[[Any], dict[str, Any]]]] = {
    Lookup: lambda m: {"req_id": m.req_id, "keys": m.keys, "t": Lookup.TAG},
    LookupResp: lambda m: {"req_id": m.req_id, "hits": m.hits, "t": LookupResp.TAG},
    Fetch: lambda m: {"req_id": m.req_id, "keys": m.keys, "slots": m.slots, "t": Fetch.TAG},
    FetchHits: lambda m: {"req_id": m.req_id, "slots": m.slots, "t": FetchHits.TAG},
    TransferDone: lambda m: {
        "req_id": m.req_id,
        "outcomes": m.outcomes,
        "checksums": m.checksums,
        "t": TransferDone.TAG,
    },
}
_hot_encode: Final = msgspec.msgpack.Encoder().encode

# msgspec bounds a code by the range of known codes; while the codes are 0..N-1 (they
# are), that range is the set, and no second check is needed.
_Code = Annotated[int, msgspec.Meta(ge=0, le=max(_OUTCOMES))]
_OUTCOMES_ARE_A_RANGE: Final = len(_OUTCOMES) == max(_OUTCOMES) + 1


class _Hot(msgspec.Struct, forbid_unknown_fields=True):
    """Every field of the five hot messages, in one struct: decoded in one pass, a field
    no hot message has refused at its name, before its value is read. A union of one
    tagged struct per message (as before) first looks for the tag, which comes last, and
    skips every value before it unchecked: a frame whose list held nested lists, or that
    had a field no message has, cost msgspec a step per byte of it before any refusal
    (16 MiB: 30-50 ms of the Trio thread), and then the general path as much again."""

    t: str
    req_id: _U64
    keys: _Keys | msgspec.UnsetType = msgspec.UNSET
    hits: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    slots: Annotated[list[_U64], msgspec.Meta(max_length=MAX_KEYS)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    outcomes: Annotated[list[_Code], msgspec.Meta(max_length=MAX_KEYS)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    # UNSET (absent) and None (sent as nil) differ in the map's size, which is checked.
    checksums: (
        Annotated[list[_U64], msgspec.Meta(max_length=MAX_KEYS)] | msgspec.UnsetType | None
    ) = msgspec.UNSET


_hot_decode: Final = msgspec.msgpack.Decoder(_Hot).decode
_UNSET: Final = msgspec.UNSET
_FIXMAP_3: Final = 0x83
_FIXMAP_4: Final = 0x84


def _decode_hot(body: bytes | bytearray | memoryview) -> Message | None:
    """The hot message in ``body``, or ``None`` where the general path must decide.

    A hot message is a map of exactly its fields (3 or 4 with the tag), so the map's size
    is known before msgspec reads it. msgspec stops at a field no hot message has (the
    general path decides such a frame); a frame whose size differs from the number of
    fields it holds names one twice, and one holding fields of another hot message goes
    to the general path too. msgspec checks every bound and exact type (a bool is not an
    int, a str not bytes); what it cannot express (equal list lengths) is checked here.
    The message is then built without running its validators a second time.
    """
    size = body[0]
    if size != _FIXMAP_3 and size != _FIXMAP_4:
        return None
    try:
        hot = _hot_decode(body)
    except (msgspec.DecodeError, RecursionError):  # DecodeError includes ValidationError
        return None
    # t and req_id are required: where the message's own fields are set too and the map
    # holds just as many entries, it holds those fields once each and nothing else (a
    # field named twice, which msgspec takes the last of, leaves one unset or the count
    # short; the general path refuses it).
    t, three = hot.t, size == _FIXMAP_3
    msg: Message
    if t == Lookup.TAG:
        if not three or hot.keys is _UNSET:
            return None
        msg = trusted[Lookup](req_id=hot.req_id, keys=hot.keys)
    elif t == LookupResp.TAG:
        if not three or hot.hits is _UNSET:
            return None
        msg = trusted[LookupResp](req_id=hot.req_id, hits=hot.hits)
    elif t == Fetch.TAG:
        keys, slots = hot.keys, hot.slots
        if three or keys is _UNSET or slots is _UNSET or len(keys) != len(slots):
            return None
        msg = trusted[Fetch](req_id=hot.req_id, keys=keys, slots=slots)
    elif t == FetchHits.TAG:
        if not three or hot.slots is _UNSET:
            return None
        msg = trusted[FetchHits](req_id=hot.req_id, slots=hot.slots)
    elif t == TransferDone.TAG:
        outcomes, checksums = hot.outcomes, hot.checksums
        if outcomes is _UNSET:
            return None
        if checksums is _UNSET:
            if not three:
                return None
            checksums = None
        elif three or (checksums is not None and len(checksums) != len(outcomes)):
            return None
        if not _OUTCOMES_ARE_A_RANGE and not _OUTCOMES.issuperset(outcomes):
            return None
        msg = trusted[TransferDone](req_id=hot.req_id, outcomes=outcomes, checksums=checksums)
    else:
        return None
    return msg
