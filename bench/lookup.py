"""ClusterOffloadingManager.lookup with a warm view of the Directory, against the local manager alone.

    python bench/lookup.py [--keys N] [--batches N]

Two replicas of one cache namespace in this process, on a local Ray, through the real
spec (a Directory shard, a DirectoryLink each): the other replica stores --keys blocks,
this one stores --keys of its own, and once every block of the other is in this
replica's view (warm), lookups are timed:

  hit   a block this replica holds
  miss  a block nobody holds: the cluster manager also consults the view

The baseline is this replica's LocalOffloadingManager, the one the cluster manager wraps,
answering the same keys from the same state. Each figure is the median, over --batches
timed passes of --keys lookups (alternating cluster and baseline), of a pass's mean
latency per call. Target: cluster / local <= 1.5.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

import ray  # noqa: E402

from distkv.abstract import ReqContext, make_offload_key  # noqa: E402
from distkv.spec import RayOffloadingSpec  # noqa: E402
from ray_actors.directory import RAY_NAMESPACE, kill_shards  # noqa: E402

PAGE_BYTES = 4 << 10
TARGET = 1.5


def make_keys(tag: str, count: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(count)]


def make_spec(salt: str, name: str, rows: int) -> RayOffloadingSpec:
    return RayOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": rows * 2 * PAGE_BYTES, "tenant_salt": salt},
        gpu_block_sizes=[16],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=name,
    )


def store(manager, keys: list[bytes]) -> None:
    ctx = ReqContext("bench")
    for i in range(0, len(keys), 256):
        out = manager.prepare_store(keys[i : i + 256], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    for _ in manager.take_events():
        pass


def pass_ns(lookup, keys: list[bytes], expected: bool) -> float:
    """Mean nanoseconds per lookup over one pass of keys."""
    ctx = ReqContext("bench")
    start = time.perf_counter_ns()
    for key in keys:
        lookup(key, ctx)
    elapsed = time.perf_counter_ns() - start
    assert lookup(keys[0], ctx) is expected
    return elapsed / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=201)
    args = parser.parse_args()

    ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, namespace=RAY_NAMESPACE)
    salt = uuid.uuid4().hex
    specs = [make_spec(salt, name, args.keys) for name in ("other", "this")]
    managers = []
    try:
        for spec in specs:
            managers.append(spec.get_manager())
        other, this = managers
        other_keys, hit_keys, miss_keys = (make_keys(tag, args.keys) for tag in ("other", "this", "nobody"))
        store(other, other_keys)
        store(this, hit_keys)
        deadline = time.monotonic() + 30
        while not all(this.link.holders(key) for key in other_keys):
            if time.monotonic() > deadline:
                raise SystemExit("the other replica's blocks never all reached this replica's view")
            time.sleep(0.01)

        ctx = ReqContext("bench")
        if not all(this.lookup(key, ctx) is True for key in hit_keys):
            raise SystemExit("some of this replica's blocks were evicted: not every hit is one")
        subjects = {"cluster": this.lookup, "local": this.local.lookup}
        print(
            f"lookup latency, median of {args.batches} passes of {args.keys} keys; view: a real DirectoryLink "
            f"on a local Ray, warm ({len(other_keys)} keys of another replica visible)"
        )
        print(f"{'':6} {'cluster ns':>10} {'local ns':>9} {'ratio':>6}  target <= {TARGET}")
        for kind, keys, expected in (("hit", hit_keys, True), ("miss", miss_keys, False)):
            times: dict[str, list[float]] = {name: [] for name in subjects}
            for name, lookup in subjects.items():
                pass_ns(lookup, keys, expected)  # warm-up
            for _ in range(args.batches):
                for name, lookup in subjects.items():
                    times[name].append(pass_ns(lookup, keys, expected))
            cluster, local = (statistics.median(times[name]) for name in subjects)
            ratio = cluster / local
            verdict = "ok" if ratio <= TARGET else "MISSED"
            print(f"{kind:6} {cluster:10.0f} {local:9.0f} {ratio:6.2f}  {verdict}")
    finally:
        for manager in managers:
            manager.shutdown()
        for spec in specs:
            spec.close()
        kill_shards(specs[0].namespace)
        ray.shutdown()

if __name__ == "__main__":
    main()
