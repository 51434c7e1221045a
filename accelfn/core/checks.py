"""The checks a step makes when it is built and prepared, and its out-of-memory advice."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .protocol import EXCLUSIVE, PHASES, Transform
from .state import TrainState

if TYPE_CHECKING:
    from .engine import Step

__all__ = ["check_optimizer_holds_trainable", "check_stack", "out_of_memory"]

_ORDER = [name for name, _, _ in PHASES]


def check_stack(transforms: tuple[Transform, ...], text: Callable[[], str]) -> None:
    names = [t.name for t in transforms]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{name} is applied twice in {text()}; apply each transform once")
    for phase in _ORDER:
        members = sorted((t for t in transforms if phase in t.hooks), key=lambda t: t.name)
        if len(members) < 2:
            continue
        first, second = members[0], members[1]
        if phase in EXCLUSIVE:
            raise ValueError(
                f"{first.name} and {second.name} both fill the {phase!r} phase, which runs one "
                f"hook only; keep one of them in {text()}")
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if not (a.commutes_with(b) and b.commutes_with(a)):
                    raise ValueError(
                        f"{a.name} and {b.name} both have a {phase!r} hook and do not both "
                        f"declare that they commute, so their order would change the result; "
                        f"declare commutes=True (or name the other) on both if it does not")


def check_optimizer_holds_trainable(state: TrainState) -> None:
    held = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in state.model.named_parameters() if p.requires_grad
               and id(p) not in held]
    if missing:
        state.warn_once("missing", (
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they get "
            "gradients that nothing applies or clears, every update. Add them to the "
            "optimizer, or freeze them with requires_grad_(False) (accelfn.freeze)"))


def out_of_memory(step: Step, error: BaseException) -> torch.OutOfMemoryError:
    split = step._hooks["split"]
    n = int(dict(split[0][0].options).get("n", 1)) if split else 1
    advice = [f"with_accumulation({2 * n}) (same update, half the activations)"]
    if not step.has("checkpoint"):
        advice.append("checkpointed (recompute block activations in backward)")
    if not step.has("forward_context"):
        advice.append("with_amp (bf16 activations take half the memory)")
    advice.append("a smaller batch")
    return torch.OutOfMemoryError(
        f"out of memory in {step}; the model, optimizer and scheduler are unchanged "
        f"and gradients were cleared. Try: {'; '.join(advice)}. ({error})")
