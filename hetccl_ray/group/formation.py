"""Forming a group: records through the rendezvous, the topology, the border (TCP to every
rank, RDMA to the cross-island peers that can take it) and the direct-transfer channel.
Ray is only asked for this node's address and labels; torch.distributed's door passes its
own store instead."""

from __future__ import annotations

import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray
import torch.distributed as dist

from hetccl_ray.memory import devices
from hetccl_ray.group.options import GroupOptions, ProcessOptions
from hetccl_ray.group.rendezvous import Rendezvous, StoreRendezvous, generation_key, get_raw
from hetccl_ray.errors import HetCCLError, HetCCLMismatchError, HetCCLTimeoutError, RecordsMissing
from hetccl_ray.core.topology import Topology, island_for
from hetccl_ray.transport import verbs
from hetccl_ray.transport.choice import Choice, choose
from hetccl_ray.transport.rdma import RdmaBorder
from hetccl_ray.transport.routed import RoutedBorder
from hetccl_ray.transport.tcp import TcpBorder

logger = logging.getLogger(__name__)


@dataclass
class Formed:
    """What formation leaves a rank: the topology, its border and how each peer is reached,
    the rendezvous, and the store (rank 0's c10d store, where vendor communicators meet)."""

    topology: Topology
    border: Any  # RoutedBorder
    transports: dict[int, Choice]
    rendezvous: Rendezvous
    store: Optional[dist.Store]
    store_address: tuple[str, int]
    direct: TcpBorder  # direct transfers (transport/direct.py): links dialled at first use
    one_host: bool  # every rank shares this host and network namespace (and same-host paths are on)


def _generation(group_name: str) -> str:
    """Tells incarnations of one group name apart: the door's generation record, else Ray's
    info actor id where the group was declared through Ray."""
    claimed = get_raw(generation_key(group_name))
    if claimed:
        return claimed.decode()
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


def form(world_size: int, rank: int, group_name: str, options: GroupOptions, store: Optional[dist.Store]) -> Formed:
    """Publish this rank's record, wait for every rank's before the deadline, build the
    topology and connect the border. A rank that does not arrive, or disagrees on the world
    size, is named; nothing started is left open."""
    in_ray = ray.is_initialized()
    deadline = time.monotonic() + options.timeout_s
    rendezvous = (StoreRendezvous(store, group_name) if store is not None
                  else Rendezvous(group_name, _generation(group_name)))
    host = options.bind_host or (ray.util.get_node_ip_address() if in_ray else _default_host())
    tcp = TcpBorder(rank, host, options.compress, same_host=options.same_host)
    direct = TcpBorder(rank, host, options.compress, redial=True, same_host=options.same_host)
    if store is None and rank == 0:
        store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
    labels = ray.get_runtime_context().get_node_labels() if in_ray else {}
    here = ProcessOptions.from_env()
    found = (verbs.discover(here.rdma_devices, here.rdma_gid_index) if options.transport != "tcp"
             else verbs.Discovery((), "transport='tcp' was asked for"))
    record = {"island": island_for(options.islands.get(rank) or here.island, labels, devices.local_accelerator()),
              "host": host, "port": tcp.address.port, "direct_port": direct.address.port,
              "local": tcp.address.local, "direct_local": direct.address.local, "world_size": world_size,
              "rdma": found.to_record()}
    if rank == 0:
        record.update(store_port=getattr(store, "port", 0), secret=secrets.token_hex(32))
    rendezvous.put(f"rank/{rank}", record)
    try:
        records = _records(rendezvous, world_size, rank, group_name, options.timeout_s, deadline)
        topology = Topology.from_islands([rec["island"] for rec in records], options.max_lanes)
        island = topology.island_of(rank)
        secret, local = bytes.fromhex(records[0]["secret"]), frozenset(island.ranks) - {rank}
        for border, port, name in ((tcp, "port", "local"), (direct, "direct_port", "direct_local")):
            border.set_peers({r: (rec["host"], rec[port], rec[name]) for r, rec in enumerate(records) if r != rank},
                             secret, local)
        tcp.connect_all(max(deadline - time.monotonic(), 1.0))
        transports = {peer: choose(options.transport, rank, found, peer,
                                   verbs.Discovery.from_record(records[peer].get("rdma")))
                      for peer in range(world_size) if peer not in island.ranks}
        border = _routed(tcp, rank, topology, transports, found, rendezvous, deadline)
    except HetCCLError:
        tcp.close()
        direct.close()
        raise
    hosts = {rec["local"].partition("/")[0] for rec in records}
    return Formed(topology, border, transports, rendezvous, store, (records[0]["host"], records[0]["store_port"]),
                  direct, options.same_host and len(hosts) == 1 and "" not in hosts)


def _records(rendezvous: Rendezvous, world_size: int, rank: int, group_name: str, timeout_s: float,
             deadline: float) -> list[dict]:
    """Every rank's record, in rank order."""
    try:
        found = rendezvous.wait([f"rank/{r}" for r in range(world_size)], deadline)
    except RecordsMissing as exc:
        missing = sorted(int(key.split("/")[1]) for key in exc.missing)
        raise HetCCLTimeoutError(f"forming group '{group_name}' on rank {rank} timed out after "
                                 f"{timeout_s:.1f}s; ranks that did not arrive: {missing}") from None
    records = [found[f"rank/{r}"] for r in range(world_size)]
    disagree = {r: rec.get("world_size") for r, rec in enumerate(records) if rec.get("world_size") != world_size}
    if disagree:
        raise HetCCLMismatchError(f"forming group '{group_name}': rank {rank} has world_size {world_size} "
                                  f"but ranks {sorted(disagree)} have {sorted(set(disagree.values()))}")
    return records


def _routed(tcp: TcpBorder, rank: int, topology: Topology, transports: dict[int, Choice], found: verbs.Discovery,
            rendezvous: Rendezvous, deadline: float) -> RoutedBorder:
    """One border over TCP and, to the peers whose transport is RDMA, queue pairs opened now."""
    rdma_peers = sorted(peer for peer, choice in transports.items() if choice.transport == "rdma")
    if not rdma_peers:
        return RoutedBorder(tcp)
    port = verbs.pick_port(found.ports, topology.local_rank(rank), devices.accelerator_numa_node())
    rdma = RdmaBorder(rank, verbs.PyverbsNic(port), rendezvous, timeout_s=max(deadline - time.monotonic(), 1.0))
    try:
        rdma.connect(rdma_peers)
    except HetCCLError:
        rdma.close()
        raise
    return RoutedBorder(tcp, {peer: rdma for peer in rdma_peers})
