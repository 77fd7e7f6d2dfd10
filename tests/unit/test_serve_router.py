"""DistkvRequestRouter, Serve's side of distkv's router, without a cluster: replicas that only
say who they are, Serve's queue-length cache filled by hand, a Directory the test answers."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from distkv.demo.request import DemoRequest  # noqa: E402
from distkv.replica.harness import block_keys  # noqa: E402
from distkv.routing.answer import PARAMS_KEY, decode  # noqa: E402
from distkv.serve_router import DistkvRequestRouter, request_tokens  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine", app_name="test")
TOKENS = np.random.default_rng(0).integers(0, 4096, 20 * 16).tolist()
KEYS = block_keys(TOKENS, 16)
# what each replica's pull gate measured (not the router's priors): a pull from its own node
# costs less than one from the other, and either less than a prefill
COSTS = {
    "prefill_s": [0.0, 0.004],
    "pull_s": {"same_node": [0.002, 0.0002], "cross_node": [0.004, 0.002]},
    "step_s": 0.003,
}


class Replica:
    def __init__(self, name: str, node: str):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.node_id, self.availability_zone, self.multiplexed_model_ids = node, None, set()
        self.max_ongoing_requests, self.is_cross_language = 8, False
        self.routing_stats = {"distkv": {
            "replica_id": f"distkv-{name}", "node_id": node, "namespace": "ns", "directory_shards": 1,
            "keys": {"kind": "seed", "block_tokens": 16}, "costs": COSTS,
        }}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def make_router(queues: dict[str, int], held_by: str | None):
    router = DistkvRequestRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True, create_replica_wrapper_func=lambda r: r,
    )
    router.initialize_state()
    asked = []

    async def ask(namespace, num_shards, shard, keys):
        asked.append(list(keys))
        return [[(f"distkv-{held_by}", "node-1", i, 1)] if held_by else [] for i, _ in enumerate(keys)]

    router.core.ask = ask
    replicas = [Replica("a", "node-1"), Replica("b", "node-1"), Replica("c", "node-2")]
    router.update_replicas(replicas)
    for r in replicas:
        router.replica_queue_len_cache.update(r.replica_id, queues.get(r.replica_id.unique_id, 0))
    return router, replicas, asked


def pending(request_id: str, request: DemoRequest) -> PendingRequest:
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(
        request_id=request_id, internal_request_id=request_id))


async def route(router, replicas, request):
    ranked = await router.choose_replicas(replicas, request)
    return [group[0].replica_id.unique_id for group in ranked]


def test_the_holder_first_and_the_answer_rides_with_the_request():
    async def scenario():
        router, replicas, asked = make_router({}, held_by="a")
        request = DemoRequest(TOKENS)
        pr = pending("r1", request)
        assert (await route(router, replicas, pr))[0] == "a"
        answer = decode(request.kv_transfer_params[PARAMS_KEY], "ns")
        assert answer.keys == tuple(KEYS) and answer.kind("distkv-a") == "holder"
        await route(router, replicas, pr)  # Serve retrying the routing: no second query
        assert asked == [KEYS]
        router.on_request_routed(pr, replicas[0].replica_id, None)
        assert router.core.decisions["holder"] == 1

    asyncio.run(scenario())


def test_a_busy_holder_loses_the_request_to_its_neighbour():
    async def scenario():
        router, replicas, _ = make_router({"a": 2}, held_by="a")
        assert (await route(router, replicas, pending("r1", DemoRequest(TOKENS))))[0] == "b"

    asyncio.run(scenario())


def test_what_the_router_sent_a_replica_is_work_ahead_there_until_it_completes():
    async def scenario():
        router, replicas, _ = make_router({}, held_by=None)
        a = replicas[0].replica_id
        # nobody holds the prompt: a recomputes it whole, and is counted busy for that long
        first = pending("r1", DemoRequest(TOKENS))
        await route(router, replicas, first)
        router.on_request_routed(first, a, None)
        router.replica_queue_len_cache.update(a, 1)
        assert router.core.work.ahead(a, 1, 0.0) > 0
        assert "a" not in (await route(router, replicas, pending("r2", DemoRequest(TOKENS))))[:2]
        router.on_request_completed(a, "r1")
        router.replica_queue_len_cache.update(a, 0)
        assert router.core.work.ahead(a, 0, 0.0) == 0.0
        third = pending("r3", DemoRequest(TOKENS))
        await route(router, replicas, third)
        router.on_request_routed(third, a, None)
        assert router.core.work.ahead(a, 0, 0.0) > 0
        router.update_replicas(replicas[1:])  # a is gone: what it was sent is forgotten
        assert router.core.work.ahead(a, 0, 0.0) == 0.0

    asyncio.run(scenario())


def test_a_request_without_token_ids_is_routed_on_load_and_counted():
    class Chat:  # a chat request as Serve LLM's ingress hands it: messages, no token ids
        messages = [{"role": "user", "content": "hi"}]
        kv_transfer_params = None

    async def scenario():
        router, replicas, asked = make_router({"a": 1, "b": 0, "c": 2}, held_by="a")
        chat = Chat()
        assert request_tokens(pending("r1", chat)) == (None, None)
        assert (await route(router, replicas, pending("r1", chat)))[0] == "b"
        assert not asked and router.core.fallbacks["no_tokens"] == 1
        assert decode(chat.kv_transfer_params[PARAMS_KEY], "ns").answered is False

    asyncio.run(scenario())
