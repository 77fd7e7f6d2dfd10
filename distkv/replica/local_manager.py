"""The scheduler-side OffloadingManager of one host pool: which block sits in which row."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Container, Mapping
from typing import Protocol

from distkv.abstract import (
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from distkv.replica.policies import make_policy
from distkv.storage.keys import MIN_KEY_BYTES, check_keys, key_problem
from distkv.storage.slots import MAX_KEY_BYTES
from distkv.storage.pool import PoolLoadStoreSpec

# Generations reserved from the pool at once (HostPool.reserve_generations: a few system
# calls), so that prepare_store reserves once per this many blocks stored.
GENERATIONS_RESERVED = 1 << 16


class Block:
    """A block in a pool row. refs: -1 while its store is in flight, else the loads reading it.

    A manager that wraps this one and keeps state of its own per block hands in a subclass
    (`block_type`) with its own fields; the local manager reads and writes only these."""

    __slots__ = ("row", "generation", "refs")

    def __init__(self, row: int, generation: int, refs: int) -> None:
        self.row = row
        self.generation = generation
        self.refs = refs


class BlockSink(Protocol):
    """Who a manager tells of the blocks its calls make loadable or let go, as each call
    makes them: (key, block) pairs, a list of its own per call, in the order of the calls."""

    def stored(self, blocks: list[tuple[OffloadKey, Block]], req_context: ReqContext) -> None:
        """complete_store(success) made `blocks` loadable, for the request of `req_context`."""

    def removed(self, blocks: list[tuple[OffloadKey, Block]]) -> None:
        """`blocks`, loadable (or being stored) until now, left the manager: evicted, a
        failed store, or reset_cache."""


class Generations:
    """The generations a manager seals blocks with, each handed out once: reserved from the
    pool's segment (`reserve`: HostPool.reserve_generations, GENERATIONS_RESERVED at a
    time), so that a row's header never shows a generation an earlier block sealed, of
    this process or of one that had the segment before it, whatever the clocks did; a
    manager with no segment behind it (benchmarks, tests) counts from the wall clock."""

    def __init__(self, reserve: Callable[[int], int] | None) -> None:
        self._reserve = reserve
        # [_next, _until) are this manager's to hand out
        self._next = 1 if reserve is not None else time.time_ns()
        self._until = 1 if reserve is not None else math.inf

    def ensure(self, n: int) -> None:
        """Have `n` at hand (before a call changes anything: reserving may fail)."""
        if self._next + n > self._until:
            count = max(n, GENERATIONS_RESERVED)
            self._next = self._reserve(count)
            self._until = self._next + count

    def take(self, n: int) -> range:
        """`n` generations that `ensure(n)` made sure of."""
        first = self._next
        self._next = first + n
        return range(first, first + n)


class _Rows:
    """A pool's rows: the free ones (`free`, popped from the end, so that rows are first
    handed out in increasing order), and those of blocks dropped while a job still used
    them (`retired`: key -> block, refs as in the table: -1 a store in flight, else its
    loads), each kept out of use until its job ends."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.free = list(range(num_rows - 1, -1, -1))
        self.retired: dict[OffloadKey, Block] = {}

    def free_retired(self, key: OffloadKey) -> None:
        """The last job of retired block `key` ended: its row is free again."""
        self.free.append(self.retired.pop(key).row)

    def reset(self, blocks: Mapping[OffloadKey, Block]) -> None:
        """Every one of `blocks` is dropped: retire those a job still uses, free the rest."""
        retired = self.retired
        for key, block in blocks.items():
            if block.refs != 0:
                retired[key] = block
        in_use = {block.row for block in retired.values()}
        self.free = [row for row in range(self.num_rows - 1, -1, -1) if row not in in_use]

    def flush(self, still_running: Container[OffloadKey]) -> None:
        """Free the rows of every retired block but those of `still_running`."""
        for key in [key for key in self.retired if key not in still_running]:
            self.free_retired(key)


class LocalOffloadingManager(OffloadingManager):
    """Keeps up to `num_rows` blocks in the rows of one pool, evicting by `policy`.

    Every stored block gets a fresh generation (`Generations`, from `generations`). A block
    is evictable only while it is ready and not pinned by a load; prepare_store's `spare`
    spares more.

    reset_cache drops every block at once, but a row that a job still reads or writes (a
    load's pin, a store in flight) is *retired*, not freed (`_Rows`): free again when that
    job's completion arrives, or at on_reset_flushed, once the engine says no job it had in
    flight at the reset will still touch its rows. While a key has a retired job,
    prepare_store leaves the key out (a lost store, so a miss) and the key is not in the
    block table: a key has jobs of one block at most, so a completion, which names keys
    only, always belongs to the block it finds, never to a newer block of the same key.
    `block_type`: the class of its blocks (a wrapping manager's subclass of Block);
    `sink`: who hears of each block made loadable or let go.
    """

    def __init__(
        self,
        num_rows: int,
        policy: str = "lru",
        medium: str = "CPU",
        generations: Callable[[int], int] | None = None,
        *,
        block_type: type[Block] = Block,
        sink: BlockSink | None = None,
    ) -> None:
        if not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows={num_rows!r}: the pool needs at least one row")
        self.num_rows = num_rows
        self._medium = medium
        self._policy = make_policy(policy, num_rows)
        self._new_block = block_type
        self._sink = sink
        self._blocks: dict[OffloadKey, Block] = {}
        self._rows = _Rows(num_rows)
        self._retired = self._rows.retired  # never replaced: the calls below read it
        self._num_evictable = 0  # ready blocks no load pins
        self._generations = Generations(generations)
        self._events: list[OffloadingEvent] = []
        # blocks made loadable by complete_store, and evicted to make room, so far
        self.blocks_stored = 0
        self.blocks_evicted = 0

    @property
    def num_free_rows(self) -> int:
        return len(self._rows.free)

    def block(self, key: OffloadKey) -> tuple[int, int] | None:
        """(row, generation) of the ready block `key`, or None if it is not ready here."""
        try:
            block = self._blocks.get(key)
        except TypeError:  # unhashable: reported below as the bad key it is
            block = None
        if block is None or block.refs < 0:
            problem = None if block is not None else key_problem(key)
            if problem is not None:
                raise ValueError(problem)
            return None
        return block.row, block.generation

    def ready_keys(self) -> list[OffloadKey]:
        """The keys of every ready block."""
        return [key for key, block in self._blocks.items() if block.refs >= 0]

    @property
    def blocks(self) -> Mapping[OffloadKey, Block]:
        """The block table: key -> block. Read-only for others; it is never replaced, so a
        caller may keep it (the cluster manager's lookup does)."""
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
        pinned: list[Block] = []
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
        released: list[tuple[OffloadKey, Block]] = []
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
                            self._rows.free_retired(key)
                return
            problem = key_problem(key) or f"offload key {key!r} is not pinned by a load"
        except TypeError:
            problem = key_problem(key)
        for key, block in released:
            if block.refs == 0 and blocks.get(key) is block:
                self._num_evictable -= 1
            block.refs += 1
        raise ValueError(f"complete_load: {problem}")

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, spare: Callable[[Block], bool] | None = None
    ) -> PrepareStoreOutput | None:
        """The seed API's prepare_store; blocks for which `spare(block)` are not evicted
        for it either."""
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
        self._generations.ensure(num_new)  # before anything changes
        free_rows = self._rows.free
        num_to_evict = num_new - len(free_rows)
        evicted: list[OffloadKey] = []
        if num_to_evict > 0:
            # Counting first turns a hopeless call into O(keys) instead of a full policy scan.
            if num_to_evict > self._num_evictable - num_protected:
                return None
            if spare is None:
                evictable = lambda key: blocks[key].refs == 0 and key not in offered  # noqa: E731
            else:
                evictable = lambda key: (block := blocks[key]).refs == 0 and key not in offered and not spare(block)  # noqa: E731
            victims = self._policy.evict(num_to_evict, evictable)
            if victims is None:
                return None
            if self._sink is None:
                for key in victims:
                    free_rows.append(blocks.pop(key).row)
            else:
                dropped = [(key, blocks.pop(key)) for key in victims]
                free_rows.extend(block.row for _, block in dropped)
                self._sink.removed(dropped)
            self._num_evictable -= num_to_evict
            self.blocks_evicted += num_to_evict
            self._events.append(OffloadingEvent(list(victims), self._medium, True))
            evicted = victims

        rows = free_rows[-num_new:]
        del free_rows[-num_new:]
        generations = self._generations.take(num_new)
        new_block = self._new_block
        for key, row, generation in zip(keys_to_store, rows, generations):
            blocks[key] = new_block(row, generation, -1)
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
        landed: list[tuple[OffloadKey, Block]] = []
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
                self._rows.free_retired(key)
        done: list[OffloadKey] = []
        if success:
            for key, block in landed:
                if block.refs < 0:  # a key repeated in `keys` lands once
                    block.refs = 0
                    done.append(key)
            self._num_evictable += len(done)
            self.blocks_stored += len(done)
            if landed and self._sink is not None:
                self._sink.stored(landed, req_context)  # a key repeated in `keys` twice: harmless
        else:
            remove = self._policy.remove
            dropped = []
            for key, block in landed:
                if blocks.pop(key, None) is not None:
                    remove(key)
                    self._rows.free.append(block.row)
                    done.append(key)
                    dropped.append((key, block))
            if dropped and self._sink is not None:
                self._sink.removed(dropped)
        if done:
            self._events.append(OffloadingEvent(done, self._medium, not success))

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        stored = [(key, block) for key, block in self._blocks.items() if block.refs >= 0]
        self._rows.reset(self._blocks)
        self._blocks.clear()
        self._policy.clear()
        self._num_evictable = 0
        if stored:
            if self._sink is not None:
                self._sink.removed(stored)
            self._events.append(OffloadingEvent([key for key, _ in stored], self._medium, True))

    def retire(self, keys: Collection[OffloadKey]) -> None:
        """Retire the in-flight stores of `keys` (others are ignored), as reset_cache does:
        lookups miss them at once; each row is freed by its complete_store, still to come."""
        check_keys(keys)
        blocks = self._blocks
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.refs < 0:
                del blocks[key]
                self._policy.remove(key)
                self._retired[key] = block

    def on_reset_flushed(self, still_running: Container[OffloadKey] = ()) -> None:
        """Every job the engine had in flight at the last reset_cache has ended: the rows of
        retired blocks are free again, but those of `still_running` (another party's jobs)."""
        self._rows.flush(still_running)
