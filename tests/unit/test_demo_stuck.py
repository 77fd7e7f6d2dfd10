"""A demo replica stuck in a request, or with its event loop blocked, prints where it is stuck
(`stacks_printed_if_stuck`, `LoopWatch`)."""

import asyncio
import sys
import threading
import time

from distkv.demo.stuck import LoopWatch, stacks_printed_if_stuck


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


def loop_in_a_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    return loop, runner


def stop(loop: asyncio.AbstractEventLoop, runner: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    runner.join()
    loop.close()


def test_an_event_loop_blocked_past_its_limit_prints_every_threads_stack(tmp_path, monkeypatch):
    stderr = tmp_path / "stderr"
    monkeypatch.setattr(sys, "stderr", stderr.open("w"))
    loop, runner = loop_in_a_thread()
    watch = LoopWatch(loop, 0.2, period_s=0.05)

    def blocking_callback() -> None:  # blocks the loop until its own stack is out
        deadline = time.monotonic() + 30
        while "blocking_callback" not in stderr.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)

    try:
        loop.call_soon_threadsafe(blocking_callback)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(60)  # it ran again after
    finally:
        watch.close()
        stop(loop, runner)
    printed = stderr.read_text()
    assert "event loop has run nothing" in printed
    assert "blocking_callback" in printed, printed
    assert printed.count("event loop has run nothing") == 1, printed  # once per stall


def test_an_event_loop_that_runs_prints_nothing(tmp_path, monkeypatch):
    stderr = tmp_path / "stderr"
    monkeypatch.setattr(sys, "stderr", stderr.open("w"))
    loop, runner = loop_in_a_thread()
    watch = LoopWatch(loop, 0.2, period_s=0.05)
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.6), loop).result(30)  # three limits' worth
    finally:
        watch.close()
        stop(loop, runner)
    assert stderr.read_text() == ""
