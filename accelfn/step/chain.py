"""The user's gradient transforms, run as one chain in the order they were stacked.

[`chain`][accelfn.chain]``(a, b, ...)`` writes that order once: ``chain(a, b)(fn)`` is
``b(a(fn))``, as ``optax.chain(a, b)``. Each transform keeps its state in the TrainState
(slot ``"gradients.<name>"``), made by its ``init(params)`` at the first update. The chain
returns the new states instead of storing them: the engine commits them with the update,
so a call that fails before the optimizer step, or an update skipped on the host, leaves
them as they were (as ``optax.apply_if_finite`` leaves its inner state). Committing runs
the transforms' ``after_step`` places too, right after the optimizer step, in chain order.

After each transform the chain checks what it left (only when there are user transforms:
a step without them reads nothing): every gradient of its parameter's shape, dtype and
device, and no parameter written (their autograd version counters unchanged); else it
raises [`GradientTransformError`][] naming the transform, before any optimizer state changes.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.contexts import UpdateContext
from .extension import Chained, GradientTransform, Transform

__all__ = ["GradientTransformError", "Held", "Pending", "chain", "commit", "run"]


class GradientTransformError(RuntimeError):
    """A gradient transform broke its contract: it left a gradient unlike its parameter, or
    wrote into a parameter. Raised before any optimizer state changes."""


def chain(*transforms: Transform | GradientTransform) -> Transform:
    """The gradient transforms ``transforms`` as one, run in the order written: equivalent to
    applying them one by one, ``chain(a, b)(fn) == b(a(fn))``, as ``optax.chain(a, b)``.

    Each keeps its own state (slot ``"gradients.<name>"``) and its ``after_step`` (run after
    the optimizer step, in the same order). A chain in a chain is flattened; ``chain()``
    changes nothing. The built-ins are refused: each fills its own place of the update
    whatever the order (clipping comes after every gradient transform), so stack them
    around the chain: ``with_clipping(max_norm=1.0)(chain(a, b)(fn))``.
    """
    members: list[Transform] = []
    for t in transforms:
        if isinstance(t, GradientTransform):
            t = t.transform()
        if not isinstance(t, Transform):
            raise TypeError(f"chain() takes gradient transforms (accelfn.Transform(name, "
                            f"update=...)), got {t!r}")
        if isinstance(t.part, Chained):
            members.extend(t.part.members)
        elif isinstance(t.part, GradientTransform):
            members.append(t)
        else:
            raise TypeError(
                f"chain() takes gradient transforms; {t!r} is a built-in, which fills its own "
                "place of the update whatever the order: stack it around the chain, "
                f"{t!r}(chain(...)(fn))")
    names = [m.name for m in members]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"chain() holds two gradient transforms named {', '.join(twice)}: "
                         "their states would share a slot; give each its own name")
    return Transform("chain", Chained(tuple(members)), options=(("transforms", tuple(members)),),
                     label=f"chain({', '.join(repr(m) for m in members)})")


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


class Pending:
    """What a run of the chain leaves for the update: the new states (kept with it) and the
    transforms with an ``after_step``, with the parameters they were handed."""

    __slots__ = ("after", "params", "states")

    def __init__(self, states: list[tuple[Held, Any]], after: list[tuple[GradientTransform, Held]],
                 params: list[Tensor]) -> None:
        self.states = states
        self.after = after
        self.params = params

    def __bool__(self) -> bool:
        """Whether committing does anything."""
        return bool(self.states or self.after)


def run(chain: Sequence[GradientTransform], ctx: UpdateContext) -> Pending:
    """Run ``chain`` on the update's gradients (edited in place), each transform checked
    after it ran; returns the new states and what runs after the optimizer step."""
    grads, params = ctx.params_with_grads()
    expected = list(map(_META, params))  # what every gradient must be
    states: list[tuple[Held, Any]] = []
    after: list[tuple[GradientTransform, Held]] = []
    for transform in chain:
        held: Held = ctx.state.slot(transform.slot, _factory(transform, params))
        versions = [p._version for p in params]
        new = transform.update(grads, params, held.value)
        _check(transform, grads, params, versions, expected, ctx)
        if new is not None:
            states.append((held, new))
        if transform.after_step is not None:
            after.append((transform, held))
    return Pending(states, after, params)


def _factory(transform: GradientTransform, params: list[Tensor]) -> Callable[[], Held]:
    init = transform.init
    return lambda: Held(None if init is None else init(params))


def commit(pending: Pending) -> None:
    """Keep the new states of an update that was applied, then run the transforms'
    ``after_step`` places in chain order (right after the optimizer step), without
    autograd (they write the parameters)."""
    for held, new in pending.states:
        held.value = new
    if pending.after:
        params, enabled = pending.params, torch.is_grad_enabled()
        try:  # switched off inside the try: an interrupt at any line leaves autograd as it was
            torch.set_grad_enabled(False)
            for transform, held in pending.after:
                assert transform.after_step is not None
                transform.after_step(params, held.value)
        finally:
            torch.set_grad_enabled(enabled)


_META = operator.attrgetter("shape", "dtype", "device")
_NOTHING_APPLIED = ("no update was applied: the gradients were cleared, and the optimizer "
                    "state, the scheduler and the gradient transforms' states are unchanged")


def _check(transform: GradientTransform, grads: list[Tensor], params: list[Tensor],
           versions: list[int], expected: list[tuple[torch.Size, torch.dtype, torch.device]],
           ctx: UpdateContext) -> None:
    """Refuse what ``transform`` left: a parameter written (its version counter moved), or a
    gradient it was handed whose shape, dtype or device is no longer its parameter's (a
    gradient assigned anew, ``p.grad = g``, torch checks itself). Two list comparisons when
    all is well; the culprit is looked for only when one differs."""
    if [p._version for p in params] != versions:
        i = next(i for i, p in enumerate(params) if p._version != versions[i])
        raise GradientTransformError(
            f"the gradient transform {_named(transform)} wrote into the parameter "
            f"{_name_of(ctx, params[i], i)}: update(grads, params, state) edits the gradients "
            "only (the optimizers change the parameters); for a projection or a constraint of "
            "the weights after the optimizer step, give it after_step= instead; "
            f"{_NOTHING_APPLIED}, but its write stays in the parameter: reload the model "
            "(from a checkpoint) before training on")
    found = list(map(_META, grads))  # one C call per tensor
    if found != expected:
        i = next(i for i, (f, e) in enumerate(zip(found, expected)) if f != e)
        (shape, dtype, device), (p_shape, p_dtype, p_device) = found[i], expected[i]
        raise GradientTransformError(
            f"the gradient transform {_named(transform)} left a gradient of shape "
            f"{tuple(shape)}, {dtype} on {device} for the parameter "
            f"{_name_of(ctx, params[i], i)} of shape {tuple(p_shape)}, {p_dtype} on {p_device}: "
            "edit the gradients in place, each keeping its shape, dtype and device "
            f"(g.mul_(...), g.copy_(new)); {_NOTHING_APPLIED}")


def _named(transform: GradientTransform) -> str:
    label = transform.label
    return repr(transform.name) + (f" ({label})" if label and label != transform.name else "")


def _name_of(ctx: UpdateContext, param: Tensor, index: int) -> str:
    for name, p in ctx.state.model.named_parameters():
        if p is param:
            return repr(name)
    return f"number {index} of the optimizers' (not in the model)"
