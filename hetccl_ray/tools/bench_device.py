"""hetccl-bench's device mode (``--device cuda`` or ``emu``): the rank's buffers in device
memory, each call timed until the device has done it (the slowest rank's), the staging bound
(pinned host <-> device copies, measured on the rank's own device), and Ray's backends run
as a CPU library must be on device data: copied out, run on host copies, copied back.

``emu`` is the emulated stream-ordered device (devices.py's named FAKE): the same code paths
on a machine without a GPU, where its numbers mean nothing.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from hetccl_ray.memory import devices

DEVICES = ("cpu", "cuda", "emu")


def prepare(device: str) -> None:
    """In the rank's actor, before its buffers are made: the emulated device for ``emu``."""
    if device == "emu":
        devices.emulate()


def moved(device: str, value: Any) -> Any:
    """``value`` (a tensor, a list of them, or None) in ``device``'s memory."""
    if isinstance(value, list):
        return [moved(device, v) for v in value]
    if value is None or device != "cuda":  # the emulated device's memory is this process's CPU tensors
        return value
    return value.to("cuda")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, list) else []


def finished(device: str, x: Any) -> None:
    """The host waits until the device has done what was queued so far (on ``x``'s device)."""
    if device != "cpu":
        devices.synchronize(_tensors(x)[0])


def step(device: str, host_library: bool, make_step: Callable[[Any, Any], Callable[[], None]], x: Any,
         out: Any) -> Callable[[], None]:
    """One timed call on the buffers ``x``/``out``: it returns once the device has done it. A
    host library (``host_library``: Ray's gloo) runs on host copies of device buffers: each
    call copies them down, runs ``make_step``'s call on those, and copies the results back up."""
    if device == "cpu":
        return make_step(x, out)
    host_x, host_out = (_host_copy(x), _host_copy(out)) if host_library else (x, out)
    call = make_step(host_x, host_out)
    pairs = list(zip(_tensors(x), _tensors(host_x))) + list(zip(_tensors(out), _tensors(host_out)))
    pairs = [(dev, host) for dev, host in pairs if host is not dev]

    def timed() -> None:
        for dev, host in pairs:
            host.copy_(dev)  # synchronous: the host library reads the copy next
        call()
        for dev, host in pairs:
            dev.copy_(host)
        finished(device, x)

    return timed


def _host_copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    return None if value is None else torch.empty(value.shape, dtype=value.dtype)


def staging_seconds(device: str, nbytes: int, repeats: int = 3) -> float:
    """The staging bound of ``nbytes``: one copy device -> pinned host and one back, the
    fastest of ``repeats`` (0 for host memory)."""
    if device == "cpu" or nbytes == 0:
        return 0.0
    dev = moved(device, torch.empty(nbytes, dtype=torch.uint8))
    owner = devices.of(dev)
    host = owner.host_buffer(nbytes)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        owner.launch(None, devices.stage_out, host, dev)
        owner.launch(None, devices.land, dev, host, None)
        devices.synchronize(dev)
        best = min(best, time.perf_counter() - started)
    return best
