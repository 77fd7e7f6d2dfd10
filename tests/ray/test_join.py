"""A replica that joins a warm namespace finds what the others hold from its first lookup."""

import time
import uuid

import numpy as np

from distkv.abstract import ReqContext
from distkv.harness import Replica, block_keys
from distkv.spec import ClusterOffloadingSpec
from ray_actors.directory import kill_shards

BLOCK_TOKENS = 16
PAGE_BYTES = 32 << 10
HELD_BLOCKS = 256
# Generous bounds for what is not under test: A's stores reaching the Directory, and the
# promotions B starts finishing.
SETUP_TIMEOUT_S = 60.0


def make_replica(salt: str) -> Replica:
    spec = ClusterOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": (HELD_BLOCKS + 16) * 2 * PAGE_BYTES, "tenant_salt": salt, "directory_shards": 2},
        gpu_block_sizes=[BLOCK_TOKENS],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    return Replica(spec, num_gpu_blocks=64, page_bytes=PAGE_BYTES, step_s=0.002)


def test_a_joining_replica_finds_the_blocks_another_holds_within_half_a_second(ray_session):
    """The replica's manager is handed to its scheduler when `join_cluster` returns; from
    then on every lookup of a block another replica holds must promote it, not recompute
    it (an autoscaled replica starts under load: each miss is a prefill done again and a
    duplicate stored). Measured from `join_cluster` returning (the spec's `get_manager`)."""
    salt = uuid.uuid4().hex
    a = make_replica(salt)
    made = [a]
    try:
        keys = []
        for seed in range(HELD_BLOCKS // 32):
            tokens = np.random.default_rng(seed).integers(0, 50_000, 32 * BLOCK_TOKENS)
            assert a.serve(tokens).stored_blocks == 32
            keys += block_keys(tokens, BLOCK_TOKENS)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while not all(a.manager.link.query(keys)):
            assert time.monotonic() < deadline, "A's blocks never reached the Directory"
            time.sleep(0.01)

        b = make_replica(salt)
        joined = time.monotonic()
        made.append(b)
        ctx = ReqContext("probe")
        # None: a promotion from A is under way; True: done. False would be a recompute.
        first = [b.manager.lookup(key, ctx) for key in keys]
        missed = [key for key, answer in zip(keys, first) if answer is False]
        while missed:
            assert time.monotonic() < joined + SETUP_TIMEOUT_S, f"B never found {len(missed)} of A's blocks"
            time.sleep(0.001)
            missed = [key for key in missed if b.manager.lookup(key, ctx) is False]
        found_s = time.monotonic() - joined
        print(f"\nB found A's {HELD_BLOCKS} blocks {found_s:.4f} s after join_cluster returned")
        assert found_s <= 0.5, f"B found A's blocks only {found_s:.3f} s after it joined"
        assert first.count(False) == 0, "B's first lookups, right after it joined, missed blocks A holds"
    finally:
        for replica in made:
            replica.shutdown()
        kill_shards(a.spec.namespace)
