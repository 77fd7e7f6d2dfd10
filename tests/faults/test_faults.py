"""Faults injected while replicas serve shared prefixes, and what every one must leave intact.

For each fault: nothing wrong is loaded (every loaded block is checked against what
computing it gives), no request waits on "retry" past the promotion timeout, no surviving
replica crashes, the hit rate is back within 10 s of the fault's end, and no thread,
object or shared-memory segment is left over. One simulated cluster (a head and three
nodes) serves the module; the node-removal test takes the third node away, so it runs last.
"""

import os
import signal
import time

import numpy as np
import pytest
import ray
from ray._private.authentication.authentication_utils import is_token_auth_enabled
from workload import (
    BLOCK_TOKENS,
    SLOT_BYTES,
    Workload,
    actor_pid,
    node_agent,
    sigkill,
    wait_until,
)

from distkv.directory.records import ReplicaInfo
from distkv.directory.wire import encode_changes, encode_stored
from distkv.directory.wire import decode_answer
from distkv.replica.harness import block_keys
from distkv.names import segment_name
from distkv.storage.pool import PoolLayout
from distkv.storage.segments import reclaim_stale_segments
from ray_actors.directory import get_or_create_shards, kill_shards


@pytest.fixture
def make_workload(cluster):
    made: list[Workload] = []

    def make(**kw) -> Workload:
        made.append(Workload(**kw))
        return made[-1]

    yield make
    for w in made:  # a failed test still leaves nothing running
        for actor in w.actors.values():
            ray.kill(actor)
        kill_shards(w.namespace)


def steady(w: Workload, seconds: float) -> tuple[float, dict]:
    """Warm the docs in, then serve for `seconds`: the hit rate before the fault, and threads."""
    w.warm()
    w.run(1.0)
    start = time.time()
    w.run(seconds)
    baseline = w.hit_rate(start, time.time())
    assert baseline is not None and baseline > 0.3, f"the workload hardly hits before the fault: {baseline}"
    return baseline, w.threads()


def durations(long_run: bool) -> dict:
    return {"baseline": 6.0 if long_run else 3.0, "repeat": 8 if long_run else 3, "stall": 15.0 if long_run else 4.0}


def test_node_agent_killed_during_promotions(cluster, make_workload, long_run):
    _, (n1, n2, _) = cluster
    d = durations(long_run)
    w = make_workload()
    w.start([("a", n1), ("b", n1), ("c", n2)])
    baseline, threads = steady(w, d["baseline"])
    def cross_node() -> dict:
        stats = ray.get([a.stats.remote() for a in w.actors.values()], timeout=30)
        return {k: sum(getattr(s.promotions, k)["cross_node"] for s in stats) for k in ("succeeded", "failed")}

    before = cross_node()
    assert before["succeeded"] > 0, "no cross-node promotion before the fault: nothing for the agents to serve"
    fault_start = time.time()
    for i in range(d["repeat"]):
        node = (n1, n2)[i % 2]  # a and b's blocks are served to c by n1's agent, c's to a and b by n2's
        sigkill(actor_pid(node_agent(node.node_id)))
        w.run(1.0)
    fault_end = time.time()
    recovery = w.run_until_recovered(baseline, fault_end)
    after = cross_node()
    assert after["succeeded"] > before["succeeded"], f"cross-node promotions never resumed: {before} -> {after}"
    out = w.outcome("NodeAgent SIGKILLed during promotions", fault_start, fault_end, baseline, threads)
    out.notes.append(f"recovered {recovery}")
    w.check(out)


def test_replica_sigkilled_mid_store_and_restarted(cluster, make_workload, long_run):
    _, (n1, n2, _) = cluster
    d = durations(long_run)
    w = make_workload()
    w.start([("a", n1), ("b", n1), ("c", n2)])
    baseline, threads = steady(w, d["baseline"])
    fault_start = time.time()
    for _ in range(max(1, d["repeat"] // 3)):
        pid = ray.get(w.actors["b"].pid.remote(), timeout=30)
        w.run(0.3)  # b is mid-request: lookups, loads and stores in flight
        w.expect_death("b")
        sigkill(pid)
        w.run(1.0)  # the others keep promoting from b's rows (its segment outlives it)
        w.restart("b")  # b's engine comes back under the same name and pool
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end)
    threads.pop("b")  # a new process
    out = w.outcome("replica process SIGKILLed mid-store, then restarted", fault_start, fault_end, baseline, threads)
    w.check(out)


def test_holder_sigkilled_during_nixl_reads(cluster, make_workload, long_run):
    """Replicas on two other nodes read a's rows one-sidedly while a is SIGKILLed and
    restarted under its name: reads from the dead process fail into misses, the restarted
    one (a new NIXL agent) is connected afresh, and nothing is left held."""
    _, (n1, n2, n3) = cluster
    d = durations(long_run)
    w = make_workload(transport="nixl")
    w.start([("a", n1), ("c", n2), ("d", n3)])
    baseline, threads = steady(w, d["baseline"])

    def by_nixl() -> int:
        stats = ray.get([w.actors[n].stats.remote() for n in ("c", "d")], timeout=30)
        return sum(s.promotions.transports["nixl"].blocks for s in stats if "nixl" in s.promotions.transports)

    before = by_nixl()
    assert before > 0, "no block came by NIXL before the fault"
    fault_start = time.time()
    for _ in range(max(1, d["repeat"] // 3)):
        pid = ray.get(w.actors["a"].pid.remote(), timeout=30)
        w.run(0.3)  # c and d are mid-request, reading a's rows
        w.expect_death("a")
        sigkill(pid)
        w.run(1.0)
        w.restart("a")
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end)
    assert by_nixl() > before, "reads by NIXL never resumed after the holder came back"
    # once idle: every scratch slot back, and no more peers than live replicas to read from
    for name in ("c", "d"):
        state = ray.get(w.actors[name].nixl_state.remote(), timeout=30)
        assert state["scratch_free"] == state["scratch"], f"{name} holds NIXL scratch after the reads: {state}"
        assert state["peers"] <= 2, f"{name} keeps peers of dead holders: {state}"
    threads.pop("a")
    out = w.outcome("holder SIGKILLed during NIXL reads, then restarted", fault_start, fault_end, baseline, threads)
    w.check(out)


def nixl_blocks(w: Workload, names: tuple[str, ...]) -> dict[str, int]:
    """Blocks the replicas `names` promoted so far, by transport."""
    stats = ray.get([w.actors[n].stats.remote() for n in names], timeout=30)
    moved: dict[str, int] = {}
    for s in stats:
        for transport, counts in s.promotions.transports.items():
            moved[transport] = moved.get(transport, 0) + counts.blocks
    return moved


def assert_nixl_idle(w: Workload, names: tuple[str, ...], max_peers: int) -> None:
    """Once idle: every scratch slot back, and no more peers than live replicas to read from."""
    for name in names:
        state = ray.get(w.actors[name].nixl_state.remote(), timeout=30)
        assert state["scratch_free"] == state["scratch"], f"{name} holds NIXL scratch after the reads: {state}"
        assert state["peers"] <= max_peers, f"{name} keeps peers of gone holders: {state}"


def test_holder_pool_closed_during_nixl_reads(cluster, make_workload, long_run):
    """a shuts down (its pool closed and its agent gone, its process alive) while c and d
    read its rows one-sidedly with its descriptors cached, then comes back under its name:
    reads of the closed pool fail into misses within the timeout, the new pool is read
    afresh, and nothing is left held; once a leaves for good, c and d forget its agent."""
    _, (n1, n2, n3) = cluster
    d = durations(long_run)
    w = make_workload(transport="nixl")
    w.start([("a", n1), ("c", n2), ("d", n3)])
    baseline, threads = steady(w, d["baseline"])
    before = nixl_blocks(w, ("c", "d"))
    assert before.get("nixl", 0) > 0, f"no block came by NIXL before the fault: {before}"
    fault_start = time.time()
    for _ in range(max(1, d["repeat"] // 3)):
        w.expect_death("a")
        closing = w.actors["a"].shutdown.remote()  # once its request in flight is served
        w.run(1.0)  # c and d keep reading a's rows, through the descriptors they cached
        ray.get(closing, timeout=60)
        ray.kill(w.actors["a"])
        w.restart("a")
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end)
    after = nixl_blocks(w, ("c", "d"))
    assert after["nixl"] > before["nixl"], f"reads by NIXL never resumed after the holder came back: {after}"
    assert after.get("object_store", 0) == 0, f"transport nixl read through the object store: {after}"
    assert_nixl_idle(w, ("c", "d"), max_peers=2)
    # a leaves for good: once the Directory no longer lists it, c and d let its agent go
    w.expect_death("a")
    ray.get(w.actors["a"].shutdown.remote(), timeout=60)
    wait_until(
        lambda: all(ray.get(w.actors[n].nixl_state.remote(), timeout=30)["peers"] <= 1 for n in ("c", "d")),
        10, "c and d forget the NIXL agent of a holder that left",
    )
    threads.pop("a")
    out = w.outcome("holder's pool closed (replica shut down) during NIXL reads, then restarted",
                    fault_start, fault_end, baseline, threads)
    w.check(out)


def test_node_agent_killed_during_nixl_reads(cluster, make_workload, long_run):
    """The NodeAgents of every node are SIGKILLed in turn while replicas read each other by
    NIXL: a replica registers its own pool (docs/architecture.md), so nothing is
    re-registered or re-handshaken, and the reads go on through the restarts."""
    _, (n1, n2, n3) = cluster
    d = durations(long_run)
    w = make_workload(transport="nixl")
    w.start([("a", n1), ("c", n2), ("d", n3)])
    baseline, threads = steady(w, d["baseline"])
    names = ("a", "c", "d")
    before = nixl_blocks(w, names)
    assert before.get("nixl", 0) > 0, f"no block came by NIXL before the fault: {before}"
    def failed_reads() -> int:  # a failed NIXL read drops its peer: the next read handshakes again
        return sum(s.errors.get("promotion_fetch", 0) for s in ray.get([w.actors[n].stats.remote() for n in names]))

    failed_before = failed_reads()
    fault_start = time.time()
    during = before
    for i in range(d["repeat"]):
        sigkill(actor_pid(node_agent((n1, n2, n3)[i % 3].node_id)))
        w.run(1.0)
        now = nixl_blocks(w, names)
        assert now["nixl"] > during["nixl"], f"no block came by NIXL while a NodeAgent restarted: {now}"
        during = now
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end)
    after = nixl_blocks(w, names)
    assert after.get("object_store", 0) == 0, f"transport nixl read through the object store: {after}"
    assert failed_reads() == failed_before, "NIXL reads failed while only NodeAgents restarted"
    assert_nixl_idle(w, names, max_peers=2)
    out = w.outcome("NodeAgent SIGKILLed during NIXL reads", fault_start, fault_end, baseline, threads)
    w.check(out)


def test_directory_killed_repeatedly(cluster, make_workload, long_run):
    _, (n1, n2, _) = cluster
    d = durations(long_run)
    w = make_workload()
    w.start([("a", n1), ("b", n1), ("c", n2)])
    baseline, threads = steady(w, d["baseline"])
    (shard,) = get_or_create_shards(w.namespace, 1)
    fault_start = time.time()
    for _ in range(d["repeat"]):
        ray.kill(shard, no_restart=False)
        w.run(0.7)
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end)
    # the restarted shard knows every replica again
    wait_until(lambda: ray.get(shard.stats.remote(), timeout=30)["replicas"] == 3, 10, "replicas re-registered")
    out = w.outcome(f"Directory killed {d['repeat']} times", fault_start, fault_end, baseline, threads)
    w.check(out)


def test_directory_stalled(cluster, make_workload, long_run):
    _, (n1, n2, _) = cluster
    d = durations(long_run)
    w = make_workload()
    w.start([("a", n1), ("b", n1), ("c", n2)])
    baseline, threads = steady(w, d["baseline"])
    (shard,) = get_or_create_shards(w.namespace, 1)
    pid = actor_pid(shard)
    fault_start = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        w.run(d["stall"])
    finally:
        os.kill(pid, signal.SIGCONT)
    fault_end = time.time()
    during = w.hit_rate(fault_start, fault_end)
    served = sum(1 for _, r in w.results if fault_start <= r["end"] < fault_end)
    w.run_until_recovered(baseline, fault_end)
    out = w.outcome(f"Directory stalled (SIGSTOP) {d['stall']:.0f} s", fault_start, fault_end, baseline, threads)
    out.notes.append(f"{served} requests served during the stall at a hit rate of {during:.0%}")
    assert served > 0 and during is not None and during >= 0.5 * baseline, out.line()
    w.check(out)


def test_pool_full_under_load(cluster, make_workload, long_run):
    _, (n1, n2, _) = cluster
    d = durations(long_run)
    w = make_workload()
    w.start([("a", n1), ("b", n1), ("c", n2)], pool_blocks=40)
    baseline, threads = steady(w, d["baseline"])
    normal = w.request
    rng = np.random.default_rng(5)

    def flood() -> np.ndarray:
        # fresh prompts of 36 to 47 blocks against pools of 40 rows: each one turns the pool
        # over, or finds no room at all; shared docs in between
        if rng.random() < 0.3:
            return normal()
        return rng.integers(0, 50_000, int(rng.integers(36, 48)) * BLOCK_TOKENS)

    w.request = flood
    fault_start = time.time()
    w.run(d["baseline"] * 2)
    fault_end = time.time()
    w.request = normal
    rejected = sum(s.errors.get("store_rejected", 0) for s in ray.get([a.stats.remote() for a in w.actors.values()]))
    w.run_until_recovered(baseline, fault_end)
    out = w.outcome("pool full under load", fault_start, fault_end, baseline, threads)
    out.notes.append(f"{rejected} stores found the pool full")
    w.check(out)


def test_corrupt_row_payload(cluster, make_workload, long_run):
    _, (n1, n2, _) = cluster
    d = durations(long_run)
    w = make_workload()
    w.start([("a", n1), ("b", n1), ("c", n2)])
    baseline, threads = steady(w, d["baseline"])
    a = w.actors["a"]
    pool = f"/dev/shm/{ray.get(a.pool_name.remote())}"
    layout = PoolLayout(64, 1, SLOT_BYTES)
    corrupted = 0
    fault_start = time.time()
    # the two docs a holds most blocks of (which ones its small pool kept is up to timing)
    held = {
        i: [block for block in ray.get([a.block.remote(key) for key in block_keys(doc, BLOCK_TOKENS)]) if block]
        for i, doc in enumerate(w.docs)
    }
    docs = sorted(held, key=lambda i: len(held[i]), reverse=True)[:2]
    # flip bytes in the middle of the payload of every block a holds of them
    for i in docs:
        for block in held[i]:
            offset = layout.payload_offset + block[0] * layout.slot_bytes + 100
            with open(pool, "r+b") as f:
                f.seek(offset)
                raw = bytearray(f.read(16))
                f.seek(offset)
                f.write(bytes(b ^ 0xFF for b in raw))
            corrupted += 1
    assert corrupted, "a held none of the blocks to corrupt"
    # every replica asks for those docs now: a loads its own rows, b and c promote them
    probes = [actor.serve_many.remote([w.docs[i] for i in docs]) for actor in w.actors.values()]
    for name, batch in zip(w.actors, ray.get(probes, timeout=60)):
        w.results.extend((name, r) for r in batch)
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end)
    out = w.outcome(f"{corrupted} row payloads corrupted in /dev/shm", fault_start, fault_end, baseline, threads)
    w.check(out)


def test_directory_and_node_agent_refuse_another_namespace(cluster, make_workload):
    _, (n1, _, _) = cluster
    assert is_token_auth_enabled(), "the cluster runs without Ray token authentication"
    w = make_workload()
    w.start([("a", n1)])
    w.warm()
    a = w.actors["a"]
    key = block_keys(w.docs[-1], BLOCK_TOKENS)[0]  # the last doc stored: still in a's pool
    row, generation = ray.get(a.block.remote(key))
    pool = ray.get(a.pool_name.remote())
    (shard,) = get_or_create_shards(w.namespace, 1)
    other = "f" * 16 if w.namespace != "f" * 16 else "e" * 16
    info = ReplicaInfo("intruder", n1.node_id, segment_name(other, "intruder"), 64, 1, SLOT_BYTES)
    calls = [
        shard.register.remote(info, 1, encode_stored([]), namespace=other),
        shard.publish.remote("a", 1 << 40, encode_changes([], [key]), None, namespace=other),
        shard.unregister.remote("a", namespace=other),
        shard.query.remote([key], namespace=other),
        shard.changes.remote(None, 0.1, namespace=other),
    ]
    for ref in calls:
        with pytest.raises(ValueError, match="refuses a call for namespace"):
            ray.get(ref, timeout=30)
    # none of them was applied: no intruder, and a still registered and holding the key
    assert [r["replica_id"] for r in ray.get(shard.replicas.remote(), timeout=30)] == ["a"]
    assert decode_answer(ray.get(shard.query.remote([key], namespace=w.namespace)), 1)[0][0][0][:3] == ("a", n1.node_id, row)

    agent = node_agent(n1.node_id)
    layout = (64, 1, SLOT_BYTES)
    with pytest.raises(ValueError, match="belongs to cache namespace"):
        ray.get(agent.read_rows.remote(pool, layout, [row], [key], [generation], namespace=other), timeout=30)
    with pytest.raises(ValueError, match="not a distkv pool segment name"):
        ray.get(agent.read_rows.remote("../../etc/passwd", layout, [row], [key], [generation], namespace=w.namespace), timeout=30)
    data, metas = ray.get(agent.read_rows.remote(pool, layout, [row], [key], [generation], namespace=w.namespace), timeout=30)
    assert metas[0] is not None and data.shape[1] == 1  # its own namespace is served
    del data
    ray.get(a.shutdown.remote(), timeout=60)


def test_node_removed(cluster, make_workload, long_run):
    ray_cluster, (n1, n2, n3) = cluster
    d = durations(long_run)
    # Docs that the two survivors' pools hold between them, with room for the tails, and
    # one pool does not: what is checked is that the hit rate comes back once the node's
    # holders are gone, not the capacity that went with them (16 docs fill the survivors'
    # pools: the hit rate then settles near the recovery line, either side of it).
    w = make_workload(docs=12)
    w.start([("a", n1), ("c", n2), ("d", n3), ("e", n3)])
    baseline, threads = steady(w, d["baseline"])
    survivors = {"a", "c"}
    segments = {name: ray.get(w.actors[name].pool_name.remote()) for name in ("d", "e")}
    fault_start = time.time()
    w.expect_death("d")
    w.expect_death("e")
    ray_cluster.remove_node(n3)
    fault_end = time.time()
    w.run_until_recovered(baseline, fault_end, survivors)
    threads = {n: t for n, t in threads.items() if n in survivors}
    # the lost node's processes could not remove their pools: on a real node they go with
    # it; here (one /dev/shm for every simulated node) a surviving node's agent reclaims
    # them, or this does
    reclaimed = reclaim_stale_segments()
    left = [name for name in segments.values() if os.path.exists(f"/dev/shm/{name}")]
    assert not left, f"{left} not reclaimable: {reclaimed}"
    out = w.outcome("node removed mid-workload", fault_start, fault_end, baseline, threads, survivors)
    w.check(out)
