import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from distkv.names import segment_name
from distkv.storage.slots import COPY_CHUNK_BYTES, MAX_KEY_BYTES, checksum, copy_checksum
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout, pin_ranges
from distkv.storage.readers import PoolReaders
from distkv.storage.segments import reclaim_stale_segments

KEY_A = b"a" * 32 + b"\0\0\0\0"
KEY_B = b"b" * 32 + b"\0\0\0\1"


@pytest.fixture
def name():
    n = segment_name("test" + uuid.uuid4().hex[:12], "r0")
    yield n
    try:
        os.unlink(os.path.join("/dev/shm", n))
    except FileNotFoundError:
        pass


@pytest.fixture
def pool(name):
    p = HostPool(name, PoolLayout(num_rows=8, num_ranks=2, slot_bytes=2 * PAGE_BYTES))
    yield p
    p.close()


def store(pool, rank, row, key, gen, fill):
    rows = np.array([row])
    pool.begin_write(rank, rows)
    pool.payload[rank, row, :] = fill
    pool.seal(rank, rows, [key], np.array([gen], dtype=np.uint64), pool.layout.slot_bytes)


def test_segment_is_private_to_its_user(pool):
    st = os.stat(pool.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()


def test_sealed_slot_verifies_and_reads_back(pool):
    store(pool, 1, 3, KEY_A, 7, 0x5A)
    assert pool.verify(1, 3, KEY_A, 7)
    out = np.empty(pool.layout.slot_bytes, dtype=np.uint8)
    assert pool.read(1, 3, KEY_A, 7, out)[0] == pool.layout.slot_bytes
    assert (out == 0x5A).all()
    # the other rank's slot of the same row is untouched
    assert not pool.verify(0, 3, KEY_A, 7)


@pytest.mark.parametrize("nbytes", [0, 1, COPY_CHUNK_BYTES, 3 * COPY_CHUNK_BYTES + 17])
def test_copy_checksum_copies_and_hashes_what_it_copied(nbytes):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.zeros(nbytes, np.uint8)
    assert copy_checksum(out, src) == checksum(src)
    np.testing.assert_array_equal(out, src)


def test_header_catches_changed_generation_and_key(pool):
    store(pool, 0, 2, KEY_A, 7, 1)
    out = np.empty(pool.layout.slot_bytes, dtype=np.uint8)
    assert not pool.verify(0, 2, KEY_A, 8)
    assert pool.read(0, 2, KEY_A, 8, out) is None
    assert not pool.verify(0, 2, KEY_B, 7)
    store(pool, 0, 2, KEY_B, 9, 2)  # row reused for another block
    assert not pool.verify(0, 2, KEY_A, 7)
    assert pool.read(0, 2, KEY_A, 7, out) is None


def test_header_catches_corrupted_payload(pool):
    store(pool, 0, 5, KEY_A, 11, 3)
    pool.payload[0, 5, 100] ^= 0xFF
    assert pool.holds(0, 5, KEY_A, 11)  # the cheap check cannot see it...
    assert not pool.verify(0, 5, KEY_A, 11)  # ...the checksum does
    out = np.empty(pool.layout.slot_bytes, dtype=np.uint8)
    assert pool.read(0, 5, KEY_A, 11, out) is None


def test_slot_being_rewritten_is_never_read(pool):
    store(pool, 0, 1, KEY_A, 4, 9)
    pool.begin_write(0, np.array([1]))
    out = np.empty(pool.layout.slot_bytes, dtype=np.uint8)
    assert pool.read(0, 1, KEY_A, 4, out) is None


def test_second_process_attaches_and_last_close_removes(name):
    layout = PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES)
    a = HostPool(name, layout)
    b = HostPool(name, layout)
    store(a, 0, 0, KEY_A, 1, 42)
    assert b.verify(0, 0, KEY_A, 1)  # same memory
    a.close()
    assert os.path.exists(b.path)
    b.close()
    assert not os.path.exists(b.path)


def test_a_reader_neither_keeps_a_segment_alive_nor_removes_it(name):
    layout = PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES)
    owner = HostPool(name, layout)
    store(owner, 0, 1, KEY_A, 5, 42)
    reader = HostPool(name, layout, create=False, member=False)
    assert reader.verify(0, 1, KEY_A, 5)
    reader.close()
    assert os.path.exists(owner.path)  # closing a reader removes nothing
    reader = HostPool(name, layout, create=False, member=False)
    owner.close()  # the replica's last process: the reader does not hold it back
    assert not os.path.exists(owner.path)
    assert reader.replaced()
    assert reader.verify(0, 1, KEY_A, 5)  # what it mapped stays readable
    reader.close()
    with pytest.raises(ValueError, match="member"):
        HostPool(name, layout, member=False)


def test_pool_readers_keep_a_pool_mapped_until_it_goes(name):
    layout = PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES)
    readers = PoolReaders(idle_s=60.0)
    owner = HostPool(name, layout)
    store(owner, 0, 0, KEY_A, 1, 7)
    with readers.reading(name, layout) as first:
        assert first.verify(0, 0, KEY_A, 1)
    with readers.reading(name, layout) as again:
        assert again is first  # mapped once
    with readers.reading(name, PoolLayout(num_rows=8, num_ranks=1, slot_bytes=PAGE_BYTES)) as other:
        assert other is None  # another layout: not this pool
    owner.close()
    with readers.reading(name, layout) as gone:
        assert gone is None
    assert len(readers) == 0
    # a replica of the same name starts anew: the readers map its new segment
    owner = HostPool(name, layout)
    with readers.reading(name, layout) as first:
        store(owner, 0, 0, KEY_B, 2, 9)
        owner.close()
        owner = HostPool(name, layout)  # replaced while read: the read finishes on the old one
        assert first.verify(0, 0, KEY_B, 2)
    with readers.reading(name, layout) as fresh:
        assert fresh is not first and not fresh.holds(0, 0, KEY_B, 2)
    owner.close()
    readers.close()


def test_pool_readers_prune_removed_and_idle_pools(name):
    layout = PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES)
    other = segment_name("test" + uuid.uuid4().hex[:12], "r0")
    removed, idle = HostPool(name, layout), HostPool(other, layout)
    readers = PoolReaders(idle_s=0.2)
    try:
        for n in (name, other):
            with readers.reading(n, layout) as pool:
                assert pool is not None
        removed.close()
        readers.prune()
        assert len(readers) == 1  # the removed one
        time.sleep(0.3)
        readers.prune()
        assert len(readers) == 0  # and the idle one
        assert os.path.exists(idle.path)  # closing a reader removes nothing
    finally:
        idle.close()
        readers.close()


def test_generations_are_reserved_once_per_segment_across_its_mappings(name):
    layout = PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES)
    a = HostPool(name, layout)
    try:
        assert a.reserve_generations(5) == 1  # a new segment: 0 marks a slot being written
        with HostPool(name, layout) as b:
            assert b.reserve_generations(3) == 6
        assert a.reserve_generations(1) == 9
        with pytest.raises(ValueError, match="must be positive"):
            a.reserve_generations(0)
        assert a.reserve_generations(1) == 10  # the refusal reserved nothing
    finally:
        a.close()
    with HostPool(name, layout) as fresh:
        assert fresh.reserve_generations(1) == 1


def test_layout_mismatch_is_a_clear_error(name):
    a = HostPool(name, PoolLayout(num_rows=4, num_ranks=1, slot_bytes=PAGE_BYTES))
    try:
        with pytest.raises(ValueError, match="same configuration"):
            HostPool(name, PoolLayout(num_rows=8, num_ranks=1, slot_bytes=PAGE_BYTES))
    finally:
        a.close()


def test_segment_of_killed_process_is_reclaimed(name):
    child = textwrap.dedent(
        f"""
        import sys, time
        from distkv.storage.pool import HostPool, PoolLayout, PAGE_BYTES
        p = HostPool({name!r}, PoolLayout(4, 1, PAGE_BYTES))
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        path = os.path.join("/dev/shm", name)
        assert os.path.exists(path)
        assert name not in reclaim_stale_segments()  # alive: never taken
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert os.path.exists(path)  # SIGKILL ran no cleanup
        other = segment_name("test" + uuid.uuid4().hex[:12], "r0")
        with HostPool(other, PoolLayout(1, 1, PAGE_BYTES)):  # any start reclaims
            assert not os.path.exists(path)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_rows=0, num_ranks=1, slot_bytes=PAGE_BYTES), "num_rows"),
        (dict(num_rows=1, num_ranks=0, slot_bytes=PAGE_BYTES), "num_ranks"),
        (dict(num_rows=1, num_ranks=1, slot_bytes=100), "slot_bytes"),
    ],
)
def test_bad_layout(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolLayout(**kwargs)


def test_pool_smaller_than_one_block():
    with pytest.raises(ValueError, match="smaller than one block"):
        PoolLayout.for_capacity(capacity_bytes=1 << 20, num_ranks=2, block_bytes_per_rank=1 << 20)
    layout = PoolLayout.for_capacity(capacity_bytes=10 << 20, num_ranks=2, block_bytes_per_rank=(1 << 20) + 1)
    assert layout.slot_bytes == (1 << 20) + PAGE_BYTES
    assert layout.num_rows == (10 << 20) // (2 * layout.slot_bytes)


def test_bad_names():
    with pytest.raises(ValueError, match="namespace"):
        segment_name("../etc", "r0")
    with pytest.raises(ValueError, match="replica"):
        segment_name("ns", "a/b")


def test_oversized_key_is_refused(pool):
    with pytest.raises(ValueError, match="exceeds"):
        pool.seal(0, np.array([0]), [b"x" * (MAX_KEY_BYTES + 1)], np.array([1], dtype=np.uint64), 16)


def test_pin_ranges_cover_rows_in_bounded_pieces():
    slot = 3 * PAGE_BYTES
    pieces = pin_ranges(offset=PAGE_BYTES, num_rows=10, slot_bytes=slot, max_piece=4 * slot + 1)
    assert pieces == [
        (PAGE_BYTES, 4 * slot),
        (PAGE_BYTES + 4 * slot, 4 * slot),
        (PAGE_BYTES + 8 * slot, 2 * slot),
    ]
    assert all(size <= 4 * slot + 1 and (off - PAGE_BYTES) % slot == 0 for off, size in pieces)
