"""The Directory's records: a holder, a replica, a follower's cursor and the changes it reads.

What a shard keeps and what crosses between a shard and a replica, as plain types. A
holder's fields travel as a plain tuple (`HolderFields`) and become a `Holder` in a
replica's view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from distkv.abstract import OffloadKey

# (key, row, generation): a block this replica made loadable in one of its pool's rows.
StoredEntry = tuple[OffloadKey, int, int]


# (replica_id, node_id, stored, removed): one replica's change, stored applied after removed.
LogEntry = tuple[str, str, list[StoredEntry], list[OffloadKey]]


# A Holder's fields in a plain tuple, as the Directory keeps and sends them: a plain tuple
# costs less to keep and to encode than a NamedTuple.
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


def with_holder(current: tuple[HolderFields, ...] | None, holder: HolderFields) -> tuple[HolderFields, ...]:
    """`current` with `holder` in place of any earlier holder of the same replica (field 0)."""
    if current is None:
        return (holder,)
    replica_id = holder[0]
    return tuple(h for h in current if h[0] != replica_id) + (holder,)


def drop_holder(holders: dict[OffloadKey, tuple[HolderFields, ...]], key: OffloadKey, replica_id: str) -> None:
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
