"""One p2pkv node in a child process, driven by the test over a control socket.

Run as a script: ``python node_proc.py FD PEER_ID NUM_BLOCKS BLOCK_LEN [options]``. Stdout
is no use for control (UCX logs there), so the child talks over the inherited socket
``FD``, one JSON object per line. It fills ``--count`` blocks deterministically from
``--seed`` (:func:`block_key` / :func:`block_bytes`), opens the node and sends
``{"event": "ready", "address": [host, port], "pid": ...}``. Then it answers one command
at a time, each ``{"op": ..., ...}`` with ``{"ok": true, ...}`` or ``{"ok": false,
"error": ...}``:

With ``--device cuda:N`` the node's region is a torch CUDA tensor on that device.

* ``connect`` ``address``: dial a peer; answers its ``peer`` id;
* ``scatter`` ``count``: put ``count`` filler blocks and evict every other one, so the
  slots a later fetch reserves are scattered;
* ``fetch`` ``peer`` ``seed`` ``start`` ``count`` [``shuffle``]: fetch those keys; answers
  ``loaded`` and ``failed`` (key index -> reason), ``crcs`` (crc32 of each loaded block,
  in key order), ``slots`` and ``mismatched`` (loaded blocks whose bytes differ from the
  seed's);
* ``evict`` ``seed`` ``start`` ``count`` (or ``indexes``): drop those blocks; answers
  how many were held (``evicted``) and which were dropped (``dropped``, key indexes);
* ``put`` ``seed`` ``indexes`` ``gen``: put those keys with generation ``gen``'s bytes
  (:func:`gen_bytes`), in that order; answers their ``slots``;
* ``evict_all``: drop every block the store holds; answers how many it ``kept`` (pinned);
* ``disconnect`` ``peer``: close the session with that peer;
* ``release_unused_pins``: the host takes its unused pins back; answers how many rounds;
* ``stats``: the node's statistics (``attrs.asdict``) and ``peers``;
* ``stop``: close the node, answer the statistics after close, exit. EOF does the same.

The parent side is :class:`NodeProcess` (async, so the test's own node keeps running
while it waits for a child), or :class:`BlockingNodeProcess` for synchronous code (a
Hypothesis state machine's rules), every call of which has a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]


# UCX over TCP alone (a wire a stopped peer stalls): NIXL refuses a UCX_TLS that names
# no CUDA transport on a machine with NVIDIA GPUs, so there cuda_copy comes along (it
# carries no host-memory traffic).
_GPU_DRIVER = Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()
UCX_TCP = "tcp,cuda_copy" if _GPU_DRIVER else "tcp"


@contextlib.contextmanager
def spawning(
    peer_id: str, log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[socket.socket, Path, int, dict[str, Any]]]:
    """For starting a child: our end of its control socket, its log's path, the
    descriptor to pass it and the spawn's keywords (the descriptor passed, the log as
    stdout and stderr, this checkout first on its path, ``env`` over ours). Our end is
    closed if the spawn raises; the child's end here once it spawned."""
    ours, theirs = socket.socketpair()
    log_path = log_dir / f"{peer_id}-{os.getpid()}-{theirs.fileno()}.log"
    try:
        with log_path.open("wb") as log:
            yield (
                ours,
                log_path,
                theirs.fileno(),
                {
                    "pass_fds": (theirs.fileno(),),
                    "env": {**os.environ, "PYTHONPATH": child_pythonpath(), **(env or {})},
                    "stdin": subprocess.DEVNULL,
                    "stdout": log,
                    "stderr": subprocess.STDOUT,
                },
            )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()


def child_pythonpath() -> str:
    """A child process imports this checkout first, then whatever the parent's
    ``PYTHONPATH`` names (packages installed by path, as on a machine without an index)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


MAX_LINE = 16 << 20
FILLER_SEED = 999_999  # the blocks of ``scatter``


def block_key(seed: int, index: int) -> bytes:
    return hashlib.sha256(f"p2pkv-test:{seed}:{index}".encode()).digest()


def block_bytes(seed: int, index: int, block_len: int) -> bytes:
    return np.random.default_rng([seed, index]).bytes(block_len)


def gen_bytes(seed: int, index: int, gen: int, block_len: int) -> bytes:
    """Generation ``gen`` of key ``index``'s block (of ``seed``): distinct per generation."""
    return np.random.default_rng([seed, index, gen, 1]).bytes(block_len)


def block_crc(seed: int, index: int, block_len: int) -> int:
    return zlib.crc32(block_bytes(seed, index, block_len))


# --- the control channel: JSON lines ---------------------------------------------------


def log_tail(path: Path, chars: int = 4000) -> str:
    """The last ``chars`` characters of a child's log ("" if it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def take_line(buffer: bytearray) -> dict[str, Any] | None:
    """The first complete line of ``buffer`` as a JSON object, removed from it; None while
    no line is complete (ValueError once an incomplete one is past ``MAX_LINE``)."""
    end = buffer.find(b"\n")
    if end < 0:
        if len(buffer) > MAX_LINE:
            raise ValueError("control line too long")
        return None
    line = bytes(buffer[:end])
    del buffer[: end + 1]
    obj = json.loads(line)
    assert isinstance(obj, dict)
    return obj


class LineChannel:
    """JSON objects, one per line, over a Trio stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def send(self, obj: dict[str, Any]) -> None:
        await self.stream.send_all(json.dumps(obj).encode() + b"\n")

    async def receive(self) -> dict[str, Any] | None:
        """The next object, or None at EOF."""
        while (obj := take_line(self._buffer)) is None:
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return None
            self._buffer += data
        return obj


# --- the child ---------------------------------------------------------------------------


async def _handle(node: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    if op == "connect":
        host, port = cmd["address"]
        peer = await node.connect((host, int(port)))
        return {"peer": peer.peer_id}
    if op == "scatter":
        store = node.store
        keys = [block_key(FILLER_SEED, i) for i in range(int(cmd["count"]))]
        for i, key in enumerate(keys):
            store.put(key, block_bytes(FILLER_SEED, i, store.block_len))
        for key in keys[::2]:
            store.evict(key)
        return {}
    if op == "fetch":
        seed, start, count = int(cmd["seed"]), int(cmd["start"]), int(cmd["count"])
        indexes = list(range(start, start + count))
        if cmd.get("shuffle"):
            random.Random(seed).shuffle(indexes)
        keys = [block_key(seed, i) for i in indexes]
        result = await node.fetch(cmd["peer"], keys)
        loaded = set(result.loaded)
        index_of = dict(zip(keys, indexes, strict=True))
        crcs: list[int | None] = []
        slots: list[int | None] = []
        mismatched: list[int] = []
        for key, i in zip(keys, indexes, strict=True):
            got_or_none = stored_bytes(node.store, key) if key in loaded else None
            if got_or_none is None:
                crcs.append(None)
                slots.append(None)
                continue
            got = got_or_none
            crcs.append(zlib.crc32(got))
            slots.append(node.store.slot_of(key))
            if got != block_bytes(seed, i, node.store.block_len):
                mismatched.append(i)
        return {
            "indexes": indexes,
            "loaded": len(result.loaded),
            "failed": {str(index_of[k]): reason for k, reason in result.failed.items()},
            "crcs": crcs,
            "slots": slots,
            "mismatched": mismatched,
        }
    if op == "evict":
        seed = int(cmd["seed"])
        if "indexes" in cmd:
            indexes = [int(i) for i in cmd["indexes"]]
        else:
            start, count = int(cmd["start"]), int(cmd["count"])
            indexes = list(range(start, start + count))
        dropped = [i for i in indexes if node.store.evict(block_key(seed, i))]
        return {"evicted": len(dropped), "dropped": dropped}
    if op == "put":
        seed, gen, store = int(cmd["seed"]), int(cmd["gen"]), node.store
        indexes = [int(i) for i in cmd["indexes"]]
        slots = [
            store.put(block_key(seed, i), gen_bytes(seed, i, gen, store.block_len)) for i in indexes
        ]
        return {"slots": slots}
    if op == "evict_all":
        kept = sum(not node.store.evict(key) for key in list(node.store.keys()))
        return {"kept": kept}
    if op == "disconnect":
        await node.disconnect(cmd["peer"])
        return {}
    if op == "release_unused_pins":
        return {"rounds": await node.release_unused_pins()}
    if op == "stats":
        return _stats(node)
    raise ValueError(f"unknown op {op!r}")


def stored_bytes(store: Any, key: bytes) -> bytes | None:
    """A copy of ``key``'s block, from a host or a GPU region (None if absent)."""
    if store.device_region:
        tensor = store.get_tensor(key)
        return None if tensor is None else bytes(tensor.cpu().numpy())
    view = store.get(key)
    return None if view is None else bytes(view)


def _stats(node: Any) -> dict[str, Any]:
    return {"stats": attrs.asdict(node.statistics()), "peers": [p.peer_id for p in node.peers()]}


async def child_main(args: argparse.Namespace) -> None:
    from p2pkv import NodeConfig, open_node

    sock = socket.socket(fileno=args.fd)
    channel = LineChannel(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    cfg = NodeConfig(
        peer_id=args.peer_id,
        host=args.host,
        port=0,
        transport="nixl",
        num_blocks=args.num_blocks,
        block_len=args.block_len,
        **json.loads(args.config),
    )
    region = None
    if args.device:  # a GPU region: a torch CUDA tensor
        import torch

        region = torch.zeros(
            args.num_blocks * args.block_len, dtype=torch.uint8, device=args.device
        )
    async with open_node(cfg, region=region) as node:
        for i in range(args.count):
            node.store.put(block_key(args.seed, i), block_bytes(args.seed, i, args.block_len))
        await channel.send({"event": "ready", "address": list(node.address), "pid": os.getpid()})
        while (cmd := await channel.receive()) is not None and cmd["op"] != "stop":
            try:
                reply = {"ok": True, **await _handle(node, cmd)}
            except Exception as exc:
                reply = {"ok": False, "error": repr(exc)}
            await channel.send(reply)
        await node.aclose()
    # If the parent is gone there is nobody to tell.
    with trio.move_on_after(5), contextlib.suppress(trio.BrokenResourceError):
        await channel.send({"ok": True, "event": "closed", **_stats(node)})


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("fd", type=int)
    parser.add_argument("peer_id")
    parser.add_argument("num_blocks", type=int)
    parser.add_argument("block_len", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--config", default="{}", help="extra NodeConfig fields, JSON")
    parser.add_argument("--device", default="", help="region on this torch device (cuda:N)")
    return parser.parse_args(argv)


# --- the parent side -----------------------------------------------------------------------


def child_args(fd: int, peer_id: str, num_blocks: int, block_len: int) -> list[str]:
    """The command line of a child on socket ``fd`` (options follow)."""
    return [sys.executable, str(SCRIPT), str(fd), peer_id, str(num_blocks), str(block_len)]


@attrs.define(eq=False)
class NodeProcess:
    """A child running one node (this script). Start with :meth:`start`; always
    :meth:`aclose` (or let the test's fixture do it): it kills and reaps the child."""

    peer_id: str
    proc: trio.Process
    channel: LineChannel
    log_path: Path
    address: tuple[str, int] = ("", 0)
    pid: int = 0

    @classmethod
    async def start(
        cls,
        peer_id: str,
        *,
        num_blocks: int,
        block_len: int,
        log_dir: Path,
        seed: int = 0,
        count: int = 0,
        host: str = "127.0.0.1",
        config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        ready_timeout: float = 30.0,
        device: str = "",
    ) -> NodeProcess:
        with spawning(peer_id, log_dir, env) as (ours, log_path, fd, spawn_kw):
            args = [
                *prefix,
                *child_args(fd, peer_id, num_blocks, block_len),
                f"--host={host}",
                f"--seed={seed}",
                f"--count={count}",
                f"--config={json.dumps(config or {})}",
                f"--device={device}",
            ]
            proc = await trio.lowlevel.open_process(args, **spawn_kw)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        child = cls(peer_id, proc, LineChannel(stream), log_path)
        try:
            with trio.fail_after(ready_timeout):
                hello = await child.channel.receive()
            if hello is None or hello.get("event") != "ready":
                raise AssertionError(f"{peer_id} did not start: {hello!r}\n{child.log_tail()}")
        except BaseException:
            await child.aclose()
            raise
        host_, port = hello["address"]
        child.address = (str(host_), int(port))
        child.pid = int(hello["pid"])
        return child

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one command and return its reply; AssertionError if it failed. No deadline
        of its own: callers wrap their test in ``trio.fail_after``."""
        await self.channel.send({"op": op, **fields})
        reply = await self.channel.receive()
        if reply is None:
            raise AssertionError(f"{self.peer_id} died during {op}\n{self.log_tail()}")
        if not reply.get("ok"):
            raise AssertionError(f"{self.peer_id}: {op} failed: {reply.get('error')}")
        return reply

    async def stop(self) -> dict[str, Any]:
        """Close the node gracefully; its statistics after close."""
        reply = await self.call("stop")
        await self.proc.wait()
        await self.aclose()
        return reply

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def aclose(self, grace: float = 10.0) -> None:
        """Close the control socket (EOF: the child closes its node and exits); SIGKILL
        it if it has not exited after ``grace`` seconds; reap it. Shielded."""
        with trio.CancelScope(shield=True):
            await self.channel.stream.aclose()
            if self.proc.returncode is None:
                with trio.move_on_after(grace):
                    await self.proc.wait()
            self.kill()
            await self.proc.wait()


class BlockingNodeProcess:
    """A child running one node (this script), driven from synchronous code: every call
    waits at most its ``timeout``. Always :meth:`close` it: it stops the child (SIGKILL
    after a grace) and reaps it."""

    def __init__(
        self, peer_id: str, proc: subprocess.Popen[bytes], sock: socket.socket, log_path: Path
    ) -> None:
        self.peer_id = peer_id
        self.proc = proc
        self.sock = sock
        self.log_path = log_path
        self._buffer = bytearray()
        self.address: tuple[str, int] = ("", 0)

    @classmethod
    def start(
        cls,
        peer_id: str,
        *,
        num_blocks: int,
        block_len: int,
        log_dir: Path,
        config: dict[str, Any] | None = None,
        ready_timeout: float = 30.0,
    ) -> BlockingNodeProcess:
        with spawning(peer_id, log_dir) as (ours, log_path, fd, spawn_kw):
            args = [
                *child_args(fd, peer_id, num_blocks, block_len),
                f"--config={json.dumps(config or {})}",
            ]
            proc = subprocess.Popen(args, **spawn_kw)
        child = cls(peer_id, proc, ours, log_path)
        try:
            hello = child.receive(ready_timeout)
            if hello is None or hello.get("event") != "ready":
                raise AssertionError(f"{peer_id} did not start: {hello!r}\n{child.log_tail()}")
        except BaseException:
            child.close(grace=0)
            raise
        host, port = hello["address"]
        child.address = (str(host), int(port))
        return child

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next object (None at EOF); ``TimeoutError`` after ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        while (obj := take_line(self._buffer)) is None:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self._buffer += data
        return obj

    def call(self, op: str, *, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
        """Send one command and return its reply; AssertionError if it failed."""
        self.sock.settimeout(timeout)
        self.sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        reply = self.receive(timeout)
        if reply is None:
            raise AssertionError(f"{self.peer_id} died during {op}\n{self.log_tail()}")
        if not reply.get("ok"):
            raise AssertionError(f"{self.peer_id}: {op} failed: {reply.get('error')}")
        return reply

    def close(self, grace: float = 10.0) -> None:
        """EOF on the control socket (the child closes its node and exits); SIGKILL if it
        has not exited after ``grace`` seconds; reap it."""
        self.sock.close()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10.0)


def count_agent_calls(monkeypatch: Any) -> dict[str, int]:
    """Count NIXL agents created and ``register_memory`` calls in this process from now on
    (through ``monkeypatch``, so the count ends with the test)."""
    from p2pkv.transport import _nixl_agent

    agent_cls = _nixl_agent.load_nixl().api.nixl_agent
    calls = {"agents": 0, "register_memory": 0}
    real_init, real_register = agent_cls.__init__, agent_cls.register_memory

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        calls["agents"] += 1
        real_init(self, *args, **kwargs)

    def counting_register(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["register_memory"] += 1
        return real_register(self, *args, **kwargs)

    monkeypatch.setattr(agent_cls, "__init__", counting_init)
    monkeypatch.setattr(agent_cls, "register_memory", counting_register)
    return calls


@attrs.define(eq=False)
class Children:
    """Every :class:`NodeProcess` a test starts; :meth:`aclose` kills and reaps them all."""

    log_dir: Path
    started: list[NodeProcess] = attrs.field(factory=list)

    async def start(self, peer_id: str, **kw: Any) -> NodeProcess:
        child = await NodeProcess.start(peer_id, log_dir=self.log_dir, **kw)
        self.started.append(child)
        return child

    async def aclose(self, grace: float = 10.0) -> None:
        """EOF to every child at once, then as :meth:`NodeProcess.aclose`. Shielded."""
        with trio.CancelScope(shield=True):
            for child in self.started:
                await child.channel.stream.aclose()
            with trio.move_on_after(grace):
                for child in self.started:
                    await child.proc.wait()
            for child in self.started:
                await child.aclose(grace=0)


if __name__ == "__main__":
    trio.run(child_main, parse_args(sys.argv[1:]))
