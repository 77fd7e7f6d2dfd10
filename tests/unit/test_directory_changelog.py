"""The ChangeLog: a shard's numbered changes and the cursors into them."""

import pytest

from distkv.directory.changelog import ChangeLog
from distkv.directory.records import Cursor


def entry(replica_id: str, stored: int = 1, removed: int = 0):
    return (replica_id, "node-1", [(bytes(36), i, 0) for i in range(stored)], [bytes(36)] * removed)


def test_a_cursor_stands_after_every_entry_so_far():
    log = ChangeLog(100)
    start = log.cursor()
    assert start == Cursor(log.epoch, 0, 0)
    log.append(entry("a"))
    log.append(entry("b"))
    assert log.cursor() == Cursor(log.epoch, 2, 0)
    log.replicas_changed()
    assert log.cursor() == Cursor(log.epoch, 2, 1)
    assert len(log) == 2


def test_since_a_position_is_every_later_entry_in_order():
    log = ChangeLog(100)
    entries = [entry(r) for r in "abc"]
    cursors = []
    for e in entries:
        cursors.append(log.cursor())
        log.append(e)
    assert [log.since(log.position(c)) for c in cursors] == [entries, entries[1:], entries[2:]]
    assert log.since(log.position(log.cursor())) == []


def test_the_log_keeps_about_capacity_keys_and_always_the_latest_entry():
    log = ChangeLog(5)
    first = log.cursor()
    log.append(entry("a", stored=2))
    second = log.cursor()
    log.append(entry("a", stored=2))
    assert len(log) == 2 and log.position(first) == 0
    log.append(entry("a", stored=1, removed=2))  # 7 keys: the oldest entry goes
    assert len(log) == 2
    assert log.position(first) is None  # fell off the log: a snapshot
    assert log.position(second) == 1
    big = entry("b", stored=10)
    log.append(big)  # larger than the capacity on its own: kept alone
    assert len(log) == 1 and log.since(log.position(log.cursor()) - 1) == [big]


def test_a_cursor_of_another_epoch_or_beyond_the_end_needs_a_snapshot():
    log, other = ChangeLog(10), ChangeLog(10)
    assert log.epoch != other.epoch
    other.append(entry("a"))
    log.append(entry("a"))
    assert log.position(other.cursor()) is None
    assert log.position(Cursor(log.epoch, 5, 0)) is None
    assert log.position(None) is None
    assert log.position(Cursor(log.epoch, 1, 0)) == 1


@pytest.mark.parametrize("cursor", ["nonsense", (1, 2), 7])
def test_a_malformed_cursor_is_a_value_error(cursor):
    log = ChangeLog(10)
    with pytest.raises(ValueError, match="is not an"):
        log.position(cursor)


def test_news_is_what_others_did_since_the_cursor():
    log = ChangeLog(100)
    cursor = log.cursor()
    assert not log.has_news(cursor, "a")
    log.append(entry("a"))
    assert not log.has_news(cursor, "a")  # a's own change
    assert log.has_news(cursor, "b") and log.has_news(cursor)
    log.append(entry("b"))
    log.append(entry("a"))
    assert log.has_news(cursor, "a")  # b's among a's own
    assert not log.has_news(log.cursor(), "b")
    cursor = log.cursor()
    log.replicas_changed()
    assert log.has_news(cursor, "a")  # a replica came or went: news for everyone
    assert log.has_news(None, "a") and log.has_news(ChangeLog(1).cursor(), "a")


def test_capacity_must_be_positive():
    for capacity in (0, -1, 1.5, "4"):
        with pytest.raises(ValueError, match="log_capacity"):
            ChangeLog(capacity)


def test_since_with_a_bound_gives_whole_entries_up_to_that_many_keys_and_one_at_least():
    log = ChangeLog(1000)
    start = log.cursor()
    entries = [entry("a", stored=n) for n in (3, 2, 4, 1, 9, 1)]
    for e in entries:
        log.append(e)
    since = lambda position: log.since(position, max_keys=5)  # noqa: E731
    assert since(0) == entries[:2]
    assert since(2) == entries[2:4]
    assert since(4) == entries[4:5]  # larger than the bound alone: whole, on its own
    assert since(5) == entries[5:] and since(6) == []
    # from the near end and from the far end of the log alike
    assert [since(p) for p in range(7)] == [log.since(p)[: len(since(p))] for p in range(7)]
    assert log.since(log.position(start)) == entries
