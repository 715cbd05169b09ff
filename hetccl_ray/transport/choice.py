"""Which transport each cross-island peer gets: RDMA where both ends have a usable port, else TCP.

Pure: decides from the ports each rank reported at rendezvous and the group's
``transport`` option (``"auto"``, ``"tcp"`` or ``"rdma"``); forcing RDMA where an end has
none is an error, never a silent TCP.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetccl_ray.errors import HetCCLError
from hetccl_ray.transport.verbs import Discovery

TRANSPORTS = ("auto", "tcp", "rdma")


@dataclass(frozen=True)
class Choice:
    """The transport of one peer and why."""

    transport: str
    why: str


def choose(option: str, rank: int, mine: Discovery, peer: int, theirs: Discovery) -> Choice:
    """The transport between ``rank`` and ``peer`` given what each found and the option."""
    if option == "tcp":
        return Choice("tcp", "transport='tcp' was asked for")
    lacking = [(r, found) for r, found in ((rank, mine), (peer, theirs)) if not found.ports]
    if not lacking:
        layers = {port.link_layer for port in mine.ports} & {port.link_layer for port in theirs.ports}
        if layers:
            return Choice("rdma", f"both ends have {'/'.join(sorted(layers))} RDMA ports "
                                  f"({mine.ports[0].device} and {theirs.ports[0].device})")
        why = (f"rank {rank}'s ports ({mine.ports[0].link_layer}) and rank {peer}'s "
               f"({theirs.ports[0].link_layer}) share no link layer")
    else:
        why = "; ".join(f"rank {r} has no usable RDMA port: {found.why}" for r, found in lacking)
    if option == "rdma":
        raise HetCCLError(f"transport='rdma' between rank {rank} and rank {peer} is impossible: {why}")
    return Choice("tcp", why)
