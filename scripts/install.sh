#!/usr/bin/env bash
# Install distkv from this checkout with the right torch: on a CUDA machine PyPI's default
# build plus CuPy (extra "gpu"); elsewhere the CPU build, torch==2.13.0, so that no multi-GB
# CUDA wheel is pulled. Usage: scripts/install.sh [EXTRA[,EXTRA...]]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras="gpu${extras:+,$extras}"
  torch=()
else
  torch=("torch==2.13.0")
fi
install() { python3 -m pip install -q ${torch[@]+"${torch[@]}"} -e ".${1:+[$1]}"; }
# NIXL (extra "rdma") reads blocks between nodes one-sidedly; where it does not install, the
# object store carries them. The tests run the NIXL transport too: there it must install.
case ",$extras," in
  *,test,*) install "$extras,rdma" ;;
  *) install "${extras:+$extras,}rdma" || {
       echo "install.sh: NIXL (extra rdma) does not install here: blocks cross nodes through Ray's object store" >&2
       install "$extras"
     } ;;
esac
# tests/vllm run against vLLM 0.33 installed without its CUDA stack.
case ",$extras," in *,test,*) bash scripts/install_vllm_cpu.sh ;; esac
# tests/ray/test_dashboard.py drives Debian's chromium headless (it skips without it): about 30 s
# of apt the first time, nothing once installed.
install_chromium() {
  [ -x /usr/bin/chromium ] && return 0
  command -v apt-get >/dev/null 2>&1 || { echo "install.sh: no apt-get, no chromium: tests/ray/test_dashboard.py will skip" >&2; return 0; }
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install.sh: not root and no sudo, no chromium: tests/ray/test_dashboard.py will skip" >&2; return 0; }
    sudo=(sudo -n)
  fi
  { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "install.sh: installing chromium failed: tests/ray/test_dashboard.py will skip" >&2
}
case ",$extras," in *,test,*) install_chromium ;; esac
