"""How often a new DeploymentHandle's router never learns the deployment's config, and what
`distkv.demo.handles.ready_handle` makes of it.

    python bench/serve_handles.py [--handles 150] [--stats-period-s 0.1]

A Serve deployment of 4 replicas that report routing stats every `--stats-period-s` (each
report is a broadcast of the deployment's replicas to every router: Ray 2.60's
`SharedRouterLongPollClient`, which stops a new router's own long poll on its first
broadcast). The baseline: handles made one after another in the same process, each watched
for `--watch-s`, then sent one request; a handle whose router has not made its request
router by then holds the request (10 s allowed). Then the same number through
`ready_handle`, which replaces such a handle: how many it made, how many requests were
answered.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ANSWER_S = 10.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handles", type=int, default=150)
    parser.add_argument("--stats-period-s", type=float, default=0.1)
    parser.add_argument("--watch-s", type=float, default=5.0)
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle

    from distkv.demo.handles import ready_handle, routes

    @serve.deployment(
        num_replicas=4, ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(request_routing_stats_period_s=args.stats_period_s),
    )
    class Echo:
        def __init__(self) -> None:
            self.reports = 0

        def record_routing_stats(self) -> dict[str, int]:
            self.reports += 1
            return {"reports": self.reports}

        async def __call__(self, x: int) -> int:
            return x

    def answered(handle, i: int) -> bool:
        try:
            return handle.remote(i).result(timeout_s=ANSWER_S) == i
        except TimeoutError:
            return False

    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False)
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(Echo.bind(), name="bench", route_prefix=None)

    stuck = unanswered = 0
    for i in range(args.handles):
        handle = DeploymentHandle("Echo", "bench")
        handle._init()
        watched = time.monotonic() + args.watch_s
        while not routes(handle) and time.monotonic() < watched:
            time.sleep(0.01)
        if not routes(handle):
            stuck += 1
            unanswered += not answered(handle, i)
        handle.shutdown()
    print(f"plain handles: {stuck} of {args.handles} could not route after {args.watch_s:.0f} s, "
          f"{unanswered} of those left their request unanswered for {ANSWER_S:.0f} s")

    made = 0

    def make():
        nonlocal made
        made += 1
        return DeploymentHandle("Echo", "bench")

    ready_answered = 0
    for i in range(args.handles):
        handle = ready_handle(make, wait_s=2.0, timeout_s=60.0)
        ready_answered += answered(handle, i)
        handle.shutdown()
    print(f"ready_handle: {made} handles made for {args.handles}, {ready_answered} of {args.handles} requests answered")
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
