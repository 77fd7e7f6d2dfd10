"""distkv's Ray Serve request router: to the replica where a request's first token is expected
soonest, knowing exactly which replicas hold how much of its prefix.

Turn it on for a deployment whose replicas run distkv (distkv's vLLM spec, distkv as a vLLM
tier, the demo's engine) with one line of its deployment config:

    request_router_config:
      request_router_class: distkv.serve_router:DistkvRequestRouter

Each replica says who it is in distkv from its deployment's `record_routing_stats`
(`distkv.routing.router.routing_stats`). Per request the router computes the prompt's keys
as the replicas' engine does, from the token ids the request carries (the `request_token_ids`
keyword Ray's LLM ingress forwards, else a `prompt_token_ids` attribute, or a `prompt` that is
a list of ints, of its first argument), asks the Directory once which replicas hold them
(within `query_deadline_s`; past it, it routes on load alone), ranks the candidates by the
time to first token it expects there (`distkv.routing.score`: the work ahead of the request on
each, from what it sent them, and the request's own pulls and prefill), and puts the answer in the
request's `kv_transfer_params["distkv"]` so that the chosen replica does not ask again.

This module meets Ray (Serve's router API, the Directory's actors): the rule is in
`distkv.routing`, plain classes tested without Ray.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from distkv.abstract import OffloadKey
from distkv.directory.wire import decode_answer
from distkv.routing.answer import PARAMS_KEY, RoutedAnswer, encode
from distkv.routing.router import QUERY_DEADLINE_S, RouterCore
from distkv.routing.score import PRIOR, Candidate

# the keyword Ray 2.60's LLM ingress passes a request's prompt token ids under
REQUEST_TOKEN_IDS_KWARG = "request_token_ids"


def request_tokens(pending_request: PendingRequest) -> tuple[list[int] | None, str | None]:
    """The prompt's token ids and cache salt, where the request carries them."""
    tokens = pending_request.kwargs.get(REQUEST_TOKEN_IDS_KWARG)
    request = pending_request.args[0] if pending_request.args else None
    if tokens is None and request is not None:
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None:
            prompt = getattr(request, "prompt", None)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                tokens = prompt
    salt = getattr(request, "cache_salt", None) if request is not None else None
    return (None if tokens is None else list(tokens)), (salt if isinstance(salt, str) else None)


def attach(pending_request: PendingRequest, answer: RoutedAnswer) -> bool:
    """Put `answer` in the request's kv_transfer_params; False where it has none to carry it."""
    request = pending_request.args[0] if pending_request.args else None
    if request is None or not hasattr(request, "kv_transfer_params"):
        return False
    params = dict(request.kv_transfer_params or {})
    params[PARAMS_KEY] = encode(answer)
    request.kv_transfer_params = params
    return True


class DistkvRequestRouter(RequestRouter):
    """Serve's RequestRouter over `distkv.routing.router.RouterCore`."""

    def initialize_state(self, query_deadline_s: float = QUERY_DEADLINE_S) -> None:
        self.core = RouterCore(self._ask_directory, query_deadline_s)
        self._shards: dict[tuple[str, int], list] = {}
        # per request being routed: its answer, and the compute expected of it on each candidate
        self._requests: dict[str, tuple[RoutedAnswer, dict[ReplicaID, float]]] = {}
        # seconds choose_replicas took, less its Directory query, per request (newest last)
        self.decision_s: list[float] = []

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        started = time.perf_counter()
        identities = [self.core.identity(r.routing_stats) for r in candidate_replicas]
        if pending_request is None:
            answer, blocks = RoutedAnswer("", False), 0
        else:
            tokens, salt = request_tokens(pending_request)
            asked = time.perf_counter()
            answer, blocks = await self.core.answer(
                pending_request.metadata.internal_request_id, tokens, salt, identities
            )
            started += time.perf_counter() - asked
        # after the query: what finished meanwhile has left Serve's queue lengths
        queue_lens = await self._queue_lens(candidate_replicas)
        now, work = time.perf_counter(), self.core.work
        candidates = [
            Candidate(
                r.replica_id, i and i.replica_id, i and i.node_id,
                work.ahead(r.replica_id, queue_lens[r.replica_id], now), i.costs if i else PRIOR,
            )
            for r, i in zip(candidate_replicas, identities)
        ]
        ranked = self.core.rank(candidates, answer, blocks)
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            if request_id not in self._requests:
                attach(pending_request, answer)
            self._requests[request_id] = (answer, {c.key: compute for c, compute in ranked})
            self.decision_s.append(time.perf_counter() - started)
            del self.decision_s[:-4096]
        replicas = {r.replica_id: r for r in candidate_replicas}
        return [[replicas[c.key]] for c, _ in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        kept = self._requests.pop(request_id, None)
        self.core.forget(request_id)
        if kept is None:
            return
        answer, computes = kept
        replica = self._replicas.get(replica_id)
        identity = self.core.identity(replica.routing_stats) if replica is not None else None
        self.core.routed(answer, identity.replica_id if identity else None)
        self.core.work.sent(replica_id, request_id, computes.get(replica_id, 0.0), time.perf_counter())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.core.work.completed(replica_id, internal_request_id, time.perf_counter())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.core.work.forget({r.replica_id for r in replicas})

    async def _queue_lens(self, replicas: Sequence[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's requests in flight: Serve's cache, probing those it lacks (a
        replica that does not answer counts as full)."""
        cache = self.replica_queue_len_cache
        lens = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if lens[r.replica_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                lens[replica.replica_id] = replica.max_ongoing_requests if queue_len is None else queue_len
        return lens

    async def _ask_directory(self, namespace: str, num_shards: int, shard: int, keys: list[OffloadKey]):
        clients = self._shards.get((namespace, num_shards))
        if clients is None:
            from ray_actors.directory import find_shards

            clients = self._shards[(namespace, num_shards)] = await asyncio.to_thread(find_shards, namespace, num_shards)
        future = clients[shard].query(keys, namespace)
        # shielded: past the deadline the query is abandoned, not cancelled under the
        # channel's reader, which answers it when it comes
        return decode_answer(await asyncio.shield(asyncio.wrap_future(future)), len(keys))[0]
