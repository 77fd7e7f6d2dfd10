"""distkv as a secondary tier of vLLM 0.33's tiered offloading, with real Schedulers.

Each replica is vLLM's Scheduler with its OffloadingConnector and TieringOffloadingSpec:
vLLM's CPU primary tier, vLLM's tiering manager, distkv's tier (distkv.vllm_tier) in its
`secondary_tiers`, beside vLLM's own fs tier where a test says so. Only the GPU <-> primary
copies run through a host-copy stand-in (host_tiering.py): vLLM's worker needs CUDA.
Replicas share one process and one local Ray here; test_tier_processes.py puts them in
processes of their own on simulated nodes.
"""

import os
import threading
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from replica_engine import DISTKV_TIER, GPU_BLOCK_TOKENS, TIERING_EXTRA, EngineReplica  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from distkv.names import SEGMENT_PREFIX  # noqa: E402
from distkv.observability.stats import ReplicaStats  # noqa: E402
from ray_actors.directory import kill_shards  # noqa: E402

PREFIX_TOKENS = 4096
CHUNK_TOKENS = 64  # extra_config block_size: 4 GPU blocks per chunk
PREFIX_CHUNKS = PREFIX_TOKENS // CHUNK_TOKENS


def tier_config(salt: str, fs_dir: str | None = None, **distkv) -> dict:
    """kv_connector_extra_config: vLLM's tiering with an 8 MiB primary tier, then vLLM's fs
    tier over `fs_dir` if given, then distkv's tier (8 MiB pool) in namespace `salt`."""
    tiers = [{"type": "fs", "root_dir": fs_dir, "n_read_threads": 2, "n_write_threads": 2}] if fs_dir else []
    # push: the view these tests wait on ("auto" queries instead when the Directory is slow to say)
    tiers.append({**DISTKV_TIER, "cpu_bytes_to_use": 8 << 20, "tenant_salt": salt, "directory_view": "push", **distkv})
    return {**TIERING_EXTRA, "block_size": CHUNK_TOKENS, "cpu_bytes_to_use": 8 << 20, "secondary_tiers": tiers}


@pytest.fixture
def replicas(ray_session, model_dir):
    made: list[EngineReplica] = []

    def make(salt: str, fs_dir: str | None = None, **distkv) -> EngineReplica:
        made.append(EngineReplica(model_dir, tier_config(salt, fs_dir, **distkv)))
        return made[-1]

    yield make
    namespaces = {r.cluster.link.namespace for r in made}
    for r in made:
        if not r.cluster.closed:
            r.shutdown()
    for namespace in namespaces:
        kill_shards(namespace)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 50_000, n).tolist()


def serve(replica: EngineReplica, req_id: str, prompt: list[int]) -> tuple[int, bool]:
    """Run one request to its end: (tokens it found in the KV cache, whether all were right)."""
    replica.add(req_id, prompt)
    replica.run()
    return replica.preloaded[req_id]


def wait_seen(replica: EngineReplica, keys: list[bytes]) -> None:
    """Until `replica`'s Directory view holds every key (how soon is not under test: the
    bound only keeps a broken link from hanging the suite)."""
    deadline = time.monotonic() + 30
    while not all(replica.cluster.link.holders(key) for key in keys):
        assert time.monotonic() < deadline, "the blocks never showed in the Directory view"
        time.sleep(0.01)


def count_loads(replica: EngineReplica) -> dict[str, list[bytes]]:
    """The keys each secondary tier of `replica` is asked to load from now on, by tier type."""
    loads: dict[str, list[bytes]] = {}
    for tier in replica.manager.secondary_tiers:
        keys = loads[tier.tier_type] = []

        def counting(job, submit=tier.submit_load, keys=keys):
            keys.extend(job.keys)
            submit(job)

        tier.submit_load = counting
    return loads


def test_b_loads_the_prefix_a_computed_from_the_cluster(replicas):
    salt = uuid.uuid4().hex
    a, b = replicas(salt), replicas(salt)
    prefix = tokens(0, PREFIX_TOKENS)
    assert serve(a, "a0", prefix + tokens(1, 100)) == (0, True)
    stored = a.cluster.local.ready_keys()
    assert len(stored) >= PREFIX_CHUNKS  # A's primary tier cascaded every chunk into its pool
    wait_seen(b, stored)

    loads = count_loads(b)
    loaded, exact = serve(b, "b0", prefix + tokens(2, 100))
    assert b.matched["b0"][0] is None, "B retries while its tier promotes the chunks"
    assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS and exact, "B's GPU blocks differ from what A computed"
    assert sorted(loads["DistkvTier"]) == sorted(k for k in stored if k in set(loads["DistkvTier"]))
    assert len(loads["DistkvTier"]) == PREFIX_CHUNKS
    ctx = ReqContext("probe")
    assert all(b.manager.primary_tier.lookup(key, ctx) is LookupResult.HIT for key in loads["DistkvTier"])

    stats = b.cluster.stats()
    assert stats.mode == "tier" and ReplicaStats.from_dict(stats.to_dict()).mode == "tier"  # as `distkv status` reads it
    assert stats.blocks.loaded["same_node"] == PREFIX_CHUNKS and stats.lookups.remote_hit == PREFIX_CHUNKS
    types, values = b.manager.get_stats().metric_sections()
    assert set(types) <= set(TieringOffloadingSpec.build_metric_definitions(tier_config(salt)))
    assert 0 < values["distkv:pool_usage_perc"][()] <= 1


def test_a_tier_replica_tells_distkvs_router_who_it_is(replicas):
    """Its engine's routing identity reaches Ray's internal key-value store, where its Serve
    replica reads it for distkv's router (distkv.serve_llm), as a replica of distkv's spec's does."""
    from ray.experimental import internal_kv

    from distkv.routing.identity import KV_NAMESPACE, read_identity
    from distkv.routing.router import STATS_KEY

    a = replicas(uuid.uuid4().hex)
    engine_id = a.scheduler.vllm_config.kv_transfer_config.engine_id
    def get(key):
        return internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)

    deadline = time.monotonic() + 30  # a heartbeat carries it: the bound only keeps a broken link from hanging
    while not (published := read_identity(engine_id, get)):
        assert time.monotonic() < deadline, "the tier never published its engine's identity"
        time.sleep(0.05)
    identity = published[STATS_KEY]
    assert identity["replica_id"] == a.cluster.link.info.replica_id
    assert identity["namespace"] == a.cluster.link.namespace
    keys = identity["keys"]  # the router keys a prompt as the tier's chunks
    assert keys["kind"] == "vllm" and keys["tokens_per_hash"] * keys["hashes_per_chunk"] == CHUNK_TOKENS


def test_beside_vllms_fs_tier_each_chunk_comes_from_one_tier(replicas, tmp_path):
    """A writes its chunks to its fs tier and to distkv. B, whose disk is another, gets
    them from the cluster. D, on A's disk but in another distkv namespace, from its fs tier.
    C, on A's disk and in A's namespace, from whichever answers first: never from both."""
    salt, other = uuid.uuid4().hex, uuid.uuid4().hex
    disk_a, disk_b = str(tmp_path / "a"), str(tmp_path / "b")
    a = replicas(salt, disk_a)
    prefix = tokens(10, PREFIX_TOKENS)
    assert serve(a, "a0", prefix + tokens(11, 100)) == (0, True)
    stored = a.cluster.local.ready_keys()
    assert sum(len(files) for _, _, files in os.walk(disk_a)) > PREFIX_CHUNKS  # the fs tier has them too

    b, c, d = replicas(salt, disk_b), replicas(salt, disk_a), replicas(other, disk_a)
    wait_seen(b, stored)
    wait_seen(c, stored)
    for replica, seed in ((b, 12), (c, 13), (d, 14)):
        loads = count_loads(replica)
        loaded, exact = serve(replica, "r", prefix + tokens(seed, 100))
        assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS and exact
        fs, distkv = loads["fs"], loads["DistkvTier"]
        assert not set(fs) & set(distkv) and len(fs) + len(distkv) == PREFIX_CHUNKS, "a chunk was loaded twice"
        if replica is b:
            assert not fs  # its disk never saw the prefix: all of it came from the cluster
        if replica is d:
            assert not distkv  # its namespace holds nothing of A's
    assert d.cluster.stats().lookups.remote_hit == 0


def test_a_different_namespace_shares_nothing(replicas):
    a, b = replicas(uuid.uuid4().hex), replicas(uuid.uuid4().hex)
    assert a.cluster.link.namespace != b.cluster.link.namespace
    prefix = tokens(20, PREFIX_TOKENS)
    serve(a, "a0", prefix + tokens(21, 100))
    loads = count_loads(b)
    assert serve(b, "b0", prefix + tokens(22, 100)) == (0, True)
    assert loads["DistkvTier"] == [] and b.cluster.stats().lookups.remote_hit == 0


def test_a_reset_with_a_promotion_in_flight_ends_every_job_and_never_loads_old_blocks(replicas, monkeypatch):
    """vLLM 0.33's reset (reset_cache, then on_reset_flushed once the workers report) while
    B's tier waits for a promotion from A into its primary chunk, held at its first copy:
    reset_cache waits until nothing writes the chunk any more, then finds every job of the
    tier ended (vLLM asserts it), and B recomputes: what landed is of the epoch before."""
    salt = uuid.uuid4().hex
    a, b = replicas(salt), replicas(salt)
    prefix = tokens(30, PREFIX_TOKENS)
    serve(a, "a0", prefix + tokens(31, 100))
    wait_seen(b, a.cluster.local.ready_keys())

    promoter = b.cluster.promoter
    copy, entered, go = promoter._copy_same_node, threading.Event(), threading.Event()

    def held(info, promotions):
        entered.set()
        go.wait()
        copy(info, promotions)

    monkeypatch.setattr(promoter, "_copy_same_node", held)
    b.add("b0", prefix + tokens(32, 100))
    while not entered.is_set():
        b.step()
        time.sleep(0.001)
    assert b.tier.has_pending_work()  # a load waits for the promotion
    reset = []
    resetting = threading.Thread(target=lambda: reset.append(b.scheduler.reset_connector_cache()))
    resetting.start()
    resetting.join(0.5)
    assert resetting.is_alive()  # the promotion may still write B's chunk: vLLM must not reset it yet
    go.set()
    resetting.join()
    assert reset == [True] and not b.tier.has_pending_work()
    b.run()
    assert b.preloaded["b0"] == (0, True)  # recomputed: A's blocks are of the epoch before
    assert b.cluster.epoch.epoch == 1 and b.cluster.link.info.replica_id.endswith(".epoch1")


def test_shutdown_leaves_no_segment_mapping_or_thread(replicas):
    before = {t.ident for t in threading.enumerate()}
    a = replicas(uuid.uuid4().hex)
    serve(a, "a0", tokens(40, 1024))
    pool = a.tier._tier._pool.name
    region = f"vllm_offload_{a.manager.primary_tier._mmap_region.mmap_path.rsplit('vllm_offload_', 1)[1]}"
    a.shutdown()  # vLLM releases its primary tier after its tiers: nothing of it may be held
    assert a.cluster.closed
    leftover = [n for n in os.listdir("/dev/shm") if n == pool or n.startswith(region)]
    assert not leftover
    with open("/proc/self/maps") as f:
        assert pool not in f.read()
    assert not [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("distkv-")]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX) and a.cluster.link.namespace in n]
