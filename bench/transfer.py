"""Throughput of the transfer handlers against a contiguous copy of the same bytes.

    python bench/transfer.py [--device cpu|cuda] [--json PATH]

Blocks of --block-mib scattered (a random permutation) over a KV tensor of --gib are
stored to a pool through the store handler (sealed), then loaded back through the load
handler (header-checked). The baseline copies the same bytes in one contiguous copy:
torch on cpu, cudaMemcpy against the same pinned pool region on cuda.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, uninstalled

from distkv.abstract import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    make_offload_key,
)
from distkv.storage.handlers import make_handlers
from distkv.storage.handlers.cpu import flat_bytes
from distkv.names import segment_name
from distkv.storage.pool import HostPool, PoolLayout, PoolLoadStoreSpec


def run_job(handler, job_id: int, spec) -> float:
    start = time.perf_counter()
    handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    seconds = time.perf_counter() - start
    (result,) = handler.get_finished()
    if not result.success:
        raise RuntimeError(f"job {job_id} failed")
    return seconds


def contiguous_copies(device: str, kv: torch.Tensor, pool: HostPool):
    """(GPU -> pool, pool -> GPU) copies of every byte of kv, in one piece each."""
    kv_bytes = flat_bytes(kv)
    if device == "cpu":
        pool_bytes = torch.from_numpy(pool.payload[0].reshape(-1))[: kv_bytes.numel()]
        return (lambda: pool_bytes.copy_(kv_bytes)), (lambda: kv_bytes.copy_(pool_bytes))

    import cupy

    runtime = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    host, gpu, nbytes = pool.rank_address(0), kv.data_ptr(), kv_bytes.numel()

    def copy(dst: int, src: int, kind: int) -> None:
        runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        stream.synchronize()

    return (
        lambda: copy(host, gpu, runtime.memcpyDeviceToHost),
        lambda: copy(gpu, host, runtime.memcpyHostToDevice),
    )


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gib", type=float, default=1.0, help="size of the KV tensor")
    parser.add_argument("--block-mib", type=int, default=2, help="size of a block")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    block_bytes = args.block_mib << 20
    num_blocks = int(args.gib * (1 << 30)) // block_bytes
    total = num_blocks * block_bytes
    kv = torch.randint(-128, 128, (num_blocks, block_bytes), dtype=torch.int8, device=args.device)
    kv_caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(kv, block_bytes)], [[CanonicalKVCacheRef(0, block_bytes)]]
    )
    pool = HostPool(
        segment_name("bench" + uuid.uuid4().hex[:8], "r0"), PoolLayout(num_blocks, 1, block_bytes)
    )
    handlers = make_handlers(kv_caches, pool, rank=0, block_size_factor=1, device=args.device)
    store, load = handlers[0][2], handlers[1][2]
    try:
        blocks = np.random.default_rng(0).permutation(num_blocks)
        gpu_spec = GPULoadStoreSpec(blocks, [num_blocks], [0])
        rows = np.arange(num_blocks)
        keys = [make_offload_key(int(b).to_bytes(8, "big"), 0) for b in blocks]
        to_pool, from_pool = contiguous_copies(args.device, kv, pool)

        times: dict[str, list[float]] = {"store": [], "load": [], "d2h": [], "h2d": []}
        for rep in range(args.reps + 1):  # rep 0 warms up: first touches of fresh memory are slow
            pool_spec = PoolLoadStoreSpec(rows, keys, np.full(num_blocks, rep + 1))
            samples = {
                "store": run_job(store, 2 * rep, (gpu_spec, pool_spec)),
                "load": run_job(load, 2 * rep + 1, (pool_spec, gpu_spec)),
                "d2h": timed(to_pool),
                "h2d": timed(from_pool),
            }
            if rep:
                for name, seconds in samples.items():
                    times[name].append(seconds)
    finally:
        store.shutdown()
        load.shutdown()
        pool.close()

    def gbps(name: str) -> float:
        return total / float(np.median(times[name])) / 1e9

    print(
        f"device={args.device}: {num_blocks} blocks of {args.block_mib} MiB scattered over "
        f"{total / (1 << 30):.2f} GiB, median of {args.reps}"
    )
    baseline = "torch contiguous copy" if args.device == "cpu" else "pinned contiguous cudaMemcpy"
    for name, direction, base in (("store", "GPU->pool (sealed)", "d2h"), ("load", "pool->GPU (checked)", "h2d")):
        print(
            f"  {name:5} {direction:20} {gbps(name):7.2f} GB/s   {baseline} {base.upper()} "
            f"{gbps(base):7.2f} GB/s   ratio {gbps(name) / gbps(base):.2f}"
        )
    # store then load, the round trip a block makes, against both contiguous copies
    round_trip = 2 * total / (float(np.median(times["store"])) + float(np.median(times["load"]))) / 1e9
    copies = 2 * total / (float(np.median(times["d2h"])) + float(np.median(times["h2d"]))) / 1e9
    print(
        f"  store+load{'':16} {round_trip:7.2f} GB/s   {baseline} both  {copies:7.2f} GB/s   "
        f"ratio {round_trip / copies:.2f}  (target >= 0.8)"
    )
    if args.json:
        figures = {
            "store_gbps": gbps("store"),
            "load_gbps": gbps("load"),
            "both_gbps": round_trip,
            "baseline_store_gbps": gbps("d2h"),
            "baseline_load_gbps": gbps("h2d"),
            "baseline_both_gbps": copies,
        }
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
