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
from distkv.storage.slots import HEADER_BYTES, check_landed
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout
from distkv.storage.segments import reclaim_stale_segments
from distkv.directory.records import ReplicaInfo  # noqa: E402
from distkv.transfer.endpoint_seal import EndpointSeal, new_secret  # noqa: E402
from distkv.transfer.landing import ChunkLanding  # noqa: E402
from distkv.transfer.rdma import NixlAgent, RdmaUnavailable, load_nixl  # noqa: E402
from distkv.transfer.transport import NixlTransport, NodeTransports, RowRead, Transfer, Transport  # noqa: E402

LAYOUT = PoolLayout(num_rows=8, num_ranks=2, slot_bytes=2 * PAGE_BYTES)
KEY = b"rdma-block\x00\x00\x00\x00"
# the requesters' and the holder's cache namespace, and the holder's pool in it
SECRET = new_secret()
SEAL = EndpointSeal("x", SECRET, "")
HOLDER_POOL = "distkv-x-holder"


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
        if command == "close pool":  # the replica shut down or reset; its process lives on
            agent.close()
            pool.close()
            conn.send("pool closed")
        elif command == "reopen":  # the reset replica's new pool, registered with a new agent
            pool = HostPool(name, LAYOUT)
            agent = NixlAgent()
            seal(0, 11)
            conn.send(agent.endpoint(pool))
        else:
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


def land(transfer, what: str):
    """What a transfer landed, or None when it failed; fails if it is not done within a
    bound far beyond a failed read."""
    deadline = time.monotonic() + 60
    while not transfer.done():
        assert time.monotonic() < deadline, f"{what} hangs"
        time.sleep(0)
    try:
        return transfer.finish()
    except Exception:
        return None


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


def test_connected_agents_at_rest_take_next_to_no_cpu(holder, reader):
    """NIXL's progress thread sleeps until UCX has an event: a reader that has read and
    the holder it read from, both idle, take next to no CPU (NIXL's Python API alone
    starts that thread polling without pause: a core per agent)."""
    import psutil

    process, _, endpoint = holder
    pool, agent, scratch = reader
    assert promote(agent, endpoint, pool, scratch, remote_row=3, local_row=5, generation=7) is not None
    holder_process = psutil.Process(process.pid)
    ours, theirs = time.process_time(), sum(holder_process.cpu_times()[:2])
    time.sleep(1.0)
    ours, theirs = time.process_time() - ours, sum(holder_process.cpu_times()[:2]) - theirs
    assert ours < 0.25 and theirs < 0.25, f"CPU seconds in a second at rest: reader {ours:.3f}, holder {theirs:.3f}"


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
    transport = NixlTransport(local, NixlAgent(), SEAL, scratch_slots=8)
    info = ReplicaInfo("holder", "node-a", HOLDER_POOL, LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes,
                       endpoint=SEAL.seal(HOLDER_POOL, endpoint))

    def run(reads):
        transfer = transport.start(info, reads, lambda: None)
        deadline = time.monotonic() + 60
        while not transfer.done() and time.monotonic() < deadline:
            time.sleep(0)
        return transfer.finish()

    try:
        elsewhere = ChunkLanding(np.zeros((2, LAYOUT.slot_bytes), dtype=np.uint8))
        with pytest.raises(ValueError, match="did not admit"):  # memory NIXL was not given
            transport.start(info, [RowRead(KEY, 3, 7, 0)], lambda: None, elsewhere)
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


def test_connect_reaches_a_holder_in_the_background_and_a_dead_one_is_forgotten(holder):
    """`connect` wires the agents up with a READ of its own, so that no transfer waits for
    it; a holder that cannot be reached is not connected, its peer is dropped, its
    scratch given back, and the next `connect` tries again."""
    process, _, endpoint = holder
    local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
    transport = NixlTransport(local, NixlAgent(), SEAL, scratch_slots=8)
    info = ReplicaInfo("holder", "node-a", HOLDER_POOL, LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes,
                       endpoint=SEAL.seal(HOLDER_POOL, endpoint))

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"never {what}"
            time.sleep(0.001)

    try:
        assert not transport.connected(info)
        transport.connect(info)
        transport.connect(info)  # connecting: nothing more
        until(lambda: transport.connected(info), "connected")
        assert transport.agent.num_peers == 1 and len(transport.scratch._free) == 8
        assert land(transport.start(info, [RowRead(KEY, 3, 7, 5)], lambda: None), "a read")[0] is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        assert land(transport.start(info, [RowRead(KEY, 3, 7, 4)], lambda: None), "a read of a killed holder") is None
        assert not transport.connected(info) and transport.agent.num_peers == 0
        transport.connect(info)  # a new try, which fails too
        until(lambda: transport.agent.num_peers == 0 and len(transport.scratch._free) == 8, "forgotten")
        assert not transport.connected(info)
    finally:
        transport.close()
        local.close()


def test_starting_an_agent_writes_nothing_to_stdout():
    """stdout is the program's: `distkv demo --json` prints its document there."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "from distkv.transfer.rdma import NixlAgent; NixlAgent().close()"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert done.stdout == ""


def test_a_closed_holder_pool_fails_reads_into_misses_and_is_forgotten(holder):
    """The holder replica shuts down or resets (its pool closed, its agent gone, its
    process alive) while this requester has its descriptors cached: every later read of
    it fails at once, the peer is dropped, the scratch comes back; the reset holder's new
    pool is read afresh, and a read through the old descriptors stays a failure."""
    _, conn, endpoint = holder
    local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
    transport = NixlTransport(local, NixlAgent(), SEAL, scratch_slots=8)

    def info(endpoint):
        return ReplicaInfo("holder", "node-a", HOLDER_POOL, LAYOUT.num_rows, LAYOUT.num_ranks,
                           LAYOUT.slot_bytes, endpoint=SEAL.seal(HOLDER_POOL, endpoint))

    def run(endpoint, generation):
        """What landed, or None when the transfer failed; never past a bound far beyond a failed read."""
        try:
            transfer = transport.start(info(endpoint), [RowRead(KEY, 3, generation, 5)], lambda: None)
        except Exception:
            return None
        return land(transfer, "a read of a closed pool")

    try:
        assert run(endpoint, 7)[0] is not None  # the descriptors are cached now
        conn.send("close pool")
        assert conn.recv() == "pool closed"
        for _ in range(3):
            assert run(endpoint, 7) is None
            assert transport.agent.num_peers == 0
        conn.send("reopen")
        reopened = conn.recv()
        assert reopened.agent_name != endpoint.agent_name
        landed = run(reopened, 11)
        assert landed[0] is not None
        for rank in range(LAYOUT.num_ranks):
            np.testing.assert_array_equal(local.payload[rank, 5], payload_of(3, rank, 0))
        stale = run(endpoint, 7)  # a view that still lists the old pool
        assert stale is None or stale[0] is None
        assert run(reopened, 11)[0] is not None
        assert transport.agent.num_peers == 1  # the reset holder's new agent only
        assert transport.scratch.take(8) is not None  # every slot of the scratch came back
    finally:
        transport.close()
        local.close()


class SteppedAgent(NixlAgent):
    """A NixlAgent that runs `at(step)` at each step of a reader's sequence of READs:
    before the n-th READ is issued, once it is issued, and once it is first seen done
    (before the reader goes on)."""

    def __init__(self) -> None:
        super().__init__()
        self.at = lambda step: None
        self.reads = 0

    def read(self, remote, pieces, *args, **kw):
        n = self.reads
        self.reads += 1
        self.at(f"before read {n}")
        read = super().read(remote, pieces, *args, **kw)
        self.at(f"read {n} issued")
        return SteppedRead(read, lambda: self.at(f"read {n} done"))


class SteppedRead:
    def __init__(self, read, on_done) -> None:
        self._read = read
        self._on_done = on_done

    def state(self) -> str:
        state = self._read.state()
        if state == "done" and self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()
        return state

    def release(self) -> bool:
        return self._read.release()


# NixlTransport's sequence: read 0 brings the slots and headers, read 1 the generations.
STEPS = ["before read 0", "read 0 issued", "read 0 done", "read 1 issued", "read 1 done"]
OTHER_KEY = b"other-block\x00\x00\x00"


@pytest.fixture(scope="module")
def one_sided():
    """A holder pool registered with its own agent, and a requester's NixlTransport reading
    it: two NIXL agents over real UCX, in one process, so that the test acts as the holder
    at any step of the requester's reads."""
    holder_pool = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "holder"), LAYOUT)
    holder_agent = NixlAgent()
    endpoint = holder_agent.endpoint(holder_pool)
    local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
    transport = NixlTransport(local, SteppedAgent(), SEAL, scratch_slots=8)
    info = ReplicaInfo("holder", "node-a", HOLDER_POOL, LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes,
                       endpoint=SEAL.seal(HOLDER_POOL, endpoint))
    yield holder_pool, transport, info, iter(range(100, 1 << 30, 2))
    transport.close()
    local.close()
    holder_agent.close()
    holder_pool.close()


def write_row(pool, row, version, key=None, generation=0, ranks=range(LAYOUT.num_ranks)) -> None:
    """Evict and rewrite `row` as a writer does: generation zeroed, then the bytes of
    `version`, then (if a key is given) the header, generation last."""
    rows = np.array([row])
    for rank in ranks:
        pool.begin_write(rank, rows)
        pool.payload[rank, row] = payload_of(row, rank, version)
        if key is not None:
            pool.seal(rank, rows, [key], np.array([generation], dtype=np.uint64), LAYOUT.slot_bytes)


# What the holder does to the row being read: evict it (generation zeroed), leave it half
# rewritten, rewrite it as the same key at a new generation, or as another key.
WRITES = {
    "evicted": lambda pool, gen: [pool.begin_write(rank, np.array([3])) for rank in range(LAYOUT.num_ranks)],
    "half rewritten": lambda pool, gen: write_row(pool, 3, 1),
    "rewritten": lambda pool, gen: write_row(pool, 3, 1, KEY, gen),
    "another key": lambda pool, gen: write_row(pool, 3, 2, OTHER_KEY, gen),
    "one rank rewritten": lambda pool, gen: write_row(pool, 3, 1, KEY, gen, ranks=[1]),
}
CASES = [(((step, write),)) for step in STEPS for write in WRITES] + [
    ((first, "evicted"), (then, write))
    for i, first in enumerate(STEPS)
    for then in STEPS[i + 1 :]
    for write in ("rewritten", "another key")
]


@pytest.mark.parametrize("actions", CASES, ids=lambda actions: " then ".join(f"{w} at {s}" for s, w in actions))
def test_a_row_rewritten_at_any_step_of_a_nixl_read_lands_exact_or_misses(one_sided, actions):
    """The holder evicts and rewrites the row at exactly one step (or two) of the real
    READs: what the requester keeps is the original block's bytes or a miss, never others.
    A writer who acted before the generations' READ was issued is seen (a miss); one who
    acts after it landed is too late to matter (the original)."""
    holder_pool, transport, info, generations = one_sided
    original = next(generations)
    write_row(holder_pool, 3, 0, KEY, original)
    local = transport.pool
    rows = np.array([5])
    for rank in range(LAYOUT.num_ranks):
        local.begin_write(rank, rows)  # as the Promoter does before a transfer
        local.payload[rank, 5] = 0xEE
    pending = list(actions)

    def at(step: str) -> None:
        while pending and pending[0][0] == step:
            WRITES[pending.pop(0)[1]](holder_pool, original + 1)

    transport.agent.reads = 0
    transport.agent.at = at
    try:
        transfer = transport.start(info, [RowRead(KEY, 3, original, 5)], lambda: None)
        deadline = time.monotonic() + 60
        while not transfer.done():
            assert time.monotonic() < deadline
            time.sleep(0)
        (metas,) = transfer.finish()
    finally:
        transport.agent.at = lambda step: None
    assert not pending, f"steps never reached: {pending}"
    first = STEPS.index(actions[0][0])
    if metas is not None:
        assert first >= STEPS.index("read 1 issued"), "a writer seen before the generations' READ was issued went unnoticed"
        for rank in range(LAYOUT.num_ranks):
            np.testing.assert_array_equal(local.payload[rank, 5], payload_of(3, rank, 0))
        assert [m.nbytes for m in metas] == [LAYOUT.slot_bytes] * LAYOUT.num_ranks
    else:
        assert first < STEPS.index("read 1 done"), "a rewrite after every READ landed spoiled the copy"
    assert len(transport.scratch._free) == 8 and transport.agent.num_peers == 1  # nothing held


def test_a_holder_that_left_is_forgotten_even_with_a_read_in_flight(holder):
    """forget_gone (the Promoter's periodic sweep): a holder still registered is kept; one
    the Directory no longer lists is dropped, a read of it in flight ends without hanging
    and gives its scratch back, and the next read of it connects afresh."""
    _, _, endpoint = holder
    local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
    transport = NixlTransport(local, NixlAgent(), SEAL, scratch_slots=8)
    info = ReplicaInfo("holder", "node-a", HOLDER_POOL, LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes,
                       endpoint=SEAL.seal(HOLDER_POOL, endpoint))

    try:
        assert land(transport.start(info, [RowRead(KEY, 3, 7, 5)], lambda: None), "a read of a forgotten holder")[0] is not None
        transport.forget_gone(lambda replica_id: info)
        assert transport.agent.num_peers == 1
        in_flight = transport.start(info, [RowRead(KEY, 3, 7, 6)], lambda: None)
        transport.forget_gone(lambda replica_id: None)
        assert transport.agent.num_peers == 0
        landed = land(in_flight, "a read of a forgotten holder")
        if landed is not None and landed[0] is not None:
            np.testing.assert_array_equal(local.payload[1, 6], payload_of(3, 1, 0))
        assert len(transport.scratch._free) == 8
        assert land(transport.start(info, [RowRead(KEY, 3, 7, 5)], lambda: None), "a read of a forgotten holder")[0] is not None
        assert transport.agent.num_peers == 1
    finally:
        transport.close()
        local.close()


def test_whoever_holds_a_pools_endpoint_can_write_into_it():
    """Why an endpoint goes out sealed: NIXL 1.5 registers memory for remote WRITEs as well
    as READs (UCX's memory keys grant both), so whoever holds a pool's endpoint changes its
    bytes, headers and checksums included, with no call the holder sees. distkv itself only
    reads."""
    api = load_nixl()
    pool = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "holder"), LAYOUT)
    holder_agent = NixlAgent()
    endpoint = holder_agent.endpoint(pool)
    intruder = api.nixl_agent(f"intruder-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    source = np.full(LAYOUT.slot_bytes, 0xAB, dtype=np.uint8)
    registered = intruder.register_memory([(source.ctypes.data, source.nbytes, 0, "")], "DRAM")
    try:
        peer = intruder.add_remote_agent(endpoint.agent_metadata)
        handle = intruder.initialize_xfer(
            "WRITE",
            intruder.get_xfer_descs(np.array([[source.ctypes.data, source.nbytes, 0]], dtype=np.int64), "DRAM"),
            intruder.get_xfer_descs(
                np.array([[endpoint.address + LAYOUT.slot_offset(1, 2), source.nbytes, 0]], dtype=np.int64), "DRAM"
            ),
            peer,
        )
        state = intruder.transfer(handle)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = intruder.check_xfer_state(handle)
        intruder.release_xfer_handle(handle)
        assert state == "DONE"
        np.testing.assert_array_equal(pool.payload[1, 2], source)
    finally:
        intruder.deregister_memory(registered)
        holder_agent.close()
        pool.close()


class ObjectStoreStandIn(Transport):
    """The object store's place in NodeTransports: records the holders it was asked to read."""

    name = "object_store"

    def __init__(self) -> None:
        self.served: list[str] = []

    def start(self, holder, reads, wake, into=None) -> Transfer:
        self.served.append(holder.replica_id)
        return Served()


class Served(Transfer):
    transport = "object_store"

    def done(self) -> bool:
        return True

    def finish(self):
        return [None]

    def cancel(self) -> None:
        pass


def test_an_endpoint_that_does_not_open_is_no_endpoint_and_the_object_store_serves_its_holder(holder, caplog):
    """A holder's sealed endpoint altered in the Directory, sealed by a replica with another
    tenant salt or without the namespace's secret, or sealed for another pool: it opens to
    nothing here, so with `transport` "nixl" or "auto" alike the object store serves that
    holder, no NIXL peer is added, nothing raises, and the replica says why once per holder.
    A member's endpoint is read through NIXL, exact."""
    _, _, endpoint = holder
    local = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "requester"), LAYOUT)
    nixl = NixlTransport(local, NixlAgent(), SEAL, scratch_slots=8)
    sealed = SEAL.seal(HOLDER_POOL, endpoint)
    unopenable = {
        "altered": sealed[:-1] + bytes([sealed[-1] ^ 1]),
        "other salt": EndpointSeal("x", SECRET, "another tenant").seal(HOLDER_POOL, endpoint),
        "no secret": EndpointSeal("x", new_secret(), "").seal(HOLDER_POOL, endpoint),
        "another pool": SEAL.seal("distkv-x-other", endpoint),
    }

    def info(blob: bytes, replica: str = "holder") -> ReplicaInfo:
        return ReplicaInfo(replica, "node-a", HOLDER_POOL, LAYOUT.num_rows, LAYOUT.num_ranks, LAYOUT.slot_bytes, endpoint=blob)

    try:
        for mode in ("nixl", "auto"):
            for why, blob in unopenable.items():
                store = ObjectStoreStandIn()
                chooser = NodeTransports(store, nixl, mode)
                transfer = chooser.start(info(blob, why), [RowRead(KEY, 3, 7, 5)], lambda: None)
                assert (transfer.transport, store.served) == ("object_store", [why]), (mode, why)
                assert transfer.finish() == [None]
                assert nixl.agent.num_peers == 0
        warned = [r.getMessage() for r in caplog.records if "does not open" in r.getMessage()]
        assert len(warned) == len(unopenable) and all(f"replica {why} " in " ".join(warned) for why in unopenable)
        store = ObjectStoreStandIn()
        member = NodeTransports(store, nixl, "nixl").start(info(sealed), [RowRead(KEY, 3, 7, 5)], lambda: None)
        assert member.transport == "nixl" and store.served == []
        assert land(member, "a member's read")[0] is not None
        for rank in range(LAYOUT.num_ranks):
            np.testing.assert_array_equal(local.payload[rank, 5], payload_of(3, rank, 0))
    finally:
        nixl.close()
        local.close()
