"""ReadQueue: READs posted on a thread of their own, in order, and cancelled so that no
byte lands and nothing is said once `cancel` returns. A fake agent stands in for NIXL,
so each test decides when a post returns and when a READ completes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from distkv.transfer.rdma import PoolEndpoint, QueuedRead, ReadQueue

REMOTE = PoolEndpoint("holder", b"", 0, 1 << 20)
WAIT_S = 30  # generous: nothing here takes more than milliseconds


class FakeRead:
    """A READ whose state the test sets. While `abortable` is clear, NIXL cannot abort it:
    `release` refuses (and sets `refused`), as NIXL does when UCX cannot cancel a READ."""

    def __init__(self, pieces: np.ndarray, abortable: bool = True) -> None:
        self.pieces = pieces
        self.outcome = "pending"
        self.released = threading.Event()
        self.abortable = threading.Event()
        if abortable:
            self.abortable.set()
        self.refused = threading.Event()

    def state(self) -> str:
        return "failed" if self.released.is_set() and self.outcome == "pending" else self.outcome

    def release(self) -> bool:
        if not self.abortable.is_set():
            self.refused.set()
            return False
        self.released.set()
        return True


class FakeAgent:
    """Records every post; a post blocks while `hold` is clear; `fail_posts` raise; reads
    posted while `abortable` is False cannot be aborted until the test says so."""

    def __init__(self) -> None:
        self.posted: list[FakeRead] = []
        self.posting = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        self.fail_posts = False
        self.abortable = True
        self._changed = threading.Condition()

    def read(self, remote: PoolEndpoint, pieces: np.ndarray) -> FakeRead:
        self.posting.set()
        assert self.hold.wait(WAIT_S)
        if self.fail_posts:
            raise ConnectionError("peer gone")
        read = FakeRead(pieces, self.abortable)
        with self._changed:
            self.posted.append(read)
            self._changed.notify_all()
        return read

    def wait_posted(self, n: int) -> FakeRead:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.posted) >= n, WAIT_S)
            return self.posted[n - 1]


class Outcomes:
    def __init__(self) -> None:
        self.said: list[bool] = []
        self.event = threading.Event()

    def __call__(self, ok: bool) -> None:
        self.said.append(ok)
        self.event.set()


@pytest.fixture
def agent_queue():
    agent = FakeAgent()
    reads = ReadQueue(agent)
    yield agent, reads
    agent.hold.set()
    reads.close()


def steps(n: int) -> list[np.ndarray]:
    return [np.array([[i, 0, 8]], dtype=np.int64) for i in range(n)]


def test_each_step_is_posted_once_the_one_before_completed_then_ok_once(agent_queue):
    agent, reads = agent_queue
    outcome = Outcomes()
    reads.submit(REMOTE, steps(2), outcome)
    first = agent.wait_posted(1)
    assert first.pieces[0, 0] == 0
    assert len(agent.posted) == 1 and not outcome.said  # the second waits on the first
    first.outcome = "done"
    second = agent.wait_posted(2)
    assert second.pieces[0, 0] == 1 and not outcome.said
    second.outcome = "done"
    assert outcome.event.wait(WAIT_S)
    assert outcome.said == [True]
    assert first.released.is_set() and second.released.is_set()


def test_a_failed_step_says_so_and_posts_nothing_after_it(agent_queue):
    agent, reads = agent_queue
    outcome = Outcomes()
    reads.submit(REMOTE, steps(2), outcome)
    agent.wait_posted(1).outcome = "failed"
    assert outcome.event.wait(WAIT_S)
    assert outcome.said == [False] and len(agent.posted) == 1


def test_a_post_that_raises_says_not_ok(agent_queue):
    agent, reads = agent_queue
    agent.fail_posts = True
    outcome = Outcomes()
    reads.submit(REMOTE, steps(1), outcome)
    assert outcome.event.wait(WAIT_S)
    assert outcome.said == [False]


def test_cancelled_while_queued_it_is_never_posted(agent_queue):
    agent, reads = agent_queue
    agent.hold.clear()
    blocker = reads.submit(REMOTE, steps(1), Outcomes())
    assert agent.posting.wait(WAIT_S)  # the thread is inside the blocker's post
    outcome = Outcomes()
    queued = reads.submit(REMOTE, steps(1), outcome)
    reads.cancel(queued)
    assert queued.state == QueuedRead.OVER
    agent.hold.set()
    agent.wait_posted(1).outcome = "done"
    reads.cancel(blocker)
    reads.close()
    assert len(agent.posted) == 1 and not outcome.said


def test_cancelled_while_posting_it_waits_for_the_post_then_releases_it(agent_queue):
    agent, reads = agent_queue
    agent.hold.clear()
    outcome = Outcomes()
    queued = reads.submit(REMOTE, steps(2), outcome)
    assert agent.posting.wait(WAIT_S)
    cancelled = threading.Event()
    canceller = threading.Thread(target=lambda: (reads.cancel(queued), cancelled.set()))
    canceller.start()
    # cancel cannot return while the post may still be moving bytes
    assert not cancelled.wait(0.2)
    agent.hold.set()
    assert cancelled.wait(WAIT_S)
    canceller.join()
    read = agent.wait_posted(1)
    assert read.released.is_set()
    read.outcome = "done"  # too late: nothing more is posted, nothing is said
    reads.close()
    assert len(agent.posted) == 1 and not outcome.said


def test_cancelled_in_flight_it_is_released_and_says_nothing(agent_queue):
    agent, reads = agent_queue
    outcome = Outcomes()
    queued = reads.submit(REMOTE, steps(2), outcome)
    read = agent.wait_posted(1)
    reads.cancel(queued)
    assert read.released.is_set()
    read.outcome = "done"
    reads.cancel(queued)  # twice is fine
    reads.close()
    assert len(agent.posted) == 1 and not outcome.said


def test_a_then_may_submit_more(agent_queue):
    agent, reads = agent_queue
    second = Outcomes()
    reads.submit(REMOTE, steps(1), lambda ok: reads.submit(REMOTE, steps(1), second))
    agent.wait_posted(1).outcome = "done"
    agent.wait_posted(2).outcome = "done"
    assert second.event.wait(WAIT_S)
    assert second.said == [True]


def test_close_releases_what_is_in_flight_and_refuses_more(agent_queue):
    agent, reads = agent_queue
    outcome = Outcomes()
    reads.submit(REMOTE, steps(1), outcome)
    read = agent.wait_posted(1)
    reads.close()
    assert read.released.is_set() and not outcome.said
    with pytest.raises(RuntimeError, match="closed"):
        reads.submit(REMOTE, steps(1), outcome)


def wait_over(queued: QueuedRead) -> None:
    deadline = time.monotonic() + WAIT_S
    while not queued.over:
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.001)


def test_a_read_nixl_cannot_abort_stays_the_queues_until_it_lets_it_go(agent_queue):
    """UCX cannot always abort a READ in flight: NIXL then keeps its handle. Cancelling
    it says so (False), and it is over (nothing of it lands any more) only once the
    queue, trying again at every poll, got the handle released; nothing is said of it."""
    agent, reads = agent_queue
    agent.abortable = False
    outcome = Outcomes()
    queued = reads.submit(REMOTE, steps(2), outcome)
    read = agent.wait_posted(1)
    assert reads.cancel(queued) is False
    assert not queued.over and read.refused.is_set() and not read.released.is_set()
    read.refused.clear()
    assert read.refused.wait(WAIT_S)  # tried again
    assert not queued.over
    read.outcome = "done"  # completing changes nothing: it was given up
    read.abortable.set()
    wait_over(queued)
    assert read.released.is_set()
    assert reads.cancel(queued) is True  # over: cancelling again is fine
    reads.close()
    assert len(agent.posted) == 1 and not outcome.said


@pytest.mark.parametrize("ended", ["done", "failed"])
def test_a_read_that_ended_is_said_to_only_once_nixl_let_it_go(agent_queue, ended):
    """A READ that failed may have parts still moving, and even a done one is over only
    once released: `then` runs, and the next step is posted, only after that."""
    agent, reads = agent_queue
    agent.abortable = False
    outcome = Outcomes()
    queued = reads.submit(REMOTE, steps(2), outcome)
    read = agent.wait_posted(1)
    read.outcome = ended
    assert read.refused.wait(WAIT_S)
    read.refused.clear()
    assert read.refused.wait(WAIT_S)
    assert not outcome.said and len(agent.posted) == 1 and not queued.over
    agent.abortable = True
    read.abortable.set()
    if ended == "done":
        agent.wait_posted(2).outcome = "done"
    assert outcome.event.wait(WAIT_S)
    assert outcome.said == [ended == "done"] and queued.over
