"""The Promoter on its own: every promotion ends exactly once, whatever one of them raises."""

import errno
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import Future

import numpy as np
import pytest

import distkv.storage.readers
import distkv.transfer.promotion as promotion
from distkv.directory.records import Holder, ReplicaInfo
from distkv.names import segment_name
from distkv.storage.pool import HostPool, PoolLayout
from distkv.storage.readers import read_rows
from distkv.transfer.landing import ChunkLanding
from distkv.transfer.promotion import Promoter, Promotion
from distkv.transfer.transport import ObjectStoreTransport

LAYOUT_FIELDS = (8, 2, 4096)  # rows, ranks, slot bytes
LAYOUT = PoolLayout(*LAYOUT_FIELDS)
NODE = "node-1"
# far enough that no promotion under test times out
DEADLINE_S = 60.0
# a generous bound on a promotion ending, which is not what is tested
END_WITHIN_S = 10.0


def key_of(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"promotion-test-key-" + bytes(13)


class Holding:
    """A holder replica's pool with a block sealed in each row: key_of(row) at generation 7."""

    def __init__(self, namespace: str, replica_id: str, node_id: str = NODE):
        self.pool = HostPool(segment_name(namespace, replica_id), LAYOUT)
        self.info = ReplicaInfo(replica_id, node_id, self.pool.name, *LAYOUT_FIELDS)
        rng = np.random.default_rng(len(replica_id))
        self.blocks = rng.integers(0, 256, (LAYOUT.num_ranks, LAYOUT.num_rows, LAYOUT.slot_bytes), dtype=np.uint8)
        rows = np.arange(LAYOUT.num_rows)
        for rank in range(LAYOUT.num_ranks):
            self.pool.begin_write(rank, rows)
            self.pool.payload[rank] = self.blocks[rank]
            self.pool.seal(
                rank, rows, [key_of(r) for r in rows.tolist()], np.full(LAYOUT.num_rows, 7, dtype=np.uint64), LAYOUT.slot_bytes
            )

    def promotion(self, row: int) -> Promotion:
        """A promotion of this holder's block in `row` into the same row of the local pool."""
        return Promotion(key_of(row), row, 100 + row, (Holder(self.info.replica_id, self.info.node_id, row, 7),),
                         time.monotonic() + DEADLINE_S)


class Fetch:
    """A cross-node fetch whose futures the test resolves: `answer` sets the rows' read."""

    def __init__(self):
        self.pending: list[tuple[Future, ReplicaInfo, list[int], list[bytes], list[int]]] = []

    def __call__(self, info, rows, keys, generations):
        future = Future()
        self.pending.append((future, info, rows, keys, generations))
        return future

    def answer(self, transform=lambda read: read):
        future, info, rows, keys, generations = self.pending.pop(0)
        pool = HostPool(info.pool_name, promotion.layout_of(info), create=False, member=False)
        try:
            data, metas = read_rows(pool, rows, keys, generations)
            read = (np.array(data), metas)
        finally:
            pool.close()
        future.set_result(transform(read))

    def fail(self, error: BaseException):
        self.pending.pop(0)[0].set_exception(error)

    def forget_gone(self, replica_info):
        pass


@pytest.fixture
def namespace():
    return "tprom" + uuid.uuid4().hex[:8]


@pytest.fixture
def world(namespace):
    """(local pool, holders by replica id, fetch, promoter, the infos the promoter knows)."""
    local = HostPool(segment_name(namespace, "local"), LAYOUT)
    holders = {}
    try:
        holders["same"] = Holding(namespace, "same")
        holders["remote"] = Holding(namespace, "remote", node_id="node-2")
        fetch = Fetch()
        infos = {h.info.replica_id: h.info for h in holders.values()}
        promoter = Promoter(local, NODE, infos.get, ObjectStoreTransport(local, fetch), namespace=namespace)
        yield local, holders, fetch, promoter, infos
        promoter.close()
    finally:
        for h in holders.values():
            h.pool.close()
        local.close()
    assert not [name for name in os.listdir("/dev/shm") if namespace in name]


def ended(promoter: Promoter, count: int) -> dict[bytes, bool]:
    """key -> success of the next `count` promotions to end; fails the test past END_WITHIN_S."""
    outcomes: dict[bytes, bool] = {}
    start = time.monotonic()
    while len(outcomes) < count:
        if time.monotonic() - start > END_WITHIN_S:
            pytest.fail(f"{count - len(outcomes)} promotion(s) never ended (thread alive: {promoter._thread.is_alive()})")
        for key, ok, _ in promoter.finished():
            assert key not in outcomes, "a promotion ended twice"
            outcomes[key] = ok
        time.sleep(0.001)
    return outcomes


def holds_block(local: HostPool, holder: Holding, row: int) -> bool:
    out = np.empty(LAYOUT.slot_bytes, dtype=np.uint8)
    for rank in range(LAYOUT.num_ranks):
        if local.read(rank, row, key_of(row), 100 + row, out) is None or not np.array_equal(out, holder.blocks[rank, row]):
            return False
    return True


OPEN_ERRORS = [
    PermissionError(errno.EACCES, "Permission denied"),
    OSError(errno.EMFILE, "Too many open files"),
    MemoryError(),
    RuntimeError("could not open pool segment: it kept being replaced"),
]


@pytest.mark.parametrize("error", OPEN_ERRORS, ids=lambda e: type(e).__name__ + str(getattr(e, "errno", "") or ""))
def test_a_holder_pool_that_cannot_be_opened_fails_only_its_promotions(world, monkeypatch, error):
    local, holders, _, promoter, _ = world
    same = holders["same"]
    failing = {same.pool.name}

    def host_pool(name, *args, **kwargs):
        if name in failing:
            raise error
        return HostPool(name, *args, **kwargs)

    monkeypatch.setattr(distkv.storage.readers, "HostPool", host_pool)  # what PoolReaders opens with
    promoter.submit(same.promotion(0))
    promoter.submit(same.promotion(1))
    assert ended(promoter, 2) == {key_of(0): False, key_of(1): False}
    assert promoter.errors.counts() == {"promotion_fetch": 2}
    assert promoter.failed["same_node"] == 2

    failing.clear()
    promoter.submit(same.promotion(2))
    assert ended(promoter, 1) == {key_of(2): True}
    assert holds_block(local, same, 2)
    assert promoter._thread.is_alive()


def test_a_write_that_raises_fails_that_promotion_only(world, monkeypatch):
    local, holders, fetch, promoter, _ = world
    same, remote = holders["same"], holders["remote"]
    seal = local.seal
    failing_rows = {1, 4}

    def seal_or_raise(rank, rows, *args, **kwargs):
        if int(rows[0]) in failing_rows:
            raise MemoryError("no memory for the write")
        return seal(rank, rows, *args, **kwargs)

    monkeypatch.setattr(local, "seal", seal_or_raise)
    for row in range(3):
        promoter.submit(same.promotion(row))
    assert ended(promoter, 3) == {key_of(0): True, key_of(1): False, key_of(2): True}

    for row in range(3, 6):
        promoter.submit(remote.promotion(row))
    wait_for_fetches(fetch, 1)
    fetch.answer()
    assert ended(promoter, 3) == {key_of(3): True, key_of(4): False, key_of(5): True}
    assert all(holds_block(local, h, row) for h, row in [(same, 0), (same, 2), (remote, 3), (remote, 5)])
    assert promoter.errors.counts() == {"promotion_error": 2}
    assert promoter.failed == {"same_node": 1, "cross_node": 1}
    assert promoter._thread.is_alive()


def wait_for_fetches(fetch: Fetch, count: int) -> None:
    start = time.monotonic()
    while len(fetch.pending) < count:
        if time.monotonic() - start > END_WITHIN_S:
            pytest.fail("the fetch was never asked for")
        time.sleep(0.001)


@pytest.mark.parametrize(
    "answer",
    [
        lambda fetch: fetch.fail(OSError(errno.ENOMEM, "Cannot allocate memory")),
        lambda fetch: fetch.answer(lambda read: None),  # not a (data, metas) pair
        lambda fetch: fetch.answer(lambda read: (read[0], read[1][:1])),  # metas of one row only
        lambda fetch: fetch.answer(lambda read: (read[0][:, :1], read[1])),  # data of one row only
    ],
    ids=["raises", "not-a-pair", "short-metas", "short-data"],
)
def test_a_fetch_whose_result_is_unusable_fails_its_promotions_and_the_next_go_on(world, answer):
    local, holders, fetch, promoter, _ = world
    remote = holders["remote"]
    promoter.submit(remote.promotion(0))
    promoter.submit(remote.promotion(1))
    wait_for_fetches(fetch, 1)
    answer(fetch)
    outcomes = ended(promoter, 2)
    assert outcomes[key_of(1)] is False
    assert promoter.started["cross_node"] == promoter.succeeded["cross_node"] + promoter.failed["cross_node"] == 2

    promoter.submit(remote.promotion(2))
    wait_for_fetches(fetch, 1)
    fetch.answer()
    assert ended(promoter, 1) == {key_of(2): True}
    assert holds_block(local, remote, 2)
    assert promoter._thread.is_alive()


def test_a_holder_naming_another_namespaces_pool_is_refused(world, namespace):
    local, _, _, promoter, infos = world
    other = Holding("tother" + uuid.uuid4().hex[:8], "same")  # a valid block, of another cache namespace
    try:
        infos["stranger"] = ReplicaInfo("stranger", NODE, other.pool.name, *LAYOUT_FIELDS)
        p = Promotion(key_of(0), 0, 100, (Holder("stranger", NODE, 0, 7),), time.monotonic() + DEADLINE_S)
        promoter.submit(p)
        assert ended(promoter, 1) == {key_of(0): False}
        assert promoter.errors.counts() == {"promotion_fetch": 1}
        assert "namespace" in promoter.errors.recent()[-1][2]
        assert local.generation(0, 0) == 0  # nothing was written
    finally:
        other.pool.close()


# A holder replica's process: seals its pool as Holding does, says so, and waits to be killed.
HOLDER_PROCESS = """
import sys
sys.path.insert(0, sys.argv[1])
from test_promotion import Holding
Holding(sys.argv[2], sys.argv[3])
print("sealed", flush=True)
sys.stdin.read()
"""


def test_a_same_node_promotion_never_unlinks_the_holders_segment(world, namespace):
    """A holder whose process was killed leaves its segment behind, locked by nobody:
    it is the holder's (restarted under its name, it attaches to it again) or a
    reclaim's to remove. A neighbour that promotes from it meanwhile (the Directory has
    not dropped the holder yet) reads the block and leaves the segment where it was."""
    local, _, _, promoter, infos = world
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_PROCESS, os.path.dirname(__file__), namespace, "killed"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"sealed\n"
    finally:
        holder.kill()
        holder.wait()
    path = os.path.join("/dev/shm", segment_name(namespace, "killed"))
    infos["killed"] = ReplicaInfo("killed", NODE, segment_name(namespace, "killed"), *LAYOUT_FIELDS)
    try:
        for row in (3, 5):  # two batches: the second reads the mapping the first opened
            promoter.submit(Promotion(key_of(row), row, 100 + row, (Holder("killed", NODE, row, 7),),
                                      time.monotonic() + DEADLINE_S))
            assert ended(promoter, 1) == {key_of(row): True}
            assert os.path.exists(path), "the promotion removed the holder's segment"
        expected = np.random.default_rng(len("killed")).integers(
            0, 256, (LAYOUT.num_ranks, LAYOUT.num_rows, LAYOUT.slot_bytes), dtype=np.uint8
        )
        out = np.empty(LAYOUT.slot_bytes, dtype=np.uint8)
        for rank in range(LAYOUT.num_ranks):
            assert local.read(rank, 3, key_of(3), 103, out) is not None and np.array_equal(out, expected[rank, 3])
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_promotions_into_a_chunk_landing_fill_whole_chunks_and_leave_this_pool_alone(namespace):
    """distkv's tier promotes straight into vLLM's primary chunks: from this node and from
    another, each chunk checked; a stale generation or a block that fills part of its slot
    fails, and nothing is reserved or sealed in this replica's own pool."""
    layout = PoolLayout(4, 1, 4096)
    local = HostPool(segment_name(namespace, "local"), layout)
    holders = {node: HostPool(segment_name(namespace, f"on_{node}".replace("-", "_")), layout) for node in (NODE, "node-2")}
    infos = {f"on-{node}": ReplicaInfo(f"on-{node}", node, pool.name, 4, 1, 4096) for node, pool in holders.items()}
    fetch = Fetch()
    promoter = Promoter(local, NODE, infos.get, ObjectStoreTransport(local, fetch), namespace=namespace)
    data = np.random.default_rng(5).integers(0, 256, (4, 4096), dtype=np.uint8)
    try:
        for pool in holders.values():
            rows = np.arange(4)
            pool.begin_write(0, rows)
            pool.payload[0] = data
            pool.seal(0, rows[:3], [key_of(r) for r in range(3)], np.full(3, 7, dtype=np.uint64), 4096)
            pool.seal(0, rows[3:], [key_of(3)], np.full(1, 7, dtype=np.uint64), 1000)  # part of its slot
        chunks = np.zeros((6, 4096), dtype=np.uint8)
        landing = ChunkLanding(chunks)
        for node, replica in ((NODE, f"on-{NODE}"), ("node-2", "on-node-2")):
            chunks[:] = 0
            for row, chunk, generation in ((0, 5, 7), (1, 4, 8), (3, 3, 7)):
                promoter.submit(Promotion(key_of(row), chunk, 0, (Holder(replica, node, row, generation),),
                                          time.monotonic() + DEADLINE_S, into=landing))
            if node != NODE:
                wait_for_fetches(fetch, 1)
                fetch.answer()
            outcomes: dict[int, bool] = {}
            start = time.monotonic()
            while len(outcomes) < 3:
                assert time.monotonic() - start < END_WITHIN_S, "a promotion never ended"
                outcomes.update((row, ok) for _, row, ok, _ in promoter.finished_into())
                time.sleep(0.001)
            assert outcomes == {5: True, 4: False, 3: False}, node
            np.testing.assert_array_equal(chunks[5], data[0])
            assert promoter.finished() == []
        assert all(local.generation(0, row) == 0 for row in range(4))  # nothing sealed here
    finally:
        promoter.close()
        for pool in (local, *holders.values()):
            pool.close()
