"""The unit absolute weights are counted in under loss scaling and fp16 compression.

Absolutely weighted micro-batches (``with_accumulation(n, mode="calls")``, or a returned
``"weight"``) multiply each loss by its sample or token count and divide the gradients by the
window's total after the backward. In float32 the magnitude of that objective does not
matter; in fp16 it does: under fp16's GradScaler ``loss * 4096 * 2**16`` overflows in the
backward where the plain loop's ``scaler.scale(loss / n).backward()`` does not, and DDP's fp16
compression hook casts gradients the sample count times larger than a mean loss's. Under a
``scale_loss`` hook or ``compression="fp16"`` the engine therefore counts weights in a unit:
a power of two near the first update's total weight, so each objective is about
``loss / n`` as in the plain loop. A power of two divides exactly, so the gradients (numerator
and divisor divided alike) are unchanged.

The unit is agreed once per TrainState, at its first weighted micro-batch, and kept in the
state (checkpointed with it): every process must count in the same unit, or DDP would
average gradients weighted differently on each. The agreement is a device all-reduce, with
no host read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .contexts import CallContext

__all__ = ["SLOT", "inverse_unit"]

SLOT = "weight_unit"
_LARGEST = 2.0**60  # far above any count; keeps the unit a normal float32


class _Unit:
    """The state's weight unit, kept as its inverse (None until agreed)."""

    def __init__(self) -> None:
        self.inverse: Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"inverse": self.inverse}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        inverse = saved.get("inverse")
        if inverse is not None and not isinstance(inverse, Tensor):
            raise ValueError(f"the checkpointed weight unit is {inverse!r}, not a tensor")
        self.inverse = inverse


def inverse_unit(ctx: CallContext, coef: Tensor | float, count: int) -> Tensor:
    """1 / the state's weight unit (a device scalar), agreed at the first call.

    ``coef`` is the first micro-batch's weight and ``count`` the micro-batches of an update
    (micro-batches of the call times calls of the window): their product estimates the
    update's total weight.
    """
    unit: _Unit = ctx.state.slot(SLOT, _Unit)
    inverse = unit.inverse
    if inverse is None:
        inverse = unit.inverse = _agree(ctx, coef, count)
    elif inverse.device != ctx.device:  # loaded from a checkpoint mapped elsewhere
        inverse = unit.inverse = inverse.to(ctx.device)
    return inverse


def _agree(ctx: CallContext, coef: Tensor | float, count: int) -> Tensor:
    if isinstance(coef, Tensor):
        total = coef.detach().to(device=ctx.device, dtype=torch.float32) * count
    else:
        total = torch.full((), float(coef) * count, dtype=torch.float32, device=ctx.device)
    # a zero, negative or non-finite first weight counts in ones
    total = torch.where(torch.isfinite(total), total, 1.0).clamp(1.0, _LARGEST)
    inverse = torch.exp2(-torch.floor(torch.log2(total)))
    group = ctx.distributed
    if group is not None:  # the largest unit of all processes: the smallest objective
        dist.all_reduce(inverse, op=dist.ReduceOp.MIN, group=group)
    return inverse
