"""Old path of the Directory's records, kept for pickles: the module that defined them before
distkv's subpackages. A `ReplicaInfo` (a shard's `register` argument) and a `Cursor` (a
follower's `changes` argument) cross Ray pickled by module path, so a replica and a shard of
versions on either side of the move still read each other's during a rolling upgrade
(docs/operations.md, "Rolling upgrades"). New code imports them from `distkv.directory`.
"""

from distkv.directory.records import Changes, Cursor, Holder, ReplicaInfo

__all__ = ["Changes", "Cursor", "Holder", "ReplicaInfo"]
