"""compiled: torch.compile of the model's forward and, on request, of the optimizer step."""

from __future__ import annotations

import dataclasses
from typing import Any, overload

import torch
from torch import nn

from ..core import compat
from ..core.engine import LossFn, Step
from ..core.protocol import Hooks, Prepared, Transform, configure
from ..core.state import TrainState

__all__ = ["compiled"]


def _compiled(mode: str | None, fullgraph: bool, dynamic: bool | None, backend: str,
              optimizer: bool, options: dict[str, Any] | None) -> Transform:
    def compile(prepared: Prepared, state: TrainState) -> Prepared:
        kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic,
                                  "backend": backend}
        if options:
            kwargs["options"] = options
        else:
            kwargs["mode"] = mode
        model: nn.Module = torch.compile(prepared.model, **kwargs)  # type: ignore[assignment]
        if not optimizer:
            return dataclasses.replace(prepared, model=model)
        for group in state.optimizer.param_groups:
            # A tensor learning rate lets schedulers change it without recompiling.
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]))
        inner = prepared.optimizer_step

        @torch.compile(fullgraph=False, backend=backend)
        def optimizer_step() -> None:
            inner()

        return dataclasses.replace(prepared, model=model, optimizer_step=optimizer_step)

    parts = [p for p in (
        mode,
        "fullgraph" if fullgraph else None,
        None if dynamic is None else f"dynamic={dynamic}",
        None if backend == "inductor" else backend,
        "optimizer" if optimizer else None,
    ) if p]
    return Transform(
        "compiled", Hooks(compile=compile),
        options=(("mode", mode), ("fullgraph", fullgraph), ("dynamic", dynamic),
                 ("backend", backend), ("optimizer", optimizer), ("options", options)),
        label=f"compiled({', '.join(parts)})" if parts else "compiled")


@overload
def compiled(fn: LossFn | Step, /) -> Step: ...
@overload
def compiled(*, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
             backend: str = "inductor", optimizer: bool = False,
             options: dict[str, Any] | None = None) -> Transform: ...
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
) -> Step | Transform:
    """Equivalent to ``model = torch.compile(model, mode=..., fullgraph=..., dynamic=...)``
    before the loop (and, with ``optimizer=True``, ``torch.compile`` of ``optimizer.step``
    with the learning rate held as a tensor so that schedules never recompile).

    The compiled model is what the step function receives, in training and in
    ``step.evaluate``; the wrap happens once, after checkpoint wrapping and after DDP/FSDP,
    whatever the stacking order. Steps of equal shapes do not recompile.
    """
    if mode is not None and mode not in compat.compile_modes():
        raise ValueError(f"compiled(mode={mode!r}) is unknown; use one of {compat.compile_modes()}")
    if mode is not None and options is not None:
        raise ValueError("compiled takes mode or options, not both (torch.compile's rule)")
    if not isinstance(fullgraph, bool) or not isinstance(optimizer, bool):
        raise TypeError("compiled(fullgraph=..., optimizer=...) take booleans")
    if dynamic not in (None, True, False):
        raise TypeError("compiled(dynamic=...) takes None, True or False")
    backends = compat.compile_backends()
    if backend not in backends:
        raise ValueError(f"compiled(backend={backend!r}) is unknown; use one of {backends}")
    return configure("compiled", fn, _compiled(mode, fullgraph, dynamic, backend, optimizer,
                                               options))
