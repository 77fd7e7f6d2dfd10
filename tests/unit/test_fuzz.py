"""Bad input, fuzzed: only a clear exception (ValueError or TypeError naming the problem),
and the state it was offered to unchanged.

Covers the configuration (kv_connector_extra_config), the spec's fields, offload keys,
block ids of transfers, the Directory's publish and kv_transfer_params through the vLLM
adapter.
"""

import math
import uuid
from dataclasses import fields

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distkv.abstract import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
)
from distkv.config import DistkvConfig
from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo
from distkv.storage.handlers import make_handlers
from distkv.replica.local_manager import LocalOffloadingManager
from distkv.storage.pool import HostPool, PoolLayout, PoolLoadStoreSpec
from distkv.replica.specs import LocalOffloadingSpec

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KNOWN_KEYS = [f.name for f in fields(DistkvConfig)] + ["spec_name", "spec_module_path", "block_size"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


# ---- configuration ---------------------------------------------------------------------


@FUZZ
@given(st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=10) | st.integers() | st.none(), values, max_size=5))
def test_extra_config_is_accepted_valid_or_refused_naming_the_key(extra):
    try:
        config = DistkvConfig.from_extra_config(extra)
    except ValueError as e:
        named = [k for k in extra if repr(k) in str(e) or str(k) in str(e)]
        assert named, f"{e} names none of the keys of {extra!r}"
        return
    assert isinstance(config.cpu_bytes_to_use, int) and config.cpu_bytes_to_use > 0
    assert config.eviction_policy in ("lru", "arc") and config.store_policy in ("always", "dedupe")
    assert isinstance(config.tenant_salt, str)
    assert config.ray_address is None or isinstance(config.ray_address, str)
    assert isinstance(config.promotion_timeout_s, float) and 0 < config.promotion_timeout_s < math.inf
    assert isinstance(config.directory_shards, int) and 1 <= config.directory_shards <= 1024


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e400, 2.5, "8", [1]])
def test_cpu_bytes_to_use_that_is_no_whole_number_is_named(value):
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        DistkvConfig.from_extra_config({"cpu_bytes_to_use": value})


def test_non_string_keys_are_named():
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        DistkvConfig.from_extra_config({1: 2, "tenant_salt": "a", None: 3})


# ---- the spec's fields -------------------------------------------------------------------


@FUZZ
@given(
    gpu_block_sizes=st.lists(st.integers(-4, 64), min_size=0, max_size=3),
    page_bytes=st.lists(st.integers(-4096, 1 << 20), min_size=0, max_size=3),
    block_size=values,
    tp=st.integers(-2, 4),
    engine_id=st.text(max_size=20),
)
def test_spec_fields_are_accepted_or_refused_clearly(gpu_block_sizes, page_bytes, block_size, tp, engine_id):
    extra = {"cpu_bytes_to_use": 1 << 24} if block_size is None else {"cpu_bytes_to_use": 1 << 24, "block_size": block_size}
    try:
        spec = LocalOffloadingSpec.from_layout(
            extra, gpu_block_sizes=gpu_block_sizes, group_page_bytes=page_bytes,
            engine_id=engine_id, tensor_parallel_size=tp,
        )
    except (ValueError, TypeError) as e:
        assert str(e)
        return
    assert spec.layout.num_rows >= 1 and spec.block_size_factor >= 1
    assert all(size > 0 for size in spec.gpu_block_size)


@pytest.mark.parametrize(
    "block_size, message",
    [("abc", "block_size"), (1.5, "block_size"), ([16], "block_size"), (True, "block_size"), (0, "block_size")],
)
def test_bad_offloaded_block_size_is_named(block_size, message):
    with pytest.raises(ValueError, match=message):
        LocalOffloadingSpec.from_layout({"block_size": block_size}, gpu_block_sizes=[16], group_page_bytes=[4096])


@pytest.mark.parametrize("sizes", [[0], [-16], [16, 0]])
def test_gpu_block_size_that_is_not_positive_is_refused(sizes):
    with pytest.raises(ValueError, match="block size"):
        LocalOffloadingSpec.from_layout({}, gpu_block_sizes=sizes, group_page_bytes=[4096] * len(sizes))


# ---- offload keys --------------------------------------------------------------------


def good_key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


bad_keys = st.one_of(
    st.binary(max_size=4),
    st.binary(min_size=97, max_size=120),
    st.text(max_size=8),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.tuples(st.binary(max_size=8)),
    st.floats(allow_nan=True),
)


def manager_state(m: LocalOffloadingManager):
    return (
        {k: (b.row, b.generation, b.refs) for k, b in m.blocks.items()},
        m.num_free_rows,
        m._num_evictable,
        list(m._policy._order) if hasattr(m._policy, "_order") else None,
        len(m._events),
        {k: (b.row, b.refs) for k, b in m._retired.items()},
    )


@FUZZ
@given(
    policy=st.sampled_from(["lru", "arc"]),
    op=st.sampled_from(["lookup", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store"]),
    bad=bad_keys,
    position=st.integers(0, 3),
)
def test_bad_key_raises_and_leaves_the_manager_unchanged(policy, op, bad, position):
    m = LocalOffloadingManager(8, policy=policy)
    ctx = ReqContext("fuzz")
    out = m.prepare_store([good_key(i) for i in range(4)], ctx)
    m.complete_store(out.keys_to_store, ctx)
    m.prepare_load([good_key(0)], ctx)  # one pin, so that complete_load has something to release
    m.prepare_store([good_key(5)], ctx)  # one store in flight
    before = manager_state(m)
    keys = [good_key(i) for i in range(3)]
    keys.insert(position, bad)
    with pytest.raises((ValueError, TypeError)) as e:
        if op == "lookup":
            m.lookup(bad, ctx)
        else:
            getattr(m, op)(keys, ctx)
    assert "key" in str(e.value) or "hashable" in str(e.value)
    assert manager_state(m) == before


# ---- block ids -------------------------------------------------------------------------

PAGE = 4096


@pytest.fixture(scope="module")
def worker():
    pool = HostPool(f"distkv-fuzz-{uuid.uuid4().hex[:8]}", PoolLayout(8, 1, 2 * PAGE))
    kv = [torch.zeros(16, PAGE, dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in kv], [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]]
    )
    handlers = {direction: handler for _, _, handler in make_handlers(caches, pool, 0, 1) for direction in [handler.gpu_to_pool]}
    yield pool, kv, handlers
    for handler in handlers.values():
        handler.shutdown()
    pool.close()


ids = st.one_of(st.integers(-3, 20), st.floats(allow_nan=True), st.just(2**64), st.text(max_size=2), st.none())


@FUZZ
@given(
    gpu_ids=st.lists(ids, min_size=1, max_size=4),
    rows=st.lists(ids, min_size=1, max_size=4),
    to_pool=st.booleans(),
)
def test_bad_block_ids_raise_and_leave_pool_and_kv_unchanged(worker, gpu_ids, rows, to_pool):
    pool, kv, handlers = worker
    handler = handlers[to_pool]
    pool_bytes = np.frombuffer(pool._mmap, dtype=np.uint8).copy()
    kv_bytes = [t.clone() for t in kv]
    job = uuid.uuid4().int & 0xFFFFFFF
    try:
        gpu = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0])
        keys = [good_key(i) for i in range(len(rows))]
        spec = PoolLoadStoreSpec(rows, keys, [7] * len(rows))
        transfer = (gpu, spec) if to_pool else (spec, gpu)
        submitted = handler.transfer_async(job, transfer)
    except (ValueError, TypeError) as e:
        assert str(e)
    else:
        valid = all(isinstance(i, int) and 0 <= i < 16 for i in gpu_ids) and all(
            isinstance(r, int) and 0 <= r < 8 for r in rows
        ) and len(gpu_ids) == len(rows)
        assert valid, f"accepted gpu ids {gpu_ids} and rows {rows}"
        handler.wait({job}) if submitted else None
        handler.get_finished()
        return
    assert np.array_equal(np.frombuffer(pool._mmap, dtype=np.uint8), pool_bytes)
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_bytes))


# ---- the Directory ---------------------------------------------------------------------


@FUZZ
@given(
    entries=st.lists(st.one_of(st.tuples(bad_keys | st.just(good_key(1)), ids, ids), st.tuples(ids), ids), min_size=1, max_size=3),
    removed=st.lists(bad_keys | st.just(good_key(2)), max_size=2),
    seq=st.one_of(st.integers(2, 5), st.text(max_size=2), st.none()),
)
def test_bad_publish_raises_and_leaves_the_directory_unchanged(entries, removed, seq):
    state = DirectoryState()
    state.register(ReplicaInfo("a", "n", "distkv-ns-a", 8, 1, PAGE))
    state.publish("a", 1, [(good_key(1), 0, 5), (good_key(2), 1, 6)], [])
    before = (state.stats(), state.query([good_key(1), good_key(2)]), state.cursor())
    try:
        state.publish("a", seq, entries, removed)
    except (ValueError, TypeError) as e:
        assert str(e)
        assert (state.stats(), state.query([good_key(1), good_key(2)]), state.cursor())[1:] == before[1:]
        return
    assert all(isinstance(row, int) and 0 <= row < 8 for _, row, _ in entries)


# ---- kv_transfer_params through the vLLM adapter -------------------------------------------


def adapter_manager():
    """distkv.vllm's manager over a ClusterOffloadingManager with an in-memory Directory,
    holding four stored blocks; (manager, their keys)."""
    from cluster_fakes import FakeDirectory, FakeLink, FunctionFetch, no_fetch

    from distkv.replica.cluster_manager import ClusterOffloadingManager
    from distkv.transfer.promotion import Promoter
    from distkv.transfer.transport import ObjectStoreTransport
    from distkv.vllm import DistkvOffloadingManager

    layout = PoolLayout(8, 1, PAGE)
    pool = HostPool(f"distkv-fuzz-{uuid.uuid4().hex[:8]}", layout)
    info = ReplicaInfo("a", "node", pool.name, layout.num_rows, layout.num_ranks, layout.slot_bytes)
    link = FakeLink(FakeDirectory(), info)
    cluster = ClusterOffloadingManager(8, link, Promoter(pool, "node", link.replica, ObjectStoreTransport(pool, FunctionFetch(no_fetch)), namespace=link.namespace))
    manager = DistkvOffloadingManager(cluster, pool, enable_events=False)
    keys = [good_key(i) for i in range(4)]
    ctx = ReqContext("setup")
    cluster.complete_store(cluster.prepare_store(keys, ctx).keys_to_store, ctx)
    return manager, keys



@FUZZ
@given(params=st.none() | st.dictionaries(st.text(max_size=12) | st.sampled_from(["kv_load_tiers", "max_load_tokens"]), values, max_size=4))
def test_kv_transfer_params_never_change_what_the_adapter_answers(params):
    vllm_base = pytest.importorskip("vllm.v1.kv_offload.base")
    manager, keys = adapter_manager()
    try:
        plain = vllm_base.ReqContext(req_id="plain")
        fuzzed = vllm_base.ReqContext(req_id="fuzzed", kv_transfer_params=params)
        manager.on_new_request(fuzzed)
        assert [manager.lookup(k, fuzzed) for k in keys] == [manager.lookup(k, plain) for k in keys]
        out = manager.prepare_store([good_key(100)], fuzzed)
        assert out is not None and out.keys_to_store == [good_key(100)]
        manager.complete_store([good_key(100)], fuzzed)
        manager.prepare_load(keys[:2], fuzzed)
        manager.complete_load(keys[:2], fuzzed)
        manager.on_request_finished(fuzzed)
    finally:
        manager.shutdown()
