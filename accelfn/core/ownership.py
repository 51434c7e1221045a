"""What a TrainState is built from: a model, its optimizers and one scheduler per optimizer.

Each trainable parameter belongs to at most one optimizer, every optimizer holds only the
model's parameters, and each scheduler schedules its own optimizer; refused with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_model_and_optimizers", "paired_schedulers"]


def check_model_and_optimizers(model: nn.Module,
                                optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not optimizers:
        raise ValueError("TrainState needs an optimizer: give one, or a sequence of them "
                         "(e.g. [muon, adamw]) that together hold the trainable parameters")
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            where = "" if len(optimizers) == 1 else f" {i}"
            raise TypeError(
                f"optimizer{where} must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; give one optimizer or a list of them")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ValueError(
            "the model has no trainable parameters (all requires_grad=False); unfreeze some "
            "parameters or there is nothing to train"
        )
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        held = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = [p for p in held if id(p) not in names]
        if foreign:
            which = "the optimizer" if len(optimizers) == 1 else f"optimizer {i}"
            raise ValueError(
                f"{which} holds {len(foreign)} parameter(s) that are not the model's; build "
                "it from this model, e.g. torch.optim.AdamW(model.parameters())"
            )
        for p in held:
            if owner.get(id(p), i) != i:
                raise ValueError(
                    f"parameter {names[id(p)]!r} is in optimizer {owner[id(p)]} and optimizer "
                    f"{i}; each parameter belongs to exactly one optimizer: split the "
                    "parameters between them (e.g. matrices to Muon, the rest to AdamW)")
            owner[id(p)] = i
    if not any(key in trainable for key in owner):
        raise ValueError(
            "the optimizer holds none of the model's trainable parameters; build it from "
            "model.parameters() after freezing, not before"
        )


def paired_schedulers(scheduler: Any, optimizers: tuple[torch.optim.Optimizer, ...]
                ) -> tuple[Any | None, ...]:
    """One scheduler (or None) per optimizer, checked against its optimizer."""
    if isinstance(scheduler, (list, tuple)):
        if len(scheduler) != len(optimizers):
            raise ValueError(
                f"TrainState got {len(optimizers)} optimizer(s) and {len(scheduler)} "
                "scheduler(s); give one scheduler per optimizer, in the same order (None for "
                "an optimizer without one)")
        schedulers = tuple(scheduler)
    elif len(optimizers) > 1 and scheduler is not None:
        raise ValueError(
            f"TrainState got {len(optimizers)} optimizers and one scheduler; give a list with "
            "one scheduler per optimizer, in the same order (None for an optimizer without one)")
    else:
        schedulers = (scheduler,) * len(optimizers) if scheduler is None else (scheduler,)
    for i, (sched, optimizer) in enumerate(zip(schedulers, optimizers)):
        if sched is None:
            continue
        where = "" if len(optimizers) == 1 else f" {i}"
        if not hasattr(sched, "step"):
            raise TypeError(
                f"scheduler{where} must be a torch.optim.lr_scheduler scheduler, got "
                f"{type(sched).__name__}"
            )
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau steps on a validation metric, not once per update; use "
                "accelfn.warmup_plateau(optimizer, ...) and call .observe(metric) when you "
                "evaluate, or keep the plateau scheduler outside the TrainState"
            )
        if getattr(sched, "optimizer", optimizer) is not optimizer:
            if len(optimizers) == 1:
                raise ValueError(
                    "the scheduler was built for another optimizer than this state's")
            raise ValueError(
                f"scheduler {i} was built for another optimizer than optimizer {i}; give the "
                "schedulers in the order of the optimizers they schedule")
    return schedulers
