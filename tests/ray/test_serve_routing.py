"""distkv's Serve router on a local Ray: requests go to the replica holding their prefix while
it is idle, and to others, which pull the prefix bit-exactly, once it is saturated.

Three replicas of the demo's engine (a tiny model) as one Serve deployment routed by
`distkv.serve_router.DistkvRequestRouter`, on one node: a replica that does not hold the
prefix promotes it from the holder's shared memory.
"""

import time

import numpy as np
import pytest

pytest.importorskip("ray.serve")

from distkv.demo.handles import ready_handle, request_router  # noqa: E402
from distkv.demo.model import ModelConfig  # noqa: E402
from distkv.demo.request import DemoRequest  # noqa: E402
from distkv.replica.harness import block_keys  # noqa: E402
from distkv.directory.wire import decode_answer  # noqa: E402
from ray_actors.directory import find_shards  # noqa: E402

BLOCK_TOKENS = 16
PREFIX_BLOCKS = 16
MODEL = ModelConfig(vocab_size=512, dim=64, layers=2, heads=4, seed=0)
MAX_PROMPT = PREFIX_BLOCKS * BLOCK_TOKENS + 64
# Generous bounds for what is not under test: replicas starting, routing stats and the
# Directory catching up.
SETUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def deployment(ray_session):
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle

    from ray_actors.demo_deployment import DemoEngine

    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING", "enable_access_log": False})
    extra = {"cpu_bytes_to_use": 8 << 20, "tenant_salt": f"router-test-{time.time_ns()}", "transport": "object_store"}
    app = DemoEngine.options(
        name="engine",
        num_replicas=3,
        max_ongoing_requests=16,
        ray_actor_options={"num_cpus": 0},
        user_config={"arm": "router", "engine": "distkv", "extra_config": extra},
        request_router_config=RequestRouterConfig(
            request_router_class="distkv.serve_router:DistkvRequestRouter",
            # the deadline is not under test: on a loaded machine a query can take longer
            # than the default, and the request is then routed on load alone
            request_router_kwargs={"query_deadline_s": 10.0},
            request_routing_stats_period_s=0.5,
        ),
    ).bind("routertest", MODEL, BLOCK_TOKENS, MAX_PROMPT, 1)
    serve.run(app, name="router-test", route_prefix=None)
    # a handle whose router has the replicas and its request router (`ready_handle`: the
    # routing stats' updates can keep either from a new handle's router)
    handle = ready_handle(lambda: DeploymentHandle("engine", "router-test"), wait_s=10.0, timeout_s=SETUP_TIMEOUT_S)
    try:
        yield handle
    finally:
        handle.shutdown()
        serve.delete("router-test")
        serve.shutdown()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {SETUP_TIMEOUT_S} s: {what}"
        time.sleep(0.05)


def prompt(prefix: np.ndarray, suffix_seed: int) -> list[int]:
    suffix = np.random.default_rng(suffix_seed).integers(0, MODEL.vocab_size, 40)
    return np.concatenate([prefix, suffix]).tolist()


def test_requests_go_to_the_prefixs_holder_while_it_is_idle_and_spread_once_it_is_saturated(deployment):
    handle = deployment
    prefix = np.random.default_rng(1).integers(0, MODEL.vocab_size, PREFIX_BLOCKS * BLOCK_TOKENS)
    keys = block_keys(prefix, BLOCK_TOKENS)
    first = handle.remote(DemoRequest(prompt(prefix, 0))).result()
    holder = first["replica"]
    computed = dict(first["computed"])
    assert set(keys) <= set(computed)

    router = request_router(handle)
    # every replica has said who it is, and the Directory knows the holder has the whole prefix
    wait_for(lambda: len(router.curr_replicas) == 3 and all(
        router.core.identity(r.routing_stats) is not None for r in router.curr_replicas.values()
    ), "every replica's routing stats")
    identities = [router.core.identity(r.routing_stats) for r in router.curr_replicas.values()]
    assert holder in {i.replica_id for i in identities}
    (shard,) = find_shards(identities[0].namespace, 1)

    def holder_has_the_prefix() -> bool:
        holders = decode_answer(shard.query(keys, identities[0].namespace).result(), len(keys))[0]
        return all(any(h[0] == holder for h in key_holders) for key_holders in holders)

    wait_for(holder_has_the_prefix, "the holder's blocks in the Directory")

    # idle: one at a time, every request with the prefix goes to its holder and loads it there
    holder_key = next(key for key, r in router.curr_replicas.items() if router.core.identity(r.routing_stats).replica_id == holder)
    for i in range(1, 6):
        # idle as the router knows it: Serve lowers a replica's queue length once the answer is in
        wait_for(lambda: not router.replica_queue_len_cache.get(holder_key), "the holder's queue length back to 0")
        result = handle.remote(DemoRequest(prompt(prefix, i))).result()
        assert result["replica"] == holder, f"request {i} went to {result['replica']}, not the idle holder"
        assert result["blocks_by_source"]["local"] >= PREFIX_BLOCKS

    # saturated: a burst; the holder's queue costs more than a pull within the node
    responses = [handle.remote(DemoRequest(prompt(prefix, 100 + i))) for i in range(12)]
    results = [r.result() for r in responses]
    elsewhere = [r for r in results if r["replica"] != holder]
    assert any(r["replica"] == holder for r in results)
    assert elsewhere, "the burst all queued on the holder"
    pulled = [r for r in elsewhere if r["blocks_by_source"]["same_node"] > 0]
    assert pulled, "no replica but the holder served the prefix from the holder's pool"
    for r in elsewhere:
        loaded = dict(r["loaded"])
        assert r["blocks_by_source"]["same_node"] + r["blocks_by_source"]["local"] == len(loaded)
        for key, digest in loaded.items():  # bit-exact: as the holder computed it
            if key in computed:
                assert digest == computed[key]
    assert sum(router.core.decisions.values()) >= 18 and router.core.decisions["puller"] >= len(pulled) > 0
