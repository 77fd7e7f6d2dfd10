"""Two vLLM replicas with distkv as a secondary tier, in two processes on two simulated nodes.

As test_two_processes.py, with vLLM's tiered offloading (its CPU primary tier, its tiering
manager, the host-copy stand-in for its CUDA worker: host_tiering.py) and distkv's tier in
`secondary_tiers`: B serves A's prefix from the cluster, through each transport, loaded
bit-exactly into its primary tier and from there into its "GPU" blocks. Then A is killed
while B's view still names it as the holder of a second prefix: B's loads fail, vLLM
recomputes, and no wrong byte reaches B's KV cache.
"""

import os
import time
import uuid

import numpy as np
import pytest
import ray

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from clusters import simulated_cluster  # noqa: E402
from engine_actor import EngineActor  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from replica_engine import DISTKV_TIER, GPU_BLOCK_TOKENS, TIERING_EXTRA  # noqa: E402

from ray_actors.directory import kill_shards  # noqa: E402

PREFIX_TOKENS = 4096
CHUNK_TOKENS = 64
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def nodes():
    with simulated_cluster(extra_nodes=1) as (cluster, added):
        yield [cluster.head_node, *added]


@pytest.fixture(scope="module", params=["nixl", "object_store"])
def engines(request, nodes):
    """Replicas A (head node) and B (the other) of one namespace, reading through `transport`."""
    transport = request.param
    config = {
        **TIERING_EXTRA,
        "block_size": CHUNK_TOKENS,
        "cpu_bytes_to_use": 8 << 20,
        "secondary_tiers": [
            {
                **DISTKV_TIER,
                "cpu_bytes_to_use": 8 << 20,
                "tenant_salt": uuid.uuid4().hex,
                # a timed out promotion would turn a hit into a miss; how long one takes on a
                # loaded machine is not under test
                "promotion_timeout_s": 20.0,
                "transport": transport,
                "directory_view": "push",  # the view the test waits on
            }
        ],
    }
    env = {"PYTHONHASHSEED": "7", "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    actors = [
        EngineActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            runtime_env={"env_vars": env},
        ).remote(request.getfixturevalue("model_dir"), config)
        for node in nodes
    ]
    namespace = ray.get(actors[0].namespace.remote(), timeout=300)
    assert ray.get([a.node_id.remote() for a in actors], timeout=300) == [n.node_id for n in nodes]
    try:
        yield transport, actors
    finally:
        for actor in actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # killed by the test
        kill_shards(namespace)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 50_000, n).tolist()


def wait_seen(b, keys: list[bytes]) -> None:
    deadline = time.monotonic() + 60  # only keeps a broken link from hanging the suite
    while not ray.get(b.sees.remote(keys)):
        assert time.monotonic() < deadline, "A's chunks never showed in B's Directory view"
        time.sleep(0.05)


def wait_exited(pid: int) -> None:
    """Until process `pid` is gone or a zombie: its memory is released, so no read reaches it.
    (`ray.kill` returns before the actor's process has exited.)"""
    deadline = time.monotonic() + 60  # only keeps a kill that never lands from hanging the suite
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"A's process {pid} still runs after it was killed"
        time.sleep(0.05)


def vllm_regions(pid: int) -> list[str]:
    """The files of vLLM's CPU-tier regions that process `pid` maps."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f if "/vllm_offload_" in line})


def test_b_on_another_node_loads_a_prefix_a_computed_and_the_holder_dies(engines):
    transport, (a, b) = engines
    assert ray.get(a.namespace.remote()) == ray.get(b.namespace.remote())
    first, second = tokens(0, PREFIX_TOKENS), tokens(1, PREFIX_TOKENS)
    served = ray.get(a.serve.remote({"a0": first + tokens(2, 100), "a1": second + tokens(3, 100)}), timeout=120)
    assert all(exact for _, (_, exact) in served.values())
    stored = ray.get(a.stored_keys.remote())
    assert len(stored) >= 2 * PREFIX_TOKENS // CHUNK_TOKENS
    wait_seen(b, stored)

    (answers, (loaded, exact)), = ray.get(b.serve.remote({"b0": first + tokens(4, 100)}), timeout=120).values()
    assert answers[0] is None, "B retries while its tier promotes the chunks"
    assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS and exact, "B's GPU blocks differ from what A computed"
    same_node, cross_node = ray.get(b.promoted_bytes.remote())
    assert same_node == 0 and cross_node > 0
    assert ray.get(b.transported.remote())[transport][1] == cross_node  # every byte by the transport set
    assert ray.get(b.tier_keys_failed.remote()) == 0

    if transport != "nixl":
        return  # through the object store a dead replica's rows are still served: its segment outlives it
    pid = ray.get(a.pid.remote())
    regions = vllm_regions(pid)
    ray.kill(a, no_restart=True)
    wait_exited(pid)
    for path in regions:  # vLLM removes its region at shutdown only: a killed replica's outlives it
        os.unlink(path)
    # The Directory drops a silent replica's holders after its heartbeat timeout: B's view
    # still names A as the holder of the second prefix, so B's tier takes it for a hit.
    assert ray.get(b.sees.remote(stored)), "the Directory dropped A before B asked"
    (_, (loaded, exact)), = ray.get(b.serve.remote({"b1": second + tokens(5, 100)}), timeout=180).values()
    assert exact, "B loaded KV bytes that differ from what computing them writes"
    assert loaded < PREFIX_TOKENS - GPU_BLOCK_TOKENS  # what did not come from A was recomputed
    assert ray.get(b.tier_keys_failed.remote()) > 0  # B's tier reported its loads failed
