"""p2pkv as a vLLM 0.33 secondary tier, loaded from configuration alone.

vLLM builds it from ``kv_connector_extra_config["secondary_tiers"]``::

    {"type": "p2pkv", "module_path": "p2pkv.integrations.vllm_tier",
     "host": "10.0.0.5", "port": 5710}

``SecondaryTierFactory`` imports this module, takes the attribute named by ``type``
(:data:`p2pkv`, bound to :class:`P2pkvSecondaryTier`) and constructs it with the offloading
spec, the CPU primary tier's memory (``primary_kv_view``) and every other key as a keyword
argument. The keys the built-in ``p2p`` tier also reads mean the same here (``host``,
``port`` plus the data-parallel index), so switching is a one-word change; the rest are
p2pkv's own (:class:`TierSettings`). Requests name their source as with the built-in tier:
``kv_transfer_params["remote_kv_source"] = {"remote_host", "remote_port", "kv_request_id"}``.

Theory of operation
-------------------
One node per tier, on its own engine thread (:func:`~p2pkv.start_node`), over vLLM's memory:
its region *is* ``primary_kv_view`` (registered with NIXL once), and its store's key map is
unused: vLLM's primary tier owns which blocks exist, where, and their pins.

* Consumer. ``lookup``/``submit_load``/``on_request_finished`` go to a
  :class:`~p2pkv.integrations.vllm.P2PTier` (batching, probe cache, deadlines, source
  connections), whose loads land in the chunk ids vLLM names (``fetch_into``). HIT means the
  source holds the key pinned for this request's round; RETRY while the probe is out; MISS
  for a miss, and for every later key of a request once anything of it failed (vLLM frees a
  failed key and asks again: without that, the request would loop). A load is reported only
  once no write of it can land any more: at once when the source said every write settled,
  otherwise ``quarantine_s`` after p2pkv gave up on it (or, with ``verify_checksums``, after
  a chunk the source reported written failed its checksum), since vLLM reuses a failed
  chunk at once.
* Source. A peer's lookup reaches vLLM's primary tier through :class:`~p2pkv.pins.HostPins`:
  the engine posts it, ``serve_external_requests`` (vLLM's tier-poll thread, under vLLM's
  lock) asks ``parent.lookup`` per key, pins the hits with ``parent.create_store_job`` in
  the same call, and answers with their chunk ids; keys vLLM is still bringing in are asked
  again on later calls until the request's answer deadline. The job ids are the pins'
  token: each is reported (``get_finished_jobs``) exactly once, when the engine released the
  round (fetched and settled, closed, lease over, quarantine over, peer gone).
* Nothing here blocks vLLM except ``drain_jobs`` and ``shutdown``, which must: the engine
  thread makes every bit of progress, so they wait on it without needing vLLM's lock.

Thread-safety: vLLM calls every method under its one lock, from the scheduler thread or its
tier-poll thread; the engine thread never calls into vLLM. What the two sides share is the
facade's ticket board and :class:`HostPins`, each behind its own short lock.
"""

from __future__ import annotations

import gc
import hashlib
import ipaddress
import itertools
import logging
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ParentManager,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..config import NodeConfig
from ..errors import P2PKVTimeout, PortalClosed
from ..facade import start_node
from ..pins import HostPins, PinRequest
from .vllm import JobResult as LoadResult
from .vllm import LoadJob, P2PTier

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec

__all__ = ["P2pkvSecondaryTier", "TierSettings", "p2pkv"]

log = logging.getLogger("p2pkv.vllm")

_METRIC_PREFIX = "vllm:kv_offload_p2pkv_"
_COUNTERS = {
    "loaded_blocks": "Blocks pulled from peers into this engine's CPU tier.",
    "loaded_bytes": "Bytes pulled from peers into this engine's CPU tier.",
    "failed_blocks": "Blocks whose pull from a peer failed (recomputed instead).",
    "served_blocks": "Blocks this engine pinned for peers' lookups.",
}


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"p2pkv tier: {name} must be a number of seconds, got {value!r}")
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"p2pkv tier: {name} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"p2pkv tier: {name} must be positive, got {value!r}")
    return out


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"p2pkv tier: {name} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"p2pkv tier: {name} must be an integer, got {value!r}") from None


@attrs.frozen(kw_only=True)
class TierSettings:
    """The tier's configuration keys (JSON values; numbers may come as strings).

    Shared with vLLM's built-in ``p2p`` tier: ``host`` (the address peers dial; default
    ``$VLLM_P2P_SIDE_CHANNEL_HOST`` or ``localhost``), ``port`` (default
    ``$VLLM_P2P_SIDE_CHANNEL_PORT`` or 5710; the bound port is ``port`` + the data-parallel
    index; 0 picks a free one) and ``backends`` (ignored: p2pkv's data plane is NIXL/UCX).
    p2pkv's own: ``peer_id`` (default ``host:port``; where ``host`` binds every interface,
    this machine's hostname in its place), ``secret_file`` (a file holding the HMAC key of
    the handshake; or ``secret``, the key itself, which vLLM prints in its start-up log),
    ``tls_cert``/``tls_key``/``tls_ca``, ``verify_checksums``, ``transport`` (``nixl`` or
    ``local`` for in-process tests), the deadlines in seconds ``load_timeout_s`` (30, as
    the built-in), ``lookup_timeout_s`` (5), ``connect_timeout_s`` (10),
    ``quarantine_s`` (6; more than ``abort_timeout_s`` + ``landing_margin_s`` +
    ``serve_timeout_s``, checked), ``abort_timeout_s`` (2), ``landing_margin_s`` (1),
    ``serve_timeout_s`` (how long a peer's lookup may wait for this engine's answer; 2),
    ``reconnect_backoff_s`` (5), ``idle_source_timeout_s`` (300: a source no request has
    named for that long is forgotten and its session closed, as the built-in tier's
    ``VLLM_P2P_IDLE_TIMEOUT_S``; at ``max_peers`` the source unused longest makes room for
    a new one at once), ``lease_s`` (10), and the caps ``max_peers`` (64),
    ``max_pinned_blocks`` (65,536 per peer) and ``max_pinned_share`` (0.9: the share of
    vLLM's CPU tier that all peers' lookups together may hold pinned, so this engine's
    own offloads always find room; 1 lets peers pin all of it), ``max_pinned_peer_share``
    (0.5: the part of that which one peer's lookups may hold, so one peer cannot leave
    the others all misses; 1: first come, first served).
    """

    host: str
    port: int
    peer_id: str
    secret: bytes | None = attrs.field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    verify_checksums: bool = False
    transport: str = "nixl"
    load_timeout_s: float = 30.0
    lookup_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    quarantine_s: float = 6.0  # > abort + landing margin + serve_timeout (checked)
    abort_timeout_s: float = 2.0
    landing_margin_s: float = 1.0
    serve_timeout_s: float = 2.0
    reconnect_backoff_s: float = 5.0
    idle_source_timeout_s: float = 300.0
    lease_s: float = 10.0
    max_peers: int = 64
    max_pinned_blocks: int = 65536
    max_pinned_share: float = 0.9
    max_pinned_peer_share: float = 0.5

    _SECONDS: ClassVar[tuple[str, ...]] = (
        "load_timeout_s",
        "lookup_timeout_s",
        "connect_timeout_s",
        "quarantine_s",
        "abort_timeout_s",
        "landing_margin_s",
        "serve_timeout_s",
        "reconnect_backoff_s",
        "idle_source_timeout_s",
        "lease_s",
    )
    _IGNORED: ClassVar[frozenset[str]] = frozenset(
        {"backends", "num_threads", "unbound_store_timeout_s", "locality"}
    )

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], dp_index: int = 0) -> TierSettings:
        """Parse the tier's keyword arguments; ValueError names the bad or unknown key."""
        kw = dict(kwargs)
        host = kw.pop("host", None)
        if host is None:  # absent, or null in the JSON: the default, as for the other keys
            host = os.environ.get("VLLM_P2P_SIDE_CHANNEL_HOST", "localhost")
        elif not isinstance(host, str) or not host:
            raise ValueError(f"p2pkv tier: host must be a non-empty string, got {host!r}")
        base = _int("port", kw.pop("port", os.environ.get("VLLM_P2P_SIDE_CHANNEL_PORT", 5710)))
        if not 0 <= base < 65536:
            raise ValueError(f"p2pkv tier: port must be 0..65535, got {base}")
        port = base + dp_index if base else 0
        out: dict[str, Any] = {"host": host, "port": port}
        peer_id = kw.pop("peer_id", None)
        if peer_id is None:  # absent, or null in the JSON: the default identity
            peer_id = f"{_identity_host(host)}:{port}" if port else ""
        elif not isinstance(peer_id, str) or not peer_id:
            raise ValueError(f"p2pkv tier: peer_id must be a non-empty string, got {peer_id!r}")
        out["peer_id"] = peer_id
        secret = kw.pop("secret", None)
        secret_file = kw.pop("secret_file", None)
        if secret is not None and secret_file is not None:
            raise ValueError("p2pkv tier: give secret or secret_file, not both")
        if secret is not None:
            if not isinstance(secret, str | bytes) or not secret:
                raise ValueError("p2pkv tier: secret must be a non-empty string")
            out["secret"] = secret.encode() if isinstance(secret, str) else secret
        elif secret_file is not None:
            out["secret"] = _read_secret(secret_file)
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = kw.pop(name, None)
            if path is None:  # absent, or null in the JSON: no TLS file
                continue
            if not isinstance(path, str) or not path:
                raise ValueError(f"p2pkv tier: {name} must be a path, got {path!r}")
            out[name] = path
        if "verify_checksums" in kw:
            flag = kw.pop("verify_checksums")
            if not isinstance(flag, bool):
                raise ValueError("p2pkv tier: verify_checksums must be true or false")
            out["verify_checksums"] = flag
        if "transport" in kw:
            transport = kw.pop("transport")
            if transport not in ("nixl", "local"):
                raise ValueError(f"p2pkv tier: transport must be nixl or local, not {transport!r}")
            out["transport"] = transport
        for name in cls._SECONDS:
            if name in kw:
                out[name] = _seconds(name, kw.pop(name))
        for name in ("max_peers", "max_pinned_blocks"):
            if name in kw:
                value = _int(name, kw.pop(name))
                if value <= 0:
                    raise ValueError(f"p2pkv tier: {name} must be positive")
                out[name] = value
        for name in ("max_pinned_share", "max_pinned_peer_share"):
            value = kw.pop(name, None)
            if value is None:  # absent, or null in the JSON: the default
                continue
            try:
                share = float(value) if isinstance(value, int | float | str) else math.nan
            except ValueError:
                share = math.nan
            if isinstance(value, bool) or not 0 < share <= 1:
                raise ValueError(f"p2pkv tier: {name} must be a number in (0, 1], got {value!r}")
            out[name] = share
        unknown = sorted(set(kw) - cls._IGNORED)
        if unknown:
            raise ValueError(f"p2pkv tier: unknown configuration keys {unknown}")
        settings = cls(**out)
        # A consumer's slots stay quarantined until no write of a fetch it gave up can land.
        # A source's reader used to wait for this engine's answer to a lookup (the host
        # pins, serve_timeout_s) and acted on an abort that much late. Since 2026-12-07 its
        # lookups wait on the host in tasks of their own and the reader acts on aborts as
        # they come; the rule stays, as margin and for sources of a fleet not yet upgraded
        # (equal settings assumed, as a fleet's are). NodeConfig checks the rest
        # (quarantine > abort + margin).
        s = settings
        if not s.quarantine_s > s.abort_timeout_s + s.landing_margin_s + s.serve_timeout_s:
            raise ValueError(
                f"p2pkv tier: quarantine_s ({s.quarantine_s:g}) must exceed abort_timeout_s "
                f"({s.abort_timeout_s:g}) + landing_margin_s ({s.landing_margin_s:g}) + "
                f"serve_timeout_s ({s.serve_timeout_s:g}): a source of an earlier p2pkv, busy "
                "answering a lookup, acts on an abort up to serve_timeout_s late"
            )
        return settings


_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*"})


def _identity_host(host: str) -> str:
    """The host part of the default ``peer_id``: ``host`` itself, unless it binds every
    interface, which names no machine (every engine of a fleet would be "0.0.0.0:5710",
    and a peer claiming our own id is refused); then this machine's
    hostname (a pod's name under Kubernetes)."""
    return socket.gethostname() if host in _WILDCARD_HOSTS else host


def _loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (no other machine can dial it)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname
        return False


def _read_secret(path: object) -> bytes:
    """The handshake secret from a file (``secret_file``): vLLM logs its
    ``kv_transfer_config`` at start, and a command line is visible to ``ps``, so a secret
    given inline is everyone's. One trailing newline is not part of it."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"p2pkv tier: secret_file must be a path, got {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read(4099)  # 4 KiB and a line end
    except OSError as exc:
        raise ValueError(f"p2pkv tier: secret_file {path!r}: {exc.strerror or exc}") from None
    # The line end an editor adds is not the secret's, nor counted against its 4 KiB.
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    if len(data) > 4096:
        raise ValueError(f"p2pkv tier: secret_file {path!r} is over 4 KiB")
    if not data:
        raise ValueError(f"p2pkv tier: secret_file {path!r} is empty")
    return data


@attrs.define(eq=False)
class _Request:
    """What the consumer side keeps on vLLM's ReqContext (``set_state``)."""

    request_id: str
    kv_transfer_params: Mapping[str, Any] | None


@attrs.define(eq=False)
class _Serve:
    """A peer's lookup being answered from vLLM's primary tier, over one or more calls."""

    req: PinRequest
    ctx: ReqContext
    slots: list[int | None]
    pending: list[int]  # indexes of keys vLLM is still bringing in (HIT_PENDING/RETRY)
    jobs: list[int] = attrs.field(factory=list)  # store jobs pinning the hits


@attrs.define
class _Share:
    """At most ``share`` of the time goes to work done on others' behalf: after working
    ``d`` seconds, rest ``d * (1 / share - 1)`` before working again (times from
    ``time.monotonic``)."""

    share: float
    rest_until: float = -math.inf
    MAX_REST: ClassVar[float] = 0.25  # seconds

    def may_work(self, now: float) -> bool:
        return now >= self.rest_until

    def worked(self, start: float, end: float) -> None:
        # At most MAX_REST: one long call (a GC pause) must not outlast peers' deadlines.
        self.rest_until = end + min((end - start) * (1 / self.share - 1), self.MAX_REST)


class P2pkvSecondaryTier(SecondaryTierManager):
    """p2pkv's peer-to-peer tier for vLLM 0.33 (see the module docstring)."""

    cache_hit_source = CacheHitSource.P2P
    tolerates_off_thread_polling = True

    #: Keys peers' lookups may make one ``serve_external_requests`` call ask vLLM about
    #: (about 10 us each, pinning included); the rest wait for the next call, about 1 ms
    #: later, so vLLM's lock is never held long on peers' behalf.
    SERVE_KEYS_PER_CALL = 2048
    #: The most of vLLM's lock that peers' lookups may take, over time: after a call that
    #: asked vLLM about keys for ``d`` seconds, calls ask nothing for ``d`` more (at 0.5),
    #: so peers that keep big lookups coming leave vLLM's scheduler its lock half the
    #: time (without it, ~20 ms calls every ~1 ms held it ~95 %). Answers still go out.
    SERVE_SHARE = 0.5

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **kwargs: Any,
    ) -> None:
        if backpressure_detector is not None:
            # vLLM builds a detector from the tier's own "backpressure" or from the top-level
            # one in kv_connector_extra_config, which it gives every tier: say where to
            # move the latter, or a user setting it for another tier cannot tell why.
            raise ValueError(
                "the p2pkv tier does not take a backpressure configuration (its stores "
                "finish at once). vLLM gives every tier the top-level 'backpressure' of "
                "kv_connector_extra_config too: set it on each tier that needs it instead"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, None)
        locality = kwargs.get("locality")
        if locality is not None:
            self.locality = Locality(str(locality).upper())
        spec_cfg = offloading_spec.config
        self.settings = TierSettings.from_kwargs(kwargs, spec_cfg.parallel.data_parallel_index)
        s = self.settings
        shape = primary_kv_view.shape or (0,)
        num_chunks = int(shape[0])  # a row per chunk
        block_len = int(self.block_size_bytes)
        region = np.frombuffer(primary_kv_view, dtype=np.uint8)
        if region.nbytes < num_chunks * block_len:
            raise ValueError("primary_kv_view is smaller than num_chunks x block_size_bytes")
        cfg = NodeConfig(
            peer_id=s.peer_id or f"{_identity_host(s.host)}:{os.getpid()}-{secrets.token_hex(4)}",
            host=s.host,
            port=s.port,
            num_blocks=num_chunks,
            block_len=block_len,
            transport="nixl" if s.transport == "nixl" else "local",
            fingerprint=_fingerprint(offloading_spec, block_len),
            hash_algo="vllm-offload-key",
            secret=s.secret,
            verify_checksums=s.verify_checksums,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
            tls_ca=s.tls_ca,
            connect_timeout=s.connect_timeout_s,
            lookup_timeout=s.lookup_timeout_s,
            fetch_timeout=s.load_timeout_s,
            abort_timeout=s.abort_timeout_s,
            quarantine=s.quarantine_s,
            landing_margin=s.landing_margin_s,
            lease=s.lease_s,
            max_peers=s.max_peers,
            max_pinned_blocks=s.max_pinned_blocks,
            max_pinned_share=s.max_pinned_share,
            max_pinned_peer_share=s.max_pinned_peer_share,
        )
        self._pins = HostPins(
            num_chunks,
            answer_within=s.serve_timeout_s,
            max_blocks=int(num_chunks * s.max_pinned_share),
        )
        failed = ""
        try:
            node = start_node(cfg, region=region, pin_source=self._pins)
        except PortalClosed as exc:  # e.g. the port is taken: say so, not "engine ended"
            failed = str(exc.__cause__ if exc.__cause__ is not None else exc)
        except P2PKVTimeout as exc:  # e.g. registering a large region took too long
            failed = str(exc)
        if failed:
            # No traceback may keep an array over the region alive: vLLM unmaps it next.
            del region
            gc.collect()
            raise RuntimeError(f"p2pkv tier could not start on {s.host}:{s.port}: {failed}")
        try:
            self._core = P2PTier(
                node,
                lookup_timeout=s.lookup_timeout_s,
                load_timeout=s.load_timeout_s,
                connect_timeout=s.connect_timeout_s,
                reconnect_backoff=s.reconnect_backoff_s,
                idle_source_timeout=s.idle_source_timeout_s,
                owns_node=True,
            )
        except BaseException:
            node.close()
            raise
        self._node = node
        self._ctx_names = itertools.count()
        self._serving: list[_Serve] = []
        self._serve_share = _Share(self.SERVE_SHARE)
        self._unfinished_ctx: list[ReqContext] = []  # drained before parent was at hand
        self._loads: dict[int, float] = {}  # load job id -> when vLLM submitted it
        self._done: deque[JobResult] = deque()  # results not yet handed to vLLM
        self._stats: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._shut = False
        log.info("p2pkv tier %s listening on %s:%d", cfg.peer_id, *node.address)
        if s.secret is None and s.tls_cert is None and not _loopback(s.host):
            # Anyone who can reach the port and guess the fingerprint (model, dtype and
            # sizes: nothing secret) may answer HIT and write the bytes vLLM then loads.
            log.warning(
                "p2pkv tier %s accepts unauthenticated peers on %s: set secret_file (or "
                "TLS) so that only engines of this fleet can serve it KV blocks",
                cfg.peer_id,
                s.host,
            )

    # ---------------------------------------------------------------- identity

    @property
    def address(self) -> tuple[str, int]:
        """Where peers reach this tier (``port`` 0 in the config picks a free one)."""
        return self._node.address

    @property
    def peer_id(self) -> str:
        return self._node.peer_id

    # ---------------------------------------------------------------- consumer side

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        view = _Request(str(req_context.req_id), req_context.kv_transfer_params)
        req_context.set_state(view)
        self._core.prepare(view)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        hit = self._core.lookup(key, self._view(req_context))
        if hit is None:
            return LookupResult.RETRY
        return LookupResult.HIT if hit else LookupResult.MISS

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        keys: list[bytes] = list(job.keys)
        self._loads[job.job_id] = time.monotonic()
        view = self._view(job.req_context)
        self._core.submit_load(
            LoadJob(
                job.job_id,
                view.request_id,
                keys,
                request=view,
                slots=np.asarray(job.chunk_ids).tolist(),
            )
        )

    def submit_store(self, job_metadata: TransferJob) -> None:
        # The blocks stay in vLLM's primary tier and are served from there.
        self._done.append(JobResult(job_metadata.job_id, True))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._core.step()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._core.on_request_finished(self._view(req_context))

    def has_pending_work(self) -> bool:
        # A peer's lookup waiting for serve_external_requests is work: without the
        # tier-poll thread, only a step serves it, and an idle engine steps only for this.
        # So are pins: held ones until the peer lets go, released ones until a step has
        # reported their job (else vLLM keeps the chunks pinned until other work comes).
        return bool(
            self._done
            or self._serving
            or self._loads
            or self._unfinished_ctx
            or self._pins.any_waiting()
            or self._core.has_pending_work()
            or self._pins.held()
            or self._pins.any_released()
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        # vLLM's tier-poll thread calls this every millisecond: idle, it costs ~1 us.
        if not self._done and not self._pins.any_released() and self._core.idle():
            return ()
        for res in self._core.get_finished_jobs():
            self._done.append(self._load_result(res))
        for token in self._pins.released():
            assert isinstance(token, tuple)
            self._done.extend(JobResult(job_id, True) for job_id in token)
        return self._hand_over()

    def _hand_over(self) -> Iterator[JobResult]:
        """The queued results, each taken off the queue as it is handed to vLLM: if vLLM
        raises on one (its tier-poll thread logs that and polls on) or stops walking,
        those behind it stay queued for the next call, so each job is reported once.
        Handed over as a list, they went with the one vLLM raised on, never reported,
        and the chunks they pinned stayed pinned."""
        while self._done:
            yield self._done.popleft()

    def _load_result(self, res: LoadResult) -> JobResult:
        submitted = self._loads.pop(res.job_id, None)
        elapsed = time.monotonic() - submitted if submitted is not None else None
        n_ok = len(res.loaded)
        self._stats["loaded_blocks"] += n_ok
        self._stats["loaded_bytes"] += n_ok * self.block_size_bytes
        self._stats["failed_blocks"] += len(res.failed)
        if res.failed:
            log.debug("p2pkv load %d: %d keys failed", res.job_id, len(res.failed))
        return JobResult(
            res.job_id,
            res.success,
            successful_keys=None if res.success else [OffloadKey(k) for k in res.loaded],
            transfer_time=elapsed,
            transfer_bytes=n_ok * self.block_size_bytes,
        )

    @staticmethod
    def _view(req_context: ReqContext) -> _Request:
        view = req_context.get_state(_Request)
        if view is None:  # a request this tier was not told about
            view = _Request(str(req_context.req_id), req_context.kv_transfer_params)
            req_context.set_state(view)
        return view

    # ---------------------------------------------------------------- source side

    def serve_external_requests(self, parent: ParentManager) -> None:
        if not (self._serving or self._unfinished_ctx or self._pins.any_waiting()):
            return  # the idle path: vLLM's tier-poll thread calls this every millisecond
        while self._unfinished_ctx:  # one at a time: vLLM may raise midway
            parent.on_request_finished(self._unfinished_ctx.pop(0))
        for _ in range(64):
            # One at a time: if vLLM raises on a request, it is answered all misses now
            # and those behind it stay queued for the next call (taken together, they
            # were answered by nobody until the engine's serve deadline).
            taken = self._pins.take(limit=1)
            if not taken:
                break
            req = taken[0]
            ctx = ReqContext(req_id=f"p2pkv:serve:{next(self._ctx_names)}")
            n = len(req.keys)
            try:
                parent.on_new_request(ctx)
            except BaseException:
                self._pins.answer(req, [None] * n, None)
                raise
            self._serving.append(_Serve(req, ctx, [None] * n, list(range(n))))
        now = time.monotonic()
        budget = self.SERVE_KEYS_PER_CALL if self._serve_share.may_work(now) else 0
        asked = False  # vLLM was asked (or raised while asked): its lock went to peers
        serving, still = self._serving, []
        # The call's keys are shared among the requests that want some, each asking at
        # most its part of what is left: given all to the first, one peer's big lookup
        # held every other peer's behind it for as many calls as it took, up to its
        # deadline (and those due just after it were then answered all misses).
        wanting = sum(1 for srv in serving if srv.pending and not srv.req.abandoned)
        done = 0  # serving[:done] are answered (dropped) or in still
        try:
            for srv in serving:
                if not srv.req.abandoned and budget > 0 and srv.pending:
                    asked = True
                    part = -(-budget // wanting)  # what is left, shared: rounded up
                    wanting -= 1
                    budget -= self._ask(parent, srv, part)
                # Answer before the engine stops waiting; keys still pending are misses.
                done += 1  # from here on it is in still, or done with (never twice)
                if srv.pending and not srv.req.abandoned and now < srv.req.deadline - 0.05:
                    still.append(srv)
                else:
                    try:
                        parent.on_request_finished(srv.ctx)
                    finally:  # answered even if vLLM raised: its pins' jobs come back
                        self._pins.answer(srv.req, srv.slots, tuple(srv.jobs) if srv.jobs else None)
        finally:
            # If vLLM raised, the requests answered so far are gone and the rest wait for
            # the next call: the one it raised on in a lookup (with what it pinned), and
            # those after it. One it raised on while finishing is not tried again.
            self._serving = still + serving[done:]
            if asked:  # time to rest, also when vLLM raised
                self._serve_share.worked(now, time.monotonic())

    def _ask(self, parent: ParentManager, srv: _Serve, budget: int) -> int:
        """Ask vLLM about at most ``budget`` of the request's pending keys and pin the
        HITs; returns how many were asked.

        A HIT may be pinned only while nothing could have evicted it since: a lookup that
        starts a promotion from another tier (it answers HIT_PENDING or RETRY) allocates
        in the primary tier and may evict a chunk HIT a moment ago. So the HITs so far
        are pinned before such a lookup's successors are asked about, after checking
        which of them vLLM still holds (:meth:`_still_hit`). Pinning a chunk gone since
        would raise inside vLLM, leave the pins it had taken held for good, and (served
        from a step) escape vLLM's ``schedule()``."""
        keys = srv.req.keys
        asked, later = srv.pending[:budget], srv.pending[budget:]
        hits: list[int] = []
        pending: list[int] = []
        for i in asked:
            res = parent.lookup(OffloadKey(keys[i]), srv.ctx)
            if res is LookupResult.HIT:
                hits.append(i)
            elif res is not LookupResult.MISS:  # HIT_PENDING or RETRY: ask again later
                pending.append(i)
                if hits:  # it may have evicted one of them: pin what is left, now
                    self._pin(parent, srv, self._still_hit(parent, srv, hits, pending))
                    hits = []
        srv.pending = later + pending
        self._pin(parent, srv, hits)  # nothing was evicted since these were HIT
        return len(asked)

    @staticmethod
    def _still_hit(
        parent: ParentManager, srv: _Serve, hits: list[int], pending: list[int]
    ) -> list[int]:
        """Those of ``hits`` vLLM still holds, asked again until a round of asking starts
        no promotion (each one that might have drops the key it was about, so this ends);
        keys no longer HIT go to ``pending`` or are misses."""
        keys = srv.req.keys
        while True:
            kept: list[int] = []
            unsure = False
            for i in hits:
                res = parent.lookup(OffloadKey(keys[i]), srv.ctx)
                if res is LookupResult.HIT:
                    kept.append(i)
                elif res is not LookupResult.MISS:
                    pending.append(i)
                    unsure = True
            if not unsure or not kept:
                return kept
            hits = kept

    def _pin(self, parent: ParentManager, srv: _Serve, hits: list[int]) -> None:
        """Pin ``hits``, which vLLM answered HIT with no eviction since, in one job."""
        if not hits:
            return
        keys = srv.req.keys
        job = parent.create_store_job([OffloadKey(keys[i]) for i in hits], srv.ctx)
        srv.jobs.append(job.job_id)
        for i, chunk in zip(hits, np.asarray(job.chunk_ids).tolist(), strict=True):
            srv.slots[i] = int(chunk)
        self._stats["served_blocks"] += len(hits)

    # ---------------------------------------------------------------- drain and shutdown

    def drain_jobs(self) -> None:
        """Every job submitted so far reported or queued for ``get_finished_jobs``: loads
        end (a load's write in flight is never cut: it settles or quarantines out),
        peers' rounds give their pins back (writes to peers are cut, as a peer's abort
        would: each settles or quarantines out), lookups being answered are answered all
        misses. Bounded by ``max(load_timeout_s, abort_timeout_s) + quarantine_s`` + 1 s."""
        s = self.settings
        end = time.monotonic() + max(s.load_timeout_s, s.abort_timeout_s) + s.quarantine_s + 1.0
        self._stop_serving()
        try:
            self._node.release_unused_pins(
                cut_writes=True, timeout=max(end - time.monotonic(), 0.1)
            )
        except Exception as exc:  # the node is gone: its sessions released everything
            log.warning("p2pkv tier: releasing peers' pins failed: %s", exc)
        self._core.drain(max(end - time.monotonic(), 0.0))
        while self._pins.held() and time.monotonic() < end:
            # Pins under a write in flight: its settle (or quarantine) releases them.
            time.sleep(0.002)
        if self._pins.held() or self._core.has_pending_work():
            log.warning("p2pkv tier: drain_jobs gave up with work in flight")

    def _stop_serving(self) -> None:
        for srv in self._serving:
            # Without the parent at hand, the pins taken so far go straight back and the
            # request's context is finished at the next serve.
            self._done.extend(JobResult(job_id, True) for job_id in srv.jobs)
            self._pins.answer(srv.req, [None] * len(srv.req.keys), None)
            self._unfinished_ctx.append(srv.ctx)
        self._serving = []

    def shutdown(self) -> None:
        """Drain (bounded as :meth:`drain_jobs`), close the node, and return only once
        nothing can touch ``primary_kv_view`` any more."""
        if self._shut:
            return
        self._shut = True
        self._stop_serving()
        try:
            self._core.shutdown()
        finally:
            self._pins.release_all()
            self._unfinished_ctx.clear()
            # Every array over primary_kv_view goes with the node (some sit in reference
            # cycles of the engine's objects), so vLLM can unmap the region next.
            del self._core, self._node
            gc.collect()

    # ---------------------------------------------------------------- metrics

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            _METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=doc)
            for name, doc in _COUNTERS.items()
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        if not any(self._stats.values()):
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, value in self._stats.items():
            if value:
                stats.increase_counter(_METRIC_PREFIX + name, value)
        self._stats = dict.fromkeys(_COUNTERS, 0)
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("transport", "peer_id")

    def config_info(self) -> dict[str, str]:
        return {"transport": self.settings.transport, "peer_id": self._node.peer_id}


def _fingerprint(spec: OffloadingSpec, chunk_bytes: int) -> str:
    """What two engines must share for their blocks to be interchangeable: everything that
    decides what a chunk's bytes mean. Besides the model and the sizes, that is which
    tokens of a block each worker holds (tensor, pipeline, prefill- and decode-context
    parallel sizes) and how a worker lays them out on the host (the KV cache layout, the
    canonical or direct host layout, a single replicated copy). vLLM's own P2P tier
    keys its files on the same (``FileMapper``). Without the layout fields, engines
    differing only in them would exchange blocks and load them as their own; engines of
    a p2pkv from before those fields have other fingerprints and get only misses."""
    c = spec.config
    groups = ";".join(
        f"{g.group_id}:{g.tokens_per_block}:{','.join(g.layer_names)}" for g in c.groups
    )
    parts: Sequence[object] = (
        "vllm",
        c.model.name,
        c.model.dtype,
        c.cache.tokens_per_hash,
        c.cache.blocks_per_chunk,
        c.parallel.world_size,
        c.parallel.tp_size,
        c.parallel.pp_size,
        c.parallel.pcp_size,
        c.parallel.dcp_size,
        c.kv_cache_layout,
        c.canonical_layout,
        c.replicated_layout,
        chunk_bytes,
        c.worker_kv_bytes_per_block,
        groups,
    )
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()


#: The attribute vLLM's factory looks up (``"type": "p2pkv"``).
p2pkv = P2pkvSecondaryTier
