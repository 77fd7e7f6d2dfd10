"""Where a stuck demo is stuck: every thread's stack printed when a step runs too long.

The demo's rare hangs have never come under a debugger; what a hang prints itself is what
there is to go on (docs/benchmarks.md, session 46).
"""

from __future__ import annotations

import contextlib
import faulthandler
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
