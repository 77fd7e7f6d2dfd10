"""The demo's arms: one trace served four ways, each by a Serve deployment of its own.

- `off`: offloading off, Serve's default router (power of two choices);
- `affinity`: each replica offloading to its own pool only (as vLLM's native CPU
  offloading does), routed by Ray's PrefixCacheAffinityRouter: what a Ray user can do today
  without distkv. Its `imbalanced_threshold` is 2 (Ray's default is infinite, which routes
  by prefix whatever the queues): past a queue-length difference of 2 it balances load;
- `distkv`: distkv, Serve's default router (what distkv gave before its router);
- `distkv-router`: distkv, distkv's router (`distkv.serve_router.DistkvRequestRouter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ray.serve.llm.request_router exports it too, from a package that needs ray[llm]
PREFIX_AFFINITY_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
)
DISTKV_ROUTER = "distkv.serve_router:DistkvRequestRouter"


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    engine: str  # "off", "own_pool" or "distkv" (ray_actors.demo_deployment.ENGINE_SPECS)
    router: str | None  # a request_router_class; None: Serve's default
    router_kwargs: dict[str, Any] = field(default_factory=dict)


ARMS = {
    arm.name: arm
    for arm in (
        Arm("off", "offloading off", "off", None),
        Arm("affinity", "own pool + affinity", "own_pool", PREFIX_AFFINITY_ROUTER, {"imbalanced_threshold": 2}),
        Arm("distkv", "distkv", "distkv", None),
        Arm("distkv-router", "distkv + its router", "distkv", DISTKV_ROUTER),
    )
}
DEFAULT_ARMS = ("off", "affinity", "distkv", "distkv-router")


def parse_arms(value: str) -> list[Arm]:
    """`--arms`: names separated by commas, each once, in the order given."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--arms {value!r}: give each of {list(ARMS)} at most once, separated by commas")
    return [ARMS[n] for n in names]
