"""Print a collective's plan without a cluster (all-to-all's too): its steps per rank, bytes
per link, border bytes against the bound.

    python -m hetccl_ray.tools.show_plan --layout 1,2,3 --interleave --op allreduce --size 16M [--steps]

The layout as ``hetccl-bench`` takes it (``hetccl-bench --explain`` prints the same).
"""

from __future__ import annotations

import argparse
import re
from typing import Optional, Sequence

from hetccl_ray.core import rounds, routes, plans
from hetccl_ray.core.opkinds import ROUND_OPS, kind, largest_region, pieces as piece_count
from hetccl_ray.core.topology import Topology

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1}
OPS = (*ROUND_OPS, "alltoall")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"128M"``, ``"1G"`` -> bytes."""
    match = re.fullmatch(r"(\d+)([KMG]?)B?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 8, 64K, 128M, 1G")
    return int(match[1]) * _UNITS[match[2]]


def explain(topo: Topology, op: str, nbytes: int, itemsize: int = 4, root: int = 0,
            piece_bytes: Optional[int] = 4 << 20, steps: bool = False) -> list[str]:
    """Lines describing ``op`` on a buffer of ``nbytes`` (nccl-tests' size; all-to-all: each
    rank's input, S/n to every rank): the plan's pieces, bytes per cross-island link and in
    all against the bound, the small round's border bytes; with ``steps``, every rank's steps."""
    world, op_kind = topo.world_size, kind(op)
    unit = itemsize * (world if op_kind.chunked else 1)
    n = max(nbytes // unit, 1) * unit // itemsize
    size = n * itemsize
    if op == "alltoall":  # the routes of device buffers (host blocks go straight: the same border bytes)
        counts = ((n // world,) * world,) * world
        pieces = piece_count(routes.largest_crossing(topo, counts) * itemsize, piece_bytes)
        built = [routes.plan(topo, r, counts, pieces, True) for r in range(world)]
    else:
        pieces = piece_count(largest_region(topo, op, n) * itemsize, piece_bytes)
        built = [plans.build(topo, r, op, n, root, pieces) for r in range(world)]
    bound = op_kind.bound(topo, size)
    sent = sum(sum(p.sent(topo).values()) for p in built) * itemsize
    lines = [topo.describe(), f"{op} of {size:,} B ({n:,} elements of {itemsize} B)"
             + (f", root {root}" if op_kind.rooted else ""),
             f"{'routes' if op == 'alltoall' else 'hierarchical'} plan: {len(built[0].pieces)} piece(s); "
             f"border bytes {sent:,} = bound {bound:,} ({op_kind.bound_text})"]
    for p in built:
        for peer, elements in sorted(p.sent(topo).items()):
            lines.append(f"  link rank {p.rank} -> rank {peer}: {elements * itemsize:,} B")
    small = [rounds.build(topo, r, op, n, root) for r in range(world)] if op_kind.round else []
    if small:
        lines.append(f"small round (3 hops, call rows inside): border bytes "
                     f"{sum(sum(r.sent(topo).values()) for r in small) * itemsize:,}; in one hop "
                     f"{plans.round_bytes(topo, op, size, root, one_hop=True):,}")
    if steps:
        for p in (*built, *small):
            lines += p.describe()
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    from hetccl_ray.tools.local_cluster import island_names, parse_layout

    parser = argparse.ArgumentParser(prog="python -m hetccl_ray.tools.show_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="2x2", help="islands: '2x2' (2 islands of 2), '1,2,3'")
    parser.add_argument("--interleave", action="store_true", help="deal ranks to islands round-robin")
    parser.add_argument("--op", default="allreduce", choices=OPS)
    parser.add_argument("--size", type=parse_size, default=parse_size("16M"))
    parser.add_argument("--dtype", default="float32", choices=list(_ITEMSIZE))
    parser.add_argument("--root", type=int, default=0)
    parser.add_argument("--piece-bytes", type=parse_size, default=parse_size("4M"))
    parser.add_argument("--max-lanes", type=int, default=None)
    parser.add_argument("--steps", action="store_true", help="print every rank's steps")
    args = parser.parse_args(argv)
    topo = Topology.from_islands(island_names(parse_layout(args.layout), args.interleave), args.max_lanes)
    if not 0 <= args.root < topo.world_size:
        parser.error(f"--root {args.root} is not a rank of {topo.world_size}")
    print("\n".join(explain(topo, args.op, args.size, _ITEMSIZE[args.dtype], args.root, args.piece_bytes,
                            args.steps)))


if __name__ == "__main__":
    main()
