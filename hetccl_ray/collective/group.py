"""HetCCLGroup: Ray's ``BaseGroup`` for islands of mixed vendors joined by a border.

Rendezvous (KV records -> topology -> border + island communicators), then every op goes
through one wrapper (:meth:`HetCCLGroup._run`) that owns sequence numbers, deadlines,
counters and error state; the plans in ``plans.py`` do the moving.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import ray
import torch
import torch.distributed as dist
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import (AllGatherOptions, AllReduceOptions, BarrierOptions, BroadcastOptions,
                                       ReduceOp, ReduceOptions, ReduceScatterOptions)

from hetccl_ray import devices
from hetccl_ray.collective import costs, plans, tree
from hetccl_ray.collective.runner import PlanContext, ScratchPool
from hetccl_ray.collective.calls import OP_CODES, Call
from hetccl_ray.collective.island import IslandComm, make_island
from hetccl_ray.collective.options import GroupOptions
from hetccl_ray.collective.reduction import copy
from hetccl_ray.collective.rendezvous import Rendezvous, StoreRendezvous, get_raw, options_key
from hetccl_ray.collective.tensors import Operand, dtype_code, same_kind
from hetccl_ray.errors import (HetCCLBrokenError, HetCCLError, HetCCLInputError, HetCCLMismatchError,
                               HetCCLPeerError, HetCCLTimeoutError)
from hetccl_ray.topology import Topology, island_for
from hetccl_ray.transport import verbs
from hetccl_ray.transport.base import Tag
from hetccl_ray.transport.choice import Choice, choose
from hetccl_ray.transport.rdma import RdmaBorder
from hetccl_ray.transport.routed import RoutedBorder
from hetccl_ray.transport.tcp import TcpBorder

logger = logging.getLogger(__name__)

BACKEND = "HETCCL"
_RAY_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}
_PROGRESS_PERIOD_S = 0.1
_PUBLISH_AFTER_S = 0.3  # an op running this long is published: quick ops cost no KV write
_PROBE_ROUNDS, _PROBE_BYTES = 5, (64 << 10, 1 << 20)  # formation's timed rounds for the cost model


def _generation(group_name: str) -> str:
    """Tells incarnations of one group name apart: Ray's info actor id when declared."""
    try:
        return ray.get_actor("info_" + group_name)._actor_id.hex()
    except ValueError:
        return "init"


def _default_host() -> str:
    """This host's address outside Ray: the one its hostname resolves to."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _timed(op: Callable[[], None], rounds: int) -> list[float]:
    """Seconds each of ``rounds`` calls of ``op`` took."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return times


class _Progress:
    """Publishes this rank's op once it has run ``_PUBLISH_AFTER_S`` (a rank waiting for a
    missing peer is such a rank), so a timed-out peer can name who is missing. Quick ops
    publish nothing: a KV write per op cost one-island 16 MiB allreduces 3-6% on 2 cores."""

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        self.seq, self._published, self._started = 0, -1, time.monotonic()
        self._rendezvous, self._rank = rendezvous, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"hetccl-progress-{rank}")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(_PROGRESS_PERIOD_S):
            if time.monotonic() - self._started >= _PUBLISH_AFTER_S:
                self.publish()

    def start(self, seq: int) -> None:
        """This rank starts op ``seq``."""
        self.seq, self._started = seq, time.monotonic()

    def publish(self) -> None:
        seq = self.seq
        if seq != self._published:
            self._rendezvous.put(f"progress/{self._rank}", {"seq": seq})
            self._published = seq

    def behind(self, world_size: int, seq: int) -> list[int]:
        """Ranks whose last published op is older than ``seq``."""
        time.sleep(_PUBLISH_AFTER_S + 3 * _PROGRESS_PERIOD_S)  # every rank waiting has published by then
        return [r for r in range(world_size)
                if (self._rendezvous.get(f"progress/{r}") or {"seq": 0})["seq"] < seq]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


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
        deadline = time.monotonic() + self.options.timeout_s
        if store is not None:
            self._rendezvous: Rendezvous = StoreRendezvous(store, group_name)
        else:
            self._rendezvous = Rendezvous(group_name, _generation(group_name))
        host = self.options.bind_host or (ray.util.get_node_ip_address() if in_ray else _default_host())
        self.border: Any = TcpBorder(rank, host, self.options.compress)
        self._store = store
        if store is None and rank == 0:
            self._store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
        labels = ray.get_runtime_context().get_node_labels() if in_ray else {}
        override = self.options.islands.get(rank) or os.environ.get("HETCCL_ISLAND")
        found = (verbs.discover() if self.options.transport != "tcp"
                 else verbs.Discovery((), "transport='tcp' was asked for"))
        record = {"island": island_for(override, labels, devices.local_accelerator()), "host": host,
                  "port": self.border.address[1], "world_size": world_size, "rdma": found.to_record()}
        if rank == 0:
            record.update(store_port=getattr(self._store, "port", 0), secret=secrets.token_hex(32))
        self._rendezvous.put(f"rank/{rank}", record)
        try:
            records = self._rendezvous.wait([f"rank/{r}" for r in range(world_size)], deadline)
        except HetCCLTimeoutError as exc:
            self._abandon()
            missing = sorted(int(key.split("/")[1]) for key in exc.missing)
            raise HetCCLTimeoutError(f"forming group '{group_name}' on rank {rank} timed out after "
                                     f"{self.options.timeout_s:.1f}s; ranks that did not arrive: {missing}") from None
        records = [records[f"rank/{r}"] for r in range(world_size)]
        disagree = {r: rec.get("world_size") for r, rec in enumerate(records) if rec.get("world_size") != world_size}
        if disagree:
            self._abandon()
            raise HetCCLMismatchError(f"forming group '{group_name}': rank {rank} has world_size {world_size} "
                                      f"but ranks {sorted(disagree)} have {sorted(set(disagree.values()))}")
        self.topology = Topology.from_islands([rec["island"] for rec in records], self.options.max_lanes)
        self.border.set_peers({r: (rec["host"], rec["port"]) for r, rec in enumerate(records) if r != rank},
                              bytes.fromhex(records[0]["secret"]), frozenset(self.island.ranks) - {rank})
        try:
            self.border.connect_all(max(deadline - time.monotonic(), 1.0))
            self._connect_border(found, records, deadline)
        except HetCCLError:
            self._abandon()
            raise
        self._store_address = (records[0]["host"], records[0]["store_port"])
        self._progress = _Progress(self._rendezvous, rank)
        self._island_for(devices.HOST)
        self._calibrate()
        logger.info("hetccl group '%s' rank %d: %s", group_name, rank, self.topology.describe())

    def _calibrate(self) -> None:
        """Set the small-message thresholds: from the ``small_bytes`` option, else from link
        costs measured now (timed rows-only rounds and small-round broadcasts, costs.py),
        which rank 0 measures and broadcasts so that every rank picks the same plans."""
        self.costs: Optional[costs.LinkCosts] = None
        self._probe_bytes = (0, 0, 0, 0)
        self._probe_messages = 0
        if self.options.small_bytes is not None or self.world_size == 1:
            self.small_bytes = dict.fromkeys(costs.OPS, self.options.small_bytes or 0)
            return
        self.small_bytes = dict.fromkeys(costs.OPS, costs.MAX_SMALL_BYTES)  # the probes below go small
        hops = _timed(self.barrier, _PROBE_ROUNDS + 1)[1:]
        moves = {size: _timed(lambda probe=torch.zeros(size // 8, dtype=torch.float64): self.broadcast(probe),
                              _PROBE_ROUNDS) for size in _PROBE_BYTES}
        measured = costs.measure(hops, moves, self.topology)
        agreed = torch.tensor([measured.hop_s, measured.bytes_per_s], dtype=torch.float64)
        self.broadcast(agreed)
        devices.synchronize(agreed, self.options.timeout_s)  # an emulated device lands it later
        self.costs = costs.LinkCosts(*agreed.tolist())
        self.small_bytes = costs.thresholds(self.topology, self.costs)
        # the probes are not the user's ops: numbering and counters start after them (every
        # message of theirs was received in order before a rank's next op can arrive)
        self._seq = self._progress.seq = 0
        self._sent_by_op.clear()
        self._probe_messages = self.border.messages_sent
        self._probe_bytes = (self.border.bytes_sent, self.border.bytes_received, self.border.wire_bytes_sent,
                             self.border.wire_bytes_received)

    def cost_model(self) -> list[str]:
        """The link costs and the small-message threshold of each op, as lines for a header."""
        source = self.costs.describe() if self.costs else "small_bytes option"
        limits = ", ".join(f"{op} <= {size:,} B" for op, size in self.small_bytes.items())
        return [f"cost model: {source}", f"small-message round for: {limits}"]

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

    def _abandon(self) -> None:
        """Release what a group that failed to form had started."""
        self.border.close()
        self._pipeline.shutdown()

    def _connect_border(self, found: verbs.Discovery, records: list[dict], deadline: float) -> None:
        """Choose each cross-island peer's transport; open RDMA queue pairs to those that get it."""
        self.transports: dict[int, Choice] = {}
        for peer in range(self.world_size):
            if peer not in self.island.ranks:
                theirs = verbs.Discovery.from_record(records[peer].get("rdma"))
                self.transports[peer] = choose(self.options.transport, self.rank, found, peer, theirs)
        rdma_peers = sorted(peer for peer, choice in self.transports.items() if choice.transport == "rdma")
        if rdma_peers:
            port = verbs.pick_port(found.ports, self.topology.local_rank(self.rank), devices.accelerator_numa_node())
            rdma = RdmaBorder(self.rank, verbs.PyverbsNic(port), self._rendezvous,
                              timeout_s=max(deadline - time.monotonic(), 1.0))
            try:
                rdma.connect(rdma_peers)
            except HetCCLError:
                rdma.close()
                raise
            self.border = RoutedBorder(self.border, {peer: rdma for peer in rdma_peers})
        else:
            self.border = RoutedBorder(self.border)
        for peer, choice in self.lane_transports().items():
            logger.info("hetccl group '%s' rank %d -> rank %d: %s (%s)", self.group_name, self.rank, peer,
                        choice.transport, choice.why)

    def lane_transports(self) -> dict[int, Choice]:
        """The transport to each peer of this rank's lane in other islands (none off-lane)."""
        lane = self.topology.lane_of(self.rank)
        if lane is None:
            return {}
        return {peer: self.transports[peer] for peer in self.topology.lane_peers(lane) if peer != self.rank}

    def _island_for(self, device: devices.Device) -> IslandComm:
        """This rank's island communicator for buffers on ``device`` (made on first use: every
        island rank makes it at the same op, since ranks of one island agree on the device)."""
        if device.kind not in self._islands:
            island = self.island
            if island.size == 1:  # a lone rank needs no store connection
                self._islands[device.kind] = make_island(device, None, 0, 1, self.options.timeout_s)
            else:
                store = self._store or dist.TCPStore(*self._store_address, None, False,
                                                     timeout=datetime.timedelta(seconds=self.options.timeout_s))
                self._store = store
                prefix = f"{self._rendezvous.prefix}{island.name}/{device.kind}"
                self._islands[device.kind] = make_island(
                    device, dist.PrefixStore(prefix, store), self.topology.local_rank(self.rank), island.size,
                    self.options.timeout_s, self.border.address[0], getattr(device, "device", None))
        return self._islands[device.kind]

    def border_stats(self) -> dict[str, Any]:
        """Bytes this rank sent/received over the border, in all and per op, and on the wire
        (fewer where compressed); each link's compression choice, ratio and measured speeds;
        the transport to each lane peer; how GPU tensors reach an RDMA NIC."""
        sent, received, wire_sent, wire_received = self._probe_bytes  # formation's probes aren't the user's
        return {"bytes_sent": self.border.bytes_sent - sent,
                "bytes_received": self.border.bytes_received - received,
                "wire_bytes_sent": self.border.wire_bytes_sent - wire_sent,
                "wire_bytes_received": self.border.wire_bytes_received - wire_received,
                "compression": self.border.compression(),
                "last_op_bytes_sent": self.last_op_bytes_sent, "per_op": dict(self._sent_by_op),
                "messages_sent": self.border.messages_sent - self._probe_messages,
                "rejected_connections": self.border.rejected,
                "transports": {peer: choice.transport for peer, choice in self.lane_transports().items()},
                "gpu_memory": verbs.gpu_memory_path()}

    # -- the one wrapper every op goes through ---------------------------------------------------

    def _run(self, call: Call, tensor: Optional[torch.Tensor], body: Optional[Callable[[PlanContext], Any]],
             small: Optional[Callable[..., Optional[str]]] = None, peer: Optional[int] = None,
             check: Optional[Callable[[PlanContext, Call], Optional[str]]] = None,
             staged: Sequence[torch.Tensor] = (), before: Optional[Callable[[], None]] = None,
             after: Optional[Callable[[], None]] = None) -> None:
        """Run one op under the group's sequence number, deadline, error state and stream order.

        Which plan runs is decided from what every rank knows alike (the call's size, the
        group's measured thresholds and topology), never from the local tensor's device, so a
        group of GPU and CPU islands always takes one plan:

        - a collective up to the small-message threshold runs ``small(ctx, call, *staged)``
          (one round of tree.py, whose messages also carry every rank's call); device
          buffers in ``staged`` go through host memory for it;
        - a group of one island runs the vendor op (``body``; on the stream for device
          tensors) with no host round, except host collectives small enough for the round
          (its calls are checked only with the ``strict`` option);
        - else the rows-only round (unless ``check_calls`` is off), then the plan ``body``.

        A rank that called something else (or ranks of one island on different device
        classes) is named on every rank before any user buffer is written, and the group
        stays usable. ``check`` replaces the rows round for ops that must agree on more than
        the call (all-to-all's block sizes); it always runs. ``before``/``after`` are device
        work around the op (staging into and out of scratch buffers).

        Device buffers (devices.py): the op's side stream waits for the caller's current
        stream at entry, device work goes on the side stream, and at exit the caller's
        stream waits for the op: the host returns without waiting for the device.
        """
        device = devices.of(tensor) if tensor is not None else devices.HOST
        call = replace(call, device=device.code)
        with self._lock:
            self._raise_if_broken()
            if peer is None:
                self._seq += 1
                seq = self._seq
                self._progress.start(seq)
            else:
                seq = self._next_p2p_seq(call.op, peer)
            where = f"{call.op} #{seq} in group '{self.group_name}' on rank {self.rank}"
            before_bytes = self.border.bytes_sent
            caller, stream = device.current_stream(), self._stream_of(device)
            if stream is not None:
                stream.wait(caller.record())
            ctx = PlanContext(self.topology, self.rank,
                                    plans.LazyIsland(lambda: self._island_for(device)), self.border,
                                    Tag(OP_CODES[call.op], seq, dtype_code(call.dtype)),
                                    time.monotonic() + self.options.timeout_s, self._scratch, self._pipeline,
                                    self.options.piece_bytes, self.border.default, device, stream)
            try:
                with device.using(stream):
                    problem = self._dispatch(ctx, call, seq, body, small, peer, check, staged, before, after)
            except (HetCCLError, RuntimeError) as exc:
                self._broken = self._explain(exc, where, seq, peer)
                self.border.close()  # peers blocked on this rank fail now, not at their deadline
                raise self._broken from exc
            finally:
                self.last_op_bytes_sent = self.border.bytes_sent - before_bytes
                self._sent_by_op[call.op] += self.last_op_bytes_sent
                if stream is not None:
                    caller.wait(stream.record())
            if problem is not None:  # every rank saw every call and no user buffer changed: still usable
                raise HetCCLMismatchError(f"{where}: mismatched call: {problem}")

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise HetCCLBrokenError(f"group '{self.group_name}' is broken by an earlier failure "
                                    f"({self._broken}); destroy and re-create it") from self._broken

    def _dispatch(self, ctx: PlanContext, call: Call, seq: int, body: Optional[Callable], small: Optional[Callable],
                  peer: Optional[int], check: Optional[Callable], staged: Sequence[torch.Tensor],
                  before: Optional[Callable], after: Optional[Callable]) -> Optional[str]:
        """The plan choice of :meth:`_run`; returns who disagrees (None: the op ran)."""
        problem = None
        by_round = small is not None and self._small(call)
        if before is not None:
            ctx.launch(before)
        if peer is not None or self.world_size == 1:
            if body is not None and call.numel:
                body(ctx)
        elif body is not None and check is None and self._fast_path(ctx.device, by_round):
            if call.numel:
                body(ctx)
        elif by_round:
            problem = self._staged(ctx, small, replace(call, seq=seq), staged)
        else:
            if check is not None or self.options.check_calls or body is None:
                problem = (check or tree.check)(ctx, replace(call, seq=seq))
            if problem is None and body is not None and call.numel:
                body(ctx)
        if problem is None and after is not None:
            ctx.launch(after)
        return problem

    def _fast_path(self, device: devices.Device, small: bool) -> bool:
        """A group of one island runs the vendor op alone, with no host round before it (as
        NCCL or Gloo would run it): on device buffers always, on host buffers above the small
        round's threshold (below it the round is faster than Gloo, and checks the calls too)."""
        return len(self.topology.islands) == 1 and not self.options.strict and not (device.host and small)

    def _stream_of(self, device: devices.Device) -> Optional[devices.StreamLike]:
        """The group's side stream on ``device`` (None for host memory)."""
        if device.host:
            return None
        if device not in self._streams:
            self._streams[device] = device.new_stream()
        return self._streams[device]

    def _staged(self, ctx: PlanContext, small: Callable[..., Optional[str]], call: Call,
                staged: Sequence[torch.Tensor]) -> Optional[str]:
        """The small round on host copies of device buffers (as is for host ones): wait for the
        stream, copy down, run the round, launch the copies back up."""
        if ctx.device.host:
            return small(ctx, call, *staged)
        ctx.host_wait()
        hosts = [self._scratch.host(("staged", i), t, ctx.device) for i, t in enumerate(staged)]
        with ctx.device.using(ctx.stream):
            for host, t in zip(hosts, staged):
                host.copy_(t)
        problem = small(ctx, call, *hosts)
        if problem is None:
            for host, t in zip(hosts, staged):
                ctx.launch(lambda dst, src: dst.copy_(src, non_blocking=True), t, host)
        return problem

    def _small(self, call: Call) -> bool:
        """Whether a call goes by the small-message round: its buffer (nccl-tests' size) is at
        most the group's threshold for that op."""
        per_rank = call.numel * call.dtype.itemsize
        whole = per_rank * (self.world_size if call.op in ("allgather", "reducescatter") else 1)
        return whole <= self.small_bytes.get(call.op, 0)

    def _explain(self, exc: BaseException, where: str, seq: int, peer: Optional[int]) -> HetCCLError:
        """The error to raise: what failed, where, and which ranks did not arrive."""
        text = str(exc)
        if isinstance(exc, HetCCLMismatchError):
            return HetCCLMismatchError(f"{where}: mismatched call: {text}")
        if peer is not None:
            missing = [peer]
        else:
            self._progress.publish()
            missing = [r for r in self._progress.behind(self.world_size, seq) if r != self.rank]
        arrival = f"ranks that did not arrive: {missing}"
        if isinstance(exc, HetCCLTimeoutError):
            detail = f"; waiting for rank {exc.waiting_for}" if exc.waiting_for is not None else ""
            return HetCCLTimeoutError(f"{where} timed out after {self.options.timeout_s:.1f}s (Timed out waiting "
                                      f"for peers; timeout {self.options.timeout_s:.0f} s); {arrival}{detail} ({text})")
        return HetCCLPeerError(f"{where} failed: {text}; {arrival}")

    # -- argument checks -------------------------------------------------------------------------

    def _one(self, tensors: Any, what: str) -> Any:
        if isinstance(tensors, (list, tuple)):
            if len(tensors) != 1:
                raise HetCCLInputError(f"group '{self.group_name}': {what} takes one tensor per rank, got a list of "
                                 f"{len(tensors)} (multi-GPU lists are not supported by hetccl)")
            return tensors[0]
        return tensors

    def _rank_arg(self, rank: int, what: str) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise HetCCLInputError(f"group '{self.group_name}': {what} {rank!r} is not a rank of this group of "
                             f"{self.world_size} (0..{self.world_size - 1})")
        return rank

    def _per_rank_list(self, lists: Any, what: str, nested: bool = True, moving: bool = False) -> list[Operand]:
        """One operand per rank; ``nested``: Ray's form, a list holding that list (multi-GPU)."""
        tensor_list = self._one(lists, what) if nested else lists
        if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != self.world_size:
            got = len(tensor_list) if isinstance(tensor_list, (list, tuple)) else type(tensor_list).__name__
            raise HetCCLInputError(f"group '{self.group_name}': {what} must be a list of world_size="
                             f"{self.world_size} tensors, got {got}")
        return [Operand(t, moving) for t in tensor_list]

    @staticmethod
    def _reduce_op(options: Any) -> str:
        op = getattr(options, "reduceOp", ReduceOp.SUM)
        if op not in _RAY_OPS:
            raise HetCCLInputError(f"unsupported reduce op {op!r}; supported: SUM, PRODUCT, MIN, MAX")
        return _RAY_OPS[op]

    # -- BaseGroup ops ---------------------------------------------------------------------------

    def allreduce(self, tensor: Any, allreduce_options: Any = AllReduceOptions()) -> None:
        x = Operand(self._one(tensor, "allreduce"))
        op = self._reduce_op(allreduce_options)
        self._run(Call("allreduce", x.flat.dtype, x.numel, reduce=op), x.flat,
                  lambda ctx: plans.allreduce(ctx, x.flat, op), lambda ctx, c, buf: tree.allreduce(ctx, c, buf, op),
                  staged=[x.flat], after=x.write_back)

    def barrier(self, barrier_options: Any = BarrierOptions()) -> None:
        self._run(Call("barrier", torch.uint8, 0), None, None)

    def reduce(self, tensor: Any, reduce_options: Any = ReduceOptions()) -> None:
        x = Operand(self._one(tensor, "reduce"))
        root = self._rank_arg(reduce_options.root_rank, "reduce root")
        op = self._reduce_op(reduce_options)
        work = x.flat if self.rank == root else self._scratch.get("reduce", x.numel, x.flat)  # others keep theirs
        self._run(Call("reduce", x.flat.dtype, x.numel, root, op), x.flat,
                  lambda ctx: plans.reduce(ctx, work, root, op), lambda ctx, c, buf: tree.reduce(ctx, c, buf, root, op),
                  staged=[work], before=None if work is x.flat else lambda: copy(work, x.flat),
                  after=x.write_back if self.rank == root else None)

    def broadcast(self, tensor: Any, broadcast_options: Any = BroadcastOptions()) -> None:
        x = Operand(self._one(tensor, "broadcast"), moving=True)
        root = self._rank_arg(broadcast_options.root_rank, "broadcast root")
        self._run(Call("broadcast", x.flat.dtype, x.numel, root), x.flat,
                  lambda ctx: plans.broadcast(ctx, x.flat, root), lambda ctx, c, buf: tree.broadcast(ctx, c, buf, root),
                  staged=[x.flat], after=x.write_back)

    def allgather(self, tensor_list: Any, tensor: Any, allgather_options: Any = AllGatherOptions()) -> None:
        x = Operand(self._one(tensor, "allgather input"), moving=True)
        outputs = self._per_rank_list(tensor_list, "allgather output tensor_list", moving=True)
        same_kind(x, outputs, "allgather output tensor_list")
        n, order = x.numel, self.topology.island_major_order()
        buf = self._scratch.get("allgather", n * self.world_size, x.flat)
        mine = order.index(self.rank)

        def spread() -> None:
            for slot, rank in enumerate(order):
                copy(outputs[rank].flat, buf[slot * n:(slot + 1) * n])
                outputs[rank].write_back()

        self._run(Call("allgather", x.flat.dtype, n), x.flat, lambda ctx: plans.allgather(ctx, buf),
                  lambda ctx, c, staged: tree.allgather(ctx, c, staged), staged=[buf],
                  before=lambda: copy(buf[mine * n:(mine + 1) * n], x.flat), after=spread)

    def reducescatter(self, tensor: Any, tensor_list: Any,
                      reducescatter_options: Any = ReduceScatterOptions()) -> None:
        out = Operand(self._one(tensor, "reducescatter output"))
        inputs = self._per_rank_list(tensor_list, "reducescatter input tensor_list")
        same_kind(out, inputs, "reducescatter input tensor_list")
        op = self._reduce_op(reducescatter_options)
        n, order = out.numel, self.topology.island_major_order()
        buf = self._scratch.get("reducescatter", n * self.world_size, out.flat)

        def lay_out() -> None:
            for slot, rank in enumerate(order):
                copy(buf[slot * n:(slot + 1) * n], inputs[rank].flat)

        def body(ctx: PlanContext) -> None:
            mine = plans.reducescatter(ctx, buf, op)
            ctx.launch(copy, out.flat, mine)

        self._run(Call("reducescatter", out.flat.dtype, n, reduce=op), out.flat, body,
                  lambda ctx, c, staged, into: tree.reducescatter(ctx, c, staged, into, op), staged=[buf, out.flat],
                  before=lay_out, after=out.write_back)

    # -- beyond Ray's BaseGroup: all-to-all, gather, scatter ---------------------------------------

    def alltoall(self, tensor_list_in: Any, tensor_list_out: Any) -> None:
        """Send ``tensor_list_in[t]`` to rank t, receive ``tensor_list_out[r]`` from rank r.
        Sizes may differ per pair (MoE token routing), but what r sends t must be what t
        expects from r: a pair that disagrees is a mismatch on every rank, no data moved."""
        ins = self._per_rank_list(tensor_list_in, "alltoall tensor_list_in", nested=False, moving=True)
        outs = self._per_rank_list(tensor_list_out, "alltoall tensor_list_out", nested=False, moving=True)
        self.alltoall_flat([x.flat for x in ins], [x.flat for x in outs], after=lambda: [o.write_back() for o in outs])

    def alltoall_flat(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                      after: Optional[Callable[[], Any]] = None) -> None:
        """:meth:`alltoall` on flat contiguous tensors (views of one buffer are fine); ``after``:
        device work once the outputs are filled (writing them back into the user's tensors)."""
        same_kind(Operand(inputs[0]), [Operand(t) for t in [*inputs, *outputs]], "alltoall tensors", sizes=False)
        mine = [t.numel() for t in inputs] + [t.numel() for t in outputs]
        agreed = {"counts": [[mine[0]]]}  # a group of one: nothing to agree with

        def check(ctx: PlanContext, call: Call) -> Optional[str]:
            problem, agreed["counts"] = tree.alltoall_counts(ctx, call, mine)
            return problem

        if self.world_size == 1 and mine[0] != mine[1]:
            raise HetCCLInputError(f"group '{self.group_name}': alltoall sends {mine[0]} elements to rank 0 "
                                   f"but expects {mine[1]} from it")
        self._run(Call("alltoall", inputs[0].dtype, self.world_size), inputs[0],
                  lambda ctx: plans.alltoall(ctx, agreed["counts"], inputs, outputs), check=check, after=after)

    def gather(self, tensor: Any, gather_list: Any, root: int) -> None:
        """Every rank's ``tensor`` into ``gather_list`` (one per rank) at ``root``: the
        all-to-all plan with blocks to root only, so bytes cross the border once."""
        x = Operand(self._one(tensor, "gather"), moving=True)
        root = self._rank_arg(root, "gather root")
        outs = self._per_rank_list(gather_list, "gather_list", nested=False, moving=True) if self.rank == root else []
        same_kind(x, outs, "gather_list")
        n, empty = x.numel, x.flat[:0]
        counts = [[n if t == root else 0 for t in range(self.world_size)] for _ in range(self.world_size)]
        ins = [x.flat if t == root else empty for t in range(self.world_size)]
        flats = [o.flat for o in outs] or [empty] * self.world_size
        self._run(Call("gather", x.flat.dtype, n, root), x.flat,
                  lambda ctx: plans.alltoall(ctx, counts, ins, flats), after=lambda: [o.write_back() for o in outs])

    def scatter(self, tensor: Any, scatter_list: Any, root: int) -> None:
        """``scatter_list[t]`` at ``root`` into rank t's ``tensor``: the all-to-all plan with
        blocks from root only."""
        x = Operand(self._one(tensor, "scatter"), moving=True)
        root = self._rank_arg(root, "scatter root")
        ins = self._per_rank_list(scatter_list, "scatter_list", nested=False, moving=True) if self.rank == root else []
        same_kind(x, ins, "scatter_list")
        n, empty = x.numel, x.flat[:0]
        counts = [[n if r == root else 0 for _ in range(self.world_size)] for r in range(self.world_size)]
        flats = [i.flat for i in ins] or [empty] * self.world_size
        outs = [x.flat if r == root else empty for r in range(self.world_size)]
        self._run(Call("scatter", x.flat.dtype, n, root), x.flat,
                  lambda ctx: plans.alltoall(ctx, counts, flats, outs), after=x.write_back)

    def recv_any(self, tensor: Any) -> int:
        """Receive ``tensor`` from whichever rank sends to this one first; returns that rank.
        CPU tensors over the TCP border (as torch's Gloo; NCCL has no any-source receive)."""
        x = Operand(self._one(tensor, "recv from any source"), moving=True)
        rdma = sorted(self.border.routes)
        if not devices.of(x.flat).host or rdma:
            why = f"ranks {rdma} are reached over RDMA" if rdma else f"the tensor is on {x.flat.device}"
            raise HetCCLInputError(f"group '{self.group_name}': recv from any source takes CPU tensors over the "
                                   f"TCP border; here {why}; pass the source rank")
        code = OP_CODES["send"]
        expected = {peer: Tag(code, self._p2p_seq["recv", peer] + 1, dtype_code(x.flat.dtype))
                    for peer in range(self.world_size) if peer != self.rank}
        try:
            source = self.border.default.first_arrival(expected, self.options.timeout_s)
        except HetCCLTimeoutError as exc:
            raise HetCCLTimeoutError(f"recv from any source in group '{self.group_name}' on rank {self.rank}: "
                                     f"{exc}") from None
        self._p2p("recv", x, source)
        return source

    def _p2p_operand(self, op: str, tensor: Any, peer: int) -> tuple[Operand, int]:
        x = Operand(self._one(tensor, op), moving=True)
        peer = self._rank_arg(peer, f"{op} peer")
        if peer == self.rank:
            raise HetCCLInputError(f"group '{self.group_name}': rank {self.rank} cannot {op} to itself")
        return x, peer

    def _p2p(self, op: str, x: Operand, peer: int) -> None:
        """A send or receive run to completion as one op (in the island library for device
        tensors of island peers, over the border otherwise)."""
        plan = plans.send if op == "send" else plans.recv
        self._run(Call(op, x.flat.dtype, x.numel), x.flat, lambda ctx: plan(ctx, x.flat, peer), peer=peer,
                  after=x.write_back if op == "recv" else None)

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
        completes whatever the sizes. Host tensors; device ones run :meth:`send`/:meth:`recv`."""
        x, peer = self._p2p_operand(op, tensor, peer)
        if not devices.of(x.flat).host or not x.numel:
            self._p2p(op, x, peer)
            return lambda: None
        with self._lock:
            self._raise_if_broken()
            seq = self._next_p2p_seq(op, peer, tag)
            where = f"{op} #{seq & 0xFFFFFFFF} (tag {tag}) in group '{self.group_name}' on rank {self.rank}"
            mark = Tag(OP_CODES[op], seq, dtype_code(x.flat.dtype))
            handle = self.border.isend(peer, x.flat, mark) if op == "send" else self.border.irecv(peer, x.flat, mark)
        deadline = time.monotonic() + self.options.timeout_s

        def wait() -> None:
            try:
                handle.wait(max(deadline - time.monotonic(), 0.0))
            except (HetCCLError, RuntimeError) as exc:
                with self._lock:
                    self._broken = self._broken or self._explain(exc, where, seq, peer)
                self.border.close()
                raise self._broken from exc
            x.write_back()

        return wait

    def send(self, tensor: Any, send_options: Any) -> None:
        self._p2p("send", *self._p2p_operand("send", tensor, send_options.dst_rank))

    def recv(self, tensor: Any, recv_options: Any) -> None:
        self._p2p("recv", *self._p2p_operand("recv", tensor, recv_options.src_rank))

    def destroy_group(self) -> None:
        """Close the border, the island communicators and the progress thread; drop KV records."""
        self._progress.close()
        self.border.close()
        self._pipeline.shutdown(wait=True, cancel_futures=True)
        for island in self._islands.values():
            island.close()
        self._islands.clear()
        for key in (f"rank/{self.rank}", f"progress/{self.rank}"):
            self._rendezvous.delete(key)
        self._store = None
