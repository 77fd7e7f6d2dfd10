"""NodeAgent: one per node, serving reads of that node's pool rows to other nodes and relaying
the publishes of its queried replicas to the Directory."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.observability import metrics
from distkv.abstract import OffloadKey
from distkv.directory.records import ReplicaInfo
from distkv.names import RAY_NAMESPACE, agent_name, check_pool_namespace
from distkv.storage.readers import PRUNE_INTERVAL_S, PoolReaders, RowsRead, read_rows
from distkv.storage.pool import PoolLayout
from distkv.directory.relay import Handed, PublishRelay, RelayBatch
from distkv.storage.segments import reclaim_stale_segments
from distkv.transfer.holder_nodes import HolderNodes
from ray_actors.directory import find_shards

logger = logging.getLogger(__name__)


# Reads of pool rows the agent serves at once, each on a thread of its own: a read copies
# rows, which releases the GIL.
READ_THREADS = 8
# Calls the agent runs at once: reads waiting for a thread, and the node's replicas'
# relayed publishes, a call per replica while its step's publishes wait for the relay.
MAX_CALLS = 1 << 14
# A relay unused this long serves no live replica of this node: a live replica's link hands
# its relay a publish every few seconds, as each publish is also its heartbeat.
RELAY_IDLE_S = 60.0


# Out of Ray's task events, as the Directory's shards are (ray_actors/directory.py): each
# replica's relayed publishes and each block read is a call.
@ray.remote(num_cpus=0, max_concurrency=MAX_CALLS, enable_task_events=False)
class NodeAgent:
    """The node's side of distkv's traffic with other nodes.

    - `read_rows` serves rows of a pool on this node to other nodes as one object in the
      object store: the rows and their headers, which Ray copies from the pool into this
      node's object store (straight from it for consecutive rows of one rank). The caller
      owns it, so it lives exactly as long as the read that needs it, and it stays in the
      object store if the agent dies meanwhile. The agent keeps the pools it reads mapped
      (PoolReaders). The requester checks every slot it receives against its checksum: a
      row rewritten while it was copied is a miss.
    - `relay` carries the publishes of the node's queried replicas to the Directory, a
      `distkv.directory.relay.PublishRelay` per cache namespace: one call per shard per interval
      for the whole node. A relay unused for longer than `relay_idle_s` (its namespace's
      replicas on this node are gone, or its shard count changed) is closed and
      forgotten; a replica that publishes again later gets a new one.
    - Every PRUNE_INTERVAL_S it closes the pools it no longer needs mapped and reclaims
      the node's stale pool segments (`distkv.storage.segments.reclaim_stale_segments`: those
      of killed replicas, which no live process holds), so that a replica killed with
      SIGKILL gives its shared memory back even if no pool is created on the node after.
    """

    def __init__(self, relay_idle_s: float = RELAY_IDLE_S) -> None:
        self._served = metrics.NodeAgentSource(metrics.this_node())
        self._pools = PoolReaders()
        self._readers = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="distkv-read-rows")
        self._relays: dict[tuple[str, int], PublishRelay] = {}
        self._relay_idle_s = relay_idle_s
        threading.Thread(target=self._upkeep, name="distkv-pool-upkeep", daemon=True).start()
        metrics.register(self._served)
        # Ray runs an async actor's __init__ on its event loop.
        self._relay_closer = asyncio.get_running_loop().create_task(self._close_unused_relays())

    async def read_rows(
        self,
        pool_name: str,
        layout: tuple[int, int, int],
        rows: list[int],
        keys: list[OffloadKey],
        generations: list[int],
        namespace: str,
    ) -> RowsRead:
        """The rows' slots as one (ranks, rows, slot_bytes) array, and each row's metas;
        (None, [None, ...]) if the pool is gone. See `distkv.storage.pool.read_rows`.

        Refuses (ValueError) a pool that is not a distkv segment of cache `namespace`, and
        a layout that is not one.
        """
        check_pool_namespace(pool_name, namespace)
        return await asyncio.get_running_loop().run_in_executor(
            self._readers, self._read_rows, pool_name, layout, rows, keys, generations
        )

    def _read_rows(
        self, pool_name: str, layout: tuple[int, int, int], rows: list[int], keys: list[OffloadKey], generations: list[int]
    ) -> RowsRead:
        with self._pools.reading(pool_name, PoolLayout(*layout)) as pool:
            if pool is None:
                self._served.record(len(rows), None)
                return None, [None] * len(rows)
            data, metas = read_rows(pool, rows, keys, generations)
        self._served.record(len(rows), metas)
        # Ray copies `data` into the object store after this returns. Should the pool be
        # closed meanwhile, `data` still maps its memory: closing leaves it to the GC.
        return data, metas

    async def relay(self, namespace: str, num_shards: int, items: list[Handed]) -> list[tuple[str, bool, float] | str]:
        """A replica's publishes (`distkv.directory.relay.RelayBatch`: one step of its link, to any of
        `namespace`'s `num_shards` shards), carried with the node's others by the namespace's
        `PublishRelay`; per item, the shard's answer, or why it was refused (a str)."""
        relay = self._relays.get((namespace, num_shards))
        if relay is None:
            # looking the shards up asks Ray's GCS: not on the event loop
            shards = await asyncio.get_running_loop().run_in_executor(None, find_shards, namespace, num_shards)
            relay = self._relays.get((namespace, num_shards))
            if relay is None:
                relay = self._relays[(namespace, num_shards)] = PublishRelay(namespace, shards)
                relay.start()
        answers: list[Future | str] = []
        for item in items:
            try:
                answers.append(relay.publish(*item))
            except Exception as e:  # a bad item refuses itself, not the replica's others
                answers.append(f"{type(e).__name__}: {e}")
        results: list[tuple[str, bool, float] | str] = []
        for answer in answers:
            if isinstance(answer, str):
                results.append(answer)
                continue
            try:
                results.append(await asyncio.wrap_future(answer))
            except Exception as e:
                results.append(f"{type(e).__name__}: {e}")
        return results

    async def _close_unused_relays(self) -> None:
        """Close and forget the relays unused for longer than `relay_idle_s`. On the event
        loop, which `relay` holds from its look-up of a relay to its publishes to it: no
        publish is handed to a relay once it was taken out of `_relays`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._relay_idle_s / 2)
            now = time.monotonic()  # the relays' clock
            unused = [key for key, relay in self._relays.items() if relay.unused_s(now) > self._relay_idle_s]
            # every one out of `_relays` before the first await, where `relay` may use one again
            closing = [self._relays.pop(key) for key in unused]
            # close joins the relay's thread: not on the event loop
            await asyncio.gather(*(loop.run_in_executor(None, relay.close) for relay in closing))

    def _upkeep(self) -> None:
        while True:
            time.sleep(PRUNE_INTERVAL_S)
            try:
                self._pools.prune()
                reclaim_stale_segments()
            except Exception:
                logger.warning("distkv: the node's pool upkeep failed", exc_info=True)

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


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
    """The Promoter's remote reads (a `distkv.transfer.transport.RemoteFetch`): a call to the holder
    node's NodeAgent, whose handle it keeps while the Directory lists a holder there."""

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace
        self._agents: dict[str, ray.actor.ActorHandle] = {}
        self._holder_nodes = HolderNodes()

    def __call__(self, info: ReplicaInfo, rows: list[int], keys: list[OffloadKey], generations: list[int]) -> "Future[RowsRead]":
        self._holder_nodes.note(info)
        agent = self._agents.get(info.node_id)
        if agent is None:
            agent = ray.get_actor(agent_name(info.node_id), namespace=RAY_NAMESPACE)
            self._agents[info.node_id] = agent
        return agent.read_rows.remote(
            info.pool_name, (info.num_rows, info.num_ranks, info.slot_bytes), rows, keys, generations,
            namespace=self._namespace,
        ).future()

    def forget_gone(self, replica_info: Callable[[str], ReplicaInfo | None]) -> None:
        """Drop the handles of nodes where the Directory lists none of the holders read."""
        live = self._holder_nodes.live(replica_info)
        for node_id in [node_id for node_id in self._agents if node_id not in live]:
            del self._agents[node_id]


def agent_relay(agent: ray.actor.ActorHandle, namespace: str, num_shards: int) -> RelayBatch:
    """A replica's way to its node's relay, in `agent`: the `relay` a `DirectoryLink` takes."""
    return RelayBatch(lambda items: agent.relay.remote(namespace, num_shards, items).future())
