"""What a shard answers its followers: the changes after a cursor from its log, or a
snapshot and the log since, each distinct answer packed once."""

from __future__ import annotations

from collections.abc import Callable

from distkv.directory.changelog import ChangeLog
from distkv.directory.records import Changes, Cursor, ReplicaInfo
from distkv.directory.snapshot import Snapshot, SnapshotBuilder
from distkv.directory.wire import PackedEntries, encode_feed

# A `changes` answer from the log carries whole entries of this many keys at most (one
# entry at least), so that a follower far behind costs the shard bounded work per answer
# and catches up over several; its cursor goes on from the last entry it got.
MAX_ANSWER_KEYS = 1 << 14


class ChangeFeed:
    """A shard's answers to its followers, from its `log`: `replicas` gives every registered
    replica's info, `builder` a snapshot to build. Packs each distinct answer once, and
    one snapshot serves every follower that needs one while its cursor is in the log."""

    def __init__(
        self, log: ChangeLog, replicas: Callable[[], dict[str, ReplicaInfo]], builder: Callable[[], SnapshotBuilder]
    ) -> None:
        self._log = log
        self._replicas = replicas
        self._builder = builder
        # packed answers of `changes` by where they start (None: a snapshot), valid while the log is at `_packed_at`
        self._packed: dict[tuple[int, bool] | None, bytes] = {}
        self._packed_at: Cursor | None = None
        self._snapshot: Snapshot | None = None  # the latest one built, which answers with the log since its cursor

    def changes(self, cursor: Cursor | None) -> Changes:
        """The changes after `cursor` (None: from nothing), with the cursor that follows
        them: all of them, or the first entries of MAX_ANSWER_KEYS keys at most (the
        answer's cursor then points before the latest; a snapshot, of the state as it is
        now, is never cut short)."""
        log = self._log
        now = log.cursor()
        position = log.position(cursor)
        if position is not None:
            replicas = None if cursor[2] == now.replicas_version else self._replicas()
            entries = log.since(position, MAX_ANSWER_KEYS)
            return Changes(now._replace(position=position + len(entries)), entries, replicas, False)
        changes = self.snapshot_answer(self._build_snapshot())
        return changes._replace(entries=changes.entries.entries())

    def packed_changes(self, cursor: Cursor | None) -> bytes:
        """`pack(self.changes(cursor))`, packed once for every follower that asks from the
        same place until the log changes: one publish wakes every follower, and most of
        them ask from the cursor of the change before it. A snapshot answer is the latest
        snapshot built and the log since, or a snapshot built here at once."""
        packed = self.packed_from_log(cursor)
        if packed is None:
            self.keep_snapshot(self._build_snapshot())
            packed = self.packed_from_log(cursor)
        return packed

    def packed_from_log(self, cursor: Cursor | None) -> bytes | None:
        """`packed_changes(cursor)` when it needs no snapshot built: the answer from the log,
        or the snapshot kept (`keep_snapshot`) with the log since its cursor, while that
        cursor is in the log; else None."""
        log = self._log
        now = log.cursor()
        if self._packed_at != now:
            self._packed.clear()
            self._packed_at = now
        position = log.position(cursor)
        # what the answer depends on: where in the log it starts (None: a snapshot) and
        # whether it carries the set of replicas
        start = None if position is None else (position, cursor[2] == now.replicas_version)
        packed = self._packed.get(start)
        if packed is not None:
            return packed
        if position is None:
            changes = None if self._snapshot is None else self.snapshot_answer(self._snapshot)
            if changes is None:
                return None
        else:
            changes = self.changes(cursor)
        packed = self._packed[start] = encode_feed(changes)
        return packed

    def keep_snapshot(self, snapshot: Snapshot) -> None:
        """Answer the followers that need a snapshot with `snapshot` and the log since its
        cursor, while that cursor is in the log."""
        self._snapshot = snapshot

    def drop_stale_snapshot(self) -> None:
        """Let go of the kept snapshot once its cursor fell off the log: it answers no one
        any more, and holds a packed copy of every holder."""
        if self._snapshot is not None and self._log.position(self._snapshot.cursor) is None:
            self._snapshot = None

    def snapshot_answer(self, snapshot: Snapshot) -> Changes | None:
        """The `changes` answer of a snapshot: `snapshot`'s chunks of the replicas registered
        now, then the log's entries since its cursor, up to now; None if that cursor fell
        off the log."""
        position = self._log.position(snapshot.cursor)
        if position is None:
            return None
        replicas = self._replicas()
        chunks = [chunk for replica_id, chunk in snapshot.chunks if replica_id in replicas]
        return Changes(self._log.cursor(), PackedEntries(chunks, self._log.since(position)), replicas, True)

    def _build_snapshot(self) -> Snapshot:
        builder = self._builder()
        while not builder.step():
            pass
        return builder.snapshot()
