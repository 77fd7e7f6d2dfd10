"""The configuration under cluster/ (and every other YAML and JSON file of the checkout): it parses,
it validates against the schema it targets where one is at hand, and the files that describe the
same cluster agree with each other, with distkv's configuration and with the installed Ray and vLLM.
"""

import copy
import json
import os
import re
import sys
from pathlib import Path

import pytest
import ray
import yaml

from distkv.config import DistkvConfig

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "ray-cluster.yaml"
SERVE = CLUSTER / "serve" / "llm-distkv.yaml"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
RAYSERVICE = CLUSTER / "kuberay" / "rayservice.yaml"
PODMONITOR = CLUSTER / "kuberay" / "podmonitor.yaml"
PROMETHEUS = CLUSTER / "prometheus" / "prometheus.yml"
DASHBOARD = CLUSTER / "grafana" / "distkv-dashboard.json"
INSTALL_NODE = CLUSTER / "install_node.sh"
DOCKERFILE = CLUSTER / "Dockerfile"
METRICS_PORT = 8080
# not the project's own files: tools' caches, build output, virtual environments
SKIPPED_DIRS = {".git", ".venv", "build", "dist", ".pytest_cache", ".hypothesis", "__pycache__", "artifacts"}

# vLLM's OffloadingConnector reads these keys of kv_connector_extra_config itself
# (distkv.vllm.VLLM_CONNECTOR_KEYS, importable only with vLLM)
VLLM_EXTRA_KEYS = {"blocks_per_chunk", "canonical_layout", "offload_prompt_only", "self_describing_kv_events",
                   "sync_load_budget_bytes"}


def config_files() -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        found += [Path(dirpath) / f for f in filenames if f.endswith((".yaml", ".yml", ".json"))]
    return sorted(found)


def load(path: Path):
    return yaml.safe_load(path.read_text())


def size_bytes(text: str) -> int:
    """'96g' (docker) or '96Gi' (Kubernetes) or '16000000000' as bytes."""
    number, unit = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", str(text)).groups()
    units = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "ki": 1 << 10, "mi": 1 << 20,
             "gi": 1 << 30, "ti": 1 << 40, "K": 1000, "M": 10**6, "G": 10**9, "T": 10**12}
    return int(number) * units.get(unit, units.get(unit.lower()))


def test_the_cluster_configs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in config_files()}
    expected = {LAUNCHER, SERVE, RAYCLUSTER, RAYSERVICE, PODMONITOR, PROMETHEUS, DASHBOARD}
    assert {p.relative_to(ROOT).as_posix() for p in expected} <= names


@pytest.mark.parametrize("path", config_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_yaml_and_json_file_parses(path):
    text = path.read_text()
    documents = [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))
    assert documents and all(isinstance(d, dict) and d for d in documents), f"{path} holds no mapping"


# ---- the Ray cluster launcher ------------------------------------------------------------


def test_launcher_config_validates_against_rays_schema():
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = load(LAUNCHER)
    jsonschema.validate(config, schema)
    # what `ray up` does with it before it contacts the cloud: merge the provider's defaults, check
    validate_config(prepare_config(copy.deepcopy(config)))


def test_launcher_has_a_cpu_head_and_gpu_workers_on_rays_image():
    config = load(LAUNCHER)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t.get("min_workers", 0) >= 1 for t in workers)
    assert all(re.match(r"(g|p)\d", t["node_config"]["InstanceType"]) for t in workers), "GPU instance types"
    assert config["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    assert f"FROM rayproject/ray:{ray.__version__}-py311-gpu" in DOCKERFILE.read_text()


def test_launcher_installs_distkv_with_the_gpu_and_vllm_extras():
    config = load(LAUNCHER)
    assert config["file_mounts"]["~/distkv"] == "."
    assert "bash ~/distkv/cluster/install_node.sh" in config["setup_commands"]
    assert '".[gpu,vllm]"' in INSTALL_NODE.read_text()
    assert "bash /home/ray/distkv/cluster/install_node.sh" in DOCKERFILE.read_text()


def test_launcher_keeps_token_auth_on_and_exports_metrics():
    config = load(LAUNCHER)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        assert "RAY_AUTH_MODE=token ray start" in command
        assert f"--metrics-export-port={METRICS_PORT}" in command
        assert "--object-store-memory=" in command
    for path in CLUSTER.rglob("*"):
        if path.is_file():
            assert not re.search(r"RAY_AUTH_MODE\W+disabled|mode:\s*disabled", path.read_text()), path


def replicas_per_gpu_node() -> tuple[int, int]:
    """(replicas per GPU node, each replica's host memory in /dev/shm: vLLM's CPU tier and
    distkv's pool) from the Serve config."""
    (llm,) = load(SERVE)["applications"][0]["args"]["llm_configs"]
    extra = llm["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]
    workers = load(RAYCLUSTER)["spec"]["workerGroupSpecs"][0]["replicas"]
    tiers = sum(tier["cpu_bytes_to_use"] for tier in extra.get("secondary_tiers", []))
    return llm["deployment_config"]["num_replicas"] // workers, extra["cpu_bytes_to_use"] + tiers


def test_launcher_shm_holds_the_pools_and_the_object_store():
    config = load(LAUNCHER)
    replicas, pool = replicas_per_gpu_node()
    (start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    object_store = int(re.search(r"--object-store-memory=(\d+)", start).group(1))
    (shm,) = [o.split("=", 1)[1] for o in config["docker"]["worker_run_options"] if o.startswith("--shm-size=")]
    assert size_bytes(shm) >= replicas * pool + object_store
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    (head_shm,) = [o.split("=", 1)[1] for o in config["docker"]["head_run_options"] if o.startswith("--shm-size=")]
    assert size_bytes(head_shm) >= int(re.search(r"--object-store-memory=(\d+)", head_start).group(1))


# ---- KubeRay ----------------------------------------------------------------------------


def pods(spec: dict) -> list[tuple[dict, dict]]:
    """(rayStartParams, pod spec) of the head group and every worker group."""
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [(g["rayStartParams"], g["template"]["spec"]) for g in groups]


def test_kuberay_manifests_are_a_raycluster_and_a_rayservice_of_the_same_cluster():
    cluster, service = load(RAYCLUSTER), load(RAYSERVICE)
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    assert service["spec"]["rayClusterConfig"] == cluster["spec"]
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == load(SERVE)
    assert cluster["spec"]["rayVersion"] == ray.__version__


def test_kuberay_cluster_keeps_token_auth_on_and_every_pod_exports_metrics():
    spec = load(RAYCLUSTER)["spec"]
    assert spec["authOptions"] == {"mode": "token"}
    images = set()
    for params, pod in pods(spec):
        assert params["metrics-export-port"] == str(METRICS_PORT)
        (container,) = pod["containers"]
        images.add(container["image"])
        assert {"containerPort": METRICS_PORT, "name": "metrics"} in container["ports"]
        assert not any(e.get("name", "").startswith("RAY_AUTH") for e in container.get("env", []))
    assert len(images) == 1, "every pod runs the image cluster/Dockerfile builds"
    monitor = load(PODMONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_kuberay_shm_holds_the_pools_and_the_object_store_within_the_memory_limit():
    spec = load(RAYCLUSTER)["spec"]
    replicas, pool = replicas_per_gpu_node()
    for i, (params, pod) in enumerate(pods(spec)):
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        shm = size_bytes(volume["emptyDir"]["sizeLimit"])
        pools = replicas * pool if i > 0 else 0  # the head runs no replica
        assert shm >= pools + int(params["object-store-memory"])
        # a Memory emptyDir counts against the container's memory limit
        assert size_bytes(container["resources"]["limits"]["memory"]) > shm
    gpu_limits = [p["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for _, p in pods(spec)[1:]]
    assert [int(g) for g in gpu_limits] == [replicas] * len(gpu_limits), "one replica per GPU"


# ---- the Ray Serve LLM application ------------------------------------------------------------


def llm_config() -> dict:
    (app,) = load(SERVE)["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    (llm,) = app["args"]["llm_configs"]
    return llm


def test_serve_config_runs_vllms_tiering_with_distkv_as_a_tier():
    kv = llm_config()["engine_kwargs"]["kv_transfer_config"]
    assert (kv["kv_connector"], kv["kv_role"]) == ("OffloadingConnector", "kv_both")
    assert "engine_id" not in kv, "replicas need one engine_id each: vLLM makes it"
    extra = kv["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    assert (tier["type"], tier["module_path"], tier["ray_address"]) == ("DistkvTier", "distkv.vllm_tier", "auto")
    DistkvConfig.from_extra_config({k: v for k, v in tier.items() if k not in ("type", "module_path")})


def test_serve_config_shows_distkvs_spec_as_the_alternative():
    """The commented alternative is a valid kv_connector_extra_config of distkv's spec."""
    lines = SERVE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "replace kv_connector_extra_config with" in line)
    block = []
    for line in lines[start + 1:]:
        if not line.strip().startswith("#   "):
            break
        block.append(line.strip()[4:])
    extra = yaml.safe_load("\n".join(block))
    assert (extra["spec_name"], extra["spec_module_path"]) == ("RayOffloadingSpec", "distkv.vllm")
    DistkvConfig.from_extra_config({k: v for k, v in extra.items() if k not in VLLM_EXTRA_KEYS})
    assert extra["cpu_bytes_to_use"] == replicas_per_gpu_node()[1], "the same host memory either way"


def test_serve_config_routes_with_distkvs_router():
    llm = llm_config()
    assert llm["server_cls"] == "distkv.serve_llm.DistkvLLMServer"
    router = llm["deployment_config"]["request_router_config"]["request_router_class"]
    assert router == "distkv.serve_router.DistkvRequestRouter"
    from ray.serve.config import RequestRouterConfig

    assert RequestRouterConfig(request_router_class=router).get_request_router_class().__name__ == "DistkvRequestRouter"


def test_serve_config_engine_kwargs_are_vllm_arguments():
    pytest.importorskip("vllm.v1.kv_offload.base")
    import dataclasses

    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import FrontendArgs

    import distkv.vllm

    assert VLLM_EXTRA_KEYS == set(distkv.vllm.VLLM_CONNECTOR_KEYS)
    engine_kwargs = llm_config()["engine_kwargs"]
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)} | {f.name for f in dataclasses.fields(FrontendArgs)}
    assert set(engine_kwargs) <= known
    kv = KVTransferConfig(**engine_kwargs["kv_transfer_config"])
    (tier,) = kv.kv_connector_extra_config["secondary_tiers"]
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from distkv.vllm_tier import DistkvTier

    assert SecondaryTierFactory.get_tier_class(tier) is DistkvTier


def test_serve_config_builds_with_ray_serve_llm(monkeypatch):
    """Where Ray Serve LLM is importable (ray[serve] and vLLM installed, as on the nodes)."""
    try:
        from ray.serve.llm import LLMServingArgs, build_openai_app
        from ray.serve.schema import ServeDeploySchema
    except ImportError as e:
        pytest.skip(f"Ray Serve LLM is not importable: {e}")
    pytest.importorskip("vllm.entrypoints.common.cli_args")
    import importlib.util

    if importlib.util.find_spec("vllm.entrypoints.launchers.cli_args") is None:
        # what cluster/install_node.sh adds on the nodes for Ray 2.60's Serve LLM
        import vllm.entrypoints.common.cli_args

        monkeypatch.setitem(sys.modules, "vllm.entrypoints.launchers.cli_args", vllm.entrypoints.common.cli_args)
    config = load(SERVE)
    ServeDeploySchema(**config)
    args = config["applications"][0]["args"]
    (llm,) = LLMServingArgs(**args).llm_configs
    assert llm.get_engine_config().engine_kwargs["kv_transfer_config"] == llm_config()["engine_kwargs"]["kv_transfer_config"]
    build_openai_app(args)


# ---- Prometheus and Grafana ---------------------------------------------------------------


def test_prometheus_config_is_well_formed():
    config = load(PROMETHEUS)
    for key in ("scrape_interval", "evaluation_interval"):
        assert re.fullmatch(r"\d+(ms|s|m|h)", config["global"][key])
    jobs = config["scrape_configs"]
    assert len({job["job_name"] for job in jobs}) == len(jobs)
    for job in jobs:
        assert set(job) & {"static_configs", "file_sd_configs", "kubernetes_sd_configs"}


def test_grafana_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["type"] and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
