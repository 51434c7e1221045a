"""The plateau schedule: a ``LinearLR`` warmup per update, then ``ReduceLROnPlateau`` per
evaluation (``warmup_plateau``); see accelfn.recipes.schedules for the others."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, SupportsFloat

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LinearLR, ReduceLROnPlateau

from .warmup import _check_optimizer, _check_steps, _is_number, _no_warmup, _start_factor, _warmup

__all__ = ["WarmupPlateau", "warmup_plateau"]


class WarmupPlateau:
    """Equivalent to ``LinearLR`` warmup stepped per update, then ``ReduceLROnPlateau``
    stepped per evaluation.

    That is: ``LinearLR(optimizer, start_factor, 1.0, warmup_steps).step()`` after each of
    the first ``warmup_steps`` updates (ending exactly on the base rates), and
    ``ReduceLROnPlateau.step(metric)`` at each evaluation after that. Give it to
    ``TrainState(scheduler=...)``: the step engine calls [`step`][] after every update (a
    no-op once warmup is over); call [`observe`][] with the validation metric where the
    loop evaluates. Metrics observed during warmup are ignored (the warmup owns the learning
    rate then); ``observe`` reads the metric on the host (``float``), which is a sync, so
    call it at evaluation time only. It has no end: after warmup, updates never change the
    rate; only reductions by ``observe`` do (down to ``min_lr``), for as long as it runs.
    """

    def __init__(self, optimizer: Optimizer, warmup: LinearLR | None,
                 plateau: ReduceLROnPlateau, warmup_steps: int) -> None:
        self.optimizer = optimizer
        self.warmup = warmup
        self.plateau = plateau
        self.warmup_steps = warmup_steps
        self.updates = 0

    @property
    def warming_up(self) -> bool:
        """True while the warmup still sets the learning rate."""
        return self.updates < self.warmup_steps

    def step(self) -> None:
        """Advance the warmup by one optimizer update (a no-op after warmup)."""
        if self.warming_up and self.warmup is not None:
            self.warmup.step()
            if self.updates + 1 == self.warmup_steps:  # exactly the base rate, not ~1 ulp off
                for group in self.optimizer.param_groups:
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"].fill_(float(group["initial_lr"]))
                    else:
                        group["lr"] = group["initial_lr"]
        self.updates += 1

    def observe(self, metric: SupportsFloat | torch.Tensor) -> bool:
        """Feed an evaluation metric to ``ReduceLROnPlateau``; True if it was used.

        Returns False (and changes nothing) during warmup.
        """
        if self.warming_up:
            return False
        value = float(metric)
        if math.isnan(value):
            raise ValueError("warmup_plateau.observe() got NaN; the validation metric diverged")
        self.plateau.step(value)
        return True

    def get_last_lr(self) -> list[float]:
        """The current learning rate of each group, as floats."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "warmup": None if self.warmup is None else self.warmup.state_dict(),
            "plateau": self.plateau.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict["warmup"] is None) != (self.warmup is None):
            raise ValueError("checkpoint and scheduler disagree on having a warmup; build "
                             "warmup_plateau with the checkpointed run's warmup_steps")
        saved_steps = (0 if state_dict["warmup"] is None
                       else int(state_dict["warmup"]["total_iters"]))
        if saved_steps != self.warmup_steps:  # its warmup would stop half-way, for good
            raise ValueError(f"the checkpoint's warmup_plateau has warmup_steps={saved_steps}, "
                             f"this one warmup_steps={self.warmup_steps}; build it with the "
                             "checkpointed run's warmup_steps")
        self.updates = int(state_dict["updates"])
        if self.warmup is not None:
            self.warmup.load_state_dict(state_dict["warmup"])
        self.plateau.load_state_dict(state_dict["plateau"])

    def __repr__(self) -> str:
        return (f"WarmupPlateau(warmup_steps={self.warmup_steps}, updates={self.updates}, "
                f"factor={self.plateau.factor}, patience={self.plateau.patience})")


def warmup_plateau(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    start_factor: float | None = None,
    mode: Literal["min", "max"] = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: Literal["rel", "abs"] = "rel",
    cooldown: int = 0,
    min_lr: float | Sequence[float] = 0.0,
) -> WarmupPlateau:
    """Equivalent to ``LinearLR`` warmup over ``warmup_steps`` updates followed by
    ``ReduceLROnPlateau(optimizer, mode, factor, patience, threshold, threshold_mode,
    cooldown, min_lr)`` fed with ``observe(val_metric)`` at each evaluation.

    ``patience`` and ``cooldown`` count observations (evaluations), as in torch. It has no
    end (no ``total_steps``). See [`WarmupPlateau`][] for the loop.
    """
    _check_optimizer("warmup_plateau", optimizer)
    _check_steps("warmup_plateau", warmup_steps, None)
    if mode not in ("min", "max"):
        raise ValueError(f"warmup_plateau(mode={mode!r}) must be 'min' or 'max'")
    if not _is_number(factor) or not 0.0 < factor < 1.0:
        raise ValueError(f"warmup_plateau(factor={factor!r}) must be a number in (0, 1): "
                         "new lr = lr * factor")
    for name, count in (("patience", patience), ("cooldown", cooldown)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"warmup_plateau({name}={count!r}) must be an int >= 0 "
                             "(evaluations)")
    if not warmup_steps:
        _no_warmup("warmup_plateau", start_factor)
    warmup = None
    if warmup_steps:
        warmup = _warmup(optimizer, warmup_steps,
                         _start_factor("warmup_plateau", start_factor, warmup_steps))
    min_lrs = min_lr if isinstance(min_lr, (int, float)) else list(min_lr)
    plateau = ReduceLROnPlateau(optimizer, mode=mode, factor=factor, patience=patience,
                                threshold=threshold, threshold_mode=threshold_mode,
                                cooldown=cooldown, min_lr=min_lrs)
    return WarmupPlateau(optimizer, warmup, plateau, warmup_steps)
