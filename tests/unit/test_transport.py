"""NodeTransports: which transport reads each holder node, by the `transport` setting."""

from __future__ import annotations

import dataclasses
import logging
import sys
import uuid

import pytest

from distkv.directory.records import ReplicaInfo
from distkv.transfer.endpoint_seal import EndpointSeal, new_secret
from distkv.names import segment_name
from distkv.storage.pool import PAGE_BYTES, HostPool, PoolLayout
from distkv.replica.join import node_transports
from distkv.transfer.node_rates import NodeRates
from distkv.transfer.transport import NodeTransports, RowRead, Transfer, Transport, _Timed

ENDPOINT = b"a sealed endpoint"
SEAL = EndpointSeal("ns", new_secret(), "")


def holder(node: str, endpoint: bytes | None = ENDPOINT) -> ReplicaInfo:
    return ReplicaInfo(f"r-{node}", node, "distkv-ns-r", 16, 1, 4096, endpoint=endpoint)


class FakeTransfer(Transfer):
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.finished = False
        self.fail = False

    def done(self) -> bool:
        return self.finished

    def finish(self):
        if self.fail:
            raise ConnectionError("the peer went away")
        return [None]

    def cancel(self) -> None:
        pass


class FakeTransport(Transport):
    def __init__(self, name: str) -> None:
        self.name = name
        self.started: list[FakeTransfer] = []

    def start(self, holder, reads, wake, into=None):
        self.started.append(FakeTransfer(self.name))
        return self.started[-1]

    def endpoint_of(self, holder):
        """As NixlTransport's: here every endpoint a holder registered opens."""
        return holder.endpoint


class FakeNixl(FakeTransport):
    """As NixlTransport: connects to a holder's agent on `connect`, at once unless
    `at_once` is False; then `reach` ends the connection."""

    def __init__(self, at_once: bool = True) -> None:
        super().__init__("nixl")
        self.at_once = at_once
        self.connections: dict[str, bool] = {}

    def connect(self, holder):
        if holder.endpoint is not None:
            self.connections.setdefault(holder.replica_id, self.at_once)

    def reach(self, holder):
        self.connections[holder.replica_id] = True

    def connected(self, holder):
        return self.connections.get(holder.replica_id, False)


@pytest.fixture
def transports():
    return FakeTransport("object_store"), FakeNixl()


READS = [RowRead(b"k" * 36, 0, 1, 0)]


def complete(transfer: Transfer, clock: list[float], seconds: float) -> None:
    """Make `transfer` done `seconds` after its start, then land it."""
    clock[0] = transfer._started + seconds
    transfer._inner.finished = True
    assert transfer.done()
    transfer.finish()


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("distkv.transfer.transport.time.perf_counter", lambda: now[0])
    monkeypatch.setattr("distkv.transfer.transport.time.monotonic", lambda: now[0])
    return now


def measure(chooser: NodeTransports, b: ReplicaInfo, clock: list[float], seconds: dict[str, list[float]]) -> None:
    """Land the transfers from b that measure the transports, one at a time: each
    transport's take `seconds[its name]` in turn."""
    left = {name: list(taken) for name, taken in seconds.items()}
    while any(left.values()):
        transfer = chooser.start(b, READS, lambda: None)
        complete(transfer, clock, left[transfer.transport].pop(0))


def test_auto_measures_both_on_real_transfers_then_keeps_the_faster(transports, clock):
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")
    first, second = chooser.start(b, READS, lambda: None), chooser.start(b, READS, lambda: None)
    assert (first.transport, second.transport) == ("nixl", "object_store")
    # both measurements in flight: the portable path
    assert chooser.start(b, READS, lambda: None).transport == "object_store"
    complete(first, clock, 0.001)
    complete(second, clock, 0.004)
    measure(chooser, b, clock, {"nixl": [0.001] * 2, "object_store": [0.004] * 2})
    assert chooser.rates()["b"]["nixl"] > chooser.rates()["b"]["object_store"]
    assert [chooser.start(b, READS, lambda: None).transport for _ in range(3)] == ["nixl"] * 3


def test_one_slow_transfer_does_not_hand_a_node_to_the_slower_transport(transports, clock):
    """A transfer that waited for a core (or for anything else once) is slower than its
    path, never faster: each transport counts at its best."""
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")
    measure(chooser, b, clock, {"nixl": [0.001, 0.002, 0.030], "object_store": [0.004] * NodeRates.SAMPLES})
    assert chooser.chosen(b) is nixl


def test_auto_reads_through_the_object_store_until_nixl_connected_to_the_holder(clock):
    """UCX wires two agents up on their first READ: a request does not wait for it, no
    measurement counts it, and the object store is measured meanwhile."""
    object_store, nixl = FakeTransport("object_store"), FakeNixl(at_once=False)
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")
    first, second = chooser.start(b, READS, lambda: None), chooser.start(b, READS, lambda: None)
    assert (first.transport, second.transport) == ("object_store", "object_store")
    assert first.stands_in and second.stands_in  # for the path the next ones take
    assert nixl.connections == {b.replica_id: False}  # connecting, once
    complete(first, clock, 0.004)
    assert list(chooser.rates()["b"]) == ["object_store"] and chooser.chosen(b) is object_store
    nixl.reach(b)
    measure(chooser, b, clock, {"nixl": [0.001] * 3, "object_store": [0.004] * 2})
    assert chooser.chosen(b) is nixl
    assert not chooser.start(b, READS, lambda: None).stands_in


def test_the_nixl_setting_waits_for_its_connection(transports):
    object_store, _ = transports
    nixl = FakeNixl(at_once=False)
    chooser = NodeTransports(object_store, nixl, "nixl")
    transfer = chooser.start(holder("b"), READS, lambda: None)
    assert transfer.transport == "nixl" and not transfer.stands_in
    assert nixl.connections == {}  # its first READ connects


def test_auto_keeps_the_object_store_where_nixl_measured_slower(transports, clock):
    """UCX with TCP only emulates one-sided reads, slower than the object store."""
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")
    measure(chooser, b, clock, {"nixl": [0.010] * 3, "object_store": [0.002] * 3})
    assert chooser.start(b, READS, lambda: None).transport == "object_store"
    # once RECHECK_S has passed, both are measured afresh
    clock[0] += NodeRates.RECHECK_S + 1
    measure(chooser, b, clock, {"nixl": [0.0005] * 3, "object_store": [0.002] * 3})
    assert chooser.chosen(b) is nixl


def test_a_transport_outpaced_many_times_is_not_measured_again_until_the_recheck(transports, clock):
    """Its measurements would be requests' transfers, each that much slower."""
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")
    first, second = chooser.start(b, READS, lambda: None), chooser.start(b, READS, lambda: None)
    complete(first, clock, 0.0001)
    complete(second, clock, 0.0002 * NodeRates.OUTPACED)
    taken = []
    for _ in range(8):
        transfer = chooser.start(b, READS, lambda: None)
        taken.append(transfer.transport)
        if isinstance(transfer, _Timed):
            complete(transfer, clock, 0.0001)
    assert taken == ["nixl"] * 8 and len(nixl.started) == 9 and len(object_store.started) == 1
    clock[0] += NodeRates.RECHECK_S + 1
    assert [chooser.start(b, READS, lambda: None).transport for _ in range(2)] == ["nixl", "object_store"]


def test_a_failed_transfer_measures_nothing_but_zero(transports, clock):
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")
    first, second = chooser.start(b, READS, lambda: None), chooser.start(b, READS, lambda: None)
    first._inner.fail = True
    with pytest.raises(ConnectionError):
        complete(first, clock, 0.001)
    complete(second, clock, 0.004)
    assert chooser.rates()["b"]["nixl"] == 0.0
    assert chooser.chosen(b) is object_store


def test_a_transfer_that_does_not_start_measures_zero(transports, clock):
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b = holder("b")

    def refuse(*args, **kwargs):
        raise ConnectionError("no agent there")

    nixl.start = refuse
    with pytest.raises(ConnectionError, match="no agent there"):
        chooser.start(b, READS, lambda: None)
    assert chooser.rates()["b"]["nixl"] == 0.0
    assert chooser.start(b, READS, lambda: None).transport == "object_store"


def test_nodes_are_measured_apart(transports, clock):
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    first, second = chooser.start(holder("b"), READS, lambda: None), chooser.start(holder("b"), READS, lambda: None)
    complete(first, clock, 0.001)
    complete(second, clock, 0.004)
    assert chooser.start(holder("c"), READS, lambda: None).transport == "nixl"  # c's first measurement
    assert "c" not in chooser.rates()


def test_a_holder_without_an_endpoint_is_read_through_the_object_store(transports):
    object_store, nixl = transports
    for mode in ("auto", "nixl"):
        chooser = NodeTransports(object_store, nixl, mode)
        assert chooser.start(holder("b", endpoint=None), READS, lambda: None).transport == "object_store"


def test_nixl_and_object_store_modes_do_not_measure(transports):
    object_store, nixl = transports
    assert NodeTransports(object_store, nixl, "nixl").start(holder("b"), READS, lambda: None).transport == "nixl"
    only = NodeTransports(object_store, nixl, "object_store")
    assert only.start(holder("b"), READS, lambda: None).transport == "object_store"
    assert only.rates() == {}


def test_rates_are_kept_only_for_nodes_where_the_directory_lists_a_holder(transports, clock):
    """The rates go out with every heartbeat: a node whose holders all left (or whose
    holders the Directory dropped with the node) leaves them, and one measured again comes
    back; a holder listed on another node now no longer keeps its old one."""
    object_store, nixl = transports
    chooser = NodeTransports(object_store, nixl, "auto")
    b1, b2, c = holder("b"), dataclasses.replace(holder("b"), replica_id="r-b2"), holder("c")
    for h in (b1, c):
        first, second = chooser.start(h, READS, lambda: None), chooser.start(h, READS, lambda: None)
        complete(first, clock, 0.001)
        complete(second, clock, 0.004)
    chooser.start(b2, READS, lambda: None)
    assert set(chooser.rates()) == {"b", "c"}
    listed = {h.replica_id: h for h in (b1, b2, c)}
    chooser.forget_gone(listed.get)
    assert set(chooser.rates()) == {"b", "c"}
    del listed["r-b"]
    chooser.forget_gone(listed.get)
    assert set(chooser.rates()) == {"b", "c"}  # r-b2 is still on b
    del listed["r-b2"]
    listed["r-c"] = dataclasses.replace(c, node_id="d")  # restarted on node d
    chooser.forget_gone(listed.get)
    assert chooser.rates() == {}
    again = chooser.start(listed["r-c"], READS, lambda: None)
    complete(again, clock, 0.001)
    assert set(chooser.rates()) == {"d"}


def test_without_nixl_everything_goes_through_the_object_store(transports):
    object_store, _ = transports
    chooser = NodeTransports(object_store, None, "auto")
    assert chooser.endpoint is None
    assert chooser.start(holder("b"), READS, lambda: None).transport == "object_store"


@pytest.fixture
def pool():
    pool = HostPool(segment_name("t" + uuid.uuid4().hex[:8], "r"), PoolLayout(4, 1, PAGE_BYTES))
    yield pool
    pool.close()


def test_nixl_missing_stops_a_replica_that_asked_for_it(pool, monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(ValueError, match=r"'transport'='nixl'.*pip install 'ray-distkv\[rdma\]'"):
        node_transports("nixl", pool, FakeTransport("object_store"), SEAL)


def test_a_nixl_agent_that_does_not_start_stops_a_replica_that_asked_for_it(pool, monkeypatch):
    def no_ucx(api, name, progress_delay_us):
        raise RuntimeError("no UCX backend")

    monkeypatch.setattr("distkv.transfer.rdma.load_nixl", object)
    monkeypatch.setattr("distkv.transfer.rdma._agent_waking_on_events", no_ucx)
    with pytest.raises(ValueError, match=r"'transport'='nixl'.*did not start \(no UCX backend\).*'object_store'"):
        node_transports("nixl", pool, FakeTransport("object_store"), SEAL)


def test_nixl_missing_leaves_auto_on_the_object_store_and_says_why_once(pool, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "nixl", None)
    with caplog.at_level(logging.WARNING, logger="distkv.replica.join"):
        chooser = node_transports("auto", pool, FakeTransport("object_store"), SEAL)
    assert chooser.endpoint is None
    assert [r.getMessage() for r in caplog.records if "object store only" in r.getMessage()] == [
        "distkv: transport 'auto' reads other nodes through the object store only: "
        "the nixl transport needs NIXL (import of nixl halted; None in sys.modules): pip install 'ray-distkv[rdma]'"
    ]
    assert chooser.start(holder("b"), READS, lambda: None).transport == "object_store"


def test_the_object_store_setting_registers_nothing(pool, monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # not even imported
    assert node_transports("object_store", pool, FakeTransport("object_store"), SEAL).endpoint is None
