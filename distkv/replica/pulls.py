"""`RequestPulls`: the cluster manager's part for what a request may pull.

Per request, once: the Directory answer its router sent with it, if any (its lookups promote
from the holders it names and miss at once what nobody held), and the pull gate's decision
on the run of held blocks it would pull (`distkv.routing.pull_gate`: pull only where that is
expected to beat recomputing). The promotions' outcomes teach the gate what pulls take.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence

from distkv.abstract import OffloadKey, ReqContext
from distkv.directory.link import DirectoryLink
from distkv.directory.records import Holder
from distkv.observability.errors import ErrorLog
from distkv.observability.stats import RoutingCounts
from distkv.routing.answer import PARAMS_KEY, ROUTED_KINDS, RoutedAnswer, decode
from distkv.routing.pull_gate import PullGate, RequestPull, prefix_run

# the end token of each key a request recorded, as its engine records them
RequestPositions = Callable[[ReqContext], Mapping[OffloadKey, int]]


def seed_request_positions(req_context: ReqContext) -> Mapping[OffloadKey, int]:
    """The positions of a request of distkv's seed API (the harness and the demo record every block's)."""
    return req_context.offload_key_positions()


class RequestPulls:
    """What the requests of one replica (its `link`) may pull, decided by `gate`; a router's
    answer that cannot be read is ignored and logged in `errors`. `positions`: how the
    engine's requests record their keys' end tokens. Runs on the scheduler's thread."""

    def __init__(
        self, link: DirectoryLink, gate: PullGate, errors: ErrorLog, positions: RequestPositions = seed_request_positions
    ) -> None:
        self._link = link
        self.gate = gate
        self._errors = errors
        self._positions = positions
        self.routed = dict.fromkeys(ROUTED_KINDS, 0)  # routed requests, by what they found here
        self.any_routed = False  # whether a request came with its router's answer yet
        self._requests = 0  # started and not finished
        self._idle_since_step = True  # whether no request was in flight at some point since the last step end

    def request_started(self, req_context: ReqContext) -> None:
        """A request arrived: keep the Directory's answer its router sent with it, if any
        (`kv_transfer_params["distkv"]`), in its state for its lookups."""
        self._requests += 1
        params, own = getattr(req_context, "kv_transfer_params", None), self._link.info.replica_id
        answer = decode(params[PARAMS_KEY], self._link.namespace) if params and PARAMS_KEY in params else False
        if answer is None:
            self._errors.add("routed_answer", "a request carried a Directory answer distkv cannot read")
        elif answer:
            self.routed[answer.kind(own)] += 1
            if not self.any_routed:
                self.any_routed = True
                self._link.answers_routed()
            req_context.set_state(answer.without(own))

    def allowed(
        self, key: OffloadKey, holders: Sequence[Holder], req_context: ReqContext, local: Container, view: Container
    ) -> bool:
        """The gate's decision on the request's run of pullable blocks from `key` on (absent
        from `local`, held per `view` or the routed answer), made at its first promotion."""
        pull = req_context.get_state(RequestPull)
        if pull is None:
            node = self._link.info.node_id
            answer = req_context.get_state(RoutedAnswer)
            run = prefix_run(
                key,
                self._positions(req_context),
                lambda k: k not in local and (k in view or (answer is not None and k in answer.holders)),
            )
            pull = self.gate.decide("same_node" if any(h.node_id == node for h in holders) else "cross_node", run)
            req_context.set_state(pull)
        return pull.allowed

    def submitted(self, key: OffloadKey, req_context: ReqContext, now: float) -> None:
        """A promotion of `key` for the request of `req_context` started at `now`."""
        self.gate.submitted(key, req_context.get_state(RequestPull), now)

    def ended(
        self, finished: Iterable[tuple[OffloadKey, bool, bool]], now: float, unmeasured: Iterable[OffloadKey]
    ) -> None:
        """The Promoter's reports (key, ok, same node) of promotions that ended by `now`, and
        the keys whose transfer stood in for their path's (`Promoter.unmeasured`, each
        reported before it ends): those pulls are not measured."""
        self.gate.forget_pulls(unmeasured)
        for key, ok, _ in finished:
            self.gate.ended(key, ok, now)

    def abandoned(self, keys: Iterable[OffloadKey] | None = None) -> None:
        """The promotions of `keys` (all if None) were abandoned: their pulls are not measured."""
        self.gate.forget_pulls(keys)

    def request_finished(self) -> None:
        self._requests = max(self._requests - 1, 0)
        if not self._requests:
            self._idle_since_step = True

    def step_ended(self, now: float) -> None:
        """The engine's step ended: a step for the gate if a request was in flight throughout."""
        self.gate.step_ended(now, busy=not self._idle_since_step)
        self._idle_since_step = not self._requests

    def counts(self) -> RoutingCounts:
        return RoutingCounts(dict(self.routed), dict(self.gate.allowed), dict(self.gate.skipped))
