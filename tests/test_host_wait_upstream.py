"""Frames still on their way to a host-pinning producer when the consumer gives up
(proven a defect on 2026-12-07 and fixed the same day; see docs/design.md, "The
producer's reader never waits for the host").

The producer's reader used to wait for the host's answer to each lookup, bounded from
when a frame reached its socket; the consumer's quarantine counts from its give-up.
Frames an honest consumer queued before it gave up, still in its outbox, its kernel or
on the link, were not "unread" to the producer: its reader caught up between the bursts
they arrived in, and each catch-up bought the next lookup a fresh ``answer_within`` from
a stalled host. A fetch queued behind a few large lookups was acted on ~8.5 s after the
give-up, past the 6 s quarantine, and its write landed in slots the consumer had reused.
Now lookups wait on the host in tasks of their own and the reader acts on every frame
as it arrives.

Two real nodes over real loopback TCP, through a FAKE link (a network model: the
consumer's bytes reach the producer a millisecond per 64 KiB hop; answers come back at
once). The producer's host is a Trio task that never answers the other callers' lookups
(``task_hosted_source``). Autojump clock, VirtualOffload (no real threads).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import trio
import trio.testing

from p2pkv import P2PKVError, open_node
from p2pkv.session.protocol import AbortRequested, FetchRequested

from .helpers import VirtualOffload, config
from .test_host_pins import (
    BLOCK,
    N_BLOCKS,
    VIRTUAL_BOUND,
    block_at,
    host_region,
    task_hosted_source,
)

HOP = 64 << 10  # bytes the link carries per hop
LATENCY = 0.001  # virtual seconds per hop (~64 MB/s)
ANSWER_WITHIN = 2.0  # the vLLM tier's serve_timeout_s
QUARANTINE = 6.0  # the tier's quarantine_s (> abort 2 + landing margin 1 + serve 2)
ABORT, MARGIN = 2.0, 1.0  # the tier's abort_timeout_s and landing_margin_s
CANCEL_AT = 0.5  # virtual seconds: when the fetch's caller cancels it
OTHER_KEYS = 65536  # a lookup of the default max_keys_per_request, 128-byte keys (~8.4 MB)


async def link(listener: trio.SocketListener, upstream: tuple[str, int]) -> None:
    """FAKE network between the nodes: the consumer's bytes go on ``LATENCY`` after the
    link took them, ``HOP`` bytes at a time, through a small send buffer (a switch's), so
    the consumer's backpressure is the producer's window, as on a real link."""
    async with (
        listener,
        await listener.accept() as down,
        await trio.open_tcp_stream(*upstream) as up,
    ):
        up.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

        async def forward() -> None:
            while data := await down.receive_some(HOP):
                await trio.sleep(LATENCY)
                await up.send_all(data)

        async def back() -> None:
            while data := await up.receive_some(HOP):
                await down.send_all(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward)
            nursery.start_soon(back)


async def test_a_fetch_queued_behind_lookups_is_acted_on_within_the_quarantine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The consumer queues four large lookups (other callers'), then a fetch, then one
    more lookup, all at once; the fetch's caller cancels it at 0.5 s. The producer must
    act on the fetch (and its abort) early enough that its write cannot land after the
    quarantine: by the give-up plus ``quarantine - abort - landing margin``. It acted on
    it ~8.5 s after, and its write overwrote every block the consumer's host put in the
    slots once their quarantine was over."""
    keys = [os.urandom(32) for _ in range(N_BLOCKS)]
    region = host_region()
    dst_kw: dict[str, Any] = {"max_landing_share": 1.0, "quarantine": QUARANTINE}
    acted: dict[str, float] = {}  # when the producer's reader acted on each
    with trio.fail_after(VIRTUAL_BOUND):
        async with (
            task_hosted_source(
                {k: i for i, k in enumerate(keys)}, answer_within=ANSWER_WITHIN, region=region
            ) as (src, _host),
            open_node(
                config("dst", num_blocks=N_BLOCKS, **dst_kw), offload=VirtualOffload()
            ) as dst,
            trio.open_nursery() as net,
        ):
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            net.start_soon(link, listeners[0], src.address)
            peer = await dst.connect(listeners[0].socket.getsockname()[:2])
            [session] = src._sessions
            for kind in (FetchRequested, AbortRequested):
                handler = session._handlers[kind]

                def timed(ev: Any, handler: Any = handler, name: str = kind.__name__) -> Any:
                    acted.setdefault(name, trio.current_time() - start)
                    return handler(ev)

                session._handlers[kind] = timed
            handle = await dst.lookup_round(peer, keys)
            assert all(handle.hits)

            async def other_caller() -> None:
                # Another caller's lookup on the same session, of keys the producer's
                # host does not answer (not there, or busy).
                with contextlib.suppress(P2PKVError):
                    await dst.lookup(peer, [os.urandom(128) for _ in range(OTHER_KEYS)])

            async def fetch() -> None:
                with trio.move_on_after(CANCEL_AT):
                    result = await dst.fetch(peer, keys, rounds=[handle])
                    assert result.loaded == [], result
                gave_up_at.append(trio.current_time() - start)  # its slots' quarantine began

            start = trio.current_time()
            gave_up_at: list[float] = []
            mine = {os.urandom(32): os.urandom(BLOCK) for _ in range(N_BLOCKS)}
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(other_caller)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(fetch)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(other_caller)  # queued before the give-up too
            # (The other callers' lookups time out; the fetch has given up.)
            await trio.sleep_until(start + gave_up_at[0] + QUARANTINE + 0.01)
            for k, data in mine.items():  # the quarantine is over: the consumer's host
                dst.store.put(k, data)  # takes the slots
            await trio.sleep(30)  # whatever the producer still does, it has done
            net.cancel_scope.cancel()
            sessions = dst.statistics().sessions
            fetched = {block_at(region, i) for i in range(N_BLOCKS)}
            bad = [k for k, data in mine.items() if bytes(dst.store.get(k) or b"") != data]
            theirs = sum(bytes(dst.store.get(k) or b"") in fetched for k in bad)
    assert sessions == 1  # the session lived throughout
    budget = gave_up_at[0] + QUARANTINE - ABORT - MARGIN
    assert acted.get("FetchRequested", 0.0) <= budget, (
        f"the producer acted on the fetch at {acted} (s after it was queued), past the "
        f"give-up at {gave_up_at[0]:.3f} s + quarantine - abort - landing margin"
    )
    assert not bad, f"{len(bad)} of {N_BLOCKS} reused blocks overwritten, {theirs} by the fetch"
