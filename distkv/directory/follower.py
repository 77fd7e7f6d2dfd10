"""A follower of one shard: the long poll of its changes (`Follower`) into a copy of it (`ShardView`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from distkv.abstract import OffloadKey
from distkv.directory.client import ShardClient, backoff
from distkv.directory.records import Changes, Cursor, Holder, ReplicaInfo, drop_holder, with_holder
from distkv.directory.wire import decode_feed
from distkv.observability.errors import ErrorLog

# How long a shard holds a change poll open when nothing changes.
POLL_TIMEOUT_S = 2.0


class Follower:
    """Keeps one shard's `ShardView` current: long-polls the shard's changes and applies them.

    One poll is in flight at a time; the shard answers it once another replica changed
    something, or after POLL_TIMEOUT_S. A failed poll is made again after a backoff. Each
    answer's epoch goes to `saw_epoch`, so that the publisher learns of a restarted shard.
    The view's `exclude` is the follower's own replica, whose changes do not end a poll.

    `step(now)` does all the calling and returns when it next needs a step; `wake` runs
    when a poll finishes. Not thread-safe: one thread (the link's) steps it.

    Its first poll has no cursor, which the shard answers at once with a snapshot of
    everything it holds: `synced` from then on.
    """

    def __init__(
        self,
        index: int,
        client: ShardClient,
        namespace: str,
        view: ShardView,
        *,
        wake: Callable[[], None],
        errors: ErrorLog,
        saw_epoch: Callable[[str, float], None],
    ) -> None:
        self.index = index
        self.client = client
        self.namespace = namespace
        self.view = view
        self._wake = wake
        self._errors = errors
        self._saw_epoch = saw_epoch
        self.polling: Future | None = None
        self.poll_failures = 0
        self.poll_at = 0.0

    @property
    def synced(self) -> bool:
        """Whether the view holds the shard: an answer (the first one a snapshot) was applied."""
        return self.view.cursor is not None

    def step(self, now: float) -> float:
        """Apply a finished poll and start the next one when due; when to step again at the latest."""
        future = self.polling
        if future is not None and future.done():
            self.polling = None
            self._done(future, now)
        if self.polling is None and now >= self.poll_at:
            try:
                future = self.client.changes(self.view.cursor, POLL_TIMEOUT_S, self.namespace, self.view.exclude)
            except Exception as e:
                self._failed(now, e)
            else:
                self.polling = future
                wake = self._wake
                future.add_done_callback(lambda _: wake())
        return self.poll_at if self.polling is None else float("inf")

    def cancel(self) -> None:
        """Give up the poll in flight, if any (when the link closes)."""
        if self.polling is not None:
            try:
                self.client.cancel(self.polling)
            except Exception:
                pass

    def _done(self, future: Future, now: float) -> None:
        try:
            changes = decode_feed(future.result())
        except Exception as e:
            self._failed(now, e)
            return
        self.poll_failures = 0
        self.view.apply(changes)
        self._saw_epoch(changes.cursor.epoch, now)

    def _failed(self, now: float, error: Exception) -> None:
        self._errors.add("directory_poll", f"shard {self.index}: {error}")
        self.poll_failures += 1
        self.poll_at = now + backoff(self.poll_failures)


class ShardView:
    """A follower's copy of one shard: the holders of each key, kept current by `apply`.

    Holders of `exclude` (the follower's own replica) are left out. The shards of a link
    share one `holders` dict (`shared`), so a reader finds any key with one `holders.get`,
    from any thread: each key's tuple is replaced, never mutated. A shared view keeps the
    keys it added, since a key's shard is its holder's placement, not a function of the
    key, and a snapshot replaces only those. While a snapshot is applied a reader may
    briefly miss a key of the shard: a miss, never a wrong holder.
    """

    def __init__(
        self,
        exclude: str | None = None,
        holders: dict[OffloadKey, tuple[Holder, ...]] | None = None,
        shared: bool = False,
    ) -> None:
        self.exclude = exclude
        self.cursor: Cursor | None = None
        self.holders: dict[OffloadKey, tuple[Holder, ...]] = {} if holders is None else holders
        self.replicas: dict[str, ReplicaInfo] = {}
        # the keys this view added to a shared `holders`; None when it owns the dict
        self._keys: set[OffloadKey] | None = set() if shared else None

    def apply(self, changes: Changes) -> None:
        holders = self.holders
        keys = self._keys
        if changes.is_snapshot:
            self._forget_shard()
        exclude = self.exclude
        for replica_id, node_id, stored, removed in changes.entries:
            if replica_id == exclude:
                continue
            for key in removed:
                drop_holder(holders, key, replica_id)
                if keys is not None and key not in holders:
                    keys.discard(key)
            for key, row, generation in stored:
                holders[key] = with_holder(holders.get(key), Holder(replica_id, node_id, row, generation))
            if keys is not None:
                keys.update(key for key, _, _ in stored)
        if changes.replicas is not None:
            self.replicas = changes.replicas
        self.cursor = changes.cursor

    def _forget_shard(self) -> None:
        if self._keys is None:
            self.holders.clear()
            return
        holders = self.holders
        for key in self._keys:
            holders.pop(key, None)
        self._keys.clear()
