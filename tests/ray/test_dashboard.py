"""The Ray dashboard, in a headless Chromium, lists distkv's actors; Prometheus can find the node.

The browser is driven over the DevTools protocol on a pipe (no port): the dashboard of a Ray
with token authentication wants the token as a cookie, which only the protocol can set. A
screenshot of the actors page is kept in the test's tmp dir and in tests/artifacts/.
"""

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import ray

from distkv.replica.harness import Replica
from distkv.names import RAY_NAMESPACE, agent_name, shard_name
from distkv.replica.specs import ClusterOffloadingSpec
from ray_actors.directory import get_or_create_shards, kill_shards

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PAGE_BYTES = 16 << 10

class Chromium:
    """A headless Chromium driven over the DevTools protocol on the pipe of its fds 3 and 4."""

    def __init__(self, user_data_dir: Path, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # above the fds the shell is about to set, so that moving them cannot clobber one
        theirs = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)]
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)
        args = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe", "--window-size=1600,1000", "about:blank",
        ]
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{theirs[0]} 4>&{theirs[1]} {theirs[0]}<&- {theirs[1]}>&-', *args],
            pass_fds=theirs,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fd in theirs:
            os.close(fd)
        self._write, self._read = to_browser_w, from_browser_r
        self._buffer = b""
        self._next_id = 0

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._read], [], [], left)[0]:
                    raise TimeoutError(f"Chromium did not answer {method} within {self.timeout_s} s")
                chunk = os.read(self._read, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (code {self.process.poll()}) during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:  # anything else is an event
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(10)
        except Exception:
            self.process.kill()
            self.process.wait(10)
        finally:
            os.close(self._write)
            os.close(self._read)


def dashboard_token() -> str | None:
    """The token the dashboard wants (None when token authentication is off)."""
    from ray._raylet import AuthenticationTokenLoader

    header = AuthenticationTokenLoader.instance().get_token_for_http_header().get("authorization")
    return header.split(" ", 1)[1] if header else None


@pytest.fixture
def replica(ray_with_dashboard):
    """A replica in this process: it starts the node's NodeAgent and its namespace's Directory shard."""
    spec = ClusterOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": 64 * 2 * PAGE_BYTES, "tenant_salt": uuid.uuid4().hex},
        gpu_block_sizes=[16],
        group_page_bytes=[2 * PAGE_BYTES],
        engine_id=f"r{uuid.uuid4().hex[:8]}",
    )
    r = Replica(spec, num_gpu_blocks=8, page_bytes=PAGE_BYTES)
    yield r
    r.shutdown()
    kill_shards(spec.namespace)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no {CHROMIUM} (Debian's chromium package)")
def test_dashboard_lists_the_directory_and_node_agent(ray_with_dashboard, replica, tmp_path):
    url = f"http://{ray_with_dashboard.dashboard_url}"
    expected = [
        "DirectoryShard",
        shard_name(replica.spec.namespace, 0),
        "NodeAgent",
        agent_name(ray.get_runtime_context().get_node_id()),
    ]
    ray.get(get_or_create_shards(replica.spec.namespace, 1)[0].stats.remote())  # alive by now
    browser = Chromium(tmp_path / "chromium-profile")
    try:
        token = dashboard_token()
        if token is not None:
            browser.call("Storage.setCookies", {"cookies": [{"name": "ray-authentication-token", "value": token, "url": url}]})
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        page = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        browser.call("Page.navigate", {"url": f"{url}/#/actors"}, page)
        deadline = time.monotonic() + 60
        loaded = time.monotonic()
        while True:
            text = browser.call(
                "Runtime.evaluate", {"expression": "document.body ? document.body.innerText : ''", "returnByValue": True},
                page,
            )["result"].get("value", "")
            missing = [name for name in expected if name not in text]
            if not missing and "PENDING" not in text or time.monotonic() > deadline:
                break
            if time.monotonic() - loaded > 3:  # the page lists what it fetched when it loaded
                browser.call("Page.reload", {}, page)
                loaded = time.monotonic()
            time.sleep(0.25)
        screenshot = tmp_path / "ray-dashboard-actors.png"
        screenshot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", {"format": "png"}, page)["data"]))
    finally:
        browser.close()
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(screenshot, ARTIFACTS / screenshot.name)
    assert not missing, f"the actors page does not list {missing}; it shows:\n{text[:2000]}"
    assert "PENDING" not in text and "ALIVE" in text
    assert screenshot.stat().st_size > 10_000


@ray.remote(num_cpus=0)
class Bystander:
    """A user's actor: its calls are in Ray's task list."""

    def ping(self) -> int:
        return 1


def test_the_directory_s_and_node_agent_s_calls_stay_out_of_ray_s_task_list(ray_with_dashboard, replica):
    """A fleet's publishes, polls and queries are thousands a second: kept among Ray's task
    events, they would push a user's own tasks out of the dashboard's list."""
    from ray.util.state import list_tasks

    shard = get_or_create_shards(replica.spec.namespace, 1)[0]
    agent = ray.get_actor(agent_name(ray.get_runtime_context().get_node_id()), namespace=RAY_NAMESPACE)
    ray.get([shard.stats.remote(), shard.query.remote([], replica.spec.namespace), agent.node_id.remote()])
    bystander = Bystander.remote()
    ray.get(bystander.ping.remote())
    # This process reports the events of the tasks it submits in order: once the bystander's
    # call is listed, the calls submitted before it would be too.
    deadline = time.monotonic() + 60
    while not list_tasks(filters=[("name", "=", "Bystander.ping")]):
        assert time.monotonic() < deadline, "Ray never listed the bystander's call"
        time.sleep(0.25)
    names = {task.name for task in list_tasks(limit=10_000)}
    assert not {name for name in names if name.startswith(("DirectoryShard.", "NodeAgent.")) and "__init__" not in name}


def test_service_discovery_file_lists_this_node(ray_with_dashboard):
    """What cluster/prometheus/prometheus.yml reads: the session's file names this node's endpoint."""
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    endpoint = f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
    path = session_dir / PROMETHEUS_SERVICE_DISCOVERY_FILE
    deadline = time.monotonic() + 30
    while not (path.exists() and any(endpoint in group["targets"] for group in json.loads(path.read_text()))):
        assert time.monotonic() < deadline, f"{path} does not list {endpoint}"
        time.sleep(0.25)
    assert Path("/tmp/ray", PROMETHEUS_SERVICE_DISCOVERY_FILE).exists()  # the link prometheus.yml names
