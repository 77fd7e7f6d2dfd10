"""The routing rule and the router's decisions, without Ray: fake candidates, fake holders,
fake queue lengths, and a Directory that is a coroutine the test controls."""

import asyncio
import collections
import dataclasses
import random

import pytest

from distkv.directory import Holder
from distkv.replica.harness import block_keys
from distkv.routing.answer import from_directory
from distkv.routing.keys import SeedKeys
from distkv.routing.router import RouterCore, routing_stats
from distkv.routing.score import PRIOR, Candidate, Costs, ExpectedTTFT, HeldPrefix
from distkv.routing.work_ahead import FORGET_S, WorkAhead

BLOCK_TOKENS = 16
TOKENS = list(range(32 * BLOCK_TOKENS))  # 32 blocks
KEYS = block_keys(TOKENS, BLOCK_TOKENS)
# a prefill of 3 ms a block; a pull within the node 3 ms + 0.1 ms a block, across nodes
# 8 ms + 0.5 ms a block; a step 2.5 ms; a request keeps a replica 40 ms
COSTS = Costs(0.003, {"same_node": (0.003, 0.0001), "cross_node": (0.008, 0.0005)}, 0.0025)
SERVICE_S = 0.040


def held_by(*replicas: tuple[str, str], blocks: int = 32):
    """The Directory's answer: each (replica, node) holds the prompt's first `blocks` blocks."""
    holders = [[(r, node, i, 1) for r, node in replicas] if i < blocks else [] for i in range(len(KEYS))]
    return from_directory("ns", KEYS, holders)


def candidates(**queues: int) -> list[Candidate]:
    """Replicas a and b on node-1, c and d on node-2, with the queue lengths given (else 0),
    sent by other routers: each a service time ahead."""
    nodes = {"a": "node-1", "b": "node-1", "c": "node-2", "d": "node-2"}
    work = WorkAhead(0.0, SERVICE_S)
    return [Candidate(name, name, node, work.ahead(name, queues.get(name, 0), 0.0), COSTS) for name, node in nodes.items()]


def ranked(answer, **queues) -> list[str]:
    score = ExpectedTTFT(random.Random(0))
    return [c.key for c, _ in score.rank(candidates(**queues), HeldPrefix(answer, len(KEYS)))]


def test_an_idle_holder_gets_the_request():
    assert ranked(held_by(("a", "node-1")))[0] == "a"
    # a shorter prefix held elsewhere does not beat a longer one held by the idle candidate
    assert ranked(held_by(("c", "node-2"), blocks=8), c=0)[0] == "c"


def test_a_hot_prefix_spreads_once_the_holders_queue_costs_more_than_a_pull():
    answer = held_by(("a", "node-1"))
    # one request ahead at the holder (40 ms) against a pull within its node (3 steps: 7.5 ms)
    order = ranked(answer, a=1)
    assert order[0] == "b"  # a's neighbour pulls it through shared memory
    assert order.index("c") > order.index("b")  # across nodes costs more
    assert ranked(answer, a=1, b=3)[0] in ("c", "d")  # the neighbour is busier still: across nodes


def test_a_pull_that_costs_more_than_the_prefill_is_scored_as_the_prefill():
    slow = Costs(0.003, {"same_node": (0.5, 0.0), "cross_node": (0.5, 0.0)}, 0.0025)
    c = Candidate("b", "b", "node-1", 0, slow)
    held = HeldPrefix(held_by(("a", "node-1")), len(KEYS))
    [(_, compute)] = ExpectedTTFT().rank([c], held)
    assert c.ahead_s + compute == pytest.approx(32 * 0.003)


def test_replicas_measured_apart_are_priced_alike_so_that_neither_is_starved():
    """A deployment's replicas run one model on like hardware: the difference between their
    measured prefill costs is noise. Followed, it would send the one measured lower every
    request its work ahead allows, and the other none that could correct its measurement."""
    low, high = dataclasses.replace(COSTS, prefill_s_per_block=0.004), dataclasses.replace(COSTS, prefill_s_per_block=0.006)
    cands = [Candidate("a", "a", "node-1", 0.0, low), Candidate("b", "b", "node-1", 0.0, high)]
    held = HeldPrefix(held_by(("a", "node-1"), ("b", "node-1"), blocks=28), len(KEYS))  # 4 blocks held by neither
    score = ExpectedTTFT(random.Random(0))
    assert [compute for _, compute in score.rank(cands, held)] == pytest.approx([4 * 0.005] * 2)  # the median
    firsts = collections.Counter(score.rank(cands, held)[0][0].key for _ in range(200))
    assert firsts["a"] > 50 and firsts["b"] > 50


def test_with_no_answer_the_least_busy_replica_gets_the_request():
    assert ranked(from_directory("ns", KEYS, [[]] * len(KEYS)), a=2, b=1, c=3, d=0)[0] == "d"


def test_the_work_ahead_counts_what_each_request_sent_there_will_compute():
    work = WorkAhead(overhead_s=0.010, service_s=SERVICE_S)
    work.sent("a", "hit", 0.005, now=0.0)  # its prefix held: a few ms of prefill
    work.sent("b", "miss", 0.300, now=0.0)  # recomputed whole
    # one request in flight at each, yet a's frees much sooner
    assert work.ahead("a", 1, now=0.0) == pytest.approx(0.015)
    assert work.ahead("b", 1, now=0.0) == pytest.approx(0.310)
    # what the oldest has done since it started is done: never below nothing left of it
    assert work.ahead("b", 1, now=0.1) == pytest.approx(0.210)
    assert work.ahead("a", 1, now=5.0) == 0.0
    # requests other routers sent (Serve counts them, this router did not send them)
    assert work.ahead("a", 3, now=0.0) == pytest.approx(0.015 + 2 * SERVICE_S)
    assert work.ahead("c", 2, now=0.0) == pytest.approx(2 * SERVICE_S)


def test_a_request_waits_at_the_replica_whose_work_ahead_is_least_not_its_shortest_queue():
    work = WorkAhead(overhead_s=0.010, service_s=SERVICE_S)
    work.sent("a", "r1", 0.300, now=0.0)
    for i in range(2):
        work.sent("b", f"r{i + 2}", 0.005, now=0.0)
    score = ExpectedTTFT(random.Random(0))
    cands = [Candidate(r, r, "node-1", work.ahead(r, n, 0.0), COSTS) for r, n in (("a", 1), ("b", 2))]
    held = HeldPrefix(from_directory("ns", KEYS, [[]] * len(KEYS)), len(KEYS))
    assert [c.key for c, _ in score.rank(cands, held)] == ["b", "a"]


def test_a_completion_leaves_the_work_ahead_and_teaches_the_overhead():
    work = WorkAhead(overhead_s=0.0, service_s=SERVICE_S)
    for i in range(60):  # one after another: each could start when the previous completed
        work.sent("a", i, 0.050, now=0.2 * i)
        work.completed("a", i, now=0.2 * i + 0.150)
    assert work.overhead_s == pytest.approx(0.100, rel=0.01)
    assert work.service_s == pytest.approx(0.150, rel=0.01)
    assert work.ahead("a", 0, now=100.0) == 0.0
    # queued behind another: its service starts at that one's completion, not when sent
    work.sent("a", "first", 0.050, now=100.0)
    work.sent("a", "second", 0.050, now=100.0)
    work.completed("a", "first", now=100.150)
    work.completed("a", "second", now=100.300)
    assert work.service_s == pytest.approx(0.150, rel=0.01)
    work.completed("a", "never sent", now=101.0)  # not this router's: nothing changes
    assert work.service_s == pytest.approx(0.150, rel=0.01)


def test_requests_never_reported_completed_and_replicas_gone_are_forgotten():
    work = WorkAhead(overhead_s=0.0, service_s=SERVICE_S)
    work.sent("a", "lost", 0.3, now=0.0)
    work.sent("b", "r", 0.3, now=0.0)
    assert work.ahead("a", 0, now=FORGET_S + 1) == 0.0
    work.forget({"a"})
    assert work.ahead("b", 0, now=0.0) == 0.0
    with pytest.raises(ValueError, match="service_s"):
        WorkAhead(0.0, float("nan"))


class FakeManager:
    """What `routing_stats` reads of a replica's cluster manager."""

    def __init__(self, replica_id, node_id):
        from types import SimpleNamespace

        from distkv.routing.pull_gate import PullGate

        self.link = SimpleNamespace(
            info=SimpleNamespace(replica_id=replica_id, node_id=node_id), namespace="ns", num_shards=2
        )
        self.pulls = SimpleNamespace(gate=PullGate())
        self.pulls.gate.observe_prefill(10, 0.02)


def stats(replica_id, node_id):
    return routing_stats(FakeManager(replica_id, node_id), SeedKeys(BLOCK_TOKENS))


class Directory:
    """A Directory shard the test answers: every query waits until `answer` is called."""

    def __init__(self):
        self.asked = []
        self.answered = asyncio.Event()
        self.holders = None

    async def ask(self, namespace, num_shards, shard, keys):
        self.asked.append((namespace, num_shards, shard, list(keys)))
        await self.answered.wait()
        if isinstance(self.holders, Exception):
            raise self.holders
        return self.holders

    def answer(self, holders):
        self.holders = holders
        self.answered.set()


def test_a_replica_says_who_it_is_and_what_its_gate_measured():
    core = RouterCore(Directory().ask)
    identity = core.identity(stats("a", "node-1"))
    assert (identity.replica_id, identity.node_id, identity.namespace, identity.directory_shards) == (
        "a", "node-1", "ns", 2,
    )
    assert identity.keys.keys(TOKENS) == KEYS
    assert identity.costs.prefill_s_per_block == pytest.approx(0.002)  # measured, not the prior
    assert identity.costs.pull_s == PRIOR.pull_s  # not measured yet: the prior
    assert core.identity({}) is None and core.identity({"distkv": {"replica_id": "x"}}) is None


def test_a_replicas_stats_are_read_once_until_serve_sends_new_ones():
    core = RouterCore(Directory().ask)
    old = stats("a", "node-1")
    assert core.identity(old) is core.identity(old)
    new = stats("a", "node-2")  # Serve's next routing stats for the replica: a new object
    assert core.identity(new).node_id == "node-2" and core.identity(old).node_id == "node-1"


def test_the_seed_keys_refuse_a_token_that_is_no_int64():
    with pytest.raises(ValueError, match="token ids"):
        SeedKeys(BLOCK_TOKENS).keys([1.5] * BLOCK_TOKENS)
    with pytest.raises(ValueError, match="token ids"):
        SeedKeys(BLOCK_TOKENS).keys([1 << 63] * BLOCK_TOKENS)


def test_candidates_of_two_namespaces_are_asked_about_in_the_most_common():
    def in_namespace(replica_id, namespace):
        entry = dict(stats(replica_id, "node-1")["distkv"], namespace=namespace)
        return core.identity({"distkv": entry})

    async def run():
        directory.answer([[] for _ in KEYS])
        return await core.answer("req", TOKENS, None, identities)

    directory = Directory()
    core = RouterCore(directory.ask)
    identities = [in_namespace("a", "old"), in_namespace("b", "new"), in_namespace("c", "new")]
    answer, _ = asyncio.run(run())
    assert answer.namespace == "new" and [asked[0] for asked in directory.asked] == ["new"]


def test_one_query_per_request_to_the_shard_of_its_first_block():
    async def run():
        directory = Directory()
        core = RouterCore(directory.ask)
        identities = [core.identity(stats(r, "node-1")) for r in ("a", "b")]
        directory.answer([[("a", "node-1", i, 1)] for i in range(len(KEYS))])
        first = await core.answer("req-1", TOKENS, None, identities)
        again = await core.answer("req-1", TOKENS, None, identities)  # a retry of its routing
        return directory, first, again

    directory, (answer, blocks), again = asyncio.run(run())
    assert again == (answer, blocks) and blocks == 32
    ((namespace, shards, shard, keys),) = directory.asked
    from distkv.directory.placement import shard_of

    assert (namespace, shards, shard, keys) == ("ns", 2, shard_of(KEYS[0], 2), KEYS)
    assert answer.holders[KEYS[5]] == (Holder("a", "node-1", 5, 1),)
    assert answer.kind("a") == "holder" and answer.kind("b") == "puller"


def test_past_its_deadline_the_router_routes_on_load_alone_and_counts_why():
    async def run(holders):
        directory = Directory()
        core = RouterCore(directory.ask, deadline_s=0.01)
        identities = [core.identity(stats("a", "node-1"))]
        if holders is not None:
            directory.answer(holders)
        answer, _ = await core.answer("req", TOKENS, None, identities)
        no_tokens, _ = await core.answer("req-2", None, None, identities)
        return core, answer, no_tokens

    core, answer, no_tokens = asyncio.run(run(None))  # the Directory never answers
    assert not answer.answered and answer.kind("a") == "load_only"
    assert core.fallbacks["deadline"] == 1 and core.fallbacks["no_tokens"] == 1 and not no_tokens.answered
    assert ranked(answer, a=2, b=0)[0] in ("b", "c", "d")  # on load: a is the busiest

    core, answer, _ = asyncio.run(run(ConnectionError("shard restarting")))
    assert not answer.answered and core.fallbacks["directory_error"] == 1
