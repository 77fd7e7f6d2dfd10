"""Worker-side transfer handlers: GPU KV caches <-> this worker's slots of a host pool."""

from __future__ import annotations

from typing import Literal

from distkv.abstract import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingHandler
from distkv.storage.handlers.base import CopyBackend, CopyTicket, LoadHandler, PoolTransferHandler, StoreHandler
from distkv.storage.handlers.cpu import CpuCopyBackend
from distkv.storage.handlers.cuda import CudaCopyBackend, PinnedRegion
from distkv.storage.handlers.layout import CopyPlan, CopyPlanner, RefPlacement, SlotLayout
from distkv.storage.pool import HostPool, PoolLoadStoreSpec

__all__ = [
    "CopyBackend",
    "CopyPlan",
    "CopyPlanner",
    "CopyTicket",
    "CpuCopyBackend",
    "CudaCopyBackend",
    "LoadHandler",
    "PinnedRegion",
    "PoolTransferHandler",
    "RefPlacement",
    "SlotLayout",
    "StoreHandler",
    "make_handlers",
]


def make_handlers(
    kv_caches: CanonicalKVCaches,
    pool: HostPool,
    rank: int,
    block_size_factor: int,
    device: Literal["auto", "cpu", "cuda"] = "auto",
) -> list[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
    """The store (GPU -> pool) and load (pool -> GPU) handlers of worker `rank`.

    "auto" copies with CUDA when the KV tensors are on a CUDA device, else with torch on
    the CPU. Shut both handlers down before closing the pool.
    """
    layout = SlotLayout.from_kv_caches(kv_caches, block_size_factor)
    layout.check_fits(pool.layout.slot_bytes)
    if not 0 <= rank < pool.layout.num_ranks:
        raise ValueError(f"rank {rank} out of range: the pool has {pool.layout.num_ranks} ranks")
    tensors = [t.tensor for t in kv_caches.tensors]
    on_cuda = tensors[0].device.type == "cuda"
    if device == "auto":
        device = "cuda" if on_cuda else "cpu"
    if device not in ("cpu", "cuda") or (device == "cuda") != on_cuda:
        raise ValueError(f"device={device!r} does not fit KV tensors on {tensors[0].device}")
    if device == "cuda":
        pinned = PinnedRegion(pool, rank)
        backends = [CudaCopyBackend(tensors, pinned), CudaCopyBackend(tensors, pinned)]
    else:
        backends = [CpuCopyBackend(tensors, pool, rank), CpuCopyBackend(tensors, pool, rank)]
    store = StoreHandler(layout, tensors, pool, rank, backends[0])
    load = LoadHandler(layout, tensors, pool, rank, backends[1])
    return [(GPULoadStoreSpec, PoolLoadStoreSpec, store), (PoolLoadStoreSpec, GPULoadStoreSpec, load)]
