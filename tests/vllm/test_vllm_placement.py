"""The vLLM adapter's placement root, from vLLM 0.33's own ReqContext as its scheduler fills it.

The positions are recorded by vLLM's code itself (`RequestOffloadState.update_offload_keys`
for every chunk key, `OffloadingConnectorScheduler._make_boundary_key` for a partial tail),
over a stand-in request that carries only block hashes.
"""

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
    RequestOffloadState,
)
from vllm.v1.kv_offload.base import ReqContext, RequestOffloadingContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingGroupConfig  # noqa: E402

from distkv.replica.cluster_manager import ClusterOffloadingManager  # noqa: E402
from distkv.directory.link import DirectoryLink  # noqa: E402
from distkv.directory.records import ReplicaInfo  # noqa: E402
from distkv.directory.placement import shard_of  # noqa: E402
from distkv.vllm import (  # noqa: E402
    DistkvOffloadingManager,
    first_chunk,
    offload_key_positions,
    request_root,
    vllm_request_root,
)
from distkv.replica.placement import BlockPlacement  # noqa: E402

TOKENS_PER_HASH = 4


def block_hashes(tokens: np.ndarray) -> list[bytes]:
    """Chained hashes of every TOKENS_PER_HASH tokens, as vLLM's request keeps them."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - TOKENS_PER_HASH + 1, TOKENS_PER_HASH):
        parent = hashlib.sha256(parent + tokens[start : start + TOKENS_PER_HASH].tobytes()).digest()
        hashes.append(parent)
    return hashes


def scheduled(tokens: np.ndarray, chunk_tokens: dict[int, int], req_id: str) -> tuple[ReqContext, SimpleNamespace]:
    """A vLLM ReqContext whose chunk keys vLLM's scheduler recorded, group by group
    (`chunk_tokens`: group index -> tokens per chunk); the stand-in request."""
    req = SimpleNamespace(request_id=req_id, block_hashes=block_hashes(tokens), kv_transfer_params=None)
    config = SimpleNamespace(
        kv_group_configs=tuple(
            SimpleNamespace(group_idx=g, tokens_per_chunk=t, hashes_per_chunk=t // TOKENS_PER_HASH)
            for g, t in chunk_tokens.items()
        )
    )
    ctx = ReqContext(req_id=req_id)
    RequestOffloadState(config, req, ctx, RequestOffloadingContext()).update_offload_keys()
    return ctx, req


def partial_tail(ctx: ReqContext, req: SimpleNamespace, group: int, boundary: int) -> bytes:
    """The key vLLM's scheduler makes (and records) for a partial tail at `boundary`."""
    scheduler = SimpleNamespace(config=SimpleNamespace(tokens_per_hash=TOKENS_PER_HASH))
    return OffloadingConnectorScheduler._make_boundary_key(scheduler, req, group, boundary, ctx)


def test_the_first_chunk_is_that_of_the_group_of_the_smallest_chunks_then_the_smallest_index():
    groups = tuple(
        OffloadingGroupConfig(tokens_per_block=tokens, layer_names=(f"l{i}",), group_id=group)
        for i, (tokens, group) in enumerate([(32, 0), (16, 3), (16, 1)])
    )
    config = SimpleNamespace(groups=groups, cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2))
    assert first_chunk(config) == (32, 1)


def test_requests_sharing_a_prefix_share_the_root_whatever_partial_tails_they_recorded():
    tokens = np.random.default_rng(0).integers(0, 50_000, 96)
    chunks = {0: 16, 1: 16}  # uniform groups, one block per chunk: where vLLM makes partial tails
    ctx_a, req_a = scheduled(tokens, chunks, "a")
    ctx_b, req_b = scheduled(np.concatenate([tokens[:40], tokens[:56]]), chunks, "b")
    # b's lookup missed its first chunk and tried partial tails below it
    tail = partial_tail(ctx_b, req_b, 0, 8)
    assert ctx_b.get_offload_key_position(tail) == 8

    root = make_offload_key(req_a.block_hashes[16 // TOKENS_PER_HASH - 1], 0)
    assert request_root(ctx_a, (16, 0)) == request_root(ctx_b, (16, 0)) == (root, 16)
    # by the smallest position recorded, b's root would be its partial tail
    assert request_root(ctx_b, None) == (tail, 8)


def test_a_hybrid_models_root_is_the_first_chunk_of_its_finer_group():
    tokens = np.random.default_rng(1).integers(0, 50_000, 128)
    ctx, req = scheduled(tokens, {0: 32, 1: 16}, "r")  # group 0 records its keys first
    first_recorded = next(iter(offload_key_positions(ctx)))
    assert first_recorded == make_offload_key(req.block_hashes[32 // TOKENS_PER_HASH - 1], 0)
    finer = make_offload_key(req.block_hashes[16 // TOKENS_PER_HASH - 1], 1)
    assert request_root(ctx, (16, 1)) == request_root(ctx, None) == (finer, 16)


def test_without_positions_there_is_no_root():
    assert request_root(ReqContext(req_id="r"), (16, 0)) is None
    assert offload_key_positions(SimpleNamespace(req_id="another engine's context")) == {}


def test_the_adapter_places_a_vllm_requests_blocks_on_its_roots_shard():
    class Promoter:
        def has_finished(self):
            return False

    info = ReplicaInfo("a", "node-1", "distkv-ns-a", 64, 1, 4096)
    link = DirectoryLink("ns", info, [object()] * 4)  # never started: no shard is called
    cluster = ClusterOffloadingManager(64, link, Promoter(), placement=BlockPlacement(4, vllm_request_root((16, 1))))
    manager = DistkvOffloadingManager(cluster, pool=None, enable_events=False)
    tokens = np.random.default_rng(2).integers(0, 50_000, 128)
    ctx, req = scheduled(tokens, {0: 32, 1: 16}, "r")
    keys = list(offload_key_positions(ctx))
    assert len({shard_of(k, 4) for k in keys}) > 1
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    root = make_offload_key(req.block_hashes[16 // TOKENS_PER_HASH - 1], 1)
    assert {cluster.local.blocks[k].shard for k in keys} == {shard_of(root, 4)}
