"""A replica's promotions in flight, the ones it abandoned, and the keys whose promotion failed."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from distkv.abstract import OffloadKey
from distkv.observability.errors import ErrorLog

logger = logging.getLogger(__name__)

# Failed promotions remembered (so that lookups answer a miss, not a new try) at most.
MAX_FAILED_KEYS = 1 << 16
# The Promoter fails a promotion at its deadline itself; the manager fails one the
# Promoter has not reported this long after (its thread is stuck or gone).
OVERDUE_GRACE_S = 1.0


class PromotionsInFlight:
    """The bookkeeping of a cluster manager's promotions: at most one per key.

    A promotion's reserved row belongs to the Promoter until it reports the promotion. One
    it has not reported OVERDUE_GRACE_S after its deadline (`overdue`), and every one in
    flight at a reset (`abandon_all`), is abandoned: a miss at once, its row kept out of
    use until the report comes (`sort` then says it `ended`). A key whose promotion failed
    answers a miss for `retry_s` (`failed_until`), so that lookups do not start it again
    and again.
    """

    def __init__(self, retry_s: float, errors: ErrorLog) -> None:
        self._retry_s = retry_s
        self._errors = errors
        # promotions in flight -> when they are overdue, in submission order (the earliest first)
        self.promoting: dict[OffloadKey, float] = {}
        # no promotion is overdue before this (a lower bound, so the hot path reads one float)
        self._next_overdue = math.inf
        # abandoned promotions whose report is still due
        self.abandoned: set[OffloadKey] = set()
        # keys whose promotion failed -> until when lookups answer a miss for them
        self.failed: dict[OffloadKey, float] = {}
        # promotions into rows of other landings than this pool, in flight
        self.into_rows = 0

    def failed_until(self, key: OffloadKey, now: float) -> bool:
        """Whether `key`'s promotion failed less than `retry_s` ago (one that failed
        longer ago is forgotten)."""
        until = self.failed.get(key)
        if until is None:
            return False
        if until > now:
            return True
        del self.failed[key]
        return False

    def started(self, key: OffloadKey, deadline: float, into_row: bool = False) -> None:
        """A promotion of `key` was submitted, to end by `deadline`: into a row of this pool,
        or `into_row` of another landing's (its owner waits for it: `landed`)."""
        if into_row:
            self.into_rows += 1
            return
        if not self.promoting:
            self._next_overdue = deadline + OVERDUE_GRACE_S
        self.promoting[key] = deadline + OVERDUE_GRACE_S

    def overdue(self, now: float) -> list[OffloadKey]:
        """The promotions overdue at `now`, abandoned and failed from now on (logged, and
        counted among the errors)."""
        if now < self._next_overdue:
            return []
        overdue = []
        self._next_overdue = math.inf
        for key, overdue_at in self.promoting.items():
            if overdue_at > now:
                self._next_overdue = overdue_at
                break
            overdue.append(key)
        if not overdue:
            return overdue
        logger.warning("distkv: %d promotions not reported by their deadline, failed as misses", len(overdue))
        self._errors.add("promotion_timeout", f"{len(overdue)} promotion(s) the promoter never reported", len(overdue))
        for key in overdue:
            del self.promoting[key]
            self.failed[key] = now + self._retry_s
        self.abandoned.update(overdue)
        return overdue

    def sort(
        self, finished: Iterable[tuple[OffloadKey, bool, bool]]
    ) -> tuple[list[tuple[OffloadKey, bool]], list[OffloadKey], list[OffloadKey]]:
        """The Promoter's reports (key, ok, same node), sorted: (the succeeded, with whether
        each came from this node; the failed; the abandoned ones that ended, whatever
        their outcome)."""
        succeeded, failed, ended = [], [], []
        for key, ok, same_node in finished:
            if self.promoting.pop(key, None) is None:
                self.abandoned.discard(key)
                ended.append(key)
            elif ok:
                succeeded.append((key, same_node))
            else:
                failed.append(key)
        return succeeded, failed, ended

    def landed(self, finished: list[tuple[OffloadKey, int, bool, bool]], now: float) -> list[OffloadKey]:
        """The Promoter's reports (key, row, ok, same node) of promotions into other
        landings: they are out of flight, and the failed ones (returned) misses for `retry_s`."""
        self.into_rows -= len(finished)
        failed = [key for key, _, ok, _ in finished if not ok]
        self.fail(failed, now)
        return failed

    def fail(self, keys: list[OffloadKey], now: float) -> None:
        """These promotions failed at `now`: misses for `retry_s`."""
        if len(self.failed) > MAX_FAILED_KEYS:  # keep it bounded: forget what expired
            self.failed = {k: t for k, t in self.failed.items() if t > now}
        retry_at = now + self._retry_s
        for key in keys:
            self.failed[key] = retry_at

    def abandon_all(self) -> None:
        """A reset: every promotion in flight is abandoned, and every failure forgotten."""
        self.abandoned.update(self.promoting)
        self.promoting.clear()
        self._next_overdue = math.inf
        self.failed.clear()
