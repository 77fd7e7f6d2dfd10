"""Where a stuck demo is stuck: every thread's stack printed when a step runs too long, or
when a replica's event loop stops running its callbacks.

The demo's rare hangs have never come under a debugger; what a hang prints itself is what
there is to go on (docs/benchmarks.md, sessions 46 and 47).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import sys
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def stacks_printed_if_stuck(seconds: float) -> Iterator[None]:
    """Print every thread's stack to stderr (a Ray worker's goes to the driver's output) if
    the block runs past `seconds`. One such block at a time per process: faulthandler keeps
    one timer."""
    faulthandler.dump_traceback_later(seconds)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class LoopWatch:
    """Prints every thread's stack to stderr when `loop` has run none of its callbacks for
    `seconds`: a blocked event loop starts no request, so no step is running to time out.
    Once per stall; again after the loop has run. Asks the loop every `period_s`, from a
    thread of its own, until `close`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, period_s: float = 1.0) -> None:
        self._loop, self._seconds, self._period_s = loop, seconds, period_s
        self._ran = time.monotonic()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="distkv-demo-loop-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _ran_now(self) -> None:
        self._ran = time.monotonic()

    def _watch(self) -> None:
        printed = False
        while not self._closed.wait(self._period_s):
            try:
                self._loop.call_soon_threadsafe(self._ran_now)
            except RuntimeError:  # the loop was closed
                return
            stalled_s = time.monotonic() - self._ran
            if stalled_s > self._seconds and not printed:
                print(f"distkv demo: this process's event loop has run nothing for {stalled_s:.0f} s",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
            printed = stalled_s > self._seconds
