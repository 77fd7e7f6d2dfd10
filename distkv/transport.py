"""Transports: how the bytes of a block held on another node reach the row reserved here.

The Promoter reserves local rows, zeroes their headers (`begin_write`) and hands a
transport the reads of one holder; the transport moves every rank's slot of each holder
row into its local row and says, per read, what the holder's headers said of the block
once its bytes are here and checked against them (the checksum), or None: a miss. The
Promoter seals what checked out.

- `ObjectStoreTransport`: the holder node's NodeAgent copies the rows into the object
  store as a call's result; they are copied here, checked as they are copied.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from distkv.abstract import OffloadKey
from distkv.directory import ReplicaInfo
from distkv.pool import HostPool, Sealed, copy_checksum

# Per read, each rank's header as the holder sealed it; None: not to be used.
Landed = list[list[Sealed] | None]


@dataclass(frozen=True)
class RowRead:
    """One block to bring here: its key, where the holder keeps it, the local row for it."""

    key: OffloadKey
    holder_row: int
    holder_generation: int
    local_row: int


class Transfer(ABC):
    """The reads of one `Transport.start`, in flight."""

    # True: `done` must be polled, nothing calls `wake` (NIXL has no completion callback)
    polled = False

    @abstractmethod
    def done(self) -> bool:
        """Whether `finish` can run without waiting. Never blocks."""

    @abstractmethod
    def finish(self) -> Landed:
        """Once done: what landed and checked out, per read in order. Runs on the caller's
        thread; raises if the transfer failed as a whole."""

    @abstractmethod
    def cancel(self) -> None:
        """Give up (a deadline passed, or the transfer failed): once this returns, no byte
        of it lands in the local rows any more. Never raises; calling it twice is fine."""


class Transport(ABC):
    """Moves blocks from a holder on another node into this replica's pool."""

    name: str

    @abstractmethod
    def start(self, holder: ReplicaInfo, reads: Sequence[RowRead], wake: Callable[[], None]) -> Transfer:
        """Start `reads` from `holder`'s pool; `wake` runs (on any thread) when the transfer
        may have become done. Raises if nothing could start."""

    def close(self) -> None:
        """Release what the transport holds."""


# ---- through the object store -------------------------------------------------------

# Each asked-for row's metas, and the slots of the rows whose metas are not None, in the
# order asked, as one (ranks, rows, slot_bytes) array (None when there are none): what a
# NodeAgent's read answers.
RowsRead = tuple[np.ndarray | None, list[list[Sealed] | None]]
# fetch(holder's replica info, rows, keys, generations) -> future of RowsRead
RemoteFetch = Callable[[ReplicaInfo, list[int], list[OffloadKey], list[int]], "Future[RowsRead]"]


def read_rows(
    pool: HostPool, rows: Sequence[int], keys: Sequence[OffloadKey], generations: Sequence[int]
) -> RowsRead:
    """The holder's side (a NodeAgent): each row's metas as its headers said, and the slots
    of the rows sealed as key@generation; a row that is not goes out as its None meta only.

    The caller copies the array out (the NodeAgent: Ray, into the object store, as the
    call's result). For consecutive rows of a one-rank pool the array is a view of the
    pool, so the rows are copied once; others are gathered first (one contiguous array:
    the object store's copy of many small arrays is several times slower). A row
    rewritten after its header was read travels torn or as another block, and fails the
    reader's check of every slot against the checksum in its meta: a miss, never data.
    """
    ranks = range(pool.layout.num_ranks)
    metas: list[list[Sealed] | None] = []
    for row, key, gen in zip(rows, keys, generations):
        meta = [pool.sealed(rank, row, key, gen) for rank in ranks]
        metas.append(None if None in meta else meta)
    sealed = [row for row, meta in zip(rows, metas) if meta is not None]
    if not sealed:
        return None, metas
    first = sealed[0]
    if sealed == list(range(first, first + len(sealed))):
        data = pool.payload[:, first : first + len(sealed)]
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
    else:
        data = pool.payload[:, np.asarray(sealed, dtype=np.int64)]
    return data, metas


def shipped_index(metas: Sequence[list[Sealed] | None]) -> list[int | None]:
    """Where each row of a RowsRead is in its array: None for a row that was not shipped."""
    index: list[int | None] = []
    shipped = 0
    for meta in metas:
        index.append(None if meta is None else shipped)
        shipped += meta is not None
    return index


class _FetchedRows(Transfer):
    def __init__(self, future: Future, pool: HostPool, reads: Sequence[RowRead]) -> None:
        self._future = future
        self._pool = pool
        self._reads = reads

    def done(self) -> bool:
        return self._future.done()

    def finish(self) -> Landed:
        data, metas = self._future.result()
        if len(metas) != len(self._reads):
            raise ValueError(f"the holder answered {len(metas)} rows' headers for {len(self._reads)} rows")
        shipped = shipped_index(metas)
        landed: Landed = []
        for read, meta, i in zip(self._reads, metas, shipped):
            if meta is not None:
                payload = self._pool.payload
                for rank, slot in enumerate(meta):
                    if not _copy_checked(data[rank, i], slot, payload[rank, read.local_row]):
                        meta = None
                        break
            landed.append(meta)
        return landed

    def cancel(self) -> None:
        self._future.cancel()  # the rows are copied here only in finish


def _copy_checked(src: np.ndarray, meta: Sealed, out: np.ndarray) -> bool:
    """Copy a slot received from another node; whether it matches its checksum."""
    return meta.nbytes <= out.nbytes and copy_checksum(out[: meta.nbytes], src[: meta.nbytes]) == meta.checksum


class ObjectStoreTransport(Transport):
    """Reads through the holder node's NodeAgent (`fetch`) and the Ray object store."""

    name = "object_store"

    def __init__(self, pool: HostPool, fetch: RemoteFetch) -> None:
        self._pool = pool
        self._fetch = fetch

    def start(self, holder: ReplicaInfo, reads: Sequence[RowRead], wake: Callable[[], None]) -> Transfer:
        future = self._fetch(
            holder, [r.holder_row for r in reads], [r.key for r in reads], [r.holder_generation for r in reads]
        )
        future.add_done_callback(lambda _: wake())
        return _FetchedRows(future, self._pool, reads)
