"""A Follower stepped by hand against a shard the test answers (no Ray, no thread)."""

import math

import pytest
from directory_fakes import FakeShard, key

from distkv.directory.follower import POLL_TIMEOUT_S, Follower
from distkv.directory.state import DirectoryState
from distkv.directory.records import Holder, ReplicaInfo
from distkv.directory.follower import ShardView
from distkv.observability.errors import ErrorLog


def info(replica_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", 64, 1, 4096)


class Rig:
    def __init__(self) -> None:
        self.shard = FakeShard()
        self.shard.state.register(info("a"))
        self.shard.state.register(info("b"))
        self.view = ShardView("a")
        self.errors = ErrorLog()
        self.epochs: list[str] = []
        self.wakes = 0
        self.follower = Follower(
            0, self.shard, "ns", self.view, wake=self.wake, errors=self.errors, saw_epoch=self.saw_epoch
        )
        self.now = 100.0

    def wake(self) -> None:
        self.wakes += 1

    def saw_epoch(self, epoch: str, now: float) -> None:
        self.epochs.append(epoch)

    def step(self, advance_s: float = 10.0) -> float:
        self.now += advance_s
        return self.follower.step(self.now)


@pytest.fixture
def rig():
    return Rig()


def test_it_polls_from_its_cursor_as_its_replica_and_applies_the_answer(rig):
    assert math.isinf(rig.step())  # a poll in flight: nothing due until it ends
    ((method, (cursor, timeout_s, namespace, follower), _),) = rig.shard.calls
    assert (method, cursor, timeout_s, namespace, follower) == ("changes", None, POLL_TIMEOUT_S, "ns", "a")
    rig.shard.state.publish("a", 1, [(key(1), 1, 10)], [])
    rig.shard.state.publish("b", 1, [(key(2), 2, 20)], [])
    rig.shard.answer()
    assert rig.wakes == 1
    rig.step()
    assert rig.view.holders == {key(2): (Holder("b", "node-1", 2, 20),)}  # its own replica's left out
    assert set(rig.view.replicas) == {"a", "b"}
    assert rig.epochs == [rig.shard.state.epoch]
    ((_, (cursor, *_), _),) = rig.shard.calls  # the next poll, from where the answer left it
    assert cursor == rig.shard.state.cursor()


def test_one_poll_at_a_time(rig):
    rig.step()
    rig.step()
    assert rig.shard.in_flight() == ["changes"]


def test_a_failed_poll_is_made_again_after_a_backoff(rig):
    rig.step()
    rig.shard.up = False
    rig.shard.answer()
    due = rig.step(0.0)
    assert rig.errors.counts() == {"directory_poll": 1}
    assert rig.shard.in_flight() == [] and rig.now < due < rig.now + 1.0
    rig.shard.up = True
    rig.step(due - rig.now)
    assert rig.shard.in_flight() == ["changes"]
    rig.shard.state.publish("b", 1, [(key(2), 2, 20)], [])
    rig.shard.answer()
    rig.step()
    assert key(2) in rig.view.holders


def test_a_restarted_shards_epoch_goes_to_saw_epoch(rig):
    rig.step()
    rig.shard.answer()
    first = rig.shard.state.epoch
    rig.shard.state = DirectoryState()
    rig.step()
    rig.shard.answer()
    rig.step()
    assert rig.epochs == [first, rig.shard.state.epoch] and first != rig.shard.state.epoch


def test_cancel_gives_up_the_poll_in_flight(rig):
    rig.follower.cancel()
    assert rig.shard.cancelled == []
    rig.step()
    rig.follower.cancel()
    assert rig.shard.cancelled == [rig.shard.calls[0][2]]


def test_a_new_followers_first_poll_takes_a_snapshot_without_waiting_for_news(rig):
    """What a joining replica sees at once: the shard answers a poll from no cursor with
    everything it holds, however long since anyone published."""
    rig.shard.state.publish("b", 1, [(key(i), i, 1) for i in range(64)], [])
    rig.step()
    assert not rig.follower.synced
    ((_, (cursor, *_), _),) = rig.shard.calls
    assert cursor is None and rig.shard.state.has_news(cursor, "a")  # the actor answers it at once
    rig.shard.answer()
    rig.step()
    assert rig.follower.synced
    assert set(rig.view.holders) == {key(i) for i in range(64)}


def test_a_failed_first_poll_leaves_it_unsynced(rig):
    rig.step()
    rig.shard.up = False
    rig.shard.answer()
    rig.step(0.0)
    assert not rig.follower.synced


def test_a_follower_far_behind_catches_up_over_bounded_answers(monkeypatch):
    import distkv.directory.feed

    monkeypatch.setattr(distkv.directory.feed, "MAX_ANSWER_KEYS", 4)
    rig = Rig()
    rig.step()
    rig.shard.answer()
    rig.step(0.0)  # the first answer: a snapshot
    state = rig.shard.state
    for seq in range(1, 30):
        state.publish("b", seq, [(key(seq), seq % 64, seq), (key(seq + 100), 1, seq)], [key(seq - 1)])
    answers = 0
    while rig.view.cursor != state.cursor():
        assert rig.shard.in_flight() == ["changes"]  # asks again at once: no wait between answers
        rig.shard.answer()
        rig.step(0.0)
        answers += 1
    assert answers == 29
    truth = {key(i): holders for i in range(200) if (holders := state.query([key(i)])[0])}
    assert rig.view.holders == {k: tuple(Holder(*h) for h in v) for k, v in truth.items()}
