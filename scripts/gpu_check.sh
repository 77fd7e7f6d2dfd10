#!/usr/bin/env bash
# distkv's one GPU check, ready to run on a GPU machine as it is: torch with CUDA, CuPy,
# numpy and xxhash installed; no Ray, no vLLM, no package index. What else it needs comes as
# wheels in WHEELS (pytest and its dependencies, nixl and nixl-cu13): gather them on a
# machine with an index with
#   pip download --no-deps -d wheels pytest pluggy iniconfig packaging nixl nixl-cu13
# In one go (within 8 minutes): tests/gpu, bench/transfer.py --device cuda beside a pinned
# cudaMemcpy, and a NIXL READ from a host pool into GPU memory; the figures go to one JSON
# file. Without CUDA it runs and reports every part skipped.
# Usage: scripts/gpu_check.sh [OUT.json]   (default: $OUT/gpu_check.json, else ./gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}/gpu_check.json}"
if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl
fi
exec timeout 480 python3 bench/gpu_check.py --out "$out" --budget-s 450
