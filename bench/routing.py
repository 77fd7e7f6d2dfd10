"""distkv's router on the demo's trace: each arm against the others, the median of several runs.

    python bench/routing.py [--runs 3] [--traces default,skew,small_pool] [--json PATH] [DEMO ARGS]

Each run is one `python -m distkv demo --json` of all four arms on the same trace, so every
ratio compares arms measured in the same run (distkv with its router over distkv with
Serve's default router, and over each replica's own pool with Ray's PrefixCacheAffinityRouter).
An arm's figures depend on which arms ran before it in the same demo (docs/benchmarks.md,
"Routing, session 37"), so the three compared arms take turns in each position: run i runs
offloading off first, then the three rotated by i (a Latin square over every 3 runs).
Three traces: the demo's default; `--skew` (one hot system prompt); pools too small for the
working set (`--pool-mib 8`: 64 blocks a replica, under the 128 of the 4 system prompts alone,
which the 4 replicas' pools together hold). For each ratio the table gives the median of the
runs and every run's value, and where each arm's slowest requests (p99 and over) spent their
time.
The demo's own arguments pass through: `--rate 20` measures the same in an open loop.

`--overhead` times instead the routers' own decisions in this process (no Ray): Serve's
default router (power of two choices, its pick of the shorter queue included) and distkv's
(its keys, its score, its ranking; the Directory answering at once), per decision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACES = {
    "default": [],
    "skew": ["--skew"],
    "small_pool": ["--pool-mib", "8"],
}
# (trace, figure, arm, baseline, goal): each ratio the issue sets a goal for
TARGETS = [
    ("default", "p50", "distkv-router", "distkv", 0.8),
    ("default", "cross_node_bytes", "distkv-router", "distkv", 0.5),
    ("default", "p50", "distkv-router", "affinity", 1.0),
    ("default", "p99", "distkv-router", "affinity", 0.9),
    ("skew", "p50", "distkv-router", "affinity", 0.8),
    ("skew", "p99", "distkv-router", "affinity", 0.6),
    ("small_pool", "p50", "distkv-router", "affinity", 0.8),
]


# the arms each ratio compares, rotated from run to run
COMPARED = ("affinity", "distkv", "distkv-router")


def arm_order(run: int) -> list[str]:
    """Run `run`'s arms: offloading off, then the compared ones rotated by `run`."""
    turn = run % len(COMPARED)
    return ["off", *COMPARED[turn:], *COMPARED[:turn]]


def run_demo(trace: str, arms: list[str], demo_args: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "distkv", "demo", "--json", "--arms", ",".join(arms), *TRACES[trace], *demo_args],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"distkv demo ({trace}) exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def ratio(doc: dict[str, Any], figure: str, arm: str, baseline: str) -> float:
    a, b = doc["arms"][arm], doc["arms"][baseline]
    if figure == "cross_node_bytes":
        x, y = (d["transfers"]["cross_node_promotion"]["bytes"] for d in (a, b))
    else:
        x, y = a["ttft_s"][figure], b["ttft_s"][figure]
    return x / y if y else float("nan")


def summarize(docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    for trace, figure, arm, baseline, goal in TARGETS:
        if trace not in docs:
            continue
        values = [ratio(d, figure, arm, baseline) for d in docs[trace]]
        median = statistics.median(values)
        rows.append({"trace": trace, "figure": figure, "arm": arm, "baseline": baseline, "goal": goal,
                     "median": median, "runs": values, "met": median <= goal})
    per_trace = {}
    for trace, runs in docs.items():
        arms = runs[0]["arms"]
        per_trace[trace] = {
            name: {
                "ttft_ms": {p: statistics.median(d["arms"][name]["ttft_s"][p] * 1e3 for d in runs) for p in ("p50", "p99")},
                "hit_rate": statistics.median(d["arms"][name]["hit_rate"] for d in runs),
                "oracle_hit_rate": runs[0]["arms"][name]["oracle_hit_rate"],
                "oracle_hit_rate_as_run": statistics.median(d["arms"][name]["oracle_hit_rate_as_run"] for d in runs),
                "max_over_mean": statistics.median(d["arms"][name]["requests_per_replica"]["max_over_mean"] for d in runs),
                "cross_node_mib": statistics.median(
                    d["arms"][name]["transfers"]["cross_node_promotion"]["bytes"] / 2**20 for d in runs),
                "p99_tail_ms": {
                    part: statistics.median(d["arms"][name]["tail"]["p99_and_slower"][part] * 1e3 for d in runs)
                    for part in ("queue_s", "wait_s", "load_s", "compute_s")
                },
                "mismatches": sum(d["mismatches"] for d in runs),
            }
            for name in arms
        }
    return {"ratios": rows, "traces": per_trace}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'trace':<11}{'ratio':<42}{'goal':>7}{'median':>9}   runs")
    for r in summary["ratios"]:
        label = f"{r['arm']} / {r['baseline']} {r['figure']}"
        runs = " ".join(f"{v:.2f}" for v in r["runs"])
        print(f"{r['trace']:<11}{label:<42}{'<=' + format(r['goal'], '.1f'):>7}{r['median']:>9.2f}   {runs}"
              f"   {'met' if r['met'] else 'NOT met'}")
    for trace, arms in summary["traces"].items():
        print(f"\n{trace}: medians of the runs")
        print(f"  {'arm':<15}{'p50 ms':>9}{'p99 ms':>9}{'hit':>7}{'oracle':>8}{'as run':>8}{'max/mean':>10}{'cross MiB':>11}"
              "   p99 tail: queue / pull wait / load / compute ms")
        for name, a in arms.items():
            tail = " / ".join(f"{a['p99_tail_ms'][p]:.0f}" for p in ("queue_s", "wait_s", "load_s", "compute_s"))
            print(f"  {name:<15}{a['ttft_ms']['p50']:>9.1f}{a['ttft_ms']['p99']:>9.1f}{a['hit_rate']:>7.1%}"
                  f"{a['oracle_hit_rate']:>8.1%}{a['oracle_hit_rate_as_run']:>8.1%}{a['max_over_mean']:>10.2f}"
                  f"{a['cross_node_mib']:>11.1f}   {tail}")


# ---- --overhead: the routers' own decisions, without Ray -----------------------------------


class _Replica:
    """What a request router reads of a running replica."""

    def __init__(self, i: int, stats: dict[str, Any]):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=f"r{i}", deployment_id=DeploymentID(name="engine", app_name="bench"))
        self.node_id, self.availability_zone, self.multiplexed_model_ids = f"node{i % 2}", None, set()
        self.max_ongoing_requests, self.is_cross_language, self.routing_stats = 100, False, stats

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def overhead(decisions: int, replicas: int) -> dict[str, float]:
    """CPU seconds per decision of each router (this thread's: the machine's other processes
    do not count): choose_replicas, and for Serve's default router its pick among the two
    candidates, with every replica's queue length in Serve's cache."""
    import numpy as np
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.request_router import PendingRequest

    from distkv.demo.request import DemoRequest
    from distkv.replica.harness import block_keys
    from distkv.serve_router import DistkvRequestRouter

    tokens = np.random.default_rng(0).integers(0, 4096, 600).tolist()
    keys = block_keys(tokens, 16)
    held = [[(f"d{i % replicas}", f"node{i % 2}", i, 1)] if i < 32 else [] for i in range(len(keys))]

    def stats(i: int) -> dict[str, Any]:
        return {"distkv": {"replica_id": f"d{i}", "node_id": f"node{i % 2}", "namespace": "ns", "directory_shards": 1,
                           "keys": {"kind": "seed", "block_tokens": 16}, "costs": {}}}

    async def run(cls) -> float:
        router = cls(deployment_id=DeploymentID(name="engine", app_name="bench"),
                     handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True,
                     create_replica_wrapper_func=lambda r: r)
        router.initialize_state()
        if cls is DistkvRequestRouter:
            async def ask(namespace, num_shards, shard, asked):
                return held[: len(asked)]

            router.core.ask = ask
        candidates = [_Replica(i, stats(i)) for i in range(replicas)]
        router.update_replicas(candidates)
        for i, r in enumerate(candidates):
            router.replica_queue_len_cache.update(r.replica_id, i % 3)
        started = time.thread_time()  # CPU time: other processes on the machine do not count
        for n in range(decisions):
            request = PendingRequest(args=[DemoRequest(tokens)], kwargs={}, metadata=RequestMetadata(
                request_id=str(n), internal_request_id=str(n)))
            ranked = await router.choose_replicas(candidates, request)
            if cls is PowerOfTwoChoicesRequestRouter:
                await router._select_from_candidate_replicas(ranked[0], 0)
            else:
                router.core.forget(str(n))
        return (time.thread_time() - started) / decisions

    return {
        "serve_default_s": asyncio.run(run(PowerOfTwoChoicesRequestRouter)),
        "distkv_s": asyncio.run(run(DistkvRequestRouter)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--overhead", action="store_true", help="time the routers' own decisions instead")
    parser.add_argument("--json", help="also write the figures here")
    args, demo_args = parser.parse_known_args()  # the rest goes to every demo run
    if args.overhead:
        figures = overhead(decisions=2000, replicas=4)
        print(f"per decision: Serve's default router {figures['serve_default_s'] * 1e6:.0f} us, "
              f"distkv's {figures['distkv_s'] * 1e6:.0f} us (the Directory answering at once)")
    else:
        docs: dict[str, list[dict[str, Any]]] = {}
        for run in range(args.runs):
            for trace in args.traces.split(","):
                started = time.perf_counter()
                arms = arm_order(run)
                docs.setdefault(trace, []).append({**run_demo(trace, arms, demo_args), "arm_order": arms})
                print(f"run {run + 1}/{args.runs} {trace} ({', '.join(arms)}): {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
                if args.json:  # what ran so far survives a run that fails
                    Path(args.json).write_text(json.dumps({"documents": docs}, indent=2))
        figures = {**summarize(docs), "documents": docs}
        print_table(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
