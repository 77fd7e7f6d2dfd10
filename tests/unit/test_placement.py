"""Placement: every block of a request's prefix on one Directory shard, the same for every replica.

Cluster managers over real DirectoryLinks whose shards the test answers (no Ray, no
pool: no promotion runs, the test says when one finished). Requests record their keys'
end tokens as vLLM's scheduler does: every chunk key of every group, group by group.
"""

import itertools

import numpy as np
import pytest
from directory_fakes import FakeShard

from distkv.abstract import ReqContext
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.link import DirectoryLink
from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo
from distkv.directory.follower import ShardView
from distkv.directory.placement import shard_of
from distkv.directory.wire import decode_changes
from distkv.directory.placement import prefix_root
from distkv.observability.errors import ErrorLog
from distkv.replica.harness import block_keys

NUM_SHARDS = 4
# a hybrid model: group 0 in chunks of 32 tokens, group 1 in chunks of 16
GROUP_CHUNK_TOKENS = {0: 32, 1: 16}


class StubPromoter:
    """Takes promotions and runs none; `finish` reports one as succeeded."""

    def __init__(self) -> None:
        self.submitted = []
        self._finished = []
        self.errors = ErrorLog()

    def submit(self, promotion) -> None:
        self.submitted.append(promotion)

    def has_finished(self) -> bool:
        return bool(self._finished)

    def finished(self):
        done, self._finished = self._finished, []
        return done

    def unmeasured(self):
        return []

    def finish(self, key) -> None:
        self._finished.append((key, True, True))

    def close(self) -> None:
        pass


class Cluster:
    """Replicas (a cluster manager and its link each) over shared fake shards, stepped by hand."""

    def __init__(self, num_shards: int = NUM_SHARDS) -> None:
        self.shards = [FakeShard() for _ in range(num_shards)]
        self.links: list[DirectoryLink] = []
        self.now = 1000.0

    def replica(self, replica_id: str, num_rows: int = 256) -> ClusterOffloadingManager:
        info = ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", num_rows, 1, 4096)
        link = DirectoryLink("ns", info, self.shards)
        self.links.append(link)
        manager = ClusterOffloadingManager(num_rows, link, StubPromoter())
        self.settle()
        return manager

    def settle(self) -> None:
        """Every link's thread passes and every shard answers, until all is published and followed."""
        for _ in range(3):
            self.now += 10.0
            for link in self.links:
                link.step(self.now)
            for shard in self.shards:
                shard.answer()

    def held(self, replica_id: str) -> dict[int, set[bytes]]:
        """The keys each shard holds of `replica_id`, by shard (shards holding none left out)."""
        held = {i: set(shard.held_by(replica_id)) for i, shard in enumerate(self.shards)}
        return {i: keys for i, keys in held.items() if keys}


def request(tokens: np.ndarray, req_id: str) -> tuple[ReqContext, list[bytes]]:
    """A request of `tokens` with its keys' end tokens recorded as vLLM's scheduler does; its keys."""
    ctx = ReqContext(req_id)
    keys = []
    for group, chunk in GROUP_CHUNK_TOKENS.items():
        for i, key in enumerate(block_keys(tokens, chunk, group)):
            ctx.set_offload_key_position(key, (i + 1) * chunk)
            keys.append(key)
    return ctx, keys


def store(manager: ClusterOffloadingManager, keys: list[bytes], ctx: ReqContext) -> None:
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)


def prompt_whose_groups_start_on_other_shards() -> np.ndarray:
    """Tokens whose first chunk keys of the two groups fall on different shards, so that a
    root taken from the wrong group shows."""
    for seed in itertools.count():
        tokens = np.random.default_rng(seed).integers(0, 50_000, 256)
        first = [block_keys(tokens, chunk, group)[0] for group, chunk in GROUP_CHUNK_TOKENS.items()]
        if shard_of(first[0], NUM_SHARDS) != shard_of(first[1], NUM_SHARDS):
            return tokens


def test_replicas_keep_every_block_of_requests_sharing_a_prefix_on_the_shard_of_its_first_chunk():
    cluster = Cluster()
    a, b = cluster.replica("a"), cluster.replica("b")
    prefix = prompt_whose_groups_start_on_other_shards()
    rng = np.random.default_rng(7)
    ctx_a, keys_a = request(np.concatenate([prefix, rng.integers(0, 50_000, 64)]), "ra")
    ctx_b, keys_b = request(np.concatenate([prefix, rng.integers(0, 50_000, 96)]), "rb")
    # the first 24 tokens only: one chunk of group 1, none of group 0
    ctx_c, keys_c = request(prefix[:24], "rc")
    assert keys_c == block_keys(prefix, 16, 1)[:1]
    root_shard = shard_of(keys_c[0], NUM_SHARDS)  # group 1 has the smaller chunks

    store(a, keys_a, ctx_a)
    # b's GPU cache held b's first chunks: its stores (and scans) start further on
    later = [k for k in keys_b if ctx_b.get_offload_key_position(k) > 64]
    store(b, later, ctx_b)
    store(b, keys_c, ctx_c)
    cluster.settle()

    assert cluster.held("a") == {root_shard: set(keys_a)}
    assert cluster.held("b") == {root_shard: set(later) | set(keys_c)}
    assert set(keys_a) & set(later)  # the shared prefix's blocks, on one shard by both


def test_a_request_publishes_to_one_shard_only():
    cluster = Cluster()
    a = cluster.replica("a")
    tokens = prompt_whose_groups_start_on_other_shards()
    ctx, keys = request(tokens, "r")
    assert len({shard_of(k, NUM_SHARDS) for k in keys}) == NUM_SHARDS  # by their own keys: every shard
    store(a, keys, ctx)
    cluster.now += 10.0
    cluster.links[0].step(cluster.now)
    publishing = [
        i
        for i, shard in enumerate(cluster.shards)
        for method, args, _ in shard.calls
        if method == "publish" and decode_changes(args[2], method)[0]
    ]
    assert publishing == [shard_of(block_keys(tokens, 16, 1)[0], NUM_SHARDS)]


def test_an_evicted_block_is_removed_from_the_shard_it_was_stored_on():
    cluster = Cluster()
    ctx, keys = request(prompt_whose_groups_start_on_other_shards(), "r")
    a = cluster.replica("a", num_rows=len(keys))  # full once the request is stored
    store(a, keys, ctx)
    cluster.settle()
    ((root_shard, held),) = cluster.held("a").items()
    assert held == set(keys)

    other_ctx, other_keys = request(np.random.default_rng(99).integers(0, 50_000, 32), "other")
    out = a.prepare_store(other_keys, other_ctx)
    assert out is not None and len(out.evicted_keys) == len(other_keys)
    a.complete_store(other_keys, other_ctx)
    cluster.settle()
    held = cluster.held("a")
    assert held.get(root_shard, set()) & set(out.evicted_keys) == set()
    assert set(keys) - set(out.evicted_keys) <= held[root_shard]
    assert set().union(*held.values()) == (set(keys) - set(out.evicted_keys)) | set(other_keys)


def test_a_reset_removes_every_block_from_the_shard_it_was_stored_on():
    cluster = Cluster()
    a = cluster.replica("a")
    ctx, keys = request(prompt_whose_groups_start_on_other_shards(), "r")
    store(a, keys, ctx)
    cluster.settle()
    assert cluster.held("a")
    a.reset_cache()
    cluster.settle()
    assert cluster.held("a") == {}
    assert [shard.state.stats()["keys"] for shard in cluster.shards] == [0] * NUM_SHARDS


def test_a_promoted_block_goes_to_the_shard_of_the_request_that_looked_it_up():
    cluster = Cluster()
    a, b = cluster.replica("a"), cluster.replica("b")
    tokens = prompt_whose_groups_start_on_other_shards()
    ctx_a, keys_a = request(tokens, "ra")
    store(a, keys_a, ctx_a)
    cluster.settle()
    ((root_shard, _),) = cluster.held("a").items()

    ctx_b, keys_b = request(tokens[:128], "rb")
    key = next(k for k in reversed(keys_b) if shard_of(k, NUM_SHARDS) != root_shard)
    assert b.lookup(key, ctx_b) is None  # promotion started
    assert b.local.blocks[key].shard == root_shard
    b.promoter.finish(key)
    b.take_events()
    cluster.settle()
    assert cluster.held("b") == {root_shard: {key}}


def test_without_positions_a_block_is_placed_by_its_own_key():
    cluster = Cluster()
    a = cluster.replica("a")
    keys = block_keys(prompt_whose_groups_start_on_other_shards(), 16, 1)
    store(a, keys, ReqContext("no-positions"))
    cluster.settle()
    assert {k: a.local.blocks[k].shard for k in keys} == {k: shard_of(k, NUM_SHARDS) for k in keys}
    assert cluster.held("a") == {
        s: {k for k in keys if shard_of(k, NUM_SHARDS) == s} for s in {shard_of(k, NUM_SHARDS) for k in keys}
    }


def test_a_block_before_the_root_and_one_without_a_position_go_by_their_own_keys():
    cluster = Cluster()
    a = cluster.replica("a")
    ctx, keys = request(prompt_whose_groups_start_on_other_shards(), "r")
    root, end = prefix_root(ctx.offload_key_positions())
    assert a.placement.shard(keys[-1], ctx) == shard_of(root, NUM_SHARDS)
    # the request's root is kept from its first placement on: a key recorded later below it
    # (a partial block of the first chunk) is placed by itself, not made the root
    early, unrecorded = bytes(32) + bytes(4), b"\1" * 32 + bytes(4)
    ctx.set_offload_key_position(early, end - 8)
    assert a.placement.shard(early, ctx) == shard_of(early, NUM_SHARDS) != shard_of(root, NUM_SHARDS)
    assert a.placement.shard(unrecorded, ctx) == shard_of(unrecorded, NUM_SHARDS)
    assert a.placement.shard(keys[-1], ctx) == shard_of(root, NUM_SHARDS)


def test_the_root_is_the_smallest_end_and_then_the_smallest_group():
    x, y, z = (name * 8 + group.to_bytes(4, "big") for name, group in ((b"x", 1), (b"y", 2), (b"z", 1)))
    positions = {x: 32, y: 16, z: 16}
    assert prefix_root(positions) == (z, 16)
    assert prefix_root({}) is None
    # with the first chunk named, keys below it or of another group are never the root
    assert prefix_root(positions, (32, 1)) == (x, 32)
    assert prefix_root(positions, (32, 2)) is None


def test_a_snapshot_of_one_shard_forgets_only_that_shards_keys():
    cluster = Cluster(num_shards=2)
    cluster.replica("a")
    (link,) = cluster.links
    other = ReplicaInfo("b", "node-2", "distkv-ns-b", 16, 1, 4096)
    # b placed each key by its prefix: on the other shard than the key's own
    on_0, on_1 = (
        next(k for k in (i.to_bytes(8, "big") * 4 + bytes(4) for i in itertools.count()) if shard_of(k, 2) == own)
        for own in (1, 0)
    )
    for shard, k in zip(cluster.shards, (on_0, on_1)):
        shard.state.register(other)
        shard.state.publish("b", 1, [(k, 0, 1)], [])
    cluster.settle()
    assert link.holders(on_0) and link.holders(on_1)

    restarted = DirectoryState()  # shard 0 restarts, without b's block
    restarted.register(other)
    cluster.shards[0].state = restarted
    cluster.settle()
    assert link.holders(on_0) == ()
    assert [h.replica_id for h in link.holders(on_1)] == ["b"]


def test_a_shared_view_forgets_at_a_snapshot_only_the_keys_it_added():
    holders = {}
    views = [ShardView("a", holders, shared=True) for _ in range(2)]
    state = DirectoryState()
    state.register(ReplicaInfo("b", "n", "p", 16, 1, 64))
    key = bytes(32) + bytes(4)
    state.publish("b", 1, [(key, 0, 1)], [])
    views[1].apply(state.changes(None))
    views[0].apply(DirectoryState().changes(None))  # a snapshot of the other shard, empty
    assert key in holders
    views[1].apply(DirectoryState().changes(None))
    assert holders == {}


class QueriedShard(FakeShard):
    """A shard that answers queries at once (the link's `query` blocks on them)."""

    def query(self, keys, namespace):
        future = super().query(keys, namespace)
        self.answer(("query",))
        return future


@pytest.mark.parametrize("num_shards", [1, 3])
def test_query_finds_a_block_on_whichever_shard_holds_it(num_shards):
    cluster = Cluster(num_shards)
    cluster.shards[:] = [QueriedShard() for _ in range(num_shards)]
    a = cluster.replica("a")
    ctx, keys = request(prompt_whose_groups_start_on_other_shards(), "r")
    store(a, keys, ctx)
    cluster.settle()
    assert len(cluster.held("a")) == 1
    answers = cluster.links[0].query(keys + [bytes(36)])
    assert [[h.replica_id for h in holders] for holders in answers] == [["a"]] * len(keys) + [[]]
