"""`distkv demo` end to end: an embedded two-node cluster, two replicas of a tiny model as a
Ray Serve deployment, the trace served by each of the four arms.

Runs the command as a user does (`python -m distkv demo --json`) and checks that blocks were
shared across nodes, that every loaded block was verified, and that the document's figures
agree with one another, arm by arm.
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
ARMS = ("off", "affinity", "distkv", "distkv-router")
DEMO_SEGMENT = re.compile(re.escape(SEGMENT_PREFIX) + r"[0-9a-f]+-demo[0-9a-f]{8}_\w+$")


def demo_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if DEMO_SEGMENT.match(name)}


def run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "distkv", "demo", *args], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:  # what a stuck demo printed: its stacks, its replicas'
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"the demo did not finish in {timeout:.0f} s; its stderr ends:\n{stderr[-30000:]}")


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
    assert doc["replicas"] == 2 and doc["nodes"] == 2 and list(doc["arms"]) == list(ARMS)
    assert doc["arms"]["distkv-router"]["requests"] == 24
    # Serve's default router lands requests away from their prefixes: they pull them
    arm = doc["arms"]["distkv"]
    assert arm["requests"] == 24
    assert arm["tokens"]["cross_node"] > 0
    assert arm["transfers"]["cross_node_promotion"]["blocks"] > 0
    assert arm["hit_tokens_computed_by_another_replica"] > 0
    # distkv's router sends them to their prefixes: the few blocks it still pulls across nodes
    # are not something to require
    assert doc["arms"]["distkv-router"]["routed"]["holder"] > 0
    assert doc["mismatches"] == 0 and doc["load_failures"] == 0
    assert doc["blocks_verified"] > 0


def test_every_field_is_there_and_the_figures_agree(document):
    doc, _ = document
    block_tokens, block_bytes = doc["block_tokens"], doc["block_bytes"]
    loaded_blocks = 0
    for name, arm in doc["arms"].items():
        tokens, transfers = arm["tokens"], arm["transfers"]
        assert set(tokens) == {"local", "same_node", "cross_node", "recomputed"}
        assert sum(tokens.values()) == arm["prompt_tokens"] > 0
        hit_tokens = tokens["local"] + tokens["same_node"] + tokens["cross_node"]
        loaded_blocks += hit_tokens // block_tokens
        assert all(tokens[s] % block_tokens == 0 for s in ("local", "same_node", "cross_node"))
        assert arm["hit_rate"] == pytest.approx(hit_tokens / arm["prompt_tokens"])
        assert arm["hit_rate"] <= arm["oracle_hit_rate"] <= 1
        assert 0 < arm["oracle_hit_rate_as_run"] <= arm["oracle_hit_rate"]
        assert 0 < arm["ttft_s"]["p50"] <= arm["ttft_s"]["p99"]
        assert set(transfers) == {"local_load", "same_node_promotion", "cross_node_promotion"}
        for path in transfers.values():
            assert path["bytes"] == path["blocks"] * block_bytes
            assert (path["gb_per_s"] > 0) == (path["bytes"] > 0)
        assert transfers["local_load"]["blocks"] == hit_tokens // block_tokens
        assert transfers["cross_node_promotion"]["blocks"] >= tokens["cross_node"] // block_tokens
        assert tokens["same_node"] == 0  # one replica per node: no neighbour to promote from
        cross = transfers["cross_node_promotion"]["bytes"]
        assert sum(t["bytes"] for t in arm["transfers_by_transport"].values()) == cross
        per_replica = arm["requests_per_replica"]
        assert per_replica["mean"] == 12 and per_replica["max"] >= 12
        assert per_replica["max_over_mean"] == pytest.approx(per_replica["max"] / 12)
        gate = arm["pull_gate"]
        assert gate["recomputed_blocks"] == tokens["recomputed"] // block_tokens
        assert gate["pulled_blocks"] == cross // block_bytes
        tail = arm["tail"]
        assert tail["all"]["requests"] == 24 and 1 <= tail["p99_and_slower"]["requests"] <= 24
        assert all(tail["all"][part] >= 0 for part in ("queue_s", "wait_s", "load_s", "compute_s"))
        assert 0 <= arm["first_tokens_as_offloading_off"] <= arm["requests"]
    assert doc["arms"]["off"]["hit_rate"] == 0 and doc["arms"]["off"]["first_tokens_as_offloading_off"] == 24
    assert doc["arms"]["affinity"]["transfers"]["cross_node_promotion"]["bytes"] == 0  # its own pool only
    # every block loaded, in every arm, is checked
    assert doc["blocks_verified"] == loaded_blocks
    assert set(doc["seconds"]) == {"start", *ARMS, "shutdown", "total"}
    assert doc["model"]["dim"] == 64 and doc["workload"]["requests"] == 24


def test_arguments_are_checked_before_anything_starts():
    done = run_demo("--arms", "distkv,sideways", timeout=60)
    assert done.returncode == 2 and "--arms 'distkv,sideways'" in done.stderr
    done = run_demo("--rate", "0", timeout=60)
    assert done.returncode == 2 and "a rate of 0.0 requests a second: must be a positive number" in done.stderr
    done = run_demo("--rate", "5", "--in-flight", "0", timeout=60)
    assert done.returncode == 2 and "--in-flight must be positive" in done.stderr


def test_an_open_loop_serves_the_trace_at_its_rate():
    done = run_demo(*SMALL, "--json", "--arms", "distkv-router", "--rate", "40")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert "an open loop of 40 requests a second" in done.stderr
    assert (doc["rate"], doc["in_flight"]) == (40, None)
    arm = doc["arms"]["distkv-router"]
    assert arm["requests"] == 24 and arm["hit_rate"] > 0
    assert doc["mismatches"] == 0 and doc["blocks_verified"] > 0


def test_ctrl_c_cleans_up():
    before = demo_segments()
    # Ctrl-C as at a terminal: a shell starts background commands with SIGINT ignored, and a
    # test run started so would hand that on to the demo, which then never sees the signal
    demo = subprocess.Popen(
        [sys.executable, "-m", "distkv", "demo", *SMALL, "--nodes", "1", "--replicas", "1", "--requests", "2000",
         "--arms", "distkv"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in demo.stdout:
            if line.lstrip().startswith("distkv ") and "requests" in line and "[" in line:  # requests being served
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
