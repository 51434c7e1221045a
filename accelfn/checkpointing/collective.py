"""The few collectives a save or a load needs: agreeing on failures and on rank 0's values.

Every stage of ``save()`` and ``load()``
ends with ``agree()``: one all-reduce (MAX) of a flag, so that an error on one process
raises on all of them and none is left waiting in the next collective. In a single process
these are plain function calls. Each takes an optional ``group`` (default: the default
process group); an asynchronous save's background thread passes its own (see ``background``).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .format import CheckpointError

__all__ = ["agree", "anyone", "from_rank0", "gather", "rank_world"]

T = TypeVar("T")


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():  # type: ignore[no-untyped-call]
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _collective_device(group: Any = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def anyone(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is set on any process (one all-reduce of an int; local otherwise)."""
    if rank_world()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def from_rank0(value: T, group: Any = None) -> T:
    """Rank 0's ``value`` on every process."""
    if rank_world()[1] == 1:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0, group=group, device=_collective_device(group))
    result: T = box[0]
    return result


def agree(error: BaseException | None, what: str,
          kind: type[Exception] = CheckpointError, group: Any = None,
          like: tuple[type[Exception], ...] = ()) -> None:
    """Raise on every process if any process failed ``what``: its own error where it failed;
    on the others, the first of ``like`` that the failing process' error is an instance of
    (so that every process raises the same type), else a ``kind``, saying which process
    failed and how (its error's type and message)."""
    if anyone(error is not None, group):
        told = gather(None if error is None else
                      (type(error).__name__, [c.__name__ for c in type(error).__mro__],
                       str(error)), group)
        if error is not None:
            raise error
        rank, (name, mro, message) = next((r, m) for r, m in enumerate(told) if m is not None)
        same = next((c for n in mro for c in like if c.__name__ == n), kind)
        raise same(f"{what} failed on another process (rank {rank}: {name}: {message})")


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every process' ``value``, in rank order (``[value]`` in a single process)."""
    world = rank_world()[1]
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out
