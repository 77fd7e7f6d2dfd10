"""Replicas on several simulated nodes: cross-node promotion, a stress run, node loss.

One `ray.cluster_utils.Cluster` (a head and three nodes) serves the whole module. The
node-loss test removes a node, so it runs last.
"""

import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
from clusters import simulated_cluster
from ray._private import internal_api
from ray.experimental.internal_kv import _internal_kv_del
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.directory.wire import decode_answer
from distkv.replica.harness import block_keys
from distkv.names import RAY_NAMESPACE, SEGMENT_PREFIX, agent_name, segment_name
from distkv.replica.specs import ClusterOffloadingSpec
from ray_actors.directory import get_or_create_shards, kill_shards
from ray_actors.namespace_secret import secret_key
from ray_actors.replica import ReplicaActor

BLOCK_TOKENS = 16
PAGE_BYTES = 32 << 10
SLOT_BYTES = 2 * PAGE_BYTES  # K and V pages of one block: what a promotion copies per block


@pytest.fixture(scope="module")
def cluster():
    """A head node (the Directory) and three nodes for replicas."""
    with simulated_cluster(extra_nodes=3) as (cluster, nodes):
        yield cluster, nodes


class Replicas:
    """ReplicaActors of one cache namespace, placed on chosen nodes, shut down together."""

    def __init__(
        self, block_tokens: int = BLOCK_TOKENS, page_bytes: int = PAGE_BYTES, runtime_env: dict | None = None, **extra
    ) -> None:
        self.block_tokens = block_tokens
        self.runtime_env = runtime_env
        self.page_bytes = page_bytes
        self.config = {"tenant_salt": uuid.uuid4().hex, **extra}
        self.namespace = ClusterOffloadingSpec.from_layout(
            self.config, gpu_block_sizes=[block_tokens], group_page_bytes=[2 * page_bytes]
        ).namespace
        self.actors: dict[str, ray.actor.ActorHandle] = {}

    def start(self, name: str, node, pool_blocks: int, gpu_blocks: int = 64) -> ray.actor.ActorHandle:
        actor = ReplicaActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False), runtime_env=self.runtime_env
        ).remote(
            name,
            {**self.config, "cpu_bytes_to_use": pool_blocks * 2 * self.page_bytes},
            self.block_tokens,
            self.page_bytes,
            gpu_blocks,
        )
        assert ray.get(actor.node_id.remote(), timeout=60) == node.node_id
        self.actors[name] = actor
        return actor

    def segments(self) -> list[str]:
        """This namespace's pool segments in /dev/shm (every simulated node shares it)."""
        return [n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX) and self.namespace in n]

    def shutdown(self, alive: list[str] | None = None) -> None:
        names = list(self.actors) if alive is None else alive
        ray.get([self.actors[name].shutdown.remote() for name in names], timeout=30)

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        kill_shards(self.namespace)


@pytest.fixture
def replicas():
    made: list[Replicas] = []

    def make(**kw) -> Replicas:
        made.append(Replicas(**kw))
        return made[-1]

    yield make
    for group in made:
        group.close()


def prompt(seed: int, blocks: int, block_tokens: int = BLOCK_TOKENS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * block_tokens)


def wait_visible(actor, keys: list[bytes], holder: str, timeout: float = 10.0) -> None:
    """Until `actor`'s view of the Directory lists `holder` for every key."""
    deadline = time.monotonic() + timeout
    while not all(holder in h for h in ray.get(actor.holders.remote(keys))):
        assert time.monotonic() < deadline, f"{holder}'s blocks never became visible"
        time.sleep(0.02)


def test_prefix_stored_on_one_node_is_loaded_on_two_others(cluster, replicas):
    _, (n1, n2, n3) = cluster
    group = replicas()
    a = group.start("a", n1, pool_blocks=128)
    b = group.start("b", n2, pool_blocks=128)
    c = group.start("c", n3, pool_blocks=128)
    tokens = prompt(1, 32)
    keys = block_keys(tokens, BLOCK_TOKENS)
    assert ray.get(a.serve.remote(tokens))["stored_blocks"] == 32
    wait_visible(b, keys, "a")
    wait_visible(c, keys, "a")

    # node 1's replica is the only holder: every promotion below is served by its NodeAgent
    assert ray.get([b.holders.remote(keys), c.holders.remote(keys)]) == [[["a"]] * 32] * 2
    assert ray.get([b.lookup.remote(keys), c.lookup.remote(keys)]) == [[None] * 32] * 2
    for result in ray.get([b.serve.remote(tokens), c.serve.remote(tokens)]):
        assert result["hit_blocks"] == 32
        assert result["mismatches"] == 0 and result["load_failures"] == 0
    for promoted in ray.get([b.promoted_bytes.remote(), c.promoted_bytes.remote()]):
        assert promoted == {"same_node": 0, "cross_node": 32 * SLOT_BYTES}
    group.shutdown()
    assert not group.segments()


def plasma_objects() -> int:
    return sum(node_stats(node).store_stats.num_local_objects for node in ray.nodes() if node["Alive"])


def node_stats(node: dict):
    return internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=True)


def node_agent_results_held() -> int:
    """References to NodeAgent results (the rows a promotion read) that any worker still holds."""
    agents = {
        ray.get_actor(actor["name"], namespace=RAY_NAMESPACE)._actor_id.binary()
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == RAY_NAMESPACE and actor["name"].startswith(agent_name(""))
    }
    assert agents
    held = 0
    for node in ray.nodes():
        if node["Alive"]:
            for worker in node_stats(node).core_workers_stats:
                # an object id is its task's id (8 bytes, then the id of the actor that ran it) and an index
                held += sum(1 for ref in worker.object_refs if ref.object_id[8:24] in agents)
    return held


def test_stress_four_replicas_two_nodes(cluster, replicas):
    _, (_, n2, n3) = cluster
    block_tokens, page_bytes = 4, 4 << 10
    group = replicas(block_tokens=block_tokens, page_bytes=page_bytes)
    # 4 pools of 48 blocks against 24 shared 8-block prefixes plus fresh tails: constant eviction
    actors = [group.start(f"s{i}", node, pool_blocks=48, gpu_blocks=16) for i, node in enumerate([n2, n2, n3, n3])]
    docs = [prompt(1000 + d, 8, block_tokens) for d in range(24)]
    rng = np.random.default_rng(7)

    def request() -> np.ndarray:
        doc = docs[rng.integers(len(docs))]
        prefix = doc[: rng.integers(1, 9) * block_tokens]
        tail = rng.integers(0, 50_000, rng.integers(0, 3) * block_tokens)
        return np.concatenate([prefix, tail])

    batch, rounds = 250, 20  # 4 x 20 x 250 = 20k requests
    refs = [actor.serve_many.remote([request() for _ in range(batch)]) for _ in range(rounds) for actor in actors]
    results = [r for batch_results in ray.get(refs, timeout=300) for r in batch_results]
    del refs
    assert len(results) == 20_000
    assert sum(r["mismatches"] for r in results) == 0
    assert sum(r["load_failures"] for r in results) == 0
    assert sum(r["stored_blocks"] for r in results) > 10 * 4 * 48  # the pools turned over many times
    hits = sum(r["hit_blocks"] for r in results)
    promoted = ray.get([actor.promoted_bytes.remote() for actor in actors])
    print(f"hit blocks {hits} of {sum(r['blocks'] for r in results)}, promoted {promoted}")
    assert hits > 0
    assert all(p["same_node"] > 0 and p["cross_node"] > 0 for p in promoted)

    group.shutdown()
    assert not group.segments()
    assert node_agent_results_held() == 0
    # The promoted rows are objects the NodeAgents own; each is freed once its reader has
    # dropped it and the owner has heard so, which takes a moment.
    deadline = time.monotonic() + 10
    while plasma_objects():
        assert time.monotonic() < deadline, f"{plasma_objects()} objects left in the object store"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["nixl", "object_store"])
def test_a_prefix_from_another_node_comes_by_the_transport_configured(cluster, replicas, transport):
    pytest.importorskip("nixl")
    _, (n1, n2, _) = cluster
    group = replicas(transport=transport)
    a = group.start("a", n1, pool_blocks=64)
    b = group.start("b", n2, pool_blocks=64)
    tokens = prompt(7, 16)
    keys = block_keys(tokens, BLOCK_TOKENS)
    assert ray.get(a.serve.remote(tokens))["stored_blocks"] == 16
    wait_visible(b, keys, "a")
    result = ray.get(b.serve.remote(tokens))
    assert result["hit_blocks"] == 16  # and each block loaded equals what computing it gives
    assert result["mismatches"] == 0 and result["load_failures"] == 0
    blocks, nbytes, seconds = ray.get(b.transported.remote())[transport]
    assert (blocks, nbytes) == (16, 16 * SLOT_BYTES) and seconds > 0
    assert list(ray.get(b.transported.remote())) == [transport]
    group.shutdown()
    assert not group.segments()


def test_a_replica_that_cannot_open_a_holders_endpoint_reads_it_through_the_object_store(cluster, replicas):
    """`transport` "nixl", and B joins after the namespace's secret was taken out of Ray's
    GCS, as a replica outside the namespace would: B makes another secret, so A's sealed
    endpoint does not open for B. B then reads A's blocks through the object store, every
    one a hit and none wrong, and never through NIXL."""
    pytest.importorskip("nixl")
    _, (n1, n2, _) = cluster
    group = replicas(transport="nixl")
    a = group.start("a", n1, pool_blocks=64)
    _internal_kv_del(secret_key(group.namespace), namespace=RAY_NAMESPACE)
    b = group.start("b", n2, pool_blocks=64)
    tokens = prompt(8, 16)
    keys = block_keys(tokens, BLOCK_TOKENS)
    assert ray.get(a.serve.remote(tokens))["stored_blocks"] == 16
    wait_visible(b, keys, "a")
    result = ray.get(b.serve.remote(tokens))
    assert result["hit_blocks"] == 16
    assert result["mismatches"] == 0 and result["load_failures"] == 0
    assert list(ray.get(b.transported.remote())) == ["object_store"]
    group.shutdown()
    assert not group.segments()


def worker_log(actor) -> str:
    """What the actor's process wrote to stderr, as Ray keeps it in the session's logs."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    (path,) = logs.glob(f"worker-*-{pid}.err")
    return path.read_text()


def test_auto_without_nixl_reads_through_the_object_store_and_says_why_once(cluster, replicas, tmp_path):
    """nixl made unimportable in the replicas' processes (a package of that name that
    refuses to import, first on their path): `auto` starts, reads other nodes through
    the object store, registers no endpoint, and each replica logs why once."""
    _, (n1, n2, _) = cluster
    blocker = tmp_path / "no_nixl" / "nixl"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("nixl made unimportable by the test")\n')
    path = os.pathsep.join(p for p in (str(blocker.parent), os.environ.get("PYTHONPATH")) if p)
    group = replicas(transport="auto", runtime_env={"env_vars": {"PYTHONPATH": path}})
    a = group.start("a", n1, pool_blocks=64)
    b = group.start("b", n2, pool_blocks=64)
    for round in range(3):  # several cross-node promotions each way: still one line each
        tokens = prompt(100 + round, 8)
        keys = block_keys(tokens, BLOCK_TOKENS)
        assert ray.get(a.serve.remote(tokens))["stored_blocks"] == 8
        wait_visible(b, keys, "a")
        result = ray.get(b.serve.remote(tokens))
        assert result["hit_blocks"] == 8 and result["mismatches"] == 0 and result["load_failures"] == 0
    assert list(ray.get(b.transported.remote())) == ["object_store"]
    assert ray.get(b.stats.remote()).promotions.transport_rates == {}  # nothing to measure
    (shard,) = get_or_create_shards(group.namespace, 1)
    assert [r["endpoint"] for r in ray.get(shard.replicas.remote(), timeout=30)] == [False, False]
    why = (
        "distkv: transport 'auto' reads other nodes through the object store only: the nixl transport "
        "needs NIXL (nixl made unimportable by the test): pip install 'ray-distkv[rdma]'"
    )
    for actor in (a, b):
        assert worker_log(actor).count(why) == 1
    group.shutdown()
    assert not group.segments()


def test_node_loss(cluster, replicas):
    ray_cluster, (n1, n2, n3) = cluster
    timeout_s = 2.0
    group = replicas(promotion_timeout_s=timeout_s)
    # pools large enough that nothing is evicted: x's blocks leave only with x
    x = group.start("x", n1, pool_blocks=1024)
    y = group.start("y", n2, pool_blocks=256)
    z = group.start("z", n3, pool_blocks=256)
    w = group.start("w", n3, pool_blocks=256)  # idle until the node is gone, to probe lookups
    docs = [prompt(2000 + d, 8) for d in range(6)]
    ray.get(x.serve_many.remote(docs))
    doc_keys = [k for doc in docs for k in block_keys(doc, BLOCK_TOKENS)]
    late = prompt(3000, 8)
    late_keys = block_keys(late, BLOCK_TOKENS)
    assert ray.get(x.serve.remote(late))["stored_blocks"] == 8
    for actor in (y, z, w):
        wait_visible(actor, doc_keys + late_keys, "x")
    assert ray.get(w.serve.remote(docs[0]))["hit_blocks"] == 8  # w has talked to node 1's NodeAgent

    # mid-workload: x keeps serving, y and z load x's prefixes and compute their own
    rng = np.random.default_rng(11)
    work = {
        name: actor.serve_many.remote(
            [docs[i % 6] if i % 2 else prompt(int(rng.integers(1 << 30)), blocks) for i in range(requests)]
        )
        for name, actor, requests, blocks in (("x", x, 1000, 1), ("y", y, 40, 4), ("z", z, 40, 4))
    }
    time.sleep(0.3)
    ray_cluster.remove_node(n1)
    removed_at = time.monotonic()

    answers = ray.get(w.lookup.remote(late_keys), timeout=10)
    assert True not in answers
    while None in answers:
        assert time.monotonic() - removed_at < timeout_s + 1.5, "lookups of the lost node's keys never ended"
        time.sleep(0.05)
        answers = ray.get(w.lookup.remote(late_keys), timeout=10)
    assert answers == [False] * 8
    print(f"lookups ended in False {time.monotonic() - removed_at:.2f} s after remove_node")

    (shard,) = get_or_create_shards(group.namespace, 1)
    while True:
        holders = decode_answer(ray.get(shard.query.remote(doc_keys + late_keys, namespace=group.namespace), timeout=10), len(doc_keys + late_keys))[0]
        views = ray.get([a.holders.remote(doc_keys + late_keys) for a in (y, z, w)], timeout=10)
        if not any(h[0] == "x" for hs in holders for h in hs) and not any("x" in hs for v in views for hs in v):
            break
        assert time.monotonic() - removed_at < 5.0, "the lost node's holders outlived it by 5 s"
        time.sleep(0.05)
    print(f"holders dropped {time.monotonic() - removed_at:.2f} s after remove_node")

    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(work["x"], timeout=30)
    for name in ("y", "z"):
        results = ray.get(work[name], timeout=60)
        assert len(results) == 40
        assert sum(r["mismatches"] for r in results) == 0
        assert sum(r["load_failures"] for r in results) == 0
    print(f"workloads done {time.monotonic() - removed_at:.2f} s after remove_node")

    # the survivors keep storing and loading, across nodes too
    fresh = prompt(4000, 16)
    assert ray.get(y.serve.remote(fresh), timeout=30)["stored_blocks"] == 16
    wait_visible(z, block_keys(fresh, BLOCK_TOKENS), "y")
    result = ray.get(z.serve.remote(fresh), timeout=30)
    assert result["hit_blocks"] == 16 and result["mismatches"] == 0
    for result in ray.get([w.serve_many.remote(docs + [late]), z.serve_many.remote(docs)], timeout=60):
        assert all(r["mismatches"] == 0 and r["load_failures"] == 0 for r in result)

    group.shutdown(alive=["y", "z", "w"])
    lost = f"/dev/shm/{segment_name(group.namespace, 'x')}"  # x's process died without removing it
    if os.path.exists(lost):
        os.unlink(lost)
    assert not group.segments()

