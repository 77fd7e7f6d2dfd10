"""How the Directory scales: one shard with millions of keys, and the cluster as replicas grow.

    python bench/scale.py [--keys 1000000,10000000] [--replicas 2,4,8] [--seconds 5] [--json PATH]

Shard state (no Ray). One DirectoryState is filled, 500-key publishes from 8 replicas
taking turns, to each size of --keys (36-byte keys, one holder each, rows and generations
as a pool hands them out). Every publish goes through pack/unpack, as it crosses Ray, so
the state holds its own copy of every object. At each size (rates per CPU second of this
process's thread, so that other processes on the cores do not count):
  memory per key   growth of the process's RSS since before the first key, / keys
  publish          events/s of a shard's work for a publish call (unpack, apply), each
                   call removing a replica's 500 oldest keys and storing 500 new ones
  query            keys/s of a shard's work for a query call of 1,000 held keys
  serve            keys/s of a shard's work to send one follower one publish it has not
                   seen (slice the change log, pack), and the packed bytes per event
Then, at the largest size, the memory of a second holder of a key (another replica
publishes 100k held keys again); and a follower's view (distkv.directory.ShardView) of up
to 1M keys: what it holds on to (tracemalloc, once the applied changes are gone) and how
fast it applies them.

Replicas (ray.cluster_utils.Cluster). A head node (the Directory: 1 shard) and one
simulated node per replica; each replica is an actor with a real ClusterOffloadingSpec (its
pool, DirectoryLink and the node's NodeAgent). Their number grows through --replicas,
earlier replicas staying. At each count every replica stores 64 new blocks 20 times a
second into a full pool (64 stored and 64 evicted events a cycle) for --seconds, while:
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
import gc
import hashlib
import json
import os
import random
import resource
import statistics
import sys
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import psutil  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from distkv.abstract import ReqContext, make_offload_key  # noqa: E402
from distkv.demo.runner import token_auth_on  # noqa: E402
from distkv.directory import Changes, Cursor, DirectoryState, ReplicaInfo, ShardView, pack, unpack  # noqa: E402
from distkv.spec import ClusterOffloadingSpec  # noqa: E402
from ray_actors.directory import get_or_create_shards, kill_shards  # noqa: E402

MiB = 1 << 20
CHUNK = 500  # keys stored (and removed) per publish call
STATE_REPLICAS = 8
QUERY_BATCH = 1000
TIMED_CALLS = 400
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
    """The i-th key: a hash-like 8 leading bytes (as a block hash has), 36 bytes in all."""
    return ((i * _MIX) & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big") + _TAIL


def chunk_payload(chunk: int, removed_chunk: int | None) -> bytes:
    """A packed publish: the keys of `chunk` stored, those of `removed_chunk` removed."""
    start = chunk * CHUNK
    stored = [(key(i), i % ROWS, 1_700_000_000_000_000_000 + i) for i in range(start, start + CHUNK)]
    removed = [] if removed_chunk is None else [key(i) for i in range(removed_chunk * CHUNK, (removed_chunk + 1) * CHUNK)]
    return pack((stored, removed))


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


class StateBench:
    """One DirectoryState grown chunk by chunk; chunk c belongs to replica c % STATE_REPLICAS."""

    def __init__(self) -> None:
        self.rss_empty = rss()
        self.state = DirectoryState()
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
        stored, removed = unpack(payload)
        name = f"r{replica}"
        self.seq[name] += 1
        self.state.publish(name, self.seq[name], stored, removed)

    def grow(self, keys: int) -> None:
        while self.keys < keys:
            self.publish(chunk_payload(self.end, None), self.end % STATE_REPLICAS)
            self.end += 1

    def publish_rate(self, calls: int) -> float:
        """Events/s of publish calls that each store a chunk and remove the oldest one.

        Keeps the size: the new chunk belongs to the replica of the removed one as long as
        the number of chunks held is a multiple of STATE_REPLICAS."""
        payloads = [chunk_payload(self.end + i, self.first + i) for i in range(calls)]
        replicas = [(self.first + i) % STATE_REPLICAS for i in range(calls)]
        start = time.thread_time()
        for payload, replica in zip(payloads, replicas):
            self.publish(payload, replica)
        elapsed = time.thread_time() - start
        self.first += calls
        self.end += calls
        return calls * 2 * CHUNK / elapsed

    def query_rate(self, calls: int) -> float:
        """Keys/s of query calls of QUERY_BATCH held keys each (the answer packed)."""
        rng = random.Random(calls)
        batches = [
            [key(rng.randrange(self.first * CHUNK, self.end * CHUNK)) for _ in range(QUERY_BATCH)] for _ in range(calls)
        ]
        query = self.state.query
        start = time.thread_time()
        for batch in batches:
            answer = pack(query(batch))
        elapsed = time.thread_time() - start
        if not all(unpack(answer)):
            raise RuntimeError("a held key has no holder")
        return calls * QUERY_BATCH / elapsed

    def serve_rate(self, calls: int) -> tuple[float, float]:
        """(keys/s, bytes per key) of serving a follower one publish it has not seen: the
        shard's work for a `changes` call (slice the log, pack), once per follower."""
        cursor = self.state.cursor()
        self.publish(chunk_payload(self.end, self.first), self.first % STATE_REPLICAS)
        self.first += 1
        self.end += 1
        changes = self.state.changes
        start = time.thread_time()
        for _ in range(calls):
            data = pack(changes(cursor))
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
            stored, removed = unpack(pack((entries, [])))
            self.state.publish(name, seq, stored, removed)
        return (rss() - before) / keys


def view_figures(keys: int) -> dict[str, float]:
    """A follower's ShardView of `keys` keys (one holder each): the bytes per key of all it
    holds on to (traced once the applied changes are gone), and keys/s applied."""
    entries = [(key(i), i % ROWS, 1_700_000_000_000_000_000 + i) for i in range(keys)]
    data = pack(Changes(Cursor("epoch", 1, 1), [("r0", "node0", entries, [])], {}, False))
    del entries
    changes = unpack(data)
    view = ShardView(exclude="me")
    start = time.thread_time()
    view.apply(changes)
    apply_s = time.thread_time() - start
    del view, changes
    gc.collect()
    tracemalloc.start()
    try:
        changes = unpack(data)
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
    """The shard-state figures at each size (ascending), then the second-holder and view figures."""
    bench = StateBench()
    per_size = []
    for size in sizes:
        if size % (CHUNK * STATE_REPLICAS):
            raise ValueError(f"--keys {size}: must be a multiple of {CHUNK * STATE_REPLICAS}")
        started = time.perf_counter()
        bench.grow(size)
        fill_s = time.perf_counter() - started
        memory = rss() - bench.rss_empty
        per_size.append(
            {
                "keys": bench.keys,
                "rss_bytes": memory,
                "bytes_per_key": memory / bench.keys,
                "fill_s": fill_s,
                "publish_events_per_s": bench.publish_rate(calls),
                "query_keys_per_s": bench.query_rate(calls),
            }
        )
        per_size[-1]["serve_keys_per_s"], per_size[-1]["wire_bytes_per_event"] = bench.serve_rate(calls)
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
            per_call = call_cpu(shard, shard_proc)
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


def call_cpu(shard, process: psutil.Process, calls: int = 2000) -> float:
    """CPU seconds the shard's process spends per call that does almost nothing (stats):
    what Ray costs the shard for any call, 100 calls in flight at a time."""
    ray.get(shard.stats.remote())
    before = cpu_seconds(process)
    for _ in range(calls // 100):
        ray.get([shard.stats.remote() for _ in range(100)])
    return (cpu_seconds(process) - before) / (calls // 100 * 100)


def counts_arg(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or values != sorted(values) or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: ascending positive integers, comma-separated")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=counts_arg, default=[1_000_000, 10_000_000], help="shard sizes, ascending (default 1000000,10000000)")
    parser.add_argument("--replicas", type=counts_arg, default=[2, 4, 8], help="replica counts, ascending, at least 2 (default 2,4,8)")
    parser.add_argument("--seconds", type=float, default=5.0, help="churn per replica count (default 5)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.replicas[0] < 2:
        parser.error("--replicas: at least 2 (replica 1 watches replica 0)")

    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; Python {sys.version.split()[0]}", flush=True)
    state = state_scale(args.keys)
    print(f"{'shard keys':>12} {'bytes/key':>10} {'publish events/s':>17} {'query keys/s':>13} {'serve keys/s':>13} {'wire B/event':>13} {'fill s':>7}")
    for s in state["sizes"]:
        print(
            f"{s['keys']:>12,} {s['bytes_per_key']:>10.0f} {s['publish_events_per_s']:>17,.0f} {s['query_keys_per_s']:>13,.0f} "
            f"{s['serve_keys_per_s']:>13,.0f} {s['wire_bytes_per_event']:>13.1f} {s['fill_s']:>7.1f}"
        )
    if state["marginal_bytes_per_key"] is not None:
        print(f"marginal bytes/key {state['sizes'][0]['keys']:,} -> {state['sizes'][-1]['keys']:,}: {state['marginal_bytes_per_key']:.0f}")
    print(f"second holder of a key: {state['extra_holder_bytes_per_key']:.0f} bytes")
    print(f"follower view of {state['view_keys']:,} keys: {state['view_bytes_per_key']:.0f} bytes/key, applies {state['view_apply_keys_per_s']:,.0f} keys/s")

    replicas = replicas_scale(args.replicas, args.seconds)
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
    if args.json:
        args.json.write_text(json.dumps({"state": state, "replicas": replicas}, indent=2))


if __name__ == "__main__":
    main()
