"""hetccl_ray: a Ray collective group over GPU islands of mixed vendors.

``import hetccl_ray`` registers the backend ``"hetccl"`` with ``ray.util.collective``.
"""

from __future__ import annotations

from hetccl_ray.core.topology import ISLAND_LABEL, Topology
from hetccl_ray.doors.ray_collective import (alltoall, border_stats, create_collective_group, get_group,
                                             get_torch_group, register, set_group_options, setup_worker)
from hetccl_ray.errors import (HetCCLBrokenError, HetCCLError, HetCCLInputError, HetCCLMismatchError,
                               HetCCLPeerError, HetCCLTimeoutError, HetCCLTypeError)
from hetccl_ray.features.weights import broadcast_state_dict
from hetccl_ray.group.group import BACKEND, HetCCLGroup
from hetccl_ray.group.options import GroupOptions

__version__ = "0.1.0"
__all__ = ["BACKEND", "GroupOptions", "HetCCLGroup", "HetCCLError", "HetCCLTimeoutError", "HetCCLPeerError",
           "HetCCLMismatchError", "HetCCLBrokenError", "HetCCLInputError", "HetCCLTypeError", "ISLAND_LABEL",
           "Topology", "register", "setup_worker", "set_group_options", "create_collective_group", "get_group",
           "get_torch_group", "alltoall", "border_stats", "broadcast_state_dict"]

register()
