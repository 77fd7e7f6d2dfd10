"""The pull gate: whether promoting a prefix from another replica is expected to beat recomputing it.

A replica that misses a prefix another replica holds can pull it (a promotion: the request
waits, answered RETRY, until the blocks land) or recompute it. Pulling pays when the wait is
shorter than the compute it saves:

    pull:      max(1, ceil(pull_s(path, n) / step_s)) * step_s
    recompute: n * prefill_s_per_block

where `pull_s(path, n)` is what pulling n blocks took on that path (same node: the holder's
shared memory; cross node: NIXL or the object store, whichever the transports chose),
`step_s` the engine's step (a RETRY defers the request by at least one), and
`prefill_s_per_block` the marginal cost of one more block in a prefill. All three are
measured as the replica runs (`observe_*`), each a least-squares line (`LinearCost`) over
recent observations. A path or a prefill cost not measured yet pulls: the first pulls
measure it. A path the gate keeps refusing pulls again every `EXPLORE_EVERY`-th refusal,
so that its estimate follows what the path costs now.

The gate keeps no state per request; `ClusterOffloadingManager` asks it once per request,
at the first block it would promote, with the length of the run of blocks it would pull.
docs/routing.md gives the rule and the figures behind it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

PATHS = ("same_node", "cross_node")

# The weight an observation keeps per newer one: about the last 20 count.
DECAY = 0.95
# A refused path pulls anyway once per this many refusals, to measure it again.
EXPLORE_EVERY = 16
# A step interval is clipped to [1/STEP_CLIP, STEP_CLIP] x the estimate before it counts,
# so that one outlier moves it little.
STEP_CLIP = 4.0


class LinearCost:
    """Seconds as `intercept + slope * x`, fit by least squares over observations whose
    weights decay by DECAY with each newer one. Both terms are kept >= 0; with a single
    distinct x the line goes through the origin."""

    __slots__ = ("_w", "_x", "_y", "_xx", "_xy", "count")

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.count = 0

    def observe(self, x: float, seconds: float) -> None:
        if not (x > 0 and seconds >= 0 and math.isfinite(x) and math.isfinite(seconds)):
            return
        d = DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + seconds
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * seconds
        self.count += 1

    @property
    def known(self) -> bool:
        return self.count > 0

    def line(self) -> tuple[float, float]:
        """(intercept, slope); (0, 0) before any observation."""
        if not self.count:
            return 0.0, 0.0
        spread = self._w * self._xx - self._x * self._x
        if spread > 1e-9 * self._w * self._xx:
            slope = (self._w * self._xy - self._x * self._y) / spread
            intercept = (self._y - slope * self._x) / self._w
            if slope >= 0 and intercept >= 0:
                return intercept, slope
            if slope < 0:  # noise beat the trend: the mean cost, flat
                return self._y / self._w, 0.0
        return 0.0, self._y / self._x  # one distinct x, or a negative intercept: through the origin

    def predict(self, x: float) -> float:
        intercept, slope = self.line()
        return intercept + slope * x


class PullGate:
    """The replica's rule for pulling a run of blocks held elsewhere. Not thread-safe:
    the scheduler's thread observes and asks (the exporter only reads its counts)."""

    def __init__(self, explore_every: int = EXPLORE_EVERY) -> None:
        if explore_every < 1:
            raise ValueError(f"explore_every={explore_every} must be positive")
        self.explore_every = explore_every
        self.prefill = LinearCost()  # seconds of a prefill of x blocks
        self.pull = {path: LinearCost() for path in PATHS}  # seconds to pull x blocks
        self.step_s: float | None = None
        self._step_ended_at: float | None = None
        # promotions in flight -> the pull of their request
        self._pulls: dict[bytes, RequestPull] = {}
        self._refusals = dict.fromkeys(PATHS, 0)
        # blocks the gate let pull, and blocks it refused (recomputed instead), by path
        self.allowed = dict.fromkeys(PATHS, 0)
        self.skipped = dict.fromkeys(PATHS, 0)

    # ---- what the replica measured ---------------------------------------------------

    def observe_prefill(self, blocks: float, seconds: float) -> None:
        """A prefill computed `blocks` blocks' worth of tokens in `seconds`."""
        self.prefill.observe(blocks, seconds)

    def observe_pull(self, path: str, blocks: int, seconds: float) -> None:
        """A request's pull of `blocks` blocks on `path` took `seconds`, from its first
        promotion's start to its last one's landing."""
        self.pull[path].observe(blocks, seconds)

    def observe_step(self, seconds: float) -> None:
        """The interval between two of the engine's step ends."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if self.step_s is None:
            self.step_s = seconds
            return
        clipped = min(max(seconds, self.step_s / STEP_CLIP), self.step_s * STEP_CLIP)
        self.step_s = DECAY * self.step_s + (1 - DECAY) * clipped

    # ---- the rule --------------------------------------------------------------------

    def pull_cost_s(self, path: str, blocks: int) -> float | None:
        """What pulling `blocks` blocks on `path` is expected to cost the request; None
        before the path was measured."""
        fit = self.pull[path]
        if not fit.known:
            return None
        seconds = fit.predict(blocks)
        step = self.step_s
        if step is None:
            return seconds
        return max(1, math.ceil(seconds / step)) * step

    def recompute_cost_s(self, blocks: int) -> float | None:
        """What computing `blocks` more blocks in a prefill is expected to cost; None
        before a prefill was measured."""
        if not self.prefill.known:
            return None
        return self.prefill.line()[1] * blocks

    def decide(self, path: str, blocks: int) -> "RequestPull":
        """A request's decision on its run of `blocks` blocks on `path` (`should_pull`)."""
        return RequestPull(path, blocks, self.should_pull(path, blocks))

    def submitted(self, key: bytes, pull: "RequestPull | None", now: float) -> None:
        """A promotion of `key` for the request of `pull` started at `now`."""
        if pull is not None:
            pull.submitted(now)
            self._pulls[key] = pull

    def ended(self, key: bytes, ok: bool, now: float) -> None:
        """The promotion of `key` ended at `now`; once a request's last one did, what its
        pull took is observed."""
        pull = self._pulls.pop(key, None) if self._pulls else None
        if pull is not None:
            pull.ended(ok, now, self)

    def forget_pulls(self, keys: Iterable[bytes] | None = None) -> None:
        """Stop measuring the promotions of `keys` (all if None): they were abandoned."""
        if keys is None:
            self._pulls.clear()
        else:
            for key in keys:
                self._pulls.pop(key, None)

    def step_ended(self, now: float, busy: bool) -> None:
        """The engine's step ended at `now` (time.monotonic()); `busy`: whether it had a
        request in flight throughout since the step before. The interval across an idle
        engine is not a step (a relative clip alone lets repeated idle gaps ratchet the
        estimate up, to over a second in a demo run)."""
        if busy and self._step_ended_at is not None:
            self.observe_step(now - self._step_ended_at)
        self._step_ended_at = now

    def should_pull(self, path: str, blocks: int) -> bool:
        """Whether to pull a run of `blocks` blocks on `path` rather than recompute them.
        Counts the blocks as allowed or skipped."""
        if path not in self.pull:
            raise ValueError(f"path {path!r} must be one of {list(PATHS)}")
        pull, recompute = self.pull_cost_s(path, blocks), self.recompute_cost_s(blocks)
        pays = pull is None or recompute is None or pull < recompute
        if not pays:
            self._refusals[path] += 1
            if self._refusals[path] % self.explore_every == 0:
                pays = True  # measure the path again
        if pays:
            self.allowed[path] += blocks
        else:
            self.skipped[path] += blocks
        return pays

    def estimates(self) -> dict[str, object]:
        """What the gate measured, as plain numbers (for routing stats, the demo's report):
        prefill (intercept, slope per block) in seconds, each path's pull (intercept, slope
        per block) or None, the step in seconds or None."""
        return {
            "prefill_s": self.prefill.line() if self.prefill.known else None,
            "pull_s": {path: fit.line() if fit.known else None for path, fit in self.pull.items()},
            "step_s": self.step_s,
        }


class RequestPull:
    """Per-request state (kept in its ReqContext): the gate's decision for the run of
    blocks it would pull, and the measurement of the pull in flight."""

    __slots__ = ("path", "blocks", "allowed", "pending", "landed", "started")

    def __init__(self, path: str, blocks: int, allowed: bool) -> None:
        self.path = path
        self.blocks = blocks
        self.allowed = allowed
        self.pending = 0  # promotions submitted and not ended
        self.landed = 0  # of those ended, the ones that succeeded
        self.started = 0.0  # when the first of the pending ones was submitted

    def submitted(self, now: float) -> None:
        if not self.pending:
            self.started, self.landed = now, 0
        self.pending += 1

    def ended(self, ok: bool, now: float, gate: PullGate) -> None:
        """One promotion ended; once the last one did, the gate learns what the pull took."""
        self.pending -= 1
        self.landed += ok
        if not self.pending and self.landed:
            gate.observe_pull(self.path, self.landed, now - self.started)


def prefix_run(key: bytes, positions: Mapping[bytes, int], pullable: Callable[[bytes], bool]) -> int:
    """How many blocks of a request's prefix, from `key` on in token order and of `key`'s
    KV-cache group, are pullable before the first that is not; 1 when the request recorded
    no positions (the gate then judges `key` alone)."""
    start = positions.get(key)
    if start is None:
        return 1
    group = key[-4:]
    later = sorted((end, k) for k, end in positions.items() if end >= start and k[-4:] == group)
    run = 0
    for _, k in later:
        if not pullable(k):
            break
        run += 1
    return max(run, 1)
