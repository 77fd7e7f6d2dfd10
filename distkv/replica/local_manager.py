"""The scheduler-side OffloadingManager of one host pool: which block sits in which row."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Container, Iterable, Mapping

from distkv.abstract import (
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from distkv.replica.policies import make_policy
from distkv.storage.pool import MAX_KEY_BYTES, PoolLoadStoreSpec

# A key is a block hash (at least one byte) and a 4-byte group index, and must fit a row header.
MIN_KEY_BYTES = 5
# Generations reserved from the pool at once (HostPool.reserve_generations: a few system
# calls), so that prepare_store reserves once per this many blocks stored.
GENERATIONS_RESERVED = 1 << 16


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


class _Block:
    """A block in a pool row. refs: -1 while its store is in flight, else the loads reading it.
    seen: a stamp of the last lookup that found it, set by a wrapping manager for
    prepare_store's protect_from. shard: the Directory shard a wrapping manager placed it
    on, where its removal goes too (0 until placed: the one shard of a one-shard Directory)."""

    __slots__ = ("row", "generation", "refs", "seen", "shard")

    def __init__(self, row: int, generation: int, refs: int) -> None:
        self.row = row
        self.generation = generation
        self.refs = refs
        self.seen = -1
        self.shard = 0


class LocalOffloadingManager(OffloadingManager):
    """Keeps up to `num_rows` blocks in the rows of one pool, evicting by `policy`.

    Every stored block gets a fresh generation, reserved from the pool's segment
    (`generations`: HostPool.reserve_generations), so a row's header never shows a
    generation that an earlier block sealed, of this process or of one that had the
    segment before it, whatever the clocks did (a manager with no segment behind it,
    for benchmarks and tests, counts from the wall clock). A block is evictable only
    while it is ready and not pinned by a load; prepare_store's `protect_from` spares more.

    reset_cache drops every block at once, but a row that a job still reads or writes (a
    load's pin, a store in flight) is *retired*, not freed: it returns to the free list
    when that job's completion arrives, or at on_reset_flushed, once the engine says no
    job it had in flight at the reset will still touch its rows. While a key has a retired
    job, prepare_store leaves the key out (a lost store, so a miss) and the key is never
    in the block table: a key has jobs of one block at most, so a completion, which names
    keys only, always belongs to the block it finds, and a stale one never reaches a
    newer block of the same key.
    """

    def __init__(
        self, num_rows: int, policy: str = "lru", medium: str = "CPU", generations: Callable[[int], int] | None = None
    ) -> None:
        if not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows={num_rows!r}: the pool needs at least one row")
        self._num_rows = num_rows
        self._medium = medium
        self._policy = make_policy(policy, num_rows)
        self._blocks: dict[OffloadKey, _Block] = {}
        # popped from the end, so rows are first handed out in increasing order
        self._free_rows = list(range(num_rows - 1, -1, -1))
        # ready blocks no load pins
        self._num_evictable = 0
        self._reserve_generations = generations
        # [_next_generation, _reserved_until) are this manager's to hand out
        self._next_generation = 1 if generations is not None else time.time_ns()
        self._reserved_until = 1 if generations is not None else math.inf
        self._events: list[OffloadingEvent] = []
        # Blocks reset_cache or retire dropped while a job still used them (refs as in
        # _blocks: -1 a store in flight, else its loads), keeping their rows until it ends.
        self._retired: dict[OffloadKey, _Block] = {}
        # When a list, complete_store appends the (key, block) of each block it makes
        # loadable: how a wrapping manager learns their rows and generations without
        # looking every key up again.
        self.landed: list[tuple[OffloadKey, _Block]] | None = None
        # Likewise `dropped` gets the (key, block) of each block a removal event names, so
        # that a wrapping manager learns where each was placed after it left the table.
        self.dropped: list[tuple[OffloadKey, _Block]] | None = None
        # blocks made loadable by complete_store, and evicted to make room, so far
        self.blocks_stored = 0
        self.blocks_evicted = 0

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def block(self, key: OffloadKey) -> tuple[int, int] | None:
        """(row, generation) of the ready block `key`, or None if it is not ready here."""
        block = self._get_block(key)
        if block is None or block.refs < 0:
            return None
        return block.row, block.generation

    def ready_keys(self) -> list[OffloadKey]:
        """The keys of every ready block."""
        return [key for key, block in self._blocks.items() if block.refs >= 0]

    def _get_block(self, key: OffloadKey) -> _Block | None:
        try:
            block = self._blocks.get(key)
        except TypeError:  # unhashable: reported below as the bad key it is
            block = None
        if block is None:
            problem = key_problem(key)
            if problem is not None:
                raise ValueError(problem)
        return block

    @property
    def blocks(self) -> Mapping[OffloadKey, _Block]:
        """The block table: key -> block (row, generation, refs: -1 while its store is in
        flight). Read-only for others; it is never replaced, so a caller may keep it
        (the cluster manager's lookup does)."""
        return self._blocks

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        try:
            block = self._blocks.get(key)
        except TypeError:  # unhashable, so not bytes
            raise ValueError(key_problem(key)) from None
        if block is None:
            if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                raise ValueError(key_problem(key))
            return False
        # True when ready, None (retry later) while its store is in flight
        return block.refs >= 0 or None

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PoolLoadStoreSpec:
        blocks = self._blocks
        pinned: list[_Block] = []
        try:
            for key in keys:
                block = blocks.get(key)
                if block is None or block.refs < 0:
                    break
                if block.refs == 0:
                    self._num_evictable -= 1
                block.refs += 1
                pinned.append(block)
            else:
                return PoolLoadStoreSpec(
                    [block.row for block in pinned], keys, [block.generation for block in pinned]
                )
            problem = key_problem(key) or (
                f"offload key {key!r} is not stored" if block is None
                else f"offload key {key!r} is still being stored"
            )
        except TypeError:
            problem = key_problem(key)
        for block in pinned:
            block.refs -= 1
            if block.refs == 0:
                self._num_evictable += 1
        raise ValueError(f"prepare_load: {problem}")

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        check_keys(keys)
        self._policy.touch(keys if isinstance(keys, (list, tuple)) else list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        blocks = self._blocks
        retired = self._retired
        released: list[tuple[OffloadKey, _Block]] = []
        try:
            for key in keys:
                block = blocks.get(key)
                if block is not None and block.refs > 0:
                    block.refs -= 1
                    if block.refs == 0:
                        self._num_evictable += 1
                else:
                    # a key with a retired block is never in the table: this is its load
                    block = retired.get(key)
                    if block is None or block.refs <= 0:
                        break
                    block.refs -= 1
                released.append((key, block))
            else:
                if retired:
                    for key, block in released:
                        if block.refs == 0 and retired.get(key) is block:
                            self._free_retired(key)
                return
            problem = key_problem(key) or f"offload key {key!r} is not pinned by a load"
        except TypeError:
            problem = key_problem(key)
        for key, block in released:
            if block.refs == 0 and blocks.get(key) is block:
                self._num_evictable -= 1
            block.refs += 1
        raise ValueError(f"complete_load: {problem}")

    def _free_retired(self, key: OffloadKey) -> None:
        """The last job of retired block `key` ended: its row is free again."""
        self._free_rows.append(self._retired.pop(key).row)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, protect_from: float = math.inf
    ) -> PrepareStoreOutput | None:
        """The seed API's prepare_store; blocks whose `seen` is at least `protect_from` are
        not evicted for it either."""
        blocks = self._blocks
        retired = self._retired
        try:
            offered = dict.fromkeys(keys)
        except TypeError:
            check_keys(keys)
            raise
        keys_to_store: list[OffloadKey] = []
        # offered blocks that would otherwise be evictable
        num_protected = 0
        for key in offered:
            block = blocks.get(key)
            if block is None:
                if not (isinstance(key, bytes) and MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES):
                    raise ValueError(f"prepare_store: {key_problem(key)}")
                # a key whose retired job has not ended is left out: see the class docstring
                if not retired or key not in retired:
                    keys_to_store.append(key)
            elif block.refs == 0:
                num_protected += 1

        num_new = len(keys_to_store)
        if not num_new:
            return PrepareStoreOutput([], PoolLoadStoreSpec([], [], []), [])
        if self._next_generation + num_new > self._reserved_until:  # before anything changes
            count = max(num_new, GENERATIONS_RESERVED)
            self._next_generation = self._reserve_generations(count)
            self._reserved_until = self._next_generation + count
        free_rows = self._free_rows
        num_to_evict = num_new - len(free_rows)
        evicted: list[OffloadKey] = []
        if num_to_evict > 0:
            # Counting first turns a hopeless call into O(keys) instead of a full policy scan.
            if num_to_evict > self._num_evictable - num_protected:
                return None
            victims = self._policy.evict(
                num_to_evict,
                lambda key: (block := blocks[key]).refs == 0 and block.seen < protect_from and key not in offered,
            )
            if victims is None:
                return None
            dropped = self.dropped
            for key in victims:
                block = blocks.pop(key)
                free_rows.append(block.row)
                if dropped is not None:
                    dropped.append((key, block))
            self._num_evictable -= num_to_evict
            self.blocks_evicted += num_to_evict
            self._events.append(OffloadingEvent(list(victims), self._medium, True))
            evicted = victims

        rows = free_rows[-num_new:]
        del free_rows[-num_new:]
        first_generation = self._next_generation
        self._next_generation = first_generation + num_new
        generations = range(first_generation, first_generation + num_new)
        for key, row, generation in zip(keys_to_store, rows, generations):
            blocks[key] = _Block(row, generation, -1)
        insert = self._policy.insert
        # the first key ends up most recent, as with touch
        for key in reversed(keys_to_store):
            insert(key)
        return PrepareStoreOutput(
            keys_to_store, PoolLoadStoreSpec(rows, keys_to_store, generations), evicted
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        blocks = self._blocks
        retired = self._retired
        landed: list[tuple[OffloadKey, _Block]] = []
        ended: list[OffloadKey] = []  # stores of retired blocks: their rows are free again
        try:
            for key in keys:
                block = blocks.get(key)
                if block is not None and block.refs < 0:
                    landed.append((key, block))
                elif block is None:
                    problem = key_problem(key)
                    if problem is not None:
                        raise ValueError(f"complete_store: {problem}")
                    # a key with a retired block is never in the table: this is its store
                    block = retired.get(key)
                    if block is not None and block.refs < 0:
                        ended.append(key)
        except TypeError:
            check_keys(keys)
            raise
        for key in ended:
            if key in retired:  # a key repeated in `keys` ends once
                self._free_retired(key)
        done: list[OffloadKey] = []
        if success:
            for key, block in landed:
                if block.refs < 0:  # a key repeated in `keys` lands once
                    block.refs = 0
                    done.append(key)
            self._num_evictable += len(done)
            self.blocks_stored += len(done)
            if self.landed is not None:
                self.landed += landed  # a key repeated in `keys` twice: harmless
        else:
            remove = self._policy.remove
            dropped = self.dropped
            for key, block in landed:
                if blocks.pop(key, None) is not None:
                    remove(key)
                    self._free_rows.append(block.row)
                    done.append(key)
                    if dropped is not None:
                        dropped.append((key, block))
        if done:
            self._events.append(OffloadingEvent(done, self._medium, not success))

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        stored: list[OffloadKey] = []
        retired = self._retired
        dropped = self.dropped
        for key, block in self._blocks.items():
            if block.refs >= 0:
                stored.append(key)
                if dropped is not None:
                    dropped.append((key, block))
            if block.refs != 0:
                retired[key] = block
        self._blocks.clear()
        self._policy.clear()
        in_use = {block.row for block in retired.values()}
        self._free_rows = [row for row in range(self._num_rows - 1, -1, -1) if row not in in_use]
        self._num_evictable = 0
        if stored:
            self._events.append(OffloadingEvent(stored, self._medium, True))

    def retire(self, keys: Collection[OffloadKey]) -> None:
        """Drop the in-flight stores of `keys` (others are ignored) from the block table, as
        reset_cache does: lookups miss them at once, and each row is freed when its
        complete_store arrives, which must still come."""
        check_keys(keys)
        blocks = self._blocks
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.refs < 0:
                del blocks[key]
                self._policy.remove(key)
                self._retired[key] = block

    def on_reset_flushed(self, still_running: Container[OffloadKey] = ()) -> None:
        """Every job the engine had in flight at the last reset_cache has ended, reported
        or not: the rows of retired blocks are free again, except those of
        `still_running`, jobs of another party (promotions) that will still complete."""
        for key in [key for key in self._retired if key not in still_running]:
            self._free_retired(key)
