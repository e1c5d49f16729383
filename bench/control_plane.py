"""Control plane: round trip of a lookup on loopback, against a bare Trio TCP round trip of
the same bytes, p50 / p90 / p99.

Reproduce (about 30 s on 2 cores; ``--quick`` for a smoke run)::

    .venv/bin/python bench/control_plane.py [--json PATH]

Three processes: the source (this script with ``--source``: a node filled like ``p2pkv
serve --fill 1024``'s, NIXL, and beside it on the same Trio loop a bare echo server), a
second bare server in a process of its own (``--bare-server``: plain Trio TCP, no p2pkv)
and this process as the client of all three, each connected once. A p2pkv sample is one
``node.lookup(peer, keys)`` with every key present (every key is pinned at the source, the
usual case before a fetch); between samples, untimed, a one-block fetch closes the round
(that releases the pins and the request slot; a lookup round otherwise stays open for its
lease) and the block is evicted again. ``--close release`` closes it with a release instead
(an empty fetch frame: no data plane between samples). A bare sample sends the very frame
that lookup puts on the wire and reads back the very frame its answer is, over a Trio TCP
stream, with nothing else on either side: what the round trip would cost with no engine at
all.

There are two bare kinds. ``bare`` is answered in the source's process, by the same Trio
loop as the node: both ends of its round trip are the processes p2pkv's lookup runs
between, with the same heaps, caches and loops, so the ratio to it is what the engine adds.
``bare_own`` is answered by a process that does nothing else; with the rounds closed by
fetches it is the slower of the two, for a reason not established (docs/design.md,
"Performance: where it stands"). It is printed for reference: until 2026-12-03 it was the
only bare kind (``bench/notes/control_plane.md``).

The kinds alternate sample by sample (their order rotates and flips), for 1 key and for
``--keys`` keys, so all see the same load. The samples are split into ``--reps``
consecutive reps; each ratio (p2pkv p50 over bare p50) is the median of the reps' ratios
with their min-max. The CPU time of the consumer's Trio thread per lookup is printed too:
what else shares the cores moves it less than it moves a latency (on a busy 2-core box it
still swings by a third).

``--ab-lane`` adds a kind, sampled in turn with the others on the same session: p2pkv with
the session's answer lane off (each answer reaches the lookup's task through the reader and
an event, as before the lane; ``docs/design.md``, "Sessions"). It prints the lane's worth
as a ratio paired rep by rep.

``--lean`` adds a kind answered by a lookup server with no engine, on the source's loop
beside ``bare``: each lookup frame decoded with p2pkv's codec, its keys pinned in the
node's own store, the answer encoded and sent, the pins dropped after the send; the client
encodes and decodes the same way. It is what the same work costs in plain Trio, with
none of a session's machinery (request slots, rounds, leases, caps, the answer lane):
a reference for how much of the gap to ``bare`` the engine's structure is
(``bench/notes/control_plane.md``). ``--pin-cpus C,S,B`` runs the client, the source
and the ``bare_own`` process each on its own CPUs (``2+3`` names two).

Targets (issue 9): ``--keys`` 1,024 at p50 <= 1.5 ms on a 2-core machine, <= 1 ms with
more cores; 1 key within 1.5 x the bare round trip (``bare``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import trio

import p2pkv
from p2pkv.cli import Child, demo_keys, set_env_defaults
from p2pkv.cli.blocks import fill_store
from p2pkv.store import BlockStore
from p2pkv.wire import HEADER, FrameDecoder, Lookup, LookupResp, encode, trusted

TARGET_RATIO_1_KEY = 1.5
T = TypeVar("T")
REQ_ID = 1000  # a request id of the size a run's ids have (msgpack: 3 bytes)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def frames(n: int) -> tuple[bytes, bytes]:
    """The lookup frame of the first ``n`` demo keys and its all-hit answer."""
    keys = demo_keys(n)
    return (
        encode(Lookup(req_id=REQ_ID, keys=keys)),
        encode(LookupResp(req_id=REQ_ID, hits=[True] * n)),
    )


async def receive_frame(stream: trio.SocketStream, buf: bytearray) -> bytes | None:
    """One length-prefixed frame from ``stream`` (``buf`` keeps what follows it)."""
    while True:
        if len(buf) >= HEADER.size:
            end = HEADER.size + HEADER.unpack_from(buf)[0]
            if len(buf) >= end:
                frame = bytes(buf[:end])
                del buf[:end]
                return frame
        data = await stream.receive_some(1 << 20)
        if not data:
            return None
        buf += data


def pin_cpus(spec: str) -> list[set[int]]:
    """``--pin-cpus``: the client's, the source's and ``bare_own``'s CPU sets."""
    sets = [{int(cpu) for cpu in part.split("+")} for part in spec.split(",")]
    if len(sets) != 3:
        raise SystemExit(f"--pin-cpus wants three CPU sets (client,source,bare_own), got {spec!r}")
    return sets


def sample_order(kinds: Sequence[T], i: int) -> list[T]:
    """The order of the kinds in sample ``i``: it flips every sample and rotates every
    second one, so over any 2k samples in a row each of k kinds runs in each place twice
    (two kinds: ab ba ba ab ...; what follows the previous sample's untimed fetch is each
    kind in turn)."""
    r = i // 2 % len(kinds)
    order = [*kinds[r:], *kinds[:r]]
    return order if i % 2 else order[::-1]


# --- the bare servers -------------------------------------------------------------------------


async def start_bare(nursery: trio.Nursery, counts: Sequence[int]) -> list[Any]:
    """Start a server that answers each lookup frame with its all-hit answer frame; its
    address."""
    answers = dict(frames(n) for n in counts)

    async def handle(stream: trio.SocketStream) -> None:
        buf = bytearray()
        while (frame := await receive_frame(stream, buf)) is not None:
            await stream.send_all(answers[frame])

    serve = functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
    listeners = await nursery.start(serve)
    return list(listeners[0].socket.getsockname()[:2])


async def start_lean(nursery: trio.Nursery, store: BlockStore) -> list[Any]:
    """Start the engine-less lookup server of ``--lean``; its address."""

    async def handle(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        while data := await stream.receive_some(1 << 20):
            decoder.feed(data)
            while (msg := decoder.next_message()) is not None:
                if type(msg) is not Lookup:
                    raise SystemExit(f"the lean server got a {type(msg).__name__}")
                owner = ("lean", msg.req_id)
                hits = [slot is not None for slot in store.pin(owner, msg.keys)]
                await stream.send_all(encode(trusted[LookupResp](req_id=msg.req_id, hits=hits)))
                store.unpin(owner)  # the round's close, after the answer (off the path)

    serve = functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
    listeners = await nursery.start(serve)
    return list(listeners[0].socket.getsockname()[:2])


def lean_client(
    stream: trio.SocketStream, keys: Sequence[bytes], cpu: list[float]
) -> Callable[[int], Awaitable[float]]:
    """A ``--lean`` sample: one lookup of the first ``n`` keys, all hits, through
    ``stream``; its round-trip time (and the client thread's CPU for it, in ``cpu``)."""
    decoder = FrameDecoder()
    req_ids = itertools.count(REQ_ID)

    async def sample(n: int) -> float:
        c0, t0 = time.thread_time(), time.perf_counter()
        req = next(req_ids)
        await stream.send_all(encode(trusted[Lookup](req_id=req, keys=list(keys[:n]))))
        while (msg := decoder.next_message()) is None:
            decoder.feed(await stream.receive_some(1 << 20))
        elapsed = time.perf_counter() - t0
        cpu.append(time.thread_time() - c0)
        if type(msg) is not LookupResp or msg.req_id != req or msg.hits != [True] * n:
            raise SystemExit(f"the lean server answered {msg!r}")
        return elapsed

    return sample


async def serve_bare(counts: Sequence[int]) -> None:
    """The bare server in a process of its own; stops at EOF on stdin."""
    async with trio.open_nursery() as nursery:
        print(json.dumps({"address": await start_bare(nursery, counts)}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # EOF: the parent is done
        nursery.cancel_scope.cancel()


async def serve_source(args: argparse.Namespace) -> None:
    """The source: a node like ``p2pkv serve --fill``'s, filled with ``--keys`` demo keys,
    and on the same Trio loop a bare server (and with ``--lean`` the lean one); stops at
    EOF on stdin."""
    cfg = p2pkv.NodeConfig(
        peer_id="source", num_blocks=args.keys, block_len=args.block_len, transport="nixl"
    )
    if args.max_keys_per_request:
        cfg = attrs.evolve(cfg, max_keys_per_request=args.max_keys_per_request)
    async with trio.open_nursery() as nursery, p2pkv.open_node(cfg) as node:
        fill_store(node.store, demo_keys(args.keys), 0)
        bare = await start_bare(nursery, args.counts)
        lean = await start_lean(nursery, node.store) if args.lean else None
        print(json.dumps({"bare": bare, "lean": lean, "address": node.address}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # EOF: the parent is done
        nursery.cancel_scope.cancel()


# --- the client ------------------------------------------------------------------------------


Samples = dict[str, dict[int, list[list[float]]]]  # kind -> keys -> rep -> seconds


async def measure(
    args: argparse.Namespace,
    source: tuple[str, int],
    bares: dict[str, tuple[str, int]],
    lean: tuple[str, int] | None = None,
) -> Samples:
    cfg = p2pkv.NodeConfig(
        peer_id="consumer", num_blocks=16, block_len=args.block_len, transport="nixl"
    )
    keys = demo_keys(args.keys)
    counts = args.counts
    samples: Samples = {
        kind: {n: [[] for _ in range(args.reps)] for n in counts}
        for kind in ("p2pkv", *bares, "p2pkv_cpu", "bare_cpu")
        + (("no_lane",) if args.ab_lane else ())
        + (("lean", "lean_cpu") if lean else ())
    }
    per_rep = math.ceil(args.samples / args.reps)
    async with p2pkv.open_node(cfg) as node:
        peer = await node.connect(source)
        (session,) = node._sessions
        streams = {kind: await trio.open_tcp_stream(*addr) for kind, addr in bares.items()}

        cpu: list[float] = []

        async def p2pkv_lookup(n: int) -> float:
            held: p2pkv.LookupRound | None = None
            c0, t0 = time.thread_time(), time.perf_counter()
            if args.close == "release":  # node.lookup's path, keeping the round's handle
                held = await node.lookup_round(peer, keys[:n])
                hits = held.hits
            else:
                hits = await node.lookup(peer, keys[:n])
            elapsed = time.perf_counter() - t0
            cpu.append(time.thread_time() - c0)
            if not all(hits):
                raise SystemExit(f"lookup missed {hits.count(False)} keys")
            # Untimed: close the round, which releases the pins and the request slot.
            if held is not None:
                if await node.release(peer, held) < 1:
                    raise SystemExit("the lookup's round was not open to release")
            else:
                result = await node.fetch(peer, keys[:1])
                assert result.loaded == keys[:1], result.failed
                node.store.evict(keys[0])
            return elapsed

        bare_frames = {n: frames(n) for n in counts}

        bare_cpu: list[float] = []  # the client's CPU per round trip with "bare"
        lean_cpu: list[float] = []  # and with "lean"

        def bare_round_trip(
            stream: trio.SocketStream, kind: str
        ) -> Callable[[int], Awaitable[float]]:
            buf = bytearray()

            async def sample(n: int) -> float:
                request, answer = bare_frames[n]
                c0, t0 = time.thread_time(), time.perf_counter()
                await stream.send_all(request)
                got = await receive_frame(stream, buf)
                elapsed = time.perf_counter() - t0
                if kind == "bare":
                    bare_cpu.append(time.thread_time() - c0)
                assert got == answer
                return elapsed

            return sample

        async def no_lane_lookup(n: int) -> float:
            # The same session with its answer lane off: each answer reaches the lookup's
            # task through the reader and an event (p2pkv before the lane).
            session.answer_lane = False
            try:
                elapsed = await p2pkv_lookup(n)
            finally:
                session.answer_lane = True
            cpu.pop()
            return elapsed

        kinds: list[tuple[str, Callable[[int], Awaitable[float]]]] = [("p2pkv", p2pkv_lookup)]
        kinds += [(kind, bare_round_trip(stream, kind)) for kind, stream in streams.items()]
        if args.ab_lane:
            kinds.insert(1, ("no_lane", no_lane_lookup))
        if lean:
            streams["lean"] = await trio.open_tcp_stream(*lean)
            kinds.append(("lean", lean_client(streams["lean"], keys, lean_cpu)))
        settle = args.settle_ms / 1e3
        for i in range(args.warmup + per_rep * args.reps):
            rep = (i - args.warmup) // per_rep
            for n in counts:
                for kind, sample in sample_order(kinds, i):
                    if settle:
                        await trio.sleep(settle)
                    elapsed = await sample(n)
                    if rep >= 0:
                        samples[kind][n][rep].append(elapsed)
                if rep >= 0:
                    samples["p2pkv_cpu"][n][rep].append(cpu[-1])
                    samples["bare_cpu"][n][rep].append(bare_cpu[-1])
                    if lean:
                        samples["lean_cpu"][n][rep].append(lean_cpu[-1])
        for stream in streams.values():
            await stream.aclose()
    return samples


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": statistics.median(values),
        "p90": pct(values, 0.9),
        "p99": pct(values, 0.99),
        "min": min(values),
        "max": max(values),
    }


def paired(samples: Samples, a: str, b: str) -> dict[str, dict[str, Any]]:
    """Kind ``a``'s p50 over kind ``b``'s, rep by rep, per key count: the median of the
    reps' ratios, their min and max, and each."""
    out: dict[str, dict[str, Any]] = {}
    for n in samples[a]:
        ratios = [
            statistics.median(x) / statistics.median(y)
            for x, y in zip(samples[a][n], samples[b][n], strict=True)
        ]
        out[str(n)] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "per_rep": ratios,
        }
    return out


def report(args: argparse.Namespace, samples: Samples, load: list[float]) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    target_p50 = args.target_ms * 1e-3 if args.target_ms else (1.5e-3 if cores <= 2 else 1e-3)
    out: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "host": platform.node(),
            "cores": cores,
            "load_average_before": load[0],
            "load_average_after": load[1],
            "python": platform.python_version(),
        },
        "reps": args.reps,
        "samples_per_kind": args.reps * len(samples["p2pkv"][1][0]),
        "close": args.close,
        "max_keys_per_request": getattr(args, "max_keys_per_request", None),
        "p2pkv_module": os.path.dirname(p2pkv.__file__),
        "cpus": sorted(os.sched_getaffinity(0)),
        "pin_cpus": getattr(args, "pin_cpus", None),
        "latency_s": {},
        "consumer_cpu_s": {},
        "ratio": {},
    }
    for kind, by_n in samples.items():
        summaries = {str(n): summary([v for r in reps for v in r]) for n, reps in by_n.items()}
        if kind == "p2pkv_cpu":
            out["consumer_cpu_s"] = summaries
        elif kind == "bare_cpu":  # the same thread's CPU per bare round trip
            out["bare_client_cpu_s"] = summaries
        elif kind == "lean_cpu":  # and per lean one
            out["lean_client_cpu_s"] = summaries
        else:
            out["latency_s"][kind] = summaries
    if "lean" in samples:  # the engine-less server's round trip over bare's
        out["ratio_lean"] = paired(samples, "lean", "bare")
    if "no_lane" in samples:
        out["ratio_no_lane"] = paired(samples, "no_lane", "bare")
        out["ratio_lane_over_no_lane"] = paired(samples, "p2pkv", "no_lane")
    # "ratio": over the bare round trip between the same two processes (the target's);
    # "ratio_own": over the bare server in a process of its own, for reference.
    out["ratio"] = paired(samples, "p2pkv", "bare")
    out["ratio_own"] = paired(samples, "p2pkv", "bare_own")
    p50 = out["latency_s"]["p2pkv"][str(args.keys)]["p50"]
    ratio = out["ratio"]["1"]["median"]
    out["targets"] = {
        f"lookup_{args.keys}_p50_s": {"limit": target_p50, "got": p50, "pass": p50 <= target_p50},
        "lookup_1_over_bare": {
            "limit": TARGET_RATIO_1_KEY,
            "got": ratio,
            "pass": ratio <= TARGET_RATIO_1_KEY,
        },
    }
    return out


def print_report(out: dict[str, Any]) -> None:
    m = out["machine"]
    print(
        f"\ncontrol plane: lookup round trip on loopback; bare: answered in the source's "
        f"process, bare_own: in a process of its own; "
        f"{out['samples_per_kind']} samples per kind in {out['reps']} alternating reps; "
        f"each p2pkv round closed, untimed, by a "
        f"{'release' if out['close'] == 'release' else 'one-block fetch'}"
        + (
            f"; the source takes {out['max_keys_per_request']} keys per request"
            if out.get("max_keys_per_request")
            else ""
        )
    )
    print(
        f"  {out['when']}, {m['host']}, {m['cores']} cores, load average "
        f"{m['load_average_before']:.2f} before / {m['load_average_after']:.2f} after "
        f"(others' work shares these cores); p2pkv from {out['p2pkv_module']}"
    )
    print(f"  {'kind':>8}{'keys':>6}{'p50':>10}{'p90':>10}{'p99':>10}{'min':>10}{'max':>10}")
    for kind, by_n in out["latency_s"].items():
        for n, s in by_n.items():
            cols = [s["p50"], s["p90"], s["p99"], s["min"], s["max"]]
            print(f"  {kind:>8}{n:>6}" + "".join(f"{v * 1e3:8.3f}ms" for v in cols))
    for n, s in out["consumer_cpu_s"].items():
        b = out["bare_client_cpu_s"][n]
        print(
            f"  consumer's Trio thread CPU per p2pkv lookup, {n:>5} keys: "
            f"p50 {s['p50'] * 1e6:.0f} us, p90 {s['p90'] * 1e6:.0f} us; "
            f"per bare round trip p50 {b['p50'] * 1e6:.0f} us"
            + (
                f", per lean one p50 {out['lean_client_cpu_s'][n]['p50'] * 1e6:.0f} us"
                if "lean_client_cpu_s" in out
                else ""
            )
        )
    for n, r in out["ratio"].items():
        o = out["ratio_own"][n]
        print(
            f"  p2pkv / bare, {n:>5} keys: p50 ratio {r['median']:.2f} "
            f"(reps {r['min']:.2f}-{r['max']:.2f}); / bare_own {o['median']:.2f} "
            f"(reps {o['min']:.2f}-{o['max']:.2f})"
        )
    for n, r in out.get("ratio_lean", {}).items():
        print(
            f"  lean / bare, {n:>5} keys: p50 ratio {r['median']:.2f} "
            f"(reps {r['min']:.2f}-{r['max']:.2f}): the same work without the engine"
        )
    if out.get("pin_cpus"):
        print(f"  client, source, bare_own on CPUs {out['pin_cpus']}")
    for n, r in out.get("ratio_no_lane", {}).items():
        q = out["ratio_lane_over_no_lane"][n]
        print(
            f"  no lane / bare, {n:>5} keys: p50 ratio {r['median']:.2f} "
            f"(reps {r['min']:.2f}-{r['max']:.2f}); lane / no lane {q['median']:.2f} "
            f"(reps {q['min']:.2f}-{q['max']:.2f})"
        )
    for name, t in out["targets"].items():
        verdict = "PASS" if t["pass"] else "FAIL"
        unit = 1e3 if name.endswith("_s") else 1.0
        print(f"{verdict}: {name} {t['got'] * unit:.3g} (target <= {t['limit'] * unit:.3g})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1024, help="default: %(default)s")
    parser.add_argument(
        "--samples", type=int, default=300, help="per kind and key count; default: %(default)s"
    )
    parser.add_argument("--reps", type=int, default=5, help="default: %(default)s")
    parser.add_argument("--warmup", type=int, default=20, help="default: %(default)s")
    parser.add_argument("--block-len", type=int, default=64 * 1024, help="default: 64 KiB")
    parser.add_argument(
        "--target-ms", type=float, help="p50 target for --keys (default: 1.5 on <= 2 cores, else 1)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="30 samples")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also 16 and 128 keys (latency against key count; slower)",
    )
    parser.add_argument(
        "--close",
        choices=["fetch", "release"],
        default="fetch",
        help="how each p2pkv sample's round is closed, untimed: a one-block fetch over NIXL"
        " (default), or a release (an empty fetch frame: no data plane between samples)",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        help="sleep this long before each sample of either kind, so that no work left from"
        " the untimed fetch before a p2pkv sample overlaps it (default: %(default)s)",
    )
    parser.add_argument(
        "--ab-lane",
        action="store_true",
        help="also sample p2pkv with the session's answer lane off (a third kind, same"
        " session, alternating): what the lane is worth, paired",
    )
    parser.add_argument(
        "--lean",
        action="store_true",
        help="also sample a lookup server with no engine (p2pkv's codec and store in plain"
        " Trio, on the source's loop): what the engine's structure adds",
    )
    parser.add_argument(
        "--pin-cpus",
        metavar="C,S,B",
        help="run the client, the source and the bare_own process on these CPUs"
        " (each a CPU or CPUs joined by +, e.g. 2,4,6 or 2+3,2+3,2+3)",
    )
    parser.add_argument(
        "--max-keys-per-request",
        type=int,
        metavar="N",
        help="the source takes at most N keys per request, so a lookup of more goes as"
        " several rounds (sent together); the bare kinds still send one frame",
    )
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pin_cpus:
        role = 1 if args.source else 2 if args.bare_server else 0
        os.sched_setaffinity(0, pin_cpus(args.pin_cpus)[role])
    args.counts = sorted({1, args.keys} | ({16, 128} if args.sweep else set()), reverse=True)
    set_env_defaults()
    if args.bare_server:
        trio.run(serve_bare, args.counts)
        return 0
    if args.source:
        trio.run(serve_source, args)
        return 0
    if args.quick:
        args.samples, args.warmup = 30, 5
    child = [sys.executable, __file__, "--keys", str(args.keys), "--block-len", str(args.block_len)]
    child += ["--sweep"] if args.sweep else []
    child += ["--lean"] if args.lean else []
    if args.max_keys_per_request:
        child += ["--max-keys-per-request", str(args.max_keys_per_request)]
    child += ["--pin-cpus", args.pin_cpus] if args.pin_cpus else []
    load_before = os.getloadavg()[0]
    with (
        Child([*child, "--source"], name="source process") as source,
        Child([*child, "--bare-server"], name="bare server") as bare_own,
    ):
        started = source.receive(timeout=300)
        bare, lean = started["bare"], started["lean"]
        host, port = started["address"]
        bares = {"bare": bare, "bare_own": bare_own.receive(timeout=60)["address"]}
        addrs = {kind: (host_, int(port_)) for kind, (host_, port_) in bares.items()}
        samples = trio.run(
            measure, args, (host, int(port)), addrs, (lean[0], int(lean[1])) if lean else None
        )
    out = report(args, samples, [load_before, os.getloadavg()[0]])
    print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(t["pass"] for t in out["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
