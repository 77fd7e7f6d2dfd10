"""A replica's plan: what every process of it derives alike from its configuration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distkv.config import DistkvConfig, KVIdentity, cache_namespace
from distkv.names import replica_name, segment_name
from distkv.storage.pool import PoolLayout


@dataclass(frozen=True)
class ReplicaPlan:
    """What every process of one replica derives alike from its configuration.

    The scheduler and each worker compute it on their own; equal inputs give the same
    pool name and layout, so they meet in the same shared memory.
    """

    config: DistkvConfig
    layout: PoolLayout
    namespace: str
    replica_id: str
    pool_name: str
    # what the namespace digests, with the tenant salt
    identity: KVIdentity

    @classmethod
    def derive(
        cls,
        extra_config: Mapping[str, Any],
        kv_identity: KVIdentity,
        block_bytes_per_rank: int,
        num_ranks: int,
        engine_id: str,
    ) -> "ReplicaPlan":
        """kv_identity: what makes KV bytes interchangeable, digested into the namespace
        with the tenant salt; block_bytes_per_rank: bytes one worker stores per offloaded block."""
        config = DistkvConfig.from_extra_config(extra_config)
        layout = PoolLayout.for_capacity(config.cpu_bytes_to_use, num_ranks, block_bytes_per_rank)
        namespace = cache_namespace(kv_identity, config.tenant_salt)
        replica_id = replica_name(engine_id)
        return cls(config, layout, namespace, replica_id, segment_name(namespace, replica_id), kv_identity)
