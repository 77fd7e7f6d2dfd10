"""A node's relay of its replicas' publishes to the Directory: one call per shard per interval.

What a shard pays for a publish is Ray's cost per call, not the work of the changes it
carries (docs/scale.md). A replica publishes to each shard once per interval the shard
asks of it, so a shard of R replicas takes R calls per interval. The replicas of a node
hand their publishes to the node's `PublishRelay` instead, which carries all of them to
each shard in one `publish_many` call per interval: a shard then takes a call per node.
Each replica's publish stays its own (its seq, its answer, its heartbeat); only the call
is shared. A replica hands over what its link publishes in one step, to every shard, in
one call too (`RelayBatch`). Plain classes, no Ray: the NodeAgent runs a relay per cache
namespace (`ray_actors.node_agent`), `bench/scale.py`'s load generator one per process.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

from distkv.directory.state import FLUSH_INTERVAL_S
from distkv.directory.records import Relayed

# A shard's publishes waiting in a relay; past it a publish fails at once (its replica
# retries after a backoff), so a shard that stopped answering cannot pile them up.
MAX_QUEUED = 1 << 12
# A call carries publishes of this many bytes of changes at most (a larger publish goes
# alone), the rest following as soon as it is answered: under Ray's bound for arguments
# sent inside the call (`max_direct_call_object_size`, 100 KiB), past which they go
# through the object store, whose put and fetch every later call of the caller to the
# shard waits for.
MAX_CALL_BYTES = 64 << 10
CLOSE_TIMEOUT_S = 2.0


class RelayTarget(Protocol):
    """A shard as a relay calls it (`ray_actors.directory.ShardActorClient` is one)."""

    def publish_many(self, items: Sequence[Relayed], namespace: str) -> Future:
        """Future of (epoch, each item's result: whether the shard knows its replica, or
        the error that refused it, the interval the shard asks of each replica)."""


class _Route:
    """One shard's side of a relay: the publishes queued for its next call, the call in flight."""

    def __init__(self, client: RelayTarget) -> None:
        self.client = client
        self.queued: list[tuple[Relayed, Future]] = []
        self.sending: Future | None = None
        self.carried: list[Future] = []  # the replicas' Futures that `sending` answers
        self.sent_at = -math.inf
        self.interval = FLUSH_INTERVAL_S  # as the shard last asked


class PublishRelay:
    """Carries the publishes of many replicas of one cache namespace to its shards.

    `publish` has the signature of `distkv.directory.client.ShardClient.publish` plus the shard:
    it queues the publish and returns the Future of the shard's answer to it. Each shard
    has at most one call in flight, carrying every publish queued for it meanwhile; the
    next goes the shard's interval after the previous one was sent (the interval the
    shard asks of each replica: a relay stands for its replicas), or at once after a quiet
    interval. A call carries MAX_CALL_BYTES of changes at most; what did not fit goes as
    soon as it is answered. A call that fails fails every publish it carried: their replicas send them
    again. A replica's answer asks it for no interval of its own (`FLUSH_INTERVAL_S`):
    it hands its next publish over as soon as the previous one is answered, and the
    relay paces it: a change waits about two of the shard's intervals at most, one
    while the replica's previous publish waits here and one for its own.

    `publish` may be called from any thread; `step(now)` sends what is due and returns
    when it next needs a step; `start` runs the steps on a thread of the relay's own.
    `unused_s(now)` says how long the relay has served no replica, for its owner to
    close one whose replicas are gone.
    """

    def __init__(self, namespace: str, shards: Sequence[RelayTarget], clock: Callable[[], float] = time.monotonic) -> None:
        if not shards:
            raise ValueError("PublishRelay: shards is empty")
        self.namespace = namespace
        self._clock = clock
        self._routes = [_Route(client) for client in shards]
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._used_at = clock()  # the last publish handed over or call answered

    def publish(self, shard: int, replica_id: str, seq: int, changes: bytes, report: dict | None) -> Future:
        """Queue a replica's publish for `shard`; the Future of (epoch, whether the shard
        knows the replica, the interval the replica is to leave between its calls)."""
        if not isinstance(shard, int) or not 0 <= shard < len(self._routes):
            raise ValueError(f"PublishRelay.publish: shard {shard!r} is not one of the namespace's {len(self._routes)}")
        future: Future = Future()
        now = self._clock()
        with self._lock:
            if self._stopping:
                raise RuntimeError("PublishRelay.publish: the relay is closed")
            self._used_at = now
            route = self._routes[shard]
            if len(route.queued) >= MAX_QUEUED:
                raise RuntimeError(f"PublishRelay.publish: {MAX_QUEUED} publishes already wait for shard {shard}")
            route.queued.append(((replica_id, seq, changes, report), future))
            # the first publish of a route with no call in flight: the thread may sleep past its time
            wake = route.sending is None and len(route.queued) == 1
        if wake:
            self._wake.set()
        return future

    def step(self, now: float) -> float:
        """Collect the calls that finished, send every shard's due publishes; when to step again at the latest."""
        settled: list[tuple[list[Future], Future]] = []  # (replicas' Futures, the call that answers them)
        failed: list[tuple[list[Future], BaseException]] = []
        due = now + 1.0
        with self._lock:
            for route in self._routes:
                sending = route.sending
                if sending is not None and sending.done():
                    if sending.exception() is None:
                        route.interval = sending.result()[2]
                    settled.append((route.carried, sending))
                    route.sending, route.carried = None, []
                    self._used_at = max(self._used_at, now)
                if route.sending is not None or not route.queued:
                    continue
                send_at = route.sent_at + route.interval
                if now < send_at:
                    due = min(due, send_at)
                    continue
                batch = _take_call(route.queued)
                if not route.queued:  # else what is left goes as soon as this call is answered
                    route.sent_at = now
                carried = [future for _, future in batch]
                try:
                    sending = route.client.publish_many([item for item, _ in batch], self.namespace)
                except Exception as e:
                    failed.append((carried, e))
                    self._used_at = max(self._used_at, now)
                    continue
                route.sending, route.carried = sending, carried
                sending.add_done_callback(lambda _: self._wake.set())
        # outside the lock: a Future's callbacks may publish again
        for carried, sending in settled:
            _settle(carried, sending)
        for carried, error in failed:
            for future in carried:
                future.set_exception(error)
        return due

    def flush(self) -> None:
        """Nothing to hand over: the relay's thread sends what is due (a `PublishPath`, as
        the in-process relay of bench/scale.py's replicas)."""

    def unused_s(self, now: float) -> float:
        """Seconds at `now` (on the relay's clock) since a publish was last handed over or
        a call last answered, or since the relay was made; 0 while a publish waits or a
        call is in flight. Counted from the answer too, not only from the publish: a
        replica hands its next publish over once its previous one is answered, however
        long the shard took to answer."""
        with self._lock:
            if any(route.queued or route.sending is not None for route in self._routes):
                return 0.0
            return max(0.0, now - self._used_at)

    def start(self) -> None:
        """Step on a thread of the relay's own until `close`."""
        if self._thread is not None:
            raise RuntimeError("PublishRelay.start: already started")
        self._thread = threading.Thread(target=self._run, name=f"distkv-relay-{self.namespace}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; the publishes still queued fail (their replicas send them again)."""
        with self._lock:
            self._stopping = True
            queued = [future for route in self._routes for _, future in route.queued]
            for route in self._routes:
                route.queued = []
        self._wake.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
        for future in queued:
            future.set_exception(RuntimeError("PublishRelay closed"))

    def _run(self) -> None:
        timeout = 0.0
        while True:
            self._wake.wait(timeout)
            self._wake.clear()
            if self._stopping:
                return
            timeout = max(0.0, self.step(self._clock()) - self._clock())


def _settle(carried: list[Future], sending: Future) -> None:
    """Answer each replica's publish that the finished call `sending` carried."""
    error = sending.exception()
    if error is not None:
        for future in carried:
            future.set_exception(error)
        return
    epoch, results, _ = sending.result()
    if len(results) != len(carried):
        for future in carried:
            future.set_exception(RuntimeError(f"publish_many answered {len(results)} results for {len(carried)} publishes"))
        return
    for future, result in zip(carried, results):
        if isinstance(result, bool):
            future.set_result((epoch, result, FLUSH_INTERVAL_S))
        else:
            future.set_exception(ValueError(result))


# (shard, replica_id, seq, packed (stored, removed), report or None): a publish as a
# replica hands it to its node's relay.
Handed = tuple[int, str, int, bytes, "dict | None"]


class RelayBatch:
    """A replica's publishes to its node's relay, gathered over one step of its link:
    `flush` (at the step's end) hands them over in one `send` call, whichever shards they
    go to, so that a replica calls its node's agent once per step, not once per shard.
    The publish path (`distkv.directory.publisher.PublishPath`) of a queried link.

    `send(items)` returns the Future of a list with, per item, the shard's answer
    (epoch, known, interval) or the error that refused it (a str). Stepped by the link's
    thread only; the answers may complete the publishes' Futures from any thread.
    """

    def __init__(self, send: Callable[[list[Handed]], Future]) -> None:
        self._send = send
        self._items: list[Handed] = []
        self._futures: list[Future] = []

    def publish(self, shard: int, replica_id: str, seq: int, changes: bytes, report: dict | None) -> Future:
        """Queue a publish for the next `flush`; the Future of the shard's answer to it."""
        future: Future = Future()
        self._items.append((shard, replica_id, seq, changes, report))
        self._futures.append(future)
        return future

    def flush(self) -> None:
        """Hand every publish queued since the last flush to the relay, in one call."""
        if not self._items:
            return
        items, futures = self._items, self._futures
        self._items, self._futures = [], []
        try:
            call = self._send(items)
        except Exception as e:
            for future in futures:
                future.set_exception(e)
            return
        call.add_done_callback(lambda done: _settle_handed(futures, done))


def _settle_handed(futures: list[Future], call: Future) -> None:
    """Answer each publish of a `RelayBatch` call from the relay's answer `call`."""
    error = call.exception()
    if error is None and len(call.result()) != len(futures):
        error = RuntimeError(f"the relay answered {len(call.result())} results for {len(futures)} publishes")
    if error is not None:
        for future in futures:
            future.set_exception(error)
        return
    for future, result in zip(futures, call.result()):
        if isinstance(result, str):
            future.set_exception(RuntimeError(result))
        else:
            future.set_result(result)


def _take_call(queued: list[tuple[Relayed, Future]]) -> list[tuple[Relayed, Future]]:
    """Take from `queued` the publishes of one call: the first, and as many after it as
    keep the call's changes within MAX_CALL_BYTES."""
    size = len(queued[0][0][2])
    end = 1
    while end < len(queued) and size + len(queued[end][0][2]) <= MAX_CALL_BYTES:
        size += len(queued[end][0][2])
        end += 1
    batch = queued[:end]
    del queued[:end]
    return batch
