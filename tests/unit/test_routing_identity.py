"""A vLLM replica's identity from its engine's process to its Serve replica's, without Ray:
a dict stands in for Ray's internal key-value store."""

import json

import pytest

from distkv.routing.identity import PUBLISH_INTERVAL_S, IdentityPublisher, name_engine, read_identity, with_identity
from distkv.routing.router import RouterCore


def test_what_an_engine_publishes_its_serve_replica_reads_back_and_a_router_understands():
    store = {}
    stats = {"distkv": {
        "replica_id": "serve-abc", "node_id": "n1", "namespace": "ns", "directory_shards": 1,
        "keys": {"kind": "seed", "block_tokens": 16}, "costs": {"prefill_s": [0.001, 0.002]},
    }}
    calls = []
    publisher = IdentityPublisher("serve-abc", lambda: calls.append(1) or stats, store.__setitem__)
    assert read_identity("serve-abc", store.get) == {}  # nothing before the first heartbeat
    publisher.step(now=100.0)
    publisher.step(now=100.0 + PUBLISH_INTERVAL_S / 2)  # at most once an interval
    assert len(calls) == 1
    read = read_identity("serve-abc", store.get)
    assert read == json.loads(json.dumps(stats))
    identity = RouterCore(lambda *a: None).identity(read)
    assert identity.replica_id == "serve-abc" and identity.costs.prefill_s_per_block == pytest.approx(0.002)
    publisher.step(now=100.0 + PUBLISH_INTERVAL_S)
    assert len(calls) == 2
    store[publisher.key] = b"not json"
    assert read_identity("serve-abc", store.get) == {}


def test_the_serve_llm_server_names_its_engine_and_adds_the_hash_algo():
    kwargs = {"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}
    assert name_engine(kwargs, "r1") == "serve-r1" == kwargs["kv_transfer_config"]["engine_id"]
    published = {"distkv": {"replica_id": "serve-r1", "keys": {"kind": "vllm", "hash_algo": "sha256"}}}
    merged = with_identity({"kv": 1}, published, "xxhash")
    assert merged["kv"] == 1 and merged["distkv"]["keys"]["hash_algo"] == "xxhash"
    assert with_identity({"kv": 1}, {}, "sha256") == {"kv": 1}  # before the engine published
    with pytest.raises(ValueError, match="kv_transfer_config"):
        name_engine({"kv_transfer_config": "a string"}, "r1")
