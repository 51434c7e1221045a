"""with_clipping: gradient clipping by global norm or by value."""

from __future__ import annotations

import math
from typing import overload

import torch

from ..core.contexts import UpdateContext
from ..step.engine import LossFn, Step
from ..step.extension import Transform, configure
from ..step.spec import Clipping

__all__ = ["with_clipping"]


def _global(norm: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm  # FSDP2 shards: over all processes


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` grouped by the mesh their gradients are sharded over (one group without
    DTensors, or under DDP, FSDP2 and HSDP). Tensor-parallel layers live on the (dp, tp)
    mesh and the rest on dp only: a DTensor operation cannot take both at once."""
    meshes: dict[object, list[torch.Tensor]] = {}
    for p in params:
        meshes.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(meshes.values())


def _total_norm(groups: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """``get_total_norm`` of the groups' gradients, over all processes: each mesh's norm,
    then their norm (the plain call, bitwise, for one group)."""
    norms = [_global(torch.nn.utils.get_total_norm(
        [p.grad for p in group if p.grad is not None], norm_type)) for group in groups]
    if len(norms) == 1:
        return norms[0]
    stacked = torch.stack(norms)
    return stacked.amax() if math.isinf(norm_type) else torch.linalg.vector_norm(
        stacked, norm_type)


def _clipping(max_norm: float | None, norm_type: float, max_value: float | None) -> Transform:
    def clip(ctx: UpdateContext) -> torch.Tensor | None:
        # the model's parameter order, as clip_grad_norm_(model.parameters()) sums the norm
        params = ctx.parameters()
        if max_value is None and all(  # no sharded gradient: torch's one call
                getattr(p.grad, "device_mesh", None) is None for p in params):
            assert max_norm is not None
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            ctx.metrics["grad_norm"] = norm
            return norm  # NaN/Inf when any gradient was: the non-finite decision reads it
        groups = _by_mesh([p for p in params if p.grad is not None])
        norm = _total_norm(groups, norm_type)
        ctx.metrics["grad_norm"] = norm.detach() if norm.requires_grad else norm
        for group in groups:
            if max_value is None:
                assert max_norm is not None
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
            else:  # clamping turns an Inf gradient into max_value: the norm before it tells
                torch.nn.utils.clip_grad_value_(group, max_value)
        return norm  # NaN/Inf when any gradient was: the non-finite decision reads it

    if max_value is not None:
        label = f"with_clipping(max_value={max_value:g})"
    else:
        assert max_norm is not None
        norm = "" if norm_type == 2.0 else f", norm_type={norm_type:g}"
        label = f"with_clipping(max_norm={max_norm:g}{norm})"
    return Transform(
        "with_clipping", Clipping(clip),
        options=(("max_norm", max_norm), ("norm_type", norm_type), ("max_value", max_value)),
        label=label)


@overload
def with_clipping(fn: LossFn | Step, /) -> Step: ...
@overload
def with_clipping(*, max_norm: float | None = None, norm_type: float = 2.0,
                  max_value: float | None = None) -> Transform: ...
def with_clipping(
    fn: LossFn | Step | None = None,
    /,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    max_value: float | None = None,
) -> Step | Transform:
    """Equivalent to ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
    norm_type)`` before ``optimizer.step()`` (or ``clip_grad_value_(model.parameters(),
    max_value)``), bitwise: the norm is summed in the model's parameter order.

    Always applied to unscaled, fully accumulated (and, across processes, reduced) gradients,
    after user gradient transforms, whatever the stacking order. Bare ``with_clipping(f)``
    clips to global L2 norm 1.0. Metric ``grad_norm``: the total norm before clipping, a
    device tensor.
    """
    if max_norm is not None and max_value is not None:
        raise ValueError("with_clipping takes max_norm or max_value, not both")
    if max_norm is None and max_value is None:
        max_norm = 1.0
    for label, value in (("max_norm", max_norm), ("max_value", max_value)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0 or math.isinf(value)):
            raise ValueError(f"with_clipping({label}={value!r}) must be a finite number > 0")
    if not (norm_type == math.inf or (isinstance(norm_type, (int, float)) and norm_type > 0)):
        raise ValueError(f"with_clipping(norm_type={norm_type!r}) must be > 0 or math.inf")
    return configure("with_clipping", fn, _clipping(
        None if max_norm is None else float(max_norm), float(norm_type),
        None if max_value is None else float(max_value)))
