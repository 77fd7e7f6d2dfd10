"""`distkv status`: the nodes, replicas, Directory shards and recent errors of a Ray cluster.

Finds every Directory shard (the named actors `directory-<namespace>-<i>` in Ray namespace
`distkv`: `distkv.names`) and asks each for its sizes and its registered replicas. Each replica's
DirectoryLink sends the replica's counts along with its heartbeat (every 0.5 s), so what is
shown is at most about a second old. Exits 1 when a shard does not answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from distkv.observability.errors import RECENT_ERRORS
from distkv.observability.metrics import DIRECTORY_SIZES
from distkv.names import RAY_NAMESPACE, parse_agent_name, parse_shard_name, shard_name
from distkv.observability.stats import ReplicaStats

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
# what a replica entry takes from the replica's latest report (None before one came)
REPORTED = ("mode", "lookups", "promotions", "blocks", "pool", "routing", "errors", "recent_errors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default="auto", help="the Ray cluster (host:port, ray://..., default auto: the local one)"
    )
    parser.add_argument("--json", action="store_true", help="print the status as a JSON document")


def run(args: argparse.Namespace) -> int:
    import ray

    connect = not ray.is_initialized()
    if connect:
        try:
            _check_reachable(args.address)
            ray.init(address=args.address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
        except (OSError, RuntimeError, ValueError) as e:  # ConnectionError is an OSError
            print(f"distkv status: cannot connect to the Ray cluster at {args.address!r}: {e}", file=sys.stderr)
            return 1
    try:
        status = collect()
    finally:
        if connect:
            ray.shutdown()
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        print()
    else:
        print(format_status(status))
    return 1 if any("error" in shard for shard in status["directory"]) else 0


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise OSError if a host:port address does not accept connections: ray.init would
    keep retrying it for minutes."""
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and "://" not in address:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()


# ---- gathering -----------------------------------------------------------------------


def collect(timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """The cluster's status as a JSON-able dict: nodes, replicas, directory (one entry per
    shard), recent_errors. Needs a connection to Ray."""
    import ray
    from ray.exceptions import GetTimeoutError

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RAY_NAMESPACE]
    agents = {node for node in map(parse_agent_name, names) if node is not None}
    shards = sorted(shard for shard in map(parse_shard_name, names) if shard is not None)

    calls: dict[tuple[str, int], tuple[Any, Any] | str] = {}
    for namespace, shard in shards:
        try:
            actor = ray.get_actor(shard_name(namespace, shard), namespace=RAY_NAMESPACE)
            calls[namespace, shard] = (actor.stats.remote(), actor.replicas.remote())
        except Exception as e:  # gone since it was listed
            calls[namespace, shard] = f"{type(e).__name__}: {e}"
    refs = [ref for call in calls.values() if not isinstance(call, str) for ref in call]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    directory, reported = [], []
    for (namespace, shard), call in calls.items():
        if isinstance(call, str):
            directory.append({"namespace": namespace, "shard": shard, "error": call})
            continue
        try:
            stats, replicas = ray.get(list(call), timeout=0)
        except GetTimeoutError:
            directory.append({"namespace": namespace, "shard": shard, "error": f"no answer within {timeout_s:.0f} s"})
            continue
        except Exception as e:  # the shard died, or failed the call
            directory.append({"namespace": namespace, "shard": shard, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        directory.append(_shard_entry(namespace, shard, stats))
        reported.extend((namespace, r) for r in replicas)
    replicas = merge_replicas(reported)
    return {
        "time": time.time(),
        "nodes": _nodes(ray.nodes(), agents, replicas),
        "replicas": replicas,
        "directory": directory,
        "recent_errors": recent_errors(replicas),
    }


def _shard_entry(namespace: str, shard: int, stats: dict[str, Any]) -> dict[str, Any]:
    """A shard's `stats()`: its sizes, and the operation counts apart."""
    named = {"namespace", "shard", "epoch", "node_id", *DIRECTORY_SIZES}
    return {
        "namespace": namespace,
        "shard": shard,
        "node_id": stats["node_id"],
        "epoch": stats["epoch"],
        **{name: stats[name] for name in DIRECTORY_SIZES},
        "operations": {op: n for op, n in stats.items() if op not in named},
    }


def merge_replicas(reported: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per replica from what every shard of its namespace said of it: the keys it
    holds summed over the shards, and the newest of its reports (`ReplicaStats.to_dict`;
    one of another stats version counts as none)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    reports: dict[tuple[str, str], ReplicaStats] = {}
    for namespace, r in reported:
        key = (namespace, r["replica_id"])
        entry = merged.setdefault(key, {
            "namespace": namespace,
            "replica": r["replica_id"],
            "node_id": r["node_id"],
            "directory_keys": 0,
            "seen_s_ago": r["seen_s_ago"],
        })
        entry["directory_keys"] += r["keys"]
        entry["seen_s_ago"] = min(entry["seen_s_ago"], r["seen_s_ago"])
        report = _read_report(r["report"])
        if report is not None and (key not in reports or report.time > reports[key].time):
            reports[key] = report
    out = []
    for key, entry in sorted(merged.items()):
        report = reports.get(key)
        entry["report_age_s"] = None if report is None else max(0.0, time.time() - report.time)
        entry["hit_rate"] = None if report is None else report.lookups.hit_rate
        shown = None if report is None else report.to_dict()
        for name in REPORTED:
            entry[name] = None if shown is None else shown[name]
        out.append(entry)
    return out


def _read_report(report: dict[str, Any] | None) -> ReplicaStats | None:
    if report is None:
        return None
    try:
        return ReplicaStats.from_dict(report)
    except ValueError as e:
        logger.warning("distkv status: a replica's report is unreadable: %s", e)
        return None


def _nodes(nodes: Sequence[dict[str, Any]], agents: set[str], replicas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for node in nodes:
        node_id = node["NodeID"]
        out.append({
            "node_id": node_id,
            "address": node.get("NodeManagerAddress", ""),
            "alive": bool(node["Alive"]),
            "head": "node:__internal_head__" in node.get("Resources", {}),
            "node_agent": node_id in agents,
            "replicas": sum(1 for r in replicas if r["node_id"] == node_id),
            "metrics_export_port": node.get("MetricsExportPort"),
        })
    out.sort(key=lambda n: (not n["alive"], not n["head"], n["address"], n["node_id"]))
    return out


def recent_errors(replicas: list[dict[str, Any]], keep: int = RECENT_ERRORS) -> list[dict[str, Any]]:
    """The last `keep` errors any replica reported, oldest first."""
    errors = [
        {"time": t, "namespace": r["namespace"], "replica": r["replica"], "kind": kind, "message": message}
        for r in replicas
        for t, kind, message in (r["recent_errors"] or ())
    ]
    errors.sort(key=lambda e: e["time"])
    return errors[-keep:]


# ---- printing ------------------------------------------------------------------------


def format_status(status: dict[str, Any]) -> str:
    nodes, replicas, directory = status["nodes"], status["replicas"], status["directory"]
    namespaces = {s["namespace"] for s in directory}
    lines = [
        f"distkv status: {sum(n['alive'] for n in nodes)} live node(s), {len(replicas)} replica(s), "
        f"{len(namespaces)} cache namespace(s), {len(directory)} Directory shard(s)",
        "",
        "NODES",
        *_table(
            ("node", "address", "alive", "head", "agent", "replicas"),
            [(_short(n["node_id"]), n["address"], _yes(n["alive"]), _yes(n["head"]), _yes(n["node_agent"]),
              n["replicas"]) for n in nodes],
        ),
        "",
        "REPLICAS",
    ]
    rows = []
    for r in replicas:
        if r["lookups"] is None:
            rows.append((r["namespace"], r["replica"], _short(r["node_id"]), *["-"] * 9, f"{r['seen_s_ago']:.1f}s"))
            continue
        lookups, promotions, blocks, pool = r["lookups"], r["promotions"], r["blocks"], r["pool"]
        used, capacity = pool["used_bytes"], pool["capacity_bytes"]
        rows.append((
            r["namespace"],
            r["replica"],
            _short(r["node_id"]),
            r["mode"],
            f"{_bytes(used)} / {_bytes(capacity)} ({used / capacity:.0%})" if capacity else "-",
            "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}",
            "/".join(str(lookups[k]) for k in ("local_hit", "remote_hit", "miss", "retry")),
            "/".join(str(promotions["succeeded"][p]) for p in ("same_node", "cross_node")),
            sum(promotions["failed"].values()),
            blocks["stored"],
            blocks["evicted"],
            sum(r["errors"].values()),
            f"{r['seen_s_ago']:.1f}s",
        ))
    lines += _table(
        ("namespace", "replica", "node", "mode", "pool used", "hit rate", "lookups local/remote/miss/retry",
         "promoted same/cross", "failed", "stored", "evicted", "errors", "seen"),
        rows,
    )
    lines += ["", "TRANSPORTS (cross-node promotions; GB/s over the transfers' own time)"]
    moved, measured = [], []
    for r in replicas:
        promotions = (r["promotions"] or {}) if r["lookups"] is not None else {}
        for transport, m in sorted(promotions.get("transports", {}).items()):
            rate = m["bytes"] / m["seconds"] / 1e9 if m["seconds"] else 0.0
            moved.append((r["replica"], _short(r["node_id"]), transport, m["blocks"], _bytes(m["bytes"]), f"{rate:.2f}"))
        for holder_node, rates in sorted(promotions.get("transport_rates", {}).items()):
            measured.append((
                r["replica"],
                f"{_short(holder_node)} -> {_short(r['node_id'])}",
                *(f"{rates[t] / 1e9:.2f}" if t in rates else "-" for t in ("object_store", "nixl")),
                max(rates, key=rates.get) if rates else "-",
            ))
    lines += _table(("replica", "node", "transport", "blocks", "bytes", "GB/s"), moved)
    if measured:
        lines += ["", "  measured per node pair (transport: auto), GB/s:"]
        lines += _table(("replica", "nodes", "object_store", "nixl", "chosen"), measured)
    lines += ["", "ROUTING (requests a distkv router sent, by what they found here; blocks the pull gate let pull or skipped)"]
    routing = [r for r in replicas if r["lookups"] is not None and any(r["routing"]["routed"].values())
               or r["lookups"] is not None and any(r["routing"]["pull_skipped"].values())]
    lines += _table(
        ("replica", "to holder", "to puller", "cold", "load only", "pulled same/cross", "skipped same/cross"),
        [
            (r["replica"], *(r["routing"]["routed"].get(k, 0) for k in ("holder", "puller", "cold", "load_only")),
             *("/".join(str(r["routing"][c].get(p, 0)) for p in ("same_node", "cross_node"))
               for c in ("pull_allowed", "pull_skipped")))
            for r in routing
        ],
    )
    lines += ["", "DIRECTORY"]
    lines += _table(
        ("namespace", "shard", "node", "keys", "holders", "replicas", "publishes", "queries", "status"),
        [
            (s["namespace"], s["shard"], "-", "-", "-", "-", "-", "-", s["error"]) if "error" in s else
            (s["namespace"], s["shard"], _short(s["node_id"]), s["keys"], s["holders"], s["replicas"],
             s["operations"].get("publishes", 0), s["operations"].get("queries", 0), "ok")
            for s in directory
        ],
    )
    lines += ["", "RECENT ERRORS"]
    errors = status["recent_errors"]
    if errors:
        lines += _table(
            ("time", "replica", "kind", "message"),
            [(time.strftime("%H:%M:%S", time.localtime(e["time"])), e["replica"], e["kind"], e["message"])
             for e in errors],
        )
    else:
        lines.append("  none")
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    if not rows:
        return ["  none"]
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _short(node_id: str) -> str:
    return node_id[:12]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
