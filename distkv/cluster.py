"""ClusterOffloadingManager: a replica's manager, its own pool first, then the cluster's."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable

from distkv.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from distkv.config import STORE_POLICIES
from distkv.directory import DirectoryLink
from distkv.manager import MAX_KEY_BYTES, MIN_KEY_BYTES, LocalOffloadingManager, check_keys, key_problem
from distkv.metrics import ErrorLog, merge_errors
from distkv.promotion import Promoter, Promotion

logger = logging.getLogger(__name__)

# Failed promotions remembered (so that lookups answer a miss, not a new try) at most.
MAX_FAILED_KEYS = 1 << 16


class ClusterOffloadingManager(OffloadingManager):
    """The seed OffloadingManager of one replica in a cluster.

    Wraps the replica's LocalOffloadingManager and adds what other replicas hold:
    - lookup of a key absent locally but held elsewhere (per the replica's view of the
      Directory) reserves a local row and starts a promotion; lookups answer None until
      the block is local (then True), or False once the promotion failed or timed out;
    - every stored and removed block is reported to the Directory, batched, from the
      DirectoryLink's thread.
    Nothing here waits on the network: the view is an in-process dict, promotions and
    publishing run on background threads, and their results are applied here, on the
    scheduler's thread, at the next call.
    """

    def __init__(
        self,
        local: LocalOffloadingManager,
        link: DirectoryLink,
        promoter: Promoter,
        store_policy: str = "always",
        promotion_timeout_s: float = 5.0,
    ):
        if store_policy not in STORE_POLICIES:
            raise ValueError(f"store_policy={store_policy!r} must be one of {list(STORE_POLICIES)}")
        if promotion_timeout_s <= 0:
            raise ValueError(f"promotion_timeout_s={promotion_timeout_s} must be positive")
        self.local = local
        local.landed = []
        self._blocks = local.blocks
        self._view = link.view
        self.link = link
        self.promoter = promoter
        self.dedupe = store_policy == "dedupe"
        self.promotion_timeout_s = promotion_timeout_s
        self._events: list[OffloadingEvent] = []
        # keys whose promotion failed, and until when lookups answer False for them
        self._failed: dict[OffloadKey, float] = {}
        self._promoting: set[OffloadKey] = set()
        # promoted blocks no load has used yet, and whether each came from this node
        self._promoted: dict[OffloadKey, bool] = {}
        # blocks handed to loads so far, by where they came from
        self.blocks_loaded = {"local": 0, "same_node": 0, "cross_node": 0}
        self._promotion_ctx = ReqContext(req_id="distkv-promotion")
        # Counts for metrics and `distkv status` (see stats). A lookup that starts a
        # promotion is counted when the promotion ends: a remote hit if it succeeded, else
        # a miss. Floats (exact to 2**53), because CPython reuses freed floats while each
        # int past 256 is a new allocation: a miss took 118 ns counting in an int and 111
        # in a float, against 75 for the local manager.
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
        # As few steps as Python allows: a promotion in flight always has a local block,
        # so a key without one needs only the view.
        try:
            block = self._blocks.get(key)
        except TypeError:  # unhashable, so not bytes
            raise ValueError(key_problem(key)) from None
        if block is not None:
            if block.refs >= 0:
                self.lookups_local_hit += 1.0
                return True
            return self._lookup_in_flight(key, req_context)
        if key not in self._view:  # `in` costs no call, and this is the common miss
            if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                raise ValueError(key_problem(key))
            self.lookups_miss += 1.0
            return False
        holders = self._view.get(key)  # None if it left the view since
        hit = self._promote(key, holders) if holders else False
        if hit is False:
            self.lookups_miss += 1.0
        return hit

    def _lookup_in_flight(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """A local block whose store or promotion has not completed, as of the last check."""
        if self.promoter.has_finished():
            self._apply_promotions()
        hit = self.local.lookup(key, req_context)
        if hit:
            self.lookups_local_hit += 1.0
            return True
        if hit is None:
            self.lookups_retry += 1.0
            return None
        self.lookups_miss += 1.0  # its promotion just failed
        return False

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.local.prepare_load(keys, req_context)
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
        if self.dedupe:
            check_keys(keys)
            keys = [k for k in keys if not self.link.holders(k)]
        out = self.local.prepare_store(keys, req_context)
        if out is None:
            self.stores_rejected += 1
        self._forward_events()
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.local.complete_store(keys, req_context, success)
        self._forward_events()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.promoter.has_finished():
            self._apply_promotions()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        # A promotion fills its reserved row from the Promoter's thread: let the running
        # ones end (each does within promotion_timeout_s) before the reset frees rows that
        # new stores may then reuse.
        deadline = time.monotonic() + self.promotion_timeout_s + 1.0
        while self._promoting and time.monotonic() < deadline:
            time.sleep(0.001)
            self._apply_promotions()
        if self._promoting:
            logger.warning("distkv: resetting with %d promotions still running", len(self._promoting))
        self.local.reset_cache()
        self._failed.clear()
        self._promoted.clear()
        self._forward_events()

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

    def stats(self) -> dict:
        """This replica's counts since it started: what `distkv status` shows and the
        metrics exporter exports. Safe to call from any thread: it only reads ints and
        copies small dicts."""
        local, promoter, info = self.local, self.promoter, self.link.info
        self.errors.sync("store_rejected", self.stores_rejected, "prepare_store found no free or evictable row")
        errors, recent = merge_errors((self.errors, promoter.errors, self.link.errors))
        row_bytes = info.num_ranks * info.slot_bytes
        return {
            "namespace": self.link.namespace,
            "replica": info.replica_id,
            "node": info.node_id,
            "time": time.time(),
            "lookups": {
                "local_hit": int(self.lookups_local_hit),
                "remote_hit": int(self.lookups_remote_hit),
                "miss": int(self.lookups_miss),
                "retry": int(self.lookups_retry),
            },
            "promotions": {
                "started": dict(promoter.started),
                "succeeded": dict(promoter.succeeded),
                "failed": dict(promoter.failed),
                "bytes": {"same_node": promoter.bytes_same_node, "cross_node": promoter.bytes_cross_node},
                "in_flight": len(self._promoting),
            },
            "blocks": {
                "stored": self.blocks_stored,
                "evicted": local.blocks_evicted,
                "loaded": dict(self.blocks_loaded),
            },
            "pool": {
                "rows": local.num_rows,
                "free_rows": local.num_free_rows,
                "used_bytes": (local.num_rows - local.num_free_rows) * row_bytes,
                "capacity_bytes": local.num_rows * row_bytes,
            },
            "errors": errors,
            "recent_errors": recent,
        }

    # ---- promotion -------------------------------------------------------------------

    @property
    def promotions_in_flight(self) -> int:
        return len(self._promoting)

    def is_promoting(self, key: OffloadKey) -> bool:
        """Whether `key` is being promoted: its local row is reserved and not yet filled."""
        return key in self._promoting

    def _promote(self, key: OffloadKey, holders) -> bool | None:
        now = time.monotonic()
        failed_until = self._failed.get(key)
        if failed_until is not None:
            if failed_until > now:
                return False
            del self._failed[key]
        out = self.local.prepare_store([key], self._promotion_ctx)
        self._forward_events()
        if out is None or not out.keys_to_store:
            return False  # no room: compute it instead
        spec = out.store_spec
        self._promoting.add(key)
        self.promoter.submit(
            Promotion(key, int(spec.block_ids[0]), int(spec.generations[0]), holders, now + self.promotion_timeout_s)
        )
        return None

    def _apply_promotions(self) -> None:
        retry_at = time.monotonic() + self.promotion_timeout_s
        succeeded, failed = [], []
        for key, ok, same_node in self.promoter.finished():
            self._promoting.discard(key)
            (succeeded if ok else failed).append(key)
            if ok:
                self._promoted[key] = same_node
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
        for event in local.take_events():
            self._events.append(event)
            if event.removed:
                self.link.removed(event.keys)
                for key in event.keys:
                    self._promoted.pop(key, None)
