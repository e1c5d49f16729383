"""The ``p2pkv`` command: ``demo``, ``serve`` and ``fetch``.

``p2pkv demo`` is the end-to-end check a reader runs first: a source node in a child
process fills its store with deterministic blocks, this process connects to it (the cold
connect is timed), looks the keys up, fetches them over NIXL in scattered order and
verifies every byte against what it computes itself. It exits 0 only if every byte
matched.

Block contents are derived from the key, so a consumer needs nothing but the seed to know
the bytes it should get: ``key_i = sha256(seed, i)`` and block = a pseudo-random base block
(fixed per seed and block length) XOR the key's first 8 bytes, repeated. Cheap (one pass
over memory), and every word of a block depends on both its position and its key, so a
missing, stale, shifted or swapped block never verifies.

The child process is always reaped: :class:`Child` closes its stdin (``serve
--exit-on-eof`` stops on EOF, so it also stops if this process dies), sends SIGTERM, and
kills it if it has not exited within the grace time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from .config import NodeConfig
from .errors import P2PKVError
from .node import Node, open_node
from .store import BlockStore

log = logging.getLogger("p2pkv.cli")

# Quiet NIXL with a fast first agent, unless the user says otherwise (see notes on NIXL).
ENV_DEFAULTS = {"UCX_MEM_MMAP_HOOK_MODE": "none", "NIXL_LOG_LEVEL": "WARN"}
KiB = 1024
MiB = 1024 * KiB


def set_env_defaults(*, loopback: bool = True) -> None:
    """The NIXL/UCX environment defaults, where the user has not set them.

    On loopback UCX is kept on ``lo``; a node that talks to other hosts gets ``all``
    (UCX's own default), since the transport's fallback would otherwise pin it to ``lo``.
    """
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("UCX_NET_DEVICES", "lo" if loopback else "all")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


# --- demo blocks --------------------------------------------------------------------------


def demo_keys(n: int, seed: int = 0) -> list[bytes]:
    """The ``n`` demo keys for ``seed``: ``sha256(seed || i)``, 32 bytes each."""
    prefix = seed.to_bytes(8, "little", signed=True)
    return [hashlib.sha256(prefix + i.to_bytes(8, "little")).digest() for i in range(n)]


@functools.lru_cache(maxsize=8)
def _base_block(block_len: int, seed: int) -> npt.NDArray[np.uint64]:
    words = -(-block_len // 8)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, block_len])
    base = np.frombuffer(rng.bytes(words * 8), dtype=np.uint64)
    base.flags.writeable = False
    return base


def demo_block(key: bytes, block_len: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """The bytes of ``key``'s demo block (a new array)."""
    word = np.uint64(int.from_bytes(key[:8], "little"))
    return np.bitwise_xor(_base_block(block_len, seed), word).view(np.uint8)[:block_len]


def fill_store(store: BlockStore, keys: Sequence[bytes], seed: int = 0) -> None:
    for key in keys:
        store.put(key, demo_block(key, store.block_len, seed))


def verify_blocks(store: BlockStore, keys: Sequence[bytes], seed: int = 0) -> list[bytes]:
    """Keys whose block is missing from ``store`` or differs from the demo bytes in any byte."""
    bad: list[bytes] = []
    for key in keys:
        view = store.get(key)
        got = None if view is None else np.frombuffer(view, dtype=np.uint8)
        if got is None or not np.array_equal(got, demo_block(key, store.block_len, seed)):
            bad.append(key)
    return bad


# --- child processes ----------------------------------------------------------------------


class ChildFailed(P2PKVError):
    """A child process died, or did not say what we waited for in time."""


class Child:
    """A Python child process that reports JSON lines on stdout; always reaped.

    Lines that are not JSON objects (a library logging to stdout) are passed to stderr.
    Use as a context manager, or call :meth:`close` in a ``finally``.
    """

    def __init__(self, argv: Sequence[str], *, name: str = "child") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, message: dict[str, Any]) -> None:
        """One JSON line to the child's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next JSON object the child prints; raises :class:`ChildFailed` on exit/timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ChildFailed(f"{self.name} said nothing for {timeout:.0f} s") from None
            if line is None:
                self._lines.put(None)
                rc = self.proc.wait()
                raise ChildFailed(f"{self.name} exited with status {rc}")
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                message = None
            if isinstance(message, dict):
                return message
            sys.stderr.write(line)

    def close(self, grace: float = 10.0) -> int:
        """Stop the child and reap it; its exit status.

        EOF on stdin first (our children stop on it), SIGTERM if it is still running
        ``grace / 2`` seconds later, SIGKILL after ``grace``.
        """
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        for action in (None, self.proc.terminate, self.proc.kill):
            if action is not None:
                if action is self.proc.kill:
                    log.warning("%s (pid %d) ignored SIGTERM: killing it", self.name, self.pid)
                action()
            try:
                rc = self.proc.wait(timeout=grace / 2)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            rc = self.proc.wait()
        self._reader.join(timeout=5.0)
        return rc

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, message: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Send one command and wait for the child's next JSON line."""
        self.send(message)
        return self.receive(timeout)


async def receive_commands() -> AsyncIterator[dict[str, Any]]:
    """JSON-line commands from stdin until EOF: the child's half of :class:`Child`."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    pending = b""
    async with stdin:
        while chunk := await stdin.receive_some():
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)


def emit(message: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed (what :meth:`Child.receive` reads)."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# --- serve --------------------------------------------------------------------------------


async def wait_for_stop(signals: AsyncIterator[int], *, exit_on_eof: bool) -> str:
    """Until a signal arrives on ``signals`` (or EOF on stdin when ``exit_on_eof``); why."""
    why: list[str] = []
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            async for signum in signals:
                why.append(signal.Signals(signum).name)
                nursery.cancel_scope.cancel()

        async def on_eof() -> None:
            async for _command in receive_commands():
                pass
            why.append("stdin closed")
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        if exit_on_eof:
            nursery.start_soon(on_eof)
    return why[0] if why else "stopped"


async def serve(cfg: NodeConfig, *, fill: int, seed: int, exit_on_eof: bool) -> None:
    # Catch the signals before saying we listen: a parent may stop us right after.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_node(cfg) as node:
            if fill:
                t0 = time.perf_counter()
                fill_store(node.store, demo_keys(fill, seed), seed)
                log.info("filled %d blocks in %.2f s", fill, time.perf_counter() - t0)
            host, port = node.address
            emit(
                {
                    "event": "listening",
                    "address": [host, port],
                    "peer_id": cfg.peer_id,
                    "transport": cfg.transport,
                    "blocks": len(node.store),
                    "pid": os.getpid(),
                }
            )
            log.info("%s listening on %s:%d (%s)", cfg.peer_id, host, port, cfg.transport)
            why = await wait_for_stop(signals, exit_on_eof=exit_on_eof)
            log.info("%s: %s, closing", cfg.peer_id, why)


_NODE_FLAGS = {  # flag dest -> NodeConfig field
    "peer_id": "peer_id",
    "host": "host",
    "port": "port",
    "blocks": "num_blocks",
    "block_len": "block_len",
    "transport": "transport",
    "fingerprint": "fingerprint",
}
_BYTES_FIELDS = {"hash_seed", "secret"}


def load_config(path: Path) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON file of NodeConfig fields, plus ``fill`` and ``seed``."""
    text = path.read_text()
    data: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    if not isinstance(data, dict):
        raise P2PKVError(f"{path}: expected a table of settings")
    known = {a.name for a in attrs.fields(NodeConfig)} | {"fill", "seed"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise P2PKVError(f"{path}: unknown settings {', '.join(unknown)}")
    for name in _BYTES_FIELDS & set(data):
        if isinstance(data[name], str):
            data[name] = data[name].encode()
    return data


def _serve_settings(args: argparse.Namespace) -> tuple[NodeConfig, int, int]:
    settings = load_config(Path(args.config)) if args.config else {}
    for dest, field in _NODE_FLAGS.items():
        if getattr(args, dest) is not None:
            settings[field] = getattr(args, dest)
    for dest in ("fill", "seed"):
        if getattr(args, dest) is not None:
            settings[dest] = getattr(args, dest)
    fill, seed = int(settings.pop("fill", 0)), int(settings.pop("seed", 0))
    settings.setdefault("peer_id", f"{socket.gethostname()}-{os.getpid()}")
    settings.setdefault("transport", "nixl")
    settings.setdefault("num_blocks", max(fill, 1024))
    try:
        cfg = NodeConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise P2PKVError(f"bad node settings: {exc}") from exc
    if fill > cfg.num_blocks:
        raise P2PKVError(f"--fill {fill} is more than the store's {cfg.num_blocks} blocks")
    return cfg, fill, seed


def cmd_serve(args: argparse.Namespace) -> int:
    cfg, fill, seed = _serve_settings(args)
    set_env_defaults(loopback=is_loopback(cfg.host))
    trio.run(functools.partial(serve, cfg, fill=fill, seed=seed, exit_on_eof=args.exit_on_eof))
    return 0


# --- the consumer: connect, lookup, fetch, verify --------------------------------------------


@attrs.define
class PullReport:
    blocks: int
    block_len: int
    connect_s: float = 0.0
    lookup_s: float = 0.0
    hits: int = 0
    fetch_s: float = 0.0
    loaded: int = 0
    failed: dict[bytes, str] = attrs.Factory(dict)
    bad: list[bytes] = attrs.Factory(list)
    verify_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_len

    @property
    def verified(self) -> bool:
        return self.loaded == self.blocks and not self.failed and not self.bad


Progress = Callable[[str], None]


async def pull(
    node: Node,
    address: tuple[str, int],
    keys: Sequence[bytes],
    *,
    seed: int,
    batch: int,
    progress: Progress,
    corrupt: bool = False,
) -> PullReport:
    """Connect to ``address``, look ``keys`` up, fetch them (scattered order), verify."""
    report = PullReport(len(keys), node.store.block_len)
    # A worker's KV tier is allocated up front; fault its pages in before timing, so the
    # throughput is the data plane's, not the first touch of fresh memory.
    node.store.array.fill(0)
    t0 = time.perf_counter()
    peer = await node.connect(address)
    report.connect_s = time.perf_counter() - t0
    progress(
        f"connected to {peer.peer_id} at {address[0]}:{address[1]} "
        f"(cold connect {_ms(report.connect_s)})"
    )
    # Ask in a shuffled order: destination slots are handed out in order, so the source
    # slots are scattered and NIXL cannot merge the blocks into one big copy.
    order = list(keys)
    random.Random(seed).shuffle(order)
    t0 = time.perf_counter()
    hits = await node.lookup(peer, order)
    report.lookup_s = time.perf_counter() - t0
    report.hits = sum(hits)
    progress(f"lookup: {report.hits:,}/{len(keys):,} hits in {_ms(report.lookup_s)}")
    batch = batch or max(1, len(order))
    loaded: list[bytes] = []
    for i in range(0, len(order), batch):
        t0 = time.perf_counter()
        result = await node.fetch(peer, order[i : i + batch])
        report.fetch_s += time.perf_counter() - t0
        report.loaded += len(result.loaded)
        loaded += result.loaded
        report.failed.update(result.failed)
        progress(
            f"fetch: {min(i + batch, len(order)):,}/{len(order):,} blocks "
            f"({_size(report.loaded * report.block_len)}) in {_ms(report.fetch_s)}"
        )
    if corrupt and loaded:  # test hook: one wrong byte must fail the run
        slot = node.store.slot_of(loaded[0])
        assert slot is not None
        node.store.array[slot * report.block_len] ^= 0xFF
    t0 = time.perf_counter()
    report.bad = verify_blocks(node.store, keys, seed)
    report.verify_s = time.perf_counter() - t0
    progress(
        f"verify: {len(keys) - len(report.bad):,}/{len(keys):,} blocks match "
        f"in {_ms(report.verify_s)}"
    )
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def render(report: PullReport, transport: str) -> str:
    gbps = report.nbytes / report.fetch_s / 1e9 if report.fetch_s else 0.0
    rows = [
        ("transport", transport),
        ("blocks", f"{report.blocks:,} x {_size(report.block_len)} (scattered order)"),
        ("bytes", _size(report.nbytes)),
        ("cold connect", _ms(report.connect_s)),
        ("lookup", f"{_ms(report.lookup_s)} ({report.hits:,} hits)"),
        ("fetch", _ms(report.fetch_s)),
        ("throughput", f"{gbps:.2f} GB/s"),
        ("verified", "yes, every byte" if report.verified else "NO"),
    ]
    return "\n".join(f"  {name:<13} {value}" for name, value in rows)


def finish(report: PullReport, transport: str) -> int:
    print(render(report, transport))
    if report.verified:
        return 0
    problems = []
    if report.failed:
        reasons = sorted(set(report.failed.values()))
        problems.append(f"{len(report.failed):,} blocks not loaded ({', '.join(reasons)})")
    if report.bad:
        problems.append(
            f"{len(report.bad):,} blocks differ from the source's bytes "
            f"(first: key {report.bad[0].hex()[:16]}...)"
        )
    print(f"p2pkv: FAILED: {'; '.join(problems)}", file=sys.stderr)
    return 1


def _stderr_progress(prefix: str) -> Progress:
    def progress(line: str) -> None:
        print(f"[{prefix}] {line}", file=sys.stderr, flush=True)

    return progress


def _consumer_config(args: argparse.Namespace, peer_id: str) -> NodeConfig:
    return NodeConfig(
        peer_id=peer_id,
        num_blocks=args.blocks,
        block_len=args.block_len,
        transport=args.transport,
        fingerprint=args.fingerprint,
    )


async def _demo_local(args: argparse.Namespace, progress: Progress) -> PullReport:
    src_cfg = _consumer_config(args, "demo-source")
    async with open_node(src_cfg) as src, open_node(_consumer_config(args, "demo-consumer")) as dst:
        keys = demo_keys(args.blocks, args.seed)
        fill_store(src.store, keys, args.seed)
        progress(f"source filled {args.blocks:,} blocks, listening at {src.address[1]}")
        return await pull(
            dst,
            src.address,
            keys,
            seed=args.seed,
            batch=args.batch,
            progress=progress,
            corrupt=args.corrupt_for_test,
        )


async def _consume(
    args: argparse.Namespace, address: tuple[str, int], peer_id: str, progress: Progress
) -> PullReport:
    async with open_node(_consumer_config(args, peer_id)) as node:
        return await pull(
            node,
            address,
            demo_keys(args.blocks, args.seed),
            seed=args.seed,
            batch=args.batch,
            progress=progress,
            corrupt=args.corrupt_for_test,
        )


def cmd_demo(args: argparse.Namespace) -> int:
    set_env_defaults()  # the child process inherits them
    progress = _stderr_progress("demo")
    progress(f"{args.blocks:,} blocks x {_size(args.block_len)} over {args.transport}")
    if args.transport == "local":  # in-process data plane: both nodes in this process
        return finish(trio.run(_demo_local, args, progress), "local (one process)")
    argv = [sys.executable, "-m", "p2pkv", "--log-level", args.log_level, "serve"]
    argv += ["--exit-on-eof", "--transport", "nixl", "--peer-id", "demo-source"]
    argv += ["--host", "127.0.0.1", "--port", "0", "--fingerprint", args.fingerprint]
    argv += ["--blocks", str(args.blocks), "--block-len", str(args.block_len)]
    argv += ["--fill", str(args.blocks), "--seed", str(args.seed)]
    child = Child(argv, name="source process")
    try:
        hello = child.receive(timeout=args.timeout)
        host, port = hello["address"]
        progress(
            f"source process {child.pid} filled {hello['blocks']:,} blocks, "
            f"listening at {host}:{port}"
        )
        report = trio.run(_consume, args, (host, int(port)), "demo-consumer", progress)
    finally:
        rc = child.close()
    if rc != 0:
        progress(f"warning: the source process exited with status {rc}")
    return finish(report, "nixl (two processes)")


def cmd_fetch(args: argparse.Namespace) -> int:
    host, _, port = args.address.rpartition(":")
    set_env_defaults(loopback=is_loopback(host))
    peer_id = args.peer_id or f"{socket.gethostname()}-fetch-{os.getpid()}"
    report = trio.run(_consume, args, (host, int(port)), peer_id, _stderr_progress("fetch"))
    return finish(report, args.transport)


# --- argument parsing -------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text, 0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_blocks(p: argparse.ArgumentParser, *, blocks: int) -> None:
    p.add_argument(
        "--blocks",
        type=_positive_int,
        default=blocks,
        help="number of blocks (default: %(default)s)",
    )
    p.add_argument(
        "--block-len",
        type=_positive_int,
        default=64 * KiB,
        help="bytes per block (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the demo keys and block contents (default: %(default)s)",
    )
    p.add_argument(
        "--batch", type=int, default=0, help="blocks per fetch call (default: all in one)"
    )
    p.add_argument("--fingerprint", default="", help="compatibility fingerprint (default: none)")
    p.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pkv", description="Share KV-cache blocks between inference workers over NIXL."
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level on stderr (default: %(default)s)",
    )
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
        type=float,
        default=120.0,
        help="seconds to wait for the source process to start",
    )
    _add_blocks(demo, blocks=1024)
    demo.set_defaults(func=cmd_demo)

    serve_p = sub.add_parser(
        "serve",
        help="run a node until SIGINT/SIGTERM",
        description="Run a node from flags and/or a config file until interrupted. When "
        "listening it prints one JSON line on stdout: "
        '{"event": "listening", "address": [host, port], ...}. Flags override the file.',
    )
    serve_p.add_argument(
        "--config",
        help="TOML (.toml) or JSON file of NodeConfig fields "
        "(plus fill, seed); strings for hash_seed/secret are UTF-8",
    )
    serve_p.add_argument("--peer-id", help="this node's peer id (default: HOSTNAME-PID)")
    serve_p.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve_p.add_argument("--port", type=int, help="port to listen on (default: 0, any)")
    serve_p.add_argument(
        "--blocks", type=_positive_int, help="store capacity in blocks (default: max(fill, 1024))"
    )
    serve_p.add_argument("--block-len", type=_positive_int, help="bytes per block (default 65536)")
    serve_p.add_argument("--transport", choices=["nixl", "local"], help="data plane (default nixl)")
    serve_p.add_argument("--fingerprint", help="compatibility fingerprint")
    serve_p.add_argument("--fill", type=int, help="put this many demo blocks in the store")
    serve_p.add_argument("--seed", type=int, help="seed of the demo blocks (default 0)")
    serve_p.add_argument(
        "--exit-on-eof",
        action="store_true",
        help="also stop when stdin reaches EOF (for a parent process)",
    )
    serve_p.set_defaults(func=cmd_serve)

    fetch = sub.add_parser(
        "fetch",
        help="fetch the demo blocks from a running `serve --fill` and verify them",
        description="Connect to HOST:PORT (a `p2pkv serve --fill N --seed S`), fetch the N "
        "demo blocks and verify every byte. Exits 0 only if every byte matched.",
    )
    fetch.add_argument("address", help="HOST:PORT of the serving node")
    fetch.add_argument("--peer-id", help="this node's peer id (default: HOSTNAME-fetch-PID)")
    fetch.add_argument(
        "--transport",
        choices=["nixl", "local"],
        default="nixl",
        help="data plane (default: %(default)s)",
    )
    _add_blocks(fetch, blocks=1024)
    fetch.set_defaults(func=cmd_fetch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
    except KeyboardInterrupt:
        return 130
    return code
