"""NodeAgent: one per node, serving reads of that node's pool rows to other nodes."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv import metrics
from distkv.abstract import OffloadKey
from distkv.directory import ReplicaInfo
from distkv.pool import HostPool, PoolLayout
from distkv.promotion import RowsRead, read_rows

RAY_NAMESPACE = "distkv"


@ray.remote(num_cpus=0, max_concurrency=8)
class NodeAgent:
    """Reads validated rows from a pool on this node and returns them as one object.

    The object is the task's return value: it lives in the object store, owned by the
    requesting replica, until that replica drops it.
    """

    def __init__(self) -> None:
        self._served = metrics.NodeAgentSource(metrics.this_node())
        metrics.register(self._served)

    def read_rows(
        self,
        pool_name: str,
        layout: tuple[int, int, int],
        rows: list[int],
        keys: list[OffloadKey],
        generations: list[int],
    ) -> RowsRead:
        try:
            pool = HostPool(pool_name, PoolLayout(*layout), create=False)
        except (FileNotFoundError, ValueError):
            self._served.record(len(rows), None)
            return np.empty((0,), dtype=np.uint8), [None] * len(rows)
        try:
            data, metas = read_rows(pool, rows, keys, generations)
        finally:
            pool.close()
        self._served.record(len(rows), metas)
        return data, metas

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def agent_name(node_id: str) -> str:
    return f"node-agent-{node_id}"


def start_node_agent(node_id: str) -> ray.actor.ActorHandle:
    """Get or create the NodeAgent of node_id, pinned there, outliving its creator."""
    return NodeAgent.options(
        name=agent_name(node_id),
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote()


class AgentFetch:
    """The Promoter's remote reads: a call to the holder node's NodeAgent."""

    def __init__(self) -> None:
        self._agents: dict[str, ray.actor.ActorHandle] = {}

    def __call__(self, info: ReplicaInfo, rows: list[int], keys: list[OffloadKey], generations: list[int]) -> "Future[RowsRead]":
        agent = self._agents.get(info.node_id)
        if agent is None:
            agent = ray.get_actor(agent_name(info.node_id), namespace=RAY_NAMESPACE)
            self._agents[info.node_id] = agent
        ref = agent.read_rows.remote(
            info.pool_name, (info.num_rows, info.num_ranks, info.slot_bytes), rows, keys, generations
        )
        return ref.future()
