"""The emulated stream-ordered device alone (devices.py's named FAKE): late completion,
ordering, events and errors, so the cluster tests built on it can trust it."""

from __future__ import annotations

import time

import pytest
import torch

from hetccl_ray.memory import devices
from hetccl_ray.errors import HetCCLError, HetCCLTimeoutError


@pytest.fixture
def emu():
    return devices.EmulatedDevice(delay_s=0.02)


def test_launches_complete_late_and_in_order(emu):
    x = torch.zeros(4)
    emu.launch(None, x.fill_, 1.0)
    emu.launch(None, x.mul_, 3.0)
    assert x.sum().item() == 0.0  # the host did not wait: the work has not run yet
    emu.host_wait(None, time.monotonic() + 5, "test")
    assert torch.equal(x, torch.full((4,), 3.0))


def test_stream_waits_for_event_of_another_stream(emu):
    side, x, seen = emu.new_stream(), torch.zeros(1), []
    emu.launch(None, x.fill_, 7.0)
    side.wait(emu.current_stream().record())
    side.launch(lambda: seen.append(x.item()))
    side.record().synchronize(time.monotonic() + 5, "test")
    assert seen == [7.0]


def test_without_the_wait_a_reader_sees_stale_bytes(emu):
    side, x, seen = emu.new_stream(), torch.zeros(1), []
    emu.launch(None, time.sleep, 0.3)  # a long kernel before the write
    emu.launch(None, x.fill_, 7.0)
    side.launch(lambda: seen.append(x.item()))  # no wait: runs beside the writer
    side.record().synchronize(time.monotonic() + 5, "test")
    assert seen == [0.0]


def test_using_makes_a_stream_current_on_this_thread(emu):
    side = emu.new_stream()
    with emu.using(side):
        assert emu.current_stream() is side
    assert emu.current_stream() is emu.default


def test_failed_work_fails_the_event_and_deadlines_hold(emu):
    stream = emu.new_stream()
    stream.launch(lambda: 1 / 0)
    with pytest.raises(HetCCLError, match="device work failed"):
        stream.record().synchronize(time.monotonic() + 5, "test")
    slow = devices.EmulatedDevice(delay_s=1.0)
    slow.launch(None, lambda: None)
    with pytest.raises(HetCCLTimeoutError, match="did not reach the event"):
        slow.host_wait(None, time.monotonic() + 0.05, "test")


def test_host_device_and_classes():
    assert devices.of(torch.zeros(1)).host  # no emulate() in the test process
    assert devices.HOST.code == devices.KINDS.index("cpu")
    assert devices.EmulatedDevice(0).code == devices.KINDS.index("emu")
    assert devices.EmulatedDevice(0).island_backend == "gloo"  # Gloo stands in for NCCL
