"""File descriptors per connect/disconnect cycle: bare NIXL vs NixlTransport (two processes).

Reproduce (about 1 min; ``--quick`` for 100 cycles)::

    .venv/bin/python bench/nixl_fds.py

A parent and a child process each own one agent (bare NIXL 1.5.1, made the way the
transport makes it) or one :class:`~p2pkv.transport.nixl.NixlTransport`. One cycle is what a
session's life does to the data plane: both sides register each other, then both release
(bare: ``add_remote_agent`` / ``remove_remote_agent``; transport: ``add_remote_peer`` /
``remove_remote_peer``). Both processes make progress all along (the child polls its agent
every millisecond). ``/proc/self/fd`` of each process is counted after the first cycle and
at the end. "restart" rows restart the child's agent before every cycle (a new incarnation,
same name, new metadata), as a peer process restarting does.

Target (issue 7, item 11): NixlTransport's fd count stays bounded, i.e. grows by at most one
connection (1 fd per process) from the first cycle to the last, on both sides.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pkv.transport import _nixl_agent
from p2pkv.transport.base import RegionLayout
from p2pkv.transport.nixl import NixlTransport

BLOCKS, BLOCK = 16, 64 * 1024
_HEADER = struct.Struct("!I")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def send(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> Any:
    def exactly(size: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < size:
            chunk = sock.recv(size - len(chunks))
            if not chunk:
                raise EOFError
            chunks += chunk
        return bytes(chunks)

    return pickle.loads(exactly(_HEADER.unpack(exactly(_HEADER.size))[0]))


class Bare:
    """One bare NIXL agent, configured as the transport configures its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.array = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
        api = _nixl_agent.load_nixl().api
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = api.nixl_agent(name, config)
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        self.agent.register_memory([(self.array.ctypes.data, self.array.nbytes, 0, "")], "DRAM")
        self.layout = RegionLayout(self.array.ctypes.data, BLOCKS, BLOCK)

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add(self, name: str, metadata: bytes, layout: RegionLayout) -> str:
        self.agent.add_remote_agent(metadata)
        return name

    def remove(self, handle: Any) -> None:
        self.agent.remove_remote_agent(handle)

    def progress(self) -> None:
        self.agent.get_new_notifs()

    def close(self) -> None:
        del self.agent


class Transport:
    """One NixlTransport."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.array = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
        self.layout = RegionLayout(self.array.ctypes.data, BLOCKS, BLOCK)
        self.transport = NixlTransport.create(
            agent_name=name, region=self.array, layout=self.layout
        )

    def metadata(self) -> bytes:
        return self.transport.metadata()

    def add(self, name: str, metadata: bytes, layout: RegionLayout) -> Any:
        return self.transport.add_remote_peer(name, metadata, layout)

    def remove(self, handle: Any) -> None:
        self.transport.remove_remote_peer(handle)

    def progress(self) -> None:
        self.transport.progress()

    def close(self) -> None:
        self.transport.close()


SIDES: dict[str, type[Bare] | type[Transport]] = {"bare": Bare, "transport": Transport}


def child_main(kind: str, fd: int) -> None:
    sock = socket.socket(fileno=fd)
    side = SIDES[kind]("fds-child")
    send(sock, (side.metadata(), side.layout))
    peer: Any = None
    while True:
        ready, _, _ = select.select([sock], [], [], 0.001)
        if ready:
            try:
                cmd, *arg = recv(sock)
            except EOFError:
                break
            if cmd == "add":
                peer = side.add("fds-parent", arg[0], arg[1])
                send(sock, None)
            elif cmd == "remove":
                side.remove(peer)
                send(sock, None)
            elif cmd == "restart":
                side.close()
                side = SIDES[kind]("fds-child")
                send(sock, (side.metadata(), side.layout))
            elif cmd == "fds":
                send(sock, open_fds())
        side.progress()
    side.close()


def run(kind: str, cycles: int, restart: bool) -> dict[str, Any]:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", kind, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    side = SIDES[kind]("fds-parent")

    def call(*msg: Any) -> Any:
        send(ours, msg)
        return recv(ours)

    try:
        metadata, layout = recv(ours)
        counts: list[tuple[int, int]] = []
        for _ in range(cycles):
            if restart:
                metadata, layout = call("restart")
            peer = side.add("fds-child", metadata, layout)
            call("add", side.metadata(), side.layout)
            side.progress()
            side.remove(peer)
            call("remove")
            side.progress()
            counts.append((open_fds(), call("fds")))
    finally:
        ours.close()
        child.wait(60)
        side.close()
    (p0, c0), (p1, c1) = counts[0], counts[-1]
    per = max(1, cycles - 1)
    return {
        "kind": kind + (" restart" if restart else ""),
        "cycles": cycles,
        "parent": (p0, p1, (p1 - p0) / per),
        "child": (c0, c1, (c1 - c0) / per),
        "bounded": p1 - p0 <= 1 and c1 - c0 <= 1,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=1000, help="same-peer cycles (1000)")
    parser.add_argument("--restarts", type=int, default=200, help="restart cycles (200)")
    parser.add_argument("--quick", action="store_true", help="100 and 50 cycles")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _nixl_agent.load_nixl()  # sets the environment defaults the child inherits
    if args.child:
        child_main(args.child[0], int(args.child[1]))
        return 0
    if args.quick:
        args.cycles, args.restarts = 100, 50
    print(
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':18} {'cycles':>6}  {'parent fds':>18}  {'child fds':>18}")
    results = []
    for kind, cycles, restart in (
        ("bare", args.cycles, False),
        ("transport", args.cycles, False),
        ("bare", args.restarts, True),
        ("transport", args.restarts, True),
    ):
        r = run(kind, cycles, restart)
        results.append(r)
        cells = [f"{a} -> {b} ({d:.2f}/cycle)" for a, b, d in (r["parent"], r["child"])]
        print(f"{r['kind']:18} {cycles:>6}  {cells[0]:>18}  {cells[1]:>18}", flush=True)
    ok = all(r["bounded"] for r in results if r["kind"].startswith("transport"))
    print(("PASS" if ok else "FAIL") + ": NixlTransport's fds stay bounded on both sides")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
