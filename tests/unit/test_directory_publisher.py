"""A Publisher stepped by hand against a shard the test answers (no Ray, no thread)."""

import collections

import pytest
from directory_fakes import FakeShard, key

from distkv.directory.state import FLUSH_INTERVAL_S, DirectoryState
from distkv.directory.publisher import HEARTBEAT_INTERVAL_S, DirectPublish, Publisher
from distkv.directory.records import ReplicaInfo
from distkv.directory.wire import decode_changes, decode_stored
from distkv.directory.state import MAX_FLUSH_INTERVAL_S
from distkv.observability.errors import ErrorLog


def info(replica_id: str = "a") -> ReplicaInfo:
    return ReplicaInfo(replica_id, "node-1", f"distkv-ns-{replica_id}", 64, 1, 4096)


class Rig:
    def __init__(self) -> None:
        self.shard = FakeShard()
        self.errors = ErrorLog()
        self.event_lags: collections.deque = collections.deque()
        self.wakes = 0
        self.publisher = Publisher(
            0, self.shard, "ns", info(),
            wake=self.wake, errors=self.errors, event_lags=self.event_lags, path=DirectPublish([self.shard], "ns"),
        )
        self.now = 100.0

    def wake(self) -> None:
        self.wakes += 1

    def step(self, advance_s: float = 10.0) -> float:
        self.now += advance_s
        return self.publisher.step(self.now)

    def store(self, *entries) -> None:
        for k, row, generation in entries:
            self.publisher.store(k, row, generation)
        self.publisher.queued(self.now, self.now, lagged=True)

    def sent(self) -> list[tuple[str, tuple]]:
        """The calls in flight, their payloads decoded."""
        decode = {"register": decode_stored, "publish": decode_changes}
        return [
            (m, tuple(decode[m](a, m) if isinstance(a, bytes) else a for a in args)) for m, args, _ in self.shard.calls
        ]


@pytest.fixture
def rig():
    r = Rig()
    r.step()
    assert r.shard.answer() == ["register"]
    return r


def test_it_registers_first_then_publishes_what_was_stored_in_one_batch(rig):
    assert rig.wakes == 1  # the register's answer woke the link
    rig.store((key(1), 1, 10), (key(2), 2, 20))
    rig.publisher.remove(key(1))
    rig.publisher.queued(rig.now, rig.now, lagged=True)
    rig.step()
    ((method, (replica_id, seq, (stored, removed), report, namespace)),) = rig.sent()
    assert (method, replica_id, seq, namespace) == ("publish", "a", 2, "ns")
    assert stored == [(key(2), 2, 20)] and removed == [key(1)]
    rig.shard.answer()
    assert rig.shard.held_by("a") == {key(2): (2, 20)}


def test_one_call_at_a_time(rig):
    rig.store((key(1), 1, 10))
    rig.step()
    rig.store((key(2), 2, 20))
    assert rig.step() == rig.now + HEARTBEAT_INTERVAL_S
    assert rig.shard.in_flight() == ["publish"]
    rig.shard.answer()
    rig.step()
    assert [args[2][0] for _, args in rig.sent()] == [[(key(2), 2, 20)]]


def test_a_failed_publish_is_sent_again_the_same(rig):
    rig.store((key(1), 1, 10))
    rig.step()
    first = rig.sent()
    rig.shard.up = False
    rig.shard.answer()
    retry_at = rig.step(0.0)  # takes the failure: nothing goes out before the backoff
    assert rig.errors.counts() == {"directory_publish": 1}
    assert rig.shard.calls == [] and rig.now < retry_at < rig.now + 1.0
    rig.shard.up = True
    rig.store((key(2), 2, 20))  # waits for the retry to go through
    rig.step(retry_at - rig.now)
    assert rig.sent() == first
    rig.shard.answer()
    rig.step()
    assert [args[1:3] for _, args in rig.sent()] == [(3, ([(key(2), 2, 20)], []))]


def test_a_shard_that_forgot_the_replica_gets_everything_held_again(rig):
    rig.store((key(1), 1, 10), (key(2), 2, 20))
    rig.step()
    rig.shard.answer()
    rig.shard.state = DirectoryState()  # restarted: it does not know the replica
    rig.publisher.remove(key(1))
    rig.publisher.queued(rig.now, rig.now, lagged=True)
    rig.step()
    assert rig.shard.answer() == ["publish"]  # answered: not known
    rig.step()  # takes the answer: registers after a jitter
    rig.step()
    ((method, (registered, _, stored, _)),) = rig.sent()
    assert method == "register" and registered == info() and stored == [(key(2), 2, 20)]
    rig.shard.answer()
    assert rig.shard.held_by("a") == {key(2): (2, 20)}


def test_an_epoch_other_than_the_registered_one_means_register_again(rig):
    rig.store((key(1), 1, 10))
    rig.step()
    rig.shard.answer()
    rig.publisher.saw_epoch(rig.shard.state.epoch, rig.now)  # the same: nothing to do
    rig.step()
    assert rig.shard.in_flight() == ["publish"]  # a heartbeat
    rig.shard.answer()
    rig.publisher.saw_epoch("another", rig.now)
    rig.step()
    assert rig.shard.in_flight() == ["register"]


def test_switch_info_unregisters_the_old_id_and_registers_the_new_one_with_what_is_held(rig):
    rig.store((key(1), 1, 10))
    rig.step()
    rig.shard.answer()
    rig.publisher.switch_info(info("a.epoch1"), rig.now)
    assert rig.sent() == [("unregister", ("a", "ns"))]
    rig.shard.answer()
    rig.step()
    ((method, (registered, _, stored, _)),) = rig.sent()
    assert method == "register" and registered == info("a.epoch1") and stored == [(key(1), 1, 10)]


def test_the_report_goes_along_at_most_every_heartbeat_and_a_failing_one_does_not_stop_publishing(rig):
    reports = iter([{"n": 1}, {"n": 2}])
    rig.publisher.report = lambda: next(reports)
    rig.step()
    assert rig.sent()[0][1][3] == {"n": 1}
    rig.shard.answer()
    rig.store((key(1), 1, 10))
    rig.step(HEARTBEAT_INTERVAL_S / 10)  # the flush is due, the report is not
    assert rig.sent()[0][1][3] is None
    rig.shard.answer()
    rig.step()
    assert rig.sent()[0][1][3] == {"n": 2}
    rig.shard.answer()
    rig.step()  # the report raises (StopIteration): published without it
    assert [(m, args[3]) for m, args in rig.sent()] == [("publish", None)]


def test_the_event_lag_is_that_of_stores_not_of_promoted_blocks(rig):
    rig.store((key(1), 1, 10))
    rig.step(0.01)  # past the flush interval since the register
    rig.shard.answer()
    rig.step(0.25)
    assert list(rig.event_lags) == [(0, pytest.approx(0.26))]
    rig.publisher.store(key(2), 2, 20)
    rig.publisher.queued(rig.now, rig.now + 0.25, lagged=False)
    rig.step()
    assert rig.sent()[0][1][2] == ([(key(2), 2, 20)], [])
    rig.shard.answer()
    rig.step()
    assert list(rig.event_lags) == [(0, pytest.approx(0.26))]


def test_changes_pending_past_the_bound_become_a_register(rig, monkeypatch):
    import distkv.directory.publisher

    monkeypatch.setattr(distkv.directory.publisher, "MAX_PENDING_KEYS", 4)
    rig.shard.up = False
    rig.store((key(1), 1, 10))
    rig.step()
    rig.shard.answer()  # fails: the batch waits for a retry
    for i in range(2, 8):
        rig.publisher.store(key(i), 1, i)
        rig.publisher.remove(key(i))
    rig.publisher.queued(rig.now, rig.now, lagged=True)
    assert rig.publisher.pending == {}
    rig.shard.up = True
    rig.step()
    ((method, (_, _, stored, _)),) = rig.sent()
    assert method == "register" and stored == [(key(1), 1, 10)]


def test_a_re_register_of_many_keys_goes_in_chunks(rig, monkeypatch):
    import distkv.directory.publisher

    monkeypatch.setattr(distkv.directory.publisher, "MAX_BATCH_KEYS", 3)
    rig.step(0.0)  # takes the register's answer
    held = {key(i): (i, 10 + i) for i in range(8)}
    for k, (row, generation) in held.items():
        rig.publisher.store(k, row, generation)
    rig.publisher.saw_epoch("another", rig.now)  # the shard restarted: register again
    rig.publisher.queued(rig.now, rig.now, lagged=True)
    rig.shard.state = DirectoryState()
    sizes = []
    for _ in range(4):
        rig.step()
        ((method, args),) = rig.sent()
        stored, removed = (args[2], []) if method == "register" else args[2]
        sizes.append((method, len(stored) + len(removed)))
        rig.shard.answer()
    assert sizes == [("register", 3), ("publish", 3), ("publish", 2), ("publish", 0)]  # then heartbeats
    assert rig.shard.held_by("a") == held
    log = rig.shard.state.changes(None)  # every entry in the shard's log is a chunk too
    assert log.is_snapshot and rig.shard.state.stats()["log_entries"] == 3


def test_changes_past_the_batch_bound_go_in_several_publishes_and_the_latest_wins(rig, monkeypatch):
    import distkv.directory.publisher

    monkeypatch.setattr(distkv.directory.publisher, "MAX_BATCH_KEYS", 2)
    rig.store(*[(key(i), i, 1) for i in range(1, 6)])
    rig.step()
    assert [len(args[2][0]) for _, args in rig.sent()] == [2]
    rig.shard.answer()
    rig.step(0.01)
    (_, (_, _, (stored, _), _, _)), = rig.sent()
    assert [k for k, _, _ in stored] == [key(3), key(4)]
    # while keys 3 and 4 are in flight: 1 goes, 3 is sealed anew
    rig.publisher.remove(key(1))
    rig.store((key(3), 3, 2))
    while rig.shard.calls:
        rig.shard.answer()
        rig.step(0.01)
    rig.step()
    rig.shard.answer()
    assert rig.shard.held_by("a") == {key(2): (2, 1), key(3): (3, 2), key(4): (4, 1), key(5): (5, 1)}
    assert rig.shard.held_by("a") == rig.publisher.held


def publish_times(rig, store_every_s: float, duration_s: float) -> list[tuple[float, int]]:
    """Store a key every `store_every_s` for `duration_s`, the shard answering at once:
    (when, keys carried) of each publish."""
    sent = []
    end = rig.now + duration_s
    i = 1000
    while rig.now < end:
        rig.store((key(i), 1, i))
        i += 1
        rig.step(store_every_s)
        sent += [(rig.now, len(args[2][0]) + len(args[2][1])) for _, args in rig.sent() if _ == "publish"]
        rig.shard.answer()
    return sent


def others_registered(rig, count: int) -> None:
    """Register `count` other replicas with the rig's shard, or unregister them (count 0)."""
    state = rig.shard.state
    for replica_id in [r["replica_id"] for r in state.replicas() if r["replica_id"] != "a"]:
        state.unregister(replica_id)
    for i in range(count):
        state.register(info(f"other{i}"))


def test_the_shard_paces_a_busy_replica_by_how_many_replicas_it_serves(rig):
    others_registered(rig, 249)  # 250 replicas: one call a second each
    assert rig.shard.state.publish_interval() == pytest.approx(1.0)
    rig.step(HEARTBEAT_INTERVAL_S)
    rig.shard.answer()
    rig.step(0.0)  # the heartbeat's answer brings the interval
    assert rig.publisher.flush_interval == pytest.approx(1.0)
    rig.step(1.5)
    rig.store((key(1), 1, 1))
    rig.step(0.0)
    assert [m for m, _ in rig.sent()] == ["publish"]  # after a quiet interval a change goes at once
    rig.shard.answer()

    sent = publish_times(rig, 0.01, 10.0)  # a busy replica: a store every 10 ms
    gaps = [b[0] - a[0] for a, b in zip(sent, sent[1:])]
    assert gaps == [pytest.approx(1.0, abs=0.011)] * len(gaps)  # one call per interval...
    assert all(n > 0 for _, n in sent)  # ...each carrying changes: each was the heartbeat too
    assert sum(n for _, n in sent) >= 990 and 9 <= len(sent) <= 11

    others_registered(rig, 0)  # the others left: the shard asks for its shortest interval
    rig.step(1.0)
    rig.shard.answer()
    rig.step(0.0)
    assert rig.publisher.flush_interval == pytest.approx(FLUSH_INTERVAL_S + 0.001)  # 1/250 s for one replica
    sent = publish_times(rig, 0.01, 1.0)
    assert len(sent) >= 90  # every store goes on its own again, within the interval
    rig.step(1.0)
    rig.shard.answer()
    rig.step(0.0)
    assert rig.shard.calls == []  # nothing pending
    rig.step(HEARTBEAT_INTERVAL_S)
    assert [(m, args[2]) for m, args in rig.sent()] == [("publish", ([], []))]  # idle: a heartbeat


def test_a_paced_replica_heartbeats_no_more_often_than_its_interval(rig):
    others_registered(rig, 499)  # 500 replicas: the longest interval
    rig.step(HEARTBEAT_INTERVAL_S)
    rig.shard.answer()
    rig.step(0.0)
    assert rig.publisher.flush_interval == MAX_FLUSH_INTERVAL_S
    rig.step(HEARTBEAT_INTERVAL_S)
    assert rig.shard.calls == []  # a heartbeat interval is not enough...
    rig.step(MAX_FLUSH_INTERVAL_S - HEARTBEAT_INTERVAL_S)
    assert [(m, args[2]) for m, args in rig.sent()] == [("publish", ([], []))]  # ...the shard's is


def test_a_full_batch_goes_without_waiting_for_the_interval(rig, monkeypatch):
    import distkv.directory.publisher

    others_registered(rig, 499)
    rig.step(HEARTBEAT_INTERVAL_S)
    rig.shard.answer()
    rig.step(0.0)
    assert rig.publisher.flush_interval == MAX_FLUSH_INTERVAL_S
    monkeypatch.setattr(distkv.directory.publisher, "MAX_BATCH_KEYS", 3)
    rig.store(*[(key(i), i, 1) for i in range(7)])
    sizes = []
    for _ in range(2):
        rig.step(0.0)
        sizes += [len(args[2][0]) for _, args in rig.sent()]
        rig.shard.answer()
    assert sizes == [3, 3]  # full batches, back to back
    assert rig.step(0.0) > rig.now  # the rest waits for the interval
    assert rig.shard.calls == []


def test_a_shard_down_past_the_pending_bound_gets_a_resync_and_memory_stays_bounded(rig, monkeypatch):
    import distkv.directory.publisher

    monkeypatch.setattr(distkv.directory.publisher, "MAX_PENDING_KEYS", 32)
    monkeypatch.setattr(distkv.directory.publisher, "MAX_BATCH_KEYS", 8)
    publisher = rig.publisher
    rig.store(*[(key(i), i, 1) for i in range(20)])
    rig.step()
    rig.shard.answer()
    rig.step(0.0)

    rig.shard.up = False
    churn = 1000
    largest_pending = largest_retry = 0
    for round_ in range(400):  # 40 s of stores and evictions while the shard is down
        for _ in range(4):
            publisher.store(key(churn), 1 + churn % 60, 2)
            publisher.remove(key(churn - 8))
            churn += 1
        if round_ % 50 == 0:
            publisher.remove(key(round_ // 50))  # some of what the shard has goes too
        publisher.queued(rig.now, rig.now, lagged=True)
        largest_pending = max(largest_pending, len(publisher.pending))
        rig.step(0.1)
        rig.shard.answer()
        if publisher.failed_batch is not None:
            _, stored, removed = publisher.failed_batch
            largest_retry = max(largest_retry, len(stored) + len(removed))
    assert largest_pending <= max(32, len(publisher.held)) + 9  # the bound, and one round's changes
    assert largest_retry <= 8
    assert rig.errors.counts()["directory_publish"] > 0

    rig.shard.up = True
    methods = []
    for _ in range(50):
        rig.step(0.1)
        methods += rig.shard.in_flight()
        rig.shard.answer()
    assert methods[0] == "register"  # a resync, not a replay of what was pending
    held = publisher.held
    assert len(held) == 20 - 8 + 8
    assert rig.shard.held_by("a") == held  # exactly what the replica holds
    assert rig.shard.state.stats()["holders"] == len(held)
