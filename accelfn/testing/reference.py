"""The plain PyTorch update every accelfn step is checked against: one optimizer update
written the way a competent user writes it by hand, importing nothing from accelfn (a test
checks it), so that it cannot share a mistake with what it checks.

    for micro-batch in split(batch):
        with autocast: loss = loss_fn(model, micro)
        (scaler.scale(loss * share) if fp16 else loss * share).backward()
    divide by the token total (token-weighted) -> scaler.unscale_ -> edit_grads
    -> clip_grad_norm_ / clip_grad_value_ -> (scaler.)step -> zero_grad -> scheduler.step
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["chunks", "full_batch_grads", "plain_update"]

LossFn = Callable[[nn.Module, Any], Any]


def chunks(batch: Mapping[str, Tensor], parts: int) -> list[dict[str, Tensor]]:
    """``batch`` split into ``parts`` contiguous pieces along its first dimension, the first
    ones larger by one (``torch.tensor_split``'s sizes)."""
    n = len(next(iter(batch.values())))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append({k: v[start:start + size] for k, v in batch.items()})
        start += size
    return out


def _loss(out: Any) -> Tensor:
    loss: Tensor = out["loss"] if isinstance(out, Mapping) else out
    return loss


def plain_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, Tensor],
                 loss_fn: LossFn, *, micro: int = 1, amp_dtype: torch.dtype | None = None,
                 scaler: torch.amp.GradScaler | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, max_value: float | None = None,
                 scheduler: Any = None, token_weighted: bool = False,
                 edit_grads: Callable[[nn.Module], None] | None = None,
                 record: dict[str, Any] | None = None) -> Tensor:
    """One update of the plain loop; returns the detached loss (of the last micro-batch).

    ``micro`` micro-batches (:func:`chunks`), each loss weighted by its share of the samples,
    or by its returned ``"weight"`` with ``token_weighted`` (the gradients divided by the
    total); ``amp_dtype`` autocasts the forward on the model's device type; ``scaler`` scales
    the losses (fp16); ``edit_grads(model)`` edits the unscaled gradients; ``max_norm`` /
    ``max_value`` clip them; ``scheduler`` steps after the optimizer. ``record``, when given,
    receives each micro-batch's detached loss (``"losses"``) and the clip's total norm
    (``"grad_norm"``, None without ``max_norm``)."""
    total = len(next(iter(batch.values())))
    pieces: list[Any] = chunks(batch, micro) if micro > 1 else [batch]
    device = next((p.device.type for p in model.parameters()), "cpu")
    weights: list[Tensor] = []
    losses: list[Tensor] = []
    for piece in pieces:
        autocast = (torch.autocast(device, dtype=amp_dtype) if amp_dtype is not None
                    else contextlib.nullcontext())
        with autocast:
            out = loss_fn(model, piece)
        loss = _loss(out)
        losses.append(loss.detach())
        if token_weighted and micro > 1:
            weight = out["weight"].detach().float()
            weights.append(weight)
            loss = loss * weight
        elif micro > 1:
            loss = loss * (len(next(iter(piece.values()))) / total)
        if scaler is not None:
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]
    if token_weighted and micro > 1:
        total_weight = torch.stack(weights).sum()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(total_weight)
    if scaler is not None:
        scaler.unscale_(optimizer)
    if edit_grads is not None:
        edit_grads(model)
    grad_norm = None
    if max_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    if max_value is not None:
        torch.nn.utils.clip_grad_value_(model.parameters(), max_value)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    if record is not None:
        record.update(losses=losses, grad_norm=grad_norm)
    return losses[-1]


def full_batch_grads(model: nn.Module, batch: Mapping[str, Tensor],
                     loss_fn: LossFn) -> list[Tensor]:
    """The gradients of the whole batch's loss in one backward (what accumulation must give),
    the model's gradients left cleared."""
    model.zero_grad(set_to_none=True)
    _loss(loss_fn(model, batch)).backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads
