"""Argument checks of the Ray door: bad input raises before any data moves, naming the group."""

from __future__ import annotations

from typing import Any

from ray.util.collective.types import ReduceOp

from hetccl_ray.collective.tensors import Operand
from hetccl_ray.errors import HetCCLInputError

_RAY_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


class ArgumentChecks:
    """The checks of one group's calls (its name and size go into every message)."""

    def __init__(self, group_name: str, world_size: int) -> None:
        self.group_name, self.world_size = group_name, world_size

    def one(self, tensors: Any, what: str) -> Any:
        """The tensor of a call that takes one (Ray passes lists for its multi-GPU form)."""
        if isinstance(tensors, (list, tuple)):
            if len(tensors) != 1:
                raise HetCCLInputError(f"group '{self.group_name}': {what} takes one tensor per rank, got a list of "
                                       f"{len(tensors)} (multi-GPU lists are not supported by hetccl)")
            return tensors[0]
        return tensors

    def rank(self, rank: int, what: str) -> int:
        """A rank of this group (a root, a peer)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise HetCCLInputError(f"group '{self.group_name}': {what} {rank!r} is not a rank of this group of "
                                   f"{self.world_size} (0..{self.world_size - 1})")
        return rank

    def per_rank_list(self, lists: Any, what: str, nested: bool = True, moving: bool = False) -> list[Operand]:
        """One operand per rank; ``nested``: Ray's form, a list holding that list (multi-GPU)."""
        tensor_list = self.one(lists, what) if nested else lists
        if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != self.world_size:
            got = len(tensor_list) if isinstance(tensor_list, (list, tuple)) else type(tensor_list).__name__
            raise HetCCLInputError(f"group '{self.group_name}': {what} must be a list of world_size="
                                   f"{self.world_size} tensors, got {got}")
        return [Operand(t, moving) for t in tensor_list]

    @staticmethod
    def reduce_op(options: Any) -> str:
        """The reduce op of Ray's options object, by hetccl's name."""
        op = getattr(options, "reduceOp", ReduceOp.SUM)
        if op not in _RAY_OPS:
            raise HetCCLInputError(f"unsupported reduce op {op!r}; supported: SUM, PRODUCT, MIN, MAX")
        return _RAY_OPS[op]
