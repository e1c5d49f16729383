"""Copy threads (issue 9): a transfer split between K threads of NIXL's UCX backend.

K comes from the ``copy_threads`` argument, ``P2PKV_NIXL_COPY_THREADS`` or the cores the
process may run on. A post of at least ``split_descs`` blocks is copied in K parts under one
handle; contiguous runs are then posted as explicit pieces that never leave the run (nor,
so, either region). What fails as a whole and what stays idle is checked in
``test_nixl_transport.py`` (killed target, idle pair), parametrised over K.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from p2pkv import staging
from p2pkv.errors import TransportError
from p2pkv.transport import _nixl_agent
from p2pkv.transport._nixl_agent import resolve_copy_threads
from p2pkv.transport._runs import contiguous_runs, run_order
from p2pkv.transport.base import RegionLayout, TransferState
from p2pkv.transport.nixl import NixlTransport

_HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl_cu12"))
needs_nixl = pytest.mark.skipif(
    not _HAVE_NIXL, reason="needs NIXL: pip install nixl-cu13 (or nixl-cu12)"
)
BLOCK = 64 * 1024
Region = np.ndarray[tuple[int], np.dtype[np.uint8]]


@pytest.mark.parametrize(
    ("resolve", "env", "by_cores"),
    [
        (
            resolve_copy_threads,
            _nixl_agent.COPY_THREADS_ENV,
            {16: 8, 4: 2, 3: 2, 2: 2, 1: 1, 128: 8},
        ),
        (staging.resolve_lanes, staging.STAGING_LANES_ENV, {1: 1, 2: 1, 16: 4, 128: 4}),
    ],
    ids=["copy threads", "staging lanes"],
)
def test_worker_counts_come_from_the_argument_then_the_environment_then_the_cores(
    monkeypatch: pytest.MonkeyPatch,
    resolve: Callable[..., int],
    env: str,
    by_cores: dict[int, int],
) -> None:
    """A 2-core box copies with two threads (a second copier doubles what one core's
    process_vm_writev moves; bench/dataplane.py) and stages through one loopback agent; a
    1-core box copies in the posting thread."""
    monkeypatch.delenv(env, raising=False)
    for cores, expected in by_cores.items():
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert resolve() == expected, cores
    monkeypatch.setenv(env, "3")
    assert resolve() == 3
    assert resolve(2) == 2
    most = _nixl_agent.MAX_PARALLELISM
    monkeypatch.setenv(env, str(most))
    assert resolve() == most
    assert resolve(most) == most
    for bad in ("0", "two", str(most + 1), "100000"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(TransportError):
            resolve()
    for number in (0, most + 1):
        with pytest.raises(TransportError, match=f"1..{most}"):
            resolve(number)


def test_node_config_takes_copy_threads_or_none() -> None:
    from p2pkv.config import NodeConfig

    assert NodeConfig(peer_id="a").nixl_copy_threads is None
    assert NodeConfig(peer_id="a", nixl_copy_threads=3).nixl_copy_threads == 3
    most = _nixl_agent.MAX_PARALLELISM
    assert NodeConfig(peer_id="a", nixl_copy_threads=most).nixl_copy_threads == most
    # Each copy thread is an OS thread: a hand-set typo is refused before any is started.
    for bad in (0, -1, most + 1, 10**6):
        with pytest.raises(ValueError, match=f"1..{most}"):
            NodeConfig(peer_id="a", nixl_copy_threads=bad)


def _region(num_blocks: int, seed: int) -> tuple[Region, RegionLayout]:
    array = np.random.default_rng(seed).integers(0, 256, num_blocks * BLOCK, dtype=np.uint8)
    return array, RegionLayout(array.ctypes.data, num_blocks, BLOCK)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, ...]]:
    """A source (64 blocks) and a destination (48 blocks) transport with K copy threads."""
    threads: int = request.param
    src_array, src_layout = _region(64, 1)
    dst_array, dst_layout = _region(48, 2)
    src = NixlTransport.create(
        agent_name="ct-src", region=src_array, layout=src_layout, copy_threads=threads
    )
    dst = NixlTransport.create(
        agent_name="ct-dst", region=dst_array, layout=dst_layout, copy_threads=threads
    )
    try:
        peer = src.add_remote_peer("ct-dst", dst.metadata(), dst_layout)
        yield src, src_array, dst, dst_array, peer
    finally:
        src.close()
        dst.close()
        assert src.statistics().live_agents == 0


def _write(pair: tuple[Any, ...], local: list[int], remote: list[int]) -> list[Any]:
    """Post, wait, check the bytes; returns the descriptor arrays given to NIXL explicitly."""
    src, src_array, dst, dst_array, peer = pair
    before = dst_array.copy()
    agent = src._state.shared.agent
    get_xfer_descs = agent.get_xfer_descs
    explicit: list[Any] = []

    def spy(descs: Any, mem_type: Any = None) -> Any:
        explicit.append(np.array(descs, copy=True))
        return get_xfer_descs(descs, mem_type)

    agent.get_xfer_descs = spy
    try:
        handle = src.post_write(peer, local, remote)
    finally:
        del agent.get_xfer_descs
    state = src.poll(handle)
    for _ in range(100_000):
        if state is not TransferState.PROC:
            break
        dst.progress()
        state = src.poll(handle)
    src.release(handle)
    assert state is TransferState.DONE
    got, want = dst_array.reshape(48, BLOCK), src_array.reshape(64, BLOCK)
    assert (got[remote] == want[local]).all()
    untouched = np.setdiff1d(np.arange(48), remote)
    assert (got[untouched] == before.reshape(48, BLOCK)[untouched]).all()
    return explicit


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("pair", [2], indirect=True)
@pytest.mark.parametrize(
    ("local", "remote"),
    [
        (list(range(16, 64)), list(range(48))),  # one run: its last block is the peer's last
        ([*range(0, 20), *range(44, 64)], [*range(28, 48), *range(0, 20)]),  # two runs
    ],
)
def test_runs_are_cut_into_pieces_for_the_copy_threads_inside_both_regions(
    pair: tuple[Any, ...], local: list[int], remote: list[int]
) -> None:
    src, _src_array, _dst, _dst_array, peer = pair
    order = np.random.default_rng(4).permutation(len(local)).tolist()
    explicit = _write(pair, [local[i] for i in order], [remote[i] for i in order])
    ours, theirs = src.layout, peer.layout
    [local_descs, remote_descs] = explicit
    assert len(local_descs) == len(remote_descs) >= src._state.shared.split_descs
    for descs, layout in ((local_descs, ours), (remote_descs, theirs)):
        addr, size = descs[:, 0].astype(np.int64), descs[:, 1].astype(np.int64)
        assert (addr >= layout.base_addr).all()
        assert (addr + size <= layout.base_addr + layout.nbytes).all()
        assert ((addr - layout.base_addr) % BLOCK == 0).all() and (size % BLOCK == 0).all()
    assert int(local_descs[:, 1].sum()) == len(local) * BLOCK
    assert (local_descs[:, 1] <= _nixl_agent.MAX_PIECE_BYTES).all()
    assert (local_descs[:, 1] == remote_descs[:, 1]).all()


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("pair", [1, 2], indirect=True)
def test_remote_slots_are_bounded_by_the_peers_region_not_ours(pair: tuple[Any, ...]) -> None:
    """The peer's region (48 blocks) is smaller than ours (64): a run whose last remote
    slot is 48, past the peer's end though inside our region, is refused before NIXL sees
    it (explicit pieces with two copy threads would address memory past the peer's
    region), and nothing is written."""
    src, _src_array, _dst, dst_array, peer = pair
    before = dst_array.copy()
    with pytest.raises(TransportError, match=r"remote slot out of range 0\.\.47"):
        src.post_write(peer, list(range(16, 64)), list(range(1, 49)))
    assert src.statistics().live_handles == 0
    assert (dst_array == before).all()


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("pair", [1, 2], indirect=True)
@pytest.mark.parametrize("seed", range(5, 13))
def test_scattered_and_mixed_posts_land_byte_exact(pair: tuple[Any, ...], seed: int) -> None:
    """Pairs without runs (split by NIXL as they are) and short posts (not split at all)
    take the prepared dlists; only a long enough post holding runs gets explicit pieces."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 48))
    local = rng.choice(64, n, replace=False)
    remote = rng.choice(48, n, replace=False)
    ordered = run_order(local.astype(np.int64), remote.astype(np.int64))
    has_runs = len(contiguous_runs(*ordered)[2]) < n
    shared = pair[0]._state.shared
    explicit = _write(pair, local.tolist(), remote.tolist())
    assert bool(explicit) == (shared.copy_threads > 1 and n >= shared.split_descs and has_runs)


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("pair", [2], indirect=True)
def test_a_run_too_short_for_the_copy_threads_to_split_takes_the_prepared_dlists(
    pair: tuple[Any, ...],
) -> None:
    """One run of one block less than ``split_descs``: NIXL copies it in one thread
    whatever is posted, so it goes through the prepared dlists (NIXL merges the run),
    not explicit descriptors (~45 us more to build, one piece per block here)."""
    n = pair[0]._state.shared.split_descs - 1
    assert _write(pair, list(range(10, 10 + n)), list(range(20, 20 + n))) == []


@pytest.mark.nixl
@needs_nixl
@pytest.mark.parametrize("pair", [1], indirect=True)
def test_one_copy_thread_never_posts_explicit_descriptors(pair: tuple[Any, ...]) -> None:
    assert _write(pair, list(range(16, 64)), list(range(48))) == []


@pytest.mark.nixl
@needs_nixl
def test_the_backend_gets_its_copy_threads_for_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    binding = _nixl_agent.load_nixl()
    create_backend = binding.api.nixl_agent.create_backend
    seen: list[dict[str, str]] = []

    def spy(self: Any, name: str, params: dict[str, str]) -> Any:
        seen.append(dict(params))
        return create_backend(self, name, params)

    monkeypatch.setattr(binding.api.nixl_agent, "create_backend", spy)
    for threads in (1, 3):
        array, layout = _region(4, threads)
        transport = NixlTransport.create(
            agent_name=f"ct-b{threads}", region=array, layout=layout, copy_threads=threads
        )
        transport.close()
    assert "num_threads" not in seen[0]
    assert seen[1]["num_threads"] == "3"
    assert seen[1]["split_batch_size"] == str(3 * _nixl_agent.SPLIT_DESCS_PER_THREAD)


@needs_nixl
@pytest.mark.nixl
async def test_a_nodes_config_sets_its_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``NodeConfig.nixl_copy_threads`` reaches the node's NIXL agent, over the environment."""
    import trio

    from p2pkv import NodeConfig, open_node

    monkeypatch.setenv(_nixl_agent.COPY_THREADS_ENV, "1")
    cfg = NodeConfig(
        peer_id="k3", num_blocks=16, block_len=4096, transport="nixl", nixl_copy_threads=3
    )
    with trio.fail_after(60):
        async with open_node(cfg) as node:
            transport = node.transport
            assert isinstance(transport, NixlTransport)
            assert transport._state.shared.copy_threads == 3
