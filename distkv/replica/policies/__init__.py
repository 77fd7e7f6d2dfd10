"""Eviction policies: which resident blocks a full pool gives up first, one policy a module
(`lru`, `arc`) behind one contract (`base.CachePolicy`).

A policy orders resident keys and nothing else. Whether a block may be evicted right
now (pinned by a load, store in flight, offered in the same call) is the manager's
business, passed to `evict` as a predicate.
"""

from __future__ import annotations

from distkv.replica.policies.arc import ARCPolicy
from distkv.replica.policies.base import CachePolicy, Evictable
from distkv.replica.policies.lru import LRUPolicy

__all__ = ["ARCPolicy", "CachePolicy", "Evictable", "LRUPolicy", "make_policy"]

_POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> CachePolicy:
    """The policy called `name` ("lru" or "arc") for a cache of `capacity` blocks."""
    policy_cls = _POLICIES.get(name)
    if policy_cls is None:
        raise ValueError(
            f"unknown cache policy {name!r}: choose one of {', '.join(map(repr, _POLICIES))}"
        )
    return policy_cls(capacity)
