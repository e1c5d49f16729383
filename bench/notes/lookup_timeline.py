"""Where a 1-key lookup's time goes: a timeline across both processes, beside a bare Trio
round trip of the same bytes between the same two processes.

    .venv/bin/python bench/notes/lookup_timeline.py [--samples 400] [--close fetch|release]

The source runs in a child process (this script with ``--source``): a node, and on the same
Trio loop a bare server that answers the lookup's very frame with its answer's (as
``bench/control_plane.py``'s ``bare``). Both processes wrap a few session methods to stamp
``time.perf_counter_ns()`` (CLOCK_MONOTONIC, one clock for both processes); the bare server
and the bare client stamp where their frame arrives and where they start to send. Lookups
and bare round trips alternate; each lookup's round is closed, untimed, by a one-block fetch
(``--close fetch``, as the control-plane bench does) or a release. The wrappers add about a
microsecond each; the bare round trip has none, so the figures are upper bounds of p2pkv's
steps. Printed: the p50 of each step's duration, consumer and source side by side, and the
bare round trip's legs: the legs that are wire and wake-ups on both sides, and what is left
(p2pkv's steps against the bare server's parse).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

import p2pkv
from p2pkv.cli import Child, demo_keys, set_env_defaults
from p2pkv.session import consumer as consumer_mod
from p2pkv.session import producer as producer_mod
from p2pkv.session import protocol as protocol_mod
from p2pkv.session import session as session_mod

now = time.perf_counter_ns
STAMPS: list[tuple[str, int]] = []


def stamp(tag: str) -> None:
    STAMPS.append((tag, now()))


def wrap_sync(cls: type, name: str, tag: str, *, after: bool = False) -> None:
    inner: Callable[..., Any] = getattr(cls, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        if not after:
            stamp(tag)
            return inner(*a, **k)
        out = inner(*a, **k)
        stamp(tag)
        return out

    setattr(cls, name, wrapper)


def wrap_async(cls: type, name: str, tag_in: str, tag_out: str) -> None:
    inner: Callable[..., Any] = getattr(cls, name)

    async def wrapper(*a: Any, **k: Any) -> Any:
        stamp(tag_in)
        try:
            return await inner(*a, **k)
        finally:
            stamp(tag_out)

    setattr(cls, name, wrapper)


def instrument() -> None:
    wrap_sync(session_mod.PeerSession, "_send_now", "send")
    wrap_sync(protocol_mod.SessionProtocol, "receive_data", "recv")
    wrap_sync(protocol_mod.SessionProtocol, "next_event", "event", after=True)
    wrap_async(producer_mod.ProducerSide, "_answer_lookup", "answer_in", "answer_out")
    wrap_sync(consumer_mod.ConsumerSide, "_on_answer", "on_answer")
    wrap_async(consumer_mod.ConsumerSide, "_wait_for_answer", "wait_in", "resumed")
    wrap_async(consumer_mod.ConsumerSide, "lookup", "lookup_in", "lookup_out")


# --- the source -------------------------------------------------------------------------------


def run_source(out_path: str) -> None:
    from control_plane import frames

    from p2pkv.cli.serve import serve

    instrument()
    cfg = p2pkv.NodeConfig(peer_id="source", num_blocks=16, block_len=64 * 1024, transport="nixl")
    request, answer = frames(1)
    bare: list[tuple[str, int]] = []

    async def handle(stream: trio.SocketStream) -> None:
        buf = bytearray()
        while data := await stream.receive_some(1 << 16):
            bare.append(("recv", now()))
            buf += data
            while len(buf) >= len(request):  # the client sends only this frame
                del buf[: len(request)]
                bare.append(("send", now()))
                await stream.send_all(answer)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
            )
            print(json.dumps({"bare": listeners[0].socket.getsockname()[1]}), flush=True)
            await serve(cfg, fill=1, seed=0, exit_on_eof=True)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        with open(out_path, "w") as f:
            json.dump([STAMPS, bare], f)


# --- the consumer -----------------------------------------------------------------------------


async def consume(
    source: tuple[str, int], bare: tuple[str, int], samples: int, gap: float, close: str
) -> list[Any]:
    from control_plane import frames

    cfg = p2pkv.NodeConfig(peer_id="consumer", num_blocks=16, block_len=64 * 1024, transport="nixl")
    keys = demo_keys(1)
    bare_times: list[tuple[int, int, int]] = []  # send starts, send returns, answer arrives
    rounds: list[tuple[int, int]] = []
    request, answer = frames(1)
    async with p2pkv.open_node(cfg) as node:
        peer = await node.connect(source)
        stream = await trio.open_tcp_stream(*bare)
        for i in range(samples + 20):
            for kind in ("p2pkv", "bare") if i % 2 else ("bare", "p2pkv"):
                if kind == "p2pkv":
                    t0 = now()
                    rnd = await node.lookup_round(peer, keys)
                    t1 = now()
                    if close == "release":
                        await node.release(peer, rnd)
                    else:
                        got = await node.fetch(peer, keys, [rnd])
                        assert got.loaded == keys, got.failed
                        node.store.evict(keys[0])
                    assert all(rnd.hits)
                    if i >= 20:
                        rounds.append((t0, t1))
                else:
                    b0 = now()
                    await stream.send_all(request)
                    b1 = now()
                    data = await stream.receive_some(1 << 16)
                    b2 = now()
                    assert data == answer
                    if i >= 20:
                        bare_times.append((b0, b1, b2))
                await trio.sleep(gap)
        await stream.aclose()
    return [rounds, bare_times]


def bare_legs(times: list[tuple[int, int, int]], src: list[Any]) -> dict[str, list[float]]:
    """The bare round trips' legs, by the server's stamps between each one's ends."""
    arrived = [t for tag, t in src if tag == "recv"]
    sent = [t for tag, t in src if tag == "send"]
    out: dict[str, list[float]] = {}

    def add(name: str, v: float) -> None:
        out.setdefault(name, []).append(v / 1e3)

    for b0, _b1, b2 in times:
        i, j = bisect.bisect_left(arrived, b0), bisect.bisect_left(sent, b0)
        if i == len(arrived) or j == len(sent) or not b0 <= arrived[i] <= sent[j] <= b2:
            continue
        add("bare total", b2 - b0)
        add("bare: send_all to the source's receive_some returns", arrived[i] - b0)
        add("bare: the source's parse", sent[j] - arrived[i])
        add("bare: the source's send_all to the client's receive_some returns", b2 - sent[j])
    return out


def steps(rounds: list[tuple[int, int]], cons: list[Any], src: list[Any]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}

    def add(name: str, v: float) -> None:
        out.setdefault(name, []).append(v / 1e3)

    ci = si = 0
    for t0, t1 in rounds:
        c = []
        while ci < len(cons) and cons[ci][1] <= t1:
            if cons[ci][1] >= t0:
                c.append(cons[ci])
            ci += 1
        while si < len(src) and src[si][1] < t0:
            si += 1
        s = []
        while si < len(src) and src[si][1] <= t1:
            s.append(src[si])
            si += 1
        first: dict[str, int] = {}
        for tag, t in c:
            first.setdefault("c_" + tag, t)
        for tag, t in s:
            first.setdefault("s_" + tag, t)
        need = ["c_send", "s_recv", "s_answer_in", "s_answer_out", "s_send", "c_recv"]
        need += ["c_on_answer", "c_resumed"]
        if not all(k in first for k in need):
            continue
        add("total", t1 - t0)
        add("consumer: lookup() to send", first["c_send"] - t0)
        add("wire + source wake: send to source's receive_data", first["s_recv"] - first["c_send"])
        add("source: receive_data to _answer_lookup", first["s_answer_in"] - first["s_recv"])
        add("source: _answer_lookup", first["s_answer_out"] - first["s_answer_in"])
        add("source: answered to send", first["s_send"] - first["s_answer_out"])
        add("wire + consumer wake: source send to receive_data", first["c_recv"] - first["s_send"])
        add("consumer: receive_data to _on_answer", first["c_on_answer"] - first["c_recv"])
        add("consumer: _on_answer to task resumed", first["c_resumed"] - first["c_on_answer"])
        add("consumer: resumed to lookup() returns", t1 - first["c_resumed"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--gap", type=float, default=0.0, help="seconds asleep between samples")
    parser.add_argument(
        "--pin", action="store_true", help="each process on a core of its own (1, 2, 3)"
    )
    parser.add_argument("--close", choices=["fetch", "release"], default="fetch")
    parser.add_argument("--source", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    set_env_defaults()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "bench"))  # control_plane's frames
    if args.source:
        run_source(args.source)
        return 0
    src_out = f"/tmp/lookup_timeline_src_{os.getpid()}.json"
    src_argv = [sys.executable, __file__, "--source", src_out]
    if args.pin:
        os.sched_setaffinity(0, {1})
        src_argv = ["taskset", "-c", "2", *src_argv]
    with Child(src_argv, name="source") as source:
        bare_port = source.receive(timeout=60)["bare"]
        host, port = source.receive(timeout=300)["address"]
        instrument()
        rounds, bare_times = trio.run(
            consume,
            (host, int(port)),
            ("127.0.0.1", int(bare_port)),
            args.samples,
            args.gap,
            args.close,
        )
    with open(src_out) as f:
        src, bare_src = json.load(f)
    os.unlink(src_out)
    result = steps(rounds, STAMPS, src)
    legs = bare_legs(bare_times, bare_src)
    print(
        f"{len(result.get('total', []))} lookups and {len(legs.get('bare total', []))} bare "
        f"round trips with every stamp; {os.cpu_count()} cores; rounds closed by a {args.close}"
    )
    for name, vals in [*legs.items(), *result.items()]:
        print(f"  {name:<66}{statistics.median(vals):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
