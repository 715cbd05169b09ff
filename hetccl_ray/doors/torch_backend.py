"""torch.distributed backend ``"hetccl"``: the same group, islands, plans and border.

``import hetccl_ray`` registers it, so ``dist.init_process_group("hetccl")`` and DDP/FSDP
run unchanged on a mixed cluster. The c10d store torch hands the backend carries the
rendezvous; islands come from the node labels when the process is a Ray worker, else from
``HETCCL_ISLAND`` or the local tensor library. Ops run in order on one thread per process
group, so every call returns an async Work. For host tensors ``wait()`` blocks until the
op is done. For device tensors (as NCCL's process group) the op is ordered after the
caller's current stream at the call, ``wait()`` makes the waiting stream wait for the op
(the host returns once the op is launched) and ``get_future()`` completes when the data is
there.
"""

from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hetccl_ray.memory import devices
from hetccl_ray.group.group import HetCCLGroup
from hetccl_ray.core.op import Reduce
from hetccl_ray.group.options import GroupOptions
from hetccl_ray.core.tensors import Operand
from hetccl_ray.errors import HetCCLInputError

NAME = "hetccl"
_REDUCE = {dist.ReduceOp.SUM: Reduce.SUM, dist.ReduceOp.PRODUCT: Reduce.PRODUCT, dist.ReduceOp.MIN: Reduce.MIN,
           dist.ReduceOp.MAX: Reduce.MAX, dist.ReduceOp.AVG: Reduce.SUM}
_count_lock = threading.Lock()
_count = 0


def _reduce_op(opts) -> tuple[Reduce, bool]:
    """The core's reduce op for torch's, and whether to divide by world size (AVG)."""
    op = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp
    if op not in _REDUCE:
        raise HetCCLInputError(f"hetccl does not support reduce op {op}; supported: SUM, AVG, PRODUCT, MIN, MAX")
    return _REDUCE[op], op == dist.ReduceOp.AVG


class _Work(dist.Work):
    """An op running on the process group's thread; ``wait`` raises what the op raised.

    ``launched`` completes when the op's host part is done (its device work launched, its
    ``done`` event recorded); ``future`` when the data is there (the host waited for ``done``),
    and ``finished`` is set then (or on failure).
    """

    def __init__(self, device: devices.Device, timeout_s: float) -> None:
        super().__init__()
        self.device, self.timeout_s = device, timeout_s
        self.launched: Future = Future()
        self.future: torch.futures.Future = torch.futures.Future()
        self.finished = devices.HostFlag()
        self.posted = False  # a posted send/recv: launched once posted, done once transferred
        self.done: devices.EventLike | None = None
        self.returned: object = None  # what the op returned: a receive from any source, its source

    def _source_rank(self) -> int:
        self.wait()
        return int(self.returned)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """As NCCL's: on device tensors the current stream waits for the op and the host goes
        on, even while the op still moves bytes on the group's thread (a device whose host ops
        are not stream-ordered, the emulated one, waits on the host); an error the op already
        raised is raised here, a later one by the next op or the future."""
        device = self.device
        if not self.posted and not device.host and device.ordered_host_ops and \
                device.wait_for_host(device.current_stream(), self.finished, self.timeout_s):
            if self.launched.done():
                self.launched.result()
            return True
        self.launched.result()  # re-raises the op's exception
        if self.posted or device.host:  # host memory: done means the data is there (and the future set)
            self.future.wait()
        elif self.done is not None:
            device.current_stream().wait(self.done)  # the waiting stream, not the host, waits
            if not device.ordered_host_ops:  # host code after wait() reads it at once
                self.future.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self) -> torch.futures.Future:
        return self.future


class HetCCLProcessGroup(dist.ProcessGroup):
    """A Python c10d process group running every op through :class:`HetCCLGroup`."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 name: str | None = None, reuse_costs: bool = False) -> None:
        """``name``: what every rank calls the group (its records' keys in ``store``); default
        ``torch-pgN``, the Nth group this process made, as c10d makes them in step on every rank.
        ``reuse_costs``: GroupOptions' (a group formed again takes the costs measured before)."""
        if store is None:
            raise ValueError("the hetccl backend needs the c10d store that init_process_group passes; got None")
        super().__init__(rank, size)
        global _count
        with _count_lock:
            _count += 1
            name = name or f"torch-pg{_count}"
        self.group = HetCCLGroup(size, rank, name, store=store,
                                 options=GroupOptions(timeout_s=max(timeout.total_seconds(), 1.0),
                                                      reuse_costs=reuse_costs))
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"hetccl-c10d-{rank}")
        self._completer = ThreadPoolExecutor(1, thread_name_prefix=f"hetccl-c10d-done-{rank}")
        self._streams: dict[devices.Device, devices.StreamLike | None] = {}
        self._name = name

    def getBackendName(self) -> str:
        return NAME

    def _set_group_name(self, name: str) -> None:
        """c10d names the group after creating it; DeviceMesh (FSDP) looks groups up by name."""
        self._name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._name

    def _async(self, result: object, fn: Callable[[], object], posted: bool = False) -> "dist.Work":
        """Run ``fn`` on the group's thread; device tensors in ``result`` order it after the
        work on the caller's current stream so far (an event recorded now, on the calling
        thread), its device work launched on the group's stream. ``posted``: ``fn`` only posts
        transfers and returns their waits, which run after it (the Work is done then)."""
        first = next((t for t in _tensors(result) if isinstance(t, torch.Tensor)), None)
        device = devices.of(first) if first is not None else devices.HOST
        device.refuse_capture(f"hetccl process group {self._name} on rank {self.rank()}")
        entry = device.mark()
        work = _Work(device, self.group.options.timeout_s)
        work.posted = posted

        def run() -> None:
            ours = self._stream_of(device)
            try:
                with device.using(ours):
                    if entry is not None:
                        ours.wait(entry)
                    work.returned = fn()
                    work.done = ours.record() if ours is not None else None
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                work.launched.set_exception(exc)
                work.future.set_exception(exc)
                work.finished.set()
                return
            work.launched.set_result(None)
            self._completer.submit(complete)

        def complete() -> None:
            try:
                for wait in work.returned if posted else ():
                    wait()
                if work.done is not None:
                    work.done.synchronize(time.monotonic() + self.group.options.timeout_s, "hetccl work")
                work.future.set_result(result)
            except BaseException as exc:  # noqa: BLE001
                work.future.set_exception(exc)
            finally:
                work.finished.set()

        self._worker.submit(run)
        return work

    def _stream_of(self, device: devices.Device) -> devices.StreamLike | None:
        """The process group's stream on ``device``, where its ops start (None on host memory);
        only the group's thread uses it."""
        if device not in self._streams:
            self._streams[device] = device.new_stream()
        return self._streams[device]

    @staticmethod
    def _launch(tensor: torch.Tensor, fn: Callable, *args) -> None:
        """Device work on the current stream (the caller's, on the group's thread)."""
        devices.of(tensor).launch(None, fn, *args)

    def _allreduce_list(self, tensors: Sequence[torch.Tensor], opts) -> None:
        reduce, average = _reduce_op(opts)
        ops = self.group.ops
        for tensor in tensors:
            if tensor.is_sparse:
                self._sparse_allreduce(tensor, reduce)
            elif tensor.is_complex():  # a sum of complex numbers is the sums of their parts
                if reduce != Reduce.SUM:
                    raise HetCCLInputError(f"all_reduce of {tensor.dtype} takes SUM or AVG only")
                self.group.run(ops.allreduce(torch.view_as_real(tensor), reduce))
            else:
                self.group.run(ops.allreduce(tensor, reduce))
            if average:
                self._launch(tensor, tensor.div_, self.size())

    def _sparse_allreduce(self, tensor: torch.Tensor, reduce: Reduce) -> None:
        """A sparse COO tensor summed over ranks (DDP with sparse embeddings), as Gloo does it:
        every rank's indices and values gathered, the result coalesced, written into ``tensor``."""
        if reduce != Reduce.SUM:
            raise HetCCLInputError("all_reduce of a sparse tensor takes SUM or AVG only")
        mine = tensor.coalesce()
        world = self.size()
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        self._allgather(counts, torch.tensor([mine._nnz()]))
        most = max(int(c) for c in counts)
        indices = torch.zeros(mine.sparse_dim(), most, dtype=torch.int64)
        values = torch.zeros((most, *mine.values().shape[1:]), dtype=mine.dtype)
        indices[:, :mine._nnz()] = mine.indices()
        values[:mine._nnz()] = mine.values()
        all_indices = [torch.empty_like(indices) for _ in range(world)]
        all_values = [torch.empty_like(values) for _ in range(world)]
        self._allgather(all_indices, indices)
        self._allgather(all_values, values)
        summed = torch.sparse_coo_tensor(
            torch.cat([i[:, :int(n)] for i, n in zip(all_indices, counts)], dim=1),
            torch.cat([v[:int(n)] for v, n in zip(all_values, counts)]), mine.shape).coalesce()
        tensor.copy_(summed)

    def _allgather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        self.group.run(self.group.ops.allgather(outputs, tensor))

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._async(tensors, lambda: self._allreduce_list(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()

        def run() -> None:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
            self._launch(flat, lambda: torch.cat([t.reshape(-1) for t in tensors], out=flat))
            self._allreduce_list([flat], opts)
            self._launch(flat, _unflatten, flat, tensors)
        return self._async(tensors, run)

    def broadcast(self, tensors, opts=None):
        root = (opts or dist.BroadcastOptions()).rootRank
        return self._async(tensors, lambda: [self.group.run(self.group.ops.broadcast(t, root)) for t in tensors])

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        reduce, average = _reduce_op(opts)

        def run() -> None:
            for tensor in tensors:
                self.group.run(self.group.ops.reduce_to(tensor, opts.rootRank, reduce))
                if average and self.rank() == opts.rootRank:
                    self._launch(tensor, tensor.div_, self.size())
        return self._async(tensors, run)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._async(output_tensors, lambda: [self._allgather(out, inp)
                                                    for out, inp in zip(output_tensors, input_tensors)])

    def _allgather_base(self, output, input, opts=None):
        return self._async(output, lambda: self._allgather(list(output.chunk(self.size())), input))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._async(outputs, lambda: [self._allgather(list(out.chunk(self.size())), inp)
                                             for out, inp in zip(outputs, inputs)])

    def _reduce_scatter_list(self, pairs, opts) -> None:
        reduce, average = _reduce_op(opts or dist.ReduceScatterOptions())
        for output, inputs in pairs:
            self.group.run(self.group.ops.reducescatter(output, list(inputs), reduce))
            if average:
                self._launch(output, output.div_, self.size())

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        return self._async(output_tensors, lambda: self._reduce_scatter_list(zip(output_tensors, input_lists), opts))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._async(output, lambda: self._reduce_scatter_list([(output, input.chunk(self.size()))], opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        pairs = [(out, inp.chunk(self.size())) for out, inp in zip(outputs, inputs)]
        return self._async(outputs, lambda: self._reduce_scatter_list(pairs, opts))

    def barrier(self, opts=None):
        return self._async([], lambda: self.group.run(self.group.ops.barrier()))

    def send(self, tensors, dst, tag=0):
        return self._posted(tensors, "send", dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._posted(tensors, "recv", src, tag)

    def _posted(self, tensors: Sequence[torch.Tensor], op: str, peer: int, tag: int) -> "dist.Work":
        """isend/irecv: posted in call order on the group's thread without waiting for the
        transfer (so batch_isend_irecv of every rank to every other completes); done when
        transferred. Device tensors run as ordered ops (``post_p2p`` runs them whole)."""
        return self._async(tensors, lambda: [self.group.post_p2p(op, t, peer, tag) for t in tensors], posted=True)

    # torch.distributed's newer names for the same ops
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        return self._async(output_lists, lambda: [self._allgather([outs[i] for outs in output_lists], inp)
                                                  for i, inp in enumerate(input_list)])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``all_to_all_single``: rows of ``input`` to each rank by ``input_split_sizes`` (even
        when empty), rows of ``output`` from each by ``output_split_sizes``."""
        def run() -> None:
            inp, ins = self._rows(input, input_split_sizes, "input")
            out, outs = self._rows(output, output_split_sizes, "output")
            self.group.run(self.group.ops.alltoall(ins, outs, written=[out]))
        return self._async(output, run)

    all_to_all_single = alltoall_base

    def _rows(self, tensor: torch.Tensor, split_sizes: Sequence[int], what: str):
        """The tensor as an operand and one flat view per rank, cut along dim 0."""
        x = Operand(tensor, moving=True)
        rows = tensor.shape[0] if tensor.dim() else 1
        world = self.size()
        if not split_sizes and rows % world:
            raise HetCCLInputError(f"all_to_all_single: {what} has {rows} rows, not divisible by world size {world}; "
                                   "pass split sizes")
        sizes = list(split_sizes) or [rows // world] * world
        if len(sizes) != world or sum(sizes) != rows or min(sizes) < 0:
            raise HetCCLInputError(f"all_to_all_single: {what} split sizes {sizes} must be {world} non-negative "
                                   f"row counts summing to {rows}")
        per_row = x.numel // rows if rows else 0
        starts = [sum(sizes[:i]) * per_row for i in range(world)]
        return x, [x.flat[start:start + size * per_row] for start, size in zip(starts, sizes)]

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._async(output_tensors, lambda: self.group.alltoall(input_tensors, output_tensors))

    def gather(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.GatherOptions()).rootRank
        outs = output_tensors[0] if output_tensors and output_tensors[0] else None
        return self._async(output_tensors, lambda: self.group.gather(input_tensors[0], outs, root))

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.ScatterOptions()).rootRank
        ins = input_tensors[0] if input_tensors else None
        return self._async(output_tensors, lambda: self.group.scatter(output_tensors[0], ins, root))

    def recv_anysource(self, tensors, tag=0):
        """``recv(src=None)``: the Work's ``_source_rank()`` names who sent."""
        return self._async(tensors, lambda: [self.group.recv_any(t) for t in tensors][-1])

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
        self._completer.shutdown(wait=True)
        self.group.destroy_group()


def _tensors(result: object) -> list:
    """The tensors of an op's result (a tensor, or lists of them, nested once)."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result or () for t in (item if isinstance(item, (list, tuple)) else [item])]


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> HetCCLProcessGroup:
    return HetCCLProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register ``"hetccl"`` with torch.distributed; calling it again is harmless."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
