"""The demo's report: each arm's figures, and every loaded block checked against what the
replicas that computed it recorded."""

import numpy as np
import pytest

from distkv.demo.report import ArmTally, Verifier, ratios, summarize
from distkv.demo.table import format_table
from distkv.demo.workload import Request

BLOCK_TOKENS = 16
BLOCK_BYTES = 8192


def result(replica, tokens, by_source, loaded, computed, ttft=0.01, stats=None):
    return {
        "replica": replica,
        "tokens": tokens,
        "blocks_by_source": by_source,
        "load_failures": 0,
        "retries": 0,
        "load_s": 0.001,
        "wait_s": 0.002,
        "compute_s": 0.004,
        "promoted_bytes": 0,
        "ttft_s": ttft,
        "first_token": 7,
        "loaded": loaded,
        "computed": computed,
        "stats": stats or {},
    }


def none(**kw):
    return {"local": 0, "same_node": 0, "cross_node": 0, **kw}


def stats(cross_node_bytes=0, skipped=0, holder=0):
    return {
        "same_node_bytes": 0, "same_node_s": 0.0, "cross_node_bytes": cross_node_bytes, "cross_node_s": 0.01,
        "nixl_bytes": cross_node_bytes, "nixl_s": 0.002, "object_store_bytes": 0, "object_store_s": 0.0,
        "pull_allowed": {"same_node": 0, "cross_node": 1}, "pull_skipped": {"same_node": 0, "cross_node": skipped},
        "routed": {"holder": holder, "puller": 0, "cold": 0, "load_only": 0}, "gate": {"step_s": 0.002},
    }


def test_loaded_blocks_must_match_a_digest_recorded_for_their_key():
    verifier = Verifier()
    verifier.add("distkv", 0, result("a", 40, none(), [], [(b"k1", 11), (b"k2", 12)]))
    verifier.add("distkv", 1, result("b", 40, none(cross_node=2), [(b"k1", 11), (b"k2", 99)], []))
    verifier.add("affinity", 2, result("a", 20, none(local=1), [(b"k3", 13)], []))  # nobody computed k3
    assert verifier.verify() == (3, 2)
    assert verifier.computed_elsewhere("distkv") == 2 and verifier.computed_elsewhere("affinity") == 1
    assert verifier.same_first_tokens("distkv") is None  # no offloading-off arm to compare with


def test_requests_per_replica_count_the_replicas_the_router_sent_nothing():
    tally = ArmTally(BLOCK_TOKENS, BLOCK_BYTES, replicas=2)
    for i in range(4):
        tally.add(i, result("a", 40, none(), [], []), 0.02, answered_at=i)
    assert tally.summary(0)["requests_per_replica"] == {"max": 4, "mean": 2.0, "max_over_mean": 2.0}


def test_an_arm_without_replicas_is_refused():
    with pytest.raises(ValueError, match="at least one replica"):
        ArmTally(BLOCK_TOKENS, BLOCK_BYTES, replicas=0)


def test_an_arms_figures_add_up_its_warm_up_left_out_and_render():
    verifier, arms = Verifier(), {"off": ArmTally(BLOCK_TOKENS, BLOCK_BYTES, replicas=2)}
    for i in range(2):
        r = result("a", 40, none(), [], [], ttft=0.02)
        arms["off"].add(i, r, 0.03, answered_at=i)  # one at a time: ttft 0.02
        verifier.add("off", i, r)
    tally = arms["distkv-router"] = ArmTally(BLOCK_TOKENS, BLOCK_BYTES, replicas=2)
    tally.warmed(result("b", 40, none(), [], [], stats=stats(cross_node_bytes=BLOCK_BYTES, holder=3)))
    first = result("a", 40, none(), [], [(b"k1", 1), (b"k2", 2)], stats=stats(holder=1))
    second = result("b", 40, none(same_node=1, cross_node=1), [(b"k1", 1), (b"k2", 2)], [], ttft=0.05,
                    stats=stats(cross_node_bytes=2 * BLOCK_BYTES, skipped=2, holder=5))
    for i, (r, client) in enumerate(((first, 0.02), (second, 0.08))):
        tally.add(i, r, client, answered_at=0.1)  # both computed at once
        verifier.add("distkv-router", i, r)
    prompt = np.arange(40)  # 2 full blocks, the second request's the first's
    trace = [Request(prompt, 0, None, 0, None), Request(prompt, 0, None, 0, None)]
    s = summarize(arms, verifier, trace, setup={"workload": {"requests": 2}, "seconds": dict.fromkeys(
        ("start", "off", "distkv-router", "shutdown", "total"), 1.0)})
    arm = s["arms"]["distkv-router"]
    assert arm["tokens"] == {"local": 0, "same_node": 16, "cross_node": 16, "recomputed": 48}
    assert arm["hit_rate"] == arm["oracle_hit_rate"] == 32 / 80
    assert arm["oracle_hit_rate_as_run"] == 0  # the second started before the first was answered
    assert s["arms"]["off"]["oracle_hit_rate_as_run"] == 32 / 80
    assert arm["ttft_s"]["p50"] == pytest.approx(0.05)  # as the client saw it
    # b's stats since its warm-up: one more block across nodes, 2 skipped, 2 routed to it as the holder
    assert arm["transfers"]["cross_node_promotion"]["blocks"] == 1
    assert arm["pull_gate"] == {"pulled_blocks": 1, "skipped_blocks": 2 + 0, "recomputed_blocks": 3}
    assert arm["routed"]["holder"] == 1 + 2
    assert arm["requests_per_replica"] == {"max": 1, "mean": 1.0, "max_over_mean": 1.0}
    assert arm["tail"]["all"]["queue_s"] == pytest.approx((0.01 + 0.03) / 2)
    assert (s["blocks_verified"], s["mismatches"]) == (2, 0)
    assert arm["first_tokens_as_offloading_off"] == 2
    versus_off = ratios(s["arms"], "distkv-router", "off")
    assert versus_off["p50"] == pytest.approx(0.05 / 0.03)
    assert versus_off["cross_node_bytes"] is None  # offloading off moved nothing: no ratio
    table = format_table(s)
    assert "from another node" in table and "mismatches 0" in table and "distkv + its router vs offloading off" in table
    assert "cross-node bytes" not in table.split("distkv + its router vs offloading off")[1].splitlines()[0]
