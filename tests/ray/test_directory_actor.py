import os
import pickle
import signal
import threading
import time
import uuid
from typing import NamedTuple

import pytest
import ray

from distkv.directory.publisher import HEARTBEAT_INTERVAL_S
from distkv.directory.link import PROMOTED_FLUSH_DELAY_S, DirectoryLink
from distkv.directory.records import Holder, ReplicaInfo
from distkv.directory.wire import decode_feed, encode_changes, encode_stored
from distkv.directory.placement import shard_of
from distkv.directory.wire import decode_answer
from distkv.directory.wire import MAX_CALL_KEYS, MAX_PAYLOAD_BYTES
from distkv.names import NODE_WATCHER_NAME, RAY_NAMESPACE, segment_name, shard_name
from distkv.directory.query_channel import QueryChannel
from ray_actors.directory import (
    FOLLOWERS_GROUP,
    MAX_FOLLOWERS,
    WATCH_EVERY_S,
    DirectoryShard,
    ShardActorClient,
    get_or_create_shards,
    kill_shards,
    shard_clients,
)

pytestmark = pytest.mark.usefixtures("ray_session")


def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until predicate() holds; fails the test after timeout_s."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"not true within {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - start


class Block(NamedTuple):
    """What `DirectoryLink.stored_blocks` and `promoted_blocks` read of a block."""

    row: int
    generation: int
    shard: int = 0


def new_keys(n: int) -> list[bytes]:
    return [os.urandom(32) + b"\0\0\0\0" for _ in range(n)]


@pytest.fixture
def namespace():
    ns = "test" + uuid.uuid4().hex[:8]
    yield ns
    kill_shards(ns)


@pytest.fixture
def make_link(namespace):
    links = []

    def make(replica_id: str, num_shards: int = 2) -> DirectoryLink:
        node_id = ray.get_runtime_context().get_node_id()
        info = ReplicaInfo(replica_id, node_id, segment_name(namespace, replica_id), 64, 2, 4096)
        link = DirectoryLink(namespace, info, shard_clients(namespace, num_shards))
        link.start()
        links.append(link)
        return link

    yield make
    for link in links:
        link.close()


def visible(link: DirectoryLink, keys, replica_id: str) -> bool:
    return all(any(h.replica_id == replica_id for h in link.holders(k)) for k in keys)


def invisible(link: DirectoryLink, keys) -> bool:
    return not any(link.holders(k) for k in keys)


def test_store_and_removal_on_one_replica_show_in_anothers_view(make_link):
    a, b = make_link("a"), make_link("b")
    keys = new_keys(20)
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    a.stored([(k, i, 1000 + i) for i, k in enumerate(keys)])
    wait_for(lambda: visible(b, keys, "a"), 10)  # the first store also waits for the shards to start
    node_id = ray.get_runtime_context().get_node_id()
    assert b.holders(keys[3]) == (Holder("a", node_id, 3, 1003),)
    assert b.replica("a") == a.info and b.replica("nobody") is None
    assert invisible(a, keys)  # a's view leaves out a itself
    assert a.query(keys[:2]) == [(Holder("a", node_id, 0, 1000),), (Holder("a", node_id, 1, 1001),)]

    more = new_keys(5)
    a.stored([(k, 20 + i, 2000 + i) for i, k in enumerate(more)])
    wait_for(lambda: visible(b, more, "a"), 2)
    b.stored([(keys[0], 7, 7)])
    a.removed(keys[:10])
    wait_for(lambda: invisible(b, keys[1:10]), 2)
    wait_for(lambda: visible(a, keys[:1], "b"), 2)
    assert [h.replica_id for h in b.query(keys[:1])[0]] == ["b"]
    assert visible(b, keys[10:], "a")


def test_a_long_poll_does_not_wake_for_the_followers_own_publish(namespace):
    (shard,) = get_or_create_shards(namespace, 1)
    node_id = ray.get_runtime_context().get_node_id()
    for replica_id in ("a", "b"):
        info = ReplicaInfo(replica_id, node_id, segment_name(namespace, replica_id), 64, 1, 4096)
        ray.get(shard.register.remote(info, 1, encode_stored([]), namespace=namespace))
    cursor = decode_feed(ray.get(shard.changes.remote(None, 0.0, namespace=namespace))).cursor
    polls = {follower: shard.changes.remote(cursor, 1.5, namespace=namespace, follower=follower) for follower in "ab"}
    ray.get(shard.publish.remote("a", 2, encode_changes([(new_keys(1)[0], 3, 30)], []), None, namespace=namespace))
    ready, _ = ray.wait(list(polls.values()), num_returns=2, timeout=0.75)
    assert ready == [polls["b"]]  # b's poll answered at once; a's waits for news of others, or its timeout
    for ref in polls.values():
        assert [entry[0] for entry in decode_feed(ray.get(ref)).entries] == ["a"]


def test_promoted_blocks_are_published_late_unless_something_else_goes(make_link):
    a, b = make_link("a", num_shards=1), make_link("b", num_shards=1)
    keys = new_keys(4)
    a.stored([(keys[0], 0, 1)])  # a just sent a batch: its next heartbeat is 0.5 s away
    wait_for(lambda: visible(b, keys[:1], "a"), 10)
    a.promoted_blocks([(keys[1], Block(1, 2))])
    time.sleep(PROMOTED_FLUSH_DELAY_S / 2)
    assert not visible(b, keys[1:2], "a")  # held back...
    wait_for(lambda: visible(b, keys[1:2], "a"), 5)  # ...not for long
    a.promoted_blocks([(keys[2], Block(2, 3))])
    a.stored([(keys[3], 3, 4)])  # goes at once, and takes the promoted block along
    wait_for(lambda: visible(b, keys[3:], "a"), 5)
    assert visible(b, keys[2:3], "a")


def epochs_of(shards) -> list[str]:
    return [s["epoch"] for s in ray.get([shard.stats.remote() for shard in shards], timeout=30)]


def test_restarted_directory_is_refilled_by_the_links(make_link, namespace):
    a, b = make_link("a"), make_link("b")
    keys = new_keys(20)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    wait_for(lambda: visible(b, keys, "a"), 10)
    shards = get_or_create_shards(namespace, 2)
    epochs = epochs_of(shards)

    for shard in shards:
        ray.kill(shard, no_restart=False)
    late = new_keys(5)
    a.stored([(k, 40 + i, 2) for i, k in enumerate(late)])  # while the Directory restarts
    assert b.holders(keys[0])  # the view answers from what it had

    # ray.kill returns before the old incarnations are gone, and they may still answer the
    # publish of `late` and the query below: wait until only the new ones answer
    wait_for(lambda: not set(epochs_of(shards)) & set(epochs), 30)
    wait_for(lambda: all(a.query(keys + late, timeout_s=10)), 10)
    wait_for(lambda: visible(b, keys + late, "a"), 5)
    stats = ray.get([shard.stats.remote() for shard in shards])
    assert all(s["epoch"] != epoch for s, epoch in zip(stats, epochs))
    assert sum(s["holders"] for s in stats) == len(keys + late)


def test_close_unregisters(make_link):
    a, b = make_link("a"), make_link("b")
    keys = new_keys(10)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    wait_for(lambda: visible(b, keys, "a"), 10)
    a.close()
    wait_for(lambda: invisible(b, keys), 2)
    assert b.query(keys) == [()] * len(keys)
    wait_for(lambda: b.replica("a") is None, 2)


def test_replica_that_stops_heartbeating_expires(make_link, namespace):
    (shard,) = get_or_create_shards(namespace, 1, replica_timeout_s=3 * HEARTBEAT_INTERVAL_S)
    alive, watcher = make_link("alive", 1), make_link("watcher", 1)
    ghost_keys, alive_keys = new_keys(3), new_keys(3)
    ghost = ReplicaInfo("ghost", watcher.info.node_id, segment_name(namespace, "ghost"), 8, 1, 4096)
    ray.get(shard.register.remote(ghost, 1, encode_stored([(k, i, 1) for i, k in enumerate(ghost_keys)]), namespace=namespace))
    alive.stored([(k, i, 1) for i, k in enumerate(alive_keys)])
    wait_for(lambda: visible(watcher, ghost_keys, "ghost") and visible(watcher, alive_keys, "alive"), 10)
    waited = wait_for(lambda: invisible(watcher, ghost_keys), 10)
    assert waited > 0.5
    assert visible(watcher, alive_keys, "alive")  # its link heartbeats
    assert ray.get(shard.stats.remote())["expired_replicas"] == 1


def test_a_shard_stopped_past_the_timeout_expires_no_live_replica(make_link, namespace):
    """A shard's process stopped (SIGSTOP: a long GC pause, a starved or swapped host) for
    longer than the replica timeout: its replicas' heartbeats wait in its queue meanwhile,
    so when it runs again it must not take their silence for death."""
    timeout_s = 3 * HEARTBEAT_INTERVAL_S
    (shard,) = get_or_create_shards(namespace, 1, replica_timeout_s=timeout_s)
    alive, watcher = make_link("alive", 1), make_link("watcher", 1)
    keys = new_keys(3)
    alive.stored([(k, i, 1) for i, k in enumerate(keys)])
    wait_for(lambda: visible(watcher, keys, "alive"), 10)
    pid = ray.get(shard.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2 * timeout_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    # the shard expires its silent replicas every WATCH_EVERY_S: give it a few rounds after the stop
    wait_for(lambda: ray.get(shard.stats.remote())["publishes"] > 0, 10)
    time.sleep(3 * WATCH_EVERY_S)
    stats = ray.get(shard.stats.remote())
    assert stats["expired_replicas"] == 0, stats
    assert stats["registers"] == 2, stats  # nobody had to register again
    assert visible(watcher, keys, "alive")


def test_replica_the_directory_forgot_publishes_again(make_link, namespace):
    a, b = make_link("a", 1), make_link("b", 1)
    keys = new_keys(5)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    wait_for(lambda: visible(b, keys, "a"), 10)
    (shard,) = get_or_create_shards(namespace, 1)
    assert ray.get(shard.unregister.remote("a", namespace=namespace))  # as if a had been expired during a long pause
    wait_for(lambda: invisible(b, keys), 2)
    wait_for(lambda: visible(b, keys, "a"), 3)  # a's next heartbeat hears it is unknown


def test_directory_down_blocks_no_caller(make_link, namespace):
    a, b = make_link("a"), make_link("b")
    keys = new_keys(10)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    wait_for(lambda: visible(b, keys, "a"), 10)
    assert kill_shards(namespace) == 2

    start = time.monotonic()
    for _ in range(100):
        a.stored([(k, 0, 2) for k in new_keys(10)])
        a.removed(keys[:1])
        assert visible(b, keys, "a")
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    a.close()
    b.close()
    assert time.monotonic() - start < 5.0


def test_bad_input_is_refused_before_queueing(make_link):
    a = make_link("a")
    with pytest.raises(ValueError, match="is a str, not bytes"):
        a.stored([(new_keys(1)[0], 1, 1), ("k" * 36, 1, 1)])
    with pytest.raises(ValueError, match="row 64"):
        a.stored([(new_keys(1)[0], 64, 1)])
    with pytest.raises(ValueError, match="is a int, not bytes"):
        a.removed([7])
    assert a.holders(new_keys(1)[0]) == ()


def test_register_refuses_a_pool_of_another_namespace(namespace):
    (shard,) = get_or_create_shards(namespace, 1)
    node_id = ray.get_runtime_context().get_node_id()
    ray.get(shard.register.remote(ReplicaInfo("a", node_id, segment_name(namespace, "a"), 8, 1, 4096), 1, encode_stored([]), namespace=namespace))
    key = new_keys(1)[0]
    refused = [
        (segment_name("other" + namespace, "b"), "belongs to cache namespace"),
        ("pool-b", "not a distkv pool segment name"),
        ("distkv-" + namespace + "-../../b", "may hold only letters, digits"),
    ]
    for pool_name, problem in refused:
        info = ReplicaInfo("b", node_id, pool_name, 8, 1, 4096)
        with pytest.raises(ValueError, match=problem):
            ray.get(shard.register.remote(info, 1, encode_stored([(key, 0, 1)]), namespace=namespace))
    # nothing of them was applied
    assert [r["replica_id"] for r in ray.get(shard.replicas.remote())] == ["a"]
    assert decode_answer(ray.get(shard.query.remote([key], namespace=namespace)), 1)[0] == [()]


def test_registers_and_publishes_are_answered_while_the_followers_loop_is_busy(namespace):
    # defined here: Ray's workers cannot import this test module, and pickle it by value
    class HeldShard(DirectoryShard.__ray_metadata__.modified_class):
        """A shard whose followers' event loop the test can hold, as packing many large
        answers would, and let go."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self._release = threading.Event()
            self._holding = threading.Event()

        @ray.method(concurrency_group=FOLLOWERS_GROUP)
        async def hold_followers(self) -> None:
            self._holding.set()
            self._release.wait()  # blocks the followers' thread and loop

        async def holding(self) -> bool:
            return self._holding.is_set()

        async def release(self) -> None:
            self._release.set()

    shard = ray.remote(concurrency_groups={FOLLOWERS_GROUP: MAX_FOLLOWERS})(HeldShard).remote(10.0, namespace, 0)
    held = shard.hold_followers.remote()
    wait_for(lambda: ray.get(shard.holding.remote()), 30)
    poll = shard.changes.remote(None, 0.0, namespace=namespace)  # waits behind the held loop
    node_id = ray.get_runtime_context().get_node_id()
    info = ReplicaInfo("a", node_id, segment_name(namespace, "a"), 8, 1, 4096)
    key = new_keys(1)[0]
    # answered while the followers' loop is held; on one loop they would wait for it
    assert ray.get(shard.register.remote(info, 1, encode_stored([]), namespace=namespace), timeout=30)[1]
    assert ray.get(shard.publish.remote("a", 2, encode_changes([(key, 3, 1)], []), None, namespace=namespace), timeout=30)[1]
    assert decode_answer(ray.get(shard.query.remote([key], namespace=namespace), timeout=30), 1)[0] == [(("a", node_id, 3, 1),)]
    assert ray.wait([poll], timeout=0)[1] == [poll]  # the poll is still held
    ray.get(shard.release.remote())
    ray.get(held)
    changes = decode_feed(ray.get(poll))
    assert changes.is_snapshot and changes.entries == [("a", node_id, [(key, 3, 1)], [])]
    ray.kill(shard)



def connected(channel: QueryChannel) -> None:
    wait_for(lambda: not channel.connecting, 30)
    assert channel.connected, channel.last_error


def test_queries_go_over_the_shard_s_channel_and_answer_as_its_actor_does(make_link, namespace):
    a = make_link("a", num_shards=1)
    keys = new_keys(30)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    actor = get_or_create_shards(namespace, 1)[0]
    wait_for(lambda: all(decode_answer(ray.get(actor.query.remote(keys, namespace=namespace)), len(keys))[0]), 10)
    client = ShardActorClient(actor, namespace)
    assert not client.channel.connected
    by_ray = decode_answer(client.query(keys, namespace).result(30), len(keys))  # the first one starts connecting
    connected(client.channel)
    assert decode_answer(client.channel.query(keys).result(30), len(keys)) == by_ray
    assert decode_answer(client.query(keys, namespace).result(30), len(keys)) == by_ray
    with pytest.raises(ValueError, match="refuses a call for namespace 'other'"):
        client.query(keys, "other").result(30)  # through Ray, whose shard refuses it
    client.close()
    assert not client.channel.connected


def test_a_connection_without_the_shard_s_token_is_not_answered(namespace):
    actor = get_or_create_shards(namespace, 1)[0]
    host, port, token = ray.get(actor.query_endpoint.remote(), timeout=30)
    wrong = bytes(b ^ 1 for b in token)
    endpoint = ray.put((host, port, wrong))  # an ObjectRef's future, as the actor's would be
    channel = QueryChannel(lambda: endpoint.future(), namespace)
    channel.connect()
    wait_for(lambda: not channel.connecting, 30)
    assert not channel.connected
    assert isinstance(channel.last_error, ConnectionError)


def test_a_restarted_shard_s_queries_go_through_ray_until_its_channel_connects_again(make_link, namespace):
    a = make_link("a", num_shards=1)
    keys = new_keys(10)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    actor = get_or_create_shards(namespace, 1)[0]
    client = ShardActorClient(actor, namespace)
    client.query(keys, namespace).result(30)
    connected(client.channel)
    endpoint = ray.get(actor.query_endpoint.remote(), timeout=30)
    epochs = epochs_of([actor])

    ray.kill(actor, no_restart=False)
    wait_for(lambda: not client.channel.connected, 30)  # the old incarnation's connection went with it
    wait_for(lambda: epochs_of([actor]) != epochs, 30)
    # through Ray meanwhile, answered by the new incarnation, which the link refills; a query
    # starts connecting the channel again once RECONNECT_DELAY_S has passed
    wait_for(lambda: all(decode_answer(client.query(keys, namespace).result(30), len(keys))[0]) and client.channel.connected, 30)
    assert ray.get(actor.query_endpoint.remote(), timeout=30) != endpoint
    assert all(decode_answer(client.channel.query(keys).result(30), len(keys))[0])
    client.close()


def test_where_ray_encrypts_its_traffic_queries_stay_on_ray(make_link, namespace, monkeypatch):
    a = make_link("a", num_shards=1)
    keys = new_keys(5)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    monkeypatch.setenv("RAY_USE_TLS", "1")  # as this process reads it; the shard was started without
    actor = get_or_create_shards(namespace, 1)[0]
    client = ShardActorClient(actor, namespace)
    assert client.channel is None
    wait_for(lambda: all(decode_answer(client.query(keys, namespace).result(30), len(keys))[0]), 10)
    client.close()


# ---- calls that would kill a shard (issue 31, finding 4) ----------------------------------


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_oversized_or_poisoned_payloads_are_refused_and_change_nothing(namespace):
    class Bomb:
        """A payload whose unpickling kills the process that unpickles it."""

        def __reduce__(self):
            return (os._exit, (1,))

    (shard,) = get_or_create_shards(namespace, 1)
    node_id = ray.get_runtime_context().get_node_id()
    infos = {r: ReplicaInfo(r, node_id, segment_name(namespace, r), 1 << 13, 1, 4096) for r in "ab"}
    held = new_keys(3)
    ray.get(shard.register.remote(infos["a"], 1, encode_stored([(k, i, 1) for i, k in enumerate(held)]), namespace=namespace))
    ray.get(shard.register.remote(infos["b"], 1, encode_stored([]), namespace=namespace))
    pid, before = pid_of(shard), ray.get(shard.stats.remote())

    too_many = [(k, i, 1) for i, k in enumerate(new_keys(MAX_CALL_KEYS + 1))]
    with pytest.raises(ValueError, match=f"register: {MAX_CALL_KEYS + 1} stored entries, over {MAX_CALL_KEYS}"):
        ray.get(shard.register.remote(infos["b"], 2, encode_stored(too_many), namespace=namespace), timeout=60)
    with pytest.raises(ValueError, match="register: not msgpack of this format"):
        ray.get(shard.register.remote(infos["b"], 2, pickle.dumps([(Bomb(), 0, 1)]), namespace=namespace), timeout=60)
    with pytest.raises(ValueError, match=f"publish: .* over {MAX_PAYLOAD_BYTES}"):
        ray.get(shard.publish.remote("a", 2, bytes(MAX_PAYLOAD_BYTES + 1), None, namespace=namespace), timeout=60)
    with pytest.raises(ValueError, match="report 7 is not a dict"):
        ray.get(shard.publish.remote("a", 2, encode_changes([(held[0], 5, 5)], []), 7, namespace=namespace), timeout=60)
    fresh = new_keys(1)
    relayed = [("a", 2, pickle.dumps(([(Bomb(), 0, 1)], [])), None), ("b", 2, encode_changes([(fresh[0], 1, 1)], []), None)]
    _, results, _ = ray.get(shard.publish_many.remote(relayed, namespace=namespace), timeout=60)
    assert "not msgpack of this format" in results[0] and results[1] is True  # one relayed publish refused, alone

    after = ray.get(shard.stats.remote())
    assert pid_of(shard) == pid and after["epoch"] == before["epoch"]  # never died
    assert (after["registers"], after["holders"]) == (before["registers"], before["holders"] + 1)
    answer = decode_answer(ray.get(shard.query.remote(held + fresh, namespace=namespace)), 4)[0]
    assert [h[0][:3] for h in answer] == [("a", node_id, 0), ("a", node_id, 1), ("a", node_id, 2), ("b", node_id, 1)]


def test_a_call_that_kills_its_shard_is_not_replayed_and_the_shard_serves_on(make_link, namespace):
    class Poison:
        """An argument whose unpickling (Ray's, before the shard's code runs) kills the shard."""

        def __reduce__(self):
            return (os._exit, (1,))

    a = make_link("a", num_shards=1)
    keys = new_keys(5)
    a.stored([(k, i, 1) for i, k in enumerate(keys)])
    (shard,) = get_or_create_shards(namespace, 1)
    wait_for(lambda: all(a.query(keys, timeout_s=30)), 30)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(shard.register.remote(Poison(), 1, encode_stored([]), namespace=namespace), timeout=60)
    # the next incarnation is not handed the call again: it stays up, and the link's blocks are back
    wait_for(lambda: all(a.query(keys, timeout_s=30)), 60)
    pid = pid_of(shard)
    assert all(decode_answer(ray.get(shard.query.remote(keys, namespace=namespace), timeout=60), len(keys))[0])
    assert pid_of(shard) == pid


# ---- a namespace's shard count, and one node watcher for every shard (issue 31) --------


def test_a_replica_of_another_shard_count_is_refused_at_start_naming_both(namespace):
    get_or_create_shards(namespace, 2)
    for other in (1, 3):
        with pytest.raises(ValueError, match=f"directory_shards={other} for cache namespace .* has 2 shards"):
            get_or_create_shards(namespace, other)
    with pytest.raises(ValueError):  # the refused call made no shard of its own
        ray.get_actor(shard_name(namespace, 2), namespace=RAY_NAMESPACE)
    assert len(get_or_create_shards(namespace, 2)) == 2


def test_every_shard_follows_the_cluster_s_one_node_watcher_and_reads_no_node_table(namespace):
    def count_node_table_reads(self) -> None:
        import ray as ray_in_shard

        reads, read = [], ray_in_shard.nodes

        def counted(*args, **kwargs):
            reads.append(1)
            return read(*args, **kwargs)

        ray_in_shard.nodes = counted
        self.node_table_reads = reads

    shards = get_or_create_shards(namespace, 2) + get_or_create_shards(namespace + "x", 1)
    try:
        ray.get([shard.__ray_call__.remote(count_node_table_reads) for shard in shards], timeout=60)
        watcher = ray.get_actor(NODE_WATCHER_NAME, namespace=RAY_NAMESPACE)
        first = ray.get(watcher.reads.remote(), timeout=60)
        wait_for(lambda: ray.get(watcher.reads.remote()) >= first + 3, 60)
        reads = ray.get([shard.__ray_call__.remote(lambda self: len(self.node_table_reads)) for shard in shards])
        assert reads == [0, 0, 0]
        watchers = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == NODE_WATCHER_NAME]
        assert len(watchers) == 1
    finally:
        kill_shards(namespace + "x")
