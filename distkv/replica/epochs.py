"""A replica's cache epoch: which other replicas' blocks it may use.

A reset (new weights) moves a replica to its next cache epoch, under a new id
(`distkv.names.epoch_replica_id`), and a replica promotes only from replicas of its own
epoch, so that blocks computed before a weight update are never loaded after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from distkv.directory.records import Holder, ReplicaInfo
from distkv.names import epoch_replica_id

# Replica ids whose cache epoch is remembered (`CacheEpoch.in_epoch`) at most.
MAX_REPLICA_EPOCHS = 1 << 16


class CacheEpoch:
    """This replica's cache epoch (`epoch`, from its `info` at start), and whether holders
    are of it. `replica` gives a holder's info (the link's view). An id names one epoch for
    good, so the answer for each id is kept until this replica's epoch changes (`advance`)."""

    def __init__(self, info: ReplicaInfo, replica: Callable[[str], ReplicaInfo | None]) -> None:
        self.epoch = info.cache_epoch
        self._name = info.replica_id  # the id of its first epoch, which later ones derive
        self._replica = replica
        # replica id -> whether it is of this cache epoch
        self._same: dict[str, bool] = {}

    def in_epoch(self, holders: Iterable[Holder]) -> bool:
        """Whether a replica of this cache epoch is among `holders`."""
        known = self._same
        for holder in holders:
            same = known.get(holder.replica_id)
            if same is None:
                info = self._replica(holder.replica_id)
                if info is None:
                    continue
                if len(known) >= MAX_REPLICA_EPOCHS:
                    known.clear()
                same = known[holder.replica_id] = info.cache_epoch == self.epoch
            if same:
                return True
        return False

    def advance(self, info: ReplicaInfo) -> ReplicaInfo:
        """Move to the next epoch: this replica's `info` under the new epoch's id and number."""
        self.epoch += 1
        self._same.clear()
        return dataclasses.replace(info, replica_id=epoch_replica_id(self._name, self.epoch), cache_epoch=self.epoch)
