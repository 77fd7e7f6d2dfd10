"""`distkv demo`: engine replicas sharing one prefix cache on a Ray cluster, measured.

Starts an embedded local Ray cluster of simulated nodes (or joins one), places model
replicas on its nodes, sends one trace through a round-robin router three times (through
distkv; with each replica offloading to its own pool only, as vLLM's native CPU offloading
does; with offloading off), checks every loaded block, and reports where the prompt tokens
came from, the time to first token and the bytes moved per path and transport.

It wires the cluster together, so it may import `ray_actors` (the library's classes never do).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, TextIO

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.config import TRANSPORTS, DistkvConfig
from distkv.demo.engine import demo_spec
from distkv.demo.model import ModelConfig
from distkv.demo.report import Tally, format_table
from distkv.demo.workload import Request, WorkloadConfig, generate, oracle_hit_tokens
from distkv.storage.segments import reclaim_stale_segments

OBJECT_STORE_BYTES = 256 << 20  # per simulated node: promotions in flight are a few MiB
REQUEST_TIMEOUT_S = 300.0  # no request finishing for that long means a replica is stuck


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WorkloadConfig()
    m = ModelConfig()
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--replicas", type=int, default=4, help="engine replicas (default 4)")
    cluster.add_argument("--nodes", type=int, default=2, help="simulated nodes of the embedded cluster (default 2)")
    cluster.add_argument("--address", help="join this Ray cluster (e.g. auto, host:port) instead of starting one")
    cluster.add_argument("--in-flight", type=int, help="requests in flight at once (default: twice the replicas)")
    cluster.add_argument("--pool-mib", type=int, default=256, help="host pool per replica, MiB (default 256)")
    cluster.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default 16)")
    cluster.add_argument(
        "--transport", choices=TRANSPORTS, default="auto",
        help="how blocks come from other nodes: object_store, nixl, or auto (default: the faster, measured)",
    )
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=int, default=d.requests, help=f"(default {d.requests})")
    work.add_argument("--system-prompts", type=int, default=d.system_prompts, help=f"(default {d.system_prompts})")
    work.add_argument("--system-tokens", type=int, default=d.system_tokens, help=f"tokens per system prompt (default {d.system_tokens})")
    work.add_argument("--user-tokens", type=int, default=d.user_tokens, help=f"new user text per request (default {d.user_tokens})")
    work.add_argument("--reply-tokens", type=int, default=d.reply_tokens, help=f"reply carried into a conversation's next turn (default {d.reply_tokens})")
    work.add_argument("--turns", type=int, default=d.turns, help=f"turns per conversation (default {d.turns})")
    work.add_argument(
        "--conversation-share", type=float, default=d.conversation_share,
        help=f"share of requests that are conversation turns, the rest one-off (default {d.conversation_share})",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model-dim", type=int, default=m.dim, help=f"(default {m.dim})")
    model.add_argument("--model-layers", type=int, default=m.layers, help=f"(default {m.layers})")
    model.add_argument("--model-heads", type=int, default=m.heads, help=f"(default {m.heads})")
    model.add_argument("--vocab-size", type=int, default=m.vocab_size, help=f"(default {m.vocab_size})")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's weights and the trace (default 0)")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON document")


def run(args: argparse.Namespace) -> int:
    log = sys.stderr if args.json else sys.stdout
    try:
        model = ModelConfig(args.vocab_size, args.model_dim, args.model_layers, args.model_heads, args.seed)
        workload = WorkloadConfig(
            args.requests, args.system_prompts, args.system_tokens, args.user_tokens, args.reply_tokens,
            args.turns, args.conversation_share, args.vocab_size, args.seed,
        )
        for name in ("replicas", "nodes", "pool_mib", "block_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if args.in_flight is not None and args.in_flight < 1:
            raise ValueError("--in-flight must be positive")
    except ValueError as e:
        print(f"distkv demo: {e}", file=sys.stderr)
        return 2

    started = time.perf_counter()
    trace = generate(workload)
    oracle = oracle_hit_tokens(trace, args.block_tokens)
    block_bytes = 2 * model.page_bytes(args.block_tokens)
    demo = Demo(args, model, workload.max_prompt_tokens, log)
    seconds: dict[str, float] = {}
    try:
        demo.start()
        seconds["start"] = time.perf_counter() - started
        conversations = len({r.conversation for r in trace if r.conversation is not None})
        print(
            f"distkv demo: {args.replicas} replicas on {demo.num_nodes} node(s) ({demo.device}), model of "
            f"{model.layers} layers x {model.dim} ({model.page_bytes(args.block_tokens) >> 10} KiB of K per "
            f"{args.block_tokens}-token block), {len(trace)} requests: {conversations} conversations and "
            f"{sum(r.conversation is None for r in trace)} one-off, behind {workload.system_prompts} system "
            f"prompts of {workload.system_tokens} tokens",
            file=log,
        )
        tally = Tally(args.block_tokens, block_bytes)
        t = time.perf_counter()
        demo.serve(trace, "serve", tally.add, "distkv", lambda: _status(tally))
        seconds["distkv"] = time.perf_counter() - t
        t = time.perf_counter()
        demo.serve(trace, "serve_own_pool_only", tally.add_own_pool_only, "own pool only", lambda: "")
        seconds["own_pool_only"] = time.perf_counter() - t
        t = time.perf_counter()
        demo.serve(trace, "serve_without_offloading", tally.add_without_offloading, "offloading off", lambda: "")
        seconds["offloading_off"] = time.perf_counter() - t
        promotions = demo.promotion_stats()
    except KeyboardInterrupt:
        print("\ndistkv demo: interrupted, cleaning up", file=sys.stderr)
        return 130
    finally:
        t = time.perf_counter()
        demo.close()
        seconds["shutdown"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - started
    setup = {
        "replicas": args.replicas,
        "nodes": demo.num_nodes,
        "device": demo.device,
        "model": asdict(model),
        "block_tokens": args.block_tokens,
        "workload": asdict(workload),
        "seconds": seconds,
    }
    summary = tally.summary(oracle, promotions, setup)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        print(format_table(summary))
    return 1 if summary["mismatches"] else 0


def token_auth_on() -> None:
    """Token authentication for a cluster started by this process, as `ray.init()` turns it
    on for a local one: ray.cluster_utils.Cluster starts its processes without it. An
    explicit RAY_AUTH_MODE is respected."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    if enable_token_auth_by_default():
        ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def _dashboard_port(usual: int = 8265) -> int:
    """Ray's usual dashboard port if it is free (another Ray may hold it), else a free one."""
    for port in (usual, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port for the Ray dashboard")


def _status(tally: Tally) -> str:
    return f"hit {tally.hit_rate:5.1%}  moved {tally.bytes_moved / 1e9:6.2f} GB"


class Demo:
    """The cluster the demo runs on and its replicas: started, used, and cleaned up."""

    def __init__(self, args: argparse.Namespace, model: ModelConfig, max_prompt_tokens: int, log: TextIO):
        self.args = args
        self.model = model
        self.max_prompt_tokens = max_prompt_tokens
        self.log = log
        run_id = uuid.uuid4().hex[:8]
        self.run_id = run_id
        self.extra_config = {
            "cpu_bytes_to_use": args.pool_mib << 20,
            "tenant_salt": f"demo-{run_id}",
            "transport": args.transport,
        }
        self.namespace = demo_spec("namespace", self.extra_config, model, args.block_tokens).namespace
        self.cluster = None
        self.actors: list[ray.actor.ActorHandle] = []
        self.pending: dict[ray.ObjectRef, int] = {}
        self.node_ids: list[str] = []
        self.device = "?"
        self._agents_before: set[str] = set()

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    def start(self) -> None:
        from distkv.names import RAY_NAMESPACE

        if self.args.address:
            context = ray.init(address=self.args.address, namespace=RAY_NAMESPACE)
        else:
            from ray.cluster_utils import Cluster

            cpus = max(1, (os.cpu_count() or 1) // self.args.nodes)
            token_auth_on()
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": cpus,
                    "object_store_memory": OBJECT_STORE_BYTES,
                    "include_dashboard": True,
                    "dashboard_port": _dashboard_port(),
                },
            )
            for _ in range(self.args.nodes - 1):
                self.cluster.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES)
            self.cluster.wait_for_nodes()
            context = ray.init(address=self.cluster.address, namespace=RAY_NAMESPACE)
        if context.dashboard_url:
            print(f"Ray dashboard: http://{context.dashboard_url}", file=self.log, flush=True)
        nodes = sorted(
            (n for n in ray.nodes() if n["Alive"]), key=lambda n: "node:__internal_head__" not in n["Resources"]
        )
        self.node_ids = [n["NodeID"] for n in nodes]
        self._agents_before = self._named_actors()
        self._start_replicas(nodes)

    def _start_replicas(self, nodes: list[Mapping[str, Any]]) -> None:
        from ray_actors.demo_replica import DemoReplicaActor

        count = self.args.replicas
        placed = [nodes[i % len(nodes)] for i in range(count)]
        for i, node in enumerate(placed):
            sharing = sum(1 for n in placed if n["NodeID"] == node["NodeID"])
            gpus = node["Resources"].get("GPU", 0)
            self.actors.append(
                DemoReplicaActor.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                    num_gpus=1 / sharing if gpus >= 1 else 0,
                ).remote(
                    f"demo{self.run_id}_r{i}",
                    self.extra_config,
                    self.model,
                    self.args.block_tokens,
                    self.max_prompt_tokens,
                    max(1, int(node["Resources"].get("CPU", 1)) // sharing),
                )
            )
        described = ray.get([a.describe.remote() for a in self.actors], timeout=REQUEST_TIMEOUT_S)
        self.device = ",".join(sorted({d["device"] for d in described}))
        # one prefill each of the longest prompt, without offloading, so that no measured
        # request pays for warming up: the first prefill of a size costs the model's
        # allocations, and a shorter one left them to the first arm's first requests
        warm = [0] * self.max_prompt_tokens
        ray.get([a.serve_without_offloading.remote(warm) for a in self.actors], timeout=REQUEST_TIMEOUT_S)
        self._wait_for_directory()

    def _wait_for_directory(self) -> None:
        """Until every replica is registered with every Directory shard: the shards start
        with the first replica, and what replicas store before then is seen late."""
        from ray_actors.directory import get_or_create_shards

        shards = get_or_create_shards(self.namespace, DistkvConfig.from_extra_config(self.extra_config).directory_shards)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while min(s["replicas"] for s in ray.get([shard.stats.remote() for shard in shards])) < len(self.actors):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not registered with the Directory in {REQUEST_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def serve(
        self,
        trace: list[Request],
        method: str,
        on_result: Callable[[int, dict[str, Any]], None],
        label: str,
        status: Callable[[], str],
    ) -> None:
        """Send the trace round-robin over the replicas, a window of requests at a time; a
        conversation's turn goes out once its previous turn is answered."""
        window = self.args.in_flight or 2 * len(self.actors)
        progress = Progress(label, len(trace), self.log, status)
        answered = [False] * len(trace)
        sent = 0
        while sent < len(trace) or self.pending:
            while sent < len(trace) and len(self.pending) < window:
                after = trace[sent].after
                if after is not None and not answered[after]:
                    break
                actor = self.actors[sent % len(self.actors)]
                self.pending[getattr(actor, method).remote(trace[sent].tokens)] = sent
                sent += 1
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=REQUEST_TIMEOUT_S)
            if not ready:
                raise TimeoutError(f"no request answered in {REQUEST_TIMEOUT_S:.0f} s")
            for ref in ready:
                i = self.pending.pop(ref)
                on_result(i, ray.get(ref))
                answered[i] = True
                progress.update(sum(answered))
        progress.finish()

    def promotion_stats(self) -> dict[str, float]:
        """Promotion bytes and seconds per path, summed over the replicas."""
        total: dict[str, float] = {}
        for stats in ray.get([a.stats.remote() for a in self.actors], timeout=REQUEST_TIMEOUT_S):
            for name, value in stats.items():
                total[name] = total.get(name, 0) + value
        return total

    def close(self) -> None:
        """Replicas shut down (their pools removed), distkv's actors killed, the embedded
        cluster stopped. A second Ctrl-C does not cut it short."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if ray.is_initialized():
                self._stop_actors()
                ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
            reclaim_stale_segments()  # pools of replicas that could not shut down
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop_actors(self) -> None:
        from distkv.names import RAY_NAMESPACE, agent_name
        from ray_actors.directory import kill_shards

        for ref in self.pending:
            ray.cancel(ref)
        self.pending.clear()
        if self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
            except Exception as e:  # a replica that died or hangs is killed below
                print(f"distkv demo: a replica did not shut down cleanly: {e}", file=sys.stderr)
            for actor in self.actors:
                ray.kill(actor)
        kill_shards(self.namespace)
        for node_id in self.node_ids:
            name = agent_name(node_id)
            if name not in self._agents_before and name in self._named_actors():
                ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)

    @staticmethod
    def _named_actors() -> set[str]:
        from distkv.names import RAY_NAMESPACE

        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RAY_NAMESPACE}


class Progress:
    """One line, rewritten in place on a terminal, every tenth of the way elsewhere."""

    def __init__(self, label: str, total: int, stream: TextIO, status: Callable[[], str], width: int = 24):
        self.label = label
        self.total = total
        self.stream = stream
        self.status = status
        self.width = width
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self._shown_at = 0.0
        self._shown_tenths = -1

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.tty:
            if now - self._shown_at >= 0.1 or done == self.total:
                self._shown_at = now
                self.stream.write("\r" + self._line(done, now))
                self.stream.flush()
        elif done * 10 // self.total > self._shown_tenths:
            self._shown_tenths = done * 10 // self.total
            print(self._line(done, now), file=self.stream, flush=True)

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, done: int, now: float) -> str:
        filled = done * self.width // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        return f"  {self.label:<15}[{bar}] {done:>5}/{self.total} requests  {self.status()}  {now - self.started:5.1f} s"
