"""Reading another replica's pool: the one way a NodeAgent and same-node promotion map it.

`PoolReaders` keeps the pools it reads mapped read-only while they are used and for a while
after, and reclaims them when their segment was replaced or removed; `read_rows` is the
holder's side of a read from another node. Every byte read here is checked by the reader
against the slot protocol (`distkv.storage.slots`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from distkv.abstract import OffloadKey
from distkv.storage.pool import HostPool, PoolLayout
from distkv.storage.segments import UntrustedSegment
from distkv.storage.slots import Sealed

logger = logging.getLogger(__name__)

# Each asked-for row's metas, and the slots of the rows whose metas are not None, in the
# order asked, as one (ranks, rows, slot_bytes) array (None when there are none): what a
# NodeAgent's read answers.
RowsRead = tuple[np.ndarray | None, list[list[Sealed] | None]]


def read_rows(
    pool: HostPool, rows: Sequence[int], keys: Sequence[OffloadKey], generations: Sequence[int]
) -> RowsRead:
    """The holder's side of a read from another node (a NodeAgent, from `PoolReaders`):
    each row's metas as its headers said, and the slots of the rows sealed as
    key@generation; a row that is not goes out as its None meta only.

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


# how often the owner of a PoolReaders prunes it (closes the pools it no longer needs mapped)
PRUNE_INTERVAL_S = 5.0


class _Reading:
    __slots__ = ("pool", "users", "last_used", "retired")

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.users = 0
        self.last_used = time.monotonic()
        self.retired = False


class PoolReaders:
    """Other replicas' pools, opened to read (`member=False`) and kept mapped between reads.

    The one way to read another replica's pool: a NodeAgent serves other nodes from it,
    the Promoter copies from it on the same node. Being no member, a reader never takes
    the replica's lock, so closing a mapping never removes the segment: that stays the
    business of the replica's own processes (or of a reclaim once they are gone).

    Pools stay mapped because mapping one anew for every read costs a page fault per page
    read and an munmap, about as much CPU again as copying the rows out
    (docs/benchmarks.md). A pool whose segment was removed or replaced is closed at its
    next read or by `prune`, as is one unread for `idle_s`, so that a mapping never keeps
    a removed segment's memory for long. Thread-safe.
    """

    def __init__(self, idle_s: float = 30.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._open: dict[str, _Reading] = {}

    @contextlib.contextmanager
    def reading(self, name: str, layout: PoolLayout) -> Iterator[HostPool | None]:
        """The pool `name`, mapped, for the duration of the block; None if there is no
        such segment, it has another layout or it is not this user's alone."""
        entry = self._acquire(name, layout)
        if entry is None:
            yield None
            return
        try:
            yield entry.pool
        finally:
            with self._lock:
                entry.users -= 1
                entry.last_used = time.monotonic()
                if entry.retired and not entry.users:
                    entry.pool.close()

    def _acquire(self, name: str, layout: PoolLayout) -> _Reading | None:
        with self._lock:
            entry = self._open.get(name)
            if entry is not None and (entry.pool.layout != layout or entry.pool.replaced()):
                self._retire(name)
                entry = None
            if entry is None:
                try:
                    pool = HostPool(name, layout, create=False, member=False)
                except (FileNotFoundError, ValueError):
                    return None
                except UntrustedSegment as e:
                    logger.warning("distkv: not reading pool %s: %s", name, e)
                    return None
                entry = self._open[name] = _Reading(pool)
            entry.users += 1
            return entry

    def prune(self) -> None:
        """Close the pools whose segment is gone or replaced, or that nobody read for idle_s."""
        now = time.monotonic()
        with self._lock:
            for name, entry in list(self._open.items()):
                if entry.pool.replaced() or now - entry.last_used > self.idle_s:
                    self._retire(name)

    def close(self) -> None:
        with self._lock:
            for name in list(self._open):
                self._retire(name)

    def __len__(self) -> int:
        return len(self._open)

    def _retire(self, name: str) -> None:
        entry = self._open.pop(name)
        entry.retired = True
        if not entry.users:
            entry.pool.close()
