"""A replica's view of the Directory: what other replicas hold, one kind of view per class.

A link reads every view the same way, one dict lookup for a key's holders (`holders`,
which no view ever replaces), and asks a view for the replicas its holders name
(`replica`). Where the holders come from is the view's kind (the `directory_view`
setting):

- `FollowedView` ("push"): a `Follower` per shard long-polls its changes into a
  `ShardView`, and the view holds every block of every shard;
- `QueriedView` ("query"): the keys a replica's lookups missed are asked (`ask`), batched
  into one call per shard (a `Querier` each) at the end of the scheduler's step, and the
  answers stand in the view for ANSWER_TTL_S;
- `SwitchingView` ("auto"): follows while the namespace is small and queries for good once
  a followed view shows more than AUTO_PUSH_MAX_REPLICAS replicas, or once requests come
  with their router's Directory answer (`ViewParts.routed`): each brings what it needs of
  the Directory, so following every change would be work for nothing.

Every view is stepped by its link's thread only (`step(now)` makes its calls and returns
when it next needs a step); `ask` and `end_step` come from the scheduler's thread and only
queue.
"""

from __future__ import annotations

import collections
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from distkv.abstract import OffloadKey
from distkv.directory.client import ShardClient, Waker
from distkv.directory.follower import Follower, ShardView
from distkv.directory.querier import Querier
from distkv.directory.records import Holder, ReplicaInfo
from distkv.observability.errors import ErrorLog

# A link of view "auto" (the `directory_view` setting) follows while the namespace has at
# most this many replicas, and queries from then on (docs/scale.md).
AUTO_PUSH_MAX_REPLICAS = 8
# A queried link's misses wait this long for the rest of their scheduler step's misses
# before they are asked, unless the owner says when its steps end (`expect_step_ends`):
# then they are asked at the step's end, or this much later at most if a step never ends.
QUERY_DELAY_S = 0.002
QUERY_STEP_TIMEOUT_S = 0.05
# How long an answer stands: longer than a scheduler step, so that the step after the one
# that asked finds it, and short, so that a miss does not hide a block stored later for long.
ANSWER_TTL_S = 2.0
# Bounds of a queried link's memory: keys asked and not yet answered (a lookup past it is a
# miss), answers kept (the oldest go first), and replicas' infos kept (the oldest go first).
MAX_ASKED_KEYS = 1 << 16
MAX_ANSWERS = 1 << 18
MAX_REPLICA_INFOS = 1 << 12


class StepEnds:
    """The owner's scheduler steps as a queried view waits for them: whether the owner says
    when a step ends (`expected`), and how many have ended."""

    def __init__(self) -> None:
        self.expected = False
        self.ended = 0


@dataclass
class ViewParts:
    """What a link hands each of its views. `holders` is the link's one dict of other
    replicas' blocks, which views fill; `own_id`, the link's replica, whose own blocks no
    view shows; `saw_epoch[i]`, the publisher of shard i, told each epoch a follower sees;
    `queried`, the link's hook for a view that starts answering by queries; `routed`, set
    once requests come with their router's Directory answer."""

    namespace: str
    shards: Sequence[ShardClient]
    holders: dict[OffloadKey, tuple[Holder, ...]]
    own_id: str
    waker: Waker
    errors: ErrorLog
    saw_epoch: Sequence[Callable[[str, float], None]]
    query_times: collections.deque
    steps: StepEnds
    queried: Callable[[QueriedView], None]
    routed: threading.Event


class HolderSource(ABC):
    """Where a link's view of the other replicas' blocks comes from (see the module)."""

    # How a lookup that missed the view has its key asked: (key, shard) -> whether it was
    # (QueriedView.ask); None where the view holds every block and a miss is a miss.
    ask: Callable[[OffloadKey, int], bool] | None = None

    @property
    @abstractmethod
    def synced(self) -> bool:
        """Whether the view holds what the shards held when it started (a followed view's
        first answers, each a snapshot, applied)."""

    @abstractmethod
    def step(self, now: float) -> float:
        """Make the view's calls and apply their answers; when to step again at the latest."""

    @abstractmethod
    def replica(self, replica_id: str) -> ReplicaInfo | None:
        """The info of a replica the view's holders name; None if unknown."""

    def own_id_changed(self, replica_id: str) -> None:
        """The link's replica registers as `replica_id` from now on."""

    def end_step(self) -> None:
        """The scheduler's step ended (`StepEnds.ended` counts it already)."""

    def has_wanted(self) -> bool:
        """Whether keys were asked that the view's thread has not taken yet."""
        return False

    def close(self) -> None:
        """Give up the calls in flight (the link closes)."""


class FollowedView(HolderSource):
    """Holds every block of every shard: a `Follower` per shard keeps its `ShardView`, each
    applying its changes into the link's `holders`."""

    def __init__(self, parts: ViewParts) -> None:
        shared = len(parts.shards) > 1
        self.views = [ShardView(parts.own_id, parts.holders, shared) for _ in parts.shards]
        self._followers = [
            Follower(
                i, client, parts.namespace, self.views[i],
                wake=parts.waker.set, errors=parts.errors, saw_epoch=parts.saw_epoch[i],
            )
            for i, client in enumerate(parts.shards)
        ]

    @property
    def synced(self) -> bool:
        return all(f.synced for f in self._followers)

    def step(self, now: float) -> float:
        return min(f.step(now) for f in self._followers)

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        for view in self.views:
            info = view.replicas.get(replica_id)
            if info is not None:
                return info
        return None

    def own_id_changed(self, replica_id: str) -> None:
        for view in self.views:
            view.exclude = replica_id

    def close(self) -> None:
        for follower in self._followers:
            follower.cancel()


class QueriedView(HolderSource):
    """Holds the answers to what the replica asked: `ask` queues a key that a lookup
    missed, of the shard its manager places it on (MAX_ASKED_KEYS waiting at most: past
    that a lookup is a miss, and a key asked and not answered yet is not asked again);
    the keys go at the end of the scheduler's step (`end_step`, where the owner
    `expect_step_ends`) or QUERY_DELAY_S after the first, one call per shard; each answer
    stands for ANSWER_TTL_S (MAX_ANSWERS kept), with the infos of the replicas it names
    (MAX_REPLICA_INFOS kept, the newest of each). A failed or overdue query answers its
    keys as misses."""

    def __init__(self, parts: ViewParts, known: Mapping[str, ReplicaInfo] | None = None) -> None:
        """`known`: the infos of the replicas a view followed before this one named."""
        self._parts = parts
        parts.holders.clear()
        # the keys asked and not yet answered, those of them not yet handed to a querier,
        # when the answers expire (oldest first), and the infos the answers (and a view
        # followed before this one) brought
        self._asked: set[OffloadKey] = set()
        self._wanted: collections.deque[tuple[OffloadKey, int]] = collections.deque()
        self._expiry: collections.deque[tuple[float, list[OffloadKey]]] = collections.deque()
        self._infos: dict[str, ReplicaInfo] = dict(known or {})
        self._steps_seen = parts.steps.ended
        self._own = parts.own_id
        self._queriers = [
            Querier(
                i, client, parts.namespace,
                wake=parts.waker.set, errors=parts.errors, answered=self._answered, query_times=parts.query_times,
            )
            for i, client in enumerate(parts.shards)
        ]

    @property
    def synced(self) -> bool:
        return True

    def ask(self, key: OffloadKey, shard: int) -> bool:
        """Have `shard` asked about `key`, which a lookup missed; False, and nothing asked,
        when MAX_ASKED_KEYS keys wait already. On the scheduler's hot path: never blocks,
        no validation (callers pass keys the local manager has checked)."""
        asked = self._asked
        if key in asked:
            return True
        if len(asked) >= MAX_ASKED_KEYS:
            return False
        asked.add(key)
        self._wanted.append((key, shard))
        # where the owner ends its steps, `end_step` wakes the thread once a step instead
        waker = self._parts.waker
        if not self._parts.steps.expected and waker.listening and not waker.event.is_set():
            waker.event.set()
        return True

    def end_step(self) -> None:
        waker = self._parts.waker
        if self._asked and not waker.event.is_set():
            waker.event.set()

    def has_wanted(self) -> bool:
        return bool(self._wanted)

    def step(self, now: float) -> float:
        """Hand the keys asked to their shards' queriers, step them, expire old answers."""
        steps = self._parts.steps
        steps_ended = steps.ended  # before the keys: those asked in the step are all in
        flush = steps_ended != self._steps_seen
        self._steps_seen = steps_ended
        delay_s = QUERY_STEP_TIMEOUT_S if steps.expected else QUERY_DELAY_S
        wanted = self._wanted
        queriers = self._queriers
        while wanted:
            key, shard = wanted.popleft()
            queriers[shard].add(key, now, delay_s)
        due = min(q.step(now, flush) for q in queriers)
        expiry = self._expiry
        answers = self._parts.holders
        while expiry and (expiry[0][0] <= now or len(answers) > MAX_ANSWERS):
            for key in expiry.popleft()[1]:
                answers.pop(key, None)
        if expiry:
            due = min(due, expiry[0][0])
        return due

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        return self._infos.get(replica_id)

    def own_id_changed(self, replica_id: str) -> None:
        self._own = replica_id

    def _answered(self, keys: list[OffloadKey], holders: list | None, infos: dict[str, ReplicaInfo], now: float) -> None:
        """A querier's answer: the holders of each key (None: the call failed, all misses)."""
        answers = self._parts.holders
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
            own = self._own
            for key, key_holders in zip(keys, holders):
                answers[key] = tuple(Holder._make(h) for h in key_holders if h[0] != own)
        self._expiry.append((now + ANSWER_TTL_S, keys))
        asked = self._asked
        for key in keys:  # after the answer is in: a lookup between the two asks nothing again
            asked.discard(key)


class SwitchingView(HolderSource):
    """directory_view "auto": a `FollowedView` until one of its shards shows more than
    AUTO_PUSH_MAX_REPLICAS replicas or requests come with their router's answer
    (`ViewParts.routed`), then a `QueriedView` for good (`switch`): the followed holders
    give way to answers, the replicas' infos stay for the promotions that started from
    them, and the link is told (`ViewParts.queried`)."""

    def __init__(self, parts: ViewParts) -> None:
        self._parts = parts
        self._followed: FollowedView | None = FollowedView(parts)
        self.current: HolderSource = self._followed

    @property
    def synced(self) -> bool:
        return self.current.synced

    def step(self, now: float) -> float:
        due = self.current.step(now)
        followed = self._followed
        if followed is not None and (
            self._parts.routed.is_set() or any(len(view.replicas) > AUTO_PUSH_MAX_REPLICAS for view in followed.views)
        ):
            due = min(due, self.switch().step(now))
        return due

    def switch(self) -> QueriedView:
        """Stop following and query from now on."""
        followed, self._followed = self._followed, None
        followed.close()
        known: dict[str, ReplicaInfo] = {}
        for view in followed.views:
            known.update(view.replicas)
        queried = self.current = QueriedView(self._parts, known)
        self._parts.queried(queried)
        return queried

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        return self.current.replica(replica_id)

    def own_id_changed(self, replica_id: str) -> None:
        self.current.own_id_changed(replica_id)

    def end_step(self) -> None:
        self.current.end_step()

    def has_wanted(self) -> bool:
        return self.current.has_wanted()

    def close(self) -> None:
        self.current.close()


# The view of each `directory_view` setting.
VIEWS: dict[str, type[HolderSource]] = {"push": FollowedView, "query": QueriedView, "auto": SwitchingView}
