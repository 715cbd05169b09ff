"""hetccl-bench: nccl-tests-style sweeps of hetccl, with Ray's own gloo side by side.

    hetccl-bench -b 8 -e 64M -f 2 -o allreduce --layout 2x2 --vs gloo --csv out.csv

Sizes follow nccl-tests: ``size`` is the whole buffer (for allgather the gathered
output, for reducescatter the input of all chunks); busbw = algbw x the op's bus factor.
Both backends run on the same actors, alternating call by call (their order rotating each
iteration), so ratios are measured side by side; ``time`` is the median call (the slowest
rank's time) and ``spread`` the p10-p90 range of the calls over it; each ratio comes with
its 90% range (``ratio_range``). Bytes that crossed island boundaries are counted for
hetccl (border counters: payload bytes, and the bytes on the wire where compressed) and
derived for gloo from its ring over ranks in rank order. ``--compress auto,off`` runs one
hetccl group per mode side by side; ``--data grads`` sends real gradients (benchdata.py),
as compression makes the content matter.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pandas as pd
import ray
import torch
from ray.util import collective as col

import hetccl_ray
from hetccl_ray.tools import bench_device
from hetccl_ray.tools.benchdata import DATA, rank_data
from hetccl_ray.core import opkinds
from hetccl_ray.core.opkinds import OpKind
from hetccl_ray.transport.compress.policy import MODES as COMPRESS_MODES
from hetccl_ray.tools.local_cluster import LocalCluster, island_names, parse_layout, place_workers
from hetccl_ray.transport.choice import TRANSPORTS
from hetccl_ray.core.topology import ISLAND_LABEL, Topology
from hetccl_ray.tools.show_plan import OPS as PLANNED_OPS, explain, parse_size

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")
ITERS = 5
DEMO_ITERS = 20  # the demo's cells are verdicts: a median of 5 calls whose spread reaches 400% is not one


def sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """nccl-tests' -b/-e/-f: min, min*f, ... up to max."""
    if min_bytes < 1 or max_bytes < min_bytes or factor <= 1:
        raise ValueError("need 1 <= -b <= -e and -f > 1")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = int(math.ceil(size * factor))
    return sizes


@dataclass(frozen=True)
class Coll:
    """One op of the bench, as nccl-tests' ``testColl``: how its buffers are made, how it is
    called, what it must leave, and the border bytes a flat ring moves; its shape, bus factor
    and border bound are the op's row of the op-kind table (``opkinds``). The harness never
    branches on the op's name.

    ``make(count, chunk, x)`` gives (input, output) from the rank's data ``x`` of ``count``
    (``chunk`` = count / world); ``call(group, x, out)`` one call; ``got(x, out, world)`` the
    tensors to check; ``want(inputs, rank)`` their values from every rank's input (rank 0 only
    for reduce). ``ring``: per ring hop, the share of S it carries and whether the ring wraps
    around (None: flat, it crosses once). ``asks``: the group op whose plan this op takes, per
    size (default: the same name); ``crossings``/``crossings_text``: the bound of a pattern the
    table has none for (the ring of sends)."""

    name: str
    make: Callable[[torch.Tensor, int], tuple]
    call: Callable[[str, int, int, torch.Tensor, Any], Callable[[], None]]
    got: Callable[[torch.Tensor, Any, int], list]
    want: Callable[[list, int, int], list]
    ring: Optional[tuple[Callable[[int], float], bool]]
    asks: str = ""
    crossings: Optional[Callable[[Topology, int], int]] = None
    crossings_text: str = ""

    @property
    def kind(self) -> OpKind:
        return opkinds.kind(self.asks or self.name)

    def bus(self, world: int) -> float:
        return self.kind.bus(world)

    def bound(self, topo: Topology, nbytes: int) -> int:
        return self.crossings(topo, nbytes) if self.crossings else self.kind.bound(topo, nbytes)

    @property
    def bound_text(self) -> str:
        return self.crossings_text or self.kind.bound_text


def _cross_pairs(topo: Topology) -> list[tuple[int, int]]:
    """Ordered (source, destination) rank pairs in different islands."""
    n = topo.world_size
    return [(r, t) for r in range(n) for t in range(n) if topo.island_of(r) != topo.island_of(t)]


def _ring_crossings(topo: Topology, nbytes: int) -> int:
    order = [topo.island_of(r).index for r in range(topo.world_size)]
    return nbytes * sum(order[r] != order[(r + 1) % len(order)] for r in range(len(order)))


def _alltoall_call(group: str, world: int, rank: int, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    if isinstance(col.get_group_handle(group), hetccl_ray.HetCCLGroup):
        ins, outs = list(x.chunk(world)), list(out.chunk(world))
        return lambda: hetccl_ray.alltoall(ins, outs, group_name=group)
    torch_group = col.get_group_handle(group)._pg  # Ray's gloo group has no all-to-all; its torch Gloo has
    return lambda: torch.distributed.all_to_all_single(out, x, group=torch_group)


def _sendrecv_call(group: str, world: int, rank: int, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """Each rank sends to the next and receives from the previous (even ranks send first)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def exchange() -> None:
        if rank % 2 == 0:
            col.send(x, nxt, group_name=group)
        col.recv(out, prv, group_name=group)
        if rank % 2:
            col.send(x, nxt, group_name=group)
    return exchange


def _summed(inputs: list) -> list:
    return [(sum(inputs), sum(x.abs() for x in inputs))]


def _moved(inputs: list) -> list:
    return [(x, x.abs()) for x in inputs]


_RING = (lambda n: 2 * (n - 1) / n, True)
_HALF_RING = (lambda n: (n - 1) / n, True)
_CHAIN = (lambda n: 1.0, False)
COLLS = {c.name: c for c in (
    Coll("allreduce", lambda x, w: (x, None),
         lambda g, w, r, x, out: lambda: col.allreduce(x, group_name=g), lambda x, out, w: [x],
         lambda inputs, w, r: _summed(inputs), _RING),
    Coll("reducescatter", lambda x, w: (torch.zeros_like(x.chunk(w)[0]), list(x.chunk(w))),
         lambda g, w, r, x, out: lambda: col.reducescatter(x, out, group_name=g), lambda x, out, w: [x],
         lambda inputs, w, r: _summed([x.chunk(w)[r] for x in inputs]), _HALF_RING),
    Coll("allgather", lambda x, w: (x.chunk(w)[0].clone(), [torch.zeros_like(x.chunk(w)[0]) for _ in range(w)]),
         lambda g, w, r, x, out: lambda: col.allgather(out, x, group_name=g), lambda x, out, w: out,
         lambda inputs, w, r: _moved([x.chunk(w)[0] for x in inputs]), _HALF_RING),
    Coll("broadcast", lambda x, w: (x, None),
         lambda g, w, r, x, out: lambda: col.broadcast(x, src_rank=0, group_name=g), lambda x, out, w: [x],
         lambda inputs, w, r: _moved(inputs[:1]), _CHAIN),
    Coll("reduce", lambda x, w: (x, None),
         lambda g, w, r, x, out: lambda: col.reduce(x, dst_rank=0, group_name=g), lambda x, out, w: [x],
         lambda inputs, w, r: _summed(inputs) if r == 0 else [], _CHAIN),
    Coll("sendrecv", lambda x, w: (x, torch.empty_like(x)), _sendrecv_call, lambda x, out, w: [out],
         lambda inputs, w, r: _moved([inputs[(r - 1) % w]]), (lambda n: 1.0, True), asks="send",
         crossings=_ring_crossings, crossings_text="S per ring hop that crosses islands"),
    Coll("alltoall", lambda x, w: (x, torch.zeros_like(x)), _alltoall_call, lambda x, out, w: list(out.chunk(w)),
         lambda inputs, w, r: _moved([x.chunk(w)[r] for x in inputs]), None),
)}
OPS = tuple(COLLS)


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw factors: what each rank's link carries relative to algbw."""
    return COLLS[op].bus(world)


def hetccl_bound(op: str, topo: Topology, nbytes: int) -> int:
    """The design's lower bound on bytes crossing island boundaries, all ranks together."""
    return COLLS[op].bound(topo, nbytes)


def ring_border_bytes(op: str, island_of_rank: Sequence[str], nbytes: int) -> int:
    """Bytes a flat ring over ranks in rank order (gloo's allreduce/allgather/reducescatter
    algorithm; broadcast and reduce as a chain, sendrecv as a ring of pairs) sends across
    island boundaries: per crossing hop, the ring's per-link bytes. Gloo's all-to-all is
    flat: each block straight to its rank, so it crosses once, as the bound."""
    topo = Topology.from_islands(island_of_rank)
    ring = COLLS[op].ring
    if ring is None:
        return hetccl_bound(op, topo, nbytes)
    share, wraps = ring
    n = len(island_of_rank)
    crossings = sum(island_of_rank[r] != island_of_rank[(r + 1) % n] for r in range(n - (0 if wraps else 1)))
    return int(round(crossings * share(n) * nbytes))


def link_seconds(op: str, topo: Topology, nbytes: int, bits_per_s: float, root: int = 0) -> Optional[float]:
    """The link bound on shaped links (each island's link shaped each way): the busiest
    island's bytes out or in over the rate, each island pair carrying what the op must move
    between them once (an island's share of a per-rank-chunked buffer is its ranks' chunks;
    allreduce: both islands' shares, as reduce-scatter then allgather; broadcast and reduce:
    the whole buffer from or to ``root``'s island; all-to-all: its cross-island blocks).
    None for point-to-point and a single island."""
    k = len(topo.islands)
    if k < 2 or op == "sendrecv":
        return None
    island = {r: topo.island_of(r).index for r in range(topo.world_size)}
    share = [isl.size * (nbytes // topo.world_size) for isl in topo.islands]
    home = island[root]
    carried = {"allreduce": lambda i, j: share[i] + share[j], "allgather": lambda i, j: share[i],
               "reducescatter": lambda i, j: share[j], "broadcast": lambda i, j: nbytes if i == home else 0,
               "reduce": lambda i, j: nbytes if j == home else 0}
    load = [0] * (2 * k)  # per island: bytes leaving, bytes entering
    if op == "alltoall":
        block = nbytes // topo.world_size
        moves = [(island[r], island[t], block) for r, t in _cross_pairs(topo)]
    else:
        moves = [(i, j, carried[op](i, j)) for i in range(k) for j in range(k) if i != j]
    for i, j, size in moves:
        load[2 * i] += size
        load[2 * j + 1] += size
    return max(load) * 8 / bits_per_s


def parse_rate(text: str) -> float:
    """tc's rate units ("1gbit", "100mbit", "500kbit") -> bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip().lower())
    if not match:
        raise ValueError(f"bad link rate {text!r}: use e.g. 1gbit, 100mbit")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]



# -- what each rank runs -------------------------------------------------------------------------

def _wrong(coll: Coll, world: int, rank: int, count: int, dtype: torch.dtype, got: list, data: str) -> int:
    """Elements that differ from the expected result of one call: moved data bit for bit,
    float reductions within the rounding of ``world`` additions in the dtype; expected values
    from every rank's input, summed in float64 (int64 for integers, wrapping as the dtype)."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    inputs = [rank_data(data, r, count, dtype).to(wide) for r in range(world)]
    wrong = 0
    for g, (w, scale) in zip(got, coll.want(inputs, world, rank)):
        w = w.to(dtype).to(torch.float64)  # overflows and wraps as the dtype does
        g = g.to(torch.float64)
        if coll.kind.reduces and dtype.is_floating_point:
            info = torch.finfo(dtype)
            close = ((g - w).abs() <= world * info.eps * scale) | (g == w)
            near_overflow = scale >= info.max / 2  # partial sums may round to inf in another order
            wrong += int((~close & ~near_overflow).sum().item())
        else:
            wrong += int((g != w).sum().item())
    return wrong


def _data_bytes_sent(group: str) -> tuple[int, int]:
    """Border bytes this rank sent for data, leaving out the tiny call checks: payload bytes
    and bytes on the wire."""
    stats = hetccl_ray.border_stats(group)
    check = stats["per_op"].get("check", 0)
    return stats["bytes_sent"] - check, stats["wire_bytes_sent"] - check


def rank_run(groups: dict[str, str], op: str, count: int, dtype_name: str, warmup: int, iters: int,
             rank: int, world: int, data: str = "fill", device: str = "cpu") -> dict[str, dict]:
    """In one actor: check one call of each backend, warm each up, then time ``iters`` calls
    of each, alternating the backends call by call and rotating their order every iteration,
    so the host's noisy moments and the cost of going first fall on every backend alike.
    Each call starts after a barrier of its group; returns each call's seconds per backend.
    On a ``device`` (bench_device.py) a call ends when the device has done it; Ray's gloo runs
    on host copies; ``staging_s`` is this rank's staging bound of the buffer."""
    dtype, coll = getattr(torch, dtype_name), COLLS[op]
    out, steps = {}, {}
    bench_device.prepare(device)
    for backend, group in groups.items():
        x, into = (bench_device.moved(device, t) for t in coll.make(rank_data(data, rank, count, dtype), world))
        step = steps[backend] = bench_device.step(device, backend == "gloo",
                                                  lambda a, b, g=group: coll.call(g, world, rank, a, b), x, into)
        hetccl = backend.startswith("hetccl")
        col.barrier(group_name=group)
        sent_before = _data_bytes_sent(group) if hetccl else (0, 0)
        step()
        got = [t.cpu() for t in coll.got(x, into, world)]
        wrong = _wrong(coll, world, rank, count, dtype, got, data)
        border, wire = ([after - before for after, before in zip(_data_bytes_sent(group), sent_before)] if hetccl
                        else (None, None))
        out[backend] = {"times_s": [], "wrong": wrong, "border_bytes": border, "wire_bytes": wire,
                        "staging_s": bench_device.staging_seconds(device, count * x.element_size()
                                                                  if isinstance(x, torch.Tensor) else 0)}
    names = list(groups)
    for i in range(warmup + iters):  # warm-up calls alternate too: no backend runs hotter
        for backend in names[i % len(names):] + names[:i % len(names)]:
            col.barrier(group_name=groups[backend])
            started = time.perf_counter()
            steps[backend]()
            if i >= warmup:
                out[backend]["times_s"].append(time.perf_counter() - started)
    return out


def iteration_seconds(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each iteration's call time: its slowest rank's, in the order the calls ran."""
    return [max(times) for times in zip(*per_rank)]


def call_seconds(iterations: Sequence[float]) -> tuple[float, float]:
    """The median of the iterations' call times (:func:`iteration_seconds`), and the spread:
    (p90 - p10) of them over the median (0.1 = 10%)."""
    calls = sorted(iterations)
    median = calls[len(calls) // 2]
    low, high = calls[int(0.1 * (len(calls) - 1))], calls[-1 - int(0.1 * (len(calls) - 1))]
    return median, (high - low) / median if median else 0.0


def ratio_range(slower: Sequence[float], faster: Sequence[float], level: float = 0.9,
                draws: int = 2000) -> tuple[float, float]:
    """The ``level`` interval of median(slower) / median(faster) over the iterations, both
    backends' calls of one iteration resampled together (they ran side by side): a ratio
    whose interval holds 1.0 is within this machine's noise. A fixed seed: one table, one answer."""
    pairs, n = np.asarray([slower, faster], dtype=float), len(slower)
    picks = np.random.default_rng(0).integers(0, n, (draws, n))
    median = lambda calls: np.sort(calls[picks], axis=1)[:, n // 2]  # noqa: E731 - call_seconds' median
    ratios = median(pairs[0]) / median(pairs[1])
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


# -- the driver ----------------------------------------------------------------------------------

@dataclass
class BenchSpec:
    ops: Sequence[str]
    sizes: Sequence[int]
    dtype: str = "float32"
    warmup: int = 2
    iters: int = 5
    vs_gloo: bool = False
    compress: Sequence[str] = ("auto",)  # one hetccl group per mode, side by side
    data: str = "fill"
    device: str = "cpu"  # where the ranks' buffers are (bench_device.py)
    vs_nccl: bool = False  # Ray's NCCL group too (one-vendor layouts, --device cuda)

    def backends(self) -> list[str]:
        """The backends' labels: "hetccl" (or "hetccl-MODE" each, for several modes), "gloo", "nccl"."""
        labels = ["hetccl" if len(self.compress) == 1 else f"hetccl-{mode}" for mode in self.compress]
        return labels + (["gloo"] if self.vs_gloo else []) + (["nccl"] if self.vs_nccl else [])


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = int(30 * self.done / self.total)
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write(f"\r{line:<80}" + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def compression_report(group: str, rank: int) -> list[str]:
    """In one actor: a line per link to another island that carried eligible messages."""
    links = hetccl_ray.border_stats(group)["compression"]
    return [f"rank {rank}->{peer} {link['mode']}: {'compressing' if link['compressing'] else 'raw'}, "
            f"ratio {link['ratio']}, link {link['link_MBps']} MB/s, codec {link['encode_MBps']} MB/s in, "
            f"{link['decode_MBps']} MB/s out, messages {link['messages_compressed']} compressed "
            f"{link['messages_raw']} raw" for peer, link in links.items()
            if link["messages_compressed"] + link["messages_raw"]]


def lane_transports(group: str, rank: int) -> tuple[list[str], list[str]]:
    """In one actor: the transport to each lane peer of this rank, and why; the cost model."""
    formed = hetccl_ray.get_group(group)
    choices = formed.lane_transports()
    return ([f"rank {rank}->{peer} {choice.transport} ({choice.why})" for peer, choice in choices.items()],
            formed.cost_model())


def plan_taken(group: str, op: str, nbytes: int) -> str:
    """In one actor: the plan a call of ``op`` on ``nbytes`` takes in this group (the group's
    agreed choice, the same on every rank): round, plan, flat, pull or p2p."""
    return hetccl_ray.get_group(group).plan_of(COLLS[op].asks or op, nbytes)


def run_sweep(actors: Sequence, island_of_rank: Sequence[str], spec: BenchSpec, progress: bool = True,
              timeout_s: float = 120.0, transport: str = "auto", link_rate: Optional[str] = None) -> pd.DataFrame:
    """Form the groups on ``actors`` and run the sweep; one row per (op, size, backend).
    ``frame.attrs["lanes"]`` says which transport each lane took; with ``link_rate`` (shaped
    links), every collective's rows get their time over the link bound."""
    world = len(actors)
    topo = Topology.from_islands(island_of_rank)
    stamp = f"{time.time_ns():x}"
    labels = spec.backends()
    groups = {label: f"bench-{label}-{stamp}" for label in labels}
    for label, mode in zip(labels, spec.compress):
        hetccl_ray.create_collective_group(actors, world, list(range(world)), group_name=groups[label],
                                           timeout_s=timeout_s, transport=transport, compress=mode)
        lanes_of = ray.get([a.call.remote(lane_transports, groups[label], r) for r, a in enumerate(actors)],
                           timeout=max(timeout_s, 60))  # also forms the group on every rank
    first = topo.islands[0].ranks
    lanes = [f"lane {lane}: " + "; ".join(lanes_of[first[lane]][0]) for lane in range(topo.lanes)
             if len(topo.islands) > 1]
    for theirs in ("gloo", "nccl"):
        if theirs in groups:
            col.create_collective_group(list(actors), world, list(range(world)), backend=theirs,
                                        group_name=groups[theirs])
    itemsize = torch.tensor([], dtype=getattr(torch, spec.dtype)).element_size()
    bar = _Progress(len(spec.ops) * len(spec.sizes) * len(groups), progress)
    rows = []
    for op in spec.ops:
        for size in spec.sizes:
            coll = COLLS[op]
            unit = itemsize * (world if coll.kind.chunked else 1)
            count = max(size // unit, 1) * unit // itemsize
            nbytes = count * itemsize
            per_rank = ray.get([a.call.remote(rank_run, groups, op, count, spec.dtype, spec.warmup, spec.iters,
                                              rank, world, spec.data, spec.device) for rank, a in enumerate(actors)],
                               timeout=max(timeout_s, 600))
            taken = {label: ray.get(actors[0].call.remote(plan_taken, groups[label], op, nbytes), timeout=60)
                     for label in labels if label.startswith("hetccl")}
            calls = {backend: iteration_seconds([r[backend]["times_s"] for r in per_rank]) for backend in groups}
            for backend in groups:
                results = [r[backend] for r in per_rank]
                seconds, spread = call_seconds(calls[backend])
                algbw = nbytes / seconds / 1e9
                hetccl = backend.startswith("hetccl")
                border = (sum(r["border_bytes"] for r in results) if hetccl
                          else ring_border_bytes(op, island_of_rank, nbytes))
                wire = sum(r["wire_bytes"] for r in results) if hetccl else border
                rows.append({"op": op, "size": nbytes, "count": count, "type": spec.dtype,
                             "redop": "sum" if coll.kind.reduces else "none",
                             "root": 0 if coll.kind.rooted else -1, "backend": backend,
                             "time_us": seconds * 1e6, "spread": spread, "algbw": algbw, "busbw": algbw * bus_factor(op, world),
                             "wrong": sum(r["wrong"] for r in results), "border_bytes": border,
                             "wire_bytes": wire, "wire_ratio": wire / border if border else None,
                             "border_bound": hetccl_bound(op, topo, nbytes), "data": spec.data,
                             "plan": taken.get(backend, "gloo")})
                if link_rate:
                    bound_s = link_seconds(op, topo, nbytes, parse_rate(link_rate))
                    rows[-1]["x_link_bound"] = seconds / bound_s if bound_s else None
                if spec.device != "cpu":  # the slowest rank's staging bound of its buffer
                    staging = max(r["staging_s"] for r in results)
                    rows[-1].update(staging_us=staging * 1e6, x_staging=seconds / staging if staging else None)
                bar.step(f"{op} {nbytes} B {backend}")
            cell, first = dict(zip(labels, rows[-len(labels):])), labels[0]
            for other in labels[1:]:  # how many times faster the first hetccl group is than each other backend
                key = f"{first}_vs_{other}"
                low, high = ratio_range(calls[other], calls[first])
                for row in cell.values():
                    row.update({key: cell[other]["time_us"] / cell[first]["time_us"], f"{key}_low": low,
                                f"{key}_high": high})
    frame = pd.DataFrame(rows)
    if spec.device != "cpu":
        memory = ray.get(actors[0].call.remote(lambda: hetccl_ray.border_stats(groups[labels[0]])["gpu_memory"]),
                         timeout=60)
        lanes.append(f"device {spec.device}: border GPU memory {memory}; staging = one copy each way through "
                     "pinned host memory, measured on each rank")
    frame.attrs["lanes"] = lanes
    frame.attrs["model"] = lanes_of[0][1]
    frame.attrs["compression"] = [
        f"{label} {line}" for label in labels if label.startswith("hetccl")
        for lines in ray.get([a.call.remote(compression_report, groups[label], r) for r, a in enumerate(actors)],
                             timeout=max(timeout_s, 60)) for line in lines]
    return frame


def format_table(frame: pd.DataFrame) -> str:
    """The nccl-tests table: one line per (op, size), each backend's columns (hetccl's with
    the bytes on the wire and their ratio to the payload), then how many times faster the
    first backend is than each other one."""
    backends = list(dict.fromkeys(frame["backend"]))
    head1 = f"{'#':>1}{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>4}"
    head2 = f"{'#':>1}{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>4}"
    linked = "x_link_bound" in frame and frame["x_link_bound"].notna().any()
    staged = "x_staging" in frame and frame["x_staging"].notna().any()
    for backend in backends:
        head1 += f" | {backend + ' time':>12} {'spread':>6} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'border':>10}"
        head2 += f" | {'(us, med)':>12} {'(%)':>6} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(B)':>10}"
        if backend.startswith("hetccl"):
            head1 += f" {'wire':>10} {'wire/':>6} {'plan':>6}"
            head2 += f" {'(B)':>10} {'border':>6} {'':>6}"
        if linked:
            head1 += f" {'time':>7}"
            head2 += f" {'/link':>7}"
        if staged:
            head1 += f" {'staging':>9} {'time':>7}"
            head2 += f" {'(us)':>9} {'/stage':>7}"
    others = [b for b in backends[1:] if f"{backends[0]}_vs_{b}" in frame]
    for other in others:
        head1 += f" | {other + '/' + backends[0]:>11} {'90% range':>11}"
        head2 += f" | {'(x faster)':>11} {'(noise)':>11}"
    lines = [head1, head2]
    for op, per_op in frame.groupby("op", sort=False):
        lines.append(f"# {op}  (hetccl border bound: {COLLS[op].bound_text})")
        for size, rows in per_op.groupby("size", sort=False):
            first = rows.iloc[0]
            line = (f" {size:>12} {first['count']:>12} {first['type']:>8} {first['redop']:>6} "
                    f"{first['root']:>4}")
            for backend in backends:
                row = rows[rows["backend"] == backend].iloc[0]
                line += (f" | {row['time_us']:>12.1f} {100 * row['spread']:>6.0f} {row['algbw']:>7.3f} {row['busbw']:>7.3f} "
                         f"{row['wrong']:>6d} {int(row['border_bytes']):>10d}")
                if backend.startswith("hetccl"):
                    ratio = f"{row['wire_ratio']:>6.3f}" if pd.notna(row["wire_ratio"]) else f"{'-':>6}"
                    line += f" {int(row['wire_bytes']):>10d} {ratio} {row.get('plan', '-'):>6}"
                if linked:
                    line += f" {row['x_link_bound']:>7.2f}" if pd.notna(row["x_link_bound"]) else f" {'-':>7}"
                if staged:
                    line += f" {row['staging_us']:>9.1f} {row['x_staging']:>7.2f}"
            for other in others:
                key = f"{backends[0]}_vs_{other}"
                line += f" | {first[key]:>11.2f} {first[key + '_low']:>5.2f}-{first[key + '_high']:<5.2f}"
            lines.append(line)
    cells = frame.drop_duplicates(["op", "size"])
    for other in others:
        key = f"{backends[0]}_vs_{other}"
        under, beyond = cells[cells[key] < 1.0], cells[cells[f"{key}_high"] < 1.0]
        lines.append(f"# {backends[0]} slower than {other}: {len(under)} of {len(cells)} cells, beyond the noise "
                     f"(90% range under 1.0) {len(beyond)}"
                     + "".join(f"; {row['op']} {row['size']} B {row[key]:.2f}" for _, row in beyond.iterrows()))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetccl-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-f", "--stepfactor", type=float, default=2.0)
    p.add_argument("-o", "--op", default="allreduce", help=f"comma list or 'all' of: {', '.join(OPS)}")
    p.add_argument("-d", "--datatype", default="float32", choices=DTYPES)
    p.add_argument("-w", "--warmup_iters", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=None,
                   help=f"timed calls per size (default {ITERS}; --demo {DEMO_ITERS})")
    p.add_argument("--layout", default="2x2", help="islands: '2x2' (2 islands of 2), '1,2,3', '4'")
    p.add_argument("--interleave", action="store_true", help="deal ranks to islands round-robin")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="border transport: auto (RDMA where both ends have a port, else TCP), tcp, rdma")
    p.add_argument("--address", default=None, help="a running Ray cluster whose nodes carry hetccl.io/island")
    p.add_argument("--vs", choices=["gloo", "nccl"], default=None,
                   help="also run Ray's own backend, side by side (gloo on host copies of device buffers; "
                        "nccl: one-vendor layouts with --device cuda)")
    p.add_argument("--device", choices=bench_device.DEVICES, default="cpu",
                   help="the ranks' buffers: host memory, a GPU (islands' nodes share the host's, one rank may be "
                        "one island), or the emulated device (a FAKE: exercises the path, measures nothing)")
    p.add_argument("--link-rate", default=None,
                   help="shape inter-island links (e.g. 1gbit): islands in their own network namespaces")
    p.add_argument("--link-delay", default=None,
                   help="with --link-rate, also delay every packet between islands this long each way (e.g. 1ms)")
    p.add_argument("--compress", default="auto",
                   help="border compression: auto, on or off; a comma list runs one hetccl group per mode")
    p.add_argument("--data", choices=DATA, default="fill",
                   help="what ranks send: rank+1 everywhere, real gradients of a small MLP, or random bits")
    p.add_argument("--csv", default=None, help="write the results here")
    p.add_argument("--timeout", type=float, default=120.0, help="group deadline, seconds")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--explain", action="store_true",
                   help="print each op's plan for the layout and sizes (steps, border bytes) without a cluster")
    p.add_argument("--demo", action="store_true",
                   help="the README demo: every op on 2x2 with --vs gloo, small sizes, unshaped then shaped")
    return p


def _ops(text: str) -> list[str]:
    ops = list(OPS) if text == "all" else [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise SystemExit(f"hetccl-bench: unknown op(s) {unknown}; choose from {', '.join(OPS)} or 'all'")
    return ops


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in COMPRESS_MODES for m in modes) or len(set(modes)) != len(modes):
        raise SystemExit(f"hetccl-bench: --compress takes distinct modes of {', '.join(COMPRESS_MODES)}, got {text!r}")
    return modes


def _cluster_islands(sizes: list[int]) -> list[str]:
    """On a running cluster: island names from node labels, dealt to the layout's sizes."""
    names = sorted({n["Labels"][ISLAND_LABEL] for n in ray.nodes()
                    if n.get("Alive") and ISLAND_LABEL in n.get("Labels", {})})
    if len(names) < len(sizes):
        raise SystemExit(f"hetccl-bench: the cluster has islands {names}; the layout needs {len(sizes)}")
    return names[:len(sizes)]


def main(argv: Optional[Sequence[str]] = None) -> pd.DataFrame:
    args = _parser().parse_args(argv)
    rates = [args.link_rate]
    if args.demo:
        args.op, args.vs = "all", "gloo"
        args.minbytes, args.maxbytes, args.stepfactor = 1 << 10, 1 << 20, 32.0
        args.iters = args.iters or DEMO_ITERS
        rates = [None, *_demo_shaped_rate()]
    spec = BenchSpec(_ops(args.op), sweep(args.minbytes, args.maxbytes, args.stepfactor), args.datatype,
                     args.warmup_iters, args.iters or ITERS, args.vs == "gloo", _modes(args.compress), args.data,
                     args.device, args.vs == "nccl")
    islands = island_names(parse_layout(args.layout), args.interleave)
    if args.explain:
        return _explain(spec, islands)
    frame = pd.concat([_bench_once(args, spec, islands, rate) for rate in rates], ignore_index=True)
    if args.csv:
        frame.to_csv(args.csv, index=False)
        print(f"# wrote {args.csv}")
    if frame["wrong"].sum():
        raise SystemExit(f"hetccl-bench: {int(frame['wrong'].sum())} wrong elements")
    return frame


def _explain(spec: BenchSpec, islands: list[str]) -> pd.DataFrame:
    """``--explain``: the plan of every planned op and size, printed."""
    topo = Topology.from_islands(islands)
    itemsize = torch.tensor([], dtype=getattr(torch, spec.dtype)).element_size()
    for op in spec.ops:
        for size in spec.sizes:
            print("\n".join(explain(topo, op, size, itemsize)) if op in PLANNED_OPS
                  else f"{op} of {size:,} B: no plan (point to point)", end="\n\n")
    return pd.DataFrame()


def _demo_shaped_rate() -> list[str]:
    """The demo's second table, a 1 Gbit/s link between islands, where this machine can shape one."""
    from hetccl_ray.tools.shaped_cluster import ShapedClusterUnavailable, check_available

    try:
        check_available()
    except ShapedClusterUnavailable as exc:
        print(f"# demo: unshaped only; no shaped 1gbit table here: {exc}")
        return []
    return ["1gbit"]


def _bench_once(args: argparse.Namespace, spec: BenchSpec, islands: list[str], link_rate: Optional[str]
                ) -> pd.DataFrame:
    """One sweep on one cluster (running, shaped or local), its table printed."""
    if args.address:
        ray.init(address=args.address, ignore_reinit_error=True)
        real = _cluster_islands(parse_layout(args.layout))
        islands = [real[int(name.removeprefix("island"))] for name in islands]
        cluster = None
    elif link_rate:
        from hetccl_ray.tools.shaped_cluster import ShapedCluster

        cluster = ShapedCluster(islands, link_rate, delay=args.link_delay)
    else:
        cluster = LocalCluster(islands, gpus={name: 1 for name in islands} if spec.device == "cuda" else None)
    header = (f"# hetccl-bench  device {spec.device}  layout {args.layout}{' interleaved' if args.interleave else ''}  "
              f"islands by rank {islands}  link {link_rate or 'unshaped'}"
              f"{f' delay {args.link_delay}' if link_rate and args.link_delay else ''}  transport {args.transport}  "
              f"type {spec.dtype}  data {spec.data}  compress {','.join(spec.compress)}  "
              f"warmup {spec.warmup}  iters {spec.iters}")
    if cluster is None:
        actors = place_workers(islands)
        frame = run_sweep(actors, islands, spec, not args.no_progress, args.timeout, args.transport, link_rate)
    else:
        with cluster:
            frame = run_sweep(cluster.workers(islands), islands, spec, not args.no_progress, args.timeout,
                              args.transport, link_rate)
    frame["layout"] = args.layout + ("i" if args.interleave else "")
    frame["link_rate"] = link_rate or "unshaped"
    print(header)
    print(Topology.from_islands(islands).describe())
    for line in frame.attrs.get("lanes", []) + frame.attrs.get("model", []) + frame.attrs.get("compression", []):
        print(f"# {line}")
    print(format_table(frame), flush=True)
    return frame


def cli() -> None:
    """The ``hetccl-bench`` console script."""
    main()


if __name__ == "__main__":
    cli()
