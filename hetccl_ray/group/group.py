"""HetCCLGroup: Ray's ``BaseGroup`` for islands of mixed vendors joined by a border.

Rendezvous (KV records -> topology -> border + island communicators); then the Ray door
turns each call into an ``Op`` record (``op.py``), and every op goes through one wrapper
(:meth:`HetCCLGroup.run`) that owns sequence numbers, deadlines, counters, error state and
stream order and takes the plan the record and the agreed data choose; the plans in
``collectives.py`` do the moving. A host message, which has no plan to choose, is posted straight
over the border under the same state (:meth:`_post`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import ray
import torch
import torch.distributed as dist
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import (AllGatherOptions, AllReduceOptions, BarrierOptions, BroadcastOptions,
                                       ReduceOp, ReduceOptions, ReduceScatterOptions)

from hetccl_ray.memory import devices
from hetccl_ray.group import hello
from hetccl_ray.runtime import collectives, small_round
from hetccl_ray.core import planner
from hetccl_ray.islands import shm
from hetccl_ray.runtime.runner import PlanContext, ScratchPool
from hetccl_ray.core.costs import LinkCosts
from hetccl_ray.core.calls import ROW_WIDTH, Call, disagreement
from hetccl_ray.transport.direct import DirectChannel
from hetccl_ray.group.formation import form
from hetccl_ray.islands.libraries import IslandComm, make_island
from hetccl_ray.core.op import Op, OpBuilder, Reduce
from hetccl_ray.group.options import GroupOptions
from hetccl_ray.group.progress import Progress
from hetccl_ray.memory.buffers import copy
from hetccl_ray.group.rendezvous import StoreRendezvous, get_raw, options_key, release
from hetccl_ray.core.tensors import Operand
from hetccl_ray.errors import (HetCCLBrokenError, HetCCLError, HetCCLInputError, HetCCLMismatchError,
                               HetCCLPeerError, HetCCLTimeoutError)
from hetccl_ray.transport.base import mismatch
from hetccl_ray.transport.choice import Choice

logger = logging.getLogger(__name__)
_COSTS: dict[str, dict] = {}  # costs agreed at formations rank 0 of this process took part in, by _costs_key
_DONE: Callable[[], None] = lambda: None  # noqa: E731 - the wait of an op that has completed

BACKEND = "HETCCL"


_RAY_REDUCE = {ReduceOp.SUM: Reduce.SUM, ReduceOp.PRODUCT: Reduce.PRODUCT, ReduceOp.MIN: Reduce.MIN,
               ReduceOp.MAX: Reduce.MAX}


def _reduce(options: Any) -> Reduce:
    """The reduce op of Ray's options object, as the core's own."""
    op = getattr(options, "reduceOp", ReduceOp.SUM)
    if op not in _RAY_REDUCE:
        raise HetCCLInputError(f"unsupported reduce op {op!r}; supported: SUM, PRODUCT, MIN, MAX")
    return _RAY_REDUCE[op]


def _pinned(cls: type, **fields: Any) -> Any:
    """An options object whose fields are its own: Ray's module-level calls set options on the
    class (``opts = types.AllReduceOptions; opts.reduceOp = op``), so ``cls()`` alone drifts
    with whatever op or root the process called last (the group's own calls would disagree)."""
    options = cls()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


class HetCCLGroup(BaseGroup):
    """A Ray collective group over vendor islands: ``backend="hetccl"``."""

    def __init__(self, world_size: int, rank: int, group_name: str, *, store: Optional[dist.Store] = None,
                 options: Optional[GroupOptions] = None) -> None:
        """Form the group. Ray's collective API passes the first three; torch.distributed's
        backend passes its c10d ``store`` (records and island stores go there, not to Ray)."""
        super().__init__(world_size, rank, group_name)
        in_ray = ray.is_initialized()
        if store is None and not in_ray:
            raise HetCCLError(f"group '{group_name}': a hetccl group forms through Ray (call it from a Ray "
                              "actor) or through a torch.distributed store (init_process_group('hetccl'))")
        self.options = options or (GroupOptions() if store is not None
                                   else GroupOptions.from_json(get_raw(options_key(group_name))))
        self._lock = threading.Lock()
        self._seq = 0
        self._p2p_seq: dict[tuple, int] = defaultdict(int)
        self._broken: Optional[BaseException] = None
        self._scratch = ScratchPool()
        self._pipeline = ThreadPoolExecutor(1, thread_name_prefix=f"hetccl-pipeline-{rank}")
        self._islands: dict[str, IslandComm] = {}
        self._streams: dict[devices.Device, devices.StreamLike] = {}
        self._sent_by_op: dict[str, int] = defaultdict(int)
        self.last_op_bytes_sent = 0
        self._agreed: set[int] = set()  # device classes a check showed every rank on (one-island fast path)
        self._met: set[tuple[int, int]] = set()  # (island peer, device class) both ends showed in a hello
        try:
            formed = form(world_size, rank, group_name, self.options, store)
        except HetCCLError:
            self._pipeline.shutdown()
            raise
        self.topology, self.border, self.transports = formed.topology, formed.border, formed.transports
        self.ops = OpBuilder(group_name, self.topology, rank, self._scratch)  # what the doors build their calls with
        self.direct = DirectChannel(formed.direct, group_name, rank, self.options.timeout_s)
        self._rendezvous, self._store, self._store_address = formed.rendezvous, formed.store, formed.store_address
        self._one_host = formed.one_host
        self._routed = frozenset(self.border.routed_peers)
        self._island_peers = frozenset(self.island.ranks) - {rank}  # whose first message on a class needs a hello
        for peer, choice in self.lane_transports().items():
            logger.info("hetccl group '%s' rank %d -> rank %d: %s (%s)", group_name, rank, peer, choice.transport,
                        choice.why)
        self._progress = Progress(self._rendezvous, rank)
        self._island_for(devices.HOST)
        self._calibrate()
        logger.info("hetccl group '%s' rank %d: %s", group_name, rank, self.topology.describe())

    def _calibrate(self) -> None:
        """The planner (planner.py): the flat library where it may run (``flat`` option,
        several islands), the small-round thresholds and the flat plan's sizes, from the
        options or measured now; then numbering and counters start for the user's ops."""
        self._probe_bytes, self._probe_messages = (0, 0, 0, 0), 0
        flat = self.options.flat != "off" and len(self.topology.islands) > 1
        self._flat = self._flat_library() if flat else None
        self._shared = self._flat if isinstance(self._flat, shm.ShmLibrary) else None
        if self._shared is not None:  # one host: every call checked and CPU data moved in shared memory
            self.planner = planner.shared_memory(self.topology, self.options.check_calls, self.options.strict,
                                                 self.rank, self._routed, self._shared)
            return
        self.planner = planner.Planner(self.topology, one_hop=self.options.one_hop,
                                       check_calls=self.options.check_calls, strict=self.options.strict,
                                       rank=self.rank, routed=self._routed)
        key = self._costs_key()
        known = self._known_costs(key)
        if known is not None:  # re-formed on a topology rank 0 measured before: no races
            planner.apply_costs(self.planner, known, self._flat is not None)
        else:
            planner.calibrate(self.planner, self.options.small_bytes, self.options.flat,
                              (lambda t: self._flat.broadcast(t, 0)) if self._flat is not None else None,
                              self.barrier, self.broadcast,
                              lambda t: devices.synchronize(t, self.options.timeout_s),
                              lambda t, op: self.run(self.ops.allreduce(t, Reduce(op))),
                              self._probe_calls)
            if self.rank == 0:
                _COSTS[key] = planner.agreed_costs(self.planner)
        # the probes are not the user's ops: numbering and counters start after them (every
        # message of theirs was received in order before a rank's next op can arrive)
        self._seq = self._progress.seq = 0
        self._sent_by_op.clear()
        self._agreed.clear()  # the probes were on host memory: the user's first op on any class is checked
        self._probe_messages = self.border.messages_sent
        self._probe_bytes = (self.border.bytes_sent, self.border.bytes_received, self.border.wire_bytes_sent,
                             self.border.wire_bytes_received)

    def _costs_key(self) -> str:
        """What measured costs hold for: the islands in rank order, their links (which peers
        RDMA reaches), one host or not, and the options that shape calibration."""
        options = self.options
        return repr((self.topology.describe(), sorted(self._routed), self._one_host is not None, options.flat,
                     options.small_bytes, options.one_hop, options.compress))

    def _known_costs(self, key: str) -> Optional[dict]:
        """Rank 0's costs for ``key`` from an earlier formation in its process (torchft re-forms
        the group at every quorum change), through the rendezvous so every rank takes the same
        choice; None where rank 0 has none (it calibrates, and remembers)."""
        if not self.options.reuse_costs:
            return None
        if self.rank == 0:
            self._rendezvous.put("costs", {"key": key, "costs": _COSTS.get(key)})
        record = self._rendezvous.wait(["costs"], time.monotonic() + self.options.timeout_s)["costs"]
        return record["costs"] if record["key"] == key else None

    def _probe_calls(self, nbytes: int) -> dict[str, Callable[[], None]]:
        """One call of each op the flat plan may take, on ``nbytes`` (nccl-tests' size) of host
        values a codec cannot shrink: what the planner times to choose between the flat and
        the hierarchical plan."""
        whole = planner.incompressible(nbytes // 4 // self.world_size * self.world_size, torch.float32)
        parts = list(whole.chunk(self.world_size))
        part = parts[0].clone()
        return {"allreduce": lambda: self.allreduce(whole), "reduce": lambda: self.reduce(whole),
                "broadcast": lambda: self.broadcast(whole), "allgather": lambda: self.allgather([parts], [part]),
                "reducescatter": lambda: self.reducescatter([part], [parts])}

    def _flat_library(self) -> IslandComm:
        """Shared memory where every rank shares this host, else Gloo, over every rank ranked
        in island-major order (the layout of per-rank chunks), so that its one-island plans
        run on the group's buffers as they are."""
        order = self.topology.island_major_order  # the library's ranks, by their group rank
        rank = order.index(self.rank)
        shared = (shm.ShmLibrary.create(self._store_of("shm"), rank, self.world_size, ROW_WIDTH + 2 * self.world_size,
                                        self.options.timeout_s, self.border.gone, order)
                  if self._one_host else None)
        return shared or self._library(devices.HOST, "flat", rank, self.world_size)

    @property
    def small_bytes(self) -> dict[str, int]:
        """Per op, the largest buffer (nccl-tests' size) that takes the small round."""
        return self.planner.small_bytes

    @property
    def link(self) -> Optional[LinkCosts]:
        """The border's hop and per-rank bandwidth measured and agreed at formation (None where
        nothing was measured: every rank on one host, or ``small_bytes`` given)."""
        return self.planner.link

    def plan_of(self, op: str, nbytes: int, every_rank_on_host: bool = True, peer: Optional[int] = None) -> str:
        """Which plan a call of ``op`` on ``nbytes`` (nccl-tests' size) takes (``Planner.plan_of``)."""
        return self.planner.plan_of(op, nbytes, every_rank_on_host, self.options.check_calls, peer)

    def cost_model(self) -> list[str]:
        """The link costs, the plan each op takes by size and this island's library for CPU
        tensors, as lines for a header."""
        island = self.island
        return [*self.planner.describe(),
                f"island {island.name} ({island.size} rank(s)): {self._island_for(devices.HOST).library} for CPU tensors"]

    def __repr__(self) -> str:
        return (f"HetCCLGroup(name={self.group_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"{self.topology.describe()})")

    @classmethod
    def backend(cls) -> str:
        return BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_available() and dist.is_gloo_available()

    @property
    def island(self):
        """This rank's island (name, index, ranks)."""
        return self.topology.island_of(self.rank)

    def lane_transports(self) -> dict[int, Choice]:
        """The transport to each peer of this rank's lane in other islands (none off-lane)."""
        lane = self.topology.lane_of(self.rank)
        if lane is None:
            return {}
        return {peer: self.transports[peer] for peer in self.topology.lane_peers(lane) if peer != self.rank}

    def _island_for(self, device: devices.Device) -> IslandComm:
        """This rank's island communicator for buffers on ``device`` (made on first use: every
        island rank makes it at the same op, since ranks of one island agree on the device):
        host memory of an island whose ranks share a host in shared memory (shm.py), else the
        device's library. Shared memory only where every island op follows a check that agreed
        the calls (several islands, calls checked): its steps cannot tell two different calls
        apart, where the vendor library waits for the other until the deadline, which then
        names them."""
        if device.kind not in self._islands:
            island, rank, name = self.island, self.topology.local_rank(self.rank), f"{self.island.name}/{device.kind}"
            checked = self.options.check_calls and len(self.topology.islands) > 1
            shared = (shm.ShmLibrary.create(self._store_of(f"{name}/shm"), rank, island.size, 1, self.options.timeout_s,
                                            self.border.gone, island.ranks, pull=False)
                      if device.shares_host_memory and island.size > 1 and self.options.same_host and checked
                      else None)
            self._islands[device.kind] = shared or self._library(device, name, rank, island.size)
        return self._islands[device.kind]

    def _library(self, device: devices.Device, name: str, rank: int, size: int) -> IslandComm:
        """A vendor communicator of ``size`` ranks named ``name`` in this group's store."""
        if size == 1:  # a lone rank needs no store connection
            return make_island(device, None, 0, 1, self.options.timeout_s)
        return make_island(device, self._store_of(name), rank, size, self.options.timeout_s, self.border.address[0],
                           getattr(device, "device", None))

    def _store_of(self, name: str) -> dist.Store:
        """The part of the group's c10d store where the communicator ``name`` meets."""
        if self._store is None:
            self._store = dist.TCPStore(*self._store_address, None, False,
                                        timeout=datetime.timedelta(seconds=self.options.timeout_s))
        return dist.PrefixStore(f"{self._rendezvous.prefix}{name}", self._store)

    def border_stats(self) -> dict[str, Any]:
        """Bytes this rank sent/received over the border, in all and per op, and on the wire
        (fewer where compressed); each link's compression choice, ratio and measured speeds;
        the transport to each lane peer; how GPU tensors reach an RDMA NIC. ``direct``: what the
        group's direct transfers (Ray Direct Transport, the bridge) moved on their own channel,
        outside the ops and the counters above."""
        sent, received, wire_sent, wire_received = self._probe_bytes  # formation's probes aren't the user's
        direct = self.direct.border
        return {"bytes_sent": self.border.bytes_sent - sent,
                "bytes_received": self.border.bytes_received - received,
                "wire_bytes_sent": self.border.wire_bytes_sent - wire_sent,
                "wire_bytes_received": self.border.wire_bytes_received - wire_received,
                "compression": self.border.compression(),
                "last_op_bytes_sent": self.last_op_bytes_sent, "per_op": dict(self._sent_by_op),
                "messages_sent": self.border.messages_sent - self._probe_messages,
                "rejected_connections": self.border.rejected,
                "transports": {peer: choice.transport for peer, choice in self.lane_transports().items()},
                "gpu_memory": {"rdma": self.border.device_paths, "tcp": "staged"} if self.border.routed_peers
                else "staged",
                "direct": {"bytes_sent": direct.bytes_sent, "bytes_received": direct.bytes_received,
                           "wire_bytes_sent": direct.wire_bytes_sent, "wire_bytes_received": direct.wire_bytes_received,
                           "messages_sent": direct.messages_sent}}

    # -- the one wrapper every op goes through ---------------------------------------------------

    def run(self, op: Op, choice: Optional[planner.Choice] = None) -> Callable[[], None]:
        """Run one op (a door's ``Op`` record) under the group's sequence number, deadline, error
        state and stream order, as the planner chooses (``choice``: made already, a message's);
        returns its wait: a host message posted straight (:meth:`_post`) completes there, every
        other op has completed on return.

        A rank that called something else (or ranks of one island on different device
        classes) is named on every rank before any user buffer is written, and the group
        stays usable. Device buffers (devices.py): the op's side stream waits for the caller's
        current stream at entry, device work goes on the side stream, and at exit the caller's
        stream waits for the op: the host returns without waiting for the device.
        """
        tensor = op.tensor
        device = devices.of(tensor) if tensor is not None else devices.HOST
        device.refuse_capture(f"{op.name} in group '{self.group_name}' on rank {self.rank}")
        with self._lock:
            self._raise_if_broken()
            if op.peer is None:
                self._seq += 1
                seq = self._seq
            else:
                seq = self._next_p2p_seq(op.name, op.peer, op.tag)
            call = op.call = op.call.numbered(seq, device.code)
            choice = choice or self.planner.choose(op, device.host, device.code in self._agreed)
            if choice.path == planner.POSTED:
                return self._post(op, seq)
            if op.peer is None:
                self._progress.start(seq, call)  # what a timed-out peer reads: which op, which call
            before_bytes = self.border.bytes_sent
            stream = self._stream_of(device)
            ctx = PlanContext(self.topology, self.rank, collectives.LazyIsland(lambda: self._island_for(device)),
                              self.border, call.tag(), time.monotonic() + self.options.timeout_s, self._scratch,
                              self._pipeline, self.options.piece_bytes, self.border.default, device, stream,
                              shared=self._shared, one_hop=self.planner.one_hop)
            try:
                with device.ordered(stream):
                    problem = self._dispatch(ctx, op, choice)
            except (HetCCLError, RuntimeError) as exc:
                raise self._break(exc, self._where(call.op, seq), seq, op.peer) from exc
            finally:
                self.last_op_bytes_sent = self.border.bytes_sent - before_bytes
                self._sent_by_op[call.op] += self.last_op_bytes_sent
            if problem is not None:  # every rank saw every call and no user buffer changed: still usable
                raise HetCCLMismatchError(f"{self._where(call.op, seq)}: mismatched call: {problem}")
        return _DONE

    def _where(self, op: str, seq: int) -> str:
        """The op of an error (made only on error): what, which call (a message's tag, in the
        high bits of its number, too), which group and rank."""
        tag = seq >> 32
        return (f"{op} #{seq & 0xFFFFFFFF}{f' (tag {tag})' if tag else ''} in group '{self.group_name}' "
                f"on rank {self.rank}")

    def _break(self, exc: BaseException, where: str, seq: int, peer: Optional[int]) -> HetCCLError:
        """With the lock held: the group is broken by ``exc`` (the first failure stays) and its
        border closed, so peers blocked on this rank fail now, not at their deadline; returns
        the error to raise."""
        self._broken = self._broken or self._explain(exc, where, seq, peer)
        self.border.close()
        return self._broken

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise HetCCLBrokenError(f"group '{self.group_name}' is broken by an earlier failure "
                                    f"({self._broken}); destroy and re-create it") from self._broken

    def _dispatch(self, ctx: PlanContext, op: Op, choice: planner.Choice) -> Optional[str]:
        """Run ``op`` the way the planner chose (``Planner.choose``: from the call, the topology,
        the agreed thresholds and the device classes checks showed); returns who disagrees
        (None: the op ran). Device buffers go through host memory for the round."""
        problem = None
        ctx.host_path, ctx.route = choice.host_path, choice.route
        for into, source in op.copy_in:
            ctx.launch(copy, into, source)
        if choice.path in (planner.DIRECT, planner.VENDOR):
            if op.moves:
                self._plan(ctx, op)
        elif choice.path == planner.SMALL:
            problem = self._staged(ctx, op, choice.plan)
        else:
            if choice.offers:
                self._shared.ahead(op.offered, pull=op.agrees_counts)
            if choice.path == planner.CHECKED:
                problem = self._check(ctx, op)
            if problem is None and op.moves:
                if self.planner.flat_with(choice, ctx.rows):
                    ctx.flat = self._flat
                self._plan(ctx, op)
        if problem is None:
            for into, source in op.copy_out:
                ctx.launch(copy, into, source)
            for operand in op.written:
                ctx.launch(operand.write_back)
            if choice.path == planner.CHECKED or choice.plan == planner.ROUND:  # its rows showed every rank's class
                self._agreed.add(ctx.device.code)
        return problem

    @staticmethod
    def _check(ctx: PlanContext, op: Op) -> Optional[str]:
        """The rows-only round; an all-to-all's also agrees every rank's block sizes (``op.counts``),
        its host blocks going ahead over the border meanwhile (on one host, after it)."""
        if not op.agrees_counts:
            return small_round.check(ctx, op.call)
        inputs, outputs = op.blocks
        op.ahead = collectives.SentAhead(ctx, inputs) if ctx.shared is None else None
        problem, op.counts = small_round.alltoall_counts(ctx, op.call, [t.numel() for t in (*inputs, *outputs)], op.ahead)
        if problem is not None and op.ahead is not None:
            op.ahead.wait()  # every receiver drains what came ahead
        return problem

    def _plan(self, ctx: PlanContext, op: Op) -> None:
        """The op's plan: a collective's over its buffer, an all-to-all's routes, a message."""
        if op.blocks is not None:
            largest = max(map(sum, op.counts)) * op.blocks[0][0].element_size()
            collectives.alltoall(ctx, self.planner.alltoall(ctx.rows, largest, ctx.host_path), op.counts, *op.blocks,
                                 op.ahead)
        elif op.peer is not None:
            (collectives.send if op.name == "send" else collectives.recv)(ctx, op.buf, op.peer)
        else:
            collectives.collective(ctx, op.name, op.buf, max(op.call.root, 0), op.call.reduce, op.out)

    def _stream_of(self, device: devices.Device) -> Optional[devices.StreamLike]:
        """The group's side stream on ``device`` (None for host memory)."""
        if device not in self._streams:
            self._streams[device] = device.new_stream()
        return self._streams[device]

    @staticmethod
    def _small(ctx: PlanContext, call: Call, plan: str, *bufs: torch.Tensor) -> Optional[str]:
        """A small ``plan`` on host buffers: the op's round (the call rows inside: who
        disagrees, or None), or a broadcast in two hops with no rows."""
        if plan == planner.TWO_HOP:
            collectives.two_hop_broadcast(ctx, bufs[0], call.root)
            return None
        return small_round.small(ctx, call, *bufs)

    def _staged(self, ctx: PlanContext, op: Op, plan: str) -> Optional[str]:
        """The small ``plan`` on host copies of device buffers (as is for host ones): wait for
        the stream, copy down, run it, launch the copies back up."""
        staged = op.staged
        if ctx.host_path:
            return self._small(ctx, op.call, plan, *staged)
        hosts = [self._scratch.host(("staged", i), t, ctx.device) for i, t in enumerate(staged)]
        for host, t in zip(hosts, staged):
            ctx.launch(devices.stage_out, host, t)
        ctx.host_wait()
        # the round's landings are host work on host copies: launched on the stream they would run
        # after its next send had read the buffer they fill (a leader sent its island's total unfolded)
        problem = self._small(dataclasses.replace(ctx, device=devices.HOST, stream=None), op.call, plan, *hosts)
        if problem is None:
            for host, t in zip(hosts, staged):
                ctx.launch(devices.land, t, host, None)
        return problem

    def _explain(self, exc: BaseException, where: str, seq: int, peer: Optional[int]) -> HetCCLError:
        """The error to raise: what failed, where, and which ranks did not arrive."""
        text = str(exc)
        if isinstance(exc, HetCCLMismatchError):
            return HetCCLMismatchError(f"{where}: mismatched call: {text}")
        other = None
        if peer is not None:
            missing = [peer]
        else:
            self._progress.publish()
            seen = self._progress.seen(self.world_size)
            missing = [r for r, (at, _) in seen.items() if at < seq and r != self.rank]
            here = {r: Call.decode(row) for r, (at, row) in seen.items() if at == seq and row}
            other = disagreement(here, [island.ranks for island in self.topology.islands]) if len(here) > 1 else None
        arrival = f"ranks that did not arrive: {missing}"
        if isinstance(exc, HetCCLTimeoutError) and other is not None:  # they arrived, at another call or class
            return HetCCLMismatchError(f"{where}: mismatched call, found when it timed out after "
                                       f"{self.options.timeout_s:.1f}s (the ranks took different paths: the "
                                       f"calls were not checked): {other}; {arrival}")
        if isinstance(exc, HetCCLTimeoutError):
            detail = f"; waiting for rank {exc.waiting_for}" if exc.waiting_for is not None else ""
            return HetCCLTimeoutError(f"{where} timed out after {self.options.timeout_s:.1f}s (Timed out waiting "
                                      f"for peers; timeout {self.options.timeout_s:.0f} s); {arrival}{detail} ({text})")
        return HetCCLPeerError(f"{where} failed: {text}; {arrival}")

    # -- Ray's BaseGroup ops: Ray's options to the core's own types, an Op each -------------------

    def allreduce(self, tensor: Any, allreduce_options: Any = _pinned(AllReduceOptions, reduceOp=ReduceOp.SUM)) -> None:
        self.run(self.ops.allreduce(tensor, _reduce(allreduce_options)))

    def barrier(self, barrier_options: Any = BarrierOptions()) -> None:
        self.run(self.ops.barrier())

    def reduce(self, tensor: Any,
               reduce_options: Any = _pinned(ReduceOptions, reduceOp=ReduceOp.SUM, root_rank=0)) -> None:
        self.run(self.ops.reduce_to(tensor, reduce_options.root_rank, _reduce(reduce_options)))

    def broadcast(self, tensor: Any, broadcast_options: Any = _pinned(BroadcastOptions, root_rank=0)) -> None:
        self.run(self.ops.broadcast(tensor, broadcast_options.root_rank))

    def allgather(self, tensor_list: Any, tensor: Any, allgather_options: Any = AllGatherOptions()) -> None:
        self.run(self.ops.allgather(self.ops.one(tensor_list, "allgather output tensor_list"), tensor))

    def reducescatter(self, tensor: Any, tensor_list: Any,
                      reducescatter_options: Any = _pinned(ReduceScatterOptions, reduceOp=ReduceOp.SUM)) -> None:
        self.run(self.ops.reducescatter(tensor, self.ops.one(tensor_list, "reducescatter input tensor_list"),
                                        _reduce(reducescatter_options)))

    # -- beyond Ray's BaseGroup: all-to-all, gather, scatter ---------------------------------------

    def alltoall(self, tensor_list_in: Any, tensor_list_out: Any) -> None:
        """Send ``tensor_list_in[t]`` to rank t, receive ``tensor_list_out[r]`` from rank r.
        Sizes may differ per pair (MoE token routing), but what r sends t must be what t
        expects from r: a pair that disagrees is a mismatch on every rank, no data moved."""
        ins = self.ops.per_rank(tensor_list_in, "alltoall tensor_list_in", moving=True)
        outs = self.ops.per_rank(tensor_list_out, "alltoall tensor_list_out", moving=True)
        self.run(self.ops.alltoall([x.flat for x in ins], [x.flat for x in outs], written=outs))

    def gather(self, tensor: Any, gather_list: Any, root: int) -> None:
        """Every rank's ``tensor`` into ``gather_list`` (one per rank) at ``root``: the
        all-to-all plan with blocks to root only, so bytes cross the border once."""
        self.run(self.ops.gather(tensor, gather_list, root))

    def scatter(self, tensor: Any, scatter_list: Any, root: int) -> None:
        """``scatter_list[t]`` at ``root`` into rank t's ``tensor``: the all-to-all plan with
        blocks from root only."""
        self.run(self.ops.scatter(tensor, scatter_list, root))

    def recv_any(self, tensor: Any) -> int:
        """Receive ``tensor`` from whichever rank sends to this one first; returns that rank.
        CPU tensors over the TCP border (as torch's Gloo; NCCL has no any-source receive)."""
        x = Operand(self.ops.one(tensor, "recv from any source"), moving=True)
        why = self.planner.any_source(devices.of(x.flat).host)
        if why is not None:
            raise HetCCLInputError(f"group '{self.group_name}': recv from any source takes CPU tensors over the "
                                   f"TCP border; here {why}; pass the source rank")
        deadline = time.monotonic() + self.options.timeout_s
        while True:  # an island peer's first message on this class comes after its hello: answer it, look again
            expected = {peer: hello.tag(self._p2p_seq["hello", peer] + 1) if self._unmet(x.flat, peer) else
                        Call("recv", x.flat.dtype, x.numel, seq=self._p2p_seq["recv", peer] + 1).tag()
                        for peer in range(self.world_size) if peer != self.rank}
            try:
                source = self.border.default.first_arrival(expected, max(deadline - time.monotonic(), 0.0))
            except HetCCLTimeoutError as exc:
                raise HetCCLTimeoutError(f"recv from any source in group '{self.group_name}' on rank {self.rank}: "
                                         f"{exc}") from None
            if not self._unmet(x.flat, source):
                break
            self._greet("recv", self._hello(x.flat, source))
        self._p2p(self.ops.message("recv", x, source))()
        return source

    def _unmet(self, flat: torch.Tensor, peer: int) -> bool:
        """Whether a message with ``peer`` on ``flat``'s device class needs a hello first (hello.py):
        the first with an island peer on that class."""
        return peer in self._island_peers and (peer, devices.of(flat).code) not in self._met

    def _hello(self, flat: torch.Tensor, peer: int) -> Optional[hello.Hello]:
        """Post the hellos with ``peer`` where a message on ``flat``'s class needs them first."""
        if not self._unmet(flat, peer):
            return None
        code = devices.of(flat).code
        with self._lock:
            self._raise_if_broken()
            posted = hello.Hello(self.border.default, peer, self._next_p2p_seq("hello", peer), code)
            # met once the hello is posted, not once answered: each end posts one whatever else it
            # posts to that peer before it waits (a batch of sends), so both ends decide alike
            self._met.add((peer, code))
        return posted

    def _greet(self, op: str, posted: Optional[hello.Hello]) -> None:
        """Wait for the peer's hello: on another device class than this rank's, both ends name the
        mismatch and the group breaks (a message may be under way on a link the other end does
        not read)."""
        if posted is None:
            return
        try:
            problem = hello.disagreement(self.rank, op, posted.code, posted.peer,
                                         posted.theirs(self.options.timeout_s))
            if problem is not None:
                raise HetCCLMismatchError(problem)
        except (HetCCLError, RuntimeError) as exc:
            with self._lock:
                raise self._break(exc, f"{op} in group '{self.group_name}' on rank {self.rank}", 0,
                                  posted.peer) from exc

    def _p2p(self, op: Op, batch: bool = False) -> Callable[[], None]:
        """A send or receive through :meth:`run` (``batch``: posted, as torch's isend/irecv, its
        wait run later); returns its wait. An island peer's first message on a device class
        comes after a hello each way (hello.py): a message run now waits for the peer's hello
        first, a posted one with its own wait."""
        choice = self.planner.message(op, devices.of(op.buf).host, batch)
        posted = self._hello(op.buf, op.peer)  # ahead of the message on its link
        if choice.path != planner.POSTED:
            self._greet(op.name, posted)
            posted = None
        wait = self.run(op, choice)
        if posted is None:
            return wait

        def greeted() -> None:
            self._greet(op.name, posted)
            wait()

        return greeted

    def _next_p2p_seq(self, op: str, peer: int, tag: int = 0) -> int:
        """The sequence number of this rank's next ``op`` ("send"/"recv") with ``peer`` under
        ``tag``: numbered per (op, peer, tag), the tag in the high bits, so a send and a
        receive of another tag are a mismatch named on both ends, never silently paired."""
        key = (op, peer) if tag == 0 else (op, peer, tag)
        self._p2p_seq[key] += 1
        return (tag << 32) | self._p2p_seq[key]

    def post_p2p(self, op: str, tensor: Any, peer: int, tag: int = 0) -> Callable[[], None]:
        """Post a send or receive of ``tensor`` ("send"/"recv") without waiting for it, as
        torch's isend/irecv: returns the wait. Every posted transfer progresses while any is
        waited for, so a batch in which every rank sends to and receives from every other
        completes whatever the sizes. Host tensors; device ones run now."""
        return self._p2p(self.ops.p2p(op, tensor, peer, tag), batch=True)

    def _post(self, op: Op, seq: int) -> Callable[[], None]:
        """With the lock held: post a host message over the border as ``seq`` (no plan to run);
        returns its wait, under the op wrapper's error state and deadline. On one host a receive
        takes whatever its sender sent, so that a sender offering a message to pull (a larger
        one) is named as a mismatch, not misread."""
        name, buf, peer, mark = op.name, op.buf, op.peer, op.call.tag()
        flexible = name == "recv" and self.planner.route(peer, buf.nbytes, True) != planner.BORDER
        try:
            handle = (self.border.isend(peer, buf, mark) if name == "send" else
                      self.border.default.irecv(peer, buf, mark, flexible=True) if flexible else
                      self.border.irecv(peer, buf, mark))
        except (HetCCLError, RuntimeError) as exc:
            raise self._break(exc, self._where(name, seq), seq, peer) from exc
        self.last_op_bytes_sent = buf.nbytes if name == "send" else 0
        self._sent_by_op[name] += self.last_op_bytes_sent
        deadline = time.monotonic() + self.options.timeout_s

        def wait() -> None:
            try:
                handle.wait(max(deadline - time.monotonic(), 0.0))
                landed = collectives.spilled(handle, buf) if flexible else None
                if landed is not None:  # a larger message, offered to pull, or bytes of another size
                    raise mismatch(self.rank, mark, buf.nbytes, peer, mark, landed[1])
            except (HetCCLError, RuntimeError) as exc:
                with self._lock:
                    broken = self._break(exc, self._where(name, seq), seq, peer)
                raise broken from exc
            for operand in op.written:
                operand.write_back()

        return wait

    def send(self, tensor: Any, send_options: Any) -> None:
        self._p2p(self.ops.p2p("send", tensor, send_options.dst_rank))()

    def recv(self, tensor: Any, recv_options: Any) -> None:
        self._p2p(self.ops.p2p("recv", tensor, recv_options.src_rank))()

    def abort(self, why: str) -> None:
        """Fail the op in flight and every later one now, without the lock an op in flight
        holds (torchft replaces the group at a quorum change): the border closes, so peers
        blocked on this rank fail too. :meth:`destroy_group` still frees the rest."""
        self._broken = self._broken or HetCCLBrokenError(f"group '{self.group_name}' on rank {self.rank}: {why}")
        self.border.close()

    def destroy_group(self) -> None:
        """Close the border, the island communicators and the progress thread; free the scratch
        and staging memory; drop KV records."""
        self._progress.close()
        self.border.close()
        self.direct.close()
        self._pipeline.shutdown(wait=True, cancel_futures=True)
        for library in [*self._islands.values(), *([self._flat] if self._flat is not None else [])]:
            library.close()
        self._islands.clear()
        self._flat = None
        self._scratch.clear()  # staging (pinned where a GPU is) goes with the group
        for key in (f"rank/{self.rank}", f"progress/{self.rank}"):
            self._rendezvous.delete(key)
        if not isinstance(self._rendezvous, StoreRendezvous):  # any rank: rank 0 may be the one that died
            release(self.group_name, self._rendezvous.generation)  # the name is free, no direct transfer goes to it
        self._store = None
