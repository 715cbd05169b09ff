"""Errors raised by hetccl_ray. Each names the op, the group and the ranks concerned."""

from __future__ import annotations


class HetCCLError(RuntimeError):
    """Base class of every hetccl_ray error."""


class HetCCLTimeoutError(HetCCLError, TimeoutError):
    """A wait passed its deadline: a peer did not arrive or did not send. ``waiting_for``:
    the rank waited for, where one transfer was."""

    def __init__(self, message: str = "", waiting_for: "int | None" = None) -> None:
        super().__init__(message)
        self.waiting_for = waiting_for


class RecordsMissing(HetCCLTimeoutError):
    """Rendezvous records that did not arrive before the deadline (``missing``: their keys)."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class HetCCLPeerError(HetCCLError):
    """A peer closed its connection or failed during an op."""


class HetCCLMismatchError(HetCCLError):
    """Ranks called different ops, dtypes, sizes or roots in the same step."""


class HetCCLBrokenError(HetCCLError):
    """The group failed earlier; destroy and re-create it."""


class HetCCLInputError(HetCCLError, ValueError):
    """Bad input to a call (size, shape, list length, rank, root, reduce op). A ``ValueError``
    as before, and a ``RuntimeError`` as Ray's own gloo/nccl backends raise for it."""


class HetCCLTypeError(HetCCLInputError, TypeError):
    """An input of an unsupported type or dtype: also a ``TypeError``."""
