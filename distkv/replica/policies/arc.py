"""ARC (adaptive replacement cache): recency and frequency, balanced by what evicted keys
that come back say."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from distkv.abstract import OffloadKey
from distkv.replica.policies.base import CachePolicy, Evictable, next_evictable


_ABSENT = object()


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

    T1 holds keys used once since they came in, T2 keys used again; B1 and B2 remember
    keys recently evicted from T1 and T2 (ghosts, no data). Evictions take from T1
    while it is larger than the target p, else from T2. A key brought back while in B1
    means T1 was too small (p grows), in B2 that T2 was (p shrinks); either way it
    returns to T2. Ghosts are bounded as in the paper: |T1| + |B1| <= c and
    |T1| + |T2| + |B1| + |B2| <= 2c.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._p = 0.0
        # each list oldest first
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    @property
    def target_t1_size(self) -> float:
        """The adaptive target p for the size of T1, in [0, capacity]."""
        return self._p

    def insert(self, key: OffloadKey) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._p = min(self._p + max(1.0, len(b2) / len(b1)), self.capacity)
            del b1[key]
            self._t2[key] = None
        elif key in b2:
            self._p = max(self._p - max(1.0, len(b1) / len(b2)), 0.0)
            del b2[key]
            self._t2[key] = None
        else:
            t1 = self._t1
            t1[key] = None
            if b1 and len(t1) + len(b1) > self.capacity:
                b1.popitem(last=False)
            elif b2 and len(t1) + len(self._t2) + len(b1) + len(b2) > 2 * self.capacity:
                b2.popitem(last=False)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        move_to_end, pop_t1 = t2.move_to_end, t1.pop
        # T2 first: the keys a request touches are mostly prefix hits, used before
        for key in reversed(keys):
            if key in t2:
                move_to_end(key)
            elif pop_t1(key, _ABSENT) is not _ABSENT:
                t2[key] = None

    def remove(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def evict(self, n: int, evictable: Evictable) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        t1_keys, t2_keys = iter(t1), iter(t2)
        t1_size = len(t1)  # as it will be once the chosen victims are gone
        from_t1: list[OffloadKey] = []
        from_t2: list[OffloadKey] = []
        for _ in range(n):
            if t1_size > self._p:
                key = next_evictable(t1_keys, evictable)
                if key is None:
                    key = next_evictable(t2_keys, evictable)
                    if key is None:
                        return None
                    from_t2.append(key)
                    continue
            else:
                key = next_evictable(t2_keys, evictable)
                if key is not None:
                    from_t2.append(key)
                    continue
                key = next_evictable(t1_keys, evictable)
                if key is None:
                    return None
            from_t1.append(key)
            t1_size -= 1
        b1, b2 = self._b1, self._b2
        for key in from_t1:
            del t1[key]
            b1[key] = None
        for key in from_t2:
            del t2[key]
            b2[key] = None
        return from_t1 + from_t2

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._p = 0.0
