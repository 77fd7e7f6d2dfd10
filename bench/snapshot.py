"""How long a follower's snapshot holds up a shard's other calls.

    python bench/snapshot.py [--keys 1000000] [--replicas 8] [--followers 3] [--baseline-s 5]

One local Ray node and one shard, filled with --keys keys from --replicas replicas (each
registered and publishing its share 16k keys a call). A thread of this process asks the
shard `query` about one key every 2 ms throughout. The baseline: those queries' round
trips over --baseline-s seconds with no follower. Then --followers followers ask `changes`
from no cursor at once (a joining replica's first poll: they need a snapshot), the
queries going on. Printed: the snapshot's wall time (from the polls sent to their last
answer), the queries' p50, p99 and longest round trip in each phase, and the ratio of the
longest query during the snapshot to the baseline's p99.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import ray  # noqa: E402

from distkv.demo.runner import token_auth_on  # noqa: E402
from distkv.directory.wire import MAX_CALL_KEYS, decode_feed, encode_changes, encode_stored  # noqa: E402
from distkv.directory.records import ReplicaInfo  # noqa: E402
from distkv.names import segment_name  # noqa: E402
from ray_actors.directory import get_or_create_shards, kill_shards  # noqa: E402

MiB = 1 << 20
ROWS = 1 << 20
CHUNK = MAX_CALL_KEYS  # keys a publish of the fill: the most a shard takes in a call
PROBE_EVERY_S = 0.002
AFTER_S = 0.5  # the queries go on this long past the snapshot


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4 + b"\0\0\0\0"


def fill(shard, namespace: str, keys: int, replicas: int) -> None:
    node_id = ray.get_runtime_context().get_node_id()
    per = keys // replicas
    for r in range(replicas):
        name = f"r{r}"
        info = ReplicaInfo(name, node_id, segment_name(namespace, name), ROWS, 1, 4096)
        ray.get(shard.register.remote(info, 1, encode_stored([]), namespace=namespace))
        for seq, start in enumerate(range(0, per, CHUNK), start=2):
            stored = [(key(r * per + i), i % ROWS, 1) for i in range(start, min(per, start + CHUNK))]
            ray.get(shard.publish.remote(name, seq, encode_changes(stored, []), None, namespace=namespace))


class Prober(threading.Thread):
    """Asks the shard about one key every PROBE_EVERY_S; (sent at, round trip) of each."""

    def __init__(self, shard, namespace: str) -> None:
        super().__init__(daemon=True)
        self.shard, self.namespace = shard, namespace
        self.times: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.perf_counter()
            ray.get(self.shard.query.remote([key(0)], namespace=self.namespace))
            self.times.append((sent, time.perf_counter() - sent))
            time.sleep(PROBE_EVERY_S)


def figures(times: list[float]) -> tuple[float, float, float]:
    """p50, p99 and the longest, in ms."""
    q = statistics.quantiles(times, n=100, method="inclusive")
    return q[49] * 1e3, q[98] * 1e3, max(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys in the shard (default 1000000)")
    parser.add_argument("--replicas", type=int, default=8, help="replicas holding them (default 8)")
    parser.add_argument("--followers", type=int, default=3, help="followers asking for a snapshot at once (default 3)")
    parser.add_argument("--baseline-s", type=float, default=5.0, help="queries with no follower (default 5)")
    args = parser.parse_args()
    token_auth_on()
    ray.init(num_cpus=2, object_store_memory=1024 * MiB, include_dashboard=False)
    namespace = f"snapbench{uuid.uuid4().hex[:8]}"
    try:
        # the replicas publish nothing after the fill: a timeout the run does not reach
        (shard,) = get_or_create_shards(namespace, 1, replica_timeout_s=3600.0)
        fill(shard, namespace, args.keys, args.replicas)
        prober = Prober(shard, namespace)
        prober.start()
        time.sleep(args.baseline_s)
        started = time.perf_counter()
        answers = ray.get([shard.changes.remote(None, 0.0, namespace=namespace) for _ in range(args.followers)])
        finished = time.perf_counter()
        time.sleep(AFTER_S)
        prober.stop.set()
        prober.join()
        held = sum(len(stored) for _, _, stored, _ in decode_feed(answers[0]).entries)
        if held != args.keys // args.replicas * args.replicas:
            raise RuntimeError(f"the snapshot holds {held:,} keys, not {args.keys:,}")
        baseline = figures([t for sent, t in prober.times if sent < started])
        during = figures([t for sent, t in prober.times if started <= sent <= finished] or [finished - started])
        print(f"shard of {args.keys:,} keys; {args.followers} followers asked for a snapshot: answered in {(finished - started) * 1e3:,.0f} ms")
        print(f"{'queries':>22} {'p50 ms':>8} {'p99 ms':>8} {'longest ms':>11}")
        print(f"{'no follower':>22} {baseline[0]:>8.2f} {baseline[1]:>8.2f} {baseline[2]:>11.2f}")
        print(f"{'during the snapshot':>22} {during[0]:>8.2f} {during[1]:>8.2f} {during[2]:>11.2f}")
        print(f"longest query during the snapshot / p99 with no follower: {during[2] / baseline[1]:.1f}")
    finally:
        kill_shards(namespace)
        ray.shutdown()


if __name__ == "__main__":
    main()
