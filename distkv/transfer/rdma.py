"""One-sided reads of other processes' pool segments, through NIXL (UCX backend).

A process registers a pool's whole segment (headers and payload) with its `NixlAgent`
once, and hands out the segment's `PoolEndpoint`. A reader that has it reads any of the
segment's bytes straight into memory it registered itself, with no call into the
holder's process: UCX moves the bytes (RDMA verbs between nodes, CMA or shared memory on
one host; with TCP only it emulates the read in software, slowly). Only registered
bytes can be read: NIXL refuses a read outside a peer's registrations.

A read orders none of its bytes: a reader of pool slots follows `pool.check_landed`.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from distkv.storage.pool import HostPool

MEM_TYPE = "DRAM"

logger = logging.getLogger(__name__)


class RdmaUnavailable(RuntimeError):
    """NIXL cannot be used in this process: not installed, or its agent did not start."""


def load_nixl() -> Any:
    """NIXL's Python API module, or RdmaUnavailable saying how to get it."""
    try:
        from nixl import _api
    except ImportError as e:
        raise RdmaUnavailable(
            f"the nixl transport needs NIXL ({e}): pip install 'ray-distkv[rdma]'"
        ) from e
    # NIXL logs to stdout, at INFO for every agent it starts: stdout is the program's (a
    # replica's, `distkv demo --json`'s), so it logs to stderr here, warnings and worse
    # unless NIXL_LOG_LEVEL says otherwise.
    nixl_logger = logging.getLogger("nixl")
    if "NIXL_LOG_LEVEL" not in os.environ:
        nixl_logger.setLevel(logging.WARNING)
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    return _api


@dataclass(frozen=True)
class PoolEndpoint:
    """Where a registered pool segment can be read: the registering process's NIXL agent
    (its name and metadata, enough to connect) and the segment's address there."""

    agent_name: str
    agent_metadata: bytes
    address: int
    nbytes: int


class NixlRead:
    """One READ in flight; `release` it once it is done or given up."""

    def __init__(self, agent: Any, lock: threading.Lock, handle: Any, state: str) -> None:
        self._agent = agent
        self._lock = lock
        self._handle = handle
        self._failed = state == "ERR"

    def state(self) -> str:
        """"done", "pending" or "failed"; never raises."""
        if self._failed:
            return "failed"
        try:
            with self._lock:
                state = self._agent.check_xfer_state(self._handle)  # also progresses the read
        except Exception:
            self._failed = True
            return "failed"
        if state == "DONE":
            return "done"
        if state == "PROC":
            return "pending"
        self._failed = True
        return "failed"

    def release(self) -> bool:
        """Give the handle back, aborting a READ still in flight: whether it is given back,
        so that no byte of the READ lands any more. NIXL refuses (and keeps the handle)
        when it cannot abort the READ, as UCX cannot always: then False, and the caller
        tries again later. Never raises; releasing twice is fine."""
        if self._handle is None:
            return True
        try:
            with self._lock:
                self._agent.release_xfer_handle(self._handle)
        except Exception:
            logger.debug("NIXL kept a READ's handle: it could not abort the READ yet", exc_info=True)
            return False
        self._handle = None
        return True


class NixlAgent:
    """This process's NIXL agent: registers memory, reads what peers registered.

    UCX needs progress on both sides (the holder's too, for a reader's connection to
    complete): NIXL's progress thread makes it, sleeping in poll() on the UCX workers'
    event descriptors until an event (a peer connecting, a read completing) or
    PROGRESS_DELAY_US, and a reader's polling of its reads progresses them. Every call of
    ours into NIXL takes one lock, so any thread may use it.
    """

    # The progress thread's wake-up when no event came (NIXL keeps one against events
    # poll() may miss); events wake it at once.
    PROGRESS_DELAY_US = 100_000

    def __init__(self, name: str | None = None) -> None:
        api = load_nixl()
        self.name = name or f"distkv-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._agent = _agent_waking_on_events(api, self.name, self.PROGRESS_DELAY_US)
        except Exception as e:
            raise RdmaUnavailable(
                f"NIXL's UCX agent did not start ({e}): check UCX on this host, or set 'transport' to 'object_store'"
            ) from e
        self._lock = threading.Lock()
        self._registrations: list[Any] = []
        self._peers: dict[str, str] = {}  # agent name -> the name NIXL gave it here

    def register(self, address: int, nbytes: int, mem_type: str = MEM_TYPE, device: int = 0) -> None:
        """Make [address, address + nbytes) of this process readable and writable by reads:
        host memory ("DRAM"), or memory of GPU `device` ("VRAM")."""
        with self._lock:
            self._registrations.append(self._agent.register_memory([(address, nbytes, device, "")], mem_type))

    def endpoint(self, pool: HostPool) -> PoolEndpoint:
        """Register pool's segment and say where peers read it."""
        nbytes = pool.layout.total_bytes
        self.register(pool.address, nbytes)
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return PoolEndpoint(self.name, metadata, pool.address, nbytes)

    def read(self, remote: PoolEndpoint, pieces: np.ndarray, local_mem_type: str = MEM_TYPE, local_device: int = 0) -> NixlRead:
        """Start one READ of `pieces`, an (n, 3) array of (offset in the remote segment,
        local address, bytes), into registered memory of `local_mem_type` (see register).
        Raises if it cannot start (the peer is gone, a piece lies outside what either side
        registered)."""
        zeros = np.zeros(len(pieces), dtype=np.int64)
        local = np.stack([pieces[:, 1], pieces[:, 2], np.full(len(pieces), local_device, dtype=np.int64)], axis=1)
        far = np.stack([remote.address + pieces[:, 0], pieces[:, 2], zeros], axis=1)
        with self._lock:
            peer = self._connect(remote)
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, local_mem_type),
                self._agent.get_xfer_descs(far, MEM_TYPE),
                peer,
            )
            try:
                state = self._agent.transfer(handle)
            except Exception:
                self._agent.release_xfer_handle(handle)
                raise
        return NixlRead(self._agent, self._lock, handle, state)

    def forget(self, agent_name: str) -> None:
        """Drop a peer (it restarted or left): the next read from it connects afresh."""
        with self._lock:
            peer = self._peers.pop(agent_name, None)
            if peer is not None:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        """Forget every peer and release every registration; the agent and its progress
        thread go once no read of it is held any more."""
        for agent_name in list(self._peers):
            self.forget(agent_name)
        with self._lock:
            while self._registrations:
                try:
                    self._agent.deregister_memory(self._registrations.pop())
                except Exception:
                    pass
            self._agent = None

    def _connect(self, remote: PoolEndpoint) -> str:
        peer = self._peers.get(remote.agent_name)
        if peer is None:
            peer = self._peers[remote.agent_name] = self._agent.add_remote_agent(remote.agent_metadata)
        return peer


def _agent_waking_on_events(api: Any, name: str, progress_delay_us: int) -> Any:
    """NIXL's agent (`api.nixl_agent`, UCX backend) with its progress thread on, sleeping
    up to `progress_delay_us` between UCX events.

    NIXL's Python API gives the agent's C++ config a delay of 0 and no way to set another;
    with 0 the progress thread polls without sleeping, a core per agent. The API's own
    constructor runs here unchanged, but sees its bindings module through a view whose
    config keeps this delay: nothing outside this agent changes."""
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class DelayedConfig(base):
        pthrDelay = property(
            lambda self: base.pthrDelay.__get__(self),
            lambda self, _: base.pthrDelay.__set__(self, progress_delay_us),  # whatever the API sets
        )

    class Bindings:
        nixlAgentConfig = DelayedConfig

        def __getattr__(self, attr: str) -> Any:
            return getattr(bindings, attr)

    init = api.nixl_agent.__init__
    if init.__globals__.get("nixlBind") is not bindings:
        raise RuntimeError(f"this NIXL's Python API ({api.__name__}) does not build its agents as distkv expects")
    seen = {**init.__globals__, "nixlBind": Bindings()}
    construct = types.FunctionType(init.__code__, seen, init.__name__, init.__defaults__, init.__closure__)
    agent = api.nixl_agent.__new__(api.nixl_agent)
    construct(agent, name, api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    return agent


class Connections:
    """The peers' agents a reader reached: `reach` connects to one in the background with
    a READ of a few of its bytes, since the first READ from a peer waits for UCX to wire the
    two agents up (tens of milliseconds, under load a hundred), and no transfer should."""

    PROBE_BYTES = 8

    def __init__(self, agent: NixlAgent, reads: ReadQueue) -> None:
        self._agent = agent
        self._reads = reads
        self._probe = np.zeros(self.PROBE_BYTES, dtype=np.uint8)  # every probe lands here, unread
        agent.register(self._probe.ctypes.data, self._probe.nbytes)
        # agent name -> reached (True) or being reached (False); set on the queue's thread too
        self._state: dict[str, bool] = {}

    def reached(self, agent_name: str) -> bool:
        return self._state.get(agent_name, False)

    def reach(self, remote: PoolEndpoint) -> None:
        """Connect to remote's agent in the background, unless reached or being reached."""
        name = remote.agent_name
        if name in self._state:
            return
        self._state[name] = False

        def probed(ok: bool) -> None:
            if not ok:
                self.forget(name)
            elif name in self._state:  # not forgotten meanwhile
                self._state[name] = True

        probe = np.array([(0, self._probe.ctypes.data, self.PROBE_BYTES)], dtype=np.int64)
        self._reads.submit(remote, [probe], probed)

    def forget(self, agent_name: str) -> None:
        """Drop a peer (it restarted, left, or a read of it failed): it is reached afresh."""
        self._state.pop(agent_name, None)
        self._agent.forget(agent_name)


class QueuedRead:
    """READs handed to a `ReadQueue` as one: queued, being posted, in flight, draining (its
    READ ended or was given up, but NIXL has not let its handle go: bytes may still land),
    or over (nothing of it lands any more)."""

    QUEUED, POSTING, IN_FLIGHT, DRAINING, OVER = range(5)

    def __init__(self, remote: PoolEndpoint, steps: list[np.ndarray], then: Callable[[bool], None]) -> None:
        self.remote = remote
        self.steps = steps
        self.then = then
        self.step = 0  # the READ of steps[step] is the one queued, posted, in flight or draining
        self.state = self.QUEUED
        self.read: NixlRead | None = None
        # what the READ of a DRAINING one ended with, said once its handle is let go; None:
        # cancelled, nothing is said
        self.outcome: bool | None = None

    @property
    def over(self) -> bool:
        """Whether no byte of these READs lands any more and nothing more is said of them."""
        return self.state == self.OVER


class ReadQueue:
    """Posts an agent's READs one after another on a thread of its own and polls them to
    completion.

    Over CMA or shared memory (one host, no RDMA NIC) UCX moves a READ's bytes inside the
    call that posts it, so posting here leaves the submitting thread free meanwhile: the
    Promoter checks what already landed while the next READ is being read. Over a NIC a
    post returns at once and the thread polls the READs in flight every POLL_S.

    A READ is over only once NIXL let its handle go: a READ it could not abort (cancelled,
    or failed with parts of it still moving) stays the queue's, draining, and the thread
    offers it back every RELEASE_RETRY_S; until then nothing more is posted or said of it.
    """

    POLL_S = 0.0002
    RELEASE_RETRY_S = 0.01

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        # re-entrant: a `then` runs holding it and may submit
        self._cond = threading.Condition(threading.RLock())
        self._queued: deque[QueuedRead] = deque()
        self._in_flight: list[QueuedRead] = []
        self._draining: list[QueuedRead] = []
        self._release_at = 0.0  # when the draining READs are offered back next
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="distkv-nixl-reads", daemon=True)
        self._thread.start()

    def submit(self, remote: PoolEndpoint, steps: list[np.ndarray], then: Callable[[bool], None]) -> QueuedRead:
        """Queue READs of `steps` (each as `NixlAgent.read`'s pieces), each posted once the
        one before has completed. `then(ok)` runs once, on the queue's thread, once no
        byte of the READs lands any more, unless they are cancelled first: ok is True when
        every READ completed, False as soon as one could not start or failed. Raises once
        the queue is closed."""
        queued = QueuedRead(remote, steps, then)
        with self._cond:
            if self._closed:
                raise RuntimeError("the NIXL read queue is closed")
            self._queued.append(queued)
            self._cond.notify_all()
        return queued

    def cancel(self, queued: QueuedRead) -> bool:
        """Give `queued` up: its `then` does not run. Whether no byte of it lands any more
        once this returns: a READ being posted is waited for and released, one in flight
        is released (aborted). A READ NIXL cannot abort stays draining: False, and
        `queued.over` says when it is over. Never raises; cancelling twice or after it
        ended is fine."""
        with self._cond:
            while queued.state == QueuedRead.POSTING:
                self._cond.wait()
            if queued.state == QueuedRead.QUEUED:
                self._queued.remove(queued)
                queued.state = QueuedRead.OVER
            elif queued.state == QueuedRead.IN_FLIGHT:
                self._in_flight.remove(queued)
                self._let_go(queued, None)
            elif queued.state == QueuedRead.DRAINING:
                queued.outcome = None
            return queued.over

    def close(self) -> None:
        """Cancel every READ not yet over and stop the thread (a READ NIXL still cannot
        abort is left to the agent's close)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queued or self._in_flight or self._draining or self._closed):
                    self._cond.wait()
                if self._closed:
                    for queued in [*self._queued, *self._in_flight, *self._draining]:
                        self.cancel(queued)
                    if self._draining:
                        logger.warning("%d NIXL READ(s) could not be aborted at close", len(self._draining))
                    return
                posting = self._queued.popleft() if self._queued else None
                if posting is not None:
                    posting.state = QueuedRead.POSTING
                else:
                    self._cond.wait(self.POLL_S if self._in_flight else self.RELEASE_RETRY_S)
            if posting is not None:
                self._post(posting)
            with self._cond:
                for queued in list(self._in_flight):
                    state = queued.read.state()
                    if state != "pending":
                        self._in_flight.remove(queued)
                        self._let_go(queued, state == "done")
                if self._draining and time.monotonic() >= self._release_at:
                    self._release_at = time.monotonic() + self.RELEASE_RETRY_S
                    for queued in list(self._draining):
                        if queued.read.release():
                            self._draining.remove(queued)
                            self._over(queued)

    def _let_go(self, queued: QueuedRead, outcome: bool | None) -> None:
        """queued's READ ended (outcome: whether it completed) or was cancelled (None):
        release its handle and go on, or keep it draining until NIXL lets it go."""
        queued.outcome = outcome
        if queued.read.release():
            self._over(queued)
        else:
            queued.state = QueuedRead.DRAINING
            self._draining.append(queued)

    def _over(self, queued: QueuedRead) -> None:
        """queued's READ handle is let go: nothing of it lands any more."""
        queued.read = None
        if queued.outcome is None:
            queued.state = QueuedRead.OVER
        else:
            self._ended(queued, queued.outcome)

    def _post(self, queued: QueuedRead) -> None:
        """Post queued's next READ, outside the condition: others queue meanwhile."""
        try:
            read = self._agent.read(queued.remote, queued.steps[queued.step])
        except Exception:
            logger.debug("a NIXL read from %s could not start", queued.remote.agent_name, exc_info=True)
            read = None
        with self._cond:
            self._cond.notify_all()  # a cancel waiting for the post
            if read is None:
                self._ended(queued, False)
            else:
                queued.read = read
                queued.state = QueuedRead.IN_FLIGHT
                self._in_flight.append(queued)

    def _ended(self, queued: QueuedRead, ok: bool) -> None:
        """queued's READ ended: post the next step first, or say how all went."""
        if ok and queued.step + 1 < len(queued.steps):
            queued.step += 1
            queued.state = QueuedRead.QUEUED
            self._queued.appendleft(queued)
            return
        queued.state = QueuedRead.OVER
        queued.then(ok)
