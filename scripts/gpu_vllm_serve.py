#!/usr/bin/env python3
"""Two `vllm serve` replicas with distkv on one GPU: replica B's prefix hit and its TTFT.

Starts a one-node Ray cluster and two vLLM replicas (A and B, each with a share of the GPU
given by --gpu-memory-utilization) that load distkv through vLLM's OffloadingConnector in
the same cache namespace. Then, on B:
  cold  a long prompt no replica has seen: computed in full;
  warm  a long prompt whose prefix A has just served: B finds A's blocks in the Directory,
        promotes them into its own pool and loads them instead of computing them.
Prints B's cached prompt tokens per request, B's external prefix-cache counters and distkv
metrics from its /metrics, and the TTFT of both requests.

Needs a CUDA machine with `pip install 'ray-distkv[vllm]'` and the model in the Hugging Face
cache (or network access). Stops the Ray cluster it started (`ray stop`) when done.

    python3 scripts/gpu_vllm_serve.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="per replica")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--prefix-records", type=int, default=700, help="lines of the shared prefix (~10 tokens each)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per offloaded block")
    p.add_argument("--cpu-bytes", type=int, default=4_000_000_000, help="distkv pool per replica")
    p.add_argument("--ports", type=int, nargs=2, default=[8101, 8102])
    p.add_argument("--out", default="gpu_vllm_serve_logs", help="where the replicas' logs go")
    p.add_argument("--start-timeout", type=float, default=900.0)
    return p.parse_args()


def kv_transfer_config(args: argparse.Namespace, replica: str) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": f"distkv-serve-{replica}",
            "kv_connector_extra_config": {
                "spec_name": "RayOffloadingSpec",
                "spec_module_path": "distkv.vllm",
                "block_size": args.block_size,
                "cpu_bytes_to_use": args.cpu_bytes,
                "ray_address": "auto",
                "tenant_salt": "gpu-vllm-serve",
            },
        }
    )


def start_replica(args: argparse.Namespace, replica: str, port: int, out: Path) -> subprocess.Popen:
    cmd = [
        "vllm", "serve", args.model,
        "--port", str(port),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-model-len", str(args.max_model_len),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", kv_transfer_config(args, replica),
    ]
    # sha256 block hashes (vLLM's default) are equal across processes; a fixed seed keeps
    # them equal with a non-cryptographic --prefix-caching-hash-algo too.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    log = open(out / f"replica_{replica}.log", "w")
    print(f"starting replica {replica} on :{port} (log {log.name})", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"replica on :{port} exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise SystemExit(f"replica on :{port} not healthy after {timeout_s:.0f}s")


def long_prompt(seed: int, records: int, question: str) -> str:
    rng = random.Random(seed)
    lines = [
        f"Record {i}: sensor {rng.randrange(10_000)} read {rng.random():.4f} at station {rng.randrange(500)}."
        for i in range(records)
    ]
    return "Inventory log.\n" + "\n".join(lines) + f"\n\nQuestion: {question}\nAnswer:"


def complete(port: int, model: str, prompt: str) -> tuple[float, int, int | None]:
    """Stream one completion: (seconds to the first token, prompt tokens, cached prompt tokens)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    ttft = None
    usage = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None or usage is None:
        raise SystemExit(f"no token or no usage from :{port}")
    details = usage.get("prompt_tokens_details") or {}
    return ttft, usage["prompt_tokens"], details.get("cached_tokens")


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """distkv's series and vLLM's prefix-cache counters, summed over all but the `path` label."""
    wanted = ("distkv:", "vllm:external_prefix_cache_", "vllm:prefix_cache_", "vllm:kv_offload_load_bytes")
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name.endswith("_created"):
            continue
        path = [label for label in labels.rstrip("}").split(",") if label.startswith("path=")]
        key = f"{name}{{{path[0]}}}" if path else name
        found[key] = found.get(key, 0.0) + float(value)
    return found


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port_a, port_b = args.ports
    subprocess.run(["ray", "start", "--head", "--disable-usage-stats", "--include-dashboard=false"], check=True)
    procs: list[subprocess.Popen] = []
    try:
        # one after the other: each replica sizes its KV cache from the GPU memory left
        for replica, port in (("a", port_a), ("b", port_b)):
            procs.append(start_replica(args, replica, port, out))
            wait_healthy(procs[-1], port, args.start_timeout)
        for port in (port_a, port_b):  # first requests pay one-time costs; keep them out of the figures
            complete(port, args.model, "Hello, world.")

        shared = long_prompt(1, args.prefix_records, "Which station appears most often?")
        unseen = long_prompt(2, args.prefix_records, "Which station appears most often?")
        cold_ttft, cold_tokens, cold_cached = complete(port_b, args.model, unseen)
        a_ttft, a_tokens, _ = complete(port_a, args.model, shared)
        time.sleep(3)  # A's stores land after its request finishes; the Directory then tells B
        before = metrics(port_b)
        warm_ttft, warm_tokens, warm_cached = complete(port_b, args.model, shared)
        after = metrics(port_b)

        print()
        print(f"model {args.model}; offloaded block {args.block_size} tokens")
        print(f"replica A, shared prompt ({a_tokens} tokens):  TTFT {a_ttft * 1000:8.1f} ms (computed)")
        print(f"replica B, cold prompt   ({cold_tokens} tokens): TTFT {cold_ttft * 1000:8.1f} ms, cached tokens {cold_cached}")
        print(f"replica B, shared prompt ({warm_tokens} tokens): TTFT {warm_ttft * 1000:8.1f} ms, cached tokens {warm_cached}")
        print(f"replica B TTFT warm / cold: {warm_ttft / cold_ttft:.3f}")
        print("replica B /metrics, change over the shared request:")
        for name in sorted(set(before) | set(after)):
            delta = after.get(name, 0.0) - before.get(name, 0.0)
            print(f"  {name:60s} {after.get(name, 0.0):14.1f}  (+{delta:.1f})")
    finally:
        stop(procs)
        subprocess.run(["ray", "stop"], check=False)


if __name__ == "__main__":
    sys.exit(main())
