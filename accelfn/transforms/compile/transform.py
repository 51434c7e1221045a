"""compiled: torch.compile of the model (whole, or block by block: see ``regional``) and, on
request, of the optimizer step; its compiled code kept in a file that survives restarts (see
``cache``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import Tensor

from ...core import compat
from ...core.contexts import Prepared, UpdateContext
from ...core.state import TrainState
from ...step.engine import LossFn, Step
from ...step.extension import Transform, configure
from ...step.spec import Compilation
from . import cache as cache_file
from . import regional as regions

__all__ = ["compiled"]

CachePath = str | os.PathLike[str]


_COMPILED = "_accelfn_compiled_with"  # on a model compiled in place: (options, label)


def _check_in_place(state: TrainState, kwargs: dict[str, Any], label: str) -> None:
    """Refuse to compile in place a model an earlier step compiled with other options (its
    call holds one compiled function, as after ``model.compile(...)``)."""
    done = state.model.__dict__.get(_COMPILED)
    if done is not None and done[0] != repr(kwargs):
        raise ValueError(
            f"{label} would compile the model in place, but another step on this TrainState "
            f"compiled it with {done[1]} (a model's call holds one compiled function); use "
            "the same compiled(...) options in every step of a state, or build a new "
            "TrainState")


def _tensor_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Every learning rate a tensor: schedulers change it without recompiling the step."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]))


def _compiled(mode: str | None, fullgraph: bool, dynamic: bool | None, backend: str,
              optimizer: bool, options: dict[str, Any] | None, regional: regions.Regional,
              cache: Path | None) -> Transform:
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend,
                              **({"options": options} if options else {"mode": mode})}

    def compile(prepared: Prepared, state: TrainState) -> Prepared:
        if cache is not None:
            cache_file.load(cache, prepared.device, state)
        model, sharded = state.model, prepared.process_group is not None
        in_place = False
        if regional is not False:
            reason = regions.in_place_reason(state.model, regional, sharded, backend)
            in_place = reason is not None
            if reason:  # "nested" asked for, in place done
                state.warn_once("compiled.regional", (
                    f"{label} compiles the blocks in place instead of as nested regions: "
                    f"{reason}; the rest of the model runs eager"))
            # what the check of a later step's regional compile compares with
            regions.wrap_blocks(state.model, kwargs, (in_place, sharded, repr(kwargs), label))
        if not in_place and model.__dict__.get(_COMPILED) is None:
            model.compile(**kwargs)  # the model's own call compiled, where it is
            model.__dict__[_COMPILED] = (repr(kwargs), label)
        if not optimizer:
            return prepared
        optimizers = state.optimizers
        for optim in optimizers:
            _tensor_lrs(optim)
        inner = prepared.optimizer_step
        compiled_step = torch.compile(lambda: inner(), fullgraph=False, backend=backend)

        def optimizer_step() -> None:
            for optim in optimizers:  # again: optimizer.load_state_dict puts back float rates
                _tensor_lrs(optim)
            compiled_step()

        return dataclasses.replace(prepared, optimizer_step=optimizer_step)

    def after_update(ctx: UpdateContext, skipped: Tensor) -> None:
        assert cache is not None
        cache_file.save(cache, ctx.device, ctx.state)

    parts = [p for p in (
        mode, "fullgraph" if fullgraph else None,
        None if dynamic is None else f"dynamic={dynamic}",
        None if backend == "inductor" else backend, "optimizer" if optimizer else None,
        {True: "regional", "nested": "regional=nested"}.get(regional),
        None if cache is None else "cache",
    ) if p]
    label = f"compiled({', '.join(parts)})" if parts else "compiled"
    part = Compilation(
        compile,
        check=(lambda s: _check_in_place(s, kwargs, label)) if regional is False else (
            lambda s: regions.check(s, regional, backend, repr(kwargs), label)),
        after_update=None if cache is None else after_update)
    return Transform(
        "compiled", part,
        options=(("mode", mode), ("fullgraph", fullgraph), ("dynamic", dynamic),
                 ("backend", backend), ("optimizer", optimizer), ("options", options),
                 ("regional", regional), ("cache", None if cache is None else str(cache))),
        label=label)


def _checked_options(options: Any, backend: str) -> dict[str, Any]:
    """A copy of ``options``, refused when it is no dict of names inductor knows."""
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"compiled(options={options!r}) takes a dict of inductor options, "
                        "e.g. options={'epilogue_fusion': True}")
    try:  # torch.compile checks the names when it is called, before tracing anything
        if backend == "inductor" and options:
            torch.compile(lambda: None, backend=backend, options=options)
    except RuntimeError as error:
        raise ValueError(f"compiled(options=...): {error}"[:600]) from None
    return dict(options)


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
    if mode is not None and mode not in compat.compile_modes():
        raise ValueError(f"compiled(mode={mode!r}) is unknown; use one of {compat.compile_modes()}")
    if mode is not None and options is not None:
        raise ValueError("compiled takes mode or options, not both (torch.compile's rule)")
    if not all(isinstance(b, bool) for b in (fullgraph, optimizer)):
        raise TypeError("compiled(fullgraph=..., optimizer=...) take booleans")
    if not isinstance(regional, bool) and regional != "nested":
        raise TypeError(f"compiled(regional={regional!r}) takes False, True (each repeated "
                        "block compiled in place) or 'nested' (the whole model compiled, "
                        "each block a nested region)")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError("compiled(dynamic=...) takes None, True or False")
    backends = compat.compile_backends()
    if not isinstance(backend, str) or backend not in backends:
        raise ValueError(f"compiled(backend={backend!r}) is unknown; use one of {backends}")
    if options is not None:
        options = _checked_options(options, backend)
    path = None
    if cache is not None:
        if not isinstance(cache, (str, os.PathLike)) or not os.fspath(cache):
            raise TypeError(f"compiled(cache={cache!r}) takes the path of a file, e.g. "
                            "compiled(cache='runs/x/compile-cache.bin')")
        if backend != "inductor":
            raise ValueError(f"compiled(cache=...) keeps inductor's compiled code, and "
                             f"backend={backend!r} makes none; use backend='inductor' or "
                             "leave cache out")
        path = Path(os.fspath(cache))
        if path.is_dir():
            raise ValueError(f"compiled(cache={str(path)!r}) names a directory; name the "
                             f"file, e.g. compiled(cache={str(path / 'compile-cache.bin')!r})")
    return configure("compiled", fn, _compiled(mode, fullgraph, dynamic, backend, optimizer,
                                               options, regional, path))
