"""A demo replica stuck in a request prints where it is stuck (`stacks_printed_if_stuck`)."""

import sys
import threading
import time

from distkv.demo.stuck import stacks_printed_if_stuck


def test_a_block_running_past_its_limit_prints_every_threads_stack(tmp_path, monkeypatch):
    stderr = tmp_path / "stderr"
    monkeypatch.setattr(sys, "stderr", stderr.open("w"))
    other = threading.Event()
    waiter = threading.Thread(target=other.wait)
    waiter.start()
    here = test_a_block_running_past_its_limit_prints_every_threads_stack.__name__
    try:
        with stacks_printed_if_stuck(0.05):
            deadline = time.monotonic() + 30
            # stuck until this thread's stack is out (the last one printed)
            while here not in stderr.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        other.set()
        waiter.join()
    printed = stderr.read_text()
    assert here in printed
    assert printed.count("(most recent call first)") >= 2, printed  # this thread and the waiting one
    assert "in wait" in printed, printed


def test_a_block_done_in_time_prints_nothing(tmp_path, monkeypatch):
    stderr = tmp_path / "stderr"
    monkeypatch.setattr(sys, "stderr", stderr.open("w"))
    with stacks_printed_if_stuck(0.2):
        pass
    time.sleep(0.4)  # past the limit: the timer was cancelled
    assert stderr.read_text() == ""
