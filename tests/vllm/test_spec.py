"""distkv.vllm.RayOffloadingSpec as vLLM 0.33 sees it: loading, configuration, the worker side.

None of these needs Ray: the worker side only maps the replica's pool.
"""

import os
import uuid

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base")

from replica_engine import DISTKV_EXTRA, kv_cache_config, vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_none_hash_seed, init_none_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from distkv.replica.local_manager import LocalOffloadingManager  # noqa: E402
from distkv.storage.segments import SHM_DIR  # noqa: E402
from distkv.vllm import (  # noqa: E402
    DistkvOffloadingWorker,
    RayOffloadingSpec,
    prefix_hash_seed,
    replica_plan,
    vllm_model_settings,
)

PAGE_BYTES = 1024
LAYERS = 2
BLOCKS_PER_CHUNK = 2
NUM_GPU_BLOCKS = 32


@pytest.fixture(autouse=True)
def built_by_a_connector(model_dir, monkeypatch):
    """The specs these tests build from an OffloadingConfig of their own find the model's
    VllmConfig as those vLLM's OffloadingConnector builds do (distkv.vllm.connector_vllm_config)."""
    config = vllm_config(model_dir, DISTKV_EXTRA)
    monkeypatch.setattr("distkv.vllm.connector_vllm_config", lambda: config)


def offloading_config(extra: dict, engine_id: str | None = None, rank: int = 0, world_size: int = 1) -> OffloadingConfig:
    """What vLLM's build_offloading_config makes of one full-attention group of 2 layers."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE_BYTES,
        enable_kv_cache_events=False,
        extra_config={**DISTKV_EXTRA, **extra},
        engine_id=engine_id or uuid.uuid4().hex,
        model=OffloadingModelConfig(name="tiny-opt", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def canonical(tensors: list[torch.Tensor]) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE_BYTES) for t in tensors],
        [[CanonicalKVCacheRef(i, PAGE_BYTES) for i in range(len(tensors))]],
    )


def test_the_factory_loads_distkv_through_spec_module_path():
    extra = {"cpu_bytes_to_use": 1 << 20}
    assert OffloadingSpecFactory.get_spec_cls(offloading_config(extra).extra_config) is RayOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert isinstance(spec, RayOffloadingSpec)
    assert spec.blocks_per_chunk == BLOCKS_PER_CHUNK
    assert spec.plan.layout.num_ranks == 1
    assert spec.plan.layout.slot_bytes >= BLOCKS_PER_CHUNK * LAYERS * PAGE_BYTES


def test_scheduler_and_workers_derive_the_same_pool():
    engine = uuid.uuid4().hex
    extra = {"cpu_bytes_to_use": 1 << 20}
    scheduler_side = RayOffloadingSpec(offloading_config(extra, engine))
    workers = [RayOffloadingSpec(offloading_config(extra, engine, rank=r, world_size=2)) for r in range(2)]
    assert workers[0].plan == workers[1].plan
    assert [w.rank for w in workers] == [0, 1]
    assert scheduler_side.plan.namespace != workers[0].plan.namespace  # another parallel layout
    salted = RayOffloadingSpec(offloading_config({**extra, "tenant_salt": "t1"}, engine))
    assert salted.plan.namespace != scheduler_side.plan.namespace


@pytest.mark.parametrize("seed", [None, "0", "vllm-none-hash"])
def test_prefix_hash_seed_is_the_one_vllm_resolves(monkeypatch, seed):
    """What the engine core resolves once the connector is built, every process knows at start."""
    with monkeypatch.context() as env:
        if seed is None:
            env.delenv("PYTHONHASHSEED", raising=False)
        else:
            env.setenv("PYTHONHASHSEED", seed)
        before = prefix_hash_seed()
        init_none_hash(sha256)
        try:
            assert before == get_none_hash_seed()
        finally:
            env.undo()
            init_none_hash(sha256)  # back to this process's own seed, which other tests hash with


def test_replicas_with_other_hash_seeds_are_other_namespaces(monkeypatch):
    """Keys hashed from other seeds never match: such replicas must not look like one namespace."""
    config = offloading_config({"cpu_bytes_to_use": 1 << 20}, uuid.uuid4().hex)

    def namespace(seed: str | None) -> str:
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        return replica_plan(config, ()).namespace  # the model's settings alike

    assert namespace("1") != namespace("2")
    assert namespace("1") == namespace("1")
    assert namespace(None) != namespace("1")
    assert namespace(None) == namespace("vllm-none-hash")  # vLLM's default seed: the same NONE_HASH


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_is_another_namespace_than_a_float16_one(model_dir, cache_dtype):
    """vLLM's OffloadingConfig.model.dtype is the KV-cache dtype, so fp8 and fp16 blocks never mix."""
    engine = uuid.uuid4().hex

    def plan(dtype: str):
        config = vllm_config(model_dir, {**DISTKV_EXTRA, "cpu_bytes_to_use": 1 << 20})
        config.kv_transfer_config.engine_id = engine
        config.cache_config.cache_dtype = dtype
        return replica_plan(build_offloading_config(config, kv_cache_config()), vllm_model_settings(config))

    assert plan("auto").namespace == plan("auto").namespace
    assert plan(cache_dtype).namespace != plan("auto").namespace


def test_stores_and_loads_through_the_worker_are_bit_exact():
    engine = uuid.uuid4().hex
    config = offloading_config({"cpu_bytes_to_use": 1 << 20}, engine)
    spec_a, spec_b = RayOffloadingSpec(config), RayOffloadingSpec(config)  # two processes of one replica
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, PAGE_BYTES), dtype=torch.int8, generator=gen) for _ in range(LAYERS)]
    dst = [torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.int8) for _ in range(LAYERS)]
    writer, reader = spec_a.get_worker(canonical(src)), spec_b.get_worker(canonical(dst))
    assert isinstance(writer, DistkvOffloadingWorker)
    pool_path = os.path.join(SHM_DIR, spec_a.plan.pool_name)
    manager = LocalOffloadingManager(spec_a.plan.layout.num_rows)
    ctx = ReqContext("r")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    try:
        gpu_blocks = [5, 9, 2, 11, 30, 7]  # 3 offloaded blocks of 2 GPU blocks each
        out = manager.prepare_store(keys, ctx)
        assert writer.submit_store(1, GPULoadStoreSpec(gpu_blocks, [6], [0]), out.store_spec)
        writer.wait({1})
        assert [(r.job_id, r.success) for r in writer.get_finished()] == [(1, True)]
        manager.complete_store(keys, ctx)

        whole = manager.prepare_load(keys, ctx)
        assert reader.submit_load(2, whole, GPULoadStoreSpec([0, 1, 2, 3, 4, 5], [6], [0]))
        # a load starting mid-block skips the first GPU block of the first offloaded block
        tail = manager.prepare_load(keys, ctx)
        assert reader.submit_load(3, tail, GPULoadStoreSpec([20, 21, 22, 23, 24], [5], [1]), expedited=True)
        reader.wait({2, 3})
        assert sorted((r.job_id, r.success) for r in reader.get_finished()) == [(2, True), (3, True)]
        for s, d in zip(src, dst):
            assert torch.equal(d[0:6], s[gpu_blocks])
            assert torch.equal(d[20:25], s[gpu_blocks[1:]])
        assert os.path.exists(pool_path)
    finally:
        writer.shutdown()
        reader.shutdown()
    assert not os.path.exists(pool_path), "the last process of the replica removes its pool"


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"cpu_bytes_to_use": 1 << 20, "cpu_bytes": 1 << 20}, "cpu_bytes"),
        ({"cpu_bytes_to_use": -1}, "cpu_bytes_to_use"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"store_policy": "never"}, "store_policy"),
        ({"promotion_timeout_s": 0}, "promotion_timeout_s"),
        ({"directory_shards": 0}, "directory_shards"),
        ({"tenant_salt": 7}, "tenant_salt"),
        ({"canonical_layout": True}, "canonical_layout"),
    ],
)
def test_bad_configuration_fails_at_start_naming_the_key(extra, key):
    with pytest.raises(ValueError, match=key):
        OffloadingSpecFactory.create_spec(offloading_config(extra))


def test_bad_configuration_fails_the_connector(model_dir):
    config = vllm_config(model_dir, {**DISTKV_EXTRA, "cpu_bytes_to_use": 1 << 20, "evicton_policy": "lru"})
    with pytest.raises(ValueError, match="evicton_policy"):
        OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config())


def test_vllm_connector_keys_pass(model_dir):
    extra = {
        **DISTKV_EXTRA,
        "block_size": 64,
        "offload_prompt_only": True,
        "self_describing_kv_events": False,
        "sync_load_budget_bytes": 0,
        "cpu_bytes_to_use": 1 << 20,
    }
    connector = OffloadingConnector(vllm_config(model_dir, extra), KVConnectorRole.WORKER, kv_cache_config())
    spec = connector.connector_worker.spec
    assert isinstance(spec, RayOffloadingSpec)
    assert spec.blocks_per_chunk == 4
    connector.shutdown()


def test_a_replica_with_a_worker_on_another_node_fails_at_start():
    """Tensor or pipeline parallel across nodes: rank 1's worker marks the pool segment of
    its own node, so the scheduler's node shows rank 0 only. The engine stops at start
    instead of failing its first promoted load."""
    engine_id = uuid.uuid4().hex
    extra = {"cpu_bytes_to_use": 1 << 20}
    worker_spec = RayOffloadingSpec(offloading_config(extra, engine_id, rank=0, world_size=2))
    worker_spec.get_worker(canonical([torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.int8) for _ in range(LAYERS)]))
    scheduler_spec = RayOffloadingSpec(offloading_config(extra, engine_id, rank=0, world_size=2))
    try:
        with pytest.raises(ValueError, match=r"worker rank\(s\) \[1\].*world_size=2, tp_size=2, pp_size=1.*across nodes"):
            scheduler_spec.get_manager()
    finally:
        worker_spec._worker.shutdown()
    assert not [n for n in os.listdir(SHM_DIR) if worker_spec.plan.pool_name in n]
