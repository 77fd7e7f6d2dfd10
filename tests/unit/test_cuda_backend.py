"""The CUDA backend's own logic over a stand-in for CuPy (fake_cupy), without a GPU.

CPU tensors stand for the KV cache in device memory and copies are memmoves, so the
pointer arithmetic per run, the stream and event ordering, the ticket flow and the pinned
registrations run in CI. Results are compared bit for bit with the CPU backend's on the
same transfers; tests/gpu runs the same backend on a real device.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from fake_cupy import MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, CudaError, FakeCuda, FakeTorchDevice
from handler_jobs import keys, run

from distkv.abstract import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from distkv.storage.handlers.layout import CopyPlanner, SlotLayout
from distkv.storage.handlers.cpu import CpuCopyBackend
from distkv.storage.handlers.cuda import CudaCopyBackend, PinnedRegion
from distkv.storage.handlers.base import LoadHandler, StoreHandler
from distkv.names import segment_name
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout, PoolLoadStoreSpec

DEVICE = 3  # not 0, so that a copy or event on torch's default device shows
RANK = 1  # not 0, so that the rank's offset in the pool counts
SLOT_BYTES = 3 * PAGE_BYTES


def make_kv(rows: list[int], row_bytes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(-128, 128, (r, b), dtype=torch.int8, generator=gen) for r, b in zip(rows, row_bytes)]


def caches(tensors: list[torch.Tensor], groups: list[list[tuple[int, int]]]) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        [[CanonicalKVCacheRef(idx, page) for idx, page in refs] for refs in groups],
    )


def new_pool(layout: PoolLayout) -> HostPool:
    return HostPool(segment_name("t" + uuid.uuid4().hex[:8], "r0"), layout)


class Rig:
    """Store and load handlers of rank RANK over a fresh pool, on the CUDA backend over
    `fake` (as make_handlers builds them: two backends, one pinned region), or on the CPU
    backend when `fake` is None."""

    def __init__(self, fake: FakeCuda | None, tensors, groups, f, pool_layout=PoolLayout(32, 2, SLOT_BYTES)):
        self.tensors = tensors
        self.kv_caches = caches(tensors, groups)
        self.pool = new_pool(pool_layout)
        if fake is None:
            backends = [CpuCopyBackend(tensors, self.pool, RANK) for _ in range(2)]
        else:
            self.model = FakeTorchDevice(fake, DEVICE)
            self.pinned = PinnedRegion(self.pool, RANK, fake.cupy)
            backends = [CudaCopyBackend(tensors, self.pinned, self.model) for _ in range(2)]
        layout = SlotLayout.from_kv_caches(self.kv_caches, f)
        self.store = StoreHandler(layout, tensors, self.pool, RANK, backends[0])
        self.load = LoadHandler(layout, tensors, self.pool, RANK, backends[1])

    def close(self) -> None:
        self.store.shutdown()
        self.load.shutdown()
        self.pool.close()


@pytest.fixture
def fake():
    return FakeCuda()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(*args, **kwargs) -> Rig:
        made.append(Rig(*args, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        if not rig.store.closed:
            rig.close()


@pytest.fixture
def small_pieces(monkeypatch):
    """Several pinned pieces of 3 rows and segments of 2 rows, in the pool of every rig."""
    monkeypatch.setattr(PinnedRegion, "max_piece_bytes", 3 * SLOT_BYTES + PAGE_BYTES)
    monkeypatch.setattr(CudaCopyBackend, "segment_bytes", 2 * SLOT_BYTES)


def check_calls(fake: FakeCuda, pool: HostPool, tensors: list[torch.Tensor], model_stream) -> None:
    """What the backend must do with CUDA, over every call made so far:
    - the pool region of the rank is registered whole, in pieces of at most
      max_piece_bytes that end on slot boundaries, and nothing else is;
    - a copy stream waits on an event recorded on the model's stream at that moment
      before it is given any copy, and on its device;
    - a copy moves bytes between one pinned piece and one KV tensor, in the direction
      its kind says;
    - every copy is followed by the record of a ticket's event on its stream."""
    region = pool.rank_address(RANK)
    region_end = region + pool.layout.num_rows * SLOT_BYTES
    kv_spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors]
    pinned: dict[int, int] = {}
    pinned_bytes = 0
    waited: set = set()
    unrecorded: dict = {}  # copy stream -> copies not yet followed by an event's record
    previous = None
    for name, *args in fake.calls:
        if name == "hostRegister":
            address, size, _flags = args
            assert region <= address and address + size <= region_end
            assert (address - region) % SLOT_BYTES == 0 and size % SLOT_BYTES == 0
            assert size <= PinnedRegion.max_piece_bytes
            pinned[address] = size
            pinned_bytes += size
        elif name == "hostUnregister":
            del pinned[args[0]]
        elif name == "wait_event":
            stream, event = args
            assert stream.non_blocking and stream.device == DEVICE
            assert previous == ("record", event, model_stream), "waited on an event not just recorded on the model's stream"
            waited.add(stream)
        elif name == "memcpyAsync":
            dst, src, size, kind, ptr = args
            stream = fake.streams[ptr]
            assert stream in waited, "a copy was queued before its stream waited on the model's stream"
            host, device = (dst, src) if kind == MEMCPY_DEVICE_TO_HOST else (src, dst)
            assert kind in (MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE)
            assert any(a <= host and host + size <= a + n for a, n in pinned.items()), "copy outside one pinned piece"
            assert any(lo <= device and device + size <= hi for lo, hi in kv_spans), "copy outside one KV tensor"
            unrecorded[stream] = unrecorded.get(stream, 0) + 1
        elif name == "record" and args[1] in waited:
            assert unrecorded.pop(args[1], 0) > 0, "a ticket's event covers no copy"
        previous = (name, *args)
    assert pinned_bytes == region_end - region
    assert not unrecorded, "copies no ticket waits for"


def check_released(fake: FakeCuda) -> None:
    """Every registration released exactly once, after the copy streams were synchronized."""
    registered = [c[1] for c in fake.calls if c[0] == "hostRegister"]
    unregistered = [c[1] for c in fake.calls if c[0] == "hostUnregister"]
    assert registered and sorted(unregistered) == sorted(registered)
    assert fake.registered == {}
    first_release = next(i for i, c in enumerate(fake.calls) if c[0] == "hostUnregister")
    synchronized = {c[1] for c in fake.calls[:first_release] if c[0] == "synchronize"}
    copy_streams = {s for s in fake.streams.values() if s.non_blocking}
    assert len(copy_streams) == 2 and copy_streams <= synchronized
    assert all(s.idle for s in fake.streams.values())


ROUND_TRIPS = {
    # name: (tensor rows, tensor row bytes, groups [(tensor, page)], f, group sizes, block indices)
    "one group": ([64], [512], [[(0, 512)]], 1, [10], [0]),
    "one group whole slots": ([64], [SLOT_BYTES], [[(0, SLOT_BYTES)]], 1, [12], [0]),
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


def transfer(name: str, scattered: bool):
    rows, _row_bytes, _groups, f, sizes, firsts = ROUND_TRIPS[name]
    rng = np.random.default_rng(1)
    ids = rng.permutation(min(rows))[: sum(sizes)] if scattered else np.arange(3, 3 + sum(sizes))
    num_rows = sum(-(-(n + b % f) // f) if n else 0 for n, b in zip(sizes, firsts))
    pool_rows = rng.permutation(32)[:num_rows] if scattered else np.arange(num_rows)
    return GPULoadStoreSpec(ids, sizes, firsts), PoolLoadStoreSpec(pool_rows, keys(num_rows), [1] * num_rows)


@pytest.mark.parametrize("name", ROUND_TRIPS)
@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_round_trip_matches_the_cpu_backend_bit_for_bit(fake, rigs, small_pieces, name, scattered):
    rows, row_bytes, groups, f, _sizes, _firsts = ROUND_TRIPS[name]
    cuda, cpu = rigs(fake, make_kv(rows, row_bytes), groups, f), rigs(None, make_kv(rows, row_bytes), groups, f)
    gpu, pool_spec = transfer(name, scattered)
    for rig in (cuda, cpu):
        assert run(rig.store, 1, (gpu, pool_spec)).success
    ticket_events = [c for c in fake.calls if c[0] == "record" and c[2].non_blocking]
    assert len(fake.registered) > 1 and len(ticket_events) > 1, "one pinned piece or one segment: not the case meant"
    np.testing.assert_array_equal(cuda.pool.payload, cpu.pool.payload)
    for row, key in zip(pool_spec.block_ids.tolist(), pool_spec.keys):
        assert cuda.pool.sealed(RANK, row, key, 1) == cpu.pool.sealed(RANK, row, key, 1)
        assert cuda.pool.verify(RANK, row, key, 1)

    for rig in (cuda, cpu):
        for t in rig.tensors:
            t.zero_()
        assert run(rig.load, 2, (pool_spec, gpu)).success
    for got, want in zip(cuda.tensors, cpu.tensors):
        assert torch.equal(got, want)
    assert any((t != 0).any() for t in cuda.tensors)

    check_calls(fake, cuda.pool, cuda.tensors, cuda.model.stream)
    cuda.close()
    check_released(fake)


def test_store_copies_what_the_model_queued_before_it(fake, rigs):
    rig = rigs(fake, make_kv([16], [512]), [[(0, 512)]], 1)
    kv = rig.tensors[0]
    gpu, pool_spec = GPULoadStoreSpec([4, 5], [2], [0]), PoolLoadStoreSpec([0, 1], keys(2), [1, 1])
    assert run(rig.store, 1, (gpu, pool_spec)).success
    # the model writes blocks 4 and 5 on its stream; the host queues the next store at once
    rig.model.stream.launch_host_func(lambda: kv[4:6].fill_(7))
    assert run(rig.store, 2, (gpu, PoolLoadStoreSpec([2, 3], keys(2, tag=1), [1, 1]))).success
    assert (rig.pool.payload[RANK, 2:4, :512] == 7).all()
    check_calls(fake, rig.pool, rig.tensors, rig.model.stream)


def test_load_waits_for_the_model_to_finish_with_the_blocks(fake, rigs):
    rig = rigs(fake, make_kv([16], [512]), [[(0, 512)]], 1)
    kv = rig.tensors[0]
    gpu, pool_spec = GPULoadStoreSpec([4], [1], [0]), PoolLoadStoreSpec([0], keys(1), [1])
    assert run(rig.store, 1, (gpu, pool_spec)).success
    old = kv[9].clone()
    seen = []
    # the model still reads block 9 on its stream when the host loads into it
    rig.model.stream.launch_host_func(lambda: seen.append(kv[9].clone()))
    assert run(rig.load, 2, (pool_spec, GPULoadStoreSpec([9], [1], [0]))).success
    rig.model.stream.synchronize()
    assert torch.equal(seen[0], old) and torch.equal(kv[9], kv[4])
    check_calls(fake, rig.pool, rig.tensors, rig.model.stream)


def plan_and_backend(tensors, pinned, model):
    """A plan of 4 segments of 2 rows, one run per row, and a backend to run it."""
    layout = SlotLayout.from_kv_caches(caches(tensors, [[(0, SLOT_BYTES)]]), 1)
    backend = CudaCopyBackend(tensors, pinned, model)
    planner = CopyPlanner(layout, tensors, PoolLayout(8, 2, SLOT_BYTES), 2 * SLOT_BYTES, backend.piece_bytes)
    return planner.plan(np.arange(8)[::-1].copy(), [8], [0], np.arange(8)), backend


@pytest.fixture
def pool8():
    pool = new_pool(PoolLayout(8, 2, SLOT_BYTES))
    yield pool
    pool.close()


def test_a_ticket_delivers_its_segment_and_waits_for_no_later_one(fake, pool8):
    tensors = make_kv([8], [SLOT_BYTES])
    model = FakeTorchDevice(fake, DEVICE)
    plan, backend = plan_and_backend(tensors, PinnedRegion(pool8, RANK, fake.cupy), model)
    tickets = backend.submit(plan, to_pool=True)
    assert len(tickets) == plan.num_segments == 4
    # each ticket's event is recorded right after its segment's copies
    copies_per_event, copies = [], 0
    for name, *args in fake.calls:
        if name == "memcpyAsync":
            copies += 1
        elif name == "record" and args[1].non_blocking:
            copies_per_event.append(copies)
            copies = 0
    assert copies_per_event == np.diff(plan.run_bounds).tolist() == [2, 2, 2, 2]
    check_calls(fake, pool8, tensors, model.stream)

    expected = tensors[0].view(torch.uint8).numpy()[::-1]
    tickets[1].wait()
    np.testing.assert_array_equal(pool8.payload[RANK, :4], expected[:4])
    assert not pool8.payload[RANK, 4:].any()
    tickets[3].wait()
    np.testing.assert_array_equal(pool8.payload[RANK], expected)
    backend.close()


def test_close_finishes_the_copies_and_the_last_user_releases_the_region(fake, pool8, monkeypatch):
    monkeypatch.setattr(PinnedRegion, "max_piece_bytes", 3 * SLOT_BYTES)
    tensors = make_kv([8], [SLOT_BYTES])
    pinned = PinnedRegion(pool8, RANK, fake.cupy)
    model = FakeTorchDevice(fake, DEVICE)
    plan, first = plan_and_backend(tensors, pinned, model)
    _, second = plan_and_backend(tensors, pinned, model)
    pieces = dict(fake.registered)
    assert sorted(pieces.values()) == [2 * SLOT_BYTES, 3 * SLOT_BYTES, 3 * SLOT_BYTES]
    assert first.piece_bytes == 3 * SLOT_BYTES

    first.submit(plan, to_pool=True)  # no ticket waited for
    first.close()
    np.testing.assert_array_equal(pool8.payload[RANK], tensors[0].view(torch.uint8).numpy()[::-1])
    assert fake.registered == pieces, "released while the other backend uses it"
    second.close()
    check_released(fake)
    assert len([c for c in fake.calls if c[0] == "hostUnregister"]) == 3


def test_a_failed_registration_releases_the_pieces_already_registered(fake, pool8, monkeypatch):
    monkeypatch.setattr(PinnedRegion, "max_piece_bytes", 3 * SLOT_BYTES)
    last_piece = pool8.rank_address(RANK) + 6 * SLOT_BYTES
    fake.runtime.hostRegister(last_piece, SLOT_BYTES, 0)  # someone else pinned part of it
    with pytest.raises(CudaError, match="AlreadyRegistered"):
        PinnedRegion(pool8, RANK, fake.cupy)
    assert fake.registered == {last_piece: SLOT_BYTES}


def test_kv_tensors_off_cuda_are_refused_by_default(fake, pool8):
    pinned = PinnedRegion(pool8, RANK, fake.cupy)
    with pytest.raises(ValueError, match="one CUDA device, got cpu"):
        CudaCopyBackend(make_kv([8], [512]), pinned)
