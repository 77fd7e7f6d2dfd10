"""What crosses between a replica and a Directory shard: typed, bounded, one codec each way.

Everything distkv itself packs for the way between a replica and a shard is msgpack of
plain data (lists, ints, strs, bytes), tagged with its format (`DIRECTORY_FORMAT`, and
`ANSWER_FORMAT` for a query's answer), read
by the one decoder of its kind, which bounds every size and checks every field it
hands on, so that whoever sent the bytes can at worst send wrong data, never run code or
exhaust the reader; a payload that does not read is a `WireError` naming what and why:

- a register's stored entries (`encode_stored` / `decode_stored`) and a publish's
  changes, itself or carried by a relay (`encode_changes` / `decode_changes`): what a
  shard takes in, MAX_CALL_KEYS keys at most, every entry then checked (`check_stored`)
  before any of it is applied;
- a follower's answer (`encode_feed` / `decode_feed`): a `Changes`, whose snapshot
  entries come as chunks a `SnapshotBuilder` encoded a step at a time (`encode_entry`,
  `PackedEntries`), spliced into the answer as bytes;
- a query's answer (`encode_answer` / `decode_answer`): each key's holders, as two
  little-endian arrays read and checked whole, and the `ReplicaInfo` of every replica
  they name, however the answer travels (the shard's Ray method or its query channel).

Nothing here is pickled: msgpack in tuple mode reads a bulk payload faster than the C
unpickler did (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import msgpack
import numpy as np

from distkv.config import DIRECTORY_FORMAT
from distkv.directory.records import Changes, Cursor, HolderFields, LogEntry, ReplicaInfo, StoredEntry
from distkv.storage.keys import MIN_KEY_BYTES, key_problem
from distkv.storage.slots import MAX_KEY_BYTES

# A register, a publish and a query carry at most this many keys (a link's batches), so
# that no one call holds a shard's loop for long; a relay's call, a publish per replica of
# its node at most.
MAX_CALL_KEYS = 1 << 12
MAX_RELAYED_PUBLISHES = 1 << 12
# A register's entries or a publish's changes of MAX_CALL_KEYS keys: an entry encodes to
# its key and 20 bytes at most.
MAX_PAYLOAD_BYTES = MAX_CALL_KEYS * (MAX_KEY_BYTES + 40)
# A follower's answer: the log's entries of 16k keys, or a snapshot of a whole shard
# (docs/scale.md: about 60 bytes a key as it crosses).
MAX_FEED_BYTES = 1 << 31
# An answer names each key's holders (every replica of the namespace, at worst) and their infos.
MAX_ANSWER_BYTES = 1 << 26
# A str of an answer (a replica's id, node, pool name, a shard's epoch) and a sealed endpoint, at most.
MAX_NAME_BYTES = 1 << 12
MAX_ENDPOINT_BYTES = 1 << 20
# A slot's generation is a u64 of its header (`distkv.storage.slots`), and crosses as one.
MAX_GENERATION = 1 << 64

# A query's answer has its own format tag, unchanged since it was first typed.
ANSWER_FORMAT = 1

# the holders' count of each key, and each holder's (index of its replica, row, generation)
_COUNT = np.dtype("<u4")
_FIELD = np.dtype("<u8")
_REPLICA_FIELDS = 8  # ReplicaInfo's, in order
_packer = msgpack.Packer()


class WireError(ValueError):
    """Bytes that are not what they were said to be, of this format."""


def _read(data: object, what: str, max_bytes: int, max_bin: int) -> object:
    """The msgpack in `data`, tuples for arrays, of `max_bytes` at most; WireError otherwise."""
    if type(data) is not bytes:
        raise WireError(f"{what}: a {type(data).__name__}, not bytes")
    if len(data) > max_bytes:
        raise WireError(f"{what}: {len(data)} bytes, over {max_bytes}")
    try:
        return msgpack.unpackb(
            data, use_list=False, raw=False, max_str_len=MAX_NAME_BYTES, max_bin_len=max_bin, max_ext_len=0,
        )
    except Exception as e:
        raise WireError(f"{what}: not msgpack of this format: {type(e).__name__}: {e}") from None


def _tagged(message: object, what: str, fields: int) -> tuple:
    if type(message) is not tuple or len(message) != fields + 1 or message[0] != DIRECTORY_FORMAT:
        raise WireError(f"{what}: not a message of format {DIRECTORY_FORMAT}: {message!r:.80}")
    return message[1:]


# ---- what a shard takes in -----------------------------------------------------------


def encode_stored(entries: Sequence[StoredEntry]) -> bytes:
    """A register's (key, row, generation) entries, as they cross."""
    return _packer.pack((DIRECTORY_FORMAT, entries))


def decode_stored(data: object, what: str) -> list[StoredEntry]:
    """A register's entries, MAX_CALL_KEYS at most (each checked where applied: `check_stored`)."""
    (stored,) = _tagged(_read(data, what, MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES), what, 1)
    if type(stored) is not tuple:
        raise WireError(f"{what}: {stored!r:.80} is not a list of stored entries")
    if len(stored) > MAX_CALL_KEYS:
        raise WireError(f"{what}: {len(stored)} stored entries, over {MAX_CALL_KEYS} a call")
    return list(stored)


def encode_changes(stored: Sequence[StoredEntry], removed: Sequence[bytes]) -> bytes:
    """A publish's (stored entries, removed keys), as they cross."""
    return _packer.pack((DIRECTORY_FORMAT, stored, removed))


def decode_changes(data: object, what: str) -> tuple[list[StoredEntry], list[bytes]]:
    """A publish's (stored, removed), of MAX_CALL_KEYS keys at most."""
    stored, removed = _tagged(_read(data, what, MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES), what, 2)
    if type(stored) is not tuple or type(removed) is not tuple:
        raise WireError(f"{what}: ({stored!r:.40}, {removed!r:.40}) is not a (stored, removed) pair of lists")
    if len(stored) + len(removed) > MAX_CALL_KEYS:
        raise WireError(f"{what}: {len(stored) + len(removed)} keys, over {MAX_CALL_KEYS} a call")
    return list(stored), list(removed)


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


def check_namespace(serves: str, namespace: object, who: str) -> None:
    """Refuse a call made for cache namespace `namespace` to `who`, which serves `serves`.

    A call naming another namespace (or none) is a ValueError, so that a replica never
    reads or writes another namespace's blocks.
    """
    if namespace != serves:
        raise ValueError(f"{who} serves cache namespace {serves!r} and refuses a call for namespace {namespace!r}")


# ---- what a follower reads -------------------------------------------------------------


class PackedEntries:
    """A snapshot answer's entries: `chunks`, each one entry a `SnapshotBuilder` encoded
    (`encode_entry`), then the log's entries since the snapshot's cursor (`tail`). The
    answer carries the chunks as they are: a copy of their bytes, not a pass over every
    entry."""

    def __init__(self, chunks: list[bytes], tail: list[LogEntry]) -> None:
        self.chunks = chunks
        self.tail = tail

    def entries(self) -> list[LogEntry]:
        """Every entry, in order, as `decode_feed` reads them."""
        return [_entry(msgpack.unpackb(chunk, use_list=False, raw=False)) for chunk in self.chunks] + self.tail


def encode_entry(entry: LogEntry) -> bytes:
    """One (replica, node, stored entries, removed keys) of the log, as it crosses."""
    return _packer.pack(entry)


def encode_feed(changes: Changes) -> bytes:
    """A follower's answer: its cursor, whether it is a snapshot, the replicas' infos if
    they changed, then the entries (a snapshot's encoded chunks as they are)."""
    entries = changes.entries
    chunks, tail = (entries.chunks, entries.tail) if isinstance(entries, PackedEntries) else ((), entries)
    replicas = None if changes.replicas is None else {rid: _info_fields(info) for rid, info in changes.replicas.items()}
    pack = _packer.pack
    return b"".join([
        _packer.pack_array_header(5), pack(DIRECTORY_FORMAT), pack(tuple(changes.cursor)), pack(changes.is_snapshot),
        pack(replicas), _packer.pack_array_header(len(chunks) + len(tail)), *chunks, *map(pack, tail),
    ])


def decode_feed(data: object) -> Changes:
    """A follower's answer (`encode_feed`); WireError for anything else."""
    what = "a follower's answer"
    cursor, is_snapshot, replicas, entries = _tagged(_read(data, what, MAX_FEED_BYTES, MAX_ENDPOINT_BYTES), what, 4)
    if (
        type(cursor) is not tuple or len(cursor) != 3 or type(cursor[0]) is not str
        or type(cursor[1]) is not int or type(cursor[2]) is not int
    ):
        raise WireError(f"{what}: cursor {cursor!r:.80} is not an (epoch, position, replicas_version)")
    if type(is_snapshot) is not bool or type(entries) is not tuple:
        raise WireError(f"{what}: is_snapshot {is_snapshot!r:.20} or entries {type(entries).__name__} of another type")
    if replicas is not None:
        if type(replicas) is not dict:
            raise WireError(f"{what}: replicas {type(replicas).__name__} is not a map")
        replicas = {replica_id: _replica_info(fields, what) for replica_id, fields in replicas.items()}
        if any(replica_id != info.replica_id for replica_id, info in replicas.items()):
            raise WireError(f"{what}: a replica's info under another replica's id")
    return Changes(Cursor(*cursor), [_entry(entry) for entry in entries], replicas, is_snapshot)


def _entry(entry: object) -> LogEntry:
    """A log entry read as the shard keeps it: (replica, node, [stored entries], [removed keys])."""
    if type(entry) is not tuple or len(entry) != 4:
        raise WireError(f"a log entry {entry!r:.80} is not a (replica, node, stored, removed)")
    replica_id, node_id, stored, removed = entry
    if type(replica_id) is not str or type(node_id) is not str or type(stored) is not tuple or type(removed) is not tuple:
        raise WireError(f"a log entry of replica {replica_id!r:.80} of another shape")
    return replica_id, node_id, list(stored), list(removed)


# ---- a query's answer ------------------------------------------------------------------


def encode_answer(holders: Sequence[tuple[HolderFields, ...]], infos: Mapping[str, ReplicaInfo]) -> bytes:
    """`DirectoryState.answer`'s (holders of each key, info of each replica they name), as it
    crosses. A holder's node is its replica's, as a shard keeps it."""
    index: dict[str, int] = {}
    replicas = []
    for replica_id, info in infos.items():
        index[replica_id] = len(replicas)
        replicas.append(_info_fields(info))
    counts = []
    flat: list[int] = []
    for key_holders in holders:
        counts.append(len(key_holders))
        for replica_id, _, row, generation in key_holders:
            flat += (index[replica_id], row, generation)
    counts_bytes = np.array(counts, dtype=_COUNT).tobytes()
    return msgpack.packb([ANSWER_FORMAT, replicas, counts_bytes, np.array(flat, dtype=_FIELD).tobytes()])


def decode_answer(data: object, num_keys: int) -> tuple[list[tuple[HolderFields, ...]], dict[str, ReplicaInfo]]:
    """The (holders of each key, ReplicaInfo of each replica they name) of an answer to a
    query of `num_keys` keys; WireError, naming the problem, for anything else."""
    if type(data) is not bytes:
        raise WireError(f"a query answer is a {type(data).__name__}, not bytes")
    if len(data) > MAX_ANSWER_BYTES:
        raise WireError(f"a query answer of {len(data)} bytes, over {MAX_ANSWER_BYTES}")
    try:
        message = msgpack.unpackb(
            data, raw=False, max_str_len=MAX_NAME_BYTES, max_bin_len=MAX_ANSWER_BYTES, max_map_len=0, max_ext_len=0
        )
    except Exception as e:
        raise WireError(f"a query answer that is not msgpack of this format: {type(e).__name__}: {e}") from None
    if type(message) is not list or len(message) != 4 or message[0] != ANSWER_FORMAT:
        raise WireError(f"not a query answer of format {ANSWER_FORMAT}: {message!r:.80}")
    _, replicas, counts_bytes, fields_bytes = message
    if type(replicas) is not list or type(counts_bytes) is not bytes or type(fields_bytes) is not bytes:
        raise WireError("a query answer whose replicas are not a list, or whose counts or holders are not bytes")
    if len(counts_bytes) != num_keys * _COUNT.itemsize:
        raise WireError(f"an answer of {len(counts_bytes) / _COUNT.itemsize:g} keys to a query of {num_keys}")
    counts = np.frombuffer(counts_bytes, _COUNT)
    if len(fields_bytes) != 3 * _FIELD.itemsize * int(counts.sum(dtype=np.uint64)):
        raise WireError(f"a query answer whose counts of holders do not add up to its {len(fields_bytes) // 24} holders")
    named = [_replica_info(fields, "a query answer") for fields in replicas]
    infos = {info.replica_id: info for info in named}
    if len(infos) != len(named):
        raise WireError("a query answer that names a replica twice")
    fields = np.frombuffer(fields_bytes, _FIELD).reshape(-1, 3)
    if len(fields):
        replica = fields[:, 0]
        if int(replica.max()) >= len(named):
            raise WireError(f"a query answer's holder names replica {int(replica.max())} of {len(named)}")
        num_rows = np.array([info.num_rows for info in named], dtype=_FIELD)
        outside = np.flatnonzero(fields[:, 1] >= num_rows[replica])
        if len(outside):
            info, row = named[int(replica[outside[0]])], int(fields[outside[0], 1])
            raise WireError(f"a query answer's holder {info.replica_id!r} is in row {row} of a pool of {info.num_rows}")
    ids, nodes = [info.replica_id for info in named], [info.node_id for info in named]
    each = [(ids[replica], nodes[replica], row, generation) for replica, row, generation in fields.tolist()]
    if len(each) == num_keys and (not num_keys or counts.min() == 1):  # one holder a key, the common case
        return [(holder,) for holder in each], infos
    taken = iter(each)
    return [tuple(itertools.islice(taken, count)) for count in counts.tolist()], infos


# ---- a replica's info ------------------------------------------------------------------


def _info_fields(info: ReplicaInfo) -> list:
    return [
        info.replica_id, info.node_id, info.pool_name, info.num_rows, info.num_ranks, info.slot_bytes,
        info.cache_epoch, info.endpoint,
    ]


def _replica_info(fields: object, what: str) -> ReplicaInfo:
    if type(fields) not in (list, tuple) or len(fields) != _REPLICA_FIELDS:
        raise WireError(f"{what}'s replica {fields!r:.80} is not a list of {_REPLICA_FIELDS} fields")
    for value in fields[3:7]:
        if type(value) is not int:
            raise WireError(f"{what}'s replica {fields[0]!r:.80}: {value!r} is not an int")
    endpoint = fields[7]
    if type(endpoint) is bytes and len(endpoint) > MAX_ENDPOINT_BYTES:
        raise WireError(f"{what}'s endpoint of {len(endpoint)} bytes, over {MAX_ENDPOINT_BYTES}")
    try:
        return ReplicaInfo(*fields[:7], endpoint=endpoint)
    except ValueError as e:
        raise WireError(f"{what}'s replica: {e}") from None
