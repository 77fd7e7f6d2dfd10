"""The demo's handle for an arm: one whose router knows the deployment's replicas, never one
that would hold its requests forever (`distkv.demo.runner.populated_handle`)."""

import pytest

from distkv.demo.runner import populated_handle


class FakeHandle:
    """A DeploymentHandle whose router learns the replicas after `polls` checks, or never."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.initialized = self.shut_down = False

    def _init(self) -> None:
        self.initialized = True

    def running_replicas_populated(self) -> bool:
        assert self.initialized, "asked before its router was made"
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def shutdown(self) -> None:
        self.shut_down = True


def handles(*polls: int | None):
    made = []

    def make() -> FakeHandle:
        made.append(FakeHandle(polls[len(made)]))
        return made[-1]

    return make, made


def test_a_handle_whose_router_learns_the_replicas_is_kept():
    make, made = handles(3)
    assert populated_handle(make, wait_s=5.0, timeout_s=10.0, poll_s=0.001) is made[0]
    assert not made[0].shut_down


def test_a_handle_whose_router_never_learns_them_is_replaced_and_shut_down():
    make, made = handles(None, 0)
    handle = populated_handle(make, wait_s=0.05, timeout_s=10.0, poll_s=0.001)
    assert handle is made[1] and not handle.shut_down
    assert made[0].shut_down  # its router stops following the deployment


def test_no_handle_learning_them_is_a_timeout_with_every_handle_shut_down():
    make, made = handles(*[None] * 1000)
    with pytest.raises(TimeoutError, match="learned the deployment's replicas"):
        populated_handle(make, wait_s=0.02, timeout_s=0.1, poll_s=0.001)
    assert len(made) >= 2 and all(h.shut_down for h in made)
