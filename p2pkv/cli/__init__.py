"""The ``p2pkv`` command: ``demo``, ``serve`` and ``fetch``.

This module parses the command line and runs the command; each command lives in its own
module: :mod:`~p2pkv.cli.demo`, :mod:`~p2pkv.cli.serve`, :mod:`~p2pkv.cli.pull` (``fetch``
and the demo's consumer). :mod:`~p2pkv.cli.settings` builds node configs from flags and
files, :mod:`~p2pkv.cli.blocks` makes and verifies the demo's deterministic blocks, and
:mod:`~p2pkv.cli.child` runs child processes that talk JSON lines.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..errors import P2PKVError
from .blocks import demo_block, demo_keys, fill_store, verify_blocks
from .child import Child, ChildFailed, emit, receive_commands
from .demo import cmd_demo
from .pull import Progress, PullReport, cmd_fetch, finish, pull, render
from .serve import cmd_serve, serve, wait_for_stop
from .settings import (
    ENV_DEFAULTS,
    KiB,
    MiB,
    is_loopback,
    load_config,
    parse_address,
    set_env_defaults,
)


def _int(text: str, base: int = 10) -> int:
    try:
        return int(text, base)
    except ValueError:
        # An ArgumentTypeError's message is shown as it is; a ValueError's would name
        # this function ("invalid _port value").
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text, 0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seed(text: str) -> int:
    value = _int(text)
    if not -(1 << 63) <= value < 1 << 63:  # the demo keys take it as 8 signed bytes
        raise argparse.ArgumentTypeError(f"must fit in 64 bits (signed), got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < math.inf:  # NaN too; inf overflows the waits it bounds
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def _address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_blocks(p: argparse.ArgumentParser, *, blocks: int, from_config: bool = False) -> None:
    """The demo blocks' flags. ``from_config``: unset flags stay None, for the config
    file's values (or these defaults) to fill in (``fetch``)."""

    def default(value: object) -> dict[str, Any]:
        return {"default": None} if from_config else {"default": value}

    file = "--config, else " if from_config else ""  # where an unset flag's value comes from
    fill = "--config's fill, else " if from_config else ""
    p.add_argument(
        "--blocks",
        type=_positive_int,
        help=f"number of blocks (default: {fill}{blocks})",
        **default(blocks),
    )
    p.add_argument(
        "--block-len",
        type=_positive_int,
        help=f"bytes per block (default: {file}{64 * KiB})",
        **default(64 * KiB),
    )
    p.add_argument(
        "--seed",
        type=_seed,
        help=f"seed of the demo keys and block contents (default: {file}0)",
        **default(0),
    )
    p.add_argument(
        "--batch",
        type=_non_negative_int,
        default=0,
        help="blocks per fetch call (default: 0, all in one)",
    )
    p.add_argument(
        "--fingerprint",
        help=f"compatibility fingerprint (default: {file}none)",
        **default(""),
    )
    p.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)


def _add_tls(p: argparse.ArgumentParser) -> None:
    tls = p.add_argument_group(
        "mutual TLS of the control connection",
        "All three or none. The certificate must name this node's peer id as the URI "
        "p2pkv://PEER_ID in its subject alternative names; peers must use the same CA. "
        "The data plane (NIXL) is not encrypted.",
    )
    tls.add_argument("--tls-cert", metavar="PEM", help="this node's certificate")
    tls.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    tls.add_argument("--tls-ca", metavar="PEM", help="the CA that signs every peer's certificate")


def _add_log_level(p: argparse.ArgumentParser, *, default: str) -> None:
    """Before the command (the default) or after it: both spellings work, and the one
    after the command wins (a subcommand's default of SUPPRESS leaves the other alone)."""
    p.add_argument(
        "--log-level",
        default=default,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level on stderr (default: WARNING)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pkv", description="Share KV-cache blocks between inference workers over NIXL."
    )
    _add_log_level(parser, default="WARNING")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="two nodes, two processes, real NIXL: fetch blocks and verify every byte",
        description="Start a source node in a child process, fill it with deterministic "
        "blocks, connect to it from this process, look the keys up, fetch them in scattered "
        "order and verify every byte. Exits 0 only if every byte matched.",
    )
    demo.add_argument(
        "--transport",
        choices=["nixl", "local"],
        default="nixl",
        help="nixl: two processes (default); local: in-process copies, both nodes in this process",
    )
    demo.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        help="seconds to wait for the source process to start",
    )
    _add_blocks(demo, blocks=1024)
    demo.set_defaults(func=cmd_demo)

    serve_p = sub.add_parser(
        "serve",
        help="run a node until SIGINT/SIGTERM/SIGHUP",
        description="Run a node from flags and/or a config file until interrupted. When "
        "listening it prints one JSON line on stdout: "
        '{"event": "listening", "address": [host, port], ...}. Flags override the file.',
    )
    serve_p.add_argument(
        "--config",
        help="TOML (.toml) or JSON file of NodeConfig fields "
        "(plus fill, seed); strings for hash_seed/secret are UTF-8; tls_* paths are "
        "relative to the file",
    )
    serve_p.add_argument(
        "--peer-id",
        help="this node's peer id (default: HOSTNAME-PID; with TLS, the one its certificate names)",
    )
    serve_p.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve_p.add_argument("--port", type=_port, help="port to listen on (default: 0, any)")
    serve_p.add_argument(
        "--blocks", type=_positive_int, help="store capacity in blocks (default: max(fill, 1024))"
    )
    serve_p.add_argument("--block-len", type=_positive_int, help="bytes per block (default 65536)")
    serve_p.add_argument("--transport", choices=["nixl", "local"], help="data plane (default nixl)")
    serve_p.add_argument("--fingerprint", help="compatibility fingerprint")
    serve_p.add_argument(
        "--fill", type=_non_negative_int, help="put this many demo blocks in the store"
    )
    serve_p.add_argument("--seed", type=_seed, help="seed of the demo blocks (default 0)")
    serve_p.add_argument(
        "--exit-on-eof",
        action="store_true",
        help="also stop when stdin reaches EOF (for a parent process)",
    )
    _add_tls(serve_p)
    serve_p.set_defaults(func=cmd_serve)

    fetch = sub.add_parser(
        "fetch",
        help="fetch the demo blocks from a running `serve --fill` and verify them",
        description="Connect to HOST:PORT (a `p2pkv serve --fill N --seed S`), fetch the N "
        "demo blocks and verify every byte. Exits 0 only if every byte matched.",
    )
    fetch.add_argument(
        "address", type=_address, help="HOST:PORT of the serving node ([V6]:PORT for IPv6)"
    )
    fetch.add_argument(
        "--peer-id",
        help="this node's peer id (default: HOSTNAME-fetch-PID; with TLS, the one its "
        "certificate names)",
    )
    fetch.add_argument(
        "--config",
        help="TOML (.toml) or JSON file of NodeConfig fields, as `serve` takes (the serving "
        "node's own will do): secret, hash_seed, fingerprint, block_len and deadlines come "
        "from it, fill and seed are the defaults of --blocks and --seed; its peer_id, "
        "host, port, num_blocks, tls_cert and tls_key are the serving node's and are not "
        "used (give this node's own with --tls-cert and --tls-key; its tls_ca is used)",
    )
    fetch.add_argument(
        "--transport",
        choices=["nixl", "local"],
        help="data plane (default: --config, else nixl)",
    )
    _add_blocks(fetch, blocks=1024, from_config=True)
    _add_tls(fetch)
    fetch.set_defaults(func=cmd_fetch)
    for command in (demo, serve_p, fetch):
        _add_log_level(command, default=argparse.SUPPRESS)
    return parser


def _lacking_streams_to_devnull() -> None:
    """A standard stream the process was started without (its descriptor closed: ``>&-``,
    a supervisor that closes them) is /dev/null, as a daemon's are. Python leaves
    ``sys.stdout`` (``sys.stdin``, ``sys.stderr``) None then: ``serve``'s listening line
    and ``--exit-on-eof`` were AttributeError tracebacks. And the next descriptor opened
    takes the free number, for a library that writes to stdout (UCX logs there) to write
    into an epoll descriptor or a socket."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
        except OSError:  # closed: /dev/null takes its number
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115
        else:  # its number was taken since (not ours to close): a /dev/null of its own
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))  # noqa: SIM115


def main(argv: Sequence[str] | None = None) -> int:
    _lacking_streams_to_devnull()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        code: int = args.func(args)
    except (P2PKVError, OSError) as exc:
        print(f"p2pkv {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError as exc:  # e.g. --blocks x --block-len beyond this machine
        print(f"p2pkv {args.command}: error: not enough memory ({exc})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:
        # Trio raises a ^C in whichever task runs: one of the engine's carries it out of
        # the node's nursery in a group, beside what the others raised as they were cut.
        if group.subgroup(KeyboardInterrupt) is not None:
            return 130
        raise
    return code


__all__ = [
    "ENV_DEFAULTS",
    "Child",
    "ChildFailed",
    "KiB",
    "MiB",
    "Progress",
    "PullReport",
    "build_parser",
    "cmd_demo",
    "cmd_fetch",
    "cmd_serve",
    "demo_block",
    "demo_keys",
    "emit",
    "fill_store",
    "finish",
    "is_loopback",
    "load_config",
    "main",
    "pull",
    "receive_commands",
    "render",
    "serve",
    "set_env_defaults",
    "verify_blocks",
    "wait_for_stop",
]
