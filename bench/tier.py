"""distkv's vLLM tier (distkv.vllm_tier) beside its baselines, each measured in the same run.

    python bench/tier.py [--part all|cascade|lookup|promote] [--runs N] [--json PATH]

cascade  A store job of 128 chunks of 2 MiB scattered over the primary tier (a random
         permutation of its chunks to the pool's rows), as the tier runs it (its store
         thread: each chunk copied and hashed a piece at a time, then the rows sealed),
         from submission to the job's end; beside a plain copy of the same chunks into the
         same rows (numpy, one memcpy per chunk) on one thread. Median of --runs, taking
         turns; beside them, one memcpy of the 256 MiB whole (the machine's limit: glibc
         copies that large with non-temporal stores). Goal: cascade GB/s >= 0.8 of the
         plain copy's. Also in CPU time of the copying thread (`store_rows`, the store
         thread's work, called on this thread, beside the plain copy): what other processes
         on the cores do not change.
lookup   CPU time per call of the tier's `lookup` on the scheduler's thread (vLLM's
         SecondaryTierManager API, a real DistkvTier on a local Ray with a warm view)
         beside vLLM 0.33's fs tier's `lookup` of the same number of keys, once its answers
         are in (every call after a key's first): chunks held (the tier: in its own pool,
         and in another replica's), and chunks nobody holds. Median of --runs passes of
         4096 keys. Beside them, the fs tier's first lookup of a key (it answers RETRY and
         queues the key for its lookup thread). Goal: tier / fs <= 1.5.
promote  64 chunks of 2 MiB from replica A on node A into replica B on node B (simulated
         nodes), by each transport: through the tier, from B's first lookup through vLLM's
         TieringOffloadingManager until every chunk answers HIT in B's primary tier (the
         transport straight into vLLM's chunks, each checked there);
         beside distkv's own spec's promotion of the same 64 blocks of 2 MiB between the
         same two nodes by the same transport (bench/promote.py's replicas: first lookup
         until all are local). Median of --runs, taking turns. Goal: tier GB/s >= 0.85 of
         the spec's.

vLLM's primary tier is the real one (its CPU manager and shared region) inside vLLM's
tiering manager, built from an OffloadingConfig as vLLM's connector builds it; no worker
is involved (nothing here copies to or from a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout, uninstalled
sys.path.append(str(ROOT / "bench"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local config.json

import numpy as np  # noqa: E402
import ray  # noqa: E402

MiB = 1 << 20
CHUNK_BYTES = 2 * MiB
CASCADE_CHUNKS = 128
PROMOTE_CHUNKS = 64
LOOKUP_KEYS = 4096
GOALS = {"cascade": 0.8, "lookup": 1.5, "promote": 0.85}
DISTKV_TIER = {"type": "DistkvTier", "module_path": "distkv.vllm_tier"}


def tiering_manager(engine_id: str, chunk_bytes: int, num_chunks: int, tiers: list[dict]):
    """vLLM's TieringOffloadingManager of a one-group model whose chunk is `chunk_bytes`,
    with a primary tier of `num_chunks` and `tiers`, as its connector builds it."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": num_chunks * chunk_bytes, "secondary_tiers": tiers},
        engine_id=engine_id,
        model=OffloadingModelConfig(name="bench-tier", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True,
        ),
        kv_cache_layout="LBNHC",
    )
    with set_current_vllm_config(bench_vllm_config()):  # the model it caches, as its connector would say
        return TieringOffloadingSpec(config).get_manager()


def bench_vllm_config():
    """A VllmConfig of a small OPT-shaped model (vLLM reads its config.json, never weights)."""
    from vllm.config import ModelConfig, VllmConfig

    model_dir = Path(tempfile.mkdtemp(prefix="distkv-bench-model-"))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "word_embed_proj_dim": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_dim": 128, "max_position_embeddings": 2048,
        "vocab_size": 50272, "torch_dtype": "float16",
    }))
    return VllmConfig(model_config=ModelConfig(model=str(model_dir), dtype="float16", skip_tokenizer_init=True))


def keys_of(tag: str, n: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


STEP = None


def end_step(manager) -> None:
    global STEP
    if STEP is None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    manager.on_schedule_end(STEP)


def store_chunks(manager, keys: list[bytes], seed: int) -> list[int]:
    """Store `keys` in the primary tier with bytes from `seed`, as its worker would, and
    wait for the cascades to every secondary tier; their checksums (xxh3), by key."""
    from vllm.v1.kv_offload.base import ReqContext

    from distkv.storage.slots import checksum

    ctx = ReqContext(f"store-{uuid.uuid4().hex[:8]}")
    primary = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, CHUNK_BYTES)
    rng = np.random.default_rng(seed)
    sums = []
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        for chunk in out.store_spec.chunk_ids.tolist():
            primary[chunk] = rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
            sums.append(checksum(primary[chunk]))
        del primary
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)
    while True:
        with manager.lock:
            end_step(manager)
            if not manager.has_pending_work():
                return sums
        time.sleep(0.001)


# ---- cascade ---------------------------------------------------------------------------


def cascade(runs: int) -> dict:
    from distkv.names import segment_name
    from distkv.storage.pool import HostPool, PoolLayout
    from distkv.storage.tier_copies import ChunkCopier, store_rows

    rng = np.random.default_rng(0)
    primary = rng.integers(0, 256, (CASCADE_CHUNKS, CHUNK_BYTES), dtype=np.uint8)
    pool = HostPool(segment_name("benchtier", uuid.uuid4().hex[:8]), PoolLayout(CASCADE_CHUNKS, 1, CHUNK_BYTES))
    copier = ChunkCopier(pool, primary)
    rows = np.arange(CASCADE_CHUNKS)
    chunks = rng.permutation(CASCADE_CHUNKS).tolist()  # row i <- chunk chunks[i]
    keys = [f"k{i:06d}".encode() for i in range(CASCADE_CHUNKS)]
    payload = pool.payload[0]

    def plain() -> None:
        for row, chunk in enumerate(chunks):
            np.copyto(payload[row], primary[chunk])

    times: dict[str, list[float]] = {"cascade": [], "memcpy": [], "whole": [], "cascade_cpu": [], "memcpy_cpu": []}
    try:
        for run in range(runs + 1):  # the first of each is a warm-up (page faults)
            generations = np.arange(1 + 2 * run * CASCADE_CHUNKS, 1 + (2 * run + 1) * CASCADE_CHUNKS, dtype=np.uint64)
            start = time.perf_counter()
            copier.store(run, chunks, rows, keys, generations)
            copier.wait_idle()
            elapsed = time.perf_counter() - start
            ((_, ok, _, _),) = copier.finished()
            assert ok and pool.verify(0, 7, keys[7], int(generations[7]))
            measured = {"cascade": elapsed}
            for name, copy in (("memcpy", plain), ("whole", lambda: np.copyto(payload, primary))):
                start = time.perf_counter()
                copy()
                measured[name] = time.perf_counter() - start
            start = time.thread_time()
            store_rows(pool, primary, chunks, rows, keys, generations + CASCADE_CHUNKS)
            measured["cascade_cpu"] = time.thread_time() - start
            start = time.thread_time()
            plain()
            measured["memcpy_cpu"] = time.thread_time() - start
            if run:
                for name, seconds in measured.items():
                    times[name].append(seconds)
    finally:
        copier.close()
        pool.close()
    nbytes = CASCADE_CHUNKS * CHUNK_BYTES
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    return {"cascade_gbps": gbps["cascade"], "memcpy_gbps": gbps["memcpy"], "whole_memcpy_gbps": gbps["whole"],
            "ratio": gbps["cascade"] / gbps["memcpy"], "cpu_ratio": gbps["cascade_cpu"] / gbps["memcpy_cpu"],
            "cascade_cpu_gbps": gbps["cascade_cpu"], "memcpy_cpu_gbps": gbps["memcpy_cpu"]}


# ---- lookup ----------------------------------------------------------------------------


def pass_ns(lookup, ctx, keys: list[bytes]) -> float:
    start = time.thread_time_ns()
    for key in keys:
        lookup(key, ctx)
    return (time.thread_time_ns() - start) / len(keys)


def fs_tier(root: str, spec, primary_view):
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    return SecondaryTierFactory.create_secondary_tier({"type": "fs", "root_dir": root}, primary_view, spec)


def lookup(runs: int) -> dict:
    """ns per call: {kind: {"tier", "fs"}} and the fs tier's first lookup."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from distkv.names import RAY_NAMESPACE
    from ray_actors.directory import kill_shards

    ray.init(address="local", num_cpus=2, object_store_memory=100 * MiB, include_dashboard=False, namespace=RAY_NAMESPACE)
    salt = uuid.uuid4().hex
    tiers = [{**DISTKV_TIER, "cpu_bytes_to_use": LOOKUP_KEYS * 4096, "tenant_salt": salt, "directory_view": "push"}]
    managers = [tiering_manager(f"bench-{name}-{salt[:6]}", 4096, LOOKUP_KEYS, tiers) for name in ("other", "this")]
    other, this = managers
    tier = this.secondary_tiers[0]
    with tempfile.TemporaryDirectory() as root:
        fs = fs_tier(root, tier._offloading_spec, this.primary_tier.get_kv_memoryview())
        try:
            theirs, mine, nobody = keys_of("theirs", LOOKUP_KEYS), keys_of("mine", LOOKUP_KEYS), keys_of("none", LOOKUP_KEYS)
            store_4k(other, theirs)
            store_4k(this, mine)
            fs.submit_store(TransferJob(0, mine, np.arange(LOOKUP_KEYS, dtype=np.int32), False, ReqContext("s")))
            while not list(fs.get_finished_jobs()):
                time.sleep(0.01)
            deadline = time.monotonic() + 60
            while not all(tier.cluster.link.holders(k) for k in theirs):
                assert time.monotonic() < deadline, "the other replica's chunks never reached the view"
                time.sleep(0.01)
            ctx, step = ReqContext("bench"), ScheduleEndContext((), ())
            first = [pass_ns(fs.lookup, ReqContext(f"cold{i}"), keys_of(f"cold{i}", LOOKUP_KEYS)) for i in range(3)]
            # the fs tier answers once its lookup thread did: every key asked, then its answers in
            for keys in (mine, nobody):
                while {fs.lookup(k, ctx) for k in keys} & {LookupResult.RETRY}:
                    fs.on_schedule_end(step)
                    time.sleep(0.01)
            cases = {"hit, own pool": (mine, mine, LookupResult.HIT), "hit, another replica": (theirs, mine, LookupResult.HIT),
                     "miss": (nobody, nobody, LookupResult.MISS)}
            figures = {}
            for kind, (tier_keys, fs_keys, answer) in cases.items():
                assert all(tier.lookup(k, ctx) is answer for k in tier_keys), kind
                assert all(fs.lookup(k, ctx) is answer for k in fs_keys), kind
                times = {"tier": [], "fs": []}
                for _ in range(runs):
                    times["tier"].append(pass_ns(tier.lookup, ctx, tier_keys))
                    times["fs"].append(pass_ns(fs.lookup, ctx, fs_keys))
                figures[kind] = {name: statistics.median(t) for name, t in times.items()}
            figures["fs first lookup"] = {"fs": statistics.median(first)}
            return figures
        finally:
            fs.shutdown()
            for manager in managers:
                manager.shutdown()
            kill_shards(tier.cluster.link.namespace)
            ray.shutdown()


def store_4k(manager, keys: list[bytes]) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(f"store-{uuid.uuid4().hex[:8]}")
    with manager.lock:
        manager.on_new_request(ctx)
        for i in range(0, len(keys), 256):
            manager.prepare_store(keys[i : i + 256], ctx)
            manager.complete_store(keys[i : i + 256], ctx)
        manager.on_request_finished(ctx)
    while True:
        with manager.lock:
            end_step(manager)
            if not manager.has_pending_work():
                return
        time.sleep(0.001)


# ---- promote ---------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class TierBenchReplica:
    """A vLLM tiering manager with distkv's tier in a Ray actor, and what the benchmark times in it."""

    def __init__(self, name: str, salt: str, transport: str, chunks: int) -> None:
        tiers = [{**DISTKV_TIER, "cpu_bytes_to_use": chunks * CHUNK_BYTES, "tenant_salt": salt,
                  "transport": transport, "promotion_timeout_s": 30.0, "directory_view": "push"}]
        self.manager = tiering_manager(name, CHUNK_BYTES, chunks, tiers)
        self.tier = self.manager.secondary_tiers[0]
        self._fillers = 0

    def namespace(self) -> str:
        return self.tier.cluster.link.namespace

    def store(self, keys: list[bytes], seed: int) -> list[int]:
        return store_chunks(self.manager, keys, seed)

    def sees(self, keys: list[bytes]) -> bool:
        return all(self.tier.cluster.link.holders(k) for k in keys)

    def promote(self, keys: list[bytes], sums: list[int], transport: str) -> tuple[float, int]:
        """(seconds from the first lookup until every key is a HIT in the primary tier,
        bytes `transport` moved); every chunk is then checked against `sums`."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        from distkv.storage.slots import checksum

        moved = self.tier.cluster.promoter.transported
        before = moved.get(transport, [0, 0, 0.0])[1]
        manager, ctx = self.manager, ReqContext(f"promote-{uuid.uuid4().hex[:8]}")
        start = time.perf_counter()
        with manager.lock:
            manager.on_new_request(ctx)
        while True:
            with manager.lock:
                answers = [manager.lookup(k, ctx) for k in keys]
                end_step(manager)
            if all(a is LookupResult.HIT for a in answers):
                break
            if LookupResult.MISS in answers:
                raise RuntimeError(f"{answers.count(LookupResult.MISS)} of {len(keys)} promotions failed: "
                                   f"{self.tier.cluster.stats().recent_errors[-3:]}")
            time.sleep(0.001)
        seconds = time.perf_counter() - start
        primary = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, CHUNK_BYTES)
        with manager.lock:
            spec = manager.prepare_load(keys, ctx)
            ok = [checksum(primary[c]) for c in spec.chunk_ids.tolist()] == sums
            manager.complete_load(keys, ctx)
            manager.on_request_finished(ctx)
        del primary
        if not ok:
            raise RuntimeError("a promoted chunk differs from what A stored")
        return seconds, moved.get(transport, [0, 0, 0.0])[1] - before

    def drop_cache(self, chunks: int) -> None:
        """Evict what was promoted from the primary tier and the pool alike: store as many
        chunks never seen before (a reset would leave A's cache epoch)."""
        self._fillers += 1
        self.store(keys_of(f"filler-{self._fillers}-{uuid.uuid4().hex[:6]}", chunks), seed=self._fillers)

    def shutdown(self) -> None:
        self.manager.shutdown()


class TierPair:
    """Tier replica A on node A holding 64 chunks, tier replica B on node B promoting them."""

    def __init__(self, nodes, transport: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.transport = transport
        salt = uuid.uuid4().hex
        self.a, self.b = (
            TierBenchReplica.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(
                f"tier-{name}-{transport}-{salt[:6]}", salt, transport, PROMOTE_CHUNKS
            )
            for name, node in zip("ab", nodes)
        )
        self.keys = keys_of(f"prefix-{salt}", PROMOTE_CHUNKS)
        self.sums = ray.get(self.a.store.remote(self.keys, 0))
        deadline = time.monotonic() + 60
        while not ray.get(self.b.sees.remote(self.keys)):
            if time.monotonic() > deadline:
                raise SystemExit("A's chunks never reached B's view of the Directory")
            time.sleep(0.01)

    def promote(self) -> float:
        seconds, moved = ray.get(self.b.promote.remote(self.keys, self.sums, self.transport))
        if moved != PROMOTE_CHUNKS * CHUNK_BYTES:
            raise SystemExit(f"{self.transport} moved {moved} bytes, expected {PROMOTE_CHUNKS * CHUNK_BYTES}")
        ray.get(self.b.drop_cache.remote(PROMOTE_CHUNKS))
        return seconds

    def shutdown(self) -> None:
        from ray_actors.directory import kill_shards

        namespace = ray.get(self.a.namespace.remote())
        ray.get([self.a.shutdown.remote(), self.b.shutdown.remote()])
        kill_shards(namespace)


def promote(runs: int, warmup: int) -> dict:
    """GB/s by transport: {transport: {"tier", "spec", "ratio"}}."""
    from ray.cluster_utils import Cluster

    import promote as spec_bench  # bench/promote.py: distkv's spec's replicas

    from distkv.demo.runner import token_auth_on

    token_auth_on()
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 100 * MiB, "include_dashboard": False},
    )
    pairs = []
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=640 * MiB) for _ in range(2)]
        cluster.wait_for_nodes()
        figures = {}
        for transport in ("object_store", "nixl"):
            spec = spec_bench.Pair(nodes, transport, PROMOTE_CHUNKS, CHUNK_BYTES // 2, seed=0)
            tier = TierPair(nodes, transport)
            pairs += [spec, tier]
            times = {"tier": [], "spec": []}
            for run in range(warmup + runs):
                tier_s, (spec_s, _) = tier.promote(), spec.promote()
                if run >= warmup:
                    times["tier"].append(tier_s)
                    times["spec"].append(spec_s)
                print(f"{transport:12} run {run}: tier {tier_s * 1e3:6.1f} ms, spec {spec_s * 1e3:6.1f} ms", flush=True)
            nbytes = PROMOTE_CHUNKS * CHUNK_BYTES
            gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
            figures[transport] = {**gbps, "ratio": gbps["tier"] / gbps["spec"]}
        return figures
    finally:
        for pair in pairs:
            pair.shutdown()
        ray.shutdown()
        cluster.shutdown()


def verdict(ratio: float, part: str) -> str:
    goal = GOALS[part]
    met = ratio <= goal if part == "lookup" else ratio >= goal
    return f"goal {'<=' if part == 'lookup' else '>='} {goal} {'ok' if met else 'MISSED'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "cascade", "lookup", "promote"], default="all")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    parts = ["cascade", "lookup", "promote"] if args.part == "all" else [args.part]
    figures: dict = {"cores": os.cpu_count()}
    if "cascade" in parts:
        f = figures["cascade"] = cascade(args.runs)
        print(f"cascade store, {CASCADE_CHUNKS} x {CHUNK_BYTES // MiB} MiB primary -> pool, hashed and sealed: "
              f"{f['cascade_gbps']:.2f} GB/s; plain copy of the chunks {f['memcpy_gbps']:.2f} GB/s; ratio "
              f"{f['ratio']:.2f} {verdict(f['ratio'], 'cascade')} (one memcpy of all: {f['whole_memcpy_gbps']:.2f} GB/s)")
        print(f"  in CPU time of the copying thread: cascade {f['cascade_cpu_gbps']:.2f} GB/s, plain copy "
              f"{f['memcpy_cpu_gbps']:.2f} GB/s; ratio {f['cpu_ratio']:.2f}")
    if "lookup" in parts:
        f = figures["lookup"] = lookup(max(args.runs, 51))
        print(f"lookup, ns per call on the scheduler's thread ({LOOKUP_KEYS} keys a pass):")
        for kind, ns in f.items():
            if "tier" in ns:
                ratio = ns["tier"] / ns["fs"]
                print(f"  {kind:22} tier {ns['tier']:6.0f}  fs {ns['fs']:6.0f}  ratio {ratio:.2f} {verdict(ratio, 'lookup')}")
            else:
                print(f"  {kind:22} {'':11} fs {ns['fs']:6.0f}")
    if "promote" in parts:
        f = figures["promote"] = promote(args.runs, args.warmup)
        for transport, g in f.items():
            print(f"promotion {PROMOTE_CHUNKS} x {CHUNK_BYTES // MiB} MiB node A -> node B, {transport}: tier "
                  f"{g['tier']:.2f} GB/s (into vLLM's primary tier), spec {g['spec']:.2f} GB/s (into its pool); "
                  f"ratio {g['ratio']:.2f} {verdict(g['ratio'], 'promote')}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
