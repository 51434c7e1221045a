"""with_amp: automatic mixed precision (bf16, or fp16 with dynamic loss scaling)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core import compat
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.modules import wrap_forward
from ..core.state import TrainState
from ..step.engine import LossFn, Step
from ..step.extension import Transform, configure
from ..step.spec import Precision

__all__ = ["with_amp"]

ModuleSpec = type | str | Callable[[str, nn.Module], bool]
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_SLOT = "with_amp"


def _to_fp32(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def _matches(spec: ModuleSpec, name: str, module: nn.Module) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    if isinstance(spec, str):
        return name == spec
    return bool(spec(name, module))


def _resolve(dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The autocast dtype: ``dtype``, or the default where the hardware computes it (None:
    float32, autocast off, on a CPU that would only emulate bf16)."""
    if dtype is not None:
        return dtype
    if device.type == "cuda" and not _cuda_bf16():
        return torch.float16
    if device.type == "cpu" and not _cpu_bf16():
        return None
    return torch.bfloat16


_NO_BF16 = ("with_amp(): this CPU has no native bf16 (AVX-512 or AMX), where autocast's bf16 "
            "runs many times slower than float32, so the forward runs in float32 (autocast "
            "off); pass dtype=torch.bfloat16 to use bf16 anyway")


def _amp(dtype: torch.dtype | None, fp32: tuple[ModuleSpec, ...], init_scale: float,
         growth_interval: int, cache: bool) -> Transform:
    def check(state: TrainState) -> list[nn.Module]:
        """The fp32 islands: the modules ``fp32`` matches (at least one when it is given)."""
        found = [module for name, module in state.model.named_modules()
                 if any(_matches(spec, name, module) for spec in fp32)]
        if fp32 and not found:
            raise ValueError(
                f"with_amp(fp32={fp32!r}) matched no module of the model; give module "
                "types (nn.LSTM), qualified names ('encoder.rnn') or a "
                "predicate(name, module)")
        return found

    def islands(prepared: Prepared, state: TrainState) -> Prepared:
        found = check(state) if fp32 else []
        resolved = _resolve(dtype, prepared.device)
        if resolved is None:
            state.warn_once("with_amp.cpu_bf16", _NO_BF16)
        if resolved == torch.float16:
            state.slot(_SLOT, lambda: torch.amp.GradScaler(
                prepared.device.type, init_scale=init_scale, growth_interval=growth_interval))
        for module in found:
            wrap_forward(module, "fp32", _run_in_fp32)
        return dataclasses.replace(prepared, compute_dtype=resolved)

    def forward_context(ctx: CallContext) -> contextlib.AbstractContextManager[Any]:
        compute = ctx.prepared.compute_dtype
        if compute is None:  # the default on a CPU without native bf16: float32
            return contextlib.nullcontext()
        return torch.autocast(ctx.device.type, dtype=compute, cache_enabled=cache)

    def scale_loss(ctx: CallContext, loss: Tensor) -> Tensor:
        scaler = ctx.state.get_slot(_SLOT)
        return loss if scaler is None else scaler.scale(loss)

    def unscale(ctx: UpdateContext) -> Tensor | None:
        scaler = ctx.state.get_slot(_SLOT)
        if scaler is None:
            return None
        ctx.metrics["loss_scale"] = compat.scaler_scale(scaler).detach().clone()
        found = []  # one scaler for all optimizers, as PyTorch's AMP recipe for several
        for optimizer in ctx.state.optimizers:
            scaler.unscale_(optimizer)
            found += compat.scaler_found_inf(scaler, optimizer)
        flags = [f.to(ctx.device) for f in found]
        overflow = (torch.stack(flags).sum() > 0 if flags
                    else torch.zeros((), dtype=torch.bool, device=ctx.device))
        if ctx.distributed is not None:
            overflow = _agree_overflow(overflow, found, ctx.distributed)
        return overflow

    def after_update(ctx: UpdateContext, skipped: Tensor) -> None:
        scaler = ctx.state.get_slot(_SLOT)
        if scaler is not None:
            scaler.update()

    def abort(ctx: CallContext) -> None:
        scaler = ctx.state.get_slot(_SLOT)
        if scaler is not None:
            compat.scaler_forget_step(scaler)

    label = "auto" if dtype is None else _DTYPES[dtype]
    extra = (f", fp32={len(fp32)} module spec(s)" if fp32 else "") + (
        "" if cache else ", cache=False")
    checked = check if fp32 else None
    if dtype == torch.bfloat16:  # no loss scaling: autocast only
        part = Precision(islands, forward_context, check=checked)
    else:  # fp16, or a dtype chosen on the device: a loss scaler
        part = Precision(islands, forward_context, check=checked, scale=scale_loss,
                         unscale=unscale, update=after_update, forget=abort)
    return Transform(
        _SLOT,
        part,
        options=(("dtype", dtype), ("fp32", fp32), ("init_scale", init_scale),
                 ("growth_interval", growth_interval), ("cache", cache)),
        label=f"with_amp({label}{extra})",
    )


def _agree_overflow(overflow: Tensor, found: list[Tensor], group: Any) -> Tensor:
    """One overflow flag for every process, in the scaler too (its ``update()`` reads
    ``found``): unscaling checked this process' gradients, which are not yet reduced when
    an update follows unsynced backwards (``step.flush``), so that an Inf on one process
    only would back the scale off there alone, and the scales, then the replicas, part.
    One all-reduce (MAX) of a scalar on the device; no host read."""
    flag = overflow.to(torch.float32)
    dist.all_reduce(flag, dist.ReduceOp.MAX, group=group)
    for f in found:
        f.copy_(flag)
    return flag > 0


@functools.cache
def _cuda_bf16() -> bool:
    return bool(torch.cuda.is_bf16_supported())


@functools.cache
def _cpu_bf16() -> bool:
    return compat.cpu_bf16_native()


def _run_in_fp32(module: nn.Module, forward: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
    # Autocast off for the CPU and for the accelerator, whichever is on: not the device of the
    # module's parameters, which a module without any (a softmax, a loss) does not have.
    accelerator = torch.accelerator.current_accelerator()
    off_there = (torch.autocast(accelerator.type, enabled=False)
                 if accelerator is not None and accelerator.type != "cpu"
                 else contextlib.nullcontext())
    with torch.autocast("cpu", enabled=False), off_there:
        return forward(*_to_fp32(args), **_to_fp32(kwargs))


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
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(
            f"with_amp(dtype={dtype}) is not a mixed-precision dtype; use torch.bfloat16 or "
            "torch.float16 (or leave it out for bf16 where supported)"
        )
    specs = tuple(fp32) if isinstance(fp32, (tuple, list)) else (fp32,)
    for spec in specs:
        if not (isinstance(spec, (type, str)) or callable(spec)):
            raise TypeError(f"with_amp(fp32=...) got {spec!r}; give a module type, name or "
                            "predicate(name, module)")
    _check_scaler_options(init_scale, growth_interval)
    if not isinstance(cache, bool):
        raise TypeError(f"with_amp(cache={cache!r}) takes True (autocast's weight cache, the "
                        "default) or False")
    return configure("with_amp", fn, _amp(dtype, specs, float(init_scale), int(growth_interval),
                                          cache))


_FP32_MAX = torch.finfo(torch.float32).max  # GradScaler keeps its scale in float32


def _check_scaler_options(init_scale: object, growth_interval: object) -> None:
    scale_range = f"a finite number > 0 (at most {_FP32_MAX:.3g}, float32's largest)"
    if isinstance(init_scale, bool) or not isinstance(init_scale, numbers.Real):
        raise TypeError(f"with_amp(init_scale={init_scale!r}) must be {scale_range}, e.g. "
                        "init_scale=2.0**16 (the default)")
    if not (math.isfinite(init_scale) and 0 < float(init_scale) <= _FP32_MAX):
        raise ValueError(f"with_amp(init_scale={init_scale!r}) must be {scale_range}, e.g. "
                         "init_scale=2.0**16 (the default): a scale that is not finite makes "
                         "every fp16 update overflow and be skipped")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral):
        raise TypeError(f"with_amp(growth_interval={growth_interval!r}) must be an int >= 1 "
                        "(the number of overflow-free updates before the scale grows), e.g. "
                        "growth_interval=2000 (the default)")
    if growth_interval < 1:
        raise ValueError(f"with_amp(growth_interval={growth_interval!r}) must be an int >= 1 "
                         "(the number of overflow-free updates before the scale grows), e.g. "
                         "growth_interval=2000 (the default)")
