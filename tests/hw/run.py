"""The hardware suite in one command, with a table of what ran, passed or skipped and why:

    .venv/bin/python tests/hw/run.py
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


def main() -> int:
    table = _Table()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-s", str(HERE)], plugins=[table])
    print(f"\n# hetccl_ray hardware suite on {platform.node()} at {time.strftime('%Y-%m-%d %H:%M')}")
    width = max((len(name) for name, _, _ in table.rows), default=10)
    for name, outcome, detail in table.rows:
        print(f"{name:<{width}}  {outcome:<8} {detail}")
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
