"""Copy backend for CPU tensors standing in for the GPU KV cache (tests, demos, CPU runs).

A segment's copies run when a handler's segment thread waits on its ticket, so a store
seals each segment right after copying it, while its bytes are still in cache, and the
segments of a job copy on several cores at once. Copies go through numpy views of the
tensors: a plain memcpy that releases the GIL. (torch's copy_ hands every slice to its
OpenMP pool, which stalls while another process holds a core: 2 MiB slices then copied
at under 1 GB/s on a 2-core machine.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from distkv.handlers.base import CopyBackend, CopyTicket
from distkv.handlers.layout import CopyPlan
from distkv.pool import HostPool


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of every byte a (rows, row_bytes) tensor spans, from its first."""
    rows, row_bytes = tensor.shape
    span = (rows - 1) * tensor.stride(0) + row_bytes if rows else 0
    return tensor.view(torch.uint8).as_strided((span,), (1,))


class _Copies:
    """One segment's runs, copied when waited on."""

    def __init__(self, kv: list[np.ndarray], pool: np.ndarray, runs: list[tuple[int, int, int, int]], to_pool: bool):
        self._kv = kv
        self._pool = pool
        self._runs = runs
        self._to_pool = to_pool

    def wait(self) -> None:
        for tensor_idx, tensor_offset, pool_offset, nbytes in self._runs:
            kv = self._kv[tensor_idx][tensor_offset : tensor_offset + nbytes]
            pool = self._pool[pool_offset : pool_offset + nbytes]
            if self._to_pool:
                pool[:] = kv
            else:
                kv[:] = pool
        self._runs = []


class CpuCopyBackend(CopyBackend):
    """Copies between CPU KV tensors and the pool region of `rank`."""

    # A store seals each segment right after copying it, so its segments stay about a
    # core's L2 and the checksum re-reads cached bytes; a load only copies, so larger
    # segments spend less per segment.
    STORE_SEGMENT_BYTES = 2 << 20
    LOAD_SEGMENT_BYTES = 32 << 20
    segment_threads = min(os.cpu_count() or 1, 4)  # memory bandwidth is spent by then

    def __init__(self, kv_tensors: Sequence[torch.Tensor], pool: HostPool, rank: int, segment_bytes: int):
        if any(t.device.type != "cpu" for t in kv_tensors):
            raise ValueError("CpuCopyBackend needs KV tensors on the CPU")
        self.segment_bytes = segment_bytes
        self._kv = [flat_bytes(t).numpy() for t in kv_tensors]
        self._pool = pool.payload[rank].reshape(-1)

    def submit(self, plan: CopyPlan, to_pool: bool) -> list[CopyTicket]:
        runs = list(
            zip(plan.tensor_idx.tolist(), plan.tensor_offset.tolist(), plan.pool_offset.tolist(), plan.nbytes.tolist())
        )
        bounds = plan.run_bounds.tolist()
        return [_Copies(self._kv, self._pool, runs[lo:hi], to_pool) for lo, hi in zip(bounds, bounds[1:])]

    def close(self) -> None:
        self._kv.clear()
        del self._pool
