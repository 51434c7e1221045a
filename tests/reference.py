"""Hand-written PyTorch training loops, as the seeds write them. Imports nothing from accelfn.

Each function performs ONE optimizer update the plain way; tests compare accelfn's steps
against them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def chunks(batch: dict, parts: int) -> list[dict]:
    """Split a dict batch into ``parts`` contiguous pieces, the first ones larger by one."""
    n = len(next(iter(batch.values())))
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append({k: v[start:start + size] for k, v in batch.items()})
        start += size
    return out


def reference_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict,
    loss_fn,
    *,
    micro: int = 1,
    amp_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    max_value: float | None = None,
    scheduler=None,
    token_weighted: bool = False,
) -> dict:
    """One update: autocast forward, (scaled) backward per micro-batch, unscale, clip, step."""
    total = len(next(iter(batch.values())))
    pieces = chunks(batch, micro) if micro > 1 else [batch]
    weights = []
    losses = []
    for piece in pieces:
        ctx = (torch.autocast("cpu", dtype=amp_dtype) if amp_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            out = loss_fn(model, piece)
        loss = out["loss"] if isinstance(out, dict) else out
        losses.append(loss.detach())
        if token_weighted and micro > 1:
            w = out["weight"].detach().float()
            weights.append(w)
            loss = loss * w
        elif micro > 1:
            loss = loss * (len(next(iter(piece.values()))) / total)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
    if token_weighted and micro > 1:
        total_w = sum(weights)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(total_w)
    grad_norm = None
    if scaler is not None:
        scaler.unscale_(optimizer)
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
    return {"losses": losses, "grad_norm": grad_norm}


def full_batch_grads(model: nn.Module, batch: dict, loss_fn) -> list[torch.Tensor]:
    """Gradients of the whole batch's loss, in one backward (the accumulation target)."""
    model.zero_grad(set_to_none=True)
    out = loss_fn(model, batch)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads
