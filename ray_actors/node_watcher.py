"""One `NodeWatcher` per cluster: reads Ray's node table for every Directory shard.

Its logic is `distkv.directory.node_table.DeadNodes`. It is a named actor in distkv's Ray namespace
(`NODE_WATCHER_NAME`), made by the first shard that asks for it (`node_watcher`) and owned
by that shard's process, not detached: when that process goes, so does the watcher, and the
next shard to ask makes another, so that none outlives the shards it serves. Each shard
long-polls `dead_nodes` (`ray_actors.directory.DirectoryShard`).
"""

from __future__ import annotations

import asyncio
import logging

import ray

from distkv.names import NODE_WATCHER_NAME, RAY_NAMESPACE
from distkv.directory.node_table import DeadNodes, DeadNodesVersion

logger = logging.getLogger(__name__)

# How often the watcher reads Ray's node table: a dead node's holders go within about this.
READ_EVERY_S = 1.0


@ray.remote(enable_task_events=False)
class NodeWatcher:
    """Reads Ray's node table every READ_EVERY_S and answers the shards' polls of it."""

    def __init__(self) -> None:
        self._dead = DeadNodes()
        self._changed = asyncio.Event()  # set (and replaced) when the dead nodes change
        self._reads = 0
        self._reading = asyncio.get_running_loop().create_task(self._read())

    async def dead_nodes(self, seen: DeadNodesVersion | None, timeout_s: float) -> tuple[DeadNodesVersion, list[str]]:
        """(version, the dead node ids) once they are other than at `seen`, or after `timeout_s`."""
        if self._dead.since(seen) is None:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self._dead.version, sorted(self._dead.dead)

    async def reads(self) -> int:
        """How many times it has read the node table."""
        return self._reads

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                nodes = await loop.run_in_executor(None, ray.nodes)
            except Exception as e:
                logger.warning("node watcher: reading Ray's node table failed: %s", e)
            else:
                self._reads += 1
                if self._dead.observe(nodes):
                    changed, self._changed = self._changed, asyncio.Event()
                    changed.set()
            await asyncio.sleep(READ_EVERY_S)


def node_watcher() -> ray.actor.ActorHandle:
    """The cluster's NodeWatcher, made (owned by the caller) if there is none. Asks Ray's GCS."""
    return NodeWatcher.options(
        name=NODE_WATCHER_NAME, namespace=RAY_NAMESPACE, get_if_exists=True, num_cpus=0, max_restarts=-1
    ).remote()
