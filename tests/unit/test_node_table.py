"""The cluster's dead nodes as one watcher reads them for every Directory shard, and a
shard dropping the holders on them (issue 31; no Ray)."""

import asyncio

from directory_fakes import key

from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo
from distkv.directory.node_table import DeadNodes, DeadNodesVersion, follow_dead_nodes


def node(node_id: str, alive: bool) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {}}


def test_a_reading_moves_the_version_only_when_the_dead_nodes_change():
    dead = DeadNodes()
    first = dead.since(None)
    assert first is not None and first[1] == frozenset()
    assert not dead.observe([node("n1", True), node("n2", True)])
    assert dead.since(first[0]) is None  # a follower that saw it: nothing new
    assert dead.observe([node("n1", True), node("n2", False)])
    version, nodes = dead.since(first[0])
    assert nodes == {"n2"}
    assert not dead.observe([node("n2", False), node("n1", True)])
    assert dead.since(version) is None
    assert DeadNodes().since(version) is not None  # a restarted watcher's version is another


def test_one_reading_serves_every_shard_and_each_drops_the_holders_on_dead_nodes():
    dead = DeadNodes()
    shards = [DirectoryState() for _ in range(100)]
    for i, state in enumerate(shards):
        for replica, node_id in (("a", "n1"), ("b", "n2"), ("c", "n2")):
            state.register(ReplicaInfo(replica, node_id, f"distkv-ns-{replica}", 8, 1, 4096))
            state.publish(replica, 1, [(key(i), ord(replica) % 8, 1)], [])
    reads = 0

    def read() -> list[dict]:
        nonlocal reads
        reads += 1
        return [node("n1", True), node("n2", False)]

    seen = [None] * len(shards)
    dead.observe(read())  # the watcher's one reading of the table
    for i, state in enumerate(shards):
        news = dead.since(seen[i])
        if news is not None:
            seen[i], nodes = news
            state.drop_nodes(nodes)
    assert reads == 1
    for i, state in enumerate(shards):
        assert state.query([key(i)]) == [(("a", "n1", ord("a") % 8, 1),)]
        assert [r["replica_id"] for r in state.replicas()] == ["a"]
        assert state.stats()["dropped_replicas"] == 2



class Watchers:
    """The cluster's watcher as `follow_dead_nodes` sees it: the handle it makes first
    answers its polls from the first script, in turn, the next one from the next: dead
    node ids, an exception (the call failed) or None (never answered)."""

    def __init__(self, *scripts: list, drops: int) -> None:
        self.scripts = [list(script) for script in scripts]
        self.made = 0
        self.dropped: list[frozenset[str]] = []
        self._drops = drops
        self.done = asyncio.Event()

    async def make(self) -> int:
        self.made += 1
        return self.made - 1

    async def poll(self, handle: int, seen: DeadNodesVersion | None) -> tuple[DeadNodesVersion, list[str]]:
        answer = self.scripts[handle].pop(0)
        if answer is None:
            await asyncio.Event().wait()
        if isinstance(answer, Exception):
            raise answer
        return DeadNodesVersion(f"watcher{handle}", len(self.dropped) + 1), answer

    def drop(self, dead: frozenset[str]) -> None:
        self.dropped.append(dead)
        if len(self.dropped) == self._drops:
            self.done.set()

    def follow(self, answer_within_s: float) -> list[frozenset[str]]:
        async def main() -> None:
            task = asyncio.create_task(follow_dead_nodes(self.make, self.poll, self.drop, answer_within_s, 0.001))
            try:
                await asyncio.wait_for(self.done.wait(), 60)
            finally:
                task.cancel()

        asyncio.run(main())
        return self.dropped


def test_a_poll_never_answered_is_asked_again_of_a_fresh_watcher():
    watchers = Watchers([["n1"], None], [["n1", "n2"]], drops=2)
    assert watchers.follow(answer_within_s=0.2) == [{"n1"}, {"n1", "n2"}]
    assert watchers.made == 2


def test_a_failed_poll_is_asked_again_of_a_fresh_watcher():
    watchers = Watchers([RuntimeError("the watcher's owner died")], [["n3"]], drops=1)
    assert watchers.follow(answer_within_s=60) == [{"n3"}]
    assert watchers.made == 2
