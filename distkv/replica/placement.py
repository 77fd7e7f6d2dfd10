"""Where a replica's blocks go in the Directory: `BlockPlacement`.

Every block of a request that ends at or past the request's placement root (the first
chunk of its prefix, `distkv.directory.placement.prefix_root`) is kept on the root's
shard, by every replica, so that a shared prefix lives on one shard; any other block on
its own key's (docs/architecture.md, "Placement"). How a request's root is found depends
on the engine: `seed_request_root` for distkv's seed API, `distkv.vllm.request_root` for
vLLM's, handed in at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from distkv.abstract import OffloadKey, ReqContext
from distkv.directory.placement import prefix_root, shard_of

# (the root's key, its end token) of a request, or None while it has none
RequestRoot = Callable[[ReqContext], "tuple[OffloadKey, int] | None"]


def seed_request_root(req_context: ReqContext) -> tuple[OffloadKey, int] | None:
    """The placement root of a request of distkv's seed API and its end token (`prefix_root`
    of the positions its engine recorded: the harness and the demo record every block's)."""
    return prefix_root(req_context.offload_key_positions())


class _Root:
    """Per-request state: the shard of the request's placement root, and the root's end token."""

    __slots__ = ("shard", "end")

    def __init__(self, shard: int, end: int) -> None:
        self.shard = shard
        self.end = end


class BlockPlacement:
    """The Directory shard of each block a replica stores or promotes, among `num_shards`,
    by its request's placement root (`request_root`: how the engine's requests find theirs).
    A request's root is found once and kept in its state; None is not kept, since a
    request reaches its first chunk later when it grows by decoding."""

    def __init__(self, num_shards: int, request_root: RequestRoot = seed_request_root) -> None:
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"BlockPlacement: num_shards={num_shards!r} must be a positive int")
        self.num_shards = num_shards
        self._request_root = request_root

    def shard(self, key: OffloadKey, req_context: ReqContext) -> int:
        """The shard of `key` of the request of `req_context`: its placement root's when the
        key ends at or past the root; else (no root yet, no position, a key before the
        root) the key's own."""
        root = self._root(req_context)
        if root is not None:
            end = req_context.get_offload_key_position(key)
            if end is not None and end >= root.end:
                return root.shard
        return shard_of(key, self.num_shards)

    def shards(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> list[int]:
        """`shard` of each of `keys`, all of the request of `req_context`."""
        num_shards = self.num_shards
        root = self._root(req_context)
        if root is None:
            return [shard_of(key, num_shards) for key in keys]
        position = req_context.get_offload_key_position
        shards = []
        for key in keys:
            end = position(key)
            shards.append(root.shard if end is not None and end >= root.end else shard_of(key, num_shards))
        return shards

    def _root(self, req_context: ReqContext) -> _Root | None:
        root = req_context.get_state(_Root)
        if root is None:
            found = self._request_root(req_context)
            if found is None:
                return None
            key, end = found
            root = _Root(shard_of(key, self.num_shards), end)
            req_context.set_state(root)
        return root
