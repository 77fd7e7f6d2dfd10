"""ClusterTier (distkv.replica.tier): distkv as a secondary tier of a primary tier's chunks, without
vLLM or Ray.

Each replica is a ClusterTier over a ClusterOffloadingManager, an in-memory Directory
(cluster_fakes) and a direct pool read standing in for the NodeAgent; its "primary tier" is
a numpy array of chunks. tests/vllm runs the same tier inside vLLM 0.33's tiering manager.
"""

import os
import threading
import time
import uuid

import numpy as np
import pytest
from cluster_fakes import FakeDirectory, FakeLink, QueriedLink, PoolFetch

from distkv.abstract import LookupResult, ReqContext
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.records import ReplicaInfo
from distkv.names import segment_name
from distkv.storage.segments import SHM_DIR
from distkv.storage.pool import HostPool, PoolLayout
from distkv.transfer.promotion import Promoter
from distkv.routing.answer import PARAMS_KEY, encode, from_directory
from distkv.replica.tier import ClusterTier
from distkv.storage.tier_copies import ChunkCopier
from distkv.transfer.transport import ObjectStoreTransport

CHUNK_BYTES = 16 << 10
NUM_CHUNKS = 32
NAMESPACE = "tiertest"
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class TierReplica:
    """A replica of the tier: its ClusterTier and its primary tier's chunks."""

    def __init__(self, directory: FakeDirectory, node_id: str, fetch: PoolFetch, rows: int, timeout_s: float):
        name = f"r{uuid.uuid4().hex[:8]}"
        pool = HostPool(segment_name(NAMESPACE, name), PoolLayout(rows, 1, CHUNK_BYTES))
        link = FakeLink(directory, ReplicaInfo(name, node_id, pool.name, rows, 1, CHUNK_BYTES))
        promoter = Promoter(pool, node_id, link.replica, ObjectStoreTransport(pool, fetch), namespace=NAMESPACE)
        cluster = ClusterOffloadingManager(rows, link, promoter, promotion_timeout_s=timeout_s)
        self.primary = np.zeros((NUM_CHUNKS, CHUNK_BYTES), dtype=np.uint8)
        self.tier = ClusterTier(cluster, pool, self.primary)
        self.pool = pool
        self.link = link
        self._next_job = 0

    def store(self, keys: list[bytes], chunks: list[int]) -> int:
        self._next_job += 1
        self.tier.submit_store(self._next_job, keys, chunks, ReqContext(f"store{self._next_job}"))
        return self._next_job

    def load(self, keys: list[bytes], chunks: list[int]) -> int:
        self._next_job += 1
        self.tier.submit_load(self._next_job, keys, chunks, ReqContext(f"load{self._next_job}"))
        return self._next_job

    def results(self, n: int) -> dict:
        """The next `n` results, by job id, polling as vLLM's manager does each step."""
        got = {}
        deadline = time.monotonic() + 30  # only keeps a broken tier from hanging the suite
        while len(got) < n:
            assert time.monotonic() < deadline, f"{len(got)} of {n} jobs ended"
            got.update((r.job_id, r) for r in self.tier.finished())
            time.sleep(0.001)
        return got


@pytest.fixture
def replicas():
    made: list[TierReplica] = []

    def make(directory, node_id="node-1", fetch=None, rows=16, timeout_s=5.0) -> TierReplica:
        made.append(TierReplica(directory, node_id, fetch or PoolFetch(), rows, timeout_s))
        return made[-1]

    yield make
    for r in made:
        r.tier.close()


def chunk_bytes(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)


def keys_of(seed: int, n: int) -> list[bytes]:
    return [f"{seed:04d}-{i:04d}".encode() for i in range(n)]


def fill(replica: TierReplica, chunks: list[int], seed: int) -> list[np.ndarray]:
    data = [chunk_bytes(seed * 1000 + c) for c in chunks]
    for chunk, d in zip(chunks, data):
        replica.primary[chunk] = d
    return data


def stored(a: TierReplica, keys: list[bytes], chunks: list[int], seed: int) -> list[np.ndarray]:
    """`keys` stored by `a` from its chunks `chunks` filled from `seed`; their bytes."""
    data = fill(a, chunks, seed)
    a.store(keys, chunks)
    (result,) = a.results(1).values()
    assert result.success and result.nbytes == len(keys) * CHUNK_BYTES
    return data


def test_a_store_copies_the_chunks_hashed_seals_and_publishes_them(replicas):
    directory = FakeDirectory()
    a = replicas(directory)
    keys = keys_of(1, 4)
    data = stored(a, keys, [3, 5, 7, 9], seed=1)
    cluster = a.tier.cluster
    for key, d in zip(keys, data):
        row, generation = cluster.local.block(key)
        assert a.pool.verify(0, row, key, generation)  # checksum of the payload, sealed
        assert np.array_equal(a.pool.payload[0, row], d)
        assert a.link.info.replica_id in directory.holders[key]
    # stored again: nothing new to copy
    job = a.store(keys, [0, 1, 2, 4])
    (result,) = a.results(1).values()
    assert (result.job_id, result.success, result.nbytes) == (job, True, 0)
    assert cluster.stats().blocks.stored == 4


def test_lookup_answers_from_the_pool_and_the_view_and_starts_nothing(replicas):
    directory = FakeDirectory()
    fetch = PoolFetch(hold=True)
    a, b = replicas(directory), replicas(directory, "node-2", fetch=fetch)
    (held,) = keys_of(2, 1)
    stored(a, [held], [0], seed=2)
    ctx = ReqContext("look")
    assert a.tier.lookup(held, ctx) is HIT  # in its own pool
    assert b.tier.lookup(held, ctx) is HIT  # held by a: b promotes it only when it loads it
    assert b.tier.lookup(b"nobody-has-it", ctx) is MISS
    assert b.tier.cluster.promotions_in_flight == 0 and fetch.calls == 0
    b.load([held], [0])  # now it is fetched, straight into the job's chunk
    while not fetch.pending:
        time.sleep(0.001)
    assert b.tier.lookup(held, ctx) is HIT  # still a chunk b can provide
    assert b.tier.cluster.local.num_free_rows == 16  # no row of b's pool reserved for it
    assert b.tier.cluster.promotions_in_flight == 1  # as `distkv status` and the metrics count it
    fetch.release()
    (result,) = b.results(1).values()
    assert result.success, b.tier.cluster.stats().recent_errors
    assert b.tier.lookup(held, ctx) is HIT and b.tier.cluster.promotions_in_flight == 0


@pytest.mark.parametrize("node_b", ["node-1", "node-2"], ids=["same-node", "cross-node"])
def test_a_load_fills_the_primary_chunks_bit_exact(replicas, node_b):
    directory = FakeDirectory()
    a, b = replicas(directory), replicas(directory, node_b)
    theirs, mine = keys_of(3, 4), keys_of(4, 2)
    their_data = stored(a, theirs, [0, 1, 2, 3], seed=3)
    my_data = stored(b, mine, [10, 11], seed=4)
    b.primary[:] = 0
    job = b.load(theirs + mine, [20, 21, 22, 23, 24, 25])
    (result,) = b.results(1).values()
    assert (result.job_id, result.success, result.successful_keys) == (job, True, None)
    for chunk, d in zip(range(20, 26), their_data + my_data):
        assert np.array_equal(b.primary[chunk], d)
    loaded = b.tier.cluster.stats().blocks.loaded
    assert loaded["local"] == 2 and loaded["same_node" if node_b == "node-1" else "cross_node"] == 4
    # promoted straight into the chunks: b's pool keeps only its own, and b holds none of a's
    assert b.tier.cluster.local.num_free_rows == 16 - 2
    assert not any(b.link.info.replica_id in directory.holders[k] for k in theirs)


def test_chunks_that_do_not_check_out_fail_their_keys_only(replicas):
    directory = FakeDirectory()
    a, b = replicas(directory), replicas(directory, "node-2", fetch=PoolFetch(corrupt=True))
    theirs, mine = keys_of(5, 2), keys_of(6, 1)
    stored(a, theirs, [0, 1], seed=5)
    stored(b, mine, [2], seed=6)
    b.load(mine + theirs, [7, 8, 9])
    (result,) = b.results(1).values()
    assert not result.success and result.successful_keys == tuple(mine)
    assert b.tier.keys_failed == 2
    ctx = ReqContext("again")
    assert b.tier.lookup(theirs[0], ctx) is MISS  # failed lately: not tried again at once


def test_a_holder_dying_mid_promotion_fails_the_job_into_recompute(replicas):
    directory = FakeDirectory()
    fetch = PoolFetch(hold=True)
    a, b = replicas(directory), replicas(directory, "node-2", fetch=fetch)
    keys = keys_of(7, 3)
    stored(a, keys, [0, 1, 2], seed=7)
    b.primary[:] = 0xAB
    b.load(keys, [4, 5, 6])
    while not fetch.pending:  # the read is in flight at the holder
        time.sleep(0.001)
    future = fetch.pending.pop()[0]
    future.set_exception(ConnectionError("the holder's node died"))
    (result,) = b.results(1).values()
    assert not result.success and result.successful_keys is None
    assert b.tier.cluster.local.num_free_rows == 16  # the reserved rows are free again
    assert not b.tier.has_pending_work()


def test_a_reset_ends_every_job_and_moves_to_a_new_epoch(replicas):
    directory = FakeDirectory()
    fetch = PoolFetch(hold=True)
    a, b = replicas(directory), replicas(directory, "node-2", fetch=fetch, rows=8)
    theirs, mine = keys_of(8, 2), keys_of(9, 4)
    stored(a, theirs, [0, 1], seed=8)
    fill(b, [10, 11, 12, 13], seed=9)
    load = b.load(theirs, [2, 3])
    store = b.store(mine, [10, 11, 12, 13])
    while not fetch.pending:
        time.sleep(0.001)
    reset = threading.Thread(target=b.tier.drain_and_reset)
    reset.start()
    # vLLM resets its primary tier once the drain returns: not while a promotion may write a chunk
    reset.join(0.5)
    assert reset.is_alive()
    fetch.release()
    reset.join()
    results = b.results(2)
    assert results[store].success  # a copy in flight is never cut short
    assert not results[load].success  # what landed is of the epoch the reset leaves: recomputed
    assert not b.tier.has_pending_work()
    cluster = b.tier.cluster
    assert cluster.epoch.epoch == 1 and b.link.info.replica_id.endswith(".epoch1")
    ctx = ReqContext("after")
    assert b.tier.lookup(mine[0], ctx) is MISS  # its own blocks of the old epoch are gone
    assert b.tier.lookup(theirs[0], ctx) is MISS  # and a's, of epoch 0, are not promoted
    assert cluster.local.num_free_rows == 8


def test_a_reset_waits_for_a_promotion_into_a_chunk_until_its_deadline(replicas):
    directory = FakeDirectory()
    fetch = PoolFetch(hold=True)
    a, b = replicas(directory), replicas(directory, "node-2", fetch=fetch, timeout_s=0.5)
    theirs = keys_of(15, 1)
    stored(a, theirs, [0], seed=15)
    load = b.load(theirs, [2])
    while not fetch.pending:  # the holder never answers
        time.sleep(0.001)
    b.tier.drain_and_reset()  # returns once the promotion failed at its deadline, nothing left to land
    (result,) = b.results(1).values()
    assert result.job_id == load and not result.success
    assert not b.tier.has_pending_work() and b.tier.keys_failed == 1


def test_a_full_pool_evicts_by_its_policy_and_a_pinned_one_fails_the_store(replicas):
    directory = FakeDirectory()
    a = replicas(directory, rows=4)
    first, second = keys_of(10, 4), keys_of(11, 1)
    stored(a, first, [0, 1, 2, 3], seed=10)
    stored(a, second, [4], seed=11)
    events = a.tier.take_events()
    # the least recently used: of one store, the last chunk (a prefix's first is its most valuable)
    assert [e.keys for e in events if e.removed] == [[first[-1]]]
    assert not directory.holders[first[-1]]
    cluster = a.tier.cluster
    cluster.prepare_load(first[:-1] + second, ReqContext("pin"))  # every row pinned by loads
    job = a.store(keys_of(12, 1), [5])
    (result,) = a.results(1).values()
    assert result.job_id == job and not result.success


def test_bad_jobs_are_refused_with_the_reason(replicas):
    a = replicas(FakeDirectory())
    with pytest.raises(ValueError, match="2 keys and 1 chunks"):
        a.tier.submit_load(1, keys_of(13, 2), [0], ReqContext("bad"))
    for chunks in ([0, 0], [0, NUM_CHUNKS]):
        with pytest.raises(ValueError, match="distinct chunks of the primary tier's"):
            a.tier.submit_load(1, keys_of(13, 2), chunks, ReqContext("bad"))
    assert not a.tier.has_pending_work()
    with pytest.raises(ValueError, match="1 rank"):
        ChunkCopier(a.pool, np.zeros((4, CHUNK_BYTES * 2), dtype=np.uint8))


def test_closing_leaves_no_segment_and_no_thread(replicas):
    directory = FakeDirectory()
    a = replicas(directory)
    stored(a, keys_of(14, 2), [0, 1], seed=14)
    name = a.pool.name
    a.tier.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert not [t for t in threading.enumerate() if t.name.startswith(("distkv-tier", "distkv-promoter"))]


def test_a_request_its_router_sent_an_answer_with_promotes_what_it_names_and_misses_the_rest(replicas):
    directory = FakeDirectory()
    a = replicas(directory)
    (held,) = keys_of(3, 1)
    data = stored(a, [held], [0], seed=3)
    b = replicas(directory, "node-2")
    b.link = QueriedLink(directory, b.link.info)
    cluster = b.tier.cluster
    cluster.link, cluster._view = b.link, b.link.view  # b queries instead of following
    b.tier._view = b.link.view  # the tier reads the same view
    cold = b"cold-0000"  # of the held key's group, as a prompt's keys are
    holders = [list(directory.holders[held].values()), []]
    answer = from_directory(b.link.namespace, [held, cold], holders)
    ctx = ReqContext("routed", kv_transfer_params={PARAMS_KEY: encode(answer)})
    b.tier.request_started(ctx)
    assert cluster.pulls.routed["puller"] == 1
    assert b.tier.lookup(cold, ctx) is MISS  # the router said nobody holds it: no question, no wait
    assert b.tier.lookup(held, ctx) is RETRY  # promoted from the holder the answer names
    assert not b.link.asked
    while b.tier.lookup(held, ctx) is RETRY:
        b.tier.finished()
        time.sleep(0.001)
    assert b.tier.lookup(held, ctx) is HIT
    b.load([held], [4])
    (result,) = b.results(1).values()
    assert result.success and np.array_equal(b.primary[4], data[0])
