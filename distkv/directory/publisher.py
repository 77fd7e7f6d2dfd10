"""Tells one shard what the replica holds there: register, batched publishes, retries, and
the re-register with everything held when the shard forgets the replica.

A publish reaches its shard by the link's publish path (`PublishPath`): the shard itself
(`DirectPublish`), or the node's relay (`distkv.directory.relay.RelayBatch`), which a
queried link publishes through.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import random
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

from distkv.abstract import OffloadKey
from distkv.directory.client import MAX_BATCH_KEYS, ShardClient, backoff
from distkv.directory.records import ReplicaInfo, StoredEntry
from distkv.directory.state import FLUSH_INTERVAL_S
from distkv.directory.wire import encode_changes, encode_stored
from distkv.observability.errors import ErrorLog

logger = logging.getLogger(__name__)


class PublishPath(Protocol):
    """How a link's publishes reach their shards. `publish` sends one (or queues it for the
    next `flush`, which the link's thread calls at the end of each step) and returns the
    Future of the shard's answer: (epoch, whether the shard knows the replica, the interval
    the replica is to leave between its calls)."""

    def publish(self, shard: int, replica_id: str, seq: int, changes: bytes, report: dict | None) -> Future: ...

    def flush(self) -> None: ...


class DirectPublish:
    """The publish path to each shard itself: one call per publish."""

    def __init__(self, shards: Sequence[ShardClient], namespace: str) -> None:
        self.shards = list(shards)
        self.namespace = namespace

    def publish(self, shard: int, replica_id: str, seq: int, changes: bytes, report: dict | None) -> Future:
        return self.shards[shard].publish(replica_id, seq, changes, report, self.namespace)

    def flush(self) -> None:
        pass


class CallKind(enum.Enum):
    """A publisher's call to its shard; the value is the shard's method."""

    REGISTER = "register"
    PUBLISH = "publish"


# A link that has published nothing for this long, or for its shard's flush interval if
# longer, publishes an empty batch, so the Directory knows it is alive; any publish counts
# as a heartbeat.
HEARTBEAT_INTERVAL_S = 1.0
# Replicas re-register after a random delay up to this, so a fresh shard is not hit all at once.
RESYNC_JITTER_S = 0.5
# A shard's changes not yet published, past this many keys and past what the replica holds
# there, are dropped for a re-register with everything it holds: while a shard is down,
# the removals would pile up without bound, and re-registering says the same in fewer keys.
MAX_PENDING_KEYS = 1 << 16


# (seq, stored entries, removed keys or None for a register): what a call sends
Batch = tuple[int, list[StoredEntry], list[OffloadKey] | None]


class Publisher:
    """Tells one shard what the replica holds there, until the shard has it.

    `store` and `remove` change what the replica holds; `queued` then schedules the
    changes: they go out in numbered batches, `flush_interval` after the previous call at
    the soonest, and an empty one (a heartbeat) when there was nothing to send for
    max(HEARTBEAT_INTERVAL_S, flush_interval). The shard sets the interval with each
    answer (`DirectoryState.publish_interval`: it grows with the replicas it serves), so
    the calls of all its replicas stay within what it can take; a change after a quiet
    interval goes at once, changes that keep coming go together, one call per interval.
    A full batch (MAX_BATCH_KEYS) goes without waiting: it cannot grow by waiting.
    One call is in flight at a time; a failed one is sent
    again, the same batch, after a backoff, however long the shard is down. When the
    shard does not know the replica (it restarted, or expired it), or `saw_epoch` reports
    a shard epoch other than the one registered with, the publisher registers again with
    everything held, and drops the changes pending (the register says them). So do
    changes pending past MAX_PENDING_KEYS and past what is held. No call carries more
    than MAX_BATCH_KEYS keys: a register sends the first of what is held, the rest goes
    on as pending, in publishes of that many keys at most, one after another.

    `step(now)` does all the calling and returns when it next needs a step; `wake` runs
    when a call finishes. Not thread-safe: one thread (the link's) steps it.
    """

    def __init__(
        self,
        index: int,
        client: ShardClient,
        namespace: str,
        info: ReplicaInfo,
        *,
        wake: Callable[[], None],
        errors: ErrorLog,
        event_lags: collections.deque[tuple[int, float]],
        path: PublishPath,
    ) -> None:
        """`event_lags` gets (index, seconds) per batch of stores and removals applied,
        from the oldest change coming in. `path`: how its publishes reach the shard (its
        link's); registers and unregisters go to `client`, the shard itself."""
        self.index = index
        self.client = client
        self.path = path
        self.namespace = namespace
        self.info = info
        self._wake = wake
        self._errors = errors
        self._event_lags = event_lags
        # the replica's stats, sent along with a publish every HEARTBEAT_INTERVAL_S at most
        self.report: Callable[[], dict] | None = None
        self.held: dict[OffloadKey, tuple[int, int]] = {}  # this replica's blocks in the shard
        # not yet published (None: removed); empty while a re-register is due
        self.pending: dict[OffloadKey, tuple[int, int] | None] = {}
        self.flush_at = float("inf")  # when pending is due to go (flush_interval apart at most)
        self.flush_interval = FLUSH_INTERVAL_S  # as the shard last asked
        # time.monotonic() when the oldest change not yet sent came in, and that of the
        # batch being published (or to be sent again): for the event lag
        self.pending_since: float | None = None
        self.batch_since: float | None = None
        self.reported_at = -float("inf")  # when the replica's stats last went with a publish
        self.seq = 0
        self.publishing: Future | None = None
        self._call: tuple[CallKind, Batch] | None = None  # what `publishing` sent
        self.failed_batch: Batch | None = None  # a publish to send again
        self.failures = 0
        self.retry_at = 0.0
        self.last_sent = -float("inf")
        self.registered_epoch: str | None = None
        self.resync_at: float | None = 0.0  # when to register and publish everything held

    def store(self, key: OffloadKey, row: int, generation: int) -> None:
        """The replica holds `key` in `row`, sealed with `generation`."""
        self.held[key] = self.pending[key] = (row, generation)

    def remove(self, key: OffloadKey) -> None:
        """The replica no longer holds `key`."""
        self.held.pop(key, None)
        self.pending[key] = None

    def queued(self, now: float, flush_at: float, lagged: bool) -> None:
        """After `store`s and `remove`s: have them published by `flush_at`. `lagged`:
        they count for the event lag (promoted blocks held back on purpose do not)."""
        if self.resync_at is None and len(self.pending) > max(MAX_PENDING_KEYS, len(self.held)):
            self.resync_later(now)
        if self.resync_at is not None:
            # the re-register sends everything held, which these changes are part of
            self.pending.clear()
            self.failed_batch = None
            return
        if self.pending:
            self.flush_at = min(self.flush_at, flush_at)
            if self.pending_since is None and lagged:
                self.pending_since = now

    def switch_info(self, info: ReplicaInfo, now: float) -> None:
        """Unregister the replica's old id and register as `info`, with what it holds."""
        old_id, self.info = self.info.replica_id, info
        try:
            self.client.unregister(old_id, self.namespace)
        except Exception as e:  # the shard is down: its restart forgets the old id anyway
            self._errors.add("directory_publish", f"shard {self.index}: unregister failed: {e}")
        self.resync_later(now)

    def saw_epoch(self, epoch: str, now: float) -> None:
        """The shard answered from `epoch`: if it is not the one registered with, the shard
        restarted since, so register again."""
        if self.registered_epoch is not None and epoch != self.registered_epoch:
            self.resync_later(now)

    def resync_later(self, now: float) -> None:
        """Register again with everything held, after a random delay up to RESYNC_JITTER_S."""
        if self.resync_at is None:
            self.resync_at = now + random.uniform(0.0, RESYNC_JITTER_S)
            self.registered_epoch = None

    def step(self, now: float) -> float:
        """Collect the finished call and start the next one; when to step again at the latest."""
        future = self.publishing
        if future is not None and future.done():
            self.publishing = None
            self._done(future, now)
        if self.publishing is None:
            return min(now + HEARTBEAT_INTERVAL_S, self._next(now))
        return now + HEARTBEAT_INTERVAL_S

    def unregister(self) -> Future | None:
        """Unregister the replica (when the link closes); None if the call could not be sent."""
        try:
            return self.client.unregister(self.info.replica_id, self.namespace)
        except Exception:
            return None

    def _next(self, now: float) -> float:
        if self.resync_at is not None:
            if now < self.resync_at:
                return self.resync_at
            self.resync_at = None
            self.failed_batch = None
            self.pending.clear()
            self.flush_at = float("inf")
            self.pending_since = self.batch_since = None
            self.seq += 1
            held = iter(self.held.items())
            stored = [(key, row, generation) for key, (row, generation) in itertools.islice(held, MAX_BATCH_KEYS)]
            self.pending.update(held)
            if self.pending:
                self.flush_at = now
            self._send(CallKind.REGISTER, (self.seq, stored, None), now)
            return now + HEARTBEAT_INTERVAL_S
        if self.failed_batch is not None:
            if now < self.retry_at:
                return self.retry_at
            batch, self.failed_batch = self.failed_batch, None
            self._send(CallKind.PUBLISH, batch, now)
            return now + HEARTBEAT_INTERVAL_S
        pending = self.pending
        heartbeat_at = self.last_sent + max(HEARTBEAT_INTERVAL_S, self.flush_interval)
        if len(pending) > MAX_BATCH_KEYS:
            batch = {key: pending.pop(key) for key in list(itertools.islice(pending, MAX_BATCH_KEYS))}
        elif pending:
            due = min(max(self.last_sent + self.flush_interval, self.flush_at), heartbeat_at)
            if now < due:
                return due
            batch = pending
        elif now < heartbeat_at:
            return heartbeat_at
        else:
            batch = pending
        stored = []
        removed = []
        for key, block in batch.items():
            if block is None:
                removed.append(key)
            else:
                stored.append((key, *block))
        self.batch_since = self.pending_since
        if batch is pending:
            pending.clear()
            self.flush_at = float("inf")
            self.pending_since = None
        self.seq += 1
        self._send(CallKind.PUBLISH, (self.seq, stored, removed), now)
        return now + HEARTBEAT_INTERVAL_S

    def _send(self, kind: CallKind, batch: Batch, now: float) -> None:
        seq, stored, removed = batch
        self.last_sent = now
        try:
            if kind is CallKind.REGISTER:
                future = self.client.register(self.info, seq, encode_stored(stored), self.namespace)
            else:
                future = self.path.publish(
                    self.index, self.info.replica_id, seq, encode_changes(stored, removed), self._report(now)
                )
        except Exception as e:
            self._failed(kind, batch, e, now)
            return
        self.publishing = future
        self._call = (kind, batch)
        wake = self._wake
        future.add_done_callback(lambda _: wake())

    def _failed(self, kind: CallKind, batch: Batch, error: Exception, now: float) -> None:
        """The shard is down, restarting or unreachable: send the same again later."""
        self.failures += 1
        self._errors.add("directory_publish", f"shard {self.index}: {kind.value} failed: {error}")
        if self.failures == 1:
            logger.warning("directory shard %d: %s failed, retrying: %s", self.index, kind.value, error)
        if kind is CallKind.REGISTER:
            self.resync_at = now + backoff(self.failures)
        else:
            self.failed_batch = batch
            self.retry_at = now + backoff(self.failures)

    def _done(self, future: Future, now: float) -> None:
        kind, batch = self._call
        self._call = None
        try:
            epoch, known, self.flush_interval = future.result()
        except Exception as e:
            self._failed(kind, batch, e, now)
            return
        if self.failures:
            logger.info("directory shard %d: %s went through again", self.index, kind.value)
            self.failures = 0
        if kind is CallKind.REGISTER:
            self.registered_epoch = epoch
        elif not known:
            self.resync_later(now)
        elif self.batch_since is not None:
            self._event_lags.append((self.index, now - self.batch_since))
            self.batch_since = None

    def _report(self, now: float) -> dict | None:
        """The replica's stats when they are due to go to the shard, else None."""
        if self.report is None or now - self.reported_at < HEARTBEAT_INTERVAL_S:
            return None
        self.reported_at = now
        try:
            return self.report()
        except Exception:  # the stats must never hold up publishing
            logger.exception("directory link: the replica's report failed")
            return None
