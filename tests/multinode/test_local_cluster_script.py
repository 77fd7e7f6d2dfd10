"""scripts/local_cluster.sh: two nodes started with `ray start`, the demo with --address, all stopped.

The script is what a user runs to try distkv on a real (if local) multi-node Ray cluster; here
it runs with a short demo, and everything it started must be gone afterwards.
"""

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "local_cluster.sh"
TIMEOUT_S = 300  # nodes start in a few seconds on an idle machine, in tens when it is shared

pytestmark = pytest.mark.skipif(
    shutil.which("ray") is None or not Path("/proc/self/environ").exists(),
    reason="needs the ray command and /proc",
)


def run_script(*args: str) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        ["bash", str(SCRIPT), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the script stops its cluster on SIGTERM
        stdout, stderr = process.communicate(timeout=120)
        pytest.fail(f"local_cluster.sh did not finish in {TIMEOUT_S} s; stderr:\n{stderr[-30000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def processes_of(work_dir: str) -> list[str]:
    """Running processes that carry the script's marker (DISTKV_LOCAL_CLUSTER=<work_dir>/<node>)
    or name work_dir on their command line."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        marker = f"DISTKV_LOCAL_CLUSTER={work_dir}/".encode()
        if any(v.startswith(marker) for v in environ) or work_dir.encode() in cmdline:
            found.append(f"{proc.name}: {cmdline[:120].decode(errors='replace')}")
    return found


def test_two_ray_start_nodes_run_the_demo_and_are_stopped():
    result = run_script("--", "--requests", "30", "--json")
    work_dir = re.search(r"work dir (\S+)", result.stderr).group(1)
    node_pids = [int(pid) for pid in re.findall(r"up \(pid (\d+)\)", result.stderr)]

    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)
    assert summary["nodes"] == 2
    assert summary["mismatches"] == 0
    assert summary["blocks_verified"] > 0
    # Serve's default router lands requests away from their prefixes: blocks cross the nodes
    transfers = summary["arms"]["distkv"]["transfers"]
    assert transfers["cross_node_promotion"]["blocks"] > 0, "distkv: no block crossed the two nodes"
    # distkv's router sends requests to the replicas holding their prefixes, through the
    # Directory of the two nodes (whether it also pulls across them depends on the load: in
    # one run of 30 requests it did not)
    routed = summary["arms"]["distkv-router"]["routed"]
    assert routed["holder"] > 0, f"distkv-router: no request was routed to a holder of its prefix: {routed}"

    assert len(node_pids) == 2  # each node's `ray start --block` carries the marker too
    assert processes_of(work_dir) == []
    assert not Path(work_dir).exists()


def test_bad_option_fails_before_starting_anything():
    result = run_script("--workers", "two")
    assert result.returncode == 2
    assert "not a positive whole number" in result.stderr
