"""Promotion: making a block that another replica holds local to this one.

The manager reserves a row for the block and submits a Promotion: a row of its own pool
(an in-flight store, so lookups say "retry" meanwhile), or of another landing its owner
reserved (`distkv.transfer.landing`: distkv's tier promotes straight into vLLM's primary
chunks). The Promoter's thread reads the holder's slots straight from its shared memory
when it is on this node, and through a Transport (distkv.transfer.transport) from another
node, into the reserved row, checks every slot against the checksum in the holder's
header, and has the landing accept the row. The manager collects the outcome on its own
thread and completes (or fails) the store, or hands it to the landing's owner. A block
that does not check out is a miss, never data.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from distkv.abstract import OffloadKey
from distkv.directory.records import Holder, ReplicaInfo
from distkv.observability.errors import ErrorLog
from distkv.observability.metrics import MAX_OBSERVATIONS
from distkv.names import check_pool_namespace
from distkv.storage.readers import PRUNE_INTERVAL_S, PoolReaders
from distkv.storage.pool import HostPool, PoolLayout
from distkv.storage.slots import Sealed
from distkv.transfer.landing import Landing, PoolLanding
from distkv.transfer.transport import RowRead, Transfer, Transport

logger = logging.getLogger(__name__)

def layout_of(info: ReplicaInfo) -> PoolLayout:
    return PoolLayout(info.num_rows, info.num_ranks, info.slot_bytes)


# wakes the Promoter's thread to collect a transfer
_FETCHED = object()


@dataclass
class Promotion:
    key: OffloadKey
    row: int  # the row reserved for it, of `into`
    generation: int  # the local generation it will be sealed with (in this replica's pool)
    holders: tuple[Holder, ...]
    deadline: float  # time.monotonic() after which it fails
    submitted: float = field(default_factory=time.monotonic)  # when the manager asked for it
    cache_epoch: int = 0  # the replica's cache epoch: only holders of the same one are read
    into: Landing | None = None  # where it lands: this replica's pool if None
    ended: bool = field(default=False, init=False)  # its outcome went to the manager


@dataclass
class _InFlight:
    """A transfer from another node and the promotions waiting on it."""

    transfer: Transfer
    holder: ReplicaInfo
    promotions: list[Promotion]
    started: float  # time.perf_counter() when it started
    # (error, detail) its promotions end with once given up: it stays in flight until
    # nothing of it can land any more (`Transfer.settled`), their rows the Promoter's
    given_up: tuple[str, str] | None = None


def _held_row(p: Promotion, info: ReplicaInfo) -> Holder:
    return next(h for h in p.holders if h.replica_id == info.replica_id)


def _drain(ended: deque) -> list:
    done = []
    while ended:
        done.append(ended.popleft())
    return done


def _write_local(into: Landing, p: Promotion, read_slot: Callable[[int, np.ndarray], Sealed | None]) -> bool:
    """Fill every rank's slot of p's reserved row of `into` through read_slot, then have
    `into` accept it."""
    into.begin(np.array([p.row]))
    metas = []
    for rank in range(len(into.payload)):
        read = read_slot(rank, into.payload[rank, p.row])
        if read is None:
            return False
        metas.append(read)
    return into.accept(p.key, p.row, p.generation, metas)


class Promoter:
    """Runs promotions on one background thread; the manager drains `finished()`.

    Every promotion submitted ends exactly once, in `finished()` (into this pool) or
    `finished_into()`: by success, by failure or at `close`. Whatever one promotion's step
    raises (the holder's pool cannot be opened, a fetch's result, the write here) fails
    the promotions of that step only, counted in `errors`; the thread goes on. Only pools of
    cache `namespace` are read. A reserved row is the Promoter's until its promotion ends:
    one given up ends once nothing of it can land (a READ NIXL could not abort may, later).
    """

    # The thread wakes on a submission or a transfer's completion, and this often for deadlines.
    IDLE_WAIT_S = 0.05
    # The transport releases what it keeps for holders that left this often.
    FORGET_GONE_S = 1.0

    def __init__(
        self,
        pool: HostPool,
        node_id: str,
        replica_info: Callable[[str], ReplicaInfo | None],
        transport: Transport,
        *,
        namespace: str,
    ):
        self._own = PoolLanding(pool)
        self._node_id = node_id
        self._namespace = namespace
        self._replica_info = replica_info
        self.transport = transport
        # promotions to start; None to stop; _FETCHED when a fetch completed
        self._submitted: queue.SimpleQueue[Promotion | object | None] = queue.SimpleQueue()
        self._wake = functools.partial(self._submitted.put, _FETCHED)  # what a transfer runs once done
        self._finished: deque[tuple[OffloadKey, bool, bool]] = deque()
        self._finished_into: deque[tuple[OffloadKey, int, bool, bool]] = deque()
        self._unmeasured: deque[OffloadKey] = deque()
        self._in_flight: list[_InFlight] = []
        self.bytes_same_node = 0
        self.bytes_cross_node = 0
        # time spent promoting, summed over batches (concurrent fetches each count)
        self.seconds_same_node = 0.0
        self.seconds_cross_node = 0.0
        # cross-node promotions by the transport that moved them ("object_store", "nixl"):
        # blocks and bytes that landed and checked out, and the seconds their transfers
        # took from start to landing (concurrent transfers each count)
        self.transported: dict[str, list[float]] = {}
        # promotions by path ("same_node", "cross_node"): started = succeeded + failed + in flight;
        # one with no readable holder is never started and only counts as an error
        self.started = {"same_node": 0, "cross_node": 0}
        self.succeeded = {"same_node": 0, "cross_node": 0}
        self.failed = {"same_node": 0, "cross_node": 0}
        # (path, seconds from submission) of successful promotions, for the metrics exporter
        self.latencies: deque[tuple[str, float]] = deque(maxlen=MAX_OBSERVATIONS)
        self.errors = ErrorLog()
        self._forget_gone_at = 0.0
        # same-node holders' pools, mapped as readers: a promotion never unlinks a holder's segment
        self._holder_pools = PoolReaders()
        self._pruned_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="distkv-promoter", daemon=True)
        self._thread.start()

    def submit(self, promotion: Promotion) -> None:
        self._submitted.put(promotion)

    def finished(self) -> list[tuple[OffloadKey, bool, bool]]:
        """(key, success, whether it came from this node) of the promotions into this pool
        that ended since the last call."""
        return _drain(self._finished)

    def has_finished(self) -> bool:
        return bool(self._finished)

    def unmeasured(self) -> list[OffloadKey]:
        """Keys of promotions whose transfer stood in for their path's (`Transfer.stands_in`), each before it ends."""
        return _drain(self._unmeasured)

    def finished_into(self) -> list[tuple[OffloadKey, int, bool, bool]]:
        """(key, row, success, from this node) of those into other landings, as `finished`."""
        return _drain(self._finished_into)

    def close(self) -> None:
        self._submitted.put(None)
        self._thread.join(timeout=10)

    # ---- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                for flight in self._in_flight:
                    flight.transfer.cancel()
                    self._fail_unended(flight, None)
                self.transport.close()
                self._holder_pools.close()
                return
            if batch:
                self._start(batch)
            self._collect()
            if time.monotonic() >= self._forget_gone_at:
                self._forget_gone_at = time.monotonic() + self.FORGET_GONE_S
                with self._failing([], None, "while forgetting holders that left"):
                    self.transport.forget_gone(self._replica_info)
            if time.monotonic() - self._pruned_at > PRUNE_INTERVAL_S:
                self._holder_pools.prune()
                self._pruned_at = time.monotonic()

    def _take_batch(self) -> list[Promotion] | None:
        """Everything submitted so far, once something was submitted or a fetch completed;
        waits at most IDLE_WAIT_S, so that timeouts are noticed that soon."""
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
        by_holder: dict[tuple[str, int], tuple[ReplicaInfo, list[Promotion]]] = {}
        for p in batch:
            with self._failing([p], None, "while choosing a holder"):
                info = self._choose(p)
                if info is None:
                    self._finish([p], False, None, "promotion_no_holder", f"{len(p.holders)} holder(s) known")
                    continue
                by_holder.setdefault((info.replica_id, id(p.into)), (info, []))[1].append(p)
        for info, promotions in by_holder.values():
            same_node = info.node_id == self._node_id
            path = "same_node" if same_node else "cross_node"
            self.started[path] += len(promotions)
            with self._failing(promotions, path, f"from {info.replica_id}"):
                if same_node:
                    self._copy_same_node(info, promotions)
                    continue
                row_bytes = info.num_ranks * info.slot_bytes
                step = max(self.transport.batch_bytes(info) // row_bytes, 1)
                # in the holder's row order: a prefix stored together then asks for runs of
                # consecutive rows, which the holder copies out without gathering them first
                promotions.sort(key=lambda p: _held_row(p, info).row)
                for i in range(0, len(promotions), step):
                    self._fetch(info, promotions[i : i + step])

    def _fetch(self, info: ReplicaInfo, promotions: list[Promotion]) -> None:
        held = [_held_row(p, info) for p in promotions]
        reads = [RowRead(p.key, h.row, h.generation, p.row) for p, h in zip(promotions, held)]
        into = promotions[0].into  # all of them: `_start` groups them by it
        (into or self._own).begin(np.array([p.row for p in promotions]))  # before any byte lands
        try:
            transfer = self.transport.start(info, reads, self._wake, into)
        except Exception as e:
            logger.warning("promotion from %s could not start", info.replica_id, exc_info=True)
            self._finish(promotions, False, "cross_node", "promotion_fetch", f"from {info.replica_id}: {e!r}")
            return
        if transfer.stands_in:
            self._unmeasured.extend(p.key for p in promotions)
        self._in_flight.append(_InFlight(transfer, info, promotions, time.perf_counter()))

    def _choose(self, p: Promotion) -> ReplicaInfo | None:
        """A holder of the promotion's cache epoch whose pool we can read, on this node if possible."""
        mine = self._own.pool.layout
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

    def _copy_same_node(self, info: ReplicaInfo, promotions: list[Promotion]) -> None:
        started = time.perf_counter()
        try:
            # refused before anything is opened: a holder's info names any path it likes
            check_pool_namespace(info.pool_name, self._namespace)
            with self._holder_pools.reading(info.pool_name, layout_of(info)) as holder_pool:
                if holder_pool is None:
                    raise FileNotFoundError(f"no pool segment {info.pool_name} with layout {layout_of(info)}")
                for p in promotions:
                    with self._failing([p], "same_node", f"from {info.replica_id}"):
                        held = _held_row(p, info)
                        ok = _write_local(
                            p.into or self._own, p,
                            lambda rank, out: holder_pool.read(rank, held.row, p.key, held.generation, out),
                        )
                        if ok:
                            self.bytes_same_node += info.num_ranks * info.slot_bytes  # as ours (`_choose`)
                        self._finish([p], ok, "same_node", None if ok else "promotion_stale", f"from {info.replica_id}")
        except Exception as e:
            logger.warning("promotion from %s: its pool %s cannot be read: %r", info.replica_id, info.pool_name, e)
            unread = [p for p in promotions if not p.ended]
            if unread:
                self._finish(unread, False, "same_node", "promotion_fetch", f"from {info.replica_id}: {e!r}")
        finally:
            self.seconds_same_node += time.perf_counter() - started

    def _collect(self) -> None:
        now = time.monotonic()
        still = []
        for flight in self._in_flight:
            where = f"from {flight.holder.replica_id}"
            try:
                if not self._land(flight, now):
                    still.append(flight)
            except Exception as e:
                logger.warning("promotion(s) %s failed", where, exc_info=True)
                if not self._give_up(flight, "promotion_error", f"{where}: {e!r}"):
                    still.append(flight)
        self._in_flight = still

    def _give_up(self, flight: _InFlight, error: str, detail: str) -> bool:
        """Cancel a transfer; whether its promotions that had not ended failed (counting
        `error`) at once, as nothing of it can land any more. Else `_land` ends them later."""
        flight.transfer.cancel()
        flight.given_up = (error, detail)
        if flight.transfer.settled():
            self._fail_unended(flight, error, detail)
            return True
        logger.warning("a transfer %s could not be aborted: its rows stay reserved until it is", detail)
        return False

    def _fail_unended(self, flight: _InFlight, error: str | None, detail: str = "") -> None:
        unended = [p for p in flight.promotions if not p.ended]
        if unended:
            self._finish(unended, False, "cross_node", error, detail)

    def _land(self, flight: _InFlight, now: float) -> bool:
        """Seal what a transfer brought and end its promotions, once it is done, its first
        deadline passed or, given up, it settled; False while it is still in flight."""
        where = f"from {flight.holder.replica_id}"
        if flight.given_up is not None:
            if not flight.transfer.settled():
                return False
            self._fail_unended(flight, *flight.given_up)
            return True
        if not flight.transfer.done():
            if min(p.deadline for p in flight.promotions) > now:
                return False
            return self._give_up(flight, "promotion_timeout", where)
        try:
            landed = flight.transfer.finish()
        except Exception as e:
            logger.warning("promotion %s failed: %r", where, e)
            self._finish(flight.promotions, False, "cross_node", "promotion_fetch", f"{where}: {e!r}")
            return True
        seconds = time.perf_counter() - flight.started
        self.seconds_cross_node += seconds
        moved = self.transported.setdefault(flight.transfer.transport, [0, 0, 0.0])
        moved[2] += seconds
        for p, metas in zip(flight.promotions, landed, strict=True):
            with self._failing([p], "cross_node", where):
                ok = metas is not None and (p.into or self._own).accept(p.key, p.row, p.generation, metas)
                if ok:
                    nbytes = sum(meta.nbytes for meta in metas)
                    self.bytes_cross_node += nbytes
                    moved[0] += 1
                    moved[1] += nbytes
                self._finish([p], ok, "cross_node", None if ok else "promotion_stale", where)
        return True

    @contextlib.contextmanager
    def _failing(self, promotions: list[Promotion], path: str | None, where: str):
        """Run a step of `promotions`: should it raise, those of them that have not ended
        fail, the error is counted and logged once, and the thread goes on."""
        try:
            yield
        except Exception as e:
            failed = [p for p in promotions if not p.ended]
            logger.warning("%d promotion(s) %s failed", len(failed), where, exc_info=True)
            if failed:
                self._finish(failed, False, path, "promotion_error", f"{where}: {e!r}")

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
            p.ended = True
            if p.into is None:
                self._finished.append((p.key, ok, path == "same_node"))
            else:
                self._finished_into.append((p.key, p.row, ok, path == "same_node"))

