"""A shard process's upkeep: how late its own wake-ups run, and when it collects its garbage."""

from __future__ import annotations

import collections
import gc

class Lateness:
    """How long a call that a shard takes now may have waited for it: the worst lateness of
    the shard's own periodic wake-ups over the last `window_s`.

    A shard that was stopped, starved of CPU or swamped with calls wakes late by about as
    long as a replica's heartbeat has waited in its queue, so a replica's silence counts
    against its timeout only beyond that (see `DirectoryState.expire`'s callers).
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._late: collections.deque[tuple[float, float]] = collections.deque()  # (when, seconds late)

    def woke(self, due: float, now: float) -> None:
        """A wake-up due at `due` ran at `now`."""
        late = self._late
        late.append((now, max(0.0, now - due)))
        while late[0][0] < now - self._window_s:
            late.popleft()

    def worst(self) -> float:
        """The longest a wake-up of the window ran late (0 before any)."""
        return max((seconds for _, seconds in self._late), default=0.0)


# A shard's state is a few large long-lived containers, which a full garbage collection
# traverses whole while no call is answered (docs/benchmarks.md); what the shard frees is
# acyclic, freed by reference counting. So a shard makes a full collection only every
# FULL_COLLECTION_S, and collects its young generations every YOUNG_COLLECTION_KEYS keys
# it stores (each such collection visits a few objects per key: its holder, the tuple of
# its holders, its entry in the log).
FULL_COLLECTION_S = 600.0


YOUNG_COLLECTION_KEYS = 8192


def defer_full_collections() -> None:
    """Make this process's full garbage collections only those it asks for (`gc.collect()`)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1 << 30)


class ShardCollections:
    """When a shard's process collects its garbage: told the keys its state stored
    (`stored`, after each change) and stepped by its watcher (`step`, for the full one).

    Python starts a young collection when the objects made outnumber those freed by its
    threshold. A shard under churn frees about as many objects as it makes (each removed
    key's holder for each stored key's), so that never happens while the new objects pile
    up in the young generation, until some burst starts a collection that visits them all
    at once (docs/benchmarks.md). Collecting the young generations every
    `young_every_keys` stored keys keeps each visit to that many keys' objects.
    """

    def __init__(
        self, now: float, young_every_keys: int = YOUNG_COLLECTION_KEYS, full_every_s: float = FULL_COLLECTION_S
    ) -> None:
        self._young_every_keys = young_every_keys
        self._full_every_s = full_every_s
        self._young_from = 0  # the stored keys at the last young collection
        self._full_at = now + full_every_s

    def stored(self, keys: int) -> None:
        """After a change: the state has stored `keys` keys in all (`DirectoryState.stored_keys`)."""
        if keys - self._young_from >= self._young_every_keys:
            gc.collect(1)
            self._young_from = keys

    def step(self, now: float) -> None:
        """The full collection, if due by `now`."""
        if now >= self._full_at:
            gc.collect()
            self._full_at = now + self._full_every_s
