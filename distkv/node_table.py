"""Old path of `DeadNodesVersion`, kept for pickles: the cluster's NodeWatcher and the
Directory's shards pass it back and forth over Ray, and a watcher and a shard of different
versions meet during a rolling upgrade (docs/operations.md, "Rolling upgrades"). New code
imports it from `distkv.directory.node_table`.
"""

from distkv.directory.node_table import DeadNodesVersion

__all__ = ["DeadNodesVersion"]
