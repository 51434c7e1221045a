"""Forward and backward of one call's micro-batches: the hot path of every step.

Each micro-batch's loss is weighted by its share of the call's samples (or counted in
samples or the step function's ``"weight"`` when weighted absolutely), scaled for fp16,
and differentiated once; the weighted losses and metrics are collected in [`Sums`][]
for the update. One loop, no call per micro-batch beyond the user's and the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core import compat, units
from ..core import optimizers as optimizers_
from ..core.batch import Batch, batch_size
from ..core.carry import SLOT as CARRY
from ..core.carry import Carries, detached
from ..core.contexts import CallContext, entered
from ..core.outputs import unpack
from ..core.plan import Plan, Sums
from ..parts import activation_checkpointing, float8, precision, sharding
from .spec import Spec

__all__ = ["forward", "forward_and_backward", "without_empty"]

# A ``with`` statement written on one line: its body has no line event of its own, where an
# interrupt (a signal, a tracing injector) would arrive after the manager is entered but
# before the statement protects the body, and never exit it (leaving autocast on for the
# rest of the thread). The interpreter's exit itself runs no line of ours.


def forward(spec: Spec, fn: Callable[..., Any], carries: bool, ctx: CallContext, micro: Batch,
            index: int = 0, carried: dict[int, Any] | None = None) -> Any:
    """``fn(model, micro)`` under autocast, float8's forward context and activation
    checkpointing's scope, run as the model's forward when it is sharded (``Prepared.call``),
    with the carry of a step function that takes one (see accelfn.core.carry). ``model`` is
    the state's own module: its submodules and methods work as through ``model(...)``."""
    managers = [] if spec.precision is None else [precision.autocast(spec.precision, ctx)]
    if spec.float8 is not None:
        managers.append(float8.forward(spec.float8, ctx))
    if spec.checkpointing is not None:
        managers.append(activation_checkpointing.scope(spec.checkpointing, ctx))
    model = ctx.prepared.model
    call = ctx.prepared.call
    if not carries:
        if call is not None:
            with entered(managers): return call(lambda: fn(model, micro))  # noqa: E701
        if not managers:
            return fn(model, micro)
        if len(managers) == 1:  # autocast: no context stack
            with managers[0]: return fn(model, micro)  # noqa: E701  (one line: see above)
        with entered(managers): return fn(model, micro)  # noqa: E701
    mode = "train" if ctx.training else "evaluate"
    carry = ctx.state.slot(CARRY, Carries).get(mode, index, ctx.device)
    if call is None:
        with entered(managers): out = fn(model, micro, carry=carry)  # noqa: E701
    else:
        with entered(managers): out = call(lambda: fn(model, micro, carry=carry))  # noqa: E701
    if not isinstance(out, Mapping) or "carry" not in out:
        raise ValueError("a step function taking 'carry' returns a mapping with 'loss' and "
                         "'carry' (None to carry nothing)")
    assert carried is not None
    rest = {k: v for k, v in out.items() if k != "carry"}
    carried[index] = detached(out["carry"])
    return rest


def without_empty(weight: Tensor, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """``values`` with 0 where ``weight`` is 0 (a micro-batch of padding only, whose loss and
    metrics are often a mean over no token: NaN), so it contributes nothing; on the device."""
    empty = weight == 0
    return {k: torch.where(empty, 0.0, v) for k, v in values.items()}


@functools.lru_cache(maxsize=64)
def _shares(sizes: tuple[int, ...]) -> tuple[float, ...]:
    """Each micro-batch's share of the call's samples (a run sees few splits)."""
    total = sum(sizes)
    return tuple(size / total for size in sizes)


def _coefficients(plan: Plan, absolute: bool) -> Sequence[float | None]:
    """A micro-batch's coefficient unless it returns a weight: its sample count when weighted
    absolutely, its share of the call's samples, nothing when it is alone."""
    micros = plan.micros
    n = len(micros)
    sizes = plan.sizes
    if type(sizes) is tuple and len(sizes) == n and n > 1 and not absolute:
        return _shares(sizes)  # type: ignore[return-value]
    if sizes is None and (n > 1 or absolute):
        sizes = [batch_size(m, plan.dim) for m in micros]
    elif sizes is not None and len(sizes) != n:
        raise ValueError(f"the split's Plan has {n} micro-batches but {len(sizes)} sizes; give "
                         "one size per micro-batch, or leave sizes out")
    if absolute:
        assert sizes is not None
        return [float(size) for size in sizes]
    if n > 1:
        assert sizes is not None
        total = sum(sizes)
        return [size / total for size in sizes]
    return [None]


def forward_and_backward(spec: Spec, fn: Callable[..., Any], carries: bool, ctx: CallContext,
                         plan: Plan, sums: Sums, absolute: bool,
                         carried: dict[int, Any], unsynced: bool = False) -> bool:
    """Forward and backward of every micro-batch of ``plan``, each loss weighted by its share
    (gradients synchronised across processes on the update's last one only; on none when
    ``unsynced``: the update's reduction all-reduces them once); returns whether the
    micro-batches were weighted absolutely (gradients and metrics to be divided by the total
    weight at the update)."""
    micros = plan.micros
    n = len(micros)
    fixed = _coefficients(plan, absolute)
    distributed, amp, float8 = spec.sharding, spec.precision, spec.float8
    scale = precision.scale if amp is not None and amp.scales else None
    # fp16 in the backward (the loss scale's, or DDP's fp16 compression of the gradients):
    # weights counted in a unit, so the objective is about the mean loss (accelfn.core.units)
    in_units = scale is not None or (distributed is not None
                                      and distributed.compression == "fp16")
    plain = not carries and distributed is None and spec.checkpointing is None
    # autocast and nothing else: entered here, without a call
    autocast = amp if plain and float8 is None else None
    direct = plain and amp is None and float8 is None
    model = ctx.prepared.model
    check = sums.empty  # the first micro-batch of a window: check the output
    losses, coefs = sums.loss_terms()
    # this call is the whole window: its plain losses are kept as they are and summed once,
    # without autograd, at the end (one stack and one sum, no detach per micro-batch)
    whole = check and plan.update and n > 1
    pending: list[Tensor] = []
    backward = compat.backward
    inputs = optimizers_.backward_inputs(ctx.state)
    weighted = sums.weighted  # a window of calls keeps one answer across its calls
    coef: Tensor | float | None
    for i, micro in enumerate(micros):
        if direct:
            out = fn(model, micro)
        elif autocast is not None:
            with precision.autocast(autocast, ctx): out = fn(model, micro)  # noqa: E701
        elif distributed is not None:
            sync = plan.update and i == n - 1 and not unsynced
            with sharding.micro(distributed, ctx, i, sync): out = forward(  # noqa: E701
                spec, fn, carries, ctx, micro, i, carried)
        else:
            out = forward(spec, fn, carries, ctx, micro, i, carried)
        metrics = None
        if type(out) is Tensor and not weighted and (  # a loss, as before (or checked here)
                i or not check or (out.dim() == 0 and out.requires_grad)):
            loss, coef = out, fixed[i]
            weighted = False
            if sums.keys:
                _other_metrics(sums.keys, _NO_METRICS)
            sums.keys = _NO_METRICS
        else:
            loss, weight, metrics = unpack(out, first=check and i == 0)
            if weighted is not None and weighted != (weight is not None):
                raise ValueError("the step function returned 'weight' for some "
                                 "micro-batches (or calls) of an update but not others; "
                                 "return it always")
            names = frozenset(metrics) if metrics else _NO_METRICS
            if sums.keys is None:
                sums.keys = names
            elif names != sums.keys:
                _other_metrics(sums.keys, names)
            weighted = weight is not None
            if weight is not None:
                sums.add_weight(weight)
            if weight is not None and (n > 1 or absolute):
                coef = weight.detach().to(torch.float32)
                absolute = True
                # its backward carries a zero gradient into the function where the weight
                # is 0 (0 * NaN would be NaN)
                cleared = without_empty(coef, {"loss": loss, **(metrics or {})})
                loss = cleared.pop("loss")
                metrics = cleared or metrics
            else:
                coef = fixed[i]
        if absolute and in_units and coef is not None:  # see accelfn.core.units
            coef = coef * units.inverse_unit(ctx, coef, n * plan.calls)
        objective = loss if coef is None else loss * coef
        if metrics:
            if pending:  # terms stay in the order of the micro-batches
                losses.extend(p.detach() for p in pending)
                pending.clear()
            whole = False
            sums.add(coef, metrics, {"loss": objective})
        else:
            if whole:
                pending.append(objective)
            else:
                losses.append(objective.detach())
            if coef is not None:
                coefs.append(coef)
        if scale is not None:
            objective = scale(ctx, objective)
        try:
            backward(objective, inputs)
        except RuntimeError as error:
            if "backward through the graph a second time" in str(error):
                raise RuntimeError(
                    "the step function called backward() itself: return the loss instead "
                    "and let the step differentiate it (once, weighted and scaled as the "
                    f"stack needs) ({error})") from error
            raise
    if pending:
        losses.append(compat.sum_unrecorded(pending))
    sums.weighted = weighted
    return absolute


_NO_METRICS: frozenset[str] = frozenset()


def _other_metrics(before: frozenset[str], now: frozenset[str]) -> None:
    """Refuse a micro-batch (or call) whose metrics are not the update's first one's: each
    is a mean over the whole batch, weighted by every micro-batch's share."""
    raise ValueError(
        f"the step function returned the metrics {sorted(now)} for a micro-batch (or call) of "
        f"an update whose first returned {sorted(before)}; each is averaged over the whole "
        "batch, so return the same metrics every time")
