"""The demo's DeploymentHandles: one whose router can route, never one that would hold its
requests forever (`ready_handle`), and the request router Serve made behind it.

Both read Serve's internals (Ray 2.60's `AsyncioRouter`), so that a change of them in a
later Ray is a wait the demo cannot see, not an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _asyncio_router(handle: Any) -> Any:
    try:
        return handle._router._asyncio_router
    except AttributeError:
        return None


def request_router(handle: Any) -> Any:
    """The request router Serve made behind `handle`, in this process (None where Serve's
    internals differ)."""
    router = _asyncio_router(handle)
    return getattr(router, "request_router", None)


def routes(handle: Any) -> bool:
    """Whether `handle`'s router can route: it has the deployment's replicas and has made its
    request router from the deployment's config. Without either, a request waits for the
    next update of what is missing (Serve's `AsyncioRouter`: `_request_router_initialized`).
    Where Serve's internals differ, the replicas alone."""
    if not handle.running_replicas_populated():
        return False
    # the attribute, not the `request_router` property, which would make the router here,
    # outside its event loop's thread; absent (internals differ): the replicas decide
    return getattr(_asyncio_router(handle), "_request_router", True) is not None


def ready_handle(make_handle: Callable[[], Any], wait_s: float, timeout_s: float, poll_s: float = 0.05) -> Any:
    """A handle from `make_handle` whose router can route (`routes`), waiting up to `wait_s`
    for each and replacing one that still cannot; TimeoutError past `timeout_s`.

    In Ray 2.60 a new handle's router learns the deployment's replicas and its config from
    a long poll of its own, which the process's shared long poll stops as soon as it
    delivers the router any update of the deployment (Serve's router.py,
    `SharedRouterLongPollClient`); a stopped poll drops what it then receives. The shared
    poll delivers an update every time a replica's routing stats change (each
    `request_routing_stats_period_s`), so one can stop a new router's poll before its answer
    is in: the router then lacks the replicas or the config until they next change, and
    every request sent through it waits as long (the config: for good, within one arm). A
    handle made again gets both from a poll of its own.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        handle = make_handle()
        handle._init()  # its router starts following the deployment now
        given_up = min(time.monotonic() + wait_s, deadline)
        while not routes(handle):
            if time.monotonic() > given_up:
                break
            time.sleep(poll_s)
        else:
            return handle
        handle.shutdown()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no handle's router learned the deployment's replicas and config in {timeout_s:.0f} s")
