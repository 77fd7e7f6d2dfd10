"""How the Directory scales: one shard with millions of keys, and the cluster as replicas grow.

    python bench/scale.py [--keys 1000000,10000000] [--replicas 64,256] [--shards 1,4,16]
        [--seconds 20] [--events-per-s 100] [--requests-per-s 0.2] [--publish relayed,direct]
        [--view-replicas 2,4,8] [--view-seconds 5] [--json PATH] [--model [--from PATH]]

Shard state (no Ray). One DirectoryState is filled, 500-key publishes from 8 replicas
taking turns, to each size of --keys (36-byte keys, one holder each, rows and generations
as a pool hands them out). Every publish is encoded and decoded, as it crosses Ray, so
the state holds its own copy of every object. At each size (rates per CPU second of this
process's thread, so that other processes on the cores do not count, the fastest of 3
passes):
  memory per key   growth of the process's RSS since before the first key, / keys
  publish          events/s of a shard's work for a publish call (decode, apply), each
                   call removing a replica's 500 oldest keys and storing 500 new ones
  worst ms         CPU time of the slowest of those calls: the longest another call to
                   the shard waits behind one publish (a table of holders rebuilding)
  1-dict ms        the baseline: the churn step of 500 keys in which one dict of all the
                   shard's keys rebuilds its table, as the holders once were
  query            keys/s of a shard's work for a query call of 1,000 held keys
  serve            keys/s of a shard's work to send one follower one publish it has not
                   seen (slice the change log, encode), and the encoded bytes per event
Then, at the largest size, the memory of a second holder of a key (another replica
publishes 100k held keys again); and a follower's view (distkv.directory.follower.ShardView) of up
to 1M keys: what it holds on to (tracemalloc, once the applied changes are gone) and how
fast it applies them.

Lightweight replicas (ray.cluster_utils.Cluster: a head and 3 simulated nodes; the
shards spread over them as `get_or_create_shards` places them). For each --shards and
each --replicas count, a fresh namespace's shards and 4 generator processes (one per node)
hosting the replicas: a `LoadGenerator` each, whose replicas publish through the
product's `Publisher` (one per shard, stepped every 2 s: a publish per replica per shard
per flush, doubling as its heartbeat) and ask `query` like replicas that miss and follow
no view (one call per shard a request's keys touch, over the shard's query channel,
connected before the load). With --publish relayed (the default,
what queried replicas do) a process's replicas publish through one `PublishRelay` in the
process, as a node's through its NodeAgent's (the hop from a replica to its agent is the
node's cost: bench/relay.py); with direct, each to every shard; each path is measured in
turn at every point. Two cores cannot offer the model's
rates: each replica offers --events-per-s stores and evictions and --requests-per-s
requests of 90 keys, and the output says so beside the model's. Each point: a wait for
a quiet machine (under 0.3 busy cores, 60 s at most: the point before may leave work
behind), the shards' CPU per stats call, per one-key query over the channel and idle CPU for 2 s, fill (every replica registers 2,048 held keys
and heartbeats from then on), then --seconds of load and a drain:
  events           offered by the generators, applied by the shards (their stats), lost
                   ("?" where replicas registered again: their keys count as applied too)
  Directory CPU    cores of all shard processes (psutil), of the busiest, idle; per
                   applied event, per call (every register, publish and query)
  query            wall time from a request's first call to its last answer, p50 and
                   p99, in the generator processes (each runs at a 1 ms GIL slice: it
                   hosts many replicas, which would be processes of their own); calls per
                   request; keys that hit
  gen late         how late the generators' 50 ms steps ran, p99 and max: far behind,
                   the load went out later than offered
  machine          cores busy (all processes), and the share of the CPU time the
                   virtual machine's host took for others (steal); how long a shard's
                   threads waited for a CPU per second (Linux's schedstat)
  model            the Directory's cores predicted by docs/scale.md's model from the
                   offered load, with the cost per stats call and with the cost per Ray
                   call fitted to the points (queries at the cost per channel query); the
                   CPU per event at the model's rates
A point whose changes do not all land within 120 s (DRAIN_TIMEOUT_S) is printed as not
measured, with why, and the run goes on.
--model: the model's shards and CPU for 1,000 replicas and 100M blocks from the inputs
this run measured, or with --from PATH from an earlier run's --json (no measuring).

View replicas (--view-replicas; none by default). A head node (the Directory: 1 shard)
and one simulated node per replica; each replica is an actor with a real
ClusterOffloadingSpec (its pool, DirectoryLink following pushed views, the node's
NodeAgent). Their number grows through --view-replicas, earlier replicas staying. At each
count every replica stores 64 new blocks 20 times a second into a full pool (64 stored and
64 evicted events a cycle) for --view-seconds, while:
  Directory events/s   stored+removed keys the shard applied, per second, beside the
                       events the replicas offered
  Directory CPU        cores the shard's process used, CPU us per applied event, the
                       publish calls it took per second; and before the churn, its CPU
                       per call of a method that does almost nothing (Ray's cost per call)
  view update          from replica 0's prepare_store of a block to replica 1's view
                       holding it (p50, p99), beside one actor call's round trip
  CPU per replica      cores each replica's process used (all its threads: churn,
                       DirectoryLink, Ray's), replica 1 (the watcher) left out
Everything runs on one machine: the replicas, the Directory and every node's Ray
processes share its cores.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import hashlib
import json
import math
import os
import random
import resource
import statistics
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import psutil  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from distkv.abstract import ReqContext, make_offload_key  # noqa: E402
from distkv.demo.runner import token_auth_on  # noqa: E402
from distkv.directory.records import Changes, Cursor, ReplicaInfo  # noqa: E402
from distkv.directory.state import DirectoryState  # noqa: E402
from distkv.directory.publisher import DirectPublish, PublishPath, Publisher  # noqa: E402
from distkv.directory.follower import ShardView  # noqa: E402
from distkv.directory.placement import shard_of  # noqa: E402
from distkv.directory.wire import decode_answer, encode_answer  # noqa: E402
from distkv.directory.upkeep import YOUNG_COLLECTION_KEYS, ShardCollections, defer_full_collections  # noqa: E402
from distkv.directory.wire import decode_changes, decode_feed, encode_changes, encode_feed  # noqa: E402
from distkv.observability.errors import ErrorLog  # noqa: E402
from distkv.names import segment_name  # noqa: E402
from distkv.directory.query_channel import QueryChannel  # noqa: E402
from distkv.replica.specs import ClusterOffloadingSpec  # noqa: E402
from distkv.directory.relay import PublishRelay  # noqa: E402
from ray_actors.directory import ShardActorClient, get_or_create_shards, kill_shards, shard_clients  # noqa: E402

MiB = 1 << 20
CHUNK = 500  # keys stored (and removed) per publish call
STATE_REPLICAS = 8
QUERY_BATCH = 1000
TIMED_CALLS = 400
# A state cost is the fastest of this many timed passes: another process on a shared
# machine (its caches, its memory bandwidth) only ever slows a pass down.
STATE_PASSES = 3
EXTRA_HOLDERS = 100_000
VIEW_KEYS = 1_000_000
ROWS = 1 << 20  # rows of each registered replica's pool
_MIX = 0x9E3779B97F4A7C15
_TAIL = hashlib.sha256(b"distkv-scale").digest()[:24] + (0).to_bytes(4, "big")

CHURN_BATCH = 64
CHURN_CYCLES_PER_S = 20
CHURN_ROWS = 4096
PROBE_EVERY = 5  # cycles
PAGE_BYTES = 4 << 10


def key(i: int) -> bytes:
    """The i-th key: a hash-like 8 leading bytes (as a block hash has), 36 bytes in all.

    The product's `shard_of` takes the leading bytes modulo the shard count, so their low
    bits must depend on all of i, as a hash's do: a product with an odd constant alone
    keeps i's parity there, and the even-numbered keys that begin prefixes of an even
    length would all fall on the even-numbered shards."""
    mixed = (i * _MIX) & 0xFFFF_FFFF_FFFF_FFFF
    return (mixed ^ (mixed >> 32)).to_bytes(8, "big") + _TAIL


def chunk_payload(chunk: int, removed_chunk: int | None) -> bytes:
    """An encoded publish: the keys of `chunk` stored, those of `removed_chunk` removed."""
    start = chunk * CHUNK
    stored = [(key(i), i % ROWS, 1_700_000_000_000_000_000 + i) for i in range(start, start + CHUNK)]
    removed = [] if removed_chunk is None else [key(i) for i in range(removed_chunk * CHUNK, (removed_chunk + 1) * CHUNK)]
    return encode_changes(stored, removed)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


class StateBench:
    """One DirectoryState grown chunk by chunk; chunk c belongs to replica c % STATE_REPLICAS.
    Its garbage is collected as a shard's is (`ShardCollections`)."""

    def __init__(self) -> None:
        self.rss_empty = rss()
        self.state = DirectoryState()
        self.collections = ShardCollections(time.monotonic())
        for r in range(STATE_REPLICAS):
            self.state.register(ReplicaInfo(f"r{r}", f"node{r}", f"pool{r}", ROWS, 1, 4096))
        self.seq = collections.Counter()
        self.first = 0  # oldest chunk held
        self.end = 0  # next chunk to store

    @property
    def keys(self) -> int:
        return (self.end - self.first) * CHUNK

    def publish(self, payload: bytes, replica: int) -> None:
        """The shard's work for one publish call."""
        stored, removed = decode_changes(payload, "publish")
        name = f"r{replica}"
        self.seq[name] += 1
        self.state.publish(name, self.seq[name], stored, removed)
        self.collections.stored(self.state.stored_keys)

    def grow(self, keys: int) -> None:
        while self.keys < keys:
            self.publish(chunk_payload(self.end, None), self.end % STATE_REPLICAS)
            self.end += 1

    def publish_rate(self, calls: int) -> tuple[float, float]:
        """(events/s, CPU seconds of the slowest call) of publish calls that each store a
        chunk and remove the oldest one.

        Keeps the size: the new chunk belongs to the replica of the removed one as long as
        the number of chunks held is a multiple of STATE_REPLICAS."""
        payloads = [chunk_payload(self.end + i, self.first + i) for i in range(calls)]
        replicas = [(self.first + i) % STATE_REPLICAS for i in range(calls)]
        clock = time.thread_time
        worst = 0.0
        start = clock()
        for payload, replica in zip(payloads, replicas):
            called = clock()
            self.publish(payload, replica)
            worst = max(worst, clock() - called)
        elapsed = clock() - start
        self.first += calls
        self.end += calls
        return calls * 2 * CHUNK / elapsed, worst

    def query_rate(self, calls: int) -> float:
        """Keys/s of query calls of QUERY_BATCH held keys each (the answer encoded)."""
        rng = random.Random(calls)
        batches = [
            [key(rng.randrange(self.first * CHUNK, self.end * CHUNK)) for _ in range(QUERY_BATCH)] for _ in range(calls)
        ]
        answer_of = self.state.answer
        start = time.thread_time()
        for batch in batches:
            answer = encode_answer(*answer_of(batch))
        elapsed = time.thread_time() - start
        if not all(decode_answer(answer, QUERY_BATCH)[0]):
            raise RuntimeError("a held key has no holder")
        return calls * QUERY_BATCH / elapsed

    def serve_rate(self, calls: int) -> tuple[float, float]:
        """(keys/s, bytes per key) of serving a follower one publish it has not seen: the
        shard's work for a `changes` call (slice the log, encode), once per follower."""
        cursor = self.state.cursor()
        self.publish(chunk_payload(self.end, self.first), self.first % STATE_REPLICAS)
        self.first += 1
        self.end += 1
        changes = self.state.changes
        start = time.thread_time()
        for _ in range(calls):
            data = encode_feed(changes(cursor))
        elapsed = time.thread_time() - start
        return calls * 2 * CHUNK / elapsed, len(data) / (2 * CHUNK)

    def extra_holder_bytes(self, keys: int) -> float:
        """Bytes per key of a second holder: another replica publishes `keys` held keys again."""
        before = rss()
        name = "second"
        self.state.register(ReplicaInfo(name, "node-second", "pool-second", ROWS, 1, 4096))
        first = self.first * CHUNK
        for seq, start in enumerate(range(first, first + keys, CHUNK), 1):
            entries = [(key(i), i % ROWS, 1_800_000_000_000_000_000 + i) for i in range(start, start + CHUNK)]
            stored, removed = decode_changes(encode_changes(entries, []), "publish")
            self.state.publish(name, seq, stored, removed)
        return (rss() - before) / keys


def one_dict_rebuild_s(first: int, end: int) -> float:
    """CPU seconds of the churn step (the oldest chunk removed, a new one stored) in which
    one dict of the holders of keys [first, end) rebuilds its table: what a shard would stop
    for if its holders were one dict, the baseline of the state's slowest publish."""
    holders = {key(i): (("r0", "node0", i % ROWS, 1),) for i in range(first, end)}
    table = sys.getsizeof(holders)
    while True:
        removed = [key(i) for i in range(first, first + CHUNK)]
        stored = [(key(i), (("r0", "node0", i % ROWS, 1),)) for i in range(end, end + CHUNK)]
        start = time.thread_time()
        for gone, (new, holder) in zip(removed, stored):
            del holders[gone]
            holders[new] = holder
        elapsed = time.thread_time() - start
        first, end = first + CHUNK, end + CHUNK
        if sys.getsizeof(holders) != table:
            return elapsed


def view_figures(keys: int) -> dict[str, float]:
    """A follower's ShardView of `keys` keys (one holder each): the bytes per key of all it
    holds on to (traced once the applied changes are gone), and keys/s applied."""
    entries = [(key(i), i % ROWS, 1_700_000_000_000_000_000 + i) for i in range(keys)]
    data = encode_feed(Changes(Cursor("epoch", 1, 1), [("r0", "node0", entries, [])], {}, False))
    del entries
    changes = decode_feed(data)
    view = ShardView(exclude="me")
    start = time.thread_time()
    view.apply(changes)
    apply_s = time.thread_time() - start
    del view, changes
    gc.collect()
    tracemalloc.start()
    try:
        changes = decode_feed(data)
        view = ShardView(exclude="me")
        view.apply(changes)
        del changes
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    if len(view.holders) != keys:
        raise RuntimeError(f"the view holds {len(view.holders)} keys, not {keys}")
    return {"bytes_per_key": traced / keys, "apply_keys_per_s": keys / apply_s}


def state_scale(sizes: list[int], calls: int = TIMED_CALLS) -> dict[str, Any]:
    """The shard-state figures at each size (ascending), then the second-holder and view
    figures; with full garbage collections deferred, as a shard's process defers them."""
    defer_full_collections()
    bench = StateBench()
    per_size = []
    for size in sizes:
        if size % (CHUNK * STATE_REPLICAS):
            raise ValueError(f"--keys {size}: must be a multiple of {CHUNK * STATE_REPLICAS}")
        started = time.perf_counter()
        bench.grow(size)
        fill_s = time.perf_counter() - started
        memory = rss() - bench.rss_empty
        # rss's full collection untracked the holder tables, which the next young collection
        # visits whole once (as in a shard after each of its full ones): the passes time the
        # churn in between
        bench.publish_rate(YOUNG_COLLECTION_KEYS // CHUNK + 1)
        publishes = [bench.publish_rate(calls) for _ in range(STATE_PASSES)]
        per_size.append(
            {
                "keys": bench.keys,
                "rss_bytes": memory,
                "bytes_per_key": memory / bench.keys,
                "fill_s": fill_s,
                "publish_events_per_s": max(rate for rate, _ in publishes),
                # the longest a call to the shard could wait behind one publish
                "publish_worst_ms": max(worst for _, worst in publishes) * 1e3,
                "one_dict_rebuild_ms": one_dict_rebuild_s(bench.first * CHUNK, bench.end * CHUNK) * 1e3,
                "query_keys_per_s": max(bench.query_rate(calls) for _ in range(STATE_PASSES)),
            }
        )
        serve = [bench.serve_rate(calls) for _ in range(STATE_PASSES)]
        per_size[-1]["serve_keys_per_s"] = max(rate for rate, _ in serve)
        per_size[-1]["wire_bytes_per_event"] = serve[-1][1]
    extra = bench.extra_holder_bytes(min(EXTRA_HOLDERS, bench.keys))
    del bench
    gc.collect()
    view = view_figures(min(VIEW_KEYS, max(sizes)))
    marginal = None
    if len(per_size) > 1:
        a, b = per_size[0], per_size[-1]
        marginal = (b["rss_bytes"] - a["rss_bytes"]) / (b["keys"] - a["keys"])
    return {
        "sizes": per_size,
        "marginal_bytes_per_key": marginal,
        "extra_holder_bytes_per_key": extra,
        "view_bytes_per_key": view["bytes_per_key"],
        "view_apply_keys_per_s": view["apply_keys_per_s"],
        "view_keys": min(VIEW_KEYS, max(sizes)),
    }


# ---- replicas on simulated nodes ---------------------------------------------------------


def churn_key(name: str, i: int) -> bytes:
    return make_offload_key(hashlib.sha256(f"{name}-{i}".encode()).digest(), 0)


@ray.remote(num_cpus=0)
class ChurnReplica:
    """A replica that stores CHURN_BATCH new blocks CHURN_CYCLES_PER_S times a second, on a
    background thread, into a full pool; replica 1 also watches replica 0's probes."""

    def __init__(self, name: str, salt: str) -> None:
        self.name = name
        self.spec = ClusterOffloadingSpec.from_layout(
            {"cpu_bytes_to_use": CHURN_ROWS * 2 * PAGE_BYTES, "tenant_salt": salt},
            gpu_block_sizes=[16],
            group_page_bytes=[2 * PAGE_BYTES],
            engine_id=name,
        )
        self.manager = self.spec.get_manager()
        self.ctx = ReqContext("churn")
        self.next_key = 0
        self.thread: threading.Thread | None = None
        self.result: dict[str, Any] = {}
        for _ in range(CHURN_ROWS // CHURN_BATCH):  # fill the pool: from now on every store evicts
            self._cycle()

    def namespace(self) -> str:
        return self.manager.link.namespace

    def ping(self) -> None:
        return None

    def _cycle(self) -> float:
        keys = [churn_key(self.name, self.next_key + j) for j in range(CHURN_BATCH)]
        self.next_key += CHURN_BATCH
        start = time.monotonic()
        out = self.manager.prepare_store(keys, self.ctx)
        if out is None:
            raise RuntimeError("prepare_store found nothing to evict")
        self.manager.complete_store(out.keys_to_store, self.ctx)
        for _ in self.manager.take_events():
            pass
        return start

    def start(self, seconds: float) -> int:
        """Start churning for `seconds`; returns the index of the first key it will store."""
        first = self.next_key
        self.thread = threading.Thread(target=self._churn, args=(seconds,), daemon=True)
        self.thread.start()
        return first

    def _churn(self, seconds: float) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0 = usage.ru_utime + usage.ru_stime
        start = time.monotonic()
        probes = []
        cycles = 0
        while time.monotonic() < start + seconds:
            first = self.next_key
            t0 = self._cycle()
            if cycles % PROBE_EVERY == 0:
                probes.append((first, t0))
            cycles += 1
            time.sleep(max(0.0, start + cycles / CHURN_CYCLES_PER_S - time.monotonic()))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.monotonic() - start
        self.result = {"cycles": cycles, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime - cpu0, "probes": probes}

    def finish(self) -> dict[str, Any]:
        self.thread.join()
        return self.result

    def watch(self, writer: str, firsts: list[int], seconds: float) -> dict[int, float]:
        """When (time.monotonic) each of `writer`'s keys `firsts` became visible in this
        replica's view, those seen within `seconds`."""
        holders = self.manager.link.holders
        pending = {first: churn_key(writer, first) for first in firsts}
        seen: dict[int, float] = {}
        deadline = time.monotonic() + seconds
        while pending and time.monotonic() < deadline:
            for first, probe in list(pending.items()):
                if holders(probe):
                    seen[first] = time.monotonic()
                    del pending[first]
            time.sleep(0.0002)
        return seen

    def shutdown(self) -> None:
        self.manager.shutdown()
        self.spec.close()


def replicas_scale(counts: list[int], seconds: float) -> list[dict[str, Any]]:
    """Per replica count: Directory events/s, view-update latency, CPU per replica."""
    token_auth_on()
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 100 * MiB, "include_dashboard": False},
    )
    salt = uuid.uuid4().hex
    replicas: list = []
    namespace = None
    rows = []
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=80 * MiB) for _ in range(max(counts))]
        cluster.wait_for_nodes()
        for count in counts:
            new = [
                ChurnReplica.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i].node_id, soft=False)).remote(f"r{i}", salt)
                for i in range(len(replicas), count)
            ]
            replicas += new
            namespace = ray.get(replicas[0].namespace.remote())
            ray.get([r.ping.remote() for r in new])
            (shard,) = get_or_create_shards(namespace, 1)
            deadline = time.monotonic() + 120
            while ray.get(shard.stats.remote())["keys"] < count * CHURN_ROWS:  # the new pools' blocks
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Directory never held the {count * CHURN_ROWS} blocks of {count} full pools")
                time.sleep(0.1)
            time.sleep(1.0)  # and every view has them
            pings = []
            for _ in range(50):
                t = time.perf_counter()
                ray.get(replicas[1].ping.remote())
                pings.append(time.perf_counter() - t)
            shard_proc = shard_process()
            per_call = call_cpu(shard, [shard_proc])
            before = ray.get(shard.stats.remote())
            shard_cpu = cpu_seconds(shard_proc)
            window = time.monotonic()
            firsts = ray.get([r.start.remote(seconds) for r in replicas])
            probes = range(firsts[0], firsts[0] + CHURN_BATCH * (int(seconds * CHURN_CYCLES_PER_S) + 1), CHURN_BATCH * PROBE_EVERY)
            seen_ref = replicas[1].watch.remote("r0", list(probes), seconds + 2.0)
            results = ray.get([r.finish.remote() for r in replicas])
            shard_cores = (cpu_seconds(shard_proc) - shard_cpu) / (time.monotonic() - window)
            after = ray.get(shard.stats.remote())
            seen = ray.get(seen_ref)
            delays = [seen[first] - t0 for first, t0 in results[0]["probes"] if first in seen]
            events = sum(after.get(k, 0) - before.get(k, 0) for k in ("stored", "removed"))
            publishes = sum(after.get(k, 0) - before.get(k, 0) for k in ("publishes", "ignored_publishes"))
            wall = max(r["wall_s"] for r in results)
            cpu = [r["cpu_s"] / r["wall_s"] for i, r in enumerate(results) if i != 1]
            q = statistics.quantiles(delays, n=100, method="inclusive") if len(delays) > 1 else [float("nan")] * 99
            rows.append(
                {
                    "replicas": count,
                    "directory_events_per_s": events / wall,
                    "offered_events_per_s": sum(2 * CHURN_BATCH * r["cycles"] for r in results) / wall,
                    "view_update_p50_ms": q[49] * 1e3,
                    "view_update_p99_ms": q[98] * 1e3,
                    "probes": len(results[0]["probes"]),
                    "probes_seen": len(delays),
                    "actor_call_p50_ms": statistics.median(pings) * 1e3,
                    "cpu_per_replica": statistics.mean(cpu),
                    "directory_cores": shard_cores,
                    "directory_publishes_per_s": publishes / wall,
                    "directory_cpu_us_per_call": per_call * 1e6,
                    "directory_cpu_us_per_event": shard_cores / (events / wall) * 1e6 if events else None,
                    "directory_keys": after["keys"],
                }
            )
    finally:
        if replicas:
            ray.get([r.shutdown.remote() for r in replicas], timeout=60)
        if namespace is not None:
            kill_shards(namespace)
        ray.shutdown()
        cluster.shutdown()
    return rows


def shard_process() -> psutil.Process:
    """The Directory shard's worker process: the raylet that forked it is a child of this driver."""
    for process in psutil.Process().children(recursive=True):
        try:
            if "DirectoryShard" in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            continue
    raise RuntimeError("no DirectoryShard process among this driver's descendants")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def cpu_wait_seconds(process: psutil.Process) -> float:
    """Seconds the threads of `process` have waited on a run queue for a CPU (Linux's
    schedstat), 0 where the system does not say."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{process.pid}/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/{process.pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def call_cpu(shard, processes: list[psutil.Process], calls: int = 2000) -> float:
    """CPU seconds the shards' `processes` spend per call to `shard` that does almost
    nothing (stats): what Ray costs a shard for any call, 100 calls in flight at a time."""
    ray.get(shard.stats.remote())
    before = sum(cpu_seconds(p) for p in processes)
    for _ in range(calls // 100):
        ray.get([shard.stats.remote() for _ in range(100)])
    return (sum(cpu_seconds(p) for p in processes) - before) / (calls // 100 * 100)


def connect_channels(channels: Sequence[QueryChannel]) -> None:
    """Connect shards' query channels, which a replica's first query to each would do (that
    query going through Ray), and wait until they are: a run measures the steady state."""
    for channel in channels:
        channel.connect()
    while any(channel.connecting for channel in channels):
        time.sleep(0.01)
    failed = [channel.last_error for channel in channels if not channel.connected]
    if failed:
        raise RuntimeError(f"{len(failed)} query channels did not connect: {failed[:3]}")


def channel_query_cpu(shard, namespace: str, processes: list[psutil.Process], calls: int = 2000) -> float:
    """CPU seconds the shards' `processes` spend per query over `shard`'s query channel
    that asks almost nothing (one key no one holds): what the channel costs a shard for a
    query besides its keys, 100 queries in flight at a time."""
    client = ShardActorClient(shard, namespace)
    try:
        connect_channels([client.channel])
        before = sum(cpu_seconds(p) for p in processes)
        for _ in range(calls // 100):
            futures = [client.channel.query([key(0)]) for _ in range(100)]
            for future in futures:
                future.result()
        return (sum(cpu_seconds(p) for p in processes) - before) / (calls // 100 * 100)
    finally:
        client.close()


# ---- lightweight replicas: a load generator ----------------------------------------------

# The model's rates per replica (docs/scale.md): what a replica would offer at full load.
MODEL_EVENTS_PER_S = 1250
MODEL_REQUESTS_PER_S = 20_000 / 2048
MODEL_QUERY_KEYS = 90
GENERATOR_TICK_S = 0.05  # a scheduler step: when a generator's replicas store, evict and ask
DRAIN_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class LoadRates:
    """What each lightweight replica offers: `events_per_s` stores and evictions together
    (half each), `requests_per_s` requests that each miss `query_keys` keys locally; it
    holds its `held` newest keys and publishes every `flush_s`."""

    events_per_s: float
    requests_per_s: float
    query_keys: int
    flush_s: float
    held: int

    def __post_init__(self) -> None:
        if not (self.events_per_s >= 0 and self.requests_per_s >= 0 and self.flush_s > 0):
            raise ValueError(f"{self}: rates must be >= 0 and flush_s > 0")
        if not (self.query_keys >= 1 and self.held > 2 * self.query_keys + self.events_per_s * self.flush_s):
            raise ValueError(
                f"{self}: held must exceed two requests of query_keys and two flush intervals of stores, so that a "
                "request's keys are published"
            )


def load_key(replica: int, i: int) -> bytes:
    """The i-th key lightweight replica `replica` stores (36 bytes, hash-like leading bytes)."""
    return key((replica << 32) | i)


class LoadGenerator:
    """Many lightweight replicas of one cache namespace in one process, publishing and
    querying the Directory as replicas do, with no model and no pool.

    Replica `index` registers a `ReplicaInfo` of a fake pool of `rates.held` rows and
    holds its `held` newest keys: each new key it stores evicts its oldest, at
    `events_per_s` / 2 each a second. Its changes go through the product's `Publisher`, one
    per shard, each stepped once every `flush_s` (the replicas' phases spread over the
    interval), so that one publish per shard carries a flush interval's changes and is the
    heartbeat too. A replica's keys come in prefixes of `query_keys`, each placed on the
    shard of its first key, as replicas place a request's prefix. A request asks about the
    oldest whole prefix the next replica of the process holds (stored more than two flush
    intervals ago, so each key should hit): one `query` call, to the shard of that prefix
    (one per shard its keys live on), the request answered when the last lands.

    Accounting: `offered` counts the stores and evictions handed to the publishers and the
    requests, calls and keys sent; `answers` collects (request, time.monotonic(), hits)
    per query call, from whichever thread completes its Future. `step(now)` does the
    rest, from one thread; `drained` says when every change has been published.
    """

    def __init__(
        self, namespace: str, node_id: str, replicas: Sequence[int], clients: Sequence[Any], rates: LoadRates,
        clock: Callable[[], float] = time.monotonic, path: PublishPath | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("LoadGenerator: no replicas")
        self.namespace = namespace
        self.rates = rates
        self.clock = clock
        self.replicas = list(replicas)
        self.num_shards = len(clients)
        self.clients = list(clients)
        # how the replicas' publishes reach the shards: each shard itself, or a relay
        self.path = DirectPublish(clients, namespace) if path is None else path
        self.errors = ErrorLog()
        self.publishers: list[list[Publisher]] = []
        for index in self.replicas:
            name = f"load{index}"
            info = ReplicaInfo(name, node_id, segment_name(namespace, name), rates.held, 1, PAGE_BYTES)
            self.publishers.append([
                Publisher(
                    s, client, namespace, info,
                    wake=_no_wake, errors=self.errors, event_lags=collections.deque(maxlen=1), path=self.path,
                )
                for s, client in enumerate(clients)
            ])
        self.next_key = [0] * len(self.replicas)
        self.offered = collections.Counter()
        self.answers: list[tuple[int, float, int]] = []
        self.sent_at: list[float] = []  # per request
        self.calls_of: list[int] = []  # per request: its query calls
        self._started = 0.0
        self._stores_done = 0
        # per publisher, its last call that carried changes (a heartbeat carries none)
        self._carrying: dict[Publisher, Future] = {}
        self._flush_at: list[float] = []
        self._request_at: list[float] = []

    def fill(self, now: float) -> None:
        """Every replica stores `held` keys (not counted as offered) and starts publishing,
        one after another; those registered heartbeat meanwhile, as live replicas do,
        however long the others of the process take to register."""
        self._started = now
        n = len(self.replicas)
        self._flush_at = [float("inf")] * n
        for r in range(n):
            self._store(r, self.rates.held, self.clock())
            for publisher in self.publishers[r]:
                self._step(publisher, self.clock())
            self._flush_at[r] = now + self.rates.flush_s * r / n
            self.step(self.clock(), offer=False)

    def start(self, now: float) -> None:
        """Start offering load from `now` (after `fill` and a drain)."""
        self._started = now
        self._stores_done = 0
        n = len(self.replicas)
        period = 1.0 / self.rates.requests_per_s if self.rates.requests_per_s else float("inf")
        self._request_at = [now + period * (r + 0.5) / n for r in range(n)]

    def step(self, now: float, offer: bool = True) -> None:
        """Store, evict and ask what is due by `now` (if `offer`), and publish for the
        replicas whose flush is due."""
        if offer:
            due = int((now - self._started) * self.rates.events_per_s / 2)
            if due > self._stores_done:
                for r in range(len(self.replicas)):
                    self._store(r, due - self._stores_done, now, evict=True)
                self._stores_done = due
            period = 1.0 / self.rates.requests_per_s if self.rates.requests_per_s else float("inf")
            for r, at in enumerate(self._request_at):
                while at <= now:
                    self._request(r)
                    at += period
                self._request_at[r] = at
        for r, at in enumerate(self._flush_at):
            if at <= now:
                for publisher in self.publishers[r]:
                    self._step(publisher, now)
                self._flush_at[r] = at + self.rates.flush_s * (1 + (now - at) // self.rates.flush_s)

    def step_busy(self, now: float) -> None:
        """Step now every publisher that has changes to publish or a call to make again
        (draining: without waiting for the flush interval; `step(now, offer=False)` keeps
        the others' heartbeats going meanwhile)."""
        for publishers in self.publishers:
            for publisher in publishers:
                if _busy(publisher):
                    self._step(publisher, now)

    @property
    def drained(self) -> bool:
        """Whether every change handed to the publishers has been applied by its shard
        (heartbeats may still be in flight)."""
        return not any(_busy(p) for publishers in self.publishers for p in publishers) and all(
            future.done() for future in self._carrying.values()
        )

    def _step(self, publisher: Publisher, now: float) -> None:
        carries = _busy(publisher)
        before = publisher.publishing
        publisher.step(now)
        if carries and publisher.publishing is not None and publisher.publishing is not before:
            self._carrying[publisher] = publisher.publishing

    def _shard(self, index: int, i: int) -> int:
        """The shard of replica `index`'s i-th key: that of its prefix's first key."""
        return shard_of(load_key(index, i - i % self.rates.query_keys), self.num_shards)

    def _store(self, r: int, count: int, now: float, evict: bool = False) -> None:
        index, publishers, held = self.replicas[r], self.publishers[r], self.rates.held
        first = self.next_key[r]
        touched = set()
        for i in range(first, first + count):
            s = self._shard(index, i)
            publishers[s].store(load_key(index, i), i % held, i)
            touched.add(s)
            if evict:
                s = self._shard(index, i - held)
                publishers[s].remove(load_key(index, i - held))
                touched.add(s)
        self.next_key[r] = first + count
        if evict:
            self.offered["stored"] += count
            self.offered["removed"] += count
        for s in touched:
            publishers[s].queued(now, now, lagged=True)

    def _request(self, r: int) -> None:
        target = (r + 1) % len(self.replicas)
        start = self.next_key[target] - self.rates.held
        start += -start % self.rates.query_keys  # the oldest whole prefix
        index = self.replicas[target]
        by_shard: dict[int, list[bytes]] = collections.defaultdict(list)
        for i in range(start, start + self.rates.query_keys):
            by_shard[self._shard(index, i)].append(load_key(index, i))
        keys = [k for shard_keys in by_shard.values() for k in shard_keys]
        request = len(self.sent_at)
        self.sent_at.append(self.clock())
        self.calls_of.append(len(by_shard))
        self.offered["requests"] += 1
        self.offered["query_calls"] += len(by_shard)
        self.offered["query_keys"] += len(keys)
        answers, clock = self.answers, self.clock
        for s, shard_keys in by_shard.items():
            future = self.clients[s].query(shard_keys, self.namespace)
            future.add_done_callback(
                lambda f, request=request, asked=len(shard_keys): answers.append((request, clock(), _hits(f, asked)))
            )

    def latencies(self) -> list[float]:
        """Seconds from each answered request's sending to its last answer."""
        last: dict[int, float] = {}
        calls = collections.Counter()
        for request, at, _ in list(self.answers):
            calls[request] += 1
            last[request] = max(last.get(request, 0.0), at)
        return [last[q] - self.sent_at[q] for q in last if calls[q] == self.calls_of[q]]

    def summary(self) -> dict[str, Any]:
        """What was offered, and what the answers said: requests answered, keys hit, failed calls."""
        answers = list(self.answers)
        return {
            **self.offered,
            "answered_calls": sum(1 for _, _, hits in answers if hits >= 0),
            "failed_calls": sum(1 for _, _, hits in answers if hits < 0),
            "hits": sum(hits for _, _, hits in answers if hits > 0),
            "publish_errors": self.errors.counts().get("directory_publish", 0),
        }


def _busy(publisher: Publisher) -> bool:
    """Whether `publisher` has changes to publish, or to publish again: pending ones, a
    batch or register to send again, or a finished call that failed or found the shard
    not knowing the replica."""
    if publisher.pending or publisher.failed_batch is not None or publisher.resync_at is not None:
        return True
    future = publisher.publishing
    if future is None or not future.done():
        return False
    if future.exception() is not None:
        return True
    _, known, _ = future.result()
    return not known


def _no_wake() -> None:
    """A generator's publishers are stepped on its schedule, not woken by their calls."""


def _hits(future: Future, asked: int) -> int:
    """Keys of a query call's answer (to `asked` keys) that have a holder; -1 if the call failed."""
    try:
        return sum(1 for holders in decode_answer(future.result(), asked)[0] if holders)
    except Exception:
        return -1


GENERATOR_PROCESSES = 4
GENERATOR_NODES = 3  # simulated nodes besides the head; shards and generator processes spread over all four
# A generator process hosts many replicas, each of which would be a process of its own: at
# Python's default GIL slice (5 ms) the thread that takes in one replica's answer waits that
# long behind the others' work, which a replica's own process would not make it do.
GENERATOR_SWITCH_INTERVAL_S = 0.001
ANSWER_TIMEOUT_S = 10.0
# The replicas' churn frees about as many objects as it makes, so Python's count starts few
# young collections and each then visits all that piled up (ShardCollections): in one
# process of 64 replicas the longest took 40-97 ms, every answer the process times waiting.
# A replica's own process would pile up a 64th of that; the run collects its young
# generations at every step instead.
GENERATOR_YOUNG_COLLECTION = 1
IDLE_S = 2.0  # the shards' CPU with no calls, measured for this long before the load


@ray.remote(num_cpus=0)
class LoadProcess:
    """One process of lightweight replicas: a `LoadGenerator` over the namespace's shards.

    `relayed`: the replicas publish through a `PublishRelay` in this process, as a node's
    queried replicas publish through their NodeAgent's (the process stands for the node;
    the hop from a replica to its agent, a call on its own node, is not the Directory's
    cost); else each to the shards itself."""

    def __init__(self, namespace: str, num_shards: int, replicas: list[int], rates: LoadRates, relayed: bool) -> None:
        sys.setswitchinterval(GENERATOR_SWITCH_INTERVAL_S)
        node_id = ray.get_runtime_context().get_node_id()
        clients = shard_clients(namespace, num_shards)
        self.channels = [client.channel for client in clients]
        self.relay = None
        if relayed:
            self.relay = PublishRelay(namespace, clients)
            self.relay.start()
        self.generator = LoadGenerator(namespace, node_id, replicas, clients, rates, path=self.relay)
        self._stop_heartbeats = threading.Event()
        self._heartbeats: threading.Thread | None = None

    def fill(self) -> None:
        """Register every replica with its `held` keys, and wait until the shards have them.
        The process then makes no full garbage collection by itself, as a shard does: its
        replicas' keys would make each one pause the answers it times (and `run` collects
        the young generations at each step). Until `run`, a
        thread keeps the replicas' heartbeats going, as live replicas do: the other
        processes may fill for longer than the shards wait for a silent replica."""
        self.generator.fill(time.monotonic())
        self._drain()
        connect_channels(self.channels)
        gc.collect()
        defer_full_collections()
        self._heartbeats = threading.Thread(target=self._heartbeat, name="heartbeats", daemon=True)
        self._heartbeats.start()

    def _heartbeat(self) -> None:
        while not self._stop_heartbeats.wait(GENERATOR_TICK_S):
            self.generator.step(time.monotonic(), offer=False)

    def run(self, seconds: float, phase_s: float = 0.0) -> dict[str, Any]:
        """Offer the load for `seconds`, its steps starting `phase_s` later than another
        process's may (the steps of replicas on different nodes are not in step), then publish
        what is pending and wait for the answers; with how late each of its steps ran (if far
        behind, the load went out later than offered)."""
        generator = self.generator
        self._stop_heartbeats.set()
        if self._heartbeats is not None:
            self._heartbeats.join()
        time.sleep(phase_s)
        cpu = time.process_time()
        start = time.monotonic()
        generator.start(start)
        ticks = 0
        late: list[float] = []
        while time.monotonic() < start + seconds:
            now = time.monotonic()
            late.append(now - (start + ticks * GENERATOR_TICK_S))
            generator.step(now)
            gc.collect(GENERATOR_YOUNG_COLLECTION)
            ticks += 1
            time.sleep(max(0.0, start + ticks * GENERATOR_TICK_S - time.monotonic()))
        self._drain()
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while len(generator.answers) < generator.offered["query_calls"] and time.monotonic() < deadline:
            time.sleep(0.01)
        return {
            **generator.summary(),
            "latencies": generator.latencies(),
            "cpu_s": time.process_time() - cpu,
            "wall_s": time.monotonic() - start,
            "steps_late_s": late,
        }

    def _drain(self) -> None:
        generator = self.generator
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        generator.step_busy(time.monotonic())
        while not generator.drained:
            if time.monotonic() > deadline:
                raise RuntimeError(f"changes still unpublished after {DRAIN_TIMEOUT_S} s: {generator.errors.recent()[-3:]}")
            time.sleep(0.01)
            generator.step(time.monotonic(), offer=False)
            generator.step_busy(time.monotonic())


def actor_processes(actor_class: str, count: int, timeout_s: float = 60.0) -> list[psutil.Process]:
    """The `count` worker processes of `actor_class` actors (all this driver's descendants
    that run one), once there are exactly that many."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for process in psutil.Process().children(recursive=True):
            try:
                if actor_class in " ".join(process.cmdline()):
                    found.append(process)
            except psutil.Error:
                continue
        if len(found) == count:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(found)} {actor_class} processes, not {count}")
        time.sleep(0.2)


# the shard's operation counters that are each one call, but for the publishes a relay
# carried (`relayed_publishes`), which came in `relay_calls`
CALL_COUNTERS = ("registers", "unregisters", "publishes", "ignored_publishes", "unknown_publishes", "queries", "relay_calls")


def machine_field(times: list[float], name: str) -> float:
    """Field `name` of a difference of two `psutil.cpu_times()`, 0 where this system has none."""
    fields = psutil.cpu_times()._fields
    return times[fields.index(name)] if name in fields else 0.0


def shards_stats(handles: list) -> tuple[collections.Counter, list[str]]:
    """The shards' counts summed, and each shard's epoch (a restarted shard has a new one,
    and its counts start again from 0)."""
    total = collections.Counter()
    stats = ray.get([h.stats.remote() for h in handles])
    for shard in stats:
        total.update({k: v for k, v in shard.items() if isinstance(v, int)})
    return total, [shard["epoch"] for shard in stats]


def generator_scale(
    replica_counts: list[int], shard_counts: list[int], rates: LoadRates, seconds: float, paths: Sequence[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per (shards, replicas): the Directory's CPU, calls, events and query latency under
    the lightweight replicas' load; see the module docstring. With the points that could
    not be measured (replicas, shards, path and why), which the run goes on past."""
    token_auth_on()
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 100 * MiB, "include_dashboard": False},
    )
    rows, failed = [], []
    try:
        for _ in range(GENERATOR_NODES):
            cluster.add_node(num_cpus=1, object_store_memory=80 * MiB)
        cluster.wait_for_nodes()
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        for num_shards in shard_counts:
            for num_replicas in replica_counts:
                for path in paths:
                    try:
                        rows.append(generator_point(num_replicas, num_shards, rates, seconds, node_ids, path))
                    except Exception as e:
                        failed.append({"replicas": num_replicas, "shards": num_shards, "publish_path": path, "failed": f"{type(e).__name__}: {e}"})
                        print(f"  {num_replicas} replicas, {num_shards} shards, {path}: FAILED {failed[-1]['failed'][-300:]}", file=sys.stderr, flush=True)
                        continue
                    r = rows[-1]
                    print(
                        f"  {num_replicas} replicas, {num_shards} shards, {path}: {r['directory_cores']:.3f} cores, "
                        f"{r['directory_cpu_us_per_event'] or float('nan'):.1f} us/event, query p99 {r['query_p99_ms']:.1f} ms, "
                        f"lost {lost_text(r)}, load {r['load_average'][0]:.1f} (settled {r['settle_s']:.0f} s, "
                        f"{r['settled_busy_cores']:.2f} cores busy), registers {r['registers']} "
                        f"(expired {r['expired_replicas']}, dropped {r['dropped_replicas']}, shard restarts {r['shard_restarts']})",
                        file=sys.stderr, flush=True,
                    )
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows, failed


# A point starts once the machine's busy cores over a second fall below this (Ray's own
# processes of four idle nodes take 0.1-0.15), or after SETTLE_TIMEOUT_S: a point that
# saturates the machine leaves work behind it (its processes ending, Ray catching up), which
# the next point's load would otherwise share the cores with.
SETTLED_BUSY_CORES = 0.3
SETTLE_TIMEOUT_S = 60.0


def settle() -> tuple[float, float]:
    """Wait for a quiet machine (SETTLED_BUSY_CORES); (seconds waited, busy cores over the last second)."""
    started = time.monotonic()
    while True:
        before, since = psutil.cpu_times(), time.monotonic()
        time.sleep(1.0)
        delta = [after - b for after, b in zip(psutil.cpu_times(), before)]
        busy = (sum(delta) - machine_field(delta, "idle") - machine_field(delta, "steal")) / (time.monotonic() - since)
        if busy < SETTLED_BUSY_CORES or time.monotonic() - started > SETTLE_TIMEOUT_S:
            return time.monotonic() - started, busy


def generator_point(
    num_replicas: int, num_shards: int, rates: LoadRates, seconds: float, node_ids: list[str], path: str
) -> dict[str, Any]:
    settle_s, settled_busy = settle()
    namespace = f"scale{uuid.uuid4().hex[:12]}"
    handles = get_or_create_shards(namespace, num_shards)
    processes: list = []
    try:
        shards_stats(handles)
        shard_procs = actor_processes("DirectoryShard", num_shards)
        # what a call and no call cost the shards, before the replicas' calls begin
        per_call = call_cpu(handles[0], shard_procs, calls=1000)
        per_channel_query = channel_query_cpu(handles[0], namespace, shard_procs, calls=1000)
        idle_before, idle_started = sum(cpu_seconds(p) for p in shard_procs), time.monotonic()
        time.sleep(IDLE_S)
        idle_cores = (sum(cpu_seconds(p) for p in shard_procs) - idle_before) / (time.monotonic() - idle_started)
        count = min(GENERATOR_PROCESSES, num_replicas)
        processes = [
            LoadProcess.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[p % len(node_ids)], soft=False)).remote(
                namespace, num_shards, list(range(p, num_replicas, count)), rates, path == "relayed"
            )
            for p in range(count)
        ]
        ray.get([p.fill.remote() for p in processes])
        load = os.getloadavg()
        before, epochs_before = shards_stats(handles)
        cpu_before = [cpu_seconds(p) for p in shard_procs]
        wait_before = sum(cpu_wait_seconds(p) for p in shard_procs)
        machine_before = psutil.cpu_times()
        started = time.monotonic()
        results = ray.get([p.run.remote(seconds, GENERATOR_TICK_S * i / count) for i, p in enumerate(processes)])
        wall = time.monotonic() - started
        machine = [after - before for after, before in zip(psutil.cpu_times(), machine_before)]
        cpu = [cpu_seconds(p) - c for p, c in zip(shard_procs, cpu_before)]
        shard_wait = sum(cpu_wait_seconds(p) for p in shard_procs) - wait_before
        after, epochs_after = shards_stats(handles)
    finally:
        for p in processes:
            ray.kill(p)
        kill_shards(namespace)
    delta = {k: after[k] - before[k] for k in after}
    offered = collections.Counter()
    for result in results:
        offered.update({k: v for k, v in result.items() if isinstance(v, int)})
    latencies = [s for result in results for s in result["latencies"]]
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else [float("nan")] * 99
    steps_late = [s for result in results for s in result["steps_late_s"]]
    events_offered = offered["stored"] + offered["removed"]
    events_applied = delta.get("stored", 0) + delta.get("removed", 0)
    calls = sum(delta.get(k, 0) for k in CALL_COUNTERS) - delta.get("relayed_publishes", 0)
    publish_calls = sum(delta.get(k, 0) for k in ("publishes", "ignored_publishes", "unknown_publishes", "relay_calls")) - delta.get(
        "relayed_publishes", 0
    )
    directory_cpu = sum(cpu)
    return {
        "replicas": num_replicas,
        "shards": num_shards,
        "publish_path": path,
        "wall_s": wall,
        "load_average": load,
        "load_average_end": os.getloadavg(),
        "settle_s": settle_s,
        "settled_busy_cores": settled_busy,
        "offered_events_per_replica_s": rates.events_per_s,
        "offered_requests_per_replica_s": rates.requests_per_s,
        "events_offered": events_offered,
        "events_applied": events_applied,
        # a shard that expired a replica (its heartbeats queued too long) makes it register
        # again with everything it holds: those keys count as applied events too, and what
        # was lost cannot be told from the counts (None)
        "events_lost": events_offered - events_applied if not delta.get("registers") else None,
        "registers": delta.get("registers", 0),
        "unknown_publishes": delta.get("unknown_publishes", 0),
        # why a shard dropped replicas: their heartbeats stopped, or Ray reported their node dead
        "expired_replicas": delta.get("expired_replicas", 0),
        "dropped_replicas": delta.get("dropped_replicas", 0),
        "shard_restarts": sum(a != b for a, b in zip(epochs_before, epochs_after)),
        "events_per_s": events_applied / wall,
        "publishes": delta.get("publishes", 0) + delta.get("ignored_publishes", 0),
        "publish_calls": publish_calls,
        "calls": calls,
        "calls_per_s": calls / wall,
        "requests": offered["requests"],
        "query_calls": delta.get("queries", 0),
        "query_calls_offered": offered["query_calls"],
        "query_calls_per_request": offered["query_calls"] / offered["requests"] if offered["requests"] else None,
        "queried_keys_per_s": delta.get("queried_keys", 0) / wall,
        "query_hit_rate": offered["hits"] / offered["query_keys"] if offered["query_keys"] else None,
        "query_failed_calls": offered["failed_calls"],
        "query_p50_ms": q[49] * 1e3,
        "query_p99_ms": q[98] * 1e3,
        "requests_answered": len(latencies),
        "directory_cores": directory_cpu / wall,
        "busiest_shard_cores": max(cpu) / wall,
        "directory_cpu_us_per_event": directory_cpu / events_applied * 1e6 if events_applied else None,
        "directory_cpu_us_per_call": directory_cpu / calls * 1e6 if calls else None,
        "directory_cpu_us_per_stats_call": per_call * 1e6,
        "directory_cpu_us_per_channel_query": per_channel_query * 1e6,
        "directory_idle_cores": idle_cores,
        "publishes_per_s": publish_calls / wall,
        "generator_cores": sum(r["cpu_s"] for r in results) / wall,
        "generator_step_late_p99_ms": statistics.quantiles(steps_late, n=100, method="inclusive")[98] * 1e3,
        "generator_step_late_max_ms": max(steps_late) * 1e3,
        "directory_keys": after["keys"],
        "publish_errors": offered["publish_errors"],
        # the machine's cores busy over the load, and the share of its CPU time its host
        # took for others (steal): the same load ran with slower queries under more steal
        "machine_busy_cores": (sum(machine) - machine_field(machine, "idle") - machine_field(machine, "steal")) / wall,
        "machine_steal_share": machine_field(machine, "steal") / sum(machine),
        # how long a shard's threads waited for a CPU, per second of the load: a call to
        # a shard waiting so is not answered, however little work it needs
        "shard_cpu_wait_ms_per_s": shard_wait / num_shards / wall * 1e3,
    }


# ---- the model ---------------------------------------------------------------------------

FLEET_REPLICAS = 1000
FLEET_BLOCKS = 100_000_000
FLEET_HOLDERS = 1.2  # per block
FLEET_FLUSH_S = 2.0
QUERY_CALLS_PER_REQUEST = 1  # a request's prefix on one shard
SHARD_CORES = 0.5
SHARD_BYTES = 4 << 30
NODE_REPLICAS = 8  # replicas of one node, when the node aggregates their publishes


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """The measured inputs of docs/scale.md's model: shard CPU seconds per Ray call
    (`c_call`: registers, publishes), per query call over the query channel besides its
    keys (`c_query_call`), per event published (`c_pub`) and per key queried (`c_query`),
    cores of a shard that takes no calls (`c_idle`: its node watcher, Ray's own); shard
    bytes per key (`m_key`) and per extra holder (`m_holder`). `source` says where they
    came from."""

    c_call: float
    c_query_call: float
    c_pub: float
    c_query: float
    m_key: float
    m_holder: float
    source: str
    c_idle: float = 0.0


def model_cores(
    ray_calls_per_s: float, query_calls_per_s: float, events_per_s: float, keys_queried_per_s: float, inputs: ModelInputs,
    shards: float = 0,
) -> float:
    """Directory CPU = S · c_idle + Ray calls · c_call + query calls · c_query_call + E · c_pub + Q · c_query, in cores."""
    return (
        shards * inputs.c_idle + ray_calls_per_s * inputs.c_call + query_calls_per_s * inputs.c_query_call
        + events_per_s * inputs.c_pub + keys_queried_per_s * inputs.c_query
    )


def fleet_model(
    inputs: ModelInputs, replicas: int = FLEET_REPLICAS, blocks: int = FLEET_BLOCKS, flush_s: float = FLEET_FLUSH_S,
    replicas_per_publisher: int = 1,
) -> dict[str, float]:
    """The Directory that `replicas` replicas at the model's rates and `blocks` blocks need
    (docs/scale.md): every publisher (a replica, or one per `replicas_per_publisher` when a
    node aggregates its replicas' publishes) publishes to every shard once per `flush_s`, a
    request is one query call, a shard gets SHARD_CORES and SHARD_BYTES. Shards: enough
    for the CPU besides each shard's publishes, and for the memory."""
    publishers = math.ceil(replicas / replicas_per_publisher)
    events = replicas * MODEL_EVENTS_PER_S
    requests = replicas * MODEL_REQUESTS_PER_S
    keys_queried = requests * MODEL_QUERY_KEYS
    query_calls = requests * QUERY_CALLS_PER_REQUEST
    work = model_cores(0, query_calls, events, keys_queried, inputs)
    left = SHARD_CORES - inputs.c_idle - publishers * inputs.c_call / flush_s  # of a shard, once its publishes are paid
    cpu_shards = math.ceil(work / left) if left > 0 else math.inf
    memory = blocks * (inputs.m_key + (FLEET_HOLDERS - 1) * inputs.m_holder)
    memory_shards = math.ceil(memory / SHARD_BYTES)
    shards = max(cpu_shards, memory_shards)
    publishes = publishers * shards / flush_s if shards != math.inf else math.inf
    return {
        "replicas": replicas,
        "blocks": blocks,
        "events_per_s": events,
        "keys_queried_per_s": keys_queried,
        "cpu_shards": cpu_shards,
        "memory_shards": memory_shards,
        "shards": shards,
        "calls_per_s": publishes + query_calls,
        "cores": model_cores(publishes, query_calls, events, keys_queried, inputs, shards),
        "memory_bytes": memory,
        # the shortest flush interval at which a shard's publishes leave it any CPU
        "min_flush_s": publishers * inputs.c_call / (SHARD_CORES - inputs.c_idle) if inputs.c_idle < SHARD_CORES else math.inf,
    }


def query_calls_per_s(point: dict[str, Any]) -> float:
    return point["query_calls"] / point["wall_s"]


def channel_query_cost(point: dict[str, Any]) -> float:
    """A point's shard CPU seconds per query call over the channel, besides its keys."""
    if "directory_cpu_us_per_channel_query" not in point:
        raise ValueError("figures from before the query channel (no directory_cpu_us_per_channel_query): measure again")
    return point["directory_cpu_us_per_channel_query"] / 1e6


def fitted_call_cost(points: list[dict[str, Any]], c_pub: float, c_query: float) -> float | None:
    """The shard CPU per Ray call that best explains the generator's points (least
    squares), given each point's idle shard CPU, its queries' cost over the channel and the
    state's own costs per event and per key: Ray's cost per call under many callers."""
    pairs = [
        (
            p["calls_per_s"] - query_calls_per_s(p),
            p["directory_cores"] - p.get("directory_idle_cores", 0.0) - query_calls_per_s(p) * channel_query_cost(p)
            - p["events_per_s"] * c_pub - p["queried_keys_per_s"] * c_query,
        )
        for p in points
        if p["calls_per_s"] > query_calls_per_s(p)
    ]
    if not pairs:
        return None
    return sum(calls * rest for calls, rest in pairs) / sum(calls * calls for calls, _ in pairs)


def model_inputs(figures: dict[str, Any], source: str) -> ModelInputs:
    """The model's inputs from a measurement's figures (this script's --json): the state's
    costs at its largest size, Ray's cost per call fitted to the generator's points (else
    the largest cost per stats call measured)."""
    state = figures["state"]
    largest = state["sizes"][-1]
    c_pub = 1 / largest["publish_events_per_s"]
    c_query = 1 / largest["query_keys_per_s"]
    m_key = state["marginal_bytes_per_key"] or largest["bytes_per_key"]
    points = figures.get("generator") or []
    smallest = state["sizes"][0]
    c_call = fitted_call_cost(points, 1 / smallest["publish_events_per_s"], 1 / smallest["query_keys_per_s"])
    if c_call is not None:
        how = f"c_call fitted to {len(points)} generator points"
    else:
        stats_calls = [p["directory_cpu_us_per_stats_call"] for p in points] + [
            r["directory_cpu_us_per_call"] for r in figures.get("replicas") or []
        ]
        if not stats_calls:
            raise ValueError("the figures hold no cost per call: run the generator or the view replicas")
        c_call = max(stats_calls) / 1e6
        how = "c_call the largest per stats call"
    c_idle = max((p["directory_idle_cores"] / p["shards"] for p in points if "directory_idle_cores" in p), default=0.0)
    c_query_call = max((channel_query_cost(p) for p in points), default=c_call)
    return ModelInputs(c_call, c_query_call, c_pub, c_query, m_key, state["extra_holder_bytes_per_key"], f"{source}; {how}", c_idle)


def print_model(inputs: ModelInputs) -> None:
    # the product's path: a queried replica publishes through its node's relay
    m = fleet_model(inputs, replicas_per_publisher=NODE_REPLICAS)
    print(f"model inputs ({inputs.source}):")
    print(
        f"  c_call {inputs.c_call * 1e6:.0f} us/Ray call, c_query_call {inputs.c_query_call * 1e6:.0f} us/query call, c_idle {inputs.c_idle:.3f} cores/shard, c_pub {inputs.c_pub * 1e6:.2f} us/event, "
        f"c_query {inputs.c_query * 1e6:.2f} us/key, m_key {inputs.m_key:.0f} B, m_holder {inputs.m_holder:.0f} B"
    )
    print(
        f"model for {m['replicas']:,} replicas and {m['blocks'] / 1e6:.0f}M blocks (e = {MODEL_EVENTS_PER_S}/s, "
        f"r = {MODEL_REQUESTS_PER_S:.2f}/s, q = {MODEL_QUERY_KEYS} per replica; a request one query call; publishes "
        f"relayed by nodes of {NODE_REPLICAS} replicas, one call per node per shard every {FLEET_FLUSH_S:g} s):"
    )
    print(
        f"  shards {m['shards']} (CPU {m['cpu_shards']}, memory {m['memory_shards']}); calls {m['calls_per_s'] / 1e3:.1f}k/s; "
        f"Directory CPU {m['cores']:.1f} cores; memory {m['memory_bytes'] / 1e9:.1f} GB"
    )
    for label, alt in (
        (f"each replica publishing itself every {FLEET_FLUSH_S:g} s", fleet_model(inputs)),
        ("each replica publishing itself every 5 s", fleet_model(inputs, flush_s=5.0)),
    ):
        if alt["shards"] == math.inf:
            print(
                f"  with {label}: no number of shards suffices (a shard's publishes take more than its {SHARD_CORES} core; "
                f"the interval must exceed {alt['min_flush_s']:.1f} s)"
            )
        else:
            print(f"  with {label}: shards {alt['shards']}, calls {alt['calls_per_s'] / 1e3:.1f}k/s, Directory CPU {alt['cores']:.1f} cores")


def counts_arg(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if values != sorted(values) or (values and values[0] < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: ascending positive integers, comma-separated")
    return values


PUBLISH_PATHS = ("relayed", "direct")


def paths_arg(text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    if not values or any(v not in PUBLISH_PATHS for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, of {', '.join(PUBLISH_PATHS)}")
    return values


def print_state(state: dict[str, Any]) -> None:
    print(
        f"{'shard keys':>12} {'bytes/key':>10} {'publish events/s':>17} {'worst ms':>9} {'1-dict ms':>10} {'query keys/s':>13} "
        f"{'serve keys/s':>13} {'wire B/event':>13} {'fill s':>7}"
    )
    for s in state["sizes"]:
        print(
            f"{s['keys']:>12,} {s['bytes_per_key']:>10.0f} {s['publish_events_per_s']:>17,.0f} {s['publish_worst_ms']:>9.1f} "
            f"{s['one_dict_rebuild_ms']:>10.1f} {s['query_keys_per_s']:>13,.0f} {s['serve_keys_per_s']:>13,.0f} "
            f"{s['wire_bytes_per_event']:>13.1f} {s['fill_s']:>7.1f}"
        )
    if state["marginal_bytes_per_key"] is not None:
        print(f"marginal bytes/key {state['sizes'][0]['keys']:,} -> {state['sizes'][-1]['keys']:,}: {state['marginal_bytes_per_key']:.0f}")
    print(f"second holder of a key: {state['extra_holder_bytes_per_key']:.0f} bytes")
    print(f"follower view of {state['view_keys']:,} keys: {state['view_bytes_per_key']:.0f} bytes/key, applies {state['view_apply_keys_per_s']:,.0f} keys/s")


def print_view_replicas(replicas: list[dict[str, Any]]) -> None:
    print(
        f"{'replicas':>8} {'offered ev/s':>13} {'directory ev/s':>15} {'view p50 ms':>12} {'p99 ms':>8} "
        f"{'call ms':>8} {'CPU/replica':>12} {'Directory CPU':>14} {'us/event':>9} {'publishes/s':>12} {'us/call':>8}"
    )
    for r in replicas:
        print(
            f"{r['replicas']:>8} {r['offered_events_per_s']:>13,.0f} {r['directory_events_per_s']:>15,.0f} "
            f"{r['view_update_p50_ms']:>12.2f} {r['view_update_p99_ms']:>8.2f} {r['actor_call_p50_ms']:>8.2f} "
            f"{r['cpu_per_replica']:>12.3f} {r['directory_cores']:>14.3f} {r['directory_cpu_us_per_event'] or float('nan'):>9.1f} "
            f"{r['directory_publishes_per_s']:>12,.0f} {r['directory_cpu_us_per_call']:>8.0f}"
        )


def generator_model(points: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    """The model beside each generator point: the Directory's cores predicted with the
    cost per stats call (`predicted`) and with the cost per Ray call fitted to all points
    (`refit`), each with the point's idle CPU and its queries at the point's cost per
    channel query; and the CPU per event amortised at the
    model's rates (`us_per_event_at_model_rates`): the same publishes (one per replica per
    shard per flush interval, however many events it carries) and idle CPU, spread over
    replicas · e events, with the fitted cost per call."""
    smallest = state["sizes"][0]
    c_pub, c_query = 1 / smallest["publish_events_per_s"], 1 / smallest["query_keys_per_s"]
    fitted = fitted_call_cost(points, c_pub, c_query)
    rows = []
    for p in points:
        queries = query_calls_per_s(p)
        load = (p["calls_per_s"] - queries, queries, p["events_per_s"], p["queried_keys_per_s"])
        c_query_call = channel_query_cost(p)
        model_events = p["replicas"] * MODEL_EVENTS_PER_S
        predicted = ModelInputs(p["directory_cpu_us_per_stats_call"] / 1e6, c_query_call, c_pub, c_query, 0, 0, "")
        rows.append({
            "replicas": p["replicas"],
            "shards": p["shards"],
            "predicted_cores": p["directory_idle_cores"] + model_cores(*load, predicted),
            "refit_cores": None if fitted is None else p["directory_idle_cores"] + model_cores(
                *load, dataclasses.replace(predicted, c_call=fitted)
            ),
            "us_per_event_at_model_rates": None if fitted is None else (
                p["directory_idle_cores"] + p["publishes_per_s"] * fitted + model_events * c_pub
            ) / model_events * 1e6,
        })
    return {"c_pub": c_pub, "c_query": c_query, "c_call_fitted": fitted, "at_state_keys": smallest["keys"], "points": rows}


def lost_text(point: dict[str, Any]) -> str:
    return "?" if point["events_lost"] is None else str(point["events_lost"])


def print_generator(points: list[dict[str, Any]], rates: LoadRates, model: dict[str, Any]) -> None:
    print(
        f"lightweight replicas: offered per replica {rates.events_per_s:g} events/s and {rates.requests_per_s:g} requests/s "
        f"of {rates.query_keys} keys, against the model's {MODEL_EVENTS_PER_S} and {MODEL_REQUESTS_PER_S:.2f} "
        f"({rates.events_per_s / MODEL_EVENTS_PER_S:.1%} and {rates.requests_per_s / MODEL_REQUESTS_PER_S:.1%}: "
        f"what this machine can generate); publishes every {rates.flush_s:g} s; {rates.held} keys held each"
    )
    print(
        f"{'replicas':>8} {'shards':>6} {'publish':>8} {'load':>5} {'offered ev':>11} {'applied':>9} {'lost':>5} {'calls/s':>8} {'Dir cores':>9} "
        f"{'idle':>6} {'busiest':>8} {'us/event':>9} {'@model e':>9} {'us/call':>8} {'us/stats':>9} {'us/chanq':>9} {'calls/req':>9} "
        f"{'q p50 ms':>9} {'q p99 ms':>9} {'hit':>5} {'model':>7} {'refit':>7} {'gen cores':>9} {'gen late ms':>11} {'busy':>5} {'steal':>5} {'wait':>5}"
    )
    for p, m in zip(points, model["points"]):
        print(
            f"{p['replicas']:>8} {p['shards']:>6} {p.get('publish_path', 'direct'):>8} {p['load_average'][0]:>5.1f} {p['events_offered']:>11,} {p['events_applied']:>9,} "
            f"{lost_text(p):>5} {p['calls_per_s']:>8,.0f} {p['directory_cores']:>9.3f} {p['directory_idle_cores']:>6.3f} "
            f"{p['busiest_shard_cores']:>8.3f} {p['directory_cpu_us_per_event'] or float('nan'):>9.1f} "
            f"{m['us_per_event_at_model_rates'] or float('nan'):>9.1f} {p['directory_cpu_us_per_call'] or float('nan'):>8.0f} "
            f"{p['directory_cpu_us_per_stats_call']:>9.0f} {p['directory_cpu_us_per_channel_query']:>9.0f} "
            f"{p['query_calls_per_request'] or float('nan'):>9.1f} "
            f"{p['query_p50_ms']:>9.2f} {p['query_p99_ms']:>9.2f} {p['query_hit_rate'] or 0:>5.0%} {m['predicted_cores']:>7.3f} "
            f"{m['refit_cores'] or float('nan'):>7.3f} {p['generator_cores']:>9.3f} "
            f"{p['generator_step_late_p99_ms']:>5.0f}/{p['generator_step_late_max_ms']:<5.0f} "
            f"{p['machine_busy_cores']:>5.2f} {p['machine_steal_share']:>5.0%} {p.get('shard_cpu_wait_ms_per_s', float('nan')):>5.0f}"
        )
    if model["c_call_fitted"] is not None:
        print(
            f"model: cores = idle + Ray calls/s * c_call + query calls/s * us/chanq + events/s * {model['c_pub'] * 1e6:.2f} us + "
            f"keys queried/s * {model['c_query'] * 1e6:.2f} us (the state's costs at {model['at_state_keys']:,} keys); 'us/chanq': "
            f"a query of one key over the channel; 'model' with c_call = us/stats, "
            f"'refit' with c_call = {model['c_call_fitted'] * 1e6:.0f} us fitted to these points; '@model e': us/event amortised "
            f"at the model's {MODEL_EVENTS_PER_S} events/s per replica (same publishes, refit c_call); 'gen late': p99/max of how "
            f"late the generators' {GENERATOR_TICK_S * 1e3:.0f} ms steps ran; 'busy': the machine's cores busy, 'steal': the share of its CPU "
            "time its host gave others; 'wait': ms per second a shard's threads waited for a CPU"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=counts_arg, default=[1_000_000, 10_000_000], help="shard sizes, ascending (default 1000000,10000000)")
    parser.add_argument("--replicas", type=counts_arg, default=[64, 256], help="lightweight replica counts (default 64,256; '' for none)")
    parser.add_argument("--shards", type=counts_arg, default=[1, 4, 16], help="shard counts for the lightweight replicas (default 1,4,16)")
    parser.add_argument("--seconds", type=float, default=20.0, help="load per lightweight point (default 20)")
    parser.add_argument("--events-per-s", type=float, default=100.0, help="stores and evictions offered per lightweight replica (default 100)")
    parser.add_argument("--requests-per-s", type=float, default=0.2, help="requests offered per lightweight replica (default 0.2)")
    parser.add_argument(
        "--publish", type=paths_arg, default=["relayed"],
        help="how lightweight replicas publish, each measured in turn: 'relayed' (through their node's relay, as queried "
        "replicas do) and/or 'direct' (each to every shard); default relayed",
    )
    parser.add_argument("--view-replicas", type=counts_arg, default=[], help="real replicas following pushed views, ascending, at least 2 (default none)")
    parser.add_argument("--view-seconds", type=float, default=5.0, help="churn per view replica count (default 5)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--model", action="store_true", help="print the model for 1,000 replicas and 100M blocks from the measured inputs")
    parser.add_argument("--from", dest="source", type=Path, help="with --model: take the inputs from this --json of an earlier run instead of measuring")
    args = parser.parse_args()
    if args.view_replicas and args.view_replicas[0] < 2:
        parser.error("--view-replicas: at least 2 (replica 1 watches replica 0)")
    if args.source is not None:
        if not args.model:
            parser.error("--from goes with --model")
        print_model(model_inputs(json.loads(args.source.read_text()), f"from {args.source}, measured earlier"))
        return
    if not args.keys:
        parser.error("--keys: at least one size")
    rates = LoadRates(args.events_per_s, args.requests_per_s, MODEL_QUERY_KEYS, FLEET_FLUSH_S, 2048)

    print(
        f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; Python {sys.version.split()[0]}; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    figures: dict[str, Any] = {"load_average_start": os.getloadavg()}
    figures["state"] = state_scale(args.keys)
    print_state(figures["state"])
    if args.view_replicas:
        figures["replicas"] = replicas_scale(args.view_replicas, args.view_seconds)
        print_view_replicas(figures["replicas"])
    if args.replicas:
        figures["generator"], figures["generator_failed"] = generator_scale(args.replicas, args.shards, rates, args.seconds, args.publish)
        figures["generator_rates"] = dataclasses.asdict(rates)
        figures["generator_model"] = generator_model(figures["generator"], figures["state"])
        print_generator(figures["generator"], rates, figures["generator_model"])
        for point in figures["generator_failed"]:
            print(f"not measured: {point['replicas']} replicas, {point['shards']} shards, {point['publish_path']}: {point['failed'][-300:]}")
    figures["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.model:
        print_model(model_inputs(figures, "measured in this run"))


if __name__ == "__main__":
    main()
