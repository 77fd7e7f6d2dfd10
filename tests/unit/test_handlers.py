"""Transfer handlers on the CPU backend: a CPU tensor stands for the GPU KV cache."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from handler_jobs import keys, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distkv.abstract import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingWorker,
)
from distkv.storage.handlers.layout import CopyPlanner, SlotLayout
from distkv.storage.handlers.cpu import CpuCopyBackend
from distkv.storage.handlers.base import LoadHandler, StoreHandler
from distkv.storage.handlers import make_handlers
from distkv.names import segment_name
from distkv.storage.pool import (
    PAGE_BYTES,
    HostPool,
    PoolLayout,
    PoolLoadStoreSpec,
)


def new_pool(layout: PoolLayout) -> HostPool:
    return HostPool(segment_name("t" + uuid.uuid4().hex[:8], "r0"), layout)


def make_kv(rows: list[int], row_bytes: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (r, b), dtype=torch.int8, generator=gen) for r, b in zip(rows, row_bytes)]


def caches(tensors: list[torch.Tensor], groups: list[list[tuple[int, int]]]) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        [[CanonicalKVCacheRef(idx, page) for idx, page in refs] for refs in groups],
    )


class Rig:
    """Store and load handlers of rank `rank` over a fresh pool."""

    def __init__(self, kv_caches: CanonicalKVCaches, f: int, pool_layout: PoolLayout, rank: int = 0):
        self.kv_caches = kv_caches
        self.f = f
        self.rank = rank
        self.pool = new_pool(pool_layout)
        (_, _, self.store), (_, _, self.load) = make_handlers(kv_caches, self.pool, rank, f, device="cpu")

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t.tensor for t in self.kv_caches.tensors]

    def close(self) -> None:
        self.store.shutdown()
        self.load.shutdown()
        self.pool.close()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(*args, **kwargs) -> Rig:
        made.append(Rig(*args, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def expected_slots(kv_caches, f, block_ids, group_sizes, block_indices, rows, slot_bytes):
    """vLLM's mapping, one sub-block at a time: row -> expected bytes (None where not written)."""
    expected: dict[int, np.ndarray] = {}
    written: dict[int, np.ndarray] = {}
    start_block = start_row = 0
    for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
        skip = first % f
        for k in range(n):
            row = int(rows[start_row + (k + skip) // f])
            sub = (k + skip) % f
            expected.setdefault(row, np.zeros(slot_bytes, np.uint8))
            written.setdefault(row, np.zeros(slot_bytes, bool))
            offset = 0
            for ref in kv_caches.group_data_refs[g]:
                page = ref.page_size_bytes
                src = kv_caches.tensors[ref.tensor_idx].tensor[block_ids[start_block + k], :page]
                lo = offset + sub * page
                expected[row][lo : lo + page] = src.view(torch.uint8).numpy()
                written[row][lo : lo + page] = True
                offset += f * page
        start_block += n
        start_row += -(-(n + skip) // f) if n else 0
    return expected, written


def specs(ids, sizes, firsts, rows, gen=1, tag=0):
    return GPULoadStoreSpec(ids, sizes, firsts), PoolLoadStoreSpec(rows, keys(len(rows), tag), [gen] * len(rows))


def round_trip(rig: Rig, ids, sizes, firsts, rows):
    """Store, check the slots byte by byte, zero the KV, load back, compare."""
    gpu, pool_spec = specs(ids, sizes, firsts, rows)
    original = [t.clone() for t in rig.tensors]
    result = run(rig.store, 1, (gpu, pool_spec))
    assert result.success

    slot_bytes = rig.pool.layout.slot_bytes
    expected, written = expected_slots(rig.kv_caches, rig.f, ids, sizes, firsts, rows, slot_bytes)
    for row, want in expected.items():
        got = rig.pool.payload[rig.rank, row]
        np.testing.assert_array_equal(got[written[row]], want[written[row]])
    for row, key in zip(pool_spec.block_ids.tolist(), pool_spec.keys):
        assert rig.pool.verify(rig.rank, row, key, 1), f"row {row}'s checksum does not match its payload"

    for t in rig.tensors:
        t.zero_()
    result = run(rig.load, 2, (pool_spec, gpu))
    assert result.success
    copied = [torch.zeros_like(t, dtype=torch.bool) for t in rig.tensors]
    start = 0
    for g, n in enumerate(sizes):
        for ref in rig.kv_caches.group_data_refs[g]:
            copied[ref.tensor_idx][ids[start : start + n], : ref.page_size_bytes] = True
        start += n
    for t, orig, mask in zip(rig.tensors, original, copied):
        assert torch.equal(t[mask], orig[mask])
        assert not t[~mask].any(), "the load wrote outside the blocks' pages"


ROUND_TRIPS = {
    # name: (tensor rows, tensor row bytes, groups [(tensor, page)], f, group sizes, block indices)
    "one group": ([64], [512], [[(0, 512)]], 1, [10], [0]),
    "one group f4": ([64], [512], [[(0, 512)]], 4, [10], [0]),
    "one group f4 unaligned": ([64], [512], [[(0, 512)]], 4, [10], [3]),
    "three groups": ([64, 64, 48], [512, 256, 1024], [[(0, 512), (1, 256)], [(2, 1024)], [(0, 512)]], 1, [5, 7, 3], [0, 2, 9]),
    "three groups f4 unaligned": (
        [64, 64, 48],
        [512, 256, 1024],
        [[(0, 512), (1, 256)], [(2, 1024)], [(0, 512)]],
        4,
        [5, 7, 3],
        [1, 6, 9],
    ),
    "padded pages": ([64, 64], [512, 768], [[(0, 384), (1, 700)]], 4, [9], [2]),
    "empty group": ([64], [512], [[(0, 512)], [(0, 256)]], 2, [0, 5], [3, 1]),
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_round_trip_is_bit_exact(rigs, name, scattered):
    rows, row_bytes, groups, f, sizes, firsts = ROUND_TRIPS[name]
    rig = rigs(caches(make_kv(rows, row_bytes), groups), f, PoolLayout(32, 1, 3 * PAGE_BYTES))
    rng = np.random.default_rng(1)
    num_blocks = min(rows)
    if scattered:
        ids = rng.permutation(num_blocks)[: sum(sizes)]
    else:
        ids = np.arange(3, 3 + sum(sizes))
    num_rows = sum(-(-(n + b % f) // f) if n else 0 for n, b in zip(sizes, firsts))
    pool_rows = rng.permutation(32)[:num_rows] if scattered else np.arange(num_rows)
    round_trip(rig, ids, sizes, firsts, pool_rows)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_transfer_places_sub_blocks_as_vllm_does(data):
    num_tensors = data.draw(st.integers(1, 3))
    row_bytes = data.draw(st.lists(st.integers(1, 96), min_size=num_tensors, max_size=num_tensors))
    num_groups = data.draw(st.integers(1, 3))
    groups = [
        [
            (t, data.draw(st.integers(1, row_bytes[t])))
            for t in data.draw(st.lists(st.integers(0, num_tensors - 1), min_size=1, max_size=3))
        ]
        for _ in range(num_groups)
    ]
    f = data.draw(st.integers(1, 4))
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=num_groups, max_size=num_groups))
    firsts = data.draw(st.lists(st.integers(0, 20), min_size=num_groups, max_size=num_groups))
    ids = np.array(data.draw(st.permutations(range(24)))[: sum(sizes)], dtype=np.int64)
    num_rows = sum(-(-(n + b % f) // f) if n else 0 for n, b in zip(sizes, firsts))
    rows = np.array(data.draw(st.permutations(range(24)))[:num_rows], dtype=np.int64)
    rig = Rig(caches(make_kv([24] * num_tensors, row_bytes), groups), f, PoolLayout(24, 2, PAGE_BYTES), rank=1)
    try:
        round_trip(rig, ids, sizes, firsts, rows)
        assert not rig.pool.payload[0].any(), "rank 1's handlers wrote into rank 0's slots"
    finally:
        rig.close()


def test_store_seals_headers_with_group_bytes(rigs):
    groups = [[(0, 512), (1, 256)], [(1, 256)]]
    rig = rigs(caches(make_kv([32, 32], [512, 256]), groups), 2, PoolLayout(16, 1, PAGE_BYTES))
    gpu, pool_spec = specs([1, 2, 3, 4, 5, 6], [4, 2], [0, 1], [7, 8, 9, 10], gen=5)
    assert run(rig.store, 1, (gpu, pool_spec)).success
    out = np.empty(PAGE_BYTES, np.uint8)
    for i, (row, key) in enumerate(zip(pool_spec.block_ids, pool_spec.keys)):
        assert rig.pool.verify(0, int(row), key, 5)
        group_bytes = 2 * (512 + 256) if i < 2 else 2 * 256
        nbytes, _checksum, _filled = rig.pool.read(0, int(row), key, 5, out)
        assert nbytes == group_bytes


def test_store_checksums_rows_larger_than_its_copy_chunks(rigs):
    # 3 rows of 2 refs x 2 sub-blocks of 200 KiB: runs cross rows and chunks, and the
    # unaligned first block leaves a row written in part
    page = 200 << 10
    rig = rigs(caches(make_kv([16, 16], [page, page]), [[(0, page), (1, page)]]), 2, PoolLayout(8, 1, 4 * page))
    round_trip(rig, np.arange(4, 9), [5], [1], np.array([5, 6, 7]))


@pytest.mark.parametrize("first", [0, 1], ids=["whole-rows", "unaligned-first-block"])
def test_load_of_a_row_damaged_in_place_fails(rigs, first):
    # the header still names the block: only the checksum can tell
    rig = rigs(caches(make_kv([16], [4096]), [[(0, 4096)]]), 2, PoolLayout(8, 1, PAGE_BYTES * 2))
    gpu, pool_spec = specs([2, 3, 4, 5], [4], [0], [3, 4], gen=1)
    assert run(rig.store, 1, (gpu, pool_spec)).success
    load_gpu = GPULoadStoreSpec([9, 10, 11, 12][first:], [4 - first], [first])
    assert run(rig.load, 2, (pool_spec, load_gpu)).success
    rig.pool.payload[0, 4, 100] ^= 0xFF
    assert not run(rig.load, 3, (pool_spec, load_gpu)).success
    rig.pool.payload[0, 4, 100] ^= 0xFF
    rig.pool.payload[0, 3, 4096 * 2 - 1] ^= 0x01
    assert not run(rig.load, 4, (pool_spec, load_gpu)).success


def test_load_of_a_replaced_row_fails_and_leaves_kv_alone(rigs):
    rig = rigs(caches(make_kv([32], [256]), [[(0, 256)]]), 1, PoolLayout(8, 1, PAGE_BYTES))
    gpu, pool_spec = specs([0, 1, 2], [3], [0], [0, 1, 2], gen=1)
    assert run(rig.store, 1, (gpu, pool_spec)).success
    one = GPULoadStoreSpec([5], [1], [0])
    # row 1 stored again: same key, next generation; row 2: another key
    assert run(rig.store, 2, (one, PoolLoadStoreSpec([1], pool_spec.keys[1:2], [2]))).success
    assert run(rig.store, 3, (one, PoolLoadStoreSpec([2], keys(1, tag=9), [1]))).success
    before = rig.tensors[0].clone()
    target = GPULoadStoreSpec([7], [1], [0])
    for row in (1, 2):
        stale = PoolLoadStoreSpec([row], pool_spec.keys[row : row + 1], [1])
        assert not run(rig.load, 10 + row, (stale, target)).success
        assert torch.equal(rig.tensors[0], before)
    assert run(rig.load, 20, (PoolLoadStoreSpec([0], pool_spec.keys[:1], [1]), target)).success
    assert torch.equal(rig.tensors[0][7], before[0])


class _ReplacingBackend(CpuCopyBackend):
    """Stands for a writer that replaces a row while the load copies it."""

    def __init__(self, *args, replace):
        super().__init__(*args)
        self._replace = replace

    def submit(self, plan, to_pool):
        tickets = super().submit(plan, to_pool)
        replace = self._replace

        class Ticket:
            def wait(self):
                tickets[0].wait()
                replace()

        return [Ticket()]


def test_load_fails_when_a_row_changes_during_the_copy():
    tensors = make_kv([16], [256])
    kv_caches = caches(tensors, [[(0, 256)]])
    pool = new_pool(PoolLayout(4, 1, PAGE_BYTES))
    (_, _, store), (_, _, _load) = make_handlers(kv_caches, pool, 0, 1)
    gpu, pool_spec = specs([3], [1], [0], [2], gen=4)
    assert run(store, 1, (gpu, pool_spec)).success

    layout = SlotLayout.from_kv_caches(kv_caches, 1)
    backend = _ReplacingBackend(tensors, pool, 0, replace=lambda: pool.begin_write(0, np.array([2])))
    load = LoadHandler(layout, tensors, pool, 0, backend)
    try:
        assert not run(load, 2, (pool_spec, GPULoadStoreSpec([5], [1], [0]))).success
    finally:
        for handler in (store, _load, load):
            handler.shutdown()
        pool.close()


def test_each_job_is_reported_once_in_order(rigs):
    rig = rigs(caches(make_kv([64], [1024]), [[(0, 1024)]]), 1, PoolLayout(64, 1, PAGE_BYTES))
    for job in range(8):
        rig.store.transfer_async(job, specs([job], [1], [0], [job], gen=job + 1))
    rig.store.wait({3})
    rig.store.wait(set(range(8)))
    rig.store.wait(set(range(8)))
    results = rig.store.get_finished()
    assert [r.job_id for r in results] == list(range(8))
    assert all(r.success and r.transfer_size == 1024 for r in results)
    assert all(r.transfer_type == ("GPU", "CPU") and r.transfer_time >= 0 for r in results)
    assert rig.store.get_finished() == []
    rig.store.wait({3})  # already reported: returns at once


def test_wait_returns_once_the_bytes_are_there(rigs):
    num_blocks = 512
    rig = rigs(caches(make_kv([num_blocks], [64 << 10]), [[(0, 64 << 10)]]), 1, PoolLayout(num_blocks, 1, 64 << 10))
    ids = np.random.default_rng(0).permutation(num_blocks)
    gpu, pool_spec = specs(ids, [num_blocks], [0], np.arange(num_blocks), gen=3)
    rig.store.transfer_async(7, (gpu, pool_spec))
    rig.store.wait({7})
    np.testing.assert_array_equal(rig.pool.payload[0], rig.tensors[0].view(torch.uint8).numpy()[ids])
    assert all(rig.pool.verify(0, r, k, 3) for r, k in zip(range(num_blocks), pool_spec.keys))
    (result,) = rig.store.get_finished()
    assert result.success and result.transfer_size == num_blocks * (64 << 10)


def test_later_store_to_a_row_wins(rigs):
    rig = rigs(caches(make_kv([8], [512]), [[(0, 512)]]), 1, PoolLayout(4, 1, PAGE_BYTES))
    rig.store.transfer_async(1, specs([1], [1], [0], [0], gen=1))
    rig.store.transfer_async(2, specs([2], [1], [0], [0], gen=2, tag=1))
    rig.store.wait({1, 2})
    assert rig.pool.verify(0, 0, keys(1, tag=1)[0], 2)
    np.testing.assert_array_equal(rig.pool.payload[0, 0, :512], rig.tensors[0][2].view(torch.uint8).numpy())


def test_shutdown_finishes_outstanding_work(rigs):
    rig = rigs(caches(make_kv([64], [4096]), [[(0, 4096)]]), 1, PoolLayout(64, 1, PAGE_BYTES))
    gpu, pool_spec = specs(np.arange(64), [64], [0], np.arange(64), gen=1)
    rig.store.transfer_async(1, (gpu, pool_spec))
    rig.store.shutdown()
    assert all(rig.pool.verify(0, r, k, 1) for r, k in zip(range(64), pool_spec.keys))
    with pytest.raises(RuntimeError):
        rig.store.transfer_async(2, (gpu, pool_spec))


def test_empty_transfer_succeeds(rigs):
    rig = rigs(caches(make_kv([8], [512]), [[(0, 512)]]), 2, PoolLayout(4, 1, PAGE_BYTES))
    result = run(rig.store, 1, specs([], [0], [3], []))
    assert result.success and result.transfer_size == 0


def test_handlers_plug_into_the_offloading_worker():
    tensors = make_kv([16], [512])
    pool = new_pool(PoolLayout(8, 1, PAGE_BYTES))
    worker = OffloadingWorker()
    handlers = make_handlers(caches(tensors, [[(0, 512)]]), pool, 0, 2)
    assert [(src.__name__, dst.__name__, type(h)) for src, dst, h in handlers] == [
        ("GPULoadStoreSpec", "PoolLoadStoreSpec", StoreHandler),
        ("PoolLoadStoreSpec", "GPULoadStoreSpec", LoadHandler),
    ]
    for src, dst, handler in handlers:
        worker.register_handler(src, dst, handler)
    try:
        original = tensors[0].clone()
        gpu, pool_spec = specs([4, 5, 6], [3], [1], [3, 4], gen=2)
        worker.transfer_async(1, (gpu, pool_spec))
        worker.wait({1})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
        tensors[0].zero_()
        worker.transfer_async(2, (pool_spec, gpu))
        worker.wait({2})
        assert [(r.job_id, r.success, r.transfer_type) for r in worker.get_finished()] == [(2, True, ("CPU", "GPU"))]
        assert torch.equal(tensors[0][4:7], original[4:7])
    finally:
        worker.shutdown()
        pool.close()


# ---- bad input -------------------------------------------------------------------------


@pytest.fixture
def stored(rigs):
    """Two groups, f=2, rows 0-2 stored and sealed."""
    rig = rigs(caches(make_kv([16, 16], [512, 256]), [[(0, 512)], [(1, 256)]]), 2, PoolLayout(8, 1, PAGE_BYTES))
    gpu, pool_spec = specs([0, 1, 2, 3], [3, 1], [0, 0], [0, 1, 2], gen=1)
    assert run(rig.store, 1, (gpu, pool_spec)).success
    return rig, pool_spec


BAD_STORES = {
    "rows": ((lambda: specs([0, 1, 2, 3], [3, 1], [0, 0], [4, 5])), "pool rows"),
    "groups": ((lambda: specs([0, 1, 2], [3], [0], [4, 5])), "KV groups"),
    "block id": ((lambda: specs([0, 1, 16, 3], [3, 1], [0, 0], [4, 5, 6])), r"block ids \[16\]"),
    "negative block id": ((lambda: specs([0, -1, 2, 3], [3, 1], [0, 0], [4, 5, 6])), r"block ids \[-1\]"),
    "pool row": ((lambda: specs([0, 1, 2, 3], [3, 1], [0, 0], [4, 8, 6])), r"pool rows \[8\]"),
    "generation 0": ((lambda: specs([0, 1, 2, 3], [3, 1], [0, 0], [4, 5, 6], gen=0)), "generation"),
    "spec types": ((lambda: specs([0, 1, 2, 3], [3, 1], [0, 0], [4, 5, 6])[::-1]), "GPULoadStoreSpec"),
}


@pytest.mark.parametrize("case", BAD_STORES)
def test_bad_store_raises_and_submits_nothing(stored, case):
    rig, pool_spec = stored
    make_spec, message = BAD_STORES[case]
    payload = rig.pool.payload[0].copy()
    with pytest.raises(ValueError, match=message):
        rig.store.transfer_async(2, make_spec())
    rig.store.wait({2})
    assert rig.store.get_finished() == []
    np.testing.assert_array_equal(rig.pool.payload[0], payload)
    assert all(rig.pool.verify(0, r, k, 1) for r, k in zip([0, 1, 2], pool_spec.keys))
    for row in range(3, 8):
        assert rig.pool.generation(0, row) == 0


def test_bad_load_raises_and_submits_nothing(stored):
    rig, pool_spec = stored
    before = [t.clone() for t in rig.tensors]
    with pytest.raises(ValueError, match="pool rows"):
        rig.load.transfer_async(2, (pool_spec, GPULoadStoreSpec([0, 1, 2], [2, 1], [0, 0])))
    with pytest.raises(ValueError, match=r"block ids \[99\]"):
        rig.load.transfer_async(2, (pool_spec, GPULoadStoreSpec([0, 1, 99, 3], [3, 1], [0, 0])))
    assert rig.load.get_finished() == []
    assert all(torch.equal(t, b) for t, b in zip(rig.tensors, before))


def test_duplicate_job_id_in_flight_raises(rigs):
    rig = rigs(caches(make_kv([8], [512]), [[(0, 512)]]), 1, PoolLayout(4, 1, PAGE_BYTES))
    rig.store.transfer_async(1, specs([0], [1], [0], [0]))
    with pytest.raises(ValueError, match="already in flight"):
        rig.store.transfer_async(1, specs([1], [1], [0], [1]))
    rig.store.wait({1})
    assert [r.job_id for r in rig.store.get_finished()] == [1]
    assert rig.pool.generation(0, 1) == 0


def test_key_too_long_raises(rigs):
    rig = rigs(caches(make_kv([8], [512]), [[(0, 512)]]), 1, PoolLayout(4, 1, PAGE_BYTES))
    with pytest.raises(ValueError, match="exceed"):
        rig.store.transfer_async(1, (GPULoadStoreSpec([0], [1], [0]), PoolLoadStoreSpec([0], [b"k" * 200], [1])))
    assert rig.store.get_finished() == []


def test_pool_slots_too_small_raise():
    pool = new_pool(PoolLayout(4, 1, PAGE_BYTES))
    try:
        kv_caches = caches(make_kv([8, 8], [2048, 1024]), [[(0, 2048), (1, 1024)]])
        with pytest.raises(ValueError, match=f"{PAGE_BYTES} bytes.*{2 * 3072} bytes"):
            make_handlers(kv_caches, pool, 0, 2)
        with pytest.raises(ValueError, match="rank 1 out of range"):
            make_handlers(kv_caches, pool, 1, 1)
        with pytest.raises(ValueError, match="does not fit"):
            make_handlers(caches(make_kv([8], [512]), [[(0, 600)]]), pool, 0, 1)
        with pytest.raises(ValueError, match="device='cuda'"):
            make_handlers(caches(make_kv([8], [512]), [[(0, 512)]]), pool, 0, 1, device="cuda")
    finally:
        pool.close()


# ---- planning --------------------------------------------------------------------------


def planner(tensors, groups, f, pool_layout, piece_bytes=None, segment_bytes=1 << 30):
    layout = SlotLayout.from_kv_caches(caches(tensors, groups), f)
    return CopyPlanner(layout, tensors, pool_layout, segment_bytes, piece_bytes)


def test_plan_coalesces_adjacent_runs():
    tensors = make_kv([64], [PAGE_BYTES])
    p = planner(tensors, [[(0, PAGE_BYTES)]], 1, PoolLayout(64, 1, PAGE_BYTES))
    plan = p.plan(np.arange(10, 26), [16], [0], np.arange(16))
    assert len(plan.nbytes) == 1 and plan.nbytes[0] == 16 * PAGE_BYTES
    plan = p.plan(np.arange(10, 26)[::-1].copy(), [16], [0], np.arange(16))
    assert len(plan.nbytes) == 16
    padded = planner(tensors, [[(0, 1000)]], 4, PoolLayout(64, 1, PAGE_BYTES))
    assert len(padded.plan(np.arange(8), [8], [0], np.arange(2)).nbytes) == 8


def test_plan_splits_runs_at_pinned_pieces_and_segments():
    tensors = make_kv([64], [PAGE_BYTES])
    pieces = planner(tensors, [[(0, PAGE_BYTES)]], 1, PoolLayout(64, 1, PAGE_BYTES), piece_bytes=5 * PAGE_BYTES)
    plan = pieces.plan(np.arange(16), [16], [0], np.arange(16))
    assert plan.nbytes.tolist() == [5 * PAGE_BYTES, 5 * PAGE_BYTES, 5 * PAGE_BYTES, PAGE_BYTES]
    segments = planner(tensors, [[(0, PAGE_BYTES)]], 1, PoolLayout(64, 1, PAGE_BYTES), segment_bytes=6 * PAGE_BYTES)
    plan = segments.plan(np.arange(16), [16], [0], np.arange(16))
    assert plan.row_bounds.tolist() == [0, 6, 12, 16]
    assert plan.run_bounds.tolist() == [0, 1, 2, 3]


def test_a_row_stored_in_part_says_so_and_never_loads_the_rest(rigs):
    """vLLM 0.33 stores a chunk whose leading GPU blocks fell out of a sliding window
    (block id 0) from its first live block, and a partial tail as one GPU block: rows
    written in part. Their headers name the sub-blocks written, and a load that would
    read any other sub-block fails instead of delivering what the row held before."""
    f, page = 4, 512
    rig = rigs(caches(make_kv([16], [page]), [[(0, page)]]), f, PoolLayout(4, 1, PAGE_BYTES))
    gpu, pool_spec = specs([1, 2, 3, 4, 5, 6], [6], [0], [0, 1])
    assert run(rig.store, 1, (gpu, pool_spec)).success
    # row 1 again, from sub-block 2 on: the store's first block is unaligned
    part, part_spec = GPULoadStoreSpec([7, 8], [1 * 2], [2]), PoolLoadStoreSpec([1], keys(1, tag=9), [2])
    assert run(rig.store, 2, (part, part_spec)).success
    key = part_spec.keys[0]
    assert rig.pool.sealed(0, 1, key, 2).filled == 0b1100
    assert rig.pool.sealed(0, 0, pool_spec.keys[0], 1).filled == 0b1111
    assert rig.pool.sealed(0, 1, pool_spec.keys[1], 1) is None  # the store replaced it

    kv = rig.tensors[0]
    kv[9:13].zero_()
    # a load reading sub-blocks 0..3 of the row: 0 and 1 hold the old block's bytes
    whole = GPULoadStoreSpec([9, 10, 11, 12], [4], [0])
    assert not run(rig.load, 3, (PoolLoadStoreSpec([1], [key], [2]), whole)).success
    # the sub-blocks it wrote load bit-exact
    tail = GPULoadStoreSpec([11, 12], [2], [2])
    assert run(rig.load, 4, (PoolLoadStoreSpec([1], [key], [2]), tail)).success
    torch.testing.assert_close(kv[11:13], kv[7:9], rtol=0, atol=0)


def test_block_size_factor_beyond_the_headers_mask_is_refused():
    kv = caches(make_kv([4], [512]), [[(0, 512)]])
    with pytest.raises(ValueError, match="block_size_factor=64 must be in 1..63"):
        SlotLayout.from_kv_caches(kv, 64)
