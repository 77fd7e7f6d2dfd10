"""A request router's decisions, without Ray: who each replica is, one Directory query per
request, and the candidates ranked by the time to first token expected there.

`RouterCore` is what `distkv.serve_router.DistkvRequestRouter` runs for each request; it
takes the way to the Directory as a function (`Ask`), so that tests hand it fakes:

1. Each replica says who it is in distkv in its routing stats (`routing_stats`): its
   replica id and node, its cache namespace and Directory shards, how its engine computes
   a prompt's keys, and what its pull gate measured. `identity` reads that back.
2. `answer` computes the prompt's keys as the candidates' engine does and asks the shard of
   its first key (where the Directory keeps the prefix) which replicas hold them, once per
   request and within `deadline_s`. Without an answer (past the deadline, the Directory
   failing, no token ids, no replica that said who it is) the request is routed on load
   alone, and `fallbacks` counts why.
3. `rank` orders the candidates by `distkv.routing.score.ExpectedTTFT`, each waiting for the
   work ahead of it (`work`: `distkv.routing.work_ahead.WorkAhead`, told by `sent` and
   `completed` what went where and when it ended).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distkv.abstract import OffloadKey
from distkv.directory.client import MAX_BATCH_KEYS
from distkv.directory.placement import shard_of
from distkv.routing.answer import ROUTED_KINDS, RoutedAnswer, from_directory, load_only
from distkv.routing.keys import PromptKeys, from_scheme
from distkv.routing.score import PRIOR, PRIOR_OVERHEAD_S, PRIOR_SERVICE_S, Candidate, Costs, ExpectedTTFT, HeldPrefix
from distkv.routing.work_ahead import WorkAhead

# the key of distkv's entry in a replica's routing stats
STATS_KEY = "distkv"
# How long a request's routing waits for the Directory's answer before it routes on load
# alone: docs/routing.md gives the query times behind it.
QUERY_DEADLINE_S = 0.05
# requests whose answer is kept (for the retries of their routing) at most
MAX_REQUESTS = 4096
# routing stats entries whose identity is kept at most (a few per replica: Serve sends new
# stats every request_routing_stats_period_s)
MAX_IDENTITIES = 1024
FALLBACKS = ("no_tokens", "no_identity", "no_keys", "deadline", "directory_error")

# ask(namespace, num_shards, shard, keys) -> the holders of each key, as the shard answers them
Ask = Callable[[str, int, int, list[OffloadKey]], Awaitable[Sequence[Sequence]]]


@dataclass(frozen=True)
class Identity:
    """A replica as distkv knows it, from its routing stats."""

    replica_id: str
    node_id: str
    namespace: str
    directory_shards: int
    keys: PromptKeys
    costs: Costs


def routing_stats(manager: Any, keys: PromptKeys) -> dict[str, Any]:
    """What a replica returns from its deployment's `record_routing_stats` (under
    STATS_KEY): `manager` is its ClusterOffloadingManager, `keys` how its engine keys prompts."""
    info = manager.link.info
    return {
        STATS_KEY: {
            "replica_id": info.replica_id,
            "node_id": info.node_id,
            "namespace": manager.link.namespace,
            "directory_shards": manager.link.num_shards,
            "keys": keys.scheme(),
            "costs": manager.pulls.gate.estimates(),
        }
    }


class RouterCore:
    """The router's state: identities, answers per request, decisions and fallbacks counted."""

    def __init__(self, ask: Ask, deadline_s: float = QUERY_DEADLINE_S, score: ExpectedTTFT | None = None) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s={deadline_s!r} must be positive")
        self.ask = ask
        self.deadline_s = deadline_s
        self.score = score or ExpectedTTFT()
        self.work = WorkAhead(PRIOR_OVERHEAD_S, PRIOR_SERVICE_S)
        self.decisions = dict.fromkeys(ROUTED_KINDS, 0)
        self.fallbacks = dict.fromkeys(FALLBACKS, 0)
        # seconds of each Directory query answered, newest last
        self.query_s: collections.deque[float] = collections.deque(maxlen=4096)
        self._answers: collections.OrderedDict[Any, tuple[RoutedAnswer, int]] = collections.OrderedDict()
        self._schemes: dict[tuple, PromptKeys] = {}
        # id(stats entry) -> (the entry, its identity): Serve hands the router a new stats
        # object when a replica's stats change and the same one until then, so an identity is
        # read once per update, not once per candidate per request (the entry is kept, so
        # its id is not reused while cached)
        self._identities: dict[int, tuple[Mapping, Identity | None]] = {}

    def identity(self, stats: Mapping[str, Any] | None) -> Identity | None:
        """The identity a replica's routing stats give; None if they give none (yet)."""
        entry = stats.get(STATS_KEY) if stats else None
        if not isinstance(entry, Mapping):
            return None
        cached = self._identities.get(id(entry))
        if cached is not None and cached[0] is entry:
            return cached[1]
        if len(self._identities) >= MAX_IDENTITIES:
            self._identities.clear()
        identity = self._read_identity(entry)
        self._identities[id(entry)] = (entry, identity)
        return identity

    def _read_identity(self, entry: Mapping[str, Any]) -> Identity | None:
        try:
            scheme = tuple(sorted(entry["keys"].items()))
            keys = self._schemes.get(scheme)
            if keys is None:
                keys = self._schemes[scheme] = from_scheme(entry["keys"])
            return Identity(
                str(entry["replica_id"]), str(entry["node_id"]), str(entry["namespace"]),
                int(entry["directory_shards"]), keys, PRIOR.from_estimates(entry.get("costs")),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    async def answer(
        self, request: Any, token_ids: Sequence[int] | None, cache_salt: str | None, identities: Sequence[Identity | None]
    ) -> tuple[RoutedAnswer, int]:
        """The Directory's answer for `request` (any hashable id) and the prompt's blocks;
        asked once per request, kept for the retries of its routing."""
        kept = self._answers.get(request)
        if kept is not None:
            return kept
        kept = await self._ask(token_ids, cache_salt, identities)
        self._answers[request] = kept
        while len(self._answers) > MAX_REQUESTS:
            self._answers.popitem(last=False)
        return kept

    def forget(self, request: Any) -> None:
        self._answers.pop(request, None)

    def rank(self, candidates: Sequence[Candidate], answer: RoutedAnswer, blocks: int) -> list[tuple[Candidate, float]]:
        """The candidates best first, each with the compute expected of the request there."""
        return self.score.rank(candidates, HeldPrefix(answer, blocks))

    def routed(self, answer: RoutedAnswer, replica_id: str | None) -> str:
        """Count, and return, what routing a request with `answer` to `replica_id` was."""
        kind = answer.kind(replica_id) if replica_id is not None else "load_only"
        self.decisions[kind] += 1
        return kind

    async def _ask(
        self, token_ids: Sequence[int] | None, cache_salt: str | None, identities: Sequence[Identity | None]
    ) -> tuple[RoutedAnswer, int]:
        known = [i for i in identities if i is not None]
        if not known:
            return self._fallback("no_identity", ""), 0
        ident = known[0]
        if any(i.namespace != ident.namespace for i in known):  # a deployment mid-update: the most common
            namespace = collections.Counter(i.namespace for i in known).most_common(1)[0][0]
            ident = next(i for i in known if i.namespace == namespace)
        namespace = ident.namespace
        if token_ids is None:
            return self._fallback("no_tokens", namespace), 0
        try:
            keys = ident.keys.keys(token_ids, cache_salt)
        except (TypeError, ValueError):
            return self._fallback("no_keys", namespace), 0
        if not keys:
            return from_directory(namespace, [], []), 0
        asked = keys[:MAX_BATCH_KEYS]
        started = time.perf_counter()
        try:
            holders = await asyncio.wait_for(
                self.ask(namespace, ident.directory_shards, shard_of(asked[0], ident.directory_shards), asked),
                self.deadline_s,
            )
        except asyncio.TimeoutError:
            return self._fallback("deadline", namespace), len(keys)
        except Exception:  # the Directory is down or restarting: route on load
            return self._fallback("directory_error", namespace), len(keys)
        self.query_s.append(time.perf_counter() - started)
        return from_directory(namespace, asked, holders), len(keys)

    def _fallback(self, reason: str, namespace: str) -> RoutedAnswer:
        self.fallbacks[reason] += 1
        return load_only(namespace)
