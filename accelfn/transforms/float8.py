"""with_float8: float8 training of the Linear layers through torchao
(``accelfn.parts.float8``)."""

from __future__ import annotations

from typing import overload

from ..parts.float8 import Float8, Predicate, eligible
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["eligible", "with_float8"]


@overload
def with_float8(fn: LossFn | Step, /) -> Step: ...
@overload
def with_float8(*, min_features: int = 1024, predicate: Predicate | None = None,
                recipe: str = "tensorwise", fsdp_float8_all_gather: bool = False,
                emulate: bool | None = None) -> Transform: ...
def with_float8(
    fn: LossFn | Step | None = None,
    /,
    *,
    min_features: int = 1024,
    predicate: Predicate | None = None,
    recipe: str = "tensorwise",
    fsdp_float8_all_gather: bool = False,
    emulate: bool | None = None,
) -> Step | Transform:
    """Equivalent to ``torchao.float8.convert_to_float8_training(model, config=
    Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=...)`` before the loop.

    Each chosen ``nn.Linear`` becomes torchao's ``Float8Linear``: its input, weight and output
    gradient are cast to float8 with dynamic scales for the three matmuls, the weights stay
    in their dtype (the optimizer updates the same Parameters) and ``state_dict`` keys do not
    change. A layer is chosen when both its sizes are multiples of 16 and at least
    ``min_features``, and ``predicate(name, module)`` (if given) accepts it, e.g.
    ``predicate=lambda name, m: name != "lm_head"``. A subclass of ``nn.Linear`` that
    overrides ``forward`` is never converted (its forward would be lost). ``recipe`` is torchao's:
    ``"tensorwise"`` (fastest), ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (more accurate).

    On CUDA the model must be compiled (``compiled`` in the stack; the call is refused
    otherwise) and the GPU must have float8 matmuls (compute capability 8.9+). Elsewhere the
    float8 numerics are emulated (``emulate=None`` picks; ``emulate=True`` forces it).
    ``fsdp_float8_all_gather=True`` makes FSDP2 all-gather the weights in float8 (tensorwise
    only) and precomputes their scales after each optimizer step, as torchao documents.
    The conversion runs first among the preparations (before fp32 islands, activation
    checkpointing, DDP/FSDP and compile), whatever the stacking order.
    """
    options = Float8(min_features, predicate, recipe, fsdp_float8_all_gather, emulate)
    return configure("with_float8", fn, builtin("with_float8", options))
