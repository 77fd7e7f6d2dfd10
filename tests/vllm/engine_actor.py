"""An EngineReplica (replica_engine.py) in a process of its own: a Ray actor on a chosen node.

The process imports vLLM afresh, so nothing process-wide (vLLM's hash seed, module globals)
is shared with another replica.
"""

from __future__ import annotations

from typing import Any

import ray
from replica_engine import EngineReplica

from distkv.replica.plan import ReplicaPlan


@ray.remote(num_cpus=0)
class EngineActor:
    def __init__(self, model_dir: str, extra_config: dict[str, Any]):
        self.engine = EngineReplica(model_dir, extra_config)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def namespace(self) -> str:
        return self.engine.cluster.link.namespace

    def serve(self, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int | None], tuple[int, bool]]]:
        """Run the requests to the end; per request, the connector's answers and what was preloaded."""
        for req_id, tokens in prompts.items():
            self.engine.add(req_id, tokens)
        self.engine.run(timeout_s=120)
        return {r: (self.engine.matched[r], self.engine.preloaded[r]) for r in prompts}

    def stored_keys(self) -> list[bytes]:
        return self.engine.cluster.local.ready_keys()

    def sees(self, keys: list[bytes]) -> bool:
        """Whether this replica's Directory view holds every key."""
        link = self.engine.cluster.link
        return all(link.holders(key) for key in keys)

    def promoted_bytes(self) -> tuple[int, int]:
        """Bytes promoted into this replica's pool: (same node, cross node)."""
        promoter = self.engine.cluster.promoter
        return promoter.bytes_same_node, promoter.bytes_cross_node

    def transported(self) -> dict[str, list[float]]:
        """Cross-node promotions by transport: [blocks, bytes, seconds]."""
        return dict(self.engine.cluster.promoter.transported)

    def pid(self) -> int:
        import os

        return os.getpid()

    def tier_keys_failed(self) -> int:
        """Keys of load jobs distkv's tier reported failed (a tier replica only)."""
        return self.engine.tier.keys_failed

    def worker_plan(self) -> tuple[Any, ReplicaPlan]:
        """The OffloadingConfig vLLM built the worker side's spec from, and the plan it derived."""
        spec = self.engine.worker.connector_worker.spec
        return spec.config, spec.plan

    def shutdown(self) -> None:
        self.engine.shutdown()
