"""Adaptive accumulation in several processes: the processes agree on each pass's outcome.

An out-of-memory error in one process must never leave a collective half done in the others.
So while the accumulation adapts its micro-batch count (``with_accumulation(adaptive=True)``)
under a process group, every micro-batch's backward runs without gradient sync (the
reduction all-reduces the gradients once, after the agreement), and after the pass one
all-reduce of four flags (failed, stuck at one sample per micro-batch, failed otherwise, the
count each proposes) tells every process the same outcome: go on, run the call again with
the largest count any proposes, or raise (every process raises, none is left waiting).
Refused where the sharding cannot run its backward unsynced (FSDP2, DDP's static graph).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.contexts import CallContext
from ..parts import accumulation, sharding
from . import checks

if TYPE_CHECKING:
    from .engine import Step

__all__ = ["agree", "agreed", "needed"]

_AGREED = "_accelfn_agreed"  # an error every process has raised after agreeing on it


def agreed(error: BaseException) -> bool:
    """Whether every process raises ``error``, having agreed on it."""
    return bool(getattr(error, _AGREED, False))


def needed(step: Step, ctx: CallContext) -> bool:
    """Whether the processes agree on each call's outcome: adaptive accumulation in several
    processes (refused, before anything changes, where the sharding cannot skip the sync)."""
    spec = step.spec
    options, distributed = spec.accumulation, spec.sharding
    if ctx.distributed is None or options is None or not options.adaptive:
        return False
    refusal = "a sharding that cannot run its backward unsynced" if distributed is None \
        else sharding.unsynced_refusal(distributed, ctx)
    if refusal is not None:
        raise ValueError(
            f"with_accumulation(adaptive=True) in several processes needs distributed() "
            f"with DDP and no static graph, got {refusal} in {step!r}: "
            "its backward must run without collectives until the processes agree. Find "
            "the count with DDP (or in one process) and set it with with_accumulation(n)")
    return True


def agree(step: Step, ctx: CallContext, error: Exception | None) -> bool:
    """The processes' agreement after a pass (one all-reduce and one host read per call):
    True when every process succeeded; False when one ran out of memory and all run the
    call again with the largest count any proposes; raises when one cannot split finer
    or failed otherwise (every process raises: none is left waiting in a collective)."""
    spec = step.spec
    options = spec.accumulation
    assert options is not None and options.adaptive
    oom = isinstance(error, torch.OutOfMemoryError)
    finer = oom and error is not None and accumulation.retry(options, ctx, error)
    flags = torch.tensor([error is not None, oom and not finer, error is not None and not oom,
                          accumulation.count(options, ctx, None)], dtype=torch.int64,
                         device=ctx.device)
    torch.distributed.all_reduce(flags, torch.distributed.ReduceOp.MAX, ctx.distributed)
    failed, stuck, other, count = flags.tolist()
    if not failed:
        if spec.sharding is not None:
            sharding.agreed(spec.sharding, ctx)
        return True
    if other or stuck:
        if error is not None:
            failure: BaseException = error
            if oom:
                failure = checks.out_of_memory(repr(step), step.transforms, spec, error)
            setattr(failure, _AGREED, True)
            if failure is error:
                raise error
            raise failure from error
        what = "failed" if other else "ran out of memory with one sample per micro-batch"
        failure = (RuntimeError if other else torch.OutOfMemoryError)(
            f"another process of the run {what} in the forward or backward of "
            f"{step!r}; this one stops too (its gradients were cleared, "
            "parameters and optimizer unchanged). Its error says what happened")
        setattr(failure, _AGREED, True)
        raise failure
    accumulation.count(options, ctx, count)
    return False
