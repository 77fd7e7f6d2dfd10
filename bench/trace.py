"""One operation trace of vLLM's scheduler on a prefix-sharing workload, replayed on each manager.

    python bench/trace.py [--requests N] [--rows N] [--runs N] [--view-keys N] [--json PATH]

The trace. The demo's workload (distkv.demo.workload: multi-turn conversations and
one-off requests behind shared system prompts, 16-token blocks) goes through a scheduler
that calls an OffloadingManager as vLLM's OffloadingConnector does, admitting up to
BATCH requests per step:

  step s     lookup of each block until the first miss (a request with a block still
             being stored is deferred to the next step, its scan run again); prepare_load
             of the hits
  step s+1   complete_load of the hits; prepare_store of the blocks it computed
  step s+2   complete_store of the blocks prepare_store took; touch of all its blocks
  each step  take_events

A conversation's next turn is admitted once its previous turn finished. The pool holds
--rows blocks, a fraction of those the trace stores, so stores evict while other
requests' loads pin blocks. The calls, with their keys and every answer, are recorded
once per eviction policy against distkv's LocalOffloadingManager.

Replay. The recorded calls, in order, on a manager emptied by reset_cache. Each call (a
request's run of lookups as one) is timed in CPU time of the calling thread
(time.thread_time_ns, less what an empty timing measures), so that other processes on
the machine's cores do not land in the figures; the CPU time other threads of this
process spend meanwhile (the cluster manager's DirectoryLink, Ray's own threads) is
reported apart. The garbage collector is off, so that a collection of the whole heap is
not charged to whichever call triggers it. vLLM's CPUOffloadingManager also gets
on_new_request and on_request_finished, as its scheduler calls them and its policies
read them; they count in its whole-trace time only. A manager whose answers differ from
the recording (a lookup, or how many blocks a prepare_store takes) stops the replay as
diverged.

Managers, for LRU and ARC each: distkv's LocalOffloadingManager; distkv's
ClusterOffloadingManager with a warm view of the Directory (a real DirectoryLink on a
local Ray, the view holding --view-keys blocks of another replica, none of the trace's,
so every local miss also misses the view); vLLM 0.33's CPUOffloadingManager (the
baseline). Figures are the median over --runs replays, the managers taking turns.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

from distkv.abstract import SEED_LOOKUP_ANSWERS, LookupResult, ReqContext  # noqa: E402
from distkv.demo.workload import WorkloadConfig, generate  # noqa: E402
from distkv.replica.harness import block_keys  # noqa: E402
from distkv.replica.local_manager import LocalOffloadingManager  # noqa: E402

KINDS = ("lookup", "prepare_load", "complete_load", "touch", "prepare_store", "complete_store", "take_events")
LOOKUP, PREPARE_LOAD, COMPLETE_LOAD, TOUCH, PREPARE_STORE, COMPLETE_STORE, TAKE_EVENTS = range(len(KINDS))
POLICIES = ("lru", "arc")
BLOCK_TOKENS = 16
BATCH = 8  # requests admitted per scheduler step
SYSTEM_PROMPTS = 8

# Lookup answers as distkv's seed API gives them: True (ready), False (miss), None (retry later).
SEED_ANSWERS: dict[Any, bool | None] = {True: True, False: False, None: None}
# The cluster manager's, by lookup_result, in the seed's terms.
CLUSTER_ANSWERS: dict[Any, bool | None] = dict(zip(LookupResult, SEED_LOOKUP_ANSWERS))


class Op(NamedTuple):
    """One recorded call. request: its index in the workload, -1 for take_events.
    answer: a lookup run's answers; how many blocks prepare_store took (None: it refused)."""

    kind: int
    request: int
    keys: list[bytes]
    answer: Any = None


@dataclass
class Trace:
    policy: str
    rows: int
    requests: int
    blocks: int  # distinct blocks of the workload
    ops: list[Op]

    def calls(self) -> list[int]:
        """Calls per kind; each lookup of a run counts."""
        counts = [0] * len(KINDS)
        for op in self.ops:
            counts[op.kind] += len(op.keys) if op.kind == LOOKUP else 1
        return counts

    def timings(self) -> list[int]:
        """Timed sections per kind: a run of lookups is one."""
        counts = [0] * len(KINDS)
        for op in self.ops:
            counts[op.kind] += 1
        return counts

    def hits(self) -> int:
        return sum(1 for op in self.ops if op.kind == LOOKUP for answer in op.answer if answer)


def record(requests: int, rows: int, policy: str, seed: int = 0) -> Trace:
    """The trace of `requests` requests of the demo's workload on a pool of `rows` blocks."""
    workload = generate(WorkloadConfig(requests=requests, system_prompts=SYSTEM_PROMPTS, seed=seed))
    keys = [block_keys(r.tokens, BLOCK_TOKENS) for r in workload]
    manager = LocalOffloadingManager(rows, policy)
    contexts: dict[int, ReqContext] = {}
    ops: list[Op] = []
    waiting = deque(range(len(workload)))
    deferred: list[int] = []
    loading: list[tuple[int, int]] = []  # (request, hits) admitted last step
    storing: list[tuple[int, list[bytes]]] = []  # (request, blocks being stored)
    finished: set[int] = set()
    while waiting or deferred or loading or storing:
        for r, accepted in storing:
            ctx = contexts.pop(r)
            if accepted:
                manager.complete_store(accepted, ctx)
                ops.append(Op(COMPLETE_STORE, r, accepted))
            manager.touch(keys[r], ctx)
            ops.append(Op(TOUCH, r, keys[r]))
            finished.add(r)
        storing = []
        for r, hits in loading:
            ctx = contexts[r]
            if hits:
                manager.complete_load(keys[r][:hits], ctx)
                ops.append(Op(COMPLETE_LOAD, r, keys[r][:hits]))
            new = keys[r][hits:]
            accepted = []
            if new:
                out = manager.prepare_store(new, ctx)
                accepted = out.keys_to_store if out is not None else []
                ops.append(Op(PREPARE_STORE, r, new, len(accepted) if out is not None else None))
            storing.append((r, accepted))
        loading = []
        retry, deferred = deferred, []
        while retry or (waiting and len(loading) < BATCH):
            if retry:
                r = retry.pop(0)
            else:
                r = waiting[0]
                after = workload[r].after
                if after is not None and after not in finished:
                    break
                waiting.popleft()
            ctx = contexts.setdefault(r, ReqContext(f"req-{r}"))
            scanned, answers = [], []
            for key in keys[r]:  # as vLLM's scan: a retry does not end it, the first miss does
                answer = manager.lookup(key, ctx)
                scanned.append(key)
                answers.append(answer)
                if answer is False:
                    break
            ops.append(Op(LOOKUP, r, scanned, answers))
            if None in answers:
                deferred.append(r)
                continue
            hits = answers.index(False) if False in answers else len(answers)
            if hits:
                manager.prepare_load(keys[r][:hits], ctx)
                ops.append(Op(PREPARE_LOAD, r, keys[r][:hits]))
            loading.append((r, hits))
        for _ in manager.take_events():
            pass
        ops.append(Op(TAKE_EVENTS, -1, []))
    return Trace(policy, rows, requests, len({k for ks in keys for k in ks}), ops)


@dataclass
class Subject:
    """A manager to replay the trace on, and how a scheduler talks to it."""

    name: str
    manager: Any
    context: Callable[[str], Any]  # req_id -> the request's ReqContext
    answers: dict[Any, bool | None] = field(default_factory=lambda: SEED_ANSWERS)  # its lookup answers, in the seed's terms
    request_hooks: bool = False  # vLLM's on_new_request / on_request_finished
    lookup: str = "lookup"  # the method the scheduler looks blocks up by


def local_subject(policy: str, rows: int) -> Subject:
    return Subject("distkv local", LocalOffloadingManager(rows, policy), ReqContext)


def vllm_subject(policy: str, rows: int) -> Subject | None:
    """vLLM 0.33's CPUOffloadingManager, or None where vLLM is not importable."""
    try:
        from vllm.v1.kv_offload.base import LookupResult
        from vllm.v1.kv_offload.base import ReqContext as VLLMReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError:
        return None
    answers = {LookupResult.HIT: True, LookupResult.MISS: False, LookupResult.HIT_PENDING: None, LookupResult.RETRY: None}
    manager = CPUOffloadingManager(rows, cache_policy=policy, enable_events=True)
    return Subject("vLLM CPUOffloadingManager", manager, lambda req_id: VLLMReqContext(req_id=req_id), answers, True)


class Diverged(Exception):
    """A manager answered a recorded call differently from the recording."""


@dataclass
class Replay:
    ns: list[int]  # CPU time of the calls, per kind
    hooks_ns: int  # of vLLM's request hooks
    background_ns: int  # CPU time of this process's other threads meanwhile

    @property
    def total_ns(self) -> int:
        return sum(self.ns) + self.hooks_ns


def timing_overhead_ns(clock: Callable[[], int], samples: int = 2001) -> int:
    """What an empty timed section measures: the median over `samples`."""
    spent = []
    for _ in range(samples):
        t = clock()
        spent.append(clock() - t)
    return int(statistics.median(spent))


def replay(trace: Trace, subject: Subject) -> Replay:
    """Run the trace's calls on the subject's manager, emptied first; the time spent per kind."""
    manager = subject.manager
    manager.reset_cache()
    for _ in manager.take_events():
        pass
    lookup, touch = getattr(manager, subject.lookup), manager.touch
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    take_events = manager.take_events
    if subject.request_hooks:
        on_new_request, on_request_finished = manager.on_new_request, manager.on_request_finished
    make_context, hooks, seed_answer = subject.context, subject.request_hooks, subject.answers
    contexts: dict[int, Any] = {}
    accepted: dict[int, list[bytes]] = {}
    ns = [0] * len(KINDS)
    hooks_ns = 0
    clock = time.thread_time_ns
    overhead = timing_overhead_ns(clock)
    gc.collect()
    gc.disable()
    process_start, thread_start = time.process_time_ns(), clock()
    try:
        for index, (kind, r, keys, answer) in enumerate(trace.ops):
            if kind == LOOKUP:
                ctx = contexts.get(r)
                if ctx is None:
                    ctx = contexts[r] = make_context(f"req-{r}")
                    if hooks:
                        t = clock()
                        on_new_request(ctx)
                        hooks_ns += clock() - t
                t = clock()
                answers = [lookup(key, ctx) for key in keys]
                ns[LOOKUP] += clock() - t
                if [seed_answer[a] for a in answers] != answer:
                    raise Diverged(f"{subject.name}: op {index}, lookups of request {r}: {answers} where the recording has {answer}")
            elif kind == PREPARE_LOAD:
                t = clock()
                prepare_load(keys, contexts[r])
                ns[PREPARE_LOAD] += clock() - t
            elif kind == COMPLETE_LOAD:
                t = clock()
                complete_load(keys, contexts[r])
                ns[COMPLETE_LOAD] += clock() - t
            elif kind == PREPARE_STORE:
                t = clock()
                out = prepare_store(keys, contexts[r])
                ns[PREPARE_STORE] += clock() - t
                taken = len(out.keys_to_store) if out is not None else None
                if taken != answer:
                    raise Diverged(f"{subject.name}: op {index}, prepare_store of request {r} took {taken} blocks where the recording has {answer}")
                accepted[r] = out.keys_to_store if out is not None else []
            elif kind == COMPLETE_STORE:
                t = clock()
                complete_store(accepted.pop(r), contexts[r])
                ns[COMPLETE_STORE] += clock() - t
            elif kind == TOUCH:  # a request's last call
                ctx = contexts.pop(r)
                accepted.pop(r, None)
                t = clock()
                touch(keys, ctx)
                ns[TOUCH] += clock() - t
                if hooks:
                    t = clock()
                    on_request_finished(ctx)
                    hooks_ns += clock() - t
            else:
                t = clock()
                for _ in take_events():
                    pass
                ns[TAKE_EVENTS] += clock() - t
        background = time.process_time_ns() - process_start - (clock() - thread_start)
    finally:
        gc.enable()
    timings = trace.timings()
    for kind in range(len(KINDS)):
        ns[kind] = max(ns[kind] - timings[kind] * overhead, 1)
    hook_calls = 2 * trace.requests if hooks else 0
    return Replay(ns, max(hooks_ns - hook_calls * overhead, 0), background)


def compare(traces: dict[str, Trace], subjects: dict[str, list[Subject]], runs: int) -> list[dict[str, Any]]:
    """Median ops/s per kind (and over the whole trace) of each subject, per policy.

    subjects: policy -> its managers; each run replays the policy's trace on every one of
    them in turn. Returns one dict per (policy, subject): {"policy", "subject", "ops_per_s":
    {kind or "trace": value}, "trace_cpu_s" (the calling thread's, for the whole trace),
    "background_cpu_s" (other threads', meanwhile), "diverged": message or None}."""
    results = []
    for policy, trace in traces.items():
        calls = trace.calls()
        samples: dict[str, list[Replay]] = {s.name: [] for s in subjects[policy]}
        diverged: dict[str, str] = {}
        for _ in range(runs):
            for subject in subjects[policy]:
                if subject.name in diverged:
                    continue
                try:
                    samples[subject.name].append(replay(trace, subject))
                except Diverged as e:
                    diverged[subject.name] = str(e)
        for subject in subjects[policy]:
            done = samples[subject.name]
            rates: dict[str, float] = {}
            background = None
            if done:
                for kind, name in enumerate(KINDS):
                    rates[name] = statistics.median(calls[kind] / (r.ns[kind] / 1e9) for r in done)
                rates["trace"] = statistics.median(sum(calls) / (r.total_ns / 1e9) for r in done)
                background = statistics.median(r.background_ns / 1e9 for r in done)
            results.append(
                {
                    "policy": policy,
                    "subject": subject.name,
                    "ops_per_s": rates,
                    "trace_cpu_s": sum(calls) / rates["trace"] if done else None,
                    "background_cpu_s": background,
                    "diverged": diverged.get(subject.name),
                }
            )
    return results


def measure(requests: int, rows: int, runs: int, view_keys: int | None) -> dict[str, Any]:
    """Record the trace for each policy and replay it on distkv's local manager, its cluster
    manager (when view_keys is given: needs a local Ray the caller started) and vLLM's.

    Returns {"trace": {policy: sizes}, "results": compare(...)}."""
    if view_keys is not None:
        from lookup import warm_cluster
    traces = {policy: record(requests, rows, policy) for policy in POLICIES}
    with contextlib.ExitStack() as stack:
        subjects: dict[str, list[Subject]] = {}
        for policy in POLICIES:
            subjects[policy] = [local_subject(policy, rows)]
            if view_keys is not None:
                cluster = stack.enter_context(warm_cluster(rows, view_keys, policy))
                # looked up as vLLM's adapter does, by the four answers
                subjects[policy].append(Subject("distkv cluster", cluster, ReqContext, CLUSTER_ANSWERS, lookup="lookup_result"))
            theirs = vllm_subject(policy, rows)
            if theirs is not None:
                subjects[policy].append(theirs)
        results = compare(traces, subjects, runs)
    sizes = {
        policy: {
            "requests": t.requests,
            "rows": t.rows,
            "blocks": t.blocks,
            "calls": dict(zip(KINDS, t.calls())),
            "lookup_hits": t.hits(),
        }
        for policy, t in traces.items()
    }
    return {"trace": sizes, "results": results}


def fmt(rate: float | None) -> str:
    if rate is None:
        return "-"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.2f}{suffix}"
    return f"{rate:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests of the workload")
    parser.add_argument("--rows", type=int, default=8192, help="pool rows (blocks)")
    parser.add_argument("--runs", type=int, default=5, help="replays per manager")
    parser.add_argument("--view-keys", type=int, default=65536, help="blocks of another replica in the cluster manager's view; 0: no cluster manager (no Ray)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    view_keys = args.view_keys or None
    if view_keys is not None:
        import ray

        from distkv.names import RAY_NAMESPACE

        ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False)
    try:
        figures = measure(args.requests, args.rows, args.runs, view_keys)
    finally:
        if view_keys is not None:
            ray.shutdown()

    for policy, sizes in figures["trace"].items():
        calls = ", ".join(f"{kind} {n:,}" for kind, n in sizes["calls"].items())
        print(f"trace ({policy}): {sizes['requests']:,} requests, {sizes['blocks']:,} distinct blocks, pool of {sizes['rows']:,}; calls: {calls}; lookup hits {sizes['lookup_hits']:,}")
    print(f"ops/s, median of {args.runs} replays; ratio: distkv / vLLM")
    by_key = {(r["policy"], r["subject"]): r for r in figures["results"]}
    names = ["distkv local", "distkv cluster", "vLLM CPUOffloadingManager"]
    header = f"{'policy':6} {'call':15} {'local':>9} {'cluster':>9} {'vLLM':>9} {'local/vLLM':>10} {'cluster/vLLM':>12}"
    print(header)
    for policy in POLICIES:
        found = [by_key.get((policy, name)) for name in names]
        for r in found:
            if r is not None and r["diverged"]:
                print(f"{policy:6} DIVERGED: {r['diverged']}")
        for kind in (*KINDS, "trace"):
            values = [r["ops_per_s"].get(kind) if r is not None else None for r in found]
            ratios = [f"{v / values[2]:.2f}" if v and values[2] else "-" for v in values[:2]]
            print(f"{policy:6} {kind:15} {fmt(values[0]):>9} {fmt(values[1]):>9} {fmt(values[2]):>9} {ratios[0]:>10} {ratios[1]:>12}")
        cpu = [
            f"{name} {r['trace_cpu_s'] * 1e3:.0f} ms (other threads {r['background_cpu_s'] * 1e3:.0f} ms)"
            for name, r in zip(names, found)
            if r is not None and r["trace_cpu_s"] is not None
        ]
        print(f"{policy:6} CPU per replay: {'; '.join(cpu)}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
