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
from dataclasses import dataclass
from typing import Any

import numpy as np

from distkv.pool import HostPool

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

    def release(self) -> None:
        """Give the handle back (a READ still in flight is aborted); never raises."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        try:
            with self._lock:
                self._agent.release_xfer_handle(handle)
        except Exception:
            pass


class NixlAgent:
    """This process's NIXL agent: registers memory, reads what peers registered.

    NIXL's own progress thread polls without pause (a core per agent); UCX needs progress
    on both sides (the holder's too, for a reader's connection to complete), so a thread
    of ours progresses the agent every PROGRESS_S instead, and a reader's polling of its
    reads progresses them. Every call into NIXL takes one lock, so any thread may use it.
    """

    PROGRESS_S = 0.005

    def __init__(self, name: str | None = None) -> None:
        api = load_nixl()
        self.name = name or f"distkv-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:
            raise RdmaUnavailable(
                f"NIXL's UCX agent did not start ({e}): check UCX on this host, or set 'transport' to 'object_store'"
            ) from e
        self._lock = threading.Lock()
        self._registrations: list[Any] = []
        self._peers: dict[str, str] = {}  # agent name -> the name NIXL gave it here
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="distkv-nixl-progress", daemon=True)
        self._progress.start()

    def _progress_loop(self) -> None:
        while not self._stop.wait(self.PROGRESS_S):
            try:
                with self._lock:
                    self._agent.get_new_notifs()
            except Exception:
                logger.debug("NIXL progress failed", exc_info=True)

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
        """Stop progressing, forget every peer and release every registration."""
        self._stop.set()
        self._progress.join()
        for agent_name in list(self._peers):
            self.forget(agent_name)
        with self._lock:
            while self._registrations:
                try:
                    self._agent.deregister_memory(self._registrations.pop())
                except Exception:
                    pass

    def _connect(self, remote: PoolEndpoint) -> str:
        peer = self._peers.get(remote.agent_name)
        if peer is None:
            peer = self._peers[remote.agent_name] = self._agent.add_remote_agent(remote.agent_metadata)
        return peer
