"""The built-ins' places in the update: one typed option per built-in, and a step's spec.

The engine ([`accelfn.step.engine`][]) writes the update once, in order; each built-in
transform fills its one place in it with the functions below, which the engine calls at a
fixed line. A place holds one transform at most (the same built-in twice is refused), so
the order the built-ins were stacked in cannot change what runs. Users extend the update
with [`GradientTransform`][accelfn.GradientTransform]s, kept in the order they were stacked.

Every function is handed the call's context (``CallContext`` or ``UpdateContext``) or, when
preparing, the [`Prepared`][accelfn.core.contexts.Prepared] so far and the state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from ..core.batch import Batch
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.plan import Plan, Sums
from ..core.state import TrainState
from .extension import Chained, GradientTransform, Transform

__all__ = ["Accumulation", "Averaging", "Checkpointing", "Clipping", "Compilation",
           "Float8", "NonFinite", "Precision", "Sharding", "Spec", "spec_of"]

Context = contextlib.AbstractContextManager[Any]
Prepare = Callable[[Prepared, TrainState], Prepared]
Check = Callable[[TrainState], object]
AfterUpdate = Callable[[UpdateContext, Tensor], None]


@dataclass(frozen=True, slots=True)
class Float8:
    """``with_float8``: Linear layers converted first; their forward and scale precompute."""

    convert: Prepare
    forward: Callable[[CallContext], Context]
    after_update: AfterUpdate | None = None


@dataclass(frozen=True, slots=True)
class Precision:
    """``with_amp``: fp32 islands and the compute dtype; autocast; fp16's loss scaling.

    ``unscale`` returns the device flag "the scaled gradients overflowed"; ``update`` moves
    the scale after the update; ``forget`` makes the scaler forget a failed call."""

    islands: Prepare
    autocast: Callable[[CallContext], Context]
    check: Check | None = None
    scale: Callable[[CallContext, Tensor], Tensor] | None = None
    unscale: Callable[[UpdateContext], Tensor | None] | None = None
    update: AfterUpdate | None = None
    forget: Callable[[CallContext], None] | None = None


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """``checkpointed``: activation checkpointing of the blocks, wrapped in place when
    preparing; ``forward`` is the scope of a call of the step function in which the blocks
    run with this step's settings (whichever submodule or method the function calls)."""

    wrap: Prepare
    forward: Callable[[CallContext], Context] | None = None
    check: Check | None = None


@dataclass(frozen=True, slots=True)
class Sharding:
    """``distributed``: DDP/FSDP wrapping, no sync but on an update's last micro-batch, the
    cross-process weight, and dropping unreduced gradients after a failed call."""

    shard: Prepare
    micro: Callable[[CallContext, int, bool], Context]
    reduce: Callable[[UpdateContext], None]
    abort: Callable[[CallContext], None] | None = None
    # a failed forward or backward's error in the strategy's terms (None: as it is)
    explain: Callable[[CallContext, BaseException], BaseException | None] | None = None
    # adaptive accumulation: why the backward cannot run without collectives until the
    # processes agree (None: it can); and what a synced backward would leave, set after
    # an agreed pass whose gradients the reduction all-reduces once
    unsynced_refusal: Callable[[CallContext], str | None] | None = None
    agreed: Callable[[CallContext], None] | None = None


@dataclass(frozen=True, slots=True)
class Compilation:
    """``compiled``: torch.compile of the model (and optimizer step); the compile cache."""

    compile: Prepare
    check: Check | None = None
    after_update: AfterUpdate | None = None


@dataclass(frozen=True, slots=True)
class Averaging:
    """``with_ema``: averaged copies of the prepared model's weights, updated after each
    update, swapped in by ``evaluate(weights=...)``."""

    average: Prepare
    update: AfterUpdate
    evaluate: Callable[[CallContext, Mapping[str, Any]], Context]
    evaluate_options: tuple[str, ...] = ("weights",)


@dataclass(frozen=True, slots=True)
class Accumulation:
    """``with_accumulation``: the micro-batches of a call (and the calls of an update).
    ``retry(ctx, error)``: after an out-of-memory error in a forward or backward (the call
    undone), whether to run the call again (with a finer split); ``metrics(ctx)``: what the
    update reports of it; ``count(ctx, agreed)``: the micro-batch count a retrying split
    uses, set first to ``agreed`` unless None (the processes of a run agree on it)."""

    split: Callable[[CallContext, Batch], Plan]
    flush: Callable[[CallContext], Sums | None] | None = None
    abort: Callable[[CallContext], None] | None = None
    retry: Callable[[CallContext, BaseException], bool] | None = None
    metrics: Callable[[CallContext], dict[str, Tensor]] | None = None
    count: Callable[[CallContext, int | None], int] | None = None


@dataclass(frozen=True, slots=True)
class Clipping:
    """``with_clipping``: clips the gradients; returns their total norm before clipping,
    NaN/Inf when any gradient was (clipping by value would turn an Inf into ``max_value``),
    which the non-finite decision reads."""

    clip: Callable[[UpdateContext], Tensor | None]


@dataclass(frozen=True, slots=True)
class NonFinite:
    """``with_nonfinite``: the decision to skip an update. ``decide(ctx, overflow, norm,
    current)`` gets fp16's overflow flag (``current``: no gradient transform wrote the
    gradients after it) and clipping's norm when it describes the gradients as the optimizers
    will see them (None otherwise: the gradients are checked again). ``abort`` forgets a
    decision deferred by a call that failed."""

    decide: Callable[[UpdateContext, Tensor | None, Tensor | None, bool], Decision]
    abort: Callable[[CallContext], None] | None = None
    advance_skipped: bool = False  # a skipped update still advances schedules and the EMA


@dataclass(frozen=True, slots=True)
class Decision:
    """The non-finite decision of an update.

    ``skip`` is the decision taken on the host; or None to leave it to the device: then
    ``flags`` is a device bool tensor and the optimizer skips on ``flags.any()`` through its
    ``found_inf`` input (fused optimizers only), the transform settling its counters later
    (``TrainState.sync``). ``checked=False`` says nothing was checked: the update is applied
    and no ``skipped`` metric is reported.
    """

    skip: bool | None = False
    flags: Tensor | None = None
    checked: bool = True

    def __post_init__(self) -> None:
        if self.skip is None and self.flags is None:
            raise ValueError("Decision(skip=None) leaves the decision to the device and needs "
                             "the device flags: Decision(None, flags=...)")


_PLACES: dict[type, str] = {
    Float8: "float8", Precision: "precision", Checkpointing: "checkpointing",
    Sharding: "sharding", Compilation: "compilation", Averaging: "averaging",
    Accumulation: "accumulation", Clipping: "clipping", NonFinite: "nonfinite",
}


@dataclass(frozen=True, slots=True)
class Spec:
    """A step's update: one entry per built-in place (None: left out), and the user's
    gradient transforms in the order they were stacked."""

    float8: Float8 | None = None
    precision: Precision | None = None
    checkpointing: Checkpointing | None = None
    sharding: Sharding | None = None
    compilation: Compilation | None = None
    averaging: Averaging | None = None
    accumulation: Accumulation | None = None
    clipping: Clipping | None = None
    nonfinite: NonFinite | None = None
    gradients: tuple[GradientTransform, ...] = ()

    @property
    def checks(self) -> list[Check]:
        """The refusals a state is checked against before any preparation changes it."""
        found = [getattr(getattr(self, f.name), "check", None) for f in fields(self)
                 if f.name != "gradients"]
        return [check for check in found if check is not None]

    @property
    def after_update(self) -> list[AfterUpdate]:
        """What runs after the optimizer step, in the sequence's order."""
        found = [self.precision and self.precision.update, self.float8 and self.float8.after_update,
                 self.averaging and self.averaging.update,
                 self.compilation and self.compilation.after_update]
        return [f for f in found if f]


def spec_of(transforms: tuple[Transform, ...], text: Callable[[], str]) -> Spec:
    """The spec of ``transforms`` (innermost first; a chain's transforms in its order);
    refuses a built-in twice, and two gradient transforms of one name (their states would
    share a slot)."""
    places: dict[str, Any] = {}
    gradients: list[GradientTransform] = []
    names: set[str] = set()
    for t in (m for each in transforms
              for m in (each.part.members if isinstance(each.part, Chained) else (each,))):
        if t.name in names:
            raise ValueError(f"{t.name} is applied twice in {text()}; apply each transform once")
        names.add(t.name)
        part = t.part
        if isinstance(part, GradientTransform):
            gradients.append(part)
            continue
        place = _PLACES.get(type(part))
        if place is None:
            raise TypeError(
                f"transform {t.name!r} fills no place of the update ({type(part).__name__}); "
                "extend the update with a gradient transform: accelfn.Transform(name, "
                "update=fn) (accelfn.GradientTransform(name, fn) makes the same)")
        if place in places:
            raise ValueError(f"{places[place][0]} and {t.name} both fill the {place!r} place "
                             f"of the update; keep one of them in {text()}")
        places[place] = (t.name, part)
    return Spec(**{k: v for k, (_, v) in places.items()}, gradients=tuple(gradients))
