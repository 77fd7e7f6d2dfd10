"""ReplicaActor: a stand-in engine replica (distkv.replica.harness.Replica) as a Ray actor.

Tests, the demo and benchmarks place replicas on chosen nodes with it; all the logic is
in the harness and the spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import ray

from distkv.abstract import ReqContext
from distkv.replica.harness import Replica
from distkv.replica.specs import ClusterOffloadingSpec
from distkv.observability.stats import ReplicaStats


@ray.remote(num_cpus=0)
class ReplicaActor:
    def __init__(
        self,
        replica_id: str,
        extra_config: Mapping[str, Any],
        block_tokens: int,
        page_bytes: int,
        num_gpu_blocks: int,
        block_size_factor: int = 1,
    ):
        config = dict(extra_config)
        if block_size_factor > 1:
            config["block_size"] = block_tokens * block_size_factor
        spec = ClusterOffloadingSpec.from_layout(
            config,
            gpu_block_sizes=[block_tokens],
            group_page_bytes=[2 * page_bytes],
            engine_id=replica_id,
        )
        self.replica = Replica(spec, num_gpu_blocks=num_gpu_blocks, page_bytes=page_bytes)

    def serve(self, tokens: Sequence[int] | np.ndarray) -> dict[str, int]:
        return asdict(self.replica.serve(tokens))

    def serve_many(self, prompts: Sequence[Sequence[int] | np.ndarray]) -> list[dict[str, int]]:
        return [asdict(self.replica.serve(tokens)) for tokens in prompts]

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def held_keys(self) -> list[bytes]:
        return self.replica.manager.local.ready_keys()

    def lookup(self, keys: Sequence[bytes]) -> list[bool | None]:
        """The manager's answers for these keys, as the scheduler would get them now."""
        ctx = ReqContext(req_id="probe")
        return [self.replica.manager.lookup(key, ctx) for key in keys]

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The other replicas that this replica's view of the Directory says hold each key."""
        link = self.replica.manager.link
        return [[h.replica_id for h in link.holders(key)] for key in keys]

    def promoted_bytes(self) -> dict[str, int]:
        """Bytes promoted so far from replicas on this node and from other nodes."""
        promoter = self.replica.manager.promoter
        return {"same_node": promoter.bytes_same_node, "cross_node": promoter.bytes_cross_node}

    def transported(self) -> dict[str, list[float]]:
        """Cross-node promotions by transport: [blocks, bytes, seconds] (see Promoter.transported)."""
        return dict(self.replica.manager.promoter.transported)

    def stats(self) -> ReplicaStats:
        """The manager's counts (see ClusterOffloadingManager.stats)."""
        return self.replica.manager.stats()

    def shutdown(self) -> None:
        self.replica.shutdown()
