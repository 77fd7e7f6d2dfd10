"""The demo's engine replica: the model's prefill behind distkv's connector steps.

The harness Replica drives the offloading manager and handlers in vLLM's order; its
compute step is the model's prefill over the replica's paged KV cache. Every request
reports what it needs to be checked and attributed: the digest of each block it loaded
and of each block it computed, and where its loaded blocks came from.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from distkv.abstract import OffloadingSpec
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.replica.dedupe import SkipHeldElsewhere
from distkv.demo.model import ModelConfig, PagedKV, TinyDecoder, prefill
from distkv.replica.harness import Prefill, Replica, block_keys
from distkv.replica.specs import ClusterOffloadingSpec
from distkv.routing.keys import SeedKeys
from distkv.routing.router import routing_stats
from distkv.transfer.transport import NixlTransport, ObjectStoreTransport

SOURCES = ("local", "same_node", "cross_node")
# the transports that move blocks between nodes (the `transport` setting also has "auto")
BLOCK_TRANSPORTS = (NixlTransport.name, ObjectStoreTransport.name)


def pick_device() -> str:
    """The GPU where there is one that distkv's CUDA handlers can drive (CuPy), else the CPU."""
    if torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None:
        return "cuda"
    return "cpu"


def demo_spec(
    replica_id: str,
    extra_config: Mapping[str, Any],
    model: ModelConfig,
    block_tokens: int,
    spec_class: type[OffloadingSpec] = ClusterOffloadingSpec,
) -> OffloadingSpec:
    """The offloading spec of a demo replica: its KV layout is the model's paged cache.
    `spec_class` LocalOffloadingSpec: a pool of its own that it shares with nobody."""
    return spec_class.from_layout(
        extra_config,
        gpu_block_sizes=[block_tokens],
        group_page_bytes=[2 * model.page_bytes(block_tokens)],
        engine_id=replica_id,
        model_config=SimpleNamespace(model=f"distkv-demo:{model}", dtype="float32"),
    )


class ModelReplica:
    """One engine replica running the model, its KV cache offloaded through `spec`.

    `spec` must have a block_size_factor of 1. With a ClusterOffloadingManager, loaded
    blocks are attributed to where they came from; with a local one, all are its own.
    """

    def __init__(
        self,
        spec: OffloadingSpec,
        model: ModelConfig,
        max_prompt_tokens: int,
        device: str | torch.device = "cpu",
        step_s: float = 0.002,
    ):
        if spec.block_size_factor != 1:
            raise ValueError(f"the demo engine pages KV per offloaded block: block_size_factor={spec.block_size_factor}")
        self.block_tokens = spec.gpu_block_size[0]
        self.model = TinyDecoder(model, device)
        num_blocks = max(max_prompt_tokens // self.block_tokens, 1)
        self.replica = Replica(
            spec, num_blocks, model.page_bytes(self.block_tokens), compute=self._compute, step_s=step_s, device=device
        )
        self.manager = self.replica.manager
        self._shared = isinstance(self.manager, (ClusterOffloadingManager, SkipHeldElsewhere))
        self.cache = PagedKV(self.replica.kv[0], self.replica.kv[1], model, self.block_tokens)
        self._prefill: Prefill | None = None

    def serve(self, tokens: Sequence[int] | np.ndarray, kv_transfer_params: dict | None = None) -> dict[str, Any]:
        """Serve one prompt through distkv (with what its router sent in `kv_transfer_params`):
        what came from where, its TTFT and where it went, and block digests."""
        loaded_before = dict(self.manager.blocks_loaded) if self._shared else None
        promoted_before = self._promoted_bytes()
        result = self.replica.serve(tokens, kv_transfer_params=kv_transfer_params)
        p = self._prefill
        hits = result.hit_blocks
        if result.load_failures:  # the manager counted a load whose blocks were then computed
            by_source = dict.fromkeys(SOURCES, 0)
        elif loaded_before is None:
            by_source = {**dict.fromkeys(SOURCES, 0), "local": hits}
        else:
            by_source = {s: self.manager.blocks_loaded[s] - loaded_before[s] for s in SOURCES}
        # The blocks are free again but untouched until the next request: digest them now,
        # outside the request's time to first token.
        digests = self.cache.digests(p.gpu_blocks) if len(p.keys) else []
        return {
            "replica": self.replica.spec.replica_id,
            "tokens": len(p.tokens),
            "blocks_by_source": by_source,
            "retries": result.retries,
            "load_failures": result.load_failures,
            "ttft_s": result.first_token_s,
            "load_s": result.load_s,
            "wait_s": result.wait_s,
            "compute_s": result.compute_s,
            "promoted_bytes": self._promoted_bytes() - promoted_before,
            "first_token": result.output,
            "loaded": list(zip(p.keys[:hits], digests[:hits])),
            "computed": list(zip(p.keys[hits:], digests[hits:])),
        }

    def serve_without_offloading(self, tokens: Sequence[int] | np.ndarray) -> dict[str, Any]:
        """Serve one prompt with offloading off: every token prefilled, nothing loaded or stored."""
        arrived = time.perf_counter()
        tokens = np.asarray(tokens)
        keys = block_keys(tokens, self.block_tokens)  # an engine hashes its prompts either way
        token = prefill(self.model, self.cache, tokens, np.arange(len(keys)), 0)
        ttft_s = time.perf_counter() - arrived
        return {
            "replica": self.replica.spec.replica_id,
            "tokens": len(tokens),
            "blocks_by_source": dict.fromkeys(SOURCES, 0),
            "retries": 0,
            "load_failures": 0,
            "ttft_s": ttft_s,
            "load_s": 0.0,
            "wait_s": 0.0,
            "compute_s": ttft_s,
            "promoted_bytes": 0,
            "first_token": token,
            "loaded": [],
            "computed": [],
        }

    def stats(self) -> dict[str, Any]:
        """Bytes and seconds of this replica's promotions so far, per path, and of its
        cross-node ones per transport (`<transport>_bytes`, `<transport>_s`); blocks its
        pull gate let pull and skipped, requests routed here by kind, what its gate measured."""
        if not self._shared:
            return {}
        promoter, gate = self.manager.promoter, self.manager.pulls.gate
        stats = {
            "same_node_bytes": promoter.bytes_same_node,
            "same_node_s": promoter.seconds_same_node,
            "cross_node_bytes": promoter.bytes_cross_node,
            "cross_node_s": promoter.seconds_cross_node,
        }
        for transport in BLOCK_TRANSPORTS:
            _, nbytes, seconds = promoter.transported.get(transport, (0, 0, 0.0))
            stats[f"{transport}_bytes"], stats[f"{transport}_s"] = nbytes, seconds
        stats.update(
            pull_allowed=dict(gate.allowed), pull_skipped=dict(gate.skipped), routed=dict(self.manager.pulls.routed),
            gate=gate.estimates(),
        )
        return stats

    def routing_stats(self) -> dict[str, Any]:
        """Who this replica is in distkv, for a router (`distkv.routing.router.routing_stats`)."""
        if not self._shared:
            return {}
        return routing_stats(self.manager, SeedKeys(self.block_tokens))

    def _promoted_bytes(self) -> int:
        if not self._shared:
            return 0
        return self.manager.promoter.bytes_same_node + self.manager.promoter.bytes_cross_node

    def shutdown(self) -> None:
        self.replica.shutdown()

    def _compute(self, p: Prefill, kv: Sequence[torch.Tensor]) -> int:
        self._prefill = p
        started = time.perf_counter()
        token = prefill(self.model, self.cache, p.tokens, p.gpu_blocks, p.hit_blocks)
        if self._shared:  # what recomputing costs this replica: the pull gate's side of the scale
            computed = (len(p.tokens) - p.hit_blocks * self.block_tokens) / self.block_tokens
            self.manager.pulls.gate.observe_prefill(computed, time.perf_counter() - started)
        return token
