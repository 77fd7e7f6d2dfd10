"""distkv's tier as vLLM 0.33's tiering sees it: its namespace, its configuration, and two
TieringOffloadingManagers of different tensor-parallel sizes sharing canonical chunks.

The plan needs no Ray; the managers join one local Ray (vLLM's CPU primary tier and its
tiering manager are real; no worker is involved: the test writes the primary chunks' bytes
where vLLM's worker would, and compares what the other replica's primary tier receives).
"""

import dataclasses
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

from replica_engine import DISTKV_TIER, vllm_config  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from distkv.vllm import replica_plan  # noqa: E402
from distkv.vllm_tier import tier_plan  # noqa: E402
from ray_actors.directory import kill_shards  # noqa: E402

KV_BYTES_PER_BLOCK = 2048  # one GPU block of every layer, all heads (TP=1)
BLOCKS_PER_CHUNK = 2
CHUNK_BYTES = KV_BYTES_PER_BLOCK * BLOCKS_PER_CHUNK  # the same under any TP: heads split, not copied


def offloading_config(
    tp: int = 1, canonical: bool = False, agnostic: bool = True, dtype: str = "float16", tiers: list | None = None
) -> OffloadingConfig:
    """What vLLM's build_offloading_config makes of one full-attention group at TP=`tp`."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK // tp,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers or []},
        engine_id=uuid.uuid4().hex,
        model=OffloadingModelConfig(name="tiny-opt", dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
        canonical_layout=canonical,
        kv_cache_layout="LBNHC",
    )


def namespace(config: OffloadingConfig, **settings) -> str:
    return tier_plan(config, (), {"cpu_bytes_to_use": 1 << 20, **settings}, CHUNK_BYTES).namespace


def test_canonical_chunks_share_across_tp_sizes_and_direct_ones_do_not():
    # vLLM certifies canonical pages parallelism-agnostic: the same bytes at TP=1 and TP=2
    assert namespace(offloading_config(1, canonical=True)) == namespace(offloading_config(2, canonical=True))
    # direct chunks are each worker's own pages: vLLM's flag does not make them the same bytes
    assert namespace(offloading_config(1)) != namespace(offloading_config(2))
    # canonical pages vLLM could not certify fall back to per-rank bytes
    assert namespace(offloading_config(1, True, agnostic=False)) != namespace(offloading_config(2, True, agnostic=False))
    assert namespace(offloading_config(1, canonical=True)) != namespace(offloading_config(1))


def test_what_else_makes_another_namespace():
    config = offloading_config()
    assert namespace(config) == namespace(dataclasses.replace(config, engine_id="another replica"))
    assert namespace(config) != namespace(config, tenant_salt="t1")
    assert namespace(config) != namespace(offloading_config(dtype="fp8"))
    # distkv's spec lays rows out otherwise (a slot per worker): the two never share
    spec_config = dataclasses.replace(config, extra_config={"cpu_bytes_to_use": 1 << 20})
    assert namespace(config) != replica_plan(spec_config, ()).namespace


def test_the_pool_holds_a_chunk_per_row():
    plan = tier_plan(offloading_config(), (), {"cpu_bytes_to_use": 10 * CHUNK_BYTES}, CHUNK_BYTES)
    assert (plan.layout.num_rows, plan.layout.num_ranks, plan.layout.slot_bytes) == (10, 1, CHUNK_BYTES)


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"cpu_bytes": 1 << 20}, "cpu_bytes"),
        ({"transport": "rdma"}, "transport"),
        ({"directory_view": "pull"}, "directory_view"),
        ({"spec_module_path": "distkv.vllm"}, "spec_module_path.*kv_connector_extra_config"),
        ({"cpu_bytes_to_use": 1}, "raise cpu_bytes_to_use"),
    ],
)
def test_bad_settings_fail_at_start_naming_the_key(settings, named):
    with pytest.raises(ValueError, match=named):
        tier_plan(offloading_config(), (), settings, CHUNK_BYTES)


def test_a_bad_tier_entry_fails_vllms_tiering_at_start(model_dir):
    tiers = [{**DISTKV_TIER, "cpu_bytes_to_use": 1 << 20, "evicton_policy": "lru"}]
    spec = TieringOffloadingSpec(offloading_config(tiers=tiers))
    with set_current_vllm_config(vllm_config(model_dir, {})), pytest.raises(ValueError, match="evicton_policy"):
        spec.get_manager()


def chunk_of(manager, key: bytes, ctx: ReqContext) -> int:
    spec = manager.primary_tier.prepare_load([key], ctx)
    manager.primary_tier.complete_load([key], ctx)
    return int(spec.chunk_ids[0])


def test_tp1_and_tp2_replicas_share_canonical_chunks(ray_session, model_dir):
    """Replica A at TP=1 stores chunks; replica B at TP=2 finds them in distkv's tier and
    promotes them into its primary tier, byte for byte."""
    salt = uuid.uuid4().hex
    tiers = [{**DISTKV_TIER, "cpu_bytes_to_use": 1 << 20, "tenant_salt": salt, "directory_view": "push"}]
    specs = [TieringOffloadingSpec(offloading_config(tp, canonical=True, tiers=tiers)) for tp in (1, 2)]
    with set_current_vllm_config(vllm_config(model_dir, {})):  # the model both run, as their connectors would say
        a, b = (spec.get_manager() for spec in specs)
    tier_a, tier_b = a.secondary_tiers[0], b.secondary_tiers[0]
    assert tier_a.cluster.link.namespace == tier_b.cluster.link.namespace
    step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(8)]
    data = np.random.default_rng(0).integers(0, 256, (len(keys), CHUNK_BYTES), dtype=np.uint8)
    try:
        ctx = ReqContext("a")
        with a.lock:
            a.on_new_request(ctx)
            out = a.prepare_store(keys, ctx)
            primary_a = np.frombuffer(a.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, CHUNK_BYTES)
            for chunk, d in zip(out.store_spec.chunk_ids.tolist(), data):
                primary_a[chunk] = d  # what A's workers write, in vLLM's canonical layout
            del primary_a
            a.complete_store(keys, ctx)  # cascades to distkv's tier
        deadline = time.monotonic() + 30
        while not all(tier_b.cluster.link.holders(k) for k in keys):
            assert time.monotonic() < deadline, "A's chunks never showed in B's view"
            with a.lock:
                a.on_schedule_end(step)
            time.sleep(0.01)

        ctx = ReqContext("b")
        with b.lock:
            b.on_new_request(ctx)
            assert {b.lookup(k, ctx) for k in keys} == {LookupResult.HIT_PENDING}  # promotions initiated
            b.on_schedule_end(step)
        while True:
            assert time.monotonic() < deadline, "B's promotions never ended"
            with b.lock:
                answers = {b.lookup(k, ctx) for k in keys}
                b.on_schedule_end(step)
            if answers == {LookupResult.HIT}:
                break
            assert LookupResult.MISS not in answers
            time.sleep(0.01)
        with b.lock:
            chunks = [chunk_of(b, k, ctx) for k in keys]
        primary_b = np.frombuffer(b.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, CHUNK_BYTES)
        assert all(np.array_equal(primary_b[chunk], d) for chunk, d in zip(chunks, data))
        del primary_b
        with b.lock:
            b.on_request_finished(ctx)
        with a.lock:
            a.on_request_finished(ReqContext("a"))
    finally:
        namespace_ = tier_a.cluster.link.namespace
        a.shutdown()
        b.shutdown()
        kill_shards(namespace_)
