"""The warmup and the argument checks the schedules share (accelfn.recipes.schedules and
accelfn.recipes.plateau): a ``LinearLR`` warmup, counts of optimizer updates, factors."""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LinearLR

__all__: list[str] = []


def _check_optimizer(fn: str, optimizer: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{fn}() takes a torch.optim.Optimizer first, got "
                        f"{type(optimizer).__name__}")


def _check_steps(fn: str, warmup_steps: Any, total_steps: Any | None) -> None:
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"{fn}(warmup_steps={warmup_steps!r}) must be an int >= 0 (optimizer "
                         "updates, not epochs)")
    if total_steps is None:
        return
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1:
        raise ValueError(f"{fn}(total_steps={total_steps!r}) must be an int >= 1: the number "
                         "of optimizer updates, e.g. epochs * len(loader)")
    if warmup_steps >= total_steps:
        raise ValueError(f"{fn}(warmup_steps={warmup_steps}) must be smaller than "
                         f"total_steps={total_steps}")


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _no_warmup(fn: str, start_factor: float | None) -> None:
    if start_factor is not None:
        raise ValueError(f"{fn}(start_factor={start_factor!r}) applies to the warmup, and "
                         "warmup_steps=0 has none; drop start_factor or give warmup_steps > 0")


def _start_factor(fn: str, start_factor: float | None, warmup_steps: int) -> float:
    if start_factor is None:
        return 1.0 / (warmup_steps + 1)
    if not isinstance(start_factor, (int, float)) or not 0.0 < start_factor <= 1.0:
        raise ValueError(f"{fn}(start_factor={start_factor!r}) must be in (0, 1]: the first "
                         "update's learning rate as a fraction of the base one")
    return float(start_factor)


def _warmup(optimizer: Optimizer, warmup_steps: int, start_factor: float) -> LinearLR:
    return LinearLR(optimizer, start_factor=start_factor, end_factor=1.0,
                    total_iters=warmup_steps)
