"""A vLLM 0.33 replica on the CPU for tests: the real Scheduler with the OffloadingConnector.

The worker side is vLLM's own worker-side OffloadingConnector over a CPU tensor standing
for the GPU KV cache, driven step by step as the model runner drives it. The "model" writes
KV bytes that are a function of the token prefix, so that any block loaded from the cache
can be checked against what computing it would have written.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

GPU_BLOCK_TOKENS = 16
NUM_GPU_BLOCKS = 1024
MAX_MODEL_LEN = 8192
# FullAttentionSpec(16 tokens, 1 KV head of 16 float16): K and V, 1024 bytes per block
KV_SPEC = FullAttentionSpec(block_size=GPU_BLOCK_TOKENS, num_kv_heads=1, head_size=16, dtype=torch.float16)
TOKEN_BYTES = KV_SPEC.page_size_bytes // GPU_BLOCK_TOKENS
DISTKV_EXTRA = {"spec_name": "RayOffloadingSpec", "spec_module_path": "distkv.vllm"}
# vLLM's own tiered offloading, its CUDA worker stood in for (host_tiering.py), distkv a
# secondary tier: tier_extra(...) adds the secondary_tiers
TIERING_EXTRA = {"spec_name": "HostTieringOffloadingSpec", "spec_module_path": "host_tiering"}
DISTKV_TIER = {"type": "DistkvTier", "module_path": "distkv.vllm_tier"}

init_none_hash(sha256)


def vllm_config(
    model_dir: str,
    extra_config: dict[str, Any],
    kv_events: bool = False,
    model: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
) -> VllmConfig:
    """The engine's configuration; `model` and `cache`: ModelConfig and CacheConfig settings
    other than the defaults here."""
    config = VllmConfig(
        model_config=ModelConfig(
            **{
                "model": model_dir,
                "dtype": "float16",
                "seed": 0,
                "skip_tokenizer_init": True,
                "max_model_len": MAX_MODEL_LEN,
                **(model or {}),
            }
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=GPU_BLOCK_TOKENS, enable_prefix_caching=True, **(cache or {})),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra_config
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )
    # vLLM resolves the layout before it builds connectors; so do we.
    config.cache_config.kv_cache_layout = "LBNHC"
    config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    return config


def kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], KV_SPEC)],
    )


def token_kv(tokens: list[int]) -> np.ndarray:
    """(len(tokens), TOKEN_BYTES): the KV bytes of each position, a function of its prefix."""
    out = np.empty((len(tokens), TOKEN_BYTES), dtype=np.uint8)
    state = b""
    for i, token in enumerate(tokens):
        state = hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=TOKEN_BYTES).digest()
        out[i] = np.frombuffer(state, dtype=np.uint8)
    return out


class EngineReplica:
    """One engine replica: schedule, run the worker connector, "compute", feed the output back."""

    def __init__(
        self,
        model_dir: str,
        extra_config: dict[str, Any],
        kv_events: bool = False,
        model: dict[str, Any] | None = None,
        cache: dict[str, Any] | None = None,
        configure: Callable[[VllmConfig], None] | None = None,
    ):
        """`model`, `cache`: as `vllm_config`'s; `configure` then changes the built config."""
        config = vllm_config(model_dir, extra_config, kv_events, model, cache)
        if configure is not None:
            configure(config)
        kv_config = kv_cache_config()
        # in vLLM's engine core's order: the workers' KV caches, then the scheduler
        self.worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
        self.kv = torch.zeros(NUM_GPU_BLOCKS, KV_SPEC.page_size_bytes, dtype=torch.int8)
        self.worker.register_kv_caches({"layer": self.kv})
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=GPU_BLOCK_TOKENS,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        self._forward_context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._hasher = get_request_block_hasher(GPU_BLOCK_TOKENS, sha256)
        self._expected: dict[str, np.ndarray] = {}
        # per request: what the connector answered each time it was asked (None: retry)
        self.matched: dict[str, list[int | None]] = defaultdict(list)
        # per request: tokens already in the KV cache when it first computed, and whether
        # every one of them held the bytes computing it would have written
        self.preloaded: dict[str, tuple[int, bool]] = {}
        ask = self.connector.get_num_new_matched_tokens

        def recorded(request: Request, num_computed_tokens: int, *args: Any, **kwargs: Any):
            answer = ask(request, num_computed_tokens, *args, **kwargs)
            self.matched[request.request_id].append(answer[0])
            return answer

        self.connector.get_num_new_matched_tokens = recorded

    @property
    def manager(self):
        """The offloading manager in this replica's scheduler: distkv's
        (distkv.vllm.DistkvOffloadingManager), or vLLM's TieringOffloadingManager."""
        return self.connector.connector_scheduler.manager

    @property
    def tier(self):
        """distkv's tier (distkv.vllm_tier.DistkvTier) among the tiering manager's secondary tiers."""
        return next(t for t in self.manager.secondary_tiers if t.tier_type == DISTKV_TIER["type"])

    @property
    def cluster(self):
        """distkv's ClusterOffloadingManager in this replica, as a spec or as a tier."""
        manager = self.manager
        return manager.cluster if hasattr(manager, "cluster") else self.tier.cluster

    def add(self, req_id: str, tokens: list[int]) -> None:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        self._expected[req_id] = token_kv(tokens)
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self._hasher,
            )
        )

    def step(self) -> None:
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self._forward_context)
        req_ids, sampled = [], []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens
            self._compute(req_id, end - num_tokens, end)
            req_ids.append(req_id)
            sampled.append([] if end < request.num_tokens else [0])
        if output.total_num_scheduled_tokens:
            self.worker.wait_for_save()
        finished_sending, finished_recving = self.worker.get_finished(output.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        self.scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=finished_sending or None,
                    finished_recving=finished_recving or None,
                    kv_connector_worker_meta=worker_meta,
                ),
            ),
        )

    def run(self, timeout_s: float = 30.0) -> int:
        """Step until every request finished and every transfer landed; the steps taken."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while self.scheduler.has_requests():
            assert time.monotonic() < deadline, f"replica still busy after {steps} steps"
            self.step()
            steps += 1
            time.sleep(0.001)  # let distkv's threads (transfers, promotions) progress
        return steps

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    def _compute(self, req_id: str, start: int, end: int) -> None:
        """Write the KV of positions start..end, as a forward pass would."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        expected = self._expected[req_id]
        view = self.kv.view(torch.uint8).numpy().reshape(NUM_GPU_BLOCKS, GPU_BLOCK_TOKENS, TOKEN_BYTES)
        if req_id not in self.preloaded:
            exact = all(
                np.array_equal(view[block_ids[p // GPU_BLOCK_TOKENS], p % GPU_BLOCK_TOKENS], expected[p])
                for p in range(start)
            )
            self.preloaded[req_id] = (start, exact)
        for p in range(start, end):
            view[block_ids[p // GPU_BLOCK_TOKENS], p % GPU_BLOCK_TOKENS] = expected[p]
