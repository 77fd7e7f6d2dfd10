"""Offloading specs: what a replica's scheduler and workers build their offloading from."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from distkv.abstract import CanonicalKVCaches, LoadStoreSpec, OffloadingHandler, OffloadingSpec
from distkv.config import DistkvConfig, cache_namespace
from distkv.handlers import make_handlers
from distkv.manager import LocalOffloadingManager
from distkv.pool import HostPool, PoolLayout, segment_name


def _attr(obj: Any, path: str, default: Any = None) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


class LocalOffloadingSpec(OffloadingSpec):
    """One replica offloading to a host pool on its own node; nothing is shared.

    The scheduler's manager and every worker's handlers derive the same pool layout and
    segment name from the configuration, so they meet in the same shared memory.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any):
        super().__init__(vllm_config, kv_cache_config)
        self.config = DistkvConfig.from_extra_config(self.extra_config)
        parallel = vllm_config.parallel_config
        self.num_ranks = _attr(parallel, "tensor_parallel_size", 1) * _attr(parallel, "pipeline_parallel_size", 1)
        self.rank = _attr(parallel, "rank", 0)
        group_bytes = [
            len(group.layer_names) * group.kv_cache_spec.page_size_bytes
            for group in kv_cache_config.kv_cache_groups
        ]
        self.block_bytes_per_rank = self.block_size_factor * max(group_bytes)
        self.layout = PoolLayout.for_capacity(
            self.config.cpu_bytes_to_use, self.num_ranks, self.block_bytes_per_rank
        )
        self.namespace = cache_namespace(
            {
                "model": _attr(vllm_config, "model_config.model"),
                "dtype": str(_attr(vllm_config, "cache_config.cache_dtype") or _attr(vllm_config, "model_config.dtype")),
                "group_block_tokens": self.gpu_block_size,
                "group_page_bytes": group_bytes,
                "block_size_factor": self.block_size_factor,
                "parallel": [self.num_ranks, _attr(parallel, "decode_context_parallel_size", 1),
                             _attr(parallel, "prefill_context_parallel_size", 1)],
            },
            self.config.tenant_salt,
        )
        engine_id = str(_attr(vllm_config, "kv_transfer_config.engine_id", "engine"))
        self.replica_id = re.sub(r"[^A-Za-z0-9_.]", "_", engine_id)
        self.pool_name = segment_name(self.namespace, self.replica_id)
        self._pool: HostPool | None = None

    @property
    def pool(self) -> HostPool:
        """This process's mapping of the replica's pool, opened on first use."""
        if self._pool is None:
            self._pool = HostPool(self.pool_name, self.layout)
        return self._pool

    def get_manager(self) -> LocalOffloadingManager:
        return LocalOffloadingManager(self.layout.num_rows, policy=self.config.eviction_policy)

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        yield from make_handlers(kv_caches, self.pool, self.rank, self.block_size_factor)

    def close(self) -> None:
        """Detach from the pool; the last process of the replica removes it."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class RayOffloadingSpec(LocalOffloadingSpec):
    """A replica of a Ray cluster, sharing one cache with every replica of its namespace.

    The scheduler's manager joins the cluster (`ray_address`; none starts an embedded
    local Ray), makes sure this node's NodeAgent runs, registers the replica with the
    Directory and returns a ClusterOffloadingManager. Workers only need the pool, as with
    the local spec.
    """

    def get_manager(self) -> "ClusterOffloadingManager":
        import ray

        from distkv.cluster import ClusterOffloadingManager
        from distkv.directory import DirectoryLink, ReplicaInfo
        from distkv.promotion import Promoter
        from ray_actors.node_agent import RAY_NAMESPACE, AgentFetch, start_node_agent

        if not ray.is_initialized():
            ray.init(address=self.config.ray_address, namespace=RAY_NAMESPACE)
        node_id = ray.get_runtime_context().get_node_id()
        ray.get(start_node_agent(node_id).node_id.remote())
        info = ReplicaInfo(
            self.replica_id, node_id, self.pool_name, self.layout.num_rows, self.layout.num_ranks, self.layout.slot_bytes
        )
        link = DirectoryLink(self.namespace, info, self.config.directory_shards)
        link.start()
        promoter = Promoter(self.pool, node_id, link.replica, AgentFetch())
        return ClusterOffloadingManager(
            super().get_manager(),
            link,
            promoter,
            store_policy=self.config.store_policy,
            promotion_timeout_s=self.config.promotion_timeout_s,
        )
