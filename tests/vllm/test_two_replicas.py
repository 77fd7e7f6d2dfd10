"""Two real vLLM Schedulers with the OffloadingConnector and distkv share a prefix cache.

Replica A computes requests sharing a 4k-token prefix; its stores go through distkv's
CPU handlers into its pool. Replica B, asked the same prefix, answers RETRY while distkv
promotes A's blocks into B's pool, then loads them: the KV bytes B ends up with are
exactly what computing them would have written.
"""

import time
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from replica_engine import DISTKV_EXTRA, GPU_BLOCK_TOKENS, EngineReplica  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, make_offload_key  # noqa: E402

from distkv import abstract  # noqa: E402
from distkv.vllm import DistkvOffloadingManager, RayOffloadingSpec  # noqa: E402
from ray_actors.directory import kill_shards  # noqa: E402

PREFIX_TOKENS = 4096
CHUNK_TOKENS = 64  # extra_config block_size: 4 GPU blocks per offloaded block


@pytest.fixture
def replicas(ray_session, model_dir):
    made: list[EngineReplica] = []

    def make(salt: str, kv_events: bool = False) -> EngineReplica:
        config = {**DISTKV_EXTRA, "block_size": CHUNK_TOKENS, "cpu_bytes_to_use": 8 << 20, "tenant_salt": salt}
        made.append(EngineReplica(model_dir, config, kv_events))
        return made[-1]

    yield make
    namespaces = {r.manager.cluster.link.namespace for r in made}
    for r in made:
        r.shutdown()
    for namespace in namespaces:
        kill_shards(namespace)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 50_000, n).tolist()


def test_replica_b_loads_the_prefix_replica_a_computed(replicas):
    salt = uuid.uuid4().hex
    a, b = replicas(salt), replicas(salt)
    prefix = tokens(0, PREFIX_TOKENS)
    for i in range(2):
        a.add(f"a{i}", prefix + tokens(100 + i, 100))
    a.run()
    for i in range(2):
        start, exact = a.preloaded[f"a{i}"]
        assert exact  # whatever A reused (its own GPU prefix cache or offloaded blocks) was right

    stored = a.manager.cluster.local.ready_keys()
    assert len(stored) >= PREFIX_TOKENS // CHUNK_TOKENS
    deadline = time.monotonic() + 10
    while not all(b.manager.cluster.link.holders(key) for key in stored):
        assert time.monotonic() < deadline, "A's blocks never showed in B's Directory view"
        time.sleep(0.01)

    b.add("b0", prefix + tokens(200, 100))
    b.run()
    answers = b.matched["b0"]
    assert answers[0] is None, "B should retry while the blocks are promoted"
    assert answers[-1] >= PREFIX_TOKENS - GPU_BLOCK_TOKENS
    loaded, exact = b.preloaded["b0"]
    assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS
    assert exact, "B loaded KV bytes that differ from what A computed"

    stats = b.manager.get_stats()
    types, values = stats.metric_sections()
    assert set(types) <= set(RayOffloadingSpec.build_metric_definitions({}))
    assert 0 < values["distkv:pool_usage_perc"][()] <= 1
    assert b.manager.cluster.promoter.bytes_same_node > 0  # the blocks came from A's pool


def test_lookup_maps_distkv_answers_to_vllm_results(replicas):
    manager = replicas(uuid.uuid4().hex).manager
    assert isinstance(manager, DistkvOffloadingManager)
    ctx = ReqContext("probe")
    key = make_offload_key(b"\x07" * 32, 0)
    with manager.lock, manager.lock:  # reentrant: callbacks may nest
        assert manager.lookup(key, ctx) is LookupResult.MISS
        out = manager.prepare_store([key], ctx)
        assert out.keys_to_store == [key]
        assert manager.lookup(key, ctx) is LookupResult.HIT_PENDING  # a store of this replica in flight
        assert not manager.has_pending_work()
        manager.complete_store([key], ctx)
        assert manager.lookup(key, ctx) is LookupResult.HIT


@pytest.mark.parametrize("answer", list(abstract.LookupResult))
def test_lookup_gives_each_answer_of_the_cluster_manager_as_vllm_s_of_that_name(answer):
    """RETRY (a promotion, which may still fail) and HIT_PENDING (a store of this replica)
    stay apart on the way to vLLM's scheduler."""

    class AnsweringCluster:  # a cluster manager whose every lookup gives `answer`
        def lookup_result(self, key, req_context):
            return answer

    manager = DistkvOffloadingManager(AnsweringCluster(), pool=None, enable_events=False)
    assert manager.lookup(make_offload_key(b"\x07" * 32, 0), ReqContext("probe")) is LookupResult[answer.name]


@pytest.mark.parametrize("kv_events", [False, True])
def test_stored_and_evicted_blocks_become_kv_events_when_vllm_asks(replicas, kv_events):
    manager = replicas(uuid.uuid4().hex, kv_events=kv_events).manager
    ctx = ReqContext("probe")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    with manager.lock:
        manager.prepare_store(keys, ctx)
        manager.complete_store(keys, ctx)
        manager.reset_cache()
        events = list(manager.take_events())
    assert not list(manager.cluster.take_events())  # drained either way: nothing piles up
    if not kv_events:
        assert events == []
        return
    assert [(e.keys, e.medium, e.removed) for e in events] == [(keys, Medium.CPU, False), (keys, Medium.CPU, True)]
