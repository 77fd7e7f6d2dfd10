"""ErrorLog: the errors a component counts by kind, with the last few messages."""

import pytest

from distkv.observability.errors import MAX_ERROR_MESSAGE, ErrorLog, merge_errors


def test_error_log_counts_by_kind_and_keeps_the_last_few():
    log = ErrorLog(keep=3)
    for i in range(5):
        log.add("promotion_timeout", f"timeout {i}")
    log.add("directory_poll", "x" * 1000)
    assert log.counts() == {"promotion_timeout": 5, "directory_poll": 1}
    recent = log.recent()
    assert [m for _, _, m in recent][:2] == ["timeout 3", "timeout 4"]
    assert len(recent[-1][2]) == MAX_ERROR_MESSAGE
    with pytest.raises(ValueError, match="error kind"):
        log.add("oops", "no such kind")
    assert log.counts()["promotion_timeout"] == 5


def test_error_log_sync_notes_only_the_increase():
    log = ErrorLog()
    log.sync("store_rejected", 0, "rejected")
    assert log.counts() == {} and log.recent() == []
    log.sync("store_rejected", 3, "rejected")
    log.sync("store_rejected", 3, "rejected")
    assert log.counts() == {"store_rejected": 3}
    assert [m for _, _, m in log.recent()] == ["3 x rejected"]
    other = ErrorLog()
    other.add("load_failed", "late")
    counts, recent = merge_errors([log, other])
    assert counts == {"store_rejected": 3, "load_failed": 1}
    assert [k for _, k, _ in recent] == ["store_rejected", "load_failed"]
