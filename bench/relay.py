"""What a node's relay of publishes costs its NodeAgent, against the shards' cost of direct publishes.

    python bench/relay.py [--shards 1,16] [--replicas 8] [--steps 200] [--events 50]

One local Ray node, a fresh namespace of --shards shards and the node's NodeAgent. --replicas
replicas (registered `ReplicaInfo`s, driven from this process) take --steps steps each, as
queried links do: a step hands one publish of --events events to every shard to the agent
in one call (`distkv.directory.relay.RelayBatch`'s call, `NodeAgent.relay`), which the agent's
`PublishRelay` carries on. Then the baseline, as following links publish: the same publishes
sent to each shard directly, one call each. Printed: the agent's CPU per replica step (its
own calls to the shards included) and the shards' CPU per step in both ways (psutil, the
processes' user+system time), and the ratio of the agent's per step to the shards' per step
of direct publishes: what a node pays for sparing the Directory its replicas' calls.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import psutil  # noqa: E402
import ray  # noqa: E402

from distkv.demo.runner import token_auth_on  # noqa: E402
from distkv.directory.records import ReplicaInfo  # noqa: E402
from distkv.directory.wire import encode_changes, encode_stored  # noqa: E402
from distkv.names import segment_name  # noqa: E402
from ray_actors.directory import get_or_create_shards, kill_shards  # noqa: E402
from ray_actors.node_agent import start_node_agent  # noqa: E402
from scale import actor_processes  # noqa: E402  (bench/, this script's directory)

MiB = 1 << 20
ROWS = 1 << 16


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4 + b"\0\0\0\0"


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def measure(num_shards: int, replicas: int, steps: int, events: int) -> dict[str, float]:
    namespace = f"relaybench{uuid.uuid4().hex[:8]}"
    shards = get_or_create_shards(namespace, num_shards)
    try:
        node_id = ray.get_runtime_context().get_node_id()
        agent = start_node_agent(node_id)
        ray.get(agent.node_id.remote())
        names = [f"r{r}" for r in range(replicas)]
        for name in names:
            info = ReplicaInfo(name, node_id, segment_name(namespace, name), ROWS, 1, 4096)
            ray.get([shard.register.remote(info, 1, encode_stored([]), namespace=namespace) for shard in shards])
        shard_procs = actor_processes("DirectoryShard", num_shards)
        agent_procs = actor_processes("NodeAgent", 1)
        half = events // 2

        def payload(step: int) -> bytes:
            return encode_changes([(key(step * events + i), (step * events + i) % ROWS, step + 1) for i in range(half)], [key((step - 1) * events + i) for i in range(half) if step > 0])

        relayed = {}
        agent_before, shards_before, started = cpu_seconds(agent_procs), cpu_seconds(shard_procs), time.monotonic()
        for step in range(steps):
            changes = payload(step)
            ray.get([
                agent.relay.remote(namespace, num_shards, [(s, name, 2 + step, changes, None) for s in range(num_shards)])
                for name in names
            ])
        relayed["seconds"] = time.monotonic() - started
        relayed["agent_us_per_step"] = (cpu_seconds(agent_procs) - agent_before) / (steps * replicas) * 1e6
        relayed["shards_us_per_step"] = (cpu_seconds(shard_procs) - shards_before) / (steps * replicas) * 1e6

        shards_before, started = cpu_seconds(shard_procs), time.monotonic()
        for step in range(steps, 2 * steps):
            changes = payload(step)
            ray.get([
                shard.publish.remote(name, 2 + step, changes, None, namespace=namespace) for name in names for shard in shards
            ])
        direct_seconds = time.monotonic() - started
        direct_us = (cpu_seconds(shard_procs) - shards_before) / (steps * replicas) * 1e6
        stats = ray.get([shard.stats.remote() for shard in shards])
    finally:
        kill_shards(namespace)
    return {
        "shards": num_shards,
        "relay_calls": sum(s.get("relay_calls", 0) for s in stats),
        "relayed_publishes": sum(s.get("relayed_publishes", 0) for s in stats),
        "relayed_seconds": relayed["seconds"],
        "agent_us_per_step": relayed["agent_us_per_step"],
        "shards_us_per_relayed_step": relayed["shards_us_per_step"],
        "direct_seconds": direct_seconds,
        "shards_us_per_direct_step": direct_us,
    }


def counts_arg(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=counts_arg, default=[1, 16], help="shard counts (default 1,16)")
    parser.add_argument("--replicas", type=int, default=8, help="replicas of the node (default 8)")
    parser.add_argument("--steps", type=int, default=200, help="steps per replica and way (default 200)")
    parser.add_argument("--events", type=int, default=50, help="events per publish, half stored, half removed (default 50)")
    args = parser.parse_args()
    token_auth_on()
    ray.init(num_cpus=2, object_store_memory=100 * MiB, include_dashboard=False)
    try:
        print(
            f"{'shards':>6} {'agent us/step':>14} {'shards us/step relayed':>23} {'shards us/step direct':>22} "
            f"{'agent / direct':>15} {'relay calls':>12} {'publishes':>10}"
        )
        for num_shards in args.shards:
            r = measure(num_shards, args.replicas, args.steps, args.events)
            print(
                f"{r['shards']:>6} {r['agent_us_per_step']:>14,.0f} {r['shards_us_per_relayed_step']:>23,.0f} "
                f"{r['shards_us_per_direct_step']:>22,.0f} {r['agent_us_per_step'] / r['shards_us_per_direct_step']:>15.2f} "
                f"{r['relay_calls']:>12,} {r['relayed_publishes']:>10,}",
                flush=True,
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
