"""The Directory: which replicas of a cache namespace hold which offloaded blocks.

The shards' data and logic (`DirectoryState`, its `ChangeLog`, a follower's `ShardView`)
are in `distkv.directory.state` and exported here too. This module is what one replica
holds: a `DirectoryLink`, which publishes the replica's stores and evictions and keeps a
view of everyone else's, doing all its calls on one background thread so that no caller
ever waits on the network. Its parts, each a plain class stepped by the link's thread:

- a `Publisher` per shard: register, batched publishes, retries, and the re-register
  with everything held when the shard forgets the replica;
- a `Follower` per shard: the long poll of the shard's changes into its `ShardView`;
- a `Querier` per shard, instead of the followers where the link is queried: batched
  questions about the keys the replica missed, whose answers stand in for the view;
- the shards themselves as `ShardClient`s, handed in by whoever wires the cluster
  together (`distkv.replica.specs.join_cluster` hands in `ray_actors.directory`'s actors). No
  Ray here: a test hands in clients whose futures it resolves itself.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

from distkv.abstract import OffloadKey
from distkv.config import DIRECTORY_VIEWS
from distkv.directory.answer import decode_answer
from distkv.directory.state import (
    FLUSH_INTERVAL_S,
    MAX_CALL_KEYS,
    ChangeLog,
    Changes,
    Cursor,
    DirectoryState,
    Holder,
    HolderFields,
    LogEntry,
    ReplicaInfo,
    ShardView,
    StoredEntry,
    check_namespace,
    check_stored,
    pack,
    shard_of,
    unpack,
)
from distkv.replica.local_manager import check_keys
from distkv.observability.errors import ErrorLog
from distkv.observability.metrics import MAX_OBSERVATIONS
from distkv.directory.relay import RelayBatch, RelayedShard

__all__ = [
    "FLUSH_INTERVAL_S", "ChangeLog", "Changes", "Cursor", "DIRECTORY_VIEWS", "DirectoryLink", "DirectoryState", "Follower",
    "Holder", "HolderFields", "InboxKind", "LogEntry", "Publisher", "Querier", "ReadyBlock", "ReplicaInfo", "ShardClient",
    "ShardView", "StoredEntry", "check_namespace", "check_stored", "pack", "shard_of", "unpack",
]

logger = logging.getLogger(__name__)


class ReadyBlock(Protocol):
    """A block of the replica's block table, as `DirectoryLink.ready` and `dropped` take it:
    `shard` is the shard its manager placed it on (docs/architecture.md, "Placement")."""

    row: int
    generation: int
    shard: int


class ShardClient(Protocol):
    """One Directory shard as a link calls it: the shard's methods (see
    `ray_actors.directory.DirectoryShard`), each returning at once a Future of its answer.

    A call that cannot even be sent raises at once; one the shard fails, or that is lost
    with it, fails its Future. Payloads are `pack`ed as the shard's methods say.
    """

    def register(self, info: ReplicaInfo, seq: int, stored: bytes, namespace: str) -> Future:
        """Future of (epoch, True, the interval to leave between calls: `DirectoryState.publish_interval`)."""

    def publish(self, replica_id: str, seq: int, changes: bytes, report: dict | None, namespace: str) -> Future:
        """Future of (epoch, whether the shard knows the replica, the interval to leave between calls)."""

    def unregister(self, replica_id: str, namespace: str) -> Future:
        """Future of whether the replica was registered."""

    def changes(self, cursor: Cursor | None, timeout_s: float, namespace: str, follower: str | None) -> Future:
        """Future of the packed `Changes` after `cursor`, once there is news for `follower` or after `timeout_s`."""

    def query(self, keys: Sequence[OffloadKey], namespace: str) -> Future:
        """Future of the (holders of each key, ReplicaInfo of each replica they name), as
        `distkv.directory.answer.encode_answer` makes it: MAX_BATCH_KEYS keys at most."""

    def cancel(self, future: Future) -> None:
        """Best effort: stop the call `future` answers (a long poll no one waits for any more)."""

    def close(self) -> None:
        """Let go of what the client holds open; the link that called it is done with it."""


class InboxKind(enum.Enum):
    """What an item of a link's inbox holds."""

    STORED = enum.auto()  # (key, row, generation) entries
    READY = enum.auto()  # (key, block) pairs
    PROMOTED = enum.auto()  # (key, block) pairs that may wait PROMOTED_FLUSH_DELAY_S
    REMOVED = enum.auto()  # keys
    DROPPED = enum.auto()  # (key, block) pairs
    NEW_INFO = enum.auto()  # (the replica's next ReplicaInfo,)


class CallKind(enum.Enum):
    """A publisher's call to its shard; the value is the shard's method."""

    REGISTER = "register"
    PUBLISH = "publish"


# Promoted blocks wait up to this long for a batch of their own (any other change takes
# them along sooner): their keys have a holder already, and a promotion is usually one
# of a burst whose transfers need the CPU and network more than the Directory does.
PROMOTED_FLUSH_DELAY_S = 0.25
# A link that has published nothing for this long, or for its shard's flush interval if
# longer, publishes an empty batch, so the Directory knows it is alive; any publish counts
# as a heartbeat.
HEARTBEAT_INTERVAL_S = 1.0
# How long a shard holds a change poll open when nothing changes.
POLL_TIMEOUT_S = 2.0
# Replicas re-register after a random delay up to this, so a fresh shard is not hit all at once.
RESYNC_JITTER_S = 0.5
# A shard's changes not yet published, past this many keys and past what the replica holds
# there, are dropped for a re-register with everything it holds: while a shard is down,
# the removals would pile up without bound, and re-registering says the same in fewer keys.
MAX_PENDING_KEYS = 1 << 16
# A register, publish or query carries at most this many keys (all a shard takes in one
# call); the rest follow in the next batches. A re-register after a shard's restart would
# otherwise carry the replica's whole pool in one call and one log entry, which the shard
# checks, logs and pickles for every follower on its one thread while every other call waits.
MAX_BATCH_KEYS = MAX_CALL_KEYS
MAX_BACKOFF_S = 2.0
CLOSE_TIMEOUT_S = 2.0

# A link of view "auto" (the `directory_view` setting) follows while the namespace has at
# most this many replicas, and queries from then on (docs/scale.md).
AUTO_PUSH_MAX_REPLICAS = 8
# A queried link's misses wait this long for the rest of their scheduler step's misses
# before they are asked, unless the owner says when its steps end (`expect_step_ends`):
# then they are asked at the step's end, or this much later at most if a step never ends.
QUERY_DELAY_S = 0.002
QUERY_STEP_TIMEOUT_S = 0.05
# A query not answered by then is given up and its keys answered as misses: a restarting
# shard holds calls until it is back.
QUERY_TIMEOUT_S = 1.0
# How long an answer stands: longer than a scheduler step, so that the step after the one
# that asked finds it, and short, so that a miss does not hide a block stored later for long.
ANSWER_TTL_S = 2.0
# Bounds of a queried link's memory: keys asked and not yet answered (a lookup past it is a
# miss), answers kept (the oldest go first), and replicas' infos kept (the oldest go first).
MAX_ASKED_KEYS = 1 << 16
MAX_ANSWERS = 1 << 18
MAX_REPLICA_INFOS = 1 << 12


def _backoff(failures: int) -> float:
    return min(MAX_BACKOFF_S, 0.05 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)


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
    ) -> None:
        """`event_lags` gets (index, seconds) per batch of stores and removals applied,
        from the oldest change coming in."""
        self.index = index
        self.client = client
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
                future = self.client.register(self.info, seq, pack(stored), self.namespace)
            else:
                future = self.client.publish(
                    self.info.replica_id, seq, pack((stored, removed)), self._report(now), self.namespace
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
            self.resync_at = now + _backoff(self.failures)
        else:
            self.failed_batch = batch
            self.retry_at = now + _backoff(self.failures)

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
            changes = unpack(future.result())
        except Exception as e:
            self._failed(now, e)
            return
        self.poll_failures = 0
        self.view.apply(changes)
        self._saw_epoch(changes.cursor.epoch, now)

    def _failed(self, now: float, error: Exception) -> None:
        self._errors.add("directory_poll", f"shard {self.index}: {error}")
        self.poll_failures += 1
        self.poll_at = now + _backoff(self.poll_failures)


class Querier:
    """Asks one shard about keys the replica missed: many keys a call, one call in flight.

    `add` queues a key; `step` sends every key queued (MAX_BATCH_KEYS at most a call) once
    `flush` says the scheduler's step ended, or once the oldest has waited `delay_s`, and
    only when no call is in flight. A key is sent once: the link adds only keys it has not
    asked yet. Every call ends in `answered(keys, holders of each key, infos of the
    replicas named)`, or in `answered(keys, None, {})` when it failed or was not answered
    within QUERY_TIMEOUT_S: the link then answers its keys as misses, never waits for them.
    `query_times` gets (index, seconds) per call answered, from its sending to its answer
    handed on (a failed call is an error of kind directory_query instead).

    `step(now, ...)` does all the calling and returns when it next needs a step; `wake`
    runs when a call finishes. Not thread-safe: one thread (the link's) steps it.
    """

    def __init__(
        self,
        index: int,
        client: ShardClient,
        namespace: str,
        *,
        wake: Callable[[], None],
        errors: ErrorLog,
        answered: Callable[[list[OffloadKey], list | None, dict[str, ReplicaInfo], float], None],
        query_times: collections.deque[tuple[int, float]],
    ) -> None:
        self.index = index
        self.client = client
        self.namespace = namespace
        self._wake = wake
        self._errors = errors
        self._answered = answered
        self._query_times = query_times
        self.waiting: list[OffloadKey] = []
        self.due_at = float("inf")  # when the keys waiting go at the latest
        self.asking: Future | None = None
        self.asked: list[OffloadKey] = []  # the keys of `asking`
        self.sent_at = 0.0  # when `asking` was sent
        self.give_up_at = float("inf")

    def add(self, key: OffloadKey, now: float, delay_s: float) -> None:
        """Queue `key`, to be asked within `delay_s`."""
        if not self.waiting:
            self.due_at = now + delay_s
        self.waiting.append(key)

    def step(self, now: float, flush: bool) -> float:
        """Collect the answer in flight and send what waits when due; when to step again at the latest."""
        future = self.asking
        if future is not None:
            if future.done():
                self.asking = None
                self._done(future, now)
            elif now >= self.give_up_at:
                self.asking = None
                self._failed(TimeoutError(f"no answer within {QUERY_TIMEOUT_S} s"), now)
        if flush and self.waiting:
            self.due_at = now
        if self.asking is None and self.waiting:
            if now < self.due_at:
                return self.due_at
            self._send(now)
        return self.give_up_at if self.asking is not None else self.due_at

    def _send(self, now: float) -> None:
        waiting = self.waiting
        if len(waiting) > MAX_BATCH_KEYS:
            self.asked, self.waiting = waiting[:MAX_BATCH_KEYS], waiting[MAX_BATCH_KEYS:]
        else:
            self.asked, self.waiting = waiting, []
            self.due_at = float("inf")
        try:
            future = self.client.query(self.asked, self.namespace)
        except Exception as e:
            self._failed(e, now)
            return
        self.asking = future
        self.sent_at = now
        self.give_up_at = now + QUERY_TIMEOUT_S
        wake = self._wake
        future.add_done_callback(lambda _: wake())

    def _done(self, future: Future, now: float) -> None:
        try:
            holders, infos = decode_answer(future.result(), len(self.asked))
        except Exception as e:
            self._failed(e, now)
            return
        asked, self.asked = self.asked, []
        self.give_up_at = float("inf")
        self._answered(asked, holders, infos, now)
        self._query_times.append((self.index, now - self.sent_at))

    def _failed(self, error: Exception, now: float) -> None:
        self._errors.add("directory_query", f"shard {self.index}: {error}")
        asked, self.asked = self.asked, []
        self.give_up_at = float("inf")
        self._answered(asked, None, {}, now)


class DirectoryLink:
    """One replica's connection to the Directory of a cache namespace.

    `stored` and `removed` only queue; a background thread publishes them in batches,
    one call per shard (a `Publisher` each), and retries until the Directory takes them,
    however long it is down. The same thread long-polls every shard's change log (a
    `Follower` each) into one in-process view, which `holders` and `replica` read without
    touching the network. When a shard restarts (new epoch) or no longer knows this
    replica, the link registers again and re-publishes everything this replica holds.

    A queried link (`view` "query", or "auto" once a view shows more than
    AUTO_PUSH_MAX_REPLICAS replicas) follows nothing: the keys the replica misses are
    `ask`ed, each of the shard its manager places it on, batched into one call per shard
    (a `Querier` each) at the end of the scheduler's step (`end_step`) or QUERY_DELAY_S
    after the first, and the answers stand in the same view for ANSWER_TTL_S, with the
    infos of the replicas they name for `replica`. It publishes as a following link does:
    the two kinds share one namespace.

    `shards`: the namespace's shards, in order; `relay`: the way to the node's relay
    (`distkv.directory.relay`), which a queried link publishes through, each step's publishes in one
    call: beyond a few replicas a shard's calls, not their changes, are its cost. A block
    goes to the shard its manager placed it on (`ready`, `promoted`, `dropped`: its block's `shard`), or, from `stored` and
    `removed`, to its own key's (`shard_of(key, len(shards))`).
    Usage: `link = DirectoryLink(ns, info, shards); link.start(); ...; link.close()`.
    """

    def __init__(
        self,
        namespace: str,
        info: ReplicaInfo,
        shards: Sequence[ShardClient],
        view: str = "push",
        relay: RelayBatch | None = None,
    ) -> None:
        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"DirectoryLink: info {info!r} is not a ReplicaInfo")
        if not shards:
            raise ValueError("DirectoryLink: shards is empty")
        if view not in DIRECTORY_VIEWS:
            raise ValueError(f"DirectoryLink: view={view!r} must be one of {list(DIRECTORY_VIEWS)}")
        self.info = info
        self.namespace = namespace
        self.num_shards = len(shards)
        self._wake = threading.Event()
        # set by the link's thread once every follower is synced: `wait_synced`
        self._synced = threading.Event()
        self.errors = ErrorLog()
        # (shard, seconds) from a change coming in to the shard having applied it
        self.event_lags: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_OBSERVATIONS)
        # (shard, seconds) from a query call's sending to its answer in the view
        self.query_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_OBSERVATIONS)
        # the view of every shard, merged: one dict lookup answers `holders`
        self._holders: dict[OffloadKey, tuple[Holder, ...]] = {}
        self._views = [ShardView(info.replica_id, self._holders, self.num_shards > 1) for _ in range(self.num_shards)]
        self._publishers = [
            Publisher(
                i, client, namespace, info,
                wake=self._wake.set, errors=self.errors, event_lags=self.event_lags,
            )
            for i, client in enumerate(shards)
        ]
        self._followers = [
            Follower(
                i, client, namespace, self._views[i],
                wake=self._wake.set, errors=self.errors, saw_epoch=self._publishers[i].saw_epoch,
            )
            for i, client in enumerate(shards)
        ]
        # Querying: whether lookups `ask`, set once for good (a following link may switch);
        # the keys asked and not yet answered, those of them not yet handed to a querier,
        # when the answers expire (oldest first), and the infos the answers brought.
        self.queried = False
        self._switches = view == "auto"
        self._relay = relay
        self._asked: set[OffloadKey] = set()
        self._wanted: collections.deque[OffloadKey] = collections.deque()
        self._expiry: collections.deque[tuple[float, list[OffloadKey]]] = collections.deque()
        self._infos: dict[str, ReplicaInfo] = {}
        # whether the owner reports its steps' ends, how many it did (`end_step`), and how
        # many of them the thread has seen
        self._step_ends = False
        self._steps_ended = 0
        self._steps_seen = 0
        self._queriers = [
            Querier(
                i, client, namespace,
                wake=self._wake.set, errors=self.errors, answered=self._answered, query_times=self.query_times,
            )
            for i, client in enumerate(shards)
        ]
        if view == "query":
            self._query_from_now()
        # (kind, items), as the InboxKind says
        self._inbox: collections.deque[tuple[InboxKind, Sequence]] = collections.deque()
        # Whether the thread sleeps longer than FLUSH_INTERVAL_S, so that `stored` and
        # `removed` must wake it. In shorter sleeps it takes the inbox when it wakes anyway,
        # which spares the scheduler's calls a thread wake-up (a syscall) each.
        self._listening = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register with every shard and start publishing and following, in the background."""
        if self._thread is not None:
            raise RuntimeError("DirectoryLink.start: already started")
        self._thread = threading.Thread(target=self._run, name=f"distkv-directory-{self.info.replica_id}", daemon=True)
        self._thread.start()

    def wait_synced(self, timeout_s: float) -> bool:
        """Block until the view holds every shard (each shard's snapshot applied), for at
        most `timeout_s`; whether it does. Until then `holders` misses blocks that other
        replicas hold, so a replica waits for this before it serves."""
        return self._synced.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread and unregister (best effort: a Directory that is down is not waited for)."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(CLOSE_TIMEOUT_S + 1.0)

    def stored(self, entries: Sequence[StoredEntry]) -> None:
        """Queue blocks this replica made loadable: (key, row, generation) each, each on
        its own key's shard (for tools and tests; a manager's blocks go by `ready`). Never blocks."""
        entries = tuple(entries)
        check_stored(entries, self.info.num_rows)
        self._queue(InboxKind.STORED, entries)

    def ready(self, blocks: Sequence[tuple[OffloadKey, ReadyBlock]]) -> None:
        """`stored` for the scheduler's path: (key, block) pairs straight from the replica's
        block table. The link's thread reads each block's row and generation, which never
        change; they are valid by construction and not checked again (the Directory checks
        every batch it takes in any case). `blocks` is not copied. Never blocks."""
        self._queue(InboxKind.READY, blocks)

    def promoted(self, blocks: Sequence[tuple[OffloadKey, ReadyBlock]]) -> None:
        """`ready` for blocks promoted from another holder: published within
        PROMOTED_FLUSH_DELAY_S, or with the next other change. Never blocks."""
        self._queue(InboxKind.PROMOTED, blocks)

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        """Queue keys this replica no longer holds, that `stored` queued. Never blocks."""
        keys = tuple(keys)
        check_keys(keys)
        self._queue(InboxKind.REMOVED, keys)

    def dropped(self, blocks: Sequence[tuple[OffloadKey, ReadyBlock]]) -> None:
        """`removed` for the scheduler's path: (key, block) pairs of blocks the replica no
        longer holds, each removed from the shard its block was placed on. `blocks` is not
        copied. Never blocks."""
        self._queue(InboxKind.DROPPED, blocks)

    def set_info(self, info: ReplicaInfo) -> None:
        """Register on every shard as `info` from now on (the replica's next cache epoch)
        and unregister the old id. Ordered with `stored` and `removed`: what was queued
        before goes out under the old id, what comes after under the new one. Never blocks."""
        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"DirectoryLink.set_info: {info!r} is not a ReplicaInfo")
        self._queue(InboxKind.NEW_INFO, (info,))

    def _queue(self, kind: InboxKind, items: Sequence) -> None:
        self._inbox.append((kind, items))
        if self._listening and not self._wake.is_set():  # set() takes a lock even when already set
            self._wake.set()

    @property
    def report(self) -> Callable[[], dict] | None:
        """The replica's stats, sent along with a publish to every shard at most every
        HEARTBEAT_INTERVAL_S (for `distkv status`); set by whoever owns the link."""
        return self._publishers[0].report

    @report.setter
    def report(self, report: Callable[[], dict] | None) -> None:
        for publisher in self._publishers:
            publisher.report = report

    @property
    def view(self) -> Mapping[OffloadKey, tuple[Holder, ...]]:
        """key -> the other replicas holding it: the view `holders` answers from. Read-only;
        it is never replaced, so the scheduler's hot path may bind its `get` once."""
        return self._holders

    def holders(self, key: OffloadKey) -> tuple[Holder, ...]:
        """The other replicas known to hold `key`, from the local view; () if none.

        On the scheduler's hot path: one dict lookup, no validation (callers pass keys
        the local manager has already checked).
        """
        return self._holders.get(key, ())

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        """A registered replica's info, from the local view or the answers; None if unknown."""
        info = self._infos.get(replica_id)
        if info is not None:
            return info
        for view in self._views:
            info = view.replicas.get(replica_id)
            if info is not None:
                return info
        return None

    def ask(self, key: OffloadKey, shard: int) -> bool:
        """A queried link's lookup missed `key`, which the view does not hold: have
        `shard` (where the replica's manager places the key) asked about it, and answer in
        the view. False, and nothing asked, when
        MAX_ASKED_KEYS keys are waiting already (the caller answers a miss). A key asked
        and not yet answered is not asked again.

        On the scheduler's hot path: never blocks, no validation (callers pass keys the
        local manager has already checked).
        """
        asked = self._asked
        if key in asked:
            return True
        if len(asked) >= MAX_ASKED_KEYS:
            return False
        asked.add(key)
        self._wanted.append((key, shard))
        # where the owner ends its steps, `end_step` wakes the thread once a step instead
        if not self._step_ends and self._listening and not self._wake.is_set():
            self._wake.set()
        return True

    def expect_step_ends(self) -> None:
        """The owner calls `end_step` at the end of every scheduler step from now on: the
        keys a step missed wait for it (QUERY_STEP_TIMEOUT_S at most), not QUERY_DELAY_S."""
        self._step_ends = True

    def end_step(self) -> None:
        """The scheduler's step ended: ask about the keys it missed now, one call per shard.
        Never blocks."""
        self._steps_ended += 1
        if self._asked and not self._wake.is_set():
            self._wake.set()

    def query(self, keys: Sequence[OffloadKey], timeout_s: float | None = 10.0) -> list[tuple[Holder, ...]]:
        """Ask the shards for the holders of each key (MAX_BATCH_KEYS at most; this replica
        included). Blocks: for tools and tests. Every shard is asked: a key's shard is where its holders placed
        it, which the key alone does not tell. TimeoutError if a shard has not answered
        within `timeout_s`."""
        check_keys(keys)
        keys = list(keys)
        futures = [publisher.client.query(keys, self.namespace) for publisher in self._publishers]
        _, late = concurrent.futures.wait(futures, timeout=timeout_s)
        if late:
            raise TimeoutError(f"DirectoryLink.query: {len(late)} shard(s) did not answer within {timeout_s} s")
        result: list[tuple[Holder, ...]] = [()] * len(keys)
        for future in futures:
            for i, holders in enumerate(decode_answer(future.result(), len(keys))[0]):
                for holder in holders:  # a replica once, should two shards list it
                    if all(h.replica_id != holder[0] for h in result[i]):
                        result[i] += (Holder._make(holder),)
        return result

    # Everything below runs on the link's thread.

    def step(self, now: float) -> float:
        """One pass of the link's thread, at time.monotonic() `now`: take the inbox, step
        every shard's publisher and follower; when the next pass is due at the latest."""
        self._take_inbox(now)
        due = min(p.step(now) for p in self._publishers)
        if self._relay is not None:
            self._relay.flush()
        for follower in self._followers:
            due = min(due, follower.step(now))
        if not self._synced.is_set() and all(f.synced for f in self._followers):
            self._synced.set()
        if self._switches and any(len(view.replicas) > AUTO_PUSH_MAX_REPLICAS for view in self._views):
            self._query_from_now()
        if self.queried:
            due = min(due, self._step_queries(now))
        return due

    def _step_queries(self, now: float) -> float:
        """Hand the keys asked to their shards' queriers, step them, expire old answers."""
        steps_ended = self._steps_ended  # before the keys: those asked in the step are all in
        flush = steps_ended != self._steps_seen
        self._steps_seen = steps_ended
        delay_s = QUERY_STEP_TIMEOUT_S if self._step_ends else QUERY_DELAY_S
        wanted = self._wanted
        queriers = self._queriers
        while wanted:
            key, shard = wanted.popleft()
            queriers[shard].add(key, now, delay_s)
        due = min(q.step(now, flush) for q in queriers)
        expiry = self._expiry
        answers = self._holders
        while expiry and (expiry[0][0] <= now or len(answers) > MAX_ANSWERS):
            for key in expiry.popleft()[1]:
                answers.pop(key, None)
        if expiry:
            due = min(due, expiry[0][0])
        return due

    def _answered(self, keys: list[OffloadKey], holders: list | None, infos: dict[str, ReplicaInfo], now: float) -> None:
        """A querier's answer: the holders of each key (None: the call failed, all misses)."""
        answers = self._holders
        if holders is None:
            for key in keys:
                answers[key] = ()
        else:
            known = self._infos
            for replica_id, info in infos.items():
                # every answer brings its replicas' infos as they are now (a replica restarted
                # under its id on another node, or with another pool): kept as the newest
                known.pop(replica_id, None)
                if len(known) >= MAX_REPLICA_INFOS:
                    del known[next(iter(known))]
                known[replica_id] = info
            own = self.info.replica_id
            for key, key_holders in zip(keys, holders):
                answers[key] = tuple(Holder._make(h) for h in key_holders if h[0] != own)
        self._expiry.append((now + ANSWER_TTL_S, keys))
        asked = self._asked
        for key in keys:  # after the answer is in: a lookup between the two asks nothing again
            asked.discard(key)

    def _query_from_now(self) -> None:
        """Stop following and query from now on, for good: the view's holders give way to
        answers, its replicas' infos stay for the promotions that started from it."""
        for follower in self._followers:
            follower.cancel()
        for view in self._views:
            self._infos.update(view.replicas)
        self._followers = []
        self._views = []
        self._switches = False
        self.queried = True
        self._holders.clear()
        if self._relay is not None:
            for publisher in self._publishers:
                publisher.client = RelayedShard(publisher.client, publisher.index, self.namespace, self._relay.publish)

    def _run(self) -> None:
        timeout = 0.0
        while True:
            self._wake.wait(timeout)
            self._listening = False
            self._wake.clear()
            if self._stopping:
                break
            due = self.step(time.monotonic())
            timeout = max(0.0, due - time.monotonic())
            if timeout > FLUSH_INTERVAL_S:
                self._listening = True
                if self._inbox or self._wanted:  # queued before the flag was up: no one woke us for it
                    timeout = 0.0
        self._shutdown()

    def _take_inbox(self, now: float) -> None:
        inbox = self._inbox
        publishers = self._publishers
        only_promoted = True
        num_shards = self.num_shards
        while inbox:
            kind, items = inbox.popleft()
            only_promoted = only_promoted and kind is InboxKind.PROMOTED
            if kind is InboxKind.NEW_INFO:
                self._switch_info(items[0], now)
            elif kind is InboxKind.DROPPED:
                for key, block in items:
                    publishers[block.shard].remove(key)
            elif kind is InboxKind.REMOVED:
                for key in items:
                    publishers[shard_of(key, num_shards)].remove(key)
            elif kind is InboxKind.STORED:
                for key, row, generation in items:
                    publishers[shard_of(key, num_shards)].store(key, row, generation)
            else:
                for key, block in items:
                    publishers[block.shard].store(key, block.row, block.generation)
        flush_at = now + PROMOTED_FLUSH_DELAY_S if only_promoted else now
        for publisher in publishers:
            # the event lag is that of stores and removals, not of promoted blocks held back
            publisher.queued(now, flush_at, lagged=not only_promoted)

    def _switch_info(self, info: ReplicaInfo, now: float) -> None:
        """Unregister the old id and register `info`, with what the replica holds now, on every shard."""
        self.info = info
        for view in self._views:
            view.exclude = info.replica_id
        for publisher in self._publishers:
            publisher.switch_info(info, now)

    def _shutdown(self) -> None:
        # a publish that lands after the unregister would bring this replica back
        in_flight = [p.publishing for p in self._publishers if p.publishing is not None]
        concurrent.futures.wait(in_flight, timeout=CLOSE_TIMEOUT_S / 2)
        futures = []
        for follower in self._followers:
            follower.cancel()
        for publisher in self._publishers:
            future = publisher.unregister()
            if future is not None:
                futures.append(future)
        concurrent.futures.wait(futures, timeout=CLOSE_TIMEOUT_S / 2)
        for publisher in self._publishers:
            publisher.client.close()
