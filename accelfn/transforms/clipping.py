"""with_clipping: gradient clipping by global norm or by value (``accelfn.parts.clipping``)."""

from __future__ import annotations

from typing import overload

from ..parts.clipping import Clipping
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["with_clipping"]


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
    options = Clipping(max_norm, norm_type, max_value)
    return configure("with_clipping", fn, builtin("with_clipping", options))
