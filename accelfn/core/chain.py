"""The user's gradient transforms, run as one chain in the order they were stacked.

Each [`GradientTransform`][accelfn.GradientTransform] keeps its state in the TrainState
(slot ``"gradients.<name>"``), made by its ``init(params)`` at the first update. The chain
returns the new states instead of storing them: the engine commits them with the update,
so a call that fails before the optimizer step, or an update skipped on the host, leaves
them as they were (as ``optax.apply_if_finite`` leaves its inner state).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from .protocol import GradientTransform, UpdateContext

__all__ = ["Held", "commit", "run"]


class Held:
    """A gradient transform's state, as the TrainState keeps it (a slot)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        value = self.value
        if hasattr(value, "state_dict"):
            return value.state_dict()
        if isinstance(value, dict):
            return {k: (v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v))
                    for k, v in value.items()}
        return copy.deepcopy(value)

    def load_state_dict(self, saved: Any) -> None:
        value = self.value
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(saved)
            return
        if isinstance(value, dict) and isinstance(saved, dict) and set(value) != set(saved):
            raise ValueError(
                f"a checkpointed gradient transform state has keys {sorted(saved)}, this "
                f"step's {sorted(value)}; the checkpoint comes from another transform")
        if isinstance(value, dict):
            device = {k: v.device for k, v in value.items() if isinstance(v, Tensor)}
            self.value = {k: (v.to(device[k], copy=True) if k in device else copy.deepcopy(v))
                          for k, v in saved.items()}
        else:
            self.value = copy.deepcopy(saved)


Pending = list[tuple[Held, Any]]


def run(chain: Sequence[GradientTransform], ctx: UpdateContext) -> Pending:
    """Run ``chain`` on the update's gradients (edited in place); returns the new states."""
    grads, params = ctx.params_with_grads()
    pending: Pending = []
    for transform in chain:
        held: Held = ctx.state.slot(transform.slot, _factory(transform, params))
        new = transform.update(grads, params, held.value)
        if new is not None:
            pending.append((held, new))
    return pending


def _factory(transform: GradientTransform, params: list[Tensor]) -> Callable[[], Held]:
    init = transform.init
    return lambda: Held(None if init is None else init(params))


def commit(pending: Pending) -> None:
    """Keep the new states of an update that was applied."""
    for held, new in pending:
        held.value = new
