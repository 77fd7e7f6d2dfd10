"""Errors by kind, as each component keeps them: a count of each and the last few messages.

The metrics exporter exports the counts (`distkv_errors`); `distkv status` shows the messages.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

# Errors each component keeps with their messages, for `distkv status`.
RECENT_ERRORS = 20
MAX_ERROR_MESSAGE = 300
# The kinds of `distkv_errors`; docs/metrics.md says what each means.
ERROR_KINDS = (
    "promotion_no_holder",  # no holder whose pool this replica can read
    "promotion_fetch",  # reading the holder's row failed
    "promotion_timeout",
    "promotion_stale",  # the holder's copy changed or did not check out
    "promotion_error",  # an unexpected failure, of this promotion only
    "store_rejected",  # no free or evictable row
    "store_failed",
    "load_failed",
    "directory_publish",  # retried
    "directory_poll",  # retried
    "directory_query",  # its keys are misses until the answers expire
    "routed_answer",  # a request carried a router's answer that could not be read: ignored
)


class ErrorLog:
    """Errors by kind: a count of each and the last few with their messages. Thread-safe;
    not for the hot path (the scheduler counts there in ints, and `sync` brings them in)."""

    def __init__(self, keep: int = RECENT_ERRORS) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._recent: deque[tuple[float, str, str]] = deque(maxlen=keep)

    def add(self, kind: str, message: str, count: int = 1) -> None:
        _check_kind(kind)
        with self._lock:
            self._add(kind, message, count)

    def sync(self, kind: str, total: int, message: str) -> None:
        """Bring the count of `kind` up to `total`, kept elsewhere, noting the increase as an error."""
        _check_kind(kind)
        with self._lock:
            new = total - self._counts.get(kind, 0)
            if new > 0:
                self._add(kind, f"{new} x {message}", new)

    def _add(self, kind: str, message: str, count: int) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + count
        self._recent.append((time.time(), kind, message[:MAX_ERROR_MESSAGE]))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def recent(self) -> list[tuple[float, str, str]]:
        """(wall-clock time, kind, message) of the last errors, oldest first."""
        with self._lock:
            return list(self._recent)


def _check_kind(kind: str) -> None:
    if kind not in ERROR_KINDS:
        raise ValueError(f"error kind {kind!r} is not one of {sorted(ERROR_KINDS)}")


def merge_errors(logs: Iterable[ErrorLog], keep: int = RECENT_ERRORS) -> tuple[dict[str, int], list[tuple[float, str, str]]]:
    """The counts of several logs summed, and their last `keep` errors, oldest first."""
    counts: dict[str, int] = {}
    recent: list[tuple[float, str, str]] = []
    for log in logs:
        for kind, n in log.counts().items():
            counts[kind] = counts.get(kind, 0) + n
        recent.extend(log.recent())
    recent.sort()
    return counts, recent[-keep:]
