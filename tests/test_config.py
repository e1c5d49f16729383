"""NodeConfig refuses what would break later, up front, with one error type."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
import pytest
import trio

from p2pkv import ConfigError, NodeConfig, P2PKVError, open_node
from p2pkv._switch import MIN_INTERVAL
from p2pkv.config import MIN_FRAME_SIZE

from .helpers import fill


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"port": 70000}, "port must be 0..65535"),  # was bound as port 4464
        ({"port": -1}, "port must be 0..65535"),
        ({"port": 65536}, "port must be 0..65535"),  # the first port past the range
        ({"port": "5710"}, "port must be int"),
        ({"secret": "s3cret"}, r"secret must be bytes \| None \(e\.g\. 'text'\.encode\(\)\)"),
        ({"secret": 5}, "secret must be bytes"),
        ({"hash_seed": "abc"}, "hash_seed must be bytes"),
        ({"verify_checksums": "no"}, "verify_checksums must be bool"),
        ({"num_blocks": 0}, "num_blocks must be > 0"),
        ({"num_blocks": 1.5}, "num_blocks must be int"),
        ({"block_len": "64"}, "block_len must be int"),
        ({"lease": True}, "lease must be float"),
        ({"peer_id": ""}, "peer_id must be 1..128"),
        ({"host": None}, "host must be str"),
        ({"transport": "tcp"}, "unknown transport"),
        ({"landing_margin": -1.0}, "landing_margin must be >= 0"),
        ({"max_landing_share": 0.0}, "max_landing_share must be > 0"),
        # Accepted, then refused by every peer of the same config (review 2026-12-04).
        ({"num_blocks": 9, "max_peer_blocks": 8}, r"num_blocks \(9\) is over max_peer_blocks"),
        ({"max_landing_share": 1.5}, r"max_landing_share \(1.5\) is a share of the store"),
        ({"max_pinned_share": 1.5}, r"max_pinned_share \(1.5\) is a share of the store"),
        ({"max_pinned_share": 0.0}, "max_pinned_share must be > 0"),
        ({"max_pinned_peer_share": 0.0}, "max_pinned_peer_share must be > 0"),
        ({"max_pinned_peer_share": math.nan}, "max_pinned_peer_share must be > 0"),
        ({"max_pinned_peer_share": 1.5}, r"max_pinned_peer_share \(1.5\) is a share"),
        # No slot at all: every lookup was answered all misses, the node serving nothing
        # without a word (review 2026-12-05).
        (
            {"num_blocks": 10, "max_pinned_share": 0.09},
            r"max_pinned_share \(0.09\) of num_blocks \(10\) is less than one slot",
        ),
        ({"num_blocks": 1, "max_pinned_share": 0.5}, "is less than one slot"),
        ({"switch_interval": 0.0}, "switch_interval must be None or >="),
        ({"heartbeat_interval": 5.0, "idle_timeout": 2.0}, "idle_timeout .* must exceed"),
        ({"quarantine": 1.0}, "quarantine .* must exceed abort_timeout"),
        ({"block_len": 4096, "max_inflight_bytes": 1024}, "less than one block"),
        ({"tls_cert": "c.pem"}, "tls_cert, tls_key and tls_ca together"),
        # Past the hello's limits: the node started, then every connection failed.
        ({"fingerprint": "f" * 1025}, "fingerprint must be at most 1024 characters"),
        ({"hash_algo": "h" * 65}, "hash_algo must be at most 64 characters"),
        ({"hash_seed": b"s" * 257}, "hash_seed must be at most 256 bytes"),
        ({"max_frame_size": 4095}, "max_frame_size must be at least 4096 bytes"),
        # HMAC with an empty key: on, and proving nothing (review 2026-12-05).
        ({"secret": b""}, "secret must be non-empty bytes"),
        # A converter runs before the validators: it names the field itself.
        ({"tls_cert": 5, "tls_key": "k", "tls_ca": "c"}, "tls_cert must be a path"),
        ({"tls_cert": "c", "tls_key": b"/k", "tls_ca": "c"}, "tls_key must be a path"),
        ({"tls_cert": "c", "tls_key": "k", "tls_ca": ["c"]}, "tls_ca must be a path"),
        ({"peer_id": "p" * 129}, "peer_id must be 1..128"),  # the hello's limit
        ({"peer_id": b"a"}, "peer_id must be str"),  # has a len(): passed the length check
        ({"hash_algo": b"sha256"}, "hash_algo must be str"),
        ({"fingerprint": b"model"}, "fingerprint must be str"),
        ({"max_key_len": 1025}, "max_key_len must be <= 1024"),
        ({"switch_interval": 1e-7}, "switch_interval must be None or >="),
        ({"heartbeat_interval": 5.0, "idle_timeout": 5.0}, "idle_timeout .* must exceed"),
        # landing_margin counts: a write may still land until abort_timeout + margin.
        (
            {"quarantine": 2.5, "abort_timeout": 2.0, "landing_margin": 1.0},
            "quarantine .* must exceed abort_timeout",
        ),
        (
            {"quarantine": 3.0, "abort_timeout": 2.0, "landing_margin": 1.0},
            "quarantine .* must exceed abort_timeout",
        ),
        ({"block_len": 4096, "max_inflight_bytes": 4095}, "less than one block"),
        # An int past a float's range, where seconds or a share are asked: it passed every
        # check, then raised OverflowError on Trio's clock (lease, the connect deadline) or
        # out of the constructor itself (landing_margin, summed with abort_timeout).
        ({"lease": 10**400}, r"lease must be at most 1.8e\+308 \(a float\), got a larger int"),
        ({"connect_timeout": 1 << 1024}, "connect_timeout must be at most 1.8e"),
        ({"landing_margin": 10**400}, "landing_margin must be at most 1.8e"),
        ({"max_pinned_share": 10**5000}, "max_pinned_share must be at most 1.8e"),
        # A lone surrogate (an undecodable byte of argv, under surrogateescape): the node
        # started, then every session crashed encoding its hello.
        ({"peer_id": "a\udcff"}, r"peer_id must be printable text, got 'a\\udcff'"),
        # Peers refuse a hello whose id is not printable (it reaches their logs and NIXL's
        # agent names): such a node could connect to nobody.
        ({"peer_id": "a\nb"}, r"peer_id must be printable text, got 'a\\nb'"),
        ({"peer_id": "a\x00"}, "peer_id must be printable text"),
        ({"fingerprint": "\ud800"}, "fingerprint must be text UTF-8 can carry"),
        ({"hash_algo": "sha\udc80"}, "hash_algo must be text UTF-8 can carry"),
        ({"host": "\udcff"}, "host must be text UTF-8 can carry"),
        # Past what the hello carries (an unsigned 64-bit int): the node started, then
        # every session crashed building its hello.
        ({"max_open_requests": 1 << 64}, r"max_open_requests must be at most 2\*\*64 - 1"),
        # Too long for an error message to show (Python's limit on int digits).
        (
            {"num_blocks": 10**5000, "max_peer_blocks": 10**5000},
            r"num_blocks must be at most 2\*\*64 - 1, got an int of 16610 bits",
        ),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_a_bad_value_is_a_config_error_naming_it(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        NodeConfig(**{"peer_id": "a", **kw})
    # One type, caught either way a caller may expect.
    assert isinstance(info.value, P2PKVError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kw",
    [
        {"port": 0},
        {"port": 65535},
        {"peer_id": "p" * 128},
        {"max_key_len": 1024},
        {"switch_interval": MIN_INTERVAL},
        {"max_frame_size": MIN_FRAME_SIZE},
        {"block_len": 4096, "max_inflight_bytes": 4096},  # one block in flight at a time
        {"num_blocks": 8, "max_peer_blocks": 8},  # a peer of this config takes our region
        {"max_pinned_share": 1.0, "max_landing_share": 1.0},
        {"num_blocks": 10, "max_pinned_share": 0.1},  # one slot peers may pin
        {"num_blocks": 1, "max_pinned_share": 1.0},  # 1 is no bound, whatever the store
        {"heartbeat_interval": 5.0, "idle_timeout": 5.5},
        {"quarantine": 3.5, "abort_timeout": 2.0, "landing_margin": 1.0},
        {"landing_margin": 0.0},
        {"max_open_requests": (1 << 64) - 1},
    ],
    ids=lambda v: "-".join(map(str, v.items())),
)
def test_a_value_at_the_edge_of_each_bound_is_accepted(kw: dict[str, Any]) -> None:
    """Every bound NodeConfig enforces lets its edge through: a bound one step too tight
    refuses a config that works (the refusal tests above prove the step past the edge)."""
    cfg = NodeConfig(**{"peer_id": "a", **kw})
    assert {name: getattr(cfg, name) for name in kw} == kw


def test_tls_files_may_be_path_objects_and_are_kept_as_str(tmp_path: Path) -> None:
    cfg = NodeConfig(peer_id="a", tls_cert=tmp_path / "c", tls_key=tmp_path / "k", tls_ca="ca")
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (
        str(tmp_path / "c"),
        str(tmp_path / "k"),
        "ca",
    )


async def test_numbers_of_any_kind_that_mean_the_same_are_plain_python_numbers() -> None:
    """A size or deadline computed with NumPy is taken as the plain number it means: a
    np.float32 deadline kept as such broke Trio's clock, a np.int64 size the store."""
    cfg = NodeConfig(
        peer_id="a",
        num_blocks=np.int64(8),  # type: ignore[arg-type]  # what a computed size often is
        lease=3,  # an int where seconds are asked
        fetch_timeout=np.float32(2.5),  # type: ignore[arg-type]
        lookup_timeout=np.float64(1.5),
        max_open_requests=np.int32(4),  # type: ignore[arg-type]
        nixl_copy_threads=None,
        switch_interval=None,
        secret=b"s",
    )
    assert (cfg.num_blocks, cfg.lease, cfg.fetch_timeout) == (8, 3, 2.5)
    assert type(cfg.num_blocks) is int and type(cfg.max_open_requests) is int
    assert type(cfg.fetch_timeout) is float and type(cfg.lookup_timeout) is float
    with trio.fail_after(10):
        async with open_node(cfg) as a, open_node(attrs.evolve(cfg, peer_id="b")) as b:
            keys = fill(a.store, 2, cfg.block_len)
            peer = await b.connect(a.address)
            assert await b.lookup(peer, keys) == [True, True]
            assert sorted((await b.fetch(peer, keys)).loaded) == sorted(keys)


@pytest.mark.parametrize("transport", ["local", pytest.param("nixl", marks=pytest.mark.nixl)])
async def test_values_at_the_hellos_limits_connect(transport: Literal["local", "nixl"]) -> None:
    """The longest fingerprint, hash_algo and hash_seed the config takes are what the
    hello carries: two such nodes connect and exchange blocks, with the smallest frame
    limit the config takes (a NIXL hello carries the agent's metadata too)."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu13")
    longest = NodeConfig(
        peer_id="s" * 128,
        fingerprint="f" * 1024,
        hash_algo="h" * 64,
        transport=transport,
        max_frame_size=MIN_FRAME_SIZE,
        num_blocks=64,
        block_len=4096,
    )
    longest = attrs.evolve(longest, hash_seed=b"s" * 256)
    with trio.fail_after(20):
        async with (
            open_node(longest) as src,
            open_node(attrs.evolve(longest, peer_id="d" * 128)) as dst,
        ):
            keys = fill(src.store, 2, src.config.block_len)
            peer = await dst.connect(src.address)
            assert sorted((await dst.fetch(peer, keys)).loaded) == sorted(keys)


def test_every_error_class_is_exported_where_users_import_errors_from() -> None:
    """``SlotsInUse`` was missing from ``p2pkv.errors.__all__`` (review 2026-12-04)."""
    import p2pkv
    import p2pkv.errors

    classes = {
        name
        for name, value in vars(p2pkv.errors).items()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == "p2pkv.errors"
    }
    assert classes == set(p2pkv.errors.__all__)
    assert classes <= set(p2pkv.__all__)
