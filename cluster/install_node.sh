#!/usr/bin/env bash
# Install what every node of a distkv Ray cluster runs, into the Python that runs Ray: distkv
# from this checkout with the `gpu` and `vllm` extras (CuPy, vLLM 0.33), Ray Serve of the
# installed Ray's version, and the other packages Ray Serve LLM imports. Ray's own `ray[llm]`
# extra is not used: it pins another vLLM (Ray 2.60: vllm==0.29.0).
# Used by cluster/ray-cluster.yaml (setup_commands) and cluster/Dockerfile.
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
ray_version="$("$python" -c 'import ray; print(ray.__version__)')"
"$python" -m pip install --no-cache-dir \
  "ray[serve]==${ray_version}" \
  ".[gpu,vllm]" \
  pyarrow pandas fsspec jsonref hf_transfer

# Ray 2.60's Serve LLM imports FrontendArgs from vllm.entrypoints.launchers.cli_args, where the
# vLLM it pins has it; vLLM 0.33 has it in vllm.entrypoints.common.cli_args. Until a Ray release
# supports vLLM 0.33, give the old module name the new module's contents.
"$python" - <<'EOF'
import importlib.util
from pathlib import Path

if importlib.util.find_spec("vllm.entrypoints.launchers.cli_args") is None:
    launchers = Path(importlib.util.find_spec("vllm.entrypoints.launchers").origin).parent
    (launchers / "cli_args.py").write_text(
        "# added by distkv's cluster/install_node.sh for Ray Serve LLM\n"
        "from vllm.entrypoints.common.cli_args import *  # noqa: F401,F403\n"
        "from vllm.entrypoints.common.cli_args import FrontendArgs  # noqa: F401\n"
    )
EOF
"$python" -c "import distkv.vllm, ray.serve.llm; from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig; print('distkv node ready: Ray', ray.__version__)"
