"""Transports: how the bytes of a block held on another node reach the row reserved here.

The Promoter reserves rows of a landing (`distkv.transfer.landing`: this replica's pool,
or its owner's chunks) and hands a transport the reads of one holder; the transport moves
every rank's slot of each holder row into its row of the landing and says, per read, what
the holder's headers said of the block once its bytes are here and checked against them
(the checksum), or None: a miss. The landing then accepts what checked out.

- `ObjectStoreTransport`: the holder node's NodeAgent copies the rows into the object
  store as a call's result; they are copied here, checked as they are copied.
- `NixlTransport`: one-sided NIXL READs from the holder's registered segment straight
  into the registered landing, headers into a scratch, then a second READ of the
  generations; nothing runs in the holder's processes.
- `NodeTransports` picks one of them per holder node (the `transport` setting).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from distkv.abstract import OffloadKey
from distkv.directory.records import ReplicaInfo
from distkv.transfer.endpoint_seal import EndpointSeal
from distkv.storage.slots import HEADER_BYTES, Sealed, check_landed, copy_checksum
from distkv.storage.pool import HostPool, PoolLayout
from distkv.storage.readers import RowsRead
from distkv.transfer.holder_nodes import HolderNodes
from distkv.transfer.landing import Landing, PoolLanding
from distkv.transfer.node_rates import NodeRates
from distkv.transfer.rdma import Connections, NixlAgent, PoolEndpoint, ReadQueue

logger = logging.getLogger(__name__)

# Per read, each rank's header as the holder sealed it; None: not to be used.
Landed = list[list[Sealed] | None]


@dataclass(frozen=True)
class RowRead:
    """One block to bring here: its key, where the holder keeps it, the row of the landing for it."""

    key: OffloadKey
    holder_row: int
    holder_generation: int
    local_row: int


class Transfer(ABC):
    """The reads of one `Transport.start`, in flight."""

    # the name of the Transport that started it
    transport = ""
    # whether it went another way than its holder's next transfers will (the object store
    # while NIXL connects): what it takes is no measure of that path
    stands_in = False

    @abstractmethod
    def done(self) -> bool:
        """Whether `finish` can run without waiting. Never blocks."""

    @abstractmethod
    def finish(self) -> Landed:
        """Once done: what landed and checked out, per read in order. Runs on the caller's
        thread; raises if the transfer failed as a whole."""

    @abstractmethod
    def cancel(self) -> None:
        """Give up (a deadline passed, or the transfer failed); `finish` is not called. Its
        bytes may still land in the landing's rows until `settled`. Never raises; calling it
        twice is fine."""

    def settled(self) -> bool:
        """Whether no byte of a cancelled transfer lands in the landing's rows any more, so that
        they may be used again: at once, but for a one-sided read that could not be
        aborted yet. Never raises."""
        return True


class Transport(ABC):
    """Moves blocks from a holder on another node into rows of a landing: this replica's
    pool unless a transfer names another."""

    name: str
    # The most bytes one transfer carries (one row at least): the Promoter splits bigger
    # promotions, so that successive transfers overlap their steps (for the object store:
    # the holder's copy into it, the transfer, the checked copy here) instead of running
    # one after the other; each transfer has a cost of its own too (docs/benchmarks.md).
    BATCH_BYTES = 64 << 20

    def batch_bytes(self, holder: ReplicaInfo) -> int:
        """The most bytes one transfer from `holder` should carry."""
        return self.BATCH_BYTES

    @abstractmethod
    def start(
        self, holder: ReplicaInfo, reads: Sequence[RowRead], wake: Callable[[], None], into: Landing | None = None
    ) -> Transfer:
        """Start `reads` from `holder`'s pool into `into` (this replica's pool if None, else
        a landing `admit` took); `wake` runs (on any thread) when the transfer may have
        become done. Raises if nothing could start."""

    def admit(self, into: Landing) -> None:
        """Let transfers land in `into` from now on (before the first that does)."""

    def rates(self) -> dict[str, dict[str, float]]:
        """Per holder node, the rate (bytes/s) measured for each transport; {} if it measures none."""
        return {}

    def forget_gone(self, replica_info: Callable[[str], ReplicaInfo | None]) -> None:
        """Release what is kept for holders that left (replica_info says None) or came
        back as another registration, and for nodes none of whose holders is listed any
        more; the next read of one starts afresh."""

    def close(self) -> None:
        """Release what the transport holds."""


# ---- through the object store -------------------------------------------------------

class RemoteFetch(Protocol):
    """How `ObjectStoreTransport` has a holder's node read rows: `ray_actors.node_agent.AgentFetch`."""

    def __call__(
        self, holder: ReplicaInfo, rows: list[int], keys: list[OffloadKey], generations: list[int]
    ) -> Future[RowsRead]:
        """A future of the rows as the holder's node read them (`distkv.storage.pool.read_rows`)."""

    def forget_gone(self, replica_info: Callable[[str], ReplicaInfo | None]) -> None:
        """Release what is kept for the nodes of holders that left (`Transport.forget_gone`)."""


def shipped_index(metas: Sequence[list[Sealed] | None]) -> list[int | None]:
    """Where each row of a RowsRead is in its array: None for a row that was not shipped."""
    index: list[int | None] = []
    shipped = 0
    for meta in metas:
        index.append(None if meta is None else shipped)
        shipped += meta is not None
    return index


class _FetchedRows(Transfer):
    transport = "object_store"

    def __init__(self, future: Future, into: Landing, reads: Sequence[RowRead]) -> None:
        self._future = future
        self._into = into
        self._reads = reads

    def done(self) -> bool:
        return self._future.done()

    def finish(self) -> Landed:
        data, metas = self._future.result()
        if len(metas) != len(self._reads):
            raise ValueError(f"the holder answered {len(metas)} rows' headers for {len(self._reads)} rows")
        shipped = shipped_index(metas)
        landed: Landed = []
        for read, meta, i in zip(self._reads, metas, shipped):
            if meta is not None:
                payload = self._into.payload
                for rank, slot in enumerate(meta):
                    if not _copy_checked(data[rank, i], slot, payload[rank, read.local_row]):
                        meta = None
                        break
            landed.append(meta)
        return landed

    def cancel(self) -> None:
        self._future.cancel()  # the rows are copied here only in finish


def _copy_checked(src: np.ndarray, meta: Sealed, out: np.ndarray) -> bool:
    """Copy a slot received from another node; whether it matches its checksum."""
    return meta.nbytes <= out.nbytes and copy_checksum(out[: meta.nbytes], src[: meta.nbytes]) == meta.checksum


class ObjectStoreTransport(Transport):
    """Reads through the holder node's NodeAgent (`fetch`) and the Ray object store."""

    name = "object_store"

    def __init__(self, pool: HostPool, fetch: RemoteFetch) -> None:
        self._pool = PoolLanding(pool)
        self._fetch = fetch

    def start(
        self, holder: ReplicaInfo, reads: Sequence[RowRead], wake: Callable[[], None], into: Landing | None = None
    ) -> Transfer:
        future = self._fetch(
            holder, [r.holder_row for r in reads], [r.key for r in reads], [r.holder_generation for r in reads]
        )
        future.add_done_callback(lambda _: wake())
        return _FetchedRows(future, into or self._pool, reads)

    def forget_gone(self, replica_info: Callable[[str], ReplicaInfo | None]) -> None:
        self._fetch.forget_gone(replica_info)


# ---- one-sided NIXL reads -------------------------------------------------------------


class _Scratch:
    """Registered memory for the headers and generations of in-flight reads, in slots of
    (HEADER_BYTES + 8) bytes handed out and back."""

    SLOT_BYTES = HEADER_BYTES + 8

    def __init__(self, agent: NixlAgent, num_slots: int) -> None:
        self.buffer = np.zeros((num_slots, self.SLOT_BYTES), dtype=np.uint8)
        agent.register(self.buffer.ctypes.data, self.buffer.nbytes)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self._free):
                return None
            taken = self._free[-n:]
            del self._free[-n:]
            return taken

    def give_back(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)


class _NixlReads(Transfer):
    """A READ of the slots (straight into the landing's rows) and their headers (into the
    scratch), then, once it is done, a READ of the generations: `check_landed`."""

    transport = "nixl"

    def __init__(
        self,
        transport: NixlTransport,
        holder: ReplicaInfo,
        endpoint: PoolEndpoint,
        reads: Sequence[RowRead],
        scratch: list[int],
        wake: Callable[[], None],
        into: Landing,
    ) -> None:
        self._transport = transport
        self._reads = reads
        self._scratch = scratch
        self._wake = wake
        self._into = into
        layout = PoolLayout(holder.num_rows, holder.num_ranks, holder.slot_bytes)
        base = transport.scratch.buffer.ctypes.data
        slots, generations = [], []
        for i, read in enumerate(reads):
            for rank in range(layout.num_ranks):
                header = base + scratch[i * layout.num_ranks + rank] * _Scratch.SLOT_BYTES
                remote_header = layout.header_offset(rank, read.holder_row)
                local = into.slot_address(rank, read.local_row)
                slots.append((layout.slot_offset(rank, read.holder_row), local, layout.slot_bytes))
                slots.append((remote_header, header, HEADER_BYTES))
                generations.append((remote_header, header + HEADER_BYTES, 8))
        self._num_ranks = layout.num_ranks
        self._endpoint = endpoint
        self._over = False  # set on the queue's thread, read on the Promoter's
        self._failed = False
        self._queued = transport.reads.submit(
            endpoint, [np.array(slots, dtype=np.int64), np.array(generations, dtype=np.int64)], self._ended
        )

    def _ended(self, ok: bool) -> None:
        if not ok:
            # the peer is gone or restarted, so the next read connects afresh (a restarted
            # holder has a new agent, and its new endpoint a new name)
            self._failed = True
            self._transport.connections.forget(self._endpoint.agent_name)
        self._over = True
        self._wake()

    def done(self) -> bool:
        return self._over

    def finish(self) -> Landed:
        try:
            if self._failed:
                raise ConnectionError(f"a NIXL read from agent {self._endpoint.agent_name} failed")
            buffer = self._transport.scratch.buffer
            payload = self._into.payload
            landed: Landed = []
            for i, read in enumerate(self._reads):
                metas = []
                for rank in range(self._num_ranks):
                    slot = buffer[self._scratch[i * self._num_ranks + rank]]
                    metas.append(
                        check_landed(
                            slot[:HEADER_BYTES].tobytes(),
                            int(slot[HEADER_BYTES:].view("<u8")[0]),
                            read.key,
                            read.holder_generation,
                            payload[rank, read.local_row],
                        )
                    )
                landed.append(None if None in metas else metas)
            return landed
        finally:
            self._give_back_scratch()

    def cancel(self) -> None:
        self._transport.reads.cancel(self._queued)
        self.settled()

    def settled(self) -> bool:
        # the scratch is written by the READs too: its slots go back only once they are over
        if not self._queued.over:
            return False
        self._give_back_scratch()
        return True

    def _give_back_scratch(self) -> None:
        """Once only: a transfer cancelled after it finished must not hand its slots out twice."""
        scratch, self._scratch = self._scratch, []
        self._transport.scratch.give_back(scratch)


class NixlTransport(Transport):
    """One-sided READs from holders whose ReplicaInfo carries a NIXL endpoint that `seal`
    opens: one sealed by a member of this replica's cache namespace.

    Registers this replica's pool with its agent once (its endpoint, sealed, goes into the
    replica's own ReplicaInfo, for the namespace's other members to read it), a scratch
    for the headers of up to `scratch_slots` slots in flight, and each landing it admits.
    """

    name = "nixl"
    # smaller: a READ's one step here is the check of what landed, which is all that runs
    # after the last READ completes
    BATCH_BYTES = 16 << 20

    def __init__(self, pool: HostPool, agent: NixlAgent, seal: EndpointSeal, scratch_slots: int = 4096) -> None:
        self.pool = pool
        self.agent = agent
        self.endpoint = agent.endpoint(pool)
        self._landings: list[Landing] = [PoolLanding(pool)]  # registered with the agent: the pool first
        self.scratch = _Scratch(agent, scratch_slots)
        self.reads = ReadQueue(agent)
        self._seal = seal
        self._agent_of: dict[str, str] = {}  # holder replica -> the NIXL agent it was last read through
        # holder replica -> its sealed endpoint and what it opened to (None: it did not)
        self._opened: dict[str, tuple[bytes, PoolEndpoint | None]] = {}
        self.connections = Connections(agent, self.reads)

    def endpoint_of(self, holder: ReplicaInfo) -> PoolEndpoint | None:
        """holder's endpoint, if it registered one and it opens here; else None (the object
        store serves that holder). Opened once per sealed endpoint."""
        if holder.endpoint is None:
            return None
        opened = self._opened.get(holder.replica_id)
        if opened is None or opened[0] != holder.endpoint:
            endpoint = self._seal.open(holder.pool_name, holder.endpoint)
            if endpoint is None:
                logger.warning(
                    "distkv: the NIXL endpoint of replica %s does not open with this replica's namespace secret "
                    "and tenant salt: reading it through the object store (docs/operations.md#security)",
                    holder.replica_id,
                )
            opened = self._opened[holder.replica_id] = (holder.endpoint, endpoint)
        return opened[1]

    def admit(self, into: Landing) -> None:
        if not any(into is landing for landing in self._landings):
            self.agent.register(*into.region)
            self._landings.append(into)

    def start(
        self, holder: ReplicaInfo, reads: Sequence[RowRead], wake: Callable[[], None], into: Landing | None = None
    ) -> Transfer:
        into = into or self._landings[0]
        if not any(into is landing for landing in self._landings):
            raise ValueError("a NIXL read into memory the transport did not admit (Transport.admit)")
        endpoint = self._agent_endpoint(holder)
        if endpoint is None:
            raise ValueError(f"replica {holder.replica_id} registered no NIXL endpoint this replica can open")
        scratch = self.scratch.take(len(reads) * holder.num_ranks)
        if scratch is None:
            raise RuntimeError("NIXL scratch exhausted: too many slots in flight")
        try:
            return _NixlReads(self, holder, endpoint, reads, scratch, wake, into)
        except BaseException:
            self.scratch.give_back(scratch)
            self.connections.forget(endpoint.agent_name)
            raise

    def connected(self, holder: ReplicaInfo) -> bool:
        """Whether `connect` reached holder's agent (and no read of it failed since)."""
        endpoint = self.endpoint_of(holder)
        return endpoint is not None and self.connections.reached(endpoint.agent_name)

    def connect(self, holder: ReplicaInfo) -> None:
        """Connect to holder's agent in the background (`Connections.reach`), unless its
        endpoint does not open here."""
        endpoint = self._agent_endpoint(holder)
        if endpoint is not None:
            self.connections.reach(endpoint)

    def _agent_endpoint(self, holder: ReplicaInfo) -> PoolEndpoint | None:
        """holder's endpoint, as `endpoint_of`; the agent it had before, if another, is forgotten."""
        endpoint = self.endpoint_of(holder)
        if endpoint is None:
            return None
        previous = self._agent_of.get(holder.replica_id)
        if previous != endpoint.agent_name:
            if previous is not None:  # the holder restarted: its old agent is gone
                self.connections.forget(previous)
            self._agent_of[holder.replica_id] = endpoint.agent_name
        return endpoint

    def forget_gone(self, replica_info: Callable[[str], ReplicaInfo | None]) -> None:
        for replica_id in list(self._opened):
            if replica_info(replica_id) is None:
                del self._opened[replica_id]
        for replica_id, agent_name in list(self._agent_of.items()):
            info = replica_info(replica_id)
            endpoint = None if info is None else self.endpoint_of(info)
            if endpoint is None or endpoint.agent_name != agent_name:
                del self._agent_of[replica_id]
                self.connections.forget(agent_name)

    def close(self) -> None:
        self.reads.close()
        self.agent.close()
        del self._landings[1:]  # their owners' memory, not to be held past the close


# ---- which transport, per holder node --------------------------------------------------


class _Timed(Transfer):
    """A transfer whose rate is a measurement of its transport from its holder's node."""

    def __init__(self, inner: Transfer, rates: NodeRates, node_id: str, nbytes: int) -> None:
        self._inner = inner
        self._rates = rates
        self._node_id = node_id
        self._nbytes = nbytes
        self._started = time.perf_counter()
        self._ended: float | None = None
        self.transport = inner.transport

    def done(self) -> bool:
        done = self._inner.done()
        if done and self._ended is None:
            self._ended = time.perf_counter()
        return done

    def finish(self) -> Landed:
        try:
            landed = self._inner.finish()
        except BaseException:
            self._rates.measured(self._node_id, self.transport, 0.0)
            raise
        seconds = (self._ended or time.perf_counter()) - self._started
        self._rates.measured(self._node_id, self.transport, self._nbytes / max(seconds, 1e-9))
        return landed

    def cancel(self) -> None:
        self._inner.cancel()
        self._rates.measured(self._node_id, self.transport, 0.0)

    def settled(self) -> bool:
        return self._inner.settled()


class NodeTransports(Transport):
    """The transport each holder node is read through (the `transport` setting).

    "object_store": always the object store. "nixl": NIXL from every holder that
    registered an endpoint that opens here (`NixlTransport.endpoint_of`), the object store
    from the others. "auto": NIXL connects to a holder's agent in the background
    (`NixlTransport.connect`) while its transfers go through the object store, so that no
    request waits for UCX's wire-up and no measurement counts it. Both are measured on
    real transfers (the object store's first, while NIXL connects; `NodeRates`) and the
    faster at its best carries the node's transfers. So a fabric where NIXL's reads are
    slower than the object store (UCX with TCP only emulates them) keeps the object store.
    """

    def __init__(self, object_store: Transport, nixl: NixlTransport | None, mode: str) -> None:
        self.name = mode
        self._object_store = object_store
        self._nixl = nixl
        self._mode = mode
        # only of nodes the Directory still lists a holder on: they go out with every heartbeat
        self._rates = NodeRates()
        self._holder_nodes = HolderNodes()

    @property
    def nixl(self) -> NixlTransport | None:
        """The NIXL transport, when this replica has one."""
        return self._nixl

    @property
    def endpoint(self) -> PoolEndpoint | None:
        """This replica's own NIXL endpoint, or None when it reads through the object store only."""
        return None if self._nixl is None else self._nixl.endpoint

    def rates(self) -> dict[str, dict[str, float]]:
        """Per holder node measured so far ("auto"), each transport's best rate since its
        last recheck, in bytes/s."""
        return self._rates.best()

    def chosen(self, holder: ReplicaInfo) -> Transport:
        """The transport the next transfer from `holder` takes (not counting re-measures)."""
        if self._nixl is None or self._mode == "object_store" or self._nixl.endpoint_of(holder) is None:
            return self._object_store
        if self._mode == "nixl":
            return self._nixl
        if not self._nixl.connected(holder):
            return self._object_store
        fastest = self._rates.fastest(holder.node_id, (self._nixl.name, self._object_store.name))
        return self._nixl if fastest == self._nixl.name else self._object_store

    def start(
        self, holder: ReplicaInfo, reads: Sequence[RowRead], wake: Callable[[], None], into: Landing | None = None
    ) -> Transfer:
        self._holder_nodes.note(holder)
        nixl = self._nixl if self._mode == "auto" else None
        if nixl is None or nixl.endpoint_of(holder) is None:
            return self.chosen(holder).start(holder, reads, wake, into)
        stands_in = not nixl.connected(holder)
        if stands_in:  # for NIXL, which connects meanwhile
            nixl.connect(holder)
        candidates = (nixl, self._object_store) if nixl.connected(holder) else (self._object_store,)
        measure = self._rates.start_measuring(holder.node_id, [t.name for t in candidates])
        if measure is None:
            transfer = self.chosen(holder).start(holder, reads, wake, into)
        else:
            try:
                transfer = next(t for t in candidates if t.name == measure).start(holder, reads, wake, into)
            except BaseException:
                self._rates.measured(holder.node_id, measure, 0.0)
                raise
            transfer = _Timed(transfer, self._rates, holder.node_id, len(reads) * holder.num_ranks * holder.slot_bytes)
        transfer.stands_in = stands_in
        return transfer

    def batch_bytes(self, holder: ReplicaInfo) -> int:
        return self.chosen(holder).batch_bytes(holder)

    def admit(self, into: Landing) -> None:
        self._object_store.admit(into)
        if self._nixl is not None:
            self._nixl.admit(into)

    def forget_gone(self, replica_info: Callable[[str], ReplicaInfo | None]) -> None:
        self._rates.keep_only(self._holder_nodes.live(replica_info))
        self._object_store.forget_gone(replica_info)
        if self._nixl is not None:
            self._nixl.forget_gone(replica_info)

    def close(self) -> None:
        self._object_store.close()
        if self._nixl is not None:
            self._nixl.close()
