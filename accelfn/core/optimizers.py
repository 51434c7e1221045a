"""The optimizers of one update: stepping them all, clearing their gradients, their rates.

A TrainState holds one optimizer or several (Muon for the hidden matrices and AdamW for the
rest, say), each parameter in exactly one; the engine treats them as one update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .state import TrainState

__all__ = ["backward_inputs", "clear_grads", "rate_metrics", "step_unless", "stepper"]


def stepper(optimizers: tuple[torch.optim.Optimizer, ...]) -> Callable[[], object]:
    """``optimizer.step()`` of every optimizer, in order: torch's call, looked up at each
    update (its hooks, its profiler label, a scheduler's call tracking and a ``step`` replaced
    on the instance later all run)."""
    if len(optimizers) == 1:
        (optimizer,) = optimizers
        return lambda: optimizer.step()

    def step_all() -> None:
        for optimizer in optimizers:
            optimizer.step()

    return step_all


def step_unless(optimizer_step: Callable[[], object],
                optimizers: tuple[torch.optim.Optimizer, ...], skip: Tensor) -> None:
    """Run ``optimizer_step`` with each (fused) optimizer's ``found_inf`` input set to the
    device flag ``skip``: they skip the update on the device, as under ``GradScaler.step``."""
    found = skip.float()
    for optimizer in optimizers:
        optimizer.found_inf = found  # type: ignore[attr-defined]
    try:
        optimizer_step()
    finally:
        for optimizer in optimizers:
            del optimizer.found_inf  # type: ignore[attr-defined]


_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def clear_grads(optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` of every optimizer that holds a gradient
    (every one whose class has its own ``zero_grad``), torch's call: after an update, and on
    the gradients a new window finds on its parameters, which something else left (another
    model's step whose loss reached them, a backward outside the step): the update applies
    its own loss's gradients only. Usually a window finds none (a step clears after its
    update), and no call is made."""
    for optimizer in optimizers:
        if type(optimizer).zero_grad is not _ZERO_GRAD or any(
                p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            optimizer.zero_grad(set_to_none=True)


def backward_inputs(state: TrainState) -> tuple[Tensor, ...]:
    """The tensors a backward accumulates into: all that require grad (``()``, autograd's
    default and fastest path) while this is the process' only TrainState, else the state's
    own parameters (``torch.autograd.backward(inputs=...)``), so that a step whose loss reaches
    another state's model (a GAN's generator through its discriminator) neither computes nor
    leaves gradients on it. Sharded parameters (DTensor, float8 all-gather) are not graph
    leaves of the forward, so their steps keep the default."""
    if not TrainState.several_alive():
        return ()
    return state.backward_inputs()


def rate_metrics(metrics: dict[str, Tensor], optimizers: tuple[torch.optim.Optimizer, ...],
                 device: torch.device) -> None:
    """``lr``: the first optimizer's first group's learning rate now, the one the update uses
    (a copy of a tensor rate, which schedulers update in place); with several optimizers also
    ``lr/<name>`` for each (its class name in lower case, ``_1``... for repeats). Fills, not
    copies: nothing waits for the device."""
    values = []
    for optimizer in optimizers:
        lr = optimizer.param_groups[0]["lr"]
        values.append(lr.detach().clone() if isinstance(lr, Tensor)
                      else torch.scalar_tensor(float(lr), device=device))
    metrics["lr"] = values[0]
    if len(values) == 1:
        return
    seen: dict[str, int] = {}
    for optimizer, value in zip(optimizers, values):
        name = type(optimizer).__name__.lower()
        count = seen.get(name, 0)
        seen[name] = count + 1
        metrics[f"lr/{name}" if not count else f"lr/{name}_{count}"] = value
