"""torch.compile of the model (whole, or its repeated blocks: ``compile_regions``) and, on
request, of the optimizer step; its compiled code kept in a file that survives restarts
(``compile_cache``): ``compiled``'s options and its calls (the compile when preparing, the
refusal of a second compile with other options, the check that the first call ran the
compiled code, the cache written after an update)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.contexts import Prepared, UpdateContext
from ..core.state import TrainState
from . import compile_cache, compile_regions

__all__ = ["Compilation", "after_update", "check", "compile", "watching"]

Regional = bool | Literal["nested"]

_COMPILED = "_accelfn_compiled_with"  # on a model compiled in place: (options, label)
_WATCHED = "_accelfn_compiled_call_seen"  # on it too: a step's first call was looked at
_NOTHING = contextlib.nullcontext()


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



@dataclass(frozen=True, slots=True, repr=False, eq=True)
class Compilation:
    """``compiled``'s options: torch.compile's ``mode``, ``fullgraph``, ``dynamic``,
    ``backend`` and inductor ``options``; ``optimizer`` (the optimizer step compiled too);
    ``regional`` (the repeated blocks compiled in place, or as nested regions); ``cache``
    (the file the compiled code is kept in)."""

    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    optimizer: bool = False
    options: dict[str, Any] | None = None
    regional: Regional = False
    cache: Path | None = None

    __hash__ = None  # type: ignore[assignment]  # options is a dict

    def __post_init__(self) -> None:
        mode, options, backend, regional = self.mode, self.options, self.backend, self.regional
        if mode is not None and mode not in compat.compile_modes():
            raise ValueError(f"compiled(mode={mode!r}) is unknown; use one of "
                             f"{compat.compile_modes()}")
        if mode is not None and options is not None:
            raise ValueError("compiled takes mode or options, not both (torch.compile's rule)")
        if not all(isinstance(b, bool) for b in (self.fullgraph, self.optimizer)):
            raise TypeError("compiled(fullgraph=..., optimizer=...) take booleans")
        if not isinstance(regional, bool) and regional != "nested":
            raise TypeError(f"compiled(regional={regional!r}) takes False, True (each repeated "
                            "block compiled in place) or 'nested' (the whole model compiled, "
                            "each block a nested region)")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError("compiled(dynamic=...) takes None, True or False")
        backends = compat.compile_backends()
        if not isinstance(backend, str) or backend not in backends:
            raise ValueError(f"compiled(backend={backend!r}) is unknown; use one of {backends}")
        if options is not None:
            object.__setattr__(self, "options", _checked_options(options, backend))
        cache = self.cache
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
                                 f"file, e.g. compiled(cache="
                                 f"{str(path / 'compile-cache.bin')!r})")
            object.__setattr__(self, "cache", path)

    @property
    def kwargs(self) -> dict[str, Any]:
        """What ``model.compile(**kwargs)`` is given."""
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend,
                **({"options": self.options} if self.options else {"mode": self.mode})}

    def __repr__(self) -> str:
        parts = [p for p in (
            self.mode, "fullgraph" if self.fullgraph else None,
            None if self.dynamic is None else f"dynamic={self.dynamic}",
            None if self.backend == "inductor" else self.backend,
            "optimizer" if self.optimizer else None,
            {True: "regional", "nested": "regional=nested"}.get(self.regional),
            None if self.cache is None else "cache",
        ) if p]
        return f"compiled({', '.join(parts)})" if parts else "compiled"


def check(options: Compilation, state: TrainState) -> None:
    """Refuse a compile in place (or of the blocks) that an earlier step made with other
    options on this state, before anything changes."""
    kwargs, label = options.kwargs, repr(options)
    if options.regional is False:
        _check_in_place(state, kwargs, label)
    else:
        compile_regions.check(state, options.regional, options.backend, repr(kwargs), label)


def compile(options: Compilation, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: the model compiled in place (or its blocks), the cache loaded first, and the
    optimizer step compiled with tensor learning rates when asked."""
    kwargs, label, regional = options.kwargs, repr(options), options.regional
    if options.cache is not None:
        compile_cache.load(options.cache, prepared.device, state)
    model, sharded = state.model, prepared.process_group is not None
    in_place = False
    if regional is not False:
        reason = compile_regions.in_place_reason(state.model, regional, sharded,
                                                 options.backend)
        in_place = reason is not None
        if reason:  # "nested" asked for, in place done
            state.warn_once("compiled.regional", (
                f"{label} compiles the blocks in place instead of as nested regions: "
                f"{reason}; the rest of the model runs eager"))
        # what the check of a later step's regional compile compares with
        compile_regions.wrap_blocks(state.model, kwargs, (in_place, sharded, repr(kwargs),
                                                          label))
    if not in_place and model.__dict__.get(_COMPILED) is None:
        model.compile(**kwargs)  # the model's own call compiled, where it is
        model.__dict__[_COMPILED] = (repr(kwargs), label)
    if not options.optimizer:
        return prepared
    optimizers = state.optimizers
    for optim in optimizers:
        _tensor_lrs(optim)
    inner = prepared.optimizer_step
    compiled_step = torch.compile(lambda: inner(), fullgraph=False, backend=options.backend)

    def optimizer_step() -> None:
        for optim in optimizers:  # again: optimizer.load_state_dict puts back float rates
            _tensor_lrs(optim)
        compiled_step()

    return dataclasses.replace(prepared, optimizer_step=optimizer_step)


def watching(options: Compilation, state: TrainState) -> AbstractContextManager[None]:
    """Around the first training call of a model compiled whole: whether the step function
    called ``model(...)``, the call that runs the compiled code. One that reaches the model
    only through submodules or methods (``model.trunk(...)``, the loss outside ``forward``)
    runs eager: said once, with the fix, rather than left a silent difference.

    Looked at with a profile function (``sys.setprofile``) that sees the model's own
    ``__call__`` start and removes itself there, before torch.compile traces anything: no
    hook on the model, whose compiled code would guard on it and recompile once it is gone.
    Not looked at under a profiler already installed (cProfile)."""
    model = state.model
    call = getattr(type(model).__call__, "__code__", None)
    if (options.regional is not False or call is None or model.__dict__.get(_WATCHED)
            or sys.getprofile() is not None):
        return _NOTHING
    return _watch(model, call, repr(options), state)


@contextlib.contextmanager
def _watch(model: nn.Module, call: Any, label: str, state: TrainState) -> Iterator[None]:
    seen = False

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        if event == "call" and frame.f_code is call and frame.f_locals.get("self") is model:
            seen = True
            sys.setprofile(None)

    sys.setprofile(profile)
    try:
        yield
    finally:
        if not seen:
            sys.setprofile(None)
    model.__dict__[_WATCHED] = True  # a call that raised is looked at again next time
    if not seen:
        state.warn_once("compiled.call", (
            f"{label} compiled the model's call, model(...), but the step function did not "
            "call it: it reached the model through submodules or methods (such as "
            "model.trunk(...)), which ran eager, uncompiled. Call model(...) in the step, or "
            "use compiled(regional=True), which compiles the repeated blocks in place, "
            "wherever they are called"))


def after_update(options: Compilation, ctx: UpdateContext, skipped: Tensor) -> None:
    """After an update: the compiled code written to the cache file (once)."""
    if options.cache is not None:
        compile_cache.save(options.cache, ctx.device, ctx.state)
