"""DemoReplicaActor: the demo's engine replica (distkv.demo.engine.ModelReplica) as a Ray actor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from distkv.demo.engine import ModelReplica, demo_spec, pick_device
from distkv.demo.model import ModelConfig
from distkv.replica.specs import LocalOffloadingSpec


@ray.remote(num_cpus=0)
class DemoReplicaActor:
    def __init__(
        self,
        replica_id: str,
        extra_config: Mapping[str, Any],
        model: ModelConfig,
        block_tokens: int,
        max_prompt_tokens: int,
        threads: int,
    ):
        torch.set_num_threads(threads)  # replicas sharing a node's cores should not oversubscribe them
        spec = demo_spec(replica_id, extra_config, model, block_tokens)
        self.engine = ModelReplica(spec, model, max_prompt_tokens, device=pick_device())
        # the same replica offloading to a pool of its own that nobody else reads: what
        # vLLM's native CPU offloading gives each replica
        own = demo_spec(f"{replica_id}_own", extra_config, model, block_tokens, spec_class=LocalOffloadingSpec)
        self.own_pool_engine = ModelReplica(own, model, max_prompt_tokens, device=pick_device())

    def describe(self) -> dict[str, str]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "device": str(self.engine.model.device)}

    def serve(self, tokens: Sequence[int] | np.ndarray) -> dict[str, Any]:
        return self.engine.serve(tokens)

    def serve_own_pool_only(self, tokens: Sequence[int] | np.ndarray) -> dict[str, Any]:
        return self.own_pool_engine.serve(tokens)

    def serve_without_offloading(self, tokens: Sequence[int] | np.ndarray) -> dict[str, Any]:
        return self.engine.serve_without_offloading(tokens)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.own_pool_engine.shutdown()
