"""The demo's tally: loaded blocks checked against what computing replicas recorded."""

from distkv.demo.report import Tally, format_table

BLOCK_TOKENS = 16
BLOCK_BYTES = 8192


def result(replica, tokens, by_source, loaded, computed, ttft=0.01):
    return {
        "replica": replica,
        "tokens": tokens,
        "blocks_by_source": by_source,
        "load_failures": 0,
        "retries": 0,
        "load_s": 0.001,
        "promoted_bytes": 0,
        "ttft_s": ttft,
        "first_token": 7,
        "loaded": loaded,
        "computed": computed,
    }


def none(**kw):
    return {"local": 0, "same_node": 0, "cross_node": 0, **kw}


def test_loaded_blocks_must_match_a_digest_recorded_for_their_key():
    tally = Tally(BLOCK_TOKENS, BLOCK_BYTES)
    tally.add(0, result("a", 40, none(), [], [(b"k1", 11), (b"k2", 12)]))
    tally.add(1, result("b", 40, none(cross_node=2), [(b"k1", 11), (b"k2", 99)], []))
    tally.add(2, result("a", 20, none(local=1), [(b"k3", 13)], []))  # nobody computed k3
    assert tally.verify() == (3, 2)
    assert tally.hit_tokens_computed_elsewhere() == 2 * BLOCK_TOKENS + BLOCK_TOKENS


def test_summary_adds_up_and_renders():
    tally = Tally(BLOCK_TOKENS, BLOCK_BYTES)
    tally.add(0, result("a", 40, none(), [], [(b"k1", 1), (b"k2", 2)]))
    tally.add(1, result("b", 40, none(same_node=1, cross_node=1), [(b"k1", 1), (b"k2", 2)], [], ttft=0.05))
    tally.add_own_pool_only(0, result("a", 40, none(), [], [(b"k1", 1), (b"k2", 2)], ttft=0.03))
    tally.add_own_pool_only(1, result("b", 40, none(), [], [(b"k1", 1), (b"k2", 2)], ttft=0.03))
    for i in range(2):
        tally.add_without_offloading(i, {"ttft_s": 0.02, "first_token": 7})
    promotions = {
        "same_node_bytes": BLOCK_BYTES, "same_node_s": 0.001, "cross_node_bytes": BLOCK_BYTES, "cross_node_s": 0.01,
        "nixl_bytes": BLOCK_BYTES, "nixl_s": 0.002, "object_store_bytes": 0, "object_store_s": 0.0,
    }
    seconds = dict.fromkeys(("start", "distkv", "own_pool_only", "offloading_off", "shutdown", "total"), 1.0)
    s = tally.summary(oracle_hit_tokens=32, promotions=promotions, setup={"seconds": seconds})
    assert s["tokens"] == {"local": 0, "same_node": 16, "cross_node": 16, "recomputed": 48}
    assert s["hit_rate"] == s["oracle_hit_rate"] == 32 / 80
    assert s["transfers"]["local_load"]["blocks"] == 2 and s["transfers"]["cross_node_promotion"]["blocks"] == 1
    assert (s["blocks_verified"], s["mismatches"], s["first_tokens_as_offloading_off"]) == (2, 0, 2)
    assert s["own_pool_only_hit_rate"] == 0 and s["ttft_s"]["own_pool_only"]["p50"] == 0.03
    assert s["transfers_by_transport"]["nixl"] == {"blocks": 1, "bytes": BLOCK_BYTES, "seconds": 0.002,
                                                  "gb_per_s": BLOCK_BYTES / 0.002 / 1e9}
    assert s["tail"]["all"]["requests"] == 2 and s["tail"]["p99_and_slower"]["requests"] == 1
    table = format_table(s)
    assert "from another node" in table and "mismatches 0" in table
    assert "own pool only" in table and "by nixl" in table and "slowest" in table
