"""Two vLLM replicas in two processes on two simulated nodes share a prefix cache.

As test_two_replicas.py, with each engine (the real Scheduler and vLLM's worker-side
connector) in a Ray actor of its own, on its own node of a `ray.cluster_utils.Cluster`:
each process resolves vLLM's hash seed and module state itself, and B promotes A's blocks
over the cross-node path (A's NodeAgent, the object store). Both run with an explicit
PYTHONHASHSEED, as vLLM hands it to its workers.
"""

import os
import time
import uuid

import numpy as np
import pytest
import ray

pytest.importorskip("vllm.v1.kv_offload.base")

from clusters import simulated_cluster  # noqa: E402
from engine_actor import EngineActor  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from replica_engine import DISTKV_EXTRA, GPU_BLOCK_TOKENS, vllm_config  # noqa: E402

from distkv.vllm import replica_plan, vllm_model_settings  # noqa: E402
from ray_actors.directory import kill_shards  # noqa: E402

PREFIX_TOKENS = 4096
CHUNK_TOKENS = 64  # extra_config block_size: 4 GPU blocks per offloaded block
HASH_SEED = "7"
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def engines(model_dir):
    """Replicas A and B of one namespace, each an EngineActor on a node of its own (A on the
    head node, beside the Directory)."""
    with simulated_cluster(extra_nodes=1) as (cluster, added):
        nodes = [cluster.head_node, *added]
        # How long a promotion takes on a loaded machine is not under test: a timed out one
        # would turn B's hits into misses.
        config = {
            **DISTKV_EXTRA,
            "block_size": CHUNK_TOKENS,
            "cpu_bytes_to_use": 8 << 20,
            "tenant_salt": uuid.uuid4().hex,
            "promotion_timeout_s": 60.0,
            "transport": "nixl",
        }
        env = {"PYTHONHASHSEED": HASH_SEED, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
        actors = [
            EngineActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                runtime_env={"env_vars": env},
            ).remote(model_dir, config)
            for node in nodes
        ]
        try:
            assert ray.get([a.node_id.remote() for a in actors], timeout=300) == [n.node_id for n in nodes]
            yield actors
        finally:
            namespaces = set(ray.get([a.namespace.remote() for a in actors], timeout=60))
            ray.get([a.shutdown.remote() for a in actors], timeout=60)
            for namespace in namespaces:
                kill_shards(namespace)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 50_000, n).tolist()


def test_replica_b_on_another_node_loads_the_prefix_replica_a_computed(engines):
    a, b = engines
    assert ray.get(a.namespace.remote()) == ray.get(b.namespace.remote())
    prefix = tokens(0, PREFIX_TOKENS)
    served = ray.get(a.serve.remote({f"a{i}": prefix + tokens(100 + i, 100) for i in range(2)}), timeout=120)
    for _, (_, exact) in served.values():
        assert exact  # whatever A reused (its own GPU prefix cache or offloaded blocks) was right

    stored = ray.get(a.stored_keys.remote())
    assert len(stored) >= PREFIX_TOKENS // CHUNK_TOKENS
    # How soon A's stores reach B's view is not under test: the bound only keeps a broken
    # link from hanging the suite.
    deadline = time.monotonic() + 60
    while not ray.get(b.sees.remote(stored)):
        assert time.monotonic() < deadline, "A's blocks never showed in B's Directory view"
        time.sleep(0.05)

    (answers, (loaded, exact)), = ray.get(b.serve.remote({"b0": prefix + tokens(200, 100)}), timeout=120).values()
    assert answers[0] is None, "B should retry while the blocks are promoted"
    assert answers[-1] >= PREFIX_TOKENS - GPU_BLOCK_TOKENS
    assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS
    assert exact, "B loaded KV bytes that differ from what A computed"
    same_node, cross_node = ray.get(b.promoted_bytes.remote())
    assert same_node == 0 and cross_node > 0  # the blocks came from A's node
    assert ray.get(b.transported.remote())["nixl"][1] == cross_node  # read one-sidedly, every byte


def test_a_worker_process_derives_the_plan_of_its_scheduler(engines, model_dir, monkeypatch):
    """The worker side of A, in A's process, and a scheduler here, given the same
    OffloadingConfig, model and PYTHONHASHSEED, meet in the same pool; another seed would not."""
    config, worker_plan = ray.get(engines[0].worker_plan.remote())
    settings = vllm_model_settings(vllm_config(model_dir, dict(config.extra_config)))
    monkeypatch.setenv("PYTHONHASHSEED", HASH_SEED)
    assert replica_plan(config, settings) == worker_plan
    monkeypatch.setenv("PYTHONHASHSEED", HASH_SEED + "0")
    assert replica_plan(config, settings).namespace != worker_plan.namespace
