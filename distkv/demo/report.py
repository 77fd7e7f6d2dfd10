"""The demo's results: each arm's requests folded into its figures, the check of every loaded
block against the digests the replicas that computed it recorded, the table and the JSON
document.

A request's result (`distkv.demo.engine.ModelReplica.serve`) comes with the time the client
waited for it (`client_ttft_s`: from sending it to its first token, routing and queueing
included). Where that time went: before the engine (routing, the way to the replica, its
queue), waiting for promotions (lookups answered RETRY), loading, computing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distkv.demo.engine import BLOCK_TRANSPORTS, SOURCES
from distkv.demo.workload import Request, oracle_hit_tokens

TOKEN_ROWS = (
    ("local", "from the replica's own pool"),
    ("same_node", "from another replica, same node"),
    ("cross_node", "from another node"),
    ("recomputed", "recomputed"),
)
TAIL_PARTS = ("queue_s", "wait_s", "load_s", "compute_s")


class Verifier:
    """Every loaded block of every arm against the digests recorded for its key by the
    replicas that computed it, and each arm's first tokens against offloading off's."""

    def __init__(self) -> None:
        self._digests: dict[bytes, set[int]] = defaultdict(set)
        self._computed_by: dict[bytes, set[str]] = defaultdict(set)
        self._loaded: list[tuple[str, bytes, int, str]] = []  # (arm, key, digest, loading replica)
        self.first_tokens: dict[str, dict[int, int]] = defaultdict(dict)

    def add(self, arm: str, index: int, result: Mapping[str, Any]) -> None:
        replica = result["replica"]
        for key, digest in result["computed"]:
            self._digests[key].add(digest)
            self._computed_by[key].add(replica)
        self._loaded.extend((arm, key, digest, replica) for key, digest in result["loaded"])
        self.first_tokens[arm][index] = result["first_token"]

    def verify(self) -> tuple[int, int]:
        """(blocks verified, mismatches); call once every request of every arm is in."""
        mismatches = sum(1 for _, key, digest, _ in self._loaded if digest not in self._digests.get(key, ()))
        return len(self._loaded), mismatches

    def computed_elsewhere(self, arm: str) -> int:
        """Blocks `arm` loaded that the loading replica never computed itself."""
        return sum(1 for a, key, _, replica in self._loaded if a == arm and replica not in self._computed_by.get(key, ()))

    def same_first_tokens(self, arm: str, reference: str = "off") -> int | None:
        """Requests of `arm` whose first token is the `reference` arm's; None without it."""
        ref = self.first_tokens.get(reference)
        if not ref:
            return None
        return sum(1 for i, t in self.first_tokens[arm].items() if ref.get(i) == t)


class ArmTally:
    """The totals of one arm of `replicas` replicas, from each request's result as it arrives."""

    def __init__(self, block_tokens: int, block_bytes: int, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"an arm needs at least one replica, not {replicas}")
        self.replicas = replicas
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.prompt_tokens = 0
        self.hit_blocks = dict.fromkeys(SOURCES, 0)
        self.load_failures = 0
        self.load_s = 0.0
        self.promoted_bytes = 0
        # per request: client TTFT, its parts (TAIL_PARTS), retries
        self.requests: list[tuple[float, tuple[float, ...], int]] = []
        self.by_replica: Counter[str] = Counter()
        self.replica_stats: dict[str, Mapping[str, Any]] = {}  # each replica's latest
        self._warm_stats: dict[str, Mapping[str, Any]] = {}  # each replica's after its warm-up
        self.router: dict[str, Any] = {}  # what distkv's router measured (`router_figures`)
        self.times: dict[int, tuple[float, float]] = {}  # trace index -> (started, answered), client's clock

    def router_figures(self, router: Any) -> None:
        """What the arm's request router measured, if it is distkv's: its Directory queries'
        times, its decisions' own time (the query left out), decisions and fallbacks."""
        core = getattr(router, "core", None)
        if core is None:
            return
        self.router = {
            "query_s": _percentiles(list(core.query_s)),
            "decision_s": _percentiles(list(router.decision_s)),
            "queries": len(core.query_s),
            "decisions": dict(core.decisions),
            "fallbacks": dict(core.fallbacks),
            "service_s": core.work.service_s,
            "overhead_s": core.work.overhead_s,
        }

    def warmed(self, result: Mapping[str, Any]) -> None:
        """A warm-up request's result: not counted; its replica's stats are the baseline
        its later ones are counted from."""
        if result.get("stats"):
            self._warm_stats[result["replica"]] = result["stats"]

    def add(self, index: int, result: Mapping[str, Any], client_ttft_s: float, answered_at: float) -> None:
        """The result of the trace's request `index`, answered at `answered_at`
        (time.perf_counter) `client_ttft_s` after it was sent."""
        self.times[index] = (answered_at - result["ttft_s"], answered_at)  # started: the engine's part before
        self.prompt_tokens += result["tokens"]
        for source, blocks in result["blocks_by_source"].items():
            self.hit_blocks[source] += blocks
        self.load_failures += result["load_failures"]
        self.load_s += result["load_s"]
        self.promoted_bytes += result["promoted_bytes"]
        before = max(client_ttft_s - result["ttft_s"], 0.0)  # routing, the way there, the queue
        parts = (before, result["wait_s"], result["load_s"], result["compute_s"])
        self.requests.append((client_ttft_s, parts, result["retries"]))
        self.by_replica[result["replica"]] += 1
        if result.get("stats"):
            self.replica_stats[result["replica"]] = result["stats"]

    @property
    def hit_rate(self) -> float:
        hits = sum(self.hit_blocks.values()) * self.block_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bytes_moved(self) -> int:
        """Bytes loaded into KV caches and promoted between replicas so far."""
        return sum(self.hit_blocks.values()) * self.block_bytes + self.promoted_bytes

    def summary(self, computed_elsewhere_blocks: int) -> dict[str, Any]:
        bt, bb = self.block_tokens, self.block_bytes
        tokens = {source: blocks * bt for source, blocks in self.hit_blocks.items()}
        tokens["recomputed"] = self.prompt_tokens - sum(tokens.values())
        stats = self._summed_stats()
        transfers = {
            "local_load": _transfer(sum(self.hit_blocks.values()), sum(self.hit_blocks.values()) * bb, self.load_s),
            **{
                f"{path}_promotion": _transfer(stats.get(f"{path}_bytes", 0) // bb, stats.get(f"{path}_bytes", 0), stats.get(f"{path}_s", 0.0))
                for path in ("same_node", "cross_node")
            },
        }
        # over every replica, those the router sent nothing included
        most, mean = max(self.by_replica.values(), default=0), len(self.requests) / self.replicas
        return {
            "requests": len(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "ttft_s": _percentiles([r[0] for r in self.requests]),
            "tokens": tokens,
            "hit_rate": self.hit_rate,
            "hit_tokens_computed_by_another_replica": computed_elsewhere_blocks * bt,
            "transfers": transfers,
            "transfers_by_transport": {
                t: _transfer(stats.get(f"{t}_bytes", 0) // bb, stats.get(f"{t}_bytes", 0), stats.get(f"{t}_s", 0.0))
                for t in BLOCK_TRANSPORTS
            },
            "requests_per_replica": {
                "max": most,
                "mean": mean,
                "max_over_mean": most / mean if mean else 0.0,
            },
            "tail": self._tail(),
            "pull_gate": {
                "pulled_blocks": (stats.get("same_node_bytes", 0) + stats.get("cross_node_bytes", 0)) // bb,
                "skipped_blocks": sum(stats.get("pull_skipped", {}).values()),
                "recomputed_blocks": tokens["recomputed"] // bt,
            },
            "routed": stats.get("routed", {}),
            "gate_estimates": {r: s["gate"] for r, s in sorted(self.replica_stats.items()) if "gate" in s},
            "router": self.router,
            "load_failures": self.load_failures,
            "lookup_retries": sum(r[2] for r in self.requests),
        }

    def _summed_stats(self) -> dict[str, Any]:
        """The replicas' latest stats less those after their warm-up, summed: numbers, and
        mappings of numbers by key."""
        total: dict[str, Any] = {}
        for replica, stats in self.replica_stats.items():
            warm = self._warm_stats.get(replica, {})
            for name, value in stats.items():
                if isinstance(value, Mapping) and name != "gate":
                    into = total.setdefault(name, {})
                    for k, v in value.items():
                        into[k] = into.get(k, 0) + v - warm.get(name, {}).get(k, 0)
                elif isinstance(value, (int, float)):
                    total[name] = total.get(name, 0) + value - warm.get(name, 0)
        return total

    def _tail(self) -> dict[str, dict[str, float]]:
        """Where the requests' time went: mean seconds before the engine (routing, the way
        there, the queue), waiting for promotions, loading and computing, of all requests
        and of those at or past the p99 and the p90 of the client's TTFT."""
        if not self.requests:
            return {}
        ttfts = [r[0] for r in self.requests]
        groups = {"all": self.requests}
        for p in (90, 99):
            cut = float(np.percentile(ttfts, p))
            groups[f"p{p}_and_slower"] = [r for r in self.requests if r[0] >= cut]
        return {
            name: {
                "requests": len(group),
                "ttft_s": float(np.mean([r[0] for r in group])),
                **{part: float(np.mean([r[1][i] for r in group])) for i, part in enumerate(TAIL_PARTS)},
                "retries": float(np.mean([r[2] for r in group])),
            }
            for name, group in groups.items()
        }


def summarize(
    arms: Mapping[str, ArmTally], verifier: Verifier, trace: Sequence[Request], setup: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON document, once every arm has run the trace: the setup, each arm's summary
    beside the oracle's hit rates (one infinite cache shared by all: on the trace, and on the
    trace as the arm ran it, where a request cannot hit what requests answered after it
    started compute), the verification over all arms."""
    verified, mismatches = verifier.verify()
    out = {}
    for name, tally in arms.items():
        summary = tally.summary(verifier.computed_elsewhere(name))
        as_run = [tally.times[i] for i in range(len(trace))]
        for field, times in (("oracle_hit_rate", None), ("oracle_hit_rate_as_run", as_run)):
            hits = oracle_hit_tokens(trace, tally.block_tokens, times)
            summary[field] = hits / tally.prompt_tokens if tally.prompt_tokens else 0.0
        summary["first_tokens_as_offloading_off"] = verifier.same_first_tokens(name)
        out[name] = summary
    return {
        **setup,
        "arms": out,
        "blocks_verified": verified,
        "mismatches": mismatches,
        "load_failures": sum(t.load_failures for t in arms.values()),
    }


def ratios(arms: Mapping[str, Mapping[str, Any]], arm: str, baseline: str) -> dict[str, float | None] | None:
    """`arm`'s TTFT p50 and p99 and cross-node bytes over `baseline`'s; None unless both ran
    (the cross-node bytes: None where the baseline moved none, a ratio of nothing)."""
    if arm not in arms or baseline not in arms:
        return None
    a, b = arms[arm], arms[baseline]
    out = {p: a["ttft_s"][p] / b["ttft_s"][p] if b["ttft_s"][p] else 0.0 for p in ("p50", "p99")}
    cross = b["transfers"]["cross_node_promotion"]["bytes"]
    out["cross_node_bytes"] = a["transfers"]["cross_node_promotion"]["bytes"] / cross if cross else None
    return out


def _transfer(blocks: int, nbytes: float, seconds: float) -> dict[str, float]:
    return {"blocks": int(blocks), "bytes": int(nbytes), "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0}


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p99": 0.0}
    p50, p99 = np.percentile(samples, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}
