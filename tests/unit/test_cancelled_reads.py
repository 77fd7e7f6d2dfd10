"""A NIXL READ given up at its promotion's deadline that NIXL cannot abort keeps its rows:
its late bytes never reach a block stored after it, and no row of it is used again before
NIXL lets the READ go.

The Promoter, its NixlTransport and ReadQueue, and the cluster manager run for real over a
one-row pool; the fake agent of test_read_queue stands in for NIXL, and the test writes
the READ's late bytes where NIXL would (the local addresses of its pieces: the reserved
row and the header scratch) at each step in turn of what follows the deadline."""

from __future__ import annotations

import ctypes
import time
import types
import uuid

import numpy as np
import pytest
from cluster_fakes import FakeDirectory, FakeLink
from test_read_queue import WAIT_S, FakeAgent

import distkv.replica.cluster_manager
import distkv.replica.protection
import distkv.transfer.promotion
from distkv.abstract import ReqContext
from distkv.replica.inflight import OVERDUE_GRACE_S
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.records import Holder, ReplicaInfo
from distkv.names import segment_name
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout
from distkv.transfer.promotion import Promoter
from distkv.transfer.endpoint_seal import EndpointSeal, new_secret
from distkv.transfer.rdma import PoolEndpoint
from distkv.transfer.transport import NixlTransport

LAYOUT = PoolLayout(num_rows=1, num_ranks=1, slot_bytes=PAGE_BYTES)
PROMOTED = b"p" * 32 + b"\0\0\0\0"  # held on another node, promoted over NIXL
STORED = b"s" * 32 + b"\0\0\0\0"  # computed here after the promotion was given up
STORED_BYTES = 0x5A
LATE_BYTES = 0xBD
TIMEOUT_S = 5.0
# after each of which the cancelled READ's bytes land, in one run each
STEPS = ["cancelled", "missed", "store reserved", "store written", "store sealed"]


class NixlStandIn(FakeAgent):
    """test_read_queue's fake agent, with what NixlTransport asks of an agent besides reads."""

    def endpoint(self, pool: HostPool) -> PoolEndpoint:
        return PoolEndpoint("requester", b"", pool.address, pool.layout.total_bytes)

    def register(self, address: int, nbytes: int) -> None:
        pass

    def forget(self, agent_name: str) -> None:
        pass

    def close(self) -> None:
        pass


def land_late_bytes(read) -> None:
    """What NIXL does with a READ it could not abort: its bytes land after all."""
    for _, address, nbytes in read.pieces.tolist():
        ctypes.memset(address, LATE_BYTES, nbytes)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.fixture
def replica(monkeypatch):
    """(manager, its pool, the stand-in agent, the transport, a hand-moved clock)."""
    now = [1000.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(distkv.transfer.promotion, "time", clock)
    monkeypatch.setattr(distkv.replica.cluster_manager, "time", clock)
    monkeypatch.setattr(distkv.replica.protection, "time", clock)
    namespace = "tcancel" + uuid.uuid4().hex[:8]
    pool = HostPool(segment_name(namespace, "local"), LAYOUT)
    directory = FakeDirectory()
    seal = EndpointSeal(namespace, new_secret(), "")
    holder_pool = segment_name(namespace, "holder")
    holder_endpoint = seal.seal(holder_pool, PoolEndpoint("holder", b"", 1 << 40, LAYOUT.total_bytes))
    directory.infos["holder"] = ReplicaInfo("holder", "node-2", holder_pool, 1, 1, PAGE_BYTES, endpoint=holder_endpoint)
    directory.holders[PROMOTED] = {"holder": Holder("holder", "node-2", 0, 7)}
    link = FakeLink(directory, ReplicaInfo("local", "node-1", pool.name, 1, 1, PAGE_BYTES))
    agent = NixlStandIn()
    transport = NixlTransport(pool, agent, seal, scratch_slots=8)
    promoter = Promoter(pool, "node-1", link.replica, transport, namespace=namespace)
    manager = ClusterOffloadingManager(1, link, promoter, promotion_timeout_s=TIMEOUT_S)
    try:
        yield manager, pool, agent, transport, now
    finally:
        agent.hold.set()
        for read in agent.posted:
            read.abortable.set()
        manager.shutdown()
        pool.close()


@pytest.mark.parametrize("landing", STEPS)
def test_late_bytes_of_a_read_nixl_could_not_abort_never_reach_a_reused_row(replica, landing):
    manager, pool, agent, transport, now = replica
    ctx = ReqContext("request")
    agent.abortable = False
    assert manager.lookup(PROMOTED, ctx) is None  # a promotion started
    read = agent.wait_posted(1)

    now[0] += TIMEOUT_S + 0.1  # past the promotion's deadline: the Promoter gives it up
    assert read.refused.wait(WAIT_S), "the Promoter never tried to abort the READ"
    if landing == "cancelled":
        land_late_bytes(read)

    now[0] += OVERDUE_GRACE_S + 0.1
    assert manager.lookup(PROMOTED, ctx) is False  # a miss: the engine computes the block
    if landing == "missed":
        land_late_bytes(read)

    reused_before_release = False
    stored = None  # (row, generation) of STORED once sealed

    def store() -> bool:
        """Store STORED as the engine and a worker's handler do; whether it got a row."""
        nonlocal stored, reused_before_release
        out = manager.prepare_store([STORED], ctx)
        if out is None or not out.keys_to_store:
            return False
        row, generation = int(out.store_spec.block_ids[0]), int(out.store_spec.generations[0])
        rows = np.array([row])
        if not read.released.is_set():
            reused_before_release = True
            if landing == "store reserved":
                land_late_bytes(read)
        pool.begin_write(0, rows)
        pool.payload[0, row] = STORED_BYTES
        if landing == "store written" and not read.released.is_set():
            land_late_bytes(read)
        pool.seal(0, rows, [STORED], np.array([generation], dtype=np.uint64), LAYOUT.slot_bytes)
        if landing == "store sealed" and not read.released.is_set():
            land_late_bytes(read)
        manager.complete_store([STORED], ctx)
        stored = (row, generation)
        return True

    if not store():
        # no row for it while the READ may still land: its row is the only one
        assert len(transport.scratch._free) == 7, "the READ's header scratch was handed out again"
        if landing.startswith("store"):
            land_late_bytes(read)  # the late bytes land now instead
        read.abortable.set()  # NIXL lets the READ go: nothing of it lands any more
        wait_for(store, "the row never came back once NIXL let the READ go")
    row, generation = stored

    out = np.empty(LAYOUT.slot_bytes, dtype=np.uint8)
    assert pool.read(0, row, STORED, generation, out) is not None, "the stored block does not check out"
    assert (out == STORED_BYTES).all(), "the stored block holds the cancelled READ's bytes"
    assert manager.lookup(STORED, ctx) is True
    assert not reused_before_release, "the READ's row was used again before NIXL let the READ go"
    assert manager.promoter.succeeded["cross_node"] == 0 and manager.promoter.failed["cross_node"] == 1
    wait_for(lambda: len(transport.scratch._free) == 8, "the READ's header scratch never came back")
