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
from dataclasses import dataclass
from typing import Any

import numpy as np

from distkv.pool import HostPool

MEM_TYPE = "DRAM"


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

    def __init__(self, agent: Any, handle: Any, state: str) -> None:
        self._agent = agent
        self._handle = handle
        self._failed = state == "ERR"

    def state(self) -> str:
        """"done", "pending" or "failed"; never raises."""
        if self._failed:
            return "failed"
        try:
            state = self._agent.check_xfer_state(self._handle)
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
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass


class NixlAgent:
    """This process's NIXL agent: registers memory, reads what peers registered.

    Not thread-safe: one thread (a replica's Promoter) drives it.
    """

    def __init__(self, name: str | None = None) -> None:
        api = load_nixl()
        self.name = name or f"distkv-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        except Exception as e:
            raise RdmaUnavailable(f"NIXL's UCX agent did not start: {e}") from e
        self._registrations: list[Any] = []
        self._peers: dict[str, str] = {}  # agent name -> the name NIXL gave it here

    def register(self, address: int, nbytes: int, mem_type: str = MEM_TYPE, device: int = 0) -> None:
        """Make [address, address + nbytes) of this process readable and writable by reads:
        host memory ("DRAM"), or memory of GPU `device` ("VRAM")."""
        self._registrations.append(self._agent.register_memory([(address, nbytes, device, "")], mem_type))

    def endpoint(self, pool: HostPool) -> PoolEndpoint:
        """Register pool's segment and say where peers read it."""
        nbytes = pool.layout.total_bytes
        self.register(pool.address, nbytes)
        return PoolEndpoint(self.name, self._agent.get_agent_metadata(), pool.address, nbytes)

    def read(self, remote: PoolEndpoint, pieces: np.ndarray, local_mem_type: str = MEM_TYPE, local_device: int = 0) -> NixlRead:
        """Start one READ of `pieces`, an (n, 3) array of (offset in the remote segment,
        local address, bytes), into registered memory of `local_mem_type` (see register).
        Raises if it cannot start (the peer is gone, a piece lies outside what either side
        registered)."""
        peer = self._connect(remote)
        zeros = np.zeros(len(pieces), dtype=np.int64)
        local = np.stack([pieces[:, 1], pieces[:, 2], np.full(len(pieces), local_device, dtype=np.int64)], axis=1)
        far = np.stack([remote.address + pieces[:, 0], pieces[:, 2], zeros], axis=1)
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
        return NixlRead(self._agent, handle, state)

    def forget(self, agent_name: str) -> None:
        """Drop a peer (it restarted or left): the next read from it connects afresh."""
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
        """Forget every peer and release every registration."""
        for agent_name in list(self._peers):
            self.forget(agent_name)
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
