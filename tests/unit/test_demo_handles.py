"""The demo's handle for an arm: one whose router can route, never one that would hold its
requests forever (`distkv.demo.handles.ready_handle`)."""

from types import SimpleNamespace

import pytest

from distkv.demo.handles import ready_handle, request_router, routes

NEVER = None


class FakeHandle:
    """A DeploymentHandle whose router learns the replicas after `replica_polls` checks and
    makes its request router (the config came) after `config_polls`; NEVER: not in this
    handle's life. Its router is laid out as Serve 2.60's (`_router._asyncio_router`)."""

    def __init__(self, replica_polls: int | None, config_polls: int | None = 0) -> None:
        self.replica_polls, self.config_polls = replica_polls, config_polls
        self.initialized = self.shut_down = False
        self._router = SimpleNamespace(_asyncio_router=SimpleNamespace(_request_router=None, request_router=None))

    def _init(self) -> None:
        self.initialized = True

    def running_replicas_populated(self) -> bool:
        assert self.initialized, "asked before its router was made"
        if self.config_polls is not NEVER:
            self.config_polls -= 1
            if self.config_polls < 0:
                made = object()
                self._router._asyncio_router._request_router = self._router._asyncio_router.request_router = made
        if self.replica_polls is NEVER:
            return False
        self.replica_polls -= 1
        return self.replica_polls < 0

    def shutdown(self) -> None:
        self.shut_down = True


def handles(*polls: tuple[int | None, int | None]):
    made = []

    def make() -> FakeHandle:
        made.append(FakeHandle(*polls[len(made)]))
        return made[-1]

    return make, made


def test_a_handle_whose_router_learns_the_replicas_and_config_is_kept():
    make, made = handles((3, 5))
    handle = ready_handle(make, wait_s=5.0, timeout_s=10.0, poll_s=0.001)
    assert handle is made[0] and not handle.shut_down
    assert request_router(handle) is handle._router._asyncio_router._request_router is not None


def test_a_handle_whose_router_never_learns_the_replicas_is_replaced_and_shut_down():
    make, made = handles((NEVER, 0), (0, 0))
    handle = ready_handle(make, wait_s=0.05, timeout_s=10.0, poll_s=0.001)
    assert handle is made[1] and not handle.shut_down
    assert made[0].shut_down  # its router stops following the deployment


def test_a_handle_with_the_replicas_but_never_the_config_is_replaced():
    # the demo's hang: every request waits for a request router that is never made
    make, made = handles((0, NEVER), (0, 2))
    handle = ready_handle(make, wait_s=0.05, timeout_s=10.0, poll_s=0.001)
    assert handle is made[1] and routes(handle)
    assert made[0].shut_down and not routes(made[0])


def test_where_serves_internals_differ_the_replicas_alone_decide():
    handle = FakeHandle(0, NEVER)
    del handle._router
    handle._init()
    assert routes(handle) and request_router(handle) is None


def test_no_handle_ready_is_a_timeout_with_every_handle_shut_down():
    make, made = handles(*[(0, NEVER)] * 1000)
    with pytest.raises(TimeoutError, match="learned the deployment's replicas and config"):
        ready_handle(make, wait_s=0.02, timeout_s=0.1, poll_s=0.001)
    assert len(made) >= 2 and all(h.shut_down for h in made)
