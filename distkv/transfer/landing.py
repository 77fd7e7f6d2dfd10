"""Where a promotion's bytes land: a row of this replica's pool, or a chunk of memory its
owner hands over (vLLM's primary tier, for distkv's tier).

A promotion reads every rank's slot of the holder's row into one row of a `Landing`, checks
each against the checksum the holder's header gives, and then has the landing `accept` the
row as the block. Its owner keeps the row reserved for that promotion until it ends.

- `PoolLanding`: rows of a HostPool. `begin` invalidates their headers before a byte
  lands; `accept` seals them, so the pool holds the block (and publishes it).
- `ChunkLanding`: chunks of a plain array of one rank (vLLM's CPU tier). Nothing is sealed
  there: a chunk is its owner's as soon as the promotion reports it, and only a whole block
  is accepted, for the owner uses the whole chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from distkv.abstract import OffloadKey
from distkv.storage.pool import HostPool
from distkv.storage.slots import ALL_SUB_BLOCKS, Sealed


class Landing(ABC):
    """Rows that promoted blocks land in: `payload`, (ranks, rows, slot bytes) uint8."""

    @property
    @abstractmethod
    def payload(self) -> np.ndarray: ...

    @abstractmethod
    def slot_address(self, rank: int, row: int) -> int:
        """Where rank `rank`'s slot of `row` is in this process (for one-sided reads)."""

    @property
    @abstractmethod
    def region(self) -> tuple[int, int]:
        """(address, bytes) of the memory the rows lie in, for a transport to register."""

    def begin(self, rows: np.ndarray) -> None:
        """Before any byte of a transfer lands in `rows`."""

    @abstractmethod
    def accept(self, key: OffloadKey, row: int, generation: int, metas: Sequence[Sealed]) -> bool:
        """Every rank's slot of `row` landed and matched the checksum of `metas` (what the
        holder's headers said): make it the block `key` (@`generation` where rows are
        sealed); whether the row now holds the block."""


class PoolLanding(Landing):
    """The rows of a replica's own pool, sealed as the promoted block."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool

    @property
    def payload(self) -> np.ndarray:
        return self.pool.payload  # no view of its own: the pool's close unmaps it

    def slot_address(self, rank: int, row: int) -> int:
        return self.pool.address + self.pool.layout.slot_offset(rank, row)

    @property
    def region(self) -> tuple[int, int]:
        return self.pool.address, self.pool.layout.total_bytes

    def begin(self, rows: np.ndarray) -> None:
        for rank in range(self.pool.layout.num_ranks):
            self.pool.begin_write(rank, rows)

    def accept(self, key: OffloadKey, row: int, generation: int, metas: Sequence[Sealed]) -> bool:
        rows = np.array([row])
        generations = np.array([generation], dtype=np.uint64)
        for rank, meta in enumerate(metas):
            self.pool.seal(rank, rows, [key], generations, meta.nbytes, [meta.checksum], [meta.filled])
        return True


class ChunkLanding(Landing):
    """The chunks of `chunks`, (chunks, bytes per chunk) uint8 in one piece of memory: a
    chunk is accepted only if the block filled all of it."""

    def __init__(self, chunks: np.ndarray) -> None:
        if chunks.ndim != 2 or chunks.dtype != np.uint8 or not chunks.flags.c_contiguous:
            raise ValueError(
                f"chunks must be one C-contiguous 2-D uint8 array, not {chunks.dtype} of shape {chunks.shape}"
            )
        self.chunks = chunks
        self._address = chunks.ctypes.data
        self._chunk_bytes = chunks.shape[1]

    @property
    def payload(self) -> np.ndarray:
        return self.chunks[None]

    def slot_address(self, rank: int, row: int) -> int:
        if rank:
            raise ValueError(f"chunks have one rank, not a rank {rank}")
        return self._address + row * self._chunk_bytes

    @property
    def region(self) -> tuple[int, int]:
        return self._address, self.chunks.nbytes

    def accept(self, key: OffloadKey, row: int, generation: int, metas: Sequence[Sealed]) -> bool:
        return all(meta.nbytes == self._chunk_bytes and meta.filled == ALL_SUB_BLOCKS for meta in metas)
