"""``p2pkv demo``: the end-to-end check a reader runs first.

A source node in a child process fills its store with deterministic blocks
(:mod:`p2pkv.cli.blocks`), this process connects to it (the cold connect is timed), looks
the keys up, fetches them over NIXL in scattered order and verifies every byte against what
it computes itself. It exits 0 only if every byte matched.
"""

from __future__ import annotations

import argparse
import functools
import sys

from ..node import open_node
from .blocks import demo_keys, fill_store
from .child import Child
from .pull import Progress, PullReport, consume, finish, pull, size_text, stderr_progress
from .settings import consumer_config, run_trio, set_env_defaults


async def _demo_local(args: argparse.Namespace, progress: Progress) -> PullReport:
    src_cfg = consumer_config(args, "demo-source")
    async with open_node(src_cfg) as src, open_node(consumer_config(args, "demo-consumer")) as dst:
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


def cmd_demo(args: argparse.Namespace) -> int:
    set_env_defaults()  # the child process inherits them
    progress = stderr_progress("demo")
    progress(f"{args.blocks:,} blocks x {size_text(args.block_len)} over {args.transport}")
    if args.transport == "local":  # in-process data plane: both nodes in this process
        return finish(run_trio(_demo_local, args, progress), "local (one process)")
    argv = [sys.executable, "-m", "p2pkv", "--log-level", args.log_level, "serve"]
    argv += ["--exit-on-eof", "--transport", "nixl", "--peer-id", "demo-source"]
    # "--flag=value": a value that starts with "-" (a fingerprint, a negative seed) is
    # not taken for a flag of its own.
    argv += ["--host", "127.0.0.1", "--port", "0", f"--fingerprint={args.fingerprint}"]
    argv += ["--blocks", str(args.blocks), "--block-len", str(args.block_len)]
    argv += ["--fill", str(args.blocks), f"--seed={args.seed}"]
    child = Child(argv, name="source process")
    try:
        hello = child.receive(timeout=args.timeout)
        host, port = hello["address"]
        progress(
            f"source process {child.pid} filled {hello['blocks']:,} blocks, "
            f"listening at {host}:{port}"
        )
        report = run_trio(
            functools.partial(
                consume,
                consumer_config(args, "demo-consumer"),
                (host, int(port)),
                blocks=args.blocks,
                seed=args.seed,
                batch=args.batch,
                progress=progress,
                corrupt=args.corrupt_for_test,
            )
        )
    finally:
        rc = child.close()
    if rc != 0:
        progress(f"warning: the source process exited with status {rc}")
    return finish(report, "nixl (two processes)")
