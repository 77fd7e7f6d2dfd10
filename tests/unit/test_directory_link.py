"""The DirectoryLink's logic, stepped by hand against shards the test answers (no Ray).

The link's thread is not started: each `step` is one pass of its loop (take the inbox,
service every shard) at a time the test chooses, and a shard's calls stay in flight
until the test answers them, from a DirectoryState as the actor would, or fails them
as a shard that is down does.
"""

import itertools
import time

import pytest
from directory_fakes import FakeShard, key

import distkv.directory.publisher as publisher_module
from distkv.directory.link import DirectoryLink
from distkv.directory.state import DirectoryState
from distkv.directory.records import ReplicaInfo


class Stepper:
    """Runs one pass of a link's loop at a time, on a clock the test advances."""

    def __init__(self, link: DirectoryLink, start: float) -> None:
        self.link = link
        self.now = start

    def step(self, advance_s: float = 10.0) -> None:
        """One pass of the link's loop, `advance_s` later than the last: every timer due."""
        self.now += advance_s
        self.link.step(self.now)


@pytest.fixture
def shards():
    return [FakeShard()]


def make_link(shards: list[FakeShard], replica_id: str = "a", num_rows: int = 1 << 20) -> DirectoryLink:
    info = ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", num_rows, 1, 4096)
    return DirectoryLink("ns", info, shards)


def test_pending_changes_stay_bounded_while_a_shard_is_down_and_it_is_refilled_from_what_is_held(
    shards, monkeypatch
):
    monkeypatch.setattr(publisher_module, "MAX_PENDING_KEYS", 64)
    link = make_link(shards)
    (shard,) = shards
    stepper = Stepper(link, time.monotonic())
    stepper.step()
    assert shard.answer(("register",)) == ["register"]
    kept = [(key(i), i, 1) for i in range(16)]
    link.stored(kept)
    stepper.step()
    shard.answer(("publish",))
    assert shard.held_by("a") == {k: (row, gen) for k, row, gen in kept}

    shard.up = False
    churn = itertools.count(1000)
    largest = 0
    for _ in range(200):  # stores and evictions go on while the shard is down
        batch = [(key(next(churn)), 20, 2) for _ in range(8)]
        link.stored(batch)
        link.removed([k for k, _, _ in batch])
        stepper.step()
        shard.answer()
        (publisher,) = link._publishers
        largest = max(largest, len(publisher.pending))
    assert largest <= 64 + 8 * 2  # the bound, and one step's changes at most

    link.removed([kept[0][0]])
    shard.up = True
    for _ in range(3):
        stepper.step()
        shard.answer()
    # the shard holds exactly what the replica holds: nothing it evicted while it was down
    assert shard.held_by("a") == {k: (row, gen) for k, row, gen in kept[1:]}


def test_a_publish_the_old_incarnation_took_just_before_it_died_is_in_the_refill(shards):
    """`ray.kill` returns before the actor is gone, and calls made right after it usually
    still reach the old incarnation: a publish it applied then dies with it, and the
    new incarnation must get it from the link's re-register."""
    link = make_link(shards)
    (shard,) = shards
    stepper = Stepper(link, time.monotonic())
    stepper.step()
    shard.answer()
    first = [(key(i), i, 1) for i in range(20)]
    link.stored(first)
    stepper.step()
    shard.answer()
    late = [(key(100 + i), 40 + i, 2) for i in range(5)]
    link.stored(late)
    stepper.step()
    assert shard.answer(("publish",)) == ["publish"]  # the old incarnation takes the late keys
    assert shard.state.stats()["holders"] == 25
    old_epoch = shard.state.epoch

    shard.state = DirectoryState()  # it dies: the new incarnation is empty, with a new epoch
    for _ in range(3):  # the call in flight is retried there, the next ones go there
        stepper.step()
        shard.answer()
    assert shard.state.epoch != old_epoch
    assert shard.held_by("a") == {k: (row, gen) for k, row, gen in first + late}
    assert shard.state.stats()["holders"] == 25


def test_wait_synced_is_true_once_every_shard_answered_its_first_poll():
    shards = [FakeShard(), FakeShard()]
    link = make_link(shards)
    stepper = Stepper(link, time.monotonic())
    stepper.step()
    assert not link.wait_synced(0.0)
    shards[0].answer(("changes",))
    stepper.step()
    assert not link.wait_synced(0.0)  # one shard's view is not the cache's
    shards[1].up = False
    shards[1].answer(("changes",))
    stepper.step()
    assert not link.wait_synced(0.0)  # a failed poll brings no view
    shards[1].up = True
    stepper.step()
    shards[1].answer(("changes",))
    stepper.step()
    assert link.wait_synced(0.0)
