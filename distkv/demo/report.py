"""The demo's results: per-request outcomes folded into totals, the check of every loaded
block against the digests its computing replicas recorded, the table and the JSON document.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np

from distkv.demo.engine import BLOCK_TRANSPORTS, SOURCES

PATH_ROWS = (
    ("local_load", "local load"),
    ("same_node_promotion", "same-node promotion"),
    ("cross_node_promotion", "cross-node promotion"),
)
TOKEN_ROWS = (
    ("local", "served from the replica's own pool"),
    ("same_node", "from another replica on the same node"),
    ("cross_node", "from another node"),
    ("recomputed", "recomputed"),
)


class Tally:
    """Totals of one demo run, from each request's result as it arrives."""

    def __init__(self, block_tokens: int, block_bytes: int):
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_blocks = dict.fromkeys(SOURCES, 0)
        self.load_failures = 0
        self.retries = 0
        self.load_s = 0.0
        self.promoted_bytes = 0
        self.ttft_s: list[float] = []
        # per distkv request: (time to first token, lookup retries, load seconds)
        self._requests: list[tuple[float, int, float]] = []
        self.ttft_own_s: list[float] = []
        self.own_hit_blocks = 0
        self.ttft_off_s: list[float] = []
        self.first_tokens: dict[int, int] = {}
        self.first_tokens_off: dict[int, int] = {}
        # per key: the digests of its bytes as computed, and the replicas that computed it
        self._digests: dict[bytes, set[int]] = defaultdict(set)
        self._computed_by: dict[bytes, set[str]] = defaultdict(set)
        self._loaded: list[tuple[bytes, int, str]] = []  # (key, digest, loading replica)

    # ---- folding results in ----------------------------------------------------------

    def add(self, index: int, result: Mapping[str, Any]) -> None:
        """One request served through distkv (ModelReplica.serve's result)."""
        self.requests += 1
        self.prompt_tokens += result["tokens"]
        for source, blocks in result["blocks_by_source"].items():
            self.hit_blocks[source] += blocks
        self.load_failures += result["load_failures"]
        self.retries += result["retries"]
        self.load_s += result["load_s"]
        self.promoted_bytes += result["promoted_bytes"]
        self.ttft_s.append(result["ttft_s"])
        self._requests.append((result["ttft_s"], result["retries"], result["load_s"]))
        self.first_tokens[index] = result["first_token"]
        self._record_blocks(result)

    def add_own_pool_only(self, index: int, result: Mapping[str, Any]) -> None:
        """The same request served by its replica offloading to a pool of its own only."""
        self.ttft_own_s.append(result["ttft_s"])
        self.own_hit_blocks += sum(result["blocks_by_source"].values())
        self.load_failures += result["load_failures"]
        self._record_blocks(result)

    def _record_blocks(self, result: Mapping[str, Any]) -> None:
        replica = result["replica"]
        for key, digest in result["computed"]:
            self._digests[key].add(digest)
            self._computed_by[key].add(replica)
        self._loaded.extend((key, digest, replica) for key, digest in result["loaded"])

    def add_without_offloading(self, index: int, result: Mapping[str, Any]) -> None:
        """The same request served with offloading off."""
        self.ttft_off_s.append(result["ttft_s"])
        self.first_tokens_off[index] = result["first_token"]

    # ---- what the progress bar shows ---------------------------------------------------

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_blocks.values()) * self.block_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def bytes_moved(self) -> int:
        """Bytes loaded into KV caches and promoted between replicas so far."""
        return sum(self.hit_blocks.values()) * self.block_bytes + self.promoted_bytes

    # ---- the end -----------------------------------------------------------------------

    def verify(self) -> tuple[int, int]:
        """(blocks verified, mismatches): each loaded block (of the distkv and the own-pool
        arms) against the digests that the replicas which computed its key recorded. Call
        once every request is in."""
        mismatches = sum(1 for key, digest, _ in self._loaded if digest not in self._digests.get(key, ()))
        return len(self._loaded), mismatches

    def hit_tokens_computed_elsewhere(self) -> int:
        """Hit tokens of blocks that the loading replica never computed itself."""
        blocks = sum(1 for key, _, replica in self._loaded if replica not in self._computed_by.get(key, ()))
        return blocks * self.block_tokens

    def summary(self, oracle_hit_tokens: int, promotions: Mapping[str, float], setup: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON document. promotions: the replicas' summed promotion bytes and seconds
        per path (ModelReplica.stats); setup: what was run, and how long each part took."""
        verified, mismatches = self.verify()
        loaded_bytes = sum(self.hit_blocks.values()) * self.block_bytes
        transfers = {
            "local_load": _transfer(sum(self.hit_blocks.values()), loaded_bytes, self.load_s),
            "same_node_promotion": _transfer(
                promotions["same_node_bytes"] // self.block_bytes, promotions["same_node_bytes"], promotions["same_node_s"]
            ),
            "cross_node_promotion": _transfer(
                promotions["cross_node_bytes"] // self.block_bytes, promotions["cross_node_bytes"], promotions["cross_node_s"]
            ),
        }
        by_transport = {
            t: _transfer(promotions[f"{t}_bytes"] // self.block_bytes, promotions[f"{t}_bytes"], promotions[f"{t}_s"])
            for t in BLOCK_TRANSPORTS
        }
        tokens = {source: blocks * self.block_tokens for source, blocks in self.hit_blocks.items()}
        tokens["recomputed"] = self.prompt_tokens - self.hit_tokens
        return {
            **setup,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "tokens": tokens,
            "hit_rate": self.hit_rate,
            "hit_tokens_computed_by_another_replica": self.hit_tokens_computed_elsewhere(),
            "oracle_hit_rate": oracle_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "own_pool_only_hit_tokens": self.own_hit_blocks * self.block_tokens,
            "own_pool_only_hit_rate": (
                self.own_hit_blocks * self.block_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
            ),
            "ttft_s": {
                "distkv": _percentiles(self.ttft_s),
                "own_pool_only": _percentiles(self.ttft_own_s),
                "offloading_off": _percentiles(self.ttft_off_s),
            },
            "tail": self._tail(),
            "transfers": transfers,
            "transfers_by_transport": by_transport,
            "block_bytes": self.block_bytes,
            "blocks_verified": verified,
            "mismatches": mismatches,
            "load_failures": self.load_failures,
            "lookup_retries": self.retries,
            "first_tokens_as_offloading_off": sum(
                1 for i, t in self.first_tokens.items() if self.first_tokens_off.get(i) == t
            ),
        }


    def _tail(self) -> dict[str, dict[str, float]]:
        """Where distkv's slowest requests spend their time: the mean time to first token,
        lookup retries (each a scheduler step waiting on a promotion) and load time of the
        requests at or past the p99, beside those of all requests."""
        if not self._requests:
            return {}
        p99 = float(np.percentile([r[0] for r in self._requests], 99))
        groups = {"all": self._requests, "p99_and_slower": [r for r in self._requests if r[0] >= p99]}
        return {
            name: {
                "requests": len(group),
                "ttft_s": float(np.mean([r[0] for r in group])),
                "retries": float(np.mean([r[1] for r in group])),
                "load_s": float(np.mean([r[2] for r in group])),
            }
            for name, group in groups.items()
        }


def _transfer(blocks: int, nbytes: float, seconds: float) -> dict[str, float]:
    return {
        "blocks": int(blocks),
        "bytes": int(nbytes),
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
    }


def _percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p99": 0.0}
    p50, p99 = np.percentile(samples, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def format_table(s: Mapping[str, Any]) -> str:
    """The summary as the table `distkv demo` prints."""
    total = s["prompt_tokens"] or 1
    t = s["tokens"]
    sec = s["seconds"]
    lines = [
        "",
        f"  requests {s['requests']:,}, prompt tokens {s['prompt_tokens']:,}",
        *(f"    {label:<40}{t[name]:>10,}  {t[name] / total:6.1%}" for name, label in TOKEN_ROWS),
        f"  hit rate {s['hit_rate']:.1%}   (oracle, one infinite cache shared by all: {s['oracle_hit_rate']:.1%})",
        f"  hit tokens computed by another replica: {s['hit_tokens_computed_by_another_replica']:,}"
        f" ({s['hit_tokens_computed_by_another_replica'] / max(t['local'] + t['same_node'] + t['cross_node'], 1):.1%})",
        "",
        f"  own pool only (each replica offloading to a pool of its own, as vLLM's CPU offloading): "
        f"hit rate {s['own_pool_only_hit_rate']:.1%}",
        "",
        "  time to first token (from a request's arrival at its replica to its first token)",
        f"  {'':<22}{'distkv':>12}{'own pool only':>17}{'offloading off':>18}{'vs own':>9}{'vs off':>9}",
    ]
    on, own, off = (s["ttft_s"][arm] for arm in ("distkv", "own_pool_only", "offloading_off"))
    for p in ("p50", "p99"):
        vs_own, vs_off = (x[p] / on[p] if on[p] > 0 else 0.0 for x in (own, off))
        lines.append(
            f"    {p:<20}{on[p] * 1e3:>9.1f} ms{own[p] * 1e3:>14.1f} ms{off[p] * 1e3:>15.1f} ms"
            f"{vs_own:>8.2f}x{vs_off:>8.2f}x"
        )
    tail = s["tail"]
    if tail:
        slow, every = tail["p99_and_slower"], tail["all"]
        lines.append(
            f"    the {slow['requests']} slowest (p99 and over): {slow['retries']:.1f} lookup retries and "
            f"{slow['load_s'] * 1e3:.1f} ms of loads each on average, against {every['retries']:.1f} and "
            f"{every['load_s'] * 1e3:.1f} ms over all"
        )
    lines += ["", f"  {'bytes moved':<22}{'blocks':>12}{'MiB':>12}{'GB/s':>10}   (GB/s over the transfers' own time)"]
    rows = [(label, s["transfers"][path]) for path, label in PATH_ROWS]
    rows += [(f"  by {t}", s["transfers_by_transport"][t]) for t in BLOCK_TRANSPORTS]
    for label, x in rows:
        lines.append(f"    {label:<20}{x['blocks']:>12,}{x['bytes'] / 2**20:>12.1f}{x['gb_per_s']:>10.2f}")
    lines += [
        "",
        f"  blocks verified {s['blocks_verified']:,}, mismatches {s['mismatches']}"
        f" (load failures {s['load_failures']}, lookup retries {s['lookup_retries']:,})",
        f"  first tokens as with offloading off: {s['first_tokens_as_offloading_off']}/{s['requests']}",
        f"  wall time {sec['total']:.1f} s: start {sec['start']:.1f} s, distkv {sec['distkv']:.1f} s, "
        f"own pool only {sec['own_pool_only']:.1f} s, offloading off {sec['offloading_off']:.1f} s, "
        f"shutdown {sec['shutdown']:.1f} s",
    ]
    return "\n".join(lines)
