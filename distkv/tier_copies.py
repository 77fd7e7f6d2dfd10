"""Copies between a primary tier's chunks and a pool's rows, off the scheduler's thread.

The primary tier (vLLM's CPU tier, for distkv's vLLM tier) holds chunks of one size in
host memory; a pool of one rank whose slot is that size holds one chunk per row. A chunk
stored into a row is hashed as it is copied and sealed (`store_rows`); a row loaded into a
chunk goes through the slot protocol (`load_row`): only a copy of the block sealed as
key@generation, whole and matching its checksum, counts, else the chunk's key fails and
its bytes are never used.

`ChunkCopier` runs the copies on two threads, one for stores and one for loads, so that a
load a request waits for never queues behind a burst of stores.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from distkv.abstract import OffloadKey
from distkv.pool import ALL_SUB_BLOCKS, HostPool, copy_checksum


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


class _Lane:
    """One thread running copies in submission order."""

    def __init__(self, name: str, done: collections.deque[Copied], idle: threading.Condition) -> None:
        self._tasks: queue.SimpleQueue[tuple[Hashable, Callable[[], int | None]] | None] = queue.SimpleQueue()
        self._done = done
        self._idle = idle
        self.queued = 0  # submitted and not yet in `done`, under `idle`
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tag: Hashable, copy: Callable[[], int | None]) -> None:
        with self._idle:
            self.queued += 1
        self._tasks.put((tag, copy))

    def stop(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            tag, copy = task
            start = time.perf_counter()
            try:
                nbytes = copy()
            except Exception:  # a copy that raised moved nothing usable
                nbytes = None
            seconds = time.perf_counter() - start
            self._done.append((tag, nbytes is not None, seconds, nbytes or 0))
            with self._idle:
                self.queued -= 1
                self._idle.notify_all()


class ChunkCopier:
    """Stores (chunks -> rows) and loads (a row -> a chunk) on a thread each; `finished`
    gives what ended since its last call, `wait_idle` blocks until nothing is queued.

    Only the pool rows and primary chunks a copy names are touched, by its thread; the
    caller keeps both reserved (a row's store in flight or a load's pin, a chunk its owner
    holds for the job) until the copy is reported.
    """

    def __init__(self, pool: HostPool, primary: np.ndarray) -> None:
        check_chunks(pool, primary)
        self._pool = pool
        self._primary = primary
        self._done: collections.deque[Copied] = collections.deque()
        self._idle = threading.Condition()
        self._stores = _Lane("distkv-tier-stores", self._done, self._idle)
        self._loads = _Lane("distkv-tier-loads", self._done, self._idle)
        self.closed = False

    @property
    def chunk_bytes(self) -> int:
        return self._primary.shape[1]

    def store(
        self, tag: Hashable, chunks: Sequence[int], rows: np.ndarray, keys: Sequence[OffloadKey], generations: np.ndarray
    ) -> None:
        pool, primary = self._pool, self._primary
        self._stores.submit(tag, lambda: store_rows(pool, primary, chunks, rows, keys, generations))

    def load(self, tag: Hashable, row: int, key: OffloadKey, generation: int, chunk: int) -> None:
        pool, primary = self._pool, self._primary
        self._loads.submit(
            tag, lambda: primary.shape[1] if load_row(pool, primary, row, key, generation, chunk) else None
        )

    def finished(self) -> list[Copied]:
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def has_finished(self) -> bool:
        return bool(self._done)

    def wait_idle(self) -> None:
        """Block until every copy submitted so far has ended (and is in `finished`)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._stores.queued and not self._loads.queued)

    def close(self) -> None:
        """Finish the copies queued, stop the threads and let go of the primary's chunks."""
        if self.closed:
            return
        self.closed = True
        self._stores.stop()
        self._loads.stop()
        self._done.clear()
        del self._primary
