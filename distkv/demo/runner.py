"""`distkv demo`: engine replicas sharing one prefix cache on a Ray cluster, as a Serve application, measured.

Starts an embedded local Ray cluster of simulated nodes (or joins one), and for each arm
(`distkv.demo.arms`: offloading off; each replica's own pool with Ray's prefix-affinity router;
distkv with Serve's default router; distkv with distkv's router) deploys the model's replicas
as a Ray Serve deployment, sends the same trace through a `DeploymentHandle`, and deletes it.
It checks every loaded block and reports, per arm, the time to first token as the client saw
it and where it went, where the prompt tokens came from, the bytes moved per path and
transport, how requests spread over the replicas, and what the pull gate and the router did.

It wires the cluster together, so it may import `ray_actors` (the library's classes never do).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TextIO

import numpy as np
import ray

from distkv.config import TRANSPORTS, DistkvConfig
from distkv.demo.arms import ARMS, DEFAULT_ARMS, Arm, parse_arms
from distkv.demo.arrivals import ClosedLoop, OpenLoop
from distkv.demo.engine import demo_spec
from distkv.demo.handles import ready_handle, request_router
from distkv.demo.model import ModelConfig
from distkv.demo.report import ArmTally, Verifier, summarize
from distkv.demo.request import DemoRequest
from distkv.demo.stuck import stacks_printed_if_stuck
from distkv.demo.table import format_table
from distkv.demo.workload import Request, WorkloadConfig, generate
from distkv.storage.segments import reclaim_stale_segments

OBJECT_STORE_BYTES = 256 << 20  # per simulated node: promotions in flight are a few MiB
REQUEST_TIMEOUT_S = 300.0  # no request finishing for that long means a replica is stuck
# The longest the demo waits for an answer from one of distkv's actors before asking again.
CALL_TIMEOUT_S = 10.0
# An arm's setup (its deployment, Directory and warm-up: seconds) running this long is stuck:
# the driver prints its stacks, well before its waits give up at REQUEST_TIMEOUT_S.
SETUP_STUCK_S = 120.0
SKEW = 1.5  # `--skew` alone: the first of 4 system prompts draws 60% of the requests
# how often Serve asks a replica for its routing stats (who it is, what its gate measured)
ROUTING_STATS_PERIOD_S = 1.0
APP, DEPLOYMENT = "distkv-demo", "engine"
# how long a new handle's router may take to learn the deployment's replicas and config
# before the handle is replaced (`ready_handle`); on an idle machine it takes one controller call
HANDLE_READY_S = 10.0
# Serve's own logs at warnings only, without a line per request (the Ray dashboard has them)
SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = WorkloadConfig()
    m = ModelConfig()
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--replicas", type=int, default=4, help="engine replicas (default 4)")
    cluster.add_argument("--nodes", type=int, default=2, help="simulated nodes of the embedded cluster (default 2)")
    cluster.add_argument("--address", help="join this Ray cluster (e.g. auto, host:port) instead of starting one")
    cluster.add_argument(
        "--in-flight", type=int, help="requests in flight at once, a closed loop (default: twice the replicas)"
    )
    cluster.add_argument(
        "--rate", type=float, metavar="PER_S",
        help="send requests at Poisson arrivals of this many a second instead, an open loop (as vLLM's "
        "benchmark_serving --request-rate); a conversation's turn still waits for its previous turn's answer",
    )
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
    work.add_argument(
        "--skew", type=float, nargs="?", const=SKEW, default=d.skew, metavar="S",
        help=f"draw system prompts from a Zipf distribution of exponent S (alone: {SKEW}), so that one prefix "
        "is hot (default: uniform)",
    )
    parser.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS),
        help=f"the arms to run, in order, separated by commas, of {list(ARMS)} (default: all four)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's weights and the trace (default 0)")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON document")


def run(args: argparse.Namespace) -> int:
    log = sys.stderr if args.json else sys.stdout
    try:
        model = ModelConfig(args.vocab_size, args.model_dim, args.model_layers, args.model_heads, args.seed)
        workload = WorkloadConfig(
            args.requests, args.system_prompts, args.system_tokens, args.user_tokens, args.reply_tokens,
            args.turns, args.conversation_share, args.vocab_size, args.seed, args.skew,
        )
        for name in ("replicas", "nodes", "pool_mib", "block_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if args.in_flight is not None and args.in_flight < 1:  # a replica's concurrency in either loop
            raise ValueError("--in-flight must be positive")
        window = 2 * args.replicas if args.in_flight is None else args.in_flight
        if args.rate is None:
            sending: ClosedLoop | OpenLoop = ClosedLoop(window, REQUEST_TIMEOUT_S)
        else:
            sending = OpenLoop(args.rate, args.seed, REQUEST_TIMEOUT_S)
        arms = parse_arms(args.arms)
    except ValueError as e:
        print(f"distkv demo: {e}", file=sys.stderr)
        return 2

    started = time.perf_counter()
    trace = generate(workload)
    block_bytes = 2 * model.page_bytes(args.block_tokens)
    demo = Demo(args, model, workload.max_prompt_tokens, sending, window, log)
    seconds: dict[str, float] = {}
    tallies: dict[str, ArmTally] = {}
    verifier = Verifier()
    try:
        demo.start()
        seconds["start"] = time.perf_counter() - started
        conversations = len({r.conversation for r in trace if r.conversation is not None})
        print(
            f"distkv demo: {args.replicas} replicas on {demo.num_nodes} node(s) ({demo.device}), model of "
            f"{model.layers} layers x {model.dim} ({model.page_bytes(args.block_tokens) >> 10} KiB of K per "
            f"{args.block_tokens}-token block), {len(trace)} requests: {conversations} conversations and "
            f"{sum(r.conversation is None for r in trace)} one-off, behind {workload.system_prompts} system "
            f"prompts of {workload.system_tokens} tokens"
            + (f" drawn with Zipf skew {workload.skew}" if workload.skew else "")
            + f", sent in {demo.sending}",
            file=log,
        )
        for arm in arms:
            t = time.perf_counter()
            tally = tallies[arm.name] = ArmTally(args.block_tokens, block_bytes, args.replicas)

            def add(
                i: int, result: dict[str, Any], client_ttft_s: float, answered_at: float, arm: Arm = arm,
                tally: ArmTally = tally,
            ) -> None:
                tally.add(i, result, client_ttft_s, answered_at)
                verifier.add(arm.name, i, result)

            demo.run_arm(arm, trace, add, tally.warmed, tally.router_figures, lambda tally=tally: _status(tally))
            seconds[arm.name] = time.perf_counter() - t
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
        "block_bytes": block_bytes,
        "workload": asdict(workload),
        "in_flight": None if args.rate is not None else window,
        "rate": args.rate,
        "seconds": seconds,
    }
    summary = summarize(tallies, verifier, trace, setup)
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


def _status(tally: ArmTally) -> str:
    return f"hit {tally.hit_rate:5.1%}  moved {tally.bytes_moved / 1e9:6.2f} GB"


class Demo:
    """The cluster the demo runs on and each arm's Serve application: started, used, cleaned up."""

    def __init__(
        self, args: argparse.Namespace, model: ModelConfig, max_prompt_tokens: int, sending: ClosedLoop | OpenLoop,
        window: int, log: TextIO,
    ):
        """`sending`: how the client sends each arm its trace; `window`: the requests a
        replica takes at once (and the warm-up's)."""
        self.args = args
        self.model = model
        self.max_prompt_tokens = max_prompt_tokens
        self.sending = sending
        self.window = window
        self.log = log
        self.run_id = uuid.uuid4().hex[:8]
        self.cluster = None
        self.node_ids: list[str] = []
        self.device = "?"
        self._placement: dict[str, Any] = {}
        self._deployed = False
        self._namespaces: list[str] = []
        self._agents_before: set[str] = set()

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    def start(self) -> None:
        from ray import serve

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
        nodes = [n for n in ray.nodes() if n["Alive"]]
        self.node_ids = [n["NodeID"] for n in nodes]
        self._agents_before = self._named_actors()
        per_node = math.ceil(self.args.replicas / len(nodes))
        gpus = all(n["Resources"].get("GPU", 0) >= 1 for n in nodes)
        self._placement = {
            "max_replicas_per_node": per_node,
            "ray_actor_options": {"num_cpus": 0, "num_gpus": 1 / per_node if gpus else 0},
            # torch threads of each replica: the node's cores over the replicas sharing them
            "threads": max(1, min(int(n["Resources"].get("CPU", 1)) for n in nodes) // per_node),
        }
        self.device = "cuda" if gpus else "cpu"
        serve.start(proxy_location="Disabled", logging_config=SERVE_LOGGING)

    def run_arm(
        self, arm: Arm, trace: list[Request], on_result: Callable, warmed: Callable, report_router: Callable,
        status: Callable[[], str],
    ) -> None:
        """Move the deployment to `arm` (deploying it first), warm it up (`warmed` gets
        those results), send it the trace (`on_result` gets each request's index, its result,
        its TTFT as the client saw it and when it was answered), and hand
        `report_router` the handle's request router."""
        from ray import serve
        from ray.serve.config import RequestRouterConfig
        from ray.serve.handle import DeploymentHandle

        from ray_actors.demo_deployment import DemoEngine

        extra_config = {
            "cpu_bytes_to_use": self.args.pool_mib << 20,
            "tenant_salt": f"demo-{self.run_id}-{arm.name}",
            "transport": self.args.transport,
        }
        options = dict(self._placement)
        threads = options.pop("threads")
        options["request_router_config"] = RequestRouterConfig(
            request_router_kwargs=arm.router_kwargs,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            **({"request_router_class": arm.router} if arm.router else {}),
        )
        deployment = DemoEngine.options(
            name=DEPLOYMENT,
            num_replicas=self.args.replicas,
            max_ongoing_requests=self.window,
            user_config={"arm": arm.name, "engine": arm.engine, "extra_config": extra_config},
            **options,
        )
        # One code version for every arm, so that the next arm reconfigures the replicas in
        # place (a new engine each, the same process and model) instead of restarting them:
        # Serve 2.60's serve.run draws a random version per call unless a deployment has one
        # (its `serve deploy` keys it on the import path), and its options() no longer take one.
        deployment._version = self.run_id
        app = deployment.bind(f"demo{self.run_id}", self.model, self.args.block_tokens, self.max_prompt_tokens, threads)
        self._deployed = True
        with stacks_printed_if_stuck(SETUP_STUCK_S):
            serve.run(app, name=APP, route_prefix=None, logging_config=SERVE_LOGGING)
            self._forget_namespaces()  # the previous arm's engines are shut down
            if arm.engine == "distkv":
                namespace = demo_spec("namespace", extra_config, self.model, self.args.block_tokens).namespace
                self._namespaces.append(namespace)
                self._wait_for_directory(namespace, DistkvConfig.from_extra_config(extra_config).directory_shards)
            # a handle of its own: a handle keeps the router it started with
            handle = ready_handle(lambda: DeploymentHandle(DEPLOYMENT, APP), HANDLE_READY_S, REQUEST_TIMEOUT_S)
            asyncio.run(self._warm_up(handle, warmed))
        progress = Progress(arm.label, len(trace), self.log, status)

        def answered(*result: Any) -> None:
            on_result(*result)
            progress.update()

        async def call(request: Request) -> dict[str, Any]:
            return await handle.remote(DemoRequest(request.tokens.tolist()))

        asyncio.run(self.sending.send(call, trace, answered))
        progress.finish()
        report_router(request_router(handle))
        handle.shutdown()  # its router stops following the deployment

    async def _warm_up(self, handle: Any, warmed: Callable[[dict[str, Any]], None]) -> None:
        """A window of random prompts, which share no block with the trace, so that no
        measured request pays for a router's or a replica's first use (Ray's prefix-affinity
        router starts its prefix tree's actor, distkv's router connects to the Directory)."""
        rng = np.random.default_rng()
        prompts = [
            rng.integers(0, self.model.vocab_size, self.max_prompt_tokens // 2).tolist() for _ in range(self.window)
        ]
        answers = asyncio.gather(*(handle.remote(DemoRequest(p)) for p in prompts))
        try:
            results = await asyncio.wait_for(answers, REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the warm-up's requests were not answered in {REQUEST_TIMEOUT_S:.0f} s") from None
        for result in results:
            warmed(result)

    def _wait_for_directory(self, namespace: str, num_shards: int) -> None:
        """Until every replica is registered with every Directory shard (the shards start
        with the first replica, and what replicas store before then is seen late) and the
        cluster's NodeWatcher has read the node table: the previous arm's went with its
        shards, and a new one is a worker process started, seconds of a core that would
        otherwise fall in this arm's measured trace."""
        from distkv.names import NODE_WATCHER_NAME, RAY_NAMESPACE
        from ray_actors.directory import get_or_create_shards

        shards = get_or_create_shards(namespace, num_shards)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S

        # A call to an actor as it dies may never be answered (the last arm's watcher goes with
        # its shards; ray-project/ray#44083, #47204): each wait is bounded and asked again.
        def registered() -> int:
            try:
                stats = ray.get([shard.stats.remote() for shard in shards], timeout=CALL_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                return 0
            return min(s["replicas"] for s in stats)

        def watching() -> bool:
            try:
                watcher = ray.get_actor(NODE_WATCHER_NAME, namespace=RAY_NAMESPACE)
                return ray.get(watcher.reads.remote(), timeout=CALL_TIMEOUT_S) > 0
            except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return False  # not made yet, or the last arm's, going

        while registered() < self.args.replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not registered with the Directory in {REQUEST_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        while not watching():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Directory's node watcher did not start in {REQUEST_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _forget_namespaces(self) -> None:
        """Kill the Directory shards of the arms whose engines are shut down."""
        from ray_actors.directory import kill_shards

        for namespace in self._namespaces:
            kill_shards(namespace)
        self._namespaces.clear()

    def close(self) -> None:
        """Applications deleted (their pools removed), distkv's actors killed, the embedded
        cluster stopped. A second Ctrl-C does not cut it short."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if ray.is_initialized():
                self._stop()
                ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
            reclaim_stale_segments()  # pools of replicas that could not shut down
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop(self) -> None:
        from ray import serve

        from distkv.names import RAY_NAMESPACE, agent_name

        if self._deployed:
            try:
                serve.delete(APP)  # its replicas shut down: their pools removed, unregistered
            except Exception as e:  # what is left is the cluster's to reclaim
                print(f"distkv demo: the Serve application did not shut down cleanly: {e}", file=sys.stderr)
        self._forget_namespaces()
        # Ray's prefix-affinity router keeps its prefix tree in a detached actor, which the
        # router calls as the application's replicas go: killed only once they are gone
        try:
            ray.kill(ray.get_actor("LlmPrefixTreeActor", namespace=f"serve::{APP}::{DEPLOYMENT}"), no_restart=True)
        except ValueError:  # no affinity arm ran
            pass
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
        self.done = 0

    def update(self) -> None:
        """One more request answered."""
        self.done += 1
        done = self.done
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
