"""NIXL one-sided reads between two processes on this machine (UCX picks CMA or shared
memory here), of pool slots sealed in the other process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("nixl")

from distkv.names import segment_name  # noqa: E402
from distkv.pool import (  # noqa: E402
    HEADER_BYTES,
    PAGE_BYTES,
    HostPool,
    PoolLayout,
    check_landed,
    reclaim_stale_segments,
)
from distkv.directory import ReplicaInfo  # noqa: E402
from distkv.rdma import NixlAgent, RdmaUnavailable, load_nixl  # noqa: E402
from distkv.transport import NixlTransport, RowRead  # noqa: E402

LAYOUT = PoolLayout(num_rows=8, num_ranks=2, slot_bytes=2 * PAGE_BYTES)
KEY = b"rdma-block\x00\x00\x00\x00"


def payload_of(row: int, rank: int, version: int) -> np.ndarray:
    return np.random.default_rng([row, rank, version]).integers(0, 256, LAYOUT.slot_bytes, dtype=np.uint8)


def holder_main(name: str, conn) -> None:
    """Seal KEY in row 3 of every rank at generation 7, register, serve commands."""
    pool = HostPool(name, LAYOUT)
    agent = NixlAgent()
    rows = np.array([3])

    def seal(version: int, generation: int) -> None:
        for rank in range(LAYOUT.num_ranks):
            pool.begin_write(rank, rows)
            pool.payload[rank, 3] = payload_of(3, rank, version)
            pool.seal(rank, rows, [KEY], np.array([generation], dtype=np.uint64), LAYOUT.slot_bytes)

    seal(0, 7)
    conn.send(agent.endpoint(pool))
    while True:
        command = conn.recv()
        if command == "close":
            break
        seal(*command)
        conn.send("sealed")
    agent.close()
    pool.close()
    conn.send("closed")


@pytest.fixture
def holder():
    context = multiprocessing.get_context("spawn")
    name = segment_name("t" + uuid.uuid4().hex[:8], "holder")
    ours, theirs = context.Pipe()
    process = context.Process(target=holder_main, args=(name, theirs), daemon=True)
    process.start()
    endpoint = ours.recv()
    yield process, ours, endpoint
    if process.is_alive():
        ours.send("close")
        ours.recv()
    process.join(30)
    reclaim_stale_segments()  # a killed holder's


@pytest.fixture
def reader():
    pool = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "reader"), LAYOUT)
    agent = NixlAgent()
    agent.endpoint(pool)
    scratch = np.zeros((LAYOUT.num_ranks, HEADER_BYTES + 8), dtype=np.uint8)
    agent.register(scratch.ctypes.data, scratch.nbytes)
    yield pool, agent, scratch
    agent.close()
    pool.close()


def wait(read) -> str:
    """The read's state once it is no longer pending (a generous bound: a read here takes
    microseconds, and one from a dead peer fails at once)."""
    deadline = time.monotonic() + 60
    while (state := read.state()) == "pending" and time.monotonic() < deadline:
        time.sleep(0)
    read.release()
    return state


def promote(agent, endpoint, pool, scratch, remote_row: int, local_row: int, generation: int):
    """The bytes of every rank's slot of remote_row in local_row, if they check out."""
    pieces = []
    for rank in range(LAYOUT.num_ranks):
        pieces.append((LAYOUT.slot_offset(rank, remote_row), pool.address + LAYOUT.slot_offset(rank, local_row), LAYOUT.slot_bytes))
        pieces.append((LAYOUT.header_offset(rank, remote_row), scratch[rank].ctypes.data, HEADER_BYTES))
    if wait(agent.read(endpoint, np.array(pieces, dtype=np.int64))) != "done":
        return None
    generations = [(LAYOUT.header_offset(rank, remote_row), scratch[rank, HEADER_BYTES:].ctypes.data, 8) for rank in range(LAYOUT.num_ranks)]
    if wait(agent.read(endpoint, np.array(generations, dtype=np.int64))) != "done":
        return None
    metas = [
        check_landed(
            scratch[rank, :HEADER_BYTES].tobytes(),
            int(scratch[rank, HEADER_BYTES:].view("<u8")[0]),
            KEY,
            generation,
            pool.payload[rank, local_row],
        )
        for rank in range(LAYOUT.num_ranks)
    ]
    return metas if None not in metas else None


def test_a_slot_read_one_sidedly_lands_bit_exact(holder, reader):
    _, _, endpoint = holder
    pool, agent, scratch = reader
    metas = promote(agent, endpoint, pool, scratch, remote_row=3, local_row=5, generation=7)
    assert metas is not None and all(m.nbytes == LAYOUT.slot_bytes for m in metas)
    for rank in range(LAYOUT.num_ranks):
        np.testing.assert_array_equal(pool.payload[rank, 5], payload_of(3, rank, 0))


def test_a_resealed_slot_read_as_the_old_block_is_a_miss(holder, reader):
    _, conn, endpoint = holder
    pool, agent, scratch = reader
    conn.send((1, 9))  # the holder evicts the block and seals another version at generation 9
    assert conn.recv() == "sealed"
    assert promote(agent, endpoint, pool, scratch, remote_row=3, local_row=5, generation=7) is None
    assert promote(agent, endpoint, pool, scratch, remote_row=3, local_row=5, generation=9) is not None
    np.testing.assert_array_equal(pool.payload[1, 5], payload_of(3, 1, 1))


def test_nothing_outside_the_registered_segment_can_be_read(holder, reader):
    _, _, endpoint = holder
    pool, agent, _ = reader
    beyond = np.array([[endpoint.nbytes, pool.address, PAGE_BYTES]], dtype=np.int64)
    with pytest.raises(Exception):
        wait(agent.read(endpoint, beyond))


def test_a_read_from_a_killed_holder_fails_without_hanging(holder, reader):
    process, _, endpoint = holder
    pool, agent, scratch = reader
    assert promote(agent, endpoint, pool, scratch, remote_row=3, local_row=5, generation=7) is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    try:
        outcome = promote(agent, endpoint, pool, scratch, remote_row=3, local_row=6, generation=7)
    except Exception:
        outcome = None
    assert outcome is None
    agent.forget(endpoint.agent_name)
    assert agent.num_peers == 0


def test_without_nixl_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(RdmaUnavailable, match=r"pip install 'ray-distkv\[rdma\]'"):
        load_nixl()


def test_the_nixl_transport_lands_checks_and_fails_into_misses(holder):
    """NixlTransport as the Promoter drives it: slots straight into the reserved rows, each
    checked; a stale generation is a miss; a killed holder fails the transfer, drops the
    peer and gives the scratch back."""
    process, _, endpoint = holder
    local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
    transport = NixlTransport(local, NixlAgent(), scratch_slots=8)
    info = ReplicaInfo("holder", "node-a", "distkv-x-holder", LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes,
                       endpoint=endpoint)

    def run(reads):
        transfer = transport.start(info, reads, lambda: None)
        deadline = time.monotonic() + 60
        while not transfer.done() and time.monotonic() < deadline:
            time.sleep(0)
        return transfer.finish()

    try:
        landed = run([RowRead(KEY, 3, 7, 5), RowRead(KEY, 3, 8, 6)])
        assert landed[1] is None  # asked at another generation: a miss
        assert [m.nbytes for m in landed[0]] == [LAYOUT.slot_bytes] * LAYOUT.num_ranks
        for rank in range(LAYOUT.num_ranks):
            np.testing.assert_array_equal(local.payload[rank, 5], payload_of(3, rank, 0))
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        with pytest.raises(Exception):
            run([RowRead(KEY, 3, 7, 4)])
        assert transport.agent.num_peers == 0
        assert transport.scratch.take(8) is not None  # every slot of the scratch came back
    finally:
        transport.close()
        local.close()


def test_starting_an_agent_writes_nothing_to_stdout():
    """stdout is the program's: `distkv demo --json` prints its document there."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "from distkv.rdma import NixlAgent; NixlAgent().close()"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert done.stdout == ""
