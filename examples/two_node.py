"""Two p2pkv nodes: a producer holds KV blocks, a consumer fetches them and checks them.

One host, one command (the producer runs in a child process, blocks move over NIXL)::

    python examples/two_node.py
    python examples/two_node.py --transport local    # in-process copies, one process

Two hosts::

    host-a$ python examples/two_node.py --listen 0.0.0.0:5555
    host-b$ python examples/two_node.py --peer host-a:5555

Across hosts UCX picks the network device; set ``UCX_NET_DEVICES`` (e.g. ``eth0``) to
choose one. On one host the example keeps UCX on loopback.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
from typing import Literal

import trio

import p2pkv

NUM_BLOCKS = 256
BLOCK_LEN = 64 * 1024  # bytes per KV block; both sides must agree (checked at handshake)


def make_block(key: bytes) -> bytes:
    """Stand-in for real KV data: the key's hash, repeated to fill a block."""
    return (key * (BLOCK_LEN // len(key) + 1))[:BLOCK_LEN]


# Blocks are named by hash, as an inference engine names prefix blocks.
KEYS = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(NUM_BLOCKS)]


Transport = Literal["nixl", "local"]


def config(peer_id: str, host: str, port: int, transport: Transport) -> p2pkv.NodeConfig:
    return p2pkv.NodeConfig(
        peer_id=peer_id,
        host=host,
        port=port,
        num_blocks=NUM_BLOCKS,
        block_len=BLOCK_LEN,
        transport=transport,
    )


async def produce(host: str, port: int, transport: Transport) -> None:
    """The producer: put blocks in the store, then answer peers until SIGINT/SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with p2pkv.open_node(config("producer", host, port, transport)) as node:
            for key in KEYS:
                node.store.put(key, make_block(key))  # the host's KV tier fills up
            host, port = node.address  # the port actually bound (port 0 picks one)
            print(f"producer listening on {host}:{port}", flush=True)
            async for _ in signals:
                break  # leaving `async with` says bye to peers and closes the node


async def consume(node: p2pkv.Node, address: tuple[str, int]) -> bool:
    """The consumer: connect, ask which blocks the producer has, fetch them, check them."""
    peer = await node.connect(address)  # returns once both sides registered each other
    hits = await node.lookup(peer, KEYS)  # one flag per key; hits stay pinned there
    print(f"{sum(hits)} of {len(KEYS)} blocks are at {peer.peer_id}")
    result = await node.fetch(peer, KEYS)  # NIXL writes them into our store
    for key, reason in result.failed.items():
        print(f"  not loaded: {key.hex()[:12]}: {reason}")
    ok = [k for k in result.loaded if bytes(node.store.get(k) or b"") == make_block(k)]
    print(f"fetched {len(result.loaded)} blocks, {len(ok)} byte-identical to the producer's")
    return len(ok) == len(KEYS)


async def consumer_main(address: tuple[str, int], transport: Transport) -> bool:
    async with p2pkv.open_node(config("consumer", "127.0.0.1", 0, transport)) as node:
        return await consume(node, address)


async def one_process() -> bool:
    """--transport local: both nodes in this process (the in-process data plane)."""
    async with p2pkv.open_node(config("producer", "127.0.0.1", 0, "local")) as producer:
        for key in KEYS:
            producer.store.put(key, make_block(key))
        async with p2pkv.open_node(config("consumer", "127.0.0.1", 0, "local")) as node:
            return await consume(node, producer.address)


def one_host_nixl() -> bool:
    """Start the producer as a child process, fetch from it, always stop it."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = next((ln for ln in child.stdout if ln.startswith("producer listening")), None)
        if line is None:
            raise SystemExit("the producer process did not start")
        host, port = line.split()[-1].rsplit(":", 1)
        return trio.run(consumer_main, (host, int(port)), "nixl")
    finally:
        child.terminate()  # SIGTERM: the producer closes its node cleanly
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--listen", metavar="HOST:PORT", help="run the producer here")
    parser.add_argument("--peer", metavar="HOST:PORT", help="fetch from the producer there")
    parser.add_argument("--transport", choices=["nixl", "local"], default="nixl")
    args = parser.parse_args()
    transport: Transport = "local" if args.transport == "local" else "nixl"
    two_hosts = bool(args.peer) or (args.listen and not args.listen.startswith("127."))
    os.environ.setdefault("UCX_NET_DEVICES", "all" if two_hosts else "lo")
    os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "none")  # faster agent start-up
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.listen:
        host, port = args.listen.rsplit(":", 1)
        trio.run(produce, host, int(port), transport)
        return 0
    if args.peer:
        host, port = args.peer.rsplit(":", 1)
        ok = trio.run(consumer_main, (host, int(port)), transport)
    else:
        ok = trio.run(one_process) if transport == "local" else one_host_nixl()
    print("OK: every block arrived intact" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
