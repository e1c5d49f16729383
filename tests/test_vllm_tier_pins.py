"""What peers' lookups may pin in vLLM's CPU tier, and when (vLLM's real tiering manager,
in process). Found by a review of the tier (2026-12-04); each test failed before its fix:

- a HIT pinned after a later lookup's promotion from another tier had evicted it: vLLM
  raised inside ``create_store_job`` with the pins taken so far held for good, and,
  served from a step, out of vLLM's ``schedule()``;
- one peer's round could pin the whole CPU tier (the node-wide share did not apply where
  the host pins), leaving vLLM's own offloads no chunk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm_spec = pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from p2pkv import BlockingNode, start_node

from .test_vllm_tier_inproc import (
    BOUND,
    CHUNKS,
    Engine,
    make_keys,
    offloading_config,
    tier_config,
)

pytestmark = pytest.mark.vllm
_n = iter(range(1 << 30))


@pytest.fixture
def build() -> Iterator[Callable[..., Engine]]:
    built: list[Engine] = []

    def make(tiers: list[dict[str, Any]] | None = None, poll_s: float = 0.001, **kw: Any) -> Engine:
        engine_id = f"p2pkvrev{os.getpid()}x{next(_n)}"
        cfg = offloading_config(tier_config(**kw), engine_id, poll_s)
        if tiers is not None:
            extra: Any = cfg.extra_config  # a dict at run time
            extra["secondary_tiers"] = [tier_config(**kw), *tiers]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = vllm_spec.TieringOffloadingSpec(cfg).get_manager()
        assert isinstance(mgr, TieringOffloadingManager)
        eng = Engine(mgr, engine_id)
        built.append(eng)
        return eng

    try:
        yield make
    finally:
        for eng in built:
            with contextlib.suppress(Exception):
                eng.mgr.shutdown()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/vllm_offload_{eng.engine_id}.mmap")


def pinned_chunks(eng: Engine) -> int:
    """Primary chunks with a reader's pin (ref_cnt > 0)."""
    with eng.mgr.lock:
        policy: Any = eng.mgr.primary_tier._policy  # vLLM's own bookkeeping, read only
        return sum(1 for c in policy.chunks.values() if c.ref_cnt > 0)


def settle(eng: Engine) -> None:
    end = time.monotonic() + BOUND
    while eng.jobs():
        assert time.monotonic() < end, "jobs never reported"
        eng.idle_step()
        time.sleep(0.002)  # a step's pacing


def peer_of(src: Engine, name: str) -> BlockingNode:  # a node with the source's fingerprint
    cfg = attrs.evolve(src.tier._node.config, peer_id=name, port=0)
    return start_node(cfg)


def test_a_peers_hits_are_pinned_before_another_tiers_promotion_can_evict_them(
    build: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM: "Only keys that lookup() just returned HIT may be pinned, in the same
    serve_external_requests call ... the two must not be separated by an eviction."
    _ask asks vLLM about every pending key of a peer's lookup first and pins the HITs
    afterwards in one create_store_job. A later key that another secondary tier holds
    starts a promotion (prepare_write), which evicts a chunk of the full primary tier:
    one that was HIT a moment ago and is about to be pinned. create_store_job then
    asserts in prepare_read ("not found in cache"), after having pinned the keys before
    it, with no job to ever unpin them: leaked primary pins, and the peer gets misses."""
    src = build(tiers=[{"type": "example"}])
    keys = make_keys(CHUNKS, "full")  # fills the primary tier: the next write evicts
    src.fill(keys)
    settle(src)  # the cascades to the example tier are reported, their pins back
    other: Any = src.mgr.secondary_tiers[1]  # vLLM's example tier: a dict of its keys
    extra = make_keys(1, "only-in-the-other-tier")[0]
    with src.mgr.lock:
        other.chunks[extra] = True  # the example tier holds it, the primary does not
    assert pinned_chunks(src) == 0
    peer = peer_of(src, "reviewer-peer")
    try:
        sp = peer.connect(src.tier.address)
        caplog.set_level(logging.WARNING)
        rnd = peer.lookup_round(sp, [*keys, extra], timeout=BOUND)
        peer.release(sp, rnd, timeout=BOUND)
        end = time.monotonic() + BOUND
        while (src.jobs() or src.tier._pins.held()) and time.monotonic() < end:
            src.idle_step()
            time.sleep(0.002)  # a step's pacing
        src.idle_step()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        # Whatever the peer was told, every pin taken for it is given back.
        assert pinned_chunks(src) == 0, (pinned_chunks(src), errors[:1])
    finally:
        peer.close()


def test_a_peer_cannot_pin_the_whole_primary_tier(build: Callable[..., Engine]) -> None:
    """What a peer can make this worker hold: a lookup round of everything the source's
    CPU tier holds, never fetched and renewed before its lease ends, used to pin every
    chunk (only the per-peer max_pinned_blocks bounded it), leaving vLLM's own GPU->CPU
    offload no chunk to store into. All peers together now pin at most
    ``max_pinned_share`` (0.9) of the tier; the keys past it are misses."""
    src = build()
    keys = make_keys(CHUNKS, "everything")
    src.fill(keys)
    peer = peer_of(src, "greedy-peer")
    try:
        sp = peer.connect(src.tier.address)
        rnd = peer.lookup_round(sp, keys, timeout=BOUND)
        share = int(CHUNKS * 0.9)
        assert rnd.hits == [True] * share + [False] * (CHUNKS - share)
        assert src.tier._pins.pinned_blocks() == share == pinned_chunks(src)
        ctx = ReqContext(req_id="own-request")
        with src.mgr.lock:
            src.mgr.on_new_request(ctx)
            out = src.mgr.prepare_store(make_keys(1, "own-new-block"), ctx)
            src.mgr.on_request_finished(ctx)
        assert out is not None, "the host cannot offload a single block while a peer pins"
    finally:
        peer.close()


def test_a_peers_lookup_never_raises_out_of_the_schedulers_step(
    build: Callable[..., Engine],
) -> None:
    """The same eviction between a HIT and its pin, without vLLM's tier-poll thread
    (tier_poll_interval_s 0): peers are served from on_schedule_end, on the scheduler
    thread, so create_store_job's AssertionError escapes vLLM's schedule() (in a serving
    engine, the engine core dies) because of one peer's lookup."""
    src = build(tiers=[{"type": "example"}], poll_s=0)
    keys = make_keys(CHUNKS, "full-step")
    src.fill(keys)
    settle(src)
    extra = make_keys(1, "only-in-the-other-tier")[0]
    with src.mgr.lock:
        other: Any = src.mgr.secondary_tiers[1]  # vLLM's example tier: a dict of its keys
        other.chunks[extra] = True
    peer = peer_of(src, "reviewer-peer-2")
    try:
        sp = peer.connect(src.tier.address)
        ticket = peer.submit_lookup_round(sp, [*keys, extra], timeout=BOUND)
        end = time.monotonic() + BOUND
        while peer.poll(ticket) is None:
            assert time.monotonic() < end, "the lookup was never answered"
            src.idle_step()  # raises AssertionError: Chunk ... not found in cache
            time.sleep(0.002)  # a step's pacing
    finally:
        peer.close()
