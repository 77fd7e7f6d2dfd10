"""The `store_policy` setting: which of the blocks an engine offers a replica stores.

"always": the cluster manager stores every block it is offered. "dedupe": it is wrapped in
`SkipHeldElsewhere`, which offers it none that another replica of its cache epoch holds
(less host memory across the cluster; a hit on such a block here costs a promotion).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from distkv.abstract import LoadStoreSpec, OffloadingEvent, OffloadingManager, OffloadKey, PrepareStoreOutput, ReqContext
from distkv.config import STORE_POLICIES
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.storage.keys import check_keys


class SkipHeldElsewhere(OffloadingManager):
    """A cluster manager that stores no block another replica of its cache epoch holds,
    as the Directory's view says when the store is offered: its prepare_store leaves
    those keys out. Everything else is the wrapped manager's (`cluster`): the seed API's
    calls go to it, and so does any other attribute (`link`, `stats`, ...). Its lookups
    are the cluster manager's bound methods, set on the instance, so that the hot path
    has no frame of this wrapper's."""

    def __init__(self, cluster: ClusterOffloadingManager) -> None:
        self.cluster = cluster
        self.lookup = cluster.lookup
        self.lookup_result = cluster.lookup_result

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        check_keys(keys)
        cluster = self.cluster
        in_epoch, holders = cluster.epoch.in_epoch, cluster.link.holders
        return cluster.prepare_store([k for k in keys if not in_epoch(holders(k))], req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:  # the instance's is the cluster's
        return self.cluster.lookup(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self.cluster.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cluster.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cluster.complete_load(keys, req_context)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.cluster.complete_store(keys, req_context, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.cluster.take_events()

    def reset_cache(self) -> None:
        self.cluster.reset_cache()

    def shutdown(self) -> None:
        self.cluster.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cluster, name)


def with_store_policy(cluster: ClusterOffloadingManager, store_policy: str) -> OffloadingManager:
    """The manager of `store_policy` over `cluster`; ValueError naming the setting for
    anything but one of STORE_POLICIES."""
    if store_policy not in STORE_POLICIES:
        raise ValueError(f"store_policy={store_policy!r} must be one of {list(STORE_POLICIES)}")
    return SkipHeldElsewhere(cluster) if store_policy == "dedupe" else cluster
