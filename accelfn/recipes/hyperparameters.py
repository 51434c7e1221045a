"""Schedules of any hyperparameter of the optimizer's groups, as functions of the update count.

nanochat and modded-nanogpt set Muon's momentum and weight decay before every update, many
recipes Adam's betas and weight decay; [`schedule`][] does it as a scheduler of the
``TrainState``::

    def muon_momentum(t):                          # t: the update, 0 for the first
        frac = min(t / 300, 1)
        return (1 - frac) * 0.85 + frac * 0.95

    muon_schedule = af.schedule(muon, momentum=muon_momentum,
                                weight_decay=lambda t: 0.2 * (1 - t / total))
    adamw_schedule = af.schedule(adamw, betas=lambda t: (0.8, 0.95 if t < 100 else 0.99))
    state = af.TrainState(model, [muon, adamw], scheduler=[muon_schedule, adamw_schedule])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["Schedule", "schedule"]

ValueFn = Callable[[int], Any]


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _fits(current: Any, value: Any) -> bool:
    """Whether ``value`` can replace (or be written into) the group's ``current`` value."""
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, torch.Tensor):
        return current.numel() == 1 and _number(value)
    if isinstance(current, (int, float)):
        return _number(value)
    if isinstance(current, (tuple, list)):
        return (isinstance(value, (tuple, list)) and len(value) == len(current)
                and all(_fits(c, v) for c, v in zip(current, value)))
    return False


def _write(group: dict[str, Any], key: str, value: Any) -> None:
    """``group[key] = value``; a tensor (a compiled optimizer's ``lr``, a tuple of tensor
    ``betas``) is filled in place, so a compiled optimizer step sees it without recompiling."""
    current = group[key]
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    elif isinstance(current, (tuple, list)) and any(isinstance(c, torch.Tensor)
                                                   for c in current):
        kept = []
        for c, v in zip(current, value):
            if isinstance(c, torch.Tensor):
                c.fill_(v)
                kept.append(c)
            else:
                kept.append(v)
        group[key] = type(current)(kept)
    else:
        group[key] = value


class Schedule:
    """Sets parameter-group keys of one optimizer from functions of the update count.

    ``functions`` maps a key to one function per parameter group (None: that group is left
    alone). Built by [`schedule`][]; a scheduler of ``TrainState`` like torch's: the step
    calls [`step`][] after every real update. ``last_epoch`` is the update the current
    values are for (0 before the first update, as in torch's schedulers).
    """

    def __init__(self, optimizer: Optimizer, functions: dict[str, list[ValueFn | None]]) -> None:
        self.optimizer = optimizer
        self.functions = functions
        self.last_epoch = 0
        self._values: dict[str, list[Any]] = {}
        self._set(0)

    def _compute(self, t: int) -> dict[str, list[Any]]:
        """Every scheduled value for update ``t``, checked; nothing is written."""
        out: dict[str, list[Any]] = {}
        for key, fns in self.functions.items():
            values: list[Any] = []
            for i, (fn, group) in enumerate(zip(fns, self.optimizer.param_groups)):
                if fn is None:
                    values.append(None)
                    continue
                value = fn(t)
                if not _fits(group[key], value):
                    raise ValueError(
                        f"schedule: the function of {key!r} (param group {i}) returned "
                        f"{value!r} for update {t}; the group holds {group[key]!r}: give a "
                        "finite number (a tuple of them for a tuple such as betas)")
                values.append(tuple(value) if isinstance(value, list) else value)
            out[key] = values
        return out

    def _set(self, t: int) -> None:
        values = self._compute(t)  # all of them first: a failing function changes nothing
        for key, per_group in values.items():
            for group, value in zip(self.optimizer.param_groups, per_group):
                if value is not None:
                    _write(group, key, value)
        self._values = values
        self.last_epoch = t

    def step(self) -> None:
        """Set the values of the next update (the step calls it after each real update)."""
        self._set(self.last_epoch + 1)

    def values(self) -> dict[str, float]:
        """The values set for the coming update, as floats to log: ``{"momentum": 0.9}``;
        a key given per group is named per group (``"weight_decay/group1"``), a tuple per
        element (``"betas[1]"``). Read on the host, no device sync."""
        out: dict[str, float] = {}
        for key, per_group in self._values.items():
            fns = self.functions[key]
            shared = fns[0] is not None and all(fn is fns[0] for fn in fns)
            for i, value in enumerate(per_group):
                if value is None:
                    continue
                name = key if shared else f"{key}/group{i}"
                if isinstance(value, tuple):
                    out.update({f"{name}[{j}]": float(v) for j, v in enumerate(value)})
                else:
                    out[name] = float(value)
        return out

    def get_last_lr(self) -> list[float]:
        """The learning rate of each group, as floats (torch's schedulers' method)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """``{"last_epoch": t}``: the functions are code, rebuilt by the script, not saved."""
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved update: the groups get the functions' values for it."""
        t = state_dict.get("last_epoch") if isinstance(state_dict, dict) else None
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"not a schedule's state: {state_dict!r}; give what "
                             "Schedule.state_dict() returned")
        self._set(t)

    def __repr__(self) -> str:
        return (f"Schedule({type(self.optimizer).__name__}, keys={sorted(self.functions)}, "
                f"last_epoch={self.last_epoch})")


def schedule(optimizer: Optimizer, /,
             **hyperparameters: ValueFn | Mapping[int, ValueFn]) -> Schedule:
    """Equivalent to setting, before update ``t`` (0 for the first), every scheduled key of
    the optimizer's groups by hand:

        for group in optimizer.param_groups:
            group["momentum"] = momentum(t)        # for each key=function given

    as nanochat's loop does for Muon's momentum and weight decay. Each keyword names a key of
    the parameter groups (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``, ...) and
    gives a function of ``t`` returning its value, the same for every group, or a dict from
    group index to function (groups left out keep their value). Values are absolute (for a
    factor of each group's rate use a torch scheduler such as ``LambdaLR``).

    Give the result to ``TrainState(model, optimizer, scheduler=...)`` (one per optimizer):
    the step calls its ``step()`` after every real update (never for a skipped one; with
    ``scheduler_every=N``, ``t`` counts blocks of ``N`` updates), and the groups hold the
    values of update 0 from the call on. Its state is the update count only (``state_dict()``:
    ``{"last_epoch": t}``); the functions are not saved, so a resumed run rebuilds the
    schedule with the same functions and continues exactly. A tensor value in a group (a
    compiled optimizer's ``lr``, tensor ``betas``) is filled in place. Every function is
    called and checked (a finite number, a tuple of them for a tuple) before any group
    changes, at every update. [`Schedule.values`][] gives the current values to log.

    To schedule the learning rate by a torch scheduler too, chain them:
    ``torch.optim.lr_scheduler.ChainedScheduler([af.warmup_stable_decay(muon, ...),
    af.schedule(muon, momentum=...)])``.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"schedule() takes a torch.optim.Optimizer first, got "
                        f"{type(optimizer).__name__}")
    if not hyperparameters:
        raise ValueError("schedule(optimizer) needs at least one key=function, e.g. "
                         "schedule(optimizer, momentum=lambda t: 0.95)")
    groups = optimizer.param_groups
    functions: dict[str, list[ValueFn | None]] = {}
    for key, given in hyperparameters.items():
        if key in ("params", "initial_lr"):
            raise ValueError(f"schedule({key}=...): {key!r} is not a hyperparameter to "
                             "schedule")
        if isinstance(given, Mapping):
            bad = [i for i in given if isinstance(i, bool) or not isinstance(i, int)
                   or not 0 <= i < len(groups)]
            if bad:
                raise ValueError(f"schedule({key}={{...}}): the keys {bad} are not indices of "
                                 f"the optimizer's {len(groups)} param groups")
            fns: list[ValueFn | None] = [given.get(i) for i in range(len(groups))]
        else:
            fns = [given] * len(groups)
        for i, fn in enumerate(fns):
            if fn is None:
                continue
            if not callable(fn):
                raise TypeError(f"schedule({key}=...) takes a function of the update count "
                                f"(or a dict of them by group index), got {fn!r}")
            if key not in groups[i]:
                raise ValueError(
                    f"schedule({key}=...): param group {i} of {type(optimizer).__name__} has "
                    f"no {key!r}; its keys are "
                    f"{sorted(k for k in groups[i] if k != 'params')}")
        functions[key] = fns
    return Schedule(optimizer, functions)
