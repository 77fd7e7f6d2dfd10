"""Which blocks a promotion must not evict: those a scan has just found.

A promotion evicting a block that a scan answered HIT would turn the scan's prefix into a
miss when its request comes back for it. So a promotion spares the blocks found since the
last prepare_store (vLLM offers stores after the step's scans), and those found by a
request whose scan was deferred (answered retry) until that request loads, stores or
finishes, or its promotions' deadlines have passed.
"""

from __future__ import annotations

import time
from typing import Protocol


class Stamped(Protocol):
    """A block as scans stamp it: `seen`, the scan round of the last lookup that found it."""

    seen: int


class ScanRounds:
    """Scan rounds, and what they protect.

    Lookups stamp each block they find with the current `round` (`block.seen = round`, one
    store on the hot path); `next_round` starts a new one (each prepare_store). A request
    whose scan answered retry is `defer`red: what it found stays protected until it is
    `admitted`, or `lapses_s` later. `spares(block)`: whether a promotion must leave it.
    """

    def __init__(self, lapses_s: float) -> None:
        self.round = 0
        self._lapses_s = lapses_s
        # deferred requests by req_id: the round of their latest scan, and when their
        # protection lapses
        self._waiting: dict[str, tuple[int, float]] = {}
        # blocks stamped with a round at least this are spared
        self._protect_from = 0

    def defer(self, req_id: str) -> None:
        """The request's scan answered retry: keep what it found until it is admitted."""
        self._waiting[req_id] = (self.round, time.monotonic() + self._lapses_s)

    def admitted(self, req_id: str) -> None:
        """The request loads, stores or finished: its blocks are its own business from now."""
        if self._waiting:
            self._waiting.pop(req_id, None)

    def next_round(self) -> None:
        """Start a new scan round: protect what lookups find from now on, and what deferred
        requests found since their latest scan."""
        self.round += 1
        protect_from = self.round
        if self._waiting:
            now = time.monotonic()
            for req_id, (found_in, lapses) in list(self._waiting.items()):
                if lapses <= now:
                    del self._waiting[req_id]  # its promotions have ended: a rescan decides
                elif found_in < protect_from:
                    protect_from = found_in
        self._protect_from = protect_from

    def spares(self, block: Stamped) -> bool:
        """Whether a promotion must not evict `block`."""
        return block.seen >= self._protect_from
