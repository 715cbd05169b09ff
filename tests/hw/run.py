"""The hardware suite in one command, with a table of what ran, passed or skipped and why:

    .venv/bin/python tests/hw/run.py

On a lent GPU machine (no Ray there): `bash tests/hw/wheels.sh` here, then device run
`bash tests/hw/lease.sh` (everything a lease should tell, under 8 minutes) or
`bash tests/hw/device.sh` carrying `.whl`.

It says what the machine has first, then runs tests/hw (under 8 minutes on one GPU).
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))


class _Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome == "skipped" or (report.when == "setup" and report.failed):
            detail = ""
            if report.skipped and isinstance(report.longrepr, tuple):
                detail = report.longrepr[2].removeprefix("Skipped: ")
            elif report.failed:
                detail = str(report.longrepr).strip().splitlines()[-1][:100]
            elif report.capstdout:
                detail = report.capstdout.strip().splitlines()[-1]
            self.rows.append((report.nodeid.split("::")[-1], report.outcome, detail))


def describe_machine() -> list[str]:
    """What the machine has, for the first lines: GPUs, torch and its collective libraries, NICs."""
    import torch
    import torch.distributed as dist

    from hetccl_ray.transport import verbs

    lines = [f"host {platform.node()}, {platform.machine()}, python {platform.python_version()}, torch "
             f"{torch.__version__} (cuda {torch.version.cuda}, hip {getattr(torch.version, 'hip', None)})"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        lines.append(f"GPUs: {names}; NCCL/RCCL {nccl}")
    else:
        lines.append("GPUs: none visible to torch")
    found = verbs.discover()
    lines.append(f"RDMA ports: {[(p.device, p.port, p.link_layer) for p in found.ports] or found.why}")
    return lines


def main() -> int:
    for line in describe_machine():
        print(line, flush=True)
    table = _Table()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-s", str(HERE)], plugins=[table])
    print(f"\n# hetccl_ray hardware suite on {platform.node()} at {time.strftime('%Y-%m-%d %H:%M')}")
    width = max((len(name) for name, _, _ in table.rows), default=10)
    for name, outcome, detail in table.rows:
        print(f"{name:<{width}}  {outcome:<8} {detail}")
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
