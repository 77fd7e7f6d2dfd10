"""The contract of an eviction policy (`CachePolicy`): it orders resident keys and nothing else."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

from distkv.abstract import OffloadKey

Evictable = Callable[[OffloadKey], bool]


class CachePolicy(ABC):
    """Orders the resident keys of a cache of `capacity` blocks for eviction.

    A key is resident from `insert` until `remove`, `evict` or `clear` drops it. The
    caller never inserts a key that is resident and keeps at most `capacity` keys
    resident at once.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"policy capacity={capacity}: must be at least 1")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: OffloadKey) -> None:
        """Make a key resident: it was just brought into the cache (a miss)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of each resident key; keys that are not resident are ignored.

        keys[0] ends up the most recently used: a prefix's later blocks are worthless
        without its earlier ones, so they should go first.
        """

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a resident key without counting it as an eviction (e.g. a failed store)."""

    @abstractmethod
    def evict(self, n: int, evictable: Evictable) -> list[OffloadKey] | None:
        """Choose and drop exactly n resident keys among those for which evictable(key).

        Returns the keys dropped. Atomic: if fewer than n keys qualify, returns
        None and the policy is unchanged.
        """

    @abstractmethod
    def clear(self) -> None:
        """Drop every key, and any history the policy keeps."""


def next_evictable(keys: Iterator[OffloadKey], evictable: Evictable) -> OffloadKey | None:
    for key in keys:
        if evictable(key):
            return key
    return None
