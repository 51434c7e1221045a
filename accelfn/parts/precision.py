"""Automatic mixed precision: ``with_amp``'s options and its calls in the update (fp32
islands when preparing, autocast around the forward, fp16's loss scaling around the
backward and the optimizer step)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core import compat
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.modules import wrap_forward
from ..core.state import TrainState

__all__ = ["ModuleSpec", "Precision", "autocast", "check", "forget", "islands", "scale",
           "unscale", "update"]

ModuleSpec = type | str | Callable[[str, nn.Module], bool]
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
SLOT = "with_amp"  # the TrainState slot of fp16's GradScaler
_FP32_MAX = torch.finfo(torch.float32).max  # GradScaler keeps its scale in float32


@dataclass(frozen=True, slots=True, repr=False)
class Precision:
    """``with_amp``'s options: the autocast ``dtype`` (None: the device's default), the
    ``fp32`` islands (module types, qualified names or predicates), fp16's loss scaler
    (``init_scale``, ``growth_interval``) and autocast's weight ``cache``."""

    dtype: torch.dtype | None = None
    fp32: tuple[ModuleSpec, ...] = ()
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    cache: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(
                f"with_amp(dtype={self.dtype}) is not a mixed-precision dtype; use "
                "torch.bfloat16 or torch.float16 (or leave it out for bf16 where supported)")
        fp32 = self.fp32
        specs = tuple(fp32) if isinstance(fp32, (tuple, list)) else (fp32,)
        for spec in specs:
            if not (isinstance(spec, (type, str)) or callable(spec)):
                raise TypeError(f"with_amp(fp32=...) got {spec!r}; give a module type, name or "
                                "predicate(name, module)")
        _check_scaler_options(self.init_scale, self.growth_interval)
        if not isinstance(self.cache, bool):
            raise TypeError(f"with_amp(cache={self.cache!r}) takes True (autocast's weight "
                            "cache, the default) or False")
        object.__setattr__(self, "fp32", specs)
        object.__setattr__(self, "init_scale", float(self.init_scale))
        object.__setattr__(self, "growth_interval", int(self.growth_interval))

    @property
    def scales(self) -> bool:
        """Whether a loss scaler may be needed (fp16, or a dtype chosen on the device)."""
        return self.dtype != torch.bfloat16

    def __repr__(self) -> str:
        label = "auto" if self.dtype is None else _DTYPES[self.dtype]
        extra = (f", fp32={len(self.fp32)} module spec(s)" if self.fp32 else "") + (
            "" if self.cache else ", cache=False")
        return f"with_amp({label}{extra})"


def check(options: Precision, state: TrainState) -> list[nn.Module]:
    """The fp32 islands: the modules ``fp32`` matches (at least one when it is given)."""
    fp32 = options.fp32
    found = [module for name, module in state.model.named_modules()
             if any(_matches(spec, name, module) for spec in fp32)]
    if fp32 and not found:
        raise ValueError(
            f"with_amp(fp32={fp32!r}) matched no module of the model; give module "
            "types (nn.LSTM), qualified names ('encoder.rnn') or a "
            "predicate(name, module)")
    return found


def islands(options: Precision, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: the fp32 islands run in float32 with autocast off; the compute dtype chosen
    for the device; fp16's GradScaler made."""
    found = check(options, state) if options.fp32 else []
    resolved = _resolve(options.dtype, prepared.device)
    if resolved is None:
        state.warn_once("with_amp.cpu_bf16", _NO_BF16)
    if resolved == torch.float16:
        state.slot(SLOT, lambda: torch.amp.GradScaler(
            prepared.device.type, init_scale=options.init_scale,
            growth_interval=options.growth_interval))
    for module in found:
        wrap_forward(module, "fp32", _run_in_fp32)
    return dataclasses.replace(prepared, compute_dtype=resolved)


def autocast(options: Precision, ctx: CallContext) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast (none on a CPU without native bf16, the default there)."""
    compute = ctx.prepared.compute_dtype
    if compute is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=compute, cache_enabled=options.cache)


def scale(ctx: CallContext, loss: Tensor) -> Tensor:
    """The loss the backward starts from: scaled by fp16's GradScaler, else as it is."""
    scaler = ctx.state.get_slot(SLOT)
    return loss if scaler is None else scaler.scale(loss)


def unscale(ctx: UpdateContext) -> Tensor | None:
    """Unscale the gradients of every optimizer (one scaler for all, as PyTorch's AMP recipe
    for several); returns the device flag "the scaled gradients overflowed" (None without a
    scaler), agreed by every process. Metric ``loss_scale``."""
    scaler = ctx.state.get_slot(SLOT)
    if scaler is None:
        return None
    ctx.metrics["loss_scale"] = compat.scaler_scale(scaler).detach().clone()
    found = []
    for optimizer in ctx.state.optimizers:
        scaler.unscale_(optimizer)
        found += compat.scaler_found_inf(scaler, optimizer)
    flags = [f.to(ctx.device) for f in found]
    overflow = (torch.stack(flags).sum() > 0 if flags
                else torch.zeros((), dtype=torch.bool, device=ctx.device))
    if ctx.distributed is not None:
        overflow = _agree_overflow(overflow, found, ctx.distributed)
    return overflow


def update(ctx: UpdateContext, skipped: Tensor) -> None:
    """After the update: the loss scale moves (backs off after an overflow, else grows)."""
    scaler = ctx.state.get_slot(SLOT)
    if scaler is not None:
        scaler.update()


def forget(ctx: CallContext) -> None:
    """After a failed call: the scaler forgets the call's unscaling."""
    scaler = ctx.state.get_slot(SLOT)
    if scaler is not None:
        compat.scaler_forget_step(scaler)


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
