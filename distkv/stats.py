"""Old path of a replica's stats, kept for pickles: a `ReplicaStats` (and the counts in it)
crosses Ray from a replica's actor (`ray_actors.replica.ReplicaActor.stats`) to whoever
asks, of whichever version during a rolling upgrade (docs/operations.md, "Rolling
upgrades"). New code imports them from `distkv.observability.stats`.
"""

from distkv.observability.stats import BlockCounts, LookupCounts, PoolUsage, PromotionCounts, ReplicaStats, TransportCounts

__all__ = ["BlockCounts", "LookupCounts", "PoolUsage", "PromotionCounts", "ReplicaStats", "TransportCounts"]
