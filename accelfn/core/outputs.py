"""What a step function returns: a scalar loss, or a mapping with "loss", "weight", metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

__all__ = ["unpack"]


def unpack(out: Any, first: bool) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """Split ``out`` into (loss, weight or None, metrics); ``first`` checks the shapes."""
    if isinstance(out, (int, float)):
        raise ValueError(
            f"the step function returned a Python {type(out).__name__}: return the loss tensor, "
            "not .item() (accelfn differentiates it; reading it on the host syncs the device)")
    if isinstance(out, Tensor):
        loss, weight, metrics = out, None, {}
    elif type(out) is dict and "loss" in out:
        loss = out["loss"]
        weight = out.get("weight")
        metrics = {k: v for k, v in out.items() if k != "loss" and k != "weight"}
    elif isinstance(out, (Mapping, TensorDictBase)):
        if "loss" not in out.keys():
            raise KeyError(
                f"the step function returned a mapping without 'loss' (keys: {list(out.keys())}); "
                "return a scalar loss or a mapping with a 'loss' entry"
            )
        loss = out["loss"]
        weight = out["weight"] if "weight" in out.keys() else None
        metrics = {k: out[k] for k in out.keys() if k not in ("loss", "weight")}
    else:
        raise TypeError(
            f"the step function returned a {type(out).__name__}; return a scalar loss tensor or "
            "a mapping with 'loss' (and optional 'weight' and scalar metrics)"
        )
    if first:
        if isinstance(loss, (int, float)):
            raise ValueError(
                f"the loss is a Python {type(loss).__name__}: return the tensor, not .item() "
                "(accelfn differentiates it; reading it on the host syncs the device)")
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in "
                "the step function"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                "the loss does not require grad: it is not computed from the model's trainable "
                "parameters (was it detached, or computed under torch.no_grad()?)"
            )
        if weight is not None and (not isinstance(weight, Tensor) or weight.dim() != 0):
            raise ValueError("'weight' must be a scalar tensor (e.g. the number of tokens); "
                             "return the tensor, not .item()")
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                raise ValueError(
                    f"metric {k!r} is a Python {type(v).__name__}: return the tensor, not "
                    ".item() (metrics stay on the device; .item() syncs it every step)")
            if not isinstance(v, Tensor) or v.dim() != 0:
                raise ValueError(
                    f"metric {k!r} must be a scalar tensor; compute it on the device and reduce"
                )
    return loss, weight, metrics
