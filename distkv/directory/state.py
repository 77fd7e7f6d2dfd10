"""The Directory's data: which replicas of a cache namespace hold which offloaded blocks.

`DirectoryState` is one shard of the cluster-wide index `OffloadKey -> holders`; its
`ChangeLog` numbers every change so that followers replay them to keep a `ShardView`, a
local copy. Plain data and logic, no Ray: `ray_actors.directory` wraps a state in an
actor per shard, and `distkv.directory.link`'s link follows the shards' logs.
"""

from __future__ import annotations

import collections
import gc
import io
import itertools
import pickle
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from distkv.abstract import OffloadKey
from distkv.replica.local_manager import MIN_KEY_BYTES, check_keys, key_problem
from distkv.storage.pool import MAX_KEY_BYTES

# (key, row, generation): a block this replica made loadable in one of its pool's rows.
StoredEntry = tuple[OffloadKey, int, int]
# (replica_id, node_id, stored, removed): one replica's change, stored applied after removed.
LogEntry = tuple[str, str, list[StoredEntry], list[OffloadKey]]
# A Holder's fields in a plain tuple, as the Directory keeps and sends them: a plain tuple
# pickles without a Python call, several times faster than a NamedTuple.
HolderFields = tuple[str, str, int, int]
# (replica_id, seq, packed (stored, removed), report or None): one replica's publish as a
# relay carries it (`distkv.directory.relay`), the arguments of its own publish call.
Relayed = tuple[str, int, bytes, "dict | None"]


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
    `endpoint`: where its pool can be read one-sidedly (NIXL), if it registered it, sealed
    (`distkv.transfer.endpoint_seal`): opaque to the Directory and to whoever else is not a member
    of the replica's cache namespace.
    """

    replica_id: str
    node_id: str
    pool_name: str
    num_rows: int
    num_ranks: int
    slot_bytes: int
    cache_epoch: int = 0
    endpoint: bytes | None = None

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
        if self.endpoint is not None and type(self.endpoint) is not bytes:
            raise ValueError(f"ReplicaInfo.endpoint={self.endpoint!r}: must be a sealed endpoint (bytes) or None")


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


def pack(payload: object) -> bytes:
    """A bulk payload (stored entries, changes, query answers) as it crosses Ray.

    Ray's cloudpickle runs a Python hook for every tuple and list in a payload (most of
    a 1k-key call's time: docs/benchmarks.md); the C pickler does not, so bulk payloads
    travel as its bytes.
    """
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """The payload `pack` made `data` from."""
    return pickle.loads(data)


# A register, a publish and a query carry at most this many keys (a link's batches), so
# that no one call holds a shard's loop for long; a relay's call, a publish per replica of
# its node at most.
MAX_CALL_KEYS = 1 << 12
MAX_RELAYED_PUBLISHES = 1 << 12
# A packed register's entries or publish's changes of MAX_CALL_KEYS keys: an entry pickles
# to its key and 20 bytes or so.
MAX_PAYLOAD_BYTES = MAX_CALL_KEYS * (MAX_KEY_BYTES + 40)


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise ValueError(f"it names {module}.{name}: only plain data (tuples, lists, bytes, ints) is taken")


def unpack_plain(data: object, what: str) -> Any:
    """What `pack` made `data` from, if it is plain data of MAX_PAYLOAD_BYTES at most: how a
    shard takes in what replicas send. A ValueError naming `what` and the problem for
    anything else, a payload that names any class or function included (none of it runs)."""
    if type(data) is not bytes:
        raise ValueError(f"{what}: a {type(data).__name__}, not packed bytes")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"{what}: {len(data)} bytes, over {MAX_PAYLOAD_BYTES} (a call carries {MAX_CALL_KEYS} keys at most)")
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise ValueError(f"{what}: not a packed payload of plain data: {e}") from None


def unpack_changes(data: object, what: str) -> tuple[list, list]:
    """A publish's packed (stored, removed), as `unpack_plain` takes it, of MAX_CALL_KEYS
    keys at most; ValueError otherwise (the entries themselves are checked where applied)."""
    changes = unpack_plain(data, what)
    if type(changes) is not tuple or len(changes) != 2 or not all(type(c) in (list, tuple) for c in changes):
        raise ValueError(f"{what}: {changes!r:.80} is not a (stored, removed) pair of lists")
    if len(changes[0]) + len(changes[1]) > MAX_CALL_KEYS:
        raise ValueError(f"{what}: {len(changes[0]) + len(changes[1])} keys, over {MAX_CALL_KEYS} a call")
    return changes


def unpack_stored(data: object, what: str) -> list:
    """A register's packed stored entries, as `unpack_plain` takes it, of MAX_CALL_KEYS at most."""
    stored = unpack_plain(data, what)
    if type(stored) not in (list, tuple):
        raise ValueError(f"{what}: {stored!r:.80} is not a list of stored entries")
    if len(stored) > MAX_CALL_KEYS:
        raise ValueError(f"{what}: {len(stored)} stored entries, over {MAX_CALL_KEYS} a call")
    return stored


def check_namespace(serves: str, namespace: object, who: str) -> None:
    """Refuse a call made for cache namespace `namespace` to `who`, which serves `serves`.

    A call naming another namespace (or none) is a ValueError, so that a replica never
    reads or writes another namespace's blocks.
    """
    if namespace != serves:
        raise ValueError(f"{who} serves cache namespace {serves!r} and refuses a call for namespace {namespace!r}")


def shard_of(key: OffloadKey, num_shards: int) -> int:
    """The shard of `key` among `num_shards`. Keys start with a hash, so its leading bytes spread evenly.

    A replica's block is kept on the shard of its request's placement root (`prefix_root`),
    and on its own key's only when it has none (see docs/architecture.md, "Placement")."""
    return int.from_bytes(key[:8], "big") % num_shards


def prefix_root(
    positions: Mapping[OffloadKey, int], first_chunk: tuple[int, int] | None = None
) -> tuple[OffloadKey, int] | None:
    """The placement root of a request and its end token, from the end token of each key the
    engine recorded for it (`positions`); None while it has none.

    Keys are chained hashes, so every request that shares any block of a prefix shares the
    prefix's first chunk: the root is that chunk's key, and every block of the request that
    ends at or past it is kept on the root's shard, by every replica. `first_chunk`: (end
    token, group index) of the first chunk of the group with the smallest chunks (ties by
    group index), where the engine records keys below it that not every request records;
    without it, the recorded key with the smallest end token, ties by group index (the
    key's last 4 bytes).
    """
    if first_chunk is not None:
        end, group = first_chunk
        suffix = group.to_bytes(4, "big")
        for key, position in positions.items():
            if position == end and key.endswith(suffix):
                return key, end
        return None
    root = None
    for key, position in positions.items():
        if root is None or (position, key[-4:]) < (root[1], root[0][-4:]):
            root = (key, position)
    return root


# A slot's generation is a u64 of its header (`distkv.storage.pool`), and crosses in answers as one.
MAX_GENERATION = 1 << 64


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
            and 0 <= entry[2] < MAX_GENERATION
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
        if not isinstance(generation, int) or not 0 <= generation < MAX_GENERATION:
            raise ValueError(f"stored entry {entry!r}: generation {generation!r} is not an int in 0..2**64-1")


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
    if len(current) == 1:  # most keys have one holder: no tuple to build
        if current[0][0] == replica_id:
            del holders[key]
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


class Lateness:
    """How long a call that a shard takes now may have waited for it: the worst lateness of
    the shard's own periodic wake-ups over the last `window_s`.

    A shard that was stopped, starved of CPU or swamped with calls wakes late by about as
    long as a replica's heartbeat has waited in its queue, so a replica's silence counts
    against its timeout only beyond that (see `DirectoryState.expire`'s callers).
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._late: collections.deque[tuple[float, float]] = collections.deque()  # (when, seconds late)

    def woke(self, due: float, now: float) -> None:
        """A wake-up due at `due` ran at `now`."""
        late = self._late
        late.append((now, max(0.0, now - due)))
        while late[0][0] < now - self._window_s:
            late.popleft()

    def worst(self) -> float:
        """The longest a wake-up of the window ran late (0 before any)."""
        return max((seconds for _, seconds in self._late), default=0.0)


# A shard's state is a few large long-lived containers, which a full garbage collection
# traverses whole while no call is answered (docs/benchmarks.md); what the shard frees is
# acyclic, freed by reference counting. So a shard makes a full collection only every
# FULL_COLLECTION_S, and collects its young generations every YOUNG_COLLECTION_KEYS keys
# it stores (each such collection visits a few objects per key: its holder, the tuple of
# its holders, its entry in the log).
FULL_COLLECTION_S = 600.0
YOUNG_COLLECTION_KEYS = 8192


def defer_full_collections() -> None:
    """Make this process's full garbage collections only those it asks for (`gc.collect()`)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1 << 30)


class ShardCollections:
    """When a shard's process collects its garbage: told the keys its state stored
    (`stored`, after each change) and stepped by its watcher (`step`, for the full one).

    Python starts a young collection when the objects made outnumber those freed by its
    threshold. A shard under churn frees about as many objects as it makes (each removed
    key's holder for each stored key's), so that never happens while the new objects pile
    up in the young generation, until some burst starts a collection that visits them all
    at once (docs/benchmarks.md). Collecting the young generations every
    `young_every_keys` stored keys keeps each visit to that many keys' objects.
    """

    def __init__(
        self, now: float, young_every_keys: int = YOUNG_COLLECTION_KEYS, full_every_s: float = FULL_COLLECTION_S
    ) -> None:
        self._young_every_keys = young_every_keys
        self._full_every_s = full_every_s
        self._young_from = 0  # the stored keys at the last young collection
        self._full_at = now + full_every_s

    def stored(self, keys: int) -> None:
        """After a change: the state has stored `keys` keys in all (`DirectoryState.stored_keys`)."""
        if keys - self._young_from >= self._young_every_keys:
            gc.collect(1)
            self._young_from = keys

    def step(self, now: float) -> None:
        """The full collection, if due by `now`."""
        if now >= self._full_at:
            gc.collect()
            self._full_at = now + self._full_every_s


class ChangeLog:
    """A shard's numbered changes and the cursors that point into them.

    Entries are numbered from 0 in the order appended. The log keeps the latest ones, up
    to about `capacity` keys (the latest entry always), and drops the oldest. `epoch`
    names this log among every incarnation of its shard, so that a cursor from another
    one is never read as a position here. `replicas_version` counts the changes to the
    set of registered replicas; a cursor carries it so that a follower learns when to
    fetch that set again.
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"log_capacity={capacity!r}: must be a positive int")
        self.epoch = random.randbytes(8).hex()
        self.replicas_version = 0
        self._capacity = capacity
        self._entries: collections.deque[LogEntry] = collections.deque()
        self._start = 0  # position of _entries[0]
        self._keys = 0
        # the position and replica of the latest entry, and the position of the latest
        # entry by another replica than that: `has_news` in O(1)
        self._last_entry: tuple[int, str | None] = (-1, None)
        self._last_other = -1

    def __len__(self) -> int:
        """How many entries the log keeps now."""
        return len(self._entries)

    def cursor(self) -> Cursor:
        """The cursor of a follower that has seen every change so far."""
        return Cursor(self.epoch, self._start + len(self._entries), self.replicas_version)

    def append(self, entry: LogEntry) -> None:
        """Add `entry` at the next position, dropping the oldest entries past the capacity."""
        entries = self._entries
        last_position, last_replica = self._last_entry
        if entry[0] != last_replica:
            self._last_other = last_position
        self._last_entry = (self._start + len(entries), entry[0])
        entries.append(entry)
        self._keys += len(entry[2]) + len(entry[3])
        while self._keys > self._capacity and len(entries) > 1:
            _, _, stored, removed = entries.popleft()
            self._keys -= len(stored) + len(removed)
            self._start += 1

    def replicas_changed(self) -> None:
        """Note that a replica came or went: a follower at an earlier cursor needs the set again."""
        self.replicas_version += 1

    def position(self, cursor: Cursor | None) -> int | None:
        """Where in the log `cursor` stands; None when it needs a snapshot (None, another
        epoch, or fallen off the log). A ValueError if `cursor` is no cursor at all."""
        if cursor is None:
            return None
        try:
            epoch, position, _ = cursor
        except (TypeError, ValueError):
            raise ValueError(f"changes: cursor {cursor!r} is not an (epoch, position, replicas_version)") from None
        end = self._start + len(self._entries)
        if epoch == self.epoch and isinstance(position, int) and self._start <= position <= end:
            return position
        return None

    def since(self, position: int, max_keys: int | None = None) -> list[LogEntry]:
        """The entries from `position` (one that `position()` returned) on, in order: to the
        latest, or as many as hold `max_keys` keys at most (one at least)."""
        entries = self._entries
        offset = position - self._start
        if max_keys is None or offset >= len(entries) // 2:  # nearer the end: read from there
            after = list(itertools.islice(reversed(entries), len(entries) - offset))
            after.reverse()
            if max_keys is None:
                return after
        else:
            after = itertools.islice(entries, offset, None)
        taken: list[LogEntry] = []
        keys = 0
        for entry in after:
            keys += len(entry[2]) + len(entry[3])
            if taken and keys > max_keys:
                break
            taken.append(entry)
        return taken

    def has_news(self, cursor: Cursor | None, follower: str | None = None) -> bool:
        """Whether a follower at `cursor` has more to learn than `follower`'s own entries:
        a snapshot, a changed set of replicas, or an entry of another replica."""
        now = self.cursor()
        if cursor == now:
            return False
        position = self.position(cursor)
        if position is None or cursor[2] != now.replicas_version:
            return True
        last_position, last_replica = self._last_entry
        return (self._last_other if last_replica == follower else last_position) >= position


# A `changes` answer from the log carries whole entries of this many keys at most (one
# entry at least), so that a follower far behind costs the shard bounded work per answer
# and catches up over several; its cursor goes on from the last entry it got.
MAX_ANSWER_KEYS = 1 << 14
# A snapshot is collected and packed this many keys at a time (`SnapshotBuilder.step`), its
# shard taking other calls in between.
SNAPSHOT_STEP_KEYS = 1 << 11
# A shard's holders are split over this many dicts by key hash. A dict grows, or sheds the
# slots of removed keys, by rebuilding its whole table in one step, holding the GIL
# throughout: one dict of millions of keys would stop the shard from answering for a good
# part of a second at each rebuild (docs/benchmarks.md). A partition rebuilds only its share.
HOLDER_PARTITIONS = 256
_PARTITION_MASK = HOLDER_PARTITIONS - 1


class _PackedEntries:
    """A snapshot answer's entries: the chunks a `SnapshotBuilder` packed, then the log's
    entries since its cursor. Pickled, the chunks cost a copy of their bytes, not a pass
    over every entry; unpickled, they are one plain list of entries, in order."""

    def __init__(self, chunks: list[bytes], tail: list[LogEntry]) -> None:
        self.chunks = chunks
        self.tail = tail

    def __reduce__(self):
        return _joined, (self.chunks, self.tail)


def _joined(chunks: list[bytes], tail: list[LogEntry]) -> list[LogEntry]:
    """The entries of packed `chunks`, then `tail` (how `_PackedEntries` unpickles)."""
    return [entry for chunk in chunks for entry in unpack(chunk)] + tail


class Snapshot(NamedTuple):
    """A complete `SnapshotBuilder`'s snapshot: the log's cursor it started at, and each
    replica's holders in packed chunks, (replica_id, packed [LogEntry])."""

    cursor: Cursor
    chunks: list[tuple[str, bytes]]


class SnapshotBuilder:
    """A snapshot of a `DirectoryState`, collected and packed a step at a time while the
    state goes on changing in between.

    It starts at the state's `cursor`; each `step` takes up to `max_keys` more of a
    replica's holders as they are when it runs. The snapshot followed by the log's entries
    since `cursor` is exactly the state (`DirectoryState.snapshot_answer`): for each key
    and replica, those entries replay every change after `cursor` in order (a store sets
    the holder, a removal drops it), and where there was none, the holder a step took is
    the one at `cursor` (a fuzzy snapshot and its redo log). Only the state's own thread
    steps it.
    """

    def __init__(self, state: DirectoryState) -> None:
        self._state = state
        self.cursor = state.cursor()
        self._pending = list(state._replicas)  # the replicas still to collect, in turn
        self._replica: str | None = None
        self._keys: list[OffloadKey] = []  # the current replica's keys still to collect
        self._chunks: list[tuple[str, bytes]] = []
        self._complete = False

    def step(self, max_keys: int = SNAPSHOT_STEP_KEYS) -> bool:
        """Collect and pack up to `max_keys` more holders; whether the snapshot is complete."""
        state = self._state
        left = max_keys
        while left > 0:
            if not self._keys:
                if not self._pending:
                    self._complete = True
                    return True
                self._replica = self._pending.pop()
                replica = state._replicas.get(self._replica)
                # one dropped since the cursor: the log removes its holders
                self._keys = [] if replica is None else list(replica.keys)
                continue
            replica = state._replicas.get(self._replica)
            if replica is None:  # dropped since the last step: the log removes its holders
                self._keys = []
                continue
            taken = self._keys[-left:]
            del self._keys[-left:]
            left -= len(taken)
            replica_id, parts = self._replica, state._holders
            stored = [
                (key, holder[2], holder[3])
                for key in taken
                for holder in parts[hash(key) & _PARTITION_MASK].get(key, ())
                if holder[0] == replica_id
            ]
            self._chunks.append((replica_id, pack([(replica_id, replica.info.node_id, stored, [])])))
        return False

    def snapshot(self) -> Snapshot:
        """The complete snapshot."""
        if not self._complete:
            raise RuntimeError("SnapshotBuilder.snapshot: the snapshot is not complete (step until it is)")
        return Snapshot(self.cursor, self._chunks)


class DirectoryState:
    """One shard of the Directory: the holders of every key of the shard.

    Replicas register, then publish numbered batches of stored and removed keys; a batch
    whose number is not greater than the last one applied for that replica is a retry
    and is ignored. Every change lands in a log of about `log_capacity` keys that
    followers read with `changes`, MAX_ANSWER_KEYS at a time; a follower whose cursor
    fell off the log, or comes from another epoch (an earlier incarnation of the shard),
    gets a snapshot instead. `packed_changes` packs each distinct answer once, and one
    snapshot serves every follower that needs one while its cursor is in the log.
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
        # packed answers of `changes` by where they start (None: a snapshot), valid while the log is at `_packed_at`
        self._packed: dict[tuple[int, bool] | None, bytes] = {}
        self._packed_at: Cursor | None = None
        self._snapshot: Snapshot | None = None  # the latest one built, which answers with the log since its cursor

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
                _drop_holder(parts[hash(key) & _PARTITION_MASK], key, replica_id)
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
                holders[key] = _with_holder(current, holder)
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
                stored, removed = unpack_changes(changes, f"replica {replica_id!r:.80}'s relayed publish")
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
        """The changes after `cursor` (None: from nothing), with the cursor that follows
        them: all of them, or the first entries of MAX_ANSWER_KEYS keys at most (the
        answer's cursor then points before the latest; a snapshot, of the state as it is
        now, is never cut short)."""
        log = self._log
        now = log.cursor()
        position = log.position(cursor)
        if position is not None:
            replicas = None if cursor[2] == now.replicas_version else self._replica_infos()
            entries = log.since(position, MAX_ANSWER_KEYS)
            return Changes(now._replace(position=position + len(entries)), entries, replicas, False)
        changes = self.snapshot_answer(self._build_snapshot())
        return changes._replace(entries=_joined(changes.entries.chunks, changes.entries.tail))

    def packed_changes(self, cursor: Cursor | None) -> bytes:
        """`pack(self.changes(cursor))`, packed once for every follower that asks from the
        same place until the log changes: one publish wakes every follower, and most of
        them ask from the cursor of the change before it. A snapshot answer is the latest
        snapshot built and the log since, or a snapshot built here at once."""
        packed = self.packed_from_log(cursor)
        if packed is None:
            self.keep_snapshot(self._build_snapshot())
            packed = self.packed_from_log(cursor)
        return packed

    def packed_from_log(self, cursor: Cursor | None) -> bytes | None:
        """`packed_changes(cursor)` when it needs no snapshot built: the answer from the log,
        or the snapshot kept (`keep_snapshot`) with the log since its cursor, while that
        cursor is in the log; else None."""
        log = self._log
        now = log.cursor()
        if self._packed_at != now:
            self._packed.clear()
            self._packed_at = now
        position = log.position(cursor)
        # what the answer depends on: where in the log it starts (None: a snapshot) and
        # whether it carries the set of replicas
        start = None if position is None else (position, cursor[2] == now.replicas_version)
        packed = self._packed.get(start)
        if packed is not None:
            return packed
        if position is None:
            changes = None if self._snapshot is None else self.snapshot_answer(self._snapshot)
            if changes is None:
                return None
        else:
            changes = self.changes(cursor)
        packed = self._packed[start] = pack(changes)
        return packed

    def snapshot_builder(self) -> SnapshotBuilder:
        """A snapshot to build a step at a time, from the state's cursor now (`SnapshotBuilder`)."""
        self._ops["snapshots"] += 1
        return SnapshotBuilder(self)

    def keep_snapshot(self, snapshot: Snapshot) -> None:
        """Answer the followers that need a snapshot with `snapshot` and the log since its
        cursor, while that cursor is in the log."""
        self._snapshot = snapshot

    def drop_stale_snapshot(self) -> None:
        """Let go of the kept snapshot once its cursor fell off the log: it answers no one
        any more, and holds a packed copy of every holder."""
        if self._snapshot is not None and self._log.position(self._snapshot.cursor) is None:
            self._snapshot = None

    def snapshot_answer(self, snapshot: Snapshot) -> Changes | None:
        """The `changes` answer of a snapshot: `snapshot`'s chunks of the replicas registered
        now, then the log's entries since its cursor, up to now; None if that cursor fell
        off the log."""
        position = self._log.position(snapshot.cursor)
        if position is None:
            return None
        replicas = self._replica_infos()
        chunks = [chunk for replica_id, chunk in snapshot.chunks if replica_id in replicas]
        return Changes(self._log.cursor(), _PackedEntries(chunks, self._log.since(position)), replicas, True)

    def _build_snapshot(self) -> Snapshot:
        builder = self.snapshot_builder()
        while not builder.step():
            pass
        return builder.snapshot()

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

    def _replica_infos(self) -> dict[str, ReplicaInfo]:
        return {replica_id: r.info for replica_id, r in self._replicas.items()}

    def _drop(self, replica: _Replica) -> None:
        replica_id = replica.info.replica_id
        parts = self._holders
        for key in replica.keys:
            _drop_holder(parts[hash(key) & _PARTITION_MASK], key, replica_id)
        self._num_holders -= len(replica.keys)
        keys = list(replica.keys)
        for i in range(0, len(keys), MAX_ANSWER_KEYS):  # entries that fit in an answer
            self._log.append((replica_id, replica.info.node_id, [], keys[i : i + MAX_ANSWER_KEYS]))
        del self._replicas[replica_id]
        self._log.replicas_changed()


class ShardView:
    """A follower's copy of one shard: the holders of each key, kept current by `apply`.

    Holders of `exclude` (the follower's own replica) are left out. The shards of a link
    share one `holders` dict (`shared`), so a reader finds any key with one `holders.get`,
    from any thread: each key's tuple is replaced, never mutated. A shared view keeps the
    keys it added, since a key's shard is its holder's placement, not a function of the
    key, and a snapshot replaces only those. While a snapshot is applied a reader may
    briefly miss a key of the shard: a miss, never a wrong holder.
    """

    def __init__(
        self,
        exclude: str | None = None,
        holders: dict[OffloadKey, tuple[Holder, ...]] | None = None,
        shared: bool = False,
    ) -> None:
        self.exclude = exclude
        self.cursor: Cursor | None = None
        self.holders: dict[OffloadKey, tuple[Holder, ...]] = {} if holders is None else holders
        self.replicas: dict[str, ReplicaInfo] = {}
        # the keys this view added to a shared `holders`; None when it owns the dict
        self._keys: set[OffloadKey] | None = set() if shared else None

    def apply(self, changes: Changes) -> None:
        holders = self.holders
        keys = self._keys
        if changes.is_snapshot:
            self._forget_shard()
        exclude = self.exclude
        for replica_id, node_id, stored, removed in changes.entries:
            if replica_id == exclude:
                continue
            for key in removed:
                _drop_holder(holders, key, replica_id)
                if keys is not None and key not in holders:
                    keys.discard(key)
            for key, row, generation in stored:
                holders[key] = _with_holder(holders.get(key), Holder(replica_id, node_id, row, generation))
            if keys is not None:
                keys.update(key for key, _, _ in stored)
        if changes.replicas is not None:
            self.replicas = changes.replicas
        self.cursor = changes.cursor

    def _forget_shard(self) -> None:
        if self._keys is None:
            self.holders.clear()
            return
        holders = self.holders
        for key in self._keys:
            holders.pop(key, None)
        self._keys.clear()
