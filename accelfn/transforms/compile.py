"""compiled: torch.compile of the model's forward and, on request, of the optimizer step."""

from __future__ import annotations

from typing import Any

import torch

from ..core.engine import Prepared, configurable
from ..core.state import TrainState

__all__ = ["compiled"]


def _modes() -> tuple[str, ...]:
    from torch._inductor import list_mode_options

    return tuple(list_mode_options())


class _Compiled:
    name = "compiled"
    prepare_order = 40

    def __init__(self, mode: str | None, fullgraph: bool, dynamic: bool | None, backend: str,
                 optimizer: bool, options: dict[str, Any] | None) -> None:
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.backend = backend
        self.optimizer = optimizer
        self.options = options

    def __repr__(self) -> str:
        parts = [p for p in (
            self.mode,
            "fullgraph" if self.fullgraph else None,
            None if self.dynamic is None else f"dynamic={self.dynamic}",
            None if self.backend == "inductor" else self.backend,
            "optimizer" if self.optimizer else None,
        ) if p]
        return f"compiled({', '.join(parts)})" if parts else "compiled"

    def prepare(self, prepared: Prepared, state: TrainState) -> None:
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic,
                                  "backend": self.backend}
        if self.options:
            kwargs["options"] = self.options
        else:
            kwargs["mode"] = self.mode
        prepared.model = torch.compile(prepared.model, **kwargs)
        if not self.optimizer:
            return
        optimizer = state.optimizer
        for group in optimizer.param_groups:
            # A tensor learning rate lets schedulers change it without recompiling.
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]))
        inner = prepared.optimizer_step

        @torch.compile(fullgraph=False, backend=self.backend)
        def optimizer_step() -> None:
            inner()

        prepared.optimizer_step = optimizer_step


def _build_compiled(
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str = "inductor",
    optimizer: bool = False,
    options: dict[str, Any] | None = None,
) -> _Compiled:
    """Equivalent to ``model = torch.compile(model, mode=..., fullgraph=..., dynamic=...)``
    before the loop (and, with ``optimizer=True``, ``torch.compile`` of ``optimizer.step``
    with the learning rate held as a tensor so that schedules never recompile).

    The compiled model is what the step function receives, in training and in
    ``step.evaluate``; the wrap happens once, after checkpoint wrapping and after DDP/FSDP,
    whatever the stacking order. Steps of equal shapes do not recompile.
    """
    if mode is not None and mode not in _modes():
        raise ValueError(f"compiled(mode={mode!r}) is unknown; use one of {_modes()}")
    if mode is not None and options is not None:
        raise ValueError("compiled takes mode or options, not both (torch.compile's rule)")
    if not isinstance(fullgraph, bool) or not isinstance(optimizer, bool):
        raise TypeError("compiled(fullgraph=..., optimizer=...) take booleans")
    if dynamic not in (None, True, False):
        raise TypeError("compiled(dynamic=...) takes None, True or False")
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise ValueError(f"compiled(backend={backend!r}) is unknown; use one of {backends}")
    return _Compiled(mode, fullgraph, dynamic, backend, optimizer, options)


compiled = configurable("compiled", _build_compiled)
