"""Transfer handlers between the KV caches and this worker's slots of a host pool.

A handler plans each job on the caller's thread and hands its byte runs to a
CopyBackend, then finishes jobs one after the other in submission order on threads of
its own. The segments of a job are finished by a few threads at once: each waits for a
segment's copies, then a store seals that segment's rows and a load checks them against
their checksums. A load re-checks the headers of the rows it read once every copy is
done. A job is reported only once finished.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from typing import Protocol

import torch

from distkv.observability import metrics
from distkv.abstract import GPULoadStoreSpec, OffloadingHandler, TransferResult, TransferSpec
from distkv.storage.handlers.layout import CopyPlan, CopyPlanner, SlotLayout
from distkv.storage.slots import MAX_KEY_BYTES
from distkv.storage.pool import HostPool, PoolLoadStoreSpec

logger = logging.getLogger(__name__)


class CopyTicket(Protocol):
    def wait(self) -> Mapping[int, tuple[int, int]] | None:
        """Return once the segment's copies are done (running them, for some backends);
        raise if they failed.

        A store's ticket may return what it hashed while copying: {pool row: (n, xxh3
        of the row's first n bytes)}, so that sealing need not read those bytes again.
        """


class CopyBackend(ABC):
    """Copies byte runs between the KV-cache tensors and one rank's region of a pool.

    The handler waits on the tickets of a job from up to `segment_threads` threads at
    once, and on a job's only once the previous job's are done.
    """

    # Bytes of pool rows per segment: the unit a store seals while others copy.
    segment_bytes: int
    # Threads finishing the segments of a job at once.
    segment_threads: int
    # No run may cross a multiple of this offset in the pool region (None: no limit).
    piece_bytes: int | None = None

    @abstractmethod
    def submit(self, plan: CopyPlan, to_pool: bool) -> list[CopyTicket]:
        """Queue the plan's copies without blocking; one ticket per segment."""

    @abstractmethod
    def close(self) -> None:
        """Wait for submitted copies and release the backend's resources."""


@dataclass
class _Job:
    job_id: int
    result: Future[TransferResult]


class PoolTransferHandler(OffloadingHandler, ABC):
    """One direction of transfers between GPU blocks and pool rows of `rank`."""

    gpu_to_pool: bool

    def __init__(
        self,
        layout: SlotLayout,
        kv_tensors: Sequence[torch.Tensor],
        pool: HostPool,
        rank: int,
        backend: CopyBackend,
    ):
        layout.check_fits(pool.layout.slot_bytes)
        if not 0 <= rank < pool.layout.num_ranks:
            raise ValueError(f"rank {rank} out of range: the pool has {pool.layout.num_ranks} ranks")
        self.layout = layout
        self.pool = pool
        self.rank = rank
        self._planner = CopyPlanner(layout, kv_tensors, pool.layout, backend.segment_bytes, backend.piece_bytes)
        self._backend = backend
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distkv-finish")
        self._segment_threads = ThreadPoolExecutor(backend.segment_threads, thread_name_prefix="distkv-segment")
        self._jobs: deque[_Job] = deque()
        self._last_end = 0.0  # touched by the finisher thread only
        self._closed = False
        # bytes copied, time busy copying and jobs failed so far (the finisher thread counts)
        self.bytes_moved = 0
        self.busy_s = 0.0
        self.jobs_failed = 0
        metrics.register(metrics.HandlerSource(self, metrics.this_node()))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def transfer_type(self) -> tuple[str, str]:
        return ("GPU", "CPU") if self.gpu_to_pool else ("CPU", "GPU")

    # ---- OffloadingHandler ---------------------------------------------------------

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self._closed:
            raise RuntimeError("transfer_async on a handler that was shut down")
        gpu_spec, pool_spec = self._unpack(spec)
        if any(job.job_id == job_id for job in self._jobs):
            raise ValueError(f"job {job_id} is already in flight")
        plan = self._planner.plan(
            gpu_spec.block_ids, gpu_spec.group_sizes, gpu_spec.block_indices, pool_spec.block_ids
        )
        self._check(pool_spec)
        submitted = time.perf_counter()
        ready = self._before_copy(job_id, pool_spec)
        tickets = self._backend.submit(plan, self.gpu_to_pool) if ready else []
        result = self._finisher.submit(self._finish, job_id, plan, pool_spec, ready, tickets, submitted)
        self._jobs.append(_Job(job_id, result))
        return True

    def get_finished(self) -> list[TransferResult]:
        # The finisher runs jobs in order, so the finished ones are a prefix.
        finished = []
        while self._jobs and self._jobs[0].result.done():
            finished.append(self._jobs.popleft().result.result())
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for job in list(self._jobs):
            if job.job_id in job_ids:
                job.result.result()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finisher.shutdown(wait=True)
        self._segment_threads.shutdown(wait=True)
        self._backend.close()

    # ---- direction-specific steps ------------------------------------------------------

    def _unpack(self, spec: TransferSpec) -> tuple[GPULoadStoreSpec, PoolLoadStoreSpec]:
        src, dst = spec
        gpu_spec, pool_spec = (src, dst) if self.gpu_to_pool else (dst, src)
        if not isinstance(gpu_spec, GPULoadStoreSpec) or not isinstance(pool_spec, PoolLoadStoreSpec):
            want = ("GPULoadStoreSpec", "PoolLoadStoreSpec")
            raise ValueError(
                f"{type(self).__name__} transfers {want if self.gpu_to_pool else want[::-1]}, "
                f"got ({type(src).__name__}, {type(dst).__name__})"
            )
        return gpu_spec, pool_spec

    def _check(self, pool_spec: PoolLoadStoreSpec) -> None:
        """Reject bad input before anything is touched."""

    @abstractmethod
    def _before_copy(self, job_id: int, pool_spec: PoolLoadStoreSpec) -> bool:
        """Runs on the caller's thread before any byte moves; False skips the copy."""

    def _after_segment(
        self, plan: CopyPlan, pool_spec: PoolLoadStoreSpec, segment: int, hashed: Mapping[int, tuple[int, int]] | None
    ) -> None:
        """Runs on a segment thread once the segment's copies are done; `hashed` is what
        its ticket returned."""

    def _after_copy(self, job_id: int, pool_spec: PoolLoadStoreSpec) -> bool:
        """Runs on the finisher thread once every copy is done; False fails the job."""
        return True

    # ---- finishing threads ---------------------------------------------------------

    def _finish(
        self,
        job_id: int,
        plan: CopyPlan,
        pool_spec: PoolLoadStoreSpec,
        ready: bool,
        tickets: list[CopyTicket],
        submitted: float,
    ) -> TransferResult:
        start = max(submitted, self._last_end)
        # Every segment is waited for, even after a failure: the job is over only when
        # nothing of it is in flight.
        segments = self._segment_threads.map(
            self._finish_segment, repeat(job_id), repeat(plan), repeat(pool_spec), range(len(tickets)), tickets
        )
        success = all(list(segments)) and ready
        if success:
            try:
                success = self._after_copy(job_id, pool_spec)
            except Exception:
                logger.exception("%s job %d failed", type(self).__name__, job_id)
                success = False
        self._last_end = time.perf_counter()
        result = TransferResult(
            job_id=job_id,
            success=success,
            transfer_size=plan.total_bytes if tickets else 0,
            transfer_time=self._last_end - start,
            transfer_type=self.transfer_type,
        )
        self.bytes_moved += result.transfer_size
        self.busy_s += result.transfer_time
        self.jobs_failed += not success
        return result

    def _finish_segment(
        self, job_id: int, plan: CopyPlan, pool_spec: PoolLoadStoreSpec, segment: int, ticket: CopyTicket
    ) -> bool:
        try:
            hashed = ticket.wait()
            self._after_segment(plan, pool_spec, segment, hashed)
            return True
        except Exception:
            logger.exception("%s job %d failed in segment %d", type(self).__name__, job_id, segment)
            return False


class StoreHandler(PoolTransferHandler):
    """GPU blocks -> pool rows: invalidates the rows' headers first, seals them after."""

    gpu_to_pool = True

    def _check(self, pool_spec: PoolLoadStoreSpec) -> None:
        long_keys = [len(k) for k in pool_spec.keys if len(k) > MAX_KEY_BYTES]
        if long_keys:
            raise ValueError(f"keys of {long_keys[:8]} bytes exceed the header's {MAX_KEY_BYTES}")
        if (pool_spec.generations == 0).any():
            raise ValueError("generation 0 marks an invalid slot; a store needs nonzero generations")

    def _before_copy(self, job_id: int, pool_spec: PoolLoadStoreSpec) -> bool:
        self.pool.begin_write(self.rank, pool_spec.block_ids)
        return True

    def _after_segment(
        self, plan: CopyPlan, pool_spec: PoolLoadStoreSpec, segment: int, hashed: Mapping[int, tuple[int, int]] | None
    ) -> None:
        # Seal per group: groups fill different numbers of slot bytes.
        lo, hi = plan.row_bounds[segment], plan.row_bounds[segment + 1]
        bounds = plan.group_row_bounds
        for g, group_bytes in enumerate(self.layout.group_bytes):
            first, last = max(lo, bounds[g]), min(hi, bounds[g + 1])
            if first < last:
                rows = pool_spec.block_ids[first:last]
                filled = plan.filled[first:last].tolist()
                checksums = None
                if hashed is not None:
                    # a row the copy hashed only in part (an unaligned first block) is hashed again
                    known = [hashed.get(row, (0, 0)) for row in rows.tolist()]
                    checksums = [digest if n == group_bytes else None for n, digest in known]
                self.pool.seal(
                    self.rank,
                    rows,
                    pool_spec.keys[first:last],
                    pool_spec.generations[first:last],
                    group_bytes,
                    checksums,
                    filled,
                )


class LoadHandler(PoolTransferHandler):
    """Pool rows -> GPU blocks: every row must hold its key@generation before and after
    the copy, its store must have written every sub-block the load reads, and the bytes
    copied must match its checksum (a row damaged in place keeps its header)."""

    gpu_to_pool = False

    def _stale_rows(self, pool_spec: PoolLoadStoreSpec) -> list[int]:
        return [
            row
            for row, key, gen in zip(pool_spec.block_ids.tolist(), pool_spec.keys, pool_spec.generations.tolist())
            if not self.pool.holds(self.rank, row, key, gen)
        ]

    def _before_copy(self, job_id: int, pool_spec: PoolLoadStoreSpec) -> bool:
        return self._fresh(job_id, pool_spec, "before")

    def _after_segment(
        self, plan: CopyPlan, pool_spec: PoolLoadStoreSpec, segment: int, hashed: Mapping[int, tuple[int, int]] | None
    ) -> None:
        lo, hi = plan.row_bounds[segment], plan.row_bounds[segment + 1]
        damaged, unwritten = [], []
        for row, key, gen, needed in zip(
            pool_spec.block_ids[lo:hi].tolist(),
            pool_spec.keys[lo:hi],
            pool_spec.generations[lo:hi].tolist(),
            plan.filled[lo:hi].tolist(),
        ):
            sealed = self.pool.sealed(self.rank, row, key, gen)
            if sealed is not None and needed & ~sealed.filled:
                unwritten.append(row)
                continue
            read = None if hashed is None else hashed.get(row)
            if sealed is not None and read is not None and read[0] == sealed.nbytes:
                intact = read[1] == sealed.checksum
            else:  # the copy hashed none or part of it (a DMA copy, an unaligned first block)
                intact = self.pool.verify(self.rank, row, key, gen)
            if not intact:
                damaged.append(row)
        if unwritten:
            raise ValueError(
                f"pool rows {unwritten[:8]} of rank {self.rank} lack sub-blocks the load reads: "
                "their stores did not write them"
            )
        if damaged:
            raise ValueError(f"pool rows {damaged[:8]} of rank {self.rank} do not match their checksums")

    def _after_copy(self, job_id: int, pool_spec: PoolLoadStoreSpec) -> bool:
        return self._fresh(job_id, pool_spec, "after")

    def _fresh(self, job_id: int, pool_spec: PoolLoadStoreSpec, when: str) -> bool:
        stale = self._stale_rows(pool_spec)
        if stale:
            logger.warning(
                "load job %d failed: %d pool row(s) of rank %d no longer hold the requested "
                "blocks %s the copy (first: %s)",
                job_id, len(stale), self.rank, when, stale[:8],
            )
        return not stale
