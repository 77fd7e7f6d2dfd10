"""A shard's numbered changes, which followers read from their cursors."""

from __future__ import annotations

import collections
import itertools
import random

from distkv.directory.records import Cursor, LogEntry

class ChangeLog:
    """A shard's numbered changes and the cursors that point into them.

    Entries are numbered from 0 in the order appended. The log keeps the latest ones, up
    to about `capacity` keys (the latest entry always), and drops the oldest. `epoch`
    names this log among every incarnation of its shard, so that a cursor from another
    one is never read as a position here. `replicas_version` counts the changes to the
    set of registered replicas; a cursor carries it so that a follower learns when to
    fetch that set again.
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"log_capacity={capacity!r}: must be a positive int")
        self.epoch = random.randbytes(8).hex()
        self.replicas_version = 0
        self._capacity = capacity
        self._entries: collections.deque[LogEntry] = collections.deque()
        self._start = 0  # position of _entries[0]
        self._keys = 0
        # the position and replica of the latest entry, and the position of the latest
        # entry by another replica than that: `has_news` in O(1)
        self._last_entry: tuple[int, str | None] = (-1, None)
        self._last_other = -1

    def __len__(self) -> int:
        """How many entries the log keeps now."""
        return len(self._entries)

    def cursor(self) -> Cursor:
        """The cursor of a follower that has seen every change so far."""
        return Cursor(self.epoch, self._start + len(self._entries), self.replicas_version)

    def append(self, entry: LogEntry) -> None:
        """Add `entry` at the next position, dropping the oldest entries past the capacity."""
        entries = self._entries
        last_position, last_replica = self._last_entry
        if entry[0] != last_replica:
            self._last_other = last_position
        self._last_entry = (self._start + len(entries), entry[0])
        entries.append(entry)
        self._keys += len(entry[2]) + len(entry[3])
        while self._keys > self._capacity and len(entries) > 1:
            _, _, stored, removed = entries.popleft()
            self._keys -= len(stored) + len(removed)
            self._start += 1

    def replicas_changed(self) -> None:
        """Note that a replica came or went: a follower at an earlier cursor needs the set again."""
        self.replicas_version += 1

    def position(self, cursor: Cursor | None) -> int | None:
        """Where in the log `cursor` stands; None when it needs a snapshot (None, another
        epoch, or fallen off the log). A ValueError if `cursor` is no cursor at all."""
        if cursor is None:
            return None
        try:
            epoch, position, _ = cursor
        except (TypeError, ValueError):
            raise ValueError(f"changes: cursor {cursor!r} is not an (epoch, position, replicas_version)") from None
        end = self._start + len(self._entries)
        if epoch == self.epoch and isinstance(position, int) and self._start <= position <= end:
            return position
        return None

    def since(self, position: int, max_keys: int | None = None) -> list[LogEntry]:
        """The entries from `position` (one that `position()` returned) on, in order: to the
        latest, or as many as hold `max_keys` keys at most (one at least)."""
        entries = self._entries
        offset = position - self._start
        if max_keys is None or offset >= len(entries) // 2:  # nearer the end: read from there
            after = list(itertools.islice(reversed(entries), len(entries) - offset))
            after.reverse()
            if max_keys is None:
                return after
        else:
            after = itertools.islice(entries, offset, None)
        taken: list[LogEntry] = []
        keys = 0
        for entry in after:
            keys += len(entry[2]) + len(entry[3])
            if taken and keys > max_keys:
                break
            taken.append(entry)
        return taken

    def has_news(self, cursor: Cursor | None, follower: str | None = None) -> bool:
        """Whether a follower at `cursor` has more to learn than `follower`'s own entries:
        a snapshot, a changed set of replicas, or an entry of another replica."""
        now = self.cursor()
        if cursor == now:
            return False
        position = self.position(cursor)
        if position is None or cursor[2] != now.replicas_version:
            return True
        last_position, last_replica = self._last_entry
        return (self._last_other if last_replica == follower else last_position) >= position
