"""Replicas sharing one cache through the real Directory and spec, on one local Ray node."""

import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import ray

from distkv.abstract import ReqContext
from distkv.replica.harness import Replica, block_keys
from distkv.names import RAY_NAMESPACE, SEGMENT_PREFIX, agent_name
from distkv.replica.specs import ClusterOffloadingSpec
from ray_actors.directory import get_or_create_shards, kill_shards
from distkv.storage.readers import PRUNE_INTERVAL_S
from ray_actors.node_agent import start_node_agent

BLOCK_TOKENS = 16
PAGE_BYTES = 32 << 10


def make_replica(salt: str, pool_blocks: int = 128, **extra) -> Replica:
    spec = ClusterOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": pool_blocks * 2 * PAGE_BYTES, "tenant_salt": salt, **extra},
        gpu_block_sizes=[BLOCK_TOKENS],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    return Replica(spec, num_gpu_blocks=64, page_bytes=PAGE_BYTES, step_s=0.002)


@pytest.fixture
def replicas(ray_session):
    made: list[Replica] = []

    def make(*args, **kw):
        made.append(make_replica(*args, **kw))
        return made[-1]

    yield make
    namespaces = {r.spec.namespace for r in made}
    for r in made:
        r.shutdown()
    for ns in namespaces:
        kill_shards(ns)


def prompt(seed: int, blocks: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * BLOCK_TOKENS)


def wait_visible(replica: Replica, key: bytes, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not replica.manager.link.holders(key):
        assert time.monotonic() < deadline, "store never became visible in the Directory view"
        time.sleep(0.005)


def test_two_replicas_share_a_prefix(replicas):
    salt = uuid.uuid4().hex
    a, b = replicas(salt), replicas(salt)
    tokens = prompt(1)
    assert a.serve(tokens).stored_blocks == 32
    keys = block_keys(tokens, BLOCK_TOKENS)
    wait_visible(b, keys[-1])

    assert b.manager.lookup(keys[0], ReqContext("probe")) is None  # promotion under way
    result = b.serve(tokens)
    assert result.hit_blocks == 32
    assert result.mismatches == 0 and result.load_failures == 0


def test_namespaces_never_share(replicas):
    tenant = uuid.uuid4().hex  # unique per run: blocks of other runs can never count
    a, b = replicas(f"{tenant}-a"), replicas(f"{tenant}-b")
    assert a.spec.namespace != b.spec.namespace
    tokens = prompt(2)
    a.serve(tokens)
    keys = block_keys(tokens, BLOCK_TOKENS)
    # How soon A's publish lands is not under test (a loaded machine delays it): the bound
    # only keeps a broken link from hanging the suite.
    deadline = time.monotonic() + 60
    while not a.manager.link.query(keys[:1], timeout_s=60)[0]:  # A's publish has landed
        assert time.monotonic() < deadline, "A's store never reached its Directory shard"
        time.sleep(0.01)
    time.sleep(0.2)
    assert not b.manager.link.holders(keys[0])
    assert not b.manager.link.query(keys[:1], timeout_s=60)[0]  # nor does B's shard hold it
    assert b.serve(tokens).hit_blocks == 0


def test_directory_restart_is_refilled_by_the_replicas(replicas):
    salt = uuid.uuid4().hex
    a = replicas(salt)
    tokens = prompt(3)
    a.serve(tokens)
    keys = block_keys(tokens, BLOCK_TOKENS)
    (shard,) = get_or_create_shards(a.spec.namespace, 1)
    ray.kill(shard, no_restart=False)
    killed = time.monotonic()

    b = replicas(salt)
    ctx = ReqContext("probe")
    while not all(b.manager.lookup(key, ctx) is True for key in keys):
        assert time.monotonic() - killed < 10, "prefix not hit again within 10 s of the Directory's restart"
        time.sleep(0.05)
    result = b.serve(tokens)
    assert result.hit_blocks == 32 and result.mismatches == 0


def test_no_segments_left_after_shutdown(ray_session):
    salt = uuid.uuid4().hex
    r = make_replica(salt)
    name = r.spec.pool_name
    r.serve(prompt(4, blocks=4))
    assert os.path.exists(f"/dev/shm/{name}")
    namespace = r.spec.namespace
    r.shutdown()
    kill_shards(namespace)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX) and namespace in n]


def agents_mapping(name: str) -> list[int]:
    """Pids of the NodeAgent processes that map the segment `name` (removed or not)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::NodeAgent"):
                    continue
            with open(f"/proc/{pid}/maps") as f:
                if f"/dev/shm/{name}" in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_node_agent_lets_go_of_a_removed_pool(ray_session):
    """The agent keeps the pools it serves mapped, but not one its replica removed: else the
    segment's memory would stay taken."""
    r = make_replica(uuid.uuid4().hex)
    keys = block_keys(prompt(6, blocks=4), BLOCK_TOKENS)
    r.serve(prompt(6, blocks=4))
    agent = ray.get_actor(agent_name(ray.get_runtime_context().get_node_id()), namespace=RAY_NAMESPACE)
    held = [r.manager.local.block(k) for k in keys]
    layout = (r.spec.layout.num_rows, r.spec.layout.num_ranks, r.spec.layout.slot_bytes)
    args = (r.spec.pool_name, layout, [row for row, _ in held], keys, [gen for _, gen in held])
    for _ in range(2):  # the second read finds the pool still mapped
        data, metas = ray.get(agent.read_rows.remote(*args, namespace=r.spec.namespace))
        assert all(metas) and data.shape[:2] == (1, 4)
    assert agents_mapping(r.spec.pool_name), "the agent did not keep the pool mapped"
    namespace = r.spec.namespace
    r.shutdown()
    kill_shards(namespace)
    assert not os.path.exists(f"/dev/shm/{r.spec.pool_name}")  # the agent does not hold it back
    deadline = time.monotonic() + PRUNE_INTERVAL_S + 5
    while agents_mapping(r.spec.pool_name):
        assert time.monotonic() < deadline, "the agent still maps the removed pool"
        time.sleep(0.2)


def test_node_agent_reclaims_the_segment_of_a_killed_replica(ray_session):
    """A replica killed with SIGKILL runs no cleanup: its segment stays in /dev/shm until
    the node's agent reclaims it, within PRUNE_INTERVAL_S, though no pool is created on
    the node meanwhile (which reclaimed it before, and nothing else did)."""
    agent = start_node_agent(ray.get_runtime_context().get_node_id())
    ray.get(agent.node_id.remote())
    name = f"{SEGMENT_PREFIX}tkill{uuid.uuid4().hex[:8]}-r0"
    killed = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys; from distkv.storage.pool import HostPool, PoolLayout, PAGE_BYTES\n"
            f"pool = HostPool({name!r}, PoolLayout(4, 1, PAGE_BYTES))\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert killed.stdout.readline().strip() == "ready"
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    assert os.path.exists(f"/dev/shm/{name}")  # SIGKILL ran no cleanup
    deadline = time.monotonic() + PRUNE_INTERVAL_S + 30
    while os.path.exists(f"/dev/shm/{name}"):
        assert time.monotonic() < deadline, "the node's agent never reclaimed the killed replica's segment"
        time.sleep(0.1)


def test_a_reset_replica_shares_only_within_its_cache_epoch(replicas):
    salt = uuid.uuid4().hex
    a, b = replicas(salt), replicas(salt)
    old = prompt(5, blocks=8)
    a.serve(old)
    wait_visible(b, block_keys(old, BLOCK_TOKENS)[-1])
    b_name = b.manager.link.info.replica_id
    b.manager.reset_cache()  # B's weights were updated
    assert b.serve(old).hit_blocks == 0  # A's blocks are of the old weights
    fresh = prompt(6, blocks=8)
    b.serve(fresh)
    last = block_keys(fresh, BLOCK_TOKENS)[-1]
    wait_visible(a, last, timeout=30.0)
    assert {h.replica_id for h in a.manager.link.holders(last)} == {f"{b_name}.epoch1"}
    assert a.serve(fresh).hit_blocks == 0  # A, still at epoch 0, does not take them
    a.manager.reset_cache()  # the same update on A: they share again
    assert a.serve(fresh).hit_blocks == 8
    shards = get_or_create_shards(a.spec.namespace, b.manager.link.num_shards)
    registered = {r["replica_id"]: r["cache_epoch"] for s in shards for r in ray.get(s.replicas.remote())}
    assert registered.get(f"{b_name}.epoch1") == 1 and b_name not in registered
