"""`distkv status` without Ray: merging what the shards say of each replica, and the table."""

import argparse
import socket

from distkv.routing.answer import ROUTED_KINDS
from distkv.observability.stats import BlockCounts, LookupCounts, PoolUsage, PromotionCounts, ReplicaStats, RoutingCounts
from distkv.observability.status import format_status, merge_replicas, recent_errors, run


def report(t: float, local_hit: int = 0, miss: int = 0, errors=(), routed=None) -> dict:
    """A replica's report as its link sends it to the Directory."""
    paths = {"same_node": 0, "cross_node": 0}
    return ReplicaStats(
        namespace="ns",
        replica="r",
        node="n" * 56,
        time=t,
        lookups=LookupCounts(local_hit=local_hit, remote_hit=0, miss=miss, retry=0),
        promotions=PromotionCounts(started=paths, succeeded=paths, failed=paths, bytes=paths, in_flight=0,
                                   transports={}, transport_rates={}),
        blocks=BlockCounts(stored=4, evicted=0, loaded={"local": 0, "same_node": 0, "cross_node": 0}),
        pool=PoolUsage(rows=8, free_rows=4, used_bytes=4 << 20, capacity_bytes=8 << 20),
        routing=RoutingCounts(routed=routed or dict.fromkeys(ROUTED_KINDS, 0), pull_allowed=paths, pull_skipped=paths),
        errors={kind: 1 for _, kind, _ in errors},
        recent_errors=tuple(errors),
    ).to_dict()


def shard_entry(replica: str, keys: int, seen: float, rep: dict | None) -> dict:
    return {"replica_id": replica, "node_id": "n" * 56, "pool_name": f"distkv-ns-{replica}", "num_rows": 8,
            "num_ranks": 1, "slot_bytes": 1 << 20, "keys": keys, "seen_s_ago": seen, "report": rep}


def test_a_replica_is_merged_over_shards_with_its_newest_report():
    merged = merge_replicas([
        ("ns", shard_entry("r1", 3, 0.4, report(10.0, local_hit=1))),
        ("ns", shard_entry("r1", 5, 0.1, report(11.0, local_hit=3, miss=1))),
        ("ns", shard_entry("r2", 0, 0.2, None)),  # registered, no report yet
    ])
    r1, r2 = merged
    assert (r1["replica"], r1["directory_keys"], r1["seen_s_ago"]) == ("r1", 8, 0.1)
    assert r1["lookups"]["local_hit"] == 3 and r1["hit_rate"] == 0.75
    assert r2["lookups"] is None and r2["hit_rate"] is None


def test_hit_rate_leaves_retries_out():
    assert LookupCounts(local_hit=2, remote_hit=1, miss=1, retry=50).hit_rate == 0.75
    assert LookupCounts(local_hit=0, remote_hit=0, miss=0, retry=3).hit_rate is None


def test_the_table_shows_every_section():
    errors = [(100.0, "promotion_timeout", "2 promotion(s) from r9"), (50.0, "store_rejected", "1 x full")]
    replicas = merge_replicas([("ns", shard_entry("r1", 4, 0.3, report(12.0, local_hit=9, miss=1, errors=errors)))])
    status = {
        "nodes": [{"node_id": "n" * 56, "address": "10.0.0.1", "alive": True, "head": True, "node_agent": True,
                   "replicas": 1, "metrics_export_port": 1234}],
        "replicas": replicas,
        "directory": [
            {"namespace": "ns", "shard": 0, "node_id": "n" * 56, "epoch": "e", "keys": 4, "holders": 4, "replicas": 1,
             "log_entries": 2, "operations": {"publishes": 7, "queries": 0}},
            {"namespace": "ns", "shard": 1, "error": "no answer within 10 s"},
        ],
        "recent_errors": recent_errors(replicas),
    }
    assert [e["kind"] for e in status["recent_errors"]] == ["store_rejected", "promotion_timeout"]
    table = format_status(status)
    assert "1 live node(s), 1 replica(s), 1 cache namespace(s), 2 Directory shard(s)" in table
    assert "4.0 MiB / 8.0 MiB (50%)" in table and "90.0%" in table
    assert "no answer within 10 s" in table and "promotion_timeout" in table
    assert "n" * 12 in table and "n" * 13 not in table  # node ids shortened


def test_an_address_nobody_listens_on_fails_at_once(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run(argparse.Namespace(address=f"127.0.0.1:{port}", json=True)) == 1
    assert "cannot connect to the Ray cluster" in capsys.readouterr().err


def test_the_table_shows_each_transport_and_the_rates_measured_per_node_pair():
    rep = report(12.0, local_hit=9)
    rep["promotions"]["transports"] = {
        "nixl": {"blocks": 64, "bytes": 128 << 20, "seconds": 0.05},
        "object_store": {"blocks": 1, "bytes": 2 << 20, "seconds": 0.01},
    }
    rep["promotions"]["transport_rates"] = {"h" * 56: {"nixl": 2.5e9, "object_store": 0.5e9}}
    status = {"nodes": [], "replicas": merge_replicas([("ns", shard_entry("r1", 4, 0.3, rep))]), "directory": [],
              "recent_errors": []}
    lines = format_status(status).splitlines()
    assert any(line.split() == ["r1", "n" * 12, "nixl", "64", "128.0", "MiB", "2.68"] for line in lines)
    assert any(line.split() == ["r1", "h" * 12, "->", "n" * 12, "0.50", "2.50", "nixl"] for line in lines)


def test_a_report_of_another_stats_version_counts_as_none():
    newer = {**report(12.0, local_hit=9), "version": 99, "lookups": {"hits": 9}}
    (entry,) = merge_replicas([("ns", shard_entry("r1", 4, 0.3, newer))])
    assert entry["lookups"] is None and entry["hit_rate"] is None and entry["report_age_s"] is None
    # and the newest report it can read still counts
    (entry,) = merge_replicas([("ns", shard_entry("r1", 4, 0.3, newer)), ("ns", shard_entry("r1", 4, 0.3, report(11.0, 3)))])
    assert entry["lookups"]["local_hit"] == 3


def test_each_replica_shows_its_mode_and_a_report_without_one_is_of_a_spec_replica():
    tier = {**report(12.0, local_hit=9), "mode": "tier"}
    older = report(12.0, local_hit=9)
    del older["mode"]  # a replica of a distkv from before modes
    replicas = merge_replicas([("ns", shard_entry("r1", 4, 0.3, tier)), ("ns", shard_entry("r2", 4, 0.3, older))])
    assert [r["mode"] for r in replicas] == ["tier", "spec"]
    status = {"nodes": [], "replicas": replicas, "directory": [], "recent_errors": []}
    rows = [line.split() for line in format_status(status).splitlines() if line.split()[:1] == ["ns"]]
    assert [row[3] for row in rows] == ["tier", "spec"]
