"""The Directory's actors: one `DirectoryShard` per key-hash shard of a cache namespace.

Each shard is a detached, restartable asyncio actor around a `DirectoryState`, placed
round-robin over the cluster's live nodes, the head first (`shard_nodes`), with a soft
affinity: when its node dies Ray restarts it on another one. Long polls for changes wait on
an event, on an event loop of their own (a concurrency group), so that neither their waiting
nor the packing of their answers holds up registers, publishes and queries. Queries also
come over the shard's `QueryServer` (`distkv.directory.query_channel`), answered on the default loop
too. A shard drops the holders on nodes that died as the cluster's one `NodeWatcher`
reports them (`ray_actors.node_watcher`), and reads no node table itself. A restarted
shard starts empty with a new epoch; the replicas' links notice and publish everything
again. `shard_clients` hands a replica's `DirectoryLink` its shards as
the `ShardClient`s it calls.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distkv.observability import metrics
from distkv.abstract import OffloadKey
from distkv.directory.node_table import follow_dead_nodes
from distkv.directory.records import Cursor, Relayed, ReplicaInfo
from distkv.directory.state import DirectoryState
from distkv.directory.wire import (
    MAX_CALL_KEYS,
    MAX_RELAYED_PUBLISHES,
    check_namespace,
    check_stored,
    decode_changes,
    decode_stored,
    encode_answer,
)
from distkv.directory.upkeep import Lateness, ShardCollections, defer_full_collections
from distkv.directory.snapshot import SnapshotBuilder
from distkv.names import RAY_NAMESPACE, check_pool_namespace, parse_shard_name, shard_name
from distkv.directory.query_channel import TOKEN_BYTES, QueryChannel, QueryServer, channel_allowed
from ray_actors.node_watcher import node_watcher

logger = logging.getLogger(__name__)

# How many times a small call (not a register, publish or query) in flight when its shard
# dies is sent again to the shard's next incarnations: one restart needs one.
SMALL_CALL_RETRIES = 3
# How often a shard expires its silent replicas.
WATCH_EVERY_S = 1.0
# How long a shard's poll of the cluster's NodeWatcher waits for a change of the dead nodes.
DEAD_NODES_POLL_S = 30.0
# How much later than that its answer may come before the poll is asked again of a fresh
# handle (a call to a watcher as it dies may never be answered).
DEAD_NODES_GRACE_S = 10.0
# How long a replica at start waits for its Directory's first shard to say how many shards
# it was made of.
SHARD_COUNT_TIMEOUT_S = 30.0
# A replica not heard from for this long is dropped; links heartbeat every 0.5 s.
REPLICA_TIMEOUT_S = 10.0
# The concurrency group of `changes`: the followers' long polls, on their own thread and
# event loop, and at most this many at once (one per replica of the namespace).
FOLLOWERS_GROUP = "followers"
MAX_FOLLOWERS = 4096

# Ray keeps the events of every task it runs in its GCS (of the last 100,000 by default) for
# the dashboard's task list: a fleet's publishes, polls and queries, thousands a second, would
# keep the GCS busy storing theirs, grow its memory, and push the user's own tasks out of the
# list. Ray Serve leaves its actors' calls out in the same way.
@ray.remote(concurrency_groups={FOLLOWERS_GROUP: MAX_FOLLOWERS}, enable_task_events=False)
class DirectoryShard:
    """One shard of the Directory. Every method returns promptly except `changes`.

    Bulk payloads cross typed and bounded (`distkv.directory.wire`): a register's stored
    entries and a publish's changes come in encoded, and a follower's changes and a
    query's answer go back encoded.
    `changes` runs in FOLLOWERS_GROUP, every other method on the default event loop,
    which alone changes the state; `_lock` keeps the followers' reads of it whole. A
    snapshot is collected on the default loop a step at a time between its other calls
    (`SnapshotBuilder`), and shared by the followers that need one meanwhile.
    """

    def __init__(
        self, replica_timeout_s: float = REPLICA_TIMEOUT_S, namespace: str = "", shard: int = 0, num_shards: int = 1
    ) -> None:
        self._state = DirectoryState()
        self._replica_timeout_s = replica_timeout_s
        self._lateness = Lateness(replica_timeout_s)
        self._namespace = namespace
        self._shard = shard
        self._num_shards = num_shards
        self._metrics = metrics.DirectorySource(self._state, namespace, shard, metrics.this_node())
        metrics.register(self._metrics)
        self._lock = threading.Lock()
        # set on the followers' loop by the first `changes`; every change sets `_changed`
        # there (and replaces it), which wakes the polls waiting on it
        self._changed: asyncio.Event | None = None
        self._followers_loop: asyncio.AbstractEventLoop | None = None
        self._building: asyncio.Future | None = None  # on the followers' loop: the snapshot being built
        # Ray runs an async actor's __init__ on its event loop.
        self._loop = asyncio.get_running_loop()
        defer_full_collections()
        self._collections = ShardCollections(time.monotonic())
        self._watcher = self._loop.create_task(self._watch())
        self._dead_nodes = self._loop.create_task(self._follow_dead_nodes())
        self._query_token = secrets.token_bytes(TOKEN_BYTES)
        self._query_address: asyncio.Task | None = None
        if channel_allowed():
            server = QueryServer(self._answer, namespace, self._query_token, self._check)
            self._query_address = self._loop.create_task(server.start(ray.util.get_node_ip_address()))

    @ray.method(max_task_retries=0)
    async def register(self, info: ReplicaInfo, seq: int, stored: bytes, namespace: str) -> tuple[str, bool, float]:
        """Register a replica afresh and publish everything it holds (encoded entries), as one
        change; (epoch, True, the interval the replica is to leave between its calls).

        Every call that changes or reads holders refuses another cache `namespace` (ValueError),
        and `register` a replica whose pool is not a segment of this shard's namespace. Every
        call checks all it carries (`decode_stored`, `decode_changes`: MAX_CALL_KEYS keys at
        most, plain data) before it applies any of it: bad input is a ValueError and changes
        nothing. The calls that carry bulk (`register`, `publish`, `publish_many`, `query`)
        are not sent again to the shard's next incarnation when it dies under them: the one
        that killed it would kill that one too; their callers send them again (a publisher
        after a backoff, a relay's replicas, a querier's next miss).
        """
        started = time.perf_counter()
        self._check(namespace)
        if type(seq) is not int:
            raise ValueError(f"register: seq {seq!r:.80} is not an int")
        stored = decode_stored(stored, "register")
        if isinstance(info, ReplicaInfo):  # else register says what is wrong
            check_pool_namespace(info.pool_name, self._namespace)
            check_stored(stored, info.num_rows)
        with self._lock:
            before = self._state.cursor()
            self._state.register(info)
            self._state.publish(info.replica_id, seq, stored, ())
        self._after_change(before)
        self._took("register", started)
        return self._state.epoch, True, self._state.publish_interval()

    @ray.method(max_task_retries=0)
    async def publish(
        self, replica_id: str, seq: int, changes: bytes, report: dict | None, namespace: str
    ) -> tuple[str, bool, float]:
        """Apply an encoded (stored, removed); (epoch, whether the replica is registered, the
        interval it is to leave between its calls: `DirectoryState.publish_interval`).

        See `DirectoryState.publish`. `report`: the replica's latest stats, if sent along.
        """
        started = time.perf_counter()
        self._check(namespace)
        stored, removed = decode_changes(changes, "publish")
        if report is not None and not isinstance(report, dict):
            raise ValueError(f"publish: report {report!r:.80} is not a dict")
        with self._lock:
            before = self._state.cursor()
            known = self._state.publish(replica_id, seq, stored, removed)
            if known and report is not None:
                self._state.set_report(replica_id, report)
        self._after_change(before)
        self._took("publish", started)
        return self._state.epoch, known, self._state.publish_interval()

    @ray.method(max_task_retries=0)
    async def publish_many(self, items: list[Relayed], namespace: str) -> tuple[str, list[bool | str], float]:
        """Apply the publishes of several replicas that a node's relay carried (`distkv.directory.relay`),
        each as its own `publish`; (epoch, per item whether its replica is registered or why
        it was refused, the interval each replica is to leave between its calls)."""
        self._check(namespace)
        if not isinstance(items, list):
            raise ValueError(f"publish_many: items {type(items).__name__} is not a list")
        if len(items) > MAX_RELAYED_PUBLISHES:
            raise ValueError(f"publish_many: {len(items)} publishes, over {MAX_RELAYED_PUBLISHES} a call")
        results: list[bool | str] = []
        took = 0.0  # the time of the call's own steps, not of the calls run between them
        for i, item in enumerate(items):
            started = time.perf_counter()
            with self._lock:
                before = self._state.cursor()
                results += self._state.publish_relayed([item], continued=i > 0)
            self._after_change(before)
            took += time.perf_counter() - started
            # A node's call carries many replicas' changes: calls that came meanwhile (a
            # query is waited on by a request) run between two replicas' publishes, not after all.
            await asyncio.sleep(0)
        self._metrics.call_times.append(("publish_many", took))
        return self._state.epoch, results, self._state.publish_interval()

    async def unregister(self, replica_id: str, namespace: str) -> bool:
        started = time.perf_counter()
        self._check(namespace)
        with self._lock:
            before = self._state.cursor()
            known = self._state.unregister(replica_id)
        self._after_change(before)
        self._took("unregister", started)
        return known

    @ray.method(max_task_retries=0)
    async def query(self, keys: Sequence[OffloadKey], namespace: str) -> bytes:
        """The (holders of each key, ReplicaInfo of each replica they name) of
        `DirectoryState.answer`, encoded as `distkv.directory.wire.encode_answer` says."""
        self._check(namespace)
        return self._answer(keys)

    async def query_endpoint(self) -> tuple[str, int, bytes]:
        """(host, port, token) of this incarnation's `QueryServer`, which answers `query`
        over a connection of the caller's (`distkv.directory.query_channel`); RuntimeError where
        `channel_allowed` says no."""
        if self._query_address is None:
            raise RuntimeError("this shard serves no query channel: Ray's traffic is encrypted (RAY_USE_TLS)")
        host, port = await asyncio.shield(self._query_address)
        return host, port, self._query_token

    @ray.method(concurrency_group=FOLLOWERS_GROUP)
    async def changes(self, cursor: Cursor | None, timeout_s: float, namespace: str, follower: str | None = None) -> bytes:
        """The encoded changes after `cursor` (see `DirectoryState.packed_changes`), once
        they hold something besides the `follower` replica's own (which its link knows
        already), or after `timeout_s`."""
        self._check(namespace)
        if self._followers_loop is None:
            self._changed = asyncio.Event()
            self._followers_loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                news = self._state.has_news(cursor, follower)
            remaining = deadline - time.monotonic()
            if news or remaining <= 0:
                break
            try:
                # a change made since has_news wakes this: its _wake_followers runs on this loop, later
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        with self._lock:
            packed = self._state.packed_from_log(cursor)
        if packed is None:
            await self._snapshot()
            with self._lock:
                # at once, should the log have moved past the new snapshot's cursor meanwhile
                packed = self._state.packed_changes(cursor)
        return packed

    async def _snapshot(self) -> None:
        """On the followers' loop: build and keep a snapshot, or wait for the one being built."""
        if self._building is None:
            self._building = asyncio.ensure_future(self._build_snapshot())
            self._building.add_done_callback(lambda _: setattr(self, "_building", None))
        # a poll cancelled meanwhile leaves the build to the others that wait for it
        await asyncio.shield(self._building)

    async def _build_snapshot(self) -> None:
        builder: SnapshotBuilder = await _run_on(self._loop, self._state.snapshot_builder)
        while not await _run_on(self._loop, builder.step):
            pass
        with self._lock:
            self._state.keep_snapshot(builder.snapshot())

    async def stats(self) -> dict[str, int | str]:
        with self._lock:
            stats = self._state.stats()
        return {
            "namespace": self._namespace,
            "shard": self._shard,
            "epoch": self._state.epoch,
            "node_id": ray.get_runtime_context().get_node_id(),
            **stats,
        }

    async def replicas(self) -> list[dict]:
        """The registered replicas with their latest reports; see `DirectoryState.replicas`."""
        return self._state.replicas()

    async def num_shards(self) -> int:
        """How many shards this shard's namespace's Directory was made of (`get_or_create_shards`)."""
        return self._num_shards

    def _check(self, namespace: str) -> None:
        check_namespace(self._namespace, namespace, f"directory shard {shard_name(self._namespace, self._shard)}")

    def _answer(self, keys: Sequence[OffloadKey]) -> bytes:
        """On the default loop: `query`'s answer, however the query came."""
        if len(keys) > MAX_CALL_KEYS:
            raise ValueError(f"query: {len(keys)} keys, over {MAX_CALL_KEYS} a call")
        started = time.perf_counter()
        answer = encode_answer(*self._state.answer(keys))
        self._took("query", started)
        return answer

    def _took(self, call: str, started: float) -> None:
        """Observe the time of a call that began at `started` (`time.perf_counter()`) and
        returns now: the shard's own part of what its caller waits for."""
        self._metrics.call_times.append((call, time.perf_counter() - started))

    def _after_change(self, before: Cursor) -> None:
        """After a call that may have changed the state since it was at `before`: make the
        young collection due, if any, and wake the followers' polls if it did change."""
        self._collections.stored(self._state.stored_keys)
        loop = self._followers_loop
        if loop is not None and self._state.cursor() != before:
            loop.call_soon_threadsafe(self._wake_followers)

    def _wake_followers(self) -> None:
        """On the followers' loop: wake every poll waiting for a change."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _watch(self) -> None:
        """Drop replicas that stopped heartbeating (silent past their timeout and past how
        late this shard has been running)."""
        while True:
            due = time.monotonic() + WATCH_EVERY_S
            await asyncio.sleep(WATCH_EVERY_S)
            self._lateness.woke(due, time.monotonic())
            self._collections.step(time.monotonic())
            with self._lock:
                before = self._state.cursor()
                # a heartbeat may have waited in the queue as long as this wake-up ran late
                self._state.expire(time.monotonic(), self._replica_timeout_s + self._lateness.worst())
                self._state.drop_stale_snapshot()
            self._after_change(before)

    async def _follow_dead_nodes(self) -> None:
        """Drop the replicas on nodes the cluster's NodeWatcher reports dead, as it reports
        them (and again every DEAD_NODES_POLL_S: a register from a node that died meanwhile)."""
        loop = asyncio.get_running_loop()

        def drop(dead: frozenset[str]) -> None:
            with self._lock:
                before = self._state.cursor()
                self._state.drop_nodes(dead)
            self._after_change(before)

        await follow_dead_nodes(
            lambda: loop.run_in_executor(None, node_watcher),  # asks Ray's GCS
            lambda watcher, seen: watcher.dead_nodes.remote(seen, DEAD_NODES_POLL_S),
            drop,
            answer_within_s=DEAD_NODES_POLL_S + DEAD_NODES_GRACE_S,
            retry_s=WATCH_EVERY_S,
        )


async def _run_on(loop: asyncio.AbstractEventLoop, fn, *args):
    """`fn(*args)` run on `loop`, another thread's, between its other callbacks; its result."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)

    loop.call_soon_threadsafe(run)
    return await asyncio.wrap_future(done)


def head_node_id() -> str:
    """The Ray node id of the cluster's head node."""
    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    raise RuntimeError("no live head node in ray.nodes()")


def shard_nodes(nodes: Sequence[dict], num_shards: int) -> list[str]:
    """The node id each of `num_shards` shards is placed on: round-robin over the live
    `nodes` (entries of `ray.nodes()`), the head first and then the others by id, so that
    one shard stays on the head and more spread over the cluster."""
    alive = [n for n in nodes if n["Alive"]]
    if not alive:
        raise RuntimeError("no live node in ray.nodes()")
    alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
    return [alive[shard % len(alive)]["NodeID"] for shard in range(num_shards)]


class ShardActorClient:
    """A `DirectoryShard` actor of cache namespace `namespace` as a
    `distkv.directory.client.ShardClient`: each method calls the actor's and returns the Future of
    its answer, but `query`, which goes over the shard's `QueryChannel` once that is
    connected (the first query starts connecting it), where `channel_allowed`."""

    def __init__(self, actor: ray.actor.ActorHandle, namespace: str) -> None:
        self.actor = actor
        self.namespace = namespace
        self.channel: QueryChannel | None = None
        if channel_allowed():
            self.channel = QueryChannel(lambda: actor.query_endpoint.remote().future(), namespace)
        # the ObjectRef behind each poll's Future, for `cancel`
        self._polls: weakref.WeakKeyDictionary[Future, ray.ObjectRef] = weakref.WeakKeyDictionary()

    def register(self, info: ReplicaInfo, seq: int, stored: bytes, namespace: str) -> Future:
        return self.actor.register.remote(info, seq, stored, namespace=namespace).future()

    def publish(self, replica_id: str, seq: int, changes: bytes, report: dict | None, namespace: str) -> Future:
        return self.actor.publish.remote(replica_id, seq, changes, report, namespace=namespace).future()

    def publish_many(self, items: Sequence[Relayed], namespace: str) -> Future:
        return self.actor.publish_many.remote(list(items), namespace=namespace).future()

    def unregister(self, replica_id: str, namespace: str) -> Future:
        return self.actor.unregister.remote(replica_id, namespace=namespace).future()

    def changes(self, cursor: Cursor | None, timeout_s: float, namespace: str, follower: str | None) -> Future:
        ref = self.actor.changes.remote(cursor, timeout_s, namespace=namespace, follower=follower)
        future = ref.future()
        self._polls[future] = ref
        return future

    def query(self, keys: Sequence[OffloadKey], namespace: str) -> Future:
        if self.channel is not None and namespace == self.namespace:  # else the actor's query refuses it
            try:
                return self.channel.query(keys)
            except ConnectionError:
                self.channel.connect()
        return self.actor.query.remote(keys, namespace=namespace).future()

    def cancel(self, future: Future) -> None:
        ref = self._polls.pop(future, None)
        if ref is not None:
            ray.cancel(ref)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def __repr__(self) -> str:
        return f"ShardActorClient({self.actor!r})"


def get_or_create_shards(
    namespace: str, num_shards: int, *, replica_timeout_s: float = REPLICA_TIMEOUT_S
) -> list[ray.actor.ActorHandle]:
    """The handles of every shard of `namespace`'s Directory, creating those that do not exist.

    The first shard records `num_shards` when it is made: a ValueError naming both counts
    if the namespace's Directory was made of another number of shards (replicas of one
    namespace that placed keys over different counts would miss each other's blocks), and
    no other shard is made then. `replica_timeout_s` applies only to shards this call
    creates. A shard is placed by `shard_nodes` with a soft affinity: a hard one would
    leave it unschedulable once its node died, while a soft one lets Ray restart it on any
    live node.
    """
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r}: must be a positive int")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace={namespace!r}: must be a non-empty str")
    nodes = shard_nodes(ray.nodes(), num_shards)

    def shard_actor(shard: int) -> ray.actor.ActorHandle:
        return DirectoryShard.options(
            name=shard_name(namespace, shard),
            namespace=RAY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_restarts=-1,
            # a small call in flight when a shard dies runs again on its next incarnation,
            # which answers it from its new (empty) state and epoch, a few times at most
            # (one that kills each incarnation stops there); the bulk ones are not replayed
            # (`DirectoryShard.register`)
            max_task_retries=SMALL_CALL_RETRIES,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[shard], soft=True),
        ).remote(replica_timeout_s, namespace, shard, num_shards)

    first = shard_actor(0)
    check_shard_count(namespace, num_shards, first)
    return [first] + [shard_actor(shard) for shard in range(1, num_shards)]


def check_shard_count(namespace: str, num_shards: int, first: ray.actor.ActorHandle) -> None:
    """Refuse (ValueError) `num_shards` for `namespace` if its Directory's first shard was made
    with another count; a warning, and no check, if it does not say within SHARD_COUNT_TIMEOUT_S."""
    try:
        made_of = ray.get(first.num_shards.remote(), timeout=SHARD_COUNT_TIMEOUT_S)
    except Exception as e:
        logger.warning("directory: shard 0 of %s did not say how many shards it has (%s): not checked", namespace, e)
        return
    if made_of != num_shards:
        raise ValueError(
            f"directory_shards={num_shards} for cache namespace {namespace!r}, whose Directory has {made_of} shards: "
            f"every replica of a namespace must use the same directory_shards (set it to {made_of}, or move the "
            "replicas to the new count together)"
        )


def find_shards(namespace: str, num_shards: int) -> list[ShardActorClient]:
    """The `num_shards` shards of `namespace`'s Directory, which must exist, as `ShardActorClient`s."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r}: must be a positive int")
    return [
        ShardActorClient(ray.get_actor(shard_name(namespace, shard), namespace=RAY_NAMESPACE), namespace)
        for shard in range(num_shards)
    ]


def shard_clients(namespace: str, num_shards: int) -> list[ShardActorClient]:
    """`get_or_create_shards`, each shard as the `ShardClient` a `DirectoryLink` takes."""
    return [ShardActorClient(actor, namespace) for actor in get_or_create_shards(namespace, num_shards)]


def kill_shards(namespace: str) -> int:
    """Kill every shard of `namespace`'s Directory for good; how many there were."""
    killed = 0
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        parsed = parse_shard_name(name) if actor["namespace"] == RAY_NAMESPACE else None
        if parsed is not None and parsed[0] == namespace:
            try:
                ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
                killed += 1
            except ValueError:  # gone meanwhile
                pass
    return killed
