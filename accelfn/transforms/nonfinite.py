"""with_nonfinite: the policy for NaN/Inf losses and gradients (``accelfn.parts.nonfinite``)."""

from __future__ import annotations

from typing import overload

from ..parts.nonfinite import NonFinite, SkipIf
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["with_nonfinite"]


@overload
def with_nonfinite(fn: LossFn | Step, /) -> Step: ...
@overload
def with_nonfinite(*, policy: str = "skip", max_consecutive: int = 10,
                   skip_if: SkipIf | None = None, skipped: str = "hold") -> Transform: ...
def with_nonfinite(fn: LossFn | Step | None = None, /, *, policy: str = "skip",
                   max_consecutive: int = 10, skip_if: SkipIf | None = None,
                   skipped: str = "hold") -> Step | Transform:
    """Equivalent to checking ``torch.isfinite`` of the loss and of every gradient the
    optimizer will apply, just before ``optimizer.step()``, and acting on the answer.

    Every step already guards by default with ``policy="skip", max_consecutive=10``: an update
    whose loss or gradients hold NaN/Inf is skipped (parameters, optimizer state and scheduler
    untouched; metric ``skipped`` is 1) and after ``max_consecutive`` such updates in a row the
    step raises [`accelfn.NonFiniteError`][]. ``policy="raise"`` raises at the first one.
    A refused update leaves parameters, optimizer state, scheduler, carry, EMA weights and loss
    scale untouched, and the next step works; buffers the forward updated, such as BatchNorm
    running statistics, are as the forward left them. ``policy="off"`` removes the check and
    its host read; fp16 loss-scale overflows are still skipped, as ``GradScaler.step`` does, and
    never count towards the limit.

    ``skip_if(loss, grads)`` adds a verdict of your own, taken on the device in the same read:
    a one-element bool tensor, true to skip the update as a non-finite one is skipped
    (counted, limited by ``max_consecutive``, raised under ``policy="raise"``), e.g. loss-spike
    skipping: ``skip_if=lambda loss, grads: loss > 4 * expected``.

    ``skipped="advance"`` makes a skipped update still step the schedulers and average the
    EMA (of the unchanged weights), as a loop that calls ``scheduler.step()`` and
    ``ema.update()`` after ``scaler.step(optimizer)`` unconditionally does (timm's); the
    default ``"hold"`` leaves them for the next applied update.
    """
    if skipped not in ("hold", "advance"):
        raise ValueError(f"with_nonfinite(skipped={skipped!r}) is unknown; use 'hold' (a "
                         "skipped update leaves schedules and EMA) or 'advance'")
    options = NonFinite(policy, max_consecutive, skip_if, advance=skipped == "advance")
    return configure("with_nonfinite", fn, builtin("with_nonfinite", options))
