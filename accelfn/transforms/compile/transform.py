"""compiled: torch.compile of the model (whole, or its repeated blocks) and, on request, of
the optimizer step; its compiled code kept in a file that survives restarts
(``accelfn.parts.compilation``)."""

from __future__ import annotations

import os
from typing import Any, Literal, overload

from ...parts.compilation import Compilation
from ...step.engine import LossFn, Step
from ...step.extension import Transform, builtin, configure

__all__ = ["compiled"]

CachePath = str | os.PathLike[str]


@overload
def compiled(fn: LossFn | Step, /) -> Step: ...
@overload
def compiled(*, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
             backend: str = "inductor", optimizer: bool = False,
             options: dict[str, Any] | None = None,
             regional: bool | Literal["nested"] = False,
             cache: CachePath | None = None) -> Transform: ...
def compiled(
    fn: LossFn | Step | None = None,
    /,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str = "inductor",
    optimizer: bool = False,
    options: dict[str, Any] | None = None,
    regional: bool | Literal["nested"] = False,
    cache: CachePath | None = None,
) -> Step | Transform:
    """Equivalent to ``model = torch.compile(model, mode=..., fullgraph=..., dynamic=...)``
    before the loop (and, with ``optimizer=True``, ``torch.compile`` of ``optimizer.step``
    with the learning rate held as a tensor so that schedules never recompile).

    The model is compiled in place, as ``model.compile(...)`` does: the step function receives
    the model itself (an instance of its own class, its submodules and methods as they are),
    and ``model(...)`` runs the compiled code, in training, in ``step.evaluate`` and in the
    user's own calls. It happens once, after checkpoint wrapping and after DDP/FSDP, whatever
    the stacking order. Steps of equal shapes do not recompile. A step function that calls
    a submodule or a method instead of ``model(...)`` reaches no compiled code that way:
    ``regional=True`` compiles the repeated blocks where they sit, for every caller.

    ``regional=True`` is torch's regional compilation, equivalent to ``for block in blocks:
    block.compile()``: each repeated block (``af.find_blocks``) compiled in place, inside
    checkpointing's wrapper and DDP/FSDP2's hooks, one compiled code shared by the blocks of
    a class, and the rest of the model eager. The compile time does not grow with depth.
    ``regional="nested"`` is torch's hierarchical compilation, equivalent to
    ``Block.forward = torch.compiler.nested_compile_region(Block.forward)`` and a
    whole-model compile: the blocks' code traced and compiled once, the step one graph at the
    whole model's speed, for a longer compile than in place; blocks are compiled in place
    instead (with a warning) under ``distributed``, with a backend other than inductor or
    aot_eager, and for blocks with BatchNorm. ``state_dict`` keys do not change.

    ``cache=path`` keeps the compiled code, with inductor's compiled C++ kernels, in a file
    (put it in the checkpoint directory): loaded before the first compiled step when it was
    written by the same torch version for the same device kind (otherwise a warning, and a
    fresh compile), written atomically after the first update, so a restarted job on a fresh
    machine starts warm.
    """
    built = Compilation(mode, fullgraph, dynamic, backend, optimizer, options,
                        regional, cache)  # type: ignore[arg-type]
    return configure("compiled", fn, builtin("compiled", built))
