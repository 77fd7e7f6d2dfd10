"""The demo's engine replicas as a Ray Serve deployment (distkv.demo.engine.ModelReplica).

Each replica runs the demo's model behind the engine of the current arm (`distkv.demo.arms`:
offloading off, its own pool only, or distkv), which its `user_config` names: the demo moves
from arm to arm by reconfiguring the deployment, so that a replica's process, and its warm
model, serve every arm, each with a fresh engine (pool, Directory registration). A replica
serves one request at a time, in arrival order, on a thread of its own; requests wait in
Serve's queue for it, which is what the routers see. It says who it is in distkv through
Serve's routing stats.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Mapping
from typing import Any

import torch
from ray import serve

from distkv.demo.engine import ModelReplica, demo_spec, pick_device
from distkv.demo.stuck import LoopWatch, stacks_printed_if_stuck
from distkv.demo.model import ModelConfig
from distkv.demo.request import DemoRequest
from distkv.replica.specs import ClusterOffloadingSpec, LocalOffloadingSpec

# A step of the engine (a request, or a switch of arms) running this long, or the replica's
# event loop running nothing as long, is stuck: its replica prints its stacks, well before
# the demo's client gives up on it.
STUCK_S = 60.0
ENGINE_SPECS = {"distkv": ClusterOffloadingSpec, "own_pool": LocalOffloadingSpec, "off": LocalOffloadingSpec}


@serve.deployment
class DemoEngine:
    def __init__(self, name: str, model: ModelConfig, block_tokens: int, max_prompt_tokens: int, threads: int):
        torch.set_num_threads(threads)  # replicas sharing a node's cores should not oversubscribe them
        self.unique_id = serve.get_replica_context().replica_id.unique_id
        self.name, self.model, self.block_tokens, self.max_prompt_tokens = name, model, block_tokens, max_prompt_tokens
        self.engine: ModelReplica | None = None
        self.offloading = False
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="distkv-demo-engine")
        self._loop_watch: LoopWatch | None = None  # of the loop Serve runs its requests on

    async def reconfigure(self, config: Mapping[str, Any]) -> None:
        """Serve the arm `config` names from now on: {"arm", "engine", "extra_config"}."""
        if self._loop_watch is None:
            self._loop_watch = LoopWatch(asyncio.get_running_loop(), STUCK_S)
        await asyncio.get_running_loop().run_in_executor(self._thread, self._switch, config)

    def _switch(self, config: Mapping[str, Any]) -> None:
        with stacks_printed_if_stuck(STUCK_S):
            self._switch_engine(config)

    def _switch_engine(self, config: Mapping[str, Any]) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        engine_id = f"{self.name}_{config['arm'].replace('-', '_')}_{self.unique_id}"
        spec = demo_spec(engine_id, config["extra_config"], self.model, self.block_tokens, ENGINE_SPECS[config["engine"]])
        self.engine = ModelReplica(spec, self.model, self.max_prompt_tokens, device=pick_device())
        self.offloading = config["engine"] != "off"
        # one prefill of the longest prompt, without offloading, so that no measured request
        # pays for warming up: the first prefill of a size costs the model's allocations
        self.engine.serve_without_offloading([0] * self.max_prompt_tokens)

    async def __call__(self, request: DemoRequest) -> dict[str, Any]:
        arrived = time.perf_counter()
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._serve, request, arrived)

    def _serve(self, request: DemoRequest, arrived: float) -> dict[str, Any]:
        started = time.perf_counter()
        tokens = request.prompt_token_ids
        with stacks_printed_if_stuck(STUCK_S):
            if self.offloading:
                result = self.engine.serve(tokens, request.kv_transfer_params)
            else:
                result = self.engine.serve_without_offloading(tokens)
        result.update(queue_s=started - arrived, stats=self.engine.stats())
        return result

    def record_routing_stats(self) -> dict[str, Any]:
        engine = self.engine
        return engine.routing_stats() if engine is not None else {}

    def __del__(self) -> None:
        if getattr(self, "_loop_watch", None) is not None:
            self._loop_watch.close()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.shutdown(wait=True)
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
