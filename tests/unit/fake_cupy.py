"""A stand-in for the CuPy calls distkv's CUDA backend makes (distkv/storage/handlers/cuda.py).

It models what distkv relies on from CUDA, and no more:
- hostRegister pins a host range, hostUnregister releases it; a range is registered at
  most once and only a registered range can be released (CUDA fails otherwise).
- memcpyAsync queues a copy on a stream. Device memory is host memory here (CPU tensors
  stand for the KV cache), so a copy is a memmove.
- A stream runs its work in order, when the device chooses: here as late as CUDA
  allows, so that the host sees bytes only where it waited for them. A stream's work
  runs when the host synchronizes with it (the stream, or an event recorded on it) or
  when another stream's work reaches a wait on one of its events.
- An event recorded on a stream completes once what was queued there before the record
  has run; a stream waiting on it runs nothing queued after the wait before that.
  Events and streams belong to the device current when they are made; an event is
  recorded only on a stream of its device.

Every call is appended to `calls`, in the order the host made it, so that tests can
check order and pairing.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace

MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2


class CudaError(RuntimeError):
    pass


class _Op:
    """One piece of a stream's work."""

    def __init__(self, run: Callable[[], None]):
        self._run = run
        self.done = False

    def run(self) -> None:
        self._run()
        self.done = True


class FakeStream:
    def __init__(self, cuda: FakeCuda, non_blocking: bool = False):
        self.ptr = next(cuda.handles)
        self.non_blocking = non_blocking
        self.device = cuda.current_device
        self._cuda = cuda
        self._queue: deque[_Op] = deque()
        cuda.streams[self.ptr] = self

    def wait_event(self, event: FakeEvent) -> None:
        self._cuda.call("wait_event", self, event)
        recorded = event.recorded  # what the event stands for now, not at a later record
        self.enqueue(lambda: recorded and recorded[0].run_through(recorded[1]))

    def synchronize(self) -> None:
        self._cuda.call("synchronize", self)
        with self._cuda.lock:
            if self._queue:
                self.run_through(self._queue[-1])

    def launch_host_func(self, fn: Callable[[], None]) -> None:
        """Work of the model's (a kernel): runs fn in stream order."""
        self.enqueue(fn)

    def enqueue(self, fn: Callable[[], None]) -> _Op:
        op = _Op(fn)
        with self._cuda.lock:
            self._queue.append(op)
        return op

    def run_through(self, op: _Op) -> None:
        with self._cuda.lock:
            while not op.done:
                self._queue.popleft().run()

    @property
    def idle(self) -> bool:
        return not self._queue


class FakeEvent:
    def __init__(self, cuda: FakeCuda, block: bool = False, disable_timing: bool = False):
        self.block = block
        self.disable_timing = disable_timing
        self.device = cuda.current_device
        self.recorded: tuple[FakeStream, _Op] | None = None
        self._cuda = cuda

    def record(self, stream: FakeStream) -> None:
        self._cuda.call("record", self, stream)
        if stream.device != self.device:
            raise CudaError(f"event of device {self.device} recorded on a stream of device {stream.device}")
        self.recorded = (stream, stream.enqueue(lambda: None))

    def synchronize(self) -> None:
        self._cuda.call("synchronize", self)
        if self.recorded is not None:
            self.recorded[0].run_through(self.recorded[1])


class FakeDevice:
    def __init__(self, cuda: FakeCuda, device_id: int):
        self.id = device_id
        self._cuda = cuda
        self._previous: list[int] = []

    def __enter__(self) -> FakeDevice:
        self._previous.append(self._cuda.current_device)
        self._cuda.current_device = self.id
        return self

    def __exit__(self, *exc) -> None:
        self._cuda.current_device = self._previous.pop()


class FakeRuntime:
    memcpyHostToDevice = MEMCPY_HOST_TO_DEVICE
    memcpyDeviceToHost = MEMCPY_DEVICE_TO_HOST

    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def hostRegister(self, address: int, size: int, flags: int) -> None:
        self._cuda.call("hostRegister", address, size, flags)
        registered = self._cuda.registered
        if any(a < address + size and address < a + n for a, n in registered.items()):
            raise CudaError("cudaErrorHostMemoryAlreadyRegistered")
        registered[address] = size

    def hostUnregister(self, address: int) -> None:
        self._cuda.call("hostUnregister", address)
        if self._cuda.registered.pop(address, None) is None:
            raise CudaError("cudaErrorHostMemoryNotRegistered")

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._cuda.call("memcpyAsync", dst, src, size, kind, stream)
        if kind not in (MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST):
            raise CudaError(f"cudaErrorInvalidMemcpyDirection: {kind}")
        self._cuda.streams[stream].enqueue(lambda: ctypes.memmove(dst, src, size))


class FakeCuda:
    """Stands for `cupy.cuda`: `.cupy` is the module to hand to distkv."""

    def __init__(self):
        self.lock = threading.RLock()
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}  # address -> size
        self.streams: dict[int, FakeStream] = {}  # ptr -> stream
        self.handles = itertools.count(0x1000)
        self.current_device = 0
        self.runtime = FakeRuntime(self)
        self.cupy = SimpleNamespace(cuda=self)

    def call(self, name: str, *args) -> None:
        with self.lock:
            self.calls.append((name, *args))

    def Device(self, device_id: int) -> FakeDevice:  # noqa: N802 (CuPy's names)
        return FakeDevice(self, device_id)

    def Stream(self, non_blocking: bool = False) -> FakeStream:  # noqa: N802
        return FakeStream(self, non_blocking)

    def Event(self, block: bool = False, disable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self, block, disable_timing)

    def ExternalStream(self, ptr: int, device_id: int) -> FakeStream:  # noqa: N802
        stream = self.streams[ptr]
        if stream.device != device_id:
            raise CudaError(f"stream {ptr:#x} is on device {stream.device}, not {device_id}")
        return stream


class FakeTorchDevice:
    """Stands for distkv's TorchCudaDevice: device `index`, the model's work on `stream`."""

    def __init__(self, cuda: FakeCuda, index: int):
        self.index = index
        with cuda.Device(index):
            self.stream = cuda.Stream()

    def current_stream(self) -> int:
        return self.stream.ptr
