import time
import uuid

import pytest
import ray
from clusters import simulated_cluster

from distkv.directory import DirectoryLink, ReplicaInfo, pack
from distkv.names import segment_name
from ray_actors.directory import get_or_create_shards, head_node_id, kill_shards, shard_clients

MB = 1024**2


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(extra_nodes=0) as (cluster, _):
        yield cluster


def test_holders_on_a_dead_node_are_dropped(cluster):
    worker = cluster.add_node(num_cpus=1, object_store_memory=100 * MB)
    cluster.wait_for_nodes()
    namespace = "test" + uuid.uuid4().hex[:8]
    shards = get_or_create_shards(namespace, 2)
    head = head_node_id()
    watcher_info = ReplicaInfo("watcher", head, segment_name(namespace, "watcher"), 8, 1, 4096)
    watcher = DirectoryLink(namespace, watcher_info, shard_clients(namespace, 2))
    watcher.start()
    try:
        keys = [i.to_bytes(8, "big") * 4 + b"\0\0\0\0" for i in range(16)]
        on_worker = ReplicaInfo("far", worker.node_id, segment_name(namespace, "far"), 16, 1, 4096)
        on_head = ReplicaInfo("near", head, segment_name(namespace, "near"), 16, 1, 4096)
        ray.get([shard.register.remote(on_worker, 1, pack([(k, i, 1) for i, k in enumerate(keys)]), namespace=namespace) for shard in shards])
        ray.get([shard.register.remote(on_head, 1, pack([(k, i, 1) for i, k in enumerate(keys[:4])]), namespace=namespace) for shard in shards])
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
