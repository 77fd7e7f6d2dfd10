"""The fault suite's workload: replicas serving shared prefixes while a fault is injected.

`FaultReplica` is a harness replica (synthetic KV, every loaded block checked against what
computing it gives) as a Ray actor that also reports how long each request waited on
lookups answering "retry". `Workload` keeps every live replica busy from the driver,
records each request's outcome with its end time, and checks what the issue asks of
every fault: nothing wrong loaded, no wait past the promotion timeout, no surviving
replica crashed, the hit rate back within 10 s, nothing leaked.
"""

from __future__ import annotations

import concurrent.futures.thread
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import ray
import ray.cloudpickle
from ray._private import internal_api
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.replica.harness import Replica
from distkv.names import RAY_NAMESPACE, SEGMENT_PREFIX, agent_name
from distkv.replica.specs import ClusterOffloadingSpec
from distkv.observability.stats import ReplicaStats
from ray_actors.directory import get_or_create_shards, kill_shards

# Workers cannot import this module (tests/faults is not on their path): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BLOCK_TOKENS = 4
PAGE_BYTES = 4 << 10
SLOT_BYTES = 2 * PAGE_BYTES
DOC_BLOCKS = 8
# The hit rate has recovered when a window of this many seconds reaches this share of the
# hit rate before the fault.
WINDOW_S = 2.0
RECOVERED_SHARE = 0.8
RECOVERY_LIMIT_S = 10.0
# Lookups may answer "retry" up to the promotion timeout; scheduling noise on a shared
# 2-core machine gets this much on top.
WAIT_SLACK_S = 2.0


class TimedReplica(Replica):
    """A harness replica that measures how long each request was deferred by retries."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._deferred_since: float | None = None
        self.last_wait_s = 0.0

    def _matched_blocks(self, keys, ctx):
        hits = super()._matched_blocks(keys, ctx)
        now = time.monotonic()
        if hits is None:
            if self._deferred_since is None:
                self._deferred_since = now
        elif self._deferred_since is not None:
            self.last_wait_s = now - self._deferred_since
            self._deferred_since = None
        return hits

    def timed_serve(self, tokens: np.ndarray, max_wait_s: float) -> dict[str, Any]:
        self.last_wait_s = 0.0
        self._deferred_since = None
        result = self.serve(tokens, max_retries=int(max_wait_s / self.step_s))
        if self._deferred_since is not None:  # gave up waiting
            self.last_wait_s = time.monotonic() - self._deferred_since
            self._deferred_since = None
        return {
            "end": time.time(),
            "wait_s": self.last_wait_s,
            "load_s": result.load_s,
            "blocks": result.blocks,
            "hit_blocks": result.hit_blocks,
            "mismatches": result.mismatches,
            "load_failures": result.load_failures,
        }


@ray.remote(num_cpus=0)
class FaultReplica:
    def __init__(self, replica_id: str, extra_config: dict, pool_blocks: int, gpu_blocks: int = 48):
        spec = ClusterOffloadingSpec.from_layout(
            {**extra_config, "cpu_bytes_to_use": pool_blocks * SLOT_BYTES},
            gpu_block_sizes=[BLOCK_TOKENS],
            group_page_bytes=[SLOT_BYTES],
            engine_id=replica_id,
        )
        self.replica = TimedReplica(spec, num_gpu_blocks=gpu_blocks, page_bytes=PAGE_BYTES)

    def serve_many(self, prompts: Sequence[np.ndarray], max_wait_s: float = 30.0) -> list[dict[str, Any]]:
        return [self.replica.timed_serve(p, max_wait_s) for p in prompts]

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> tuple[int, int]:
        """(Python threads outside thread pools, OS threads) of this process. A pool's
        workers are no leak: it starts them as its work first needs them, up to its size."""
        pooled = sum(1 for t in threading.enumerate() if getattr(t, "_target", None) is concurrent.futures.thread._worker)
        return threading.active_count() - pooled, psutil.Process().num_threads()

    def block(self, key: bytes) -> tuple[int, int] | None:
        return self.replica.manager.local.block(key)

    def pool_name(self) -> str:
        return self.replica.spec.pool_name

    def stats(self) -> ReplicaStats:
        return self.replica.manager.stats()

    def nixl_state(self) -> dict[str, int]:
        """What this replica's NIXL transport holds: peers connected, scratch slots free and in all."""
        nixl = self.replica.manager.promoter.transport.nixl
        scratch = nixl.scratch
        return {"peers": nixl.agent.num_peers, "scratch_free": len(scratch._free), "scratch": len(scratch.buffer)}

    def shutdown(self) -> None:
        self.replica.shutdown()


def plasma_objects() -> int:
    """Objects in the object stores of every live node."""
    total = 0
    for node in ray.nodes():
        if node["Alive"]:
            stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
            total += stats.store_stats.num_local_objects
    return total


def actor_pid(handle: ray.actor.ActorHandle, timeout: float = 30.0) -> int:
    """The pid of an actor's process, once it is up (it may be restarting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def node_agent(node_id: str) -> ray.actor.ActorHandle:
    return ray.get_actor(agent_name(node_id), namespace=RAY_NAMESPACE)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Seconds until predicate() holds; AssertionError naming `what` after timeout_s."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


@dataclass
class Outcome:
    """What a fault did to the workload: the figures docs/faults.md tabulates."""

    fault: str
    requests: int = 0
    blocks_loaded: int = 0
    mismatches: int = 0
    load_failures: int = 0
    max_wait_s: float = 0.0
    max_load_s: float = 0.0
    baseline_hit_rate: float = 0.0
    dip_hit_rate: float = 1.0
    recovery_s: float | None = None
    crashed: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        recovery = "never" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        return (
            f"FAULT {self.fault}: {self.requests} requests, {self.blocks_loaded} blocks loaded, "
            f"mismatches {self.mismatches}, load failures {self.load_failures}, max wait {self.max_wait_s:.2f} s, "
            f"max load {self.max_load_s:.2f} s, "
            f"hit rate {self.baseline_hit_rate:.0%} -> min {self.dip_hit_rate:.0%}, recovered in {recovery}, "
            f"crashed {self.crashed or 'none'}, leaks {self.leaks or 'none'}"
            + (f"; {'; '.join(self.notes)}" if self.notes else "")
        )


class Workload:
    """Replicas of one fresh cache namespace serving shared prefixes, driven from here.

    `run` keeps one batch of requests in flight per live replica; each request's outcome
    lands in `results` with its replica and end time. Replicas expected to die are
    marked with `expect_death` so that their errors are not counted as crashes.
    """

    def __init__(self, promotion_timeout_s: float = 2.0, docs: int = 16, batch: int = 6, seed: int = 0, **extra: Any):
        self.promotion_timeout_s = promotion_timeout_s
        self.config = {"tenant_salt": uuid.uuid4().hex, "promotion_timeout_s": promotion_timeout_s, **extra}
        self.namespace = ClusterOffloadingSpec.from_layout(
            self.config, gpu_block_sizes=[BLOCK_TOKENS], group_page_bytes=[SLOT_BYTES]
        ).namespace
        self.rng = np.random.default_rng(seed)
        self.docs = [self.rng.integers(0, 50_000, DOC_BLOCKS * BLOCK_TOKENS) for _ in range(docs)]
        self.batch = batch
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.placement: dict[str, tuple[Any, int]] = {}
        self.expected_dead: set[str] = set()
        self.crashed: dict[str, str] = {}
        self.results: list[tuple[str, dict[str, Any]]] = []
        self._in_flight: dict[ray.ObjectRef, str] = {}
        self.plasma_before = plasma_objects()

    # ---- replicas ------------------------------------------------------------------

    def start(self, names_nodes: Sequence[tuple[str, Any]], pool_blocks: int = 64) -> None:
        for name, node in names_nodes:
            self.placement[name] = (node, pool_blocks)
            self.actors[name] = self._new_actor(name, node, pool_blocks)
        ray.get([a.pid.remote() for a in self.actors.values()], timeout=120)
        shards = get_or_create_shards(self.namespace, 1)
        wait_until(
            lambda: ray.get(shards[0].stats.remote(), timeout=30)["replicas"] >= len(self.actors),
            60, "replicas registered with the Directory",
        )

    def _new_actor(self, name: str, node: Any, pool_blocks: int) -> ray.actor.ActorHandle:
        return FaultReplica.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        ).remote(name, self.config, pool_blocks)

    def restart(self, name: str) -> None:
        """A new process for replica `name`, on its node, with its pool name (as an engine restart)."""
        node, pool_blocks = self.placement[name]
        self.actors[name] = self._new_actor(name, node, pool_blocks)
        ray.get(self.actors[name].pid.remote(), timeout=120)
        self.expected_dead.discard(name)

    def expect_death(self, name: str) -> None:
        self.expected_dead.add(name)

    def live(self) -> dict[str, ray.actor.ActorHandle]:
        return {n: a for n, a in self.actors.items() if n not in self.expected_dead and n not in self.crashed}

    # ---- traffic -------------------------------------------------------------------

    def request(self) -> np.ndarray:
        doc = self.docs[self.rng.integers(len(self.docs))]
        prefix = doc[: self.rng.integers(4, DOC_BLOCKS + 1) * BLOCK_TOKENS]
        tail = self.rng.integers(0, 50_000, self.rng.integers(0, 2) * BLOCK_TOKENS)
        return np.concatenate([prefix, tail])

    def warm(self) -> None:
        """Every doc stored once, spread over the replicas, and visible to all."""
        names = list(self.live())
        refs = [self.actors[names[i % len(names)]].serve_many.remote([doc]) for i, doc in enumerate(self.docs)]
        ray.get(refs, timeout=120)

    def run(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Keep every live replica busy for `seconds` (or until `until()` holds)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until is not None and until()):
            busy = set(self._in_flight.values())
            for name, actor in self.live().items():
                if name not in busy:
                    ref = actor.serve_many.remote([self.request() for _ in range(self.batch)], 30.0)
                    self._in_flight[ref] = name
            self._collect(0.2)

    def drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            self._collect(1.0)
        assert not self._in_flight, f"requests still running {timeout_s} s after the workload stopped"

    def _collect(self, timeout_s: float) -> None:
        if not self._in_flight:
            time.sleep(timeout_s)
            return
        ready, _ = ray.wait(list(self._in_flight), num_returns=len(self._in_flight), timeout=timeout_s)
        for ref in ready:
            name = self._in_flight.pop(ref)
            try:
                batch = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if name not in self.expected_dead:
                    self.crashed[name] = f"{type(e).__name__}: {e}"[:300]
                continue
            self.results.extend((name, r) for r in batch)

    # ---- measures ------------------------------------------------------------------

    def hit_rate(self, start: float, end: float, replicas: set[str] | None = None) -> float | None:
        """Hit blocks over blocks of the requests that ended in [start, end); None with too few."""
        chosen = [
            r for name, r in self.results
            if start <= r["end"] < end and (replicas is None or name in replicas)
        ]
        blocks = sum(r["blocks"] for r in chosen)
        if len(chosen) < 8 or not blocks:
            return None
        return sum(r["hit_blocks"] for r in chosen) / blocks

    def recovered_at(self, baseline: float, since: float, replicas: set[str] | None = None) -> float | None:
        """Seconds after `since` when a WINDOW_S window first reached RECOVERED_SHARE of baseline."""
        ends = sorted(r["end"] for name, r in self.results if r["end"] >= since)
        for t in ends:
            if t - WINDOW_S < since:
                continue
            rate = self.hit_rate(t - WINDOW_S, t, replicas)
            if rate is not None and rate >= RECOVERED_SHARE * baseline:
                return t - since
        return None

    def run_until_recovered(self, baseline: float, since: float, replicas: set[str] | None = None) -> float | None:
        self.run(
            RECOVERY_LIMIT_S + WINDOW_S + 1.0 - (time.time() - since),
            until=lambda: self.recovered_at(baseline, since, replicas) is not None,
        )
        self.drain()
        return self.recovered_at(baseline, since, replicas)

    def threads(self) -> dict[str, tuple[int, int]]:
        live = self.live()
        return dict(zip(live, ray.get([a.threads.remote() for a in live.values()], timeout=60)))

    def segments(self) -> list[str]:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX) and self.namespace in n)

    # ---- the verdict ---------------------------------------------------------------

    def outcome(
        self,
        fault: str,
        fault_start: float,
        fault_end: float,
        baseline: float,
        threads_before: dict[str, tuple[int, int]],
        replicas: set[str] | None = None,
    ) -> Outcome:
        """Check every guarantee once the workload has stopped; shuts the replicas down.

        `replicas`: whose hit rate must recover (default: all of them).
        """
        out = Outcome(fault)
        out.requests = len(self.results)
        out.blocks_loaded = sum(r["hit_blocks"] for _, r in self.results)
        out.mismatches = sum(r["mismatches"] for _, r in self.results)
        out.load_failures = sum(r["load_failures"] for _, r in self.results)
        out.max_wait_s = max((r["wait_s"] for _, r in self.results), default=0.0)
        out.max_load_s = max((r["load_s"] for _, r in self.results), default=0.0)
        out.baseline_hit_rate = baseline
        dips = [
            self.hit_rate(t, t + 1.0, replicas)
            for t in np.arange(fault_start, fault_end + RECOVERY_LIMIT_S, 0.5)
        ]
        out.dip_hit_rate = min((d for d in dips if d is not None), default=float("nan"))
        out.recovery_s = self.recovered_at(baseline, fault_end, replicas)
        out.crashed = sorted(self.crashed)

        threads_after = self.threads()
        for name, (py_before, os_before) in threads_before.items():
            if name in threads_after:
                py_after, os_after = threads_after[name]
                if py_after > py_before or os_after > os_before + 4:
                    out.leaks.append(f"threads of {name}: {py_before}/{os_before} -> {py_after}/{os_after}")
        live = self.live()
        ray.get([a.shutdown.remote() for a in live.values()], timeout=60)
        for actor in self.actors.values():
            ray.kill(actor)
        kill_shards(self.namespace)
        try:
            wait_until(lambda: not self.segments(), 10, "segments removed")
        except AssertionError:
            out.leaks.append(f"segments {self.segments()}")
        try:
            wait_until(lambda: plasma_objects() <= self.plasma_before, 15, "object store emptied", poll_s=0.2)
        except AssertionError:
            out.leaks.append(f"object store: {plasma_objects()} objects, {self.plasma_before} before")
        print(out.line())
        return out

    def check(self, out: Outcome) -> None:
        assert out.mismatches == 0, out.line()
        assert out.max_wait_s <= self.promotion_timeout_s + WAIT_SLACK_S, out.line()
        assert out.max_load_s <= self.promotion_timeout_s + WAIT_SLACK_S, out.line()
        assert not out.crashed, f"{out.line()}: {self.crashed}"
        assert out.recovery_s is not None and out.recovery_s <= RECOVERY_LIMIT_S, out.line()
        assert not out.leaks, out.line()


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
