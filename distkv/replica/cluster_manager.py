"""ClusterOffloadingManager: a replica's manager, its own pool first, then the cluster's.

Its parts: `PromotionsInFlight` (one promotion per key at most, overdue and abandoned ones),
`ScanRounds` (what a promotion must not evict), `BlockPlacement` (the Directory shard of each
block), `CacheEpoch` (reset_cache moves the replica to its next one, and it promotes only from
holders of its own), `RequestPulls` (a request sent with its router's Directory answer,
`request_started`, promotes from the holders it names and misses at once what nobody held;
its `PullGate` decides once per request whether pulling beats recomputing, else MISS).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable

from distkv.abstract import (
    SEED_LOOKUP_ANSWERS,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from distkv.directory.link import DirectoryLink
from distkv.directory.records import Holder
from distkv.observability.errors import ErrorLog
from distkv.observability.stats import Observations, ReplicaStats
from distkv.replica.epochs import CacheEpoch
from distkv.replica.inflight import OVERDUE_GRACE_S, PromotionsInFlight
from distkv.replica.local_manager import Block, LocalOffloadingManager
from distkv.replica.placement import BlockPlacement
from distkv.replica.protection import ScanRounds
from distkv.replica.pulls import RequestPositions, RequestPulls, seed_request_positions
from distkv.replica.replica_stats import LoadSources, drain_observations, replica_stats
from distkv.routing.answer import RoutedAnswer
from distkv.routing.pull_gate import PullGate
from distkv.storage.keys import MIN_KEY_BYTES, key_problem
from distkv.storage.slots import MAX_KEY_BYTES
from distkv.transfer.landing import Landing
from distkv.transfer.promotion import Promoter, Promotion

# The answers as globals: one cached load each on the hot path, where `LookupResult.HIT`
# goes through the enum class's attribute lookup.
MISS, HIT, HIT_PENDING, RETRY = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY


class ClusterBlock(Block):
    """A block of a cluster manager's pool: the local manager's fields, and the cluster's
    own: `seen`, the scan round of the last lookup that found it (`ScanRounds`), and
    `shard`, the Directory shard its placement chose, where its removal goes too (0 until
    placed: the one shard of a one-shard Directory)."""

    __slots__ = ("seen", "shard")

    def __init__(self, row: int, generation: int, refs: int) -> None:
        super().__init__(row, generation, refs)
        self.seen = -1
        self.shard = 0


class _Announcements:
    """The local manager's sink: each block its calls make loadable or let go is announced
    to the Directory as the call makes it; one stored for `promotions` (the cluster
    manager's context of its promotions) as promoted, which may wait for a batch."""

    def __init__(self, link: DirectoryLink, promotions: ReqContext) -> None:
        self._link = link
        self._promotions = promotions

    def stored(self, blocks: list[tuple[OffloadKey, Block]], req_context: ReqContext) -> None:
        if req_context is self._promotions:
            self._link.promoted_blocks(blocks)
        else:
            self._link.stored_blocks(blocks)

    def removed(self, blocks: list[tuple[OffloadKey, Block]]) -> None:
        self._link.removed_blocks(blocks)


class ClusterOffloadingManager(OffloadingManager):
    """The seed OffloadingManager of one replica in a cluster.

    Owns the replica's LocalOffloadingManager (`local`: `num_rows` rows, evicting by `policy`),
    used through its API only, and adds what other replicas hold: a key held elsewhere (per the
    link's view) is promoted into a row reserved here (RETRY until local, then HIT, or MISS once
    it failed), or into its owner's chunk for the tier (`promote_into`, `landed`). What `local`
    stores or lets go is announced to the Directory. Nothing waits on the network: promotions and
    publishing run on threads; a key in neither pool nor a queried view is RETRY until answered.
    """

    def __init__(
        self,
        num_rows: int,
        link: DirectoryLink,
        promoter: Promoter,
        *,
        policy: str = "lru",
        generations: Callable[[int], int] | None = None,
        placement: BlockPlacement | None = None,
        promotion_timeout_s: float = 5.0,
        mode: str = "spec",
        gate: PullGate | None = None,
        request_positions: RequestPositions = seed_request_positions,
    ):
        """`placement`: by the seed API's request roots over the link's shards if None;
        `mode`: how the engine uses this replica (ReplicaStats.mode); `gate`: one that lets
        every pull go until it measured a prefill if None; `request_positions`: how the
        engine's requests record their keys' end tokens."""
        if promotion_timeout_s <= 0:
            raise ValueError(f"promotion_timeout_s={promotion_timeout_s} must be positive")
        self._promotion_ctx = ReqContext(req_id="distkv-promotion")
        self.local = LocalOffloadingManager(
            num_rows, policy, generations=generations, block_type=ClusterBlock,
            sink=_Announcements(link, self._promotion_ctx),
        )
        self._blocks = self.local.blocks
        self.link = link
        self._view = link.view
        self.promoter = promoter
        self.placement = placement or BlockPlacement(link.num_shards)
        self._num_shards = self.placement.num_shards
        self.promotion_timeout_s = promotion_timeout_s
        self.mode = mode
        self._events: list[OffloadingEvent] = []
        self.errors = ErrorLog()
        self.pulls = RequestPulls(link, gate or PullGate(), self.errors, request_positions)
        self._inflight = PromotionsInFlight(promotion_timeout_s, self.errors)
        self._promoting = self._inflight.promoting  # never replaced: the hot path reads it
        self._scans = ScanRounds(promotion_timeout_s + OVERDUE_GRACE_S)
        self.epoch = CacheEpoch(link.info, link.replica)
        self._loads = LoadSources()
        self.blocks_loaded = self._loads.loaded  # blocks handed to loads, by where they came from
        # Counts for `replica_stats` (a promotion's when it ends); floats: an int past 256 allocates (benchmarks.md).
        self.lookups_local_hit = self.lookups_remote_hit = self.lookups_miss = self.lookups_retry = 0.0
        self._promoted_stored = 0  # blocks the local manager stored for promotions
        self.stores_rejected = 0
        self.closed = False

    # ---- the hot path ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """The seed's lookup: lookup_result, with None for both HIT_PENDING and RETRY."""
        return SEED_LOOKUP_ANSWERS[self.lookup_result(key, req_context)]

    def lookup_result(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the block is ready in this pool; HIT_PENDING while this replica's own
        store of it is in flight; RETRY while it is promoted from another replica (this
        call may start that), until HIT or MISS; MISS when no replica of this cache epoch
        can provide it now. ValueError for a key that is not an OffloadKey."""
        # As few steps as Python allows: a key without a local block needs only the view.
        try:
            block = self._blocks.get(key)
        except TypeError:  # unhashable, so not bytes
            raise ValueError(key_problem(key)) from None
        if block is not None:
            block.seen = self._scans.round
            if block.refs >= 0:
                self.lookups_local_hit += 1.0
                return HIT
            return self._lookup_in_flight(key, req_context)
        if key not in self._view:  # `in` costs no call, and this is the common miss
            if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                raise ValueError(key_problem(key))
            answer = req_context.get_state(RoutedAnswer) if self.pulls.any_routed else None  # no call unless routed
            if (holders := answer and answer.holders_for(key, self.link.replica)) is None:
                ask = self.link.ask
                if ask is not None and ask(key, self.placement.shard(key, req_context) if self._num_shards > 1 else 0):
                    self.lookups_retry += 1.0
                    self._scans.defer(req_context.req_id)
                    return RETRY
                self.lookups_miss += 1.0
                return MISS
        else:
            holders = self._view.get(key)  # None if it left the view since
        result = self._promote(key, holders, req_context) if holders else MISS
        if result is MISS:
            self.lookups_miss += 1.0
        else:
            self._scans.defer(req_context.req_id)
        return result

    def _lookup_in_flight(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """A local block whose store or promotion has not completed, as of the last check."""
        if self.promoter.has_finished():
            self._apply_promotions()
        if key in self._promoting:
            self._fail_overdue()
        hit = self.local.lookup(key, req_context)
        if hit:
            self.lookups_local_hit += 1.0
            return HIT
        if hit is None:
            self.lookups_retry += 1.0
            self._scans.defer(req_context.req_id)
            return RETRY if key in self._promoting else HIT_PENDING
        self.lookups_miss += 1.0  # its promotion just failed
        return MISS

    def promotable(self, key: OffloadKey, holders: Collection[Holder]) -> bool:
        """For an owner that promotes on load (the tier): whether `key`, held by `holders`, can be
        promoted (in this epoch, not failed lately). A miss counts now, a hit once `landed`."""
        inflight = self._inflight  # no clock read while no promotion failed lately (the common case)
        if self.epoch.in_epoch(holders) and not (inflight.failed and inflight.failed_until(key, time.monotonic())):
            return True
        self.lookups_miss += 1.0
        return False

    def promote_into(self, key: OffloadKey, req_context: ReqContext, into: Landing, row: int) -> bool:
        """Start promoting `key` into row `row` of `into` (its owner's until `landed`): whether it did."""
        holders = self._view.get(key)
        if holders and self._promote(key, holders, req_context, into, row) is RETRY:
            return True
        self.lookups_miss += 1.0
        return False

    def landed(self) -> list[tuple[int, bool]]:
        """(row, success) of the promotions `promote_into` started that ended since the last call."""
        finished, now = self.promoter.finished_into(), time.monotonic()
        self.pulls.ended(((key, ok, same) for key, _, ok, same in finished), now, self.promoter.unmeasured())
        failed = self._inflight.landed(finished, now)
        self._loads.landed(same for _, _, ok, same in finished if ok)
        self.lookups_remote_hit += len(finished) - len(failed)
        self.lookups_miss += len(failed)
        return [(row, ok) for _, row, ok, _ in finished]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.local.prepare_load(keys, req_context)
        self._scans.admitted(req_context.req_id)  # its load pins what it uses
        self._loads.load(keys)
        return spec

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.local.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.local.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self._apply_finished()
        self._scans.admitted(req_context.req_id)
        self._scans.next_round()
        out = self.local.prepare_store(keys, req_context)
        if out is None:
            self.stores_rejected += 1
        elif self._num_shards > 1 and out.keys_to_store:
            blocks = self._blocks
            for key, shard in zip(out.keys_to_store, self.placement.shards(out.keys_to_store, req_context)):
                blocks[key].shard = shard
        self._take_local_events()
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.local.complete_store(keys, req_context, success)
        self._take_local_events()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._apply_finished()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        # Running promotions keep writing their rows: abandoned, retired until reported. No waiting.
        self._inflight.abandon_all()
        self.pulls.abandoned()
        self.local.reset_cache()  # the removals go out under the old epoch's id
        self._take_local_events()
        self.link.set_info(self.epoch.advance(self.link.info))

    def expect_step_ends(self) -> None:
        """The owner calls end_step at the end of every scheduler step from now on."""
        self.link.expect_step_ends()

    def end_step(self) -> None:
        """The scheduler's step ended: the Directory is asked about its misses now."""
        self.link.end_step()
        self.pulls.step_ended(time.monotonic())

    def request_started(self, req_context: ReqContext) -> None:
        """A request arrived (`RequestPulls.request_started`)."""
        self.pulls.request_started(req_context)

    def request_finished(self, req_context: ReqContext) -> None:
        """The request ended: the blocks it found are no longer protected for it."""
        self._scans.admitted(req_context.req_id)
        self.pulls.request_finished()

    def on_reset_flushed(self) -> None:
        """The jobs in flight at the last reset_cache ended: their rows are free (abandoned promotions' later)."""
        self.local.on_reset_flushed(self._inflight.abandoned)

    def shutdown(self) -> None:
        self.promoter.close()
        self._apply_promotions()
        self.link.close()
        self.local.shutdown()
        self.closed = True

    @property
    def blocks_stored(self) -> int:  # the engine's: the promoter counts promoted blocks
        return self.local.blocks_stored - self._promoted_stored

    @property
    def promotions_in_flight(self) -> int:  # into this pool's rows and into a tier's chunks
        return len(self._promoting) + self._inflight.into_rows

    def stats(self) -> ReplicaStats:
        """This replica's counts since it started (`replica_stats`)."""
        return replica_stats(self)

    def drain_observations(self) -> Observations:
        """The observations since the last call (`replica_stats.drain_observations`)."""
        return drain_observations(self)

    # ---- promotion -------------------------------------------------------------------

    def _promote(self, key: OffloadKey, holders, req_context: ReqContext, into: Landing | None = None, row: int = 0) -> LookupResult:
        """The one place that decides whether `key`, held by `holders`, is promoted for the
        request of `req_context` (whose prefix places it), into a row of this pool it
        reserves, or row `row` of `into`: RETRY, the promotion started; MISS where it cannot
        start (a recent failure, no row), and the engine computes it."""
        now = time.monotonic()
        if self._inflight.failed_until(key, now):
            return MISS
        if not self.pulls.allowed(key, holders, req_context, self._blocks, self._view):
            return MISS  # recomputing it is expected to be faster
        deadline, generation = now + self.promotion_timeout_s, 0
        if into is None:
            out = self.local.prepare_store([key], self._promotion_ctx, spare=self._scans.spares)
            self._take_local_events()
            if out is None or not out.keys_to_store:
                return MISS  # no room: compute it instead
            if self._num_shards > 1:
                self._blocks[key].shard = self.placement.shard(key, req_context)
            row, generation = int(out.store_spec.block_ids[0]), int(out.store_spec.generations[0])
        self._inflight.started(key, deadline, into is not None)
        self.promoter.submit(Promotion(key, row, generation, holders, deadline, cache_epoch=self.epoch.epoch, into=into))
        self.pulls.submitted(key, req_context, now)
        return RETRY

    def _apply_finished(self) -> None:
        """Apply the promotions the Promoter reported, and fail the overdue ones."""
        if self.promoter.has_finished():
            self._apply_promotions()
        if self._promoting:
            self._fail_overdue()

    def _fail_overdue(self) -> None:
        """Abandon, as misses, the promotions the Promoter has not reported in time."""
        overdue = self._inflight.overdue(time.monotonic())
        if overdue:
            self.pulls.abandoned(overdue)
            self.local.retire(overdue)
            self.lookups_miss += len(overdue)

    def _apply_promotions(self) -> None:
        now = time.monotonic()
        finished = self.promoter.finished()
        self.pulls.ended(finished, now, self.promoter.unmeasured())
        succeeded, failed, ended = self._inflight.sort(finished)
        if ended:  # abandoned: their retired rows are free again, whatever the outcome
            self.local.complete_store(ended, self._promotion_ctx, success=False)
        self.lookups_remote_hit += len(succeeded)
        self.lookups_miss += len(failed)
        if succeeded:
            self._loads.promoted(succeeded)
            stored = self.local.blocks_stored
            self.local.complete_store([key for key, _ in succeeded], self._promotion_ctx, success=True)
            self._promoted_stored += self.local.blocks_stored - stored
        if failed:
            self.local.complete_store(failed, self._promotion_ctx, success=False)
            self._inflight.fail(failed, now)
        self._take_local_events()

    def _take_local_events(self) -> None:
        for event in self.local.take_events():
            self._events.append(event)
            if event.removed:
                self._loads.removed(event.keys)
