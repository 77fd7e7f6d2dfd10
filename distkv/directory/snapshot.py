"""A shard's snapshot, collected and packed a step at a time while the shard goes on changing.

A follower whose cursor fell off the log, or comes from another epoch, gets a snapshot and
the log's entries since the snapshot's cursor (`DirectoryState.snapshot_answer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from distkv.abstract import OffloadKey
from distkv.directory.records import Cursor
from distkv.directory.wire import encode_entry

if TYPE_CHECKING:
    from distkv.directory.state import DirectoryState

# A snapshot is collected and packed this many keys at a time (`SnapshotBuilder.step`), its
# shard taking other calls in between.
SNAPSHOT_STEP_KEYS = 1 << 11


class Snapshot(NamedTuple):
    """A complete `SnapshotBuilder`'s snapshot: the log's cursor it started at, and each
    replica's holders in encoded chunks, (replica_id, an encoded LogEntry)."""

    cursor: Cursor
    chunks: list[tuple[str, bytes]]


class SnapshotBuilder:
    """A snapshot of a `DirectoryState`, collected and packed a step at a time while the
    state goes on changing in between.

    It starts at the state's `cursor`; each `step` takes up to `max_keys` more of a
    replica's holders as they are when it runs. The snapshot followed by the log's entries
    since `cursor` is exactly the state (`DirectoryState.snapshot_answer`): for each key
    and replica, those entries replay every change after `cursor` in order (a store sets
    the holder, a removal drops it), and where there was none, the holder a step took is
    the one at `cursor` (a fuzzy snapshot and its redo log). Only the state's own thread
    steps it.
    """

    def __init__(self, state: DirectoryState) -> None:
        self._state = state
        self.cursor = state.cursor()
        self._pending = state.replica_ids()  # the replicas still to collect, in turn
        self._replica: str | None = None
        self._keys: list[OffloadKey] = []  # the current replica's keys still to collect
        self._chunks: list[tuple[str, bytes]] = []
        self._complete = False

    def step(self, max_keys: int = SNAPSHOT_STEP_KEYS) -> bool:
        """Collect and pack up to `max_keys` more holders; whether the snapshot is complete."""
        state = self._state
        left = max_keys
        while left > 0:
            if not self._keys:
                if not self._pending:
                    self._complete = True
                    return True
                self._replica = self._pending.pop()
                # None: one dropped since the cursor, whose holders the log removes
                self._keys = state.keys_of(self._replica) or []
                continue
            taken = self._keys[-left:]
            del self._keys[-left:]
            left -= len(taken)
            held = state.entries_of(self._replica, taken)
            if held is None:  # dropped since the last step: the log removes its holders
                self._keys = []
                continue
            node_id, stored = held
            self._chunks.append((self._replica, encode_entry((self._replica, node_id, stored, []))))
        return False

    def snapshot(self) -> Snapshot:
        """The complete snapshot."""
        if not self._complete:
            raise RuntimeError("SnapshotBuilder.snapshot: the snapshot is not complete (step until it is)")
        return Snapshot(self.cursor, self._chunks)
