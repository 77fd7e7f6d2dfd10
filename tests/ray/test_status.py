"""`distkv status` against a running two-node cluster: what it shows is what the replicas count.

A `ray.cluster_utils.Cluster` (a head and one more node, as `distkv demo` starts) holds three
replicas of one cache namespace: A in this process on the head, B and C as ReplicaActors on
the other node. B promotes A's blocks across nodes, C promotes B's on its own node.
"""

import argparse
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
from clusters import simulated_cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.observability import status
from distkv.abstract import ReqContext
from distkv.replica.harness import Replica, block_keys
from distkv.names import RAY_NAMESPACE, shard_name
from distkv.replica.specs import ClusterOffloadingSpec
from ray_actors.replica import ReplicaActor

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 16
PAGE_BYTES = 32 << 10
BLOCK_BYTES = 2 * PAGE_BYTES
POOL_BLOCKS = 64
COUNTS = ("lookups", "promotions", "blocks", "pool", "errors")


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(extra_nodes=1) as (cluster, _):
        yield cluster


@pytest.fixture
def sharing(cluster):
    """A on the head (in this process), B and C on the other node, sharing one namespace."""
    config = {"cpu_bytes_to_use": POOL_BLOCKS * BLOCK_BYTES, "tenant_salt": uuid.uuid4().hex}
    a = Replica(
        ClusterOffloadingSpec.from_layout(
            config, gpu_block_sizes=[BLOCK_TOKENS], group_page_bytes=[BLOCK_BYTES], engine_id=f"a{uuid.uuid4().hex[:6]}"
        ),
        num_gpu_blocks=64,
        page_bytes=PAGE_BYTES,
    )
    (other,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" not in n["Resources"]]
    place = NodeAffinitySchedulingStrategy(other, soft=False)
    actors = {
        name: ReplicaActor.options(scheduling_strategy=place).remote(
            f"{name}{uuid.uuid4().hex[:6]}", config, BLOCK_TOKENS, PAGE_BYTES, 64
        )
        for name in ("b", "c")
    }
    try:
        yield a, actors["b"], actors["c"]
    finally:
        ray.get([actor.shutdown.remote() for actor in actors.values()])
        a.shutdown()


def wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


def counts(report: dict) -> dict:
    return {name: report[name] for name in COUNTS}


def test_status_shows_what_the_replicas_count(sharing, cluster, capsys):
    a, b, c = sharing
    tokens = np.random.default_rng(1).integers(0, 50_000, 32 * BLOCK_TOKENS)
    keys = block_keys(tokens, BLOCK_TOKENS)
    assert a.serve(tokens).stored_blocks == 32
    a_id = a.spec.replica_id
    wait_for(lambda: all(a_id in h for h in ray.get(b.holders.remote(keys))), "A's blocks in B's view")
    assert ray.get(b.serve.remote(tokens))["hit_blocks"] == 32  # across nodes, from A
    b_id = ray.get(b.stats.remote()).replica
    wait_for(lambda: all(b_id in h for h in ray.get(c.holders.remote(keys))), "B's blocks in C's view")
    assert ray.get(c.serve.remote(tokens))["hit_blocks"] == 32  # on its node, from B
    too_big = block_keys(np.arange((POOL_BLOCKS + 1) * BLOCK_TOKENS), BLOCK_TOKENS)
    assert a.manager.prepare_store(too_big, ReqContext("too-big")) is None  # an error to show

    own = {s.replica: s.to_dict() for s in [a.manager.stats(), *ray.get([b.stats.remote(), c.stats.remote()])]}
    c_id = next(r for r in own if r not in (a_id, b_id))
    assert own[b_id]["promotions"]["succeeded"] == {"same_node": 0, "cross_node": 32}
    assert own[c_id]["promotions"]["succeeded"] == {"same_node": 32, "cross_node": 0}
    assert own[a_id]["errors"] == {"store_rejected": 1}

    # the replicas' reports reach the Directory with their next heartbeats
    def reported() -> bool:
        shown = {r["replica"]: r for r in status.collect()["replicas"]}
        return all(r in shown and shown[r]["lookups"] and counts(shown[r]) == counts(s) for r, s in own.items())

    wait_for(reported, "the reports matching the replicas' counts")

    out = subprocess.run(
        [sys.executable, "-m", "distkv", "status", "--address", cluster.address, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    replicas = {r["replica"]: r for r in shown["replicas"] if r["replica"] in own}
    assert {r: counts(entry) for r, entry in replicas.items()} == {r: counts(s) for r, s in own.items()}
    assert replicas[a_id]["hit_rate"] == 0.0  # its one lookup missed
    assert replicas[b_id]["hit_rate"] == replicas[c_id]["hit_rate"] == 1.0
    assert all(r["directory_keys"] == 32 for r in replicas.values())

    head = ray.get_runtime_context().get_node_id()
    nodes = {n["node_id"]: n for n in shown["nodes"]}
    assert len(nodes) == 2 and all(n["alive"] and n["node_agent"] for n in nodes.values())
    assert nodes[head]["head"] and nodes[head]["replicas"] == 1
    assert [n["replicas"] for i, n in nodes.items() if i != head] == [2]

    (shard,) = [s for s in shown["directory"] if s["namespace"] == a.spec.namespace]
    assert (shard["shard"], shard["keys"], shard["holders"], shard["replicas"]) == (0, 32, 96, 3)
    # the node the shard actor runs on, as Ray says there (placed on the head with a soft
    # affinity, which Ray may override)
    actor = ray.get_actor(shard_name(a.spec.namespace, 0), namespace=RAY_NAMESPACE)
    assert shard["node_id"] == ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
    errors = [e for e in shown["recent_errors"] if e["replica"] == a_id]
    assert [e["kind"] for e in errors] == ["store_rejected"]

    # the table, from this process (already connected)
    assert status.run(argparse.Namespace(address=cluster.address, json=False)) == 0
    table = capsys.readouterr().out
    assert "2 live node(s)" in table
    for section in ("NODES", "REPLICAS", "DIRECTORY", "RECENT ERRORS"):
        assert section in table
    for replica_id in own:
        assert replica_id in table
    assert "store_rejected" in table and a.spec.namespace in table
