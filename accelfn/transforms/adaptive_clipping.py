"""adaptive_clipping: unit-wise adaptive gradient clipping (AGC, the NFNets paper), as timm's
``timm.utils.agc.adaptive_clip_grad``, as a gradient transform.

    step = af.adaptive_clipping(0.01, skip=model.head)(my_step)           # timm --clip-mode agc
    step = af.with_clipping(max_norm=1.0)(af.chain(af.adaptive_clipping(0.01), other)(my_step))

A gradient transform of the chain ([`accelfn.chain`][]) rather than a built-in: it edits the
gradients of each update where the user's transforms do (after unscaling, micro-batch weighting
and the reduction across processes, before ``with_clipping`` and the non-finite decision), in
the order it is stacked among them. It keeps no state. It lives here, with the transforms,
because it is one (a [`Transform`][accelfn.Transform] value); recipes may not import the step.

timm's rule, per parameter ``p`` with gradient ``g`` (``unitwise_norm``: the norm over every
dimension but the first for ``p.ndim > 1``, one norm per output unit; the whole tensor's for
``p.ndim <= 1``)::

    max_norm = unitwise_norm(p).clamp_(min=eps).mul_(clip_factor)
    grad_norm = unitwise_norm(g)
    g <- where(grad_norm < max_norm, g, g * (max_norm / grad_norm.clamp(min=1e-6)))

Written here as one multiplication per gradient by a factor that is 1 where a unit is under its
limit (``g * 1`` is ``g``, bitwise); the norms of the parameters of one dtype and device are
joined into one vector, so the limits and factors take a handful of kernels for the whole
model, whatever its size. No value is read on the host.

Under FSDP2 the gradients and parameters are this process' shards (DTensors, ``Shard(0)``):
the same operations run on the DTensors, one parameter at a time. A row of a row-sharded
weight lies whole on one process, so its norm is this process' (bitwise the unsharded one);
the norm of a sharded bias or gain is reduced across the processes by DTensor (exact, rounded
differently from one process' norm). Tensor-parallel shardings reduce the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import compat
from ..step.extension import Transform

__all__ = ["adaptive_clipping"]

#: what ``skip=`` takes: a module, several, or a rule on each parameter
Skip = nn.Module | Iterable[nn.Module] | Callable[[Tensor], bool] | None


def adaptive_clipping(clip_factor: float = 0.01, *, eps: float = 1e-3, norm_type: float = 2.0,
                      skip: Skip = None) -> Transform:
    """Equivalent to timm's ``adaptive_clip_grad(params, clip_factor, eps, norm_type)``
    before ``optimizer.step()`` (bitwise on the CPU; on a GPU the fused norm of the biases
    and gains may round differently from timm's one at a time): each output unit's gradient
    (a row of a weight along its first dimension; a whole bias or gain) is scaled down to
    ``clip_factor * max(its weight's norm, eps)`` where it is longer.

    Every parameter the optimizers update is clipped but those ``skip`` leaves out: the
    NFNets paper leaves the final classifier unclipped, which timm's ``train.py`` does with
    ``--clip-mode agc`` (``model_parameters(model, exclude_head=True)``: all but the last two
    parameters). ``skip`` is a module or several (``skip=model.head``, ``skip=[model.fc]``:
    their parameters, read at each update, so FSDP2's sharded parameters are followed), or a
    rule on a parameter (``skip=lambda p: p.shape[:1] == (classes,)``: what the host knows;
    no device value may be read). A transform that skips modules belongs to their model: a
    state whose parameters include none of theirs is refused.

    Args:
        clip_factor: the largest ratio of a unit's gradient norm to its weight norm (the
            paper: 0.01 for large batches, larger for small ones; timm's ``--clip-grad``).
        eps: the least weight norm, so that units initialised at zero can move.
        norm_type: the norm's order (timm's ``norm_type``; ``math.inf`` for the largest
            absolute value).
        skip: what is left unclipped (see above); None clips every parameter.

    Returns:
        A gradient transform: apply it (``adaptive_clipping(0.01)(fn)``) or chain it
        (``af.chain(adaptive_clipping(0.01), ...)``). Its name is ``agc``, its label
        ``agc(0.01)`` (``agc(0.01, eps=0.0001, norm_type=1, skip)`` with other options).
    """
    for name, value in (("clip_factor", clip_factor), ("eps", eps), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or (math.isinf(value) and name != "norm_type"):
            raise ValueError(f"adaptive_clipping({name}={value!r}): give a positive number "
                             f"(timm's defaults: clip_factor=0.01, eps=1e-3, norm_type=2.0)")
    chosen = _chooser(skip)
    factor, least, order = float(clip_factor), float(eps), float(norm_type)

    def update(grads: list[Tensor], params: list[Tensor], state: Any) -> None:
        if chosen is not None:
            kept = chosen(params)
            grads = [g for g, keep in zip(grads, kept) if keep]
            params = [p for p, keep in zip(params, kept) if keep]
        _clip(grads, params, factor, least, order)

    options = [f"{factor:g}"]
    options += [] if least == 1e-3 else [f"eps={least:g}"]
    options += [] if order == 2.0 else [f"norm_type={order:g}"]
    options += [] if skip is None else ["skip"]
    return Transform("agc", update=update, label=f"agc({', '.join(options)})")


def _chooser(skip: Skip) -> Callable[[list[Tensor]], list[bool]] | None:
    """What ``skip`` keeps of an update's parameters, one bool per parameter; None: all."""
    if skip is None:
        return None
    if isinstance(skip, nn.Module):
        skip = [skip]
    names = ("names need the model: write the module itself (skip=model.head.fc for "
             "\"head.fc\")")
    if callable(skip) and not isinstance(skip, (str, Tensor)):
        rule = skip

        def by_rule(params: list[Tensor]) -> list[bool]:
            return [not rule(p) for p in params]

        return by_rule
    if isinstance(skip, (str, Tensor)) or not isinstance(skip, Iterable):
        raise TypeError(f"adaptive_clipping(skip={skip!r}): give the modules to leave "
                        "unclipped (skip=model.head, skip=[model.fc]) or a rule on a parameter "
                        f"(skip=lambda p: p.shape[:1] == (classes,)); {names}")
    modules = list(skip)
    wrong = [m for m in modules if not isinstance(m, nn.Module)]
    if wrong or not modules:
        raise TypeError(f"adaptive_clipping(skip=...) takes modules (or one rule on a "
                        f"parameter), got {wrong[0] if wrong else 'an empty collection'!r}"
                        + (f"; {names}" if wrong and isinstance(wrong[0], str) else ""))

    def by_module(params: list[Tensor]) -> list[bool]:
        left_out = {id(p) for m in modules for p in m.parameters() if p.requires_grad}
        kept = [id(p) not in left_out for p in params]
        if all(kept) and left_out and params:
            raise ValueError(
                "adaptive_clipping(skip=...): none of the skipped modules' parameters has a "
                "gradient in this update. The transform belongs to another model (skip= holds "
                "that model's modules: build one per model), or they took no part in this "
                "loss; a rule on the parameter (skip=lambda p: ...) serves any model")
        return kept

    return by_module


def _unitwise_norm(x: Tensor, norm_type: float) -> Tensor:
    """timm's ``unitwise_norm``: the whole tensor's norm for ``ndim <= 1``; else one per
    slice along the first dimension, kept broadcastable (``keepdim``)."""
    dims = None if x.ndim <= 1 else tuple(range(1, x.ndim))
    norm: Tensor = torch.linalg.vector_norm(x, norm_type, dim=dims, keepdim=x.ndim > 1)
    return norm


def _clip(grads: list[Tensor], params: list[Tensor], clip_factor: float, eps: float,
          norm_type: float) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        if _is_dtensor(g) or _is_dtensor(params[i]):
            _clip_one(g, params[i].detach(), clip_factor, eps, norm_type)
        else:
            groups.setdefault((g.device, g.dtype), []).append(i)
    with torch.no_grad():
        for members in groups.values():
            _clip_group([grads[i] for i in members], [params[i].detach() for i in members],
                        clip_factor, eps, norm_type)


def _clip_group(grads: list[Tensor], params: list[Tensor], clip_factor: float, eps: float,
                norm_type: float) -> None:
    """timm's rule for plain tensors of one dtype and device: the unit norms joined into one
    vector, the limits and factors computed once, one multiplication per gradient."""
    flat = [i for i, p in enumerate(params) if p.ndim <= 1]
    whole = dict(zip(flat, zip(compat.foreach_norm([params[i] for i in flat], norm_type),
                               compat.foreach_norm([grads[i] for i in flat], norm_type)))
                 ) if flat else {}  # whole-tensor norms: one fused call for each list
    pairs = [whole[i] if i in whole else (_unitwise_norm(p, norm_type),
                                          _unitwise_norm(grads[i], norm_type))
             for i, p in enumerate(params)]
    weights, norms = [w for w, _ in pairs], [n for _, n in pairs]
    limit = torch.cat([w.reshape(-1) for w in weights]).clamp_(min=eps).mul_(clip_factor)
    norm = torch.cat([n.reshape(-1) for n in norms])
    factor = (limit / norm.clamp(min=1e-6)).masked_fill_(norm < limit, 1.0)
    for g, f, n in zip(grads, factor.split_with_sizes([n.numel() for n in norms]), norms):
        g.mul_(f.view(n.shape))  # a factor per unit, broadcast over its row


def _clip_one(g: Tensor, p: Tensor, clip_factor: float, eps: float, norm_type: float) -> None:
    """timm's rule for one parameter as it is (a DTensor: no operation in place on a norm
    that DTensor may still have to reduce across processes)."""
    with torch.no_grad():
        limit = _unitwise_norm(p, norm_type).clamp(min=eps) * clip_factor
        norm = _unitwise_norm(g, norm_type)
        g.mul_((limit / norm.clamp(min=1e-6)).masked_fill(norm < limit, 1.0))


def _is_dtensor(t: Tensor) -> bool:
    return callable(getattr(t, "to_local", None))
