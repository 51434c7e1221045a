"""with_amp: automatic mixed precision, bf16 or fp16 with dynamic loss scaling
(``accelfn.parts.precision``)."""

from __future__ import annotations

from typing import overload

import torch

from ..parts.precision import ModuleSpec, Precision
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["with_amp"]


@overload
def with_amp(fn: LossFn | Step, /) -> Step: ...
@overload
def with_amp(*, dtype: torch.dtype | None = None,
             fp32: ModuleSpec | tuple[ModuleSpec, ...] | list[ModuleSpec] = (),
             init_scale: float = 2.0**16, growth_interval: int = 2000,
             cache: bool = True) -> Transform: ...
def with_amp(
    fn: LossFn | Step | None = None,
    /,
    *,
    dtype: torch.dtype | None = None,
    fp32: ModuleSpec | tuple[ModuleSpec, ...] | list[ModuleSpec] = (),
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    cache: bool = True,
) -> Step | Transform:
    """Equivalent to running the forward under ``torch.autocast(device, dtype)``.

    With ``dtype=torch.float16`` the loss is also scaled by a ``torch.amp.GradScaler``
    (``scaler.scale(loss).backward(); scaler.unscale_(opt)``; an overflow skips the update and
    halves the scale, exactly as ``scaler.step``/``scaler.update`` do). The default dtype is
    bf16 where the hardware computes it: fp16 on GPUs without bf16, and float32 (autocast off,
    with a warning) on CPUs without native bf16 (AVX-512 or AMX), where emulated bf16 runs
    many times slower than float32. ``fp32`` names modules that must run in float32 with
    autocast off (module types, qualified names, or ``predicate(name, module)``), e.g.
    ``fp32=nn.LSTM``; autocast is off there for the CPU and the accelerator, so modules without
    parameters (a softmax, a loss) qualify too. ``init_scale`` is a finite number > 0 and
    ``growth_interval`` an int >= 1 (else an error when the transform is built).
    ``cache=False`` turns autocast's weight cache off (``cache_enabled=False``): a module
    called twice in one step (a GAN's discriminator on real, then fake) otherwise reuses one
    low-precision copy of its weight, so the two uses' weight gradients are summed in bf16
    before reaching the float32 weight, where two autocast regions sum them in float32 (about
    1e-4 relative on a 64-wide Linear); without the cache each use casts again (a cast per call).
    Metrics: ``loss_scale`` with fp16.
    """
    options = Precision(dtype, fp32, init_scale, growth_interval, cache)  # type: ignore[arg-type]
    return configure("with_amp", fn, builtin("with_amp", options))
