"""Two-process harness over vLLM 0.33's real tiering manager, agnostic of the secondary tier.

Used by tests/test_vllm_tier.py and bench/vllm_tier.py. A node is a process (see
tests/vllm_node.py for what it runs) holding a real ``TieringOffloadingManager`` whose one
secondary tier is built from a ``tier_config`` dict, exactly as vLLM builds it from
``kv_connector_extra_config["secondary_tiers"]``: the built-in ``{"type": "p2p", ...}`` or
an out-of-tree ``{"type": "p2pkv", "module_path": ..., ...}``.

Processes come from one forkserver per parent process that has preloaded vLLM's tiering
stack (and the p2pkv tier when it imports), so vLLM's import (~8-13 s) is paid once and each
node starts in well under a second. This module itself imports no vLLM: the parent stays
light, and keys are made here with the layout of vLLM's ``make_offload_key`` (the child
checks that they agree).

Every node has a unique ``engine_id``; its ``/dev/shm/vllm_offload_<engine_id>.mmap*`` is
unlinked when the node is closed, killed or not (vLLM unlinks it only in a clean shutdown).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import itertools
import multiprocessing as mp
import multiprocessing.context
import os
import random
import secrets
import signal
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tests.vllm_node import POLL_THREAD, SCHEDULER_THREAD, node_main, shm_paths

__all__ = [
    "POLL_THREAD",
    "SCHEDULER_THREAD",
    "VllmNode",
    "builtin_tier",
    "forkserver",
    "free_port",
    "make_key",
    "make_keys",
    "p2pkv_tier",
    "p2pkv_tier_missing",
    "shm_paths",
    "vllm_missing",
]

PRELOAD = [
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.tiering.p2p.manager",
    "tests.vllm_node",
]
P2PKV_TIER_MODULE = "p2pkv.integrations.vllm_tier"
START_TIMEOUT_S = 180.0  # the first node also waits for the forkserver's vLLM import
_counter = itertools.count()


def vllm_missing() -> str | None:
    """Why the vLLM harness cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM 0.33.0 is not installed (bash scripts/setup.sh installs it lean)"
    return None


def p2pkv_tier_missing() -> str | None:
    """Why p2pkv's vLLM tier cannot be loaded, or None when it can (checked without vLLM)."""
    try:
        found = importlib.util.find_spec(P2PKV_TIER_MODULE)
    except ImportError as exc:
        return f"{P2PKV_TIER_MODULE}: {exc}"
    return None if found is not None else f"{P2PKV_TIER_MODULE} does not exist"


def make_key_from_hash(block_hash: bytes, group: int = 0) -> bytes:
    """vLLM's ``make_offload_key``: the block hash, then the group index (4 bytes, BE)."""
    return block_hash + group.to_bytes(4, "big")


def make_key(salt: str, i: int) -> bytes:
    return make_key_from_hash(hashlib.sha256(f"{salt}/{i}".encode()).digest())


def make_keys(salt: str, n: int) -> list[bytes]:
    return [make_key(salt, i) for i in range(n)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range (outgoing
    connections of other nodes take ports from that range, so a port picked there may be
    gone by the time a node binds it). The built-in tier binds port + DP index 0."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    while True:
        port = random.randrange(10_000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def builtin_tier(port: int) -> dict[str, Any]:
    return {"type": "p2p", "host": "127.0.0.1", "port": port}


def p2pkv_tier(port: int, **deadlines: float) -> dict[str, Any]:
    config: dict[str, Any] = {
        "type": "p2pkv",
        "module_path": P2PKV_TIER_MODULE,
        "host": "127.0.0.1",
        "port": port,
        "load_timeout_s": 2.0,
        "lookup_timeout_s": 2.0,
        # > abort + margin + serve_timeout_s (its default, 2): the tier's rule
        "quarantine_s": 3.2,
        "abort_timeout_s": 0.5,
        "landing_margin_s": 0.5,
        # These tiers are small (256 chunks) and one peer pulls up to 75 % of one: past
        # its default part of the pin share (0.5 of 0.9), the rest would be misses.
        "max_pinned_peer_share": 1.0,
    }
    config.update(deadlines)
    return config


def forkserver() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, with vLLM's tiering stack (and p2pkv's tier) preloaded.

    The server starts with the first node and inherits this process's environment, so the
    quiet, loopback-only NIXL/UCX defaults of the test suite are set here too.
    """
    for name, value in (
        ("UCX_MEM_MMAP_HOOK_MODE", "none"),
        ("UCX_NET_DEVICES", "lo"),
        ("NIXL_LOG_LEVEL", "WARN"),
    ):
        os.environ.setdefault(name, value)
    ctx = mp.get_context("forkserver")
    preload = list(PRELOAD)
    if p2pkv_tier_missing() is None:
        preload.append(P2PKV_TIER_MODULE)
    ctx.set_forkserver_preload(preload)
    return ctx


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` ("T" once a SIGSTOP has taken hold)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2]


class NodeError(RuntimeError):
    """A command failed inside the node process; the message is its traceback."""


class VllmNode:
    """A node process; its methods are commands answered over a Pipe (see tests/vllm_node.py)."""

    def __init__(
        self,
        ctx: multiprocessing.context.ForkServerContext,
        tier_config: dict[str, Any],
        *,
        num_chunks: int = 256,
        chunk_bytes: int = 256 << 10,
        step_s: float = 0.0,
        step_mode: str = "sleep",
        poll_interval_s: float = 0.001,
        name: str = "node",
    ) -> None:
        self.name = name
        self.port = int(tier_config.get("port", 0))
        self.address = (str(tier_config.get("host", "127.0.0.1")), self.port)
        self.engine_id = f"p2pkvh{os.getpid()}x{next(_counter)}{secrets.token_hex(3)}"
        params = {
            "engine_id": self.engine_id,
            "tier_config": tier_config,
            "num_chunks": num_chunks,
            "chunk_bytes": chunk_bytes,
            "step_s": step_s,
            "step_mode": step_mode,
            "poll_interval_s": poll_interval_s,
        }
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=node_main, args=(child_conn, params), name=name)
        self.proc.start()
        child_conn.close()
        self._pending: str | None = None
        self.info = self._reply("start", START_TIMEOUT_S)
        self.pid: int = self.info["pid"]

    def _reply(self, name: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer to {name} after {timeout_s} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise NodeError(f"{self.name}: {name} failed:\n{value}")
        return value

    def call(self, name: str, answer_within_s: float = 60.0, /, **kwargs: Any) -> Any:
        self._conn.send((name, kwargs))
        return self._reply(name, answer_within_s)

    # -- commands ---------------------------------------------------------------------------

    def fill(self, keys: Sequence[bytes], seed: int) -> int:
        return int(self.call("fill", keys=list(keys), seed=seed)["stored"])

    def start_pull(
        self,
        source: VllmNode,
        requests: Sequence[tuple[str, Sequence[bytes]]],
        *,
        seed: int,
        timeout_s: float = 30.0,
        finish: bool = True,
        gate: bool = False,
    ) -> int:
        """Start ``(req_id, keys)`` requests pulling from ``source``, all in the same step.

        Returns the step count before they start (for ``stats(since=...)``).
        """
        reqs = [
            {
                "req_id": req_id,
                "keys": list(keys),
                "seed": seed,
                "source": source.address,
                "kv_request_id": f"kv-{req_id}-{secrets.token_hex(4)}",
                "timeout_s": timeout_s,
                "finish": finish,
                "gate": gate,
            }
            for req_id, keys in requests
        ]
        return int(self.call("start_pull", requests=reqs)["steps_before"])

    def wait_pull(self, req_ids: Sequence[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Per request: ``outcome`` per key (loaded, local, miss, failed, timeout; past the end
        of the prefix: dropped if its load was in flight, else unscanned),
        ``matched`` per key (every byte equal), ``elapsed_s``, ``submits`` per key, ``scans``."""
        result: list[dict[str, Any]] = self.call(
            "wait_pull", timeout_s + 5.0, req_ids=list(req_ids), timeout_s=timeout_s
        )
        return result

    def pull(
        self, source: VllmNode, req_id: str, keys: Sequence[bytes], *, seed: int, **kw: Any
    ) -> dict[str, Any]:
        self.start_pull(source, [(req_id, keys)], seed=seed, **kw)
        return self.wait_pull([req_id], timeout_s=kw.get("timeout_s", 30.0) + 5.0)[0]

    def wait_gate(self, req_id: str, timeout_s: float = 30.0) -> None:
        if not self.call("wait_gate", timeout_s + 5.0, req_id=req_id, timeout_s=timeout_s):
            raise TimeoutError(f"{self.name}: {req_id} never reached its gate")

    def open_gate(self, req_id: str, timeout_s: float = 30.0, *, posted_keys: int = 0) -> None:
        """Let the gated step go on; returns once its load has been submitted and, with
        ``posted_keys``, once p2pkv has sent fetches for that many keys (p2pkv tier only)."""
        if not self.call(
            "open_gate",
            timeout_s + 5.0,
            req_id=req_id,
            timeout_s=timeout_s,
            posted_keys=posted_keys,
        ):
            detail = self.call("diagnose", req_id=req_id)
            raise TimeoutError(
                f"{self.name}: the step gated by {req_id} did not end or post {posted_keys} "
                f"keys\n{detail}"
            )

    def finish(self, req_id: str) -> None:
        self.call("finish", req_id=req_id)

    def reset_cache(self, timeout_s: float = 60.0) -> dict[str, Any]:
        result: dict[str, Any] = self.call("reset_cache", timeout_s)
        return result

    def set_step(self, step_s: float, step_mode: str = "sleep") -> None:
        self.call("set_step", step_s=step_s, step_mode=step_mode)

    def stats(self, since: int = 0) -> dict[str, Any]:
        result: dict[str, Any] = self.call("stats", since=since)
        return result

    def thread_cpu(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("thread_cpu")
        return result

    def poll_round_cost(self) -> dict[str, float]:
        result: dict[str, float] = self.call("poll_round_cost")
        return result

    def shutdown(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Shut the manager down cleanly; returns what was left (threads, shm files)."""
        result: dict[str, Any] = self.call("shutdown", timeout_s)
        self.proc.join(timeout_s)
        return result

    # -- signals and teardown ---------------------------------------------------------------

    def sigstop(self) -> None:
        """Freeze the process (it hangs without closing anything) and wait until it has."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while process_state(self.pid) != "T":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not stop")
            os.sched_yield()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10.0)

    def close(self) -> None:
        """End the process however it is (a clean shutdown if it answers) and unlink its shm."""
        if self.proc.is_alive() and process_state(self.pid) not in "TZ":
            with contextlib.suppress(Exception):
                self.shutdown(timeout_s=20.0)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()
        for path in shm_paths(self.engine_id):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@contextlib.contextmanager
def nodes(ctx: multiprocessing.context.ForkServerContext) -> Iterator[list[VllmNode]]:
    """A list to put nodes in; every one is closed at the end."""
    started: list[VllmNode] = []
    try:
        yield started
    finally:
        for node in reversed(started):
            node.close()


def bytes_ok(result: dict[str, Any]) -> bool:
    """Every key loaded (not local, not missed) and every byte of it equal."""
    return all(o == "loaded" for o in result["outcome"]) and all(result["matched"])
