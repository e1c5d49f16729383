"""``p2pkv serve``: run a node until a signal (or EOF on stdin) stops it."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

import trio

from ..config import NodeConfig
from ..node import open_node
from .blocks import demo_keys, fill_store
from .child import emit, receive_commands
from .settings import is_loopback, run_trio, serve_settings, set_env_defaults

log = logging.getLogger("p2pkv.cli")


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
    # Catch the signals before saying we listen: a parent may stop us right after. SIGHUP
    # (the terminal or session went away) stops us as gracefully: left to its default, it
    # ended the process with no bye to the peers and writes cut wherever they were.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
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


def cmd_serve(args: argparse.Namespace) -> int:
    cfg, fill, seed = serve_settings(args)
    set_env_defaults(loopback=is_loopback(cfg.host))
    run_trio(functools.partial(serve, cfg, fill=fill, seed=seed, exit_on_eof=args.exit_on_eof))
    return 0
