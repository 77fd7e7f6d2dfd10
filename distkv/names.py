"""Every name distkv gives a thing in Ray or in shared memory, built and parsed here only.

- `RAY_NAMESPACE`: the Ray namespace of every distkv actor.
- Directory shards: the actors `directory-<cache namespace>-<shard>`.
- NodeAgents: the actors `node-agent-<Ray node id>`.
- Pool segments: `/dev/shm/distkv-<cache namespace>-<replica>`. Both parts hold only
  letters, digits, '_' and '.', so a segment name never names a path elsewhere and
  parses back into the one (namespace, replica) that built it.

Each `parse_*` inverts its builder and answers None for a name that builder never makes.
"""

from __future__ import annotations

import re

RAY_NAMESPACE = "distkv"
SEGMENT_PREFIX = "distkv-"
_SHARD_PREFIX = "directory-"
_AGENT_PREFIX = "node-agent-"
_SEGMENT_PART = re.compile(r"^[A-Za-z0-9_.]+$")
_SHARD_NAME = re.compile(re.escape(_SHARD_PREFIX) + r"(.+)-([0-9]+)", re.DOTALL)


# ---- pool segments -------------------------------------------------------------------


def replica_name(engine_id: str) -> str:
    """The engine id as the replica part of a pool's name, one to one: letters, digits and
    '_' stay, any other character becomes '.' and two hex digits per UTF-8 byte, so that
    two engines never share a pool (replacing them with '_' made "a-b" and "a_b" one)."""
    return "".join(
        c if c.isascii() and (c.isalnum() or c == "_") else "".join(f".{b:02x}" for b in c.encode())
        for c in engine_id
    )


def epoch_replica_id(replica_id: str, cache_epoch: int) -> str:
    """The id a replica registers under once a reset moved it to `cache_epoch` (> 0): a
    view that still lists the old id can never pair it with the new epoch's blocks."""
    return f"{replica_id}.epoch{cache_epoch}"


def segment_name(namespace: str, replica: str) -> str:
    """The pool segment of `replica` in cache `namespace`; ValueError for a part with other
    characters than letters, digits, '_' and '.'."""
    for what, value in (("namespace", namespace), ("replica", replica)):
        if not _SEGMENT_PART.match(value):
            raise ValueError(f"pool {what} {value!r} may hold only letters, digits, '_' and '.'")
    return f"{SEGMENT_PREFIX}{namespace}-{replica}"


def parse_segment_name(name: object) -> tuple[str, str] | None:
    """(cache namespace, replica) of a name `segment_name` builds, else None."""
    parts = _split_segment_name(name)
    if parts is None or not all(_SEGMENT_PART.match(part) for part in parts):
        return None
    return parts


def check_pool_namespace(pool_name: object, namespace: object) -> None:
    """Raise ValueError unless `pool_name` is a pool segment name of cache namespace
    `namespace`; the message says which part is wrong."""
    parts = _split_segment_name(pool_name)
    if parts is None:
        raise ValueError(f"{pool_name!r} is not a distkv pool segment name")
    segment_name(*parts)  # refuses a part `segment_name` never builds
    if parts[0] != namespace:
        raise ValueError(f"pool {pool_name!r} belongs to cache namespace {parts[0]!r}, not to {namespace!r}")


def _split_segment_name(name: object) -> tuple[str, str] | None:
    if not isinstance(name, str) or not name.startswith(SEGMENT_PREFIX):
        return None
    namespace, _, replica = name[len(SEGMENT_PREFIX):].partition("-")
    return namespace, replica


# ---- actors --------------------------------------------------------------------------


def shard_name(namespace: str, shard: int) -> str:
    """The actor of Directory shard `shard` of cache `namespace`."""
    return f"{_SHARD_PREFIX}{namespace}-{shard}"


def parse_shard_name(name: str) -> tuple[str, int] | None:
    """(cache namespace, shard) of a name `shard_name` builds, else None."""
    match = _SHARD_NAME.fullmatch(name)
    return None if match is None else (match.group(1), int(match.group(2)))


def agent_name(node_id: str) -> str:
    """The NodeAgent actor of Ray node `node_id`."""
    return f"{_AGENT_PREFIX}{node_id}"


def parse_agent_name(name: str) -> str | None:
    """The Ray node id of a name `agent_name` builds, else None."""
    return name[len(_AGENT_PREFIX):] if name.startswith(_AGENT_PREFIX) else None


# The cluster's one NodeWatcher (`ray_actors.node_watcher`), which reads Ray's node table for
# every Directory shard.
NODE_WATCHER_NAME = "node-watcher"
