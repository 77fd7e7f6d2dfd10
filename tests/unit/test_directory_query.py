"""A queried DirectoryLink (no pushed view) and the cluster manager over it, stepped by hand
against shards the test answers (no Ray).

The link's thread is not started: each `step` is one pass of its loop at a time the test
chooses, and a shard's calls stay in flight until the test answers them from its
DirectoryState, as the actor would, or fails them, as a shard that is down does.
"""

import pickle
import time

import pytest
from pickle_bomb import EXPLODED, Bomb
from directory_fakes import FakeShard, key
from test_cluster_faults import SilentPromoter
from test_directory_link import Stepper

import distkv.directory.querier as querier
import distkv.directory.views as directory
from distkv.abstract import LookupResult, ReqContext
from distkv.replica.cluster_manager import ClusterOffloadingManager
from distkv.directory.link import DirectoryLink
from distkv.directory.records import Holder, ReplicaInfo
from distkv.directory.placement import shard_of

OTHER = ReplicaInfo("b", "node-2", "distkv-ns-b", 64, 1, 4096)


def ask(link, k):
    """`link.ask` of `k` on its own key's shard: these tests place keys as `hold` does."""
    return link.ask(k, shard_of(k, link.num_shards))


def make_link(shards, replica_id="a", view="query"):
    info = ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", 64, 1, 4096)
    return DirectoryLink("ns", info, shards, view)


def hold(shards, keys, info=OTHER):
    """`info`'s replica holds `keys` (row i for the i-th) in the shards' states."""
    for shard in shards:
        shard.state.register(info)
    link = make_link(shards, info.replica_id)
    for row, k in enumerate(keys):
        shards[shard_of(k, link.num_shards)].state.publish(info.replica_id, row + 1, [(k, row, 7)], [])


def queries(shard):
    return [args[0] for method, args, _ in shard.calls if method == "query"]


@pytest.fixture
def shards():
    return [FakeShard(), FakeShard()]


def started(link):
    """The link past its registers, with no call in flight but what it asks from now on."""
    stepper = Stepper(link, time.monotonic())
    stepper.step()
    for publisher in link._publishers:
        publisher.client.answer(("register",))
    return stepper


def test_a_steps_misses_go_out_as_one_call_per_shard_at_the_steps_end(shards):
    link = make_link(shards)
    link.expect_step_ends()
    stepper = started(link)
    keys = [key(i) for i in range(200)]
    assert all(ask(link, k) for k in keys[:100])
    stepper.step(directory.QUERY_DELAY_S)  # the thread passes mid-step: the step has not ended
    assert queries(shards[0]) == queries(shards[1]) == []
    assert all(ask(link, k) for k in keys[100:])
    assert all(ask(link, k) for k in keys[:50])  # asked again within the step: not queued twice
    link.end_step()
    stepper.step(0.0)
    asked = [queries(shard) for shard in shards]
    assert [len(a) for a in asked] == [1, 1]
    assert sorted(asked[0][0] + asked[1][0]) == sorted(keys)
    for i, shard in enumerate(shards):
        assert all(shard_of(k, link.num_shards) == i for k in asked[i][0])


def test_without_step_ends_the_misses_go_out_after_the_delay(shards):
    link = make_link(shards)
    stepper = started(link)
    keys = [key(i) for i in range(50)]
    for k in keys:
        ask(link, k)
    stepper.step(0.0)
    assert queries(shards[0]) == queries(shards[1]) == []  # waiting for the rest of the step
    stepper.step(directory.QUERY_DELAY_S)
    assert [len(queries(shard)) for shard in shards] == [1, 1]


def test_a_key_in_flight_is_not_asked_again_and_the_answer_lands_in_the_view(shards):
    hold(shards, [key(1)])
    link = make_link(shards)
    stepper = started(link)
    ask(link, key(1))
    ask(link, key(2))
    link.end_step()
    stepper.step(0.0)
    ask(link, key(1))  # the scan of the next step, before the answer
    link.end_step()
    stepper.step(0.0)
    assert sum(len(queries(shard)) for shard in shards) <= 2  # one per shard: nothing asked twice
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.view[key(1)] == (Holder("b", "node-2", 0, 7),)
    assert link.view[key(2)] == ()
    assert link.replica("b") == OTHER  # the answer brought the holder's info
    assert not link._source._asked
    link.end_step()
    stepper.step(0.0)
    assert all(queries(shard) == [] for shard in shards)  # nothing was left to ask again


def test_answers_expire_and_the_key_is_asked_again(shards):
    link = make_link(shards)
    stepper = started(link)
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.view[key(1)] == ()
    hold(shards, [key(1)])  # stored a moment after the miss was answered
    stepper.step(directory.ANSWER_TTL_S)
    assert key(1) not in link.view
    assert ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.view[key(1)] == (Holder("b", "node-2", 0, 7),)


def test_a_holder_restarted_under_its_id_is_looked_for_at_its_new_place(shards):
    hold(shards, [key(1)])
    link = make_link(shards)
    stepper = started(link)
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.replica("b") == OTHER
    moved = ReplicaInfo("b", "node-3", "distkv-ns-b", 128, 2, 8192)  # b restarted on another node, with another pool
    hold(shards, [key(1)], moved)
    stepper.step(directory.ANSWER_TTL_S)
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.view[key(1)] == (Holder("b", "node-3", 0, 7),)
    assert link.replica("b") == moved


def test_the_replicas_own_holders_are_not_answered(shards):
    link = make_link(shards, "a")
    stepper = started(link)
    hold(shards, [key(1)], link.info)  # the Directory has not heard of its eviction yet
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.view[key(1)] == ()


def test_a_failed_query_answers_misses(shards):
    link = make_link(shards)
    stepper = started(link)
    for shard in shards:
        shard.up = False
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    for shard in shards:
        shard.answer(("query",))
    stepper.step(0.0)
    assert link.view[key(1)] == ()
    assert link.errors.counts()["directory_query"] == 1


def test_an_answer_that_is_no_typed_answer_runs_nothing_and_answers_misses(shards):
    """Whatever answers a query, nothing of the answer runs in the replica: it is decoded
    as the typed answer or refused, and its keys are misses."""
    hold(shards, [key(1)])
    link = make_link(shards)
    stepper = started(link)
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    shard = shards[shard_of(key(1), link.num_shards)]
    (call,) = [c for c in shard.calls if c[0] == "query"]
    shard.calls.remove(call)
    call[2].set_result(pickle.dumps(([((Bomb(), "node-2", 0, 7),)], {"b": OTHER})))
    stepper.step(0.0)
    assert not EXPLODED
    assert link.view[key(1)] == ()
    assert link.errors.counts()["directory_query"] == 1
    assert "not msgpack" in link.errors.recent()[-1][2]


def test_each_answered_call_is_timed_from_its_sending_to_its_answer_and_a_failed_one_is_an_error(shards):
    link = make_link(shards)
    stepper = started(link)
    a, b = next(k for k in map(key, range(100)) if shard_of(k, 2) == 0), next(k for k in map(key, range(100)) if shard_of(k, 2) == 1)
    ask(link, a)
    ask(link, b)
    link.end_step()
    stepper.step(0.0)  # both calls go out
    shards[0].answer(("query",))
    stepper.step(0.004)  # shard 0's answer lands 4 ms after its call went
    shards[1].up = False
    shards[1].answer(("query",))
    stepper.step(0.003)
    assert list(link.query_times) == [(0, pytest.approx(0.004))]
    assert link.errors.counts()["directory_query"] == 1


def test_a_query_never_answered_is_given_up_into_misses_and_the_next_goes_out(shards):
    link = make_link(shards)
    stepper = started(link)
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    shard = shards[shard_of(key(1), link.num_shards)]
    same_shard = next(key(i) for i in range(2, 100) if shard_of(key(i), link.num_shards) == shard_of(key(1), link.num_shards))
    ask(link, same_shard)
    link.end_step()
    stepper.step(0.0)
    assert len(queries(shard)) == 1  # one call in flight a shard: the next key waits
    stepper.step(querier.QUERY_TIMEOUT_S)
    assert link.view[key(1)] == ()
    assert len(queries(shard)) == 2  # the waiting key went out once the first was given up


def test_memory_is_bounded(shards, monkeypatch):
    monkeypatch.setattr(directory, "MAX_ASKED_KEYS", 8)
    monkeypatch.setattr(directory, "MAX_ANSWERS", 16)
    monkeypatch.setattr(directory, "MAX_REPLICA_INFOS", 2)
    link = make_link(shards)
    stepper = started(link)
    assert [ask(link, key(i)) for i in range(10)] == [True] * 8 + [False] * 2  # the rest are misses
    answered = 8
    for round_ in range(10):
        infos = [ReplicaInfo(f"r{round_}.{i}", "node-2", f"distkv-ns-r{round_}.{i}", 64, 1, 4096) for i in range(2)]
        for info in infos:
            hold(shards, [key(1000 * round_ + j) for j in range(4)], info)
        for j in range(8):
            ask(link, key(1000 * round_ + j))
        link.end_step()
        stepper.step(0.0)
        for shard in shards:
            shard.answer(("query",))
        stepper.step(0.0)
        answered += 8
        assert len(link.view) <= 16 + 8  # the bound, and one answer's keys
        assert len(link._source._infos) <= 2
        assert len(link._source._asked) <= 8
    assert answered > 16


class StepManager:
    """A cluster manager over a queried link, the link stepped by the test."""

    def __init__(self, shards):
        self.link = make_link(shards)
        self.stepper = started(self.link)
        self.promoter = SilentPromoter()
        self.manager = ClusterOffloadingManager(8, self.link, self.promoter)
        self.shards = shards

    def step_end(self):
        """The scheduler's step ends; the link asks, the shards answer, the answers land."""
        self.manager.end_step()
        self.stepper.step(0.0)
        for shard in self.shards:
            shard.answer(("query",))
        self.stepper.step(0.0)


def test_the_manager_answers_retry_until_the_answer_then_promotes_or_misses(shards):
    hold(shards, [key(1)])
    m = StepManager(shards)
    ctx = ReqContext("r1")
    assert m.manager.lookup_result(key(1), ctx) is LookupResult.RETRY
    assert m.manager.lookup_result(key(2), ctx) is LookupResult.RETRY  # the scan goes on past it
    assert m.manager.lookup_result(key(1), ctx) is LookupResult.RETRY  # not yet answered
    m.step_end()
    assert sum(len(s.calls) for s in shards) == 0  # every question answered
    assert m.manager.lookup_result(key(2), ctx) is LookupResult.MISS  # nobody holds it
    assert m.manager.lookup_result(key(1), ctx) is LookupResult.RETRY  # the promotion started
    (promotion,) = m.promoter.submitted
    assert promotion.key == key(1) and promotion.holders == (Holder("b", "node-2", 0, 7),)
    m.promoter.report(key(1), True)
    assert m.manager.lookup_result(key(1), ctx) is LookupResult.HIT
    assert m.manager.lookups_miss == 1


def test_a_failed_answer_is_a_miss_not_a_retry_forever(shards):
    hold(shards, [key(1)])
    m = StepManager(shards)
    for shard in shards:
        shard.up = False
    ctx = ReqContext("r1")
    assert m.manager.lookup_result(key(1), ctx) is LookupResult.RETRY
    m.step_end()
    assert m.manager.lookup_result(key(1), ctx) is LookupResult.MISS
    assert m.promoter.submitted == []


def test_a_following_link_asks_nothing(shards):
    link = make_link(shards, view="push")
    manager = ClusterOffloadingManager(8, link, SilentPromoter())
    assert manager.lookup_result(key(1), ReqContext("r1")) is LookupResult.MISS
    assert link.ask is None  # a followed view has no way to ask


def following_auto_link(shards):
    """A link of view "auto" following shards that show 2 replicas, b holding key 1."""
    link = make_link(shards, view="auto")
    stepper = started(link)
    hold(shards, [key(1)])
    for shard in shards:
        shard.answer(("changes",))
    stepper.step(0.0)
    assert not link.queried and link.view[key(1)] == (Holder("b", "node-2", 0, 7),)
    return link, stepper


def asks_on_a_miss(link, stepper, shards):
    """Whether a miss of the link's lookups is asked, in one query."""
    ask(link, key(1))
    link.end_step()
    stepper.step(0.0)
    return sum(len(queries(shard)) for shard in shards) == 1


def test_an_auto_link_switches_to_queries_once_its_view_shows_more_replicas_than_the_bound(shards, monkeypatch):
    monkeypatch.setattr(directory, "AUTO_PUSH_MAX_REPLICAS", 2)
    link, stepper = following_auto_link(shards)  # 2 replicas: following
    for shard in shards:
        shard.state.register(ReplicaInfo("c", "node-3", "distkv-ns-c", 64, 1, 4096))
        shard.answer(("changes",))
    stepper.step(0.0)
    assert link.queried
    assert key(1) not in link.view  # answers from now on
    assert link.replica("b") == OTHER  # kept for the promotions that started from the view
    assert asks_on_a_miss(link, stepper, shards)


def test_an_auto_link_switches_to_queries_once_requests_come_with_their_routers_answer(shards):
    link, stepper = following_auto_link(shards)
    link.answers_routed()
    stepper.step(0.0)
    assert link.queried and key(1) not in link.view  # 2 replicas, yet it follows no more
    for shard in shards:
        shard.answer(("changes",))  # the polls in flight as it switched
    stepper.step(0.0)
    assert all("changes" not in shard.in_flight() for shard in shards)  # and no poll since
    assert asks_on_a_miss(link, stepper, shards)  # a request that came without an answer


def test_a_link_told_to_push_keeps_following_whatever_requests_bring(shards):
    link = make_link(shards, view="push")
    stepper = started(link)
    link.answers_routed()
    stepper.step(0.0)
    assert not link.queried and link.ask is None


def test_bad_view_names_the_choices(shards):
    with pytest.raises(ValueError, match=r"view='pull' must be one of \['auto', 'push', 'query'\]"):
        make_link(shards, view="pull")


def test_directory_view_is_checked_like_the_other_keys():
    from distkv.config import DistkvConfig

    assert DistkvConfig.from_extra_config({}).directory_view == "auto"
    assert DistkvConfig.from_extra_config({"directory_view": "query"}).directory_view == "query"
    with pytest.raises(ValueError, match=r"'directory_view'='pull' must be one of \['auto', 'push', 'query'\]"):
        DistkvConfig.from_extra_config({"directory_view": "pull"})
