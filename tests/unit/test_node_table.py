"""The cluster's dead nodes as one watcher reads them for every Directory shard, and a
shard dropping the holders on them (issue 31; no Ray)."""

from directory_fakes import key

from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo
from distkv.directory.node_table import DeadNodes


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
