"""GPU regions over the real NIXL data plane (skipped without a CUDA GPU, torch and NIXL).

The node under test runs in this process over a torch CUDA tensor; its peers are
``node_proc.py`` children over CUDA tensors on the same GPU, so blocks cross between two
processes over UCX cuda_ipc. torch is imported only inside these tests (the ``cuda``
fixture), never at collection: the CPU suite does not pay for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from p2pkv import NodeConfig, open_node, staging
from p2pkv.errors import TransportError
from p2pkv.node import Node

from .helpers import failing_lane, record_lane_parts
from .node_proc import (
    Children,
    block_bytes,
    block_crc,
    block_key,
    child_pythonpath,
    count_agent_calls,
    stored_bytes,
)

_HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
# Cheap pre-check (no torch import): a machine without the NVIDIA driver has no GPU.
_HAVE_DRIVER = Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()
pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13"),
    pytest.mark.skipif(not _HAVE_DRIVER, reason="needs a CUDA GPU (no NVIDIA driver here)"),
]

BLOCK = 64 * 1024
DEVICE = "cuda:0"
# Children import p2pkv from ROOT and everything else from wherever this process does.
CHILD_ENV = {"PYTHONPATH": child_pythonpath()}


@pytest.fixture
def cuda() -> Any:
    """torch, once it is known to see a GPU (skips otherwise)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda is not available")
    return torch


def gpu_region(torch: Any, num_blocks: int) -> Any:
    return torch.zeros(num_blocks * BLOCK, dtype=torch.uint8, device=DEVICE)


def gpu_config(peer_id: str, num_blocks: int) -> NodeConfig:
    return NodeConfig(peer_id=peer_id, transport="nixl", num_blocks=num_blocks, block_len=BLOCK)


def fill(node: Node, seed: int, count: int) -> list[bytes]:
    keys = [block_key(seed, i) for i in range(count)]
    for i, key in enumerate(keys):
        node.store.put(key, block_bytes(seed, i, BLOCK))
    return keys


async def start_gpu_child(children: Children, name: str, seed: int, count: int) -> Any:
    return await children.start(
        name,
        num_blocks=count + 64,
        block_len=BLOCK,
        seed=seed,
        count=count,
        device=DEVICE,
        env=CHILD_ENV,
        ready_timeout=60,
    )


async def child_fetch(child: Any, peer: str, seed: int, start: int, count: int) -> None:
    got = await child.call("fetch", peer=peer, seed=seed, start=start, count=count, shuffle=True)
    assert got["failed"] == {} and got["loaded"] == count, got["failed"]
    assert got["mismatched"] == []
    assert got["crcs"] == [block_crc(seed, i, BLOCK) for i in got["indexes"]]


async def test_gpu_fetches_between_two_processes_are_byte_exact_both_ways(
    children: Children, cuda: Any
) -> None:
    seed, own_seed, count = 31, 32, 96
    with trio.fail_after(120):
        src = await start_gpu_child(children, "gpu-src", seed, count)
        async with open_node(gpu_config("gpu-dst", 256), region=gpu_region(cuda, 256)) as dst:
            assert dst.store.device_region
            filler = fill(dst, 99, 64)
            for key in filler[::2]:  # scattered destination slots
                assert dst.store.evict(key)
            own = fill(dst, own_seed, count)
            peer = await dst.connect(src.address)

            # The child writes into our VRAM.
            keys = [block_key(seed, i) for i in range(count)]
            wanted = keys[::-1]
            result = await dst.fetch(peer, wanted)
            assert result.failed == {} and sorted(result.loaded) == sorted(keys)
            for i, key in enumerate(keys):
                assert stored_bytes(dst.store, key) == block_bytes(seed, i, BLOCK), i
            for i, key in enumerate(filler[1::2]):  # survivors untouched
                assert stored_bytes(dst.store, key) == block_bytes(99, 2 * i + 1, BLOCK)

            # We write into the child's VRAM.
            await src.call("scatter", count=32)
            await child_fetch(src, "gpu-dst", own_seed, 0, count)

            shared = dst.transport._state.shared  # type: ignore[attr-defined]
            assert (shared.mem_type, shared.device) == ("VRAM", 0)
            with shared.call_lock:
                layout = shared.live["gpu-src"].layout
                assert shared.remote_memory("gpu-src", layout) == ("VRAM", 0)
            assert len(own) == count


async def test_local_staging_copies_blocks_between_host_and_gpu_byte_exact(cuda: Any) -> None:
    n = 64
    rng = np.random.default_rng(5)
    host_src = rng.integers(0, 256, n * BLOCK, dtype=np.uint8)  # pageable NumPy
    pinned = cuda.zeros(n * BLOCK, dtype=cuda.uint8).pin_memory()  # pinned torch
    gpu = gpu_region(cuda, n)
    src = staging.attach_region(host_src, BLOCK)
    mid = staging.attach_region(gpu, BLOCK)
    dst = staging.attach_region(pinned, BLOCK)
    try:
        assert (mid.mem_type, dst.mem_type, src.mem_type) == ("VRAM", "DRAM", "DRAM")
        order = rng.permutation(n).tolist()
        to_gpu = order[: n // 2]
        src.agent.copy(src, to_gpu, mid, list(range(n // 2)))  # host -> GPU, scattered
        back = rng.permutation(n).tolist()[: n // 2]
        mid.agent.copy(mid, list(range(n // 2)), dst, back)  # GPU -> host, scattered
        got_gpu = gpu.cpu().numpy()
        got_host = pinned.numpy()
        for i, s in enumerate(to_gpu):
            want = host_src[s * BLOCK : (s + 1) * BLOCK]
            assert np.array_equal(got_gpu[i * BLOCK : (i + 1) * BLOCK], want), i
            d = back[i]
            assert np.array_equal(got_host[d * BLOCK : (d + 1) * BLOCK], want), i
        untouched = sorted(set(range(n)) - set(back))
        assert all(not got_host[d * BLOCK : (d + 1) * BLOCK].any() for d in untouched)
        assert not got_gpu[(n // 2) * BLOCK :].any()
        # Attaching again registers nothing new: one registration per region.
        again = staging.attach_region(gpu, BLOCK)
        assert again is mid and mid.refs == 2
        again.release()
    finally:
        for reg in (src, mid, dst):
            reg.release()
    assert not staging.loopback_agent_exists()


async def test_staging_split_over_lanes_is_byte_exact_both_ways_and_fails_as_a_whole(
    cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(staging.STAGING_LANES_ENV, "3")
    parts = record_lane_parts(monkeypatch)
    n = 101  # three parts of 34, 34, 33
    rng = np.random.default_rng(11)
    host_src = rng.integers(0, 256, n * BLOCK, dtype=np.uint8)
    pinned = cuda.zeros(n * BLOCK, dtype=cuda.uint8).pin_memory()
    gpu = gpu_region(cuda, n)
    src = staging.attach_region(host_src, BLOCK)
    mid = staging.attach_region(gpu, BLOCK)
    dst = staging.attach_region(pinned, BLOCK)
    try:
        agent = mid.agent
        assert len(agent.lanes) == 3 and all(len(r.lanes) == 3 for r in (src, mid, dst))
        to_gpu, at_gpu = rng.permutation(n).tolist(), rng.permutation(n).tolist()
        agent.copy(src, to_gpu, mid, at_gpu)  # host -> GPU
        back = rng.permutation(n).tolist()
        agent.copy(mid, at_gpu, dst, back)  # GPU -> host
        for copy in (parts[:3], parts[3:]):
            assert sorted(size for _, size in copy) == [33, 34, 34]
            assert len({name for name, _ in copy}) == 3
        host = host_src.reshape(n, BLOCK)
        assert np.array_equal(gpu.view(n, BLOCK).cpu().numpy()[at_gpu], host[to_gpu])
        assert np.array_equal(pinned.view(n, BLOCK).numpy()[back], host[to_gpu])

        with failing_lane(agent, 2), pytest.raises(TransportError, match="ERR"):
            agent.copy(mid, at_gpu, dst, back)
        gpu.zero_()
        agent.copy(src, to_gpu, mid, at_gpu)  # the lanes still work after a failed copy
        assert np.array_equal(gpu.view(n, BLOCK).cpu().numpy()[at_gpu], host[to_gpu])
    finally:
        for reg in (src, mid, dst):
            reg.release()
    assert not staging.loopback_agent_exists()


async def test_remote_gpu_block_reaches_host_memory_in_two_legs(
    children: Children, cuda: Any
) -> None:
    seed, count = 41, 16
    host = np.zeros(count * BLOCK, dtype=np.uint8)
    with trio.fail_after(120):
        src = await start_gpu_child(children, "leg-src", seed, count)
        async with open_node(gpu_config("leg-dst", 64), region=gpu_region(cuda, 64)) as dst:
            keys = [block_key(seed, i) for i in range(count)]
            result = await dst.fetch(await dst.connect(src.address), keys)  # leg 1: cuda_ipc
            assert result.failed == {}
            slots = [s for s in map(dst.store.slot_of, keys) if s is not None]
            assert len(slots) == count
            gpu = staging.attach_region(dst.store.buffer, BLOCK)
            out = staging.attach_region(host, BLOCK)
            try:  # leg 2: cuda_copy through the loopback agent, not the peer-mode agent
                await trio.to_thread.run_sync(
                    lambda: gpu.agent.copy(gpu, slots, out, list(range(count)))
                )
            finally:
                gpu.release()
                out.release()
    for i in range(count):
        assert bytes(host[i * BLOCK : (i + 1) * BLOCK]) == block_bytes(seed, i, BLOCK), i
    assert not staging.loopback_agent_exists()


async def test_reconfigurations_over_a_gpu_region_register_it_once(
    children: Children, cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_agent_calls(monkeypatch)
    seeds = {"r-a": 71, "r-b": 72}
    with trio.fail_after(180):
        sources = {n: await start_gpu_child(children, n, s, 64) for n, s in seeds.items()}
        region = gpu_region(cuda, 256)
        async with open_node(gpu_config("r-hub", 256), region=region) as hub:
            for child in sources.values():
                await hub.connect(child.address)
            shared = hub.transport._state.shared  # type: ignore[attr-defined]
            names = list(seeds)
            for step, keep in enumerate((names, names[:1], names[:1])):  # three reconfigurations
                await hub.reconfigure(keep)
                assert calls == {"agents": 1, "register_memory": 1}, step
                assert hub.transport._state.shared is shared  # type: ignore[attr-defined]
                assert sorted(shared.live) == sorted(keep), step
                name = keep[0]
                keys = [block_key(seeds[name], 8 * step + i) for i in range(8)]
                result = await hub.fetch(name, keys)
                assert result.failed == {}, (step, result.failed)
                for i, key in enumerate(keys):
                    want = block_bytes(seeds[name], 8 * step + i, BLOCK)
                    assert stored_bytes(hub.store, key) == want, (step, i)
            with trio.fail_after(10):
                while shared.refs != 1:
                    await trio.sleep(0.01)
        assert calls == {"agents": 1, "register_memory": 1}
