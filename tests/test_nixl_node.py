"""Whole nodes over the real NIXL data plane, one node per process (skipped without NIXL).

The node under test runs in this process; its peers run ``node_proc.py`` in child
processes (fixture ``children`` kills and reaps them, also when a test fails). Blocks are
derived from a seed (``block_key`` / ``block_bytes``), so every side can check the bytes it
got against bytes it computed itself. The ``no_agent_left`` fixture proves that nothing a
test opened in this process is left registered with NIXL.
"""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest
import trio

from p2pkv import NodeConfig, PeerUnavailable, open_node
from p2pkv.node import Node
from p2pkv.transport import _nixl_agent

from .helpers import NIXL_ONLY, fetch_at_once, until
from .node_proc import (
    UCX_TCP,
    Children,
    NodeProcess,
    block_bytes,
    block_crc,
    block_key,
    count_agent_calls,
)

pytestmark = NIXL_ONLY

BLOCK = 64 * 1024


def nixl_config(peer_id: str, num_blocks: int, **kw: Any) -> NodeConfig:
    return NodeConfig(
        peer_id=peer_id, transport="nixl", num_blocks=num_blocks, block_len=BLOCK, **kw
    )


def fill(node: Node, seed: int, count: int) -> list[bytes]:
    keys = [block_key(seed, i) for i in range(count)]
    for i, key in enumerate(keys):
        node.store.put(key, block_bytes(seed, i, BLOCK))
    return keys


def agents_and_regions(node: Node) -> tuple[int, int]:
    st = node.statistics().transport
    return st.live_agents, st.registered_regions


async def check_child_fetch(
    child: NodeProcess, peer: str, seed: int, start: int, count: int
) -> dict[str, Any]:
    """``child`` fetches blocks ``start..start+count`` of ``seed`` from ``peer`` (shuffled);
    every one must load with exactly the seed's bytes."""
    got = await child.call("fetch", peer=peer, seed=seed, start=start, count=count, shuffle=True)
    assert got["failed"] == {} and got["loaded"] == count, got["failed"]
    assert got["mismatched"] == []
    assert got["crcs"] == [block_crc(seed, i, BLOCK) for i in got["indexes"]]
    return got


async def test_fetch_from_another_process_lands_byte_exact_in_scattered_slots(
    children: Children,
) -> None:
    seed, count = 11, 300
    with trio.fail_after(60):
        src = await children.start("p-src", num_blocks=320, block_len=BLOCK, seed=seed, count=count)
        async with open_node(nixl_config("p-dst", 512)) as dst:
            # 200 filler blocks, every other one evicted: the fetch's destination slots are
            # the holes (in LIFO order), then fresh ones.
            filler = fill(dst, 99, 200)
            holes = [dst.store.slot_of(key) for key in filler[::2]]
            for key in filler[::2]:
                assert dst.store.evict(key)
            keys = [block_key(seed, i) for i in range(count)]
            order = list(range(count))
            random.Random(seed).shuffle(order)
            wanted = [keys[i] for i in order]

            peer = await dst.connect(src.address)
            assert peer.peer_id == "p-src"
            assert await dst.lookup(peer, wanted) == [True] * count
            result = await dst.fetch(peer, wanted)

            assert result.failed == {}
            assert sorted(result.loaded) == sorted(keys)
            # The destination slots are scattered: every evicted hole (between survivors)
            # and fresh slots, never a slot a surviving block holds.
            slots = [dst.store.slot_of(key) for key in wanted]
            landed = {s for s in slots if s is not None}
            assert len(landed) == count and set(holes) <= landed
            assert landed.isdisjoint(dst.store.slot_of(k) for k in filler[1::2])
            for i, key in enumerate(keys):
                assert bytes(dst.store.get(key) or b"") == block_bytes(seed, i, BLOCK), i
            for i, key in enumerate(filler):  # survivors untouched
                if i % 2:
                    assert bytes(dst.store.get(key) or b"") == block_bytes(99, i, BLOCK), i

            stats = dst.statistics()
            # The transport's own thread drove the target side of the writes, and no hold
            # is left.
            assert stats.transport.progress_ticks >= 1
            assert dst.transport._state.target.holds == 0  # type: ignore[attr-defined]
            assert agents_and_regions(dst) == (1, 1)
            assert (stats.transport.remote_peers, stats.transport.live_handles) == (1, 0)
            assert (stats.registrations.live, stats.reserved_slots) == (1, 0)
            remote = (await src.call("stats"))["stats"]
            assert remote["transport"]["live_agents"] == 1
            assert remote["transport"]["registered_regions"] == 1
            assert remote["inflight_transfers"] == 0 and remote["pinned_slots"] == 0


async def test_two_fetches_at_once_on_overlapping_keys_over_nixl(children: Children) -> None:
    """Two fetches of the same keys at once, each holding the progress thread: both load
    the source's bytes (the second shares the first one's transfer), and once they are
    done no hold is left and the thread parks."""
    seed, count = 13, 64
    with trio.fail_after(60):
        src = await children.start(
            "o-src", num_blocks=count, block_len=BLOCK, seed=seed, count=count
        )
        async with open_node(nixl_config("o-dst", 2 * count)) as dst:
            keys = [block_key(seed, i) for i in range(count)]
            peer = await dst.connect(src.address)
            results = await fetch_at_once(dst, peer, keys, keys[count // 2 :])
            assert sorted(len(r.loaded) for r in results) == [count // 2, count]
            assert all(r.failed == {} for r in results)
            for i, key in enumerate(keys):
                assert bytes(dst.store.get(key) or b"") == block_bytes(seed, i, BLOCK), i
            target = dst.transport._state.target  # type: ignore[attr-defined]
            assert target.holds == 0 and target.wait_parked(10.0)
            assert dst.statistics().reserved_slots == 0


async def test_peer_killed_mid_transfer_fails_its_keys_in_time_while_others_are_served(
    children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tcp: transfers are asynchronous and stall while the target (this node) makes no
    # progress, so the source can be caught mid-transfer for sure.
    tcp = {"UCX_TLS": UCX_TCP}
    monkeypatch.setenv("UCX_TLS", UCX_TCP)
    # The fetch's deadline is far off: only the kill can end it early, and a fetch that
    # waited it out instead fails its keys with "timeout" (checked below).
    fetch_timeout, doomed_seed, own_seed = 60.0, 21, 22
    n = 512  # 32 MiB: far more than socket buffers hold
    with trio.fail_after(90):
        doomed = await children.start(
            "k-doomed", num_blocks=n, block_len=BLOCK, seed=doomed_seed, count=n, env=tcp
        )
        third = await children.start("k-third", num_blocks=128, block_len=BLOCK, env=tcp)
        cfg = nixl_config("k-hub", n + 64, fetch_timeout=fetch_timeout)
        async with open_node(cfg) as hub:
            fill(hub, own_seed, 64)
            await hub.connect(doomed.address)
            assert (await third.call("connect", address=list(hub.address)))["peer"] == "k-hub"
            await check_child_fetch(third, "k-hub", own_seed, 0, 16)

            real_progress = hub.transport.progress
            stalled = [True]
            held_back = [0]  # progress calls the gate swallowed

            def gated_progress() -> None:
                if not stalled[0]:
                    real_progress()
                else:
                    held_back[0] += 1

            monkeypatch.setattr(hub.transport, "progress", gated_progress)
            # No progress thread: the poller drives the (gated) progress for the fetch.
            monkeypatch.setattr(hub.transport, "hold_target_progress", lambda: False)
            keys = [block_key(doomed_seed, i) for i in range(n)]
            outcome: list[Any] = []

            async def fetch_all() -> None:
                outcome.append(await hub.fetch("k-doomed", keys))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch_all)
                with trio.fail_after(10):
                    while (await doomed.call("stats"))["stats"]["inflight_transfers"] == 0:
                        await trio.sleep(0.02)
                # Stalled: the hub's poller has asked for progress a few times since and
                # got none (a counter, not a sleep, says so).
                seen = held_back[0]
                with trio.fail_after(10):
                    while held_back[0] < seen + 3:
                        await trio.sleep(0.01)
                in_flight = (await doomed.call("stats"))["stats"]["inflight_transfers"]
                assert in_flight >= 1 and not outcome, "the transfer was not stalled"
                doomed.kill()
                killed_at = trio.current_time()
                stalled[0] = False
            took = trio.current_time() - killed_at
            assert await doomed.proc.wait() == -signal.SIGKILL

            result = outcome[0]
            assert result.loaded == [] and sorted(result.failed) == sorted(keys)
            # The kill ended the fetch, not its deadline: no key failed by "timeout", and
            # it returned long before that deadline (a "did not hang" guard, not a speed
            # target: this takes milliseconds; how fast is bench's business).
            assert "timeout" not in result.failed.values(), result.failed
            assert took < fetch_timeout / 3, f"fetch took {took:.2f} s after the kill"
            assert not any(k in hub.store for k in keys)
            print(
                f"failed keys surfaced {took * 1000:.0f} ms after SIGKILL: "
                f"{next(iter(result.failed.values()))!r}"
            )

            # The survivor keeps serving its third peer, on the same session.
            await check_child_fetch(third, "k-hub", own_seed, 16, 48)
            assert [p.peer_id for p in hub.peers()] == ["k-third"]
            third_stats = await third.call("stats")
            assert third_stats["peers"] == ["k-hub"]
            assert third_stats["stats"]["registrations"]["started"] == 1
            # The dead peer's registration is released on a worker thread by its session's
            # clean-up, which goes on after the fetch it failed has returned.
            with trio.fail_after(10):
                await until(lambda: hub.statistics().transport.remote_peers == 1)
            stats = hub.statistics()
            assert agents_and_regions(hub) == (1, 1)
            assert (stats.transport.remote_peers, stats.transport.live_handles) == (1, 0)
            assert stats.reserved_slots == 0 and stats.inflight_transfers == 0


async def test_restarted_peer_with_the_same_name_is_served_again(children: Children) -> None:
    with trio.fail_after(60):
        first = await children.start("r-src", num_blocks=64, block_len=BLOCK, seed=31, count=64)
        async with open_node(nixl_config("r-hub", 256)) as hub:
            fill(hub, 33, 64)
            await hub.connect(first.address)
            result = await hub.fetch("r-src", [block_key(31, i) for i in range(32)])
            assert result.failed == {}
            await check_child_fetch(first, "r-hub", 33, 0, 16)

            first.kill()
            await first.proc.wait()
            with trio.fail_after(10):
                while hub.peers():  # until the hub has seen the peer die
                    await trio.sleep(0.01)

            # Same peer id, a new process, a new region and new NIXL metadata; it rejoins.
            second = await children.start(
                "r-src", num_blocks=160, block_len=BLOCK, seed=32, count=96
            )
            assert (await second.call("connect", address=list(hub.address)))["peer"] == "r-hub"
            await check_child_fetch(second, "r-hub", 33, 0, 64)  # the hub writes into it
            keys = [block_key(32, i) for i in range(96)]
            result = await hub.fetch("r-src", keys)  # and it writes into the hub
            assert result.failed == {}
            for i, key in enumerate(keys):
                assert bytes(hub.store.get(key) or b"") == block_bytes(32, i, BLOCK), i

            stats = hub.statistics()
            assert agents_and_regions(hub) == (1, 1)
            assert (stats.transport.remote_peers, stats.registrations.live) == (1, 1)
            assert stats.transport.live_handles == 0


async def test_closing_a_node_twice_leaves_no_agent_registration_or_handle(
    children: Children,
) -> None:
    with trio.fail_after(60):
        src = await children.start("c-src", num_blocks=64, block_len=BLOCK, seed=41, count=64)
        async with open_node(nixl_config("c-dst", 64)) as node:
            await node.connect(src.address)
            keys = [block_key(41, i) for i in range(64)]
            assert (await node.fetch("c-src", keys[:16])).failed == {}
            assert await node.lookup("c-src", keys[16:32]) == [True] * 16  # pins at src
            assert (await src.call("stats"))["stats"]["pinned_slots"] == 16
            assert agents_and_regions(node) == (1, 1)
            await node.aclose()
            await node.aclose()
        await node.aclose()

        stats = node.statistics()
        assert transport_counts(stats.transport) == (0, 0, 0, 0)
        assert (stats.registrations.live, stats.sessions, stats.peers) == (0, 0, 0)
        assert stats.registrations.retired == stats.registrations.published == 1
        assert _nixl_agent.registry_counts() == (0, 0)

        async def peer_forgot_us() -> bool:
            # The session's end is seen there later, and its registration is released on
            # a worker thread after that (the session's clean-up awaits it): the NIXL
            # remote peer may still be counted once the peer and its pins are gone.
            remote = await src.call("stats")
            st = remote["stats"]
            return bool(
                remote["peers"] == []
                and st["pinned_slots"] == 0
                and st["transport"]["remote_peers"] == 0
            )

        with trio.fail_after(10):
            while not await peer_forgot_us():
                await trio.sleep(0.02)
        remote = (await src.call("stats"))["stats"]
        assert remote["transport"]["remote_peers"] == 0
        assert remote["registrations"]["live"] == 0


def transport_counts(st: Any) -> tuple[int, int, int, int]:
    return st.live_agents, st.registered_regions, st.remote_peers, st.live_handles


async def test_reconfigurations_keep_one_agent_and_one_registration(
    children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_agent_calls(monkeypatch)
    seeds = {"g-a": 61, "g-b": 62, "g-c": 63}
    own_seed = 64
    with trio.fail_after(90):
        sources = await start_all(children, seeds)
        async with open_node(nixl_config("g-hub", 512)) as hub:
            fill(hub, own_seed, 32)
            for name in seeds:
                await hub.connect(sources[name].address)
            shared = hub.transport._state.shared  # type: ignore[attr-defined]
            names = list(seeds)
            fetched = 0
            for step, keep in enumerate((names, names[:2], names[:1], names[:1])):
                # Which names it returns: test_reconfigure_returns_the_departed_peers.
                await hub.reconfigure(keep)

                stats = hub.statistics()
                assert agents_and_regions(hub) == (1, 1), step
                assert calls == {"agents": 1, "register_memory": 1}, step
                assert sorted(p.peer_id for p in hub.peers()) == sorted(keep), step
                assert stats.sessions == len(keep), step
                assert stats.transport.remote_peers == len(keep), step
                assert stats.registrations.live == len(keep), step
                assert sorted(shared.live) == sorted(keep), step  # NIXL's remote agents
                for name in seeds:
                    if name in keep:  # it writes into the hub, the hub writes into it
                        keys = [block_key(seeds[name], fetched + i) for i in range(8)]
                        result = await hub.fetch(name, keys)
                        assert result.failed == {}, (step, name, result.failed)
                        for i, key in enumerate(keys):
                            want = block_bytes(seeds[name], fetched + i, BLOCK)
                            assert bytes(hub.store.get(key) or b"") == want, (step, name, i)
                        await check_child_fetch(sources[name], "g-hub", own_seed, 8 * step, 8)
                    else:  # its session is gone on both sides
                        while (await sources[name].call("stats"))["peers"]:
                            await trio.sleep(0.01)
                        with pytest.raises(PeerUnavailable):
                            await hub.fetch(name, [block_key(seeds[name], 0)])
                fetched += 8
            # Every replaced transport lets go of the agent once its writes have settled.
            with trio.fail_after(10):
                while shared.refs != 1:
                    await trio.sleep(0.01)
        assert calls == {"agents": 1, "register_memory": 1}


async def start_all(children: Children, seeds: dict[str, int], **kw: Any) -> dict[str, NodeProcess]:
    """One source child per peer id (in parallel), each holding 64 blocks of its seed."""
    started: dict[str, NodeProcess] = {}

    async def start(name: str) -> None:
        started[name] = await children.start(
            name, num_blocks=96, block_len=BLOCK, seed=seeds[name], count=64, **kw
        )

    async with trio.open_nursery() as nursery:
        for name in seeds:
            nursery.start_soon(start, name)
    return started


async def test_reconfigure_after_close_leaves_no_nixl_agent_or_registration() -> None:
    """Over real NIXL: reconfigure on a closed node used to build a new agent and register
    the region again after the close had released both, and leave them alive."""
    cfg = NodeConfig(peer_id="nx-hub", transport="nixl", num_blocks=64, block_len=BLOCK)
    with trio.fail_after(30):
        async with open_node(cfg) as hub:
            assert _nixl_agent.registry_counts() == (1, 1)
        assert _nixl_agent.registry_counts() == (0, 0)
        with pytest.raises(PeerUnavailable, match="node is closed"):
            await hub.reconfigure([])
    assert _nixl_agent.registry_counts() == (0, 0)


async def test_reconfigure_returns_the_departed_peers(children: Children) -> None:
    seeds = {"d-a": 71, "d-b": 72}
    with trio.fail_after(60):
        sources = await start_all(children, seeds)
        async with open_node(nixl_config("d-hub", 64)) as hub:
            for name in seeds:
                await hub.connect(sources[name].address)
            assert await hub.reconfigure(list(seeds)) == []
            assert await hub.reconfigure(["d-a"]) == ["d-b"]
            assert await hub.reconfigure(["d-a"]) == []


async def test_reconfiguration_that_keeps_a_peer_does_not_fail_its_fetches(
    children: Children,
) -> None:
    seed, n = 81, 256
    with trio.fail_after(60):
        consumer = await children.start("s-consumer", num_blocks=n, block_len=BLOCK)
        cfg = nixl_config("s-hub", n, transfer_chunk_bytes=8 * BLOCK)  # 32 posts per fetch
        async with open_node(cfg) as hub:
            fill(hub, seed, n)
            await consumer.call("connect", address=list(hub.address))
            done = trio.Event()
            failed: list[dict[str, str]] = []

            async def fetch_rounds() -> None:
                for _ in range(3):
                    got = await consumer.call(
                        "fetch", peer="s-hub", seed=seed, start=0, count=n, shuffle=True
                    )
                    assert got["mismatched"] == []
                    failed.append(got["failed"])
                    await consumer.call("evict", seed=seed, start=0, count=n)
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch_rounds)
                while not done.is_set():  # membership unchanged: nothing may fail
                    await hub.reconfigure(["s-consumer"])
            assert failed == [{}, {}, {}]
