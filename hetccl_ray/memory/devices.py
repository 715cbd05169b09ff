"""Device mechanics in one place: streams, events, launches, host staging, the island library.

Plans, the small round and the transports never call ``torch.cuda``; they ask a
:class:`Device` for the stream an op runs on, to launch device work on it, to wait for it
before the host touches device memory, and for pinned host buffers. The ordering rule of
every op on device tensors (as NCCL's process group): its side stream waits for the
caller's current stream at entry (an event, no host block), device work of the op is
launched on the side stream, the host waits for that stream's event before a border step
reads or writes device memory, and at exit the caller's stream waits for the op's last
event. No device-wide synchronize anywhere.

Three kinds:

- :class:`HostDevice` (``cpu``): no streams; a launch runs at once.
- :class:`TorchDevice` (``cuda``/ROCm, ``xpu``, any device type torch's generic
  ``torch.Stream``/``torch.Event`` serve): the real thing, what ``tests/hw`` runs.
- :class:`EmulatedDevice` (``emu``), a named FAKE for CI on machines without a GPU: CPU
  tensors of a process that called :func:`emulate` stand for device memory, and every
  launch completes later, in order, on its stream's own thread (after a delay), so code
  that forgets a wait reads stale bytes and a test fails. Its island library is Gloo,
  standing in for NCCL/RCCL.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from hetccl_ray.errors import HetCCLError, HetCCLInputError, HetCCLTimeoutError
from hetccl_ray.memory import buffers

# device classes as carried in call rows (calls.py): index = code
KINDS = ("cpu", "emu", "cuda", "xpu", "hpu", "npu", "mps", "other")
_POLL_S = (20e-6, 1e-3)  # an event wait polls from 20 us, backing off to 1 ms (no GIL held between)


class EventLike:
    """What an event offers: whether its stream has reached it, and a host wait for that."""

    def query(self) -> bool: ...
    def synchronize(self, deadline: float, what: str) -> None: ...


class StreamLike:
    """What a stream offers: record an event at its end; wait (on the device) for an event."""

    def record(self) -> EventLike: ...
    def wait(self, event: EventLike) -> None: ...


class HostFlag(EventLike):
    """Set by the host once the work it stands for is done on the device. A stream can be made
    to wait for it (:meth:`Device.wait_for_host`) before that work is even launched: what an
    op's ``Work.wait()`` gives the caller's stream while the op still runs on the host."""

    def __init__(self) -> None:
        self._set = threading.Event()

    def set(self) -> None:
        self._set.set()

    def query(self) -> bool:
        return self._set.is_set()

    def synchronize(self, deadline: float, what: str) -> None:
        if not self._set.wait(max(deadline - time.monotonic(), 0.0)):
            raise HetCCLTimeoutError(f"{what}: not done before the deadline")


class Device:
    """One kind of device memory and how work on it is ordered."""

    kind = "cpu"
    shares_host_memory = False  # whether an island of one host runs its ops in shared memory (shm.py)
    host = True  # the host reads and writes its memory directly, with nothing to wait for
    # torch ops the host issues on this memory are themselves stream-ordered (kernels on the
    # current stream); where not (the emulated device runs them at once), a waiter blocks
    ordered_host_ops = True

    @property
    def code(self) -> int:
        """The device class in call rows: ranks of one island must agree on it."""
        return KINDS.index(self.kind) if self.kind in KINDS else KINDS.index("other")

    @property
    def island_backend(self) -> str:
        """The vendor collective library inside an island of this device."""
        return "gloo"

    def current_stream(self) -> Optional[StreamLike]:
        return None

    def new_stream(self) -> Optional[StreamLike]:
        return None

    def launch(self, stream: Optional[StreamLike], fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` as device work ordered on ``stream``."""
        fn(*args)

    def host_wait(self, stream: Optional[StreamLike], deadline: float, what: str) -> None:
        """Block the host until ``stream`` has done everything launched on it so far."""

    def capturing(self) -> bool:
        """Whether the current stream is capturing a graph (CUDA graphs): an op cannot run then,
        as its host waits for the device in the middle of it."""
        return False

    def refuse_capture(self, what: str) -> None:
        """Raise, naming ``what``, while the calling thread's stream is capturing a graph."""
        if self.capturing():
            raise HetCCLInputError(f"{what}: the current {self.kind} stream is capturing a graph; hetccl ops "
                                   "wait on the host in the middle (border transfers), so run them outside the "
                                   "captured region")

    def wait_for_host(self, stream: Optional[StreamLike], flag: HostFlag, timeout_s: float) -> bool:
        """Make ``stream`` wait (on the device, the host not blocked) until ``flag`` is set, or
        ``timeout_s`` passed; False where this device cannot (the caller waits on the host)."""
        return False

    @contextlib.contextmanager
    def using(self, stream: Optional[StreamLike]) -> Iterator[None]:
        """Make ``stream`` current on this thread (kernels the host starts go there)."""
        yield

    @contextlib.contextmanager
    def ordered(self, side: Optional[StreamLike]) -> Iterator[None]:
        """An op on its side stream ``side`` (None on host memory: nothing to order): it waits
        for the caller's current stream at entry (an event, no host block), is current
        meanwhile, and the caller's stream waits for it at exit."""
        if side is None:
            yield
            return
        caller = self.current_stream()
        side.wait(caller.record())
        try:
            with self.using(side):
                yield
        finally:
            caller.wait(side.record())

    def mark(self) -> Optional[EventLike]:
        """An event at the end of the current stream (None on host memory: nothing to wait for)."""
        stream = self.current_stream()
        return stream.record() if stream is not None else None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory for staging (pinned where the device copies from it faster)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of this device's memory."""
        return torch.empty(nbytes, dtype=torch.uint8)


def stage_out(host: torch.Tensor, buf: torch.Tensor) -> None:
    """Device work: ``buf``'s bytes into the host buffer ``host`` (of its dtype and size)."""
    host.copy_(buf, non_blocking=True)


def land(out: torch.Tensor, part: torch.Tensor, op: Optional[str]) -> None:
    """Device work: ``part`` (host or device memory) into ``out``, copied, or folded with ``op``."""
    part = part.to(out.device, non_blocking=True)
    if op is None:
        buffers.copy(out, part)
    else:
        buffers.combine(out, part, op)


class HostDevice(Device):
    """CPU tensors: every launch runs now, every wait returns at once."""

    shares_host_memory = True  # ranks of an island on one host take a shared-memory island library


def _wait_polling(done: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll ``done`` until it holds or the deadline passes (sleeping between polls)."""
    pause = _POLL_S[0]
    while not done():
        if time.monotonic() >= deadline:
            raise HetCCLTimeoutError(f"{what}: the device did not reach the event before the deadline")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])


class _TorchEvent(EventLike):
    def __init__(self, event: "torch.Event") -> None:
        self.event = event

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self, deadline: float, what: str) -> None:
        _wait_polling(self.query, deadline, what)


class _TorchStream(StreamLike):
    def __init__(self, stream: "torch.Stream") -> None:
        self.stream = stream

    def record(self) -> EventLike:
        return _TorchEvent(self.stream.record_event())

    def wait(self, event: EventLike) -> None:
        self.stream.wait_event(event.event)


class TorchDevice(Device):
    """A torch accelerator (``cuda`` on NVIDIA and ROCm, ``xpu``, ...): its own streams and events."""

    host = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = device.type
        self._module = torch.get_device_module(device.type)

    @property
    def island_backend(self) -> str:
        import torch.distributed as dist

        backend = dist.Backend.default_device_backend_map.get(self.kind)
        if backend is None:
            raise HetCCLError(f"no collective library for {self.kind} tensors: torch {torch.__version__} maps "
                              f"{dict(dist.Backend.default_device_backend_map)}; install the {self.kind} plugin "
                              "that registers one")
        return "rccl" if backend == "nccl" and getattr(torch.version, "hip", None) else backend

    def current_stream(self) -> StreamLike:
        return _TorchStream(self._module.current_stream(self.device))

    def new_stream(self) -> StreamLike:
        return _TorchStream(self._module.Stream(self.device))

    def launch(self, stream: Optional[StreamLike], fn: Callable[..., Any], *args: Any) -> None:
        with self.using(stream):
            fn(*args)

    def host_wait(self, stream: Optional[StreamLike], deadline: float, what: str) -> None:
        if stream is not None:
            stream.record().synchronize(deadline, what)

    def capturing(self) -> bool:
        capturing = getattr(self._module, "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    def wait_for_host(self, stream: Optional[StreamLike], flag: HostFlag, timeout_s: float) -> bool:
        """On CUDA, a host function on the stream (the driver's ``cuLaunchHostFunc``) that
        returns once ``flag`` is set: it makes no CUDA call, as host functions must not."""
        if stream is None or self.kind != "cuda" or getattr(torch.version, "hip", None):
            return False
        return _launch_host_function(stream.stream.cuda_stream, lambda: flag._set.wait(timeout_s))

    @contextlib.contextmanager
    def using(self, stream: Optional[StreamLike]) -> Iterator[None]:
        with self._module.device(self.device):  # also gives a bare thread the device's context
            if stream is None:
                yield
                return
            with self._module.stream(stream.stream):
                yield

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


# -- the emulated stream-ordered device (a named FAKE) ---------------------------------------------

class EmulatedEvent(EventLike):
    """Completes when its stream's thread reaches it; carries that stream's first error."""

    def __init__(self, stream: Optional["EmulatedStream"] = None) -> None:
        self._reached = threading.Event()
        self._stream = stream
        if stream is None:
            self._reached.set()  # never recorded: complete, as a fresh CUDA event

    def query(self) -> bool:
        return self._reached.is_set()

    def synchronize(self, deadline: float, what: str) -> None:
        if not self._reached.wait(max(deadline - time.monotonic(), 0.0)):
            raise HetCCLTimeoutError(f"{what}: the emulated device did not reach the event before the deadline")
        if self._stream is not None and self._stream.error is not None:
            raise HetCCLError(f"{what}: device work failed: {self._stream.error}") from self._stream.error


class EmulatedStream(StreamLike):
    """Work runs in launch order on this stream's own thread, ``delay_s`` after it is its turn."""

    _WAIT_LIMIT_S = 600.0  # a stream waiting on an event nobody records gives up (never hangs)

    def __init__(self, delay_s: float, name: str) -> None:
        self.delay_s = delay_s
        self.error: Optional[BaseException] = None
        self._work: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"hetccl-emu-{name}")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._work.get()
            if self.delay_s:
                time.sleep(self.delay_s)
            try:
                item()
            except BaseException as exc:  # noqa: BLE001 - device work fails the stream, as a CUDA error
                self.error = self.error or exc

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        self._work.put(lambda: None if self.error is not None else fn(*args))

    def record(self) -> EmulatedEvent:
        event = EmulatedEvent(self)
        self._work.put(event._reached.set)
        return event

    def wait(self, event: EventLike) -> None:
        def block() -> None:
            reached = event._reached if isinstance(event, EmulatedEvent) else event._set
            if not reached.wait(self._WAIT_LIMIT_S):
                raise HetCCLTimeoutError("an emulated stream waited over 600 s for an event")
        self._work.put(block)


class EmulatedDevice(Device):
    """FAKE device for CI: this process's CPU tensors stand for device memory whose work is
    stream-ordered and completes late (see the module docstring). Gloo stands in for NCCL."""

    kind = "emu"
    host = False
    ordered_host_ops = False  # torch ops on its (CPU) tensors run at once, outside stream order
    capture = False  # a FAKE graph capture on the current stream (tests set it)

    def capturing(self) -> bool:
        return self.capture

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.default = EmulatedStream(delay_s, "default")
        self._current = threading.local()
        self._host: dict[int, int] = {}  # host buffers (their storage's address: size), not device memory

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory: what :func:`of` tells from the emulated device's (every other CPU tensor
        of this process), so host staging is seen as host memory, as a pinned buffer is."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        storage = buf.untyped_storage()  # one Python object per storage, alive while any view is
        with _lock:
            self._host[storage.data_ptr()] = nbytes
        weakref.finalize(storage, self._host.pop, storage.data_ptr(), None)
        return buf

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a CPU tensor) is emulated device memory, not a host buffer."""
        return not self._host or tensor.untyped_storage().data_ptr() not in self._host

    def current_stream(self) -> EmulatedStream:
        return getattr(self._current, "stream", None) or self.default

    def new_stream(self) -> EmulatedStream:
        return EmulatedStream(self.delay_s, "side")

    def launch(self, stream: Optional[StreamLike], fn: Callable[..., Any], *args: Any) -> None:
        (stream or self.current_stream()).launch(fn, *args)

    def host_wait(self, stream: Optional[StreamLike], deadline: float, what: str) -> None:
        (stream or self.current_stream()).record().synchronize(deadline, what)

    def wait_for_host(self, stream: Optional[StreamLike], flag: HostFlag, timeout_s: float) -> bool:
        (stream or self.current_stream()).wait(flag)
        return True

    @contextlib.contextmanager
    def using(self, stream: Optional[StreamLike]) -> Iterator[None]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream or before
        try:
            yield
        finally:
            self._current.stream = before


_host_functions: set = set()  # callbacks the driver holds until they ran


def _launch_host_function(stream_handle: int, fn: Callable[[], Any]) -> bool:
    """Queue ``fn`` on a CUDA stream (the driver API's ``cuLaunchHostFunc``, which takes the
    runtime's stream handles); False where the driver offers no such call."""
    import ctypes

    try:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    except (OSError, AttributeError):
        return False

    def run(_: Any) -> None:
        try:
            fn()
        finally:
            _host_functions.discard(callback)

    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(run)
    _host_functions.add(callback)
    if launch(ctypes.c_void_p(stream_handle), callback, None) != 0:
        _host_functions.discard(callback)
        return False
    return True


HOST = HostDevice()
_emulated: Optional[EmulatedDevice] = None
_environment_read = False
_torch_devices: dict[torch.device, TorchDevice] = {}
_lock = threading.Lock()


def emulate(delay_s: float = 0.002) -> EmulatedDevice:
    """Make this process's CPU tensors emulated-device tensors (tests, CI); returns the device."""
    global _emulated
    with _lock:
        if _emulated is None:
            _emulated = EmulatedDevice(delay_s)
        return _emulated


def emulated() -> Optional[EmulatedDevice]:
    """The emulated device, when this process uses one (``emulate()``, or ``HETCCL_EMULATED_DEVICE``
    as it was at the first lookup: every op looks, and reading the environment cost a microsecond)."""
    global _environment_read
    if not _environment_read:
        _environment_read = True
        if _emulated is None and os.environ.get("HETCCL_EMULATED_DEVICE"):
            emulate(float(os.environ["HETCCL_EMULATED_DEVICE"]))
    return _emulated


def of(tensor: torch.Tensor) -> Device:
    """The device that owns ``tensor``'s memory."""
    if tensor.device.type == "cpu":
        emu = emulated()
        return emu if emu is not None and emu.owns(tensor) else HOST
    with _lock:
        if tensor.device not in _torch_devices:
            _torch_devices[tensor.device] = TorchDevice(tensor.device)
        return _torch_devices[tensor.device]


def synchronize(tensor: torch.Tensor, timeout_s: float = 300.0) -> None:
    """Block the host until the work on ``tensor``'s current stream so far is done (the host may
    then read it): what a caller does before reading a device result on the host."""
    device = of(tensor)
    device.host_wait(device.current_stream(), time.monotonic() + timeout_s, f"synchronize {tensor.device}")


def accelerator_numa_node() -> Optional[int]:
    """The NUMA node of this process's current GPU, from sysfs (None where unknown)."""
    try:
        bus = torch.cuda.get_device_properties(torch.cuda.current_device()).pci_bus_id.lower()
        return int(open(f"/sys/bus/pci/devices/{bus}/numa_node").read())
    except (AttributeError, AssertionError, OSError, RuntimeError, ValueError):
        return None


def local_accelerator() -> Optional[str]:
    """The vendor of the accelerator this process drives, if any (amd on a ROCm torch)."""
    if getattr(torch.version, "hip", None):
        return "amd"
    try:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    except RuntimeError:
        return None
    if accelerator is None:
        return None
    return {"cuda": "nvidia", "xpu": "intel"}.get(accelerator.type, accelerator.type)
