"""Transfer handlers on the CUDA backend (CuPy): GPU KV tensors <-> pinned host pool."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
cupy = pytest.importorskip("cupy")

from handler_jobs import keys, run  # noqa: E402

from distkv.abstract import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from distkv.storage.handlers import make_handlers  # noqa: E402
from distkv.names import segment_name  # noqa: E402
from distkv.storage.pool import (  # noqa: E402
    PAGE_BYTES,
    HostPool,
    PoolLayout,
    PoolLoadStoreSpec,
)

pytestmark = pytest.mark.gpu


class Rig:
    def __init__(self, rows, row_bytes, groups, f, pool_layout):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.tensors = [
            torch.randint(-128, 128, (r, b), dtype=torch.int8, device="cuda", generator=gen)
            for r, b in zip(rows, row_bytes)
        ]
        self.kv_caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors],
            [[CanonicalKVCacheRef(idx, page) for idx, page in refs] for refs in groups],
        )
        self.f = f
        self.pool = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "r0"), pool_layout)
        (_, _, self.store), (_, _, self.load) = make_handlers(self.kv_caches, self.pool, 0, f)

    def close(self):
        self.store.shutdown()
        self.load.shutdown()
        self.pool.close()


@pytest.fixture
def rigs():
    made = []

    def make(*args):
        made.append(Rig(*args))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


ROUND_TRIPS = {
    "one group": ([64], [512], [[(0, 512)]], 1, [10], [0]),
    "one group f4 unaligned": ([64], [512], [[(0, 512)]], 4, [10], [3]),
    "three groups f4 unaligned": (
        [64, 64, 48],
        [512, 256, 1024],
        [[(0, 512), (1, 256)], [(2, 1024)], [(0, 512)]],
        4,
        [5, 7, 3],
        [1, 6, 9],
    ),
    "padded pages": ([64, 64], [512, 768], [[(0, 384), (1, 700)]], 4, [9], [2]),
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_round_trip_is_bit_exact(rigs, name, scattered):
    rows, row_bytes, groups, f, sizes, firsts = ROUND_TRIPS[name]
    rig = rigs(rows, row_bytes, groups, f, PoolLayout(32, 1, 3 * PAGE_BYTES))
    rng = np.random.default_rng(1)
    ids = rng.permutation(min(rows))[: sum(sizes)] if scattered else np.arange(3, 3 + sum(sizes))
    num_rows = sum(-(-(n + b % f) // f) if n else 0 for n, b in zip(sizes, firsts))
    pool_rows = rng.permutation(32)[:num_rows] if scattered else np.arange(num_rows)
    gpu = GPULoadStoreSpec(ids, sizes, firsts)
    pool_spec = PoolLoadStoreSpec(pool_rows, keys(num_rows), [1] * num_rows)
    original = [t.cpu() for t in rig.tensors]

    assert run(rig.store, 1, (gpu, pool_spec)).success
    assert all(rig.pool.verify(0, int(r), k, 1) for r, k in zip(pool_rows, pool_spec.keys))
    # vLLM's mapping, one sub-block at a time
    start_block = start_row = 0
    for g, (n, first) in enumerate(zip(sizes, firsts)):
        skip = first % f
        for k in range(n):
            row, sub = int(pool_rows[start_row + (k + skip) // f]), (k + skip) % f
            offset = 0
            for idx, page in groups[g]:
                want = original[idx][ids[start_block + k], :page].view(torch.uint8).numpy()
                got = rig.pool.payload[0, row, offset + sub * page : offset + (sub + 1) * page]
                np.testing.assert_array_equal(got, want)
                offset += f * page
        start_block += n
        start_row += -(-(n + skip) // f) if n else 0

    for t in rig.tensors:
        t.zero_()
    assert run(rig.load, 2, (pool_spec, gpu)).success
    start = 0
    for g, n in enumerate(sizes):
        for idx, page in groups[g]:
            block_ids = torch.as_tensor(ids[start : start + n])
            assert torch.equal(rig.tensors[idx][block_ids, :page].cpu(), original[idx][block_ids, :page])
        start += n


def test_store_waits_for_the_model_stream(rigs):
    rig = rigs([64], [1 << 20], [[(0, 1 << 20)]], 1, PoolLayout(64, 1, 1 << 20))
    fresh = torch.full((64, 1 << 20), 7, dtype=torch.int8, device="cuda")
    torch.cuda._sleep(200_000_000)  # keeps the current stream busy before the KV write
    rig.tensors[0].copy_(fresh)
    pool_spec = PoolLoadStoreSpec(np.arange(64), keys(64), [1] * 64)
    assert run(rig.store, 1, (GPULoadStoreSpec(np.arange(64), [64], [0]), pool_spec)).success
    assert (rig.pool.payload[0] == 7).all()


def test_load_of_a_replaced_row_fails(rigs):
    rig = rigs([16], [512], [[(0, 512)]], 1, PoolLayout(8, 1, PAGE_BYTES))
    gpu = GPULoadStoreSpec([3], [1], [0])
    pool_spec = PoolLoadStoreSpec([2], keys(1), [1])
    assert run(rig.store, 1, (gpu, pool_spec)).success
    assert run(rig.store, 2, (gpu, PoolLoadStoreSpec([2], keys(1), [2]))).success
    before = rig.tensors[0].clone()
    assert not run(rig.load, 3, (pool_spec, GPULoadStoreSpec([5], [1], [0]))).success
    assert torch.equal(rig.tensors[0], before)


def test_shutdown_unregisters_the_pinned_region():
    tensors = [torch.zeros((8, 512), dtype=torch.int8, device="cuda")]
    kv_caches = CanonicalKVCaches([CanonicalKVCacheTensor(tensors[0], 512)], [[CanonicalKVCacheRef(0, 512)]])
    pool = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "r0"), PoolLayout(8, 1, PAGE_BYTES))
    try:
        handlers = make_handlers(kv_caches, pool, 0, 1)
        address, size = pool.rank_address(0), pool.layout.rank_bytes
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            cupy.cuda.runtime.hostRegister(address, size, 0)  # already registered
        handlers[0][2].shutdown()
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            cupy.cuda.runtime.hostRegister(address, size, 0)  # the load handler still uses it
        handlers[1][2].shutdown()
        cupy.cuda.runtime.hostRegister(address, size, 0)
        cupy.cuda.runtime.hostUnregister(address)
    finally:
        pool.close()
