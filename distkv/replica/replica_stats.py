"""What a replica reports of itself (`ReplicaStats`, for `distkv status` and the metrics
exporter), gathered from its cluster manager's parts."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from distkv.abstract import OffloadKey

from distkv.observability.errors import merge_errors
from distkv.observability.stats import (
    BlockCounts,
    LookupCounts,
    Observations,
    PoolUsage,
    PromotionCounts,
    ReplicaStats,
    TransportCounts,
)

if TYPE_CHECKING:
    from distkv.replica.cluster_manager import ClusterOffloadingManager


class LoadSources:
    """Where the blocks a replica handed to loads came from (`loaded`): its own stores
    ("local"), or promotions from this node or another; a promoted block counts as such
    for its first load only."""

    def __init__(self) -> None:
        self.loaded = {"local": 0, "same_node": 0, "cross_node": 0}
        # promoted blocks no load has used yet, and whether each came from this node
        self._promoted: dict[OffloadKey, bool] = {}

    def promoted(self, blocks: Iterable[tuple[OffloadKey, bool]]) -> None:
        """These blocks were promoted: (key, whether from this node)."""
        self._promoted.update(blocks)

    def load(self, keys: Iterable[OffloadKey]) -> None:
        """A load uses these blocks."""
        loaded, promoted = self.loaded, self._promoted
        for key in keys:
            same_node = promoted.pop(key, None)
            loaded["local" if same_node is None else "same_node" if same_node else "cross_node"] += 1

    def landed(self, same_node: Iterable[bool]) -> None:
        """Blocks were promoted straight into a load, each from this node or another."""
        for near in same_node:
            self.loaded["same_node" if near else "cross_node"] += 1

    def removed(self, keys: Iterable[OffloadKey]) -> None:
        """These blocks left the pool."""
        for key in keys:
            self._promoted.pop(key, None)


def replica_stats(cluster: ClusterOffloadingManager) -> ReplicaStats:
    """The replica's counts since it started. Safe to call from any thread: it only reads
    ints and copies small dicts."""
    local, promoter, link = cluster.local, cluster.promoter, cluster.link
    info = link.info
    cluster.errors.sync("store_rejected", cluster.stores_rejected, "prepare_store found no free or evictable row")
    errors, recent = merge_errors((cluster.errors, promoter.errors, link.errors))
    row_bytes = info.num_ranks * info.slot_bytes
    return ReplicaStats(
        namespace=link.namespace,
        replica=info.replica_id,
        node=info.node_id,
        time=time.time(),
        lookups=LookupCounts(
            local_hit=int(cluster.lookups_local_hit),
            remote_hit=int(cluster.lookups_remote_hit),
            miss=int(cluster.lookups_miss),
            retry=int(cluster.lookups_retry),
        ),
        promotions=PromotionCounts(
            started=dict(promoter.started),
            succeeded=dict(promoter.succeeded),
            failed=dict(promoter.failed),
            bytes={"same_node": promoter.bytes_same_node, "cross_node": promoter.bytes_cross_node},
            in_flight=cluster.promotions_in_flight,
            transports={
                name: TransportCounts(int(blocks), int(nbytes), seconds)
                for name, (blocks, nbytes, seconds) in list(promoter.transported.items())
            },
            transport_rates=promoter.transport.rates(),
        ),
        blocks=BlockCounts(stored=cluster.blocks_stored, evicted=local.blocks_evicted, loaded=dict(cluster.blocks_loaded)),
        pool=PoolUsage(
            rows=local.num_rows,
            free_rows=local.num_free_rows,
            used_bytes=(local.num_rows - local.num_free_rows) * row_bytes,
            capacity_bytes=local.num_rows * row_bytes,
        ),
        routing=cluster.pulls.counts(),
        errors=errors,
        recent_errors=tuple(recent),
        mode=cluster.mode,
    )


def drain_observations(cluster: ClusterOffloadingManager) -> Observations:
    """The promotion latencies, Directory event lags and query times observed since the
    last call (each goes to one caller: the metrics exporter). Safe to call from any thread."""
    link = cluster.link
    return Observations(_drain(cluster.promoter.latencies), _drain(link.event_lags), _drain(link.query_times))


def _drain(observations: collections.deque) -> list:
    """Everything in `observations` now, oldest first; what its owner appends meanwhile stays."""
    drained = []
    while observations:
        drained.append(observations.popleft())
    return drained
