"""bench/scale.py's load generator and model, without Ray: the generator's lightweight
replicas against fake shards must offer exactly what the shards apply, ask one query
call per shard a request's keys touch, and the model must give docs/scale.md's figures
from its inputs. Nothing here is timed."""

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from directory_fakes import Clock, FakeShard

from distkv.directory.state import DirectoryState
from distkv.directory.relay import PublishRelay



def load_scale():
    spec = importlib.util.spec_from_file_location("bench_scale", Path(__file__).resolve().parents[2] / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


scale = load_scale()
NAMESPACE = "scaletest"


class Relayed:
    """Fake shards behind a node's PublishRelay: the clients a relayed generator publishes through."""

    def __init__(self, shards, clock) -> None:
        self.shards = shards
        self.relay = PublishRelay(NAMESPACE, shards, clock=clock)
        self.clock = clock

    def answer(self) -> None:
        """The relay sends what is due, the shards answer, the relay hands the answers on."""
        self.relay.step(self.clock())
        answer_all(self.shards)
        self.relay.step(self.clock())


def answer_all(shards):
    if isinstance(shards, Relayed):
        shards.answer()
        return
    for shard in shards:
        shard.answer()


def applied(shards) -> int:
    return sum(s.state.stats().get("stored", 0) + s.state.stats().get("removed", 0) for s in shards)


def drain(generator, shards, clock):
    for _ in range(100):
        answer_all(shards)
        generator.step(clock(), offer=False)
        generator.step_busy(clock())
        if generator.drained:
            return
        clock.now += 0.01
    raise AssertionError("the generator never drained")


@pytest.fixture(params=["direct", "relayed"])
def run(request):
    """A generator of 4 replicas on 3 fake shards, filled, then offering load for 6 s of its
    clock; its replicas publish to the shards themselves or through one relay."""
    shards = [FakeShard() for _ in range(3)]
    clock = Clock(100.0)
    rates = scale.LoadRates(events_per_s=100, requests_per_s=1.0, query_keys=20, flush_s=2.0, held=256)
    relayed = Relayed(shards, clock) if request.param == "relayed" else None
    generator = scale.LoadGenerator(
        NAMESPACE, "node0", [10, 11, 12, 13], shards, rates, clock=clock, path=relayed.relay if relayed else None
    )
    answering = relayed or shards
    generator.fill(clock())
    drain(generator, answering, clock)
    before = applied(shards)
    generator.start(clock())
    start = clock.now
    for tick in range(1, 121):  # 6 s of 50 ms steps
        clock.now = start + tick / 20
        generator.step(clock())
        answer_all(answering)
    drain(generator, answering, clock)
    return generator, shards, before, rates


class SlowRegisters(FakeShard):
    """A shard that answers every call at once, on the test's clock, and takes `register_s`
    of it for a register: a fill among many processes on few cores."""

    def __init__(self, clock, register_s: float) -> None:
        super().__init__()
        self.state = DirectoryState(clock=clock)
        self.clock = clock
        self.register_s = register_s

    def _call(self, method: str, *args):
        future = super()._call(method, *args)
        if method == "register":
            self.clock.now += self.register_s
        self.answer()
        return future


def test_the_replicas_that_registered_heartbeat_while_the_others_of_the_process_register():
    clock = Clock(100.0)
    shards = [SlowRegisters(clock, register_s=0.5) for _ in range(2)]
    rates = scale.LoadRates(events_per_s=100, requests_per_s=1.0, query_keys=20, flush_s=2.0, held=512)
    generator = scale.LoadGenerator(NAMESPACE, "node0", list(range(32)), shards, rates, clock=clock)
    started = clock()
    generator.fill(started)
    timeout_s = 10.0  # a shard's replica timeout (ray_actors.directory.REPLICA_TIMEOUT_S)
    assert clock() - started > timeout_s  # 64 registers of 0.5 s
    assert [shard.state.expire(clock(), timeout_s) for shard in shards] == [[], []]


def test_every_event_offered_is_applied_once(run):
    generator, shards, before, rates = run
    offered = generator.offered["stored"] + generator.offered["removed"]
    assert offered == 4 * 6 * rates.events_per_s  # 4 replicas, 6 s
    assert applied(shards) - before == offered
    # each replica still holds exactly its `held` newest keys, on the shard its key hashes to
    for r, index in enumerate(generator.replicas):
        held = {k for s in shards for k in s.held_by(f"load{index}") if s.state.query([k])[0]}
        newest = {scale.load_key(index, i) for i in range(generator.next_key[r] - rates.held, generator.next_key[r])}
        assert held == newest


def test_a_publisher_publishes_once_per_flush_interval(run):
    generator, shards, _, rates = run
    publishes = sum(s.state.stats()["publishes"] for s in shards)
    # fill: a register and its drain; then one publish per shard per replica per 2 s (6 s: 3 or 4), then the drain
    per_publisher = publishes / (4 * 3)
    assert 3 <= per_publisher <= 7


def test_a_relay_carries_the_replicas_publishes_in_fewer_calls(run):
    generator, shards, _, rates = run
    stats = [s.state.stats() for s in shards]
    relayed = sum(s.get("relayed_publishes", 0) for s in stats)
    if isinstance(generator.path, scale.DirectPublish):
        assert relayed == 0
        return
    # every publish but the registers' went through the relay, several to a call
    assert relayed == sum(s["publishes"] + s.get("ignored_publishes", 0) - s["registers"] for s in stats)
    assert sum(s["relay_calls"] for s in stats) < relayed


def test_a_request_is_one_query_call_to_the_shard_of_its_prefix_and_hits(run):
    generator, shards, _, rates = run
    assert generator.offered["requests"] == 4 * 6
    queries = sum(s.state.stats().get("queries", 0) for s in shards)
    assert queries == generator.offered["query_calls"] == sum(generator.calls_of)
    summary = generator.summary()
    assert summary["failed_calls"] == 0
    assert summary["hits"] == generator.offered["query_keys"] == 4 * 6 * rates.query_keys
    assert len(generator.latencies()) == generator.offered["requests"]
    # a request asks for one prefix, which its replica placed on one shard
    assert set(generator.calls_of) == {1}


@pytest.mark.parametrize("num_shards", [4, 16])
def test_the_replicas_prefixes_spread_over_every_shard(num_shards):
    """As a fleet's do, whose keys are hashes: a shard that no prefix lands on leaves its share
    of the load to the others."""
    clock = Clock(100.0)
    shards = [FakeShard() for _ in range(num_shards)]
    rates = scale.LoadRates(events_per_s=100, requests_per_s=0.2, query_keys=scale.MODEL_QUERY_KEYS, flush_s=2.0, held=2048)
    generator = scale.LoadGenerator(NAMESPACE, "node0", list(range(8)), shards, rates, clock=clock)
    generator.fill(clock())
    drain(generator, shards, clock)
    keys = [s.state.stats()["keys"] for s in shards]
    share = sum(keys) / num_shards
    assert sum(keys) == 8 * rates.held
    assert all(0.6 * share <= k <= 1.4 * share for k in keys), keys


def test_the_model_gives_the_documented_fleet_from_the_documented_inputs():
    inputs = scale.ModelInputs(
        c_call=265e-6, c_query_call=265e-6, c_pub=1.95e-6, c_query=2.58e-6, m_key=349, m_holder=220, source="docs/scale.md"
    )
    fleet = scale.fleet_model(inputs)
    assert fleet["shards"] == 20 and fleet["cpu_shards"] == 20 and fleet["memory_shards"] == 10
    assert fleet["cores"] == pytest.approx(9.9, abs=0.05)
    assert fleet["calls_per_s"] == pytest.approx(19.8e3, rel=0.01)
    assert fleet["memory_bytes"] == pytest.approx(39.3e9, rel=0.01)
    # publishes alone take every shard's half core: no number of shards is enough
    assert scale.fleet_model(inputs, flush_s=0.5)["shards"] == math.inf


def test_queries_over_the_channel_cost_the_model_their_own_call_cost():
    inputs = scale.ModelInputs(
        c_call=1650e-6, c_query_call=10e-6, c_pub=1.3e-6, c_query=2.9e-6, m_key=353, m_holder=171, source="test"
    )
    fleet = scale.fleet_model(inputs, replicas_per_publisher=scale.NODE_REPLICAS)
    as_ray_calls = scale.fleet_model(dataclasses.replace(inputs, c_query_call=inputs.c_call), replicas_per_publisher=scale.NODE_REPLICAS)
    queries = scale.FLEET_REPLICAS * scale.MODEL_REQUESTS_PER_S
    publishes = fleet["calls_per_s"] - queries
    assert fleet["cores"] == pytest.approx(
        fleet["shards"] * inputs.c_idle + publishes * inputs.c_call + queries * inputs.c_query_call
        + fleet["events_per_s"] * inputs.c_pub + fleet["keys_queried_per_s"] * inputs.c_query
    )
    assert fleet["shards"] < as_ray_calls["shards"] and fleet["cores"] < as_ray_calls["cores"]


def test_the_fitted_cost_per_call_explains_the_points():
    c_call, c_query_call, c_pub, c_query = 300e-6, 20e-6, 2e-6, 3e-6
    points = [
        {"calls_per_s": calls + queries, "query_calls": queries * 10, "wall_s": 10, "events_per_s": events, "queried_keys_per_s": keys,
         "directory_cpu_us_per_channel_query": c_query_call * 1e6,
         "directory_cores": calls * c_call + queries * c_query_call + events * c_pub + keys * c_query}
        for calls, queries, events, keys in ((100, 10, 5000, 900), (800, 40, 20000, 3600), (3000, 40, 25000, 3600))
    ]
    assert scale.fitted_call_cost(points, c_pub, c_query) == pytest.approx(c_call)


def test_figures_from_before_the_query_channel_are_refused_by_the_model():
    point = {"calls_per_s": 10, "query_calls": 10, "wall_s": 10, "events_per_s": 1, "queried_keys_per_s": 1, "directory_cores": 0.1}
    with pytest.raises(ValueError, match="before the query channel"):
        scale.fitted_call_cost([point], 1e-6, 1e-6)


def test_requests_start_with_the_load_not_with_the_fill():
    """A long fill must not leave a backlog of requests that all go out at the first step."""
    shards = [FakeShard() for _ in range(2)]
    clock = Clock(100.0)
    rates = scale.LoadRates(events_per_s=0, requests_per_s=1.0, query_keys=10, flush_s=2.0, held=64)
    generator = scale.LoadGenerator(NAMESPACE, "node0", [1, 2], shards, rates, clock=clock)
    generator.fill(clock())
    clock.now += 30.0  # the fill's drain took long
    drain(generator, shards, clock)
    generator.start(clock())
    clock.now += 1.0
    generator.step(clock())
    assert generator.offered["requests"] == 2


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="Linux's schedstat only")
def test_cpu_wait_counts_the_time_a_process_waits_for_a_cpu_another_holds():
    cpu = min(os.sched_getaffinity(0))
    spin = "for _ in range(40_000_000): pass"
    # two processes that want the same one CPU all the time: each waits while the other runs
    procs = [
        subprocess.Popen([sys.executable, "-c", spin], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        for _ in range(2)
    ]
    waited = {p.pid: 0.0 for p in procs}
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                if p.poll() is None:  # not reaped yet: its /proc entry is there to read
                    waited[p.pid] = max(waited[p.pid], scale.cpu_wait_seconds(psutil.Process(p.pid)))
            time.sleep(0.05)
    finally:
        for p in procs:
            p.wait()
    assert max(waited.values()) > 0.3
