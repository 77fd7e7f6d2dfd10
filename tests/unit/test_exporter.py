"""Metrics without Ray: what components count, and how the exporter turns it into Ray metric calls.

A recording backend stands in for `ray.util.metrics`; replicas share a dict-backed
Directory and read each other's pools directly (tests/ray/test_metrics.py runs the same
through Ray's metrics endpoint).
"""

import collections
import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict

import numpy as np
import pytest

from distkv.observability import metrics
from distkv.abstract import ReqContext
from cluster_fakes import FakeDirectory, FakeLink, FunctionFetch

from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo
from distkv.routing.answer import PARAMS_KEY, encode, from_directory
from distkv.replica.harness import Replica, block_keys
from distkv.observability.metrics import (
    METRICS,
    DirectorySource,
    Exporter,
    HandlerSource,
    NodeAgentSource,
    ReplicaSource,
)
from distkv.storage.slots import ALL_SUB_BLOCKS, Sealed
from distkv.storage.pool import HostPool
from distkv.storage.readers import read_rows
from distkv.transfer.promotion import Promoter, layout_of
from distkv.transfer.transport import ObjectStoreTransport
from distkv.replica.specs import LocalOffloadingSpec
from distkv.observability.stats import BlockCounts, LookupCounts, PoolUsage

BLOCK_TOKENS = 16
PAGE_BYTES = 16 << 10
BLOCK_BYTES = 2 * PAGE_BYTES


class Recorder:
    """A metrics backend that keeps what it was given: counters summed, gauges last, observations listed."""

    def __init__(self, ready: bool = True):
        self.is_ready = ready
        self.counters: dict[tuple, float] = collections.defaultdict(float)
        self.gauges: dict[tuple, float] = {}
        self.observed: dict[tuple, list[float]] = collections.defaultdict(list)
        self.incs = 0

    def ready(self):
        return self.is_ready

    @staticmethod
    def _key(metric, tags):
        return (metric.name, *(tags[k] for k in metric.tag_keys))

    def inc(self, metric, tags, value):
        assert value > 0  # ray.util.metrics.Counter.inc refuses anything else
        self.incs += 1
        self.counters[self._key(metric, tags)] += value

    def set(self, metric, tags, value):
        self.gauges[self._key(metric, tags)] = value

    def observe(self, metric, tags, value):
        self.observed[self._key(metric, tags)].append(value)


class Counting:
    """A source with counts a test sets."""

    def __init__(self):
        self.total = 0
        self.level = 0.0
        self.pending: list[float] = []
        self.alive = True

    def collect(self, out):
        out.count("distkv_node_agent_reads", {"node": "n1"}, self.total)
        out.gauge("distkv_pool_used_bytes", {"namespace": "ns", "replica": "r", "node": "n1"}, self.level)
        while self.pending:
            out.observe(
                "distkv_promotion_latency_seconds",
                {"namespace": "ns", "replica": "r", "node": "n1", "path": "same_node"},
                self.pending.pop(),
            )
        return self.alive


def test_exporter_pushes_increments_gauges_and_observations():
    backend = Recorder()
    exporter = Exporter(backend)
    source = Counting()
    exporter.add(source)
    source.total, source.level, source.pending = 5, 10.0, [0.01, 0.02]
    exporter.export()
    source.total, source.level = 7, 4.0
    exporter.export()
    exporter.export()  # nothing new: no increment at all
    assert backend.counters[("distkv_node_agent_reads", "n1")] == 7
    assert backend.incs == 2
    assert backend.gauges[("distkv_pool_used_bytes", "ns", "r", "n1")] == 4.0
    assert sorted(backend.observed[("distkv_promotion_latency_seconds", "ns", "r", "n1", "same_node")]) == [0.01, 0.02]

    source.total, source.alive = 9, False  # shut down: its last counts go out, then it is dropped
    exporter.export()
    source.total = 20
    exporter.export()
    assert backend.counters[("distkv_node_agent_reads", "n1")] == 9


def test_exporter_waits_for_its_backend():
    backend = Recorder(ready=False)
    exporter = Exporter(backend)
    source = Counting()
    exporter.add(source)
    source.total = 3
    exporter.export()
    assert not backend.counters
    backend.is_ready = True
    exporter.export()
    assert backend.counters[("distkv_node_agent_reads", "n1")] == 3


def test_exporter_thread_exports_until_closed():
    backend = Recorder()
    exporter = Exporter(backend, interval_s=0.01)
    source = Counting()
    source.total = 1
    exporter.add(source)
    exporter.start()
    deadline = time.monotonic() + 5
    while not backend.counters and time.monotonic() < deadline:
        time.sleep(0.005)
    source.total = 2
    exporter.close()  # exports once more on the way out
    assert backend.counters[("distkv_node_agent_reads", "n1")] == 2


@pytest.mark.parametrize(
    "report, message",
    [
        (lambda out: out.count("distkv_nonsense", {"node": "n"}, 1), "no metric"),
        (lambda out: out.gauge("distkv_node_agent_reads", {"node": "n"}, 1), "is a counter"),
        (lambda out: out.count("distkv_node_agent_reads", {"node": "n", "replica": "r"}, 1), "tag keys"),
    ],
)
def test_a_sample_that_does_not_fit_its_definition_is_refused(report, message):
    pusher = metrics._Pusher(Recorder(), {})
    with pytest.raises(ValueError, match=message):
        report(pusher)


def test_register_does_nothing_without_ray():
    import ray

    assert not ray.is_initialized()
    assert metrics.register(Counting()) is False
    assert metrics.this_node() == ""


def test_definitions_are_well_formed():
    for metric in METRICS.values():
        assert metric.name.startswith("distkv_") and metric.description
        assert metric.kind in (metrics.COUNTER, metrics.GAUGE, metrics.HISTOGRAM)
        assert not metric.name.endswith("_total")  # Ray adds it to counters
        assert (metric.kind == metrics.HISTOGRAM) == bool(metric.boundaries)
        assert list(metric.boundaries) == sorted(set(metric.boundaries))
    assert METRICS["distkv_lookups"].exported == "ray_distkv_lookups_total"
    assert METRICS["distkv_pool_used_bytes"].exported == "ray_distkv_pool_used_bytes"
    assert METRICS["distkv_promotion_latency_seconds"].series[0] == "ray_distkv_promotion_latency_seconds_bucket"


# ---- what the components count ---------------------------------------------------------


def read_holder(info, rows, keys, gens):
    """Stands in for the NodeAgent: reads the holder's pool at once."""
    future: Future = Future()
    pool = HostPool(info.pool_name, layout_of(info), create=False)
    try:
        data, metas = read_rows(pool, rows, keys, gens)
        future.set_result((np.array(data), metas))
    finally:
        pool.close()
    return future


def failing_fetch(info, rows, keys, gens):
    future: Future = Future()
    future.set_exception(ConnectionError("node agent unreachable"))
    return future


class FakeClusterSpec(LocalOffloadingSpec):
    def get_manager(self):
        layout = self.layout
        info = ReplicaInfo(self.replica_id, self.node_id, self.pool_name, layout.num_rows, layout.num_ranks, layout.slot_bytes)
        link = FakeLink(self.directory, info)
        promoter = Promoter(
            self.pool, self.node_id, link.replica, ObjectStoreTransport(self.pool, FunctionFetch(self.fetch)), namespace=self.namespace
        )
        return ClusterOffloadingManager(
            self.layout.num_rows, link, promoter,
            policy=self.config.eviction_policy, generations=self.pool.reserve_generations, promotion_timeout_s=self.timeout_s,
        )


@pytest.fixture
def replicas():
    made = []

    def make(directory, node_id, fetch=read_holder, pool_blocks=64, timeout_s=5.0):
        spec = FakeClusterSpec.from_layout(
            {"cpu_bytes_to_use": pool_blocks * BLOCK_BYTES},
            gpu_block_sizes=[BLOCK_TOKENS],
            group_page_bytes=[BLOCK_BYTES],
            engine_id=f"r{uuid.uuid4().hex[:8]}",
        )
        spec.directory, spec.node_id, spec.fetch, spec.timeout_s = directory, node_id, fetch, timeout_s
        made.append(Replica(spec, num_gpu_blocks=64, page_bytes=PAGE_BYTES, step_s=0.001))
        return made[-1]

    yield make
    for r in made:
        r.shutdown()


def prompt(seed, blocks=8):
    return np.random.default_rng(seed).integers(0, 50_000, blocks * BLOCK_TOKENS)


def test_lookups_are_counted_by_outcome(replicas):
    directory = FakeDirectory()
    a, b = replicas(directory, "node-1"), replicas(directory, "node-1")
    tokens = prompt(1)
    a.serve(tokens)  # one miss ends the scan
    a.serve(tokens)  # 8 local hits
    first = b.serve(tokens)  # the first scan starts 8 promotions, the next ones wait for them
    second = b.serve(tokens)  # loaded once: its own now
    assert first.hit_blocks == second.hit_blocks == 8
    sa, sb = a.manager.stats(), b.manager.stats()
    assert sa.lookups == LookupCounts(local_hit=8, remote_hit=0, miss=1, retry=0)
    # the 8 lookups that started promotions are remote hits; the scans while they ran
    # answered retry or (once a block was in) a local hit, as does the second serve
    assert sb.lookups.remote_hit == 8 and sb.lookups.miss == 0
    assert sb.lookups.local_hit + sb.lookups.retry == 8 * first.retries + 8
    assert sb.lookups.local_hit >= 16
    assert sb.promotions.started == sb.promotions.succeeded == {"same_node": 8, "cross_node": 0}
    assert sb.promotions.bytes["same_node"] == 8 * BLOCK_BYTES
    assert sb.blocks == BlockCounts(stored=0, evicted=0, loaded={"local": 8, "same_node": 8, "cross_node": 0})
    assert sa.blocks.stored == 8
    assert sa.pool == PoolUsage(rows=64, free_rows=56, used_bytes=8 * BLOCK_BYTES, capacity_bytes=64 * BLOCK_BYTES)
    assert len(b.manager.promoter.latencies) == 8


def test_replica_source_exports_the_stats(replicas):
    directory = FakeDirectory()
    a, b = replicas(directory, "node-1"), replicas(directory, "node-2")
    tokens = prompt(2)
    a.serve(tokens)
    keys = block_keys(tokens, BLOCK_TOKENS)  # b's request comes with a router's answer: a holds them
    answer = from_directory("ns0", keys, [list(directory.holders[k].values()) for k in keys])
    b.serve(tokens, kv_transfer_params={PARAMS_KEY: encode(answer)})
    b.manager.link.query_times.append((0, 0.012))  # as a queried link's answered call
    backend = Recorder()
    exporter = Exporter(backend)
    exporter.add(ReplicaSource(b.manager))
    exporter.export()
    stats = b.manager.stats()
    tags = ("ns0", b.spec.replica_id, "node-2")
    assert backend.observed[("distkv_directory_query_seconds", *tags, "0")] == [0.012]
    assert not b.manager.link.query_times  # each observation is exported once
    for outcome, n in asdict(stats.lookups).items():
        assert backend.counters.get(("distkv_lookups", *tags, outcome), 0) == n
    assert backend.counters[("distkv_promotions_succeeded", *tags, "cross_node")] == 8
    assert backend.counters[("distkv_promotion_bytes", *tags, "cross_node")] == 8 * BLOCK_BYTES
    assert len(backend.observed[("distkv_promotion_latency_seconds", *tags, "cross_node")]) == 8
    assert backend.gauges[("distkv_pool_capacity_bytes", *tags)] == 64 * BLOCK_BYTES
    assert backend.gauges[("distkv_pool_used_bytes", *tags)] == 8 * BLOCK_BYTES
    assert backend.gauges[("distkv_promotions_in_flight", *tags)] == 0
    # every cross-node byte came by the object store (the fake spec's only transport), over
    # transfers that took some time
    assert backend.counters[("distkv_transport_bytes", *tags, "object_store")] == 8 * BLOCK_BYTES
    assert backend.counters[("distkv_transport_seconds", *tags, "object_store")] > 0
    assert stats.promotions.transports["object_store"].blocks == 8
    assert backend.counters[("distkv_routed_requests", *tags, "puller")] == 1
    assert backend.counters[("distkv_pull_gate_blocks", *tags, "cross_node", "pull")] == 8


def test_evictions_and_rejected_stores_are_counted(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1", pool_blocks=8)
    a.serve(prompt(3))
    a.serve(prompt(4))  # 8 new blocks push the first 8 out
    ctx = ReqContext("too-big")
    keys = block_keys(prompt(5, blocks=9), BLOCK_TOKENS)
    a.manager.lookup(keys[0], ctx)
    assert a.manager.prepare_store(keys, ctx) is None  # 9 blocks never fit 8 rows
    stats = a.manager.stats()
    assert stats.blocks.stored == 16 and stats.blocks.evicted == 8
    assert stats.errors == {"store_rejected": 1}
    (_, kind, message), = stats.recent_errors
    assert kind == "store_rejected" and "no free or evictable row" in message


def test_failed_promotions_are_counted_by_path_and_kind(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2", fetch=failing_fetch)
    tokens = prompt(6, blocks=4)
    a.serve(tokens)
    assert b.serve(tokens).hit_blocks == 0
    stats = b.manager.stats()
    assert stats.promotions.started["cross_node"] == stats.promotions.failed["cross_node"] == 4
    assert stats.errors == {"promotion_fetch": 4}
    assert stats.lookups.miss >= 4 and stats.lookups.remote_hit == 0
    assert "node agent unreachable" in stats.recent_errors[-1][2]

    # a holder whose pool cannot be read is never started
    c = replicas(directory, "node-3")
    directory.infos.pop(a.spec.replica_id)
    directory.infos.pop(b.spec.replica_id)
    assert c.serve(tokens).hit_blocks == 0
    stats = c.manager.stats()
    assert stats.promotions.started == {"same_node": 0, "cross_node": 0}
    assert stats.errors == {"promotion_no_holder": 4}


def test_handlers_count_bytes_and_time(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    tokens = prompt(7)
    a.serve(tokens)
    a.serve(tokens)
    store, load = (a.worker._routes[t].handler for t in (("GPU", "CPU"), ("CPU", "GPU")))
    assert store.bytes_moved == load.bytes_moved == 8 * BLOCK_BYTES
    assert store.busy_s > 0 and store.jobs_failed == load.jobs_failed == 0
    backend = Recorder()
    exporter = Exporter(backend)
    exporter.add(HandlerSource(store, "node-1"))
    exporter.export()
    tags = (a.spec.namespace, a.spec.replica_id, "node-1", "store", "0")
    assert backend.counters[("distkv_transfer_bytes", *tags)] == 8 * BLOCK_BYTES
    assert backend.counters[("distkv_transfer_seconds", *tags)] == pytest.approx(store.busy_s)
    assert backend.gauges[("distkv_transfer_gbps", *tags)] == pytest.approx(8 * BLOCK_BYTES / store.busy_s / 1e9)


def test_node_agent_source_counts_rows_by_result():
    source = NodeAgentSource("n1")
    source.record(3, [[Sealed(100, 1, ALL_SUB_BLOCKS)], None, [Sealed(50, 2, ALL_SUB_BLOCKS)]])
    source.record(2, None)
    backend = Recorder()
    exporter = Exporter(backend)
    exporter.add(source)
    exporter.export()
    assert backend.counters[("distkv_node_agent_reads", "n1")] == 2
    assert backend.counters[("distkv_node_agent_rows", "n1", "served")] == 2
    assert backend.counters[("distkv_node_agent_rows", "n1", "stale")] == 1
    assert backend.counters[("distkv_node_agent_rows", "n1", "pool_missing")] == 2
    assert backend.counters[("distkv_node_agent_bytes", "n1")] == 150


def test_directory_keeps_reports_and_exports_its_sizes():
    state = DirectoryState()
    info = ReplicaInfo("r1", "n1", "pool-r1", 16, 1, 4096)
    state.register(info)
    key = b"k" * 32 + b"\0\0\0\0"
    state.publish("r1", 1, [(key, 3, 7)], [])
    assert state.set_report("r1", {"lookups": 1}) and not state.set_report("ghost", {})
    with pytest.raises(ValueError, match="not a dict"):
        state.set_report("r1", [1])
    (entry,) = state.replicas()
    assert entry["replica_id"] == "r1" and entry["keys"] == 1 and entry["report"] == {"lookups": 1}
    assert entry["seen_s_ago"] >= 0
    backend = Recorder()
    exporter = Exporter(backend)
    exporter.add(DirectorySource(state, "ns", 0, "n1"))
    exporter.export()
    assert backend.gauges[("distkv_directory_keys", "ns", "0", "n1")] == 1
    assert backend.gauges[("distkv_directory_holders", "ns", "0", "n1")] == 1
    assert backend.gauges[("distkv_directory_replicas", "ns", "0", "n1")] == 1
    assert backend.counters[("distkv_directory_operations", "ns", "0", "n1", "registers")] == 1
    assert backend.counters[("distkv_directory_operations", "ns", "0", "n1", "stored")] == 1


def test_a_shard_s_call_times_are_observed_once_each_by_call():
    source = DirectorySource(DirectoryState(), "ns", 0, "n1")
    source.call_times.extend([("query", 0.0003), ("publish", 0.002), ("query", 0.0004)])
    backend = Recorder()
    exporter = Exporter(backend)
    exporter.add(source)
    exporter.export()
    assert backend.observed[("distkv_directory_call_seconds", "ns", "0", "n1", "query")] == [0.0003, 0.0004]
    assert backend.observed[("distkv_directory_call_seconds", "ns", "0", "n1", "publish")] == [0.002]
    source.call_times.append(("query", 0.0005))
    exporter.export()  # only what came since
    assert backend.observed[("distkv_directory_call_seconds", "ns", "0", "n1", "query")] == [0.0003, 0.0004, 0.0005]
