"""The Directory on several simulated nodes: holders on a dead node, shards on a dead node.

The tests share one cluster: each adds the nodes it needs and removes them.
"""

import time
import uuid

import pytest
import ray
from clusters import simulated_cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.directory.link import DirectoryLink
from distkv.directory.records import ReplicaInfo
from distkv.directory.wire import encode_stored
from distkv.directory.placement import shard_of
from distkv.names import segment_name
from ray_actors.directory import get_or_create_shards, head_node_id, kill_shards, shard_clients, shard_nodes

MB = 1024**2


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(extra_nodes=0) as (cluster, _):
        yield cluster


def test_holders_on_a_dead_node_are_dropped(cluster):
    namespace = "test" + uuid.uuid4().hex[:8]
    shards = get_or_create_shards(namespace, 2)  # the head is the only node: both go there
    worker = cluster.add_node(num_cpus=1, object_store_memory=100 * MB)
    cluster.wait_for_nodes()
    head = head_node_id()
    watcher_info = ReplicaInfo("watcher", head, segment_name(namespace, "watcher"), 8, 1, 4096)
    watcher = DirectoryLink(namespace, watcher_info, shard_clients(namespace, 2))
    watcher.start()
    try:
        keys = [i.to_bytes(8, "big") * 4 + b"\0\0\0\0" for i in range(16)]
        on_worker = ReplicaInfo("far", worker.node_id, segment_name(namespace, "far"), 16, 1, 4096)
        on_head = ReplicaInfo("near", head, segment_name(namespace, "near"), 16, 1, 4096)
        ray.get([shard.register.remote(on_worker, 1, encode_stored([(k, i, 1) for i, k in enumerate(keys)]), namespace=namespace) for shard in shards])
        ray.get([shard.register.remote(on_head, 1, encode_stored([(k, i, 1) for i, k in enumerate(keys[:4])]), namespace=namespace) for shard in shards])
        watcher.stored([(k, i, 1) for i, k in enumerate(keys[:4])])
        deadline = time.monotonic() + 10
        while not all(len(holders) == 3 for holders in watcher.query(keys[:4])):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert all(s["node_id"] == head for s in ray.get([shard.stats.remote() for shard in shards]))

        cluster.remove_node(worker)
        removed_at = time.monotonic()
        while any(h.replica_id == "far" for holders in watcher.query(keys) for h in holders):
            assert time.monotonic() - removed_at < 5.0, "holders on the dead node outlived it by 5 s"
            time.sleep(0.05)
        assert [sorted(h.replica_id for h in holders) for holders in watcher.query(keys[:4])] == [["near", "watcher"]] * 4
        print(f"dropped {time.monotonic() - removed_at:.2f} s after remove_node")
    finally:
        watcher.close()
        kill_shards(namespace)


def test_shards_go_round_robin_over_the_live_nodes_the_head_first():
    def node(node_id, alive=True, head=False):
        return {"NodeID": node_id, "Alive": alive, "Resources": {"node:__internal_head__": 1.0} if head else {}}

    nodes = [node("c"), node("b", alive=False), node("z", head=True), node("a")]
    assert shard_nodes(nodes, 1) == ["z"]
    assert shard_nodes(nodes, 5) == ["z", "a", "c", "z", "a"]
    with pytest.raises(RuntimeError, match="no live node"):
        shard_nodes([node("b", alive=False)], 2)


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Poll `condition` until it holds; the seconds it took. Fails after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@ray.remote(num_cpus=0)
class Probe:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def wait_until_soft_affinity_lands(node_ids: list[str], timeout_s: float) -> None:
    """Wait until an actor placed as the shards are (a soft affinity, no CPU) lands on each of
    `node_ids`. Ray's scheduler knows a node some time after its table says it is alive, and
    until then a soft affinity to it falls back to the head: all three shards went there twice,
    once after a task pinned to each new node had run there."""

    def landed() -> bool:
        probes = [Probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=True)).remote() for n in node_ids]
        try:
            return ray.get([p.node_id.remote() for p in probes], timeout=60) == node_ids
        finally:
            for p in probes:
                ray.kill(p)

    wait_until(landed, timeout_s, "actors with a soft affinity land on the new nodes")


def test_a_shard_whose_node_died_restarts_elsewhere_and_is_refilled(cluster):
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=100 * MB) for _ in range(2)]
    cluster.wait_for_nodes()
    wait_until_soft_affinity_lands([n.node_id for n in nodes], 120)
    num_shards = 3
    head = head_node_id()
    # placed round-robin with a soft affinity, which Ray may override (it put two of three
    # on one node in some runs here, all three on the head in two fresh clones after the
    # probes had landed): the test needs one shard off the head, and makes the shards again
    # until it has one
    for _ in range(5):
        namespace = "test" + uuid.uuid4().hex[:8]
        shards = get_or_create_shards(namespace, num_shards)
        placed = [s["node_id"] for s in ray.get([shard.stats.remote() for shard in shards], timeout=60)]
        if any(p != head for p in placed):
            break
        kill_shards(namespace)
        time.sleep(2)
    assert any(p != head for p in placed), f"shards placed on {placed}"
    links = {
        name: DirectoryLink(
            namespace,
            ReplicaInfo(name, head, segment_name(namespace, name), 64, 1, 4096),
            shard_clients(namespace, num_shards),
        )
        for name in ("a", "b")
    }
    for link in links.values():
        link.start()
    a, b = links["a"], links["b"]
    try:
        keys = [i.to_bytes(8, "big") * 4 + b"\0\0\0\0" for i in range(48)]
        assert {shard_of(k, num_shards) for k in keys} == set(range(num_shards))
        a.stored([(k, i, 1) for i, k in enumerate(keys)])
        wait_until(lambda: all(b.holders(k) for k in keys), 10, "b sees a's blocks")

        lost_index = next(i for i, p in enumerate(placed) if p != head)
        lost = shards[lost_index]
        lost_node = next(n for n in nodes if n.node_id == placed[lost_index])
        old_epoch = ray.get(lost.stats.remote(), timeout=10)["epoch"]
        cluster.remove_node(lost_node)
        removed_at = time.monotonic()

        def restarted() -> bool:
            try:
                stats = ray.get(lost.stats.remote(), timeout=2)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False
            return stats["epoch"] != old_epoch

        wait_until(restarted, 30, "the lost node's shard restarts")
        stats = ray.get(lost.stats.remote(), timeout=10)
        assert stats["node_id"] != lost_node.node_id
        assert stats["node_id"] in {head} | {n.node_id for n in nodes if n is not lost_node}
        # the replicas re-publish: the restarted shard itself, and b's view, hold a's blocks
        # again (b's view alone is no proof: until its poll's retry reaches the restarted
        # shard, it still holds what the lost one had sent)
        took = wait_until(
            lambda: all(hs for hs in b.query(keys))
            and all(b.holders(k) and b.holders(k)[0].replica_id == "a" for k in keys),
            10,
            "hits return",
        )
        print(f"hits returned {time.monotonic() - removed_at:.2f} s after remove_node ({took:.2f} s after the restart)")
        assert [sorted(h.replica_id for h in hs) for hs in b.query(keys)] == [["a"]] * len(keys)
        assert [sorted(h.replica_id for h in hs) for hs in a.query(keys)] == [["a"]] * len(keys)
        # every shard is found by name again, the restarted one too, and still takes new blocks
        again = get_or_create_shards(namespace, num_shards)
        assert [s._actor_id for s in again] == [s._actor_id for s in shards]
        fresh = [(i + 100).to_bytes(8, "big") * 4 + b"\0\0\0\0" for i in range(12)]
        a.stored([(k, i, 2) for i, k in enumerate(fresh)])
        wait_until(lambda: all(b.holders(k) for k in fresh), 10, "b sees a's new blocks")
        # no replica crashed: both links still run, and the other shards never restarted
        assert all(link._thread.is_alive() for link in links.values())
    finally:
        for link in links.values():
            link.close()
        kill_shards(namespace)
        for node in nodes:
            if node is not lost_node:
                cluster.remove_node(node)
