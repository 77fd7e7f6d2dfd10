"""Which shard keeps a block: its key's (`shard_of`), or its request's placement root's
(`prefix_root`), so that every replica keeps a shared prefix on one shard
(docs/architecture.md, "Placement")."""

from __future__ import annotations

from collections.abc import Mapping

from distkv.abstract import OffloadKey

def shard_of(key: OffloadKey, num_shards: int) -> int:
    """The shard of `key` among `num_shards`. Keys start with a hash, so its leading bytes spread evenly.

    A replica's block is kept on the shard of its request's placement root (`prefix_root`),
    and on its own key's only when it has none (see docs/architecture.md, "Placement")."""
    return int.from_bytes(key[:8], "big") % num_shards


def prefix_root(
    positions: Mapping[OffloadKey, int], first_chunk: tuple[int, int] | None = None
) -> tuple[OffloadKey, int] | None:
    """The placement root of a request and its end token, from the end token of each key the
    engine recorded for it (`positions`); None while it has none.

    Keys are chained hashes, so every request that shares any block of a prefix shares the
    prefix's first chunk: the root is that chunk's key, and every block of the request that
    ends at or past it is kept on the root's shard, by every replica. `first_chunk`: (end
    token, group index) of the first chunk of the group with the smallest chunks (ties by
    group index), where the engine records keys below it that not every request records;
    without it, the recorded key with the smallest end token, ties by group index (the
    key's last 4 bytes).
    """
    if first_chunk is not None:
        end, group = first_chunk
        suffix = group.to_bytes(4, "big")
        for key, position in positions.items():
            if position == end and key.endswith(suffix):
                return key, end
        return None
    root = None
    for key, position in positions.items():
        if root is None or (position, key[-4:]) < (root[1], root[0][-4:]):
            root = (key, position)
    return root
