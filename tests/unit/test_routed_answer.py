"""The Directory's answer as it travels with a request, and what the chosen replica does with it.

A replica whose link queries the Directory on a miss (directory_view "query") would answer
RETRY for a block nobody holds until the Directory replies; with its router's answer it
misses at once, and promotes from the holders the answer names without asking.
"""

import json

import pytest

from cluster_fakes import FakeDirectory, QueriedLink
from distkv.directory import Holder
from distkv.replica.harness import block_keys
from distkv.routing.answer import PARAMS_KEY, decode, encode, from_directory, load_only
from test_cluster import BLOCK_TOKENS, FakeClusterSpec, make_replica, prompt


def test_an_answer_reads_back_as_it_was_sent_and_anything_else_is_ignored():
    keys = block_keys(prompt(1, blocks=4), BLOCK_TOKENS)
    answer = from_directory("ns", keys, [[("a", "n1", 7, 3), ("b", "n2", 1, 9)], [("a", "n1", 8, 3)], [], []])
    sent = json.loads(json.dumps(encode(answer)))  # it may ride in an HTTP body
    assert decode(sent, "ns") == answer
    assert decode(sent, "another namespace") is None
    assert decode(encode(load_only("ns")), "ns") == load_only("ns")
    for bad in (
        None, "x", {**sent, "v": 99}, {**sent, "keys": ["zz"]}, {**sent, "holders": [[[0, -1, 3]]] * 4},
        {**sent, "holders": [[[5, 1, 1]]] * 4}, {**sent, "keys": sent["keys"] + ["00" * 40]},
    ):
        assert decode(bad, "ns") is None
    assert answer.without("a").holders == {keys[0]: (Holder("b", "n2", 1, 9),)}


class QueriedSpec(FakeClusterSpec):
    def get_manager(self):
        manager = super().get_manager()
        manager.link = manager.pulls._link = QueriedLink(self.directory, manager.link.info)
        manager._view = manager.link.view
        return manager


@pytest.fixture
def queried(monkeypatch):
    import test_cluster

    monkeypatch.setattr(test_cluster, "FakeClusterSpec", QueriedSpec)
    made = []
    yield lambda directory, node: made.append(make_replica(directory, node)) or made[-1]
    for r in made:
        r.shutdown()


def answer_for(directory, tokens, namespace):
    """What a router would send: the Directory's holders of each of the prompt's keys."""
    keys = block_keys(tokens, BLOCK_TOKENS)
    holders = [list(directory.holders.get(k, {}).values()) for k in keys]
    return {PARAMS_KEY: encode(from_directory(namespace, keys, holders))}


def test_a_prompt_nobody_holds_is_a_plain_miss_with_the_routers_answer(queried):
    directory = FakeDirectory()
    b = queried(directory, "node-2")
    tokens = prompt(3)
    unrouted = b.serve(prompt(4), max_retries=2)  # without an answer it asks, and waits
    assert unrouted.retries == 3 and b.manager.link.asked and not b.manager.link.routed
    b.manager.link.asked.clear()

    routed = b.serve(tokens, kv_transfer_params=answer_for(directory, tokens, b.manager.link.namespace))
    assert (routed.hit_blocks, routed.retries) == (0, 0) and not b.manager.link.asked
    assert b.manager.link.routed  # told, so that a view of "auto" stops following
    assert b.manager.pulls.routed["cold"] == 1


def test_a_replica_promotes_from_the_holders_the_answer_names_without_asking(queried):
    directory = FakeDirectory()
    a = queried(directory, "node-1")
    b = queried(directory, "node-2")
    tokens = prompt(5)
    assert a.serve(tokens).stored_blocks == 32
    namespace = b.manager.link.namespace
    routed = b.serve(tokens, kv_transfer_params=answer_for(directory, tokens, namespace))
    assert routed.hit_blocks == 32 and routed.mismatches == 0 and not b.manager.link.asked
    assert b.manager.promoter.succeeded["cross_node"] == 32
    assert b.manager.pulls.routed["puller"] == 1
    assert a.serve(tokens, kv_transfer_params=answer_for(directory, tokens, namespace)).hit_blocks == 32
    assert a.manager.pulls.routed["holder"] == 1


def test_an_unreadable_answer_is_ignored_and_counted(queried):
    b = queried(FakeDirectory(), "node-2")
    result = b.serve(prompt(6), max_retries=1, kv_transfer_params={PARAMS_KEY: {"v": 1, "namespace": 7}})
    assert result.retries == 2 and b.manager.link.asked  # looked up as if unrouted
    assert b.manager.stats().errors == {"routed_answer": 1}


def test_keys_the_router_did_not_ask_about_are_looked_up_as_usual(queried):
    """A prompt the engine keys otherwise than the router (a LoRA adapter, images): the
    answer covers none of its keys, and the replica asks the Directory as if unrouted."""
    directory = FakeDirectory()
    b = queried(directory, "node-2")
    tokens = prompt(7)
    sent = answer_for(directory, prompt(8), b.manager.link.namespace)  # keys of another prompt
    result = b.serve(tokens, max_retries=1, kv_transfer_params=sent)
    assert result.retries == 2 and b.manager.link.asked
