"""The Directory: which replicas of a cache namespace hold which blocks, both sides of its wire.

The shard's side: `state` (one shard's holders) with its `changelog`, `snapshot` and the
process's `upkeep`. The replica's side: `link` (DirectoryLink), whose parts are the
`publisher`, the view (`views`: followed through a `follower`, queried through a
`querier`, or the switch between them), the shards as `client`s, and the node's `relay`
of publishes. Between the two: the `records` that cross, the `wire` they cross as (a
query's answer among them), the query `query_channel`, `placement` (which shard keeps a block)
and the `node_table` the shards follow.

May import: the foundation (`distkv.abstract`, `distkv.config`, `distkv.names`),
`distkv.observability`, and `distkv.storage`'s key and slot rules. No Ray: the shards come
in as `client.ShardClient`s from whoever wires the cluster (`ray_actors` wraps a state in
an actor per shard).

`distkv.directory` itself names the records that cross Ray (`ReplicaInfo`, `Cursor`,
`Changes`, `Holder`), as the module `distkv.directory` did before the subpackages.
"""

from distkv.directory.records import Changes, Cursor, Holder, ReplicaInfo

__all__ = ["Changes", "Cursor", "Holder", "ReplicaInfo"]
