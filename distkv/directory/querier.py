"""Asks one shard about the keys a replica missed, many keys a call."""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future

from distkv.abstract import OffloadKey
from distkv.directory.wire import decode_answer
from distkv.directory.client import MAX_BATCH_KEYS, ShardClient
from distkv.directory.records import ReplicaInfo
from distkv.observability.errors import ErrorLog

# A query not answered by then is given up and its keys answered as misses: a restarting
# shard holds calls until it is back.
QUERY_TIMEOUT_S = 1.0


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
