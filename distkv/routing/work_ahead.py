"""The work ahead of a request sent to a replica now: how long it is expected to wait there.

A replica works through what it was sent roughly in order: the demo's engine serves one
request at a time, and vLLM schedules waiting prefills first come, first served, so a prefill
waits behind the compute of those sent before it. Queue lengths alone count a request that
finds its prefix held (a few blocks to prefill) as much as one that recomputes it all; the
router knows better, since it scored each request it sent. So the wait at a replica is

    ahead(r) = sum over the requests sent to r and not completed of (compute_i + overhead_s)
             - what the oldest of them has done since it could start
             + (queue_len(r) - those requests) x service_s      requests other routers sent

`compute_i`: the pull and prefill the score expected for request i on r
(`distkv.routing.score.ExpectedTTFT.compute`). `overhead_s`: what a request keeps a replica
busy beyond that compute (storing its blocks, its first token and response), learned from
completions as (observed service - compute_i). A request's observed service runs from when it
could start (sent, or the previous completion on that replica, whichever is later) to its
completion; `service_s` averages those. Both are averaged with a weight of (1 - DECAY) per
completion, and start from priors measured on the demo (docs/routing.md, "The constants").
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable
from dataclasses import dataclass

# How much of its estimate the overhead and the service time keep per completion observed.
DECAY = 0.9
# A request sent this long ago and never reported completed (its replica died, a callback
# lost) is no longer counted ahead of anything.
FORGET_S = 120.0
# At most this many requests are remembered per replica.
MAX_SENT = 4096


@dataclass(frozen=True)
class _Sent:
    request: Hashable
    compute_s: float
    sent_at: float


class WorkAhead:
    """Per replica, the requests this router sent and has not seen complete, in order sent."""

    def __init__(self, overhead_s: float, service_s: float) -> None:
        for name, value in (("overhead_s", overhead_s), ("service_s", service_s)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        self.overhead_s = overhead_s
        self.service_s = service_s
        self._sent: dict[Hashable, collections.deque[_Sent]] = {}
        self._done_at: dict[Hashable, float] = {}  # per replica, its last completion

    def ahead(self, replica: Hashable, queue_len: int, now: float) -> float:
        """Seconds a request sent to `replica` at `now` is expected to wait before its own
        compute; `queue_len`, Serve's count of the requests it has in flight."""
        sent = self._sent.get(replica)
        while sent and now - sent[0].sent_at > FORGET_S:
            sent.popleft()
        if not sent:
            return max(queue_len, 0) * self.service_s
        work = sum(s.compute_s for s in sent) + len(sent) * self.overhead_s
        head = sent[0]
        work -= min(max(now - self._could_start(replica, head), 0.0), head.compute_s + self.overhead_s)
        return work + max(queue_len - len(sent), 0) * self.service_s

    def sent(self, replica: Hashable, request: Hashable, compute_s: float, now: float) -> None:
        """`request` went to `replica` at `now`, expected to compute for `compute_s` there."""
        sent = self._sent.setdefault(replica, collections.deque())
        sent.append(_Sent(request, max(compute_s, 0.0), now))
        if len(sent) > MAX_SENT:
            sent.popleft()

    def completed(self, replica: Hashable, request: Hashable, now: float) -> None:
        """`request` completed on `replica` at `now`: it leaves the work ahead, and its
        service time teaches the overhead and the mean service."""
        sent = self._sent.get(replica)
        found = next((s for s in sent if s.request == request), None) if sent else None
        if found is None:
            return
        sent.remove(found)
        service = now - self._could_start(replica, found)
        self._done_at[replica] = now
        if not (service >= 0 and math.isfinite(service)):
            return
        self.service_s = DECAY * self.service_s + (1 - DECAY) * service
        self.overhead_s = DECAY * self.overhead_s + (1 - DECAY) * max(service - found.compute_s, 0.0)

    def _could_start(self, replica: Hashable, s: _Sent) -> float:
        """When `s` could start on `replica`: when sent, or at the replica's last completion."""
        return max(s.sent_at, self._done_at.get(replica, s.sent_at))

    def forget(self, replicas: set[Hashable]) -> None:
        """Drop what is kept of replicas other than `replicas` (those gone)."""
        for replica in [r for r in self._sent if r not in replicas]:
            del self._sent[replica]
            self._done_at.pop(replica, None)
