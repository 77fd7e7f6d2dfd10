"""Who can use a replica's NIXL endpoint: only the members of its cache namespace.

Any Ray caller who names a namespace (it is public: it names the Directory's actors and the
pool segments) gets the Directory's answers. A replica's endpoint, which lets one read and
write its pool, is in them only sealed: opened by the namespace's members alone.
"""

import threading
import time
import uuid

import numpy as np
import pytest
import ray

pytest.importorskip("nixl")

from distkv.directory import ReplicaInfo, unpack  # noqa: E402
from distkv.directory_answer import decode_answer  # noqa: E402
from distkv.endpoint_seal import EndpointSeal, new_secret  # noqa: E402
from distkv.harness import Replica, block_keys  # noqa: E402
from distkv.spec import ClusterOffloadingSpec  # noqa: E402
from ray_actors.directory import get_or_create_shards, kill_shards  # noqa: E402
from ray_actors.namespace_secret import namespace_secret  # noqa: E402

BLOCK_TOKENS = 16
PAGE_BYTES = 4096


@pytest.fixture
def replica(ray_session):
    """A replica that registered its pool with NIXL, holding one prompt's blocks."""
    salt = uuid.uuid4().hex
    spec = ClusterOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": 64 * 2 * PAGE_BYTES, "tenant_salt": salt, "transport": "nixl"},
        gpu_block_sizes=[BLOCK_TOKENS],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    made = Replica(spec, num_gpu_blocks=16, page_bytes=PAGE_BYTES)
    try:
        tokens = np.random.default_rng(0).integers(0, 50_000, 4 * BLOCK_TOKENS)
        assert made.serve(tokens).stored_blocks == 4
        yield made, salt, block_keys(tokens, BLOCK_TOKENS)
    finally:
        made.shutdown()
        kill_shards(spec.namespace)


def infos_any_caller_gets(namespace: str, keys: list[bytes], replica_id: str) -> list[ReplicaInfo]:
    """The replica's ReplicaInfo in every Directory answer that carries one, as any Ray caller
    asks for them: the changes a follower reads, and a query's answer once the replica's
    blocks are in it."""
    (shard,) = get_or_create_shards(namespace, 1)
    changes = unpack(ray.get(shard.changes.remote(None, 0.0, namespace), timeout=60))
    # how soon the blocks reach the Directory is not under test: the bound only keeps a
    # broken link from hanging the suite
    deadline = time.monotonic() + 60
    while not all((answer := decode_answer(ray.get(shard.query.remote(keys, namespace), timeout=60), len(keys)))[0]):
        assert time.monotonic() < deadline, "the replica's blocks never reached the Directory"
        time.sleep(0.01)
    holders, named = answer
    return [changes.replicas[replica_id], named[replica_id]]


def test_the_directory_hands_any_caller_a_replicas_endpoint_sealed_only(replica):
    made, salt, keys = replica
    namespace = made.spec.namespace
    own = made.manager.promoter.transport.endpoint
    assert own is not None  # the replica registered its pool with NIXL
    infos = infos_any_caller_gets(namespace, keys, made.manager.link.info.replica_id)
    for info in infos:
        assert type(info.endpoint) is bytes, "the Directory handed out a usable endpoint"
        assert own.agent_metadata[:32] not in info.endpoint and own.agent_name.encode() not in info.endpoint
        # a Ray caller reads the namespace's secret, but without the tenant salt it opens nothing
        secret = namespace_secret(namespace)
        for stranger in (EndpointSeal(namespace, secret, "another tenant"), EndpointSeal(namespace, secret, ""),
                         EndpointSeal(namespace, new_secret(), salt)):
            assert stranger.open(info.pool_name, info.endpoint) is None
        # a member of the namespace (its secret and its salt) opens it
        assert EndpointSeal(namespace, secret, salt).open(info.pool_name, info.endpoint) == own


def test_replicas_joining_at_once_agree_on_their_namespaces_secret(ray_session):
    namespace = uuid.uuid4().hex[:16]
    start = threading.Barrier(8)
    secrets: list[bytes] = []

    def join() -> None:
        start.wait()
        secrets.append(namespace_secret(namespace))

    threads = [threading.Thread(target=join) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(secrets) == 8 and len(set(secrets)) == 1
    assert namespace_secret(namespace) == secrets[0] != namespace_secret(uuid.uuid4().hex[:16])
