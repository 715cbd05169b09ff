"""The floor table of RESULTS.md from `hetccl-bench --vs gloo --csv` runs: per op and floor size,
each run's gloo time / hetccl time (with the plan hetccl took), the median over runs, and
for shaped runs each cell's time over the link bound.

    python benchmarks/floor_table.py "2x2=benchmarks/floors_22_r*.csv" "1+2+3=benchmarks/floors_123_r*.csv"
"""

from __future__ import annotations

import glob
import statistics
import sys

import pandas as pd

FLOOR_SIZES = (1024, 65536, 1 << 20, 16 << 20)


def _cell(frame: pd.DataFrame, op: str, size: int):
    """hetccl's row of ``op`` nearest ``size`` (a chunked op's size is rounded to whole chunks
    per rank: 1,008 B on 6 ranks for 1 KiB), None where the run has none within 10%."""
    rows = frame[(frame.op == op) & (frame.backend == "hetccl")]
    if not len(rows):
        return None
    row = rows.iloc[(rows["size"] - size).abs().argmin()]
    return row if abs(row["size"] - size) <= size // 10 else None


def table(layouts: dict[str, list[str]], sizes: tuple[int, ...] = FLOOR_SIZES) -> list[str]:
    """Markdown lines: one row per op and size, one column group per layout."""
    runs = {name: [pd.read_csv(path) for path in sorted(paths)] for name, paths in layouts.items()}
    head = "| op | size (B) | " + " | ".join(f"{name}: {len(frames)} runs | median" for name, frames in runs.items())
    lines = [head + " |", "|---|---:|" + "---|---:|" * len(runs)]
    under = dict.fromkeys(runs, 0)
    ops = list(dict.fromkeys(next(iter(runs.values()))[0]["op"]))
    for op in ops:
        for size in sizes:
            cells = []
            for name, frames in runs.items():
                rows = [_cell(f, op, size) for f in frames]
                rows = [r for r in rows if r is not None]
                if not rows:
                    cells += ["-", "-"]
                    continue
                ratios = [r.hetccl_vs_gloo for r in rows]
                median = statistics.median(ratios)
                under[name] += median < 1.0
                cells += [" / ".join(f"{v:.2f}" for v in ratios) + f" ({rows[0].plan})",
                          f"**{median:.2f}**" if median < 1.0 else f"{median:.2f}"]
            if any(c != "-" for c in cells):
                lines.append(f"| {op} | {size:,} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("; ".join(f"{name}: {count} of the cells' medians under 1.0" for name, count in under.items()))
    return lines


def main(argv: list[str]) -> None:
    layouts = {}
    for arg in argv:
        name, pattern = arg.split("=", 1)
        layouts[name] = glob.glob(pattern)
    print("\n".join(table(layouts)))


if __name__ == "__main__":
    main(sys.argv[1:])
