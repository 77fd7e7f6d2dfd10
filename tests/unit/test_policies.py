from collections import OrderedDict

import pytest

from distkv.replica.policies.arc import ARCPolicy
from distkv.replica.policies.base import CachePolicy
from distkv.replica.policies.lru import LRUPolicy
from distkv.replica.policies import make_policy

POLICIES = ["lru", "arc"]


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"\0\0\0\0"


def everything(key: bytes) -> bool:
    return True


def policy_state(policy: CachePolicy) -> dict:
    return {
        name: list(value.items()) if isinstance(value, OrderedDict) else value
        for name, value in vars(policy).items()
    }


class Cache:
    """Drives a policy the way a manager does: a miss evicts (when full), then inserts."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.resident: set[bytes] = set()

    def access(self, key: bytes) -> list[bytes]:
        if key in self.resident:
            self.policy.touch([key])
            return []
        victims = []
        if len(self.resident) == self.policy.capacity:
            victims = self.policy.evict(1, everything)
            self.resident.difference_update(victims)
        self.policy.insert(key)
        self.resident.add(key)
        return victims


def test_make_policy_builds_each_policy() -> None:
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    assert make_policy("arc", 4).capacity == 4


def test_make_policy_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"'fifo'.*'lru'.*'arc'"):
        make_policy("fifo", 4)


@pytest.mark.parametrize("name", POLICIES)
def test_capacity_below_one_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        make_policy(name, 0)


@pytest.mark.parametrize("name", POLICIES)
def test_evicts_oldest_first(name: str) -> None:
    policy = make_policy(name, 8)
    for i in range(4):
        policy.insert(k(i))
    assert policy.evict(2, everything) == [k(0), k(1)]
    assert policy.evict(2, everything) == [k(2), k(3)]
    assert policy.evict(1, everything) is None


@pytest.mark.parametrize("name", POLICIES)
def test_evict_zero_is_empty(name: str) -> None:
    policy = make_policy(name, 2)
    policy.insert(k(0))
    assert policy.evict(0, everything) == []
    assert policy.evict(1, everything) == [k(0)]


@pytest.mark.parametrize("name", POLICIES)
def test_evict_only_takes_evictable_keys(name: str) -> None:
    policy = make_policy(name, 8)
    for i in range(5):
        policy.insert(k(i))
    pinned = {k(0), k(2)}
    assert policy.evict(2, lambda key: key not in pinned) == [k(1), k(3)]
    assert policy.evict(3, everything) is not None


@pytest.mark.parametrize("name", POLICIES)
def test_evict_is_atomic(name: str) -> None:
    policy = make_policy(name, 8)
    for i in range(4):
        policy.insert(k(i))
    policy.touch([k(3)])
    before = policy_state(policy)
    assert policy.evict(3, lambda key: key in (k(1), k(3))) is None
    assert policy_state(policy) == before
    assert sorted(policy.evict(4, everything)) == [k(i) for i in range(4)]


@pytest.mark.parametrize("name", POLICIES)
def test_touch_keeps_key_longer(name: str) -> None:
    policy = make_policy(name, 8)
    for i in range(3):
        policy.insert(k(i))
    policy.touch([k(0)])
    assert policy.evict(2, everything) == [k(1), k(2)]
    assert policy.evict(1, everything) == [k(0)]


@pytest.mark.parametrize("name", POLICIES)
def test_touch_makes_first_key_most_recent(name: str) -> None:
    policy = make_policy(name, 8)
    for i in range(3):
        policy.insert(k(i))
    policy.touch([k(0), k(1), k(2)])
    assert policy.evict(3, everything) == [k(2), k(1), k(0)]


@pytest.mark.parametrize("name", POLICIES)
def test_touch_ignores_keys_not_resident(name: str) -> None:
    policy = make_policy(name, 8)
    policy.insert(k(0))
    before = policy_state(policy)
    policy.touch([k(5), k(6)])
    assert policy_state(policy) == before


@pytest.mark.parametrize("name", POLICIES)
def test_remove_drops_key(name: str) -> None:
    policy = make_policy(name, 8)
    for i in range(3):
        policy.insert(k(i))
    policy.touch([k(2)])
    policy.remove(k(0))
    policy.remove(k(2))
    assert policy.evict(1, everything) == [k(1)]
    assert policy.evict(1, everything) is None


@pytest.mark.parametrize("name", POLICIES)
def test_clear_drops_everything(name: str) -> None:
    policy = make_policy(name, 4)
    for i in range(4):
        policy.insert(k(i))
    policy.touch([k(1)])
    policy.evict(1, everything)
    policy.clear()
    assert policy.evict(1, everything) is None
    assert policy_state(policy) == policy_state(make_policy(name, 4))


def test_arc_frequent_key_survives_scan_lru_does_not() -> None:
    arc, lru = Cache(ARCPolicy(4)), Cache(LRUPolicy(4))
    for cache in (arc, lru):
        cache.access(k(0))
        cache.access(k(0))  # used twice: frequent
        for i in range(100, 120):  # a scan of blocks used once
            cache.access(k(i))
    assert k(0) in arc.resident
    assert k(0) not in lru.resident


def arc_with_frequent_key(capacity: int) -> tuple[ARCPolicy, Cache]:
    policy = ARCPolicy(capacity)
    cache = Cache(policy)
    cache.access(k(0))
    cache.access(k(0))  # T2 = [k(0)]
    return policy, cache


def test_arc_b1_ghost_hit_grows_target_and_returns_to_t2() -> None:
    policy, cache = arc_with_frequent_key(3)
    cache.access(k(1))
    cache.access(k(2))
    assert cache.access(k(3)) == [k(1)]  # T1 above p = 0 gives the victim; k(1) -> B1
    assert policy.target_t1_size == 0
    assert cache.access(k(1)) == [k(2)]  # B1 hit
    assert policy.target_t1_size == 1
    # T1 = [k(3)] is no larger than p = 1, so T2 gives the next victims, oldest first
    assert policy.evict(2, everything) == [k(0), k(1)]


def test_arc_b2_ghost_hit_shrinks_target() -> None:
    policy, cache = arc_with_frequent_key(3)
    cache.access(k(1))
    cache.access(k(2))
    cache.access(k(3))  # k(1) -> B1
    cache.access(k(1))  # B1 hit: p = 1, k(1) -> T2; k(2) -> B1
    assert policy.target_t1_size == 1
    assert cache.access(k(4)) == [k(0)]  # T1 = [k(3)] is not above p: k(0) -> B2
    cache.access(k(0))  # B2 hit: p -= max(1, |B1| / |B2|)
    assert policy.target_t1_size == 0


def test_arc_target_stays_within_capacity() -> None:
    policy = ARCPolicy(3)
    cache = Cache(policy)
    for round_ in range(20):
        for i in range(5):
            cache.access(k(i if round_ % 2 else i % 2))
        assert 0 <= policy.target_t1_size <= 3


def test_arc_forgets_ghosts_beyond_capacity() -> None:
    # The paper's bound |T1| + |B1| <= c: once-used blocks push older ghosts out.
    policy, cache = arc_with_frequent_key(3)
    for i in range(1, 5):
        cache.access(k(i))  # T1 = [k(3), k(4)], B1 = [k(2)]; k(1) forgotten
    cache.access(k(2))
    assert policy.target_t1_size == 1
    cache.access(k(1))
    assert policy.target_t1_size == 1


def test_arc_full_t1_leaves_no_ghost() -> None:
    # With T1 alone filling the cache, the paper drops T1's oldest outright.
    policy = ARCPolicy(2)
    cache = Cache(policy)
    for i in range(3):
        cache.access(k(i))
    cache.access(k(0))
    assert policy.target_t1_size == 0


def test_arc_falls_back_to_other_list_when_preferred_is_pinned() -> None:
    policy = ARCPolicy(4)
    policy.insert(k(0))
    policy.touch([k(0)])  # T2
    policy.insert(k(1))  # T1, above p = 0: preferred
    assert policy.evict(1, lambda key: key != k(1)) == [k(0)]
