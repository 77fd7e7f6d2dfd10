"""A Directory query over the shard's query channel, against the same query over gRPC and as
a Ray actor call.

    python bench/query_channel.py [--calls 3000] [--rounds 3]

One local Ray node and one shard holding a replica's 9,000 keys. The same queries of 90
keys (a request's prefix, all of them hits), the same typed answer back, through
`ShardActorClient.query`, which uses the shard's channel (`distkv.directory.query_channel`: both
ends proven, every frame tagged), over gRPC with mutual TLS to the same shard
(`bench/query_grpc.py`: what the channel would be with the library), and as the baseline
through the actor's `query` method, in the same run, alternating by round (the shard's key
budget per connection lifted: the bench asks back to back, far more than a replica does):
- latency: one query at a time, --calls of them, p50 and p99 from sending to the answer;
- CPU: --calls queries, 100 in flight at a time; the shard's and this driver's CPU per
  call (psutil, user+system time, less what each uses idle), the fastest round;
- reading one answer in the replica (`decode_answer`), against `pickle.loads` of the same
  answer, which is how answers crossed before they were typed.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
import timeit
import uuid
from concurrent.futures import wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import psutil  # noqa: E402
import ray  # noqa: E402

from distkv.demo.runner import token_auth_on  # noqa: E402
from distkv.directory.records import ReplicaInfo  # noqa: E402
from distkv.directory.wire import encode_changes, encode_stored  # noqa: E402
from distkv.directory.wire import decode_answer  # noqa: E402
from distkv.directory.wire import MAX_CALL_KEYS  # noqa: E402
from distkv.names import RAY_NAMESPACE, segment_name  # noqa: E402
from ray_actors.directory import ShardActorClient  # noqa: E402
import query_grpc  # noqa: E402  (bench/, this script's directory, as the next)
from scale import PAGE_BYTES, actor_processes, connect_channels, cpu_seconds, key  # noqa: E402

QUERY_KEYS = 90
HELD_KEYS = 9000
IN_FLIGHT = 100
IDLE_S = 2.0


def one_at_a_time(send, keys: list[bytes], calls: int) -> list[float]:
    """Seconds from sending each query to its answer, one query in flight."""
    times = []
    for i in range(calls):
        prefix = keys[(i * QUERY_KEYS) % HELD_KEYS :][:QUERY_KEYS]
        start = time.perf_counter()
        answer = send(prefix).result()
        times.append(time.perf_counter() - start)
        holders, _ = decode_answer(answer, len(prefix))
        if not all(holders):
            raise RuntimeError("a held key came back without a holder")
    return times


def cpu_per_call(send, keys: list[bytes], calls: int, processes: dict[str, psutil.Process], idle: dict[str, float]) -> dict[str, float]:
    """CPU seconds per call of each process, IN_FLIGHT queries at a time, less its idle use."""
    prefix = keys[:QUERY_KEYS]
    start = time.monotonic()
    before = {name: cpu_seconds(p) for name, p in processes.items()}
    for _ in range(calls // IN_FLIGHT):
        wait([send(prefix) for _ in range(IN_FLIGHT)])
    wall = time.monotonic() - start
    sent = calls // IN_FLIGHT * IN_FLIGHT
    return {name: (cpu_seconds(p) - before[name] - idle[name] * wall) / sent for name, p in processes.items()}


def best_of(call, number: int = 300, repeat: int = 20) -> float:
    """Seconds a `call` takes, the fastest of `repeat` passes of `number` calls."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number


def percentile(times: list[float], q: float) -> float:
    return statistics.quantiles(times, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    token_auth_on()
    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, namespace=RAY_NAMESPACE)
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    ray.cloudpickle.register_pickle_by_value(query_grpc)  # Ray's workers cannot import bench/
    actor = query_grpc.start_grpc_shard(namespace, replica_timeout_s=3600.0)  # the holder never heartbeats
    try:
        node_id = ray.get_runtime_context().get_node_id()
        info = ReplicaInfo("holder", node_id, segment_name(namespace, "holder"), HELD_KEYS, 1, PAGE_BYTES)
        keys = [key(i) for i in range(HELD_KEYS)]
        entries = [(k, row, 1) for row, k in enumerate(keys)]
        ray.get(actor.register.remote(info, 1, encode_stored(entries[:MAX_CALL_KEYS]), namespace))
        for seq, start in enumerate(range(MAX_CALL_KEYS, HELD_KEYS, MAX_CALL_KEYS), start=2):
            ray.get(actor.publish.remote("holder", seq, encode_changes(entries[start : start + MAX_CALL_KEYS], []), None, namespace))
        client = ShardActorClient(actor, namespace)
        connect_channels([client.channel])
        grpc_client = query_grpc.GrpcQueryClient(actor, namespace)
        paths = {
            "channel": lambda ks: client.query(ks, namespace),
            "gRPC, mutual TLS": grpc_client.query,
            "Ray call (baseline)": lambda ks: actor.query.remote(ks, namespace).future(),
        }
        processes = {"shard": actor_processes("DirectoryShard", 1)[0], "driver": psutil.Process()}
        before = {name: cpu_seconds(p) for name, p in processes.items()}
        time.sleep(IDLE_S)
        idle = {name: (cpu_seconds(p) - before[name]) / IDLE_S for name, p in processes.items()}
        latencies: dict[str, list[float]] = {label: [] for label in paths}
        cpu: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for label, send in paths.items():
                latencies[label] += one_at_a_time(send, keys, args.calls)
                costs = cpu_per_call(send, keys, args.calls, processes, idle)
                if label not in cpu or sum(costs.values()) < sum(cpu[label].values()):
                    cpu[label] = costs
        print(
            f"queries of {QUERY_KEYS} keys, all hits; {args.rounds} rounds of {args.calls} one at a time "
            f"and {args.calls} with {IN_FLIGHT} in flight"
        )
        print(f"{'path':>20} {'p50 us':>8} {'p99 us':>8} {'shard us/call':>14} {'driver us/call':>15}")
        for label in paths:
            times, costs = latencies[label], cpu[label]
            print(
                f"{label:>20} {percentile(times, 50) * 1e6:>8.0f} {percentile(times, 99) * 1e6:>8.0f} "
                f"{costs['shard'] * 1e6:>14.1f} {costs['driver'] * 1e6:>15.1f}"
            )
        channel, library, baseline = paths.keys()
        for label, against in ((channel, baseline), (library, baseline), (library, channel)):
            print(
                f"{label} against {against}: p50 x{percentile(latencies[label], 50) / percentile(latencies[against], 50):.2f}, "
                f"p99 x{percentile(latencies[label], 99) / percentile(latencies[against], 99):.2f}, "
                f"shard CPU x{cpu[label]['shard'] / cpu[against]['shard']:.2f}, "
                f"driver CPU x{cpu[label]['driver'] / cpu[against]['driver']:.2f}"
            )
        answer = client.query(keys[:QUERY_KEYS], namespace).result()
        pickled = pickle.dumps(decode_answer(answer, QUERY_KEYS), protocol=pickle.HIGHEST_PROTOCOL)
        typed = best_of(lambda: decode_answer(answer, QUERY_KEYS))
        unpickled = best_of(lambda: pickle.loads(pickled))
        print(
            f"reading one answer in the replica: decode_answer {typed * 1e6:.1f} us, against pickle.loads of the same "
            f"answer (how answers crossed before) {unpickled * 1e6:.1f} us: x{typed / unpickled:.2f}"
        )
        client.close()
        grpc_client.close()
    finally:
        ray.kill(actor)
        ray.shutdown()


if __name__ == "__main__":
    main()
