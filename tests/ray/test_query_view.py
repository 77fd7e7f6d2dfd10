"""Replicas that query the Directory on a miss instead of following its pushed view, alone
and beside replicas that follow it, through the real shards and spec on one local Ray, and
the node agent that relays their publishes."""

import threading
import time
import uuid

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.directory.records import ReplicaInfo
from distkv.directory.wire import encode_changes, encode_stored
from distkv.directory.wire import decode_answer
from distkv.directory.placement import shard_of
from distkv.directory.views import AUTO_PUSH_MAX_REPLICAS
from distkv.replica.harness import Replica, block_keys
from distkv.names import RAY_NAMESPACE, agent_name, segment_name
from ray_actors.directory import get_or_create_shards, kill_shards
from ray_actors.node_agent import NodeAgent
from test_cluster_ray import BLOCK_TOKENS, prompt
from test_cluster_ray import replicas as any_replicas  # noqa: F401 (a fixture)

SHARDS = 2
# A generous bound for what is not under test: a store reaching the Directory.
SETUP_TIMEOUT_S = 60.0
# The idle time of a NodeAgent under test: long beside the few calls the test makes to see
# its relay before it is unused for that long.
RELAY_IDLE_S = 3.0


@pytest.fixture
def replicas(any_replicas):
    """Make a replica of a namespace of SHARDS shards that learns what others hold by `view`."""
    return lambda salt, view: any_replicas(salt, directory_shards=SHARDS, directory_view=view)


def stored_in_directory(replica: Replica, keys: list[bytes]) -> None:
    """Wait until the Directory holds `keys` (not under test: how soon a publish lands)."""
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not all(replica.manager.link.query(keys, timeout_s=SETUP_TIMEOUT_S)):
        assert time.monotonic() < deadline, "the stores never reached the Directory"
        time.sleep(0.01)


def shard_stats(namespace: str) -> list[dict]:
    return ray.get([shard.stats.remote() for shard in get_or_create_shards(namespace, SHARDS)])


def shard_queries(namespace: str) -> list[int]:
    return [s["queries"] for s in shard_stats(namespace)]


def relayed_publishes(namespace: str) -> int:
    return sum(s.get("relayed_publishes", 0) for s in shard_stats(namespace))


def crowd(namespace: str) -> None:
    """AUTO_PUSH_MAX_REPLICAS more replicas, silent, registered with every shard: the
    namespace is large, so its queried replicas publish through their node's relay."""
    node_id = ray.get_runtime_context().get_node_id()
    infos = [
        ReplicaInfo(f"crowd_{i}", node_id, segment_name(namespace, f"crowd_{i}"), 64, 1, 4096)
        for i in range(AUTO_PUSH_MAX_REPLICAS)
    ]
    calls = [
        shard.register.remote(info, 0, encode_stored([]), namespace=namespace)
        for shard in get_or_create_shards(namespace, SHARDS)
        for info in infos
    ]
    ray.get(calls, timeout=SETUP_TIMEOUT_S)


def relaying(replica: Replica) -> None:
    """Wait until the replica's link publishes through its node's relay (it learns how
    large the namespace is from its shards' answers)."""
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not replica.manager.link.relayed:
        assert time.monotonic() < deadline, "the link never took its node's relay"
        time.sleep(0.01)


def test_a_queried_replica_promotes_a_prefix_bit_exact_with_one_call_per_shard(replicas):
    salt = uuid.uuid4().hex
    a = replicas(salt, "query")
    crowd(a.spec.namespace)
    b = replicas(salt, "query")
    assert b.manager.link.queried and type(b.manager.link._source).__name__ == "QueriedView"  # no pushed view
    tokens = prompt(1)
    assert a.serve(tokens).stored_blocks == 32
    keys = block_keys(tokens, BLOCK_TOKENS)
    stored_in_directory(a, keys)

    before = shard_queries(b.spec.namespace)
    result = b.serve(tokens)
    after = shard_queries(b.spec.namespace)
    assert result.hit_blocks == 32
    assert result.mismatches == 0 and result.load_failures == 0
    # the prefix is placed on its first block's shard: the request cost one call, there
    calls = [n - m for n, m in zip(after, before)]
    root_shard = shard_of(keys[0], SHARDS)
    assert calls == [int(shard == root_shard) for shard in range(SHARDS)], calls
    # in a large namespace a queried replica publishes through its node's agent, which
    # carries the node's publishes together (b's promoted blocks, for one)
    relaying(b)
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while relayed_publishes(b.spec.namespace) == 0:
        assert time.monotonic() < deadline, "no publish came through the node's relay"
        time.sleep(0.05)


def test_a_small_namespace_s_queried_replicas_publish_to_the_shards_themselves(replicas):
    """Through the relay each publish would cost an actor call more and save the shards
    no call: there are too few replicas a node to fold."""
    salt = uuid.uuid4().hex
    a, b = replicas(salt, "query"), replicas(salt, "query")
    tokens = prompt(2)
    assert a.serve(tokens).stored_blocks == 32
    stored_in_directory(a, block_keys(tokens, BLOCK_TOKENS))
    assert b.serve(tokens).hit_blocks == 32
    assert not a.manager.link.relayed and not b.manager.link.relayed
    assert relayed_publishes(a.spec.namespace) == 0


def test_publishes_go_on_through_a_restarted_node_agent(replicas):
    salt = uuid.uuid4().hex
    a = replicas(salt, "query")
    crowd(a.spec.namespace)
    b = replicas(salt, "query")
    relaying(b)
    tokens = prompt(4)
    assert a.serve(tokens).stored_blocks == 32  # its answer shows a the namespace's size
    relaying(a)
    agent = ray.get_actor(agent_name(a.manager.link.info.node_id), namespace=RAY_NAMESPACE)
    before = relayed_publishes(a.spec.namespace)
    ray.kill(agent, no_restart=False)
    tokens = prompt(5)
    assert a.serve(tokens).stored_blocks == 32
    stored_in_directory(a, block_keys(tokens, BLOCK_TOKENS))
    assert relayed_publishes(a.spec.namespace) > before
    result = b.serve(tokens)
    assert (result.hit_blocks, result.mismatches, result.load_failures) == (32, 0, 0)


def agent_relays(agent: ray.actor.ActorHandle, namespace: str) -> tuple[list, int]:
    """The agent's relays, and how many threads of `namespace`'s relay run in its process."""
    def look(self):
        threads = [t for t in threading.enumerate() if t.name == f"distkv-relay-{namespace}" and t.is_alive()]
        return list(self._relays), len(threads)

    return ray.get(agent.__ray_call__.remote(look))


def test_an_agent_closes_a_relay_nobody_uses_and_a_later_publish_gets_a_new_one(ray_session):
    namespace = f"idle_{uuid.uuid4().hex}"
    # the replica stays silent while its relay idles: the shards must not expire it meanwhile
    shards = get_or_create_shards(namespace, SHARDS, replica_timeout_s=10 * SETUP_TIMEOUT_S)
    node_id = ray.get_runtime_context().get_node_id()
    # an agent of its own beside the node's, with a short idle time
    on_this_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
    agent = NodeAgent.options(scheduling_strategy=on_this_node).remote(relay_idle_s=RELAY_IDLE_S)
    try:
        first, second = block_keys(prompt(6), BLOCK_TOKENS)[:2]
        shard = shard_of(first, SHARDS)
        info = ReplicaInfo("r", node_id, segment_name(namespace, "r"), 64, 1, 4096)
        ray.get(shards[shard].register.remote(info, 0, encode_stored([]), namespace=namespace))

        def publish(seq: int, key: bytes) -> None:
            items = [(shard, "r", seq, encode_changes([(key, seq, seq)], []), None)]
            [answer] = ray.get(agent.relay.remote(namespace, SHARDS, items))
            assert not isinstance(answer, str) and answer[1] is True, answer

        publish(1, first)
        assert agent_relays(agent, namespace) == ([(namespace, SHARDS)], 1)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while agent_relays(agent, namespace) != ([], 0):
            assert time.monotonic() < deadline, "the agent never closed its unused relay"
            time.sleep(0.05)

        publish(2, second)  # through a new relay
        assert agent_relays(agent, namespace) == ([(namespace, SHARDS)], 1)
        holders, _ = decode_answer(ray.get(shards[shard].query.remote([first, second], namespace=namespace)), 2)
        assert [[h[0] for h in key_holders] for key_holders in holders] == [["r"], ["r"]]
    finally:
        ray.kill(agent)
        kill_shards(namespace)


def test_pushed_and_queried_replicas_share_both_ways(replicas):
    salt = uuid.uuid4().hex
    pushed, queried = replicas(salt, "push"), replicas(salt, "query")
    assert not pushed.manager.link.queried and queried.manager.link.queried

    tokens = prompt(2)  # the pushed replica's, found by the queried one
    assert pushed.serve(tokens).stored_blocks == 32
    keys = block_keys(tokens, BLOCK_TOKENS)
    stored_in_directory(pushed, keys)
    result = queried.serve(tokens)
    assert (result.hit_blocks, result.mismatches, result.load_failures) == (32, 0, 0)

    tokens = prompt(3)  # the queried replica's, in the pushed replica's view
    assert queried.serve(tokens).stored_blocks == 32
    keys = block_keys(tokens, BLOCK_TOKENS)
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not all(pushed.manager.link.holders(k) for k in keys):
        assert time.monotonic() < deadline, "the pushed view never showed the queried replica's blocks"
        time.sleep(0.005)
    result = pushed.serve(tokens)
    assert (result.hit_blocks, result.mismatches, result.load_failures) == (32, 0, 0)


def test_auto_follows_a_small_namespace_and_queries_once_it_grows_past_the_bound(replicas, monkeypatch):
    monkeypatch.setattr("distkv.directory.views.AUTO_PUSH_MAX_REPLICAS", 1)
    salt = uuid.uuid4().hex
    first = replicas(salt, "auto")
    assert not first.manager.link.queried  # alone in its namespace: it follows
    second = replicas(salt, "auto")
    assert second.manager.link.queried  # one replica registered already: the bound
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not first.manager.link.queried:  # its view shows two replicas now
        assert time.monotonic() < deadline, "the first replica never switched to queries"
        time.sleep(0.005)
    tokens = prompt(4)
    assert first.serve(tokens).stored_blocks == 32
    stored_in_directory(first, block_keys(tokens, BLOCK_TOKENS))
    assert second.serve(tokens).hit_blocks == 32
