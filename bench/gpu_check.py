"""distkv's CUDA path on a GPU machine, in one go: what scripts/gpu_check.sh runs.

    python bench/gpu_check.py --out gpu_check.json [--budget-s 450]

Three parts, each reported as {"status": "ok" | "failed" | "skipped", "reason", figures}:
- tests_gpu: `pytest tests/gpu` (the CUDA handlers against the CPU backend, bit-exact);
- transfer: `bench/transfer.py --device cuda`, the handlers beside a pinned cudaMemcpy;
- nixl_to_gpu: a holder process seals blocks in a host pool and registers it with NIXL;
  this process reads them one-sidedly straight into GPU memory, checks every byte, and
  times the READ beside a cudaMemcpy of the same bytes from a pinned host buffer.
Needs no Ray and no vLLM: torch, CuPy, numpy, xxhash, and for the last part nixl
(nixl-cu13 here). Without CUDA every part is skipped, saying why. Exits 1 if a part failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout, uninstalled

MiB = 1 << 20
NIXL_BYTES = 256 * MiB


def no_cuda_reason() -> str | None:
    """Why the CUDA parts cannot run here, or None when they can."""
    try:
        import torch
    except ImportError as e:
        return f"no torch: {e}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"CuPy cannot use the GPU: {e!r}"
    return None


def tests_gpu(budget_s: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=budget_s,
    )
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    status = "ok" if done.returncode == 0 and counts.get("passed") else "failed"
    return {"status": status, "summary": summary, **counts, "output_tail": done.stdout[-2000:] + done.stderr[-2000:]}


def transfer(budget_s: float, out_dir: Path) -> dict[str, Any]:
    path = out_dir / "transfer.json"
    done = subprocess.run(
        [sys.executable, "bench/transfer.py", "--device", "cuda", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=budget_s,
    )
    if done.returncode != 0 or not path.exists():
        return {"status": "failed", "output_tail": done.stdout[-2000:] + done.stderr[-2000:]}
    return {"status": "ok", **json.loads(path.read_text()), "output": done.stdout[-2000:]}


def _holder(name: str, layout: tuple[int, int, int], conn) -> None:
    """Seal row i with bytes i+1 (every byte), register the pool, serve until told."""
    import numpy as np

    from distkv.storage.pool import HostPool, PoolLayout
    from distkv.transfer.rdma import NixlAgent

    pool = HostPool(name, PoolLayout(*layout))
    rows = np.arange(pool.layout.num_rows)
    pool.begin_write(0, rows)
    for row in rows.tolist():
        pool.payload[0, row] = row + 1
    pool.seal(0, rows, [f"block-{row:04d}".encode() for row in rows.tolist()],
              np.arange(1, len(rows) + 1, dtype=np.uint64), pool.layout.slot_bytes)
    agent = NixlAgent()
    conn.send(agent.endpoint(pool))
    conn.recv()
    agent.close()
    pool.close()


def nixl_to_gpu() -> dict[str, Any]:
    import cupy
    import numpy as np
    import torch

    from distkv.names import segment_name
    from distkv.storage.pool import PoolLayout
    from distkv.transfer.rdma import NixlAgent, RdmaUnavailable

    layout = PoolLayout(num_rows=128, num_ranks=1, slot_bytes=NIXL_BYTES // 128)
    try:
        agent = NixlAgent()
    except RdmaUnavailable as e:
        return {"status": "skipped", "reason": str(e)}
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    holder = context.Process(
        target=_holder, args=(segment_name("gpucheck" + uuid.uuid4().hex[:8], "holder"), (layout.num_rows, 1, layout.slot_bytes), theirs)
    )
    holder.start()
    try:
        endpoint = ours.recv()
        gpu = torch.empty(NIXL_BYTES, dtype=torch.uint8, device="cuda")
        agent.register(gpu.data_ptr(), NIXL_BYTES, mem_type="VRAM", device=gpu.device.index or 0)
        pieces = np.array([[layout.slot_offset(0, 0), gpu.data_ptr(), NIXL_BYTES]], dtype=np.int64)
        seconds = []
        for _ in range(6):
            gpu.zero_()
            torch.cuda.synchronize()
            start = time.perf_counter()
            read = agent.read(endpoint, pieces, local_mem_type="VRAM", local_device=gpu.device.index or 0)
            while (state := read.state()) == "pending":
                pass
            seconds.append(time.perf_counter() - start)
            read.release()
            if state != "done":
                return {"status": "failed", "reason": f"the READ ended {state}"}
        expected = torch.arange(1, layout.num_rows + 1, dtype=torch.uint8, device="cuda").repeat_interleave(layout.slot_bytes)
        exact = bool(torch.equal(gpu, expected))
        pinned = cupy.cuda.alloc_pinned_memory(NIXL_BYTES)
        stream = cupy.cuda.Stream(non_blocking=True)
        copies = []
        for _ in range(6):
            start = time.perf_counter()
            cupy.cuda.runtime.memcpyAsync(gpu.data_ptr(), pinned.ptr, NIXL_BYTES, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            stream.synchronize()
            copies.append(time.perf_counter() - start)
        read_s, copy_s = sorted(seconds[1:])[len(seconds[1:]) // 2], sorted(copies[1:])[len(copies[1:]) // 2]
        return {
            "status": "ok" if exact else "failed",
            "bit_exact": exact,
            "bytes": NIXL_BYTES,
            "nixl_read_gbps": NIXL_BYTES / read_s / 1e9,
            "pinned_memcpy_gbps": NIXL_BYTES / copy_s / 1e9,
            "ratio": copy_s / read_s,
        }
    finally:
        ours.send("close")
        holder.join(60)
        agent.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="time for the whole check")
    args = parser.parse_args()
    started = time.monotonic()
    report: dict[str, Any] = {}
    reason = no_cuda_reason()
    parts = {
        "tests_gpu": lambda left: tests_gpu(left),
        "transfer": lambda left: transfer(left, args.out.resolve().parent),
        "nixl_to_gpu": lambda left: nixl_to_gpu(),
    }
    for name, part in parts.items():
        left = args.budget_s - (time.monotonic() - started)
        if reason is not None:
            report[name] = {"status": "skipped", "reason": reason}
            continue
        try:
            report[name] = part(left)
        except subprocess.TimeoutExpired:
            report[name] = {"status": "failed", "reason": f"ran past the check's budget of {args.budget_s:.0f} s"}
        except Exception as e:
            report[name] = {"status": "failed", "reason": repr(e)}
        print(f"{name}: {report[name]['status']}", flush=True)
    report["seconds"] = time.monotonic() - started
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v if not isinstance(v, dict) else {x: y for x, y in v.items() if "output" not in x}
                      for k, v in report.items()}, indent=2))
    return 1 if any(isinstance(v, dict) and v["status"] == "failed" for v in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
