"""The routing rule: each candidate replica scored by the time to first token expected there.

    expected(c) = ahead(c)                                       the work c has to do first
                + pull(c, path, n_pull) if c pulls them            blocks another replica holds
                  else prefill * n_pull
                + prefill * (blocks - own(c) - n_pull)             blocks nobody holds for it

`own(c)`: the leading blocks of the prompt in c's own pool (they cost nothing); `n_pull`: the
blocks after those that another replica holds, pulled on `path` (the same node when a
replica on c's node holds them, else across nodes) or recomputed, whichever c's pull gate
will choose (`distkv.routing.pull_gate`: the same rule, the same measurements). The last two
terms are the request's compute on c (`ExpectedTTFT.compute`); `ahead(c)` the compute and
overhead of the requests sent to c before it (`distkv.routing.work_ahead`). A replica's costs
are what its pull gate measured, sent in its routing stats (`Costs.from_estimates`); what it
has not measured yet is taken from `PRIOR`, measured on the demo (docs/routing.md). `prefill`
is the candidates' median prefill cost per block: a deployment's replicas run one model on
like hardware, and the differences between their measurements are noise that, followed,
starves the replicas measured higher of the requests that would correct them. With no
Directory answer every candidate holds nothing and the rule is the least work ahead.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distkv.routing.pull_gate import PATHS
from distkv.routing.answer import RoutedAnswer

@dataclass(frozen=True)
class Costs:
    """What a request costs on one replica, seconds: a prefill per block, a pull of n blocks
    per path as (intercept, slope per block), the engine's step (a pull waits whole steps)."""

    prefill_s_per_block: float
    pull_s: Mapping[str, tuple[float, float]]
    step_s: float

    def pull(self, path: str, blocks: int) -> float:
        intercept, slope = self.pull_s[path]
        return max(1, math.ceil((intercept + slope * blocks) / self.step_s)) * self.step_s

    def recompute(self, blocks: float) -> float:
        return self.prefill_s_per_block * blocks

    def from_estimates(self, estimates: Mapping[str, Any] | None) -> "Costs":
        """These costs with what a replica's `PullGate.estimates()` measured in place of
        each prior it has a measurement for; these costs alone for anything malformed."""
        try:
            prefill = estimates.get("prefill_s")
            pulls = estimates.get("pull_s") or {}
            step = estimates.get("step_s")
            return Costs(
                float(prefill[1]) if prefill else self.prefill_s_per_block,
                {p: tuple(map(float, pulls[p])) if pulls.get(p) else self.pull_s[p] for p in PATHS},
                float(step) if step and step > 0 else self.step_s,
            )
        except (AttributeError, TypeError, ValueError, IndexError, KeyError):
            return self


# Measured on the demo's trace, as the medians of what the replicas' pull gates and the router
# measured over 9 runs of bench/routing.py (4 replicas of the demo's model on 2 simulated nodes
# of a 2-core machine, which other jobs shared): docs/routing.md, "The constants".
PRIOR = Costs(
    prefill_s_per_block=0.011,
    pull_s={"same_node": (0.0087, 0.0010), "cross_node": (0.0053, 0.0045)},
    step_s=0.0071,
)
PRIOR_SERVICE_S = 0.16
PRIOR_OVERHEAD_S = 0.076


@dataclass(frozen=True)
class Candidate:
    """A replica the router may choose: `key` is the router's own id for it; `replica_id`
    and `node_id` its distkv identity (None before it said, in its routing stats); `ahead_s`
    the work it has to do before a request sent now (`WorkAhead.ahead`)."""

    key: Any
    replica_id: str | None
    node_id: str | None
    ahead_s: float
    costs: Costs = PRIOR


class HeldPrefix:
    """Who holds how much of a prompt's prefix, from the Directory's answer: each replica's
    run of leading blocks, and for each block who holds it."""

    def __init__(self, answer: RoutedAnswer | None, blocks: int) -> None:
        self.blocks = blocks
        keys = answer.keys if answer is not None and answer.answered else ()
        holders = answer.holders if answer is not None else {}
        self.runs: dict[str, int] = {}
        self.nodes: dict[str, str] = {}
        # per block in prefix order, up to the last one held: its holders, as the shard gives
        # them ((replica_id, node_id, row, generation) tuples)
        self.held: list[tuple] = []
        last = max((i for i, key in enumerate(keys) if key in holders), default=-1)
        runs, nodes = self.runs, self.nodes
        for i in range(last + 1):
            key_holders = holders.get(keys[i], ())
            self.held.append(key_holders)
            for h in key_holders:
                nodes[h[0]] = h[1]
                if runs.get(h[0], 0) == i:
                    runs[h[0]] = i + 1

    def split(self, c: Candidate) -> tuple[int, int, str]:
        """(blocks in c's own pool, blocks after those held by other replicas, the path
        to pull them on)."""
        own = self.runs.get(c.replica_id, 0) if c.replica_id is not None else 0
        pull = 0
        for key_holders in self.held[own:]:
            if not any(h[0] != c.replica_id for h in key_holders):
                break
            pull += 1
        near = any(
            run >= own + pull and self.nodes[r] == c.node_id for r, run in self.runs.items() if r != c.replica_id
        )
        return own, pull, "same_node" if near and c.node_id is not None else "cross_node"


class ExpectedTTFT:
    """Scores candidates by the rule above."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def compute(self, c: Candidate, held: HeldPrefix, prefill_s_per_block: float) -> float:
        """Seconds of c's pulls and prefill for the prompt, a block's prefill taking
        `prefill_s_per_block`; c pulls what its own gate would pull."""
        own, pull, path = held.split(c)
        if pull:
            pulled = c.costs.pull(path, pull)
            if pulled < c.costs.recompute(pull):
                return pulled + prefill_s_per_block * (held.blocks - own - pull)
        return prefill_s_per_block * (held.blocks - own)

    def rank(self, candidates: Sequence[Candidate], held: HeldPrefix) -> list[tuple[Candidate, float]]:
        """The candidates, best first (equal scores in random order), each with its compute."""
        prefill = statistics.median(c.costs.prefill_s_per_block for c in candidates)
        computes = [self.compute(c, held, prefill) for c in candidates]
        order = sorted(
            range(len(candidates)), key=lambda i: (candidates[i].ahead_s + computes[i], self._rng.random())
        )
        return [(candidates[i], computes[i]) for i in order]
