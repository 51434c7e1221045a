"""with_amp: automatic mixed precision (bf16, or fp16 with dynamic loss scaling)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core.engine import Prepared, StepContext, configurable
from ..core.modules import wrap_forward
from ..core.state import TrainState

__all__ = ["with_amp"]

ModuleSpec = type | str | Callable[[str, nn.Module], bool]
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


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


class _Amp:
    name = "with_amp"
    prepare_order = 5
    grads_order = 0

    def __init__(self, dtype: torch.dtype | None, fp32: tuple[ModuleSpec, ...],
                 init_scale: float, growth_interval: int) -> None:
        self.dtype = dtype
        self.fp32 = fp32
        self.init_scale = init_scale
        self.growth_interval = growth_interval

    def __repr__(self) -> str:
        dtype = "auto" if self.dtype is None else _DTYPES[self.dtype]
        extra = f", fp32={len(self.fp32)} module spec(s)" if self.fp32 else ""
        return f"with_amp({dtype}{extra})"

    def _dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        if device.type == "cuda" and not _cuda_bf16():
            return torch.float16
        return torch.bfloat16

    def prepare(self, prepared: Prepared, state: TrainState) -> None:
        if self._dtype(state.device) == torch.float16:
            state.slot(self.name, lambda: torch.amp.GradScaler(
                state.device.type, init_scale=self.init_scale,
                growth_interval=self.growth_interval))
        if not self.fp32:
            return
        found = 0
        for name, module in state.model.named_modules():
            if any(_matches(spec, name, module) for spec in self.fp32):
                wrap_forward(module, "fp32", _run_in_fp32)
                found += 1
        if not found:
            raise ValueError(
                f"with_amp(fp32={self.fp32!r}) matched no module of the model; give module "
                "types (nn.LSTM), qualified names ('encoder.rnn') or a predicate(name, module)"
            )

    def forward_context(self, ctx: StepContext) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(ctx.device.type, dtype=self._dtype(ctx.device))

    def _scaler(self, ctx: StepContext) -> torch.amp.GradScaler | None:
        return ctx.state.get_slot(self.name)

    def scale_loss(self, loss: Tensor, ctx: StepContext) -> Tensor:
        scaler = self._scaler(ctx)
        return loss if scaler is None else scaler.scale(loss)

    def on_grads(self, ctx: StepContext) -> None:
        scaler = self._scaler(ctx)
        if scaler is None:
            return
        ctx.metrics["loss_scale"] = scaler._get_scale_async().detach().clone()
        scaler.unscale_(ctx.optimizer)
        found = scaler._found_inf_per_device(ctx.optimizer)
        flags = [f.to(ctx.device) for f in found.values()]
        ctx.grads_nonfinite = (torch.stack(flags).sum() > 0 if flags
                               else torch.zeros((), dtype=torch.bool, device=ctx.device))

    def on_update(self, ctx: StepContext, skipped: Tensor) -> None:
        scaler = self._scaler(ctx)
        if scaler is not None:
            scaler.update()


@functools.cache
def _cuda_bf16() -> bool:
    return torch.cuda.is_bf16_supported()


def _run_in_fp32(module: nn.Module, forward: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
    device_type = next(module.parameters(), torch.empty(0)).device.type
    with torch.autocast(device_type, enabled=False):
        return forward(*_to_fp32(args), **_to_fp32(kwargs))


def _build_amp(
    *,
    dtype: torch.dtype | None = None,
    fp32: ModuleSpec | tuple[ModuleSpec, ...] | list[ModuleSpec] = (),
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
) -> _Amp:
    """Equivalent to running the forward under ``torch.autocast(device, dtype)``.

    With ``dtype=torch.float16`` the loss is also scaled by a ``torch.amp.GradScaler``
    (``scaler.scale(loss).backward(); scaler.unscale_(opt)``; an overflow skips the update and
    halves the scale, exactly as ``scaler.step``/``scaler.update`` do). The default dtype is
    bf16 (fp16 on GPUs without bf16). ``fp32`` names modules that must run in float32 with
    autocast off (module types, qualified names, or ``predicate(name, module)``), e.g.
    ``fp32=nn.LSTM``. Metrics: ``loss_scale`` with fp16.
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
    if init_scale <= 0 or growth_interval < 1:
        raise ValueError("with_amp needs init_scale > 0 and growth_interval >= 1")
    return _Amp(dtype, specs, float(init_scale), int(growth_interval))


with_amp = configurable("with_amp", _build_amp)
