"""Joining a Ray cluster: the composition root of a replica's parts.

`join_cluster` makes the replica's manager: it starts or finds the actors
(`ray_actors`: the Directory's shards, this node's NodeAgent, the namespace's secret) and
hands their handles, as plain interfaces, to the plain classes that never import them:
the DirectoryLink (its shards' clients, its publish path through the node's relay), the
Promoter (its transports), and the ClusterOffloadingManager that joins them, wrapped
as `store_policy` says. The one module of `distkv.replica` that imports `ray_actors`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from distkv.abstract import OffloadingManager
from distkv.config import namespace_inputs
from distkv.directory import views
from distkv.directory.link import DirectoryLink
from distkv.directory.records import ReplicaInfo
from distkv.names import RAY_NAMESPACE
from distkv.observability import metrics
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.replica.dedupe import with_store_policy
from distkv.replica.placement import BlockPlacement, RequestRoot, seed_request_root
from distkv.replica.pulls import RequestPositions, seed_request_positions
from distkv.replica.plan import ReplicaPlan
from distkv.storage.pool import HostPool
from distkv.transfer.endpoint_seal import EndpointSeal
from distkv.transfer.promotion import Promoter
from distkv.transfer.rdma import NixlAgent, RdmaUnavailable
from distkv.transfer.transport import NixlTransport, NodeTransports, ObjectStoreTransport, Transport

logger = logging.getLogger(__name__)

# How long a joining replica waits for the Directory's view before it serves without it:
# long enough for a fresh cluster's shards to start, short enough that a Directory that is
# down does not keep the replica from serving (its view then fills in the background).
DIRECTORY_SYNC_TIMEOUT_S = 10.0


def node_transports(mode: str, pool: HostPool, object_store: Transport, seal: EndpointSeal) -> NodeTransports:
    """The replica's transports for `transport` = mode: NIXL's too unless "object_store",
    reading the holders whose endpoints `seal` opens.

    "nixl" stops the replica at start when NIXL cannot be used, with the cause and the fix;
    "auto" then reads through the object store and logs why, once.
    """
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

    try:
        registered = ray.get(shard.stats.remote(), timeout=DIRECTORY_SYNC_TIMEOUT_S)["replicas"]
    except Exception as e:
        logger.warning("distkv: the Directory did not say how many replicas it has (%s): querying it on misses", e)
        return "query"
    return "query" if registered >= views.AUTO_PUSH_MAX_REPLICAS else "auto"


def join_cluster(
    plan: ReplicaPlan,
    pool: HostPool,
    *,
    generations: Callable[[int], int] | None = None,
    request_root: RequestRoot = seed_request_root,
    request_positions: RequestPositions = seed_request_positions,
    mode: str = "spec",
) -> OffloadingManager:
    """The replica's manager in its Ray cluster: a ClusterOffloadingManager of the plan's
    pool rows (`generations`: how its local manager reserves them, `pool.reserve_generations`
    where the pool's segment counts them), placing blocks by `request_root` (how its
    engine's requests find their placement roots) and reading the runs a request would
    pull by `request_positions` (how they record their keys), wrapped as `store_policy` says.

    Joins the cluster (`ray_address`; none starts an embedded local Ray), makes sure this
    node's NodeAgent runs (a queried link publishes through it), registers the replica with
    the Directory, and waits (up to DIRECTORY_SYNC_TIMEOUT_S) for the Directory's view, so
    that the replica's first lookups already find what other replicas hold. `pool` is the
    scheduler's mapping of the replica's pool: it claims the replica's name until it
    closes, and a ValueError says so if a live replica on this node has it. `mode`: how the
    engine uses the replica ("spec", or "tier": distkv.vllm_tier), as `distkv status`
    shows it.
    """
    if not pool.claim():
        raise ValueError(
            f"replica {plan.replica_id!r}: another live replica on this node already runs under this "
            f"kv_transfer_config.engine_id (its pool {pool.name} is claimed); give each replica its own engine_id"
        )
    import ray

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
        link = _link(plan, transport, seal, node_id, agent, started)
        promoter = Promoter(pool, node_id, link.replica, transport, namespace=plan.namespace)
        started.callback(promoter.close)  # it closes the transport too (closing it again is harmless)
        cluster = ClusterOffloadingManager(
            plan.layout.num_rows,
            link,
            promoter,
            policy=config.eviction_policy,
            generations=generations,
            placement=BlockPlacement(link.num_shards, request_root),
            promotion_timeout_s=config.promotion_timeout_s,
            mode=mode,
            request_positions=request_positions,
        )
        manager = with_store_policy(cluster, config.store_policy)
        # goes to the Directory with the link's heartbeats, for `distkv status`: plain dicts, as the shards keep reports
        link.report = lambda: cluster.stats().to_dict()
        metrics.register(metrics.ReplicaSource(cluster))
        started.pop_all()
        return manager


def _link(
    plan: ReplicaPlan, transport: NodeTransports, seal: EndpointSeal, node_id: str, agent: Any, started: contextlib.ExitStack
) -> DirectoryLink:
    """The replica's DirectoryLink, started (on `started`) and, for DIRECTORY_SYNC_TIMEOUT_S
    at most, waited for: its shards (made if they do not exist) and its relay, `agent`'s."""
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
    return link
