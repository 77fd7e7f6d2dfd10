"""The cluster's dead nodes, as one reader of Ray's node table sees them for every shard.

Each Directory shard drops the holders on nodes Ray reports dead. Reading the node table is
a call to Ray's GCS, and a cluster may run a thousand shards (many namespaces, many shards
each): one watcher per cluster reads it (`ray_actors.node_watcher`) and the shards follow
what it saw (`DeadNodes.since`), each applying a change once (`DirectoryState.drop_nodes`),
not the whole table every second (`follow_dead_nodes`). Plain data and logic, no Ray.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class DeadNodesVersion(NamedTuple):
    """Which reading of the dead nodes a follower has seen: of which watcher (a restarted
    one starts a new `epoch`) and how many changes into it."""

    epoch: str
    changes: int


class DeadNodes:
    """The node ids that Ray's node table reports dead, as of the latest reading, and a
    version that moves on each reading that changed them."""

    def __init__(self) -> None:
        self.dead: frozenset[str] = frozenset()
        self.version = DeadNodesVersion(secrets.token_hex(8), 0)

    def observe(self, nodes: Iterable[Mapping[str, Any]]) -> bool:
        """Take a reading of the table (entries of `ray.nodes()`); whether the dead nodes changed."""
        dead = frozenset(node["NodeID"] for node in nodes if not node["Alive"])
        if dead == self.dead:
            return False
        self.dead = dead
        self.version = self.version._replace(changes=self.version.changes + 1)
        return True

    def since(self, seen: DeadNodesVersion | None) -> tuple[DeadNodesVersion, frozenset[str]] | None:
        """(version, dead node ids) for a follower that has seen `seen` (None: nothing yet),
        or None when it has seen them already."""
        if seen == self.version:
            return None
        return self.version, self.dead


async def follow_dead_nodes(
    watcher: Callable[[], Awaitable[Any]],
    poll: Callable[[Any, DeadNodesVersion | None], Awaitable[tuple[DeadNodesVersion, Iterable[str]]]],
    drop: Callable[[frozenset[str]], None],
    answer_within_s: float,
    retry_s: float,
) -> None:
    """A shard's long poll of the cluster's watcher, forever: `drop` each set of dead nodes
    it reports. `watcher()`: a handle to it (made if there is none); `poll(handle, seen)`:
    its answer to a follower that has seen `seen`. An answer that fails, or does not come
    within `answer_within_s`, is asked again of a fresh handle, `retry_s` times the failures
    in a row later (`answer_within_s` at most): the watcher goes with the process that made
    it, and a call to an actor as it dies may never be answered."""
    handle, seen, failures = None, None, 0
    while True:
        try:
            if handle is None:
                handle = await watcher()
            seen, dead = await asyncio.wait_for(poll(handle, seen), answer_within_s)
        except Exception as e:  # TimeoutError among them
            failures += 1
            if failures == 1:
                logger.warning("directory: following the node watcher failed, asking again: %r", e)
            handle = None
            await asyncio.sleep(min(retry_s * failures, answer_within_s))
            continue
        failures = 0
        drop(frozenset(dead))
