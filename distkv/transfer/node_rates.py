"""`NodeRates`: what each transport measured from each holder node, and which is due a measurement."""

from __future__ import annotations

import time
from collections.abc import Sequence


class NodeRates:
    """Per holder node, the rates (bytes/s) of each transport's measured transfers since
    its last recheck, for `NodeTransports`' "auto".

    A transport is measured on SAMPLES transfers and counts at its best (a transfer that
    waited for a core is slower than its path, never faster); every RECHECK_S afresh. One
    that another outpaces OUTPACED times at their best is not measured again until then:
    its measurements are requests' transfers, and a wait for a core does not slow a
    transfer that much. A transfer that failed or timed out measures 0 until the recheck.
    """

    SAMPLES = 3
    RECHECK_S = 60.0
    OUTPACED = 8.0

    def __init__(self) -> None:
        # node -> transport -> (its rates since the last recheck, when the first was measured)
        self._rates: dict[str, dict[str, tuple[list[float], float]]] = {}
        self._measuring: set[tuple[str, str]] = set()  # (node, transport) with a measurement in flight

    def best(self) -> dict[str, dict[str, float]]:
        """Per node measured so far, each transport's best rate since its last recheck."""
        return {node: {name: max(rates) for name, (rates, _) in list(by.items())} for node, by in list(self._rates.items())}

    def fastest(self, node_id: str, names: Sequence[str]) -> str | None:
        """Of `names`, the one with the best rate from `node_id`; None if none was measured."""
        by_transport = self._rates.get(node_id, {})
        measured = [name for name in names if name in by_transport]
        return max(measured, key=lambda name: max(by_transport[name][0]), default=None)

    def start_measuring(self, node_id: str, names: Sequence[str]) -> str | None:
        """The first of `names` due a measurement from `node_id` and not being measured, now
        being measured (`measured` ends it); None if none is."""
        now = time.monotonic()
        by_transport = self._rates.get(node_id, {})
        for name in names:
            rates, since = by_transport.get(name, ([], now))
            if now - since > self.RECHECK_S:
                due = True
            else:
                due = len(rates) < self.SAMPLES and not self._outpaced(by_transport, name, now)
            if due and (node_id, name) not in self._measuring:
                self._measuring.add((node_id, name))
                return name
        return None

    def measured(self, node_id: str, name: str, rate: float) -> None:
        """A transfer from `node_id` by `name` that `start_measuring` chose ran at `rate`; 0: it failed."""
        self._measuring.discard((node_id, name))
        by_transport, now = self._rates.setdefault(node_id, {}), time.monotonic()
        rates, since = by_transport.get(name, ([], now))
        if not rate:  # failed: no more of it until the next recheck
            by_transport[name] = ([0.0] * self.SAMPLES, now)
        elif now - since > self.RECHECK_S:
            by_transport[name] = ([rate], now)
        else:
            by_transport[name] = (rates + [rate], since)

    def keep_only(self, nodes: set[str]) -> None:
        """Forget the nodes not in `nodes`."""
        for node_id in [node_id for node_id in self._rates if node_id not in nodes]:
            del self._rates[node_id]

    def _outpaced(self, by_transport: dict[str, tuple[list[float], float]], name: str, now: float) -> bool:
        best = {n: max(rates) for n, (rates, since) in by_transport.items() if rates and now - since <= self.RECHECK_S}
        others = [rate for n, rate in best.items() if n != name]
        return name in best and bool(others) and max(others) >= self.OUTPACED * best[name]
