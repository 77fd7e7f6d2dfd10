"""Directory throughput and visibility delay, against a no-op actor measured in the same run.

Throughput: lanes (replicas) each publish a batch of 1k keys to one shard, then query the
same 1k keys, and again; keys/s counts each key once per publish+query round. The
baseline makes the same calls, same payloads, to an async actor that does nothing.
Visibility: from `stored()` on one link to `holders()` answering on another (same
process), against the round trip of one no-op actor call.

Usage: python bench/directory.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

from distkv.directory.link import DirectoryLink  # noqa: E402
from distkv.directory.records import ReplicaInfo  # noqa: E402
from distkv.directory.wire import encode_answer, encode_changes, encode_stored  # noqa: E402
from distkv.directory.placement import shard_of  # noqa: E402
from distkv.names import RAY_NAMESPACE, segment_name  # noqa: E402
from ray_actors.directory import get_or_create_shards, head_node_id, kill_shards, shard_clients  # noqa: E402

BATCH = 1000
LANES_PER_SHARD = 2
BATCHES_PER_LANE = 64


@ray.remote
class NoOp:
    """Takes the Directory's calls and does nothing."""

    async def register(self, info, seq, stored, namespace):
        return "", True

    async def publish(self, replica_id, seq, changes, report, namespace):
        return "", True

    async def query(self, keys, namespace):
        return encode_answer([()] * len(keys), {})


def make_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]


class Lane:
    """One replica sending rounds of publish(1k keys) then query(those keys) to one actor."""

    def __init__(self, actor, info: ReplicaInfo, batches: list[list[bytes]], namespace: str) -> None:
        self.actor = actor
        self.namespace = namespace
        self.info = info
        self.batches = batches
        self.seq = 0
        self.round = 0

    def call(self):
        batch = self.batches[self.round // 2 % len(self.batches)]
        self.round += 1
        if self.round % 2:
            self.seq += 1
            changes = encode_changes([(k, i, self.seq) for i, k in enumerate(batch)], [])
            return self.actor.publish.remote(self.info.replica_id, self.seq, changes, None, namespace=self.namespace)
        return self.actor.query.remote(batch, namespace=self.namespace)


def throughput(actors: list, keys_of: list[list[bytes]], seconds: float, namespace: str) -> float:
    """Keys per second through publish+query rounds, LANES_PER_SHARD lanes per actor."""
    node = head_node_id()
    lanes = []
    for s, actor in enumerate(actors):
        for j in range(LANES_PER_SHARD):
            info = ReplicaInfo(f"bench-{s}-{j}", node, segment_name(namespace, f"bench_{s}_{j}"), BATCH, 1, 4096)
            keys = keys_of[s][j * BATCHES_PER_LANE * BATCH:(j + 1) * BATCHES_PER_LANE * BATCH]
            lanes.append(Lane(actor, info, [keys[b * BATCH:(b + 1) * BATCH] for b in range(BATCHES_PER_LANE)], namespace))
    ray.get([lane.actor.register.remote(lane.info, 0, encode_stored([]), namespace=namespace) for lane in lanes])
    in_flight = {lane.call(): lane for lane in lanes}
    rounds = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        for ref in ready:
            lane = in_flight.pop(ref)
            ray.get(ref)
            rounds += 1
            in_flight[lane.call()] = lane
    ray.get(list(in_flight))
    elapsed = time.perf_counter() - start
    return rounds / 2 * BATCH / elapsed


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49], q[98]


def visibility(namespace: str, samples: int) -> list[float]:
    """Seconds from `stored()` on one link to `holders()` answering on another."""
    node = head_node_id()
    a = DirectoryLink(namespace, ReplicaInfo("a", node, segment_name(namespace, "a"), 1 << 20, 1, 4096), shard_clients(namespace, 2))
    b = DirectoryLink(namespace, ReplicaInfo("b", node, segment_name(namespace, "b"), 1 << 20, 1, 4096), shard_clients(namespace, 2))
    a.start()
    b.start()
    try:
        warm = make_keys(1)
        a.stored([(warm[0], 0, 0)])
        while not b.holders(warm[0]):
            time.sleep(0.01)
        delays = []
        for i, key in enumerate(make_keys(samples)):
            time.sleep(random.uniform(0.0, 0.01))
            start = time.perf_counter()
            a.stored([(key, i, i)])
            while not b.holders(key):
                time.sleep(0.0001)
            delays.append(time.perf_counter() - start)
        return delays
    finally:
        a.close()
        b.close()


def round_trips(actor, samples: int, namespace: str) -> list[float]:
    delays = []
    for key in make_keys(samples):
        time.sleep(random.uniform(0.0, 0.01))
        start = time.perf_counter()
        ray.get(actor.publish.remote("a", 1, encode_changes([(key, 0, 0)], []), None, namespace=namespace))
        delays.append(time.perf_counter() - start)
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per throughput measurement")
    parser.add_argument("--samples", type=int, default=300, help="visibility samples")
    args = parser.parse_args()

    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=200 * 1024**2,
        include_dashboard=False,
        namespace=RAY_NAMESPACE,
        log_to_driver=False,
    )
    namespace = "bench" + uuid.uuid4().hex[:8]
    try:
        rows = []
        needed = LANES_PER_SHARD * BATCHES_PER_LANE * BATCH
        for num_shards in (1, 2, 4):
            shard_namespace = f"{namespace}_{num_shards}"
            shards = get_or_create_shards(shard_namespace, num_shards)
            noops = [NoOp.options(num_cpus=0).remote() for _ in range(num_shards)]
            ray.get([s.stats.remote() for s in shards] + [n.query.remote([], shard_namespace) for n in noops])
            keys_of: list[list[bytes]] = [[] for _ in range(num_shards)]
            while min(map(len, keys_of)) < needed:
                for key in make_keys(needed):
                    keys_of[shard_of(key, num_shards)].append(key)
            throughput(shards, keys_of, 0.3, shard_namespace)  # warm up
            directory = throughput(shards, keys_of, args.seconds, shard_namespace)
            baseline = throughput(noops, keys_of, args.seconds, shard_namespace)
            rows.append((f"{num_shards} shard{'s' * (num_shards > 1)}", directory, baseline))
            kill_shards(shard_namespace)
            for noop in noops:
                ray.kill(noop)

        noop = NoOp.options(num_cpus=0).remote()
        round_trips(noop, 20, namespace)
        baseline_delays = round_trips(noop, args.samples, namespace)
        delays = visibility(namespace, args.samples)
    finally:
        kill_shards(namespace)
        ray.shutdown()

    print(f"Directory bench: {BATCH}-key batches, {LANES_PER_SHARD} lanes per shard, {os.cpu_count()} cores, Ray {ray.__version__}")
    print(f"{'throughput (publish+query)':<28}{'keys/s':>12}{'no-op keys/s':>15}{'ratio':>8}")
    for name, directory, baseline in rows:
        print(f"{name:<28}{directory:>12,.0f}{baseline:>15,.0f}{directory / baseline:>8.2f}")
    p50, p99 = percentiles(delays)
    b50, b99 = percentiles(baseline_delays)
    print(f"{'visibility stored->holders':<28}{'p50 ms':>12}{'p99 ms':>15}")
    print(f"{'  link A -> link B':<28}{p50 * 1e3:>12.2f}{p99 * 1e3:>15.2f}")
    print(f"{'  no-op call round trip':<28}{b50 * 1e3:>12.2f}{b99 * 1e3:>15.2f}")
    print(f"{'  ratio':<28}{p50 / b50:>12.2f}{p99 / b99:>15.2f}")


if __name__ == "__main__":
    main()
