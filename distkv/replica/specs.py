"""Offloading specs of distkv's own (the seed's) API, and the plan every spec derives.

LocalOffloadingSpec and ClusterOffloadingSpec are what an engine speaking vLLM's seed
kv_offload API builds its offloading from: the stand-in engine of distkv.replica.harness, the
demo and the benchmarks. vLLM 0.33 loads distkv.vllm.RayOffloadingSpec instead; both
derive the replica's plan (ReplicaPlan) from a KVIdentity filled from their configuration.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

from distkv.abstract import CanonicalKVCaches, LoadStoreSpec, OffloadingHandler, OffloadingManager, OffloadingSpec
from distkv.config import KVIdentity, model_settings
from distkv.storage.handlers import make_handlers
from distkv.replica.join import join_cluster
from distkv.replica.local_manager import LocalOffloadingManager
from distkv.replica.plan import ReplicaPlan
from distkv.storage.pool import HostPool

logger = logging.getLogger(__name__)


def engine_id_of(vllm_config: Any) -> str:
    """The replica's `kv_transfer_config.engine_id`; where it has none, a fresh one, written
    back to the config as vLLM's KVTransferConfig makes one: every process of the replica
    handed this config (its scheduler, its workers) meets in the same pool, and replicas
    of other nodes never share an id (a fixed default made them one replica in the
    Directory, each one's holders replacing the other's)."""
    kv_transfer_config = vllm_config.kv_transfer_config
    engine_id = getattr(kv_transfer_config, "engine_id", None)
    if engine_id is None:
        engine_id = kv_transfer_config.engine_id = uuid.uuid4().hex
    return str(engine_id)


def _attr(obj: Any, path: str, default: Any = None) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


class LocalOffloadingSpec(OffloadingSpec):
    """One replica of a seed-API engine offloading to a host pool on its own node; nothing
    is shared.

    The scheduler's manager and every worker's handlers derive the same pool layout and
    segment name from the configuration, so they meet in the same shared memory.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any):
        super().__init__(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        self.num_ranks = _attr(parallel, "tensor_parallel_size", 1) * _attr(parallel, "pipeline_parallel_size", 1)
        self.rank = _attr(parallel, "rank", 0)
        group_bytes = [
            len(group.layer_names) * group.kv_cache_spec.page_size_bytes
            for group in kv_cache_config.kv_cache_groups
        ]
        self.block_bytes_per_rank = self.block_size_factor * max(group_bytes)
        model_config = _attr(vllm_config, "model_config")
        self.plan = ReplicaPlan.derive(
            self.extra_config,
            KVIdentity(
                model=_attr(model_config, "model"),
                dtype=str(_attr(vllm_config, "cache_config.cache_dtype") or _attr(model_config, "dtype")),
                group_block_tokens=self.gpu_block_size,
                blocks_per_chunk=self.block_size_factor,
                parallel=(self.num_ranks, _attr(parallel, "decode_context_parallel_size", 1),
                          _attr(parallel, "prefill_context_parallel_size", 1)),
                group_page_bytes=tuple(group_bytes),
                # every setting the engine's model config offers (its revision, weights dtype,
                # quantization, overrides, ...) but those that change no KV byte
                model_settings=model_settings(vars(model_config) if model_config is not None else {}),
            ),
            self.block_bytes_per_rank,
            self.num_ranks,
            engine_id_of(vllm_config),
        )
        self.config = self.plan.config
        self.layout = self.plan.layout
        self.namespace = self.plan.namespace
        self.replica_id = self.plan.replica_id
        self.pool_name = self.plan.pool_name
        self._pool: HostPool | None = None

    @property
    def pool(self) -> HostPool:
        """This process's mapping of the replica's pool, opened on first use."""
        if self._pool is None:
            self._pool = HostPool(self.pool_name, self.layout)
        return self._pool

    def get_manager(self) -> LocalOffloadingManager:
        return LocalOffloadingManager(
            self.layout.num_rows, policy=self.config.eviction_policy, generations=self.pool.reserve_generations
        )

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        yield from make_handlers(kv_caches, self.pool, self.rank, self.block_size_factor)

    def close(self) -> None:
        """Detach from the pool; the last process of the replica removes it."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class ClusterOffloadingSpec(LocalOffloadingSpec):
    """A replica of a seed-API engine in a Ray cluster, sharing one cache with every
    replica of its namespace.

    The scheduler's manager joins the cluster (`ray_address`; none starts an embedded
    local Ray), makes sure this node's NodeAgent runs, registers the replica with the
    Directory and returns a ClusterOffloadingManager. Workers only need the pool, as with
    the local spec.
    """

    def get_manager(self) -> OffloadingManager:
        return join_cluster(self.plan, self.pool, generations=self.pool.reserve_generations)
