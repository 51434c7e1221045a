"""What a step's parts are handed: the state's preparation ([`Prepared`][]), a call's context
([`CallContext`][]) and an update's ([`UpdateContext`][])."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .state import TrainState

__all__ = ["CallContext", "Prepared", "UpdateContext", "entered", "held"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a [`TrainState`][] looks like to a step after preparation (immutable).

    Each preparing part returns a new one (``dataclasses.replace``). Fields and their owners:
    ``model`` (what ``fn`` receives: the state's model itself, every technique applied to it
    in place), ``call`` (sharding: runs a call of the step function as the model's forward,
    so DDP's and FSDP2's forward hooks wrap the whole function, whichever submodules and
    methods it calls; None: called as it is), ``optimizer_step``
    (compilation may replace it), ``device`` (the engine), ``compute_dtype`` (mixed
    precision: the autocast dtype of the forward, None in fp32), ``process_group``
    (sharding: the group gradients are reduced over, None in one process),
    ``skips_on_device`` (the engine: the optimizer honours a device ``found_inf`` flag),
    ``parameters`` (the engine: the state's model's parameters in ``model.parameters()``
    order once prepared, and ``held``, how many parameters its optimizers held then; see
    [`CallContext.parameters`][]).
    """

    model: nn.Module
    optimizer_step: Callable[[], object]
    device: torch.device
    call: Callable[[Callable[[], Any]], Any] | None = None
    compute_dtype: torch.dtype | None = None
    process_group: Any = None
    skips_on_device: bool = False
    parameters: tuple[Tensor, ...] = ()
    held: int = -1


def held(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """How many parameters ``optimizers`` hold (``add_param_group`` changes it)."""
    return sum(len(group["params"]) for o in optimizers for group in o.param_groups)


@dataclass(slots=True)
class CallContext:
    """Handed to the parts of a call: the state, its preparation, and whether this is training."""

    state: TrainState
    prepared: Prepared
    training: bool = True

    @property
    def model(self) -> nn.Module:
        return self.prepared.model

    @property
    def device(self) -> torch.device:
        return self.prepared.device

    @property
    def distributed(self) -> Any:
        """The process group gradients are reduced over, or None in a single process."""
        return self.prepared.process_group

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The state's optimizer when it has one (see [`optimizers`][])."""
        return self.state.optimizer

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """Every optimizer of the state, in order."""
        return self.state.optimizers

    def parameters(self) -> tuple[Tensor, ...]:
        """``tuple(state.model.parameters())``: the model's parameters in their order (what
        ``clip_grad_norm_(model.parameters())`` sums over), walked once when the state was
        prepared and again only when its optimizers' parameters changed since (a module
        walk costs more than a small model's clip)."""
        prepared = self.prepared
        if prepared.held == held(self.state.optimizers):
            return prepared.parameters
        return tuple(self.state.model.parameters())


class UpdateContext(CallContext):
    """Handed to the update's parts (unscaling to after the update). Fields and owners:

    ``loss`` (the engine: the weighted mean loss of the update, a device scalar);
    ``metrics`` (every part may add device scalars; they are returned with the step's);
    ``divisor`` (the engine sets the local weight total when micro-batches are weighted
    absolutely; the sharding part may replace it, the engine divides the gradients by it after
    the reduction); ``weight_total`` (likewise: the weight summed over processes).
    """

    __slots__ = ("divisor", "loss", "metrics", "weight_total")

    def __init__(self, state: TrainState, prepared: Prepared, loss: Tensor) -> None:
        self.state = state  # CallContext's fields, without a call per update
        self.prepared = prepared
        self.training = True
        self.loss = loss
        self.metrics: dict[str, Tensor] = {}
        self.divisor: Tensor | None = None
        self.weight_total: Tensor | None = None

    def grads(self) -> list[Tensor]:
        """The gradients the optimizers will apply (parameters without one are left out)."""
        return [p.grad for o in self.state.optimizers for g in o.param_groups
                for p in g["params"] if p.grad is not None]

    def params_with_grads(self) -> tuple[list[Tensor], list[Tensor]]:
        """(gradients, parameters) of the parameters the optimizers will update, aligned."""
        params = [p for o in self.state.optimizers for g in o.param_groups
                  for p in g["params"] if p.grad is not None]
        return [p.grad for p in params], params  # type: ignore[misc]

    def local_grads(self) -> list[Tensor]:
        """[`grads`][] as plain tensors: this process' shard of sharded (DTensor) ones."""
        out = []
        for g in self.grads():
            to_local = getattr(g, "to_local", None)
            out.append(to_local() if callable(to_local) else g)
        return out


@contextlib.contextmanager
def entered(managers: Sequence[contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Enter ``managers`` in order (the first outermost)."""
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield
