"""What a second task costs a Trio round trip: the floor under a p2pkv lookup's latency.

Reproduce (a few seconds)::

    .venv/bin/python bench/trio_handoff.py [--samples 3000]

Two processes on loopback: a plain Trio echo server (a 60-byte request, a 20-byte answer:
a 1-key lookup's sizes) and this client. A ``one task`` sample sends and receives the
answer in the same task, as a bare client does. A ``two tasks`` sample sends from one task
and parks it on a ``trio.Event`` that a reader task sets when the answer arrives, as a
p2pkv session does (its reader reads every frame; the request's task waits for its
answer). The samples alternate, so both see the same load. The difference is one more
trip through Trio's scheduler per answer: the reader goes back to waiting on the socket
before the woken task runs in the next batch.

docs/design.md ("The answer lane") records what it was on the GPU machine and why p2pkv
keeps the two tasks all the same.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import trio

REQUEST = b"\x00" * 60
ANSWER = b"\x01" * 20


async def serve(port: int) -> None:
    async def echo(stream: trio.SocketStream) -> None:
        while await stream.receive_some(1 << 16):
            await stream.send_all(ANSWER)

    await trio.serve_tcp(echo, port, host="127.0.0.1")


async def client(port: int, samples: int) -> dict[str, list[float]]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    waiting: list[trio.Event] = []
    out: dict[str, list[float]] = {"one task": [], "two tasks": []}

    async def reader(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while await stream.receive_some(1 << 16):
            waiting.pop().set()

    for i in range(samples):
        order = ["one task", "two tasks"] if i % 2 else ["two tasks", "one task"]
        for kind in order:
            if kind == "one task":
                t0 = time.perf_counter()
                await stream.send_all(REQUEST)
                await stream.receive_some(1 << 16)
                out[kind].append(time.perf_counter() - t0)
            else:
                async with trio.open_nursery() as nursery:
                    await nursery.start(reader)
                    answered = trio.Event()
                    waiting.append(answered)
                    t0 = time.perf_counter()
                    await stream.send_all(REQUEST)
                    await answered.wait()
                    out[kind].append(time.perf_counter() - t0)
                    nursery.cancel_scope.cancel()
            await trio.sleep(0.0005)  # both sides go idle between samples, as lookups do
    await stream.aclose()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=3000, help="default: %(default)s")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        trio.run(serve, args.serve)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:  # until the server listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        res = trio.run(client, port, args.samples)
    finally:
        server.kill()
        server.wait()
    skip = min(200, args.samples // 10)  # warm-up
    print(f"Trio round trip on loopback, {args.samples} samples per kind, alternating")
    p50 = {}
    for kind, values in res.items():
        v = sorted(values[skip:])
        p50[kind] = statistics.median(v)
        print(
            f"  {kind:>9}: p50 {p50[kind] * 1e6:6.1f} us  p10 {v[len(v) // 10] * 1e6:6.1f}"
            f"  p90 {v[9 * len(v) // 10] * 1e6:6.1f}"
        )
    print(f"  two tasks - one task, p50: {(p50['two tasks'] - p50['one task']) * 1e6:+.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
