"""Offloading specs of distkv's own (the seed's) API, and the plan every spec derives.

LocalOffloadingSpec and ClusterOffloadingSpec are what an engine speaking vLLM's seed
kv_offload API builds its offloading from: the stand-in engine of distkv.replica.harness, the
demo and the benchmarks. vLLM 0.33 loads distkv.vllm.RayOffloadingSpec instead; both
derive the replica's plan (ReplicaPlan) from a KVIdentity filled from their configuration.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distkv.abstract import CanonicalKVCaches, LoadStoreSpec, OffloadingHandler, OffloadingSpec
from distkv.config import DistkvConfig, KVIdentity, cache_namespace, model_settings, namespace_inputs
from distkv.storage.handlers import make_handlers
from distkv.replica.local_manager import LocalOffloadingManager
from distkv.names import replica_name, segment_name
from distkv.storage.pool import HostPool, PoolLayout

if TYPE_CHECKING:
    from distkv.replica.cluster_manager import ClusterOffloadingManager
    from distkv.transfer.endpoint_seal import EndpointSeal
    from distkv.transfer.transport import NodeTransports, Transport

logger = logging.getLogger(__name__)

# How long a joining replica waits for the Directory's view before it serves without it:
# long enough for a fresh cluster's shards to start, short enough that a Directory that is
# down does not keep the replica from serving (its view then fills in the background).
DIRECTORY_SYNC_TIMEOUT_S = 10.0


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


def node_transports(mode: str, pool: HostPool, object_store: "Transport", seal: "EndpointSeal") -> "NodeTransports":
    """The replica's transports for `transport` = mode: NIXL's too unless "object_store",
    reading the holders whose endpoints `seal` opens.

    "nixl" stops the replica at start when NIXL cannot be used, with the cause and the fix;
    "auto" then reads through the object store and logs why, once.
    """
    from distkv.transfer.rdma import NixlAgent, RdmaUnavailable
    from distkv.transfer.transport import NixlTransport, NodeTransports

    nixl = None
    if mode != "object_store":
        try:
            nixl = NixlTransport(pool, NixlAgent(), seal)
        except RdmaUnavailable as e:
            if mode == "nixl":
                raise ValueError(f"kv_connector_extra_config 'transport'='nixl': {e}") from e
            logger.warning("distkv: transport 'auto' reads other nodes through the object store only: %s", e)
    return NodeTransports(object_store, nixl, mode)


def joining_view(view: str, shard: Any) -> str:
    """The `view` a joining replica's DirectoryLink starts with, for `directory_view` = view.

    "auto" queries at once when the namespace has AUTO_PUSH_MAX_REPLICAS replicas registered
    already, so that it would have more with this one (`shard` is one of its shard actors:
    every replica registers with each), or when the Directory does not say: following would start with a snapshot of every
    block, the cost that querying avoids at scale, while a small namespace that queries only
    waits one round trip on a miss. Else it follows, and switches to querying for good once
    its view shows the namespace grew past the bound.
    """
    if view != "auto":
        return view
    import ray

    from distkv.directory.link import AUTO_PUSH_MAX_REPLICAS

    try:
        registered = ray.get(shard.stats.remote(), timeout=DIRECTORY_SYNC_TIMEOUT_S)["replicas"]
    except Exception as e:
        logger.warning("distkv: the Directory did not say how many replicas it has (%s): querying it on misses", e)
        return "query"
    return "query" if registered >= AUTO_PUSH_MAX_REPLICAS else "auto"


def join_cluster(
    plan: ReplicaPlan, pool: HostPool, local: LocalOffloadingManager, mode: str = "spec"
) -> "ClusterOffloadingManager":
    """The replica's manager in its Ray cluster.

    Joins the cluster (`ray_address`; none starts an embedded local Ray), makes sure this
    node's NodeAgent runs (a queried link publishes through it), registers the replica with
    the Directory, waits (up to DIRECTORY_SYNC_TIMEOUT_S) for the Directory's view, so that
    the replica's first lookups already find what other replicas hold, and wraps `local`.
    `pool` is the scheduler's mapping of the replica's pool: it claims the replica's name
    until it closes, and a ValueError says so if a live replica on this node has it.
    `mode`: how the engine uses the replica ("spec", or "tier": distkv.vllm_tier), as
    `distkv status` shows it.

    This is where the library meets Ray's actors (`ray_actors`): it creates them and
    hands their handles to the plain classes, which never import them.
    """
    if not pool.claim():
        raise ValueError(
            f"replica {plan.replica_id!r}: another live replica on this node already runs under this "
            f"kv_transfer_config.engine_id (its pool {pool.name} is claimed); give each replica its own engine_id"
        )
    import ray

    from distkv.transfer.endpoint_seal import EndpointSeal
    from distkv.names import RAY_NAMESPACE
    from distkv.transfer.transport import ObjectStoreTransport
    from ray_actors.namespace_secret import namespace_secret
    from ray_actors.node_agent import AgentFetch, start_node_agent

    config = plan.config
    if not ray.is_initialized():
        ray.init(address=config.ray_address, namespace=RAY_NAMESPACE)
    logger.info(
        "distkv: replica %s joins cache namespace %s of %s",
        plan.replica_id, plan.namespace, namespace_inputs(plan.identity, config.tenant_salt),
    )
    seal = EndpointSeal(plan.namespace, namespace_secret(plan.namespace), config.tenant_salt)
    transport = node_transports(config.transport, pool, ObjectStoreTransport(pool, AgentFetch(plan.namespace)), seal)
    # what is started, closed (the last first) should a later step fail: else the NIXL
    # agent and the threads of the transports, the link and the Promoter outlive the failure
    with contextlib.ExitStack() as started:
        started.callback(transport.close)
        node_id = ray.get_runtime_context().get_node_id()
        agent = start_node_agent(node_id)
        ray.get(agent.node_id.remote())
        manager = _join(plan, pool, local, transport, seal, node_id, agent, started, mode)
        started.pop_all()
        return manager


def _join(
    plan: ReplicaPlan,
    pool: HostPool,
    local: LocalOffloadingManager,
    transport: "NodeTransports",
    seal: "EndpointSeal",
    node_id: str,
    agent: Any,
    started: contextlib.ExitStack,
    mode: str,
) -> "ClusterOffloadingManager":
    """join_cluster's steps once this node's agent runs: what they start goes on `started`."""
    from distkv.observability import metrics
    from distkv.replica.cluster_manager import ClusterOffloadingManager
    from distkv.directory.link import DirectoryLink, ReplicaInfo
    from distkv.transfer.promotion import Promoter
    from ray_actors.directory import shard_clients
    from ray_actors.node_agent import agent_relay

    config = plan.config
    layout = plan.layout
    info = ReplicaInfo(
        plan.replica_id,
        node_id,
        plan.pool_name,
        layout.num_rows,
        layout.num_ranks,
        layout.slot_bytes,
        endpoint=None if transport.endpoint is None else seal.seal(plan.pool_name, transport.endpoint),
    )
    shards = shard_clients(plan.namespace, config.directory_shards)
    relay = agent_relay(agent, plan.namespace, len(shards))
    link = DirectoryLink(plan.namespace, info, shards, joining_view(config.directory_view, shards[0].actor), relay)
    link.start()
    started.callback(link.close)
    if not link.wait_synced(DIRECTORY_SYNC_TIMEOUT_S):
        logger.warning(
            "distkv: replica %s starts without the Directory's view (not every shard answered within %s s); "
            "until it arrives, blocks other replicas hold are misses",
            plan.replica_id, DIRECTORY_SYNC_TIMEOUT_S,
        )
    promoter = Promoter(pool, node_id, link.replica, transport, namespace=plan.namespace)
    started.callback(promoter.close)  # it closes the transport too (closing it again is harmless)
    manager = ClusterOffloadingManager(
        local,
        link,
        promoter,
        store_policy=config.store_policy,
        promotion_timeout_s=config.promotion_timeout_s,
        mode=mode,
    )
    # goes to the Directory with the link's heartbeats, for `distkv status`: plain dicts, as the shards keep reports
    link.report = lambda: manager.stats().to_dict()
    metrics.register(metrics.ReplicaSource(manager))
    return manager


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

    def get_manager(self) -> "ClusterOffloadingManager":
        return join_cluster(self.plan, self.pool, super().get_manager())
