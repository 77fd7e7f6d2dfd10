"""distkv as a secondary tier of a primary tier of host-memory chunks, without vLLM: ClusterTier.

vLLM 0.33's tiered offloading keeps a primary tier of chunks in host memory (its GPU copies
go there and come from there only) and hands each secondary tier jobs: a *store* (cascade)
copies primary chunks into the tier, a *load* (promotion) copies the tier's chunks into
primary chunks vLLM reserved. `ClusterTier` does them with a replica's parts:

- its `ClusterOffloadingManager` (the pool's rows and eviction, the Directory, promotion)
  decides where a chunk goes and where one comes from;
- a `ChunkCopier` (distkv.storage.tier_copies) moves the bytes between a primary chunk and a pool
  row of one slot, off the caller's thread: hashed and sealed on a store, through the
  slot protocol on a load;
- a `ChunkLanding` (distkv.transfer.landing) over the primary chunks, which promotions from
  other replicas land in.

store: the rows the manager reserves (chunks held already are skipped, a full pool evicts
by its policy) are filled from the chunks and sealed, then completed, which publishes them
to the Directory.
lookup: the cluster manager's `lookup_result`, and `promotable` for a chunk held elsewhere:
HIT for a chunk in this pool or held by a replica of the cache epoch, RETRY while a store, a promotion or a Directory query it needs
is pending, MISS otherwise; the lookup starts nothing and never waits.
load: a chunk in this pool is pinned and copied; one held elsewhere is promoted straight
into the job's primary chunk (`ClusterOffloadingManager.promote_into`: distkv's
transports, every slot checked where it landed), with no copy through this pool, which
does not keep it: vLLM's primary tier does. A chunk whose promotion fails or times out,
or whose copy does not check out, is a failed key of its job: its primary chunk is
reported not loaded, never used. A job's chunk is reported only once nothing writes it
any more (a promotion's READ that could not be aborted ends first).

Calls come one at a time (vLLM's manager lock), from any thread; the copies and the
promotions run on threads of their own and report through `finished`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distkv.abstract import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.storage.pool import HostPool
from distkv.storage.tier_copies import ChunkCopier
from distkv.transfer.landing import ChunkLanding

logger = logging.getLogger(__name__)

MISS, HIT, RETRY = LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY
# A tier has three answers: a store of this replica in flight (HIT_PENDING) is a retry.
TIER_ANSWERS: tuple[LookupResult, ...] = (MISS, HIT, RETRY, RETRY)
# how often a reset looks again for the promotions into primary chunks it waits for
DRAIN_POLL_S = 0.005


@dataclass(frozen=True)
class TierResult:
    """A job that ended. success: every key; successful_keys: of a load that failed in
    part, the keys whose chunks were loaded (None: all share `success`)."""

    job_id: int
    success: bool
    successful_keys: tuple[OffloadKey, ...] | None
    seconds: float
    nbytes: int


class _Job:
    """A job in flight: a store's keys being copied into rows, or a load's keys (into
    `chunks`, by index), each loaded, failed or not yet resolved."""

    __slots__ = ("job_id", "keys", "chunks", "req_context", "started", "loaded", "unresolved", "nbytes")

    def __init__(self, job_id: int, keys: list[OffloadKey], chunks: Sequence[int], req_context: ReqContext):
        self.job_id = job_id
        self.keys = keys
        self.chunks = [int(c) for c in chunks]
        self.req_context = req_context
        self.started = time.monotonic()
        self.loaded: list[bool] = [False] * len(keys)
        self.unresolved = len(keys)
        self.nbytes = 0

    def result(self, success: bool | None = None) -> TierResult:
        """A store's result (its `success`), or a load's from what each of its keys did."""
        seconds = time.monotonic() - self.started
        if success is not None or all(self.loaded):
            return TierResult(self.job_id, success is not False, None, seconds, self.nbytes)
        loaded = tuple(key for key, ok in zip(self.keys, self.loaded) if ok)
        return TierResult(self.job_id, False, loaded or None, seconds, self.nbytes)


class ClusterTier:
    """A replica's pool as a secondary tier of a primary tier's chunks (see the module).

    `primary`: the primary tier's chunks, (chunks, bytes per chunk) uint8, which the pool's
    one slot per row matches. Owns `cluster` and `pool`: `close` shuts both down.
    """

    def __init__(self, cluster: ClusterOffloadingManager, pool: HostPool, primary: np.ndarray) -> None:
        self.cluster = cluster
        self._pool = pool
        self._blocks = cluster.local.blocks
        self._view = cluster.link.view
        self._copies = ChunkCopier(pool, primary)
        self._landing = ChunkLanding(primary)
        cluster.promoter.transport.admit(self._landing)
        self._jobs: dict[int, _Job] = {}
        # primary chunks being promoted into -> the load waiting: (job, index of the key in the job)
        self._landing_in: dict[int, tuple[_Job, int]] = {}
        # keys whose blocks are in flight here (a store, a promotion) -> the loads waiting
        # for them: (job, index of the key in the job)
        self._waiting: dict[OffloadKey, list[tuple[_Job, int]]] = {}
        self._results: list[TierResult] = []
        self._events: list[OffloadingEvent] = []
        # keys of loads that failed so far (vLLM counts failed jobs, and the manager stores it rejected)
        self.keys_failed = 0
        self.closed = False

    # ---- the scheduler's calls ---------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """The cluster manager's lookup_result, except that a chunk only other replicas hold is
        a HIT that starts nothing (its load promotes it), or a MISS if it cannot be promoted."""
        try:
            holders = self._view.get(key) if key not in self._blocks else None
        except TypeError:  # unhashable: lookup_result names the bad key
            holders = None
        if holders is None:
            return TIER_ANSWERS[self.cluster.lookup_result(key, req_context)]
        return HIT if self.cluster.promotable(key, holders) else MISS

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], chunks: Sequence[int], req_context: ReqContext) -> None:
        """Copy the chunks of `keys` this pool does not hold into rows, sealed, then publish them."""
        self._check_new(job_id, keys, chunks)
        out = self.cluster.prepare_store(list(keys), req_context)
        if out is None or not out.keys_to_store:  # no row free or evictable, or nothing new
            self._results.append(_Job(job_id, [], (), req_context).result(success=out is not None))
            return
        chunk_of = dict(zip(keys, chunks))
        job = self._jobs[job_id] = _Job(job_id, list(out.keys_to_store), (), req_context)
        spec = out.store_spec
        self._copies.store(
            job_id, [int(chunk_of[key]) for key in job.keys], np.asarray(spec.block_ids), job.keys, spec.generations
        )

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], chunks: Sequence[int], req_context: ReqContext) -> None:
        """Fill the primary chunks `chunks` with the blocks of `keys`: from this pool, or
        promoted into them from the replica holding them."""
        self._check_new(job_id, keys, chunks)
        num_chunks, taken = len(self._landing.chunks), [int(c) for c in chunks]
        if any(not 0 <= c < num_chunks or c in self._landing_in for c in taken) or len(set(taken)) < len(taken):
            raise ValueError(
                f"job {job_id}: chunks {taken} must be distinct chunks of the primary tier's {num_chunks}, "
                "none being loaded"
            )
        job = _Job(job_id, list(keys), chunks, req_context)
        if not job.keys:
            self._results.append(job.result())
            return
        self._jobs[job_id] = job
        blocks, cluster = self._blocks, self.cluster
        for index, key in enumerate(job.keys):
            block = blocks.get(key)
            if block is None:
                chunk = job.chunks[index]
                if cluster.promote_into(key, req_context, self._landing, chunk):
                    self._landing_in[chunk] = (job, index)
                else:
                    self._resolve(job, index, False)
            elif block.refs < 0:  # its store or promotion (a router's answer named its holders) is in flight
                self._waiting.setdefault(key, []).append((job, index))
            else:
                self._copy_out(job, index)

    def finished(self) -> list[TierResult]:
        """The jobs that ended since the last call. Applies what the copies and promotions
        did meanwhile: stores completed (published), loads unpinned, promoted chunks loaded."""
        self._apply_copies()
        self._events.extend(self.cluster.take_events())
        if self._waiting:
            self._load_stored()
        if self._landing_in:
            self._apply_landed()
        results, self._results = self._results, []
        return results

    def take_events(self) -> list[OffloadingEvent]:
        """This pool's stored and removed blocks since the last call."""
        self._events.extend(self.cluster.take_events())
        events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._results)

    def end_step(self) -> None:
        """The scheduler's step ended: the step's Directory questions go now."""
        self.cluster.end_step()

    def request_started(self, req_context: ReqContext) -> None:
        """A request arrived: the Directory's answer its router sent, if any, serves its lookups."""
        self.cluster.request_started(req_context)

    def request_finished(self, req_context: ReqContext) -> None:
        self.cluster.request_finished(req_context)

    def drain_and_reset(self) -> None:
        """End every job and move to the next cache epoch (ClusterOffloadingManager.reset_cache).

        Copies queued or running are waited for (one in flight is never cut short), and so
        are promotions into primary chunks, for nothing may write a chunk after vLLM's reset:
        each ends by its deadline, or once a READ that could not be aborted is over. Their
        keys fail whatever landed (blocks of the epoch a reset leaves), as do loads still
        waiting for a store or a promotion into this pool, that promotion abandoned to the
        manager, which keeps its row out of use until it ends. Every job's result is then
        in `finished`. Blocks stored before are dropped: after a reset (new weights) no
        replica promotes them, nor this one.
        """
        self._copies.wait_idle()
        self._apply_copies()
        while self._landing_in:
            self._apply_landed(reset=True)
            time.sleep(DRAIN_POLL_S)
        for waiters in self._waiting.values():
            for job, index in waiters:
                self._resolve(job, index, False)
        self._waiting.clear()
        assert not self._jobs, f"jobs {sorted(self._jobs)} still running after a drain"
        self.cluster.reset_cache()
        self.cluster.on_reset_flushed()  # no copy of this tier still uses a row
        self._events.extend(self.cluster.take_events())

    def close(self) -> None:
        """Stop the copies, leave the cluster (unregister, close the link and the transports)
        and close the pool: its segment is removed."""
        if self.closed:
            return
        self.closed = True
        try:
            self._copies.close()
        finally:
            try:
                self.cluster.shutdown()
            finally:
                self._pool.close()
                del self._landing  # the primary tier's memory is vLLM's to release

    # ---- the rest ----------------------------------------------------------------------

    def _check_new(self, job_id: int, keys: Sequence[OffloadKey], chunks: Sequence[int]) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already running")
        if len(keys) != len(chunks):
            raise ValueError(f"job {job_id}: {len(keys)} keys and {len(chunks)} chunks must be as many")

    def _copy_out(self, job: _Job, index: int) -> None:
        """Pin the ready block of the job's key at `index` and copy it into the job's chunk."""
        key = job.keys[index]
        spec = self.cluster.prepare_load([key], job.req_context)
        self._copies.load((job.job_id, index), int(spec.block_ids[0]), key, int(spec.generations[0]), job.chunks[index])

    def _load_stored(self) -> None:
        """Loads waiting for blocks whose store or promotion into this pool ended: copy the
        ready ones out, fail the ones whose blocks are gone (a failed store or promotion)."""
        blocks = self._blocks
        for key in [key for key in self._waiting if (block := blocks.get(key)) is None or block.refs >= 0]:
            waiters = self._waiting.pop(key)
            ready = key in blocks
            for job, index in waiters:
                if ready:
                    self._copy_out(job, index)
                else:
                    self._resolve(job, index, False)

    def _apply_landed(self, reset: bool = False) -> None:
        """Loads whose promotions into their chunks ended: each chunk loaded or failed (all
        failed in a `reset`)."""
        nbytes = self._landing.chunks.shape[1]
        for chunk, ok in self.cluster.landed():
            job, index = self._landing_in.pop(chunk)
            ok = ok and not reset
            job.nbytes += nbytes if ok else 0
            self._resolve(job, index, ok)

    def _apply_copies(self) -> None:
        for tag, ok, _, nbytes in self._copies.finished():
            if isinstance(tag, tuple):  # a load's key
                job_id, index = tag
                job = self._jobs[job_id]
                self.cluster.complete_load([job.keys[index]], job.req_context)
                job.nbytes += nbytes
                self._resolve(job, index, ok)
            else:
                job = self._jobs.pop(tag)
                self.cluster.complete_store(job.keys, job.req_context, success=ok)
                if not ok:
                    logger.warning("distkv tier: a store of %d chunk(s) failed its copy", len(job.keys))
                job.nbytes = nbytes
                self._results.append(job.result(success=ok))

    def _resolve(self, job: _Job, index: int, ok: bool) -> None:
        """The load's key at `index` is loaded (ok) or failed; the job ends with its last."""
        job.loaded[index] = ok
        if not ok:
            self.keys_failed += 1
        job.unresolved -= 1
        if not job.unresolved:
            del self._jobs[job.job_id]
            self._results.append(job.result())
