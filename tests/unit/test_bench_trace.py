"""bench/trace.py, the manager benchmark's trace: it records a workload that shares prefixes
and evicts, and replays it to the recorded answers on distkv's managers and vLLM's.

A replay that answered differently would time different work on each manager; these
tests keep the benchmark comparing like with like. Nothing here is timed.
"""

import importlib.util
import sys
import uuid
from pathlib import Path

import pytest
from cluster_fakes import FakeDirectory, FakeLink, FunctionFetch, no_fetch

from distkv.abstract import ReqContext
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.records import ReplicaInfo
from distkv.replica.harness import block_keys
from distkv.replica.local_manager import LocalOffloadingManager
from distkv.names import segment_name
from distkv.storage.pool import HostPool, PoolLayout
from distkv.transfer.promotion import Promoter
from distkv.transfer.transport import ObjectStoreTransport

REQUESTS = 300
ROWS = 512  # of the ~1,700 blocks the workload stores


def load_trace():
    """bench/trace.py, imported as bench_trace so that it does not shadow the standard library's trace."""
    spec = importlib.util.spec_from_file_location("bench_trace", Path(__file__).resolve().parents[2] / "bench" / "trace.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


trace = load_trace()


@pytest.fixture(scope="module", params=trace.POLICIES)
def recorded(request):
    return trace.record(REQUESTS, ROWS, request.param)


def test_the_trace_shares_prefixes_evicts_and_makes_every_call(recorded):
    calls = dict(zip(trace.KINDS, recorded.calls()))
    assert all(calls[kind] > 0 for kind in trace.KINDS)
    # the pool took more blocks than it has rows: its stores evicted
    stored = sum(op.answer or 0 for op in recorded.ops if op.kind == trace.PREPARE_STORE)
    assert stored > 2 * ROWS
    # most lookups hit, as requests share system prompts and conversation histories
    assert recorded.hits() > calls["lookup"] // 2


def test_replay_on_distkv_answers_as_recorded_and_times_every_call(recorded):
    subject = trace.local_subject(recorded.policy, ROWS)
    first = trace.replay(recorded, subject)
    again = trace.replay(recorded, subject)  # reset_cache empties it for the next run
    for result in (first, again):
        assert all(ns > 0 for ns in result.ns)
        assert result.hooks_ns == 0


def test_replay_on_vllm_gives_the_same_hits_and_misses(recorded):
    pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
    subject = trace.vllm_subject(recorded.policy, ROWS)
    result = trace.replay(recorded, subject)  # raises Diverged on any other answer
    assert result.hooks_ns > 0


def test_replay_on_the_cluster_manager_answers_as_recorded_and_publishes(recorded):
    directory = FakeDirectory()
    other = FakeLink(directory, ReplicaInfo("other", "node-b", "pool-other", 4096, 1, 4096))
    tokens = list(range(100_000, 100_000 + 16 * 256))
    other.stored([(key, row, 1) for row, key in enumerate(block_keys(tokens, trace.BLOCK_TOKENS))])
    pool = HostPool(segment_name("testtrace" + uuid.uuid4().hex[:8], "r0"), PoolLayout(ROWS, 1, 4096))
    try:
        link = FakeLink(directory, ReplicaInfo("this", "node-a", pool.name, ROWS, 1, 4096))
        promoter = Promoter(pool, "node-a", link.replica, ObjectStoreTransport(pool, fetch=FunctionFetch(no_fetch)), namespace=link.namespace)
        manager = ClusterOffloadingManager(ROWS, link, promoter, policy=recorded.policy)
        try:
            trace.replay(recorded, trace.Subject("distkv cluster", manager, ReqContext))
            assert link.mine() == set(manager.local.ready_keys())
            assert manager.promotions_in_flight == 0
        finally:
            manager.shutdown()
    finally:
        pool.close()


def test_a_manager_that_answers_otherwise_stops_the_replay(recorded):
    smaller = trace.Subject("smaller pool", LocalOffloadingManager(ROWS // 4, recorded.policy), ReqContext)
    with pytest.raises(trace.Diverged, match="where the recording has"):
        trace.replay(recorded, smaller)


def test_compare_gives_ops_per_second_for_every_call_and_the_whole_trace(recorded):
    results = trace.compare(
        {recorded.policy: recorded}, {recorded.policy: [trace.local_subject(recorded.policy, ROWS)]}, runs=1
    )
    (result,) = results
    assert result["diverged"] is None
    assert set(result["ops_per_s"]) == {*trace.KINDS, "trace"}
    assert all(rate > 0 for rate in result["ops_per_s"].values())
