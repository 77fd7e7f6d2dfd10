"""A vLLM replica's distkv identity, from its engine's process to its Serve replica's.

Under Ray Serve LLM a replica's distkv manager runs in vLLM's engine-core process, while
Serve asks the replica's LLMServer process for its routing stats. The manager's side
(`IdentityPublisher`, stepped on its Directory link's thread with each heartbeat, never on
the scheduler's) puts its routing stats (`distkv.routing.router.routing_stats`) under its
engine id in Ray's internal key-value store, which Ray's token authentication guards; the
LLMServer's side (`read_identity`) reads them back when Serve asks (`distkv.serve_llm`).
What it holds is who the replica is and what its pull gate measured, no endpoint and no key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from distkv.routing.router import STATS_KEY

# the key-value namespace and the key of an engine's identity
KV_NAMESPACE = "distkv"
# how often a replica refreshes what it published (its gate's measurements move slowly)
PUBLISH_INTERVAL_S = 5.0


def identity_key(engine_id: str) -> bytes:
    return f"engine/{engine_id}".encode()


class IdentityPublisher:
    """Puts `stats()` under the engine's key at most every PUBLISH_INTERVAL_S. `put(key,
    value)` is the store's (Ray's internal KV in a replica; a dict in tests). Not thread-safe:
    one thread (the link's) steps it."""

    def __init__(self, engine_id: str, stats: Callable[[], dict[str, Any]], put: Callable[[bytes, bytes], Any]):
        self.key = identity_key(engine_id)
        self._stats = stats
        self._put = put
        self._due = 0.0

    def step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._due:
            return
        self._due = now + PUBLISH_INTERVAL_S
        self._put(self.key, json.dumps(self._stats()).encode())


def read_identity(engine_id: str, get: Callable[[bytes], bytes | None]) -> dict[str, Any]:
    """The routing stats an engine published, or {} before it did (or if unreadable)."""
    value = get(identity_key(engine_id))
    if not value:
        return {}
    try:
        stats = json.loads(value)
    except ValueError:
        return {}
    return stats if isinstance(stats, dict) else {}


def name_engine(engine_kwargs: dict[str, Any], replica_unique_id: str) -> str:
    """Set the engine's `kv_transfer_config.engine_id` to one named after the Serve replica
    (unless set already); the engine id."""
    kv_transfer = engine_kwargs.setdefault("kv_transfer_config", {})
    if not isinstance(kv_transfer, dict):
        raise ValueError(
            f"engine_kwargs.kv_transfer_config {kv_transfer!r}: DistkvLLMServer needs it as a mapping"
        )
    return kv_transfer.setdefault("engine_id", f"serve-{replica_unique_id}")


def with_identity(stats: dict[str, Any], published: dict[str, Any], hash_algo: str) -> dict[str, Any]:
    """Serve's routing stats `stats` and the engine's `published` distkv identity, its keys
    hashed with the engine's `prefix_caching_hash_algo` (the engine core does not know it)."""
    entry = published.get(STATS_KEY)
    if not isinstance(entry, dict) or not isinstance(entry.get("keys"), dict):
        return stats
    return {**stats, STATS_KEY: {**entry, "keys": {**entry["keys"], "hash_algo": hash_algo}}}
