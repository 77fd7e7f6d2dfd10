"""distkv as a vLLM (0.33) offloading spec, loaded by vLLM's OffloadingConnector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "RayOffloadingSpec",
        "spec_module_path": "distkv.vllm", "cpu_bytes_to_use": 8000000000, ...}}'

vLLM builds the spec once in the scheduler process, which asks for the manager, and once
in every worker process, which asks for the worker. Both derive the replica's pool name
and layout from the same OffloadingConfig (distkv.replica.specs.ReplicaPlan), so they meet in the
same shared memory. Every key of ``kv_connector_extra_config`` is listed in
docs/configuration.md.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

try:
    from vllm.config import VllmConfig, get_current_vllm_config_or_none
    from vllm.config.utils import get_hash_factors, normalize_value
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed
    from vllm.v1.kv_offload.base import (
        CanonicalKVCaches,
        GPULoadStoreSpec,
        LoadStoreSpec,
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingManager,
        OffloadingMetricMetadata,
        OffloadingSpec,
        OffloadingWorker,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
        TransferResult,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig
except ImportError as e:
    raise ImportError(
        "distkv.vllm needs vLLM 0.33 (vllm.v1.kv_offload.base); install it with "
        "pip install 'ray-distkv[vllm]'"
    ) from e

from distkv import abstract
from distkv.config import HF_CONFIG_SOURCES, MODEL_SETTINGS_OUTSIDE_KV, KVIdentity, model_settings
from distkv.directory.placement import prefix_root
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.replica.join import join_cluster
from distkv.replica.placement import RequestRoot
from distkv.replica.plan import ReplicaPlan
from distkv.storage.handlers import make_handlers
from distkv.storage.pool import HostPool

logger = logging.getLogger(__name__)

# kv_connector_extra_config keys that vLLM 0.33's OffloadingConnector reads itself, beyond
# those DistkvConfig already lets through (spec_name, spec_module_path, block_size).
VLLM_CONNECTOR_KEYS = frozenset(
    {
        "blocks_per_chunk",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
        "sync_load_budget_bytes",
    }
)

POOL_USAGE = "distkv:pool_usage_perc"
PROMOTIONS_IN_FLIGHT = "distkv:promotions_in_flight"
PROMOTED_BYTES = "distkv:promoted_bytes"


def prefix_hash_seed() -> str:
    """The seed vLLM chains its block hashes from (NONE_HASH), as this process resolves it.

    vLLM's engine core resolves the seed (init_none_hash) only after the connector is
    built, and workers never do, so `get_none_hash_seed()` answers vLLM's default in both;
    vLLM's own rule gives the same answer in every process of a replica: PYTHONHASHSEED
    when set (vLLM hands it to its workers), else a fixed default. The rule for sha256
    holds for every cryptographic hash; a non-cryptographic one without PYTHONHASHSEED
    draws a random seed per engine, whose keys no other replica can match.
    """
    return resolve_none_hash_seed(sha256)


# vLLM's CacheConfig fields that change the KV bytes a prompt produces, beyond the KV dtype
# and layout the OffloadingConfig gives: layers whose KV stays in the model's dtype under a
# quantized KV cache, and the dtypes of Mamba layers' state blocks.
CACHE_SETTINGS_IN_KV = ("kv_cache_dtype_skip_layers", "mamba_cache_dtype", "mamba_ssm_cache_dtype")


def connector_vllm_config() -> VllmConfig:
    """The VllmConfig of the engine whose OffloadingConnector is building the spec (or tier) now.

    vLLM 0.33 hands a spec only an OffloadingConfig, which keeps of the model its name and
    KV dtype: not its revision, weights dtype, quantization or config overrides, which
    change the KV bytes of every prompt (docs/configuration.md). It builds the spec inside
    `OffloadingConnector.__init__(self, vllm_config, role, kv_cache_config)`, in the
    scheduler and in every worker. This is the one place that reads that constructor's
    `vllm_config`, found on the call stack by the constructor's own code, read-only. Code
    that builds a spec outside the connector (a benchmark, a test of the tier alone) says
    which config is in effect as vLLM does for its model code, with
    `vllm.config.set_current_vllm_config`. A spec built with neither would not know which
    weights it caches: a ValueError says so.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is OffloadingConnector.__init__.__code__:
            vllm_config = frame.f_locals.get("vllm_config")
            if isinstance(vllm_config, VllmConfig):
                return vllm_config
        frame = frame.f_back
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None and vllm_config.model_config is not None:
        return vllm_config
    raise ValueError(
        "distkv must be built by vLLM's OffloadingConnector (kv_transfer_config 'kv_connector': "
        "'OffloadingConnector'), or under vllm.config.set_current_vllm_config: the model's revision, "
        "weights and config overrides, part of the cache namespace, come from the engine's VllmConfig"
    )


def vllm_model_settings(vllm_config: VllmConfig) -> tuple[tuple[str, str], ...]:
    """KVIdentity.model_settings of a vLLM engine: every field of its ModelConfig but those
    that change no KV byte (MODEL_SETTINGS_OUTSIDE_KV; for HF_CONFIG_SOURCES hf_config,
    after every override, counts), as vLLM normalizes them for its own config hash; the
    revision as the commit vLLM resolved it to on the Hub, where it did (`main` and that
    commit's hash are one snapshot); whether a multimodal model runs its language model
    only (vLLM counts it: it changes the graph); CACHE_SETTINGS_IN_KV."""
    model = vllm_config.model_config
    settings = get_hash_factors(model, MODEL_SETTINGS_OUTSIDE_KV | HF_CONFIG_SOURCES)
    settings["revision"] = getattr(model.revision, "resolved", None) or model.revision
    if model.multimodal_config is not None:
        settings["language_model_only"] = model.multimodal_config.language_model_only
    for name in CACHE_SETTINGS_IN_KV:
        settings[f"cache.{name}"] = normalize_value(getattr(vllm_config.cache_config, name))
    return model_settings(settings)


def replica_plan(config: OffloadingConfig, settings: tuple[tuple[str, str], ...]) -> ReplicaPlan:
    """The replica's plan from vLLM's OffloadingConfig and its model's `settings`
    (`vllm_model_settings`), equal in the scheduler and workers.

    The extra config is checked by DistkvConfig once vLLM's own keys are set aside.
    Replicas whose block hashes start from different seeds compute different keys for the
    same tokens, so the seed (digested: for a non-cryptographic hash it must stay secret)
    is part of the namespace: such replicas show as different namespaces.
    """
    extra = dict(config.extra_config)
    if extra.get("canonical_layout"):
        raise ValueError(
            "kv_connector_extra_config 'canonical_layout'=true is not supported by distkv: "
            "each worker offloads its own pages; leave it unset"
        )
    if config.worker_kv_bytes_per_block <= 0:
        raise ValueError(
            f"vLLM reports {config.worker_kv_bytes_per_block} KV bytes per block: distkv needs "
            "the KV cache to be allocated before the connector is built"
        )
    return ReplicaPlan.derive(
        {k: v for k, v in extra.items() if k not in VLLM_CONNECTOR_KEYS},
        kv_identity(config, settings),
        config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk,
        config.parallel.world_size,
        config.engine_id,
    )


def kv_identity(config: OffloadingConfig, settings: tuple[tuple[str, str], ...]) -> KVIdentity:
    """What makes a vLLM replica's KV bytes interchangeable with another's, from its
    OffloadingConfig and its model's `settings` (`vllm_model_settings`): the namespace's
    inputs for distkv's spec and for its tier (distkv.vllm_tier) alike."""
    parallel = config.parallel
    return KVIdentity(
        model=config.model.name,
        dtype=config.model.dtype,
        group_block_tokens=tuple(group.tokens_per_block for group in config.groups),
        blocks_per_chunk=config.cache.blocks_per_chunk,
        parallel=(parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size),
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        kv_cache_layout=config.kv_cache_layout,
        tokens_per_hash=config.cache.tokens_per_hash,
        prefix_hash_seed=hashlib.sha256(prefix_hash_seed().encode()).hexdigest(),
        model_settings=settings,
    )


def first_chunk(config: OffloadingConfig) -> tuple[int, int]:
    """(end token, group index) of a request's first chunk in the group of the smallest
    chunks (ties by group index): the key a request's blocks are placed by (`request_root`).
    Every request of at least that many tokens records it, whatever it looks up."""
    blocks_per_chunk = config.cache.blocks_per_chunk
    return min((group.tokens_per_block * blocks_per_chunk, group.group_id) for group in config.groups)


def offload_key_positions(req_context: ReqContext) -> Mapping[OffloadKey, int]:
    """The end token of each offload key vLLM's scheduler recorded for the request.

    vLLM 0.33's ReqContext records them (`set_offload_key_position`, every chunk key of the
    request in order, and the partial-tail keys its lookups and stores make) but gives them
    back one key at a time: finding the request's first chunk needs the whole record, which
    only its private `_offload_key_positions` holds. This is the one place that reads it,
    read-only; a ReqContext without it gives no positions, and its blocks are placed by
    their own keys (a miss across replicas at worst, never wrong data).
    """
    return getattr(req_context, "_offload_key_positions", None) or {}


def request_root(req_context: ReqContext, first_chunk: tuple[int, int] | None) -> tuple[OffloadKey, int] | None:
    """The placement root of a vLLM request and its end token: the key of its `first_chunk`
    (`prefix_root`). Partial-tail keys below it, which only some lookups record, never are."""
    return prefix_root(offload_key_positions(req_context), first_chunk)


def vllm_request_root(first_chunk: tuple[int, int] | None) -> RequestRoot:
    """How a replica's cluster manager finds the placement root of a vLLM request
    (`BlockPlacement`): `request_root` with `first_chunk` (None places by the smallest
    position recorded, for a single group without partial tails)."""
    return functools.partial(request_root, first_chunk=first_chunk)


class _ReusedKeys:
    """Per-request state: the stored blocks a request used, in order, for recency."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: dict[abstract.OffloadKey, None] = {}


class ReplicaConnectorStats:
    """distkv's own series among vLLM's offloading metrics, from a replica's cluster
    manager: its pool's usage, promotions in flight, bytes promoted by path. What
    DistkvOffloadingManager and distkv's tier (distkv.vllm_tier) report from get_stats."""

    def __init__(self, cluster: ClusterOffloadingManager) -> None:
        self._cluster = cluster
        self._reported_bytes = (0, 0)  # promoted bytes (same node, cross node) already reported

    @staticmethod
    def definitions() -> dict[str, OffloadingMetricMetadata]:
        return {
            POOL_USAGE: OffloadingGaugeMetadata(
                documentation="Fraction of this replica's distkv pool rows holding or receiving a block."
            ),
            PROMOTIONS_IN_FLIGHT: OffloadingGaugeMetadata(
                documentation="Blocks being copied into this replica's pool from other replicas."
            ),
            PROMOTED_BYTES: OffloadingCounterMetadata(
                documentation="Bytes promoted into this replica's pool from other replicas, by path.",
                labelnames=("path",),
            ),
        }

    def take(self) -> OffloadingConnectorStats:
        """The gauges now, and the counters' increase since the last call."""
        stats = OffloadingConnectorStats()
        cluster = self._cluster
        local = cluster.local
        stats.set_gauge(POOL_USAGE, 1.0 - local.num_free_rows / local.num_rows)
        stats.set_gauge(PROMOTIONS_IN_FLIGHT, cluster.promotions_in_flight)
        promoter = cluster.promoter
        now = (promoter.bytes_same_node, promoter.bytes_cross_node)
        for path, total, reported in zip(("same_node", "cross_node"), now, self._reported_bytes):
            if total > reported:
                stats.increase_counter(PROMOTED_BYTES, total - reported, (path,))
        self._reported_bytes = now
        return stats


# vLLM's answer for each of distkv's LookupResults, indexed by it: the same four answers.
VLLM_LOOKUP_ANSWERS: tuple[LookupResult, ...] = tuple(LookupResult[r.name] for r in abstract.LookupResult)


class DistkvOffloadingManager(OffloadingManager):
    """vLLM 0.33's OffloadingManager over a replica's ClusterOffloadingManager.

    lookup gives the cluster manager's lookup_result as vLLM's LookupResult of the same
    name: RETRY while a block is being promoted from another replica (it may still fail
    into a miss), HIT_PENDING while a store of this replica is (it only waits for the
    worker). Recency is applied when a request finishes: the blocks it loaded, or offered for
    storing and found stored, are touched in the order it used them. Until then the
    blocks its lookups answered HIT are protected from eviction by the cluster manager.
    """

    def __init__(
        self,
        cluster: ClusterOffloadingManager,
        pool: HostPool,
        enable_events: bool,
    ):
        """`cluster` places a request's blocks by `vllm_request_root`."""
        self.cluster = cluster
        self._pool = pool
        self._enable_events = enable_events
        self._events: list[OffloadingEvent] = []
        # callbacks may come from other threads than the scheduler's
        self._lock = threading.RLock()
        self._stats = ReplicaConnectorStats(cluster)
        # the pull gate's prefill cost: blocks offered for storing (computed) between two
        # step ends, against the time between them (decodes included: a bound from above)
        self._offered = 0
        self._step_ended_at: float | None = None

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # ---- hot path --------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return VLLM_LOOKUP_ANSWERS[self.cluster.lookup_result(key, req_context)]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.cluster.prepare_load(keys, req_context)
        self._reused(req_context).keys.update(dict.fromkeys(keys))
        return spec

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cluster.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cluster.touch(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        self._offered += len(keys)
        out = self.cluster.prepare_store(keys, req_context)
        if out is None:
            return None
        if len(out.keys_to_store) < len(keys):
            new = set(out.keys_to_store)
            self._reused(req_context).keys.update(dict.fromkeys(k for k in keys if k not in new))
        return PrepareStoreOutput(out.keys_to_store, out.store_spec, out.evicted_keys)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.cluster.complete_store(keys, req_context, success)

    # ---- request and step hooks ----------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.cluster.request_started(req_context)  # the Directory's answer its router sent, if any
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.cluster.request_finished(req_context)
        used = req_context.get_state(_ReusedKeys)
        if used is not None and used.keys:
            self.cluster.touch(list(used.keys), req_context)
            used.keys.clear()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # The step's misses go to the Directory now, one call per shard. Then: applies
        # finished promotions and keeps the event backlog bounded even when vLLM never
        # drains events (kv events off).
        self.cluster.end_step()
        now = time.monotonic()
        if self._step_ended_at is not None and self._offered:
            self.cluster.pulls.gate.observe_prefill(self._offered, now - self._step_ended_at)
        self._offered, self._step_ended_at = 0, now
        self._collect_events()

    def has_pending_work(self) -> bool:
        return self.cluster.promotions_in_flight > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._collect_events()
        events, self._events = self._events, []
        yield from events

    def get_stats(self) -> OffloadingConnectorStats:
        return self._stats.take()

    def reset_cache(self) -> None:
        # vLLM completes none of the jobs in flight now: their rows stay out of use until
        # on_reset_flushed says the workers have finished with them.
        self.cluster.reset_cache()
        self._collect_events()

    def on_reset_flushed(self) -> None:
        self.cluster.on_reset_flushed()

    def shutdown(self) -> None:
        self.cluster.shutdown()
        self._pool.close()

    # ---- helpers -------------------------------------------------------------------

    @staticmethod
    def _reused(req_context: ReqContext) -> _ReusedKeys:
        state = req_context.get_state(_ReusedKeys)
        if state is None:
            state = _ReusedKeys()
            req_context.set_state(state)
        return state

    def _collect_events(self) -> None:
        events = self.cluster.take_events()
        if not self._enable_events:
            for _ in events:
                pass
            return
        self._events.extend(
            OffloadingEvent(keys=list(event.keys), medium=Medium.CPU, removed=event.removed, locality=Locality.LOCAL)
            for event in events
        )


def _gpu_spec(spec: GPULoadStoreSpec) -> abstract.GPULoadStoreSpec:
    return abstract.GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)


def _kv_caches(kv_caches: CanonicalKVCaches) -> abstract.CanonicalKVCaches:
    return abstract.CanonicalKVCaches(
        [abstract.CanonicalKVCacheTensor(t.tensor, t.page_size_bytes) for t in kv_caches.tensors],
        [
            [abstract.CanonicalKVCacheRef(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
            for refs in kv_caches.group_data_refs
        ],
    )


class DistkvOffloadingWorker(OffloadingWorker):
    """vLLM 0.33's OffloadingWorker over distkv's handlers: GPU <-> this rank's pool slots.

    Jobs finish in submission order per direction; an expedited load is not moved ahead
    of earlier loads.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, pool: HostPool, rank: int, blocks_per_chunk: int):
        self._pool = pool
        self._worker = abstract.OffloadingWorker()
        for src, dst, handler in make_handlers(_kv_caches(kv_caches), pool, rank, blocks_per_chunk):
            self._worker.register_handler(src, dst, handler)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._worker.transfer_async(job_id, (_gpu_spec(src_spec), dst_spec))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._worker.transfer_async(job_id, (src_spec, _gpu_spec(dst_spec)))

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time)
            for r in self._worker.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self._worker.wait(set(job_ids))

    def shutdown(self) -> None:
        self._worker.shutdown()
        self._pool.close()


def publish_identity(cluster: ClusterOffloadingManager, config: OffloadingConfig) -> None:
    """Have the replica's Directory link publish its routing stats under its engine id with
    its heartbeats, for the Serve replica around it (`distkv.serve_llm`): its keys are vLLM's
    chunk keys of the group its prefixes are placed by (`first_chunk`)."""
    from ray.experimental import internal_kv

    from distkv.routing.identity import KV_NAMESPACE, IdentityPublisher
    from distkv.routing.keys import VllmKeys
    from distkv.routing.router import routing_stats

    end, group = first_chunk(config)
    keys = VllmKeys("sha256", config.cache.tokens_per_hash, end // config.cache.tokens_per_hash, group)
    publisher = IdentityPublisher(
        config.engine_id,
        lambda: routing_stats(cluster, keys),
        lambda key, value: internal_kv._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE),
    )
    report = cluster.link.report

    def report_and_publish() -> dict:
        publisher.step()
        return report()

    cluster.link.report = report_and_publish


class RayOffloadingSpec(OffloadingSpec):
    """A vLLM replica of a Ray cluster sharing one KV cache with every replica of its namespace.

    The scheduler's manager joins the cluster (`ray_address`; none starts an embedded
    local Ray) and serves blocks other replicas hold after promoting them into this
    replica's pool. Workers copy between their KV caches and their slots of that pool.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return ReplicaConnectorStats.definitions()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.plan = replica_plan(config, vllm_model_settings(connector_vllm_config()))
        # vLLM's worker index in [0, world_size), the tensor-parallel rank without PP or PCP;
        # vLLM's own CPU spec places a worker's slot of its shared region by it too.
        self.rank = config.parallel.rank
        self._manager: DistkvOffloadingManager | None = None
        self._worker: DistkvOffloadingWorker | None = None

    def get_manager(self) -> DistkvOffloadingManager:
        if self._manager is None:
            plan = self.plan
            pool = HostPool(plan.pool_name, plan.layout)
            try:
                self._check_workers_attached(pool)
                cluster = join_cluster(
                    plan,
                    pool,
                    generations=pool.reserve_generations,
                    request_root=vllm_request_root(first_chunk(self.config)),
                    request_positions=offload_key_positions,
                )
                cluster.expect_step_ends()  # DistkvOffloadingManager.on_schedule_end
            except BaseException:
                pool.close()
                raise
            logger.info(
                "distkv: replica %s in namespace %s, %d pool rows of %d x %d bytes",
                plan.replica_id, plan.namespace, plan.layout.num_rows, plan.layout.num_ranks, plan.layout.slot_bytes,
            )
            self._manager = DistkvOffloadingManager(cluster, pool, self.kv_events_config.enable_kv_cache_events)
            publish_identity(cluster, self.config)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> DistkvOffloadingWorker:
        if self._worker is None:
            pool = HostPool(self.plan.pool_name, self.plan.layout)
            try:
                self._worker = DistkvOffloadingWorker(kv_caches, pool, self.rank, self.blocks_per_chunk)
                pool.mark_attached(self.rank)
            except BaseException:
                pool.close()
                raise
        return self._worker

    def _check_workers_attached(self, pool: HostPool) -> None:
        """Refuse a replica whose workers are not all on this node.

        vLLM 0.33's engine core builds every worker's connector (allocating the KV caches)
        before its scheduler, so by now each worker has marked the pool segment of its
        node. One on another node marked another segment: its slots there would never be
        promoted into, and the first promoted hit would fail its load.
        """
        missing = sorted(set(range(pool.layout.num_ranks)) - pool.attached_ranks())
        if missing:
            parallel = self.config.parallel
            raise ValueError(
                f"distkv: worker rank(s) {missing[:8]} of this replica did not attach to its pool "
                f"on this node (world_size={parallel.world_size}, tp_size={parallel.tp_size}, "
                f"pp_size={parallel.pp_size}): every worker of a replica must run on the node of its "
                "scheduler; tensor or pipeline parallelism across nodes is not supported"
            )


__all__ = [
    "DistkvOffloadingManager",
    "DistkvOffloadingWorker",
    "RayOffloadingSpec",
    "connector_vllm_config",
    "ReplicaConnectorStats",
    "first_chunk",
    "kv_identity",
    "offload_key_positions",
    "prefix_hash_seed",
    "request_root",
    "replica_plan",
    "vllm_request_root",
    "vllm_model_settings",
]
