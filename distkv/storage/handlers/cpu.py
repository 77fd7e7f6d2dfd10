"""Copy backend for CPU tensors standing in for the GPU KV cache (tests, demos, CPU runs).

A segment's copies run when a handler's segment thread waits on its ticket, so the
segments of a job copy on several cores at once. Copies go through numpy views of the
tensors: a plain memcpy that releases the GIL. (torch's copy_ hands every slice to its
OpenMP pool, which stalls while another process holds a core: docs/benchmarks.md.)

Both directions checksum each pool row as they copy it, a cache-sized chunk at a time,
so the hash reads bytes the copy just left in L2 instead of reading the row from memory
a second time: the copy is memory-bound and the hash then comes almost free. A store
seals rows with the checksums of what it wrote; a load checks what it delivered against
the checksums the rows were sealed with.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from distkv.storage.handlers.base import CopyBackend, CopyTicket
from distkv.storage.handlers.layout import CopyPlan
from distkv.storage.slots import COPY_CHUNK_BYTES
from distkv.storage.pool import HostPool


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of every byte a (rows, row_bytes) tensor spans, from its first."""
    rows, row_bytes = tensor.shape
    span = (rows - 1) * tensor.stride(0) + row_bytes if rows else 0
    return tensor.view(torch.uint8).as_strided((span,), (1,))


class _Copies:
    """One segment's runs, copied when waited on."""

    def __init__(
        self, kv: list[np.ndarray], pool: np.ndarray, slot_bytes: int, runs: list[tuple[int, int, int, int]], to_pool: bool
    ):
        self._kv = kv
        self._pool = pool
        self._slot_bytes = slot_bytes
        self._runs = runs
        self._to_pool = to_pool

    def wait(self) -> dict[int, tuple[int, int]]:
        """Copy the runs, hashing what they wrote of every row they cover from its start
        without gaps: {row: (bytes hashed, xxh3 of them)}.

        A load hashes the bytes it delivered, not the pool's, which a writer could change
        between the copy and the hash: what is checked is what the KV cache got."""
        runs, self._runs = self._runs, []
        slot, chunk, to_pool = self._slot_bytes, COPY_CHUNK_BYTES, self._to_pool
        hashed: dict[int, list] = {}  # row -> [bytes hashed so far, hasher]
        for tensor_idx, tensor_offset, pool_offset, nbytes in runs:
            kv = self._kv[tensor_idx]
            end = pool_offset + nbytes
            while pool_offset < end:
                row, within = divmod(pool_offset, slot)
                n = min(end - pool_offset, slot - within, chunk)
                pool = self._pool[pool_offset : pool_offset + n]
                if to_pool:
                    pool[:] = kv[tensor_offset : tensor_offset + n]
                    written = pool
                else:
                    written = kv[tensor_offset : tensor_offset + n]
                    written[:] = pool
                state = hashed.get(row)
                if state is None and within == 0:
                    state = hashed[row] = [0, xxhash.xxh3_64()]
                if state is not None and state[0] == within:
                    state[1].update(memoryview(written))
                    state[0] += n
                elif state is not None:
                    del hashed[row]  # a gap: this row is hashed apart
                pool_offset += n
                tensor_offset += n
        return {row: (done, hasher.intdigest()) for row, (done, hasher) in hashed.items()}


class CpuCopyBackend(CopyBackend):
    """Copies between CPU KV tensors and the pool region of `rank`."""

    # Large enough that per-segment work is small, small enough that a job's segments
    # spread over the threads.
    segment_bytes = 32 << 20
    segment_threads = min(os.cpu_count() or 1, 4)  # memory bandwidth is spent by then

    def __init__(self, kv_tensors: Sequence[torch.Tensor], pool: HostPool, rank: int):
        if any(t.device.type != "cpu" for t in kv_tensors):
            raise ValueError("CpuCopyBackend needs KV tensors on the CPU")
        self._slot_bytes = pool.layout.slot_bytes
        self._kv = [flat_bytes(t).numpy() for t in kv_tensors]
        self._pool = pool.payload[rank].reshape(-1)

    def submit(self, plan: CopyPlan, to_pool: bool) -> list[CopyTicket]:
        runs = list(
            zip(plan.tensor_idx.tolist(), plan.tensor_offset.tolist(), plan.pool_offset.tolist(), plan.nbytes.tolist())
        )
        bounds = plan.run_bounds.tolist()
        return [_Copies(self._kv, self._pool, self._slot_bytes, runs[lo:hi], to_pool) for lo, hi in zip(bounds, bounds[1:])]

    def close(self) -> None:
        self._kv.clear()
        del self._pool
