"""ClusterOffloadingManager against the faults of issue 15 that are the manager's to handle,
each driven step by step: a Promoter that never reports (finding 4), a reset meant to
leave old weights' blocks behind (finding 3), and a promotion that would evict what the
same scan just found (finding 7). Without Ray; the Promoter is a stand-in whose reports
the test makes, and the clock is the test's where deadlines matter.
"""

import pytest

import distkv.replica.cluster_manager
import distkv.replica.protection
import distkv.replica.replica_stats
from cluster_fakes import FakeDirectory, FakeLink
from distkv.abstract import LookupResult, ReqContext
from distkv.replica.inflight import OVERDUE_GRACE_S
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.records import ReplicaInfo
from distkv.replica.harness import block_keys
from test_cluster import BLOCK_TOKENS, prompt, replicas  # noqa: F401 (a fixture)

TIMEOUT_S = 5.0


class SilentPromoter:
    """Takes promotions and reports one only when the test says so: a stuck or dead thread."""

    def __init__(self):
        self.submitted = []
        self._finished = []

    def submit(self, promotion):
        self.submitted.append(promotion)

    def report(self, key, ok):
        self._finished.append((key, ok, False))

    def has_finished(self):
        return bool(self._finished)

    def finished(self):
        done, self._finished = self._finished, []
        return done

    def unmeasured(self):
        return []

    def close(self):
        pass


class FakeTime:
    """The `time` module of the cluster manager and its scan rounds, with a clock that moves only when the test says."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def time(self):
        return self.now


def k(i):
    return i.to_bytes(4, "big") + b"\0\0\0\0"


def held_elsewhere(directory, keys, epoch=0):
    """Register a replica on another node holding `keys`, at cache epoch `epoch`."""
    other = FakeLink(directory, ReplicaInfo("other", "node-2", "distkv-ns-other", 64, 1, 64, epoch))
    other.stored([(key, row, 1) for row, key in enumerate(keys)])
    return other


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    for module in (distkv.replica.cluster_manager, distkv.replica.protection, distkv.replica.replica_stats):
        monkeypatch.setattr(module, "time", fake)
    return fake


def silent_manager(directory, num_rows=4):
    link = FakeLink(directory, ReplicaInfo("this", "node-1", "distkv-ns-this", num_rows, 1, 64))
    promoter = SilentPromoter()
    manager = ClusterOffloadingManager(num_rows, link, promoter, promotion_timeout_s=TIMEOUT_S)
    return manager, promoter


# ---- finding 4: the manager enforces the promotion deadline itself --------------------


@pytest.mark.parametrize("notices", ["lookup", "prepare_store", "take_events"])
def test_a_promotion_never_reported_fails_into_a_miss_after_its_deadline(clock, notices):
    directory = FakeDirectory()
    held_elsewhere(directory, [k(0)])
    manager, promoter = silent_manager(directory)
    ctx = ReqContext("r")
    assert manager.lookup(k(0), ctx) is None
    assert len(promoter.submitted) == 1 and manager.promotions_in_flight == 1
    clock.now += TIMEOUT_S + OVERDUE_GRACE_S - 0.01
    assert manager.lookup(k(0), ctx) is None  # not overdue yet: still retry
    clock.now += 0.02
    {
        "lookup": lambda: manager.lookup(k(0), ctx),
        "prepare_store": lambda: manager.prepare_store([k(9)], ctx),
        "take_events": lambda: manager.take_events(),
    }[notices]()
    assert manager.promotions_in_flight == 0  # so vLLM's has_pending_work is False again
    assert manager.lookup(k(0), ctx) is False  # a miss, and not retried at once
    assert manager.errors.counts() == {"promotion_timeout": 1}
    # the row stays reserved: the Promoter may still write it, if it is only stuck
    local = manager.local
    assert local.num_free_rows == local.num_rows - 1 - (notices == "prepare_store")
    assert manager.prepare_store([k(0)], ctx).keys_to_store == []  # no second job on that key meanwhile
    promoter.report(k(0), True)  # its late report frees the row and makes nothing loadable
    manager.take_events()
    assert local.num_free_rows == local.num_rows - (notices == "prepare_store")
    assert local.lookup(k(0), ctx) is False


def test_only_overdue_promotions_fail(clock):
    directory = FakeDirectory()
    held_elsewhere(directory, [k(0), k(1)])
    manager, promoter = silent_manager(directory)
    ctx = ReqContext("r")
    assert manager.lookup(k(0), ctx) is None
    clock.now += 1.0
    assert manager.lookup(k(1), ctx) is None
    clock.now += TIMEOUT_S + OVERDUE_GRACE_S - 0.5
    manager.take_events()
    assert manager.lookup_result(k(0), ctx) is LookupResult.MISS  # failed: not promoting any more
    assert manager.lookup_result(k(1), ctx) is LookupResult.RETRY  # still being promoted
    promoter.report(k(1), True)
    manager.take_events()
    assert manager.lookup(k(1), ctx) is True


def test_lookup_result_tells_a_promotion_from_a_store_in_flight(clock):
    """vLLM defers a request on both, but only a promotion may still end in a miss: the
    manager says which, and the seed's lookup answers None for both."""
    directory = FakeDirectory()
    held_elsewhere(directory, [k(0)])
    manager, promoter = silent_manager(directory)
    ctx = ReqContext("r")
    assert manager.lookup_result(k(9), ctx) is LookupResult.MISS  # nobody holds it
    assert manager.lookup_result(k(0), ctx) is LookupResult.RETRY  # starts its promotion
    assert manager.lookup_result(k(0), ctx) is LookupResult.RETRY
    assert manager.prepare_store([k(1)], ctx).keys_to_store == [k(1)]
    assert manager.lookup_result(k(1), ctx) is LookupResult.HIT_PENDING  # this replica's own store
    assert manager.lookup(k(0), ctx) is None and manager.lookup(k(1), ctx) is None
    manager.complete_store([k(1)], ctx)
    promoter.report(k(0), False)
    assert manager.lookup_result(k(1), ctx) is LookupResult.HIT
    assert manager.lookup_result(k(0), ctx) is LookupResult.MISS  # its promotion failed
    assert [manager.lookup(k(i), ctx) for i in (1, 0, 9)] == [True, False, False]


# ---- finding 3: a reset moves the replica to a new cache epoch ----------------------


def test_a_reset_registers_the_replica_again_under_its_next_epoch():
    directory = FakeDirectory()
    manager, _ = silent_manager(directory)
    manager.reset_cache()
    manager.reset_cache()
    info = manager.link.info
    assert (info.replica_id, info.cache_epoch, info.pool_name) == ("this.epoch2", 2, "distkv-ns-this")
    assert set(directory.infos) == {"this.epoch2"}


def test_promotions_read_only_holders_of_the_replicas_epoch():
    directory = FakeDirectory()
    manager, promoter = silent_manager(directory)
    ctx = ReqContext("r")
    held_elsewhere(directory, [k(0), k(1)], epoch=0)
    manager.lookup(k(0), ctx)
    manager.reset_cache()
    manager.lookup(k(1), ctx)
    assert [p.cache_epoch for p in promoter.submitted] == [0, 1]


@pytest.mark.parametrize("node_b", ["node-1", "node-2"], ids=["same-node", "cross-node"])
def test_a_reset_replica_never_loads_blocks_of_the_old_weights(replicas, node_b):  # noqa: F811
    a = replicas(directory := FakeDirectory(), "node-1")
    b = replicas(directory, node_b)
    old = prompt(30, blocks=8)
    a.serve(old)
    b.manager.reset_cache()  # B's weights were updated; A's were not
    result = b.serve(old)
    assert result.hit_blocks == 0 and result.mismatches == 0
    assert b.manager.promoter.succeeded == {"same_node": 0, "cross_node": 0}
    fresh = prompt(31, blocks=8)
    b.serve(fresh)
    assert a.serve(fresh).hit_blocks == 0  # nor does A take B's blocks of the new weights
    a.manager.reset_cache()  # the same update on A: the two share again
    assert a.serve(fresh).hit_blocks == 8
    assert a.manager.promoter.succeeded["same_node" if node_b == "node-1" else "cross_node"] == 8


def test_dedupe_stores_what_only_other_epochs_hold(replicas):  # noqa: F811
    a = replicas(directory := FakeDirectory(), "node-1")
    b = replicas(directory, "node-2", store_policy="dedupe")
    shared = block_keys(prompt(32, blocks=8), BLOCK_TOKENS)
    a.serve(prompt(32, blocks=8))
    ctx = ReqContext("b")
    assert b.manager.prepare_store(shared, ctx).keys_to_store == []  # A's are B's to promote
    b.manager.reset_cache()
    assert b.manager.prepare_store(shared, ctx).keys_to_store == shared  # not any more


# ---- finding 7: a promotion never evicts what the same scan just answered HIT ---------


def store(manager, keys, ctx):
    out = manager.prepare_store(keys, ctx)
    manager.complete_store(out.keys_to_store, ctx)


def test_a_promotion_does_not_evict_the_prefix_its_scan_found(clock):
    directory = FakeDirectory()
    prefix, remote = [k(0), k(1), k(2)], k(3)
    held_elsewhere(directory, [remote])
    manager, promoter = silent_manager(directory, num_rows=3)
    store(manager, prefix, ReqContext("earlier"))
    ctx = ReqContext("r")
    assert [manager.lookup(key, ctx) for key in prefix] == [True, True, True]
    # the pool is full of the prefix just found: the promotion finds no row to take
    assert manager.lookup(remote, ctx) is False
    assert promoter.submitted == []
    assert [manager.lookup(key, ctx) for key in prefix] == [True, True, True]


def test_a_deferred_request_keeps_what_it_found_until_it_is_admitted(clock):
    directory = FakeDirectory()
    prefix, remote = [k(0), k(1), k(2)], k(3)
    held_elsewhere(directory, [remote])
    manager, promoter = silent_manager(directory, num_rows=5)
    store(manager, [k(10)], ReqContext("older"))  # the least recent: promotions may take their rows
    store(manager, [k(11)], ReqContext("older"))
    store(manager, prefix, ReqContext("earlier"))
    ctx = ReqContext("r")
    assert [manager.lookup(key, ctx) for key in prefix] == [True, True, True]
    assert manager.lookup(remote, ctx) is None  # deferred, its promotion reserved k(10)'s row
    assert manager.lookup(k(10), ctx) is False
    # before R comes back, another request's lookups promote too: R's prefix is spared
    held_elsewhere(directory, [remote, k(4), k(5)])
    other = ReqContext("other")
    manager.prepare_store([], other)  # a new step
    assert manager.lookup(k(4), other) is None  # took k(11)'s row
    assert manager.lookup(k(5), other) is False  # every other row holds R's prefix
    promoter.report(remote, True)
    assert [manager.lookup(key, ctx) for key in [*prefix, remote]] == [True] * 4
    manager.prepare_load([*prefix, remote], ctx)  # admitted: its load pins them now
    manager.complete_load([*prefix, remote], ctx)
    manager.prepare_store([], other)  # the next step: nothing is spared any more
    assert manager.lookup(k(5), other) is None


def test_a_request_that_finished_spares_nothing(clock):
    directory = FakeDirectory()
    held_elsewhere(directory, [k(3), k(5)])
    manager, promoter = silent_manager(directory, num_rows=4)
    store(manager, [k(0), k(1), k(2)], ReqContext("earlier"))
    ctx = ReqContext("r")
    assert [manager.lookup(key, ctx) for key in [k(0), k(1), k(2), k(3)]] == [True, True, True, None]
    manager.request_finished(ctx)  # dropped before it was admitted
    manager.prepare_store([], ReqContext("other"))
    assert manager.lookup(k(5), ReqContext("other")) is None  # it may evict R's prefix now
