"""The planner: which plan each call takes, from what every rank knows alike.

Candidates per call: the small round (small_round.py, 3 hops, call rows inside), the hierarchical
plan (plans.py), and the flat plan (one library over every rank: Gloo, for CPU tensors
on every rank, after the rows check; shared memory where every rank shares a host, which
then also checks every call and leaves no round). The choice reads only the call's op and size, the
agreed rows and what formation measured and agreed (the worst of every rank's link costs,
costs.py, and the timed races of the plans, each call's slowest rank), never the local tensor, so
every rank of a group of GPU and CPU islands takes the same plan.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Sequence

import torch

from hetccl_ray.core import costs
from hetccl_ray.core.calls import on_host
from hetccl_ray.core.op import Op
from hetccl_ray.core.opkinds import kind
from hetccl_ray.core.topology import Topology

PROBE_ROUNDS, PROBE_BYTES = 7, (256 << 10, 4 << 20)  # formation's timed rounds for the cost model
OP_PROBE_ROUNDS = 3  # timed calls per op and plan at each size of the ladder
# The ladder: each op raced by its candidate plans at these sizes, ascending. The round runs
# at those up to MAX_SMALL_BYTES that fit ROUND_PROBE_BUDGET_S by the model (on the 2-core
# VM its line said 4 MiB where the round lost at 1 MiB: 1+2+3 broadcast 0.5x of Gloo); the
# hierarchical and flat plans at 4 and 16 MiB too (1+2+3 loopback broadcast ties at 4 MiB
# and is 1.5x faster flat at 16), scaled down where the flat library is slow (a slow border)
# so that those calls take about OP_PROBE_BUDGET_S.
ROUND_PROBE_BYTES = (256 << 10, 1 << 20, 4 << 20)
ROUND_PROBE_BUDGET_S = 2.0
OP_PROBE_BYTES = (4 << 20, 16 << 20)
OP_PROBE_BUDGET_S = 2.0
ROUND, PLAN, FLAT = "round", "plan", "flat"
TWO_HOP = "2hop"  # a small broadcast whose calls are not checked: the round's place, no rows
# how an op runs (Choice.path): its plan alone (a message, a group of one); the vendor op alone
# (one island); the small plan (the round, rows inside, or the two-hop broadcast); the rows-only
# check, then the plan; the plan with no check (calls not checked)
DIRECT, VENDOR, SMALL, CHECKED, UNCHECKED = "direct", "vendor", "small", "checked", "unchecked"
POSTED = "posted"  # a host message posted straight over the border: no plan, none of the op wrapper's work
# how a message moves (Choice.route): through the island library; pulled by its receiver from
# the sender's memory (one host); over the TCP border's socket, the receiver taking whatever
# the sender chose (one host); over the border
ISLAND, PULL, SOCKET, BORDER = "island", "pull", "socket", "border"


class OneHost(Protocol):
    """What the shared-memory library takes where every rank shares this host (shm.py)."""

    def takes_alltoall(self, nbytes: int) -> bool: ...
    def pulls(self, nbytes: int) -> bool: ...
    def pulls_message(self, nbytes: int) -> bool: ...


@dataclass(frozen=True)
class Choice:
    """How one op runs: ``path`` (DIRECT, VENDOR, SMALL, CHECKED, UNCHECKED) and, for the ops
    the round and the flat library run, ``plan`` (ROUND, TWO_HOP, FLAT or PLAN; FLAT once the
    check's rows show host memory on every rank); ``offers``: on one host, the op's host
    buffers are published with its check (the shared-memory op reads them there); ``host_path``:
    the op's buffers take the host path (messages over the border's socket, blocks sent ahead,
    pulls; the small round on the buffers themselves), else the device path (island peers
    through the island library, the round on host copies)."""

    path: str
    plan: Optional[str] = None
    offers: bool = False
    host_path: bool = False
    route: str = BORDER  # a message's (ISLAND, PULL, SOCKET, BORDER)


@dataclass(frozen=True)
class AllToAll:
    """How an all-to-all's blocks move, once its check agreed every rank's row: through shared
    memory (``shared``: one host, host memory on every rank, sizes the library takes), else the
    blocks of ``straight`` ranks (host memory) straight to their destinations and the rest along
    the routes, whose moves inside an island go as one vendor all-to-all (``by_island``) or
    over the border's socket."""

    shared: bool
    straight: frozenset[int]
    by_island: bool


@dataclass
class Planner:
    """The plan choice of one group: small-round thresholds and where the flat plan starts."""

    topology: Topology
    small_bytes: dict[str, int] = field(default_factory=dict)
    flat: bool = False  # a flat library exists (the ``flat`` option, several islands)
    flat_from: dict[str, float] = field(default_factory=lambda: dict.fromkeys(costs.OPS, math.inf))
    flat_until: float = math.inf  # the largest size raced, where the ladder was cut short (a slow flat library)
    link: Optional[costs.LinkCosts] = None
    flat_link: Optional[costs.LinkCosts] = None
    forced: Optional[str] = None  # ROUND, PLAN or FLAT whatever the size: what calibration times
    shared_memory: bool = False  # the flat library is shm.py's (every rank on one host), not Gloo
    one_hop: bool = False  # small rounds and checks in one hop (rounds.py): the ``one_hop`` option
    check_calls: bool = True  # the ``check_calls`` option: a rows round before ops that carry no rows
    # what calibration's races measured: per op, per size, each plan's fastest call on its slowest rank
    races: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    strict: bool = False  # the ``strict`` option: a group of one island checks its calls too
    rank: int = 0  # whose choices these are
    routed: frozenset[int] = frozenset()  # peers reached over a border of their own (RDMA)
    one_host: Optional[OneHost] = None  # the shared-memory library, where every rank shares this host

    def choose(self, op: Op, host: bool, agreed: bool) -> Choice:
        """How ``op`` runs, from what every rank knows alike: the call, the topology, the
        thresholds agreed at formation, and ``agreed`` (a check showed every rank on this op's
        device class; ``host``: that class is host memory, which every rank of one island
        shares then). The order of the rules:

        - a message, or a group of one: the op's plan alone;
        - a group of one island runs the vendor op alone (as NCCL or Gloo would) once its
          device class is agreed, except a host collective the round takes (faster than the
          library, and checked) and with ``strict``;
        - a collective up to its small-message threshold: the round (``check_calls`` off: a
          broadcast in two hops);
        - else the rows-only check (always for an all-to-all, whose block sizes it agrees, for
          the barrier, which it is, and for an op on a class not yet agreed in one island;
          otherwise unless ``check_calls`` is off), then the plan: flat where the planner
          chose it and the rows show host memory on every rank, else hierarchical."""
        if op.peer is not None:
            return self.message(op, host)  # posted or not: a batch's caller asks message()
        call, topo = op.call, self.topology
        row = kind(call.op)
        plan = (self.plan_of(call.op, row.whole_bytes(call.numel * call.dtype.itemsize, topo.world_size),
                             checked=self.check_calls) if row.round else None)
        if topo.world_size == 1:
            return Choice(DIRECT, plan, host_path=host)
        one_island, small = len(topo.islands) == 1, plan in (ROUND, TWO_HOP)
        if one_island and agreed and op.moves and not op.agrees_counts and not self.strict and not (host and small):
            return Choice(VENDOR, plan, host_path=host)
        if small:
            return Choice(SMALL, plan, host_path=host)
        checked = op.agrees_counts or self.check_calls or op.tensor is None or (one_island and not agreed)
        offers = self.shared_memory and op.offered is not None and host and self.check_calls
        return Choice(CHECKED if checked else UNCHECKED, plan, offers, host)

    def message(self, op: Op, host: bool, batch: bool = False) -> Choice:
        """How a send or receive runs: a host message is posted straight over the border (in a
        ``batch``, as torch's isend/irecv, every host message is: one pulled would wait for its
        receiver), except one pulled on one host; the rest run their plan (``route``)."""
        route = self.route(op.peer, op.buf.nbytes, host)
        posted = host and op.moves and (batch or route != PULL)
        return Choice(POSTED if posted else DIRECT, host_path=host, route=route)

    def route(self, peer: int, nbytes: int, host: bool) -> str:
        """How a message between this rank and ``peer`` moves (both ends decide alike from its
        size): device buffers of an island peer through the island library; on one host over
        the TCP border's socket unless ``peer`` is reached over a border of its own (RDMA), a
        large host message pulled by its receiver; else over the border."""
        topo = self.topology
        if not host and topo.island_of(peer) == topo.island_of(self.rank):
            return ISLAND
        if self.one_host is None or peer in self.routed:
            return BORDER
        return PULL if host and self.one_host.pulls_message(nbytes) else SOCKET

    def any_source(self, host: bool) -> Optional[str]:
        """Why a receive from any source cannot run here (None: it can): it takes host memory
        over the TCP border, as torch's Gloo (NCCL has no any-source receive)."""
        if self.routed:
            return f"ranks {sorted(self.routed)} are reached over RDMA"
        return None if host else "the tensor is not in host memory"

    def flat_with(self, choice: Choice, rows: Optional[Mapping[int, Sequence[int]]]) -> bool:
        """Whether a checked op the planner gave the flat plan runs it: the rows show host
        memory on every rank (the flat library is Gloo's or shared memory's)."""
        return choice.plan == FLAT and rows is not None and all(map(on_host, rows.values()))

    def alltoall(self, rows: Optional[Mapping[int, Sequence[int]]], largest_bytes: int, host_path: bool) -> AllToAll:
        """How an all-to-all whose largest rank sends ``largest_bytes`` moves, from its agreed
        ``rows`` (without rows, every block takes the routes)."""
        straight = frozenset(r for r, row in (rows or {}).items() if self.goes_straight(row))
        shared = (self.one_host is not None and rows is not None and len(straight) == len(rows)
                  and self.one_host.takes_alltoall(largest_bytes))
        return AllToAll(shared, straight, not host_path)

    @staticmethod
    def goes_straight(row: Sequence[int]) -> bool:
        """Whether the rank whose call row is ``row`` sends its all-to-all blocks straight to
        their destinations (host memory: one hop over the socket, sent during the check)."""
        return on_host(row)

    def plan_of(self, op: str, nbytes: int, every_rank_on_host: bool = True, checked: bool = True,
                peer: Optional[int] = None) -> str:
        """"round", "2hop", "flat" or "plan" for a call of ``op`` on ``nbytes`` (nccl-tests'
        size). The flat plan needs the rows (``checked``) to show CPU tensors on every rank; a
        small broadcast whose calls are not checked needs none and takes two hops (not when
        calibration forces the round, which it times). An all-to-all: "flat" through shared
        memory, "pull" from the senders' memory, else "direct" (blocks straight to their ranks);
        a send of host memory (to ``peer``, or any peer over the TCP border): "pull" by its
        receiver, else "p2p"."""
        if op == "send":
            return "pull" if self.route(self.rank if peer is None else peer, nbytes, True) == PULL else "p2p"
        if op == "alltoall":
            if self.one_host is None or not every_rank_on_host or not self.one_host.takes_alltoall(nbytes):
                return "direct"
            return "pull" if self.one_host.pulls(nbytes) else FLAT
        if self.forced == ROUND or (self.forced is None and nbytes <= self.small_bytes.get(op, 0)):
            return TWO_HOP if op == "broadcast" and not checked and self.forced is None else ROUND
        return self.beyond_round(op, nbytes, every_rank_on_host, checked)

    def beyond_round(self, op: str, nbytes: int, every_rank_on_host: bool = True, checked: bool = True) -> str:
        """"flat" or "plan": what a call takes where the round does not."""
        flat = self.forced == FLAT or (self.forced is None and self.flat_from.get(op, math.inf) <= nbytes <= self.flat_until)
        return FLAT if flat and self.flat and every_rank_on_host and checked else PLAN

    def describe(self) -> list[str]:
        """The link costs and the plan each op takes by size, as lines for a header."""
        limits = ", ".join(f"{op} <= {size:,} B" for op, size in self.small_bytes.items() if size >= 0) or "none"
        unmeasured = "one host, not measured" if self.shared_memory else "small_bytes option"
        measured = self.link.describe() if self.link else unmeasured
        hops = "one hop" if self.one_hop else "three hops"
        lines = [f"cost model: {measured}", f"small-message round ({hops}) for: {limits}"]
        if self.flat:
            sizes = ", ".join(f"{op} >= {size:,.0f} B" for op, size in self.flat_from.items() if size < math.inf)
            sizes += f" (up to {self.flat_until:,.0f} B)" if sizes and self.flat_until < math.inf else ""
            given = "every call checked there too" if self.shared_memory else "flat=on"
            how = self.flat_link.describe() if self.flat_link else given
            library = "shared memory" if self.shared_memory else "Gloo"
            lines.append(f"flat {library} over every rank ({how}) for: {sizes or 'none'}")
        for op, by_size in self.races.items():
            rungs = "; ".join(f"{size:,} B " + " ".join(f"{plan} {seconds * 1e3:.1f}" for plan, seconds in times.items())
                              for size, times in sorted(by_size.items()))
            lines.append(f"raced {op} (ms, fastest call's slowest rank): {rungs}")
        return lines


def incompressible(count: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``count`` host values in [0, 1) that a border codec cannot shrink (random mantissas,
    fixed seed): probes of zeros timed the codec's compressed messages, not the link (the
    round's rate read as the 10 GB/s cap, and it took 4 MiB ops where it lost)."""
    return torch.rand(count, dtype=dtype, generator=torch.Generator().manual_seed(count))


def timed(op: Callable[[], None], rounds: int) -> list[float]:
    """Seconds each of ``rounds`` calls of ``op`` took."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return times


def _probes(broadcasts: list[Callable[[torch.Tensor], None]], rounds: int) -> list[dict[int, list[float]]]:
    """Timed broadcasts of each probe size by each of ``broadcasts``, taken in turn round by
    round, so that what else loads the machine meanwhile weighs on each alike."""
    probes = {size: incompressible(size // 8) for size in PROBE_BYTES}
    times: list[dict[int, list[float]]] = [{size: [] for size in PROBE_BYTES} for _ in broadcasts]
    for _ in range(rounds):
        for size, probe in probes.items():
            for fn, out in zip(broadcasts, times):
                out[size] += timed(lambda: fn(probe), 1)
    return times


def shared_memory(topology: Topology, check_calls: bool = True, strict: bool = False, rank: int = 0,
                  routed: frozenset[int] = frozenset(), one_host: Optional[OneHost] = None) -> Planner:
    """The plan choice of a group on one host (shm.py, ``one_host``): no round, the flat plan at
    every size for CPU tensors (no socket is faster than shared memory), the hierarchical one
    for devices."""
    return Planner(topology, dict.fromkeys(costs.OPS, -1), True, dict.fromkeys(costs.OPS, 0.0),
                   shared_memory=True, check_calls=check_calls, strict=strict, rank=rank, routed=routed,
                   one_host=one_host)


def agreed_costs(planner: Planner) -> dict:
    """What :func:`calibrate` agreed, as a JSON record (infinities as None): what a group
    re-formed on the same topology applies instead of racing again (:func:`apply_costs`)."""
    finite = lambda x: None if x == math.inf else x  # noqa: E731
    link = lambda c: None if c is None else [c.hop_s, c.bytes_per_s]  # noqa: E731
    return {"small_bytes": dict(planner.small_bytes), "flat_until": finite(planner.flat_until),
            "flat_from": {op: finite(size) for op, size in planner.flat_from.items()},
            "link": link(planner.link), "flat_link": link(planner.flat_link)}


def apply_costs(planner: Planner, record: Mapping, flat: bool) -> None:
    """Set ``planner`` from an :func:`agreed_costs` record (``flat``: a flat library exists)."""
    infinite = lambda x: math.inf if x is None else x  # noqa: E731
    link = lambda pair: None if pair is None else costs.LinkCosts(*pair)  # noqa: E731
    planner.flat = flat
    planner.small_bytes = dict(record["small_bytes"])
    planner.flat_from = {op: infinite(size) for op, size in record["flat_from"].items()}
    planner.flat_until = infinite(record["flat_until"])
    planner.link, planner.flat_link = link(record["link"]), link(record["flat_link"])


def calibrate(planner: Planner, small_bytes: Optional[int], flat_mode: str, flat_broadcast: Optional[Callable],
              barrier: Callable[[], None], broadcast: Callable[[torch.Tensor], None],
              synchronize: Callable[[torch.Tensor], None], allreduce: Callable[[torch.Tensor, str], None],
              probe_calls: Callable[[int], dict[str, Callable[[], None]]]) -> None:
    """Set the group's planner: thresholds from the ``small_bytes`` option, else from costs
    measured now on every rank and agreed (``allreduce(t, "max")``: the slowest rank's), so
    that every rank plans alike: timed rows-only rounds and small-round broadcasts through the
    group's own ``barrier`` and ``broadcast`` (the link), the flat library's broadcasts
    (``flat_broadcast``), then each op of ``probe_calls`` raced by its candidate plans up a
    ladder of sizes (each call's time on its slowest rank: one rank's view of a close race is
    noise). The round's threshold and the flat plan's start are where their races were won;
    the model's line fills in below the ladder."""
    topology = planner.topology
    planner.flat = flat_broadcast is not None
    planner.flat_from = dict.fromkeys(costs.OPS, 0.0 if flat_mode == "on" else math.inf)
    if small_bytes is not None or topology.world_size == 1:
        planner.small_bytes = dict.fromkeys(costs.OPS, small_bytes or 0)
        return
    planner.small_bytes = dict.fromkeys(costs.OPS, costs.MAX_SMALL_BYTES)  # the probes go by the small round
    measure_flat = planner.flat and flat_mode == "auto"
    planner.forced = ROUND  # the link is timed by the round's broadcasts, whatever the options
    try:
        hops = timed(barrier, PROBE_ROUNDS + 1)[1:]
        probes = _probes([broadcast, flat_broadcast] if measure_flat else [broadcast], PROBE_ROUNDS)
    finally:
        planner.forced = None
    measured = costs.measure(hops, probes[0], topology, planner.one_hop)
    numbers = [measured.hop_s, 1 / measured.bytes_per_s]
    if measure_flat:
        tiny = torch.zeros(1, dtype=torch.float64)
        flat_hops = timed(lambda: flat_broadcast(tiny), PROBE_ROUNDS + 1)[1:]
        flat_link = costs.measure_flat(probes[1], topology.world_size, flat_hops)
        numbers += [flat_link.hop_s, 1 / flat_link.bytes_per_s, min(probes[1][max(PROBE_BYTES)])]
    # every rank's costs, the worst of each agreed: an op ends on its last rank (a root's own
    # time ends when its sends are buffered, and read 10 GB/s where its receivers saw 3-5)
    agreed = torch.tensor(numbers, dtype=torch.float64)
    allreduce(agreed, "max")
    synchronize(agreed)  # an emulated device lands it later
    values = agreed.tolist()
    planner.link = costs.LinkCosts(values[0], 1 / values[1])
    if len(values) > 2:
        planner.flat_link = costs.LinkCosts(values[2], 1 / values[3])
    sizes = _ladder(topology, planner.link, values[4] if len(values) > 2 else None, planner.one_hop)
    round_lost = _run_ladder(planner, sizes, measure_flat, functools.partial(_race, probe_calls, planner, barrier,
                                                                             allreduce, synchronize))
    if measure_flat and max(sizes) < max(OP_PROBE_BYTES):
        # the rungs shrank for a slow flat library: a win there is latency, not bandwidth, and
        # is not extrapolated (on a 1 Gbit/s link the flat broadcast won at 1-2 MiB and ran at
        # 0.4x of the hierarchical plan at 16 MiB)
        planner.flat_until = float(max(sizes))
    taken = [op for op, size in planner.flat_from.items() if size < math.inf]
    model = costs.thresholds(topology, planner.link, planner.flat_link, taken, planner.one_hop)
    raced = [size for size in sizes if size <= costs.MAX_SMALL_BYTES]
    planner.small_bytes = {op: _round_limit(model[op], round_lost[op], raced) for op in costs.OPS}


def _ladder(topology: Topology, link: costs.LinkCosts, flat_broadcast_s: Optional[float],
            one_hop: bool = False) -> list[int]:
    """The sizes each op is raced at: the round probe sizes whose calls the model says fit
    ``ROUND_PROBE_BUDGET_S``, and the op probe sizes, scaled down where the flat library is
    slow (``flat_broadcast_s`` for the largest broadcast probe) never below the smallest
    broadcast probe (none without a flat library)."""
    calls = len(costs.OPS) * (OP_PROBE_ROUNDS + 1) * 3
    sizes = {size for size in ROUND_PROBE_BYTES
             if calls * costs.round_seconds(topology, link, size, one_hop) <= ROUND_PROBE_BUDGET_S}
    if flat_broadcast_s is not None:
        calls = len(costs.OPS) * (OP_PROBE_ROUNDS + 1) * 2 * sum(OP_PROBE_BYTES) / max(PROBE_BYTES)
        scale = min(OP_PROBE_BUDGET_S / max(calls * flat_broadcast_s, 1e-9), 1.0)
        sizes |= {int(max(size * scale, min(PROBE_BYTES))) for size in OP_PROBE_BYTES}
    return sorted(sizes)


def _run_ladder(planner: Planner, sizes: list[int], flat: bool,
                race: Callable[[int, dict[str, tuple[str, ...]]], dict[str, dict[str, float]]]) -> dict[str, float]:
    """Race each op up the ladder: the round while it has not lost (up to its cap), and
    the hierarchical plan against the flat one (``flat``: measured) at every rung. The flat
    plan is taken (``planner.flat_from``) from the lowest rung from which it won every race
    to the top: on a slow border it wins small broadcasts and loses large ones. Returns the
    size where each op's round first lost (inf: never)."""
    round_lost = dict.fromkeys(costs.OPS, math.inf)
    flat_won: dict[str, list[tuple[int, bool]]] = {op: [] for op in costs.OPS}
    for size in sizes:
        entrants = {}
        for op in costs.OPS:
            beyond = (PLAN, FLAT) if flat else (planner.beyond_round(op, size),)
            alive = round_lost[op] == math.inf and size <= costs.MAX_SMALL_BYTES
            if alive or len(beyond) > 1:
                entrants[op] = ((ROUND,) if alive else ()) + beyond
        if not entrants:
            break
        for op, seconds in race(size, entrants).items():
            planner.races.setdefault(op, {})[size] = seconds
            if ROUND in seconds and min(seconds, key=seconds.get) != ROUND:
                round_lost[op] = float(size)
            if flat:
                flat_won[op].append((size, seconds[FLAT] < seconds[PLAN]))
    for op, wins in flat_won.items():
        from_size = math.inf
        for size, won in reversed(wins):
            if not won:
                break
            from_size = float(size)
        if wins:
            planner.flat_from[op] = from_size
    return round_lost


def _race(probe_calls: Callable[[int], dict[str, Callable[[], None]]], planner: Planner,
          barrier: Callable[[], None], allreduce: Callable[[torch.Tensor, str], None],
          synchronize: Callable[[torch.Tensor], None], size: int,
          entrants: dict[str, tuple[str, ...]]) -> dict[str, dict[str, float]]:
    """Each op's plans raced at ``size``: ``OP_PROBE_ROUNDS`` timed calls each (after one
    untimed), the plans taken in turn, every call started together (a barrier); a call takes
    its slowest rank's time (an op ends on its last rank: a root's own time ends when its sends
    are buffered, so a sum over ranks favoured rooted and flat ops by what their first ranks
    did not wait), and a plan its fastest call (not the model's crossover: between its probes
    its line is extrapolated, and has picked plans where they lost)."""
    calls, names = probe_calls(size), (ROUND, PLAN, FLAT)
    times = [_timed_calls(planner, barrier, calls[op], plans) for op, plans in entrants.items()]
    seconds = torch.tensor([[mine.get(plan, [0.0] * OP_PROBE_ROUNDS) for plan in names] for mine in times],
                           dtype=torch.float64)
    allreduce(seconds, "max")
    synchronize(seconds)
    fastest = seconds.min(dim=2).values.tolist()
    return {op: {plan: row[names.index(plan)] for plan in plans}
            for (op, plans), row in zip(entrants.items(), fastest)}


def _timed_calls(planner: Planner, barrier: Callable[[], None], call: Callable[[], None],
                 plans: tuple[str, ...]) -> dict[str, list[float]]:
    """Each plan's ``OP_PROBE_ROUNDS`` timed calls of ``call`` on this rank, after one
    untimed, each after a barrier."""
    times: dict[str, list[float]] = {plan: [] for plan in plans}
    try:
        for warm in [True] + [False] * OP_PROBE_ROUNDS:  # a first call allocates: not timed
            for plan in plans:
                planner.forced = None  # the barrier goes its own way
                barrier()
                planner.forced = plan
                seconds = timed(call, 1)[0]
                if not warm:
                    times[plan].append(seconds)
    finally:
        planner.forced = None
    return times


def _round_limit(model: int, lost_at: float, sizes: list[int]) -> int:
    """An op's round threshold: the last timed size the round won before it first lost (it
    lost at the first: the model's, below that size); never lost: the model's or the last
    timed size, the larger."""
    won = [size for size in sizes if size < lost_at]
    if lost_at == math.inf:
        return max([model, *won])
    return won[-1] if won else min(model, sizes[0] // 2)
