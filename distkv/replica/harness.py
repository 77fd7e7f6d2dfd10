"""A stand-in engine replica without vLLM, for tests, the demo and benchmarks.

It holds a KV tensor (a CPU tensor standing for GPU memory), hashes prompts into block
keys as vLLM does (chained hashes of full blocks, each key's end token recorded in the
request's ReqContext), and drives an OffloadingSpec's manager and handlers in the order
vLLM's OffloadingConnector does: lookup until the first miss (deferring the request
while any lookup says retry), prepare_load / load / complete_load, compute the rest,
prepare_store / store / complete_store, touch.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distkv.abstract import (
    CanonicalKVCaches,
    CanonicalKVCacheRef,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    TransferResult,
    make_offload_key,
)


@dataclass
class Prefill:
    """A prompt to compute once its offloaded prefix is loaded."""

    tokens: np.ndarray  # the whole prompt
    keys: list[OffloadKey]  # its full blocks
    gpu_blocks: np.ndarray  # block_size_factor GPU blocks per key, in key order
    hit_blocks: int  # leading keys whose KV is loaded in their GPU blocks already


# compute(prefill, kv_tensors): write the KV of the blocks past the hits into their GPU
# blocks; returns the request's output (the model's first token, say)
ComputeFn = Callable[[Prefill, Sequence[torch.Tensor]], Any]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def block_keys(tokens: Sequence[int] | np.ndarray, block_tokens: int, group_idx: int = 0) -> list[OffloadKey]:
    """Keys of the full blocks of a prompt: each hash covers the whole prefix up to its block."""
    arr = np.asarray(tokens, dtype=np.int64)
    keys = []
    parent = b""
    for start in range(0, len(arr) - block_tokens + 1, block_tokens):
        parent = hashlib.sha256(parent + arr[start : start + block_tokens].tobytes()).digest()
        keys.append(make_offload_key(parent, group_idx))
    return keys


def synthetic_page(key: OffloadKey, sub_block: int, tensor_idx: int, page_bytes: int) -> np.ndarray:
    """Deterministic bytes for one GPU page of a block: what 'computing' it yields here."""
    seed = np.uint64(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
    salt = np.uint64((sub_block << 8) | tensor_idx)
    words = np.arange(page_bytes // 8, dtype=np.uint64) * _GOLDEN + seed + salt
    return words.view(np.int8)


@dataclass
class RequestResult:
    blocks: int  # full offloaded blocks in the prompt
    hit_blocks: int  # loaded through the offloading manager
    stored_blocks: int
    retries: int  # steps the request was deferred because a lookup said retry
    load_failures: int  # load jobs that reported failure (their blocks were recomputed)
    mismatches: int  # loaded blocks whose bytes differ from what computing them gives
    first_token_s: float = 0.0  # from the request's arrival to the end of compute
    load_s: float = 0.0  # the load job's transfer time, as its handler reported it
    wait_s: float = 0.0  # deferred: from its first lookup to the scan that admitted it
    compute_s: float = 0.0  # the prefill of what was not loaded
    output: Any = None  # what compute returned


class Replica:
    """One engine replica: a KV tensor pair (K, V), a manager, and a worker's handlers."""

    def __init__(
        self,
        spec: OffloadingSpec,
        num_gpu_blocks: int,
        page_bytes: int,
        compute: ComputeFn | None = None,
        step_s: float = 0.002,
        device: str | torch.device = "cpu",
    ):
        self.spec = spec
        self.manager = spec.get_manager()
        self.factor = spec.block_size_factor
        self.block_tokens = spec.gpu_block_size[0] * self.factor
        self.page_bytes = page_bytes
        self.kv = [torch.zeros(num_gpu_blocks, page_bytes, dtype=torch.int8, device=device) for _ in range(2)]
        kv_caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, page_bytes) for t in self.kv],
            group_data_refs=[[CanonicalKVCacheRef(0, page_bytes), CanonicalKVCacheRef(1, page_bytes)]],
        )
        self.worker = OffloadingWorker()
        for src, dst, handler in spec.get_handlers(kv_caches):
            self.worker.register_handler(src, dst, handler)
        self.compute = compute or self._synthetic_compute
        self.step_s = step_s
        self._end_step = getattr(self.manager, "end_step", None)  # the cluster manager's; the local one has none
        if self._end_step is not None:
            self.manager.expect_step_ends()
        # the cluster manager's, called as vLLM's on_new_request (reads a router's answer) and
        # on_request_finished
        self._request_started = getattr(self.manager, "request_started", None)
        self._request_finished = getattr(self.manager, "request_finished", None)
        self._free_gpu = list(range(num_gpu_blocks))
        self._jobs = itertools.count()
        self._requests = itertools.count()

    def serve(
        self, tokens: Sequence[int] | np.ndarray, max_retries: int = 1000, kv_transfer_params: dict | None = None
    ) -> RequestResult:
        """Serve one prompt (with the `kv_transfer_params` its router sent); returns what
        came from the offloaded cache."""
        arrived = time.perf_counter()
        tokens = np.asarray(tokens)
        keys = block_keys(tokens, self.block_tokens)
        ctx = ReqContext(req_id=f"req-{next(self._requests)}", kv_transfer_params=kv_transfer_params)
        for i, key in enumerate(keys):  # as vLLM's scheduler records its chunks' keys
            ctx.set_offload_key_position(key, (i + 1) * self.block_tokens)
        if self._request_started is not None:
            self._request_started(ctx)
        retries = 0
        while (hits := self._matched_blocks(keys, ctx)) is None:
            if self._end_step is not None:  # the step ends as vLLM's does: on_schedule_end
                self._end_step()
            retries += 1
            if retries > max_retries:
                hits = 0
                break
            time.sleep(self.step_s)  # the scheduler defers the request by one step
        admitted = time.perf_counter()

        n_gpu = len(keys) * self.factor
        if n_gpu > len(self._free_gpu):
            raise ValueError(f"prompt needs {n_gpu} GPU blocks, {len(self._free_gpu)} are free")
        gpu = np.array(self._free_gpu[-n_gpu:] if n_gpu else [], dtype=np.int64)
        del self._free_gpu[len(self._free_gpu) - n_gpu :]
        try:
            load_failures = mismatches = 0
            load_s = 0.0
            if hits:
                loaded, load_s = self._load(keys[:hits], gpu[: hits * self.factor], ctx)
                if loaded:
                    mismatches = self._count_mismatches(keys[:hits], gpu)
                else:
                    load_failures, hits = 1, 0
            computing = time.perf_counter()
            output = self.compute(Prefill(tokens, keys, gpu, hits), self.kv)
            done = time.perf_counter()
            first_token_s = done - arrived
            stored = self._store(keys, hits, gpu, ctx)
            self.manager.touch(keys, ctx)
        finally:
            self._free_gpu.extend(gpu.tolist())
            if self._request_finished is not None:
                self._request_finished(ctx)
        return RequestResult(
            len(keys), hits, stored, retries, load_failures, mismatches, first_token_s, load_s,
            admitted - arrived if retries else 0.0, done - computing, output,
        )

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()
        close = getattr(self.spec, "close", None)
        if close is not None:
            close()

    # ---- the connector's steps ---------------------------------------------------------

    def _matched_blocks(self, keys: list[OffloadKey], ctx: ReqContext) -> int | None:
        # As vLLM's connector: a retry does not end the scan, so that the manager starts
        # every promotion the prefix needs at once; the first miss does.
        deferred = False
        for i, key in enumerate(keys):
            hit = self.manager.lookup(key, ctx)
            if hit is None:
                deferred = True
            elif not hit:
                return None if deferred else i
        return None if deferred else len(keys)

    def _run(self, src, dst) -> TransferResult | None:
        job = next(self._jobs)
        if not self.worker.transfer_async(job, (src, dst)):
            return None
        self.worker.wait({job})
        results = {r.job_id: r for r in self.worker.get_finished()}
        return results[job]

    def _load(self, keys: list[OffloadKey], gpu: np.ndarray, ctx: ReqContext) -> tuple[bool, float]:
        """(success, transfer time) of loading the blocks of keys into gpu."""
        pool_spec = self.manager.prepare_load(keys, ctx)
        try:
            result = self._run(pool_spec, GPULoadStoreSpec(gpu, [len(gpu)], [0]))
        finally:
            self.manager.complete_load(keys, ctx)
        return (result.success, result.transfer_time) if result is not None else (False, 0.0)

    def _store(self, keys: list[OffloadKey], hits: int, gpu: np.ndarray, ctx: ReqContext) -> int:
        out = self.manager.prepare_store(keys[hits:], ctx)
        if out is None or not out.keys_to_store:
            return 0
        index = {key: i for i, key in enumerate(keys)}
        f = self.factor
        ids = np.concatenate([gpu[index[k] * f : (index[k] + 1) * f] for k in out.keys_to_store])
        result = self._run(GPULoadStoreSpec(ids, [len(ids)], [0]), out.store_spec)
        ok = result is not None and result.success
        self.manager.complete_store(out.keys_to_store, ctx, success=ok)
        return len(out.keys_to_store) if ok else 0

    # ---- synthetic KV ----------------------------------------------------------------

    def _synthetic_compute(self, prefill: Prefill, kv: Sequence[torch.Tensor]) -> None:
        first = prefill.hit_blocks
        for i, key in enumerate(prefill.keys[first:], start=first):
            for sub in range(self.factor):
                block = int(prefill.gpu_blocks[i * self.factor + sub])
                for t, tensor in enumerate(kv):
                    tensor[block].copy_(torch.from_numpy(synthetic_page(key, sub, t, self.page_bytes)))

    def _count_mismatches(self, keys: Sequence[OffloadKey], gpu: np.ndarray) -> int:
        """Loaded blocks that differ from what computing them gives (must stay 0)."""
        if self.compute != self._synthetic_compute:
            return 0
        bad = 0
        for i, key in enumerate(keys):
            for sub in range(self.factor):
                block = int(gpu[i * self.factor + sub])
                if any(
                    not np.array_equal(tensor[block].numpy(), synthetic_page(key, sub, t, self.page_bytes))
                    for t, tensor in enumerate(self.kv)
                ):
                    bad += 1
                    break
        return bad
