"""The benchmark suite: every distkv figure beside its baseline, measured in the same run.

    python bench/suite.py [--quick] [--json PATH]

Runs each part and prints one table (figure | distkv | baseline | baseline value | ratio |
goal | met; ratio is always distkv / baseline); --json also writes every figure, the
machine and each part's seconds. docs/benchmarks.md says what each row compares;
docs/scale.md builds the scale model from the scale rows.

  manager   bench/trace.py: CPU time per call of one recorded vLLM-scheduler trace:
            distkv's local and cluster managers beside vLLM 0.33's
            CPUOffloadingManager, LRU and ARC. Goal: ops/s ratio >= 1.
  lookup    bench/lookup.py: ClusterOffloadingManager.lookup_result with a warm Directory view,
            hits and misses, beside vLLM's CPUOffloadingManager.lookup of the same keys.
            Goal: ns ratio <= 1.5.
  transfer  python bench/transfer.py: the CPU handlers beside a torch contiguous copy.
            Goal: store+load ratio >= 0.8.
  gpu       with CUDA only: bench/transfer.py --device cuda beside the pinned cudaMemcpy
            peak (goal >= 0.8) and beside vLLM's CPUOffloadingWorker (CUDA-only in 0.33)
            on the same blocks.
  promote   python bench/promote.py: promotion beside a raw ray.get between two nodes.
            Goal: ratio >= 0.7.
  tier      python bench/tier.py: distkv as a tier of vLLM's tiered offloading: the
            cascade store beside a plain copy of the chunks (goal >= 0.8), the tier's lookup
            beside vLLM's fs tier's (goal ns ratio <= 1.5), and promotion into vLLM's CPU
            tier from another node beside the spec's promotion, by each transport (goal
            >= 0.85).
  demo      python bench/routing.py --runs 1: the demo's four arms on its default trace, with
            --skew and with a small pool; distkv with its router against distkv with Serve's
            default router and against each replica's own pool with Ray's prefix-affinity router.
  scale     python bench/scale.py: one Directory shard at 1M and 10M keys (1M with
            --quick), replicas following pushed views 2 -> 8 (2 -> 4) on simulated nodes,
            and 64 lightweight replicas against 1 and 4 shards (16 against 1).

A part that fails shows as one row saying why; the suite then exits 1. --quick runs
every part smaller; most of either run is Ray starting simulated nodes and replicas.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))  # runs from a checkout, uninstalled
sys.path.append(str(BENCH))  # after the standard library: bench/trace.py must not shadow its trace

import torch  # noqa: E402

MiB = 1 << 20


def load_bench(name: str):
    """A script of bench/ as a module (bench/trace.py as bench_trace: no clash with the standard library)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class Row:
    part: str
    figure: str
    unit: str
    distkv: float | None
    baseline: str = "-"
    baseline_value: float | None = None
    goal: tuple[str, float] | None = None  # (">=" or "<=", bound) on the ratio
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.distkv is None or not self.baseline_value:
            return None
        return self.distkv / self.baseline_value

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.ratio is None:
            return None
        op, bound = self.goal
        return self.ratio >= bound if op == ">=" else self.ratio <= bound

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


@dataclass
class Sizes:
    """How big each part runs: the full suite, or --quick."""

    trace_requests: int
    trace_rows: int
    trace_runs: int
    view_keys: int
    lookup_batches: int
    transfer_args: list[str]
    promote_args: list[str]
    tier_args: list[str]
    demo_args: list[str]
    scale_args: list[str]


FULL = Sizes(
    trace_requests=5000, trace_rows=8192, trace_runs=5, view_keys=65536, lookup_batches=201,
    transfer_args=[], promote_args=[], tier_args=[], demo_args=[],
    scale_args=["--keys", "1000000,10000000", "--view-replicas", "2,4,8", "--view-seconds", "5", "--replicas", "64", "--shards", "1,4", "--seconds", "10"],
)
QUICK = Sizes(
    trace_requests=1000, trace_rows=2048, trace_runs=3, view_keys=8192, lookup_batches=51,
    transfer_args=["--gib", "0.25", "--reps", "3"], promote_args=["--runs", "3", "--warmup", "1"],
    tier_args=["--runs", "5", "--warmup", "1"],
    demo_args=["--requests", "60"],
    scale_args=["--keys", "1000000", "--view-replicas", "2,4", "--view-seconds", "2", "--replicas", "16", "--shards", "1", "--seconds", "5"],
)


def run_script(args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `python ARGS --json PATH` from the checkout; what it wrote to PATH."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figures.json"
        proc = subprocess.run(
            [sys.executable, *args, "--json", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"`python {' '.join(args)}` exited {proc.returncode}: {tail(proc.stderr)}")
        return json.loads(path.read_text())


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


# ---- the parts -----------------------------------------------------------------------


def manager_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    trace = load_bench("trace")
    result = trace.measure(sizes.trace_requests, sizes.trace_rows, sizes.trace_runs, sizes.view_keys)
    figures["manager"] = result
    by_key = {(r["policy"], r["subject"]): r for r in result["results"]}
    rows = []
    for policy in trace.POLICIES:
        theirs = by_key.get((policy, "vLLM CPUOffloadingManager"))
        for subject in ("distkv local", "distkv cluster"):
            ours = by_key[(policy, subject)]
            diverged = ours["diverged"] or (theirs and theirs["diverged"])
            for kind in (*trace.KINDS, "trace"):
                label = "whole trace" if kind == "trace" else kind
                rows.append(
                    Row(
                        "manager",
                        f"{label}, {policy}, {subject.split()[1]}",
                        "ops/s",
                        ours["ops_per_s"].get(kind),
                        "vLLM CPUOffloadingManager" if theirs else "vLLM not importable",
                        theirs["ops_per_s"].get(kind) if theirs else None,
                        (">=", 1.0),
                        f"diverged: {diverged}" if diverged else "",
                    )
                )
    return rows


def lookup_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    lookup = load_bench("lookup")
    result = lookup.measure(4096, sizes.lookup_batches)
    figures["lookup"] = result
    rows = []
    for kind, ns in result.items():
        rows.append(
            Row(
                "lookup",
                f"cluster lookup, warm view, {kind}",
                "ns",
                ns["cluster"],
                "vLLM CPUOffloadingManager.lookup" if "vllm" in ns else "vLLM not importable",
                ns.get("vllm"),
                ("<=", lookup.TARGET),
            )
        )
    return rows


TRANSFER_ROWS = (("store", "store KV->pool (sealed)"), ("load", "load pool->KV (checked)"), ("both", "store+load"))


def transfer_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    result = run_script(["bench/transfer.py", *sizes.transfer_args], timeout_s=600)
    figures["transfer"] = result
    return [
        Row(
            "transfer",
            f"CPU {label}",
            "GB/s",
            result[f"{name}_gbps"],
            "torch contiguous copy",
            result[f"baseline_{name}_gbps"],
            (">=", 0.8) if name == "both" else None,
        )
        for name, label in TRANSFER_ROWS
    ]


def gpu_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    if not torch.cuda.is_available():
        figures["gpu"] = "skipped: no CUDA"
        return [
            Row("gpu", f"CUDA {label}", "GB/s", None, baseline, note="skipped: no CUDA")
            for baseline in ("pinned cudaMemcpy peak", "vLLM CPUOffloadingWorker")
            for _, label in TRANSFER_ROWS
        ]
    result = run_script(["bench/transfer.py", "--device", "cuda", *sizes.transfer_args], timeout_s=600)
    rows = [
        Row("gpu", f"CUDA {label}", "GB/s", result[f"{name}_gbps"], "pinned cudaMemcpy peak", result[f"baseline_{name}_gbps"], (">=", 0.8))
        for name, label in TRANSFER_ROWS
    ]
    gib = float(sizes.transfer_args[sizes.transfer_args.index("--gib") + 1]) if "--gib" in sizes.transfer_args else 1.0
    try:
        theirs = vllm_worker_gbps(gib)
        note = ""
    except Exception as e:  # a CPU build of vLLM has no CUDA kernels: the rows say so
        theirs, note = {}, f"vLLM worker failed: {type(e).__name__}: {e}"
    figures["gpu"] = {"distkv": result, "vllm_worker": theirs or note}
    rows += [
        Row("gpu", f"CUDA {label}", "GB/s", result[f"{name}_gbps"], "vLLM CPUOffloadingWorker", theirs.get(name), note=note)
        for name, label in TRANSFER_ROWS
    ]
    return rows


def vllm_worker_gbps(gib: float, block_mib: int = 2, reps: int = 5) -> dict[str, float]:
    """GB/s of vLLM 0.33's CPUOffloadingWorker (pinned CPU chunks) storing and loading the
    blocks of a CUDA KV tensor of `gib`, scattered as bench/transfer.py scatters them."""
    import numpy as np
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    block_bytes = block_mib * MiB
    num_blocks = int(gib * (1 << 30)) // block_bytes
    kv = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8, device="cuda")
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv, block_bytes)], [[CanonicalKVCacheRef(0, block_bytes)]])
    worker = CPUOffloadingWorker(caches, blocks_per_chunk=1, num_cpu_chunks=num_blocks)
    try:
        blocks = np.random.default_rng(0).permutation(num_blocks).tolist()
        gpu, cpu = GPULoadStoreSpec(blocks, [num_blocks], [0]), CPULoadStoreSpec(list(range(num_blocks)))
        times: dict[str, list[float]] = {"store": [], "load": []}
        job = 0
        for rep in range(reps + 1):  # rep 0 warms up
            for name in ("store", "load"):
                job += 1
                start = time.perf_counter()
                submitted = worker.submit_store(job, gpu, cpu) if name == "store" else worker.submit_load(job, cpu, gpu)
                if not submitted:
                    raise RuntimeError(f"vLLM's worker refused the {name}")
                worker.wait({job})
                elapsed = time.perf_counter() - start
                if not all(r.success for r in worker.get_finished()):
                    raise RuntimeError(f"vLLM's worker failed the {name}")
                if rep:
                    times[name].append(elapsed)
    finally:
        worker.shutdown()
    total = num_blocks * block_bytes
    store, load = (statistics.median(times[name]) for name in ("store", "load"))
    return {"store": total / store / 1e9, "load": total / load / 1e9, "both": 2 * total / (store + load) / 1e9}


def promote_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    result = run_script(["bench/promote.py", *sizes.promote_args], timeout_s=900)
    figures["promote"] = result
    store, nixl = result["transports"]["object_store"], result["transports"]["nixl"]
    return [
        Row("promote", "object-store promotion 64 x 2 MiB, node A -> node B", "GB/s", store["promote_gbps"],
            "raw ray.get of 128 MiB, same nodes", store["baseline_gbps"], (">=", 0.7)),
        Row("promote", "NIXL promotion 64 x 2 MiB, node A -> node B", "GB/s", nixl["promote_gbps"],
            "raw NIXL READ of 128 MiB, same processes", nixl["baseline_gbps"], (">=", 0.85)),
        Row("promote", "NIXL promotion 64 x 2 MiB", "GB/s", nixl["promote_gbps"],
            "object-store promotion, same run", store["promote_gbps"], (">=", 4.0),
            note=f"in-process copy {result['copy_gbps']:.2f} GB/s"),
        Row("promote", "one 128 KiB block, first lookup -> local, NIXL p50", "ms", nixl["latency_p50_ms"],
            "object store p50, same run", store["latency_p50_ms"], ("<=", 0.3),
            note=f"p99 {nixl['latency_p99_ms']:.2f} vs {store['latency_p99_ms']:.2f} ms"),
    ]


def tier_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    result = run_script(["bench/tier.py", *sizes.tier_args], timeout_s=1500)
    figures["tier"] = result
    cascade, lookups = result["cascade"], result["lookup"]
    rows = [
        Row("tier", "cascade store 128 x 2 MiB, vLLM's CPU tier -> pool, hashed", "GB/s", cascade["cascade_gbps"],
            "plain copy of the chunks, one thread", cascade["memcpy_gbps"], (">=", 0.8),
            note=f"one memcpy of all {cascade['whole_memcpy_gbps']:.2f} GB/s"),
    ]
    for kind in ("hit, own pool", "hit, another replica", "miss"):
        ns = lookups[kind]
        rows.append(Row("tier", f"tier lookup, {kind}", "ns", ns["tier"], "vLLM fs tier lookup, answered", ns["fs"],
                        ("<=", 1.5), note=f"fs first lookup {lookups['fs first lookup']['fs']:.0f} ns"))
    for transport, label in (("object_store", "object-store"), ("nixl", "NIXL")):
        g = result["promote"][transport]
        rows.append(Row("tier", f"{label} promotion through the tier into vLLM's CPU tier, 64 x 2 MiB", "GB/s", g["tier"],
                        f"spec's {label} promotion, same nodes", g["spec"], (">=", 0.85)))
    return rows


def demo_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    """One run of the demo's arms on each trace of bench/routing.py; each row an arm's TTFT
    (or cross-node bytes) over another arm's in the same run."""
    result = run_script(["bench/routing.py", "--runs", "1", *sizes.demo_args], timeout_s=3600)
    figures["demo"] = {k: v for k, v in result.items() if k != "documents"}
    rows = []
    for r in result["ratios"]:
        (doc,) = result["documents"][r["trace"]]
        arm, base = doc["arms"][r["arm"]], doc["arms"][r["baseline"]]
        if r["figure"] == "cross_node_bytes":
            unit, value, baseline = "MiB", *(a["transfers"]["cross_node_promotion"]["bytes"] / MiB for a in (arm, base))
        else:
            unit, value, baseline = "ms", *(a["ttft_s"][r["figure"]] * 1e3 for a in (arm, base))
        rows.append(Row(
            "demo", f"{r['trace']}: {r['figure']} of distkv + its router", unit, value,
            f"{r['baseline']}, same run", baseline, ("<=", r["goal"]),
            note=f"hit {arm['hit_rate']:.1%} (oracle {arm['oracle_hit_rate']:.1%}, as run "
            f"{arm['oracle_hit_rate_as_run']:.1%}), requests per replica max/mean "
            f"{arm['requests_per_replica']['max_over_mean']:.2f} vs {base['requests_per_replica']['max_over_mean']:.2f}, "
            f"mismatches {doc['mismatches']}",
        ))
    (doc,) = result["documents"]["default"]
    for p in ("p50", "p99"):
        rows.append(Row("demo", f"default: {p} of distkv", "ms", doc["arms"]["distkv"]["ttft_s"][p] * 1e3,
                        "offloading off, same run", doc["arms"]["off"]["ttft_s"][p] * 1e3))
    return rows


def scale_part(sizes: Sizes, figures: dict[str, Any]) -> list[Row]:
    result = run_script(["bench/scale.py", *sizes.scale_args], timeout_s=1200)
    figures["scale"] = result
    state = result["state"]
    rows = []
    for s in state["sizes"]:
        n = f"{s['keys'] / 1e6:g}M keys"
        rows += [
            Row("scale", f"Directory shard memory per key, {n}", "B", s["bytes_per_key"]),
            Row("scale", f"shard publish, {n} (per CPU s)", "events/s", s["publish_events_per_s"]),
            Row("scale", f"shard query, {n} (per CPU s)", "keys/s", s["query_keys_per_s"]),
            Row("scale", f"shard serves a follower, {n} (per CPU s)", "keys/s", s["serve_keys_per_s"]),
        ]
    if state["marginal_bytes_per_key"] is not None:
        rows.append(Row("scale", "shard memory per added key, 1M -> 10M", "B", state["marginal_bytes_per_key"]))
    rows += [
        Row("scale", "change on the wire, per event", "B", state["sizes"][-1]["wire_bytes_per_event"]),
        Row("scale", "second holder of a key", "B", state["extra_holder_bytes_per_key"]),
        Row("scale", "follower view memory per key", "B", state["view_bytes_per_key"]),
        Row("scale", "follower view apply (per CPU s)", "keys/s", state["view_apply_keys_per_s"]),
    ]
    for r in result["replicas"]:
        n = f"{r['replicas']} replicas"
        rows += [
            Row("scale", f"Directory events applied, {n}", "events/s", r["directory_events_per_s"], "events the replicas offered", r["offered_events_per_s"]),
            Row("scale", f"view update p50, {n}", "ms", r["view_update_p50_ms"], "one actor call round trip", r["actor_call_p50_ms"]),
            Row("scale", f"view update p99, {n}", "ms", r["view_update_p99_ms"]),
            Row("scale", f"Directory CPU per applied event, {n}", "us", r["directory_cpu_us_per_event"]),
            Row("scale", f"Directory CPU per call (Ray), {n}", "us", r["directory_cpu_us_per_call"]),
            Row("scale", f"CPU per replica, {n}", "cores", r["cpu_per_replica"]),
        ]
    for p in result.get("generator", []):
        n = f"{p['replicas']} lightweight replicas, {p['shards']} shards"
        rows += [
            Row("scale", f"Directory events applied, {n}", "events", p["events_applied"], "events offered", p["events_offered"]),
            Row("scale", f"Directory CPU per event, {n}", "us", p["directory_cpu_us_per_event"], note="at the offered (scaled-down) rates"),
            Row("scale", f"Directory CPU per call, {n}", "us", p["directory_cpu_us_per_call"], "per stats call", p["directory_cpu_us_per_stats_call"]),
            Row("scale", f"query p99 (wall), {n}", "ms", p["query_p99_ms"]),
        ]
    return rows


# ---- the table -----------------------------------------------------------------------


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("ops/s", "events/s", "keys/s"):
        for scale, suffix in ((1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:.2f}{suffix}"
        return f"{value:.0f}"
    if unit in ("ns", "B"):
        return f"{value:,.0f} {unit}"
    if unit == "cores":
        return f"{value:.3f}"
    return f"{value:.2f} {unit}"


def short_note(note: str) -> str:
    """What the value column shows for a row without a value: a short note, or its first word."""
    return note if len(note) <= 24 else note.split(":")[0]


def table(rows: list[Row]) -> str:
    header = ("figure", "distkv", "baseline", "baseline value", "ratio", "goal", "met")
    lines = []
    for r in rows:
        goal = f"{r.goal[0]} {r.goal[1]:.2f}" if r.goal else "-"
        met = "-" if r.met is None else "yes" if r.met else "NO"
        value = fmt(r.distkv, r.unit) if r.distkv is not None else short_note(r.note)
        lines.append(
            (r.figure, value, r.baseline, fmt(r.baseline_value, r.unit), f"{r.ratio:.2f}" if r.ratio is not None else "-", goal, met)
        )
    widths = [max(len(str(line[i])) for line in (header, *lines)) for i in range(len(header))]
    out = []
    part = None
    for r, line in zip([None, *rows], (header, *lines)):
        if r is not None and r.part != part:
            part = r.part
            out.append(f"[{part}]")
        out.append("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip())
        if r is not None and r.note and (r.distkv is not None or short_note(r.note) != r.note):
            out.extend(textwrap.wrap(r.note, 110, initial_indent="    ", subsequent_indent="      "))
    return "\n".join(out)


def machine() -> dict[str, Any]:
    import ray

    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "vllm": vllm_version,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every part smaller")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL

    import ray

    from distkv.names import RAY_NAMESPACE

    started = time.time()
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/suite.py", *sys.argv[1:]]),
        "machine": machine(),
        "load_average_start": os.getloadavg(),
        "seconds": {},
        "figures": {},
    }
    rows: list[Row] = []
    failed = False

    def run(name: str, part: Callable[[Sizes, dict[str, Any]], list[Row]]) -> None:
        nonlocal failed
        print(f"suite: {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            rows.extend(part(sizes, report["figures"]))
        except Exception as e:
            failed = True
            traceback.print_exc()
            rows.append(Row(name, f"{name}: failed", "", None, note=f"failed: {type(e).__name__}: {e}"))
        report["seconds"][name] = round(time.perf_counter() - t, 1)

    # the parts in this process share one local Ray; the others start their own
    ray.init(
        address="local", num_cpus=2, object_store_memory=200 * MiB, include_dashboard=False,
        namespace=RAY_NAMESPACE, log_to_driver=False,
    )
    try:
        run("manager", manager_part)
        run("lookup", lookup_part)
    finally:
        ray.shutdown()
    for name, part in (
        ("transfer", transfer_part), ("gpu", gpu_part), ("promote", promote_part), ("tier", tier_part),
        ("demo", demo_part), ("scale", scale_part),
    ):
        run(name, part)

    report["seconds"]["total"] = round(time.time() - started, 1)
    report["load_average_end"] = os.getloadavg()
    report["rows"] = [r.as_dict() for r in rows]
    m = report["machine"]
    print(
        f"distkv benchmark suite{' (--quick)' if args.quick else ''}: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
        f"{'GPU ' + m['cuda'] if m['cuda'] else 'no GPU'}; Python {m['python']}, torch {m['torch']}, Ray {m['ray']}, vLLM {m['vllm']}"
    )
    print(
        f"load average {report['load_average_start'][0]:.1f} at the start, {report['load_average_end'][0]:.1f} at the end; "
        f"{report['seconds']['total']:.0f} s; ratio = distkv / baseline"
    )
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
