"""Learning-rate schedules with warmup, built from ``torch.optim.lr_scheduler``.

Each helper returns a torch scheduler (or, for the plateau schedule, a small object with the
same interface) meant for ``TrainState(model, optimizer, scheduler=...)``: the step engine
calls ``scheduler.step()`` once after every real optimizer update (never per micro-batch,
never for a skipped update), so every count below is a count of **optimizer updates**::

    steps_per_epoch = len(loader)                 # one step(state, batch) = one update
    scheduler = af.warmup_cosine(optimizer, warmup_steps=500,
                                 total_steps=epochs * steps_per_epoch)
    state = af.TrainState(model, optimizer, scheduler=scheduler)

(with ``with_accumulation(n, mode="calls")`` an update happens every ``n`` calls: divide.)

Past its end every schedule holds its final learning rate, so a run that trains longer than
``total_steps`` (a resumed run extended, a miscounted ``len(loader)``) continues at the rate
it ended on, as nanoGPT's schedule does:

* [`warmup_cosine`][]: ``min_lr`` from update ``total_steps`` on (torch's
  ``CosineAnnealingLR`` climbs back up towards ``lr``, a cosine of period ``2 * T_max``);
* [`warmup_linear`][]: ``lr * end_factor`` (as torch's ``LinearLR`` does);
* [`warmup_stable_decay`][]: ``lr * end_factor`` from update ``total_steps`` on (nanochat's
  formula would go on decaying below it);
* [`one_cycle`][]: its final rate ``max_lr / div_factor / final_div_factor`` and final
  momentum (torch's ``OneCycleLR`` overshoots by one update, then raises ``ValueError``);
* [`warmup_plateau`][]: has no end; after warmup only [`WarmupPlateau.observe`][] changes
  the rate.
Why these helpers exist: each is torch's schedulers composed (``SequentialLR`` of
``LinearLR`` and ``CosineAnnealingLR``, ``OneCycleLR``, ``LambdaLR``, ``ReduceLROnPlateau``);
what is written here is only the composition, the hold at the end that torch's
``CosineAnnealingLR`` and ``OneCycleLR`` lack, nanochat's warmup-stable-decay multiplier
(no torch scheduler has it) with its plan recorded for an exact extension, and the checks
that refuse a wrong count before the optimizer changes.

Torch's schedulers write a tensor learning rate in place (``fill_``), so they keep working
when ``compiled(optimizer=True)`` holds each group's ``lr`` as a tensor, and the optimizer
step never recompiles. The step's metrics report ``lr`` (of the first parameter group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    SequentialLR,
)

from .plateau import WarmupPlateau, warmup_plateau
from .warmup import _check_optimizer, _check_steps, _is_number, _no_warmup, _start_factor, _warmup

__all__ = ["WarmupPlateau", "one_cycle", "warmup_cosine", "warmup_linear", "warmup_plateau",
           "warmup_stable_decay"]


class _HeldCosine(CosineAnnealingLR):
    """``CosineAnnealingLR`` holding ``eta_min`` from ``T_max`` on (torch's climbs back up)."""

    def get_lr(self) -> list[float | torch.Tensor]:
        if self.last_epoch >= self.T_max:
            return [self.eta_min for _ in self.optimizer.param_groups]
        return super().get_lr()


class _HeldOneCycle(OneCycleLR):
    """``OneCycleLR`` holding its final rate (and momentum) from ``total_steps - 1`` on
    (torch's overshoots at ``total_steps`` and raises after it)."""

    def get_lr(self) -> list[float | torch.Tensor]:
        if self.last_epoch >= self.total_steps:
            return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                    for g in self.optimizer.param_groups]
        return super().get_lr()


def warmup_cosine(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr: float = 0.0,
    start_factor: float | None = None,
) -> LRScheduler:
    """Equivalent to ``SequentialLR(optimizer, [LinearLR(optimizer, start_factor, 1.0,
    warmup_steps), CosineAnnealingLR(optimizer, total_steps - warmup_steps, eta_min=min_lr)],
    milestones=[warmup_steps])`` for the first ``total_steps`` updates, then ``min_lr``.

    The learning rate of update ``t`` (counting from 0) for a group of base rate ``lr`` is:

        t <  warmup_steps:  lr * (start_factor + (1 - start_factor) * t / warmup_steps)
        t >= warmup_steps:  min_lr + (lr - min_lr) * (1 + cos(pi * (t - warmup_steps)
                                                      / (total_steps - warmup_steps))) / 2
        t >= total_steps:   min_lr (held for as long as training goes on, as nanoGPT does;
                            torch's CosineAnnealingLR would climb back up towards lr)

    ``start_factor`` defaults to ``1 / (warmup_steps + 1)``, so warmup climbs
    ``lr * (t + 1) / (warmup_steps + 1)`` and reaches ``lr`` at ``t = warmup_steps``.
    ``min_lr`` is absolute (torch's ``eta_min``), the same for every group; one above a
    group's rate (layer-wise rates) raises ``ValueError``, as that group would climb to it.
    ``warmup_steps=0`` gives the plain ``CosineAnnealingLR``.
    """
    _check_optimizer("warmup_cosine", optimizer)
    _check_steps("warmup_cosine", warmup_steps, total_steps)
    if not _is_number(min_lr) or min_lr < 0:
        raise ValueError(f"warmup_cosine(min_lr={min_lr!r}) must be a finite number >= 0")
    for i, group in enumerate(optimizer.param_groups):
        # the groups' base rates as torch's schedulers take them (initial_lr once set)
        base = float(group.get("initial_lr", group["lr"]))
        if min_lr > base:  # the "decay" would climb from base up to min_lr
            raise ValueError(f"warmup_cosine(min_lr={min_lr:g}) is above the learning rate "
                             f"{base:g} of param group {i}: that group's rate would rise to "
                             "min_lr instead of decaying (min_lr is absolute, as torch's "
                             "eta_min, the same for every group); give min_lr <= the smallest "
                             "group rate")
    if warmup_steps == 0:
        _no_warmup("warmup_cosine", start_factor)
        return _HeldCosine(optimizer, T_max=total_steps, eta_min=float(min_lr))
    factor = _start_factor("warmup_cosine", start_factor, warmup_steps)
    warmup = _warmup(optimizer, warmup_steps, factor)
    decay = _HeldCosine(optimizer, T_max=total_steps - warmup_steps, eta_min=float(min_lr))
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


def warmup_linear(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    end_factor: float = 0.0,
    start_factor: float | None = None,
) -> LRScheduler:
    """Equivalent to ``SequentialLR(optimizer, [LinearLR(optimizer, start_factor, 1.0,
    warmup_steps), LinearLR(optimizer, 1.0, end_factor, total_steps - warmup_steps)],
    milestones=[warmup_steps])``.

    Linear warmup to each group's ``lr``, then linear decay to ``lr * end_factor`` at update
    ``total_steps`` (``end_factor`` is relative to each group, as in ``LinearLR``), held
    after it. ``start_factor`` defaults to ``1 / (warmup_steps + 1)`` (see
    [`warmup_cosine`][]).
    """
    _check_optimizer("warmup_linear", optimizer)
    _check_steps("warmup_linear", warmup_steps, total_steps)
    if not isinstance(end_factor, (int, float)) or not 0.0 <= end_factor <= 1.0:
        raise ValueError(f"warmup_linear(end_factor={end_factor!r}) must be in [0, 1]: the "
                         "final learning rate as a fraction of the base one")
    decay_steps = total_steps - warmup_steps
    if warmup_steps == 0:
        _no_warmup("warmup_linear", start_factor)
        return LinearLR(optimizer, start_factor=1.0, end_factor=float(end_factor),
                        total_iters=decay_steps)
    factor = _start_factor("warmup_linear", start_factor, warmup_steps)
    warmup = _warmup(optimizer, warmup_steps, factor)
    decay = LinearLR(optimizer, start_factor=1.0, end_factor=float(end_factor),
                     total_iters=decay_steps)
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


def _count(fn: str, name: str, value: Any, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{fn}({name}={value!r}) must be an int >= {least} (optimizer updates)")
    return value


def warmup_stable_decay(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    end_factor: float = 0.0,
    anneal_strategy: Literal["linear", "cos"] = "linear",
) -> LRScheduler:
    """Equivalent to ``LambdaLR(optimizer, get_lr_multiplier)`` with nanochat's warmup,
    constant, warmdown multiplier, held at ``end_factor`` after ``total_steps``.

    The learning rate of update ``t`` (counting from 0) for a group of base rate ``lr`` is
    ``lr * m(t)`` (``lr`` times the multiplier, as nanochat's
    ``group["initial_lr"] * lrm``), with ``W = warmup_steps``, ``D = decay_steps``,
    ``T = total_steps``:

        t <  W:       m = (t + 1) / W
        t <= T - D:   m = 1.0
        t <= T:       p = (T - t) / D;  m = p * 1.0 + (1 - p) * end_factor     ("linear")
                      q = (t - (T - D)) / D;
                      m = end_factor + (1 - end_factor) * (1 + cos(pi * q)) / 2  ("cos")
        t >  T:       m = end_factor

    nanochat's ``warmup_ratio``, ``warmdown_ratio`` and ``final_lr_frac`` are
    ``warmup_steps=round(warmup_ratio * T)``, ``decay_steps=round(warmdown_ratio * T)`` and
    ``end_factor``. ``end_factor`` is relative to each group's rate (as in ``LinearLR``).
    Refused, before the optimizer changes: ``warmup_steps + decay_steps > total_steps``,
    ``decay_steps < 1`` (give ``warmup_linear``'s or a constant rate instead) and an
    ``end_factor`` outside [0, 1].
    """
    fn = "warmup_stable_decay"
    _check_optimizer(fn, optimizer)
    warmup = _count(fn, "warmup_steps", warmup_steps, 0)
    decay = _count(fn, "decay_steps", decay_steps, 1)
    total = _count(fn, "total_steps", total_steps, 1)
    if warmup + decay > total:
        raise ValueError(f"{fn}(warmup_steps={warmup}, decay_steps={decay}) take more than "
                         f"total_steps={total} updates; give warmup_steps + decay_steps <= "
                         "total_steps")
    if not _is_number(end_factor) or not 0.0 <= end_factor <= 1.0:
        raise ValueError(f"{fn}(end_factor={end_factor!r}) must be in [0, 1]: the final "
                         "learning rate as a fraction of the base one")
    if anneal_strategy not in ("linear", "cos"):
        raise ValueError(f"{fn}(anneal_strategy={anneal_strategy!r}) must be 'linear' or 'cos'")
    end = float(end_factor)
    cosine = anneal_strategy == "cos"

    def multiplier(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        if t <= total - decay:
            return 1.0
        if t > total:
            return end
        if cosine:
            q = (t - (total - decay)) / decay
            return end + (1 - end) * (1 + math.cos(math.pi * q)) / 2
        progress = (total - t) / decay
        return progress * 1.0 + (1 - progress) * end

    plan = {"warmup_steps": warmup, "decay_steps": decay, "total_steps": total}
    return _WarmupStableDecay(optimizer, multiplier, plan)


class _WarmupStableDecay(LambdaLR):
    """``warmup_stable_decay``'s ``LambdaLR``, whose state records its plan, so that a run is
    resumed with another one (extended, or shortened) only while the update it resumes at is
    in the stable phase of both: then every rate is the one the new plan gives from the start
    (the optimizer's current rate, restored with it, included). Loading keeps this
    scheduler's own plan."""

    def __init__(self, optimizer: Optimizer, multiplier: Any, plan: dict[str, int]) -> None:
        self._plan = dict(plan)
        super().__init__(optimizer, multiplier)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = dict(state_dict)
        theirs = saved.pop("_plan", None)  # None: saved as a plain LambdaLR, not compared
        ours = self._plan
        if isinstance(theirs, dict) and theirs != ours:
            at = int(saved.get("last_epoch", 0))  # the update the run resumes at
            stable = min(theirs.get("total_steps", 0) - theirs.get("decay_steps", 0),
                         ours["total_steps"] - ours["decay_steps"])
            if theirs.get("warmup_steps") != ours["warmup_steps"] or at > stable:
                raise ValueError(
                    f"warmup_stable_decay: the checkpoint's schedule is {_plan_text(theirs)}, "
                    f"this one {_plan_text(ours)}, and the run resumes at update {at}: another "
                    "plan continues a run exactly only with the same warmup_steps and while "
                    f"both are in their stable phase (up to update {stable} here), before any "
                    "decay began. Resume with the checkpoint's plan, or extend the run from a "
                    "checkpoint of its stable phase")
        super().load_state_dict(saved)


def _plan_text(plan: dict[str, Any]) -> str:
    return ", ".join(f"{k}={plan.get(k)}" for k in ("warmup_steps", "decay_steps",
                                                     "total_steps"))


def _has_momentum(optimizer: Optimizer) -> bool:
    if "betas" in optimizer.defaults:
        return True
    return "momentum" in optimizer.defaults and all(
        float(g.get("momentum", 0.0)) > 0 for g in optimizer.param_groups)


def one_cycle(
    optimizer: Optimizer,
    *,
    total_steps: int,
    max_lr: float | Sequence[float] | None = None,
    warmup_steps: int | None = None,
    pct_start: float = 0.3,
    anneal_strategy: Literal["cos", "linear"] = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
    cycle_momentum: bool | None = None,
) -> LRScheduler:
    """Equivalent to ``OneCycleLR(optimizer, max_lr, total_steps=total_steps,
    pct_start=pct_start, ...)`` (its own warmup: from ``max_lr / div_factor`` up to
    ``max_lr``, then annealing to ``max_lr / div_factor / final_div_factor``) for the first
    ``total_steps`` updates; after them the final rate and momentum are held (torch's
    ``OneCycleLR`` overshoots at update ``total_steps`` and raises ``ValueError`` at the next).

    ``max_lr`` defaults to each group's current ``lr``, or to the ``max_lr`` a ``OneCycleLR``
    already built on the optimizer left in its groups (a rebuilt cycle, or an optimizer whose
    mid-cycle state was loaded first, keeps its peak). ``warmup_steps``, when given, sets
    ``pct_start = warmup_steps / total_steps``. ``cycle_momentum`` defaults to True only for
    optimizers that have momentum (``betas``, or SGD with ``momentum > 0``), where torch's
    default would switch momentum on for plain SGD. ``total_steps`` counts optimizer
    updates: ``epochs * steps_per_epoch`` in ``OneCycleLR``'s notation. Refused where
    torch's would divide by zero or lose a phase: a rise of one update or less
    (``warmup_steps < 2``, ``pct_start * total_steps <= 1``), and with ``three_phase=True``
    a ``pct_start`` above about 0.5 (the rise and the fall would take every update and the
    final annealing would never run).
    """
    _check_optimizer("one_cycle", optimizer)
    _check_steps("one_cycle", 0 if warmup_steps is None else warmup_steps, total_steps)
    if warmup_steps is not None:
        if warmup_steps < 2:
            raise ValueError(f"one_cycle(warmup_steps={warmup_steps}): the cycle needs a rising "
                             "phase of 2 updates at least (max_lr / div_factor at update 0, "
                             "max_lr at update warmup_steps - 1); give warmup_steps >= 2 or "
                             "use warmup_cosine(warmup_steps=0, ...)")
        pct_start = warmup_steps / total_steps
    if not 0.0 < pct_start < 1.0:
        raise ValueError(f"one_cycle(pct_start={pct_start!r}) must be in (0, 1)")
    if pct_start * total_steps - 1 <= 1e-9:
        # OneCycleLR's rise ends at update pct_start * total_steps - 1: at 0 it divides by
        # zero, before 0 update 0 is already past the peak (no rise at all)
        raise ValueError(f"one_cycle(pct_start={pct_start:g}, total_steps={total_steps}): the "
                         "cycle needs a rising phase of more than one update; give "
                         "pct_start > 1 / total_steps (or warmup_steps >= 2)")
    if three_phase and 2 * pct_start * total_steps - 2 >= total_steps - 1:
        # OneCycleLR's second phase (back down to max_lr / div_factor) would end on or after
        # the last update: the annealing phase never runs, the final rate never comes
        raise ValueError(f"one_cycle(three_phase=True, pct_start={pct_start:g}): the rise and "
                         f"the fall of {total_steps} updates leave none for the final "
                         "annealing; give pct_start (or warmup_steps / total_steps) of 0.5 at most")
    for name, value in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
        if not _is_number(value) or value <= 0:
            raise ValueError(f"one_cycle({name}={value!r}) must be a finite number > 0 (the "
                             "rates are max_lr / div_factor and "
                             "max_lr / div_factor / final_div_factor)")
    if max_lr is None:
        # a OneCycleLR already built on this optimizer (or on the one a loaded state came
        # from) left its peak in "max_lr" and moved "lr" off it
        max_lr = [float(g.get("max_lr", g["lr"])) for g in optimizer.param_groups]
    elif not isinstance(max_lr, (int, float)):
        max_lr = [float(v) for v in max_lr]
    if cycle_momentum is None:
        cycle_momentum = _has_momentum(optimizer)
    elif cycle_momentum and not _has_momentum(optimizer):
        raise ValueError("one_cycle(cycle_momentum=True) needs an optimizer with momentum "
                         "(SGD(momentum>0), Adam/AdamW betas)")
    return _HeldOneCycle(optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=pct_start,
                      anneal_strategy=anneal_strategy, div_factor=div_factor,
                      final_div_factor=final_div_factor, three_phase=three_phase,
                      cycle_momentum=cycle_momentum)
