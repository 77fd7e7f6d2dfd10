"""What an offload key may be: the rule every manager and the Directory check keys by.

A key is a block hash (one byte at least) and a 4-byte group index, and it must fit a
slot's header (`distkv.storage.slots.MAX_KEY_BYTES`).
"""

from __future__ import annotations

from collections.abc import Iterable

from distkv.storage.slots import MAX_KEY_BYTES

# A key is a block hash (at least one byte) and a 4-byte group index, and must fit a row header.
MIN_KEY_BYTES = 5


def key_problem(key: object) -> str | None:
    """What makes `key` unusable as an OffloadKey, or None if it is fine."""
    if not isinstance(key, bytes):
        return f"offload key {key!r} is a {type(key).__name__}, not bytes"
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        return (
            f"offload key {key!r} is {len(key)} bytes long, "
            f"not {MIN_KEY_BYTES}..{MAX_KEY_BYTES}"
        )
    return None


def check_keys(keys: Iterable[object]) -> None:
    """Raise ValueError naming the first key of `keys` that is not a valid OffloadKey."""
    for key in keys:
        # the common case inline: this runs per key on the scheduler's batch calls
        if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            problem = key_problem(key)
            if problem is not None:
                raise ValueError(problem)
