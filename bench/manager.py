"""Throughput of LocalOffloadingManager: lookups, store cycles and load cycles.

    python bench/manager.py [--rows N] [--runs N] [--json PATH]

A pool of --rows rows is filled with ready blocks (36-byte keys, as vLLM's 32-byte block
hashes plus a group index), then, per policy:

  lookup        every stored key once (hits). Baseline: the same keys through a bare
                dict.get and compare, the floor for a per-key lookup in Python.
  store cycle   prepare_store + complete_store + take_events of 64 new keys, pool full,
                so each cycle evicts 64.
  load cycle    prepare_load + complete_load of 64 stored keys.

Each figure is the median of --runs runs after a warm-up run. vLLM's CPUOffloadingManager
is measured the same way, one request context per cycle, when vLLM is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

from distkv.abstract import ReqContext, make_offload_key
from distkv.replica.local_manager import LocalOffloadingManager

BATCH = 64
TARGETS = {"lookup": 2e6, "store": 3e3, "load": 5e3}
UNITS = {"lookup": "lookups/s", "store": "store cycles/s", "load": "load cycles/s"}


def make_keys(start: int, count: int) -> list[bytes]:
    return [
        make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)
        for i in range(start, start + count)
    ]


def median_rate(run: Callable[[int], int], runs: int) -> float:
    """Median of `runs` timed calls of run(i) (after one untimed), in operations per second."""
    run(0)
    rates = []
    for i in range(1, runs + 1):
        start = time.perf_counter()
        ops = run(i)
        rates.append(ops / (time.perf_counter() - start))
    return statistics.median(rates)


class Subject:
    """One manager driven through the three figures; subclasses adapt its API."""

    def __init__(self, manager, keys: list[bytes]) -> None:
        self.manager = manager
        self.keys = keys
        for i in range(0, len(keys), BATCH):
            self.store(keys[i : i + BATCH])

    def context(self):
        return ReqContext("bench")

    def finish(self, ctx) -> None:
        return

    def store(self, keys: list[bytes]) -> None:
        ctx = self.context()
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            raise RuntimeError("prepare_store found nothing to evict")
        self.manager.complete_store(out.keys_to_store, ctx)
        for _ in self.manager.take_events():
            pass
        self.finish(ctx)

    def lookup_run(self, _: int) -> int:
        lookup, ctx = self.manager.lookup, self.context()
        for key in self.keys:
            lookup(key, ctx)
        return len(self.keys)

    def load_run(self, cycles: int) -> Callable[[int], int]:
        batches = [self.keys[i : i + BATCH] for i in range(0, len(self.keys) - BATCH + 1, BATCH)]

        def run(_: int) -> int:
            manager = self.manager
            for i in range(cycles):
                keys = batches[i % len(batches)]
                ctx = self.context()
                manager.prepare_load(keys, ctx)
                manager.complete_load(keys, ctx)
                self.finish(ctx)
            return cycles

        return run

    def store_run(self, cycles: int, fresh: list[bytes]) -> Callable[[int], int]:
        def run(i: int) -> int:
            base = i * cycles * BATCH
            for c in range(cycles):
                self.store(fresh[base + c * BATCH : base + (c + 1) * BATCH])
            return cycles

        return run


class VLLMSubject(Subject):
    def __init__(self, manager, keys: list[bytes]) -> None:
        from vllm.v1.kv_offload.base import ReqContext as VLLMReqContext

        self.context_cls = VLLMReqContext
        super().__init__(manager, keys)

    def context(self):
        return self.context_cls(req_id="bench")

    def finish(self, ctx) -> None:
        self.manager.on_request_finished(ctx)


def vllm_manager(num_rows: int, policy: str):
    """vLLM's CPUOffloadingManager, or None where vLLM is not importable."""
    try:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError:
        return None
    return CPUOffloadingManager(num_rows, cache_policy=policy, enable_events=True)


def fmt(rate: float | None) -> str:
    if rate is None:
        return "-"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.2f}{suffix}"
    return f"{rate:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="pool rows, all filled")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per figure")
    parser.add_argument("--store-cycles", type=int, default=500, help="store cycles per run")
    parser.add_argument("--load-cycles", type=int, default=2000, help="load cycles per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    keys = make_keys(0, args.rows)
    fresh = make_keys(args.rows, (args.runs + 1) * args.store_cycles * BATCH)
    table = dict.fromkeys(keys, 0)

    def dict_run(_: int) -> int:
        get = table.get
        for key in keys:
            get(key, -1) >= 0
        return len(keys)

    results = []
    for policy in ("lru", "arc"):
        ours = Subject(LocalOffloadingManager(args.rows, policy), keys)
        manager = vllm_manager(args.rows, policy)
        theirs = VLLMSubject(manager, keys) if manager is not None else None
        for figure in ("lookup", "load", "store"):
            runs: list[Callable[[int], int] | None] = []
            for subject in (ours, theirs):
                if subject is None:
                    runs.append(None)
                elif figure == "lookup":
                    runs.append(subject.lookup_run)
                elif figure == "load":
                    runs.append(subject.load_run(args.load_cycles))
                else:
                    runs.append(subject.store_run(args.store_cycles, fresh))
            rate = median_rate(runs[0], args.runs)
            if figure == "lookup":
                baseline_name, baseline = "dict.get+compare", median_rate(dict_run, args.runs)
            else:
                baseline_name = "vLLM CPUOffloadingManager"
                baseline = median_rate(runs[1], args.runs) if runs[1] is not None else None
            results.append(
                {
                    "figure": UNITS[figure],
                    "policy": policy,
                    "value": rate,
                    "target": TARGETS[figure],
                    "baseline_name": baseline_name,
                    "baseline": baseline,
                    "ratio": rate / baseline if baseline else None,
                }
            )

    print(
        f"LocalOffloadingManager, {args.rows:,} rows, {BATCH}-key cycles, "
        f"median of {args.runs} runs"
    )
    header = ("figure", "policy", "distkv", "target", "met", "baseline (same run)", "value", "ratio")
    rows = [
        (
            r["figure"],
            r["policy"],
            fmt(r["value"]),
            fmt(r["target"]),
            "yes" if r["value"] >= r["target"] else "NO",
            r["baseline_name"],
            fmt(r["baseline"]) if r["baseline"] is not None else "not importable",
            f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
        )
        for r in results
    ]
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "batch": BATCH, "results": results}, indent=2))


if __name__ == "__main__":
    main()
