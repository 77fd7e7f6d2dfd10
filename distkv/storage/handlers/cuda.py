"""Copy backend with CuPy: cudaMemcpyAsync per run on a stream of the handler's own.

The pool region of the worker's rank is registered as pinned memory (in pieces of at
most pool.MAX_PIN_BYTES, ending on slot boundaries) so that copies are asynchronous DMA.
CuPy is imported on first use: it imports without a GPU and fails only when used.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from distkv.storage.handlers.base import CopyBackend, CopyTicket
from distkv.storage.handlers.layout import CopyPlan
from distkv.storage.pool import MAX_PIN_BYTES, HostPool, pin_ranges

_HOST_REGISTER_DEFAULT = 0


def _cupy() -> ModuleType:
    import cupy

    return cupy


class PinnedRegion:
    """The pool region of one rank, registered with CUDA while any backend uses it.

    `cupy`: the CuPy module to register with (imported unless given); the backends
    attached to the region copy through the same one.
    """

    # cudaHostRegister fails on very large ranges
    max_piece_bytes = MAX_PIN_BYTES

    def __init__(self, pool: HostPool, rank: int, cupy: ModuleType | None = None):
        self.cupy = _cupy() if cupy is None else cupy
        runtime = self.cupy.cuda.runtime
        layout = pool.layout
        self.address = pool.rank_address(rank)
        pieces = pin_ranges(self.address, layout.num_rows, layout.slot_bytes, self.max_piece_bytes)
        self.piece_bytes = pieces[0][1]
        self._registered: list[int] = []
        try:
            for address, size in pieces:
                runtime.hostRegister(address, size, _HOST_REGISTER_DEFAULT)
                self._registered.append(address)
        except BaseException:
            self._unregister()
            raise
        self._users = 0

    def attach(self) -> None:
        self._users += 1

    def detach(self) -> None:
        self._users -= 1
        if self._users == 0:
            self._unregister()

    def _unregister(self) -> None:
        runtime = self.cupy.cuda.runtime
        while self._registered:
            runtime.hostUnregister(self._registered.pop())


class TorchCudaDevice:
    """The CUDA device the KV tensors are on, as torch sees it: its index, and the stream
    torch queues the model's work on there."""

    def __init__(self, kv_tensors: Sequence[torch.Tensor]):
        device = kv_tensors[0].device
        if device.type != "cuda" or any(t.device != device for t in kv_tensors):
            raise ValueError(f"CudaCopyBackend needs every KV tensor on one CUDA device, got {device}")
        self._device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()

    def current_stream(self) -> int:
        """The raw handle of torch's current stream on the device."""
        return torch.cuda.current_stream(self._device).cuda_stream


class _EventTicket:
    def __init__(self, event):
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()


class CudaCopyBackend(CopyBackend):
    """Copies between KV tensors in CUDA device memory and a pinned pool region on a
    non-blocking stream.

    `device`: the tensors' device and the stream the model's work is queued on (by
    default torch's, found from the tensors); the copies of a submit start after what is
    queued there.
    """

    # One end event per segment: sealing overlaps the DMA of later segments, and several
    # threads seal at once to keep up with it.
    segment_bytes = 32 << 20
    segment_threads = 4

    def __init__(
        self, kv_tensors: Sequence[torch.Tensor], pinned: PinnedRegion, device: TorchCudaDevice | None = None
    ):
        self._model_device = TorchCudaDevice(kv_tensors) if device is None else device
        cupy = pinned.cupy
        self._cupy = cupy
        self._device = cupy.cuda.Device(self._model_device.index)
        with self._device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._tensors = list(kv_tensors)  # keeps the memory behind the pointers alive
        self._kv_ptrs = np.array([t.data_ptr() for t in kv_tensors], dtype=np.int64)
        self._pinned = pinned
        self.piece_bytes = pinned.piece_bytes
        pinned.attach()

    def submit(self, plan: CopyPlan, to_pool: bool) -> list[CopyTicket]:
        cuda = self._cupy.cuda
        memcpy_async = cuda.runtime.memcpyAsync
        with self._device:
            # Stores read KV the model writes on torch's stream; loads overwrite blocks that
            # earlier work on it may still touch. Either way, start after what is queued there.
            queued = cuda.Event(disable_timing=True)
            queued.record(cuda.ExternalStream(self._model_device.current_stream(), self._device.id))
            self._stream.wait_event(queued)
            gpu = (self._kv_ptrs[plan.tensor_idx] + plan.tensor_offset).tolist()
            host = (self._pinned.address + plan.pool_offset).tolist()
            dst, src, kind = (
                (host, gpu, cuda.runtime.memcpyDeviceToHost) if to_pool else (gpu, host, cuda.runtime.memcpyHostToDevice)
            )
            nbytes = plan.nbytes.tolist()
            stream = self._stream.ptr
            bounds = plan.run_bounds.tolist()
            tickets: list[CopyTicket] = []
            for lo, hi in zip(bounds, bounds[1:]):
                for i in range(lo, hi):
                    memcpy_async(dst[i], src[i], nbytes[i], kind, stream)
                done = cuda.Event(block=True, disable_timing=True)
                done.record(self._stream)
                tickets.append(_EventTicket(done))
        return tickets

    def close(self) -> None:
        self._stream.synchronize()
        self._pinned.detach()
        self._tensors.clear()
