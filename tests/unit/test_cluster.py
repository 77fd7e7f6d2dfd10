"""ClusterOffloadingManager and promotion, without Ray.

An in-memory Directory stands in for the actors and a direct pool read for the
NodeAgent, so that the rules of sharing (promotion, validation, failure into misses,
store policies, events) are tested in one process. tests/ray and tests/multinode run
the same flows through the real actors.
"""

import time
import uuid

import numpy as np
import pytest

from distkv.abstract import ReqContext
from cluster_fakes import FakeDirectory, FakeLink, PoolFetch

from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.replica.dedupe import with_store_policy
from distkv.directory.records import ReplicaInfo
from distkv.replica.harness import Replica, block_keys
from distkv.transfer.promotion import Promoter
from distkv.transfer.transport import ObjectStoreTransport
from distkv.replica.specs import LocalOffloadingSpec

BLOCK_TOKENS = 16
PAGE_BYTES = 16 << 10
BLOCK_BYTES = 2 * PAGE_BYTES


class FakeClusterSpec(LocalOffloadingSpec):
    """The local spec with a ClusterOffloadingManager over the fakes (set after construction)."""

    def get_manager(self):
        info = ReplicaInfo(self.replica_id, self.node_id, self.pool_name, *self._layout_tuple())
        link = FakeLink(self.directory, info)
        promoter = Promoter(
            self.pool, self.node_id, link.replica, ObjectStoreTransport(self.pool, self.fetch), namespace=self.namespace
        )
        cluster = ClusterOffloadingManager(
            self.layout.num_rows, link, promoter,
            policy=self.config.eviction_policy, generations=self.pool.reserve_generations, promotion_timeout_s=self.timeout_s,
        )
        return with_store_policy(cluster, self.store_policy)

    def _layout_tuple(self):
        return self.layout.num_rows, self.layout.num_ranks, self.layout.slot_bytes


def make_replica(directory, node_id, fetch=None, pool_blocks=64, store_policy="always", timeout_s=5.0):
    spec = FakeClusterSpec.from_layout(
        {"cpu_bytes_to_use": pool_blocks * BLOCK_BYTES},
        gpu_block_sizes=[BLOCK_TOKENS],
        group_page_bytes=[BLOCK_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    spec.directory, spec.node_id, spec.fetch = directory, node_id, fetch or PoolFetch()
    spec.store_policy, spec.timeout_s = store_policy, timeout_s
    return Replica(spec, num_gpu_blocks=64, page_bytes=PAGE_BYTES, step_s=0.001)


@pytest.fixture
def replicas():
    made = []

    def make(*args, **kw):
        r = make_replica(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.shutdown()


def prompt(seed, blocks=32):
    return np.random.default_rng(seed).integers(0, 50_000, blocks * BLOCK_TOKENS)


@pytest.mark.parametrize("node_b", ["node-1", "node-2"], ids=["same-node", "cross-node"])
def test_prefix_stored_on_a_is_loaded_bit_exact_by_b(replicas, node_b):
    directory = FakeDirectory()
    fetch = PoolFetch()
    a = replicas(directory, "node-1")
    b = replicas(directory, node_b, fetch=fetch)
    tokens = prompt(1)
    first = a.serve(tokens)
    assert (first.hit_blocks, first.stored_blocks) == (0, 32)

    keys = block_keys(tokens, BLOCK_TOKENS)
    assert b.manager.lookup(keys[0], ReqContext("probe")) is None  # promotion started
    second = b.serve(tokens)
    assert second.hit_blocks == 32
    assert second.retries >= 0 and second.mismatches == 0 and second.load_failures == 0
    assert (fetch.calls > 0) == (node_b == "node-2")
    # B now holds the blocks too, and says so
    assert b.manager.link.mine() == set(keys)


def test_a_promoted_prefix_is_fetched_as_runs_of_the_holders_rows(replicas, monkeypatch):
    # A stores a prefix in one batch, whatever rows its manager hands out; B asks A's
    # node for them in A's row order, at most BATCH_BYTES per fetch, so that each fetch
    # is one slice of A's pool
    monkeypatch.setattr(ObjectStoreTransport, "BATCH_BYTES", 8 * BLOCK_BYTES)
    directory = FakeDirectory()
    fetch = PoolFetch()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2", fetch=fetch)
    tokens = prompt(2)
    a.serve(tokens)
    assert b.serve(tokens).hit_blocks == 32
    assert [len(rows) for rows in fetch.rows_asked] == [8, 8, 8, 8]
    for rows in fetch.rows_asked:
        assert rows == list(range(rows[0], rows[0] + 8))


def test_loaded_blocks_are_counted_by_where_they_came_from(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    near = replicas(directory, "node-1")
    far = replicas(directory, "node-2")
    tokens = prompt(8, blocks=8)
    a.serve(tokens)
    assert near.serve(tokens).hit_blocks == far.serve(tokens).hit_blocks == 8
    assert near.serve(tokens).hit_blocks == 8  # promoted once, then its own
    assert a.manager.blocks_loaded == {"local": 0, "same_node": 0, "cross_node": 0}
    assert near.manager.blocks_loaded == {"local": 8, "same_node": 8, "cross_node": 0}
    assert far.manager.blocks_loaded == {"local": 0, "same_node": 0, "cross_node": 8}
    assert (near.manager.promoter.bytes_same_node, near.manager.promoter.bytes_cross_node) == (8 * BLOCK_BYTES, 0)
    assert (far.manager.promoter.bytes_same_node, far.manager.promoter.bytes_cross_node) == (0, 8 * BLOCK_BYTES)
    assert near.manager.promoter.seconds_same_node > 0 and far.manager.promoter.seconds_cross_node > 0


def test_block_evicted_during_promotion_is_a_miss_never_wrong_bytes(replicas):
    directory = FakeDirectory()
    fetch = PoolFetch(hold=True)
    a = replicas(directory, "node-1", pool_blocks=32)
    b = replicas(directory, "node-2", fetch=fetch)
    tokens = prompt(2)
    a.serve(tokens)
    keys = block_keys(tokens, BLOCK_TOKENS)
    ctx = ReqContext("b")
    assert all(b.manager.lookup(k, ctx) is None for k in keys)
    deadline = time.monotonic() + 5
    while not fetch.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    a.serve(prompt(3))  # fills A's 32 rows with other blocks: every promoted row is reused
    fetch.release()
    assert wait_lookup(b, keys[0]) is False
    result = b.serve(tokens)
    assert result.hit_blocks == 0 and result.mismatches == 0
    assert b.serve(tokens).hit_blocks == 32  # B computed and stored them itself


def test_corruption_in_transit_is_a_miss(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2", fetch=PoolFetch(corrupt=True))
    tokens = prompt(4)
    a.serve(tokens)
    result = b.serve(tokens)
    assert result.hit_blocks == 0 and result.mismatches == 0 and result.retries >= 1
    promoter = b.manager.promoter
    assert promoter.succeeded["cross_node"] == 0 and promoter.failed["cross_node"] >= 1


def test_a_promotion_outliving_a_reset_keeps_its_row_until_it_ends(replicas):
    # a promotion writes into its reserved row: the reset must not free that row under it,
    # however long the promotion still takes (the reset itself does not wait)
    directory = FakeDirectory()
    fetch = PoolFetch(hold=True)
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2", fetch=fetch, pool_blocks=4)
    tokens = prompt(6, blocks=4)
    a.serve(tokens)
    key = block_keys(tokens, BLOCK_TOKENS)[0]
    assert b.manager.lookup(key, ReqContext("probe")) is None
    wait_until(lambda: fetch.pending)
    (promoted_row,) = [block.row for block in b.manager.local.blocks.values()]
    b.manager.reset_cache()
    assert b.manager.promotions_in_flight == 0
    local = b.manager.local
    assert local.num_free_rows == local.num_rows - 1
    ctx = ReqContext("after")
    others = [bytes([i]) * 8 for i in range(1, 5)]
    assert b.manager.prepare_store(others, ctx) is None  # three rows are free, not four
    out = b.manager.prepare_store(others[:3], ctx)
    assert promoted_row not in out.store_spec.block_ids.tolist()
    fetch.release()
    wait_until(b.manager.promoter.has_finished)
    b.manager.take_events()
    assert local.num_free_rows == 1  # the promotion's row, back once it ended
    assert local.lookup(key, ctx) is False  # and nothing of it was made loadable
    b.manager.complete_store(others[:3], ctx)
    assert local.num_free_rows == local.num_rows - 3


def test_promotion_that_never_answers_times_out_into_a_miss(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2", fetch=PoolFetch(hold=True), timeout_s=0.2)
    tokens = prompt(5, blocks=4)
    a.serve(tokens)
    key = block_keys(tokens, BLOCK_TOKENS)[0]
    start = time.monotonic()
    assert wait_lookup(b, key) is False
    assert time.monotonic() - start < 2
    # it stays a miss for a while rather than retrying the holder at every lookup
    assert b.manager.lookup(key, ReqContext("again")) is False


def test_dedupe_store_policy_skips_blocks_held_elsewhere(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2", store_policy="dedupe")
    shared, own = prompt(6, blocks=8), prompt(7, blocks=8)
    a.serve(shared)
    b.manager.promoter.close()  # no promotions: B computes, and must not store A's blocks
    out = b.manager.prepare_store(block_keys(shared, BLOCK_TOKENS), ReqContext("b"))
    assert out is not None and out.keys_to_store == []
    out = b.manager.prepare_store(block_keys(own, BLOCK_TOKENS), ReqContext("b"))
    assert len(out.keys_to_store) == 8


def test_directory_follows_stores_and_evictions(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1", pool_blocks=16)
    for seed in range(4):
        a.serve(prompt(10 + seed, blocks=8))
    assert a.manager.link.mine() == set(a.manager.local.ready_keys())
    assert len(a.manager.link.mine()) == 16


def test_directory_learns_the_row_and_generation_of_each_stored_block(replicas):
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    a.serve(prompt(20, blocks=8))
    local = a.manager.local
    published = {key: (h.row, h.generation) for key, hs in directory.holders.items() for h in hs.values()}
    assert published == {key: local.block(key) for key in local.ready_keys()}
    assert len(published) == 8


@pytest.mark.parametrize(
    "key, problem",
    [("abcdefgh", "str, not bytes"), ([1, 2], "list, not bytes"), (b"abcd", "4 bytes long"), (b"x" * 200, "200 bytes long")],
    ids=["str", "unhashable", "short", "long"],
)
def test_lookup_of_a_bad_key_names_it_and_counts_nothing(replicas, key, problem):
    a = replicas(FakeDirectory(), "node-1")
    before = a.manager.stats().lookups
    with pytest.raises(ValueError, match=problem):
        a.manager.lookup(key, ReqContext("bad"))
    assert a.manager.stats().lookups == before


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: with_store_policy(None, store_policy="sometimes"), "store_policy"),
        (lambda: ClusterOffloadingManager(1, link=None, promoter=None, promotion_timeout_s=0), "promotion_timeout_s"),
    ],
    ids=["store_policy", "promotion_timeout_s"],
)
def test_bad_options(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def wait_lookup(replica, key, timeout=5.0):
    ctx = ReqContext("wait")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = replica.manager.lookup(key, ctx)
        if hit is not None:
            return hit
        time.sleep(0.005)
    raise AssertionError("lookup kept answering retry")


def wait_until(condition, timeout=10.0):
    """Wait for another thread's step; the bound only keeps a broken test from hanging."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)
