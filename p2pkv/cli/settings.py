"""Settings of the ``p2pkv`` commands: node configs from flags and files, the NIXL/UCX
environment defaults, and how a command runs its Trio loop."""

from __future__ import annotations

import argparse
import json
import os
import socket
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from .. import tls
from ..config import NodeConfig
from ..errors import P2PKVError

# Quiet NIXL with a fast first agent, unless the user says otherwise (see notes on NIXL).
ENV_DEFAULTS = {"UCX_MEM_MMAP_HOOK_MODE": "none", "NIXL_LOG_LEVEL": "WARN"}
KiB = 1024
MiB = 1024 * KiB
T = TypeVar("T")


def run_trio(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """``trio.run(fn, *args)`` with a ^C raised only at a checkpoint of the command's main
    task. Left to Trio's default, a ^C is raised wherever the main thread happens to run,
    and landing inside ``trio.fail_after``'s generator (its scope entered, the caller's
    ``with`` not yet) it left the scope on the stack: "Cancel scope stack corrupted", a
    traceback and exit status 1 instead of 130 (the Ctrl-C test, once in ~20 suite
    runs). At a checkpoint it cancels the command like any error, and the engine closes
    in order."""
    return trio.run(fn, *args, restrict_keyboard_interrupt_to_checkpoints=True)


def set_env_defaults(*, loopback: bool = True) -> None:
    """The NIXL/UCX environment defaults, where the user has not set them.

    On loopback UCX is kept on ``lo``; a node that talks to other hosts gets ``all``
    (UCX's own default), since the transport's fallback would otherwise pin it to ``lo``.
    """
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("UCX_NET_DEVICES", "lo" if loopback else "all")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets, ``[::1]:5710``, or bare, ``::1:5710``) as
    (host, port); ValueError naming what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"expected HOST:PORT with a numeric port, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be 1..65535, got {port}")
    return host, port


_NODE_FLAGS = {  # flag dest -> NodeConfig field
    "peer_id": "peer_id",
    "host": "host",
    "port": "port",
    "blocks": "num_blocks",
    "block_len": "block_len",
    "transport": "transport",
    "fingerprint": "fingerprint",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "tls_ca": "tls_ca",
}
_BYTES_FIELDS = {"hash_seed", "secret"}
_PATH_FIELDS = {"tls_cert", "tls_key", "tls_ca"}  # relative to the config file's folder


def load_config(path: Path) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON file of NodeConfig fields, plus ``fill`` and ``seed``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise P2PKVError(f"{path}: not UTF-8 text: {exc}") from exc
    try:
        data: Any = (
            tomllib.loads(text)
            if path.suffix == ".toml"
            else json.loads(text, object_pairs_hook=_once_each)
        )
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON (a .toml file is read as TOML)"
        raise P2PKVError(f"{path}: not valid {kind}: {exc}") from exc
    except _Twice as exc:
        raise P2PKVError(f"{path}: {exc.args[0]} is given twice") from None
    if not isinstance(data, dict):
        raise P2PKVError(f"{path}: expected a table of settings")
    known = {a.name for a in attrs.fields(NodeConfig)} | {"fill", "seed"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise P2PKVError(f"{path}: unknown settings {', '.join(unknown)}")
    for name in _BYTES_FIELDS & set(data):
        if isinstance(data[name], str):
            try:
                data[name] = data[name].encode()
            except UnicodeEncodeError as exc:  # a lone surrogate, which JSON may spell
                # Where, not what: the value may be the secret.
                raise P2PKVError(
                    f"{path}: {name} must be text UTF-8 can carry ({exc.reason} at {exc.start})"
                ) from None
    for name in _PATH_FIELDS & set(data):
        if isinstance(data[name], str):
            data[name] = os.fspath(path.parent / data[name])
    return data


class _Twice(Exception):
    """A JSON object names one member twice (its name in ``args[0]``)."""


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; :class:`_Twice` for a name given twice. ``json`` keeps the
    last silently, where TOML refuses the file: which of two secrets, ports or stores
    the user meant is not ours to guess."""
    data: dict[str, Any] = {}
    for name, value in pairs:
        if name in data:
            raise _Twice(name)
        data[name] = value
    return data


def serve_settings(args: argparse.Namespace) -> tuple[NodeConfig, int, int]:
    settings = load_config(Path(args.config)) if args.config else {}
    for dest, field in _NODE_FLAGS.items():
        if getattr(args, dest) is not None:
            settings[field] = getattr(args, dest)
    for dest in ("fill", "seed"):
        if getattr(args, dest) is not None:
            settings[dest] = getattr(args, dest)
    fill, seed = _demo_blocks(settings.pop("fill", 0), settings.pop("seed", 0))
    settings.setdefault("transport", "nixl")
    settings.setdefault("num_blocks", max(fill, 1024))
    cfg = _node_config(settings, f"{socket.gethostname()}-{os.getpid()}")
    if fill > cfg.num_blocks:
        raise P2PKVError(f"--fill {fill} is more than the store's {cfg.num_blocks} blocks")
    return cfg, fill, seed


def _demo_blocks(fill: object, seed: object) -> tuple[int, int]:
    """A config's ``fill`` and ``seed``, checked (P2PKVError naming the bad one)."""
    if type(fill) is not int or fill < 0:
        raise P2PKVError(f"fill must be an int >= 0, got {fill!r}")
    if type(seed) is not int or not -(1 << 63) <= seed < 1 << 63:
        raise P2PKVError(f"seed must be an int of 64 bits (signed), got {seed!r}")
    return fill, seed


def _node_config(settings: dict[str, Any], default_peer_id: str) -> NodeConfig:
    """``NodeConfig(**settings)``, P2PKVError if it is refused. Without a ``peer_id`` the
    node is the peer its TLS certificate names, else ``default_peer_id``."""
    if "peer_id" not in settings:
        cert = settings.get("tls_cert")
        if cert is not None and not isinstance(cert, str):
            # Read before NodeConfig checks it: the peer id comes from the certificate.
            raise P2PKVError(f"bad node settings: tls_cert must be a path, got {cert!r}")
        settings["peer_id"] = tls.cert_file_peer_id(cert) if cert else default_peer_id
    try:
        return NodeConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise P2PKVError(f"bad node settings: {exc}") from exc


def consumer_config(args: argparse.Namespace, peer_id: str) -> NodeConfig:
    return NodeConfig(
        peer_id=peer_id,
        num_blocks=args.blocks,
        block_len=args.block_len,
        transport=args.transport,
        fingerprint=args.fingerprint,
        tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None),
        tls_ca=getattr(args, "tls_ca", None),
        # Its store is sized to this one pull from the one peer it names.
        max_landing_share=1.0,
    )


# A config file given to ``fetch`` may be the serving node's own: these settings describe
# that node (who it is, by id and by certificate, where it listens, how big its store is),
# not the fetching one.
_SERVER_PLACE = ("peer_id", "host", "port", "num_blocks")  # no flag of fetch's sets these
_SERVER_ONLY = (*_SERVER_PLACE, "tls_cert", "tls_key")  # fetch's own TLS files: flags
# flag dest -> NodeConfig field; a flag given wins over the file (peer_id: see below)
_FETCH_FLAGS = {d: f for d, f in _NODE_FLAGS.items() if f not in _SERVER_PLACE}


def fetch_settings(args: argparse.Namespace, default_peer_id: str) -> tuple[NodeConfig, int, int]:
    """``p2pkv fetch``'s node config, and how many demo blocks of which seed to fetch.

    ``--config`` takes the file ``serve`` takes, the serving node's own included: what
    peers must agree on (``secret``, ``hash_algo``, ``hash_seed``, ``fingerprint``,
    ``block_len``) and the deadlines come from it, and its ``fill`` and ``seed`` are the
    defaults of ``--blocks`` and ``--seed``. Its ``peer_id``, ``host``, ``port``,
    ``num_blocks``, ``tls_cert`` and ``tls_key`` are the serving node's and are not used
    (with TLS, this node's certificate and key come from the flags; the file's CA
    stands). Flags win over the file."""
    settings = load_config(Path(args.config)) if args.config else {}
    identity = [name for name in ("tls_cert", "tls_key") if name in settings]
    for name in _SERVER_ONLY:
        settings.pop(name, None)
    if identity and (args.tls_cert is None or args.tls_key is None):
        # A fetch that took them would claim the serving node's own identity, and be
        # refused as "peer id ... is our own".
        raise P2PKVError(
            f"the config's {' and '.join(identity)} are the serving node's own identity: "
            "give this node's certificate and key with --tls-cert and --tls-key"
        )
    fill, seed = _demo_blocks(settings.pop("fill", 1024), settings.pop("seed", 0))
    blocks = args.blocks if args.blocks is not None else (fill or 1024)
    seed = args.seed if args.seed is not None else seed
    for dest, field in _FETCH_FLAGS.items():
        if getattr(args, dest) is not None:
            settings[field] = getattr(args, dest)
    settings.setdefault("block_len", 64 * KiB)
    settings.setdefault("transport", "nixl")
    # Its store is sized to this one pull from the one peer it names (a file may say less).
    settings.setdefault("max_landing_share", 1.0)
    if args.peer_id is not None:
        settings["peer_id"] = args.peer_id
    return _node_config({**settings, "num_blocks": blocks}, default_peer_id), blocks, seed
