"""State a step function carries from one call to the next (truncated BPTT hidden states).

A step function that takes a parameter named ``carry`` receives what it returned as
``"carry"`` on the previous call (None on the first), detached from the graph::

    def lm_step(model, batch, carry):
        logits, hidden = model(batch["tokens"], carry)
        return {"loss": F.cross_entropy(...), "carry": hidden}

The carried values live in the TrainState (slot ``carry``) and are checkpointed with it. Under
``with_accumulation(n)`` each micro-batch position keeps its own carry, since micro-batch
``i`` of a batch holds the same rows as micro-batch ``i`` of the previous one; ``evaluate``
keeps a separate one. A call that fails leaves the carry as it was, and so does a call whose
update is skipped (non-finite loss or gradients, an fp16 overflow): the skipped batch is
dropped with its update, so a NaN carry cannot poison the calls after it. When a fused
optimizer decides the skip on the device, the choice is made there (``torch.where``, no host
read), and a skipped call that had no carry before leaves zeros, what the recurrent modules
take None for. Under ``with_accumulation(n, mode="calls")`` the calls that only accumulate
commit their carry (there is no update yet to skip); the window's last call commits with
the update. ``state.reset_carry()`` starts over (at an epoch boundary, say).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["SLOT", "Carries", "detached", "kept", "takes_carry"]

SLOT = "carry"


def takes_carry(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` declares a parameter named ``carry``."""
    try:
        return "carry" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def detached(value: Any) -> Any:
    """``value`` with every tensor detached (tensors, or tuples, lists and dicts of them)."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(detached(v) for v in value)
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if value is None:
        return None
    raise TypeError(f"a carry must be tensors (or tuples, lists, dicts of them), got "
                    f"{type(value).__name__}")


def kept(old: Any, new: Any, skip: Tensor) -> Any:
    """``old`` where the device flag ``skip`` is set, ``new`` otherwise, leaf by leaf (zeros
    stand in for an old leaf that is missing or of another shape, dtype or device)."""
    if isinstance(new, Tensor):
        if not (isinstance(old, Tensor) and old.shape == new.shape and old.dtype == new.dtype
                and old.device == new.device):
            old = torch.zeros_like(new)
        return torch.where(skip.to(new.device), old, new)
    if isinstance(new, (tuple, list)):
        olds = old if isinstance(old, type(new)) and len(old) == len(new) else [None] * len(new)
        return type(new)(kept(o, n, skip) for o, n in zip(olds, new))
    if isinstance(new, dict):
        previous = old if isinstance(old, dict) else {}
        return {k: kept(previous.get(k), v, skip) for k, v in new.items()}
    return None


def _leaves(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return []


def _elsewhere(value: Any, device: torch.device) -> bool:
    return any(leaf.device != device for leaf in _leaves(value))


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


class Carries:
    """The carried values, by mode (``"train"``, ``"evaluate"``) and micro-batch position."""

    def __init__(self) -> None:
        self.values: dict[str, dict[int, Any]] = {"train": {}, "evaluate": {}}

    def get(self, mode: str, index: int, device: torch.device | None = None) -> Any:
        """The carry of micro-batch ``index``, its tensors on ``device`` (a checkpoint loads
        them on the CPU: moved once, when a step on the GPU first asks)."""
        values = self.values[mode]
        value = values.get(index)
        if device is not None and value is not None and _elsewhere(value, device):
            value = values[index] = _moved(value, device)
        return value

    def commit(self, mode: str, new: dict[int, Any]) -> None:
        self.values[mode].update(new)

    def commit_unless(self, mode: str, new: dict[int, Any], skip: Tensor) -> None:
        """Commit ``new`` unless the device flag ``skip`` is set, without reading it: each
        carried tensor becomes ``torch.where(skip, old, new)`` (zeros where there was no old
        one of the same shape, dtype and device: what the recurrent modules take None for)."""
        values = self.values[mode]
        for index, value in new.items():
            values[index] = kept(values.get(index), value, skip)

    def commit_update(self, new: dict[int, Any], skip: bool | None,
                      on_device: Tensor | None) -> None:
        """Commit a training update's carries: unless it was skipped, decided on the host
        (``skip``) or on the device (``on_device``, never read)."""
        if on_device is not None:
            self.commit_unless("train", new, on_device)
        elif not skip:
            self.commit("train", new)

    def reset(self, mode: str | None = None) -> None:
        for key in ([mode] if mode else list(self.values)):
            self.values[key] = {}

    def state_dict(self) -> dict[str, Any]:
        return {mode: dict(values) for mode, values in self.values.items()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.values = {"train": dict(saved.get("train", {})),
                       "evaluate": dict(saved.get("evaluate", {}))}
