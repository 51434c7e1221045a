"""Gradient clipping by global norm or by value: ``with_clipping``'s options and its one call
in the update, ``clip``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.contexts import UpdateContext

__all__ = ["Clipping", "clip"]


@dataclass(frozen=True, slots=True, repr=False)
class Clipping:
    """``with_clipping``'s options: ``max_norm`` (global norm, of ``norm_type``) or
    ``max_value`` (by value); neither given: ``max_norm=1.0``."""

    max_norm: float | None = None
    norm_type: float = 2.0
    max_value: float | None = None

    def __post_init__(self) -> None:
        if self.max_norm is not None and self.max_value is not None:
            raise ValueError("with_clipping takes max_norm or max_value, not both")
        for label, value in (("max_norm", self.max_norm), ("max_value", self.max_value)):
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))
                                      or not value > 0 or math.isinf(value)):
                raise ValueError(f"with_clipping({label}={value!r}) must be a finite number > 0")
        norm_type = self.norm_type
        if not (norm_type == math.inf or (isinstance(norm_type, (int, float))
                                          and not isinstance(norm_type, bool) and norm_type > 0)):
            raise ValueError(f"with_clipping(norm_type={norm_type!r}) must be > 0 or math.inf")
        max_norm = 1.0 if self.max_norm is None and self.max_value is None else self.max_norm
        object.__setattr__(self, "max_norm", None if max_norm is None else float(max_norm))
        object.__setattr__(self, "norm_type", float(norm_type))
        if self.max_value is not None:
            object.__setattr__(self, "max_value", float(self.max_value))

    def __repr__(self) -> str:
        if self.max_value is not None:
            return f"with_clipping(max_value={self.max_value:g})"
        norm = "" if self.norm_type == 2.0 else f", norm_type={self.norm_type:g}"
        return f"with_clipping(max_norm={self.max_norm:g}{norm})"


def clip(options: Clipping, ctx: UpdateContext) -> torch.Tensor:
    """Clip the update's gradients; returns their total norm before clipping (metric
    ``grad_norm``), NaN/Inf when any gradient was (clipping by value would turn an Inf into
    ``max_value``), which the non-finite decision reads."""
    max_norm, norm_type, max_value = options.max_norm, options.norm_type, options.max_value
    # the model's parameter order, as clip_grad_norm_(model.parameters()) sums the norm
    params = ctx.parameters()
    if max_value is None and all(  # no sharded gradient: torch's one call
            getattr(p.grad, "device_mesh", None) is None for p in params):
        assert max_norm is not None
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        ctx.metrics["grad_norm"] = norm
        return norm
    groups = _by_mesh([p for p in params if p.grad is not None])
    norm = _total_norm(groups, norm_type)
    ctx.metrics["grad_norm"] = norm.detach() if norm.requires_grad else norm
    for group in groups:
        if max_value is None:
            assert max_norm is not None
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        else:  # clamping turns an Inf gradient into max_value: the norm before it tells
            torch.nn.utils.clip_grad_value_(group, max_value)
    return norm


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
