"""The slot protocol under every interleaving of one writer with one reader.

A writer (the holder replica) rewrites a row while a reader reads the block it held. The
reader runs its real code over a mapping of the pool whose arrays call back before every
access (a read or write of a header or of payload bytes); the callback takes the writer's
next steps wherever the schedule puts them. Every placement of the writer's steps among
the reader's accesses is run, and none may deliver bytes under a key and generation other
than the ones they were sealed with: a reader that cannot be sure answers a miss.

The writer's steps are those of a store into an occupied row: evict the block (the
manager's bookkeeping, no byte of the pool changes, so where it falls among the reader's
accesses changes nothing and it is taken first), begin_write, the payload in two halves
(so that a copy may be torn), seal.
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from distkv.abstract import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from distkv.storage.handlers import make_handlers
from distkv.replica.local_manager import LocalOffloadingManager
from distkv.names import segment_name
from distkv.storage.slots import HEADER_BYTES, check_landed
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout, PoolLoadStoreSpec
from distkv.storage.readers import read_rows
from distkv.directory.records import ReplicaInfo
from distkv.storage.tier_copies import load_row
from distkv.transfer.transport import ObjectStoreTransport, RowRead

SLOT_BYTES = PAGE_BYTES
HALF = SLOT_BYTES // 2
LAYOUT = PoolLayout(num_rows=2, num_ranks=1, slot_bytes=SLOT_BYTES)
KEY_A = make_offload_key(b"block-a", 0)
KEY_B = make_offload_key(b"block-b", 0)
CTX = ReqContext(req_id="slot-protocol")


class Traced(np.ndarray):
    """An array that calls `Traced.step` before each access to its elements.

    A view of one is one too, and every read of the pool's bytes in distkv goes through an
    index or `tobytes` of the pool's arrays right before it, so the callback runs between
    any two of a reader's accesses.
    """

    step: Callable[[], None] = staticmethod(lambda: None)

    def __getitem__(self, index):
        Traced.step()
        return super().__getitem__(index)

    def __setitem__(self, index, value):
        Traced.step()
        super().__setitem__(index, value)

    def tobytes(self, order="C"):
        Traced.step()
        return super().tobytes(order)


def traced(pool: HostPool) -> HostPool:
    """`pool`, with its arrays traced."""
    pool._words = pool._words.view(Traced)
    pool._headers = pool._headers.view(Traced)
    pool.payload = pool.payload.view(Traced)
    return pool


class Schedule:
    """Takes writer step i just before the reader's access number positions[i]."""

    def __init__(self, positions: tuple[int, ...], steps: list[Callable[[], None]]) -> None:
        self.positions = positions
        self.steps = steps
        self.accesses = 0
        self.taken = 0

    def __call__(self) -> None:
        while self.taken < len(self.steps) and self.positions[self.taken] <= self.accesses:
            self.steps[self.taken]()
            self.taken += 1
        self.accesses += 1

    def finish(self) -> None:
        for step in self.steps[self.taken :]:
            step()


class Row:
    """Row 1 of a pool, holding KEY_A: the holder's writer and what was sealed in it."""

    def __init__(self, new_key: bytes) -> None:
        self.name = segment_name("t" + uuid.uuid4().hex[:8], "holder")
        self.holder = HostPool(self.name, LAYOUT)
        self.new_key = new_key
        rng = np.random.default_rng(0)
        self.old_bytes = rng.integers(0, 256, SLOT_BYTES, dtype=np.uint8)
        self.new_bytes = rng.integers(0, 256, SLOT_BYTES, dtype=np.uint8)

    def reset(self) -> None:
        """KEY_A stored in row 1 of a fresh manager, its bytes sealed there."""
        self.manager = LocalOffloadingManager(LAYOUT.num_rows)
        self.manager.prepare_store([make_offload_key(b"other", 0)], CTX)  # takes row 0
        out = self.manager.prepare_store([KEY_A], CTX)
        self.row, self.generation = int(out.store_spec.block_ids[0]), int(out.store_spec.generations[0])
        self.manager.complete_store([KEY_A], CTX)
        rows = np.array([self.row])
        self.holder.begin_write(0, rows)
        self.holder.payload[0, self.row] = self.old_bytes
        self.holder.seal(0, rows, [KEY_A], np.array([self.generation], dtype=np.uint64), SLOT_BYTES)

    def writer_steps(self) -> list[Callable[[], None]]:
        """A store of new_key into the row KEY_A holds, its eviction already done."""
        # evict KEY_A by a store that finds no free row, which then fails and frees the row
        filler = make_offload_key(b"filler", 0)
        assert self.manager.prepare_store([filler], CTX).evicted_keys == [KEY_A]
        self.manager.complete_store([filler], CTX, success=False)
        out = self.manager.prepare_store([self.new_key], CTX)
        assert list(out.store_spec.block_ids) == [self.row]
        rows = np.array([self.row])
        generation = np.array([int(out.store_spec.generations[0])], dtype=np.uint64)
        payload = self.holder.payload[0, self.row]

        def first_half():
            payload[:HALF] = self.new_bytes[:HALF]

        def second_half():
            payload[HALF:] = self.new_bytes[HALF:]

        return [
            lambda: self.holder.begin_write(0, rows),
            first_half,
            second_half,
            lambda: self.holder.seal(0, rows, [self.new_key], generation, SLOT_BYTES),
        ]

    def close(self) -> None:
        self.holder.close()


# ---- the readers: each returns the bytes it delivers as KEY_A's, or None for a miss ----


class SameNodeRead:
    """A promoter on the holder's node: `HostPool.read` of the holder's mapped segment."""

    def __init__(self, row: Row) -> None:
        self.pool = traced(HostPool(row.name, LAYOUT, create=False, member=False))

    def __call__(self, row: Row) -> np.ndarray | None:
        out = np.zeros(SLOT_BYTES, dtype=np.uint8)
        return out if self.pool.read(0, row.row, KEY_A, row.generation, out) is not None else None

    def close(self) -> None:
        self.pool.close()


class AgentRead:
    """A NodeAgent's `read_rows`, Ray's copy of its result (in two halves, so that it may
    be torn), and the requester's ObjectStoreTransport, which copies and checks each slot
    into the row reserved for it."""

    def __init__(self, row: Row) -> None:
        self.pool = traced(HostPool(row.name, LAYOUT, create=False, member=False))
        self.local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
        self.holder = ReplicaInfo("holder", "node-a", row.name, LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes)
        self.transport = ObjectStoreTransport(self.local, self.agent_read)

    def agent_read(self, info, rows, keys, generations) -> Future:
        data, metas = read_rows(self.pool, rows, keys, generations)
        if data is not None:
            data = np.concatenate([data[..., :HALF], data[..., HALF:]], axis=-1)
        future: Future = Future()
        future.set_result((data, metas))
        return future

    def __call__(self, row: Row) -> np.ndarray | None:
        transfer = self.transport.start(self.holder, [RowRead(KEY_A, row.row, row.generation, 0)], lambda: None)
        (metas,) = transfer.finish()
        return self.local.payload[0, 0].copy() if metas is not None else None

    def close(self) -> None:
        self.pool.close()
        self.local.close()


class LocalLoad:
    """The holder's own worker loading the block: its LoadHandler on the CPU backend."""

    def __init__(self, row: Row) -> None:
        self.pool = traced(HostPool(row.name, LAYOUT, create=False))
        self.kv = torch.zeros((1, SLOT_BYTES), dtype=torch.uint8)
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(self.kv, SLOT_BYTES)], [[CanonicalKVCacheRef(0, SLOT_BYTES)]])
        (_, _, self.store), (_, _, self.load) = make_handlers(caches, self.pool, 0, 1, device="cpu")
        self.jobs = itertools.count()

    def __call__(self, row: Row) -> np.ndarray | None:
        self.kv.zero_()
        job = next(self.jobs)
        spec = (PoolLoadStoreSpec([row.row], [KEY_A], [row.generation]), GPULoadStoreSpec([0], [1], [0]))
        assert self.load.transfer_async(job, spec)
        self.load.wait({job})
        (result,) = self.load.get_finished()
        return self.kv[0].numpy().copy() if result.success else None

    def close(self) -> None:
        self.store.shutdown()
        self.load.shutdown()
        self.pool.close()


class OneSidedRead:
    """A one-sided read (RDMA) of the holder's slot: its header and payload land in the
    given order of four pieces (the header's generation word, the rest of the header, the
    payload's halves: RDMA orders none of them), then a second read of the generation,
    and `check_landed` decides."""

    def __init__(self, row: Row, order: tuple[int, ...]) -> None:
        self.pool = traced(HostPool(row.name, LAYOUT, create=False, member=False))
        self.order = order

    def __call__(self, row: Row) -> np.ndarray | None:
        header = np.zeros(HEADER_BYTES, dtype=np.uint8)
        payload = np.zeros(SLOT_BYTES, dtype=np.uint8)
        remote_header, remote_payload = self.pool._headers[0, row.row], self.pool.payload[0, row.row]
        pieces = [
            lambda: header.__setitem__(slice(0, 8), remote_header[:8]),
            lambda: header.__setitem__(slice(8, None), remote_header[8:]),
            lambda: payload.__setitem__(slice(0, HALF), remote_payload[:HALF]),
            lambda: payload.__setitem__(slice(HALF, None), remote_payload[HALF:]),
        ]
        for piece in self.order:
            pieces[piece]()
        generation_after = int(self.pool._words[0, row.row, 0])
        meta = check_landed(header.tobytes(), generation_after, KEY_A, row.generation, payload)
        return payload if meta is not None else None

    def close(self) -> None:
        self.pool.close()


class TierLoad:
    """distkv's vLLM tier loading the block into a chunk of vLLM's primary tier
    (`distkv.storage.tier_copies.load_row`): the holder's own mapping of its pool."""

    def __init__(self, row: Row) -> None:
        self.pool = traced(HostPool(row.name, LAYOUT, create=False))
        self.primary = np.zeros((2, SLOT_BYTES), dtype=np.uint8)

    def __call__(self, row: Row) -> np.ndarray | None:
        self.primary[1] = 0
        return self.primary[1].copy() if load_row(self.pool, self.primary, row.row, KEY_A, row.generation, 1) else None

    def close(self) -> None:
        self.pool.close()


READERS = [SameNodeRead, AgentRead, LocalLoad, TierLoad]


def explore(reader_kind, new_key: bytes) -> dict[str, int]:
    """Run the reader under every placement of the writer's steps; count the outcomes."""
    row = Row(new_key)
    reader = reader_kind(row)
    try:
        row.reset()
        counter = Schedule((), [])
        Traced.step = counter
        assert np.array_equal(reader(row), row.old_bytes), "the reader misses with no writer at all"
        accesses = counter.accesses
        outcomes = {"delivered": 0, "missed": 0}
        for positions in itertools.combinations_with_replacement(range(accesses + 1), 4):
            row.reset()
            schedule = Schedule(positions, row.writer_steps())
            Traced.step = schedule
            got = reader(row)
            Traced.step = lambda: None
            schedule.finish()
            assert schedule.accesses <= accesses, "a run took more accesses than the writer-free one"
            if got is None:
                outcomes["missed"] += 1
            else:
                assert np.array_equal(got, row.old_bytes), (
                    f"{getattr(reader_kind, '__name__', reader_kind)} delivered other bytes as {KEY_A!r}@{row.generation} "
                    f"with the writer's steps before its accesses {positions}"
                )
                outcomes["delivered"] += 1
        return outcomes
    finally:
        Traced.step = lambda: None
        reader.close()
        row.close()


@pytest.mark.parametrize("reader_kind", READERS, ids=lambda r: r.__name__)
@pytest.mark.parametrize("new_key", [KEY_B, KEY_A], ids=["another_key", "same_key_new_generation"])
def test_no_interleaving_delivers_bytes_under_another_key(reader_kind, new_key):
    outcomes = explore(reader_kind, new_key)
    # Both outcomes occur, so the schedules did reach the reader: a writer done before the
    # reader starts is a miss, one that starts after the reader is done is a hit.
    assert outcomes["delivered"] > 0 and outcomes["missed"] > 0, outcomes


@pytest.mark.parametrize("new_key", [KEY_B, KEY_A], ids=["another_key", "same_key_new_generation"])
def test_no_interleaving_of_a_one_sided_read_delivers_bytes_under_another_key(new_key):
    for order in itertools.permutations(range(4)):
        outcomes = explore(functools.partial(OneSidedRead, order=order), new_key)
        assert outcomes["delivered"] > 0 and outcomes["missed"] > 0, (order, outcomes)
