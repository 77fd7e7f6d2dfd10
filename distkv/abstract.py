"""The offloading API distkv implements: vLLM's kv_offload abstractions.

Every name of vLLM's seed ``vllm/v1/kv_offload/abstract.py`` with the same signatures
and semantics, plus the worker side of the same generation (``OffloadingHandler``,
``TransferSpec``, ``TransferResult``, ``OffloadingWorker``), and vLLM 0.33's four lookup
answers (``LookupResult``), which distkv's own managers give. Written for this project:
nothing here imports vLLM, so distkv runs under any engine.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from types import SimpleNamespace
from typing import Any, NewType, TypeVar

import numpy as np
import torch

# `OffloadKey` identifies an offloaded block: a block hash followed by its KV-cache group
# index as 4 big-endian bytes. Raw bytes rather than a tuple keep the GC out of the hot path.
OffloadKey = NewType("OffloadKey", bytes)

GROUP_IDX_BYTES = 4

_T = TypeVar("_T")


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and group index into an `OffloadKey`."""
    return OffloadKey(block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Extract the block hash from an `OffloadKey`."""
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """Extract the group index from an `OffloadKey`."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big", signed=False)


@dataclass
class ReqContext:
    """A request as the manager sees it, as in vLLM 0.33: its id and transfer params, a
    per-request state by type (`set_state`/`get_state`), and the end token of each offload
    key the engine recorded for it (`set_offload_key_position`), which places a request's
    blocks on the Directory's shards by its prefix."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[OffloadKey, int] = field(default_factory=dict, repr=False, init=False)

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._offload_key_positions.get(key)

    def offload_key_positions(self) -> Mapping[OffloadKey, int]:
        """Every recorded key's end token, in the order recorded (distkv's own: vLLM's
        ReqContext reads them back one key at a time only)."""
        return self._offload_key_positions


class LoadStoreSpec(ABC):
    """Metadata that lets a worker load, and optionally store, blocks of KV data."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium this spec addresses ("GPU", "CPU", ...)."""


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    keys: list[OffloadKey]
    medium: str
    # True if blocks are removed, False if stored
    removed: bool


class LookupResult(IntEnum):
    """What a lookup of one block found: vLLM 0.33's four answers (its
    ``vllm.v1.kv_offload.base.LookupResult``), of which the seed's ``bool | None`` keeps three.

    An IntEnum so that an adapter maps it by indexing a tuple (see SEED_LOOKUP_ANSWERS):
    no call on the scheduler's per-block path.
    """

    MISS = 0  # not offloaded: compute it
    HIT = 1  # offloaded and ready to be read
    HIT_PENDING = 2  # being stored by this replica: readable once its store completes
    RETRY = 3  # being fetched from elsewhere: ask again next step (it may still end a miss)


# The seed's lookup answer for each LookupResult, indexed by it: the seed has one "retry
# later" (None) for both a store and a fetch in flight.
SEED_LOOKUP_ANSWERS: tuple[bool | None, ...] = tuple(
    {LookupResult.MISS: False, LookupResult.HIT: True, LookupResult.HIT_PENDING: None, LookupResult.RETRY: None}[r]
    for r in LookupResult
)


class OffloadingManager(ABC):
    """Tracks which blocks are offloaded and where; runs in the scheduler.

    lookup() - whether a single block is offloaded and ready.
    prepare_load() - protect blocks from eviction and say where to read them.
    touch() - mark blocks recently used (also those served by the GPU prefix cache).
    complete_load() - re-allow eviction of blocks prepared for loading.
    prepare_store() - choose where to write blocks, evicting as needed.
    complete_store() - make stored blocks loadable (or drop them on failure).
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Whether one block is offloaded and ready to be read.

        Returns True if ready, False if not, or None if the lookup should be retried
        later (the vLLM scheduler then delays the request by a step).
        """

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Prepare the given blocks, all of them offloaded, to be read.

        They are protected from eviction until `complete_load`. Returns the spec a
        worker uses to locate the data.
        """

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark the given blocks as recently used."""
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks previously prepared for loading as done loading."""
        return

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Prepare the given blocks to be offloaded.

        They are protected from eviction until `complete_store`. Returns which blocks
        need storing, where (a LoadStoreSpec), and which blocks were evicted for them;
        None if the blocks cannot be stored.
        """

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Mark blocks previously prepared for storing as stored: they become loadable.

        If success is False, blocks not yet marked as stored are removed.
        """
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Yield the OffloadingEvents collected since the last call."""
        return ()

    def reset_cache(self) -> None:
        """Evict all tracked blocks and reset internal state."""
        return

    def shutdown(self) -> None:
        """Release every resource the manager holds."""
        return


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Spec for loading/storing KV blocks given by block numbers."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray):
        ids = np.asarray(block_ids)
        # no silent cast: a float, a string, a bool or an int past int64 is no block id
        if ids.size and (ids.dtype.kind not in "iu" or (ids.dtype.kind == "u" and ids.max() > np.iinfo(np.int64).max)):
            raise ValueError(f"block ids {block_ids!r} must be integers")
        self.block_ids = ids.astype(np.int64)

    def __repr__(self) -> str:
        return repr(self.block_ids)


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Spec for loading/storing KV blocks to GPU memory.

    With several KV groups, block ids are ordered by group index and group_sizes[i] is
    the number of blocks of group i (sum(group_sizes) == len(block_ids)).

    block_indices[i] is the logical index, within its request, of the first block of
    group i. Offloaded blocks may span several GPU blocks; the first GPU block of a
    group may then be unaligned to an offloaded block, and block_indices tells the
    worker how much of the first offloaded block to skip.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ):
        super().__init__(block_ids)
        if sum(group_sizes) != len(self.block_ids):
            raise ValueError(
                f"GPULoadStoreSpec: group_sizes sum to {sum(group_sizes)} "
                f"but there are {len(self.block_ids)} block ids"
            )
        if len(block_indices) != len(group_sizes):
            raise ValueError(
                f"GPULoadStoreSpec: {len(block_indices)} block_indices "
                f"for {len(group_sizes)} groups"
            )
        self.group_sizes: Sequence[int] = group_sizes
        self.block_indices: Sequence[int] = block_indices

    @staticmethod
    def medium() -> str:
        return "GPU"


@dataclass
class CanonicalKVCacheTensor:
    """A KV-cache tensor whose first dimension is num_blocks (int8, (num_blocks, page))."""

    tensor: torch.Tensor
    # The (possibly padded) page size per block in bytes
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """A layer's (or group of layers') reference to one CanonicalKVCacheTensor."""

    # Index into CanonicalKVCaches.tensors
    tensor_idx: int
    # The un-padded page size per block in bytes
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """Block-level view of the KV caches.

    tensors: the unique KV tensors, each (num_blocks, page_size_in_bytes) int8.
    group_data_refs: per KV-cache group, the references mapping its layers to tensors.
    """

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


class OffloadingSpec(ABC):
    """Spec for an offloading connector: builds the manager and the worker handlers.

    Constructed from vLLM's ``(vllm_config, kv_cache_config)``, read by attribute so that
    any objects with those attributes do; `from_layout` builds it for other engines.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config

        kv_transfer_config = vllm_config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("OffloadingSpec needs vllm_config.kv_transfer_config")
        self.extra_config: dict[str, Any] = dict(kv_transfer_config.kv_connector_extra_config or {})

        parallel_config = vllm_config.parallel_config
        context_parallel_factor = getattr(parallel_config, "decode_context_parallel_size", 1) * getattr(
            parallel_config, "prefill_context_parallel_size", 1
        )

        # gpu block size per group
        self.gpu_block_size: tuple[int, ...] = tuple(
            group.kv_cache_spec.block_size * context_parallel_factor
            for group in kv_cache_config.kv_cache_groups
        )
        if not self.gpu_block_size:
            raise ValueError("OffloadingSpec needs at least one KV cache group")
        for block_size in self.gpu_block_size:
            if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"KV cache group block size {block_size!r} must be a positive int")

        # The granularity of the scheduler's block hashes: vLLM's prefix_match_unit if set,
        # else the GCD of the groups' block sizes (the block size itself for one group).
        prefix_match_unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
        self.hash_block_size: int = prefix_match_unit or math.gcd(*self.gpu_block_size)
        for block_size in self.gpu_block_size:
            if block_size % self.hash_block_size:
                raise ValueError(
                    f"gpu_block_size={block_size} not divisible by "
                    f"hash_block_size={self.hash_block_size}"
                )

        # offloaded block size / gpu block size
        self.block_size_factor: int = 1
        offloaded_block_size = self.extra_config.get("block_size")
        if offloaded_block_size is not None:
            if isinstance(offloaded_block_size, bool) or not isinstance(offloaded_block_size, int):
                raise ValueError(
                    f"kv_connector_extra_config 'block_size'={offloaded_block_size!r} must be a whole number of tokens"
                )
            offloaded = offloaded_block_size
            sizes = set(self.gpu_block_size)
            if len(sizes) != 1:
                raise ValueError(
                    "kv_connector_extra_config 'block_size' needs every KV cache group "
                    f"to have the same block size, got {sorted(sizes)}"
                )
            gpu_block_size = sizes.pop()
            if offloaded <= 0 or offloaded % gpu_block_size:
                raise ValueError(
                    f"kv_connector_extra_config 'block_size'={offloaded} must be a positive "
                    f"multiple of the GPU block size {gpu_block_size}"
                )
            self.block_size_factor = offloaded // gpu_block_size

    @classmethod
    def from_layout(
        cls,
        extra_config: Mapping[str, Any],
        gpu_block_sizes: Sequence[int],
        group_page_bytes: Sequence[int],
        *,
        engine_id: str | None = None,
        tensor_parallel_size: int = 1,
        rank: int = 0,
        **config_attrs: Any,
    ) -> "OffloadingSpec":
        """Build the spec without vLLM.

        gpu_block_sizes: tokens per GPU block, one per KV group. group_page_bytes: bytes of
        one GPU block of each group on one worker, all layers together. engine_id: the
        replica's, None for a fresh one (the spec makes it). `config_attrs` become
        attributes of the stand-in vllm_config (model, dtype, ...).
        """
        if len(group_page_bytes) != len(gpu_block_sizes):
            raise ValueError(
                f"{len(gpu_block_sizes)} gpu_block_sizes but {len(group_page_bytes)} group_page_bytes"
            )
        vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config=dict(extra_config), engine_id=engine_id
            ),
            parallel_config=SimpleNamespace(
                decode_context_parallel_size=1,
                prefill_context_parallel_size=1,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=1,
                rank=rank,
            ),
            cache_config=SimpleNamespace(prefix_match_unit=None),
            **config_attrs,
        )
        kv_cache_config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(
                    kv_cache_spec=SimpleNamespace(block_size=size, page_size_bytes=page),
                    layer_names=["all_layers"],
                )
                for size, page in zip(gpu_block_sizes, group_page_bytes)
            ]
        )
        return cls(vllm_config, kv_cache_config)

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The OffloadingManager the scheduler-side connector uses."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], "OffloadingHandler"]]:
        """Yield (src_spec_type, dst_spec_type, handler) for each transfer direction."""


# ---------------------------------------------------------------------------------------
# Worker side (vllm/v1/kv_offload/worker/worker.py of the same generation)

# A transfer reads from the first spec and writes to the second.
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None  # bytes
    transfer_time: float | None = None  # seconds
    transfer_type: tuple[str, str] | None = None  # (src medium, dst medium)


class OffloadingHandler(ABC):
    """Moves blocks in one direction between two mediums, asynchronously."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a transfer; never blocks. Returns whether it was submitted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of the transfers finished since the last call, each job once."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until every given job has finished."""

    def shutdown(self) -> None:
        """Finish or abandon outstanding transfers and release resources."""
        return


@dataclass
class _HandlerJobs:
    """A registered handler and the jobs in flight on it."""

    handler: OffloadingHandler
    jobs: set[int] = field(default_factory=set)


class OffloadingWorker:
    """Dispatches transfers to handlers by (src.medium(), dst.medium())."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], _HandlerJobs] = {}
        self._job_route: dict[int, _HandlerJobs] = {}

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        transfer_type = (src_cls.medium(), dst_cls.medium())
        if transfer_type in self._routes:
            raise ValueError(f"a handler for {transfer_type} is already registered")
        self._routes[transfer_type] = _HandlerJobs(handler)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        transfer_type = (src.medium(), dst.medium())
        route = self._routes.get(transfer_type)
        if route is None:
            raise ValueError(f"no handler registered for transfers {transfer_type}")
        if job_id in self._job_route:
            raise ValueError(f"job {job_id} is already in flight")
        if not route.handler.transfer_async(job_id, spec):
            return False
        route.jobs.add(job_id)
        self._job_route[job_id] = route
        return True

    def get_finished(self) -> list[TransferResult]:
        finished: list[TransferResult] = []
        for route in self._routes.values():
            if not route.jobs:
                continue
            for result in route.handler.get_finished():
                route.jobs.discard(result.job_id)
                self._job_route.pop(result.job_id, None)
                finished.append(result)
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for route in self._routes.values():
            mine = job_ids & route.jobs
            if mine:
                route.handler.wait(mine)

    def shutdown(self) -> None:
        for route in self._routes.values():
            route.handler.shutdown()
        self._routes.clear()
        self._job_route.clear()
