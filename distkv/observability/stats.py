"""A replica's counts since it started, as one typed, versioned value.

`ClusterOffloadingManager.stats()` builds a `ReplicaStats`; the metrics exporter and
`distkv status` read its attributes. It crosses the wire twice: pickled as it is (a
`ReplicaActor.stats()` result), and as its `to_dict()` with the Directory heartbeats, which
`distkv status` reads back with `from_dict`. `version` names the shape: a reader refuses
a report of another shape (a replica running another distkv) instead of misreading it.

Counts keyed by what they count ("same_node"/"cross_node", a transport's name, an error
kind) stay mappings: their keys are label values, not fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

STATS_VERSION = 2


@dataclass(frozen=True)
class LookupCounts:
    """Lookups by answer. One that started a promotion counts once the promotion ended:
    a remote hit if it succeeded, else a miss."""

    local_hit: int
    remote_hit: int
    miss: int
    retry: int

    @property
    def hit_rate(self) -> float | None:
        """Hits over hits and misses (retries are neither); None before any."""
        hits = self.local_hit + self.remote_hit
        total = hits + self.miss
        return hits / total if total else None


@dataclass(frozen=True)
class TransportCounts:
    """Cross-node promotions one transport moved: blocks and bytes that landed and checked
    out, and the seconds their transfers took (concurrent transfers each count)."""

    blocks: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class PromotionCounts:
    """Promotions by path ("same_node", "cross_node"): started = succeeded + failed + in
    flight; bytes promoted by path; cross-node ones by transport; and each holder node's
    measured rates, holder node -> transport -> bytes/s."""

    started: Mapping[str, int]
    succeeded: Mapping[str, int]
    failed: Mapping[str, int]
    bytes: Mapping[str, int]
    in_flight: int
    transports: Mapping[str, TransportCounts]
    transport_rates: Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class BlockCounts:
    """Blocks the engine stored, blocks evicted, and blocks handed to loads by where they
    came from ("local", "same_node", "cross_node")."""

    stored: int
    evicted: int
    loaded: Mapping[str, int]


@dataclass(frozen=True)
class PoolUsage:
    rows: int
    free_rows: int
    used_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class RoutingCounts:
    """Requests a router sent with the Directory's answer, by what routing them here was
    ("holder", "puller", "cold", "load_only": distkv.routing.answer); and blocks the pull
    gate let pull and blocks it skipped (recomputed instead), by path."""

    routed: Mapping[str, int]
    pull_allowed: Mapping[str, int]
    pull_skipped: Mapping[str, int]


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's counts at `time` (wall clock). `errors`: counts by kind;
    `recent_errors`: (time, kind, message) of the last few, oldest first. `mode`: how its
    engine uses distkv: "spec" (distkv's offloading spec) or "tier" (a secondary tier of
    vLLM's tiered offloading); a report without it is of a spec replica."""

    namespace: str
    replica: str
    node: str
    time: float
    lookups: LookupCounts
    promotions: PromotionCounts
    blocks: BlockCounts
    pool: PoolUsage
    routing: RoutingCounts
    errors: Mapping[str, int]
    recent_errors: tuple[tuple[float, str, str], ...]
    mode: str = "spec"
    version: int = STATS_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and numbers (JSON-able); `from_dict` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ReplicaStats":
        """The stats `to_dict` gave; ValueError for another version."""
        if d.get("version") != STATS_VERSION:
            raise ValueError(f"replica stats of version {d.get('version')!r}; this distkv reads version {STATS_VERSION}")
        promotions = d["promotions"]
        return cls(
            namespace=d["namespace"],
            replica=d["replica"],
            node=d["node"],
            time=d["time"],
            lookups=LookupCounts(**d["lookups"]),
            promotions=PromotionCounts(
                **{**promotions, "transports": {n: TransportCounts(**t) for n, t in promotions["transports"].items()}}
            ),
            blocks=BlockCounts(**d["blocks"]),
            pool=PoolUsage(**d["pool"]),
            routing=RoutingCounts(**d["routing"]),
            errors=dict(d["errors"]),
            recent_errors=tuple(tuple(e) for e in d["recent_errors"]),
            mode=d.get("mode", "spec"),
        )


class Observations(NamedTuple):
    """Histogram observations gathered since the last drain, oldest first."""

    promotion_latencies: list[tuple[str, float]]  # (path, seconds from submission to success)
    event_lags: list[tuple[int, float]]  # (Directory shard, seconds from a change to its publish)
    query_times: list[tuple[int, float]]  # (Directory shard, seconds from a query call to its answer)
