"""The demo's summary (`distkv.demo.report.summarize`) as the table `distkv demo` prints: one
column per arm, and the ratios of distkv with its router against the other arms."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from distkv.demo.arms import ARMS
from distkv.demo.report import TOKEN_ROWS, ratios

LABEL = 36
COLUMN = 21


def format_table(s: Mapping[str, Any]) -> str:
    arms = s["arms"]
    names = list(arms)
    lines = [
        "",
        f"  {s['workload']['requests']} requests, the same trace in each arm; oracle hit rate (one infinite "
        f"cache shared by all) {next(iter(arms.values()))['oracle_hit_rate']:.1%}",
        "",
        "  " + " " * LABEL + "".join(f"{ARMS[n].label:>{COLUMN}}" for n in names),
    ]

    def row(label: str, cell: Callable[[Mapping[str, Any]], str]) -> None:
        lines.append(f"  {label:<{LABEL}}" + "".join(f"{cell(arms[n]):>{COLUMN}}" for n in names))

    row("time to first token p50", lambda a: f"{a['ttft_s']['p50'] * 1e3:.1f} ms")
    row("time to first token p99", lambda a: f"{a['ttft_s']['p99'] * 1e3:.1f} ms")
    row("prompt tokens:", lambda a: "")
    for name, label in TOKEN_ROWS:
        row(f"  {label}", lambda a, name=name: f"{a['tokens'][name] / max(a['prompt_tokens'], 1):.1%}")
    row("hit rate", lambda a: f"{a['hit_rate']:.1%}")
    row("  oracle, the trace as this arm ran", lambda a: f"{a['oracle_hit_rate_as_run']:.1%}")
    row("bytes moved, same node", lambda a: _mib(a["transfers"]["same_node_promotion"]["bytes"]))
    row("bytes moved, another node", lambda a: _mib(a["transfers"]["cross_node_promotion"]["bytes"]))
    for transport in ("nixl", "object_store"):
        row(f"  by {transport}", lambda a, t=transport: _mib(a["transfers_by_transport"][t]["bytes"]))
    row("requests per replica max / mean", lambda a: f"{a['requests_per_replica']['max']} / "
        f"{a['requests_per_replica']['mean']:.1f} ({a['requests_per_replica']['max_over_mean']:.2f})")
    row("blocks pulled / skipped / recomputed", lambda a: "{pulled_blocks} / {skipped_blocks} / {recomputed_blocks}".format(
        **a["pull_gate"]))
    row("routed to holder/puller/cold/load", lambda a: "/".join(
        str(a["routed"].get(k, 0)) for k in ("holder", "puller", "cold", "load_only")) if a["routed"] else "-")
    for group in ("p99_and_slower", "all"):
        row(f"{'p99 tail' if group != 'all' else 'all'}: queue/pull wait/load/compute", lambda a, g=group: "/".join(
            f"{a['tail'][g][part] * 1e3:.0f}" for part in ("queue_s", "wait_s", "load_s", "compute_s")) + " ms")
    row("first tokens as offloading off", lambda a: "-" if a["first_tokens_as_offloading_off"] is None
        else f"{a['first_tokens_as_offloading_off']}/{a['requests']}")
    lines.append("")
    for baseline in ("distkv", "affinity", "off"):
        r = ratios(arms, "distkv-router", baseline)
        if r is not None:
            cross = r["cross_node_bytes"]
            lines.append(
                f"  distkv + its router vs {ARMS[baseline].label}: TTFT p50 {r['p50']:.2f}x, p99 {r['p99']:.2f}x"
                + (f", cross-node bytes {cross:.2f}x" if cross is not None else "")
            )
    lines += [
        "",
        f"  blocks verified {s['blocks_verified']:,}, mismatches {s['mismatches']} (load failures {s['load_failures']})",
        f"  wall time {s['seconds']['total']:.1f} s: start {s['seconds']['start']:.1f} s, "
        + ", ".join(f"{ARMS[n].label} {s['seconds'][n]:.1f} s" for n in names)
        + f", shutdown {s['seconds']['shutdown']:.1f} s",
    ]
    return "\n".join(lines)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
