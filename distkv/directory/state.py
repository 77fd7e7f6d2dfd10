"""A shard's state: which replicas of a cache namespace hold which of the shard's blocks.

`DirectoryState` is one shard of the cluster-wide index `OffloadKey -> holders`; its
`ChangeLog` (`distkv.directory.changelog`) numbers every change so that followers replay
them to keep a copy (`distkv.directory.views.ShardView`), and a follower that cannot
replay gets a snapshot (`distkv.directory.snapshot`). Plain data and logic, no Ray:
`ray_actors.directory` wraps a state in an actor per shard.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from distkv.abstract import OffloadKey
from distkv.directory.changelog import ChangeLog
from distkv.directory.records import (
    Changes,
    Cursor,
    HolderFields,
    Relayed,
    ReplicaInfo,
    StoredEntry,
    drop_holder,
    with_holder,
)
from distkv.directory import feed
from distkv.directory.feed import ChangeFeed
from distkv.directory.snapshot import Snapshot, SnapshotBuilder
from distkv.directory.wire import MAX_RELAYED_PUBLISHES, check_stored, decode_changes
from distkv.storage.keys import check_keys

# A shard asks each replica to leave this long between its calls at least, so that a
# lone change goes at once...
FLUSH_INTERVAL_S = 0.003
# ...and at most this long, whatever the load: a replica's calls are its heartbeats too,
# and a shard drops a replica silent for a few of these.
MAX_FLUSH_INTERVAL_S = 2.0
# What a shard's replicas together may send it, in calls a second: a publish costs a shard
# Ray's cost per call, not the state's work (docs/scale.md), so the shard paces its replicas
# to this many calls and batches what they send in between.
SHARD_PUBLISHES_PER_S = 250


def publish_interval(num_replicas: int) -> float:
    """How long each of a shard's `num_replicas` replicas should leave between its calls:
    their count over SHARD_PUBLISHES_PER_S, within [FLUSH_INTERVAL_S, MAX_FLUSH_INTERVAL_S]."""
    return min(MAX_FLUSH_INTERVAL_S, max(FLUSH_INTERVAL_S, num_replicas / SHARD_PUBLISHES_PER_S))


class _Replica:
    __slots__ = ("info", "keys", "last_seq", "last_seen", "report")

    def __init__(self, info: ReplicaInfo, now: float) -> None:
        self.info = info
        self.keys: set[OffloadKey] = set()
        self.last_seq = 0
        self.last_seen = now
        self.report: dict | None = None  # its latest stats, as its link sent them


# A shard's holders are split over this many dicts by key hash. A dict grows, or sheds the
# slots of removed keys, by rebuilding its whole table in one step, holding the GIL
# throughout: one dict of millions of keys would stop the shard from answering for a good
# part of a second at each rebuild (docs/benchmarks.md). A partition rebuilds only its share.
HOLDER_PARTITIONS = 256
_PARTITION_MASK = HOLDER_PARTITIONS - 1


class DirectoryState:
    """One shard of the Directory: the holders of every key of the shard.

    Replicas register, then publish numbered batches of stored and removed keys; a batch
    whose number is not greater than the last one applied for that replica is a retry
    and is ignored. Every change lands in a log of about `log_capacity` keys that
    followers read with `changes`, MAX_ANSWER_KEYS at a time; a follower whose cursor
    fell off the log, or comes from another epoch (an earlier incarnation of the shard),
    gets a snapshot instead: the answers are its `ChangeFeed`'s.
    """

    def __init__(self, log_capacity: int = 1 << 18, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = ChangeLog(log_capacity)
        self.epoch = self._log.epoch
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        # HOLDER_PARTITIONS dicts; a key's is self._holders[hash(key) & _PARTITION_MASK]
        self._holders: list[dict[OffloadKey, tuple[HolderFields, ...]]] = [{} for _ in range(HOLDER_PARTITIONS)]
        self._num_holders = 0
        self._ops = collections.Counter()
        self._feed = ChangeFeed(self._log, self.replica_infos, self.snapshot_builder)

    def register(self, info: ReplicaInfo) -> None:
        """Add a replica, holding nothing. A replica registered again loses its holders."""
        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"register: {info!r} is not a ReplicaInfo")
        old = self._replicas.get(info.replica_id)
        if old is not None:
            self._drop(old)
        self._replicas[info.replica_id] = _Replica(info, self._clock())
        self._log.replicas_changed()
        self._ops["registers"] += 1

    def publish_interval(self) -> float:
        """The interval this shard asks of each replica between calls (`publish_interval`)."""
        return publish_interval(len(self._replicas))

    def unregister(self, replica_id: str) -> bool:
        """Drop a replica and its holders; whether it was registered."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        self._drop(replica)
        self._ops["unregisters"] += 1
        return True

    def publish(
        self, replica_id: str, seq: int, stored: Sequence[StoredEntry], removed: Sequence[OffloadKey]
    ) -> bool:
        """Apply batch `seq` of a replica's changes (removed first, then stored).

        Returns whether the replica is registered; when it is not, nothing is applied
        and the replica should register and publish all it holds. Any publish, empty or
        a retry, counts as a heartbeat.
        """
        replica = self._replicas.get(replica_id)
        if replica is None:
            self._ops["unknown_publishes"] += 1
            return False
        if not isinstance(seq, int):
            raise ValueError(f"publish: seq {seq!r} is not an int")
        check_stored(stored, replica.info.num_rows)
        check_keys(removed)
        replica.last_seen = self._clock()
        if seq <= replica.last_seq:
            self._ops["ignored_publishes"] += 1
            return True
        replica.last_seq = seq
        self._ops["publishes"] += 1
        if not stored and not removed:
            return True
        parts = self._holders
        keys = replica.keys
        for key in removed:
            if key in keys:
                keys.remove(key)
                drop_holder(parts[hash(key) & _PARTITION_MASK], key, replica_id)
                self._num_holders -= 1
        node_id = replica.info.node_id
        added = 0
        for key, row, generation in stored:
            holder = (replica_id, node_id, row, generation)
            holders = parts[hash(key) & _PARTITION_MASK]
            current = holders.get(key)
            if current is None:
                holders[key] = (holder,)
                keys.add(key)
                added += 1
            elif len(current) == 1 and current[0][0] == replica_id:
                holders[key] = (holder,)
            else:
                if key not in keys:
                    keys.add(key)
                    added += 1
                holders[key] = with_holder(current, holder)
        self._num_holders += added
        self._ops["stored"] += len(stored)
        self._ops["removed"] += len(removed)
        self._log.append((replica_id, node_id, list(stored), list(removed)))
        return True

    def publish_relayed(self, items: Sequence[Relayed], *, continued: bool = False) -> list[bool | str]:
        """Apply the publishes a relay carried in one call, each as its own `publish` (and
        `set_report`): per item, whether its replica is registered, or why the item was
        refused (a str; that item changed nothing, the others are applied all the same).
        `continued`: these items go on a call whose first items an earlier `publish_relayed`
        applied (they count as no call of their own)."""
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"publish_relayed: items {type(items).__name__} is not a list")
        if len(items) > MAX_RELAYED_PUBLISHES:
            raise ValueError(f"publish_relayed: {len(items)} publishes, over {MAX_RELAYED_PUBLISHES} a call")
        results: list[bool | str] = []
        for item in items:
            try:
                replica_id, seq, changes, report = item
                stored, removed = decode_changes(changes, f"replica {replica_id!r:.80}'s relayed publish")
                if report is not None and not isinstance(report, dict):
                    raise ValueError(f"report {report!r} is not a dict")
                known = self.publish(replica_id, seq, stored, removed)
            except Exception as e:  # one replica's bad publish must not refuse the node's others
                results.append(f"relayed publish {str(item)[:80]}: {type(e).__name__}: {e}")
                continue
            if known and report is not None:
                self.set_report(replica_id, report)
            results.append(known)
        self._ops["relay_calls"] += not continued
        self._ops["relayed_publishes"] += len(items)
        return results

    def set_report(self, replica_id: str, report: dict) -> bool:
        """Keep a registered replica's latest stats (what `distkv status` shows); whether it is registered."""
        if not isinstance(report, dict):
            raise ValueError(f"set_report: report {report!r} is not a dict")
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        replica.report = report
        return True

    def replicas(self) -> list[dict[str, Any]]:
        """Every registered replica: its ReplicaInfo's fields (the endpoint only as whether
        it has one: this answers any caller, and the endpoint lets one read the pool), the
        keys it holds in this shard, seconds since it was last heard from, and its latest
        report (None before one)."""
        now = self._clock()
        return [
            {
                **asdict(r.info),
                "endpoint": r.info.endpoint is not None,
                "keys": len(r.keys),
                "seen_s_ago": now - r.last_seen,
                "report": r.report,
            }
            for r in self._replicas.values()
        ]

    def replica_ids(self) -> list[str]:
        """The ids of the registered replicas."""
        return list(self._replicas)

    def keys_of(self, replica_id: str) -> list[OffloadKey] | None:
        """The keys a registered replica holds in this shard; None if it is not registered."""
        replica = self._replicas.get(replica_id)
        return None if replica is None else list(replica.keys)

    def entries_of(self, replica_id: str, keys: Sequence[OffloadKey]) -> tuple[str, list[StoredEntry]] | None:
        """(node, the (key, row, generation) of each of `keys` it still holds) of a
        registered replica; None if it is not registered."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return None
        parts = self._holders
        stored = [
            (key, holder[2], holder[3])
            for key in keys
            for holder in parts[hash(key) & _PARTITION_MASK].get(key, ())
            if holder[0] == replica_id
        ]
        return replica.info.node_id, stored

    def query(self, keys: Sequence[OffloadKey]) -> list[tuple[HolderFields, ...]]:
        """The holders of each key, in order, as Holder fields; () for a key nobody holds."""
        check_keys(keys)
        self._ops["queries"] += 1
        self._ops["queried_keys"] += len(keys)
        parts = self._holders
        return [parts[hash(key) & _PARTITION_MASK].get(key, ()) for key in keys]

    def answer(self, keys: Sequence[OffloadKey]) -> tuple[list[tuple[HolderFields, ...]], dict[str, ReplicaInfo]]:
        """What a queried link asks: `query`'s holders of each key, and the ReplicaInfo of
        every replica they name, so that the asker can read those replicas' pools without
        following the shard's replica set."""
        holders = self.query(keys)
        replicas = self._replicas
        named: dict[str, ReplicaInfo] = {}
        for key_holders in holders:
            for holder in key_holders:
                replica_id = holder[0]
                if replica_id not in named:
                    named[replica_id] = replicas[replica_id].info
        return holders, named

    def drop_node(self, node_id: str) -> list[str]:
        """Drop every replica on a node (it died) with its holders; the ids of those dropped."""
        return self.drop_nodes(frozenset((node_id,)))

    def drop_nodes(self, node_ids: frozenset[str]) -> list[str]:
        """Drop every replica on any of `node_ids` (they died) with its holders, in one pass
        over the replicas; the ids of those dropped."""
        dropped = [r for r in self._replicas.values() if r.info.node_id in node_ids]
        for replica in dropped:
            self._drop(replica)
        self._ops["dropped_replicas"] += len(dropped)
        return [r.info.replica_id for r in dropped]

    def expire(self, now: float, timeout_s: float) -> list[str]:
        """Drop every replica not heard from in more than `timeout_s`; the ids of those dropped."""
        silent = [r for r in self._replicas.values() if now - r.last_seen > timeout_s]
        for replica in silent:
            self._drop(replica)
        self._ops["expired_replicas"] += len(silent)
        return [r.info.replica_id for r in silent]

    def cursor(self) -> Cursor:
        """The cursor of a follower that has seen every change so far."""
        return self._log.cursor()

    def has_news(self, cursor: Cursor | None, follower: str | None = None) -> bool:
        """Whether `changes(cursor)` holds something besides `follower`'s own log entries:
        a follower's link already knows what its replica published."""
        return self._log.has_news(cursor, follower)

    def changes(self, cursor: Cursor | None) -> Changes:
        """The changes after `cursor` (`ChangeFeed.changes`)."""
        return self._feed.changes(cursor)

    def packed_changes(self, cursor: Cursor | None) -> bytes:
        """`pack(self.changes(cursor))`, packed once (`ChangeFeed.packed_changes`)."""
        return self._feed.packed_changes(cursor)

    def packed_from_log(self, cursor: Cursor | None) -> bytes | None:
        """`packed_changes(cursor)` when it needs no snapshot built, else None (`ChangeFeed`)."""
        return self._feed.packed_from_log(cursor)

    def snapshot_builder(self) -> SnapshotBuilder:
        """A snapshot to build a step at a time, from the state's cursor now (`SnapshotBuilder`)."""
        self._ops["snapshots"] += 1
        return SnapshotBuilder(self)

    def keep_snapshot(self, snapshot: Snapshot) -> None:
        """Answer the followers that need a snapshot with `snapshot` (`ChangeFeed`)."""
        self._feed.keep_snapshot(snapshot)

    def drop_stale_snapshot(self) -> None:
        """Let go of the kept snapshot once its cursor fell off the log (`ChangeFeed`)."""
        self._feed.drop_stale_snapshot()

    def snapshot_answer(self, snapshot: Snapshot) -> Changes | None:
        """The `changes` answer of a snapshot (`ChangeFeed.snapshot_answer`)."""
        return self._feed.snapshot_answer(snapshot)

    @property
    def stored_keys(self) -> int:
        """Keys stored since the start, in every publish and register (`stats()["stored"]`)."""
        return self._ops["stored"]

    def stats(self) -> dict[str, int]:
        """Sizes (keys, holders, replicas, log entries) and operation counts."""
        return {
            "keys": sum(map(len, self._holders)),
            "holders": self._num_holders,
            "replicas": len(self._replicas),
            "log_entries": len(self._log),
            **self._ops,
        }

    def replica_infos(self) -> dict[str, ReplicaInfo]:
        """Every registered replica's info."""
        return {replica_id: r.info for replica_id, r in self._replicas.items()}

    def _drop(self, replica: _Replica) -> None:
        replica_id = replica.info.replica_id
        parts = self._holders
        for key in replica.keys:
            drop_holder(parts[hash(key) & _PARTITION_MASK], key, replica_id)
        self._num_holders -= len(replica.keys)
        keys = list(replica.keys)
        step = feed.MAX_ANSWER_KEYS  # entries that fit in an answer
        for i in range(0, len(keys), step):
            self._log.append((replica_id, replica.info.node_id, [], keys[i : i + step]))
        del self._replicas[replica_id]
        self._log.replicas_changed()


