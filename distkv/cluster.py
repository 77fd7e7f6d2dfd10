"""ClusterOffloadingManager: a replica's manager, its own pool first, then the cluster's."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Collection, Iterable

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
from distkv.config import STORE_POLICIES
from distkv.directory import DirectoryLink
from distkv.directory_state import prefix_root, shard_of
from distkv.manager import MAX_KEY_BYTES, MIN_KEY_BYTES, LocalOffloadingManager, check_keys, key_problem
from distkv.errors import ErrorLog, merge_errors
from distkv.names import epoch_replica_id
from distkv.promotion import Promoter, Promotion
from distkv.pull_gate import PullGate, RequestPull, prefix_run
from distkv.routing.answer import PARAMS_KEY, ROUTED_KINDS, RoutedAnswer, decode
from distkv.stats import (
    BlockCounts,
    LookupCounts,
    Observations,
    PoolUsage,
    PromotionCounts,
    ReplicaStats,
    RoutingCounts,
    TransportCounts,
)

logger = logging.getLogger(__name__)

# The answers as globals: one cached load each on the hot path, where `LookupResult.HIT`
# goes through the enum class's attribute lookup.
MISS, HIT, HIT_PENDING, RETRY = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY

# Failed promotions remembered (so that lookups answer a miss, not a new try) at most.
MAX_FAILED_KEYS = 1 << 16
# Replica ids whose cache epoch is remembered (`_in_epoch`) at most.
MAX_REPLICA_EPOCHS = 1 << 16
# The Promoter fails a promotion at its deadline itself; the manager fails one the
# Promoter has not reported this long after (its thread is stuck or gone).
OVERDUE_GRACE_S = 1.0


def seed_request_root(req_context: ReqContext) -> tuple[OffloadKey, int] | None:
    """The placement root of a request of distkv's seed API and its end token (`prefix_root`
    of the positions its engine recorded: the harness and the demo record every block's)."""
    return prefix_root(req_context.offload_key_positions())


class _PlacementRoot:
    """Per-request state: the shard of the request's placement root, and the root's end token."""

    __slots__ = ("shard", "end")

    def __init__(self, shard: int, end: int) -> None:
        self.shard = shard
        self.end = end


class ClusterOffloadingManager(OffloadingManager):
    """The seed OffloadingManager of one replica in a cluster.

    Wraps the replica's LocalOffloadingManager and adds what other replicas hold:
    - lookup_result of a key absent locally but held elsewhere (per the replica's view of
      the Directory) reserves a local row and starts a promotion; lookups answer RETRY
      until the block is local (then HIT), or MISS once the promotion failed or timed out.
      `lookup`, the seed's, answers the same with None for both RETRY and HIT_PENDING;
    - every stored and removed block is reported to the Directory, batched, from the
      DirectoryLink's thread.
    Nothing here waits on the network: the view is an in-process dict, promotions and
    publishing run on background threads, and their results are applied here, on the
    scheduler's thread, at the next call. Where the link is queried, a key missing from
    both the pool and the view is asked about (`DirectoryLink.ask`) and answers RETRY until
    the answer is in the view; `end_step` has the step's questions sent at once.

    A promotion's reserved row belongs to the Promoter until it reports the promotion.
    One it has not reported OVERDUE_GRACE_S after its deadline, and every one in flight
    at reset_cache, is abandoned: a miss at once, its row retired in the local manager
    (never reused) until the report comes. A key has one promotion at most: the local
    manager does not store a key again while its retired row is in use.

    A promotion never evicts a block that a scan has just answered HIT, which would turn
    the scan's prefix into a miss when the request comes back for it: it spares those
    found since the last prepare_store (vLLM offers stores after the step's scans), and
    those found by a request whose scan was deferred (answered retry) until that request
    loads, stores or finishes (request_finished), or its promotions' deadlines have
    passed. Lookups stamp the blocks they find with the scan round, one int store.

    reset_cache moves the replica to the next cache epoch: it registers again under
    "<replica_id>.epoch<n>" with `cache_epoch` n, and promotes only from holders of its
    own epoch, so that blocks computed before a weight update are never loaded after it.

    Each block it stores or promotes is placed on a Directory shard by its request's
    prefix (`block_shard`), noted on the block, and its removal goes to the same shard.
    `request_root` finds a request's placement root; the vLLM adapter sets its own.
    `gate` (PullGate) decides once per request whether pulling beats recomputing (else MISS);
    a request sent with its router's Directory answer (`request_started`) promotes from the
    holders it names and misses at once what nobody held, without asking again.
    """

    def __init__(
        self,
        local: LocalOffloadingManager,
        link: DirectoryLink,
        promoter: Promoter,
        store_policy: str = "always",
        promotion_timeout_s: float = 5.0,
        mode: str = "spec",
        gate: PullGate | None = None,
    ):
        """`mode`: how the engine uses this replica (ReplicaStats.mode), shown by `distkv status`."""
        if store_policy not in STORE_POLICIES:
            raise ValueError(f"store_policy={store_policy!r} must be one of {list(STORE_POLICIES)}")
        if promotion_timeout_s <= 0:
            raise ValueError(f"promotion_timeout_s={promotion_timeout_s} must be positive")
        self.local = local
        local.landed = []
        local.dropped = []
        self._blocks = local.blocks
        self._num_shards = link.num_shards
        self.request_root = seed_request_root
        self.request_positions = ReqContext.offload_key_positions  # the seed's; the vLLM adapter sets its own
        self.gate = gate or PullGate()  # unfed (no prefill measured), it lets every pull go
        self.routed = dict.fromkeys(ROUTED_KINDS, 0)  # routed requests, by what they found here
        self._view = link.view
        self.link = link
        self.promoter = promoter
        self.dedupe = store_policy == "dedupe"
        self.promotion_timeout_s = promotion_timeout_s
        self.mode = mode
        self._events: list[OffloadingEvent] = []
        # keys whose promotion failed, and until when lookups answer False for them
        self._failed: dict[OffloadKey, float] = {}
        # promotions in flight -> when the manager fails them if the Promoter has not, in
        # submission order, so the earliest is first
        self._promoting: dict[OffloadKey, float] = {}
        # no promotion is overdue before this (a lower bound, so the hot path reads one float)
        self._next_overdue = math.inf
        # abandoned promotions whose report is still due (see the class docstring)
        self._abandoned: set[OffloadKey] = set()
        self._replica_name = link.info.replica_id
        # Protection of looked-up blocks: lookups stamp them with the current scan round
        # (advanced by each prepare_store); requests answered retry, by req_id, with the
        # round of that answer and when their protection lapses.
        self._round = 0
        self._waiting: dict[str, tuple[int, float]] = {}
        # promotions spare the blocks stamped with a round at least this
        self._protect_from = 0
        self.cache_epoch = link.info.cache_epoch
        # replica id -> whether it is of this cache epoch (`_in_epoch`)
        self._same_epoch: dict[str, bool] = {}
        # promoted blocks no load has used yet, and whether each came from this node
        self._promoted: dict[OffloadKey, bool] = {}
        # blocks handed to loads so far, by where they came from
        self.blocks_loaded = {"local": 0, "same_node": 0, "cross_node": 0}
        self._promotion_ctx = ReqContext(req_id="distkv-promotion")
        # Counts for metrics and `distkv status` (see stats). A lookup that starts a
        # promotion is counted when the promotion ends: a remote hit if it succeeded, else
        # a miss. Floats (exact to 2**53), because CPython reuses freed floats while each
        # int past 256 is a new allocation, on the hot path (docs/benchmarks.md).
        self.lookups_local_hit = 0.0
        self.lookups_remote_hit = 0.0
        self.lookups_miss = 0.0
        self.lookups_retry = 0.0
        # blocks the local manager stored for promotions; the rest the engine stored
        self._promoted_stored = 0
        self.stores_rejected = 0
        self.errors = ErrorLog()
        self.closed = False

    # ---- the hot path ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """The seed's lookup: lookup_result, with None for both HIT_PENDING and RETRY."""
        return SEED_LOOKUP_ANSWERS[self.lookup_result(key, req_context)]

    def lookup_result(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether one block can be loaded here: HIT when it is ready in this replica's pool;
        HIT_PENDING while this replica's own store of it is in flight; RETRY while it is
        being promoted from another replica (this call may start the promotion), until it
        ends in HIT or MISS; MISS when no replica of this cache epoch can provide it now.

        A request whose lookup answered HIT_PENDING or RETRY keeps the blocks its scan
        found protected until it is admitted (see the class docstring). Raises ValueError
        for a key that is not an OffloadKey.
        """
        # As few steps as Python allows: a promotion in flight always has a local block,
        # so a key without one needs only the view.
        try:
            block = self._blocks.get(key)
        except TypeError:  # unhashable, so not bytes
            raise ValueError(key_problem(key)) from None
        if block is not None:
            block.seen = self._round
            if block.refs >= 0:
                self.lookups_local_hit += 1.0
                return HIT
            return self._lookup_in_flight(key, req_context)
        if key not in self._view:  # `in` costs no call, and this is the common miss
            if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                raise ValueError(key_problem(key))
            answer = req_context.get_state(RoutedAnswer)  # the router's, if it sent one
            if (holders := answer and answer.holders_for(key, self.link.replica)) is None:
                link = self.link
                if link.queried and link.ask(key, self.block_shard(key, req_context) if self._num_shards > 1 else 0):
                    self.lookups_retry += 1.0
                    self._defer(req_context)
                    return RETRY
                self.lookups_miss += 1.0
                return MISS
        else:
            holders = self._view.get(key)  # None if it left the view since
        result = self._promote(key, holders, req_context) if holders else MISS
        if result is MISS:
            self.lookups_miss += 1.0
        else:
            self._defer(req_context)
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
            self._defer(req_context)
            return RETRY if key in self._promoting else HIT_PENDING
        self.lookups_miss += 1.0  # its promotion just failed
        return MISS

    def provides(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """lookup_result for an owner that promotes on load (distkv.tier): a block only
        replicas of this cache epoch hold is a HIT and nothing starts (`promote` starts it
        when a load asks), a MISS if its promotion failed within promotion_timeout_s."""
        try:
            elsewhere = key in self._view and key not in self._blocks
        except TypeError:  # unhashable: lookup_result names the bad key
            elsewhere = False
        if not elsewhere:
            return self.lookup_result(key, req_context)
        if self._in_epoch(self._view.get(key, ())) and not (self._failed and self._failed.get(key, 0.0) > time.monotonic()):
            return HIT  # counted when its promotion ends, as lookup_result counts it
        self.lookups_miss += 1.0
        return MISS

    def promote(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Start promoting `key`, absent here, for the request of `req_context`: whether it
        started. Its block is then in flight until the promotion ends: ready, or gone if it
        failed. One that cannot start (no holder, a recent failure, no row) is a miss."""
        holders = self._view.get(key)
        if holders and key not in self._blocks and self._promote(key, holders, req_context) is RETRY:
            return True
        self.lookups_miss += 1.0
        return False

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.local.prepare_load(keys, req_context)
        if self._waiting:
            self._waiting.pop(req_context.req_id, None)  # admitted: its load pins what it uses
        for key in keys:
            same_node = self._promoted.pop(key, None)
            self.blocks_loaded["local" if same_node is None else "same_node" if same_node else "cross_node"] += 1
        return spec

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.local.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.local.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self.promoter.has_finished():
            self._apply_promotions()
        if self._promoting:
            self._fail_overdue()
        if self._waiting:
            self._waiting.pop(req_context.req_id, None)
        self._next_round()
        if self.dedupe:
            check_keys(keys)
            keys = [k for k in keys if not self._held_in_epoch(k)]
        out = self.local.prepare_store(keys, req_context)
        if out is None:
            self.stores_rejected += 1
        elif self._num_shards > 1 and out.keys_to_store:
            self._place(out.keys_to_store, req_context)
        self._forward_events()
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.local.complete_store(keys, req_context, success)
        self._forward_events()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.promoter.has_finished():
            self._apply_promotions()
        if self._promoting:
            self._fail_overdue()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        # Running promotions keep writing their reserved rows: abandoned, their rows stay
        # retired until the Promoter reports them. No waiting on the scheduler's thread.
        self._abandoned.update(self._promoting)
        self._promoting.clear()
        self.gate.forget_pulls()
        self._next_overdue = math.inf
        self.local.reset_cache()
        self._failed.clear()
        self._promoted.clear()
        self._forward_events()  # the removals go out under the old epoch's id
        self.cache_epoch += 1
        self._same_epoch.clear()
        self.link.set_info(
            dataclasses.replace(
                self.link.info, replica_id=epoch_replica_id(self._replica_name, self.cache_epoch), cache_epoch=self.cache_epoch
            )
        )

    def expect_step_ends(self) -> None:
        """The owner calls end_step at the end of every scheduler step from now on, so that
        the Directory is asked about a step's misses then, in one call per shard."""
        self.link.expect_step_ends()

    def end_step(self) -> None:
        """The scheduler's step ended (its last call): the Directory is asked about the
        step's misses now, one call per shard, instead of after a delay."""
        self.link.end_step()
        self.gate.step_ended(time.monotonic())

    def request_started(self, req_context: ReqContext) -> None:
        """A request arrived: keep the Directory's answer its router sent with it, if any
        (`kv_transfer_params["distkv"]`), in its state for its lookups."""
        params, own = getattr(req_context, "kv_transfer_params", None), self.link.info.replica_id
        answer = decode(params[PARAMS_KEY], self.link.namespace) if params and PARAMS_KEY in params else False
        if answer is None:
            self.errors.add("routed_answer", "a request carried a Directory answer distkv cannot read")
        elif answer:
            self.routed[answer.kind(own)] += 1
            req_context.set_state(answer.without(own))


    def request_finished(self, req_context: ReqContext) -> None:
        """The request ended: the blocks it found are no longer protected for it."""
        self._waiting.pop(req_context.req_id, None)

    def on_reset_flushed(self) -> None:
        """The engine's jobs in flight at the last reset_cache have all ended: their rows are
        free again (abandoned promotions' rows wait for the Promoter's reports)."""
        self.local.on_reset_flushed(self._abandoned)

    def shutdown(self) -> None:
        self.promoter.close()
        self._apply_promotions()
        self.link.close()
        self.local.shutdown()
        self.closed = True

    # ---- counts ----------------------------------------------------------------------

    @property
    def blocks_stored(self) -> int:
        """Blocks the engine stored here; promoted blocks are counted by the promoter."""
        return self.local.blocks_stored - self._promoted_stored

    def stats(self) -> ReplicaStats:
        """This replica's counts since it started: what `distkv status` shows and the
        metrics exporter exports. Safe to call from any thread: it only reads ints and
        copies small dicts."""
        local, promoter, info = self.local, self.promoter, self.link.info
        self.errors.sync("store_rejected", self.stores_rejected, "prepare_store found no free or evictable row")
        errors, recent = merge_errors((self.errors, promoter.errors, self.link.errors))
        row_bytes = info.num_ranks * info.slot_bytes
        return ReplicaStats(
            namespace=self.link.namespace,
            replica=info.replica_id,
            node=info.node_id,
            time=time.time(),
            lookups=LookupCounts(
                local_hit=int(self.lookups_local_hit),
                remote_hit=int(self.lookups_remote_hit),
                miss=int(self.lookups_miss),
                retry=int(self.lookups_retry),
            ),
            promotions=PromotionCounts(
                started=dict(promoter.started),
                succeeded=dict(promoter.succeeded),
                failed=dict(promoter.failed),
                bytes={"same_node": promoter.bytes_same_node, "cross_node": promoter.bytes_cross_node},
                in_flight=len(self._promoting),
                transports={
                    name: TransportCounts(int(blocks), int(nbytes), seconds)
                    for name, (blocks, nbytes, seconds) in list(promoter.transported.items())
                },
                transport_rates=promoter.transport.rates(),
            ),
            blocks=BlockCounts(stored=self.blocks_stored, evicted=local.blocks_evicted, loaded=dict(self.blocks_loaded)),
            pool=PoolUsage(
                rows=local.num_rows,
                free_rows=local.num_free_rows,
                used_bytes=(local.num_rows - local.num_free_rows) * row_bytes,
                capacity_bytes=local.num_rows * row_bytes,
            ),
            routing=RoutingCounts(dict(self.routed), dict(self.gate.allowed), dict(self.gate.skipped)),
            errors=errors,
            recent_errors=tuple(recent),
            mode=self.mode,
        )

    def drain_observations(self) -> Observations:
        """The promotion latencies, Directory event lags and query times observed since the
        last call (each goes to one caller: the metrics exporter). Safe to call from any thread."""
        link = self.link
        return Observations(_drain(self.promoter.latencies), _drain(link.event_lags), _drain(link.query_times))

    # ---- promotion -------------------------------------------------------------------

    @property
    def promotions_in_flight(self) -> int:
        return len(self._promoting)

    # ---- placement -------------------------------------------------------------------

    def block_shard(self, key: OffloadKey, req_context: ReqContext) -> int:
        """The Directory shard of `key` of the request of `req_context`: its placement
        root's when the key ends at or past the root, so that every replica keeps a whole
        shared prefix on one shard; else (no root yet, no position, a key before the root)
        the key's own."""
        root = self._root(req_context)
        if root is not None:
            end = req_context.get_offload_key_position(key)
            if end is not None and end >= root.end:
                return root.shard
        return shard_of(key, self._num_shards)

    def _root(self, req_context: ReqContext) -> _PlacementRoot | None:
        """The request's placement root, found once and kept in its state. None is not
        kept: a request reaches its first chunk later when it grows by decoding."""
        root = req_context.get_state(_PlacementRoot)
        if root is None:
            found = self.request_root(req_context)
            if found is None:
                return None
            key, end = found
            root = _PlacementRoot(shard_of(key, self._num_shards), end)
            req_context.set_state(root)
        return root

    def _place(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        """Note on the new blocks of `keys` the shard of each (`block_shard`)."""
        blocks, num_shards = self._blocks, self._num_shards
        root = self._root(req_context)
        if root is None:
            for key in keys:
                blocks[key].shard = shard_of(key, num_shards)
            return
        position = req_context.get_offload_key_position
        for key in keys:
            end = position(key)
            blocks[key].shard = root.shard if end is not None and end >= root.end else shard_of(key, num_shards)

    def _held_in_epoch(self, key: OffloadKey) -> bool:
        """Whether another replica of this cache epoch holds `key`: one this replica can promote."""
        return self._in_epoch(self.link.holders(key))

    def _in_epoch(self, holders: Iterable) -> bool:
        """Whether a replica of this cache epoch is among `holders`. An id names one epoch for
        good (`epoch_replica_id`): its answer is kept until this replica's epoch changes."""
        known = self._same_epoch
        for holder in holders:
            same = known.get(holder.replica_id)
            if same is None:
                info = self.link.replica(holder.replica_id)
                if info is None:
                    continue
                if len(known) >= MAX_REPLICA_EPOCHS:
                    known.clear()
                same = known[holder.replica_id] = info.cache_epoch == self.cache_epoch
            if same:
                return True
        return False

    def _defer(self, req_context: ReqContext) -> None:
        """The request's scan answered retry: keep what it found until it is admitted."""
        lapses = time.monotonic() + self.promotion_timeout_s + OVERDUE_GRACE_S
        self._waiting[req_context.req_id] = (self._round, lapses)

    def _next_round(self) -> None:
        """Start a new scan round: protect what lookups find from now on, and what deferred
        requests found since their latest scan."""
        self._round += 1
        protect_from = self._round
        if self._waiting:
            now = time.monotonic()
            for req_id, (found_in, lapses) in list(self._waiting.items()):
                if lapses <= now:
                    del self._waiting[req_id]  # its promotions have ended: a rescan decides
                elif found_in < protect_from:
                    protect_from = found_in
        self._protect_from = protect_from

    def _fail_overdue(self) -> None:
        """Abandon, as misses, the promotions the Promoter has not reported in time."""
        now = time.monotonic()
        if now < self._next_overdue:
            return
        overdue = []
        self._next_overdue = math.inf
        for key, overdue_at in self._promoting.items():
            if overdue_at > now:
                self._next_overdue = overdue_at
                break
            overdue.append(key)
        if not overdue:
            return
        logger.warning("distkv: %d promotions not reported by their deadline, failed as misses", len(overdue))
        self.errors.add("promotion_timeout", f"{len(overdue)} promotion(s) the promoter never reported", len(overdue))
        for key in overdue:
            del self._promoting[key]
            self._failed[key] = now + self.promotion_timeout_s
        self._abandoned.update(overdue)
        self.gate.forget_pulls(overdue)
        self.local.retire(overdue)
        self.lookups_miss += len(overdue)

    def _promote(self, key: OffloadKey, holders, req_context: ReqContext) -> LookupResult:
        """Start promoting `key` from `holders` for the request of `req_context` (whose
        prefix places it): RETRY, or MISS where it cannot start."""
        now = time.monotonic()
        failed_until = self._failed.get(key)
        if failed_until is not None:
            if failed_until > now:
                return MISS
            del self._failed[key]
        if not self._pull_pays(key, holders, req_context):
            return MISS  # recomputing it is expected to be faster
        out = self.local.prepare_store([key], self._promotion_ctx, protect_from=self._protect_from)
        self._forward_events()
        if out is None or not out.keys_to_store:
            return MISS  # no room: compute it instead
        if self._num_shards > 1:
            self._blocks[key].shard = self.block_shard(key, req_context)
        spec = out.store_spec
        deadline = now + self.promotion_timeout_s
        if not self._promoting:
            self._next_overdue = deadline + OVERDUE_GRACE_S
        self._promoting[key] = deadline + OVERDUE_GRACE_S
        self.promoter.submit(
            Promotion(key, int(spec.block_ids[0]), int(spec.generations[0]), holders, deadline, cache_epoch=self.cache_epoch)
        )
        self.gate.submitted(key, req_context.get_state(RequestPull), now)
        return RETRY

    def _pull_pays(self, key: OffloadKey, holders, req_context: ReqContext) -> bool:
        """The gate's decision on the request's run of pullable blocks from `key` on, made once."""
        pull = req_context.get_state(RequestPull)
        if pull is None:
            node = self.link.info.node_id
            answer, blocks, view = req_context.get_state(RoutedAnswer), self._blocks, self._view
            run = prefix_run(
                key,
                self.request_positions(req_context),
                lambda k: k not in blocks and (k in view or (answer is not None and k in answer.holders)),
            )
            pull = self.gate.decide("same_node" if any(h.node_id == node for h in holders) else "cross_node", run)
            req_context.set_state(pull)
        return pull.allowed

    def _apply_promotions(self) -> None:
        retry_at = time.monotonic() + self.promotion_timeout_s
        succeeded, failed, ended = [], [], []
        for key, ok, same_node in self.promoter.finished():
            self.gate.ended(key, ok, time.monotonic())
            if self._promoting.pop(key, None) is None:
                self._abandoned.discard(key)
                ended.append(key)
                continue
            (succeeded if ok else failed).append(key)
            if ok:
                self._promoted[key] = same_node
        if ended:  # abandoned: their retired rows are free again, whatever the outcome
            self.local.complete_store(ended, self._promotion_ctx, success=False)
        self.lookups_remote_hit += len(succeeded)
        self.lookups_miss += len(failed)
        if succeeded:
            stored = self.local.blocks_stored
            self.local.complete_store(succeeded, self._promotion_ctx, success=True)
            if self.local.landed:
                self.link.promoted(self.local.landed)
                self.local.landed = []
            self._promoted_stored += self.local.blocks_stored - stored
        if failed:
            self.local.complete_store(failed, self._promotion_ctx, success=False)
            if len(self._failed) > MAX_FAILED_KEYS:  # keep it bounded: forget what expired
                now = time.monotonic()
                self._failed = {k: t for k, t in self._failed.items() if t > now}
            for key in failed:
                self._failed[key] = retry_at
        self._forward_events()

    # ---- events ----------------------------------------------------------------------

    def _forward_events(self) -> None:
        """Pass the local manager's events on to vLLM and, as holder updates, to the Directory."""
        local = self.local
        # Landed blocks first: among one call's changes a key may land and then go, never
        # the other way round.
        if local.landed:
            self.link.ready(local.landed)
            local.landed = []
        if local.dropped:
            self.link.dropped(local.dropped)
            local.dropped = []
        for event in local.take_events():
            self._events.append(event)
            if event.removed:
                for key in event.keys:
                    self._promoted.pop(key, None)


def _drain(observations: collections.deque) -> list:
    """Everything in `observations` now, oldest first; what its owner appends meanwhile stays."""
    drained = []
    while observations:
        drained.append(observations.popleft())
    return drained
