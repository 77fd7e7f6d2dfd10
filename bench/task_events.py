"""What Ray's task events would cost the GCS for the Directory's calls, against none.

    python bench/task_events.py [--calls 5000] [--rounds 3]

One local Ray node and two shards of fresh namespaces: one as `get_or_create_shards` makes
it (its calls out of Ray's task events), the baseline the same class with them on, measured
after it. --rounds rounds for each: --calls queries of 90 keys, 100 in flight at a time,
then 3 s for their task events to reach the GCS. Printed per call: the GCS's CPU, the
shard's and this driver's (psutil, user+system time, less what each uses idle; the fastest
round), and the growth of the GCS's memory over the rounds; then what the task events of a
call cost the GCS, beside the shard's own CPU for the call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import psutil  # noqa: E402
import ray  # noqa: E402

from distkv.demo.runner import token_auth_on  # noqa: E402
from distkv.names import RAY_NAMESPACE  # noqa: E402
from ray_actors.directory import DirectoryShard, get_or_create_shards, kill_shards  # noqa: E402
from scale import actor_processes, cpu_seconds, key  # noqa: E402  (bench/, this script's directory)

QUERY_KEYS = 90
IN_FLIGHT = 100
# Ray reports a process's task events every second (`task_events_report_interval_ms`):
# after this long those of a round's calls are in the GCS.
REPORT_WAIT_S = 3.0
TASKS_KEPT = 100_000  # the GCS keeps the events of this many tasks (`task_events_max_num_task_in_gcs`)


def gcs_process() -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        if "gcs_server" in " ".join(process.info["cmdline"] or []):
            return process
    raise RuntimeError("no gcs_server process")


def idle_cores(process: psutil.Process, seconds: float = REPORT_WAIT_S) -> float:
    before = cpu_seconds(process)
    time.sleep(seconds)
    return (cpu_seconds(process) - before) / seconds


def round_costs(shard, namespace: str, processes: dict[str, psutil.Process], idle: dict[str, float], calls: int) -> dict[str, float]:
    """CPU seconds per call of each process for `calls` queries to `shard`, with the task
    events they report, less what each process uses idle."""
    keys = [key(i) for i in range(QUERY_KEYS)]
    time.sleep(REPORT_WAIT_S)  # the previous round's events are in
    start = time.monotonic()
    before = {name: cpu_seconds(p) for name, p in processes.items()}
    for _ in range(calls // IN_FLIGHT):
        ray.get([shard.query.remote(keys, namespace) for _ in range(IN_FLIGHT)])
    time.sleep(REPORT_WAIT_S)
    wall = time.monotonic() - start
    sent = calls // IN_FLIGHT * IN_FLIGHT
    return {name: (cpu_seconds(p) - before[name] - idle[name] * wall) / sent for name, p in processes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    token_auth_on()
    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, namespace=RAY_NAMESPACE)
    quiet, traced = f"bench-{uuid.uuid4().hex[:8]}", f"bench-{uuid.uuid4().hex[:8]}"
    try:
        shards = {
            "off": get_or_create_shards(quiet, 1)[0],
            "on (baseline)": DirectoryShard.options(num_cpus=0, enable_task_events=True).remote(namespace=traced),
        }
        namespaces = {"off": quiet, "on (baseline)": traced}
        ray.get([s.stats.remote() for s in shards.values()])
        shard_procs = actor_processes("DirectoryShard", 2)
        pids = {label: ray.get(shard.__ray_call__.remote(lambda self: os.getpid())) for label, shard in shards.items()}
        processes = {
            label: {"gcs": gcs_process(), "shard": next(p for p in shard_procs if p.pid == pid), "driver": psutil.Process()}
            for label, pid in pids.items()
        }
        idle = {label: {name: idle_cores(p) for name, p in procs.items()} for label, procs in processes.items()}
        best: dict[str, dict[str, float]] = {}
        grown: dict[str, float] = {}
        for label, shard in shards.items():  # the baseline last: what it leaves in the GCS stays
            gcs = processes[label]["gcs"]
            rss = gcs.memory_info().rss
            for _ in range(args.rounds):
                costs = round_costs(shard, namespaces[label], processes[label], idle[label], args.calls)
                if label not in best or costs["gcs"] < best[label]["gcs"]:
                    best[label] = costs
            grown[label] = (gcs.memory_info().rss - rss) / (args.rounds * args.calls)
        print(f"{args.calls} queries of {QUERY_KEYS} keys a round, {IN_FLIGHT} in flight; CPU: the fastest of {args.rounds} rounds")
        print(f"{'task events':>14} {'GCS us/call':>12} {'shard us/call':>14} {'driver us/call':>15} {'GCS RSS B/call':>15}")
        for label, costs in best.items():
            print(
                f"{label:>14} {costs['gcs'] * 1e6:>12.1f} {costs['shard'] * 1e6:>14.1f} {costs['driver'] * 1e6:>15.1f} "
                f"{grown[label]:>15.0f}"
            )
        off, on = best["off"], best["on (baseline)"]
        print(
            f"the task events of a call cost the GCS {(on['gcs'] - off['gcs']) * 1e6:.1f} us of CPU, "
            f"{(on['gcs'] - off['gcs']) / on['shard']:.1%} of the shard's CPU for the call with them on, "
            f"and {grown['on (baseline)'] - grown['off']:.0f} bytes of its memory (until it holds {TASKS_KEPT:,} tasks' events)"
        )
    finally:
        kill_shards(quiet)
        ray.shutdown()


if __name__ == "__main__":
    main()
