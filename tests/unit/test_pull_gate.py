"""The pull gate: a replica pulls a prefix held elsewhere only when that beats recomputing it.

The rule alone (PullGate, fed measurements by hand), then through the cluster manager: two
replicas over the in-memory Directory of tests/unit/cluster_fakes.py, the second one on
another node, whose gate has measured a fast prefill and a slow cross-node pull.
"""

import pytest

from distkv.routing.pull_gate import EXPLORE_EVERY, LinearCost, PullGate
from test_cluster import prompt, replicas  # noqa: F401 (a fixture)

MS = 1e-3


def measured_gate() -> PullGate:
    """Prefill: 1 ms a block; a pull across nodes: 5 ms plus 0.2 ms a block; within the
    node: 0.1 ms plus 0.01 ms a block; a step: 2 ms."""
    gate = PullGate()
    for blocks in (4, 8, 32, 16):
        gate.observe_prefill(blocks, 0.5 * MS + blocks * MS)
    for blocks in (1, 16, 4, 32):
        gate.observe_pull("cross_node", blocks, 5 * MS + 0.2 * MS * blocks)
        gate.observe_pull("same_node", blocks, 0.1 * MS + 0.01 * MS * blocks)
    for _ in range(5):
        gate.observe_step(2 * MS)
    return gate


def test_a_line_is_recovered_from_what_was_observed():
    fit = LinearCost()
    for x in (1, 5, 9, 30):
        fit.observe(x, 0.004 + 0.0002 * x)
    intercept, slope = fit.line()
    assert intercept == pytest.approx(0.004) and slope == pytest.approx(0.0002)
    assert fit.predict(100) == pytest.approx(0.024)


def test_a_long_prefix_is_pulled():
    gate = measured_gate()
    # 32 blocks across nodes: 11.4 ms, 6 steps of 2 ms = 12 ms, against 32 ms of prefill
    assert gate.pull_cost_s("cross_node", 32) == pytest.approx(12 * MS)
    assert gate.recompute_cost_s(32) == pytest.approx(32 * MS)
    assert gate.should_pull("cross_node", 32)
    assert gate.allowed["cross_node"] == 32 and gate.skipped["cross_node"] == 0


def test_a_one_block_prefix_from_another_node_is_recomputed_when_its_promotion_costs_more():
    gate = measured_gate()
    # 5.2 ms of promotion (3 steps: 6 ms) against 1 ms of prefill
    assert not gate.should_pull("cross_node", 1)
    assert gate.skipped["cross_node"] == 1
    # within the node the copy is nearly free, but the RETRY costs the request a step (2 ms)
    assert gate.pull_cost_s("same_node", 1) == pytest.approx(2 * MS)
    assert not gate.should_pull("same_node", 1)
    assert gate.should_pull("same_node", 3)


def test_the_rates_it_uses_follow_what_was_measured():
    gate = measured_gate()
    assert not gate.should_pull("cross_node", 4)  # 5.8 ms -> 6 ms against 4 ms
    # the path got faster (NIXL instead of the object store): 0.3 ms plus 0.05 ms a block
    for blocks in (1, 4, 16, 32) * 20:
        gate.observe_pull("cross_node", blocks, 0.3 * MS + 0.05 * MS * blocks)
    intercept, slope = gate.estimates()["pull_s"]["cross_node"]
    assert intercept == pytest.approx(0.3 * MS, rel=0.05) and slope == pytest.approx(0.05 * MS, rel=0.05)
    assert gate.should_pull("cross_node", 4)  # 0.5 ms -> one step, 2 ms, against 4 ms
    # the prefill got faster: pulling 4 blocks no longer pays
    for blocks in (4, 8, 32, 16) * 20:
        gate.observe_prefill(blocks, 0.5 * MS + 0.2 * MS * blocks)
    assert not gate.should_pull("cross_node", 4)


def test_what_was_never_measured_is_pulled_and_a_refused_path_is_measured_again():
    gate = PullGate()
    assert gate.should_pull("cross_node", 1)  # nothing measured: pull, and measure
    gate = measured_gate()
    decisions = [gate.should_pull("cross_node", 1) for _ in range(2 * EXPLORE_EVERY)]
    assert decisions.count(True) == 2 and decisions[EXPLORE_EVERY - 1] and decisions[-1]


def test_an_idle_gap_between_steps_is_not_a_step():
    gate = measured_gate()
    gate.observe_step(30.0)  # the engine sat idle for half a minute
    assert gate.step_s < 3 * MS
    with pytest.raises(ValueError, match="path 'sideways'"):
        gate.should_pull("sideways", 1)


def test_a_step_counts_only_while_a_request_is_in_flight():
    """An engine that serves one request at a time steps a few times per request, then sits
    idle until the next: intervals across the idle time are not steps, however many."""
    from types import SimpleNamespace

    from distkv.abstract import ReqContext
    from distkv.observability.errors import ErrorLog
    from distkv.replica.pulls import RequestPulls

    link = SimpleNamespace(info=SimpleNamespace(replica_id="r", node_id="n"), namespace="ns")
    pulls = RequestPulls(link, PullGate(), ErrorLog())
    now = 0.0
    for i in range(50):
        pulls.request_started(ReqContext(f"req-{i}"))
        for _ in range(3):  # three steps of 5 ms
            pulls.step_ended(now)
            now += 5 * MS
        pulls.request_finished()
        now += 1.0  # idle for a second
    assert pulls.gate.step_s == pytest.approx(5 * MS)
    # two requests overlapping: the engine is never idle, every interval is a step
    pulls.request_started(ReqContext("a"))
    pulls.step_ended(now)
    pulls.request_started(ReqContext("b"))
    pulls.request_finished()
    pulls.step_ended(now + 8 * MS)
    assert pulls.gate.step_s > 5 * MS


def short_prefix(tokens, blocks):
    """A prompt sharing its first `blocks` blocks with `tokens`, then of its own."""
    other = prompt(99, blocks=8)
    return list(tokens[: blocks * 16]) + list(other)


def test_the_manager_recomputes_a_short_prefix_across_nodes_and_pulls_a_long_one(replicas):
    from cluster_fakes import FakeDirectory

    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2")
    tokens = prompt(1, blocks=32)
    assert a.serve(tokens).stored_blocks == 32
    gate = b.manager.pulls.gate
    for blocks in (4, 8, 32, 16):  # B's prefill: 1 ms a block
        gate.observe_prefill(blocks, 0.5 * MS + blocks * MS)
    for blocks in (1, 16, 4, 32):  # a pull from node-1: 5 ms plus 0.2 ms a block
        gate.observe_pull("cross_node", blocks, 5 * MS + 0.2 * MS * blocks)

    one = b.serve(short_prefix(tokens, 1))
    assert (one.hit_blocks, one.retries) == (0, 0)  # a miss at once, not a wait
    assert b.manager.promoter.started["cross_node"] == 0
    assert gate.skipped["cross_node"] == 1

    whole = b.serve(tokens)  # its first block B computed and stored above: 31 pulled
    assert whole.hit_blocks == 32 and whole.mismatches == 0
    assert b.manager.promoter.succeeded["cross_node"] == 31
    assert gate.allowed["cross_node"] == 31
    assert b.manager.stats().routing.pull_skipped == {"same_node": 0, "cross_node": 1}


def test_a_pull_whose_transfer_stood_in_for_its_path_teaches_the_gate_nothing(replicas, monkeypatch):
    """The object store carries a holder's first transfers while NIXL connects to it: what
    they take is no measure of the path the next pulls take."""
    from cluster_fakes import FakeDirectory
    from distkv.transfer.transport import ObjectStoreTransport

    start = ObjectStoreTransport.start
    standing_in = [True]

    def start_standing_in(self, *args, **kw):
        transfer = start(self, *args, **kw)
        transfer.stands_in = standing_in[0]
        return transfer

    monkeypatch.setattr(ObjectStoreTransport, "start", start_standing_in)
    directory = FakeDirectory()
    a = replicas(directory, "node-1")
    b = replicas(directory, "node-2")
    first, second = prompt(1, blocks=8), prompt(2, blocks=8)
    a.serve(first)
    a.serve(second)
    gate = b.manager.pulls.gate
    assert b.serve(first).hit_blocks == 8
    assert gate.pull["cross_node"].count == 0
    standing_in[0] = False
    assert b.serve(second).hit_blocks == 8
    assert gate.pull["cross_node"].count == 1
