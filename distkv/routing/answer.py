"""The Directory's answer about a request's prefix, as it travels with the request.

The router asks the Directory once which replicas hold the prompt's blocks, and puts the
answer in the request (for vLLM: `kv_transfer_params["distkv"]`), so that the replica it
chose does not ask again: a block the answer names a holder of is promoted from it, and a
block nobody held is a plain miss at once, not a lookup that waits a step for the Directory.
It is advice, never data: a holder that evicted the block since fails its promotion into a
miss, and every promoted row is checked against its checksum.

The answer crosses processes as plain JSON-able values (lists, strings, ints): it may ride
in an HTTP body. It carries holders' rows, never their pools' endpoints: a replica reads a
holder only through the `ReplicaInfo` its own Directory link knows. `decode` checks every
field and bounds every size; anything else is `None` (the replica ignores the answer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distkv.abstract import OffloadKey
from distkv.directory.records import Holder
from distkv.storage.keys import MIN_KEY_BYTES
from distkv.storage.slots import MAX_KEY_BYTES

# the entry of kv_transfer_params the answer rides in
PARAMS_KEY = "distkv"
FORMAT = 1
# bounds on what a replica decodes: a prompt's keys, and holders per key
MAX_KEYS = 1 << 14
MAX_HOLDERS = 256

# what the router's answer meant for the replica it chose (`RoutedAnswer.kind`)
HOLDER, PULLER, COLD, LOAD_ONLY = "holder", "puller", "cold", "load_only"
ROUTED_KINDS = (HOLDER, PULLER, COLD, LOAD_ONLY)


@dataclass(frozen=True)
class RoutedAnswer:
    """What the router learned of a request's prefix from the Directory.

    `answered`: False when the router had no answer (past its deadline, the Directory
    down, no token ids): the replica looks its blocks up as if unrouted. `keys`: the keys
    asked, in prefix order, all of one KV-cache group; `holders`: those someone held, with
    their holders. Keys not asked (of other groups, or that the engine computed otherwise)
    are not covered: they are looked up as usual.
    """

    namespace: str
    answered: bool
    keys: tuple[OffloadKey, ...] = ()
    holders: Mapping[OffloadKey, tuple[Holder, ...]] = field(default_factory=dict)
    asked: frozenset[OffloadKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "asked", frozenset(self.keys))

    def covers(self, key: OffloadKey) -> bool:
        """Whether the answer says who held `key` (possibly nobody): only the keys the
        router asked about. A key the engine computed otherwise (a LoRA adapter, images:
        extra keys the router does not know) is looked up as if the request were unrouted."""
        return key in self.asked

    def holders_for(self, key: OffloadKey, known: Callable[[str], object]) -> tuple[Holder, ...] | None:
        """The holders to promote `key` from: () when the answer says nobody held it; None
        when it does not cover `key`, or names only holders whose ReplicaInfo `known`
        (the replica's link) does not know yet: the caller then asks the Directory as usual."""
        if not self.covers(key):
            return None
        holders = self.holders.get(key, ())
        if holders and all(known(h.replica_id) is None for h in holders):
            return None
        return holders

    def kind(self, replica_id: str) -> str:
        """What routing the request to `replica_id` was: to a holder of its prefix's first
        block, to a puller of it from others, a cold prefix nobody held, or on load only."""
        if not self.answered:
            return LOAD_ONLY
        first = self.holders.get(self.keys[0], ()) if self.keys else ()
        if any(h[0] == replica_id for h in first):
            return HOLDER
        return PULLER if first else COLD

    def without(self, replica_id: str) -> "RoutedAnswer":
        """The answer less `replica_id`'s own holdings: what it can promote from others."""
        holders = {}
        for key, key_holders in self.holders.items():
            others = tuple(h for h in key_holders if h[0] != replica_id)
            if others:
                holders[key] = others
        return RoutedAnswer(self.namespace, self.answered, self.keys, holders)


def load_only(namespace: str) -> RoutedAnswer:
    return RoutedAnswer(namespace, False)


def from_directory(namespace: str, keys: Sequence[OffloadKey], holders: Sequence[Sequence[Sequence]]) -> RoutedAnswer:
    """The answer from a shard's holders of each of `keys` (`directory_answer.decode_answer`),
    as the shard gives them: (replica_id, node_id, row, generation) tuples, which `encode`
    and the router read by position (a replica reads them back as `Holder`s: `decode`)."""
    held = {key: tuple(key_holders) for key, key_holders in zip(keys, holders) if key_holders}
    return RoutedAnswer(namespace, True, tuple(keys), held)


def encode(answer: RoutedAnswer) -> dict[str, Any]:
    """The answer as JSON-able values (`decode` reads it back)."""
    replicas: dict[tuple[str, str], int] = {}
    holders = []
    for key in answer.keys:
        row = []
        for replica_id, node_id, block_row, generation in answer.holders.get(key, ()):
            index = replicas.setdefault((replica_id, node_id), len(replicas))
            row.append([index, block_row, generation])
        holders.append(row)
    return {
        "v": FORMAT,
        "namespace": answer.namespace,
        "answered": answer.answered,
        "keys": [key.hex() for key in answer.keys],
        "replicas": [list(r) for r in replicas],
        "holders": holders,
    }


def decode(value: Any, namespace: str) -> RoutedAnswer | None:
    """The answer `encode` gave, if `value` is one for cache `namespace`; else None."""
    try:
        return _decode(value, namespace)
    except (TypeError, ValueError, KeyError, IndexError):
        return None


def _decode(value: Any, namespace: str) -> RoutedAnswer | None:
    if not isinstance(value, Mapping) or value.get("v") != FORMAT or value.get("namespace") != namespace:
        return None
    if value.get("answered") is not True:
        return load_only(namespace)
    hex_keys, replicas, rows = value["keys"], value["replicas"], value["holders"]
    if not (isinstance(hex_keys, list) and isinstance(replicas, list) and isinstance(rows, list)):
        return None
    if len(hex_keys) > MAX_KEYS or len(rows) != len(hex_keys) or len(replicas) > MAX_HOLDERS:
        return None
    names = []
    for entry in replicas:
        replica_id, node_id = entry
        if not (isinstance(replica_id, str) and isinstance(node_id, str) and replica_id and node_id):
            return None
        names.append((replica_id, node_id))
    keys = []
    for hex_key in hex_keys:
        key = bytes.fromhex(hex_key)
        if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            return None
        keys.append(OffloadKey(key))
    if len({key[-4:] for key in keys}) > 1:
        return None  # one group only
    held = {}
    for key, row in zip(keys, rows):
        if not isinstance(row, list) or len(row) > MAX_HOLDERS:
            return None
        holders = []
        for index, block_row, generation in row:
            if not all(type(x) is int and x >= 0 for x in (index, block_row, generation)):
                return None
            holders.append(Holder(*names[index], block_row, generation))
        if holders:
            held[key] = tuple(holders)
    return RoutedAnswer(namespace, True, tuple(keys), held)
