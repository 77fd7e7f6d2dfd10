"""distkv's metrics: every definition in one place, and the exporter that pushes them to Ray.

Components count in plain ints and attributes on their own threads; on the scheduler's hot
path that is one `+= 1`, nothing more. Each process that runs distkv inside Ray has one
exporter thread: every `EXPORT_INTERVAL_S` it reads the registered sources, turns their
cumulative counts into increments of `ray.util.metrics` counters, sets the gauges and records
the histogram observations gathered since. Ray exports them to Prometheus with the `ray_`
prefix (counters also get `_total`): `MetricDef.exported`. Without Ray nothing is exported
and the components count all the same.

`docs/metrics.md` and `cluster/grafana/distkv-dashboard.json` are checked against `METRICS`
by tests/unit/test_metric_docs.py.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from distkv.names import parse_segment_name

logger = logging.getLogger(__name__)

EXPORT_INTERVAL_S = 1.0
# Histogram observations a component keeps for the exporter at most (older ones are dropped).
MAX_OBSERVATIONS = 4096

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
REPLICA_TAGS = ("namespace", "replica", "node")
SHARD_TAGS = ("namespace", "shard", "node")
PATHS = ("same_node", "cross_node")

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a shard's own time for a call: tenths of a millisecond for a query, more for large publishes
CALL_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric: `name` is what `ray.util.metrics` gets; `exported` is what Prometheus shows."""

    name: str
    kind: str
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        return f"ray_{self.name}_total" if self.kind == COUNTER else f"ray_{self.name}"

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name Prometheus shows for it."""
        if self.kind == HISTOGRAM:
            return tuple(f"{self.exported}_{suffix}" for suffix in ("bucket", "sum", "count"))
        return (self.exported,)


METRICS: dict[str, MetricDef] = {
    m.name: m
    for m in (
        # a replica's scheduler: ClusterOffloadingManager, its Promoter and DirectoryLink
        MetricDef("distkv_lookups", COUNTER,
                  "Lookups by outcome: local_hit (answered True: the block is in this replica's pool), remote_hit "
                  "(started a promotion that succeeded), miss (answered False, or started a promotion that failed), "
                  "retry (answered None: the block's store or promotion is in flight)",
                  REPLICA_TAGS + ("outcome",)),
        MetricDef("distkv_promotions_started", COUNTER,
                  "Promotions started: reads of a block another replica holds, by path", REPLICA_TAGS + ("path",)),
        MetricDef("distkv_promotions_succeeded", COUNTER,
                  "Promotions whose block was copied into this replica's pool and checked", REPLICA_TAGS + ("path",)),
        MetricDef("distkv_promotions_failed", COUNTER,
                  "Promotions started that failed (timeout, read failure, stale or corrupt copy, shutdown)",
                  REPLICA_TAGS + ("path",)),
        MetricDef("distkv_promotions_in_flight", GAUGE,
                  "Promotions submitted and not yet finished", REPLICA_TAGS),
        MetricDef("distkv_promotion_latency_seconds", HISTOGRAM,
                  "Time from a lookup starting a promotion to the block being local, of successful promotions",
                  REPLICA_TAGS + ("path",), LATENCY_BUCKETS_S),
        MetricDef("distkv_promotion_bytes", COUNTER,
                  "Bytes promoted into this replica's pool", REPLICA_TAGS + ("path",)),
        MetricDef("distkv_transport_bytes", COUNTER,
                  "Bytes of cross-node promotions that landed and checked out, by the transport that moved them "
                  "(object_store, nixl)", REPLICA_TAGS + ("transport",)),
        MetricDef("distkv_transport_seconds", COUNTER,
                  "Time cross-node transfers took from start to landing, by transport (concurrent transfers each "
                  "count): bytes over seconds is the transport's rate over its own time", REPLICA_TAGS + ("transport",)),
        MetricDef("distkv_transport_rate_gbps", GAUGE,
                  "The best rate (GB/s) transport `auto` measured reading from `holder_node` by each transport; "
                  "the faster carries that node's promotions", REPLICA_TAGS + ("holder_node", "transport")),
        MetricDef("distkv_routed_requests", COUNTER,
                  "Requests distkv's Serve router sent here with the Directory's answer, by what routing them here "
                  "was: holder (this replica held the prefix), puller (others held it: pulled or recomputed here), "
                  "cold (nobody held it), load_only (the router had no answer: past its deadline, the Directory "
                  "down, no token ids)", REPLICA_TAGS + ("kind",)),
        MetricDef("distkv_pull_gate_blocks", COUNTER,
                  "Blocks held elsewhere that the pull gate let this replica pull (decision=pull) or had it "
                  "recompute because pulling was expected to cost more (decision=skip), by path",
                  REPLICA_TAGS + ("path", "decision")),
        MetricDef("distkv_blocks_stored", COUNTER,
                  "Blocks the engine stored (offloaded) into this replica's pool", REPLICA_TAGS),
        MetricDef("distkv_blocks_evicted", COUNTER,
                  "Blocks evicted from this replica's pool to make room", REPLICA_TAGS),
        MetricDef("distkv_blocks_loaded", COUNTER,
                  "Blocks handed to loads (pool -> GPU), by where they came from: local, same_node, cross_node",
                  REPLICA_TAGS + ("source",)),
        MetricDef("distkv_pool_used_bytes", GAUGE,
                  "Bytes of this replica's pool holding blocks (stored or being stored)", REPLICA_TAGS),
        MetricDef("distkv_pool_capacity_bytes", GAUGE, "Bytes of this replica's pool", REPLICA_TAGS),
        MetricDef("distkv_errors", COUNTER, "Errors by kind (see docs/metrics.md)", REPLICA_TAGS + ("kind",)),
        MetricDef("distkv_directory_event_lag_seconds", HISTOGRAM,
                  "Time from a store or eviction reaching this replica's DirectoryLink to the shard having applied it",
                  REPLICA_TAGS + ("shard",), LAG_BUCKETS_S),
        MetricDef("distkv_directory_query_seconds", HISTOGRAM,
                  "Time from this replica's DirectoryLink sending a shard the keys it missed to the answer standing in its view",
                  REPLICA_TAGS + ("shard",), LAG_BUCKETS_S),
        # a worker's transfer handlers
        MetricDef("distkv_transfer_bytes", COUNTER,
                  "Bytes copied by transfer jobs: store (GPU -> pool), load (pool -> GPU)",
                  REPLICA_TAGS + ("direction", "rank")),
        MetricDef("distkv_transfer_seconds", COUNTER,
                  "Time transfer jobs were busy copying", REPLICA_TAGS + ("direction", "rank")),
        MetricDef("distkv_transfer_gbps", GAUGE,
                  "Throughput (GB/s) of the transfer jobs finished in the last export interval; kept while idle",
                  REPLICA_TAGS + ("direction", "rank")),
        # the Directory shards
        MetricDef("distkv_directory_keys", GAUGE, "Keys held by at least one replica, per shard", SHARD_TAGS),
        MetricDef("distkv_directory_holders", GAUGE, "(key, replica) holder entries, per shard", SHARD_TAGS),
        MetricDef("distkv_directory_replicas", GAUGE, "Replicas registered with the shard", SHARD_TAGS),
        MetricDef("distkv_directory_call_seconds", HISTOGRAM,
                  "Time this shard took for each call, by call: register, publish, publish_many, unregister, query",
                  SHARD_TAGS + ("call",), CALL_BUCKETS_S),
        MetricDef("distkv_directory_operations", COUNTER,
                  "Shard operations by op: registers, unregisters, publishes, ignored_publishes, unknown_publishes, "
                  "stored, removed (keys), queries, queried_keys, snapshots, dropped_replicas, expired_replicas, "
                  "relay_calls, relayed_publishes",
                  SHARD_TAGS + ("op",)),
        # the NodeAgents
        MetricDef("distkv_node_agent_reads", COUNTER, "Read calls a NodeAgent served for other nodes", ("node",)),
        MetricDef("distkv_node_agent_rows", COUNTER,
                  "Rows a NodeAgent was asked for, by result: served, stale (no longer the block asked for), "
                  "pool_missing (the replica's pool is gone)", ("node", "result")),
        MetricDef("distkv_node_agent_bytes", COUNTER, "Bytes of rows a NodeAgent served", ("node",)),
    )
}

DIRECTORY_SIZES = ("keys", "holders", "replicas", "log_entries")


# ---- what sources report to ----------------------------------------------------------


class Collector(Protocol):
    def count(self, name: str, tags: Mapping[str, str], total: float) -> None:
        """A counter's total so far (it only grows)."""

    def gauge(self, name: str, tags: Mapping[str, str], value: float) -> None:
        """A gauge's current value."""

    def observe(self, name: str, tags: Mapping[str, str], value: float) -> None:
        """One observation of a histogram."""


class Source(Protocol):
    def collect(self, out: Collector) -> bool:
        """Report the component's counts to `out`; False once the component is shut down
        (this was its last report)."""


class Backend(Protocol):
    def ready(self) -> bool:
        """Whether it can take values now."""

    def inc(self, metric: MetricDef, tags: Mapping[str, str], value: float) -> None: ...
    def set(self, metric: MetricDef, tags: Mapping[str, str], value: float) -> None: ...
    def observe(self, metric: MetricDef, tags: Mapping[str, str], value: float) -> None: ...


def check_sample(name: str, kind: str, tags: Mapping[str, str]) -> MetricDef:
    """The definition of `name`; ValueError if it is not a `kind` with exactly these tag keys."""
    metric = METRICS.get(name)
    if metric is None:
        raise ValueError(f"no metric {name!r} in distkv.observability.metrics.METRICS")
    if metric.kind != kind:
        raise ValueError(f"metric {name!r} is a {metric.kind}, reported as a {kind}")
    if tags.keys() != set(metric.tag_keys):
        raise ValueError(f"metric {name!r} has tag keys {metric.tag_keys}, reported with {tuple(tags)}")
    return metric


class _Pusher:
    """One source's reports, turned into increments, gauge values and observations."""

    __slots__ = ("_backend", "_totals")

    def __init__(self, backend: Backend, totals: dict[tuple, float]) -> None:
        self._backend = backend
        self._totals = totals

    def count(self, name: str, tags: Mapping[str, str], total: float) -> None:
        metric = check_sample(name, COUNTER, tags)
        key = (name, *(tags[k] for k in metric.tag_keys))
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            self._backend.inc(metric, tags, delta)
        self._totals[key] = total

    def gauge(self, name: str, tags: Mapping[str, str], value: float) -> None:
        self._backend.set(check_sample(name, GAUGE, tags), tags, value)

    def observe(self, name: str, tags: Mapping[str, str], value: float) -> None:
        self._backend.observe(check_sample(name, HISTOGRAM, tags), tags, value)


class Exporter:
    """Reads every registered source each `interval_s` on one thread and pushes to `backend`."""

    def __init__(self, backend: Backend, interval_s: float = EXPORT_INTERVAL_S) -> None:
        self._backend = backend
        self._interval_s = interval_s
        self._lock = threading.Lock()
        # each source with the counter totals it last reported
        self._sources: dict[Source, dict[tuple, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[int] = set()  # sources whose failure was logged

    def add(self, source: Source) -> None:
        with self._lock:
            self._sources.setdefault(source, {})

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="distkv-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after a last export."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval_s + 5.0)

    def export(self) -> None:
        """Read every source once and push what it reported."""
        if not self._backend.ready():  # counts keep growing and go out once it is
            return
        with self._lock:
            sources = list(self._sources.items())
        for source, totals in sources:
            try:
                keep = source.collect(_Pusher(self._backend, totals))
            except Exception:
                if id(source) not in self._failing:  # once, not every interval
                    self._failing.add(id(source))
                    logger.exception("distkv metrics: %r failed to report", source)
                keep = True
            if not keep:
                with self._lock:
                    self._sources.pop(source, None)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.export()
        self.export()


class RayMetrics:
    """The `ray.util.metrics` object of each definition, made on first use."""

    def __init__(self) -> None:
        self._made: dict[str, Any] = {}

    def ready(self) -> bool:
        import ray

        return ray.is_initialized()

    def _metric(self, metric: MetricDef) -> Any:
        made = self._made.get(metric.name)
        if made is None:
            from ray.util import metrics

            if metric.kind == COUNTER:
                made = metrics.Counter(metric.name, metric.description, metric.tag_keys)
            elif metric.kind == GAUGE:
                made = metrics.Gauge(metric.name, metric.description, metric.tag_keys)
            else:
                made = metrics.Histogram(metric.name, metric.description, list(metric.boundaries), metric.tag_keys)
            self._made[metric.name] = made
        return made

    def inc(self, metric: MetricDef, tags: Mapping[str, str], value: float) -> None:
        self._metric(metric).inc(value, dict(tags))

    def set(self, metric: MetricDef, tags: Mapping[str, str], value: float) -> None:
        self._metric(metric).set(value, dict(tags))

    def observe(self, metric: MetricDef, tags: Mapping[str, str], value: float) -> None:
        self._metric(metric).observe(value, dict(tags))


_exporter: Exporter | None = None
_exporter_lock = threading.Lock()


def register(source: Source) -> bool:
    """Export `source` from this process's exporter (started on first use); whether it will be.

    Nothing is exported, and False returned, when this process is not connected to Ray.
    """
    global _exporter
    ray = sys.modules.get("ray")  # not imported: not initialized either
    if ray is None or not ray.is_initialized():
        return False
    with _exporter_lock:
        if _exporter is None:
            _exporter = Exporter(RayMetrics())
            _exporter.start()
        _exporter.add(source)
    return True


def this_node() -> str:
    """The Ray node id of this process ("" outside Ray)."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else ""


# ---- sources -------------------------------------------------------------------------


class ReplicaSource:
    """A replica's scheduler side: its ClusterOffloadingManager's `stats()`, and the
    observations it drained since the last report."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def collect(self, out: Collector) -> bool:
        manager = self._manager
        stats = manager.stats()
        base = {"namespace": stats.namespace, "replica": stats.replica, "node": stats.node}
        for outcome, n in asdict(stats.lookups).items():
            out.count("distkv_lookups", {**base, "outcome": outcome}, n)
        promotions = stats.promotions
        for path in PATHS:
            tags = {**base, "path": path}
            out.count("distkv_promotions_started", tags, promotions.started[path])
            out.count("distkv_promotions_succeeded", tags, promotions.succeeded[path])
            out.count("distkv_promotions_failed", tags, promotions.failed[path])
            out.count("distkv_promotion_bytes", tags, promotions.bytes[path])
        out.gauge("distkv_promotions_in_flight", base, promotions.in_flight)
        for transport, moved in promotions.transports.items():
            out.count("distkv_transport_bytes", {**base, "transport": transport}, moved.bytes)
            out.count("distkv_transport_seconds", {**base, "transport": transport}, moved.seconds)
        for holder_node, rates in promotions.transport_rates.items():
            for transport, rate in rates.items():
                out.gauge("distkv_transport_rate_gbps", {**base, "holder_node": holder_node, "transport": transport}, rate / 1e9)
        observed = manager.drain_observations()
        for path, seconds in observed.promotion_latencies:
            out.observe("distkv_promotion_latency_seconds", {**base, "path": path}, seconds)
        for kind, n in stats.routing.routed.items():
            out.count("distkv_routed_requests", {**base, "kind": kind}, n)
        for path in PATHS:
            out.count("distkv_pull_gate_blocks", {**base, "path": path, "decision": "pull"}, stats.routing.pull_allowed[path])
            out.count("distkv_pull_gate_blocks", {**base, "path": path, "decision": "skip"}, stats.routing.pull_skipped[path])
        blocks = stats.blocks
        out.count("distkv_blocks_stored", base, blocks.stored)
        out.count("distkv_blocks_evicted", base, blocks.evicted)
        for source, n in blocks.loaded.items():
            out.count("distkv_blocks_loaded", {**base, "source": source}, n)
        out.gauge("distkv_pool_used_bytes", base, stats.pool.used_bytes)
        out.gauge("distkv_pool_capacity_bytes", base, stats.pool.capacity_bytes)
        for kind, n in stats.errors.items():
            out.count("distkv_errors", {**base, "kind": kind}, n)
        for shard, seconds in observed.event_lags:
            out.observe("distkv_directory_event_lag_seconds", {**base, "shard": str(shard)}, seconds)
        for shard, seconds in observed.query_times:
            out.observe("distkv_directory_query_seconds", {**base, "shard": str(shard)}, seconds)
        return not manager.closed


class HandlerSource:
    """One transfer handler of a worker: bytes, busy time, throughput and failed jobs."""

    def __init__(self, handler: Any, node: str) -> None:
        self._handler = handler
        namespace, replica = parse_segment_name(handler.pool.name) or ("", handler.pool.name)
        self._base = {"namespace": namespace, "replica": replica, "node": node}
        self._tags = {**self._base, "direction": "store" if handler.gpu_to_pool else "load", "rank": str(handler.rank)}
        self._last = (0, 0.0)
        self._gbps = 0.0

    def collect(self, out: Collector) -> bool:
        handler = self._handler
        closed = handler.closed
        moved, busy = handler.bytes_moved, handler.busy_s
        out.count("distkv_transfer_bytes", self._tags, moved)
        out.count("distkv_transfer_seconds", self._tags, busy)
        last_moved, last_busy = self._last
        if busy > last_busy:
            self._gbps = (moved - last_moved) / (busy - last_busy) / 1e9
        self._last = (moved, busy)
        out.gauge("distkv_transfer_gbps", self._tags, self._gbps)
        kind = "store_failed" if handler.gpu_to_pool else "load_failed"
        out.count("distkv_errors", {**self._base, "kind": kind}, handler.jobs_failed)
        return not closed


class DirectorySource:
    """One Directory shard: its sizes and operation counts, and the time of each call it
    took, which its actor appends to `call_times` as (call, seconds)."""

    def __init__(self, state: Any, namespace: str, shard: int, node: str) -> None:
        self._state = state
        self._tags = {"namespace": namespace, "shard": str(shard), "node": node}
        self.call_times: collections.deque[tuple[str, float]] = collections.deque(maxlen=MAX_OBSERVATIONS)

    def collect(self, out: Collector) -> bool:
        stats = self._state.stats()
        tags = self._tags
        calls = self.call_times
        for _ in range(len(calls)):  # those appended meanwhile go with the next export
            call, seconds = calls.popleft()
            out.observe("distkv_directory_call_seconds", {**tags, "call": call}, seconds)
        out.gauge("distkv_directory_keys", tags, stats["keys"])
        out.gauge("distkv_directory_holders", tags, stats["holders"])
        out.gauge("distkv_directory_replicas", tags, stats["replicas"])
        for op, n in stats.items():
            if op not in DIRECTORY_SIZES:
                out.count("distkv_directory_operations", {**tags, "op": op}, n)
        return True


class NodeAgentSource:
    """What one NodeAgent served. `record` is called from the agent's concurrent calls."""

    def __init__(self, node: str) -> None:
        self._node = node
        self._lock = threading.Lock()
        self.reads = 0
        self.rows = {"served": 0, "stale": 0, "pool_missing": 0}
        self.bytes = 0

    def record(self, num_rows: int, metas: list | None) -> None:
        """One read of `num_rows` rows: `metas` as `read_rows` gave them, None if the pool was gone."""
        if metas is None:
            served, nbytes = 0, 0
        else:
            served = sum(1 for meta in metas if meta is not None)
            nbytes = sum(slot.nbytes for meta in metas if meta is not None for slot in meta)
        with self._lock:
            self.reads += 1
            self.bytes += nbytes
            if metas is None:
                self.rows["pool_missing"] += num_rows
            else:
                self.rows["served"] += served
                self.rows["stale"] += num_rows - served

    def collect(self, out: Collector) -> bool:
        node = {"node": self._node}
        with self._lock:
            reads, rows, nbytes = self.reads, dict(self.rows), self.bytes
        out.count("distkv_node_agent_reads", node, reads)
        for result, n in rows.items():
            out.count("distkv_node_agent_rows", {**node, "result": result}, n)
        out.count("distkv_node_agent_bytes", node, nbytes)
        return True
