import time
from collections import OrderedDict

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from distkv.abstract import OffloadingEvent, OffloadingManager, ReqContext
from distkv.replica.local_manager import LocalOffloadingManager
from distkv.storage.slots import MAX_KEY_BYTES
from distkv.storage.pool import PoolLoadStoreSpec

POLICIES = ["lru", "arc"]
CTX = ReqContext("req-0")

BAD_KEYS = [
    pytest.param("abcdefgh", "str, not bytes", id="str"),
    pytest.param(12345678, "int, not bytes", id="int"),
    pytest.param(bytearray(8), "bytearray, not bytes", id="bytearray"),
    pytest.param([1, 2, 3], "list, not bytes", id="unhashable"),
    pytest.param(b"abcd", "4 bytes long", id="short"),
    pytest.param(b"x" * (MAX_KEY_BYTES + 1), f"{MAX_KEY_BYTES + 1} bytes long", id="long"),
]


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"\0\0\0\0"


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> str:
    return request.param


def make(policy: str, num_rows: int = 4) -> LocalOffloadingManager:
    return LocalOffloadingManager(num_rows, policy)


def store(manager: LocalOffloadingManager, keys: list[bytes]) -> PoolLoadStoreSpec:
    out = manager.prepare_store(keys, CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    return out.store_spec


def state(manager: LocalOffloadingManager) -> tuple:
    """Everything the manager holds, to check that a rejected call changed nothing."""
    policy_state = {
        name: list(value) if isinstance(value, OrderedDict) else value
        for name, value in vars(manager._policy).items()
    }
    return (
        {key: (b.row, b.generation, b.refs) for key, b in manager._blocks.items()},
        list(manager._rows.free),
        manager._num_evictable,
        {key: (b.row, b.refs) for key, b in manager._retired.items()},
        list(manager._events),
        manager._generations._next,
        policy_state,
    )


def live_rows(manager: LocalOffloadingManager) -> list[int]:
    return [b.row for b in manager._blocks.values()]


# ---- construction ------------------------------------------------------------------


def test_is_an_offloading_manager(policy: str) -> None:
    manager = make(policy, 3)
    assert isinstance(manager, OffloadingManager)
    assert manager.num_rows == 3
    assert manager.num_free_rows == 3
    assert manager.ready_keys() == []


@pytest.mark.parametrize("num_rows", [0, -1])
def test_needs_at_least_one_row(num_rows: int) -> None:
    with pytest.raises(ValueError, match=f"num_rows={num_rows}"):
        LocalOffloadingManager(num_rows)


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match=r"'mru'.*'lru'.*'arc'"):
        LocalOffloadingManager(4, "mru")


# ---- lookup ------------------------------------------------------------------------


def test_lookup_follows_store(policy: str) -> None:
    manager = make(policy)
    assert manager.lookup(k(0), CTX) is False
    manager.prepare_store([k(0)], CTX)
    assert manager.lookup(k(0), CTX) is None
    manager.complete_store([k(0)], CTX)
    assert manager.lookup(k(0), CTX) is True


@pytest.mark.parametrize("key, problem", BAD_KEYS)
def test_lookup_rejects_bad_key(policy: str, key: object, problem: str) -> None:
    manager = make(policy)
    with pytest.raises(ValueError, match=problem):
        manager.lookup(key, CTX)


@pytest.mark.parametrize("length", [5, MAX_KEY_BYTES])
def test_key_length_bounds_are_accepted(policy: str, length: int) -> None:
    manager = make(policy)
    key = b"k" * length
    assert manager.lookup(key, CTX) is False
    store(manager, [key])
    assert manager.lookup(key, CTX) is True


# ---- prepare_store / complete_store ------------------------------------------------


def test_prepare_store_hands_out_free_rows_with_fresh_generations(policy: str) -> None:
    before = time.time_ns()
    manager = make(policy, 4)
    out = manager.prepare_store([k(0), k(1), k(2)], CTX)
    assert out.keys_to_store == [k(0), k(1), k(2)]
    assert out.evicted_keys == []
    spec = out.store_spec
    assert isinstance(spec, PoolLoadStoreSpec)
    assert spec.keys == [k(0), k(1), k(2)]
    assert len(set(spec.block_ids.tolist())) == 3
    assert set(spec.block_ids.tolist()) <= set(range(4))
    gens = spec.generations.tolist()
    assert gens == sorted(gens) and len(set(gens)) == 3 and gens[0] >= before
    assert manager.num_free_rows == 1
    later = manager.prepare_store([k(3)], CTX).store_spec.generations.tolist()
    assert later[0] > gens[-1]


def test_generations_do_not_repeat_across_managers(policy: str) -> None:
    first = make(policy)
    gens = store(first, [k(0), k(1)]).generations.tolist()
    second = make(policy)
    assert store(second, [k(0)]).generations.tolist()[0] > max(gens)


def test_generations_never_repeat_in_a_segment_after_a_clock_step_and_a_re_attach(monkeypatch) -> None:
    """A replica's scheduler that restarts while its workers keep the segment attaches to
    it again, and the wall clock may have stepped back meanwhile (NTP, a restored VM): no
    generation sealed or handed out before may be handed out again, or a reader of an old
    (key, generation) would take a row sealed anew under it (the slot protocol's premise)."""
    from distkv.replica.specs import LocalOffloadingSpec

    wall_clock = [1_750_000_000_000_000_000]
    monkeypatch.setattr(time, "time_ns", lambda: wall_clock[0])
    first = LocalOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": 64 * 4096}, gpu_block_sizes=[16], group_page_bytes=[4096]
    )
    worker_pool = first.pool  # a worker's mapping, held across the scheduler's restart
    try:
        before = first.get_manager()
        sealed = set()
        for batch in range(8):
            spec = store(before, [k(batch * 8 + i) for i in range(8)])
            sealed.update(spec.generations.tolist())
            for row, key, generation in zip(spec.block_ids.tolist(), spec.keys, spec.generations.tolist()):
                rows = np.array([row])
                worker_pool.begin_write(0, rows)
                worker_pool.seal(0, rows, [key], np.array([generation], dtype=np.uint64), 4096)
        restarted = LocalOffloadingSpec(first.vllm_config, first.kv_cache_config)  # the new scheduler
        try:
            assert restarted.pool_name == first.pool_name
            after = restarted.get_manager()  # the clock has not moved: it stepped back to its start
            handed = set()
            for batch in range(8):
                handed.update(store(after, [k(1000 + batch * 8 + i) for i in range(8)]).generations.tolist())
        finally:
            restarted.close()
        assert not handed & sealed, "a generation handed out again in the same segment"
        assert min(handed) > max(sealed)
    finally:
        first.close()


def test_block_reports_row_and_generation_of_ready_blocks(policy: str) -> None:
    manager = make(policy)
    out = manager.prepare_store([k(0)], CTX)
    assert manager.block(k(0)) is None  # in flight
    manager.complete_store([k(0)], CTX)
    row, generation = manager.block(k(0))
    assert row == out.store_spec.block_ids[0]
    assert generation == out.store_spec.generations[0]
    assert manager.block(k(1)) is None
    with pytest.raises(ValueError, match="4 bytes long"):
        manager.block(b"abcd")


def test_ready_keys_lists_only_ready_blocks(policy: str) -> None:
    manager = make(policy)
    store(manager, [k(0), k(1)])
    manager.prepare_store([k(2)], CTX)
    assert sorted(manager.ready_keys()) == [k(0), k(1)]


def test_prepare_store_skips_stored_in_flight_and_repeated_keys(policy: str) -> None:
    manager = make(policy, 8)
    store(manager, [k(0)])
    manager.prepare_store([k(1)], CTX)
    out = manager.prepare_store([k(0), k(1), k(2), k(2), k(3), k(2)], CTX)
    assert out.keys_to_store == [k(2), k(3)]
    assert out.store_spec.keys == [k(2), k(3)]
    assert manager.num_free_rows == 4


def test_prepare_store_of_nothing_new_is_empty(policy: str) -> None:
    manager = make(policy)
    store(manager, [k(0)])
    for keys in ([], [k(0)]):
        out = manager.prepare_store(keys, CTX)
        assert out.keys_to_store == [] and out.evicted_keys == []
        assert len(out.store_spec.block_ids) == 0
    assert manager.take_events() == [OffloadingEvent([k(0)], "CPU", False)]


@pytest.mark.parametrize("key, problem", BAD_KEYS)
def test_prepare_store_rejects_bad_key_without_change(policy: str, key: object, problem: str) -> None:
    manager = make(policy, 2)
    store(manager, [k(0), k(1)])
    before = state(manager)
    with pytest.raises(ValueError, match=problem):
        manager.prepare_store([k(2), key], CTX)
    assert state(manager) == before


def test_full_pool_evicts_least_recently_used(policy: str) -> None:
    manager = make(policy, 3)
    store(manager, [k(0)])
    store(manager, [k(1)])
    store(manager, [k(2)])
    manager.take_events()
    out = manager.prepare_store([k(3), k(4)], CTX)
    assert out.evicted_keys == [k(0), k(1)]
    assert manager.lookup(k(0), CTX) is False
    assert set(out.store_spec.block_ids.tolist()) | {manager.block(k(2))[0]} == {0, 1, 2}
    manager.complete_store([k(3), k(4)], CTX)
    assert manager.take_events() == [
        OffloadingEvent([k(0), k(1)], "CPU", True),
        OffloadingEvent([k(3), k(4)], "CPU", False),
    ]


def test_touch_keeps_block_longer(policy: str) -> None:
    manager = make(policy, 3)
    for i in range(3):
        store(manager, [k(i)])
    manager.touch([k(0), k(9)], CTX)  # k(9) is unknown: ignored
    assert manager.prepare_store([k(3)], CTX).evicted_keys == [k(1)]


@pytest.mark.parametrize("key, problem", BAD_KEYS)
def test_touch_rejects_bad_key_without_change(policy: str, key: object, problem: str) -> None:
    manager = make(policy, 3)
    store(manager, [k(0), k(1)])
    before = state(manager)
    with pytest.raises(ValueError, match=problem):
        manager.touch([k(1), key], CTX)
    assert state(manager) == before


def test_pinned_blocks_are_not_evicted(policy: str) -> None:
    manager = make(policy, 3)
    for i in range(3):
        store(manager, [k(i)])
    manager.prepare_load([k(0), k(1)], CTX)
    assert manager.prepare_store([k(3)], CTX).evicted_keys == [k(2)]


def test_in_flight_blocks_are_not_evicted(policy: str) -> None:
    manager = make(policy, 3)
    manager.prepare_store([k(0), k(1)], CTX)
    store(manager, [k(2)])
    assert manager.prepare_store([k(3)], CTX).evicted_keys == [k(2)]
    assert manager.prepare_store([k(4)], CTX) is None


def test_offered_keys_are_not_evicted_by_their_call(policy: str) -> None:
    manager = make(policy, 2)
    store(manager, [k(0)])
    store(manager, [k(1)])
    out = manager.prepare_store([k(0), k(2)], CTX)  # k(0) is the oldest, but offered
    assert out.keys_to_store == [k(2)]
    assert out.evicted_keys == [k(1)]
    assert manager.prepare_store([k(0), k(1)], CTX) is None  # only k(0) could go


def test_prepare_store_is_all_or_nothing(policy: str) -> None:
    manager = make(policy, 3)
    for i in range(3):
        store(manager, [k(i)])
    manager.prepare_load([k(0)], CTX)
    manager.take_events()
    before = state(manager)
    assert manager.prepare_store([k(3), k(4), k(5)], CTX) is None
    assert state(manager) == before
    assert manager.prepare_store([k(i) for i in range(10, 14)], CTX) is None  # more than the pool
    assert state(manager) == before
    assert manager.prepare_store([k(3), k(4)], CTX).evicted_keys == [k(1), k(2)]


def test_complete_store_makes_blocks_ready_once(policy: str) -> None:
    manager = make(policy)
    manager.prepare_store([k(0), k(1)], CTX)
    manager.complete_store([k(0), k(0), k(7)], CTX)  # k(7) is not in flight: ignored
    assert manager.lookup(k(0), CTX) is True
    assert manager.lookup(k(1), CTX) is None
    manager.complete_store([k(0), k(1)], CTX)
    assert manager.take_events() == [
        OffloadingEvent([k(0)], "CPU", False),
        OffloadingEvent([k(1)], "CPU", False),
    ]


def test_failed_store_frees_rows_and_reports_removal(policy: str) -> None:
    manager = make(policy, 2)
    store(manager, [k(0)])
    manager.prepare_store([k(1)], CTX)
    manager.take_events()
    manager.complete_store([k(0), k(1), k(5)], CTX, success=False)
    assert manager.lookup(k(0), CTX) is True  # already stored: not in flight, ignored
    assert manager.lookup(k(1), CTX) is False
    assert manager.num_free_rows == 1
    assert manager.take_events() == [OffloadingEvent([k(1)], "CPU", True)]
    assert manager.prepare_store([k(2)], CTX).evicted_keys == []  # the freed row


def test_complete_store_rejects_unhashable_key_without_change(policy: str) -> None:
    manager = make(policy)
    manager.prepare_store([k(0)], CTX)
    before = state(manager)
    with pytest.raises(ValueError, match="list, not bytes"):
        manager.complete_store([k(0), [1]], CTX)
    assert state(manager) == before


# ---- prepare_load / complete_load --------------------------------------------------


def test_prepare_load_points_at_the_stored_rows(policy: str) -> None:
    manager = make(policy, 4)
    stored = store(manager, [k(0), k(1), k(2)])
    spec = manager.prepare_load([k(2), k(0)], CTX)
    assert isinstance(spec, PoolLoadStoreSpec)
    assert spec.keys == [k(2), k(0)]
    assert spec.block_ids.tolist() == [stored.block_ids[2], stored.block_ids[0]]
    np.testing.assert_array_equal(spec.generations, stored.generations[[2, 0]])


def test_pins_stack(policy: str) -> None:
    manager = make(policy, 2)
    store(manager, [k(0), k(1)])
    manager.prepare_load([k(0)], CTX)
    manager.prepare_load([k(0)], CTX)
    manager.complete_load([k(0)], CTX)
    assert manager.prepare_store([k(2), k(3)], CTX) is None  # k(0) still pinned once
    manager.complete_load([k(0)], CTX)
    assert sorted(manager.prepare_store([k(2), k(3)], CTX).evicted_keys) == [k(0), k(1)]


def test_repeated_key_in_one_load_pins_twice(policy: str) -> None:
    manager = make(policy, 1)
    store(manager, [k(0)])
    manager.prepare_load([k(0), k(0)], CTX)
    manager.complete_load([k(0)], CTX)
    assert manager.prepare_store([k(1)], CTX) is None
    manager.complete_load([k(0)], CTX)
    with pytest.raises(ValueError, match="not pinned"):
        manager.complete_load([k(0)], CTX)


@pytest.mark.parametrize("missing", ["absent", "in flight"])
def test_prepare_load_of_unready_key_takes_no_pin(policy: str, missing: str) -> None:
    manager = make(policy, 3)
    store(manager, [k(0), k(1)])
    if missing == "in flight":
        manager.prepare_store([k(2)], CTX)
    before = state(manager)
    problem = "not stored" if missing == "absent" else "still being stored"
    with pytest.raises(ValueError, match=rf"{k(2)!r}.*{problem}".replace("\\", "\\\\")):
        manager.prepare_load([k(0), k(1), k(2)], CTX)
    assert state(manager) == before


@pytest.mark.parametrize("key, problem", BAD_KEYS)
def test_prepare_load_rejects_bad_key_without_change(policy: str, key: object, problem: str) -> None:
    manager = make(policy)
    store(manager, [k(0)])
    before = state(manager)
    with pytest.raises(ValueError, match=problem):
        manager.prepare_load([k(0), key], CTX)
    assert state(manager) == before


def test_complete_load_of_unpinned_key_changes_nothing(policy: str) -> None:
    manager = make(policy)
    store(manager, [k(0), k(1)])
    manager.prepare_load([k(0)], CTX)
    before = state(manager)
    for keys in ([k(0), k(1)], [k(0), k(0)], [k(0), k(5)]):
        with pytest.raises(ValueError, match="not pinned"):
            manager.complete_load(keys, CTX)
        assert state(manager) == before
    with pytest.raises(ValueError, match="int, not bytes"):
        manager.complete_load([k(0), 7], CTX)
    assert state(manager) == before


# ---- events and reset --------------------------------------------------------------


def test_take_events_returns_only_new_events(policy: str) -> None:
    manager = LocalOffloadingManager(2, policy, medium="HOST")
    store(manager, [k(0)])
    assert manager.take_events() == [OffloadingEvent([k(0)], "HOST", False)]
    assert manager.take_events() == []
    store(manager, [k(1)])
    assert manager.take_events() == [OffloadingEvent([k(1)], "HOST", False)]


def test_reset_cache_empties_everything(policy: str) -> None:
    manager = make(policy, 4)
    store(manager, [k(0), k(1)])
    manager.prepare_load([k(0)], CTX)
    manager.prepare_store([k(2)], CTX)
    manager.take_events()
    manager.reset_cache()
    assert manager.take_events() == [OffloadingEvent([k(0), k(1)], "CPU", True)]
    # the rows of the load and the store in flight stay out of use until they end
    assert manager.num_free_rows == 2
    assert manager.ready_keys() == []
    for i in range(3):
        assert manager.lookup(k(i), CTX) is False
    # completions of the dropped jobs free their rows and nothing else
    manager.complete_store([k(2)], CTX)
    manager.complete_load([k(0)], CTX)
    assert manager.lookup(k(2), CTX) is False
    assert manager.take_events() == []
    assert manager.num_free_rows == 4
    with pytest.raises(ValueError, match="not pinned"):
        manager.complete_load([k(0)], CTX)  # its one dropped pin is spent
    # the whole pool is usable again, with generations that never repeat
    out = manager.prepare_store([k(i) for i in range(10, 14)], CTX)
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2, 3]


def test_reset_cache_of_empty_manager_reports_nothing(policy: str) -> None:
    manager = make(policy)
    manager.prepare_store([k(0)], CTX)
    manager.reset_cache()
    assert manager.take_events() == []


# Finding 2 of issue 15: each case drives the completions of jobs a reset interrupted
# in the order that broke the manager, and checks that they touch nothing newer.


def test_a_row_a_load_still_reads_is_not_reused_after_a_reset(policy: str) -> None:
    manager = make(policy, 2)
    (row,) = store(manager, [k(0)]).block_ids.tolist()
    manager.prepare_load([k(0)], CTX)
    manager.reset_cache()
    assert manager.prepare_store([k(1), k(2)], CTX) is None  # one row is free, not two
    out = manager.prepare_store([k(1)], CTX)
    assert out.store_spec.block_ids.tolist() != [row]
    manager.complete_load([k(0)], CTX)  # the load is done: its row is free again
    assert manager.prepare_store([k(2)], CTX).store_spec.block_ids.tolist() == [row]


def test_a_late_complete_load_never_spends_a_newer_loads_pin(policy: str) -> None:
    manager = make(policy, 2)
    store(manager, [k(0)])
    manager.prepare_load([k(0)], CTX)  # load A
    manager.reset_cache()
    # k(0) is not stored again while A may still read its old row
    assert manager.prepare_store([k(0)], CTX).keys_to_store == []
    assert manager.lookup(k(0), CTX) is False
    manager.complete_load([k(0)], CTX)  # A's late completion
    store(manager, [k(0)])
    manager.prepare_load([k(0)], CTX)  # load C, of the new block
    # C's block stays pinned: a store needing every row cannot evict it
    assert manager.prepare_store([k(1), k(2)], CTX) is None
    with pytest.raises(ValueError, match="not pinned"):
        manager.complete_load([k(0), k(0)], CTX)  # A's pin was spent once, on A's row
    manager.complete_load([k(0)], CTX)  # C's
    assert manager.prepare_store([k(1), k(2)], CTX).evicted_keys == [k(0)]


def test_a_late_complete_store_never_marks_a_newer_store_ready(policy: str) -> None:
    manager = make(policy, 2)
    manager.prepare_store([k(0)], CTX)  # store S1
    manager.reset_cache()
    # no second store of k(0) while S1 may still write its row
    assert manager.prepare_store([k(0)], CTX).keys_to_store == []
    manager.complete_store([k(0)], CTX)  # S1's late completion
    assert manager.lookup(k(0), CTX) is False  # not HIT: nothing of S1 is loadable
    assert manager.take_events() == []
    assert manager.num_free_rows == 2
    out = manager.prepare_store([k(0)], CTX)  # store S2
    assert out.keys_to_store == [k(0)]
    assert manager.lookup(k(0), CTX) is None  # in flight until S2's own completion
    manager.complete_store([k(0)], CTX)
    assert manager.lookup(k(0), CTX) is True


def test_a_failed_late_complete_store_frees_its_row_only(policy: str) -> None:
    manager = make(policy, 2)
    manager.prepare_store([k(0)], CTX)
    manager.reset_cache()
    store(manager, [k(1)])
    manager.complete_store([k(0)], CTX, success=False)
    assert manager.num_free_rows == 1
    assert manager.lookup(k(1), CTX) is True


def test_on_reset_flushed_frees_the_rows_of_jobs_never_completed(policy: str) -> None:
    # vLLM never completes the jobs in flight at a reset; it calls on_reset_flushed once
    # its workers have finished them
    manager = make(policy, 4)
    store(manager, [k(0)])
    manager.prepare_load([k(0)], CTX)
    manager.prepare_store([k(1), k(2)], CTX)
    manager.reset_cache()
    assert manager.num_free_rows == 1
    manager.on_reset_flushed(still_running={k(2)})  # k(2): a promotion, still writing
    assert manager.num_free_rows == 3
    assert manager.prepare_store([k(0), k(1), k(2)], CTX).keys_to_store == [k(0), k(1)]
    manager.complete_store([k(2)], CTX)  # the promotion's report
    assert manager.num_free_rows == 2
    assert manager.lookup(k(2), CTX) is False


def test_retire_drops_an_in_flight_store_and_keeps_its_row(policy: str) -> None:
    manager = make(policy, 2)
    store(manager, [k(0)])
    manager.prepare_load([k(0)], CTX)  # not evictable either
    manager.prepare_store([k(1)], CTX)
    manager.retire([k(0), k(1)])  # k(0) is ready: left alone
    assert manager.lookup(k(1), CTX) is False and manager.lookup(k(0), CTX) is True
    assert manager.prepare_store([k(1)], CTX).keys_to_store == []
    assert manager.prepare_store([k(2)], CTX) is None  # k(1)'s row is not reused
    manager.complete_store([k(1)], CTX)
    assert manager.lookup(k(1), CTX) is False
    assert manager.prepare_store([k(2)], CTX).keys_to_store == [k(2)]


# ---- ARC through the manager -------------------------------------------------------


def test_arc_keeps_frequent_block_through_a_scan() -> None:
    for policy, survives in (("arc", True), ("lru", False)):
        manager = make(policy, 4)
        store(manager, [k(0)])
        manager.touch([k(0)], CTX)
        for i in range(100, 120):
            store(manager, [k(i)])
        assert manager.lookup(k(0), CTX) is survives, policy


# ---- model-based -------------------------------------------------------------------

NUM_KEYS = 10
KEYS = [k(i) for i in range(NUM_KEYS)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=5)


class ManagerModel(RuleBasedStateMachine):
    """Random operations against a plain model of what the manager must hold."""

    policy = "lru"

    @initialize(num_rows=st.integers(1, 6))
    def setup(self, num_rows: int) -> None:
        self.manager = LocalOffloadingManager(num_rows, self.policy)
        self.num_rows = num_rows
        self.ready: dict[bytes, int] = {}  # key -> pins
        self.in_flight: set[bytes] = set()
        self.rows: dict[bytes, int] = {}
        # what reset_cache retired: key -> (row, pins, or -1 for a store in flight)
        self.retired: dict[bytes, tuple[int, int]] = {}
        self.replayed: set[bytes] = set()
        self.last_generation = 0

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[bytes]) -> None:
        offered = list(dict.fromkeys(keys))
        new = [key for key in offered if key not in self.ready and key not in self.in_flight and key not in self.retired]
        need = len(new) - (self.num_rows - len(self.rows) - len(self.retired))
        evictable = {key for key, pins in self.ready.items() if pins == 0 and key not in offered}
        out = self.manager.prepare_store(keys, CTX)
        if new and need > len(evictable):
            assert out is None
            return
        assert out is not None
        assert out.keys_to_store == new
        assert len(out.evicted_keys) == max(need, 0)
        assert set(out.evicted_keys) <= evictable
        for key in out.evicted_keys:
            del self.ready[key]
            del self.rows[key]
        spec = out.store_spec
        assert spec.keys == new
        rows = spec.block_ids.tolist()
        assert not set(rows) & set(self.rows.values())
        assert not set(rows) & {row for row, _ in self.retired.values()}
        gens = spec.generations.tolist()
        assert all(gen > self.last_generation for gen in gens)
        assert gens == sorted(set(gens))
        if gens:
            self.last_generation = gens[-1]
        self.rows.update(zip(new, rows))
        self.in_flight.update(new)

    @rule(keys=key_lists, success=st.booleans())
    def complete_store(self, keys: list[bytes], success: bool) -> None:
        self.manager.complete_store(keys, CTX, success)
        for key in set(keys):
            if self.retired.get(key, (0, 0))[1] < 0:
                del self.retired[key]
        for key in set(keys) & self.in_flight:
            self.in_flight.discard(key)
            if success:
                self.ready[key] = 0
            else:
                del self.rows[key]

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def complete_some_store(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.in_flight)), min_size=1))
        self.complete_store(keys, data.draw(st.booleans()))

    @rule(keys=key_lists)
    def prepare_load(self, keys: list[bytes]) -> None:
        if all(key in self.ready for key in keys):
            spec = self.manager.prepare_load(keys, CTX)
            assert spec.block_ids.tolist() == [self.rows[key] for key in keys]
            for key in keys:
                self.ready[key] += 1
        else:
            with pytest.raises(ValueError):
                self.manager.prepare_load(keys, CTX)

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def prepare_load_ready(self, data: st.DataObject) -> None:
        self.prepare_load(data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1)))

    @rule(keys=key_lists)
    def complete_load(self, keys: list[bytes]) -> None:
        ready = dict(self.ready)
        retired = dict(self.retired)
        ok = True
        for key in keys:
            if ready.get(key, 0) > 0:
                ready[key] -= 1
            elif retired.get(key, (0, 0))[1] > 0:
                row, pins = retired[key]
                if pins == 1:
                    del retired[key]
                else:
                    retired[key] = (row, pins - 1)
            else:
                ok = False
        if ok:
            self.manager.complete_load(keys, CTX)
            self.ready = ready
            self.retired = retired
        else:
            with pytest.raises(ValueError):
                self.manager.complete_load(keys, CTX)

    @precondition(lambda self: any(self.ready.values()))
    @rule(data=st.data())
    def complete_pinned_load(self, data: st.DataObject) -> None:
        pinned = sorted(key for key, pins in self.ready.items() if pins)
        self.complete_load(data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=2)))

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.manager.touch(keys, CTX)

    @rule()
    def take_events(self) -> None:
        for event in self.manager.take_events():
            assert len(set(event.keys)) == len(event.keys)
            if event.removed:
                self.replayed.difference_update(event.keys)
            else:
                assert not set(event.keys) & self.replayed
                self.replayed.update(event.keys)
        assert self.replayed == set(self.ready)

    # only with blocks in flight, so that resets drop interesting states and stay rarer
    @precondition(lambda self: self.in_flight)
    @rule()
    def reset_cache(self) -> None:
        self.manager.reset_cache()
        for key, pins in self.ready.items():
            if pins:
                self.retired[key] = (self.rows[key], pins)
        for key in self.in_flight:
            self.retired[key] = (self.rows[key], -1)
        self.ready.clear()
        self.in_flight.clear()
        self.rows.clear()

    @precondition(lambda self: self.retired)
    @rule(data=st.data())
    def on_reset_flushed(self, data: st.DataObject) -> None:
        still_running = set(data.draw(st.lists(st.sampled_from(sorted(self.retired)))))
        self.manager.on_reset_flushed(still_running)
        self.retired = {key: v for key, v in self.retired.items() if key in still_running}

    @precondition(lambda self: any(pins > 0 for _, pins in self.retired.values()))
    @rule(data=st.data())
    def complete_retired_load(self, data: st.DataObject) -> None:
        pinned = sorted(key for key, (_, pins) in self.retired.items() if pins > 0)
        self.complete_load(data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=2)))

    @precondition(lambda self: any(pins < 0 for _, pins in self.retired.values()))
    @rule(data=st.data())
    def complete_retired_store(self, data: st.DataObject) -> None:
        writing = sorted(key for key, (_, pins) in self.retired.items() if pins < 0)
        self.complete_store(data.draw(st.lists(st.sampled_from(writing), min_size=1)), data.draw(st.booleans()))

    @invariant()
    def agrees_with_model(self) -> None:
        manager = self.manager
        assert len(self.rows) + len(self.retired) <= self.num_rows
        assert not set(self.rows) & set(self.retired)
        assert manager.num_free_rows == self.num_rows - len(self.rows) - len(self.retired)
        for key in KEYS:
            expected = True if key in self.ready else None if key in self.in_flight else False
            assert manager.lookup(key, CTX) is expected
        assert sorted(manager.ready_keys()) == sorted(self.ready)
        for key in self.ready:
            assert manager.block(key)[0] == self.rows[key]
        rows = live_rows(manager)
        assert len(set(rows)) == len(rows) == len(self.rows)
        assert sorted(rows) == sorted(self.rows.values())
        assert {key: (b.row, b.refs) for key, b in manager._retired.items()} == self.retired
        assert not set(rows) & {row for row, _ in self.retired.values()}


class LRUManagerModel(ManagerModel):
    policy = "lru"


class ARCManagerModel(ManagerModel):
    policy = "arc"


MODEL_SETTINGS = settings(max_examples=100, stateful_step_count=80, deadline=None)
TestLRUManagerModel = MODEL_SETTINGS(LRUManagerModel).TestCase
TestARCManagerModel = MODEL_SETTINGS(ARCManagerModel).TestCase
