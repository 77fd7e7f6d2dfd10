"""distkv as a secondary tier of vLLM 0.33's tiered offloading: `DistkvTier`.

vLLM keeps its own CPU tier (the primary tier: its GPU <-> host copies, its eviction) and
any tiers it ships (fs, obj, ...); distkv joins them as one more entry of `secondary_tiers`,
loaded by vLLM's SecondaryTierFactory from `module_path`:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16000000000,
            "secondary_tiers": [
                {"type": "fs", "root_dir": "/mnt/kv"},
                {"type": "DistkvTier", "module_path": "distkv.vllm_tier",
                 "cpu_bytes_to_use": 32000000000, "ray_address": "auto"}]}}'

The keys of the tier's entry are distkv's spec's where they apply (docs/configuration.md):
`cpu_bytes_to_use` there sizes distkv's pool, not vLLM's primary tier. vLLM cascades every
chunk its primary tier stores to each secondary tier, and looks a chunk the primary tier
misses up in the secondary tiers in list order, promoting it from the first that has it.

A chunk in the tier is the bytes vLLM's primary tier holds for it (`primary_chunk_format`).
The tier's cache namespace is derived as distkv's spec's (`distkv.vllm.kv_identity`), with
the chunk's format, and without the parallel layout where vLLM's chunks are canonical.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingMetricMetadata,
        OffloadingSpec,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as e:
    raise ImportError(
        "distkv.vllm_tier needs vLLM 0.33 (vllm.v1.kv_offload.tiering); install it with "
        "pip install 'ray-distkv[vllm]'"
    ) from e

from distkv.config import CONNECTOR_KEYS
from distkv.storage.pool import HostPool
from distkv.replica.plan import ReplicaPlan
from distkv.replica.join import join_cluster
from distkv.replica.tier import ClusterTier
from distkv.vllm import (
    VLLM_LOOKUP_ANSWERS,
    ReplicaConnectorStats,
    connector_vllm_config,
    first_chunk,
    kv_identity,
    offload_key_positions,
    publish_identity,
    vllm_request_root,
    vllm_model_settings,
)

logger = logging.getLogger(__name__)


def primary_chunk_format(config: OffloadingConfig) -> tuple[str, bool]:
    """(name, portable) of the layout of vLLM's primary-tier chunks, from its OffloadingConfig.

    vLLM 0.33 lays a chunk out in one of two ways (vllm/v1/kv_offload/cpu/gpu_worker.py,
    shared_offload_region.py):
    - direct (the default): each worker copies its own GPU pages verbatim into its slot of
      the chunk (`create_next_worker_view`, "one whole-page copy per (block, ref)"), so a
      chunk is every worker's pages in rank order, each in that worker's page encoding of
      its share of the heads: its bytes depend on the parallel layout (a TP=2 chunk is
      [rank 0's heads | rank 1's heads] per tensor, not TP=1's pages). "replicated" when one
      copy stands for every rank (MLA under TP, `replicated_layout`).
    - canonical (`canonical_layout: true`): every worker writes its share into one
      canonical page per tensor (`create_next_canonical_view`, canonical_mapping.py), the
      page of the whole block without parallelism. When vLLM certifies every layer
      parallelism-agnostic (`parallel.is_parallelism_agnostic`, enforced by its
      create_worker), those bytes are the same under any TP size: portable.
    """
    if config.canonical_layout:
        name = f"vllm-primary-canonical-{canonical_format_id(config.kv_cache_layout)}"
        return name, bool(config.parallel.is_parallelism_agnostic)
    return ("vllm-primary-replicated" if config.replicated_layout else "vllm-primary-direct"), False


def tier_plan(
    config: OffloadingConfig, model_settings: tuple[tuple[str, str], ...], settings: Mapping[str, Any], chunk_bytes: int
) -> ReplicaPlan:
    """The tier's replica plan: its pool of one `chunk_bytes` slot per row, sized by the
    entry's `cpu_bytes_to_use`, and its namespace, distkv's spec's (`kv_identity` of the
    model's settings, `distkv.vllm.vllm_model_settings`) with the chunk's format, and
    without the parallel layout where the format is portable."""
    misplaced = sorted(set(settings) & CONNECTOR_KEYS)
    if misplaced:
        raise ValueError(
            f"distkv tier: {misplaced} belong in kv_connector_extra_config, not in the tier's secondary_tiers entry"
        )
    if chunk_bytes <= 0:
        raise ValueError("distkv tier: vLLM's primary tier has no chunks (its KV cache is not allocated yet)")
    chunk_format, portable = primary_chunk_format(config)
    identity = dataclasses.replace(kv_identity(config, model_settings), chunk_format=chunk_format)
    if portable:
        identity = dataclasses.replace(identity, parallel=(), worker_kv_bytes_per_block=None)
    try:
        return ReplicaPlan.derive(settings, identity, chunk_bytes, 1, config.engine_id)
    except ValueError as e:
        raise ValueError(f"distkv tier (its secondary_tiers entry): {e}") from e


class DistkvTier(SecondaryTierManager):
    """distkv's pool and its Ray cluster as a secondary tier of vLLM's tiered offloading.

    Chunks vLLM's primary tier stores are copied into this replica's pool and published to
    the Directory; a chunk the primary tier misses is a HIT here when this pool or another
    replica of the namespace holds it, and its load copies it into the primary chunk vLLM
    reserved, promoted from the holder first where needed, every chunk checked. A chunk
    that does not check out is a failed key of its job (JobResult.successful_keys), which
    vLLM recomputes. See distkv.replica.tier.ClusterTier.
    """

    medium: ClassVar[Medium] = Medium.CPU
    # Most hits come from other replicas' memory: a host hit would hide the fleet's share.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        **settings: Any,
    ) -> None:
        """`settings`: distkv's keys from the tier's entry (docs/configuration.md);
        `enable_kv_events`: emit the tier's stored and removed chunks as KV events (when
        vLLM's are on); `locality`: vLLM's tier filter label, as for its fs tier."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        config = offloading_spec.config
        plan = tier_plan(config, vllm_model_settings(connector_vllm_config()), settings, self.block_size_bytes)
        self._events_on = bool(enable_kv_events) and offloading_spec.kv_events_config.enable_kv_cache_events
        num_chunks = primary_kv_view.shape[0] if primary_kv_view.ndim else 0
        primary = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(num_chunks, self.block_size_bytes)
        pool = HostPool(plan.pool_name, plan.layout)
        try:
            cluster = join_cluster(
                plan,
                pool,
                request_root=vllm_request_root(first_chunk(config)),
                request_positions=offload_key_positions,
                mode="tier",
            )
            try:
                cluster.expect_step_ends()  # on_schedule_end
                self._tier = ClusterTier(cluster, pool, primary)
                publish_identity(cluster, config)  # who it is, for distkv's router (distkv.serve_llm)
            except BaseException:
                cluster.shutdown()
                raise
        except BaseException:
            pool.close()
            raise
        self._stats = ReplicaConnectorStats(cluster)
        logger.info(
            "distkv tier: replica %s in namespace %s, %d pool rows of %d bytes (chunks %s)",
            plan.replica_id, plan.namespace, plan.layout.num_rows, plan.layout.slot_bytes,
            primary_chunk_format(config)[0],
        )

    @property
    def cluster(self):
        """The replica's ClusterOffloadingManager (its pool, the Directory, promotion)."""
        return self._tier.cluster

    @property
    def keys_failed(self) -> int:
        """Keys of load jobs reported failed so far (vLLM recomputed them)."""
        return self._tier.keys_failed

    # ---- vLLM's calls ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return VLLM_LOOKUP_ANSWERS[self._tier.lookup(key, req_context)]

    def submit_store(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        self._tier.submit_store(job.job_id, list(job.keys), job.chunk_ids.tolist(), job.req_context)

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = job_metadata
        self._tier.submit_load(job.job_id, list(job.keys), job.chunk_ids.tolist(), job.req_context)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [
            JobResult(r.job_id, r.success, r.successful_keys, r.seconds, r.nbytes or None)
            for r in self._tier.finished()
        ]

    def has_pending_work(self) -> bool:
        return self._tier.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._tier.take_events()
        if not self._events_on:
            return ()
        return [
            OffloadingEvent(keys=list(e.keys), medium=self.medium, removed=e.removed, locality=self.locality)
            for e in events
        ]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tier.cluster.touch(list(keys), req_context)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._tier.request_started(req_context)  # the Directory's answer its router sent, if any
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._tier.request_finished(req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._tier.end_step()

    def drain_jobs(self) -> None:
        """vLLM 0.33 calls this from reset_cache only (TieringOffloadingManager.reset_cache:
        weights updated, or sleep), so it is the tier's reset too: every job ends (copies
        finish; promotions into vLLM's chunks end, by their deadline at the latest, before
        vLLM resets its primary tier; their loads fail) and the replica moves to a new cache
        epoch, as distkv's spec does on reset_cache, so that no replica promotes the chunks
        of the old weights from it, nor it from them."""
        self._tier.drain_and_reset()

    def shutdown(self) -> None:
        """Stop the copies, leave the cluster and remove the pool's segment; the primary
        tier's memory is let go before vLLM releases it."""
        self._tier.close()

    # ---- metrics -----------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return ReplicaConnectorStats.definitions()

    def get_stats(self) -> OffloadingConnectorStats:
        return self._stats.take()


__all__ = ["DistkvTier", "primary_chunk_format", "tier_plan"]
