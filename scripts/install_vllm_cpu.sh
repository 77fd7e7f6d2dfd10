#!/usr/bin/env bash
# Install vLLM 0.33 without its CUDA stack, for CPU-only tests of distkv.vllm (tests/vllm).
#
# vLLM's wheel pins a CUDA build of torch and GPU kernels; here it goes in with --no-deps,
# over the torch already installed (scripts/install.sh pins the CPU build, torch==2.13.0), plus the
# pure-Python packages that importing the OffloadingConnector, the v1 Scheduler and a model
# config needs. Ranges follow vLLM 0.33's own requirements. xgrammar also goes in with
# --no-deps: its own dependencies would pull ~1 GB of triton, which nothing here runs.
# Serving a model needs the full install instead: pip install 'ray-distkv[vllm]'.
set -euo pipefail
# Whatever resolves below must keep the torch that is installed.
keep=$(mktemp)
trap 'rm -f "$keep"' EXIT
python3 -c "import torch; print('torch==' + torch.__version__)" >"$keep"
pip=(python3 -m pip install -q -c "$keep")
"${pip[@]}" --no-deps "vllm==0.33.0" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"
"${pip[@]}" \
  "transformers>=5.16.1,<5.21.0" \
  "fastapi>=0.133.0,<0.137.0" \
  "llguidance>=1.7.0,<1.8.0" \
  "openai>=2.25.0" \
  openai-harmony \
  msgspec psutil pyzmq cbor2 pillow pybase64 cachetools uvloop partial-json-parser einops \
  cloudpickle py-cpuinfo
python3 -c "import torch, vllm.v1.kv_offload.base; print('vLLM', vllm.__version__, 'over torch', torch.__version__)"
