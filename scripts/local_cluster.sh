#!/usr/bin/env bash
# A Ray cluster of a head and worker nodes started with `ray start` on this machine, the distkv
# demo run against it with --address, and everything this script started stopped again, also on
# failure or Ctrl-C. It exits with the demo's status (0: every loaded block checked out).
#
#   scripts/local_cluster.sh [--workers N] [--cpus-per-node N] [--object-store-mib N] [-- DEMO ARGS]
#
# DEMO ARGS are passed to `python3 -m distkv demo` after this script's small defaults
# (--replicas 2 --requests 40 --pool-mib 32), so they override them: `-- --requests 200 --json`.
# The demo's output is this script's stdout; the script's own messages go to stderr.
#
# Only this script's processes are stopped: each node runs under `ray start --block` and is
# stopped by signalling that process (not `ray stop`, which stops every Ray on the machine), and
# every process of the cluster carries DISTKV_LOCAL_CLUSTER=<work dir>/<node> in its environment,
# so that any left behind is found and killed. Token authentication is on: the cluster gets a
# fresh token (or uses RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH if set) that nodes and the demo read.
set -euo pipefail
cd "$(dirname "$0")/.."

workers=1
cpus=1
object_store_mib=100
demo_args=(--replicas 2 --requests 40 --pool-mib 32)
usage_error() { echo "local_cluster.sh: $* (see --help)" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --workers|--cpus-per-node|--object-store-mib) [ $# -ge 2 ] || usage_error "$1 needs a value" ;;&
    --workers) workers="$2"; shift 2 ;;
    --cpus-per-node) cpus="$2"; shift 2 ;;
    --object-store-mib) object_store_mib="$2"; shift 2 ;;
    --) shift; demo_args+=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage_error "unknown option $1" ;;
  esac
done
for value in "$workers" "$cpus" "$object_store_mib"; do
  [[ "$value" =~ ^[1-9][0-9]*$ ]] || usage_error "'$value' is not a positive whole number"
done

# Job control: each node and the demo run in their own process group, where SIGINT is not
# ignored (the demo cleans up on SIGINT), and a Ctrl-C reaches only this script, which stops them.
set -m
PYTHON="${PYTHON:-python3}"
START_TIMEOUT_S=120
START_ATTEMPTS=3
work_dir="$(mktemp -d "${TMPDIR:-/tmp}/distkv-local-XXXXXX")"
log() { echo "local_cluster: [${SECONDS}s] $*" >&2; }
log "work dir $work_dir (Ray's temp dir, node logs, the token)"

export RAY_AUTH_MODE=token
if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then
  (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$work_dir/auth_token")
  export RAY_AUTH_TOKEN_PATH="$work_dir/auth_token"
fi

node_pids=()  # the `ray start --block` processes, head first
address=""
demo_pid=""
status=1

# "PID START" of the running processes whose environment carries a marker starting with $1, and
# with $2 = tree, of every descendant of the nodes too (a process whose title Ray rewrote no
# longer shows its environment). START tells a pid reused meanwhile apart.
snapshot() {
  local pids
  pids="$(
    {
      [ "${2:-}" = tree ] && ps -e -o pid= -o ppid= | awk -v roots="${node_pids[*]}" '
        { parent[$1] = $2 }
        END {
          n = split(roots, queue, " "); for (i = 1; i <= n; i++) mine[queue[i]] = 1
          for (changed = 1; changed;) {
            changed = 0
            for (pid in parent) if (!(pid in mine) && (parent[pid] in mine)) { mine[pid] = 1; changed = 1 }
          }
          for (pid in mine) print pid
        }'
      grep -lszF "DISTKV_LOCAL_CLUSTER=$1" /proc/[0-9]*/environ | sed -e 's|^/proc/||' -e 's|/environ$||'
    } | sort -un | paste -sd, -
  )" || true
  [ -z "$pids" ] || ps -o pid= -o lstart= -p "$pids" || true
}

# The pids of those "PID START" lines that still run the same process (zombies left out: they
# are gone, only not reaped yet).
still_running() {
  local pid start now
  while read -r pid start; do
    [ -n "$pid" ] || continue
    now="$(ps -o stat= -o lstart= -p "$pid" 2>/dev/null)" || continue
    [[ "$now" == Z* ]] && continue
    [ "$(echo ${now#* })" = "$(echo $start)" ] && echo "$pid"
  done
  return 0
}

wait_gone() {  # wait_gone SECONDS PID...: true once none of the pids runs (zombies do not)
  local deadline=$((SECONDS + $1)) pid alive; shift
  while :; do
    alive=0
    for pid in "$@"; do
      kill -0 "$pid" 2>/dev/null && [[ "$(ps -o stat= -p "$pid")" != Z* ]] && alive=1
    done
    [ "$alive" -eq 0 ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

stop() {  # stop PID...: SIGTERM, then SIGKILL what still runs 30 s later
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  wait_gone 30 "$@" || kill -KILL "$@" 2>/dev/null || true
}

reap() {  # reap PID...: collect this script's children once they ended (no job notices then)
  local pid
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

cleanup() {
  trap '' INT TERM
  set +e  # stop everything, whatever fails on the way
  local i before left ignored demo_stopped=""
  if [ -n "$demo_pid" ] && kill -0 "$demo_pid" 2>/dev/null; then
    # On SIGINT the demo removes its actors and pools. One that ignores SIGINT (this script was
    # started with SIGINT ignored, as by nohup) gets SIGTERM, and its pools are reclaimed below.
    ignored="$(awk '/^SigIgn:/ {print $2}' "/proc/$demo_pid/status" 2>/dev/null)"
    if (( 0x${ignored:-0} & 2 )); then
      kill -TERM "$demo_pid"
      demo_stopped=1
    else
      kill -INT "$demo_pid"
    fi
    wait_gone 30 "$demo_pid" || { kill -KILL "$demo_pid" 2>/dev/null; demo_stopped=1; }
    reap "$demo_pid"
  fi
  before="$(snapshot "$work_dir/" tree)"
  # workers first, then the head; each `ray start --block` stops its node's processes on SIGTERM
  for ((i = ${#node_pids[@]} - 1; i >= 0; i--)); do
    stop "${node_pids[i]}"
    reap "${node_pids[i]}"
  done
  left="$( { echo "$before"; snapshot "$work_dir/"; } | still_running | sort -un)"
  if [ -n "$left" ]; then
    log "stopping what the nodes left behind: $(ps -o pid= -o args= -p "$(echo $left | tr ' ' ,)" | cut -c1-100)"
    stop $left
  fi
  if [ -n "$demo_stopped" ]; then
    # the pools of replicas that could not shut down: only segments no live process holds go
    "$PYTHON" -c 'from distkv.pool import reclaim_stale_segments; reclaim_stale_segments()'
  fi
  if [ "$status" -eq 0 ]; then
    rm -rf "$work_dir"
  else
    log "failed (status $status); the nodes' output and Ray's logs are kept in $work_dir"
  fi
  log "stopped"
}
trap cleanup EXIT
trap 'status=130; exit 130' INT
trap 'status=143; exit 143' TERM

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_node NAME: one node under `ray start --block`, the head (NAME=head, which sets $address)
# or a worker joining it; every port free or left to Ray, so that other Ray clusters on this
# machine are left alone. Ray gives a starting node 30 s to register with the head: on a machine
# too busy for that the start fails, and is tried again.
start_node() {
  local name="$1" attempt marker node_log pid deadline args
  for ((attempt = 1; attempt <= START_ATTEMPTS; attempt++)); do
    marker="$work_dir/$name.$attempt"
    node_log="$marker.log"
    if [ "$name" = head ]; then
      address="127.0.0.1:$(free_port)"
      args=(--head --port="${address##*:}" --temp-dir="$work_dir/ray"
            --dashboard-port="$(free_port)" --ray-client-server-port="$(free_port)")
    else
      args=(--address="$address")
    fi
    : >"$node_log"
    RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 DISTKV_LOCAL_CLUSTER="$marker" ray start --block \
      --node-ip-address=127.0.0.1 \
      --num-cpus="$cpus" --object-store-memory=$((object_store_mib << 20)) \
      --dashboard-agent-listen-port="$(free_port)" --dashboard-agent-grpc-port="$(free_port)" \
      --runtime-env-agent-port="$(free_port)" --metrics-export-port="$(free_port)" \
      --disable-usage-stats "${args[@]}" >"$node_log" 2>&1 </dev/null &
    pid=$!
    deadline=$((SECONDS + START_TIMEOUT_S))
    while ! grep -q "Ray runtime started" "$node_log" && kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 0.2
    done
    if grep -q "Ray runtime started" "$node_log" && kill -0 "$pid" 2>/dev/null; then
      node_pids+=("$pid")
      log "$name up (pid $pid)"
      return 0
    fi
    log "$name did not start (attempt $attempt of $START_ATTEMPTS); the end of its output:"
    tail -n 3 "$node_log" >&2
    stop "$pid"
    reap "$pid"
    stop $(snapshot "$marker" | still_running)
  done
  return 1
}

start_node head
for ((i = 1; i <= workers; i++)); do
  start_node "worker$i"
done

# the demo places replicas on the nodes alive when it starts: wait for all of them
"$PYTHON" - "$address" $((workers + 1)) "$START_TIMEOUT_S" <<'EOF'
import logging, sys, time
import ray
address, expected, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
deadline = time.monotonic() + timeout_s
while sum(n["Alive"] for n in ray.nodes()) < expected:
    if time.monotonic() > deadline:
        sys.exit(f"local_cluster: {expected} nodes not alive within {timeout_s:.0f} s")
    time.sleep(0.2)
EOF
log "$((workers + 1)) nodes alive at $address; distkv demo --address $address ${demo_args[*]}"

"$PYTHON" -m distkv demo --address "$address" "${demo_args[@]}" &
demo_pid=$!
set +e
wait "$demo_pid"
status=$?
set -e
demo_pid=""
log "demo exited with status $status"
exit "$status"
