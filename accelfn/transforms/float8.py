"""with_float8: float8 training of the Linear layers through torchao
(``accelfn.parts.float8``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from torch import nn

from ..parts.float8 import SHAPE_RULES, Box, Float8, Float8Layers, Predicate, eligible, layers_of
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["SHAPE_RULES", "Float8Layers", "eligible", "float8_layers", "with_float8"]


@overload
def with_float8(fn: LossFn | Step, /) -> Step: ...
@overload
def with_float8(*, layers: str | Sequence[Box] = "auto", min_features: int | None = None,
                predicate: Predicate | None = None, recipe: str = "tensorwise",
                fsdp_float8_all_gather: bool = False,
                emulate: bool | None = None) -> Transform: ...
def with_float8(
    fn: LossFn | Step | None = None,
    /,
    *,
    layers: str | Sequence[Box] = "auto",
    min_features: int | None = None,
    predicate: Predicate | None = None,
    recipe: str = "tensorwise",
    fsdp_float8_all_gather: bool = False,
    emulate: bool | None = None,
) -> Step | Transform:
    """Equivalent to ``torchao.float8.convert_to_float8_training(model, config=
    Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=...)`` before the loop,
    the filter being torchao's auto filter for the recipe (``_auto_filter_for_recipe``).

    Each chosen ``nn.Linear`` becomes torchao's ``Float8Linear``: its input, weight and output
    gradient are cast to float8 with dynamic scales for the three matmuls, the weights stay
    in their dtype (the optimizer updates the same Parameters) and ``state_dict`` keys do not
    change. A layer of ``K`` input and ``N`` output features is chosen when both are multiples
    of 16, its shape passes the rule (``layers``) and ``predicate(name, module)`` (if given)
    accepts it, e.g. ``predicate=lambda name, m: name != "lm_head"``:

    * ``layers="auto"`` (default): the recipe's shape rule, from torchao's H100 measurements
      (``SHAPE_RULES``): tensorwise leaves out ``K <= 4096 and N <= 1024``; rowwise (and
      rowwise_with_gw_hp) ``N <= 2048``, ``K <= 1024``, and ``K <= 2048 and N <= 4096``;
      float8 runs those shapes slower than bf16;
    * ``layers="all"``: every Linear whose sizes are multiples of 16;
    * ``layers=[(k, n), ...]``: leaves out the layers with ``K <= k and N <= n`` for one pair
      (``None``: any size);
    * ``min_features=m`` (the rule before ``layers``, still honoured): both sizes at least
      ``m``; given with ``layers`` other than ``"auto"``, refused.

    A subclass of ``nn.Linear`` that overrides ``forward`` is never converted (its forward
    would be lost), nor a Linear inside ``nn.MultiheadAttention`` (which never calls its
    forward: ``out_proj``'s weight goes to ``F.multi_head_attention_forward``).
    ``describe(step, state)`` lists the layers converted and those left out, with why
    (``float8_layers(model)`` gives them as data). ``recipe`` is torchao's:
    ``"tensorwise"`` (fastest), ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (more accurate).

    On CUDA the model must be compiled (``compiled`` in the stack; the call is refused
    otherwise) and the GPU must have float8 matmuls (compute capability 8.9+). Elsewhere the
    float8 numerics are emulated (``emulate=None`` picks; ``emulate=True`` forces it).
    ``fsdp_float8_all_gather=True`` makes FSDP2 all-gather the weights in float8 (tensorwise
    only) and precomputes their scales after each optimizer step, as torchao documents.
    The conversion runs first among the preparations (before fp32 islands, activation
    checkpointing, DDP/FSDP and compile), whatever the stacking order.
    """
    options = Float8(min_features, predicate, recipe, fsdp_float8_all_gather, emulate,
                     layers)  # type: ignore[arg-type]  # a sequence of pairs: checked there
    return configure("with_float8", fn, builtin("with_float8", options))


def float8_layers(model: nn.Module) -> Float8Layers | None:
    """The Linear layers ``with_float8`` converted in ``model`` (name -> (K, N)) and those it
    left out (name -> ((K, N), why)), or None before a ``with_float8`` step prepared it;
    ``str()`` of it is what ``describe(step, state)`` prints."""
    return layers_of(model)
