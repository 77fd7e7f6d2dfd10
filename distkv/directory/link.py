"""What one replica holds of the Directory: a `DirectoryLink`.

The link publishes the replica's stored and removed blocks and keeps a view of what the
other replicas hold, doing all its calls on one background thread so that no caller ever
waits on the network. Its parts, each a plain class stepped by the link's thread:

- a `Publisher` per shard (`distkv.directory.publisher`): register, batched publishes,
  retries, and the re-register with everything held when the shard forgets the replica;
  its publishes go by the link's publish path (`PublishPath`: to the shards themselves,
  or through the node's relay, `distkv.directory.relay`);
- a view (`distkv.directory.views.HolderSource`), of the kind the `directory_view` setting
  names: followed, queried, or the switch from one to the other;
- the shards themselves as `ShardClient`s (`distkv.directory.client`), handed in by
  whoever wires the cluster together (`distkv.replica.join` hands in `ray_actors.directory`'s
  actors). No Ray here: a test hands in clients whose futures it resolves itself.

What the replica tells the link of a block is one of three announcements, each a state
of the block in this replica's pool: `stored` (it holds the block), `promoted` (it holds
a copy it promoted from another replica, which may wait PROMOTED_FLUSH_DELAY_S for a
batch), `removed` (it holds it no longer). The scheduler's path hands them in as blocks of
its block table (`stored_blocks`, `promoted_blocks`, `removed_blocks`), tools and tests as
entries and keys (`stored`, `removed`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import NamedTuple, Protocol

from distkv.abstract import OffloadKey
from distkv.config import DIRECTORY_VIEWS
from distkv.directory.wire import decode_answer
from distkv.directory.client import ShardClient, Waker
from distkv.directory.placement import shard_of
from distkv.directory.publisher import DirectPublish, PublishPath, Publisher
from distkv.directory.records import Holder, ReplicaInfo, StoredEntry
from distkv.directory.state import FLUSH_INTERVAL_S, publish_interval
from distkv.directory.views import AUTO_PUSH_MAX_REPLICAS, VIEWS, HolderSource, QueriedView, StepEnds, ViewParts
from distkv.directory.wire import check_stored
from distkv.observability.errors import ErrorLog
from distkv.observability.metrics import MAX_OBSERVATIONS
from distkv.storage.keys import check_keys

# Promoted blocks wait up to this long for a batch of their own (any other change takes
# them along sooner): their keys have a holder already, and a promotion is usually one
# of a burst whose transfers need the CPU and network more than the Directory does.
PROMOTED_FLUSH_DELAY_S = 0.25
CLOSE_TIMEOUT_S = 2.0
# A queried link publishes through its node's relay once a shard paces it as one of more
# than AUTO_PUSH_MAX_REPLICAS replicas, and to the shards itself before: the relay folds a
# node's publishes into one call per shard, which a shard of many replicas needs, and costs
# a small namespace an actor call more per publish (docs/benchmarks.md, session 43).
RELAY_PAST_INTERVAL_S = publish_interval(AUTO_PUSH_MAX_REPLICAS)


class PlacedBlock(Protocol):
    """A block as the link takes it: the row and generation it was sealed with, and the
    shard its manager placed it on (docs/architecture.md, "Placement"), where its removal
    goes too."""

    row: int
    generation: int
    shard: int


class _Entry(NamedTuple):
    """A block that tools hand in as an entry or a key: on its own key's shard."""

    row: int
    generation: int
    shard: int


class InboxKind(enum.Enum):
    """What an item of a link's inbox announces: (key, PlacedBlock) pairs, or the info."""

    STORED = enum.auto()
    PROMOTED = enum.auto()  # may wait PROMOTED_FLUSH_DELAY_S
    REMOVED = enum.auto()
    NEW_INFO = enum.auto()  # (the replica's next ReplicaInfo,)


class _CurrentPath:
    """The link's publish path now (a PublishPath): to the shards themselves, or its
    node's relay once the link queries a large namespace, for good (`relay_if_paced`)."""

    def __init__(self, direct: PublishPath, relay: PublishPath | None) -> None:
        self.path = direct
        self._relay = relay

    @property
    def relayed(self) -> bool:
        return self.path is self._relay  # never None: the direct path is a path

    def relay_if_paced(self, intervals: Iterable[float]) -> None:
        """Take the relay once a shard paces the replica as one of more than
        AUTO_PUSH_MAX_REPLICAS (an interval past RELAY_PAST_INTERVAL_S)."""
        if self._relay is not None and not self.relayed and any(i > RELAY_PAST_INTERVAL_S for i in intervals):
            self.path = self._relay  # the relay's answers pace nobody: it stays

    def publish(self, shard: int, replica_id: str, seq: int, changes: bytes, report: dict | None) -> Future:
        return self.path.publish(shard, replica_id, seq, changes, report)

    def flush(self) -> None:
        self.path.flush()


class DirectoryLink:
    """One replica's connection to the Directory of a cache namespace.

    Announcements only queue; a background thread publishes them in batches, one call per
    shard (a `Publisher` each), and retries until the Directory takes them, however long
    it is down. The same thread keeps the view (`view`, `holders`, `replica`), which the
    scheduler reads without touching the network. When a shard restarts (new epoch) or no
    longer knows this replica, the link registers again and re-publishes everything this
    replica holds.

    `view`: the `directory_view` setting, the kind of view (`distkv.directory.views`). A
    lookup that misses a queried view has its key asked (`ask`, None while the view holds
    every block). `relay`: the publish path of a queried link once a shard says the
    namespace is large (the node's relay: beyond a few replicas a shard's calls, not their
    changes, are its cost); before, and without a relay, a link publishes to the shards
    themselves.
    Usage: `link = DirectoryLink(ns, info, shards); link.start(); ...; link.close()`.
    """

    def __init__(
        self,
        namespace: str,
        info: ReplicaInfo,
        shards: Sequence[ShardClient],
        view: str = "push",
        relay: PublishPath | None = None,
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
        self._shards = list(shards)
        self._waker = Waker()
        # set by the link's thread once the view is synced: `wait_synced`
        self._synced = threading.Event()
        self.errors = ErrorLog()
        # (shard, seconds) from a change coming in to the shard having applied it
        self.event_lags: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_OBSERVATIONS)
        # (shard, seconds) from a query call's sending to its answer in the view
        self.query_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_OBSERVATIONS)
        # every view's holders: one dict lookup answers `holders`
        self._holders: dict[OffloadKey, tuple[Holder, ...]] = {}
        self._path = _CurrentPath(DirectPublish(shards, namespace), relay)
        self._publishers = [
            Publisher(
                i, client, namespace, info,
                wake=self._waker.set, errors=self.errors, event_lags=self.event_lags, path=self._path,
            )
            for i, client in enumerate(shards)
        ]
        self._steps = StepEnds()
        # How a lookup that missed the view has its key asked: the queried view's `ask`,
        # None while the view holds every block (see `_queried`).
        self.ask: Callable[[OffloadKey, int], bool] | None = None
        self._routed = threading.Event()  # `answers_routed`
        parts = ViewParts(
            namespace, self._shards, self._holders, info.replica_id, self._waker, self.errors,
            [p.saw_epoch for p in self._publishers], self.query_times, self._steps, self._queried, self._routed,
        )
        self._source: HolderSource = VIEWS[view](parts)
        if isinstance(self._source, QueriedView):
            self._queried(self._source)
        # (kind, items), as the InboxKind says
        self._inbox: collections.deque[tuple[InboxKind, Sequence]] = collections.deque()
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
        self._waker.set()
        self._thread.join(CLOSE_TIMEOUT_S + 1.0)

    # ---- announcements (never block) -----------------------------------------------

    def stored_blocks(self, blocks: Sequence[tuple[OffloadKey, PlacedBlock]]) -> None:
        """The replica stored these blocks: (key, block) pairs straight from its block
        table. The link's thread reads each block's row, generation and shard, which never
        change; they are valid by construction and not checked again (the Directory checks
        every batch it takes in any case). `blocks` is not copied."""
        self._queue(InboxKind.STORED, blocks)

    def promoted_blocks(self, blocks: Sequence[tuple[OffloadKey, PlacedBlock]]) -> None:
        """`stored_blocks` of blocks promoted from another holder: published within
        PROMOTED_FLUSH_DELAY_S, or with the next other change."""
        self._queue(InboxKind.PROMOTED, blocks)

    def removed_blocks(self, blocks: Sequence[tuple[OffloadKey, PlacedBlock]]) -> None:
        """The replica no longer holds these blocks: (key, block) pairs, each removed from
        the shard its block was placed on. `blocks` is not copied."""
        self._queue(InboxKind.REMOVED, blocks)

    def stored(self, entries: Sequence[StoredEntry]) -> None:
        """`stored_blocks` for tools and tests: (key, row, generation) entries, checked,
        each on its own key's shard."""
        entries = tuple(entries)
        check_stored(entries, self.info.num_rows)
        n = self.num_shards
        self._queue(InboxKind.STORED, [(key, _Entry(row, generation, shard_of(key, n))) for key, row, generation in entries])

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        """`removed_blocks` for tools and tests: keys that `stored` announced."""
        keys = tuple(keys)
        check_keys(keys)
        n = self.num_shards
        self._queue(InboxKind.REMOVED, [(key, _Entry(0, 0, shard_of(key, n))) for key in keys])

    def set_info(self, info: ReplicaInfo) -> None:
        """Register on every shard as `info` from now on (the replica's next cache epoch)
        and unregister the old id. Ordered with the announcements: what was queued before
        goes out under the old id, what comes after under the new one."""
        if not isinstance(info, ReplicaInfo):
            raise ValueError(f"DirectoryLink.set_info: {info!r} is not a ReplicaInfo")
        self._queue(InboxKind.NEW_INFO, (info,))

    def _queue(self, kind: InboxKind, items: Sequence) -> None:
        self._inbox.append((kind, items))
        waker = self._waker
        if waker.listening and not waker.event.is_set():
            waker.event.set()

    # ---- the view ------------------------------------------------------------------

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

    @property
    def relayed(self) -> bool:
        """Whether the link's publishes go through its node's relay (it queries a large
        namespace: RELAY_PAST_INTERVAL_S)."""
        return self._path.relayed

    @property
    def queried(self) -> bool:
        """Whether the view answers by queries (a lookup that misses it is `ask`ed)."""
        return self.ask is not None

    def holders(self, key: OffloadKey) -> tuple[Holder, ...]:
        """The other replicas known to hold `key`, from the local view; () if none.

        On the scheduler's hot path: one dict lookup, no validation (callers pass keys
        the local manager has already checked).
        """
        return self._holders.get(key, ())

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        """A registered replica's info, from the view; None if unknown."""
        return self._source.replica(replica_id)

    def answers_routed(self) -> None:
        """Requests come with their router's Directory answer (`distkv.routing`): a view of
        "auto" stops following every shard's changes and queries what a request without one
        misses. From the scheduler's thread; never blocks."""
        if not self._routed.is_set():
            self._routed.set()
            self._waker.set()

    def expect_step_ends(self) -> None:
        """The owner calls `end_step` at the end of every scheduler step from now on: the
        keys a step missed wait for it (QUERY_STEP_TIMEOUT_S at most), not QUERY_DELAY_S."""
        self._steps.expected = True

    def end_step(self) -> None:
        """The scheduler's step ended: ask about the keys it missed now, one call per shard.
        Never blocks."""
        self._steps.ended += 1
        self._source.end_step()

    def query(self, keys: Sequence[OffloadKey], timeout_s: float | None = 10.0) -> list[tuple[Holder, ...]]:
        """Ask the shards for the holders of each key (MAX_BATCH_KEYS at most; this replica
        included). Blocks: for tools and tests. Every shard is asked: a key's shard is
        where its holders placed it, which the key alone does not tell. TimeoutError if a
        shard has not answered within `timeout_s`."""
        check_keys(keys)
        keys = list(keys)
        futures = [shard.query(keys, self.namespace) for shard in self._shards]
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

    # ---- the link's thread ---------------------------------------------------------

    def step(self, now: float) -> float:
        """One pass of the link's thread, at time.monotonic() `now`: take the inbox, step
        every shard's publisher and the view; when the next pass is due at the latest."""
        self._take_inbox(now)
        due = min(p.step(now) for p in self._publishers)
        if self.queried:
            self._path.relay_if_paced(p.flush_interval for p in self._publishers)
        self._path.flush()
        due = min(due, self._source.step(now))
        if not self._synced.is_set() and self._source.synced:
            self._synced.set()
        return due

    def _queried(self, view: QueriedView) -> None:
        """The view answers by queries from now on: lookups that miss it ask it (and
        publishes may go through the relay, see `step`)."""
        self.ask = view.ask

    def _run(self) -> None:
        waker = self._waker
        timeout = 0.0
        while True:
            waker.event.wait(timeout)
            waker.listening = False
            waker.event.clear()
            if self._stopping:
                break
            due = self.step(time.monotonic())
            timeout = max(0.0, due - time.monotonic())
            if timeout > FLUSH_INTERVAL_S:
                waker.listening = True
                # queued before the flag was up: no one woke us for it
                if self._inbox or self._source.has_wanted():
                    timeout = 0.0
        self._shutdown()

    def _take_inbox(self, now: float) -> None:
        inbox = self._inbox
        publishers = self._publishers
        only_promoted = True
        while inbox:
            kind, items = inbox.popleft()
            only_promoted = only_promoted and kind is InboxKind.PROMOTED
            if kind is InboxKind.NEW_INFO:
                self._switch_info(items[0], now)
            elif kind is InboxKind.REMOVED:
                for key, block in items:
                    publishers[block.shard].remove(key)
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
        self._source.own_id_changed(info.replica_id)
        for publisher in self._publishers:
            publisher.switch_info(info, now)

    def _shutdown(self) -> None:
        # a publish that lands after the unregister would bring this replica back
        in_flight = [p.publishing for p in self._publishers if p.publishing is not None]
        concurrent.futures.wait(in_flight, timeout=CLOSE_TIMEOUT_S / 2)
        self._source.close()
        futures = []
        for publisher in self._publishers:
            future = publisher.unregister()
            if future is not None:
                futures.append(future)
        concurrent.futures.wait(futures, timeout=CLOSE_TIMEOUT_S / 2)
        for shard in self._shards:
            shard.close()
