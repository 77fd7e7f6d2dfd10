"""A replica's side of a shard: the calls it makes (`ShardClient`), how long it waits before
making a failed one again (`backoff`), and how the link's thread is woken to make them (`Waker`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from distkv.abstract import OffloadKey
from distkv.directory.records import Cursor, ReplicaInfo
from distkv.directory.wire import MAX_CALL_KEYS

class ShardClient(Protocol):
    """One Directory shard as a link calls it: the shard's methods (see
    `ray_actors.directory.DirectoryShard`), each returning at once a Future of its answer.

    A call that cannot even be sent raises at once; one the shard fails, or that is lost
    with it, fails its Future. Payloads are encoded as `distkv.directory.wire` says.
    """

    def register(self, info: ReplicaInfo, seq: int, stored: bytes, namespace: str) -> Future:
        """Future of (epoch, True, the interval to leave between calls: `DirectoryState.publish_interval`)."""

    def publish(self, replica_id: str, seq: int, changes: bytes, report: dict | None, namespace: str) -> Future:
        """Future of (epoch, whether the shard knows the replica, the interval to leave between calls)."""

    def unregister(self, replica_id: str, namespace: str) -> Future:
        """Future of whether the replica was registered."""

    def changes(self, cursor: Cursor | None, timeout_s: float, namespace: str, follower: str | None) -> Future:
        """Future of the encoded `Changes` after `cursor` (`wire.encode_feed`), once there is news for `follower` or after `timeout_s`."""

    def query(self, keys: Sequence[OffloadKey], namespace: str) -> Future:
        """Future of the (holders of each key, ReplicaInfo of each replica they name), as
        `wire.encode_answer` makes it: MAX_BATCH_KEYS keys at most."""

    def cancel(self, future: Future) -> None:
        """Best effort: stop the call `future` answers (a long poll no one waits for any more)."""

    def close(self) -> None:
        """Let go of what the client holds open; the link that called it is done with it."""


# A register, publish or query carries at most this many keys (all a shard takes in one
# call); the rest follow in the next batches. A re-register after a shard's restart would
# otherwise carry the replica's whole pool in one call and one log entry, which the shard
# checks, logs and encodes for every follower on its one thread while every other call waits.
MAX_BATCH_KEYS = MAX_CALL_KEYS


MAX_BACKOFF_S = 2.0


def backoff(failures: int) -> float:
    return min(MAX_BACKOFF_S, 0.05 * 2 ** min(failures, 6)) * random.uniform(0.5, 1.0)


class Waker:
    """The wake-up of a link's thread. `set` wakes it; a caller on the scheduler's path
    wakes it only while `listening`: the thread sleeps longer than FLUSH_INTERVAL_S
    (`distkv.directory.state`), and in shorter sleeps it takes what came when it wakes
    anyway, which spares the caller a syscall (`Event.set` takes a lock even when set)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.listening = False

    def set(self) -> None:
        self.event.set()
