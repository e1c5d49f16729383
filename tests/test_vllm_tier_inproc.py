"""The vLLM tier inside vLLM 0.33's real tiering manager, two managers in this process.

vLLM's own ``TieringOffloadingSpec`` builds the tier from its config dict (``type`` +
``module_path``), exactly as in a serving engine; the test plays the scheduler the way
``OffloadingConnectorScheduler`` does: one lock region per step holding the lookups and
``on_schedule_end``, with vLLM's tier-poll thread running beside it. The steps are paced
(2 ms), as vLLM paces them; what ends a wait is a condition checked every step, under a
bound. The two-process tests (real processes, SIGKILL, SIGSTOP) are in test_vllm_tier.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np
import pytest

with warnings.catch_warnings():  # vLLM and torch warn at import; not ours to fix
    warnings.simplefilter("ignore")
    vllm_spec = pytest.importorskip(
        "vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed"
    )
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.tiering import manager as vllm_manager
    from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from p2pkv import BlockingNode, FetchResult, LookupRound, Peer, start_node
from p2pkv.integrations import vllm_tier
from p2pkv.integrations.vllm_tier import P2pkvSecondaryTier

from .helpers import FaultFactory

pytestmark = pytest.mark.vllm

CHUNK = 64 * 1024
CHUNKS = 64
BOUND = 10.0  # seconds: "this did not hang", never an expected duration
QUARANTINE = 2.0  # > abort_timeout_s + landing_margin_s + serve_timeout_s below
_ids = itertools.count()

FAST = {  # test deadlines
    "load_timeout_s": 2.0,
    "lookup_timeout_s": 2.0,
    "quarantine_s": QUARANTINE,
    "abort_timeout_s": 0.4,
    "landing_margin_s": 0.4,
    "serve_timeout_s": 1.0,
}


def tier_config(**kw: Any) -> dict[str, Any]:
    cfg = {
        "type": "p2pkv",
        "module_path": "p2pkv.integrations.vllm_tier",
        "host": "127.0.0.1",
        "port": "0",  # JSON may carry ports as strings
        "transport": "local",
        **FAST,
        **kw,
    }
    if "quarantine_s" not in kw:  # the tier's rule: past abort + margin + serve_timeout
        floor = sum(
            float(cfg[k]) for k in ("abort_timeout_s", "landing_margin_s", "serve_timeout_s")
        )
        cfg["quarantine_s"] = max(QUARANTINE, floor + 0.2)
    return cfg


def offloading_config(
    tier: dict[str, Any], engine_id: str, poll_s: float = 0.001
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": CHUNKS * CHUNK,
            "tier_poll_interval_s": poll_s,  # 0: no tier-poll thread, steps only
            "secondary_tiers": [tier],
        },
        engine_id=engine_id,
        model=OffloadingModelConfig(name="test-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


@attrs.define
class Engine:
    """One vLLM engine's offloading stack: the manager and its p2pkv tier."""

    mgr: TieringOffloadingManager
    engine_id: str

    @property
    def tier(self) -> P2pkvSecondaryTier:
        tier = self.mgr.secondary_tiers[0]
        assert isinstance(tier, P2pkvSecondaryTier)
        return tier

    def view(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        # Rows from the buffer's size: the tier model's engines have fewer chunks.
        return np.frombuffer(self.tier._primary_kv_view, np.uint8).reshape(-1, CHUNK)

    def fill(self, keys: list[OffloadKey]) -> None:
        """Store ``keys`` in the primary tier with their reference bytes."""
        ctx = ReqContext(req_id=f"fill-{next(_ids)}")
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
            out = self.mgr.prepare_store(keys, ctx)
            assert out is not None
            view = self.view()
            for key, chunk in zip(out.keys_to_store, chunk_ids(out.store_spec), strict=True):
                view[chunk] = expected(key)
            del view
            self.mgr.complete_store(out.keys_to_store, ctx)
            self.mgr.on_request_finished(ctx)

    def step(self, ctx: ReqContext, keys: list[OffloadKey]) -> list[LookupResult]:
        """One scheduler step for one request: lookups in prefix order, then the end."""
        with self.mgr.lock:
            out = []
            for key in keys:
                res = self.mgr.lookup(key, ctx)
                out.append(res)
                if res is LookupResult.MISS:
                    break
            self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        return out

    def idle_step(self) -> None:
        """A scheduler step with nothing scheduled (what an idle engine that steps does)."""
        with self.mgr.lock:
            self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def jobs(self) -> int:
        with self.mgr.lock:
            return len(self.mgr._jobs)


def expected(key: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(hashlib.sha256(key).digest() * (CHUNK // 32), np.uint8)


def chunk_ids(spec: object) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    return [int(c) for c in spec.chunk_ids]


def make_keys(n: int, salt: str) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(f"{salt}{i}".encode()).digest(), 0) for i in range(n)]


def request(source: Engine, name: str) -> ReqContext:
    host, port = source.tier.address
    params = {"remote_kv_source": {"kv_request_id": name, "remote_host": host, "remote_port": port}}
    return ReqContext(req_id=name, kv_transfer_params=params)


def until(cond: Callable[[], bool], what: str, step: Callable[[], object] = lambda: None) -> None:
    end = time.monotonic() + BOUND
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        step()
        time.sleep(0.002)  # a scheduler step's pacing, not a synchronisation


def pull(dst: Engine, ctx: ReqContext, keys: list[OffloadKey]) -> tuple[list[LookupResult], bool]:
    """Step until every key is a primary hit (HIT) or the prefix ends at a MISS; then
    check the loaded chunks byte for byte."""
    with dst.mgr.lock:
        dst.mgr.on_new_request(ctx)
    res: list[LookupResult] = []

    def settled() -> bool:
        nonlocal res
        res = dst.step(ctx, keys)
        return res[-1] is LookupResult.MISS or (
            len(res) == len(keys) and all(r is LookupResult.HIT for r in res)
        )

    until(settled, "the request to settle")
    exact = False
    if all(r is LookupResult.HIT for r in res) and len(res) == len(keys):
        exact = load_exact(dst, ctx, keys)
    return res, exact


def load_exact(dst: Engine, ctx: ReqContext, keys: list[OffloadKey]) -> bool:
    """Load ``keys`` (all hits) for ``ctx``: whether every chunk holds its key's bytes."""
    with dst.mgr.lock:
        spec = dst.mgr.prepare_load(keys, ctx)
        view = dst.view()
        exact = all(
            np.array_equal(view[c], expected(k)) for k, c in zip(keys, chunk_ids(spec), strict=True)
        )
        del view
        dst.mgr.complete_load(keys, ctx)
    return exact


Wanted = dict[str, tuple[ReqContext, list[OffloadKey]]]


def step_together(dst: Engine, wanted: Wanted) -> dict[str, list[LookupResult]]:
    """ONE scheduler step for several requests: each one's lookups in prefix order, up to
    its first MISS, then the step's end."""
    res: dict[str, list[LookupResult]] = {}
    with dst.mgr.lock:
        for name, (ctx, keys) in wanted.items():
            res[name] = []
            for key in keys:
                r = dst.mgr.lookup(key, ctx)
                res[name].append(r)
                if r is LookupResult.MISS:
                    break
        dst.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    return res


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    built: list[Engine] = []

    def build(
        poll_s: float = 0.001,
        tiers: list[dict[str, Any]] | None = None,
        change: Callable[[OffloadingConfig], OffloadingConfig] | None = None,
        **tier_kw: Any,
    ) -> Engine:
        """An engine with the p2pkv tier (``tier_kw``), then ``tiers`` (vLLM's own
        secondary tiers' configurations) beside it; ``change`` edits vLLM's config."""
        engine_id = f"p2pkvtest{os.getpid()}x{next(_ids)}"
        cfg = offloading_config(tier_config(**tier_kw), engine_id, poll_s)
        if change is not None:
            cfg = change(cfg)
        if tiers is not None:
            extra: Any = cfg.extra_config  # a dict at run time
            extra["secondary_tiers"] = [tier_config(**tier_kw), *tiers]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = vllm_spec.TieringOffloadingSpec(cfg).get_manager()
        assert isinstance(mgr, TieringOffloadingManager)
        eng = Engine(mgr, engine_id)
        built.append(eng)
        return eng

    try:
        yield build
    finally:
        for eng in built:
            with contextlib.suppress(Exception):
                eng.mgr.shutdown()
            for leftover in (f"/dev/shm/vllm_offload_{eng.engine_id}.mmap",):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)


def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("p2pkv-engine")]


# ------------------------------------------------------------------------- loading


def test_vllm_builds_the_tier_from_its_config_alone(engines: Callable[..., Engine]) -> None:
    eng = engines()
    assert type(eng.tier) is P2pkvSecondaryTier
    assert vllm_tier.p2pkv is P2pkvSecondaryTier
    assert not P2pkvSecondaryTier.__abstractmethods__
    assert P2pkvSecondaryTier.tolerates_off_thread_polling
    assert eng.tier.settings.port == 0 and eng.tier.address[1] > 0
    assert eng.tier.config_info()["transport"] == "local"
    assert set(P2pkvSecondaryTier.config_info_keys({})) == set(eng.tier.config_info())
    assert "tier" not in P2pkvSecondaryTier.config_info_keys({})


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"no_such_key": 1}, "unknown configuration keys"),
        ({"load_timeout_s": "soon"}, "load_timeout_s"),
        ({"quarantine_s": -1}, "quarantine_s"),
        ({"port": "http"}, "port"),
        ({"transport": "carrier-pigeon"}, "transport"),
        (  # a configuration vLLM builds a detector from: the tier refuses it
            {"backpressure": {"backpressure_cls": "EMABackpressureDetector"}},
            "does not take a backpressure.*top-level 'backpressure'.*each tier that needs it",
        ),
        ({"tls_cert": 5, "tls_key": "k.pem", "tls_ca": "ca.pem"}, "tls_cert must be a path"),
        (  # 0.4 + 0.4 + 1.0: a source busy answering may act on an abort that late
            {"quarantine_s": 1.5},
            r"quarantine_s \(1.5\) must exceed .*serve_timeout_s \(1\)",
        ),
    ],
)
def test_a_bad_configuration_is_refused_naming_the_key(
    engines: Callable[..., Engine], bad: dict[str, Any], match: str
) -> None:
    before = engine_threads()
    with pytest.raises(Exception, match=match):
        engines(**bad)
    assert engine_threads() == before  # nothing started, or it was stopped again


def test_the_default_quarantine_outlasts_an_abort_a_busy_source_acts_on_late() -> None:
    """A source whose reader waits for its engine's answer to a lookup (the host pins, up
    to serve_timeout_s; p2pkv before 2026-12-07, so still possible in a fleet being
    upgraded) acts on an abort that much late, then may take abort_timeout_s to cut the
    write and landing_margin_s more for the bytes to stop: the consumer's quarantine must
    outlast all three. The default (5) covered only the last two, so a cut write could
    land in a chunk vLLM had reused (found by a review, 2026-12-05)."""
    s = vllm_tier.TierSettings.from_kwargs({})
    assert s.quarantine_s > s.abort_timeout_s + s.landing_margin_s + s.serve_timeout_s
    with pytest.raises(ValueError, match="serve_timeout_s"):
        vllm_tier.TierSettings.from_kwargs({"quarantine_s": 5.0, "serve_timeout_s": 2.0})
    assert vllm_tier.TierSettings.from_kwargs({"serve_timeout_s": 1.0, "quarantine_s": 4.5})


@pytest.mark.parametrize("name", vllm_tier.TierSettings._SECONDS)
@pytest.mark.parametrize("value", [0, "0", -1.5, "nan", float("inf")])
def test_every_deadline_key_refuses_a_value_that_is_not_a_positive_time(
    name: str, value: object
) -> None:
    # Zero is no deadline: a serve, backoff or idle timeout of 0 never reaches NodeConfig.
    with pytest.raises(ValueError, match=name):
        vllm_tier.TierSettings.from_kwargs({"port": 5710, name: value})


def test_tls_files_given_as_null_are_absent() -> None:
    # JSON's null means "not given", as for the secret: it was read as the path "None".
    tls = {"tls_cert": None, "tls_key": None, "tls_ca": None}
    s = vllm_tier.TierSettings.from_kwargs({"host": "127.0.0.1", "port": 0, **tls})
    assert (s.tls_cert, s.tls_key, s.tls_ca) == (None, None, None)


def test_a_host_given_as_null_is_the_default_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It was read as the host "None" (a review, 2026-12-04), and failed only at start.
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_HOST", "10.1.2.3")
    s = vllm_tier.TierSettings.from_kwargs({"host": None, "port": 5710})
    assert (s.host, s.peer_id) == ("10.1.2.3", "10.1.2.3:5710")
    for bad in ("", 7):
        with pytest.raises(ValueError, match="host"):
            vllm_tier.TierSettings.from_kwargs({"host": bad, "port": 5710})
    for name, default_share in (("max_pinned_share", 0.9), ("max_pinned_peer_share", 0.5)):
        for default in ({}, {name: None}):
            s = vllm_tier.TierSettings.from_kwargs({"port": 5710, **default})
            assert getattr(s, name) == default_share
        for share in (0, 1.5, "half", True, [0.5], "nan"):
            with pytest.raises(ValueError, match=name):
                vllm_tier.TierSettings.from_kwargs({"port": 5710, name: share})
        s = vllm_tier.TierSettings.from_kwargs({"port": 5710, name: "0.25"})
        assert getattr(s, name) == 0.25


def test_the_port_is_the_base_plus_the_data_parallel_index_and_only_a_real_port_is_taken() -> None:
    s = vllm_tier.TierSettings.from_kwargs({"host": "10.0.0.7", "port": "5710"}, dp_index=2)
    assert (s.port, s.peer_id) == (5712, "10.0.0.7:5712")
    assert vllm_tier.TierSettings.from_kwargs({"port": 0}, dp_index=2).port == 0  # a free one
    assert vllm_tier.TierSettings.from_kwargs({"port": 65535}).port == 65535
    for bad in (65536, -1, True, 5710.5):
        with pytest.raises(ValueError, match="port"):
            vllm_tier.TierSettings.from_kwargs({"port": bad})


def test_a_flag_or_a_cap_of_the_wrong_kind_is_refused_naming_the_key() -> None:
    bads: list[tuple[str, object]] = [
        ("verify_checksums", "yes"),
        ("verify_checksums", 1),
        ("max_peers", 0),
        ("max_peers", True),
        ("max_pinned_blocks", 0),
        ("max_pinned_blocks", "many"),
    ]
    for name, value in bads:
        with pytest.raises(ValueError, match=name):
            vllm_tier.TierSettings.from_kwargs({"port": 5710, name: value})
    s = vllm_tier.TierSettings.from_kwargs(
        {"port": 5710, "verify_checksums": True, "max_peers": "1", "max_pinned_blocks": 1}
    )
    assert (s.verify_checksums, s.max_peers, s.max_pinned_blocks) == (True, 1, 1)


@pytest.mark.parametrize("line_end", [b"", b"\n", b"\r\n"])
def test_a_secret_file_of_up_to_4_kib_is_read_and_a_larger_one_refused(
    tmp_path: Path, line_end: bytes
) -> None:
    """The limit is the secret's: a line end after 4 KiB of it is not counted."""
    path = tmp_path / "secret"
    path.write_bytes(b"k" * 4096 + line_end)
    s = vllm_tier.TierSettings.from_kwargs({"port": 5710, "secret_file": str(path)})
    assert s.secret == b"k" * 4096
    path.write_bytes(b"k" * 4097 + line_end)
    with pytest.raises(ValueError, match="over 4 KiB"):
        vllm_tier.TierSettings.from_kwargs({"port": 5710, "secret_file": str(path)})


def test_a_secret_in_a_file_stays_out_of_vllms_start_up_log(tmp_path: Path) -> None:
    """vLLM logs its non-default arguments, ``kv_transfer_config`` among them, at start
    (and a command line is visible to ``ps``): a secret given inline is printed, one given
    as ``secret_file`` is not (review 2026-12-04: the tier took it inline only)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.startup import get_non_default_args, redact_sensitive_args

    path = tmp_path / "p2pkv.secret"
    path.write_text("fleet-secret-123")

    def logged(tier: dict[str, Any]) -> str:
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [tier],
            },
        )
        args = get_non_default_args(EngineArgs(model="m", kv_transfer_config=kv))
        return str(redact_sensitive_args(args))

    assert "fleet-secret-123" in logged({"type": "p2pkv", "secret": "fleet-secret-123"})
    assert "fleet-secret-123" not in logged({"type": "p2pkv", "secret_file": str(path)})
    s = vllm_tier.TierSettings.from_kwargs({"port": 5710, "secret_file": str(path)})
    assert s.secret == b"fleet-secret-123"
    (tmp_path / "empty").write_text("\n")
    bads: list[tuple[dict[str, Any], str]] = [
        ({"secret": "x", "secret_file": str(path)}, "not both"),
        ({"secret_file": str(tmp_path / "absent")}, "secret_file .*absent"),
        ({"secret_file": str(tmp_path / "empty")}, "empty"),
        ({"secret_file": 5}, "secret_file must be a path"),
    ]
    for bad, match in bads:
        with pytest.raises(ValueError, match=match):
            vllm_tier.TierSettings.from_kwargs({"port": 5710, **bad})


def test_a_tier_reachable_from_other_machines_without_a_secret_warns(
    engines: Callable[..., Engine],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a secret or TLS any host that reaches the port and knows the model may
    serve this engine KV bytes: said at start, unless only this machine can dial it.
    (The tests bind loopback only: "reachable from elsewhere" is patched in.)"""
    loopback = vllm_tier._loopback
    assert loopback("127.0.0.1") and loopback("localhost") and loopback("::1")
    assert not loopback("0.0.0.0") and not loopback("10.0.0.7") and not loopback("node-7")
    (tmp_path / "secret").write_text("s")
    with caplog.at_level(logging.WARNING, logger="p2pkv"):
        engines()
        monkeypatch.setattr(vllm_tier, "_loopback", lambda host: False)
        engines(secret_file=str(tmp_path / "secret"))
        assert "unauthenticated" not in caplog.text
        engines()
    assert "accepts unauthenticated peers on 127.0.0.1" in caplog.text


def test_a_host_binding_every_interface_names_the_machine_in_the_default_id() -> None:
    """With ``host: 0.0.0.0`` (usual in containers) every engine of a fleet had the id
    "0.0.0.0:5710": each refused the others' hellos as its own, every pull missed (review
    2026-12-04). The machine's hostname stands in for a wildcard host."""
    for wildcard in ("0.0.0.0", "::"):
        s = vllm_tier.TierSettings.from_kwargs({"host": wildcard, "port": 5710})
        assert s.peer_id == f"{socket.gethostname()}:5710"
    s = vllm_tier.TierSettings.from_kwargs({"host": "10.0.0.7", "port": 5710})
    assert s.peer_id == "10.0.0.7:5710"


def test_a_peer_id_given_as_null_is_absent(engines: Callable[..., Engine]) -> None:
    """JSON's null for peer_id means "not given", as for the secret: it became the
    identity "None", so two engines configured so refused each other's handshake ("peer
    id is our own") and every pull missed."""
    s = vllm_tier.TierSettings.from_kwargs({"host": "127.0.0.1", "port": 5710, "peer_id": None})
    assert s.peer_id == "127.0.0.1:5710"
    with pytest.raises(ValueError, match="peer_id"):
        vllm_tier.TierSettings.from_kwargs({"host": "127.0.0.1", "port": 5710, "peer_id": 7})
    src, dst = engines(peer_id=None), engines(peer_id=None)
    keys = make_keys(4, "nullid")
    src.fill(keys)
    res, exact = pull(dst, request(src, "r-null"), keys)
    assert res == [LookupResult.HIT] * len(keys) and exact


def test_a_port_in_use_fails_the_build_and_leaves_nothing_running(
    engines: Callable[..., Engine],
) -> None:
    # (Whether vLLM can then unmap its region is not checked here: pytest's log capture
    # keeps the engine's failure record, traceback and all, alive.)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = engine_threads()
        with pytest.raises(Exception, match=r"could not start on .*(?i:address|in use)"):
            engines(port=taken.getsockname()[1])
        assert engine_threads() == before


# ------------------------------------------------------------------------- pulls


@pytest.mark.parametrize("transport", ["local", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_a_pull_is_byte_exact_and_every_source_pin_is_reported_once(
    engines: Callable[..., Engine], transport: str
) -> None:
    src, dst = engines(transport=transport), engines(transport=transport)
    keys = make_keys(24, "pull")
    src.fill(keys)
    res, exact = pull(dst, request(src, "r1"), keys)
    assert res == [LookupResult.HIT] * len(keys) and exact
    # The source's pin jobs come back exactly once (a second report would trip the
    # manager's assertion on its tier-poll thread), so its job table empties.
    until(lambda: src.jobs() == 0 and dst.jobs() == 0, "every job to be reported")
    with dst.mgr.lock:
        stats = dst.tier.get_stats()
    assert stats is not None
    assert stats.data["data"]["vllm:kv_offload_p2pkv_loaded_blocks"][()] == len(keys)


def _parallel(**kw: Any) -> Callable[[OffloadingConfig], OffloadingConfig]:
    return lambda c: dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, **kw))


def _model(**kw: Any) -> Callable[[OffloadingConfig], OffloadingConfig]:
    return lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, **kw))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_parallel(dcp_size=2), id="decode-context-parallel"),
        pytest.param(_parallel(pcp_size=2), id="prefill-context-parallel"),
        pytest.param(lambda c: dataclasses.replace(c, kv_cache_layout="HND"), id="kv-layout"),
        pytest.param(
            lambda c: dataclasses.replace(c, canonical_layout=True, kv_cache_layout="NHD"),
            id="canonical-host-layout",
        ),
        pytest.param(lambda c: dataclasses.replace(c, replicated_layout=True), id="replicated"),
        # Offload keys hash the tokens only: engines of two models share every key.
        pytest.param(_model(name="another-model"), id="model"),
        pytest.param(_model(dtype="bfloat16"), id="dtype"),
    ],
)
def test_engines_whose_chunks_mean_different_bytes_never_exchange_them(
    engines: Callable[..., Engine], change: Callable[[OffloadingConfig], OffloadingConfig]
) -> None:
    """Engines alike but for which tokens of a block each worker holds, or how a worker
    lays them out on the host, have different fingerprints: the source's chunks are not
    loaded as the consumer's own (review 2026-12-04: they were, every key a HIT)."""
    src, dst = engines(), engines(change=change)
    keys = make_keys(4, "layout")
    src.fill(keys)
    res, _exact = pull(dst, request(src, "r-layout"), keys)
    assert res[-1] is LookupResult.MISS, f"blocks crossed a layout difference: {res}"


def test_with_a_secret_only_engines_that_hold_it_exchange_blocks(
    engines: Callable[..., Engine], tmp_path: Path
) -> None:
    """The secret may come from a file (``secret_file``), one trailing newline dropped:
    a member reading it so and one given it inline are one fleet."""
    (tmp_path / "secret").write_text("fleet-secret\n")
    src = engines(secret="fleet-secret", verify_checksums=True)
    member = engines(secret_file=str(tmp_path / "secret"), verify_checksums=True)
    outsider = engines(secret="another-secret", verify_checksums=True)
    keys = make_keys(6, "secret")
    src.fill(keys)
    res, exact = pull(member, request(src, "r-member"), keys)
    assert res == [LookupResult.HIT] * len(keys) and exact
    res, exact = pull(outsider, request(src, "r-outsider"), keys)
    assert res == [LookupResult.MISS] and not exact  # the handshake fails: a miss, no loop


def test_two_requests_sharing_a_prefix_in_one_step_both_load_it(
    engines: Callable[..., Engine],
) -> None:
    src, dst = engines(), engines()
    shared, own_a, own_b = make_keys(8, "shared"), make_keys(4, "a"), make_keys(4, "b")
    src.fill(shared + own_a + own_b)
    wanted = {"a": (request(src, "ra"), shared + own_a), "b": (request(src, "rb"), shared + own_b)}
    with dst.mgr.lock:
        for ctx, _ in wanted.values():
            dst.mgr.on_new_request(ctx)

    def both_hit() -> bool:
        done = step_together(dst, wanted)  # both requests in ONE step
        return all(len(v) == 12 and set(v) == {LookupResult.HIT} for v in done.values())

    until(both_hit, "both requests to hit")
    for ctx, keys in wanted.values():
        assert load_exact(dst, ctx, keys), ctx.req_id
    until(lambda: src.jobs() == 0 and dst.jobs() == 0, "every job to be reported")


def test_a_source_gone_before_the_load_fails_it_at_once_and_the_request_then_misses(
    engines: Callable[..., Engine],
) -> None:
    # A load that was never posted cannot have a write in flight: it fails at once. (A
    # posted load is held for the quarantine: the SIGKILL/SIGSTOP tests in
    # test_vllm_tier.py check that lower bound.)
    src, dst = engines(), engines()
    keys = make_keys(8, "fail")
    src.fill(keys)
    ctx = request(src, "r1")
    with dst.mgr.lock:
        dst.mgr.on_new_request(ctx)
    # One step sends the probe; wait for its answer without stepping (a step would
    # turn the answer into HITs and submit the load)...
    assert dst.step(ctx, keys) == [LookupResult.RETRY] * len(keys)

    def answered() -> bool:
        with dst.mgr.lock:
            return dst.tier._core.lookup(keys[-1], dst.tier._view(ctx)) is True

    until(answered, "the probe's answer")
    src.mgr.shutdown()  # ...then the source goes away before the load is posted.
    assert dst.step(ctx, keys) == [LookupResult.HIT_PENDING] * len(keys)  # load submitted
    until(lambda: dst.step(ctx, keys)[0] is LookupResult.MISS, "the failed load")
    assert dst.jobs() == 0  # reported, exactly once (a second report would assert)
    assert dst.step(ctx, keys) == [LookupResult.MISS]  # no loop: the request misses


def finish(eng: Engine, ctx: ReqContext) -> None:
    with eng.mgr.lock:
        eng.mgr.on_request_finished(ctx)


def test_at_max_peers_the_source_unused_longest_makes_room_for_a_new_one(
    engines: Callable[..., Engine],
) -> None:
    """Sessions to sources were kept for good, each counted against ``max_peers`` at both
    ends: once an engine had pulled from that many sources, every request naming a new
    one missed, and the engine refused new consumers too (review 2026-12-04). At the cap,
    the session to the source no request has named for longest is closed first."""
    dst = engines(max_peers=2)
    sources = [engines() for _ in range(3)]
    for i, src in enumerate(sources):
        keys = make_keys(3, f"room{i}")
        src.fill(keys)
        ctx = request(src, f"r-room{i}")
        res, exact = pull(dst, ctx, keys)
        assert res == [LookupResult.HIT] * 3 and exact, f"source {i} locked out: {res}"
        finish(dst, ctx)
    core = dst.tier._core
    assert sorted(core._sources) == sorted(s.tier.address for s in sources[1:])
    assert dst.tier._node.peer_count() == 2  # the first source's session was closed


def test_requests_naming_the_new_source_and_the_evicted_one_in_one_step_all_settle(
    engines: Callable[..., Engine],
) -> None:
    """At the cap, in one step: two requests name a new source (one dial, one eviction
    for both) and a third names the very source being evicted for it. The two load
    byte-exact; the third settles too, exact if it hits (its source's session may be
    closing under it: then it misses), and no job is lost or the cap passed."""
    dst = engines(max_peers=2)
    old, kept, new = engines(), engines(), engines()
    for i, src in enumerate((old, kept)):  # ``old`` is the source unused longest
        keys = make_keys(2, f"evict{i}")
        src.fill(keys)
        ctx = request(src, f"r-evict{i}")
        assert pull(dst, ctx, keys) == ([LookupResult.HIT] * 2, True)
        finish(dst, ctx)
    fresh, again = make_keys(3, "fresh"), make_keys(3, "again")
    new.fill(fresh)
    old.fill(again)
    wanted = {
        "a": (request(new, "r-a"), fresh),
        "b": (request(new, "r-b"), fresh),
        "c": (request(old, "r-c"), again),
    }
    with dst.mgr.lock:
        for ctx, _ in wanted.values():
            dst.mgr.on_new_request(ctx)
    res: dict[str, list[LookupResult]] = {}

    def all_settled() -> bool:
        res.update(step_together(dst, wanted))  # every request in ONE step
        return all(
            v[-1] is LookupResult.MISS or (len(v) == 3 and set(v) == {LookupResult.HIT})
            for v in res.values()
        )

    until(all_settled, "every request to settle")
    assert res["a"] == res["b"] == [LookupResult.HIT] * 3, res
    for name, (ctx, keys) in wanted.items():
        if res[name][-1] is not LookupResult.MISS:
            assert load_exact(dst, ctx, keys), name
        finish(dst, ctx)
    until(lambda: dst.jobs() == 0 and new.jobs() == 0 and old.jobs() == 0, "every job reported")
    assert dst.tier._node.peer_count() <= 2
    assert new.tier.address in dst.tier._core._sources


def test_a_source_no_request_names_is_forgotten_and_its_session_closed(
    engines: Callable[..., Engine],
) -> None:
    """A tier kept a source (and its session) for every address any request ever named,
    one a client chose included. A source whose dial failed is forgotten once its backoff
    is over, one with a session after ``idle_source_timeout_s`` unnamed; one a live
    request names is kept however long."""
    dst = engines(reconnect_backoff_s=0.05, idle_source_timeout_s=0.2)
    core = dst.tier._core
    nowhere = make_keys(1, "nowhere")
    for port in range(1, 11):  # privileged ports nobody listens on here: refused at once
        params = {"remote_kv_source": {"remote_host": "127.0.0.1", "remote_port": port}}
        ctx = ReqContext(req_id=f"r-nowhere-{port}", kv_transfer_params=params)
        with dst.mgr.lock:
            dst.mgr.on_new_request(ctx)
        until(lambda: dst.step(ctx, nowhere) == [LookupResult.MISS], "the failed dial")  # noqa: B023
        finish(dst, ctx)
    src, kept = engines(), engines()
    keys = make_keys(2, "idle")
    src.fill(keys)
    kept.fill(keys)
    ctx = request(src, "r-idle")
    assert pull(dst, ctx, keys) == ([LookupResult.HIT] * 2, True)
    finish(dst, ctx)
    live = request(kept, "r-live")  # not finished: its source stays
    assert pull(dst, live, keys)[0][-1] is not LookupResult.MISS
    until(
        lambda: list(core._sources) == [kept.tier.address], "idle sources forgotten", dst.idle_step
    )
    until(lambda: dst.tier._node.peer_count() == 1, "the idle session closed", dst.idle_step)
    assert dst.tier._node.is_connected(kept.tier.peer_id)


def test_an_engine_vllm_no_longer_steps_still_forgets_its_sources(
    engines: Callable[..., Engine],
) -> None:
    """vLLM steps an engine with no request only while ``has_pending_work()``; an idle
    one hears only from its tier-poll thread. Sources were looked at only from a step, so
    an engine idle since its last pull kept its session to every source it had pulled
    from, each counted against the source's ``max_peers`` (refusing its new consumers),
    for as long as it stayed idle. Here nothing steps ``dst`` after its pull."""
    dst = engines(idle_source_timeout_s=0.2)
    src = engines()
    keys = make_keys(2, "unstepped")
    src.fill(keys)
    ctx = request(src, "r-unstepped")
    assert pull(dst, ctx, keys) == ([LookupResult.HIT] * 2, True)
    finish(dst, ctx)
    until(lambda: not dst.mgr.has_pending_work(), "vLLM to stop stepping the engine")
    until(
        lambda: src.tier._node.peer_count() == dst.tier._node.peer_count() == 0,
        "the idle session closed, at both ends",
    )
    assert dst.tier._core._sources == {}
    assert not dst.mgr.has_pending_work()  # it was never stepped for this


def test_a_source_that_pulls_from_us_keeps_the_session_we_no_longer_need(
    engines: Callable[..., Engine],
) -> None:
    """One session serves both ways. A tier forgets a source no request of its own names,
    but closes the session only if it is idle both ways: the source, pulling from us over
    it meanwhile, keeps it, and none of its pulls fails."""
    a, b = engines(idle_source_timeout_s=0.1), engines()
    keys = make_keys(2, "ab")
    b.fill(keys)
    ctx = request(b, "r-ab")
    assert pull(a, ctx, keys) == ([LookupResult.HIT] * 2, True)
    finish(a, ctx)
    ours = a.tier._node
    end = time.monotonic() + 0.6  # six of a's idle timeouts, b pulling all along
    i = 0
    while time.monotonic() < end:
        more = make_keys(1, f"ba{i}")
        a.fill(more)
        back = request(a, f"r-ba{i}")
        assert pull(b, back, more) == ([LookupResult.HIT], True)
        finish(b, back)
        a.idle_step()
        assert ours.is_connected(b.tier.peer_id), f"closed under b's pull {i}"
        i += 1
    assert ours.peer_count() == 1


def source_params(src: Engine, name: str, **extra: Any) -> ReqContext:
    host, port = src.tier.address
    spec = {"remote_host": host, "remote_port": port, "kv_request_id": name, **extra}
    return ReqContext(req_id=name, kv_transfer_params={"remote_kv_source": spec})


def test_a_request_naming_a_wrong_peer_id_fails_alone_and_never_its_source(
    engines: Callable[..., Engine],
) -> None:
    """remote_kv_source's peer_id comes from the request's client. A wrong one fails
    that request; the source at that address serves every other request. The tier kept
    the first request's peer_id on the source for good, so one bad client made every
    later request of that source miss (a request with the right peer_id included)."""
    src, dst = engines(), engines()
    first, second, third = make_keys(4, "poison1"), make_keys(4, "poison2"), make_keys(4, "p3")
    src.fill(first + second + third)  # each pulled once: a pulled key is a primary hit after
    res, _ = pull(dst, source_params(src, "r-bad", peer_id="bogus"), first)
    assert res[-1] is LookupResult.MISS
    res, exact = pull(dst, source_params(src, "r-right", peer_id=src.tier.peer_id), first)
    assert res == [LookupResult.HIT] * len(first) and exact
    res, _ = pull(dst, source_params(src, "r-bad-again", peer_id="bogus"), second)
    assert res[-1] is LookupResult.MISS  # checked on an established session too
    res, exact = pull(dst, source_params(src, "r-none"), second)
    assert res == [LookupResult.HIT] * len(second) and exact
    res, exact = pull(dst, source_params(src, "r-right-again", peer_id=src.tier.peer_id), third)
    assert res == [LookupResult.HIT] * len(third) and exact


def test_a_load_submitted_while_its_source_backs_off_is_reported_at_once(
    engines: Callable[..., Engine],
) -> None:
    """A request holds answered probes for a source whose session has since ended, and a
    redial by another request failed (the source backs off). Its next scan asks one new
    key besides the known hits: the load submitted then can never be posted and must fail
    at once (vLLM recomputes). It waited for load_timeout_s instead."""
    src = engines()
    dst = engines(load_timeout_s=BOUND * 3, reconnect_backoff_s=BOUND * 3)
    keys = make_keys(5, "backoff")
    src.fill(keys)
    r1 = request(src, "r1")
    with dst.mgr.lock:
        dst.mgr.on_new_request(r1)
    assert dst.step(r1, keys[:4]) == [LookupResult.RETRY] * 4

    def answered() -> bool:
        with dst.mgr.lock:
            return dst.tier._core.lookup(keys[3], dst.tier._view(r1)) is True

    until(answered, "r1's lookup to be answered")
    r2 = request(src, "r2")
    src.mgr.shutdown()  # its session ends, its port closes
    with dst.mgr.lock:
        dst.mgr.on_new_request(r2)
    until(lambda: dst.step(r2, keys[:1]) == [LookupResult.MISS], "r2's failed dial")
    res = dst.step(r1, keys)  # 4 known hits, and a new key
    assert res[:4] == [LookupResult.HIT_PENDING] * 4, res
    # Reported within a few steps, far inside load_timeout_s (3 x BOUND): until's BOUND.
    until(lambda: dst.jobs() == 0, "the load's report", step=dst.idle_step)


def test_a_reused_request_id_is_not_failed_by_the_old_requests_load(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request "r" loads from a source whose write hangs, and finishes; a new request
    with the same id (another source) starts. The old load's failure must not fail the
    new request (its keys would all miss): the load knew its request by id alone."""
    bad, _ = hanging_source(engines, monkeypatch)
    good, dst = engines(), engines()
    old_keys, new_keys = make_keys(3, "old"), make_keys(3, "new")
    bad.fill(old_keys)
    good.fill(new_keys)
    old = request(bad, "r")
    with dst.mgr.lock:
        dst.mgr.on_new_request(old)
    until(
        lambda: dst.step(old, old_keys) == [LookupResult.HIT_PENDING] * 3, "the old load to start"
    )
    with dst.mgr.lock:
        dst.mgr.on_request_finished(old)
    new = request(good, "r")  # the same request id, another source
    with dst.mgr.lock:
        dst.mgr.on_new_request(new)
    assert dst.step(new, new_keys) == [LookupResult.RETRY] * 3
    until(lambda: dst.jobs() == 0, "the old load's report", step=dst.idle_step)
    with dst.mgr.lock:
        assert dst.tier._core.debug_state()["requests"]["r"]["failed"] is None
    res, exact = pull(dst, new, new_keys)
    assert res == [LookupResult.HIT] * 3 and exact


def test_reset_cache_drains_a_peers_unfetched_round_under_the_lock(
    engines: Callable[..., Engine],
) -> None:
    src = engines()
    keys = make_keys(6, "drain")
    src.fill(keys)
    cfg = src.tier._node.config
    peer_cfg = attrs.evolve(cfg, peer_id="raw-peer", port=0, transport="local")
    peer: BlockingNode = start_node(peer_cfg)
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        rnd = peer.lookup_round(remote, keys, timeout=BOUND)
        assert rnd.hits == [True] * len(keys)
        assert src.jobs() == 1  # the round's pins: one store job at the source
        with src.mgr.lock:
            src.mgr.reset_cache()  # asserts that drain_jobs left no job behind
        assert src.jobs() == 0
        got = peer.fetch(remote, keys, rounds=rnd, timeout=BOUND)
        assert got.loaded == [] and set(got.failed.values()) == {"not_pinned"}
    finally:
        peer.close()


def test_reset_cache_while_a_peers_lookup_is_half_answered_reports_its_pins(
    engines: Callable[..., Engine],
) -> None:
    """A peer's lookup being answered over several calls (its HITs pinned, a key another
    tier is still promoting pending) when vLLM resets its cache: drain_jobs answers the
    peer all misses and hands the pins' job back to vLLM, which asserts that no job is
    left (without the tier-poll thread, so that nothing serves in between)."""
    src = engines(poll_s=0, tiers=[{"type": "example"}])
    keys = make_keys(4, "half-answered")
    src.fill(keys)
    settle(src)  # the cascades to the example tier are reported
    other: Any = src.mgr.secondary_tiers[1]  # vLLM's example tier: a dict of its keys
    extra = make_keys(1, "being-promoted")[0]
    with src.mgr.lock:
        other.chunks[extra] = True  # the example tier holds it, the primary does not
    peer = peer_of(src, "half-answered-peer")
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        ticket = peer.submit_lookup_round(remote, [*keys, extra], timeout=BOUND)
        until(src.tier._pins.any_waiting, "the peer's lookup to reach the tier")
        src.idle_step()  # the HITs are pinned, the promoted key is pending
        assert len(src.tier._serving) == 1 and src.tier._serving[0].jobs
        assert src.tier.has_pending_work()  # a lookup half served keeps the engine stepping
        with src.mgr.lock:
            src.mgr.reset_cache()  # asserts that drain_jobs left no job behind
        assert src.jobs() == 0
        until(lambda: peer.pending() == 0, "the peer's answer")
        answer = peer.poll(ticket)
        assert isinstance(answer, LookupRound) and answer.hits == [False] * 5
        settle(src)
        src.idle_step()  # the served request's context is finished here
        assert pinned_chunks(src) == 0
    finally:
        peer.close()


def hanging_source(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> tuple[Engine, FaultFactory]:
    """A source engine whose data plane posts writes that never settle (FAKE: a stalled
    NIC), and the factory that built its transport."""
    factory = FaultFactory(lambda t: setattr(t, "hang", True))
    real = start_node  # the function vllm_tier calls

    def with_fault(cfg: Any, **skw: Any) -> BlockingNode:
        return real(cfg, transport=factory, **skw)

    with monkeypatch.context() as m:
        m.setattr(vllm_tier, "start_node", with_fault)
        return engines(**kw), factory


def open_rounds(eng: Engine) -> int:
    """The rounds the engine's node holds open at its peers (as a consumer)."""
    node = eng.tier._node._node
    return sum(len(s._rounds) for s in node._sessions)


def test_reset_cache_at_a_source_whose_write_to_a_peer_hangs_reports_every_job(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's round is under a write that never settles. Left alone, the producer
    would hold its pins until the peer gives up, then abort_timeout and a quarantine:
    past drain_jobs' bound, and vLLM's reset_cache asserts that no job is left. The drain
    cuts the write itself; the peer's fetch fails, loading nothing."""
    times = {"abort_timeout_s": 1.0, "quarantine_s": 2.6}
    src, factory = hanging_source(engines, monkeypatch, **times)
    keys = make_keys(4, "hang")
    src.fill(keys)
    # The peer would wait for the write much longer than the source's drain may take.
    peer_cfg = attrs.evolve(src.tier._node.config, peer_id="raw-peer", port=0, fetch_timeout=8.0)
    peer: BlockingNode = start_node(peer_cfg)
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        rnd = peer.lookup_round(remote, keys, timeout=BOUND)
        assert rnd.hits == [True] * len(keys)
        ticket = peer.submit_fetch(remote, keys, rounds=rnd, timeout=BOUND)
        until(lambda: factory.transport.posts > 0, "the source to post its write")
        with src.mgr.lock:
            src.mgr.reset_cache()  # asserts that drain_jobs left no job behind
        assert src.jobs() == 0
        until(lambda: peer.pending() == 0, "the peer's fetch to end")
        result = peer.poll(ticket)
        assert isinstance(result, FetchResult)
        assert result.loaded == [] and set(result.failed) == set(keys)
    finally:
        peer.close()


def test_a_slot_load_that_must_look_its_keys_up_again_is_reported_within_the_drain(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's round expired before its load, so the load's fetch looks the keys
    up again (the source answers late), then writes, and the write hangs. The load must
    still end by its own deadline and a quarantine: its ticket used to cut it later
    than that, and the tier then held the report another quarantine, past drain_jobs'
    bound (vLLM's reset_cache then asserts)."""
    src, factory = hanging_source(engines, monkeypatch, poll_s=0, lease_s=1.0, serve_timeout_s=4.0)
    dst = engines(lease_s=1.0)
    keys = make_keys(4, "relook")
    src.fill(keys)
    ctx = request(src, "r-relook")
    with dst.mgr.lock:
        dst.mgr.on_new_request(ctx)
    assert set(dst.step(ctx, keys)) == {LookupResult.RETRY}

    def answered() -> bool:
        with dst.mgr.lock:
            return dst.tier._core.lookup(keys[-1], dst.tier._view(ctx)) is True

    until(answered, "the lookup's answer", step=src.idle_step)
    until(lambda: open_rounds(dst) == 0, "the round's lease to run out")
    assert set(dst.step(ctx, keys)) == {LookupResult.HIT_PENDING}  # the load is submitted
    until(src.tier._pins.any_waiting, "the fetch's own lookup to reach the source")
    errors: list[BaseException] = []

    def reset() -> None:
        try:
            with dst.mgr.lock:
                dst.mgr.reset_cache()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reset, name="test-reset-cache")
    t.start()
    # The scenario, not a synchronisation: the source's vLLM answers that lookup only
    # 1.5 s later (no tier-poll thread: a step serves it), eating into the load's 2 s.
    time.sleep(1.5)
    until(lambda: factory.transport.posts > 0, "the source's write", step=src.idle_step)
    t.join(BOUND + 10)
    assert not t.is_alive()
    assert errors == []
    assert dst.jobs() == 0


def test_a_peers_lookup_waiting_for_a_step_keeps_an_idle_engine_stepping(
    engines: Callable[..., Engine],
) -> None:
    """Without the tier-poll thread (``tier_poll_interval_s: 0``, or once it gave up after
    30 s of failures) a peer's lookup is served only from a step, and an idle engine
    steps only while a tier has pending work: the waiting lookup must count as such."""
    src = engines(poll_s=0)
    keys = make_keys(3, "idle")
    src.fill(keys)

    idle_step = src.idle_step
    until(lambda: not src.tier.has_pending_work(), "the engine to go idle", step=idle_step)
    peer_cfg = attrs.evolve(src.tier._node.config, peer_id="raw-peer", port=0)
    peer: BlockingNode = start_node(peer_cfg)
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        ticket = peer.submit_lookup(remote, keys)
        until(src.tier._pins.any_waiting, "the peer's lookup to wait for a step")
        assert src.tier.has_pending_work()  # vLLM steps the idle engine for it
        hits: list[bool] | None = None

        def answered() -> bool:
            nonlocal hits
            hits = peer.poll(ticket)  # type: ignore[assignment]
            return hits is not None

        until(answered, "the step to serve the lookup", step=idle_step)
        assert hits == [True] * len(keys)
    finally:
        peer.close()


def held_round(src: Engine) -> tuple[BlockingNode, Any, LookupRound]:
    """A peer of ``src`` (an engine without the tier-poll thread, gone idle) holding a
    lookup round of three keys: their chunks pinned, the pins' job not reported yet."""
    keys = make_keys(3, "held")
    src.fill(keys)
    idle_step = src.idle_step
    until(lambda: not src.tier.has_pending_work(), "the engine to go idle", step=idle_step)
    peer = peer_of(src, "holding-peer")
    remote = peer.connect(src.tier.address, timeout=BOUND)
    ticket = peer.submit_lookup_round(remote, keys, timeout=BOUND)
    until(lambda: peer.pending() == 0, "the step to serve the lookup", step=idle_step)
    rnd = peer.poll(ticket)
    assert isinstance(rnd, LookupRound) and rnd.hits == [True] * len(keys)
    assert src.jobs() == 1  # the round's pins: one store job at the source
    return peer, remote, rnd


def test_pins_a_peer_holds_keep_an_idle_engine_stepping(engines: Callable[..., Engine]) -> None:
    """Without the tier-poll thread an idle engine steps only while a tier has pending
    work, and only a step reports the job of a peer's pins to vLLM (once the peer
    released the round, fetched it, or its lease ended): while the round holds them,
    the tier has pending work."""
    src = engines(poll_s=0)
    peer, remote, rnd = held_round(src)
    try:
        assert src.tier.has_pending_work()
        peer.release(remote, rnd, timeout=BOUND)
        until(lambda: src.jobs() == 0, "the pins' job to be reported", step=src.idle_step)
        assert pinned_chunks(src) == 0
    finally:
        peer.close()


def test_released_pins_keep_an_idle_engine_stepping_until_their_job_is_reported(
    engines: Callable[..., Engine],
) -> None:
    """Once the peer lets go of its round, the pins' job still has to be reported by a
    step: until then the tier has pending work. Counting only pins still held, an idle
    engine stopped stepping with the job unreported and the chunks pinned in vLLM."""
    src = engines(poll_s=0)
    peer, remote, rnd = held_round(src)
    try:
        peer.release(remote, rnd, timeout=BOUND)
        # vLLM steps the idle engine exactly while the tier has pending work:
        until(lambda: not src.tier.has_pending_work(), "the engine to go idle", step=src.idle_step)
        assert src.jobs() == 0 and pinned_chunks(src) == 0
    finally:
        peer.close()


def test_vllm_raising_while_peers_are_served_loses_and_repeats_no_answer(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM raises from a lookup while the tier serves two peers' requests in one call,
    after the first was answered: the next call answers the second, and never the first
    again (answering it twice raised there, and on every call after)."""
    src = engines(poll_s=0)
    keys = make_keys(4, "raise")
    src.fill(keys)

    idle_step = src.idle_step
    until(lambda: not src.tier.has_pending_work(), "the engine to go idle", step=idle_step)
    peers: list[BlockingNode] = []
    try:
        tickets = []
        for i, part in enumerate((keys[:2], keys[2:])):  # two sessions: one request each
            cfg = attrs.evolve(src.tier._node.config, peer_id=f"raw-peer-{i}", port=0)
            peers.append(peer := start_node(cfg))
            remote = peer.connect(src.tier.address, timeout=BOUND)
            tickets.append((peer, peer.submit_lookup(remote, part)))
        until(lambda: len(src.tier._pins._inbox) == 2, "both lookups to wait for a step")
        real_ask, calls = src.tier._ask, []

        def ask_failing_once(parent: Any, srv: Any, budget: int) -> int:
            calls.append(srv)
            if len(calls) == 2:
                raise RuntimeError("vLLM failed a lookup")
            return real_ask(parent, srv, budget)

        monkeypatch.setattr(src.tier, "_ask", ask_failing_once)
        with pytest.raises(RuntimeError, match="vLLM failed"):
            idle_step()
        results: dict[int, object] = {}

        def answered() -> bool:
            for i, (peer, ticket) in enumerate(tickets):
                if i not in results and (r := peer.poll(ticket)) is not None:
                    results[i] = r
            return len(results) == len(tickets)

        until(answered, "both lookups to be answered", step=idle_step)
        assert results == {0: [True, True], 1: [True, True]}
        idle_step()  # and the calls after it serve on, raising nothing
    finally:
        for peer in peers:
            peer.close()


def test_a_lookup_larger_than_one_serve_call_is_answered_over_several(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = engines()
    keys = make_keys(10, "budget")
    src.fill(keys[:7])
    asked: list[int] = []
    real_ask = src.tier._ask

    def counting_ask(parent: Any, srv: Any, budget: int) -> int:
        asked.append(n := real_ask(parent, srv, budget))
        return n

    monkeypatch.setattr(src.tier, "SERVE_KEYS_PER_CALL", 3)
    monkeypatch.setattr(src.tier, "_ask", counting_ask)
    peer_cfg = attrs.evolve(src.tier._node.config, peer_id="raw-peer", port=0)
    peer: BlockingNode = start_node(peer_cfg)
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        rnd = peer.lookup_round(remote, keys, timeout=BOUND)
        assert rnd.hits == [True] * 7 + [False] * 3
        assert max(asked) <= 3 and sum(asked) == 10  # vLLM's lock: 3 keys per call
        peer.release(remote, rnd, timeout=BOUND)
        until(lambda: src.jobs() == 0, "the pins' jobs to be reported")
    finally:
        peer.close()


@pytest.mark.nixl
def test_shutdown_leaves_no_thread_and_lets_vllm_unmap_its_region(
    engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    # NIXL, not the local transport: in one process the local transport's stand-in for
    # the peer's registration holds the peer's array, which NIXL (raw addresses) never does.
    src, dst = engines(transport="nixl"), engines(transport="nixl")
    keys = make_keys(4, "shut")
    src.fill(keys)
    assert pull(dst, request(src, "r1"), keys)[1]
    with caplog.at_level(logging.WARNING):
        for eng in (dst, src):
            eng.mgr.shutdown()
            assert not os.path.exists(f"/dev/shm/vllm_offload_{eng.engine_id}.mmap")
    assert "still exported" not in caplog.text
    assert engine_threads() == []


def test_the_serve_share_rests_as_long_as_it_worked_at_one_half() -> None:
    share = vllm_tier._Share(0.5)
    assert share.may_work(0.0)
    share.worked(1.000, 1.020)  # 20 ms asking vLLM on peers' behalf
    assert not share.may_work(1.030)
    assert share.may_work(1.040)
    quarter = vllm_tier._Share(0.25)
    quarter.worked(0.0, 0.010)
    assert not quarter.may_work(0.039) and quarter.may_work(0.040)
    long = vllm_tier._Share(0.5)  # one long call (a GC pause): the rest is capped
    long.worked(0.0, 10.0)
    assert long.may_work(10.0 + vllm_tier._Share.MAX_REST)


class Gate:
    """A stand-in for the tier's serve share that the test opens and closes."""

    def __init__(self) -> None:
        self.open = False
        self.worked_calls = 0

    def may_work(self, now: float) -> bool:
        return self.open

    def worked(self, start: float, end: float) -> None:
        assert start <= end
        self.worked_calls += 1


def serve_calls_of_four_keys(src: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier serves at most 4 keys a call, with no rests between calls (an open
    :class:`Gate` as its serve share): only the per-call budget is under test."""
    gate = Gate()
    gate.open = True
    monkeypatch.setattr(src.tier, "_serve_share", gate)
    monkeypatch.setattr(src.tier, "SERVE_KEYS_PER_CALL", 4)


def test_peers_lookups_ask_vllm_only_when_the_serve_share_allows(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peers that keep big lookups coming could hold vLLM's lock ~95 % of the time (~20
    ms of asking every ~1 ms poll). The tier asks vLLM only while its serve share allows,
    and tells it each time it asked (so it rests as long): with the share closed, steps
    ask nothing; opened, the lookup is served."""
    src = engines(poll_s=0)
    keys = make_keys(6, "share")
    src.fill(keys)
    gate = Gate()
    monkeypatch.setattr(src.tier, "_serve_share", gate)
    asked: list[int] = []
    real_ask = src.tier._ask

    def counting_ask(parent: Any, srv: Any, budget: int) -> int:
        asked.append(n := real_ask(parent, srv, budget))
        return n

    monkeypatch.setattr(src.tier, "_ask", counting_ask)
    peer_cfg = attrs.evolve(src.tier._node.config, peer_id="raw-peer", port=0)
    peer: BlockingNode = start_node(peer_cfg)
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        ticket = peer.submit_lookup(remote, keys)
        until(lambda: len(src.tier._pins._inbox) == 1, "the lookup to wait for a step")
        for _ in range(5):
            src.idle_step()
        assert asked == [] and gate.worked_calls == 0
        gate.open = True
        results: list[object] = []

        def answered() -> bool:
            if (r := peer.poll(ticket)) is not None:
                results.append(r)
            return bool(results)

        until(answered, "the lookup to be answered", step=src.idle_step)
        assert results == [[True] * 6] and sum(asked) == 6
        assert gate.worked_calls == len(asked)

        # A call in which vLLM raises held its lock too: the share is told all the same.
        def failing_ask(parent: Any, srv: Any, budget: int) -> int:
            raise RuntimeError("vLLM failed a lookup")

        monkeypatch.setattr(src.tier, "_ask", failing_ask)
        ticket = peer.submit_lookup(remote, keys[:2])
        until(lambda: len(src.tier._pins._inbox) == 1, "the second lookup to wait")
        worked = gate.worked_calls
        with pytest.raises(RuntimeError, match="vLLM failed"):
            src.idle_step()
        assert gate.worked_calls == worked + 1
        monkeypatch.setattr(src.tier, "_ask", counting_ask)
        results.clear()
        until(answered, "the second lookup to be answered", step=src.idle_step)
    finally:
        peer.close()


def test_a_big_lookup_does_not_hold_a_small_one_of_another_peer_behind_it(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each serve call asks vLLM about at most SERVE_KEYS_PER_CALL keys; it used to give
    them all to the request taken first, so a peer's lookup larger than one call held a
    second peer's one-key lookup behind it for every call it took, up to its own answer
    deadline (and then the small one, due a moment after it, was answered all misses).
    The call's keys are now shared among the requests being served: the small lookup is
    answered in the first call that sees it, the big one goes on over the next ones."""
    # Steps only: the test decides when the tier serves. The big lookup may pin all 40
    # (by default one peer holds at most half the tier's pin share, 28 of 64 chunks).
    src = engines(poll_s=0, max_pinned_peer_share=1)
    big_keys = make_keys(40, "big")
    small_keys = make_keys(1, "small")
    src.fill(big_keys[:10] + small_keys)
    serve_calls_of_four_keys(src, monkeypatch)
    big: BlockingNode = start_node(attrs.evolve(src.tier._node.config, peer_id="big", port=0))
    small: BlockingNode = start_node(attrs.evolve(src.tier._node.config, peer_id="small", port=0))
    try:
        big_remote = big.connect(src.tier.address, timeout=BOUND)
        small_remote = small.connect(src.tier.address, timeout=BOUND)
        big_ticket = big.submit_lookup(big_remote, big_keys)
        until(lambda: len(src.tier._pins._inbox) == 1, "the big lookup to wait for a step")
        small_ticket = small.submit_lookup(small_remote, small_keys)
        until(lambda: len(src.tier._pins._inbox) == 2, "the small lookup to wait behind it")
        src.idle_step()  # one serve call: it takes both, the big one first
        # The small lookup was asked about and answered in that one call.
        assert [len(s.req.keys) for s in src.tier._serving] == [40]
        results: list[object] = []

        def small_answered() -> bool:
            if (r := small.poll(small_ticket)) is not None:
                results.append(r)
            return bool(results)

        until(small_answered, "the small lookup's answer")  # no step: answered already
        assert results == [[True]]
        results.clear()

        def big_answered() -> bool:
            if (r := big.poll(big_ticket)) is not None:
                results.append(r)
            return bool(results)

        until(big_answered, "the big lookup's answer", step=src.idle_step)
        assert results == [[True] * 10 + [False] * 30]
    finally:
        big.close()
        small.close()


def test_a_serve_calls_keys_left_by_one_request_go_to_the_next(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call's keys are shared among the requests that want some, each asking its
    part of what is left: two peers' lookups of 2 keys each fit one call of 4 keys, and
    both are answered in it (a share fixed when the call began, or one that still counted
    the requests already asked, left the second lookup's last key to the next call)."""
    src = engines(poll_s=0)
    keys = {name: make_keys(2, name) for name in ("first", "second")}
    src.fill(keys["first"] + keys["second"])
    serve_calls_of_four_keys(src, monkeypatch)
    peers = {
        name: start_node(attrs.evolve(src.tier._node.config, peer_id=name, port=0)) for name in keys
    }
    try:
        tickets: dict[str, int] = {}

        def inbox_holds(n: int) -> Callable[[], bool]:
            return lambda: len(src.tier._pins._inbox) == n

        for name, peer in peers.items():
            remote = peer.connect(src.tier.address, timeout=BOUND)
            tickets[name] = peer.submit_lookup(remote, keys[name])
            until(inbox_holds(len(tickets)), f"{name}'s lookup to wait for a step")
        src.idle_step()  # one serve call, 4 keys: both lookups asked in whole
        results: dict[str, object] = {}

        def both_answered() -> bool:
            for name, peer in peers.items():
                if name not in results and (r := peer.poll(tickets[name])) is not None:
                    results[name] = r
            return len(results) == 2

        until(both_answered, "both lookups' answers")  # no step: answered already
        assert results == {"first": [True, True], "second": [True, True]}
    finally:
        for peer in peers.values():
            peer.close()


def test_a_lookup_the_engine_stopped_waiting_for_takes_no_part_of_a_serve_call(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup half asked about when the engine stopped waiting for it (abandoned at
    ``serve_timeout_s``) is answered and dropped by the next call, and wants no part of
    that call's keys: a 4-key lookup behind it is asked about in whole and answered in the
    same call (counted as wanting, the abandoned one left it half its keys)."""
    src = engines(poll_s=0, serve_timeout_s=0.5)
    old_keys, new_keys = make_keys(8, "old"), make_keys(4, "new")
    src.fill(old_keys + new_keys)
    serve_calls_of_four_keys(src, monkeypatch)
    old: BlockingNode = start_node(attrs.evolve(src.tier._node.config, peer_id="old", port=0))
    new: BlockingNode = start_node(attrs.evolve(src.tier._node.config, peer_id="new", port=0))
    try:
        old_ticket = old.submit_lookup(old.connect(src.tier.address, timeout=BOUND), old_keys)
        until(lambda: len(src.tier._pins._inbox) == 1, "the old lookup to wait for a step")
        src.idle_step()  # asks about 4 of its 8 keys
        assert [len(s.pending) for s in src.tier._serving] == [4]
        answers: list[object] = []

        def old_answered() -> bool:  # by the engine, at its deadline: abandoned
            if (r := old.poll(old_ticket)) is not None:
                answers.append(r)
            return bool(answers)

        until(old_answered, "the engine to stop waiting for the old lookup")
        assert src.tier._serving[0].req.abandoned
        new_ticket = new.submit_lookup(new.connect(src.tier.address, timeout=BOUND), new_keys)
        until(lambda: len(src.tier._pins._inbox) == 1, "the new lookup to wait for a step")
        src.idle_step()  # one serve call, 4 keys: all the new lookup's
        answers.clear()

        def new_answered() -> bool:
            if (r := new.poll(new_ticket)) is not None:
                answers.append(r)
            return bool(answers)

        until(new_answered, "the new lookup's answer")  # no step: answered already
        assert answers == [[True] * 4]
    finally:
        old.close()
        new.close()


def test_vllm_raising_while_a_served_request_finishes_still_hands_its_pins_back(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM raises from ``on_request_finished`` for a peer's served request: the request
    is answered all the same, so its pins' store jobs come back through
    ``get_finished_jobs`` (they were never handed to the engine, and vLLM's pins leaked)."""
    src = engines()
    keys = make_keys(3, "finish")
    src.fill(keys)
    facing = vllm_manager._SecondaryTierFacingParent
    real_finish = facing.on_request_finished
    raised: list[str] = []

    def finish_failing_once(self: Any, ctx: ReqContext) -> None:
        if ctx.req_id.startswith("p2pkv:serve:") and not raised:
            raised.append(ctx.req_id)
            real_finish(self, ctx)  # vLLM did its part, then raised
            raise RuntimeError("vLLM failed finishing a request")
        real_finish(self, ctx)

    monkeypatch.setattr(facing, "on_request_finished", finish_failing_once)
    peer_cfg = attrs.evolve(src.tier._node.config, peer_id="raw-peer", port=0)
    peer: BlockingNode = start_node(peer_cfg)
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        rnd = peer.lookup_round(remote, keys, timeout=BOUND)
        assert rnd.hits == [True] * 3 and raised
        peer.release(remote, rnd, timeout=BOUND)
        until(lambda: src.jobs() == 0, "the pins' jobs to be reported")
    finally:
        peer.close()


# --- what peers' lookups may pin, and when (a review, 2026-12-04) -------------------------
# Each test failed before its fix:
# - a HIT pinned after a later lookup's promotion from another tier had evicted it: vLLM
#   raised inside create_store_job with the pins taken so far held for good, and, served
#   from a step, out of vLLM's schedule();
# - one peer's round could pin the whole CPU tier (the node-wide share did not apply where
#   the host pins), leaving vLLM's own offloads no chunk.


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
    engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM: "Only keys that lookup() just returned HIT may be pinned, in the same
    serve_external_requests call ... the two must not be separated by an eviction."
    _ask asks vLLM about every pending key of a peer's lookup first and pins the HITs
    afterwards in one create_store_job. A later key that another secondary tier holds
    starts a promotion (prepare_write), which evicts a chunk of the full primary tier:
    one that was HIT a moment ago and is about to be pinned. create_store_job then
    asserts in prepare_read ("not found in cache"), after having pinned the keys before
    it, with no job to ever unpin them: leaked primary pins, and the peer gets misses."""
    # Peers may pin all of it: at the default share (0.9) the keys past the cap are
    # misses never asked about, the other tier's key among them, and nothing is evicted.
    src = engines(tiers=[{"type": "example"}], max_pinned_share=1)
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
        # A lookup of the whole tier and the other tier's key would be past the cap (the
        # key past it a miss, never asked): the chunk not asked about is held by a load
        # of this engine's own instead, so the promotion can only evict one asked about.
        own = ReqContext(req_id="own-load")
        with src.mgr.lock:
            src.mgr.on_new_request(own)
            assert src.mgr.prepare_load([keys[-1]], own) is not None
        rnd = peer.lookup_round(sp, [*keys[:-1], extra], timeout=BOUND)
        peer.release(sp, rnd, timeout=BOUND)
        with src.mgr.lock:
            src.mgr.complete_load([keys[-1]], own)
            src.mgr.on_request_finished(own)
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


def test_a_peers_lookup_of_a_key_another_tier_holds_is_a_hit_once_promoted(
    engines: Callable[..., Engine],
) -> None:
    """vLLM answers HIT_PENDING for a key another secondary tier holds and promotes it
    into the primary tier: the key is asked again on later calls, and pinned and
    served as a hit once there, not answered a miss at once."""
    src = engines(tiers=[{"type": "example"}])
    other: Any = src.mgr.secondary_tiers[1]  # vLLM's example tier: a dict of its keys
    keys = make_keys(2, "promoted")
    with src.mgr.lock:
        for key in keys:
            other.chunks[key] = True  # the example tier holds them, the primary does not
    peer = peer_of(src, "promoting-peer")
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        ticket = peer.submit_lookup_round(remote, keys, timeout=BOUND)
        # The example tier's promotions complete in scheduler steps only.
        until(lambda: peer.pending() == 0, "the lookup's answer", step=src.idle_step)
        rnd = peer.poll(ticket)
        assert isinstance(rnd, LookupRound) and rnd.hits == [True, True]
        peer.release(remote, rnd, timeout=BOUND)
    finally:
        peer.close()


def test_a_peer_cannot_pin_the_whole_primary_tier(engines: Callable[..., Engine]) -> None:
    """What a peer can make this worker hold: a lookup round of everything the source's
    CPU tier holds, never fetched and renewed before its lease ends, used to pin every
    chunk (only the per-peer max_pinned_blocks bounded it), leaving vLLM's own GPU->CPU
    offload no chunk to store into. All peers together now pin at most
    ``max_pinned_share`` (0.9) of the tier; the keys past it are misses. (One peer may
    hold it all here: ``max_pinned_peer_share`` 1; its default is the next test's.)"""
    src = engines(max_pinned_peer_share=1)
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


def test_one_peer_holds_at_most_half_the_tiers_pin_share_by_default(
    engines: Callable[..., Engine],
) -> None:
    """``max_pinned_peer_share`` (0.5) of the tier's pin share (0.9) is what one peer's
    rounds may hold: a peer that sits on rounds of everything the tier holds leaves the
    other half of the share to the other peers, whose lookups still hit (before, the
    first such peer held the whole share and every other peer's lookups missed)."""
    src = engines()
    keys = make_keys(CHUNKS, "everything")
    src.fill(keys)
    part = int(int(CHUNKS * 0.9) * 0.5)
    greedy, other = peer_of(src, "greedy-peer"), peer_of(src, "other-peer")
    try:
        rounds = [
            p.lookup_round(p.connect(src.tier.address), keys, timeout=BOUND)
            for p in (greedy, other)
        ]
        assert [r.hits for r in rounds] == [[True] * part + [False] * (CHUNKS - part)] * 2
        # The share counts each round's pins (the same chunks here, pinned twice).
        assert src.tier._pins.pinned_blocks() == 2 * part
        assert pinned_chunks(src) == part
    finally:
        greedy.close()
        other.close()


def test_a_peers_lookup_never_raises_out_of_the_schedulers_step(
    engines: Callable[..., Engine],
) -> None:
    """The same eviction between a HIT and its pin, without vLLM's tier-poll thread
    (tier_poll_interval_s 0): peers are served from on_schedule_end, on the scheduler
    thread, so create_store_job's AssertionError escapes vLLM's schedule() (in a serving
    engine, the engine core dies) because of one peer's lookup."""
    src = engines(tiers=[{"type": "example"}], poll_s=0)
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


def test_a_new_request_dials_its_source_before_its_first_lookup(
    engines: Callable[..., Engine],
) -> None:
    """The dial is the tier's pending work: without the tier-poll thread, an idle engine
    steps for it (only a step reads it)."""
    src, dst = engines(), engines(poll_s=0)
    with dst.mgr.lock:
        dst.mgr.on_new_request(request(src, "r-early"))
        assert dst.tier.has_pending_work()
    until(lambda: dst.tier._node.is_connected(src.tier.peer_id), "the dial", dst.idle_step)


def test_a_partial_load_names_the_keys_that_landed_and_a_store_succeeds_at_once(
    engines: Callable[..., Engine],
) -> None:
    """vLLM frees the chunks of the keys a failed load does not name as loaded: naming
    none would throw away the ones that landed. A store cascade needs no transfer (the
    blocks are served from vLLM's primary tier): it is done when submitted."""
    from p2pkv.integrations.vllm import JobResult as LoadResult

    eng = engines(poll_s=0)  # no tier-poll thread: this test reads the results
    landed, lost = make_keys(2, "partial")
    res = eng.tier._load_result(LoadResult(7, False, [landed], {lost: "gone"}))
    assert (res.job_id, res.success, res.successful_keys) == (7, False, [landed])
    assert eng.tier._load_result(LoadResult(8, True, [landed, lost])).successful_keys is None
    stats = eng.tier.get_stats()  # the counters of both loads, then reset
    assert stats is not None
    counters = {k: v[()] for k, v in stats._values.items()}
    block = eng.tier.block_size_bytes
    prefix = "vllm:kv_offload_p2pkv_"
    assert counters == {
        prefix + "loaded_blocks": 3,
        prefix + "loaded_bytes": 3 * block,
        prefix + "failed_blocks": 1,
    }
    assert eng.tier.get_stats() is None
    job = TransferJob(9, [landed], np.array([0], np.int32), False, ReqContext(req_id="s"))
    with eng.mgr.lock:
        eng.tier.submit_store(job)
        done = list(eng.tier.get_finished_jobs())
    assert [(r.job_id, r.success) for r in done] == [(9, True)]


def test_a_result_vllm_raises_on_loses_none_behind_it_and_repeats_none(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM raising while it walks the tier's finished jobs (a step's poll; its tier-poll
    thread logs the error and polls on): the jobs behind the one it raised on are
    reported at the next call, each once (a repeat would trip its assertion). They were
    lost: taken off the tier with the one it raised on, never reported, and the chunks
    they pinned stayed pinned for good. A walk abandoned midway loses none either."""
    eng = engines(poll_s=0)  # no tier-poll thread: the steps here make every poll
    ctxs = [ReqContext(req_id=f"walk-{i}") for i in range(3)]
    with eng.mgr.lock:
        stores = []
        for i, ctx in enumerate(ctxs):  # prepare_store polls: all three first
            eng.mgr.on_new_request(ctx)
            stores.append(eng.mgr.prepare_store(make_keys(1, f"walk{i}"), ctx))
        for ctx, out in zip(ctxs, stores, strict=True):  # one store job each, reported at once
            assert out is not None
            eng.mgr.complete_store(out.keys_to_store, ctx)
            eng.mgr.on_request_finished(ctx)
        eng.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    assert eng.jobs() == 3 and pinned_chunks(eng) == 3
    real, seen = eng.mgr._metrics.on_job_finished, []

    def raising_on_the_first(job_metadata: Any, result: Any) -> None:  # FAKE vLLM fault
        seen.append(result.job_id)
        if len(seen) == 1:
            raise RuntimeError("vLLM failed a finished job")
        real(job_metadata, result)

    monkeypatch.setattr(eng.mgr._metrics, "on_job_finished", raising_on_the_first)
    with pytest.raises(RuntimeError, match="vLLM failed a finished job"):
        eng.idle_step()
    settle(eng)  # (the step after vLLM raised skips its poll: vLLM's once-a-step gate)
    assert len(seen) == len(set(seen)) == 3  # the one vLLM raised on it took itself
    assert pinned_chunks(eng) == 1  # the one vLLM raised on: vLLM's to unpin
    # A walk abandoned after its first result leaves the rest for the next call.
    for i in range(3):
        eng.tier.submit_store(
            TransferJob(100 + i, [], np.array([], np.int32), False, ReqContext(req_id="s"))
        )
    with eng.mgr.lock:
        walk = iter(eng.tier.get_finished_jobs())
        assert next(walk).job_id == 100
        del walk
        assert [r.job_id for r in eng.tier.get_finished_jobs()] == [101, 102]
        assert list(eng.tier.get_finished_jobs()) == []


def test_shutdown_twice_is_harmless_and_leaves_no_engine_thread(
    engines: Callable[..., Engine],
) -> None:
    eng = engines(poll_s=0)  # vLLM stops its tier-poll thread before the shutdown
    name = f"p2pkv-engine-{eng.tier.peer_id}"
    assert name in engine_threads()
    eng.tier.shutdown()
    eng.tier.shutdown()
    assert name not in engine_threads()


# --- peers' lookups kept over calls, and their contexts after a drain (a mutation review) --
# Each test failed on a mutant of vllm_tier.py that every other test survived.


class PendingParent(ParentManager):
    """FAKE vLLM (fault injection) in front of the engine's own parent for the tier: every
    key in ``pending`` is one vLLM is still bringing in (RETRY, for good; vLLM is not
    asked). It records the contexts finished through it, fails the test on one finished
    twice, and raises on those in ``fail`` once vLLM has finished them, and on the
    ``refuse``-th calls of on_new_request instead of passing them on."""

    def __init__(self, eng: Engine, pending: Collection[bytes]) -> None:
        self.real: ParentManager = eng.mgr._tier_parents[eng.tier]
        self.pending = set(pending)
        self.asked: list[bytes] = []
        self.finished: list[str] = []
        self.fail: set[str] = set()
        self.refuse: set[int] = set()  # on_new_request raises on these calls (0 = first)
        self.new = 0

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.new += 1
        if self.new - 1 in self.refuse:
            raise RuntimeError("vLLM refused a new request")
        return self.real.on_new_request(req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.asked.append(key)
        if key in self.pending:
            return LookupResult.RETRY
        return self.real.lookup(key, req_context)

    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> TransferJob:
        return self.real.create_store_job(keys, req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        assert req_context.req_id not in self.finished, f"{req_context.req_id} finished twice"
        self.finished.append(str(req_context.req_id))
        self.real.on_request_finished(req_context)
        if req_context.req_id in self.fail:
            raise RuntimeError("vLLM failed finishing a request")


def test_a_peers_lookup_still_pending_is_answered_50_ms_before_its_deadline(
    engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's lookup with a key vLLM is still bringing in is kept for the next call
    while more than 50 ms remain before the engine stops waiting for the answer; within
    50 ms of that, it is answered (the key a miss), so that the answer reaches the engine
    in time: one too late gives the peer all misses, its hits included. The tier's clock
    is a FAKE, set relative to the request's deadline (no timing here)."""
    src = engines(poll_s=0, serve_timeout_s=BOUND)  # the engine waits out every call here
    keys = make_keys(3, "margin")
    src.fill(keys[:2])
    parent = PendingParent(src, pending=keys[2:])
    gate = Gate()  # the serve share (on the real clock) has no say here
    gate.open = True
    monkeypatch.setattr(src.tier, "_serve_share", gate)
    peer = peer_of(src, "margin-peer")
    try:
        remote = peer.connect(src.tier.address, timeout=BOUND)
        ticket = peer.submit_lookup_round(remote, keys, timeout=BOUND)
        until(src.tier._pins.any_waiting, "the peer's lookup to reach the tier")
        deadline = src.tier._pins._inbox[0].deadline

        def serve_at(before_deadline: float) -> None:
            clock = SimpleNamespace(monotonic=lambda: deadline - before_deadline)
            with src.mgr.lock, monkeypatch.context() as m:
                m.setattr(vllm_tier, "time", clock)
                src.tier.serve_external_requests(parent)

        serve_at(0.06)  # the hits are pinned; the last key is pending, asked again later
        assert [s.pending for s in src.tier._serving] == [[2]]
        serve_at(0.04)
        assert src.tier._serving == []
        assert parent.asked.count(keys[2]) == 2
        until(lambda: peer.pending() == 0, "the peer's answer")
        rnd = peer.poll(ticket)
        assert isinstance(rnd, LookupRound) and rnd.hits == [True, True, False]
        peer.release(remote, rnd, timeout=BOUND)
        settle(src)
        assert pinned_chunks(src) == 0
    finally:
        peer.close()


def queue_lookups(
    src: Engine, keys: list[OffloadKey], name: str, peers: list[BlockingNode]
) -> tuple[list[Peer], list[int]]:
    """One peer per key (appended to ``peers``, for the caller to close) asks ``src``'s
    tier to look its key up, each queued there before the next asks, so the tier's inbox
    holds them in this order; returns each peer's session with ``src`` and its ticket."""
    remotes, tickets = [], []
    for i, key in enumerate(keys):
        peers.append(peer := peer_of(src, f"{name}-{i}"))
        remotes.append(remote := peer.connect(src.tier.address, timeout=BOUND))
        tickets.append(peer.submit_lookup_round(remote, [key], timeout=BOUND))

        def queued(n: int = i + 1) -> bool:
            return len(src.tier._pins._inbox) == n

        until(queued, "the lookup to reach the tier")
    return remotes, tickets


def cut_lookups(src: Engine, n: int) -> tuple[PendingParent, list[str], list[BlockingNode]]:
    """``n`` peers' lookups of a key each, being served by ``src`` (an engine without the
    tier-poll thread) from calls through a :class:`PendingParent` for which every key is
    pending; returns it, the served requests' ids in their order, and the peers."""
    keys = make_keys(n, "cut")
    parent = PendingParent(src, pending=keys)
    peers: list[BlockingNode] = []
    queue_lookups(src, keys, "cut-peer", peers)
    with src.mgr.lock:
        src.tier.serve_external_requests(parent)
    served = [str(s.ctx.req_id) for s in src.tier._serving]
    assert len(served) == n and parent.finished == []
    return parent, served, peers


def test_requests_a_drain_cut_are_finished_once_each_in_order_at_the_next_calls(
    engines: Callable[..., Engine],
) -> None:
    """drain_jobs (vLLM's reset_cache) answers the peers' lookups being served all misses
    without vLLM's parent at hand: their requests are finished at the next
    serve_external_requests call, each once and in the order served, and until then the
    tier has pending work (without the tier-poll thread only a step makes that call, and
    an idle engine steps only for pending work). vLLM raising on one of them: that one
    is not finished again, those after it are at the next call."""
    src = engines(poll_s=0, serve_timeout_s=BOUND)  # the engine waits out every call here
    parent, served, peers = cut_lookups(src, 3)
    try:
        parent.fail = {served[1]}
        with src.mgr.lock:
            src.mgr.reset_cache()  # drain_jobs, then vLLM's own reset
        until(lambda: all(p.pending() == 0 for p in peers), "the peers' answers")
        assert parent.finished == []
        assert src.tier.has_pending_work()
        with src.mgr.lock, pytest.raises(RuntimeError, match="vLLM failed finishing"):
            src.tier.serve_external_requests(parent)
        assert parent.finished == served[:2]
        assert src.tier.has_pending_work()  # the third is still to be finished
        with src.mgr.lock:
            src.tier.serve_external_requests(parent)
        assert parent.finished == served
        assert not src.tier.has_pending_work()
        with src.mgr.lock:
            src.tier.serve_external_requests(parent)
        assert parent.finished == served
    finally:
        for peer in peers:
            peer.close()


def test_after_shutdown_no_request_a_drain_cut_is_finished_through_vllm(
    engines: Callable[..., Engine],
) -> None:
    """shutdown drops the requests drain_jobs left to finish: a serve_external_requests
    call after it (as a tier-poll round that outlived it would make) finishes none of
    them in vLLM's manager, which is being torn down."""
    src = engines(poll_s=0, serve_timeout_s=BOUND)
    parent, _served, peers = cut_lookups(src, 2)
    try:
        with src.mgr.lock:
            src.tier.drain_jobs()
        src.tier.shutdown()
        with src.mgr.lock:
            src.tier.serve_external_requests(parent)
        assert parent.finished == []
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.parametrize("same_key", [False, True])
def test_vllm_refusing_a_peers_request_costs_only_that_request(
    engines: Callable[..., Engine], same_key: bool
) -> None:
    """vLLM raising in on_new_request for one peer's lookup: that lookup is answered all
    misses at once, and the ones queued behind it are served at the next call (they used
    to be taken with it and answered by nobody until the engine's serve deadline). Also
    when the three ask for the same key: the refusal costs the others' hits nothing."""
    src = engines(poll_s=0, serve_timeout_s=BOUND)  # only the tier's answers end a wait
    keys = make_keys(1, "refused") * 3 if same_key else make_keys(3, "refused")
    src.fill(list(dict.fromkeys(keys)))
    parent = PendingParent(src, pending=())
    parent.refuse = {1}
    peers: list[BlockingNode] = []
    try:
        remotes, tickets = queue_lookups(src, keys, "refused-peer", peers)
        with src.mgr.lock, pytest.raises(RuntimeError, match="vLLM refused"):
            src.tier.serve_external_requests(parent)
        assert src.tier._pins.any_waiting()  # the third waits for the next call
        assert [str(s.ctx.req_id) for s in src.tier._serving] == ["p2pkv:serve:0"]
        until(lambda: peers[1].pending() == 0, "the refused lookup's answer")
        refused = peers[1].poll(tickets[1])
        assert isinstance(refused, LookupRound) and refused.hits == [False]
        with src.mgr.lock:
            src.tier.serve_external_requests(parent)
        assert not src.tier._pins.any_waiting() and src.tier._serving == []
        for peer, remote, ticket in [*zip(peers, remotes, tickets, strict=True)][::2]:

            def answered(p: BlockingNode = peer) -> bool:
                return p.pending() == 0

            until(answered, "a served lookup's answer")
            rnd = peer.poll(ticket)
            assert isinstance(rnd, LookupRound) and rnd.hits == [True]
            peer.release(remote, rnd, timeout=BOUND)
        settle(src)
        assert pinned_chunks(src) == 0
    finally:
        for peer in peers:
            peer.close()
