"""with_clipping: gradient clipping by global norm or by value."""

from __future__ import annotations

import math

import torch

from ..core.engine import StepContext, configurable

__all__ = ["with_clipping"]


class _Clipping:
    name = "with_clipping"
    grads_order = 30

    def __init__(self, max_norm: float | None, norm_type: float, max_value: float | None) -> None:
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.max_value = max_value

    def __repr__(self) -> str:
        if self.max_value is not None:
            return f"with_clipping(max_value={self.max_value:g})"
        norm = "" if self.norm_type == 2.0 else f", norm_type={self.norm_type:g}"
        return f"with_clipping(max_norm={self.max_norm:g}{norm})"

    def on_grads(self, ctx: StepContext) -> None:
        params = [p for g in ctx.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], self.norm_type)
        if hasattr(norm, "full_tensor"):  # FSDP2 shards: the norm over all processes
            norm = norm.full_tensor()
        if self.max_value is None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        else:
            torch.nn.utils.clip_grad_value_(params, self.max_value)
        ctx.grad_norm = norm
        ctx.metrics["grad_norm"] = norm.detach()


def _build_clipping(
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    max_value: float | None = None,
) -> _Clipping:
    """Equivalent to ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` before
    ``optimizer.step()`` (or ``clip_grad_value_(params, max_value)``).

    Always applied to unscaled, fully accumulated (and, across processes, reduced) gradients,
    whatever the stacking order. Bare ``with_clipping(f)`` clips to global L2 norm 1.0.
    Metric ``grad_norm``: the total norm before clipping, a device tensor.
    """
    if max_norm is not None and max_value is not None:
        raise ValueError("with_clipping takes max_norm or max_value, not both")
    if max_norm is None and max_value is None:
        max_norm = 1.0
    for label, value in (("max_norm", max_norm), ("max_value", max_value)):
        if value is not None and (not isinstance(value, (int, float)) or not value > 0
                                  or math.isinf(value)):
            raise ValueError(f"with_clipping({label}={value!r}) must be a finite number > 0")
    if not (norm_type == math.inf or (isinstance(norm_type, (int, float)) and norm_type > 0)):
        raise ValueError(f"with_clipping(norm_type={norm_type!r}) must be > 0 or math.inf")
    return _Clipping(None if max_norm is None else float(max_norm), float(norm_type),
                     None if max_value is None else float(max_value))


with_clipping = configurable("with_clipping", _build_clipping)
