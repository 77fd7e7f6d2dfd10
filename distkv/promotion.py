"""Promotion: making a block that another replica holds local to this one.

The manager reserves a local row for the block (an in-flight store, so lookups say
"retry" meanwhile) and submits a Promotion. The Promoter's thread reads the holder's
slots — straight from its shared memory when it is on this node, through the holder
node's NodeAgent and the object store otherwise — writes them into the reserved row and
checks every slot against the checksum in the holder's header. The manager collects the
outcome on its own thread and completes (or fails) the store. A block that does not
check out is a miss, never data.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from distkv.abstract import OffloadKey
from distkv.directory import Holder, ReplicaInfo
from distkv.metrics import MAX_OBSERVATIONS, ErrorLog
from distkv.pool import HostPool, PoolLayout, copy_checksum

logger = logging.getLogger(__name__)

# Per row, per rank: (nbytes, checksum) of a sealed slot; None for a row that did not
# check out at the holder.
SlotMeta = list[tuple[int, int]] | None
# The rows' slots as one (ranks, rows, slot_bytes) array (None when none could be read),
# and each row's metas: the bytes of a row whose meta is None are not to be used.
RowsRead = tuple[np.ndarray | None, list[SlotMeta]]
# fetch(holder's replica info, rows, keys, generations) -> future of RowsRead
RemoteFetch = Callable[[ReplicaInfo, list[int], list[OffloadKey], list[int]], "Future[RowsRead]"]


def layout_of(info: ReplicaInfo) -> PoolLayout:
    return PoolLayout(info.num_rows, info.num_ranks, info.slot_bytes)


def read_rows(
    pool: HostPool, rows: Sequence[int], keys: Sequence[OffloadKey], generations: Sequence[int]
) -> RowsRead:
    """Whole rows (every rank's slot) sealed as key@generation: one (ranks, rows,
    slot_bytes) array, and each row's metas as its headers said.

    What a holder serves; the caller copies the array out (the NodeAgent: Ray, into the
    object store, as the call's result). For consecutive rows of a one-rank pool the
    array is a view of the pool, so the rows are copied once; others are gathered first
    (one contiguous array: the object store's copy of many small arrays is several times
    slower). A row rewritten after its header was read travels torn or as another block,
    and fails the reader's check of every slot against the checksum in its meta: a miss,
    never data.
    """
    ranks = range(pool.layout.num_ranks)
    metas: list[SlotMeta] = []
    for row, key, gen in zip(rows, keys, generations):
        meta = [pool.sealed(rank, row, key, gen) for rank in ranks]
        metas.append(None if None in meta else meta)
    first = rows[0] if rows else 0
    if list(rows) == list(range(first, first + len(rows))):
        data = pool.payload[:, first : first + len(rows)]
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
    else:
        data = pool.payload[:, np.asarray(rows, dtype=np.int64)]
    return data, metas


# wakes the Promoter's thread to collect a fetch
_FETCHED = object()


@dataclass
class Promotion:
    key: OffloadKey
    row: int  # the local row reserved for it
    generation: int  # the local generation it will be sealed with
    holders: tuple[Holder, ...]
    deadline: float  # time.monotonic() after which it fails
    submitted: float = field(default_factory=time.monotonic)  # when the manager asked for it
    cache_epoch: int = 0  # the replica's cache epoch: only holders of the same one are read


class Promoter:
    """Runs promotions on one background thread; the manager drains `finished()`."""

    # A fetch from another node asks for at most this many bytes (one row at least), so
    # that the holder's copy into the object store, the transfer and the checked copy
    # here of successive fetches overlap instead of running one after the other. Each
    # fetch also costs an actor call, an object and a concurrent copy at the holder:
    # 128 MiB took 120 ms in 32 MiB fetches, 107 in 64 and 112 in one (bench/promote.py,
    # steady state, two simulated nodes sharing two cores).
    FETCH_BYTES = 64 << 20
    # The thread wakes when a promotion is submitted or a fetch completes, and at least
    # this often to fail the promotions past their deadline.
    IDLE_WAIT_S = 0.05

    def __init__(
        self,
        pool: HostPool,
        node_id: str,
        replica_info: Callable[[str], ReplicaInfo | None],
        fetch_remote: RemoteFetch,
    ):
        self._pool = pool
        self._node_id = node_id
        self._replica_info = replica_info
        self._fetch_remote = fetch_remote
        # promotions to start; None to stop; _FETCHED when a fetch completed
        self._submitted: queue.SimpleQueue[Promotion | object | None] = queue.SimpleQueue()
        self._finished: deque[tuple[OffloadKey, bool, bool]] = deque()
        # (future of the rows read, holder, promotions still waiting on it, row index of each
        # key, when it was asked for)
        self._in_flight: list[tuple[Future, ReplicaInfo, list[Promotion], dict[OffloadKey, int], float]] = []
        self.bytes_same_node = 0
        self.bytes_cross_node = 0
        # time spent promoting, summed over batches (concurrent fetches each count)
        self.seconds_same_node = 0.0
        self.seconds_cross_node = 0.0
        # promotions by path ("same_node", "cross_node"): started = succeeded + failed + in flight;
        # one with no readable holder is never started and only counts as an error
        self.started = {"same_node": 0, "cross_node": 0}
        self.succeeded = {"same_node": 0, "cross_node": 0}
        self.failed = {"same_node": 0, "cross_node": 0}
        # (path, seconds from submission) of successful promotions, for the metrics exporter
        self.latencies: deque[tuple[str, float]] = deque(maxlen=MAX_OBSERVATIONS)
        self.errors = ErrorLog()
        self._thread = threading.Thread(target=self._run, name="distkv-promoter", daemon=True)
        self._thread.start()

    def submit(self, promotion: Promotion) -> None:
        self._submitted.put(promotion)

    def finished(self) -> list[tuple[OffloadKey, bool, bool]]:
        """(key, success, whether it came from this node) of the promotions that ended
        since the last call."""
        done = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    def has_finished(self) -> bool:
        return bool(self._finished)

    def close(self) -> None:
        self._submitted.put(None)
        self._thread.join(timeout=10)

    # ---- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                for _, _, promotions, _, _ in self._in_flight:
                    self._finish(promotions, False, "cross_node")
                return
            if batch:
                self._start(batch)
            self._collect()

    def _take_batch(self) -> list[Promotion] | None:
        """Everything submitted so far, once something was submitted or a fetch completed.

        Waits at most IDLE_WAIT_S, so that timeouts are noticed that soon."""
        batch: list[Promotion] = []
        try:
            item = self._submitted.get(timeout=self.IDLE_WAIT_S)
            while True:
                if item is None:
                    return None
                if item is not _FETCHED:
                    batch.append(item)
                item = self._submitted.get_nowait()
        except queue.Empty:
            return batch

    def _start(self, batch: list[Promotion]) -> None:
        by_holder: dict[str, tuple[ReplicaInfo, list[Promotion]]] = {}
        for p in batch:
            info = self._choose(p)
            if info is None:
                self._finish([p], False, None, "promotion_no_holder", f"{len(p.holders)} holder(s) known")
                continue
            by_holder.setdefault(info.replica_id, (info, []))[1].append(p)
        for info, promotions in by_holder.values():
            same_node = info.node_id == self._node_id
            self.started["same_node" if same_node else "cross_node"] += len(promotions)
            if same_node:
                self._copy_same_node(info, promotions)
                continue
            row_bytes = info.num_ranks * info.slot_bytes
            step = max(self.FETCH_BYTES // row_bytes, 1)
            # in the holder's row order: a prefix stored together then asks for runs of
            # consecutive rows, which the holder copies out without gathering them first
            promotions.sort(key=lambda p: self._held_row(p, info).row)
            for i in range(0, len(promotions), step):
                self._fetch(info, promotions[i : i + step])

    def _fetch(self, info: ReplicaInfo, promotions: list[Promotion]) -> None:
        held = [self._held_row(p, info) for p in promotions]
        asked = time.perf_counter()
        try:
            future = self._fetch_remote(
                info, [h.row for h in held], [p.key for p in promotions], [h.generation for h in held]
            )
        except Exception as e:
            logger.warning("promotion from %s could not start", info.replica_id, exc_info=True)
            self._finish(promotions, False, "cross_node", "promotion_fetch", f"from {info.replica_id}: {e}")
            return
        index = {p.key: i for i, p in enumerate(promotions)}
        self._in_flight.append((future, info, promotions, index, asked))
        future.add_done_callback(lambda _: self._submitted.put(_FETCHED))

    def _choose(self, p: Promotion) -> ReplicaInfo | None:
        """A holder of the promotion's cache epoch whose pool we can read, on this node if possible."""
        mine = self._pool.layout
        candidates = []
        for holder in p.holders:
            info = self._replica_info(holder.replica_id)
            if (
                info is not None
                and info.cache_epoch == p.cache_epoch
                and (info.num_ranks, info.slot_bytes) == (mine.num_ranks, mine.slot_bytes)
            ):
                candidates.append(info)
        candidates.sort(key=lambda info: info.node_id != self._node_id)
        return candidates[0] if candidates else None

    @staticmethod
    def _held_row(p: Promotion, info: ReplicaInfo) -> Holder:
        return next(h for h in p.holders if h.replica_id == info.replica_id)

    def _copy_same_node(self, info: ReplicaInfo, promotions: list[Promotion]) -> None:
        started = time.perf_counter()
        try:
            holder_pool = HostPool(info.pool_name, layout_of(info), create=False)
        except (FileNotFoundError, ValueError) as e:
            self._finish(promotions, False, "same_node", "promotion_fetch", f"from {info.replica_id}: {e}")
            return
        try:
            for p in promotions:
                held = self._held_row(p, info)
                ok = self._write_local(p, lambda rank, out: holder_pool.read(rank, held.row, p.key, held.generation, out))
                if ok:
                    self.bytes_same_node += self._pool.layout.num_ranks * self._pool.layout.slot_bytes
                self._finish([p], ok, "same_node", None if ok else "promotion_stale", f"from {info.replica_id}")
        finally:
            holder_pool.close()
            self.seconds_same_node += time.perf_counter() - started

    def _collect(self) -> None:
        now = time.monotonic()
        still = []
        for future, info, promotions, index, asked in self._in_flight:
            if not future.done():
                expired = [p for p in promotions if p.deadline <= now]
                if expired:
                    self._finish(expired, False, "cross_node", "promotion_timeout", f"from {info.replica_id}")
                    promotions = [p for p in promotions if p.deadline > now]
                if promotions:
                    still.append((future, info, promotions, index, asked))
                continue
            try:
                data, metas = future.result()
            except Exception as e:
                logger.warning("promotion from %s failed: %s", info.replica_id, e)
                self._finish(promotions, False, "cross_node", "promotion_fetch", f"from {info.replica_id}: {e}")
                continue
            for p in promotions:
                i = index[p.key]
                ok = metas[i] is not None and self._write_local(
                    p, lambda rank, out, i=i: _copy_checked(data[rank, i], metas[i][rank], out)
                )
                if ok:
                    self.bytes_cross_node += sum(n for n, _ in metas[i])
                self._finish([p], ok, "cross_node", None if ok else "promotion_stale", f"from {info.replica_id}")
            self.seconds_cross_node += time.perf_counter() - asked
        self._in_flight = still

    def _write_local(self, p: Promotion, read_slot: Callable[[int, np.ndarray], tuple[int, int] | None]) -> bool:
        """Fill every rank's slot of the reserved row through read_slot, then seal it."""
        rows = np.array([p.row])
        gens = np.array([p.generation], dtype=np.uint64)
        for rank in range(self._pool.layout.num_ranks):
            self._pool.begin_write(rank, rows)
            read = read_slot(rank, self._pool.payload[rank, p.row])
            if read is None:
                return False
            nbytes, checksum = read
            self._pool.seal(rank, rows, [p.key], gens, nbytes, [checksum])
        return True

    def _finish(
        self, promotions: list[Promotion], ok: bool, path: str | None, error: str | None = None, detail: str = ""
    ) -> None:
        """Hand the outcome to the manager. `path`: how they were read (None: never started);
        `error`: the kind of failure to count (None for successes and shutdown)."""
        # counted first: a caller that saw the outcome sees it counted
        if path is not None:
            if ok:
                self.succeeded[path] += len(promotions)
                now = time.monotonic()
                self.latencies.extend((path, now - p.submitted) for p in promotions)
            else:
                self.failed[path] += len(promotions)
        if error is not None:
            self.errors.add(error, f"{len(promotions)} promotion(s) {detail}", len(promotions))
        for p in promotions:
            self._finished.append((p.key, ok, path == "same_node"))


def _copy_checked(src: np.ndarray, meta: tuple[int, int], out: np.ndarray) -> tuple[int, int] | None:
    """Copy a slot received from another node; None if it does not match its checksum."""
    nbytes, expected = meta
    return meta if copy_checksum(out[:nbytes], src[:nbytes]) == expected else None
