"""`distkv demo` end to end: an embedded two-node cluster, two replicas, a tiny model.

Runs the command as a user does (`python -m distkv demo --json`) and checks that blocks
were shared across nodes, that every loaded block was verified, and that the document's
figures agree with one another.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from distkv.names import SEGMENT_PREFIX

SMALL = [
    "--replicas", "2", "--nodes", "2", "--requests", "24", "--system-prompts", "2", "--system-tokens", "64",
    "--user-tokens", "16", "--reply-tokens", "16", "--turns", "3", "--model-dim", "64", "--model-layers", "2",
    "--vocab-size", "512", "--pool-mib", "16",
]
DEMO_SEGMENT = re.compile(re.escape(SEGMENT_PREFIX) + r"[0-9a-f]+-demo[0-9a-f]{8}_r\d+(_own)?$")


def demo_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if DEMO_SEGMENT.match(name)}


def run_demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distkv", "demo", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def document():
    before = demo_segments()
    done = run_demo(*SMALL, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert demo_segments() <= before, "the replicas' pools were left in /dev/shm"
    return json.loads(done.stdout), done.stderr


def test_blocks_are_shared_across_nodes_and_every_loaded_block_checks_out(document):
    doc, log = document
    assert "Ray dashboard: http://" in log
    assert doc["replicas"] == 2 and doc["nodes"] == 2 and doc["requests"] == 24
    assert doc["tokens"]["cross_node"] > 0
    assert doc["transfers"]["cross_node_promotion"]["blocks"] > 0
    assert doc["hit_tokens_computed_by_another_replica"] > 0
    assert doc["mismatches"] == 0 and doc["load_failures"] == 0
    assert doc["blocks_verified"] > 0


def test_every_field_is_there_and_the_figures_agree(document):
    doc, _ = document
    block_tokens, block_bytes = doc["block_tokens"], doc["block_bytes"]
    tokens, transfers = doc["tokens"], doc["transfers"]
    assert set(tokens) == {"local", "same_node", "cross_node", "recomputed"}
    assert sum(tokens.values()) == doc["prompt_tokens"] > 0
    hit_tokens = tokens["local"] + tokens["same_node"] + tokens["cross_node"]
    assert all(tokens[s] % block_tokens == 0 for s in ("local", "same_node", "cross_node"))
    assert doc["hit_rate"] == pytest.approx(hit_tokens / doc["prompt_tokens"])
    assert 0 < doc["hit_rate"] <= doc["oracle_hit_rate"] <= 1
    assert 0 < doc["hit_tokens_computed_by_another_replica"] <= hit_tokens
    # every block loaded, by distkv and by the own-pool arm, is checked
    assert doc["blocks_verified"] == (hit_tokens + doc["own_pool_only_hit_tokens"]) // block_tokens

    for side in ("distkv", "own_pool_only", "offloading_off"):
        ttft = doc["ttft_s"][side]
        assert 0 < ttft["p50"] <= ttft["p99"]

    assert set(transfers) == {"local_load", "same_node_promotion", "cross_node_promotion"}
    for path in transfers.values():
        assert set(path) == {"blocks", "bytes", "seconds", "gb_per_s"}
        assert path["bytes"] == path["blocks"] * block_bytes
        assert (path["gb_per_s"] > 0) == (path["bytes"] > 0)
    # every hit is loaded from the replica's own pool; a promoted block is loaded at most once as such
    assert transfers["local_load"]["blocks"] == hit_tokens // block_tokens
    assert transfers["same_node_promotion"]["blocks"] >= tokens["same_node"] // block_tokens
    assert transfers["cross_node_promotion"]["blocks"] >= tokens["cross_node"] // block_tokens
    assert tokens["same_node"] == 0  # one replica per node: no neighbour to promote from

    assert 0 <= doc["first_tokens_as_offloading_off"] <= doc["requests"]
    assert set(doc["seconds"]) == {"start", "distkv", "own_pool_only", "offloading_off", "shutdown", "total"}
    by_transport = doc["transfers_by_transport"]
    assert set(by_transport) == {"nixl", "object_store"}
    cross = doc["transfers"]["cross_node_promotion"]
    assert sum(t["bytes"] for t in by_transport.values()) == cross["bytes"]
    assert 0 <= doc["own_pool_only_hit_rate"] <= doc["hit_rate"] + 0.05
    assert doc["model"]["dim"] == 64 and doc["workload"]["requests"] == 24


def test_ctrl_c_cleans_up():
    before = demo_segments()
    # Ctrl-C as at a terminal: a shell starts background commands with SIGINT ignored, and a
    # test run started so would hand that on to the demo, which then never sees the signal
    demo = subprocess.Popen(
        [sys.executable, "-m", "distkv", "demo", *SMALL, "--nodes", "1", "--replicas", "1", "--requests", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in demo.stdout:
            if line.lstrip().startswith("distkv ") and "[" in line:  # progress: requests being served
                break
        assert demo_segments() - before, "no pools while the demo runs"
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, rest[-3000:]
    assert "interrupted, cleaning up" in rest
    deadline = time.monotonic() + 10
    while demo_segments() - before:
        assert time.monotonic() < deadline, "the replicas' pools were left in /dev/shm"
        time.sleep(0.1)
