"""Node configuration: identity, region layout, deadlines and per-peer caps."""

from __future__ import annotations

import hashlib
import numbers
import operator
import os
import sys
from typing import Any, Literal

import attrs

from ._switch import MIN_INTERVAL
from .errors import ConfigError
from .transport._nixl_agent import MAX_PARALLELISM
from .wire import MAX_PEER_ID, U64_MAX

# The smallest max_frame_size: room for a hello whose texts are ASCII (its fields within
# their limits, ~1.5 KB at most, plus NIXL's metadata: ~300 B and 44 B a registered
# region). The limits count characters, not bytes: a non-ASCII fingerprint of 1,024
# characters alone takes up to 4 KB, which a peer at this smallest size refuses (typed).
MIN_FRAME_SIZE = 4096

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 2  # 1.1: max_open_requests in the hello; 1.2: fetch_hits


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (numbers.Integral,),  # NumPy's integers too
    "float": (numbers.Real,),
    "bool": (bool,),
    "str": (str,),
    "bytes": (bytes,),
    "None": (type(None),),
}


def _check_type(attr: attrs.Attribute[Any], value: object) -> None:
    """``value`` is of ``attr``'s declared type (an int is a float; a bool is neither)."""
    declared = str(attr.type)
    if declared.startswith("Literal"):
        return  # checked in __attrs_post_init__
    allowed = tuple(t for part in declared.split(" | ") for t in _TYPES.get(part, (object,)))
    ok = isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))
    if not ok:
        hint = " (e.g. 'text'.encode())" if bytes in allowed and isinstance(value, str) else ""
        # A field kept out of the repr (the secret) is kept out of its errors too: they
        # reach logs (a config file's secret written as a number was printed whole).
        shown = f" {value!r}" if attr.repr else ""
        raise ConfigError(
            f"{attr.name} must be {declared}{hint}, got {type(value).__name__}{shown}"
        )


def _typed(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    _check_type(attr, value)


def check_seconds(value: object, name: str) -> float:
    """A caller's number of seconds (a timeout, a deadline), checked where it is passed:
    TypeError for what is not a real number (a bool neither), ValueError for a negative
    one or NaN, or one past a float's range (an int: ``float()`` raises OverflowError for
    it). ``math.inf`` is a number: "no limit of mine"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        raise ValueError(
            f"{name} must be at most {sys.float_info.max:.2g} seconds (a float), got a "
            f"larger {type(value).__name__}"
        ) from None
    if not seconds >= 0:  # NaN as well
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return seconds


def _positive(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    _check_type(attr, value)
    if not value > 0:
        raise ConfigError(f"{attr.name} must be > 0, got {value!r}")


def _copy_threads(_inst: object, attr: attrs.Attribute[Any], value: int | None) -> None:
    _check_type(attr, value)
    if value is not None and not 1 <= value <= MAX_PARALLELISM:
        raise ConfigError(f"{attr.name} must be None or 1..{MAX_PARALLELISM}, got {value!r}")


def _switch_interval(_inst: object, attr: attrs.Attribute[Any], value: float | None) -> None:
    _check_type(attr, value)
    if value is not None and not value >= MIN_INTERVAL:
        raise ConfigError(f"{attr.name} must be None or >= {MIN_INTERVAL} s, got {value!r}")


def _port(_inst: object, attr: attrs.Attribute[Any], value: int) -> None:
    _check_type(attr, value)
    if not 0 <= value <= 65535:
        raise ConfigError(f"{attr.name} must be 0..65535 (0: any free port), got {value!r}")


def _to_path(value: object, name: str) -> str | None:
    """A converter: it runs before any validator, so it checks the type itself (os.fspath
    would raise a TypeError naming no field, and would let bytes through)."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise ConfigError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    return path


# Named functions: mypy's attrs plugin reads a converter's type only from one.
def _tls_cert(value: str | os.PathLike[str] | None) -> str | None:
    return _to_path(value, "tls_cert")


def _tls_key(value: str | os.PathLike[str] | None) -> str | None:
    return _to_path(value, "tls_key")


def _tls_ca(value: str | os.PathLike[str] | None) -> str | None:
    return _to_path(value, "tls_ca")


def _all_or_no_tls_files(inst: NodeConfig, _attr: attrs.Attribute[Any], _value: object) -> None:
    given = [f for f in ("tls_cert", "tls_key", "tls_ca") if getattr(inst, f) is not None]
    if given and len(given) != 3:
        raise ConfigError(f"TLS needs tls_cert, tls_key and tls_ca together; only {given} given")


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    _check_type(attr, value)
    if not value >= 0:
        raise ConfigError(f"{attr.name} must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything a node needs. Immutable; every deadline is in seconds on the Trio clock.

    Two nodes only talk when their protocol major version, ``block_len``, ``fingerprint``
    and ``hash_algo``/``hash_seed`` agree: blocks are addressed by hash, so peers that
    hash differently or lay out blocks differently must never exchange them.
    """

    peer_id: str = attrs.field(validator=_typed)
    host: str = attrs.field(default="127.0.0.1", validator=_typed)
    port: int = attrs.field(default=0, validator=_port)
    num_blocks: int = attrs.field(default=1024, validator=_positive)
    block_len: int = attrs.field(default=64 * 1024, validator=_positive)
    transport: Literal["local", "nixl"] = "local"
    # NIXL over host memory: threads copying one transfer (None: P2PKV_NIXL_COPY_THREADS,
    # else one per 2 cores, at least 2 (1 on a single core), at most 8; set by hand, at most
    # MAX_PARALLELISM; see docs/design.md, "Data plane parallelism").
    nixl_copy_threads: int | None = attrs.field(default=None, validator=_copy_threads)
    # While a node runs on its own engine thread (start_node, the vLLM integrations): the
    # interpreter's switch interval at most this (seconds), so that a host thread busy in
    # Python hands the GIL to the engine within it instead of Python's 5 ms; None leaves it
    # alone. Process-wide and shared by the running engines (see p2pkv._switch and
    # docs/design.md, "A busy host and the GIL"); open_node never touches it.
    switch_interval: float | None = attrs.field(default=0.001, validator=_switch_interval)

    # Compatibility: peers must agree on these (checked at handshake).
    fingerprint: str = attrs.field(default="", validator=_typed)  # e.g. model + dtype
    hash_algo: str = attrs.field(default="sha256", validator=_typed)
    hash_seed: bytes = attrs.field(default=b"", validator=_typed)
    # Optional HMAC authentication of peers: both sides must hold the same secret.
    secret: bytes | None = attrs.field(default=None, repr=False, validator=_typed)
    # Producer sends a crc32 per block in transfer_done; consumer verifies before loading.
    verify_checksums: bool = attrs.field(default=False, validator=_typed)

    # Deadlines (seconds).
    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    handshake_timeout: float = attrs.field(default=10.0, validator=_positive)
    lookup_timeout: float = attrs.field(default=5.0, validator=_positive)
    fetch_timeout: float = attrs.field(default=30.0, validator=_positive)
    abort_timeout: float = attrs.field(default=2.0, validator=_positive)
    idle_timeout: float = attrs.field(default=30.0, validator=_positive)
    heartbeat_interval: float = attrs.field(default=5.0, validator=_positive)
    # Pins held for a lookup; no write of the round is posted after it (a fetch that
    # waited for the data plane past it gets LEASE_EXPIRED for the keys not posted).
    lease: float = attrs.field(default=10.0, validator=_positive)
    # Slots of an unsettled write stay unusable this long; must exceed abort_timeout plus
    # landing_margin (checked below).
    quarantine: float = attrs.field(default=5.0, validator=_positive)
    registration_timeout: float = attrs.field(default=30.0, validator=_positive)
    close_timeout: float = attrs.field(default=5.0, validator=_positive)

    # Caps (per peer unless said otherwise).
    max_peers: int = attrs.field(default=64, validator=_positive)  # per node
    max_open_requests: int = attrs.field(default=64, validator=_positive)
    max_keys_per_request: int = attrs.field(default=65536, validator=_positive)
    max_pinned_blocks: int = attrs.field(default=65536, validator=_positive)
    # Of this node's own store (not per peer): the share of its slots that peers' lookups
    # may hold pinned, all peers together; hits past it are answered as misses. Pinned
    # slots cannot be evicted: at 1 (the default, so a peer may fetch a full store in one
    # go) one peer can pin every slot and the host's put raises StoreFull until it calls
    # release_unused_pins. A host that keeps putting while it serves sets e.g. 0.5. Where
    # the host pins (a pin source, vLLM) the host bounds its own.
    max_pinned_share: float = attrs.field(default=1.0, validator=_positive)
    # Of a node-wide bound on pins (``max_pinned_share``'s slots when it is below 1, or a
    # pin source's ``max_blocks``): the part one peer's rounds may hold at once, so one
    # peer that keeps its rounds open (a new lookup as each lease ends) cannot leave
    # every other peer's lookups all misses. 1: first come, first served. Without a
    # node-wide bound it changes nothing (``max_pinned_blocks`` caps each peer).
    max_pinned_peer_share: float = attrs.field(default=0.5, validator=_positive)
    # Of this node's own store, per peer: the share of its slots that one peer's writes
    # may hold at once, i.e. slots reserved for our fetches from it in flight plus slots
    # quarantined after we gave up on one (a write may still land there). Keys of a
    # fetch past it fail locally, nothing asked for them, so a producer that says "hit"
    # and never writes cannot make fetches from other peers meet StoreFull. A fetch
    # larger than this share of the store from one peer loads in parts, one after the
    # other, each waiting for the last one's slots to settle (docs/design.md).
    max_landing_share: float = attrs.field(default=0.5, validator=_positive)
    max_inflight_bytes: int = attrs.field(default=8 << 30, validator=_positive)
    max_frame_size: int = attrs.field(default=16 << 20, validator=_positive)
    max_key_len: int = attrs.field(default=128, validator=_positive)
    # Large fetches are posted as several handles of at most this many bytes, so one
    # request never holds the data plane for long and failures stay per chunk.
    transfer_chunk_bytes: int = attrs.field(default=256 << 20, validator=_positive)
    # The largest region (in blocks) a peer's hello may claim; registering a region costs
    # memory and time in proportion to its blocks, so bigger claims are refused up front.
    max_peer_blocks: int = attrs.field(default=1 << 21, validator=_positive)
    # A peer id may make us start at most this many registrations (each connection it
    # dials, each restart on a connection) within ``peer_registration_window`` seconds; a
    # hello over it is refused. Registrations run one at a time on a thread every peer
    # shares, so a peer in a restart loop would otherwise keep the others' waiting. A
    # client that connects and disconnects more than once a second is refused too.
    max_peer_registrations: int = attrs.field(default=60, validator=_positive)
    peer_registration_window: float = attrs.field(default=60.0, validator=_positive)
    # A hello claiming the peer id of a live, established session is refused if that
    # session answers a ping within this time (so no one can take over a live peer's id);
    # otherwise the old session is taken to be dead and is replaced.
    probe_timeout: float = attrs.field(default=2.0, validator=_positive)
    # What one peer can make us hold: keys of its lookups being answered, its pins and the
    # keys of its fetches being written. A lookup over it is answered all misses (nothing
    # pinned), a fetch over it gets OVER_CAP for every key; the session stays up.
    max_keys_held_per_peer: int = attrs.field(default=131072, validator=_positive)
    # Fairness: a session handles at most this much of its peer's input before it sends
    # what it has and lets the other sessions run (a big lookup is pinned in such slices).
    max_events_per_turn: int = attrs.field(default=64, validator=_positive)
    max_keys_per_turn: int = attrs.field(default=1024, validator=_positive)

    # Optional mutual TLS of the control connection (p2pkv/tls.py): paths to PEM files of
    # this node's certificate (naming its peer id), its private key, and the CA that signs
    # every peer's certificate. All three or none.
    tls_cert: str | None = attrs.field(default=None, converter=_tls_cert)
    tls_key: str | None = attrs.field(default=None, converter=_tls_key)
    tls_ca: str | None = attrs.field(
        default=None, converter=_tls_ca, validator=_all_or_no_tls_files
    )

    # How long the data plane may keep writing after a transfer handle was released
    # (NIXL: up to ~1 s, notes/nixl.md). A consumer that gave up on a fetch cannot see the
    # producer's writes stop, so it keeps the slots quarantined for ``quarantine`` seconds:
    # the producer's abort deadline, then this margin, must both fit inside it.
    landing_margin: float = attrs.field(default=1.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        # Plain Python numbers from here on: a NumPy number passes the checks above but
        # behaves differently later (np.float32 deadlines stay float32 on Trio's clock).
        # A float field is a float: an int past a float's range would raise OverflowError
        # wherever a deadline is computed from it (Trio's clock, a sum of deadlines), once
        # the node is running.
        for field in attrs.fields(NodeConfig):
            value = getattr(self, field.name)
            kind = str(field.type).split(" | ")[0]
            if value is None:
                continue
            if kind == "int" and type(value) is not int:
                object.__setattr__(self, field.name, operator.index(value))
            elif kind == "float" and type(value) is not float:
                try:
                    plain = float(value)
                except OverflowError:
                    raise ConfigError(
                        f"{field.name} must be at most {sys.float_info.max:.2g} (a float), "
                        f"got a larger {type(value).__name__}"
                    ) from None
                object.__setattr__(self, field.name, plain)
            if kind == "int" and getattr(self, field.name) > U64_MAX:
                # The hello carries such counts as unsigned 64-bit ints (max_open_requests):
                # past it no hello of ours could be built, and every session crashed.
                raise ConfigError(
                    f"{field.name} must be at most 2**64 - 1, got an int of "
                    f"{getattr(self, field.name).bit_length()} bits"
                )
        if not self.peer_id or len(self.peer_id) > MAX_PEER_ID:
            raise ConfigError(f"peer_id must be 1..{MAX_PEER_ID} characters, got {self.peer_id!r}")
        if not self.peer_id.isprintable():
            # Peers refuse a hello whose id is not (it reaches their logs and NIXL's agent
            # names): a node with such an id could connect to nobody.
            raise ConfigError(f"peer_id must be printable text, got {self.peer_id!r}")
        # What the hello carries, within its limits (wire.Hello): past them every
        # connection failed, the node having started and listened without a word.
        for name, limit, unit in (
            ("fingerprint", 1024, "characters"),
            ("hash_algo", 64, "characters"),
            ("hash_seed", 256, "bytes"),
        ):
            if len(getattr(self, name)) > limit:
                raise ConfigError(f"{name} must be at most {limit} {unit} (the hello's limit)")
        # (peer_id: its printable check above refuses a lone surrogate already.)
        for name in ("fingerprint", "hash_algo", "host"):
            try:
                getattr(self, name).encode()
            except UnicodeEncodeError as exc:
                # A lone surrogate (what an undecodable byte of a command line or a file
                # name becomes): no hello carries it, so every session would crash (and
                # no address lookup takes it).
                raise ConfigError(
                    f"{name} must be text UTF-8 can carry, got {getattr(self, name)!r} "
                    f"({exc.reason} at {exc.start})"
                ) from None
        if self.secret is not None and not self.secret:
            # An empty key turns the HMAC handshake on and proves nothing: any peer holds
            # it. A host that read its secret from an unset variable would believe itself
            # authenticated (the vLLM tier refuses it too).
            raise ConfigError("secret must be non-empty bytes (None turns authentication off)")
        if self.max_frame_size < MIN_FRAME_SIZE:
            # Below it no hello fits: every connection either way would fail, after the
            # node had started and listened.
            raise ConfigError(
                f"max_frame_size must be at least {MIN_FRAME_SIZE} bytes: a hello must fit "
                f"(a few hundred bytes plus NIXL's metadata), got {self.max_frame_size}"
            )
        if self.transport not in ("local", "nixl"):
            raise ConfigError(f"unknown transport {self.transport!r} (use 'local' or 'nixl')")
        if self.max_key_len > 1024:
            raise ConfigError("max_key_len must be <= 1024")
        if self.max_inflight_bytes < self.block_len:
            raise ConfigError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) is less than one block "
                f"({self.block_len}): every fetch from this node would be refused"
            )
        if self.max_pinned_share > 1:
            raise ConfigError(
                f"max_pinned_share ({self.max_pinned_share}) is a share of the store: at most 1"
            )
        if self.max_pinned_peer_share > 1:
            raise ConfigError(
                f"max_pinned_peer_share ({self.max_pinned_peer_share}) is a share of the "
                "node-wide pin bound: at most 1"
            )
        if self.max_pinned_share < 1 and int(self.num_blocks * self.max_pinned_share) < 1:
            # The producer's bound, as it computes it: no slot at all, so every lookup of
            # every peer would be answered all misses, the node serving nothing, silently.
            raise ConfigError(
                f"max_pinned_share ({self.max_pinned_share}) of num_blocks "
                f"({self.num_blocks}) is less than one slot: peers could pin nothing and "
                "every lookup would miss"
            )
        if self.num_blocks > self.max_peer_blocks:
            raise ConfigError(
                f"num_blocks ({self.num_blocks}) is over max_peer_blocks "
                f"({self.max_peer_blocks}): a peer with this config would refuse this "
                "node's region; raise max_peer_blocks on every node, or use fewer blocks"
            )
        if self.max_landing_share > 1:
            raise ConfigError(
                f"max_landing_share ({self.max_landing_share}) is a share of the store: at most 1"
            )
        if not self.idle_timeout > self.heartbeat_interval:
            raise ConfigError(
                f"idle_timeout ({self.idle_timeout} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval} s): an idle peer would be dropped before its ping"
            )
        if not self.quarantine > self.abort_timeout + self.landing_margin:
            raise ConfigError(
                f"quarantine ({self.quarantine} s) must exceed abort_timeout "
                f"({self.abort_timeout} s) + landing_margin ({self.landing_margin} s): "
                "a write may land until then"
            )

    def compat_digest(self) -> str:
        """What must match between peers, as one short digest (for logs)."""
        h = hashlib.sha256()
        for part in (
            str(PROTOCOL_MAJOR),
            str(self.block_len),
            self.fingerprint,
            self.hash_algo,
            self.hash_seed.hex(),
        ):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:16]
