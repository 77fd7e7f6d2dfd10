"""Copies between a primary tier's chunks and a pool's rows, off the scheduler's thread.

The primary tier (vLLM's CPU tier, for distkv's vLLM tier) holds chunks of one size in
host memory; a pool of one rank whose slot is that size holds one chunk per row. A chunk
stored into a row is hashed as it is copied and sealed (`store_rows`); a row loaded into a
chunk goes through the slot protocol (`load_row`): only a copy of the block sealed as
key@generation, whole and matching its checksum, counts, else the chunk's key fails and
its bytes are never used.

`ChunkCopier` runs the copies on threads of its own, a few for stores and a few for loads, so
that a load a request waits for never queues behind a burst of stores, and a job's chunks
are copied (and hashed) on several cores at once: one part of the job a thread, not one
task a chunk, whose hand-offs between threads cost more than the copies gain.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from distkv.abstract import OffloadKey
from distkv.storage.slots import ALL_SUB_BLOCKS, copy_checksum
from distkv.storage.pool import HostPool


def check_chunks(pool: HostPool, primary: np.ndarray) -> None:
    """Raise ValueError unless `pool` holds `primary`'s chunks: one rank, a slot of a chunk."""
    if primary.ndim != 2 or primary.dtype != np.uint8:
        raise ValueError(f"primary chunks must be a 2-D uint8 array, not {primary.dtype} of shape {primary.shape}")
    layout = pool.layout
    if layout.num_ranks != 1 or layout.slot_bytes != primary.shape[1]:
        raise ValueError(
            f"pool {pool.name} has {layout.num_ranks} rank(s) of {layout.slot_bytes}-byte slots; "
            f"the primary's chunks need 1 rank of {primary.shape[1]} bytes"
        )


def store_rows(
    pool: HostPool,
    primary: np.ndarray,
    chunks: Sequence[int],
    rows: np.ndarray,
    keys: Sequence[OffloadKey],
    generations: np.ndarray,
) -> int:
    """Copy each primary chunk into its pool row, hashing as it copies, and seal the rows
    as keys@generations: the bytes copied. The rows' headers are invalidated first."""
    nbytes = primary.shape[1]
    pool.begin_write(0, rows)
    payload = pool.payload[0]
    sums = [copy_checksum(payload[row], primary[chunk]) for row, chunk in zip(rows.tolist(), chunks)]
    pool.seal(0, rows, keys, generations, nbytes, sums)
    return nbytes * len(sums)


def load_row(pool: HostPool, primary: np.ndarray, row: int, key: OffloadKey, generation: int, chunk: int) -> bool:
    """Copy pool row `row` into primary chunk `chunk`: whether the copy is of the block
    sealed there as key@generation, whole, and matches its checksum (HostPool.read: the
    generation before and after, the checksum of what was copied)."""
    out = primary[chunk]
    sealed = pool.read(0, row, key, generation, out)
    return sealed is not None and sealed.nbytes == out.nbytes and sealed.filled == ALL_SUB_BLOCKS


# (tag, ok, seconds, bytes) of a copy that ended
Copied = tuple[Hashable, bool, float, int]

# Threads copying each way: a chunk's copy and hash run on one core, and memory bandwidth
# is spent by about four (as distkv.storage.handlers.cpu's segment threads).
COPY_THREADS = min(os.cpu_count() or 1, 4)


class _Store:
    """A store job's parts, each copied and sealed by one store thread; it ends with its
    last part (ok if every part was)."""

    def __init__(self, tag: Hashable, parts: int) -> None:
        self.tag = tag
        self.left = parts
        self.ok = True
        self.nbytes = 0
        self.started = time.perf_counter()


class ChunkCopier:
    """Stores (chunks -> rows) and loads (a row -> a chunk) on threads of their own, so that
    a load a request waits for never queues behind a burst of stores; `finished` gives what
    ended since its last call, `wait_idle` blocks until nothing is left.

    Only the pool rows and primary chunks a copy names are touched, by its thread; the
    caller keeps both reserved (a row's store in flight or a load's pin, a chunk its owner
    holds for the job) until the copy is reported.
    """

    def __init__(self, pool: HostPool, primary: np.ndarray) -> None:
        check_chunks(pool, primary)
        self._pool = pool
        self._primary = primary
        self._done: collections.deque[Copied] = collections.deque()
        self._lock = threading.Condition()
        self._running = 0  # copies submitted and not yet in `done`, under `_lock`
        self._stores = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="distkv-tier-store")
        self._loads = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="distkv-tier-load")
        self.closed = False

    def store(
        self, tag: Hashable, chunks: Sequence[int], rows: np.ndarray, keys: Sequence[OffloadKey], generations: np.ndarray
    ) -> None:
        """Copy chunk chunks[i] into row rows[i], sealed as keys[i]@generations[i]: one job, `tag`."""
        parts = min(COPY_THREADS, len(chunks))
        job = _Store(tag, parts)
        self._started()
        if not parts:
            self._ended((tag, True, 0.0, 0))
        for part in range(parts):
            self._stores.submit(
                self._store_part, job, chunks[part::parts], rows[part::parts], keys[part::parts], generations[part::parts]
            )

    def load(self, tag: Hashable, row: int, key: OffloadKey, generation: int, chunk: int) -> None:
        """Copy row `row`, if it holds key@generation, into chunk `chunk`: one copy, `tag`."""
        self._started()
        self._loads.submit(self._load_row, tag, row, key, generation, chunk)

    def finished(self) -> list[Copied]:
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def has_finished(self) -> bool:
        return bool(self._done)

    def wait_idle(self) -> None:
        """Block until every copy submitted so far has ended (and is in `finished`)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._running)

    def close(self) -> None:
        """Finish the copies submitted, stop the threads and let go of the primary's chunks."""
        if self.closed:
            return
        self.closed = True
        self._stores.shutdown(wait=True)
        self._loads.shutdown(wait=True)
        self._done.clear()
        del self._primary

    def _started(self) -> None:
        with self._lock:
            self._running += 1

    def _ended(self, copied: Copied) -> None:
        self._done.append(copied)
        with self._lock:
            self._running -= 1
            self._lock.notify_all()

    def _store_part(
        self, job: _Store, chunks: Sequence[int], rows: np.ndarray, keys: Sequence[OffloadKey], generations: np.ndarray
    ) -> None:
        try:
            nbytes = store_rows(self._pool, self._primary, chunks, rows, keys, generations)
        except Exception:  # a copy that raised stored nothing usable: the job fails
            nbytes = None
        with self._lock:
            job.ok = job.ok and nbytes is not None
            job.nbytes += nbytes or 0
            job.left -= 1
            last = not job.left
        if last:
            self._ended((job.tag, job.ok, time.perf_counter() - job.started, job.nbytes))

    def _load_row(self, tag: Hashable, row: int, key: OffloadKey, generation: int, chunk: int) -> None:
        start = time.perf_counter()
        try:
            ok = load_row(self._pool, self._primary, row, key, generation, chunk)
        except Exception:  # a copy that raised delivered nothing usable
            ok = False
        self._ended((tag, ok, time.perf_counter() - start, self._primary.shape[1] if ok else 0))
