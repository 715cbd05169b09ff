"""pyverbs behind the RDMA border's :class:`~hetccl_ray.transport.rdma.Nic` interface.

- :func:`discover`: the active RDMA ports of this host, or none with the reason (pyverbs
  missing, no device: ``get_device_list`` raises ``PyverbsRDMAError`` on a kernel without
  RDMA, no active port).
- :func:`enum`: one name for a verbs constant across pyverbs v44 (``pyverbs.enums``) and
  v59 (``pyverbs.libibverbs_enums``, enum classes).
- :class:`PyverbsNic`: one protection domain per process, a completion queue per border, RC
  queue pairs, memory regions for host memory (``MR``), CUDA memory through dmabuf
  (``DmaBufMR`` on a fd from ``cuMemGetHandleForAddressRange``) or, when the peer memory
  module is loaded, plain ``MR``; ROCm memory through HSA's dmabuf export. What was chosen
  is logged and given by ``memory_path``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import random
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

from hetccl_ray.transport.rdma import Completion, ConnInfo, Region

logger = logging.getLogger(__name__)

_PAGE = 1 << 16  # dmabuf exports want page-aligned ranges; 64 KiB covers every GPU page size


def enum(name: str) -> int:
    """A verbs constant such as ``IBV_QPT_RC``, from whichever pyverbs is installed."""
    try:
        from pyverbs import enums as v44
        return getattr(v44, name)
    except (ImportError, AttributeError):
        from pyverbs import libibverbs_enums as v59
        if hasattr(v59, name):
            return getattr(v59, name)
        for value in vars(v59).values():
            if hasattr(value, name):
                return int(getattr(value, name))
        raise AttributeError(f"pyverbs has no constant {name}") from None


@dataclass(frozen=True)
class Port:
    """An active RDMA port: what a queue pair on it needs and what a peer must match."""

    device: str
    port: int
    link_layer: str  # "infiniband" or "ethernet" (RoCE)
    lid: int
    gid_index: int
    gid: str
    mtu: int


@dataclass(frozen=True)
class Discovery:
    """This host's RDMA ports, or why there are none."""

    ports: tuple[Port, ...]
    why: str

    def to_record(self) -> dict:
        return {"ports": [asdict(port) for port in self.ports], "why": self.why}

    @staticmethod
    def from_record(record: Optional[dict]) -> "Discovery":
        record = record or {"ports": [], "why": "the rank did not report RDMA ports"}
        return Discovery(tuple(Port(**port) for port in record["ports"]), record["why"])


def _gid_index(ctx: Any, port: int, link_layer: str, forced: Optional[int]) -> tuple[int, str]:
    """The GID to use: ``forced`` (``HETCCL_RDMA_GID_INDEX``), else the first non-zero entry
    (RoCE: a RoCE v2 one first, which routes over IP, then an IPv4-mapped one, so that it
    routes like the host's own address; the first IPv4-mapped entry is usually RoCE v1, which
    does not)."""
    if forced is not None:
        return forced, str(ctx.query_gid(port, forced).gid)
    found = []
    for index in range(ctx.query_port(port).gid_tbl_len):
        try:
            gid = str(ctx.query_gid(port, index).gid)
        except Exception:  # noqa: BLE001 - an unused table entry
            continue
        if gid.strip("0:"):
            found.append((index, gid))
    if not found:
        raise LookupError("no GID")
    if link_layer != "ethernet":
        return found[0]

    def rank(entry: tuple[int, str]) -> tuple[bool, bool]:
        return not _roce_v2(ctx, port, entry[0]), "ffff:" not in entry[1]

    return min(found, key=rank)


def _roce_v2(ctx: Any, port: int, index: int) -> bool:
    """Whether GID table entry ``index`` is RoCE v2 (False where pyverbs cannot tell)."""
    try:
        return ctx.query_gid_type(port, index) == enum("IBV_GID_TYPE_SYSFS_ROCE_V2")
    except Exception:  # noqa: BLE001 - a pyverbs without GID types: keep the table order
        return False


def pick_port(ports: Sequence[Port], local_rank: int, numa_node: Optional[int]) -> Port:
    """This rank's port: one on the GPU's NUMA node where sysfs tells, spread over such ports
    by the rank's place in its island (ranks of one host do not all share the first NIC)."""
    near = [p for p in ports if numa_node is not None and _numa_of(p.device) == numa_node] or list(ports)
    return near[local_rank % len(near)]


def _numa_of(device: str) -> Optional[int]:
    try:
        return int(open(f"/sys/class/infiniband/{device}/device/numa_node").read())
    except (OSError, ValueError):
        return None


@functools.cache
def discover(only: tuple[str, ...] = (), gid_index: Optional[int] = None) -> Discovery:
    """Every active port of every RDMA device here (of ``only`` where given, with the GID
    entry ``gid_index`` where given); none (with the reason) is an answer, not an error."""
    try:
        from pyverbs.device import Context, get_device_list
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        return Discovery((), f"pyverbs is not installed ({exc})")
    try:
        devices = get_device_list()
    except PyverbsError as exc:
        return Discovery((), f"no RDMA devices ({exc})")
    ports, skipped = [], []
    for device in devices:
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        if only and name not in only:
            skipped.append(f"{name}: not in HETCCL_RDMA_DEVICES")
            continue
        try:
            with Context(name=name) as ctx:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    attr = ctx.query_port(port)
                    if attr.state != enum("IBV_PORT_ACTIVE"):
                        skipped.append(f"{name}:{port}: not active")
                        continue
                    layer = "ethernet" if attr.link_layer == enum("IBV_LINK_LAYER_ETHERNET") else "infiniband"
                    index, gid = _gid_index(ctx, port, layer, gid_index)
                    ports.append(Port(name, port, layer, attr.lid, index, gid, int(attr.active_mtu)))
        except (PyverbsError, LookupError) as exc:
            skipped.append(f"{name}: {exc}")
    why = f"{len(ports)} active port(s)" if ports else "no active RDMA port"
    return Discovery(tuple(ports), why + (f" ({'; '.join(skipped)})" if skipped else ""))


# -- device memory -------------------------------------------------------------------------------------

def _peer_memory_loaded() -> bool:
    return any(os.path.exists(f"/sys/module/{name}") for name in ("nvidia_peermem", "nv_peer_mem"))


def _cuda_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python before 12.6
    return driver


@functools.cache
def gpu_memory_path() -> str:
    """How this process's GPU tensors reach the NIC: dmabuf, peermem, or staged (pinned host copies)."""
    try:
        if not torch.cuda.is_available():
            return "staged"
    except RuntimeError:
        return "staged"
    if getattr(torch.version, "hip", None):
        try:
            ctypes.CDLL("libhsa-runtime64.so.1").hsa_amd_portable_export_dmabuf  # noqa: B018 - probing
            return "dmabuf"
        except (OSError, AttributeError):
            return "staged"
    try:
        driver = _cuda_driver()
        err, supported = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, torch.cuda.current_device())
        if int(err) == 0 and supported:
            return "dmabuf"
    except (ImportError, AttributeError):
        pass
    return "peermem" if _peer_memory_loaded() else "staged"


def _dmabuf_fd(addr: int, length: int, index: int) -> tuple[int, int, int, int]:
    """A dmabuf fd for GPU memory of device ``index`` around [addr, addr + length): (fd, aligned
    start, aligned length, where that start lies in the dmabuf: HSA exports the whole allocation)."""
    start = addr & ~(_PAGE - 1)
    size = ((addr + length - start) + _PAGE - 1) & ~(_PAGE - 1)
    if getattr(torch.version, "hip", None):
        hsa = ctypes.CDLL("libhsa-runtime64.so.1")
        fd, offset = ctypes.c_int(), ctypes.c_uint64()
        status = hsa.hsa_amd_portable_export_dmabuf(ctypes.c_void_p(start), ctypes.c_size_t(size),
                                                    ctypes.byref(fd), ctypes.byref(offset))
        if status != 0:
            raise RuntimeError(f"hsa_amd_portable_export_dmabuf failed with status {status}")
        return fd.value, start, size, offset.value
    driver = _cuda_driver()
    _make_context_current(driver, index)
    err, fd = driver.cuMemGetHandleForAddressRange(
        start, size, driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    if int(err) != 0:
        raise RuntimeError(f"cuMemGetHandleForAddressRange failed with {err}")
    return int(fd), start, size, 0


def _make_context_current(driver: Any, index: int) -> None:
    """The device's primary context, current on this thread: a thread that never ran CUDA work
    has none, and ``torch.cuda.device(i)`` does not set one where ``i`` is already torch's
    current device, so the driver's export would fail there with an invalid context."""
    err, current = driver.cuCtxGetCurrent()
    if int(err) == 0 and int(current):
        return
    err, device = driver.cuDeviceGet(index)
    if int(err) == 0:
        err, context = driver.cuDevicePrimaryCtxRetain(device)
    if int(err) == 0:
        (err,) = driver.cuCtxSetCurrent(context)
    if int(err) != 0:
        raise RuntimeError(f"no CUDA context for device {index} on this thread: {err}")


_HOP_LIMIT = 64


# -- the NIC --------------------------------------------------------------------------------------------

_KINDS = {"IBV_WC_SEND": "send", "IBV_WC_RDMA_WRITE": "write", "IBV_WC_RECV": "recv",
          "IBV_WC_RECV_RDMA_WITH_IMM": "recv_imm"}


@functools.cache
def _completion_names() -> tuple[dict[int, str], dict[int, str]]:
    """Work completion opcodes to our kinds, and status codes to their verbs names."""
    kinds = {enum(name): kind for name, kind in _KINDS.items()}
    statuses = {}
    for name in ("IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_PROT_ERR",
                 "IBV_WC_WR_FLUSH_ERR", "IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR",
                 "IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_REM_ABORT_ERR", "IBV_WC_FATAL_ERR", "IBV_WC_GENERAL_ERR"):
        statuses[enum(name)] = name
    return kinds, statuses


@functools.cache
def _protection_domain(device: str) -> tuple[Any, Any]:
    """The device context and the one protection domain of this process on it, kept for the
    process's life (memory regions and queue pairs of every group hang off it)."""
    from pyverbs.device import Context
    from pyverbs.pd import PD

    ctx = Context(name=device)
    return ctx, PD(ctx)


class PyverbsNic:
    """One RDMA port as one border uses it: the process's PD, a CQ of its own, RC queue pairs."""

    def __init__(self, port: Port, cq_depth: int = 4096) -> None:
        from pyverbs.cq import CQ

        self.port = port
        self.name = f"{port.device}:{port.port}"
        self.ctx, self.pd = _protection_domain(port.device)
        self.cq = CQ(self.ctx, cq_depth)
        self._access = enum("IBV_ACCESS_LOCAL_WRITE") | enum("IBV_ACCESS_REMOTE_WRITE")
        logger.info("hetccl RDMA on %s (%s, gid index %d); GPU memory: %s", self.name, port.link_layer,
                    port.gid_index, gpu_memory_path())

    def memory_path(self, device: torch.device) -> str:
        return "host" if device.type == "cpu" else gpu_memory_path()

    def register(self, addr: int, length: int, device: torch.device) -> Region:
        from pyverbs.mr import MR, DmaBufMR

        path = self.memory_path(device)
        if path in ("host", "peermem"):
            mr = MR(self.pd, length, self._access, address=addr)
            return Region(addr, length, mr.lkey, mr.rkey, mr)
        if path == "dmabuf":
            fd, start, size, at = _dmabuf_fd(addr, length, device.index or 0)
            try:
                mr = DmaBufMR(self.pd, size, self._access, dmabuf=fd, offset=at)
            finally:
                os.close(fd)  # the MR holds its own reference to the dmabuf
            # pyverbs registers it with iova = offset (rdma-core pyverbs/mr.pyx, v44 as v59:
            # ibv_reg_dmabuf_mr(pd, offset, length, offset, fd, access)): the NIC knows the byte
            # at ``start`` by ``at``, which is not 0 where HSA exported the whole allocation
            return Region(start, size, mr.lkey, mr.rkey, mr, iova=at)
        raise ValueError(f"RDMA {self.name}: memory on {device} cannot be registered (path {path}); "
                         "it is staged through host memory")

    def deregister(self, region: Region) -> None:
        region.handle.close()

    def create_qp(self, send_depth: int, recv_depth: int) -> "PyverbsQueuePair":
        return PyverbsQueuePair(self, send_depth, recv_depth)

    def poll(self, max_entries: int) -> list[Completion]:
        count, wcs = self.cq.poll(max_entries)
        if not count:
            return []
        kinds, statuses = _completion_names()
        success = enum("IBV_WC_SUCCESS")
        return [Completion(wc.wr_id, wc.qp_num, kinds.get(wc.opcode, f"opcode {wc.opcode}"), wc.status == success,
                           statuses.get(wc.status, f"status {wc.status}"), wc.imm_data, wc.byte_len)
                for wc in wcs[:count]]

    def close(self) -> None:
        self.cq.close()  # the PD and context stay: other groups of this process may use them


class PyverbsQueuePair:
    """An RC queue pair: RESET -> INIT -> RTR -> RTS once the peer's connection data is in."""

    def __init__(self, nic: PyverbsNic, send_depth: int, recv_depth: int) -> None:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.nic = nic
        cap = QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=enum("IBV_QPT_RC"), scq=nic.cq, rcq=nic.cq, cap=cap, sq_sig_all=1)
        self.qp = QP(nic.pd, init)
        self.qpn = self.qp.qp_num
        self.psn = random.getrandbits(24)

    def info(self) -> ConnInfo:
        port = self.nic.port
        return ConnInfo(port.device, port.port, self.qpn, self.psn, port.lid, port.gid, port.mtu)

    def connect(self, remote: ConnInfo) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        port = self.nic.port
        attr = QPAttr(port_num=port.port)
        attr.qp_access_flags = self.nic._access
        gid = GID()
        gid.gid = remote.gid
        route = GlobalRoute(dgid=gid, sgid_index=port.gid_index, hop_limit=_HOP_LIMIT)  # RoCEv2 crosses routers
        attr.ah_attr = AHAttr(port_num=port.port, is_global=1, gr=route, dlid=remote.lid)
        attr.path_mtu = min(port.mtu, remote.mtu)
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote.qpn, remote.psn, self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7  # rnr 7: retry forever
        self.qp.to_rts(attr)

    def _sge(self, region: Region, addr: int, length: int) -> Any:
        from pyverbs.wr import SGE
        return SGE(addr, length, region.lkey)

    def post_recv(self, region: Region, addr: int, length: int, wr_id: int) -> None:
        from pyverbs.wr import RecvWR
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[self._sge(region, addr, length)]))

    def post_send(self, region: Region, addr: int, length: int, wr_id: int) -> None:
        from pyverbs.wr import SendWR
        self.qp.post_send(SendWR(wr_id=wr_id, opcode=enum("IBV_WR_SEND"), num_sge=1,
                                 sg=[self._sge(region, addr, length)], send_flags=enum("IBV_SEND_SIGNALED")))

    def post_write_imm(self, region: Region, addr: int, length: int, remote_addr: int, rkey: int, imm: int,
                       wr_id: int) -> None:
        from pyverbs.wr import SendWR
        wr = SendWR(wr_id=wr_id, opcode=enum("IBV_WR_RDMA_WRITE_WITH_IMM"), num_sge=1,
                    sg=[self._sge(region, addr, length)], send_flags=enum("IBV_SEND_SIGNALED"), imm_data=imm)
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)

    def close(self) -> None:
        self.qp.close()
