"""What crosses between a replica and a shard, and how a shard checks what it takes in.

Bulk payloads (a register's stored entries, a publish's changes, a follower's changes)
cross packed (`pack`), a shard taking them in as plain data only (`unpack_plain`,
`unpack_changes`, `unpack_stored`), each call bounded (MAX_CALL_KEYS keys) and every entry
checked (`check_stored`) before any of it is applied. Query answers cross typed
(`distkv.directory.answer`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from typing import Any

from distkv.storage.keys import MIN_KEY_BYTES, key_problem
from distkv.storage.slots import MAX_KEY_BYTES

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
