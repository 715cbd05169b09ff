"""A simulated slow island: a Ray node's processes under a cgroup CPU quota.

The slowdown is real CPU time taken away by the kernel (cgroup v2 ``cpu.max`` or v1
``cpu.cfs_quota_us``), not a sleep in the model code. Needs root and a writable cgroup
CPU controller; :func:`unavailable` says why not where it is missing. Used by LocalCluster
for the balanced-training tests, example and benchmark.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # short periods: a throttled rank runs in small slices, not 50 ms bursts


def _root() -> tuple[Optional[Path], int]:
    """The cgroup folder to make groups in and its version, or (None, 0)."""
    controllers = _V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return _V2, 2
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1, 1
    return None, 0


def unavailable() -> Optional[str]:
    """Why CPU quotas cannot be set here, or None when they can."""
    root, _ = _root()
    if root is None:
        return "no cgroup CPU controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us) on this machine"
    if not os.access(root, os.W_OK):
        return f"cgroup CPU controller at {root} is not writable (needs root)"
    return None


def pin(pid: int, cores: list[int]) -> None:
    """Run process ``pid`` and the processes it has started on ``cores`` only (processes it
    starts later inherit the affinity): a simulated island that owns its cores."""
    import psutil

    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        process.cpu_affinity(cores)


class CpuQuota:
    """One cgroup whose processes share ``cores`` CPUs' worth of time (None: no limit)."""

    def __init__(self, name: str) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot simulate a slow island: {why}")
        root, self.version = _root()
        self.path = root / f"hetccl-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        if self.version == 2:  # a v2 group's own processes need the parent to delegate cpu
            (root / "cgroup.subtree_control").write_text("+cpu")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group; its later children follow."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def set(self, cores: Optional[float]) -> None:
        """Limit the group to ``cores`` CPUs of time per period, or lift the limit (None)."""
        if cores is not None and cores <= 0:
            raise ValueError(f"a CPU quota of {cores} cores: must be positive")
        quota = int(cores * PERIOD_US) if cores is not None else None
        if self.version == 2:
            (self.path / "cpu.max").write_text(f"{quota if quota else 'max'} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota if quota else -1))

    def close(self) -> None:
        """Move any process still inside back to the parent group and remove the group."""
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.path.parent / "cgroup.procs").write_text(pid)
            except OSError:  # exited meanwhile
                pass
        self.path.rmdir()
