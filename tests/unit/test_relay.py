"""A node's PublishRelay between replicas' Publishers and shards the test answers (no Ray, no thread)."""

import collections
from concurrent.futures import Future

import pytest
from directory_fakes import FakeShard, key

from distkv.directory import relay as relay_module
from distkv.directory.state import FLUSH_INTERVAL_S
from distkv.directory.link import DirectoryLink
from distkv.directory.publisher import DirectPublish, Publisher
from distkv.directory.records import ReplicaInfo
from distkv.directory.wire import encode_changes
from distkv.directory.state import DirectoryState
from distkv.observability.errors import ErrorLog
from distkv.directory.relay import PublishRelay, RelayBatch
from distkv.directory.views import AUTO_PUSH_MAX_REPLICAS


def info(replica_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", 64, 1, 4096)


class Node:
    """Replicas of one node, one publisher each per shard, publishing through the node's relay."""

    def __init__(self, num_shards: int = 1, replicas=("a", "b", "c")) -> None:
        self.shards = [FakeShard() for _ in range(num_shards)]
        self.now = 100.0
        self.relay = PublishRelay("ns", self.shards, clock=lambda: self.now)
        self.errors = ErrorLog()
        self.publishers = {
            r: [
                Publisher(
                    s, shard, "ns", info(r),
                    wake=lambda: None, errors=self.errors, event_lags=collections.deque(), path=self.relay,
                )
                for s, shard in enumerate(self.shards)
            ]
            for r in replicas
        }

    def step(self, advance_s: float = 0.0) -> float:
        """Step the relay (its answers reach the publishers), every publisher, and the relay
        again (it sends what they handed over); when the relay is next due."""
        self.now += advance_s
        self.relay.step(self.now)
        for publishers in self.publishers.values():
            for publisher in publishers:
                publisher.step(self.now)
        return self.relay.step(self.now)

    def store(self, replica: str, *keys: int, shard: int = 0) -> None:
        publisher = self.publishers[replica][shard]
        for i in keys:
            publisher.store(key(i), i, i + 1)
        publisher.queued(self.now, self.now, lagged=True)

    def calls(self, shard: int = 0) -> list[str]:
        return self.shards[shard].in_flight()

    def relayed(self, shard: int = 0) -> list[list[str]]:
        """Per publish_many call in flight, the replicas it carries."""
        return [[item[0] for item in args[0]] for m, args, _ in self.shards[shard].calls if m == "publish_many"]


@pytest.fixture
def node():
    n = Node()
    n.step()  # registers go to the shard itself
    assert n.calls() == ["register"] * 3
    n.shards[0].answer()
    return n


def test_the_publishes_of_a_nodes_replicas_go_to_the_shard_in_one_call(node):
    for i, r in enumerate("abc"):
        node.store(r, i)
    node.step(0.1)
    assert node.relayed() == [["a", "b", "c"]]
    node.shards[0].answer()
    node.step()
    state = node.shards[0].state
    assert {r: node.shards[0].held_by(r) for r in "abc"} == {r: {key(i): (i, i + 1)} for i, r in enumerate("abc")}
    assert state.stats()["relay_calls"] == 1 and state.stats()["relayed_publishes"] == 3
    assert all(p.publishing is None and not p.pending for ps in node.publishers.values() for p in ps)


def test_one_call_in_flight_per_shard_and_the_next_waits_the_shards_interval(monkeypatch):
    monkeypatch.setattr("distkv.directory.state.SHARD_PUBLISHES_PER_S", 4)  # 2 replicas: 0.5 s apart
    shard = FakeShard()
    relay = PublishRelay("ns", [shard])
    for r in "ab":
        shard.state.register(info(r))
    first = relay.publish(0, "a", 1, encode_changes([(key(1), 1, 2)], []), None)
    relay.step(10.0)
    second = relay.publish(0, "b", 1, encode_changes([(key(2), 2, 3)], []), None)
    relay.step(10.1)
    assert [[item[0] for item in args[0]] for _, args, _ in shard.calls] == [["a"]]
    shard.answer()
    relay.step(10.2)
    assert first.result()[1] is True and not second.done()
    relay.step(10.49)
    assert shard.calls == []
    relay.step(10.5)
    assert [[item[0] for item in args[0]] for _, args, _ in shard.calls] == [["b"]]


def test_a_call_carries_what_fits_under_the_bound_and_the_rest_goes_once_it_is_answered(monkeypatch):
    monkeypatch.setattr(relay_module, "MAX_CALL_BYTES", 250)
    shard = FakeShard()
    relay = PublishRelay("ns", [shard])
    for r in "abcd":
        shard.state.register(info(r))
    padded = encode_changes([], [b"\x01" * 46, b"\x02" * 46])  # removals of keys nobody holds: 100 bytes
    assert len(padded) == 100
    futures = [relay.publish(0, r, 1, padded, None) for r in "abc"]
    big = relay.publish(0, "d", 1, encode_changes([], [bytes([i + 1]) * 72 for i in range(4)]), None)  # 300 bytes: alone
    relay.step(10.0)
    assert [[item[0] for item in args[0]] for _, args, _ in shard.calls] == [["a", "b"]]
    shard.answer()
    relay.step(10.001)  # well within the shard's interval: the rest was due with the first
    assert [[item[0] for item in args[0]] for _, args, _ in shard.calls] == [["c"]]
    shard.answer()
    relay.step(10.002)
    assert [[item[0] for item in args[0]] for _, args, _ in shard.calls] == [["d"]]
    shard.answer()
    relay.step(10.003)
    assert [f.result()[1] for f in futures + [big]] == [True] * 4


def test_a_replica_is_asked_for_no_interval_of_its_own_the_relay_paces_it(node):
    node.store("a", 1)
    node.step(0.1)
    node.step()
    node.shards[0].answer()
    node.step()
    assert node.publishers["a"][0].flush_interval == FLUSH_INTERVAL_S


def test_a_failed_call_fails_each_publish_it_carried_and_each_is_sent_again_once(node):
    node.store("a", 1)
    node.store("b", 2)
    node.step(0.1)
    node.step()
    node.shards[0].up = False
    node.shards[0].answer()
    node.step()
    assert node.errors.counts()["directory_publish"] == 2
    node.shards[0].up = True
    node.step(5.0)  # past the backoff: the same batches again (and c's heartbeat)
    assert node.relayed() == [["a", "b", "c"]]
    node.shards[0].answer()
    node.step()
    assert node.shards[0].held_by("a") == {key(1): (1, 2)} and node.shards[0].held_by("b") == {key(2): (2, 3)}


def test_a_call_lost_after_the_shard_applied_it_is_applied_once():
    """The relay's call went through but its answer was lost: the replicas' retries carry
    the same seqs, which the shard ignores."""
    node = Node(replicas=("a",))
    node.step()
    node.shards[0].answer()
    node.store("a", 1)
    node.step(0.1)
    node.step()
    method, args, future = node.shards[0].calls.pop()
    node.shards[0]._publish_many(*args)
    future.set_exception(ConnectionError("answer lost"))
    node.step()
    node.step(5.0)
    node.step()
    node.shards[0].answer()
    stats = node.shards[0].state.stats()
    assert stats["relayed_publishes"] == 2 and stats["ignored_publishes"] == 1 and stats["stored"] == 1


def test_one_replicas_bad_publish_is_refused_alone():
    relay_shard = FakeShard()
    relay = PublishRelay("ns", [relay_shard])
    for r in "ab":
        relay_shard.state.register(info(r))
    good = relay.publish(0, "a", 1, encode_changes([(key(1), 1, 2)], []), None)
    bad = relay.publish(0, "b", 1, b"not a payload", None)
    unknown = relay.publish(0, "z", 1, encode_changes([], []), None)
    relay.step(0.0)
    relay_shard.answer()
    relay.step(0.0)
    assert good.result()[:2] == (relay_shard.state.epoch, True)
    assert unknown.result()[1] is False
    with pytest.raises(ValueError, match="relayed publish.*'b'"):
        bad.result()
    assert relay_shard.held_by("a") == {key(1): (1, 2)} and relay_shard.held_by("b") == {}


def test_publish_relayed_refuses_what_is_not_a_list_and_changes_nothing():
    state = DirectoryState()
    state.register(info("a"))
    before = state.stats()
    with pytest.raises(ValueError, match="not a list"):
        state.publish_relayed(b"abc")
    assert state.stats() == before
    assert state.publish_relayed([("a", 1, encode_changes([(key(1), 1, 2)], []), {"rows": 1})]) == [True]
    assert state.replicas()[0]["report"] == {"rows": 1}
    assert isinstance(state.publish_relayed([("a", 2, encode_changes([], []), "not a dict")])[0], str)


def test_each_shard_gets_its_own_call():
    node = Node(num_shards=2, replicas=("a", "b"))
    node.step()
    for shard in node.shards:
        shard.answer()
    node.store("a", 1, shard=0)
    node.store("b", 2, shard=1)
    node.store("a", 3, shard=1)
    node.step(0.1)
    node.step()
    assert node.relayed(0) == [["a"]] and node.relayed(1) == [["a", "b"]]


def test_bad_calls_and_bounds(monkeypatch):
    relay = PublishRelay("ns", [FakeShard()])
    with pytest.raises(ValueError, match="shard 1 is not one of the namespace's 1"):
        relay.publish(1, "a", 1, b"", None)
    with pytest.raises(ValueError, match="shards is empty"):
        PublishRelay("ns", [])
    monkeypatch.setattr(relay_module, "MAX_QUEUED", 2)
    queued = [relay.publish(0, r, 1, b"", None) for r in "ab"]
    with pytest.raises(RuntimeError, match="2 publishes already wait"):
        relay.publish(0, "c", 1, b"", None)
    relay.close()
    for future in queued:
        with pytest.raises(RuntimeError, match="closed"):
            future.result()
    with pytest.raises(RuntimeError, match="closed"):
        relay.publish(0, "a", 2, b"", None)


def test_the_relay_thread_sends_a_publish_handed_over_after_a_long_sleep():
    shard = FakeShard()
    relay = PublishRelay("ns", [shard])
    relay.start()
    try:
        shard.state.register(info("a"))
        future = relay.publish(0, "a", 1, encode_changes([(key(1), 1, 2)], []), None)
        while not shard.calls:
            pass
        shard.answer()
        assert future.result(timeout=30)[1] is True
    finally:
        relay.close()


def test_a_relay_is_unused_since_its_last_publish_or_answer_and_never_while_it_carries_one():
    shards = [FakeShard(), FakeShard()]
    for shard in shards:
        shard.state.register(info("a"))
    clock = [100.0]
    relay = PublishRelay("ns", shards, clock=lambda: clock[0])
    assert relay.unused_s(130.0) == 30.0  # made at 100, never handed a publish

    clock[0] = 140.0
    relay.publish(0, "a", 1, encode_changes([(key(1), 1, 2)], []), None)
    relay.step(140.0)
    shards[0].answer()
    relay.step(140.0)
    assert relay.unused_s(140.0) == 0.0 and relay.unused_s(165.0) == 25.0  # since the publish

    clock[0] = 200.0
    future = relay.publish(1, "a", 1, encode_changes([(key(2), 2, 3)], []), None)
    assert relay.unused_s(260.0) == 0.0  # queued for shard 1 (shard 0 has nothing)
    relay.step(260.0)
    assert shards[1].in_flight() == ["publish_many"]
    assert relay.unused_s(300.0) == 0.0  # in flight
    shards[1].answer()
    assert relay.unused_s(300.0) == 0.0  # answered, the answer not collected by a step yet
    relay.step(310.0)
    assert future.result()[1] is True
    # counted from the answer: its replica hands the next publish over once answered
    assert relay.unused_s(310.0) == 0.0 and relay.unused_s(340.0) == 30.0


class Agent:
    """A node's agent as a replica's RelayBatch calls it: runs each handed publish through
    the relay and answers per item, once the test lets it (`answer`)."""

    def __init__(self, relay: PublishRelay) -> None:
        self.relay = relay
        self.calls: list[tuple[list, Future]] = []

    def send(self, items) -> Future:
        future: Future = Future()
        self.calls.append((items, future))
        return future

    def answer(self) -> None:
        for items, future in self.calls:
            answers = []
            for item in items:
                try:
                    answers.append(self.relay.publish(*item))
                except Exception as e:
                    answers.append(f"{type(e).__name__}: {e}")
            self.relay.step(0.0)
            for shard in self.relay._routes:
                shard.client.answer()
            self.relay.step(0.0)
            future.set_result([a if isinstance(a, str) else (a.result() if a.exception() is None else str(a.exception())) for a in answers])
        self.calls = []


def test_a_replica_hands_over_a_steps_publishes_to_every_shard_in_one_call():
    shards = [FakeShard(), FakeShard()]
    for shard in shards:
        shard.state.register(info("a"))
    agent = Agent(PublishRelay("ns", shards))
    batch = RelayBatch(agent.send)
    first = batch.publish(0, "a", 1, encode_changes([(key(1), 1, 2)], []), None)
    second = batch.publish(1, "a", 1, encode_changes([(key(2), 2, 3)], []), None)
    bad = batch.publish(2, "a", 1, encode_changes([], []), None)  # the namespace has 2 shards
    assert agent.calls == []
    batch.flush()
    batch.flush()  # nothing queued since: no call
    assert [[item[0] for item in items] for items, _ in agent.calls] == [[0, 1, 2]]
    agent.answer()
    assert first.result()[1] is True and second.result()[1] is True
    with pytest.raises(RuntimeError, match="shard 2 is not one of the namespace's 2"):
        bad.result()
    assert shards[0].held_by("a") == {key(1): (1, 2)} and shards[1].held_by("a") == {key(2): (2, 3)}


def test_a_failed_hand_over_fails_each_publish_it_carried():
    def send(items):
        raise ConnectionError("the agent is gone")

    batch = RelayBatch(send)
    futures = [batch.publish(s, "a", 1, b"", None) for s in range(2)]
    batch.flush()
    for future in futures:
        with pytest.raises(ConnectionError):
            future.result()
    answered: Future = Future()
    batch = RelayBatch(lambda items: answered)
    futures = [batch.publish(s, "a", 1, b"", None) for s in range(2)]
    batch.flush()
    answered.set_result([("e", True, 0.003)])  # one answer for two publishes
    for future in futures:
        with pytest.raises(RuntimeError, match="1 results for 2 publishes"):
            future.result()


def crowd(shard: FakeShard, replicas: int) -> None:
    """`replicas` other replicas registered with `shard`."""
    for i in range(replicas):
        shard.state.register(info(f"other-{i}"))


def test_a_link_publishes_through_the_relay_once_it_queries_a_large_namespace():
    """A following link, and a queried one of a small namespace, publish to the shard
    itself (through the relay each publish would cost an actor call more); a queried link
    goes through its node's relay once its shard paces it as one of more than
    AUTO_PUSH_MAX_REPLICAS replicas."""
    shard = FakeShard()
    relay = RelayBatch(lambda items: Future())
    queried = DirectoryLink("ns", info("q"), [shard], "query", relay)
    following = DirectoryLink("ns", info("f"), [shard], "push", relay)
    auto = DirectoryLink("ns", info("s"), [shard], "auto", relay)
    auto._source.switch()  # what a routed request, or a view of many replicas, makes it do
    links = (queried, following, auto)

    def publish_and_answer(now: float) -> None:
        for i, link in enumerate(links):
            link.stored([(key(int(now) + i), 1, 2)])
            link.step(now)
        shard.answer()
        for link in links:
            link.step(now + 0.1)

    for link in links:
        link.step(100.0)  # registers, to the shard itself
    shard.answer()
    publish_and_answer(101.0)
    assert all(type(link._path.path) is DirectPublish and link._path.path.shards == [shard] for link in links)
    assert not any(link.relayed for link in links)
    crowd(shard, AUTO_PUSH_MAX_REPLICAS)  # the shard's answers now pace 3 + 8 replicas
    publish_and_answer(102.0)
    assert queried._path.path is relay and auto._path.path is relay
    assert queried.relayed and auto.relayed and not following.relayed
    assert type(following._path.path) is DirectPublish
    assert queried._publishers[0].client is shard  # registers go to the shard itself


def test_a_queried_links_step_hands_its_publishes_over_in_one_call():
    shards = [FakeShard(), FakeShard()]
    sent = []
    link = DirectoryLink("ns", info("q"), shards, "query", RelayBatch(lambda items: sent.append(items) or Future()))
    link.step(100.0)  # registers, to the shards themselves
    for shard in shards:
        crowd(shard, AUTO_PUSH_MAX_REPLICAS)  # a large namespace: the link's publishes go through the relay
        assert shard.in_flight() == ["register"]
        shard.answer()
    link.step(100.5)  # the registers' answers pace it as one of many: the relay from now on
    link.stored([(key(1), 1, 2), (key(2), 2, 3), (key(3), 3, 4)])
    link.step(101.0)
    link.step(101.1)
    assert len(sent) == 1 and sorted(item[0] for item in sent[0]) == [0, 1]
