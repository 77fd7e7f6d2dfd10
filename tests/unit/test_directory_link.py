"""The DirectoryLink's logic, stepped by hand against shards the test answers (no Ray).

The link's thread is not started: each `step` is one pass of its loop (take the inbox,
service every shard) at a time the test chooses, and a shard's calls stay in flight
until the test answers them, from a DirectoryState as the actor would, or fails them
as a shard that is down does.
"""

import itertools
import time
from concurrent.futures import Future

import pytest

import distkv.directory as directory
import ray_actors.directory
from distkv.directory import DirectoryLink, DirectoryState, ReplicaInfo, pack, unpack


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4 + b"\0\0\0\0"


class ShardDown(Exception):
    pass


class FakeRef:
    def __init__(self) -> None:
        self._future: Future = Future()

    def future(self) -> Future:
        return self._future


class FakeShard:
    """A shard actor: its calls wait in `calls` until `answer` runs them on `state`."""

    def __init__(self) -> None:
        self.state = DirectoryState()
        self.calls: list[tuple[str, tuple, dict, FakeRef]] = []
        self.up = True

    def __getattr__(self, method: str):
        shard = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                ref = FakeRef()
                shard.calls.append((method, args, kwargs, ref))
                return ref

        return Method

    def answer(self, methods=("register", "publish", "unregister", "changes")) -> list[str]:
        """Run (or, when down, fail) the calls in flight of `methods`, in order; their names."""
        answered = []
        for call in [c for c in self.calls if c[0] in methods]:
            self.calls.remove(call)
            method, args, kwargs, ref = call
            answered.append(method)
            if not self.up:
                ref.future().set_exception(ShardDown("the shard is down"))
                continue
            ref.future().set_result(getattr(self, "_" + method)(*args, **kwargs))
        return answered

    def _register(self, info, seq, stored, namespace):
        self.state.register(info)
        self.state.publish(info.replica_id, seq, unpack(stored), ())
        return self.state.epoch, True

    def _publish(self, replica_id, seq, changes, report, namespace):
        stored, removed = unpack(changes)
        return self.state.epoch, self.state.publish(replica_id, seq, stored, removed)

    def _unregister(self, replica_id, namespace):
        return self.state.unregister(replica_id)

    def _changes(self, cursor, timeout_s, namespace, follower=None):
        return pack(self.state.changes(cursor))

    def held_by(self, replica_id: str) -> dict[bytes, tuple[int, int]]:
        entries = [e for e in self.state.changes(None).entries if e[0] == replica_id]
        return {k: (row, gen) for _, _, stored, _ in entries for k, row, gen in stored}


class Stepper:
    """Runs one pass of a link's loop at a time, on a clock the test advances."""

    def __init__(self, link: DirectoryLink, start: float) -> None:
        self.link = link
        self.now = start

    def step(self, advance_s: float = 10.0) -> None:
        """One pass of the link's loop, `advance_s` later than the last: every timer due."""
        self.now += advance_s
        self.link._take_inbox()
        for shard in self.link._shards:
            self.link._service(shard, self.now)


@pytest.fixture
def shards(monkeypatch):
    made: list[FakeShard] = []

    def get_or_create_shards(namespace, num_shards):
        made.extend(FakeShard() for _ in range(num_shards - len(made)))
        return made[:num_shards]

    monkeypatch.setattr(ray_actors.directory, "get_or_create_shards", get_or_create_shards)
    return made


def make_link(replica_id: str = "a", num_rows: int = 1 << 20) -> DirectoryLink:
    info = ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", num_rows, 1, 4096)
    return DirectoryLink("ns", info, 1)


def test_pending_changes_stay_bounded_while_a_shard_is_down_and_it_is_refilled_from_what_is_held(
    shards, monkeypatch
):
    monkeypatch.setattr(directory, "MAX_PENDING_KEYS", 64)
    link = make_link()
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
        (state,) = link._shards
        largest = max(largest, len(state.pending))
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
    link = make_link()
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
