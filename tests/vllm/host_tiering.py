"""vLLM 0.33's TieringOffloadingSpec with a host-copy stand-in for its CUDA worker (tests only).

vLLM's CPUOffloadingWorker moves pages between the GPU KV cache and the primary tier's
shared region with CUDA streams and events; this machine has no GPU. `HostCopyWorker`
moves the same bytes to the same places (the direct layout: each worker's pages in its
slot of a chunk row, `SharedOffloadRegion.create_next_worker_view`, a GPU page per
sub-block of a chunk, the first chunk of a group entered at `block_indices`) with plain
copies, synchronously. Everything else is vLLM's own: the primary tier, the tiering
manager, the secondary tiers (distkv's among them), the scheduler.

Loaded as kv_connector_extra_config {"spec_name": "HostTieringOffloadingSpec",
"spec_module_path": "host_tiering"}, with tests/vllm on the path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """GPU pages <-> this rank's slots of the primary tier's chunks, copied on the caller's thread."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self._region = region
        self._blocks_per_chunk = blocks_per_chunk
        self._gpu: list[np.ndarray] = []
        self._cpu: list[np.ndarray] = []
        for t in kv_caches.tensors:
            self._gpu.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes).numpy().view(np.uint8))
            cpu = region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk)
            self._cpu.append(cpu.numpy().view(np.uint8))
        self._refs = kv_caches.group_data_refs
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        self._finished.append(TransferResult(job_id, True, self._copy(src_spec, dst_spec.block_ids, True), 0.0))
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        self._finished.append(TransferResult(job_id, True, self._copy(dst_spec, src_spec.block_ids, False), 0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submitted

    def shutdown(self) -> None:
        self._gpu.clear()
        self._cpu.clear()
        self._region.cleanup()

    def _copy(self, gpu_spec: GPULoadStoreSpec, chunk_ids: Sequence[int], to_chunks: bool) -> int:
        """Copy every group's GPU blocks to (or from) their sub-blocks of the chunks: the bytes moved."""
        bpc, nbytes = self._blocks_per_chunk, 0
        blocks, chunks = np.asarray(gpu_spec.block_ids), np.asarray(chunk_ids)
        block_at = chunk_at = 0
        for group, (size, first) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            if not size:
                continue
            skip = first % bpc
            group_blocks = blocks[block_at : block_at + size]
            group_chunks = chunks[chunk_at : chunk_at + cdiv(size + skip, bpc)]
            block_at += size
            chunk_at += len(group_chunks)
            for ref in self._refs[group]:
                gpu, cpu = self._gpu[ref.tensor_idx], self._cpu[ref.tensor_idx]
                page = cpu.shape[1] // bpc
                for i, block in enumerate(group_blocks.tolist()):
                    chunk, sub = divmod(skip + i, bpc)
                    cpu_page = cpu[group_chunks[chunk], sub * page : sub * page + ref.page_size_bytes]
                    gpu_page = gpu[block, : ref.page_size_bytes]
                    if to_chunks:
                        cpu_page[:] = gpu_page
                    else:
                        gpu_page[:] = cpu_page
                    nbytes += ref.page_size_bytes
        assert block_at == len(blocks) and chunk_at == len(chunks), "the spec's blocks and chunks do not match"
        return nbytes


class HostTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec whose worker is the HostCopyWorker stand-in."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker
