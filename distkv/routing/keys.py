"""A prompt's block keys, computed outside the engine exactly as the engine computes them.

A router asks the Directory about a prompt by its keys, so it must chain the same hashes the
engine does, or it asks about blocks nobody holds. Each replica says which scheme its engine
uses in its routing stats (`scheme()`, a JSON-able dict); `from_scheme` builds the same
computer in the router's process. The first key is the prefix's placement root: the
Directory keeps a request's prefix on the shard of its first chunk.

- `SeedKeys`: distkv's seed engines (the harness, the demo): sha256 chained over full blocks
  of `block_tokens` (`distkv.replica.harness.block_keys`).
- `VllmKeys`: vLLM 0.33: its block hashes (`hash_block_tokens` over `tokens_per_hash`
  tokens, chained from NONE_HASH, the first block's extra keys carrying `cache_salt`), one
  offload key per chunk of `hashes_per_chunk` hashes in KV-cache group `group` (vLLM's
  `RequestOffloadState.update_offload_keys`). The seed NONE_HASH derives from is resolved
  by vLLM's own rule in the router's process (`resolve_none_hash_seed`: PYTHONHASHSEED,
  else a fixed default for cryptographic hashes), never sent: for a non-cryptographic hash
  it must stay secret. A router whose seed differs computes keys nobody holds: it then
  routes on load, never to wrong data.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from distkv.abstract import OffloadKey, make_offload_key

# the group bytes of a seed engine's keys (`make_offload_key(hash, 0)`)
_GROUP_0 = make_offload_key(b"", 0)


class PromptKeys(Protocol):
    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[OffloadKey]:
        """The offload keys of the prompt's full chunks, in prefix order."""

    def scheme(self) -> dict[str, Any]:
        """What `from_scheme` builds this computer from."""


class SeedKeys:
    """distkv's seed engines' keys (the harness and the demo): they know no cache salt."""

    kind = "seed"

    def __init__(self, block_tokens: int) -> None:
        if type(block_tokens) is not int or block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens!r} must be a positive int")
        self.block_tokens = block_tokens

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[OffloadKey]:
        """`distkv.replica.harness.block_keys`, hashing slices of one buffer instead of one array each."""
        if cache_salt:
            raise ValueError("distkv's seed engines have no cache_salt")
        try:  # the bytes of an int64 array in native order, as the harness's numpy array
            data = struct.pack(f"={len(token_ids)}q", *token_ids)
        except struct.error as e:  # a token that is no int64
            raise ValueError(f"token ids: {e}") from None
        step = self.block_tokens * 8
        keys, parent, sha256, group = [], b"", hashlib.sha256, _GROUP_0
        for start in range(0, len(data) - step + 1, step):
            parent = sha256(parent + data[start : start + step]).digest()
            keys.append(OffloadKey(parent + group))
        return keys

    def scheme(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_tokens": self.block_tokens}


class VllmKeys:
    """vLLM 0.33's offload keys of one KV-cache group (imports vLLM when built)."""

    kind = "vllm"

    def __init__(self, hash_algo: str = "sha256", tokens_per_hash: int = 16, hashes_per_chunk: int = 1, group: int = 0):
        for name, value in (("tokens_per_hash", tokens_per_hash), ("hashes_per_chunk", hashes_per_chunk)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if type(group) is not int or group < 0:
            raise ValueError(f"group={group!r} must be an int >= 0")
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

        self.hash_algo, self.tokens_per_hash, self.hashes_per_chunk, self.group = (
            hash_algo, tokens_per_hash, hashes_per_chunk, group,
        )
        self._hash = get_hash_fn_by_name(hash_algo)
        self._hash_block = hash_block_tokens
        self._none_hash = self._hash(resolve_none_hash_seed(self._hash))

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[OffloadKey]:
        step, per_chunk = self.tokens_per_hash, self.hashes_per_chunk
        tokens = [int(t) for t in token_ids]  # vLLM hashes Python ints: a numpy int pickles otherwise
        parent, keys = self._none_hash, []
        for i, start in enumerate(range(0, len(tokens) - step + 1, step)):
            # vLLM's extra keys of a block without LoRA, multimodal input or prompt embeds
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self._hash_block(self._hash, parent, tokens[start : start + step], extra)
            if (i + 1) % per_chunk == 0:
                keys.append(make_offload_key(parent, self.group))
        return keys

    def scheme(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "hash_algo": self.hash_algo,
            "tokens_per_hash": self.tokens_per_hash,
            "hashes_per_chunk": self.hashes_per_chunk,
            "group": self.group,
        }


def from_scheme(scheme: Mapping[str, Any]) -> PromptKeys:
    """The key computer a replica's `scheme()` describes; ValueError for one it cannot be."""
    if not isinstance(scheme, Mapping):
        raise ValueError(f"key scheme {scheme!r} is not a mapping")
    kind = scheme.get("kind")
    args = {k: v for k, v in scheme.items() if k != "kind"}
    kinds = {SeedKeys.kind: SeedKeys, VllmKeys.kind: VllmKeys}
    if kind not in kinds:
        raise ValueError(f"key scheme kind {kind!r} is not one of {list(kinds)}")
    try:
        return kinds[kind](**args)
    except TypeError as e:  # a field it does not take
        raise ValueError(f"key scheme {dict(scheme)!r}: {e}") from None
