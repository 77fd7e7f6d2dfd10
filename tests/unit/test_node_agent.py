"""AgentFetch, the Promoter's reads through NodeAgents, without Ray: the handles it keeps."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

import ray_actors.node_agent as node_agent
from distkv.directory.records import ReplicaInfo
from distkv.names import agent_name
from ray_actors.node_agent import AgentFetch


def holder(replica_id: str, node_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, node_id, "distkv-ns-" + replica_id, 4, 1, 4096)


class FakeAgentHandle:
    """Stands in for a NodeAgent's actor handle: `read_rows.remote(...).future()`."""

    def __init__(self) -> None:
        self.read_rows = self
        self.calls = 0

    def remote(self, *args, **kwargs) -> "FakeAgentHandle":
        self.calls += 1
        return self

    def future(self) -> Future:
        future: Future = Future()
        future.set_result((None, []))
        return future


@pytest.fixture
def looked_up(monkeypatch):
    """The NodeAgents AgentFetch looks up in Ray, by actor name, in order."""
    names: list[str] = []

    def get_actor(name, namespace=None):
        names.append(name)
        return FakeAgentHandle()

    monkeypatch.setattr(node_agent.ray, "get_actor", get_actor)
    return names


def test_agent_handles_are_kept_only_for_nodes_where_the_directory_lists_a_holder(looked_up):
    fetch = AgentFetch("ns")
    a, b1, b2 = holder("a", "node-a"), holder("b1", "node-b"), holder("b2", "node-b")
    for h in (a, b1, b2, a):
        fetch(h, [0], [b"k" * 36], [1])
    assert looked_up == [agent_name("node-a"), agent_name("node-b")]  # once per node
    listed = {h.replica_id: h for h in (a, b1, b2)}
    del listed["b1"]
    fetch.forget_gone(listed.get)
    fetch(b2, [0], [b"k" * 36], [1])
    assert len(looked_up) == 2  # b2 still holds on node-b: its handle is kept
    del listed["b2"]
    fetch.forget_gone(listed.get)
    assert len(fetch._agents) == 1  # node-b's went with its last holder
    fetch(holder("b3", "node-b"), [0], [b"k" * 36], [1])
    assert looked_up[2:] == [agent_name("node-b")]  # a holder there again: looked up afresh
    fetch.forget_gone({}.get)  # every holder left (their nodes died, say)
    assert len(fetch._agents) == 0
