"""ReplicaStats: what crosses the wire reads back as it was, pickled or as a dict."""

import json
import pickle

import pytest

from distkv.observability.stats import (
    STATS_VERSION,
    BlockCounts,
    LookupCounts,
    PoolUsage,
    PromotionCounts,
    ReplicaStats,
    RoutingCounts,
    TransportCounts,
)

PATHS = {"same_node": 3, "cross_node": 5}
STATS = ReplicaStats(
    namespace="ns",
    replica="r1",
    node="n1",
    time=12.5,
    lookups=LookupCounts(local_hit=4, remote_hit=8, miss=1, retry=2),
    promotions=PromotionCounts(
        started=PATHS, succeeded=PATHS, failed={"same_node": 0, "cross_node": 0}, bytes=PATHS, in_flight=0,
        transports={"object_store": TransportCounts(blocks=5, bytes=5 << 20, seconds=0.25)},
        transport_rates={"h1": {"object_store": 2.0e9}},
    ),
    blocks=BlockCounts(stored=4, evicted=1, loaded={"local": 4, "same_node": 3, "cross_node": 5}),
    pool=PoolUsage(rows=8, free_rows=2, used_bytes=6 << 20, capacity_bytes=8 << 20),
    routing=RoutingCounts(
        routed={"holder": 3, "puller": 1, "cold": 2, "load_only": 0},
        pull_allowed={"same_node": 4, "cross_node": 9},
        pull_skipped={"same_node": 0, "cross_node": 2},
    ),
    errors={"store_rejected": 1},
    recent_errors=((10.0, "store_rejected", "1 x full"),),
)


def test_stats_survive_pickling_and_a_json_round_trip_of_their_dict():
    assert pickle.loads(pickle.dumps(STATS)) == STATS
    assert ReplicaStats.from_dict(json.loads(json.dumps(STATS.to_dict()))) == STATS
    assert STATS.version == STATS_VERSION


def test_stats_of_another_version_are_refused():
    with pytest.raises(ValueError, match="version 1; this distkv reads version 2"):
        ReplicaStats.from_dict({**STATS.to_dict(), "version": 1})
    with pytest.raises(ValueError, match="version None"):
        ReplicaStats.from_dict({k: v for k, v in STATS.to_dict().items() if k != "version"})
