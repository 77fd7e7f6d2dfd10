"""The Directory: which replicas of a cache namespace hold which offloaded blocks.

`DirectoryState` is one shard of the cluster-wide index `OffloadKey -> holders`, with a
bounded change log that followers replay to keep a local copy. `ray_actors.directory`
wraps it in a Ray actor per shard. `DirectoryLink` is what one replica holds: it
publishes the replica's stores and evictions and keeps a view of everyone else's,
doing all its Ray traffic on one background thread so that no caller ever waits on
the network.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import pickle
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol

from distkv.abstract import OffloadKey
from distkv.manager import MIN_KEY_BYTES, check_keys, key_problem
from distkv.errors import ErrorLog
from distkv.metrics import MAX_OBSERVATIONS
from distkv.pool import MAX_KEY_BYTES
from distkv.rdma import PoolEndpoint

logger = logging.getLogger(__name__)

# (key, row, generation): a block this replica made loadable in one of its pool's rows.
StoredEntry = tuple[OffloadKey, int, int]


class ReadyBlock(Protocol):
    """A block of the replica's block table, as `DirectoryLink.ready` takes it."""

    row: int
    generation: int


# (replica_id, node_id, stored, removed): one replica's change, stored applied after removed.
LogEntry = tuple[str, str, list[StoredEntry], list[OffloadKey]]
# A Holder's fields in a plain tuple, as the Directory keeps and sends them: a plain tuple
# pickles without a Python call, several times faster than a NamedTuple.
HolderFields = tuple[str, str, int, int]


class Holder(NamedTuple):
    """A replica holding a block: in row `row` of its pool, sealed with `generation`."""

    replica_id: str
    node_id: str
    row: int
    generation: int


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica that holds blocks, and the layout of its pool so a reader can map its rows.

    `cache_epoch` counts the replica's cache resets: replicas share blocks only within one
    epoch. It is part of the replica's id too (see ClusterOffloadingManager), so an id's
    info never changes and no view can pair a holder with another epoch's info.
    `endpoint`: where its pool can be read one-sidedly (NIXL), if it registered it; the
    Directory hands it only to replicas of the same cache namespace.
    """

    replica_id: str
    node_id: str
    pool_name: str
    num_rows: int
    num_ranks: int
    slot_bytes: int
    cache_epoch: int = 0
    endpoint: PoolEndpoint | None = None

    def __post_init__(self) -> None:
        for name in ("replica_id", "node_id", "pool_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"ReplicaInfo.{name}={value!r}: must be a non-empty str")
        for name in ("num_rows", "num_ranks", "slot_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ReplicaInfo.{name}={value!r}: must be a positive int")
        if type(self.cache_epoch) is not int or self.cache_epoch < 0:
            raise ValueError(f"ReplicaInfo.cache_epoch={self.cache_epoch!r}: must be an int >= 0")
        if self.endpoint is not None and not isinstance(self.endpoint, PoolEndpoint):
            raise ValueError(f"ReplicaInfo.endpoint={self.endpoint!r}: must be a PoolEndpoint or None")


class Cursor(NamedTuple):
    """How far a follower has read a shard's changes."""

    epoch: str
    position: int
    replicas_version: int


class Changes(NamedTuple):
    """What a follower at some cursor has not seen yet.

    `entries` are applied in order; when `is_snapshot` they describe the whole shard and
    replace what the follower had. `replicas` is every registered replica, or None when
    that set did not change since the cursor.
    """

    cursor: Cursor
    entries: list[LogEntry]
    replicas: dict[str, ReplicaInfo] | None
    is_snapshot: bool


def pack(payload: object) -> bytes:
    """A bulk payload (stored entries, changes, query answers) as it crosses Ray.

    Ray's cloudpickle runs a Python hook for every tuple and list in a payload (~0.7 us
    each, most of a 1k-key call); the C pickler does not, so bulk payloads travel as
    its bytes.
    """
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """The payload `pack` made `data` from."""
    return pickle.loads(data)


def check_namespace(serves: str, namespace: object, who: str) -> None:
    """Refuse a call made for cache namespace `namespace` to `who`, which serves `serves`.

    A call naming another namespace (or none) is a ValueError, so that a replica never
    reads or writes another namespace's blocks.
    """
    if namespace != serves:
        raise ValueError(f"{who} serves cache namespace {serves!r} and refuses a call for namespace {namespace!r}")


def shard_of(key: OffloadKey, num_shards: int) -> int:
    """The shard of `key` among `num_shards`. Keys start with a hash, so its leading bytes spread evenly."""
    return int.from_bytes(key[:8], "big") % num_shards


def check_stored(entries: Iterable[object], num_rows: int) -> None:
    """Raise ValueError naming the first entry that is not a (key, row, generation) of a pool of `num_rows`."""
    for entry in entries:
        # one test for the common case: this runs per block the replica stores
        if (
            type(entry) is tuple
            and len(entry) == 3
            and type(entry[0]) is bytes
            and MIN_KEY_BYTES <= len(entry[0]) <= MAX_KEY_BYTES
            and type(entry[1]) is int
            and 0 <= entry[1] < num_rows
            and type(entry[2]) is int
        ):
            continue
        try:
            key, row, generation = entry
        except (TypeError, ValueError):
            raise ValueError(f"stored entry {entry!r} is not a (key, row, generation) triple") from None
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(problem)
        if not isinstance(row, int) or not 0 <= row < num_rows:
            raise ValueError(f"stored entry {entry!r}: row {row!r} is not an int in 0..{num_rows - 1}")
        if not isinstance(generation, int):
            raise ValueError(f"stored entry {entry!r}: generation {generation!r} is not an int")


def _with_holder(current: tuple[HolderFields, ...] | None, holder: HolderFields) -> tuple[HolderFields, ...]:
    """`current` with `holder` in place of any earlier holder of the same replica (field 0)."""
    if current is None:
        return (holder,)
    replica_id = holder[0]
    return tuple(h for h in current if h[0] != replica_id) + (holder,)


def _drop_holder(holders: dict[OffloadKey, tuple[HolderFields, ...]], key: OffloadKey, replica_id: str) -> None:
    current = holders.get(key)
    if current is None:
        return
    rest = tuple(h for h in current if h[0] != replica_id)
    if rest:
        holders[key] = rest
    else:
        del holders[key]


class _Replica:
    __slots__ = ("info", "keys", "last_seq", "last_seen", "report")

    def __init__(self, info: ReplicaInfo, now: float) -> None:
        self.info = info
        self.keys: set[OffloadKey] = set()
        self.last_seq = 0
        self.last_seen = now
        self.report: dict | None = None  # its latest stats, as its link sent them


class DirectoryState:
    """One shard of the Directory: the holders of every key of the shard.

    Replicas register, then publish numbered batches of stored and removed keys; a batch
    whose number is not greater than the last one applied for that replica is a retry
    and is ignored. Every change lands in a log of about `log_capacity` keys that
    followers read with `changes`; a follower whose cursor fell off the log, or comes
    from another epoch (an earlier incarnation of the shard), gets a snapshot instead.
    """

    def __init__(self, log_capacity: int = 1 << 18, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(log_capacity, int) or log_capacity < 1:
            raise ValueError(f"log_capacity={log_capacity!r}: must be a positive int")
        self.epoch = random.randbytes(8).hex()
        self._clock = clock
        self._log_capacity = log_capacity
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[OffloadKey, tuple[HolderFields, ...]] = {}
        self._num_holders = 0
        self._replicas_version = 0
        self._log: collections.deque[LogEntry] = collections.deque()
        self._log_start = 0  # position of _log[0]
        self._log_keys = 0
        # the position and replica of the latest entry, and the position of the latest
        # entry by another replica than that: `has_news` in O(1)
        self._last_entry: tuple[int, str | None] = (-1, None)
        self._last_other = -1
        self._ops = collections.Counter()

    def register(self, info: ReplicaInfo) -> None:
        """Add a replica, holding nothing. A replica registered again loses its holders."""
        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"register: {info!r} is not a ReplicaInfo")
        old = self._replicas.get(info.replica_id)
        if old is not None:
            self._drop(old)
        self._replicas[info.replica_id] = _Replica(info, self._clock())
        self._replicas_version += 1
        self._ops["registers"] += 1

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
        holders = self._holders
        keys = replica.keys
        for key in removed:
            if key in keys:
                keys.remove(key)
                _drop_holder(holders, key, replica_id)
                self._num_holders -= 1
        node_id = replica.info.node_id
        added = 0
        for key, row, generation in stored:
            holder = (replica_id, node_id, row, generation)
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
                holders[key] = _with_holder(current, holder)
        self._num_holders += added
        self._ops["stored"] += len(stored)
        self._ops["removed"] += len(removed)
        self._append((replica_id, node_id, list(stored), list(removed)))
        return True

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

    def query(self, keys: Sequence[OffloadKey]) -> list[tuple[HolderFields, ...]]:
        """The holders of each key, in order, as Holder fields; () for a key nobody holds."""
        check_keys(keys)
        self._ops["queries"] += 1
        self._ops["queried_keys"] += len(keys)
        get = self._holders.get
        return [get(key, ()) for key in keys]

    def drop_node(self, node_id: str) -> list[str]:
        """Drop every replica on a node (it died) with its holders; the ids of those dropped."""
        dropped = [r for r in self._replicas.values() if r.info.node_id == node_id]
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
        return Cursor(self.epoch, self._log_start + len(self._log), self._replicas_version)

    def has_news(self, cursor: Cursor | None, follower: str | None = None) -> bool:
        """Whether `changes(cursor)` holds something besides `follower`'s own log entries:
        a follower's link already knows what its replica published."""
        now = self.cursor()
        if cursor == now:
            return False
        position = self._position(cursor, now)
        if position is None or cursor[2] != now.replicas_version:
            return True
        last_position, last_replica = self._last_entry
        return (self._last_other if last_replica == follower else last_position) >= position

    def changes(self, cursor: Cursor | None) -> Changes:
        """The changes after `cursor` (None: from nothing), with the cursor that follows them."""
        now = self.cursor()
        position = self._position(cursor, now)
        if position is not None:
            entries = list(itertools.islice(reversed(self._log), now.position - position))
            entries.reverse()
            replicas = None if cursor[2] == now.replicas_version else self._replica_infos()
            return Changes(now, entries, replicas, False)
        self._ops["snapshots"] += 1
        holders = self._holders
        entries = []
        for replica_id, replica in self._replicas.items():
            stored = [
                (key, h[2], h[3])
                for key in replica.keys
                for h in holders[key]
                if h[0] == replica_id
            ]
            entries.append((replica_id, replica.info.node_id, stored, []))
        return Changes(now, entries, self._replica_infos(), True)

    def _position(self, cursor: Cursor | None, now: Cursor) -> int | None:
        """Where in the log `cursor` stands; None when it needs a snapshot (None, another
        epoch, or fallen off the log)."""
        if cursor is None:
            return None
        try:
            epoch, position, _ = cursor
        except (TypeError, ValueError):
            raise ValueError(f"changes: cursor {cursor!r} is not an (epoch, position, replicas_version)") from None
        if epoch == self.epoch and isinstance(position, int) and self._log_start <= position <= now.position:
            return position
        return None

    def stats(self) -> dict[str, int]:
        """Sizes (keys, holders, replicas, log entries) and operation counts."""
        return {
            "keys": len(self._holders),
            "holders": self._num_holders,
            "replicas": len(self._replicas),
            "log_entries": len(self._log),
            **self._ops,
        }

    def _replica_infos(self) -> dict[str, ReplicaInfo]:
        return {replica_id: r.info for replica_id, r in self._replicas.items()}

    def _drop(self, replica: _Replica) -> None:
        replica_id = replica.info.replica_id
        holders = self._holders
        for key in replica.keys:
            _drop_holder(holders, key, replica_id)
        self._num_holders -= len(replica.keys)
        if replica.keys:
            self._append((replica_id, replica.info.node_id, [], list(replica.keys)))
        del self._replicas[replica_id]
        self._replicas_version += 1

    def _append(self, entry: LogEntry) -> None:
        log = self._log
        last_position, last_replica = self._last_entry
        if entry[0] != last_replica:
            self._last_other = last_position
        self._last_entry = (self._log_start + len(log), entry[0])
        log.append(entry)
        self._log_keys += len(entry[2]) + len(entry[3])
        while self._log_keys > self._log_capacity and len(log) > 1:
            _, _, stored, removed = log.popleft()
            self._log_keys -= len(stored) + len(removed)
            self._log_start += 1


class ShardView:
    """A follower's copy of one shard: the holders of each key, kept current by `apply`.

    Holders of `exclude` (the follower's own replica) are left out. The shards of a link
    share one `holders` dict (their keys are disjoint), so a reader finds any key with one
    `holders.get`, from any thread: each key's tuple is replaced, never mutated. While a
    snapshot is applied a reader may briefly miss a key of the shard: a miss, never a
    wrong holder.
    """

    def __init__(
        self,
        exclude: str | None = None,
        holders: dict[OffloadKey, tuple[Holder, ...]] | None = None,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        self.exclude = exclude
        self.cursor: Cursor | None = None
        self.holders: dict[OffloadKey, tuple[Holder, ...]] = {} if holders is None else holders
        self.replicas: dict[str, ReplicaInfo] = {}
        self._shard = shard
        self._num_shards = num_shards

    def apply(self, changes: Changes) -> None:
        holders = self.holders
        if changes.is_snapshot:
            self._forget_shard()
        exclude = self.exclude
        for replica_id, node_id, stored, removed in changes.entries:
            if replica_id == exclude:
                continue
            for key in removed:
                _drop_holder(holders, key, replica_id)
            for key, row, generation in stored:
                holders[key] = _with_holder(holders.get(key), Holder(replica_id, node_id, row, generation))
        if changes.replicas is not None:
            self.replicas = changes.replicas
        self.cursor = changes.cursor

    def _forget_shard(self) -> None:
        if self._num_shards == 1:
            self.holders.clear()
            return
        for key in [k for k in self.holders if shard_of(k, self._num_shards) == self._shard]:
            del self.holders[key]


# what an item of a link's inbox holds
_STORED, _READY, _PROMOTED, _REMOVED, _NEW_INFO = range(5)
# The link flushes a shard's pending changes at most this often, so they travel in batches.
FLUSH_INTERVAL_S = 0.003
# Promoted blocks wait up to this long for a batch of their own (any other change takes
# them along sooner): their keys have a holder already, and a promotion is usually one
# of a burst whose transfers need the CPU and network more than the Directory does.
PROMOTED_FLUSH_DELAY_S = 0.25
# An idle link publishes an empty batch this often, so the Directory knows it is alive.
HEARTBEAT_INTERVAL_S = 0.5
# How long a shard holds a change poll open when nothing changes.
POLL_TIMEOUT_S = 2.0
# Replicas re-register after a random delay up to this, so a fresh shard is not hit all at once.
RESYNC_JITTER_S = 0.5
# A shard's changes not yet published, past this many keys and past what the replica holds
# there, are dropped for a re-register with everything it holds: while a shard is down,
# the removals would pile up without bound, and re-registering says the same in fewer keys.
MAX_PENDING_KEYS = 1 << 16
MAX_BACKOFF_S = 2.0
CLOSE_TIMEOUT_S = 2.0


def _backoff(failures: int) -> float:
    return min(MAX_BACKOFF_S, 0.05 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)


class _Call:
    """A call to a shard in flight, resolved on Ray's side; `wake` runs when it is done."""

    __slots__ = ("ref", "future", "batch")

    def __init__(self, ref: Any, wake: Callable[[], None], batch: tuple | None = None) -> None:
        self.ref = ref
        self.future = ref.future()
        self.future.add_done_callback(lambda _: wake())
        self.batch = batch


class _Shard:
    """What the link's thread knows of one shard."""

    def __init__(self, index: int, actor: Any, view: ShardView) -> None:
        self.index = index
        self.actor = actor
        self.view = view
        # time.monotonic() when the oldest change not yet sent came in, and that of the
        # batch being published (or to be sent again): for the event lag
        self.pending_since: float | None = None
        self.batch_since: float | None = None
        self.reported_at = -float("inf")  # when the replica's stats last went with a publish
        self.held: dict[OffloadKey, tuple[int, int]] = {}  # this replica's blocks in the shard
        # not yet published (None: removed); empty while a re-register is due
        self.pending: dict[OffloadKey, tuple[int, int] | None] = {}
        self.flush_at = float("inf")  # when pending is due to go (FLUSH_INTERVAL_S apart at most)
        self.seq = 0
        self.publishing: _Call | None = None
        self.failed_batch: tuple | None = None  # (seq, stored, removed) to send again
        self.failures = 0
        self.retry_at = 0.0
        self.last_sent = -float("inf")
        self.registered_epoch: str | None = None
        self.resync_at: float | None = 0.0  # when to register and publish everything held
        self.polling: _Call | None = None
        self.poll_failures = 0
        self.poll_at = 0.0


class DirectoryLink:
    """One replica's connection to the Directory of a cache namespace.

    `stored` and `removed` only queue; a background thread publishes them in batches,
    one call per shard, and retries until the Directory takes them, however long it is
    down. The same thread long-polls every shard's change log into an in-process view,
    which `holders` and `replica` read without touching the network. When a shard
    restarts (new epoch) or no longer knows this replica, the link registers again and
    re-publishes everything this replica holds.

    Usage: `link = DirectoryLink(ns, info, num_shards); link.start(); ...; link.close()`.
    """

    def __init__(self, namespace: str, info: ReplicaInfo, num_shards: int) -> None:
        from ray_actors.directory import get_or_create_shards

        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"DirectoryLink: info {info!r} is not a ReplicaInfo")
        self.info = info
        self.namespace = namespace
        self.num_shards = num_shards
        # the view of every shard, merged: one dict lookup answers `holders`
        self._holders: dict[OffloadKey, tuple[Holder, ...]] = {}
        self._shards = [
            _Shard(i, actor, ShardView(info.replica_id, self._holders, i, num_shards))
            for i, actor in enumerate(get_or_create_shards(namespace, num_shards))
        ]
        self._views = [shard.view for shard in self._shards]
        # (what, items): _STORED entries, _READY (key, block) pairs, _REMOVED keys
        self._inbox: collections.deque[tuple[int, Sequence]] = collections.deque()
        self._wake = threading.Event()
        # Whether the thread sleeps longer than FLUSH_INTERVAL_S, so that `stored` and
        # `removed` must wake it. In shorter sleeps it takes the inbox when it wakes anyway,
        # which spares the scheduler's calls a thread wake-up (a syscall) each.
        self._listening = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        # The replica's stats, sent along with a publish to every shard at most every
        # HEARTBEAT_INTERVAL_S (for `distkv status`); set by whoever owns the link.
        self.report: Callable[[], dict] | None = None
        self.errors = ErrorLog()
        # (shard, seconds) from a change coming in to the shard having applied it
        self.event_lags: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_OBSERVATIONS)

    def start(self) -> None:
        """Register with every shard and start publishing and following, in the background."""
        if self._thread is not None:
            raise RuntimeError("DirectoryLink.start: already started")
        self._thread = threading.Thread(target=self._run, name=f"distkv-directory-{self.info.replica_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and unregister (best effort: a Directory that is down is not waited for)."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(CLOSE_TIMEOUT_S + 1.0)

    def stored(self, entries: Sequence[StoredEntry]) -> None:
        """Queue blocks this replica made loadable: (key, row, generation) each. Never blocks."""
        entries = tuple(entries)
        check_stored(entries, self.info.num_rows)
        self._queue(_STORED, entries)

    def ready(self, blocks: Sequence[tuple[OffloadKey, ReadyBlock]]) -> None:
        """`stored` for the scheduler's path: (key, block) pairs straight from the replica's
        block table. The link's thread reads each block's row and generation, which never
        change; they are valid by construction and not checked again (the Directory checks
        every batch it takes in any case). `blocks` is not copied. Never blocks."""
        self._queue(_READY, blocks)

    def promoted(self, blocks: Sequence[tuple[OffloadKey, ReadyBlock]]) -> None:
        """`ready` for blocks promoted from another holder: published within
        PROMOTED_FLUSH_DELAY_S, or with the next other change. Never blocks."""
        self._queue(_PROMOTED, blocks)

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        """Queue keys this replica no longer holds. Never blocks."""
        keys = tuple(keys)
        check_keys(keys)
        self._queue(_REMOVED, keys)

    def set_info(self, info: ReplicaInfo) -> None:
        """Register on every shard as `info` from now on (the replica's next cache epoch)
        and unregister the old id. Ordered with `stored` and `removed`: what was queued
        before goes out under the old id, what comes after under the new one. Never blocks."""
        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"DirectoryLink.set_info: {info!r} is not a ReplicaInfo")
        self._queue(_NEW_INFO, (info,))

    def _queue(self, what: int, items: Sequence) -> None:
        self._inbox.append((what, items))
        if self._listening and not self._wake.is_set():  # set() takes a lock even when already set
            self._wake.set()

    @property
    def view(self) -> Mapping[OffloadKey, tuple[Holder, ...]]:
        """key -> the other replicas holding it: the view `holders` answers from. Read-only;
        it is never replaced, so the scheduler's hot path may bind its `get` once."""
        return self._holders

    def holders(self, key: OffloadKey) -> tuple[Holder, ...]:
        """The other replicas known to hold `key`, from the local view; () if none.

        On the scheduler's hot path: one dict lookup, no validation (callers pass keys
        the local manager has already checked).
        """
        return self._holders.get(key, ())

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        """A registered replica's info, from the local view; None if unknown."""
        for view in self._views:
            info = view.replicas.get(replica_id)
            if info is not None:
                return info
        return None

    def query(self, keys: Sequence[OffloadKey], timeout_s: float | None = 10.0) -> list[tuple[Holder, ...]]:
        """Ask the shards for the holders of each key (this replica included). Blocks: for tools and tests."""
        import ray

        check_keys(keys)
        by_shard: dict[int, list[int]] = collections.defaultdict(list)
        for i, key in enumerate(keys):
            by_shard[shard_of(key, self.num_shards)].append(i)
        refs = {
            shard: self._shards[shard].actor.query.remote([keys[i] for i in indices], namespace=self.namespace)
            for shard, indices in by_shard.items()
        }
        answers = dict(zip(refs, map(unpack, ray.get(list(refs.values()), timeout=timeout_s))))
        result: list[tuple[Holder, ...]] = [()] * len(keys)
        for shard, indices in by_shard.items():
            for i, holders in zip(indices, answers[shard]):
                result[i] = tuple(map(Holder._make, holders))
        return result

    # Everything below runs on the link's thread.

    def _run(self) -> None:
        timeout = 0.0
        while True:
            self._wake.wait(timeout)
            self._listening = False
            self._wake.clear()
            if self._stopping:
                break
            self._take_inbox()
            now = time.monotonic()
            due = min(self._service(shard, now) for shard in self._shards)
            timeout = max(0.0, due - time.monotonic())
            if timeout > FLUSH_INTERVAL_S:
                self._listening = True
                if self._inbox:  # queued before the flag was up: no one woke us for it
                    timeout = 0.0
        self._shutdown()

    def _take_inbox(self) -> None:
        inbox = self._inbox
        shards = self._shards
        num_shards = self.num_shards
        only_promoted = True
        while inbox:
            what, items = inbox.popleft()
            only_promoted = only_promoted and what == _PROMOTED
            if what == _NEW_INFO:
                self._switch_info(items[0])
            elif what != _REMOVED:
                if what != _STORED:
                    items = ((key, block.row, block.generation) for key, block in items)
                for key, row, generation in items:
                    shard = shards[int.from_bytes(key[:8], "big") % num_shards]
                    shard.held[key] = shard.pending[key] = (row, generation)
            else:
                for key in items:
                    shard = shards[int.from_bytes(key[:8], "big") % num_shards]
                    shard.held.pop(key, None)
                    shard.pending[key] = None
        now = time.monotonic()
        flush_at = now + PROMOTED_FLUSH_DELAY_S if only_promoted else now
        for shard in shards:
            if shard.resync_at is None and len(shard.pending) > max(MAX_PENDING_KEYS, len(shard.held)):
                self._resync_later(shard, now)
            if shard.resync_at is not None:
                # the re-register sends everything held, which these changes are part of
                shard.pending.clear()
                shard.failed_batch = None
                continue
            if shard.pending:
                shard.flush_at = min(shard.flush_at, flush_at)
                # the event lag is that of stores and removals, not of promoted blocks held back
                if shard.pending_since is None and not only_promoted:
                    shard.pending_since = now

    def _switch_info(self, info: ReplicaInfo) -> None:
        """Unregister the old id and register `info`, with what the replica holds now, on every shard."""
        old_id, self.info = self.info.replica_id, info
        now = time.monotonic()
        for shard in self._shards:
            shard.view.exclude = info.replica_id
            try:
                shard.actor.unregister.remote(old_id, namespace=self.namespace)
            except Exception as e:  # the shard is down: its restart forgets the old id anyway
                self.errors.add("directory_publish", f"shard {shard.index}: unregister failed: {e}")
            self._resync_later(shard, now)

    def _service(self, shard: _Shard, now: float) -> float:
        """Collect the shard's finished calls and start the next ones; when it next needs attention."""
        due = now + HEARTBEAT_INTERVAL_S
        call = shard.publishing
        if call is not None and call.future.done():
            shard.publishing = None
            self._publish_done(shard, call, now)
        if shard.publishing is None:
            due = min(due, self._publish_next(shard, now))
        call = shard.polling
        if call is not None and call.future.done():
            shard.polling = None
            self._poll_done(shard, call, now)
        if shard.polling is None:
            if now >= shard.poll_at:
                try:
                    shard.polling = _Call(
                        shard.actor.changes.remote(
                            shard.view.cursor, POLL_TIMEOUT_S, namespace=self.namespace, follower=self.info.replica_id
                        ),
                        self._wake.set,
                    )
                except Exception as e:
                    self._poll_failed(shard, now, e)
            if shard.polling is None:
                due = min(due, shard.poll_at)
        return due

    def _publish_next(self, shard: _Shard, now: float) -> float:
        if shard.resync_at is not None:
            if now < shard.resync_at:
                return shard.resync_at
            shard.resync_at = None
            shard.failed_batch = None
            shard.pending.clear()
            shard.flush_at = float("inf")
            shard.pending_since = shard.batch_since = None
            shard.seq += 1
            stored = [(key, row, generation) for key, (row, generation) in shard.held.items()]
            self._send(shard, "register", (shard.seq, stored, None), now)
            return now + HEARTBEAT_INTERVAL_S
        if shard.failed_batch is not None:
            if now < shard.retry_at:
                return shard.retry_at
            batch, shard.failed_batch = shard.failed_batch, None
            self._send(shard, "publish", batch, now)
            return now + HEARTBEAT_INTERVAL_S
        if shard.pending:
            due = min(max(shard.last_sent + FLUSH_INTERVAL_S, shard.flush_at), shard.last_sent + HEARTBEAT_INTERVAL_S)
            if now < due:
                return due
        elif now < shard.last_sent + HEARTBEAT_INTERVAL_S:
            return shard.last_sent + HEARTBEAT_INTERVAL_S
        stored = []
        removed = []
        for key, block in shard.pending.items():
            if block is None:
                removed.append(key)
            else:
                stored.append((key, *block))
        shard.pending.clear()
        shard.flush_at = float("inf")
        shard.batch_since, shard.pending_since = shard.pending_since, None
        shard.seq += 1
        self._send(shard, "publish", (shard.seq, stored, removed), now)
        return now + HEARTBEAT_INTERVAL_S

    def _send(self, shard: _Shard, method: str, batch: tuple, now: float) -> None:
        seq, stored, removed = batch
        shard.last_sent = now
        try:
            if method == "register":
                ref = shard.actor.register.remote(self.info, seq, pack(stored), namespace=self.namespace)
            else:
                ref = shard.actor.publish.remote(
                    self.info.replica_id, seq, pack((stored, removed)), self._report(shard, now), namespace=self.namespace
                )
            shard.publishing = _Call(ref, self._wake.set, (method, batch))
        except Exception as e:
            self._publish_failed(shard, method, batch, e, now)

    def _publish_failed(self, shard: _Shard, method: str, batch: tuple, error: Exception, now: float) -> None:
        """The shard is down, restarting or unreachable: send the same again later."""
        shard.failures += 1
        self.errors.add("directory_publish", f"shard {shard.index}: {method} failed: {error}")
        if shard.failures == 1:
            logger.warning("directory shard %s: %s failed, retrying: %s", shard.actor, method, error)
        if method == "register":
            shard.resync_at = now + _backoff(shard.failures)
        else:
            shard.failed_batch = batch
            shard.retry_at = now + _backoff(shard.failures)

    def _publish_done(self, shard: _Shard, call: _Call, now: float) -> None:
        method, batch = call.batch
        try:
            result = call.future.result()
        except Exception as e:
            self._publish_failed(shard, method, batch, e, now)
            return
        if shard.failures:
            logger.info("directory shard %s: %s went through again", shard.actor, method)
            shard.failures = 0
        epoch, known = result
        if method == "register":
            shard.registered_epoch = epoch
        elif not known:
            self._resync_later(shard, now)
        elif shard.batch_since is not None:
            self.event_lags.append((shard.index, now - shard.batch_since))
            shard.batch_since = None

    def _poll_done(self, shard: _Shard, call: _Call, now: float) -> None:
        try:
            changes = unpack(call.future.result())
        except Exception as e:
            self._poll_failed(shard, now, e)
            return
        shard.poll_failures = 0
        shard.view.apply(changes)
        if shard.registered_epoch is not None and changes.cursor.epoch != shard.registered_epoch:
            self._resync_later(shard, now)

    def _report(self, shard: _Shard, now: float) -> dict | None:
        """The replica's stats when they are due to go to `shard`, else None."""
        if self.report is None or now - shard.reported_at < HEARTBEAT_INTERVAL_S:
            return None
        shard.reported_at = now
        try:
            return self.report()
        except Exception:  # the stats must never hold up publishing
            logger.exception("directory link: the replica's report failed")
            return None

    def _poll_failed(self, shard: _Shard, now: float, error: Exception) -> None:
        self.errors.add("directory_poll", f"shard {shard.index}: {error}")
        shard.poll_failures += 1
        shard.poll_at = now + _backoff(shard.poll_failures)

    def _resync_later(self, shard: _Shard, now: float) -> None:
        if shard.resync_at is None:
            shard.resync_at = now + random.uniform(0.0, RESYNC_JITTER_S)
            shard.registered_epoch = None

    def _shutdown(self) -> None:
        import ray

        # a publish that lands after the unregister would bring this replica back
        in_flight = [shard.publishing.future for shard in self._shards if shard.publishing is not None]
        concurrent.futures.wait(in_flight, timeout=CLOSE_TIMEOUT_S / 2)
        futures = []
        for shard in self._shards:
            if shard.polling is not None:
                try:
                    ray.cancel(shard.polling.ref)
                except Exception:
                    pass
            try:
                futures.append(shard.actor.unregister.remote(self.info.replica_id, namespace=self.namespace).future())
            except Exception:
                pass
        concurrent.futures.wait(futures, timeout=CLOSE_TIMEOUT_S / 2)
