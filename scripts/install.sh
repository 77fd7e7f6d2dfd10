#!/usr/bin/env bash
# Install distkv from this checkout with the right torch: on a CUDA machine PyPI's default
# build plus CuPy (extra "gpu"); elsewhere the CPU build, torch==2.13.0, so that no multi-GB
# CUDA wheel is pulled. Usage: scripts/install.sh [EXTRA[,EXTRA...]]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras="gpu${extras:+,$extras}"
  python3 -m pip install -q -e ".[${extras}]"
else
  python3 -m pip install -q "torch==2.13.0" -e ".${extras:+[$extras]}"
fi
# tests/vllm run against vLLM 0.33 installed without its CUDA stack.
case ",$extras," in *,test,*) bash scripts/install_vllm_cpu.sh ;; esac
