"""The `distkv` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import numpy as np

from distkv.harness import Replica
from distkv.spec import LocalOffloadingSpec


def _demo(args: argparse.Namespace) -> int:
    """One replica storing and loading real blocks through the manager and the CPU handlers."""
    page_bytes = args.page_kib << 10
    spec = LocalOffloadingSpec.from_layout(
        {"cpu_bytes_to_use": args.pool_mib << 20, "eviction_policy": args.policy},
        gpu_block_sizes=[args.block_tokens],
        group_page_bytes=[2 * page_bytes],
        engine_id=f"demo-{uuid.uuid4().hex[:8]}",
        model_config=None,
    )
    prompt_blocks = args.prompt_tokens // args.block_tokens
    replica = Replica(spec, num_gpu_blocks=prompt_blocks + 1, page_bytes=page_bytes)
    rng = np.random.default_rng(args.seed)
    system_prompts = [rng.integers(0, 50_000, args.prompt_tokens // 2) for _ in range(args.prefixes)]
    totals = dict(requests=0, blocks=0, hit_blocks=0, stored_blocks=0, load_failures=0, mismatches=0)
    block_bytes = 2 * page_bytes
    start = time.perf_counter()
    try:
        print(
            f"distkv demo: one replica, pool of {spec.layout.num_rows} blocks of {block_bytes >> 10} KiB "
            f"({args.policy}), {args.requests} requests over {args.prefixes} shared system prompts"
        )
        for _ in range(args.requests):
            prefix = system_prompts[rng.integers(len(system_prompts))]
            suffix = rng.integers(0, 50_000, args.prompt_tokens - len(prefix))
            result = replica.serve(np.concatenate([prefix, suffix]))
            totals["requests"] += 1
            for name in ("blocks", "hit_blocks", "stored_blocks", "load_failures", "mismatches"):
                totals[name] += getattr(result, name)
    finally:
        replica.shutdown()
    elapsed = time.perf_counter() - start
    summary = {
        **totals,
        "hit_rate": totals["hit_blocks"] / max(totals["blocks"], 1),
        "bytes_loaded": totals["hit_blocks"] * block_bytes,
        "bytes_stored": totals["stored_blocks"] * block_bytes,
        "seconds": elapsed,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        for name, value in summary.items():
            print(f"  {name:15} {value:.3f}" if isinstance(value, float) else f"  {name:15} {value}")
    return 1 if totals["mismatches"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="store and load real blocks and print what happened")
    demo.add_argument("--requests", type=int, default=200)
    demo.add_argument("--prefixes", type=int, default=8, help="shared system prompts")
    demo.add_argument("--prompt-tokens", type=int, default=1024)
    demo.add_argument("--block-tokens", type=int, default=16)
    demo.add_argument("--page-kib", type=int, default=64, help="bytes of K (and of V) per GPU block")
    demo.add_argument("--pool-mib", type=int, default=256)
    demo.add_argument("--policy", choices=["lru", "arc"], default="lru")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)
