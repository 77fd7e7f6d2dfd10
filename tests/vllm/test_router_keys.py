"""The router's keys for vLLM are the keys vLLM 0.33's scheduler computes for the same tokens.

A real vLLM Request (its own block hasher, with and without `cache_salt`) and vLLM's own
`RequestOffloadState.update_offload_keys`, which records the offload key of every chunk the
OffloadingConnector's scheduler looks up and stores, against `distkv.routing.keys.VllmKeys`
computing them outside the engine, from the token ids alone.
"""

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import RequestOffloadState  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, RequestOffloadingContext  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from distkv.routing.keys import VllmKeys, from_scheme  # noqa: E402
from distkv.vllm import offload_key_positions  # noqa: E402

TOKENS_PER_HASH = 16


def scheduler_keys(tokens: list[int], hash_algo: str, hashes_per_chunk: int, group: int, salt: str | None) -> list[bytes]:
    """The offload keys vLLM's OffloadingConnector scheduler records for a request of `tokens`."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    request = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(TOKENS_PER_HASH, hash_fn),
    )
    config = SimpleNamespace(kv_group_configs=(SimpleNamespace(
        group_idx=group, tokens_per_chunk=TOKENS_PER_HASH * hashes_per_chunk, hashes_per_chunk=hashes_per_chunk,
    ),))
    ctx = ReqContext(req_id="r")
    RequestOffloadState(config, request, ctx, RequestOffloadingContext()).update_offload_keys()
    return list(offload_key_positions(ctx))


@pytest.mark.parametrize("hash_algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("hashes_per_chunk, group", [(1, 0), (4, 1)])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_the_routers_keys_are_the_schedulers(hash_algo, hashes_per_chunk, group, salt):
    tokens = np.random.default_rng(7).integers(0, 50_000, 1000).tolist()
    expected = scheduler_keys(tokens, hash_algo, hashes_per_chunk, group, salt)
    assert len(expected) == 1000 // (TOKENS_PER_HASH * hashes_per_chunk)
    computer = VllmKeys(hash_algo, TOKENS_PER_HASH, hashes_per_chunk, group)
    assert computer.keys(tokens, salt) == expected
    assert computer.keys(np.array(tokens), salt) == expected  # numpy ints hash as vLLM's ints
    assert from_scheme(computer.scheme()).keys(tokens, salt) == expected


def test_another_salt_is_another_prefix():
    tokens = np.random.default_rng(8).integers(0, 50_000, 256).tolist()
    computer = VllmKeys("sha256", TOKENS_PER_HASH, 1, 0)
    salted, other, plain = (computer.keys(tokens, salt) for salt in ("a", "b", None))
    assert not set(salted) & set(other) and not set(salted) & set(plain)
    assert plain == scheduler_keys(tokens, "sha256", 1, 0, None)
