"""Soak: the demo's workload for a long while with random faults; are resources flat?

    python3 scripts/soak.py --minutes 30

Starts an embedded cluster of simulated nodes (as `distkv demo` does) with the demo's model
replicas and sends them the demo's trace over and over (a few seeds in turn, so the set
of prefixes is bounded), through a round-robin router. Every `--fault-every` seconds on
average one fault, chosen at random, strikes: a NodeAgent SIGKILLed, the Directory killed,
the Directory stalled (SIGSTOP) for 3-15 s, or a replica's process SIGKILLed and the
replica restarted under the same name. Every loaded block is checked against the digest
its key had when computed.

Every `--sample-every` seconds it samples the RSS of every process involved (the driver
and every process the cluster started: replicas, NodeAgents, the Directory, raylets,
GCS), the object stores' use, and the distkv pools in /dev/shm. At the end it prints the
samples as a table and, per series, its value at the end of warm-up and at the end and
the verdict: flat after warm-up or not. Exit status 0 when everything is flat and no
loaded block mismatched.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import ray
from ray._private import internal_api
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

from distkv.demo.engine import demo_spec
from distkv.demo.model import ModelConfig
from distkv.demo.runner import token_auth_on
from distkv.demo.workload import WorkloadConfig, generate
from distkv.names import RAY_NAMESPACE, SEGMENT_PREFIX, agent_name
from distkv.storage.segments import reclaim_stale_segments
from ray_actors.demo_replica import DemoReplicaActor
from ray_actors.directory import get_or_create_shards, kill_shards

MiB = 1 << 20
FAULTS = ("kill_node_agent", "kill_directory", "stall_directory", "kill_replica")
# A series is flat when its last third after warm-up exceeds its first third by no more
# than this share of its value, or this absolute amount (whichever is larger).
FLAT_SHARE = 0.05
FLAT_ABS = {"bytes": 24 * MiB, "count": 2}
# Series that are mostly what happens to be in flight when sampled: a leak raises their floor.
IN_FLIGHT = ("object_store_bytes", "object_store_objects", "rss_other_workers", "rss_total")


def pid_of(handle: ray.actor.ActorHandle, timeout: float = 60.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            time.sleep(0.2)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None
    return None


@dataclass
class Sample:
    t: float
    series: dict[str, float]


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model = ModelConfig(seed=0)
        self.workload = WorkloadConfig(requests=args.requests, system_tokens=256, user_tokens=48, reply_tokens=16)
        self.traces = [generate(WorkloadConfig(**{**self.workload.__dict__, "seed": s})) for s in range(args.seeds)]
        self.run_id = uuid.uuid4().hex[:8]
        self.extra = {"cpu_bytes_to_use": args.pool_mib * MiB, "tenant_salt": f"soak-{self.run_id}", "promotion_timeout_s": 2.0}
        self.namespace = demo_spec("ns", self.extra, self.model, args.block_tokens).namespace
        self.cluster: Cluster | None = None
        self.node_ids: list[str] = []
        self.replicas: dict[str, ray.actor.ActorHandle] = {}
        self.placement: dict[str, str] = {}
        self.starting: dict[str, ray.ObjectRef] = {}
        self.pids: dict[str, int] = {}
        self.pending: dict[ray.ObjectRef, tuple[str, int, int]] = {}
        self.digests: dict[bytes, set[int]] = collections.defaultdict(set)
        self.counts = collections.Counter()
        self.faults: list[tuple[float, str, str]] = []
        self.samples: list[Sample] = []
        self.rng = random.Random(args.seed)
        self.stalled: tuple[int, float] | None = None  # (pid, resume at)
        self.started = time.monotonic()
        self._interval = collections.Counter()
        # Sampling runs on its own thread: a raylet asked for its stats while a worker on it
        # is stopped (the stalled Directory) answers only after a long timeout.
        self._lock = threading.Lock()
        self._stop_sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, name="soak-sampler", daemon=True)

    # ---- cluster -------------------------------------------------------------------

    def start(self) -> None:
        cpus = max(1, (os.cpu_count() or 1) // self.args.nodes)
        token_auth_on()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": cpus, "object_store_memory": 256 * MiB, "include_dashboard": False},
        )
        for _ in range(self.args.nodes - 1):
            self.cluster.add_node(num_cpus=cpus, object_store_memory=256 * MiB)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: "node:__internal_head__" not in n["Resources"])
        self.node_ids = [n["NodeID"] for n in nodes]
        for i in range(self.args.replicas):
            name = f"soak{self.run_id}_r{i}"
            self.placement[name] = self.node_ids[i % len(self.node_ids)]
            self._launch(name)
        while self.starting:
            self._poll_starting(timeout=600)

    def _launch(self, name: str) -> None:
        per_node = sum(1 for n in self.placement.values() if n == self.placement[name])
        actor = DemoReplicaActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.placement[name], soft=False)
        ).remote(name, self.extra, self.model, self.args.block_tokens, self.workload.max_prompt_tokens, max(1, 2 // per_node))
        self.starting[name] = actor.describe.remote()
        self.replicas[name] = actor

    def _poll_starting(self, timeout: float = 0.0) -> None:
        if not self.starting:
            return
        ready, _ = ray.wait(list(self.starting.values()), num_returns=len(self.starting), timeout=timeout)
        for name, ref in list(self.starting.items()):
            if ref in ready:
                del self.starting[name]
                try:
                    ray.get(ref)
                    self.pids[name] = pid_of(self.replicas[name])
                except ray.exceptions.RayError as e:
                    print(f"replica {name} failed to start ({e}); starting it again", flush=True)
                    self._launch(name)

    def close(self) -> None:
        self._resume()
        self._stop_sampling.set()
        if self._sampler.is_alive():
            self._sampler.join(120)
        try:
            for ref in self.pending:
                ray.cancel(ref)
            live = [a for n, a in self.replicas.items() if n not in self.starting]
            ray.get([a.shutdown.remote() for a in live], timeout=120)
        except Exception as e:
            print(f"soak: a replica did not shut down cleanly: {e}", file=sys.stderr)
        for actor in self.replicas.values():
            ray.kill(actor)
        kill_shards(self.namespace)
        for node_id in self.node_ids:
            try:
                ray.kill(ray.get_actor(agent_name(node_id), namespace=RAY_NAMESPACE), no_restart=True)
            except ValueError:
                pass
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        reclaim_stale_segments()

    # ---- traffic ---------------------------------------------------------------------

    def serve_round(self, deadline: float, round_no: int) -> None:
        trace = self.traces[round_no % len(self.traces)]
        answered = [False] * len(trace)
        sent = 0
        window = 2 * self.args.replicas
        while (sent < len(trace) or self.pending) and time.monotonic() < deadline:
            self.tick()
            live = [n for n in self.replicas if n not in self.starting]
            while sent < len(trace) and len(self.pending) < window and live:
                after = trace[sent].after
                if after is not None and not answered[after]:
                    break
                name = live[sent % len(live)]
                ref = self.replicas[name].serve.remote(trace[sent].tokens)
                self.pending[ref] = (name, sent, round_no)
                sent += 1
            if not self.pending:
                time.sleep(0.05)
                continue
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=1.0)
            for ref in ready:
                name, i, _ = self.pending.pop(ref)
                answered[i] = True
                try:
                    self.fold(ray.get(ref))
                except ray.exceptions.RayError:
                    self.counts["requests_failed"] += 1

    def fold(self, result: dict) -> None:
        self.counts["requests"] += 1
        tokens = result["tokens"]
        hit = sum(result["blocks_by_source"].values()) * self.args.block_tokens
        with self._lock:
            self._interval["requests"] += 1
            self._interval["tokens"] += tokens
            self._interval["hit_tokens"] += hit
        self.counts["load_failures"] += result["load_failures"]
        for key, digest in result["computed"]:
            self.digests[key].add(digest)
        for key, digest in result["loaded"]:
            known = self.digests.get(key)
            if known is None:
                self.counts["blocks_unverifiable"] += 1
            elif digest in known:
                self.counts["blocks_verified"] += 1
            else:
                self.counts["mismatches"] += 1

    # ---- faults ----------------------------------------------------------------------

    def tick(self) -> None:
        """Faults and restarts that are due."""
        now = time.monotonic()
        self._poll_starting()
        if self.stalled is not None and now >= self.stalled[1]:
            self._resume()
            self._schedule_fault(now)
        if self.stalled is None and now >= self.next_fault and now - self.started > self.args.warmup_s:
            self.inject()
            if self.stalled is None:
                self._schedule_fault(now)

    def _resume(self) -> None:
        if self.stalled is not None:
            os.kill(self.stalled[0], signal.SIGCONT)
            self.stalled = None

    def _schedule_fault(self, now: float) -> None:
        self.next_fault = now + self.rng.uniform(0.5, 1.5) * self.args.fault_every

    def inject(self) -> None:
        fault = self.rng.choice(FAULTS)
        detail = ""
        try:
            if fault == "kill_node_agent":
                node = self.rng.choice(self.node_ids)
                pid = pid_of(ray.get_actor(agent_name(node), namespace=RAY_NAMESPACE), timeout=10)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                detail = f"node {node[:8]} pid {pid}"
            elif fault == "kill_directory":
                (shard,) = get_or_create_shards(self.namespace, 1)
                ray.kill(shard, no_restart=False)
            elif fault == "stall_directory":
                (shard,) = get_or_create_shards(self.namespace, 1)
                pid = pid_of(shard, timeout=10)
                if pid:
                    seconds = self.rng.uniform(3.0, 15.0)
                    os.kill(pid, signal.SIGSTOP)
                    self.stalled = (pid, time.monotonic() + seconds)
                    detail = f"{seconds:.1f} s"
            else:
                live = [n for n in self.replicas if n not in self.starting]
                if live:
                    name = self.rng.choice(live)
                    pid = self.pids.get(name)
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                    self._launch(name)  # the engine restarts under its name
                    detail = name
        except Exception as e:  # a fault that could not be injected is reported, not fatal
            detail = f"not injected: {e}"[:120]
        self.faults.append((time.monotonic() - self.started, fault, detail))
        self.counts[f"fault_{fault}"] += 1
        print(f"[{time.monotonic() - self.started:7.1f} s] fault {fault} {detail}", flush=True)

    # ---- sampling --------------------------------------------------------------------

    def _sample_loop(self) -> None:
        while not self._stop_sampling.wait(self.args.sample_every):
            try:
                self.sample()
            except Exception as e:
                print(f"soak: sample failed: {e}", flush=True)

    @staticmethod
    def _role(proc: psutil.Process) -> str:
        """What a process the cluster started is, from its name and command line."""
        cmd = " ".join(proc.cmdline())
        if "NodeAgent" in cmd:
            return "rss_node_agents"
        if "DirectoryShard" in cmd:
            return "rss_directory"
        if "gcs_server" in cmd:
            return "rss_gcs"
        if "raylet" in proc.name():
            return "rss_raylets"
        if "default_worker" in cmd:
            return "rss_other_workers"  # idle or starting workers, replicas being restarted
        return "rss_ray_agents"  # dashboard, runtime-env and log agents

    def sample(self) -> None:
        driver = psutil.Process()
        roles: dict[int, str] = {driver.pid: "rss_driver"}
        for name, pid in self.pids.items():
            if pid:
                roles[pid] = "rss_replicas"
        series = collections.Counter()
        threads = 0
        for proc in [driver, *driver.children(recursive=True)]:
            try:
                rss = proc.memory_info().rss
                role = roles.get(proc.pid)
                if role is None:
                    role = self._role(proc)
                series[role] += rss
                if role == "rss_replicas":
                    threads += proc.num_threads()
            except psutil.Error:
                continue
        series["rss_total"] = sum(v for k, v in series.items() if k.startswith("rss_"))
        series["replica_threads"] = threads
        used = objects = 0
        for node in ray.nodes():
            if node["Alive"]:
                try:
                    stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"]).store_stats
                except Exception:
                    continue
                used += stats.object_store_bytes_used
                objects += stats.num_local_objects
        series["object_store_bytes"] = used
        series["object_store_objects"] = objects
        shm = 0
        segments = 0
        for name in os.listdir("/dev/shm"):
            if name.startswith(SEGMENT_PREFIX) and self.namespace in name:
                try:
                    shm += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
                    segments += 1
                except FileNotFoundError:
                    pass
        series["shm_pool_bytes"] = shm
        series["shm_pool_segments"] = segments
        with self._lock:
            tokens = self._interval["tokens"]
            series["hit_rate"] = self._interval["hit_tokens"] / tokens if tokens else float("nan")
            series["requests"] = self._interval["requests"]
            self._interval.clear()
            self.samples.append(Sample(time.monotonic() - self.started, dict(series)))

    def transported(self) -> dict[str, str]:
        """MiB each transport moved across nodes, summed over the live replicas (a restarted
        replica counts from its restart)."""
        live = [a for n, a in self.replicas.items() if n not in self.starting]
        try:
            stats = ray.get([a.stats.remote() for a in live], timeout=60)
        except ray.exceptions.RayError as e:
            return {"unknown": repr(e)[:200]}
        moved = collections.Counter()
        for s in stats:
            moved.update({k[: -len("_bytes")]: v for k, v in s.items() if k.endswith("_bytes") and "node" not in k})
        return {transport: f"{nbytes / MiB:.1f} MiB" for transport, nbytes in sorted(moved.items())}

    # ---- the whole run ---------------------------------------------------------------

    def run(self) -> int:
        end = time.monotonic() + self.args.minutes * 60
        self.next_fault = self.started + self.args.warmup_s
        self.sample()
        self._sampler.start()
        round_no = 0
        while time.monotonic() < end:
            self.serve_round(end, round_no)
            round_no += 1
            print(
                f"[{time.monotonic() - self.started:7.1f} s] round {round_no}: {self.counts['requests']} requests, "
                f"mismatches {self.counts['mismatches']}, faults {len(self.faults)}",
                flush=True,
            )
        self._resume()
        self._stop_sampling.set()
        self._sampler.join(120)
        self.sample()
        return self.report()

    def report(self) -> int:
        keys = [
            "rss_total", "rss_replicas", "rss_node_agents", "rss_directory", "rss_gcs", "rss_raylets",
            "rss_ray_agents", "rss_other_workers", "rss_driver",
            "replica_threads", "object_store_bytes", "object_store_objects", "shm_pool_bytes", "shm_pool_segments",
        ]
        print("\nSAMPLES (MiB for bytes)")
        header = ["t_s", *keys, "hit_rate", "requests"]
        print("  ".join(f"{h:>12}" for h in header))
        step = max(1, len(self.samples) // 60)
        for s in self.samples[::step] + ([self.samples[-1]] if (len(self.samples) - 1) % step else []):
            row = [f"{s.t:12.0f}"]
            for k in [*keys, "hit_rate", "requests"]:
                v = s.series.get(k, 0)
                row.append(f"{v / MiB:12.1f}" if k.endswith("bytes") or k.startswith("rss") else f"{v:12.2f}" if k == "hit_rate" else f"{v:12.0f}")
            print("  ".join(row))

        warm = [s for s in self.samples if s.t >= self.args.warmup_s]
        verdicts = {}
        print(
            f"\nAFTER WARM-UP ({self.args.warmup_s:.0f} s): first third vs last third; medians, and floors "
            "(minimums) for what is in flight (objects, the workers of replicas being restarted)"
        )
        for k in keys:
            values = [s.series.get(k, 0) for s in warm]
            if len(values) < 6:
                verdicts[k] = None
                continue
            third = len(values) // 3
            level = min if k in IN_FLIGHT else np.median
            first, last = float(level(values[:third])), float(level(values[-third:]))
            kind = "count" if ("objects" in k or "segments" in k or "threads" in k) else "bytes"
            allowed = max(FLAT_SHARE * first, FLAT_ABS[kind])
            flat = last - first <= allowed
            verdicts[k] = flat
            unit = (lambda v: f"{v / MiB:.1f} MiB") if kind == "bytes" else (lambda v: f"{v:.0f}")
            print(f"  {k:<22} {unit(first):>12} -> {unit(last):>12}  (max {unit(max(values))}, allowed +{unit(allowed)})  {'flat' if flat else 'GROWING'}")
        total_faults = collections.Counter(f for _, f, _ in self.faults)
        print(f"\nrequests {self.counts['requests']} (failed by faults {self.counts['requests_failed']}), "
              f"blocks verified {self.counts['blocks_verified']}, unverifiable {self.counts['blocks_unverifiable']}, "
              f"mismatches {self.counts['mismatches']}, load failures {self.counts['load_failures']}")
        print(f"faults injected: {dict(total_faults)}")
        print(f"cross-node promotions by transport (transport {self.extra.get('transport', 'auto')!r}): {self.transported()}")
        flat = all(v is not False for v in verdicts.values()) and any(v for v in verdicts.values())
        print(f"VERDICT: {'flat after warm-up' if flat else 'NOT flat after warm-up'}; "
              f"{'no' if not self.counts['mismatches'] else self.counts['mismatches']} mismatched block(s)")
        return 0 if flat and not self.counts["mismatches"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--pool-mib", type=int, default=16, help="pool per replica, small so that it turns over (default 16)")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=120, help="requests per trace (default 120)")
    parser.add_argument("--seeds", type=int, default=3, help="traces sent in turn (default 3)")
    parser.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between faults (default 20)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--warmup-s", type=float, help="seconds before faults and the flatness check (default: a fifth of the run, at most 300)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.warmup_s is None:
        args.warmup_s = min(300.0, args.minutes * 60 / 5)
    soak = Soak(args)
    print(f"soak: {args.minutes} min, {args.replicas} replicas on {args.nodes} nodes, namespace {soak.namespace}", flush=True)
    try:
        soak.start()
        return soak.run()
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
