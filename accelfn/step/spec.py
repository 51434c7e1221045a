"""A step's spec: one place per built-in, typed by the built-in's options, and the user's
gradient transforms in the order they were stacked.

The engine ([`accelfn.step.engine`][]) writes the update once, in order, and calls each
built-in by name at its place: a place holds the built-in's options (a frozen dataclass of
``accelfn.parts``), which the engine hands to that module's functions
(``clipping.clip(options, ctx)``, ``sharding.reduce(options, ctx)``). A place holds one
transform at most (the same built-in twice is refused), so the order the built-ins were
stacked in cannot change what runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..core.contexts import UpdateContext
from ..core.state import TrainState
from ..parts import activation_checkpointing, averaging, capture, compilation, float8, precision
from ..parts.accumulation import Accumulation
from ..parts.activation_checkpointing import Checkpointing
from ..parts.averaging import Averaging
from ..parts.capture import Capture
from ..parts.clipping import Clipping
from ..parts.compilation import Compilation
from ..parts.float8 import Float8
from ..parts.nonfinite import NonFinite
from ..parts.precision import Precision
from ..parts.sharding import Sharding
from .extension import Chained, GradientTransform, Transform

__all__ = ["Spec", "spec_of"]

Check = Callable[[TrainState], object]
AfterUpdate = Callable[[UpdateContext, Tensor], None]


_PLACES: dict[type, str] = {
    Float8: "float8", Precision: "precision", Checkpointing: "checkpointing",
    Sharding: "sharding", Compilation: "compilation", Averaging: "averaging",
    Accumulation: "accumulation", Clipping: "clipping", NonFinite: "nonfinite",
    Capture: "capture",
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
    capture: Capture | None = None
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
            "capture": self.capture and functools.partial(capture.check, self.capture,
                                                          checks_flags=self._checks_flags),
        }
        return [check for check in found.values() if check]

    @property
    def _checks_flags(self) -> bool:
        """Whether the update is checked for NaN/Inf (the default guard checks)."""
        guard = self.nonfinite
        return guard is None or guard.policy != "off" or guard.skip_if is not None

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
