"""How the demo's client sends its trace: a closed loop keeps a fixed number of requests in
flight, an open loop sends them at their arrival times whatever is in flight; both hold a
conversation's turn until its previous turn is answered."""

import asyncio

import numpy as np
import pytest

from distkv.demo.arrivals import ClosedLoop, OpenLoop
from distkv.demo.workload import Request

SAFETY_S = 30.0  # only a hang hits it


def one_off(i: int) -> Request:
    return Request(np.array([i]), 0, None, 0, None)


def turn(i: int, after: int) -> Request:
    return Request(np.array([i]), 0, 0, 1, after)


class Replicas:
    """A fake deployment: each request is answered once the test releases it."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.release: dict[int, asyncio.Event] = {}
        self.arrived = asyncio.Event()  # set whenever a request is sent

    async def call(self, request: Request) -> dict:
        i = int(request.tokens[0])
        self.sent.append(i)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.arrived.set()
        await self.release.setdefault(i, asyncio.Event()).wait()
        self.in_flight -= 1
        return {"request": i}

    def answer(self, i: int) -> None:
        self.release.setdefault(i, asyncio.Event()).set()

    async def until_sent(self, count: int) -> None:
        while len(self.sent) < count:
            self.arrived.clear()
            await self.arrived.wait()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_S))


def test_a_closed_loop_keeps_its_window_and_holds_a_turn_until_its_previous_answer():
    trace = [one_off(0), one_off(1), turn(2, after=0), one_off(3)]
    answers = []

    async def scenario():
        replicas = Replicas()
        sending = asyncio.ensure_future(
            ClosedLoop(2, SAFETY_S).send(replicas.call, trace, lambda i, r, ttft, at: answers.append(i))
        )
        await replicas.until_sent(2)
        replicas.answer(1)  # a slot frees, but the next is a turn of 0, still in flight
        while answers != [1]:
            await asyncio.sleep(0)
        assert replicas.sent == [0, 1]
        replicas.answer(0)
        await replicas.until_sent(4)
        assert replicas.sent == [0, 1, 2, 3]
        replicas.answer(2)
        replicas.answer(3)
        await sending
        return replicas

    replicas = run(scenario())
    assert sorted(answers) == [0, 1, 2, 3] and answers[:2] == [1, 0]
    assert replicas.most_in_flight == 2


def test_an_open_loop_sends_at_arrival_whatever_is_in_flight_and_holds_turns():
    trace = [one_off(0), one_off(1), turn(2, after=0), one_off(3), one_off(4)]
    results = []

    async def scenario():
        replicas = Replicas()
        # arrivals all but at once: every one-off request goes out while none is answered
        sending = asyncio.ensure_future(
            OpenLoop(1e9, seed=0, timeout_s=SAFETY_S).send(
                replicas.call, trace, lambda i, r, ttft, at: results.append((i, r, ttft, at))
            )
        )
        await replicas.until_sent(4)
        assert sorted(replicas.sent) == [0, 1, 3, 4]  # not the turn: its previous one is in flight
        replicas.answer(0)
        await replicas.until_sent(5)
        for i in (1, 2, 3, 4):
            replicas.answer(i)
        await sending
        return replicas

    replicas = run(scenario())
    assert replicas.most_in_flight == 4
    assert sorted(i for i, *_ in results) == [0, 1, 2, 3, 4]
    assert all(r == {"request": i} and ttft >= 0 for i, r, ttft, _ in results)
    answered_at = dict((i, at) for i, _, _, at in results)
    assert answered_at[0] <= answered_at[2]


def test_open_loop_arrivals_are_seeded_poisson_times_at_the_rate():
    loop = OpenLoop(rate=50.0, seed=3, timeout_s=SAFETY_S)
    times = loop.arrivals(20_000)
    assert np.array_equal(times, OpenLoop(50.0, 3, SAFETY_S).arrivals(20_000))
    assert not np.array_equal(times, OpenLoop(50.0, 4, SAFETY_S).arrivals(20_000))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: the mean's spread


@pytest.mark.parametrize("sending", [ClosedLoop(2, timeout_s=0.05), OpenLoop(1e9, seed=0, timeout_s=0.05)])
def test_a_request_never_answered_is_a_timeout_that_says_so(sending):
    async def never(request):
        await asyncio.Event().wait()

    with pytest.raises(TimeoutError, match="answered in 0 s"):
        run(sending.send(never, [one_off(0)], lambda *a: None))


def test_bad_loads_are_refused():
    with pytest.raises(ValueError, match="0 requests in flight: must be at least 1"):
        ClosedLoop(0, SAFETY_S)
    for rate in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="requests a second: must be a positive number"):
            OpenLoop(rate, 0, SAFETY_S)
