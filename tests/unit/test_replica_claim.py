"""Two replicas never share a pool by sharing an engine_id; a replica restarted under its name does."""

import os
import signal
import subprocess
import sys
import uuid

import pytest
import ray

from distkv.storage.pool import HostPool
from distkv.replica.specs import LocalOffloadingSpec
from distkv.replica.join import join_cluster


@pytest.fixture
def plan():
    spec = LocalOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": 8 * 4096}, gpu_block_sizes=[16], group_page_bytes=[4096],
        engine_id=f"claim-{uuid.uuid4().hex[:8]}",
    )
    yield spec.plan
    assert not [name for name in os.listdir("/dev/shm") if spec.plan.replica_id in name]


def test_a_second_replica_of_the_same_engine_id_fails_at_start(plan, monkeypatch):
    assert not ray.is_initialized()

    def init(*args, **kwargs):
        raise AssertionError("the second replica went on to join the cluster")

    monkeypatch.setattr(ray, "init", init)
    first = HostPool(plan.pool_name, plan.layout)
    try:
        assert first.claim()  # what the first replica's join_cluster did
        worker = HostPool(plan.pool_name, plan.layout)  # the first replica's workers attach as before
        worker.close()
        second = HostPool(plan.pool_name, plan.layout)
        try:
            with pytest.raises(ValueError, match="engine_id") as refused:
                join_cluster(plan, second)
            assert plan.replica_id in str(refused.value)
        finally:
            second.close()
    finally:
        first.close()


def test_a_replica_killed_and_restarted_under_its_name_claims_it_again(plan):
    owner = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys; from distkv.storage.pool import HostPool, PoolLayout\n"
            f"pool = HostPool({plan.pool_name!r}, PoolLayout{(plan.layout.num_rows, plan.layout.num_ranks, plan.layout.slot_bytes)!r})\n"
            "print(pool.claim(), flush=True)\n"
            "sys.stdin.read()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert owner.stdout.readline().strip() == "True"
        restarted = HostPool(plan.pool_name, plan.layout)
        try:
            assert not restarted.claim()  # the owner lives
            owner.send_signal(signal.SIGKILL)
            owner.wait()
            assert restarted.claim()  # its lock went with it
        finally:
            restarted.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
