"""LRU: evict the least recently inserted or touched key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from distkv.abstract import OffloadKey
from distkv.replica.policies.base import CachePolicy, Evictable


class LRUPolicy(CachePolicy):
    """Evicts the least recently inserted or touched key."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # oldest first
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey) -> None:
        self._order[key] = None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        move_to_end = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        del self._order[key]

    def evict(self, n: int, evictable: Evictable) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        victims: list[OffloadKey] = []
        for key in self._order:
            if evictable(key):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()
