"""How the demo's client sends its trace: a closed loop or an open one.

- `ClosedLoop`: a fixed number of requests in flight, the next sent as one is answered (the
  demo's default). The machine stays saturated, so an arm's response time follows the work
  it does per request.
- `OpenLoop`: requests arrive at Poisson times of a given rate, whatever is in flight, as
  vLLM's `benchmark_serving --request-rate` sends them. Below saturation, an arm's response
  time is its queues and its compute, and where requests land matters more.

Either way a conversation's turn goes out once its previous turn is answered. Each answer
is handed to `on_result(index in the trace, result, seconds from sending it to its answer,
time.perf_counter() at the answer)`, in the order answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from distkv.demo.workload import Request

Call = Callable[[Request], Awaitable[dict[str, Any]]]
OnResult = Callable[[int, dict[str, Any], float, float], None]


async def _answered(call: Call, request: Request) -> tuple[dict[str, Any], float, float]:
    sent = time.perf_counter()
    result = await call(request)
    answered = time.perf_counter()
    return result, answered - sent, answered


class ClosedLoop:
    """`in_flight` requests at a time, in trace order; a turn whose previous turn is not
    answered yet holds back the requests after it."""

    def __init__(self, in_flight: int, timeout_s: float) -> None:
        if in_flight < 1:
            raise ValueError(f"{in_flight} requests in flight: must be at least 1")
        self.in_flight = in_flight
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return f"a closed loop of {self.in_flight} requests in flight"

    async def send(self, call: Call, trace: Sequence[Request], on_result: OnResult) -> None:
        pending: dict[asyncio.Task, int] = {}
        answered = [False] * len(trace)
        sent = 0
        while sent < len(trace) or pending:
            while sent < len(trace) and len(pending) < self.in_flight:
                after = trace[sent].after
                if after is not None and not answered[after]:
                    break
                pending[asyncio.ensure_future(_answered(call, trace[sent]))] = sent
                sent += 1
            finished, _ = await asyncio.wait(pending, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not finished:
                raise TimeoutError(f"no request answered in {self.timeout_s:.0f} s")
            for task in finished:
                i = pending.pop(task)
                on_result(i, *task.result())
                answered[i] = True


class OpenLoop:
    """Requests arriving at `rate` a second, the gaps between them drawn from an exponential
    distribution seeded by `seed` (the same arrivals for every arm); a turn is sent at its
    arrival or once its previous turn is answered, whichever is later."""

    def __init__(self, rate: float, seed: int, timeout_s: float) -> None:
        if not rate > 0 or not np.isfinite(rate):
            raise ValueError(f"a rate of {rate} requests a second: must be a positive number")
        self.rate = rate
        self.seed = seed
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return f"an open loop of {self.rate:g} requests a second (Poisson arrivals)"

    def arrivals(self, n: int) -> np.ndarray:
        """Seconds from the start at which each of `n` requests arrives."""
        return np.cumsum(np.random.default_rng(self.seed).exponential(1 / self.rate, n))

    async def send(self, call: Call, trace: Sequence[Request], on_result: OnResult) -> None:
        answered = [asyncio.Event() for _ in trace]
        start = time.perf_counter()

        async def arrive(i: int, at: float) -> None:
            await asyncio.sleep(max(start + at - time.perf_counter(), 0.0))
            after = trace[i].after
            if after is not None:
                await answered[after].wait()
            outcome = await asyncio.wait_for(_answered(call, trace[i]), self.timeout_s)
            on_result(i, *outcome)
            answered[i].set()

        tasks = [asyncio.ensure_future(arrive(i, at)) for i, at in enumerate(self.arrivals(len(trace)))]
        try:
            await asyncio.gather(*tasks)
        except asyncio.TimeoutError:
            raise TimeoutError(f"a request was not answered in {self.timeout_s:.0f} s") from None
        finally:
            for task in tasks:
                task.cancel()
