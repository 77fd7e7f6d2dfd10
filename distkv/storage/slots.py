"""The slot protocol: what a slot's header holds, and how every reader of a slot checks it.

A pool row holds one block, a slot per worker rank, each with a header of HEADER_BYTES:
the block's generation, the checksum of its payload (xxh3-64), its length, the sub-blocks
its writer wrote, and its key. A writer zeroes the generation before it touches a slot
and writes it last (`HostPool.begin_write`, `HostPool.seal`), and no generation is sealed
twice. A reader takes the header under a seqlock (the generation, a copy of the header,
the generation again: `HostPool.sealed`), or, when its bytes land in no known order
(one-sided RDMA), reads the generation again once its read is done (`check_landed`), and
accepts bytes only if they match the checksum the header gives: a race with a writer
costs a miss, never wrong data.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import xxhash

HEADER_BYTES = 128
# header layout, as uint64 words: generation, checksum, nbytes, key_len, filled; key bytes follow
WORD_GENERATION, WORD_CHECKSUM, WORD_NBYTES, WORD_KEY_LEN, WORD_FILLED = range(5)
HEADER_WORDS = struct.Struct("<5Q")
KEY_OFFSET = HEADER_WORDS.size
MAX_KEY_BYTES = HEADER_BYTES - KEY_OFFSET
# `filled` of a slot written whole: every sub-block
ALL_SUB_BLOCKS = (1 << 64) - 1


class Sealed(NamedTuple):
    """What a slot's header says of the block sealed in it.

    filled: bit i set for each sub-block i of the slot the block's writer wrote (the
    handlers' unit: one GPU block of each ref); a reader may deliver no other sub-block.
    """

    nbytes: int
    checksum: int
    filled: int


def checksum(payload: np.ndarray) -> int:
    """The checksum stored in slot headers: xxh3-64 of the payload bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(payload))


# Copies that also hash go a chunk at a time, so that the hash reads the bytes the copy
# just left in a core's L2 rather than from memory a second time: a chunk well inside
# the L2 of the cores distkv runs on (docs/benchmarks.md).
COPY_CHUNK_BYTES = 256 << 10


def copy_checksum(out: np.ndarray, src: np.ndarray) -> int:
    """Copy src (1-D uint8) into out and return the checksum of the bytes copied."""
    hasher = xxhash.xxh3_64()
    for start in range(0, len(src), COPY_CHUNK_BYTES):
        chunk = out[start : start + COPY_CHUNK_BYTES]
        chunk[:] = src[start : start + COPY_CHUNK_BYTES]
        hasher.update(memoryview(chunk))
    return hasher.intdigest()


def parse_header(header: bytes, key: bytes, generation: int) -> Sealed | None:
    """What a copy of a slot's header says of key@generation, or None if it names another
    block. Only a copy the slot protocol vouches for means anything (HostPool.sealed,
    check_landed)."""
    sealed_generation, digest, nbytes, key_len, filled = HEADER_WORDS.unpack_from(header)
    if (
        not generation
        or sealed_generation != generation
        or key_len != len(key)
        or header[KEY_OFFSET : KEY_OFFSET + key_len] != key
    ):
        return None
    return Sealed(nbytes, digest, filled)


def check_landed(
    header: bytes, generation_after: int, key: bytes, generation: int, payload: np.ndarray
) -> Sealed | None:
    """The slot protocol for a reader whose copy of a slot's header and payload landed in
    no known order (one-sided RDMA): what the header says, if the copy is of key@generation.

    `header` and `payload` came in one read, `generation_after` from a read of the slot's
    generation issued once that one had completed. An unchanged generation across the two
    means no writer touched the slot while the first was read (writers zero it first and
    no generation comes back), so header and payload are of one block; the payload must
    still match the checksum the header gives.
    """
    meta = parse_header(header, key, generation)
    if meta is None or generation_after != generation or meta.nbytes > payload.nbytes:
        return None
    return meta if checksum(payload[: meta.nbytes]) == meta.checksum else None
