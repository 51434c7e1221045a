"""A step's spec: one place per built-in, typed by the built-in's options, and the user's
gradient transforms in the order they were stacked.

The engine ([`accelfn.step.engine`][]) writes the update once, in order, and calls each
built-in by name at its place: the options of ``accelfn.parts`` (``Clipping``,
``Precision``, ``Accumulation``, ``NonFinite``) are handed to their module's functions
(``clipping.clip(options, ctx)``). The built-ins that prepare the model (float8, activation
checkpointing, sharding, compile, EMA) still fill their place with a record of functions,
defined below. A place holds one transform at most (the same built-in twice is refused), so
the order the built-ins were stacked in cannot change what runs.

Every function is handed the call's context (``CallContext`` or ``UpdateContext``) or, when
preparing, the [`Prepared`][accelfn.core.contexts.Prepared] so far and the state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.state import TrainState
from ..parts import activation_checkpointing, averaging, compilation, float8, precision
from ..parts.accumulation import Accumulation
from ..parts.activation_checkpointing import Checkpointing
from ..parts.averaging import Averaging
from ..parts.clipping import Clipping
from ..parts.compilation import Compilation
from ..parts.float8 import Float8
from ..parts.nonfinite import NonFinite
from ..parts.precision import Precision
from .extension import Chained, GradientTransform, Transform

__all__ = ["Sharding", "Spec",
           "spec_of"]

Context = contextlib.AbstractContextManager[Any]
Prepare = Callable[[Prepared, TrainState], Prepared]
Check = Callable[[TrainState], object]
AfterUpdate = Callable[[UpdateContext, Tensor], None]


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
    # whether the update is applied, asked once after the reduction (fault tolerance: every
    # replica group agreed); False skips it as a skipped update is skipped (None: applied)
    commit: Callable[[UpdateContext], bool] | None = None


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
        amp, blocks, compiling = self.precision, self.checkpointing, self.compilation
        found = {
            "precision": amp and amp.fp32 and functools.partial(precision.check, amp),
            "checkpointing": blocks and functools.partial(activation_checkpointing.check,
                                                          blocks),
            "compilation": compiling and functools.partial(compilation.check, compiling),
        }
        checks = [found[f.name] if f.name in found else getattr(getattr(self, f.name), "check",
                                                                None)
                  for f in fields(self) if f.name != "gradients"]
        return [check for check in checks if check]

    @property
    def after_update(self) -> list[AfterUpdate]:
        """What runs after the optimizer step, in the sequence's order."""
        scales = self.precision is not None and self.precision.scales
        fp8 = self.float8
        found = [scales and precision.update,
                 fp8 and fp8.fsdp_float8_all_gather and functools.partial(float8.after_update,
                                                                          fp8),
                 self.averaging and functools.partial(averaging.update, self.averaging),
                 self.compilation and self.compilation.cache is not None
                 and functools.partial(compilation.after_update, self.compilation)]
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
