"""ClusterOffloadingManager.lookup_result with a warm view of the Directory, against vLLM's manager and the local one.

    python bench/lookup.py [--keys N] [--batches N]

Two replicas of one cache namespace in this process, on a local Ray, through the real
spec (a Directory shard, a DirectoryLink each): the other replica stores --keys blocks,
this one stores --keys of its own, and once every block of the other is in this
replica's view (warm), lookups are timed, the cluster manager's by lookup_result (the
four answers that vLLM's adapter maps per block):

  hit   a block this replica holds
  miss  a block nobody holds: the cluster manager also consults the view

Baselines, answering the same keys: vLLM 0.33's CPUOffloadingManager holding this
replica's blocks (when vLLM is importable), and this replica's LocalOffloadingManager,
the one the cluster manager wraps. Each figure is the median, over --batches timed passes
of --keys lookups (the managers taking turns), of a pass's mean CPU time per call
(time.thread_time_ns: other processes on the cores do not count). Targets: cluster /
local <= 1.5 (what the cluster adds to the manager it wraps) and cluster / vLLM <= 1.5
(against the manager a user would otherwise run).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import ray  # noqa: E402

from distkv.abstract import LookupResult, ReqContext, make_offload_key  # noqa: E402
from distkv.replica.cluster_manager import ClusterOffloadingManager  # noqa: E402
from distkv.names import RAY_NAMESPACE  # noqa: E402
from distkv.replica.specs import ClusterOffloadingSpec  # noqa: E402
from ray_actors.directory import kill_shards  # noqa: E402

PAGE_BYTES = 4 << 10
TARGET = 1.5


def make_keys(tag: str, count: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(count)]


def make_spec(salt: str, name: str, rows: int, policy: str = "lru") -> ClusterOffloadingSpec:
    return ClusterOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": rows * 2 * PAGE_BYTES, "tenant_salt": salt, "eviction_policy": policy},
        gpu_block_sizes=[16],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=name,
    )


def store(manager, keys: list[bytes], ctx: Any = None) -> None:
    ctx = ctx or ReqContext("bench")
    for i in range(0, len(keys), 256):
        out = manager.prepare_store(keys[i : i + 256], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    for _ in manager.take_events():
        pass


@contextlib.contextmanager
def warm_cluster(rows: int, view_keys: int, policy: str = "lru") -> Iterator[ClusterOffloadingManager]:
    """A replica's ClusterOffloadingManager with a pool of `rows`, once `view_keys` blocks of
    another replica of its cache namespace are all in its view of the Directory.

    Runs on the local Ray the caller started; its own Directory (a fresh namespace) is
    killed on exit."""
    salt = uuid.uuid4().hex
    specs = [make_spec(salt, "other", view_keys, policy), make_spec(salt, "this", rows, policy)]
    managers = []
    try:
        for spec in specs:
            managers.append(spec.get_manager())
        other, this = managers
        other_keys = make_keys(f"other-{salt}", view_keys)
        store(other, other_keys)
        deadline = time.monotonic() + 60
        while not all(this.link.holders(key) for key in other_keys):
            if time.monotonic() > deadline:
                raise RuntimeError("the other replica's blocks never all reached this replica's view")
            time.sleep(0.01)
        yield this
    finally:
        for manager in managers:
            manager.shutdown()
        for spec in specs:
            spec.close()
        kill_shards(specs[0].namespace)


def pass_ns(lookup: Callable, ctx: Any, keys: list[bytes]) -> float:
    """Mean nanoseconds of CPU time per lookup over one pass of keys."""
    start = time.thread_time_ns()
    for key in keys:
        lookup(key, ctx)
    return (time.thread_time_ns() - start) / len(keys)


def vllm_manager(keys: list[bytes]):
    """(vLLM 0.33's CPUOffloadingManager holding `keys`, a request context for it, its
    answers for a hit and a miss), or None where vLLM is not importable."""
    try:
        from vllm.v1.kv_offload.base import LookupResult
        from vllm.v1.kv_offload.base import ReqContext as VLLMReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError:
        return None
    manager = CPUOffloadingManager(len(keys), enable_events=True)
    store(manager, keys, VLLMReqContext(req_id="store"))
    return manager, VLLMReqContext(req_id="bench"), LookupResult.HIT, LookupResult.MISS


def measure(keys: int, batches: int) -> dict[str, dict[str, float]]:
    """Median ns per lookup, {"hit" | "miss": {"cluster", "local", "vllm"}} ("vllm" only
    where vLLM is importable). Needs a local Ray the caller started."""
    with warm_cluster(keys, keys) as this:
        hit_keys, miss_keys = make_keys("this", keys), make_keys("nobody", keys)
        store(this, hit_keys)
        ctx = ReqContext("bench")
        # name -> (lookup, its request context, its answer for a hit, for a miss)
        subjects = {
            "cluster": (this.lookup_result, ctx, LookupResult.HIT, LookupResult.MISS),
            "local": (this.local.lookup, ctx, True, False),
        }
        theirs = vllm_manager(hit_keys)
        if theirs is not None:
            manager, vllm_ctx, hit, miss = theirs
            subjects["vllm"] = (manager.lookup, vllm_ctx, hit, miss)
        figures: dict[str, dict[str, float]] = {}
        for kind, kind_keys in (("hit", hit_keys), ("miss", miss_keys)):
            for name, (lookup, subject_ctx, hit, miss) in subjects.items():
                expected = hit if kind == "hit" else miss
                if any(lookup(key, subject_ctx) != expected for key in kind_keys):
                    raise RuntimeError(f"{name}: not every {kind} key answers {expected}")
                pass_ns(lookup, subject_ctx, kind_keys)  # warm-up
            times: dict[str, list[float]] = {name: [] for name in subjects}
            for _ in range(batches):
                for name, (lookup, subject_ctx, _, _) in subjects.items():
                    times[name].append(pass_ns(lookup, subject_ctx, kind_keys))
            figures[kind] = {name: statistics.median(samples) for name, samples in times.items()}
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=201)
    args = parser.parse_args()

    ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, namespace=RAY_NAMESPACE)
    try:
        figures = measure(args.keys, args.batches)
    finally:
        ray.shutdown()
    print(
        f"lookup latency, median of {args.batches} passes of {args.keys} keys; view: a real DirectoryLink "
        f"on a local Ray, warm ({args.keys} keys of another replica visible)"
    )
    print(f"{'':6} {'cluster ns':>10} {'local ns':>9} {'cluster/local':>13} {'vLLM ns':>8} {'cluster/vLLM':>12}  target <= {TARGET}")

    def ratio(value: float, base: float | None) -> str:
        if not base:
            return f"{'-':>9}"
        return f"{value / base:5.2f} {'ok' if value / base <= TARGET else 'MISSED':>6}"

    for kind, ns in figures.items():
        vllm = ns.get("vllm")
        print(
            f"{kind:6} {ns['cluster']:10.0f} {ns['local']:9.0f} {ratio(ns['cluster'], ns['local']):>13} "
            f"{vllm or float('nan'):8.0f} {ratio(ns['cluster'], vllm):>12}"
        )


if __name__ == "__main__":
    main()
