"""The host pool: one shared-memory segment per replica holding its offloaded blocks.

Layout of the segment `/dev/shm/distkv-<namespace>-<replica>` (mode 0600; `distkv.names`):

    page 0          superblock: magic, then the PoolLayout it was created with
    headers         num_ranks x num_rows headers of HEADER_BYTES, page-padded
    payload         rank 0: num_rows slots of slot_bytes, then rank 1, ...

A row holds one offloaded block; each worker rank writes its own slot of the row.
Slots of one rank are contiguous (rank-major) so that a worker pins only its own region
and consecutive rows coalesce into one copy.

Every slot has a header (key, generation, checksum of its payload, the sub-blocks
written) that any reader can validate: the slot protocol (`distkv.storage.slots`), whose
writer's side (`begin_write`, `seal`) and seqlocked readers (`sealed`, `read`) are here.
Reading another replica's pool goes through `distkv.storage.readers`.

The file itself (created and opened ours alone, locked by its members, removed by the
last of them or by a reclaim) is `distkv.storage.segments`' business.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distkv.abstract import BlockIDsLoadStoreSpec, OffloadKey
from distkv.storage.segments import (
    SHM_DIR,
    create_segment,
    lock_member,
    open_segment,
    reclaim_stale_segments,
    release_member,
)
from distkv.storage.slots import (
    ALL_SUB_BLOCKS,
    HEADER_BYTES,
    KEY_OFFSET,
    MAX_KEY_BYTES,
    WORD_CHECKSUM,
    WORD_FILLED,
    WORD_GENERATION,
    WORD_KEY_LEN,
    WORD_NBYTES,
    Sealed,
    checksum,
    copy_checksum,
    parse_header,
)

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
MAGIC = b"DISTKV\x00\x02"
# cudaHostRegister fails on very large ranges; pin in pieces of at most this size.
MAX_PIN_BYTES = 64 << 30

# In the superblock after the layout: the next generation never handed out in this segment
# (HostPool.reserve_generations), then a byte per rank, set by that rank's worker once it
# uses the segment (HostPool.mark_attached).
_GENERATIONS_OFFSET = 48
_GENERATIONS = struct.Struct("<Q")
_ATTACHED_OFFSET = 64
MAX_RANKS = PAGE_BYTES - _ATTACHED_OFFSET


def page_align(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


class PoolLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Rows of a host pool, with the key and generation each row holds (or will hold).

    Store handlers seal the rows' headers with them; load handlers check them.
    """

    def __init__(self, rows: Sequence[int] | np.ndarray, keys: Sequence[OffloadKey], generations: Sequence[int] | np.ndarray):
        super().__init__(rows)
        self.keys = list(keys)
        self.generations = np.array(generations, dtype=np.uint64)
        if not len(self.keys) == len(self.generations) == len(self.block_ids):
            raise ValueError(
                f"PoolLoadStoreSpec: {len(self.block_ids)} rows, {len(self.keys)} keys "
                f"and {len(self.generations)} generations must be as many"
            )

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass(frozen=True)
class PoolLayout:
    """Shape of a pool: rows (blocks) x ranks (worker slots) of slot_bytes each."""

    num_rows: int
    num_ranks: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"PoolLayout: num_rows={self.num_rows}, the pool holds no block")
        if not 1 <= self.num_ranks <= MAX_RANKS:
            raise ValueError(f"PoolLayout: num_ranks={self.num_ranks} must be in 1..{MAX_RANKS}")
        if self.slot_bytes < 1 or self.slot_bytes % PAGE_BYTES:
            raise ValueError(
                f"PoolLayout: slot_bytes={self.slot_bytes} must be a positive multiple of the "
                f"page size {PAGE_BYTES}"
            )

    @classmethod
    def for_capacity(cls, capacity_bytes: int, num_ranks: int, block_bytes_per_rank: int) -> "PoolLayout":
        """The most rows of `block_bytes_per_rank` (page-aligned) that fit in `capacity_bytes`."""
        if block_bytes_per_rank < 1:
            raise ValueError(f"block_bytes_per_rank={block_bytes_per_rank} must be positive")
        slot_bytes = page_align(block_bytes_per_rank)
        row_bytes = slot_bytes * max(num_ranks, 1)
        num_rows = capacity_bytes // row_bytes
        if num_rows < 1:
            raise ValueError(
                f"pool of {capacity_bytes} bytes is smaller than one block "
                f"({num_ranks} rank(s) x {slot_bytes} bytes): raise cpu_bytes_to_use"
            )
        return cls(num_rows, num_ranks, slot_bytes)

    @property
    def headers_offset(self) -> int:
        return PAGE_BYTES

    @property
    def payload_offset(self) -> int:
        return self.headers_offset + page_align(self.num_ranks * self.num_rows * HEADER_BYTES)

    @property
    def rank_bytes(self) -> int:
        return self.num_rows * self.slot_bytes

    def header_offset(self, rank: int, row: int) -> int:
        """Where the header of rank's slot of row starts in the segment."""
        return self.headers_offset + (rank * self.num_rows + row) * HEADER_BYTES

    def slot_offset(self, rank: int, row: int) -> int:
        """Where rank's slot of row starts in the segment."""
        return self.payload_offset + rank * self.rank_bytes + row * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.payload_offset + self.num_ranks * self.rank_bytes

    def pack(self) -> bytes:
        return MAGIC + np.array([self.num_rows, self.num_ranks, self.slot_bytes], dtype="<u8").tobytes()

    @classmethod
    def unpack(cls, raw: bytes) -> "PoolLayout | None":
        if raw[: len(MAGIC)] != MAGIC:
            return None
        rows, ranks, slot = np.frombuffer(raw[len(MAGIC) : len(MAGIC) + 24], dtype="<u8")
        return cls(int(rows), int(ranks), int(slot))


def _range_lock(kind: int, start: int, length: int) -> bytes:
    """A `struct flock` for an OFD lock of `kind` on [start, start + length) of a file."""
    return struct.pack("hhqqi", kind, os.SEEK_SET, start, length, 0)


def pin_ranges(offset: int, num_rows: int, slot_bytes: int, max_piece: int = MAX_PIN_BYTES) -> list[tuple[int, int]]:
    """(offset, size) pieces of at most max_piece covering num_rows slots from offset.

    Pieces end on slot boundaries so that no single slot copy straddles two registrations.
    """
    rows_per_piece = max(max_piece // slot_bytes, 1)
    return [
        (offset + first * slot_bytes, min(rows_per_piece, num_rows - first) * slot_bytes)
        for first in range(0, num_rows, rows_per_piece)
    ]


class HostPool:
    """A replica's pool segment, created by the first process that opens it.

    Every process of the replica (the scheduler's manager, each worker) opens it with
    the same name and layout. The last one to close it removes it. A segment is opened
    only if it is this user's alone (`distkv.storage.segments`): else UntrustedSegment.
    """

    def __init__(self, name: str, layout: PoolLayout, shm_dir: str = SHM_DIR, create: bool = True, member: bool = True):
        """Open the segment `name`, creating it if absent and `create` (else FileNotFoundError).

        member=False opens another replica's segment only to read it, and maps it
        read-only: the mapping holds no lock, so the segment's liveness stays its
        replica's business (its last process removes it, or a reclaim does, while the
        mapping stays readable), and closing the mapping never removes the segment.
        """
        if create and not member:
            raise ValueError("HostPool: only a member of the replica creates its segment")
        self.name = name
        self.layout = layout
        self.path = os.path.join(shm_dir, name)
        self._shm_dir = shm_dir
        self._member = member
        self._fd = self._open(create) if member else open_segment(self.path, writable=False)
        try:
            self._check_superblock()
            access = mmap.ACCESS_WRITE if member else mmap.ACCESS_READ
            self._mmap = mmap.mmap(self._fd, layout.total_bytes, access=access)
        except BaseException:
            if member:
                release_member(self._fd, self.path)  # the last to let go removes it
            else:
                os.close(self._fd)
            raise
        buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = buf.ctypes.data  # of the segment in this process, for one-sided reads
        headers = buf[layout.headers_offset : layout.headers_offset + layout.num_ranks * layout.num_rows * HEADER_BYTES]
        self._headers = headers.reshape(layout.num_ranks, layout.num_rows, HEADER_BYTES)
        self._words = self._headers.view("<u8")  # (ranks, rows, HEADER_BYTES // 8)
        payload = buf[layout.payload_offset : layout.total_bytes]
        self.payload = payload.reshape(layout.num_ranks, layout.num_rows, layout.slot_bytes)
        self._closed = False

    # ---- opening -------------------------------------------------------------------

    def _open(self, create: bool) -> int:
        """A member's descriptor of the segment, locked: attached, or created if absent."""
        for _ in range(5):
            try:
                fd = open_segment(self.path, writable=True)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                if lock_member(fd, self.path):
                    return fd
                continue  # reclaimed between our open and our lock
            if not create:
                raise FileNotFoundError(f"no pool segment {self.path}")
            reclaim_stale_segments(self._shm_dir)
            fd = create_segment(self.path, self.layout.total_bytes, self.layout.pack())
            if fd is not None:
                return fd
        raise RuntimeError(f"could not open pool segment {self.path}: it kept being replaced")

    def _check_superblock(self) -> None:
        found = PoolLayout.unpack(os.pread(self._fd, PAGE_BYTES, 0))
        if found != self.layout:
            raise ValueError(
                f"pool segment {self.path} has layout {found}, this process expects "
                f"{self.layout}: every process of a replica must use the same configuration"
            )

    def _check_member(self, what: str) -> None:
        if not self._member:
            raise ValueError(f"{what}: {self.path} is mapped read-only, as another replica's pool")

    def claim(self) -> bool:
        """Take the replica's owner lock on the segment, held until this mapping closes:
        whether no other mapping held it.

        The scheduler of a replica claims its segment, its workers do not, so that a
        second replica of the same name finds it claimed instead of sharing the rows.
        The lock belongs to this open file (an OFD lock, apart from the members' flock)
        and the kernel drops it with a killed owner, so a replica restarted under its
        name claims it again.
        """
        self._check_member("claim")
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _range_lock(fcntl.F_WRLCK, 0, 1))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def reserve_generations(self, n: int) -> int:
        """The first of `n` consecutive generations that no process has reserved in this
        segment before, whatever the clocks did: the counter lives in the superblock, so a
        scheduler that attaches again (restarted, its workers still holding the segment)
        goes on past every generation its predecessor handed out, sealed or still being
        written, and no generation is ever sealed twice in a slot (the slot protocol's
        premise). A new segment starts at 1 (0 marks a slot being written)."""
        self._check_member("reserve_generations")
        if n < 1:
            raise ValueError(f"reserve_generations: n={n} must be positive")
        span = (_GENERATIONS_OFFSET, _GENERATIONS.size)
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _range_lock(fcntl.F_WRLCK, *span))
        try:
            (stored,) = _GENERATIONS.unpack(os.pread(self._fd, _GENERATIONS.size, _GENERATIONS_OFFSET))
            first = max(stored, 1)
            os.pwrite(self._fd, _GENERATIONS.pack(first + n), _GENERATIONS_OFFSET)
        finally:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _range_lock(fcntl.F_UNLCK, *span))
        return first

    # ---- headers -------------------------------------------------------------------

    def begin_write(self, rank: int, rows: np.ndarray) -> None:
        """Invalidate the headers of rows about to be overwritten, before any payload byte."""
        self._words[rank, rows, WORD_GENERATION] = 0

    def seal(
        self,
        rank: int,
        rows: np.ndarray,
        keys: Sequence[bytes],
        generations: np.ndarray,
        nbytes: int,
        checksums: Sequence[int | None] | None = None,
        filled: Sequence[int] | None = None,
    ) -> None:
        """Write the headers of freshly written rows: checksum and key first, generation last.

        `checksums`, the xxh3 of rows the caller hashed as it wrote or verified them
        (None: hash that row here), saves reading them again. `filled`: each row's
        sub-blocks written (see Sealed); None: all of them.
        """
        words = self._words[rank]
        for i, (row, key, gen) in enumerate(zip(rows.tolist(), keys, generations.tolist())):
            if len(key) > MAX_KEY_BYTES:
                raise ValueError(f"key of {len(key)} bytes exceeds the header's {MAX_KEY_BYTES}")
            known = None if checksums is None else checksums[i]
            words[row, WORD_CHECKSUM] = checksum(self.payload[rank, row, :nbytes]) if known is None else known
            words[row, WORD_NBYTES] = nbytes
            words[row, WORD_FILLED] = ALL_SUB_BLOCKS if filled is None else filled[i]
            words[row, WORD_KEY_LEN] = len(key)
            self._headers[rank, row, KEY_OFFSET : KEY_OFFSET + len(key)] = np.frombuffer(key, dtype=np.uint8)
            words[row, WORD_GENERATION] = gen

    def generation(self, rank: int, row: int) -> int:
        return int(self._words[rank, row, WORD_GENERATION])

    def sealed(self, rank: int, row: int, key: bytes, generation: int) -> Sealed | None:
        """What the slot's header says of the block sealed as key@generation, or None.

        The one way to read a header, a seqlock: the generation, then a copy of the whole
        header, then the generation again. Writers zero the generation before they touch
        a slot and write it last, and no generation is sealed twice, so an unchanged
        nonzero generation means the copy is of one sealed header, never of one half
        rewritten or of the block sealed next in the row. It says nothing of the payload:
        a reader accepts bytes only if they match the checksum, and one that reads the
        payload in place re-checks the generation after its copy.
        """
        if not generation:
            return None
        words = self._words[rank, row]
        if words[WORD_GENERATION] != generation:
            return None
        header = self._headers[rank, row].tobytes()
        if words[WORD_GENERATION] != generation:
            return None
        return parse_header(header, key, generation)

    def holds(self, rank: int, row: int, key: bytes, generation: int) -> bool:
        """Cheap check: the header names this key at this generation."""
        return self.sealed(rank, row, key, generation) is not None

    def verify(self, rank: int, row: int, key: bytes, generation: int) -> bool:
        """Full check in place: header names key@generation and the payload matches its checksum."""
        meta = self.sealed(rank, row, key, generation)
        if meta is None:
            return False
        return checksum(self.payload[rank, row, : meta.nbytes]) == meta.checksum and self.generation(rank, row) == generation

    def read(self, rank: int, row: int, key: bytes, generation: int, out: np.ndarray) -> Sealed | None:
        """Copy a sealed slot into out: what its header says, or None if it is not key@generation.

        Safe against a concurrent writer: the copy is checked, not the pool.
        """
        meta = self.sealed(rank, row, key, generation)
        if meta is None or meta.nbytes > out.nbytes:
            return None
        copied = copy_checksum(out[: meta.nbytes], self.payload[rank, row, : meta.nbytes])
        if self.generation(rank, row) != generation or copied != meta.checksum:
            return None
        return meta

    def mark_attached(self, rank: int) -> None:
        """Record that worker `rank` of the replica uses this segment: a worker on another
        node marks the segment of that node, which `attached_ranks` here never shows."""
        self._check_member("mark_attached")
        if not 0 <= rank < self.layout.num_ranks:
            raise ValueError(f"rank {rank} out of range: the pool has {self.layout.num_ranks} ranks")
        os.pwrite(self._fd, b"\x01", _ATTACHED_OFFSET + rank)

    def attached_ranks(self) -> set[int]:
        """The ranks whose workers marked this segment since it was created."""
        marks = os.pread(self._fd, self.layout.num_ranks, _ATTACHED_OFFSET)
        return {rank for rank, mark in enumerate(marks) if mark}

    def replaced(self) -> bool:
        """Whether the segment's path no longer names this mapping's segment: removed, or
        created anew by a replica of the same name."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return True

    def rank_address(self, rank: int) -> int:
        """Host address of rank's first slot (for pinning and raw copies)."""
        return self.payload[rank].ctypes.data

    # ---- closing -------------------------------------------------------------------

    def close(self) -> None:
        """Detach; the last member attached removes the segment."""
        if self._closed:
            return
        self._closed = True
        del self._headers, self._words, self.payload
        try:
            self._mmap.close()
        except BufferError:
            pass  # views handed out (torch tensors) still map it; the GC unmaps it later
        if self._member:
            release_member(self._fd, self.path)
        else:
            os.close(self._fd)

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


