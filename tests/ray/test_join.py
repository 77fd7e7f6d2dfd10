"""A replica that joins a warm namespace finds what the others hold from its first lookup."""

import threading
import time
import uuid

import numpy as np
import pytest

from distkv.abstract import ReqContext
from distkv.replica.harness import Replica, block_keys
from distkv.replica.specs import ClusterOffloadingSpec
from ray_actors.directory import kill_shards

import distkv.directory.link
import distkv.observability.metrics
import distkv.replica.join
import ray_actors.directory
import ray_actors.node_agent

BLOCK_TOKENS = 16
PAGE_BYTES = 32 << 10
HELD_BLOCKS = 256
# Generous bounds for what is not under test: A's stores reaching the Directory, and the
# promotions B starts finishing.
SETUP_TIMEOUT_S = 60.0


def make_replica(salt: str, view: str = "push") -> Replica:
    spec = ClusterOffloadingSpec.from_layout(
        {
            "cpu_bytes_to_use": (HELD_BLOCKS + 16) * 2 * PAGE_BYTES,
            "tenant_salt": salt,
            "directory_shards": 2,
            "directory_view": view,
        },
        gpu_block_sizes=[BLOCK_TOKENS],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    return Replica(spec, num_gpu_blocks=64, page_bytes=PAGE_BYTES, step_s=0.002)


@pytest.mark.parametrize("view", ["push", "query"])
def test_a_joining_replica_finds_the_blocks_another_holds_within_half_a_second(ray_session, view):
    """The replica's manager is handed to its scheduler when `join_cluster` returns; from
    then on every lookup of a block another replica holds must promote it, not recompute
    it (an autoscaled replica starts under load: each miss is a prefill done again and a
    duplicate stored). Measured from `join_cluster` returning (the spec's `get_manager`),
    following the pushed view or querying on misses."""
    salt = uuid.uuid4().hex
    a = make_replica(salt)
    made = [a]
    try:
        keys = []
        contexts = []  # each key's request, with the positions that place its prefix
        for seed in range(HELD_BLOCKS // 32):
            tokens = np.random.default_rng(seed).integers(0, 50_000, 32 * BLOCK_TOKENS)
            assert a.serve(tokens).stored_blocks == 32
            request = block_keys(tokens, BLOCK_TOKENS)
            ctx = ReqContext(f"probe{seed}")
            for i, key in enumerate(request):
                ctx.set_offload_key_position(key, (i + 1) * BLOCK_TOKENS)
            keys += request
            contexts += [ctx] * len(request)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while not all(a.manager.link.query(keys)):
            assert time.monotonic() < deadline, "A's blocks never reached the Directory"
            time.sleep(0.01)

        b = make_replica(salt, view)
        joined = time.monotonic()
        made.append(b)
        assert b.manager.link.queried == (view == "query")
        # None: a promotion from A under way, or (queried) the Directory asked; True: done.
        # False would be a recompute. A pushed view has found the blocks when its first
        # lookups say no False; a queried link once every block is here, past its answers.
        answers = [b.manager.lookup(key, ctx) for key, ctx in zip(keys, contexts)]
        b.manager.end_step()
        assert False not in answers, "B's first lookups, right after it joined, missed blocks A holds"
        while view == "query" and None in answers:
            assert time.monotonic() < joined + SETUP_TIMEOUT_S, f"B never found {answers.count(None)} of A's blocks"
            time.sleep(0.001)
            answers = [b.manager.lookup(key, ctx) for key, ctx in zip(keys, contexts)]
            b.manager.end_step()
            assert False not in answers, "B's lookups missed blocks A holds"
        found_s = time.monotonic() - joined
        print(f"\nB found A's {HELD_BLOCKS} blocks {found_s:.4f} s after join_cluster returned")
        assert found_s <= 0.5, f"B found A's blocks only {found_s:.3f} s after it joined"
    finally:
        for replica in made:
            replica.shutdown()
        kill_shards(a.spec.namespace)


class Injected(RuntimeError):
    pass


def fail(*args, **kwargs):
    raise Injected("the step after")


# The step that fails, after each step of join_cluster that starts something: the
# transports (a NIXL agent and its threads), the node's agent, the link's thread, the
# Promoter's thread, the manager.
FAILURES = {
    "after the transports": (ray_actors.node_agent, "start_node_agent"),
    "after the node's agent": (ray_actors.directory, "shard_clients"),
    "after the link": (distkv.directory.link.DirectoryLink, "wait_synced"),
    "after the promoter": (distkv.replica.join, "ClusterOffloadingManager"),
    "after the manager": (distkv.observability.metrics, "register"),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_join_that_fails_closes_what_it_started(ray_session, monkeypatch, failure):
    """A replica whose join fails half way leaves nothing running: no NIXL agent, no
    thread of its link, its Promoter or its reads."""
    spec = ClusterOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": 64 * 2 * PAGE_BYTES, "tenant_salt": uuid.uuid4().hex, "transport": "nixl"},
        gpu_block_sizes=[BLOCK_TOKENS],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    replica_threads = {"distkv-promoter", "distkv-nixl-reads", f"distkv-directory-{spec.replica_id}"}
    monkeypatch.setattr(*FAILURES[failure], fail)
    try:
        with pytest.raises(Injected):
            spec.get_manager()
        left = replica_threads & {t.name for t in threading.enumerate() if t.is_alive()}
        assert not left, f"a join that failed {failure} left {sorted(left)} running"
    finally:
        spec.close()
        kill_shards(spec.namespace)
