"""linear_cross_entropy: the cross-entropy of a linear head without its logits in memory.

    def lm_step(model, batch):
        hidden = model.body(batch["tokens"])                  # (B, T, D), the head not applied
        loss, tokens = af.linear_cross_entropy(hidden, model.head.weight, batch["targets"],
                                               return_count=True)
        return {"loss": loss, "weight": tokens}

A language model's logits are ``tokens x vocabulary``: 8k tokens over a 128k vocabulary are
2 GiB in bf16, often more than the rest of the step's activations, and the plain
``F.cross_entropy(hidden @ weight.T, targets)`` keeps more than that at once (the logits,
their float32 log-softmax, then its gradient). Here the tokens are cut into chunks; each
chunk's logits are made, turned into the chunk's loss and its gradients with respect to
``hidden`` and ``weight``, and dropped, all in the forward. The backward only scales the
gradients kept.

Built on torch's own op where it gives the same: torch 2.14's
``F.linear_cross_entropy(hidden, weight, targets, options=LinearCrossEntropyOptions(...))``
(its chunked path) computes the loss of a float32 or float64 head outside autocast, and
accelfn adds only the count of counted tokens (``return_count``, the ``"weight"`` a step
returns) and the ``chunks`` spelling (``batch_chunk_size``).

Why the chunked path below is still written here: torch's op does not fit a step under
``with_amp``, nor take a z-loss. It ignores autocast (its matmuls run in the inputs' dtype:
float32 for a float32 head, without bf16's speed or memory), and given bf16 inputs it
returns the loss in bf16: on a 2048-token, 4000-class head, 3.0e-2 from float64, where the
plain computation under bf16 autocast is 4.0e-5 from it (measured on torch 2.14.1). This
path follows autocast as ``F.linear`` does (matmuls in the autocast dtype, softmax and loss in
float32), returns a float32 loss and adds PaLM's z-loss (it needs each token's logsumexp,
which torch's op does not give). It also serves torch < 2.14, and DTensor heads (tensor
parallelism), which torch's custom op has no sharding rule for.
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["linear_cross_entropy"]

Reduction = Literal["mean", "sum"]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss of valid rows and, computed chunk by chunk in the forward, its
    gradients (kept until the backward scales them by the incoming gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor,
                valid: Tensor, rows: int, z_loss: float, compute: torch.dtype,
                need_hidden: bool, need_weight: bool) -> Tensor:
        acc = torch.promote_types(compute, torch.float32)  # softmax, loss, weight gradient
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            grad_hidden = (torch.empty(hidden.shape, dtype=compute, device=hidden.device)
                           if need_hidden else None)
            grad_weight = (torch.zeros(weight.shape, dtype=acc, device=weight.device)
                           if need_weight else None)
            total = torch.zeros((), dtype=acc, device=hidden.device)
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start:start + rows].to(compute)
                t = targets[start:start + rows].unsqueeze(1)
                v = valid[start:start + rows]
                # the chunk's logits: the only tensor of a chunk's logits' size alive in
                # float32 (in a lower compute dtype, its mm output too, for the cast)
                logits = torch.mm(h, w.t()).to(acc)
                picked = logits.gather(1, t).squeeze(1)
                top = logits.amax(1, keepdim=True)
                logits.sub_(top).exp_()
                norm = logits.sum(1, keepdim=True)
                lse = (top + norm.log()).squeeze(1)
                per = lse - picked
                if z_loss:
                    per = per + z_loss * lse.square()
                total = total + torch.where(v, per, 0.0).sum()
                if grad_hidden is None and grad_weight is None:
                    del logits
                    continue
                # d(per)/d(logits) = softmax * (1 + 2 z lse) - onehot(target), zero if ignored
                scale = (1.0 + 2.0 * z_loss * lse) / norm.squeeze(1) if z_loss \
                    else norm.squeeze(1).reciprocal()
                logits.mul_(torch.where(v, scale, 0.0).unsqueeze(1))
                logits.scatter_add_(1, t, v.to(logits.dtype).neg().unsqueeze(1))
                g = logits.to(compute)
                del logits
                if grad_hidden is not None:
                    grad_hidden[start:start + rows] = torch.mm(g, w)
                if grad_weight is not None:
                    if compute == acc:
                        grad_weight.addmm_(g.t(), h)
                    else:
                        grad_weight.add_(torch.mm(g.t(), h))
                del g  # before the next chunk's logits exist
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = grad_total.to(torch.promote_types(grad_total.dtype, torch.float32))
        gh = None if grad_hidden is None else (grad_hidden.to(scale.dtype) * scale).to(
            hidden_dtype)
        gw = None if grad_weight is None else (grad_weight * scale).to(weight_dtype)
        return gh, gw, None, None, None, None, None, None, None


def _torch_computes(hidden: Tensor, weight: Tensor) -> bool:
    """Whether torch's ``F.linear_cross_entropy`` gives this module's result here: it exists
    (torch >= 2.14), autocast is off, the inputs are plain float32 or float64 tensors of one
    dtype (not DTensors)."""
    if getattr(torch.nn, "LinearCrossEntropyOptions", None) is None \
            or not hasattr(F, "linear_cross_entropy"):
        return False
    if torch.is_autocast_enabled(hidden.device.type):
        return False
    plain = all(type(t) in (Tensor, torch.nn.Parameter) for t in (hidden, weight))
    return plain and hidden.dtype == weight.dtype and hidden.dtype in (torch.float32,
                                                                        torch.float64)


def _torch_op(hidden: Tensor, weight: Tensor, labels: Tensor, chunks: int | None, n: int,
              ignore_index: int) -> Tensor:
    """The summed loss by torch's chunked ``F.linear_cross_entropy``: its own chunk size
    (``chunking_method="auto"``) for ``chunks=None``, else ``ceil(n / chunks)`` rows a chunk;
    ``allow_retain_graph`` as this module's backward (it can run twice)."""
    options_type: Any = torch.nn.LinearCrossEntropyOptions
    if chunks is None:
        options = options_type(allow_retain_graph=True)
    else:
        options = options_type(allow_retain_graph=True, chunking_method=None,
                               batch_chunk_size=max(1, -(-n // max(1, min(chunks, n)))))
    total: Tensor = F.linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index,
                                           reduction="sum", options=options)
    return total


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, chunks: int | None,
           reduction: str, z_loss: float) -> None:
    if not all(isinstance(x, Tensor) for x in (hidden, weight, targets)):
        raise TypeError("linear_cross_entropy(hidden, weight, targets) takes three tensors")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight "
            f"{tuple(weight.shape)} do not match; weight is (classes, features) as an "
            "nn.Linear's (model.head.weight), hidden (..., features)")
    if targets.shape != hidden.shape[:-1] or targets.dtype.is_floating_point \
            or targets.dtype == torch.bool:
        raise ValueError(
            f"linear_cross_entropy: targets must be class indices of shape "
            f"{tuple(hidden.shape[:-1])} (hidden's without its last dimension), got "
            f"{targets.dtype} {tuple(targets.shape)}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < 1):
        raise ValueError(f"linear_cross_entropy(chunks={chunks!r}) takes None (automatic) or "
                         "an int >= 1: the number of pieces the tokens are cut into")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy(reduction={reduction!r}) takes 'mean' or "
                         "'sum'; a per-token loss would hold a value per token, and its "
                         "backward the logits again")
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) \
            or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"linear_cross_entropy(z_loss={z_loss!r}) takes a float >= 0 "
                         "(e.g. 1e-4)")


@overload
def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                         chunks: int | None = None, ignore_index: int = -100,
                         reduction: Reduction = "mean", z_loss: float = 0.0,
                         return_count: Literal[False] = False) -> Tensor: ...
@overload
def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                         chunks: int | None = None, ignore_index: int = -100,
                         reduction: Reduction = "mean", z_loss: float = 0.0,
                         return_count: Literal[True]) -> tuple[Tensor, Tensor]: ...
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunks: int | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    z_loss: float = 0.0,
    return_count: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Equivalent to ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=...,
    reduction=...)``, without the logits in memory: at most one chunk of them at a time.

    Value and gradients (of ``hidden`` and ``weight``) equal the plain computation's within
    float32 rounding, and under bf16 autocast within the plain computation's own distance
    from float32 (the matmuls run in the autocast dtype, as ``F.linear``'s, the softmax and
    the loss in float32). The gradients are made in the forward, one chunk at a time, and
    kept (``hidden``'s and ``weight``'s size) until the backward scales them; the backward
    can run twice (``retain_graph``), not to a second order. A weight shared with an
    embedding (tied) gets both gradients, summed. Works under [`compiled`][accelfn.compiled]
    and ``torch.compile``.

    Args:
        hidden: the inputs of the head, ``(..., features)`` (e.g. ``(batch, time, d)``).
        weight: the head's weight, ``(classes, features)`` (an ``nn.Linear``'s, or the
            embedding's when tied); a bias is not supported.
        targets: class indices of shape ``hidden.shape[:-1]``.
        chunks: how many pieces the tokens are cut into. ``None``: ``classes / features``
            rounded up, so that a chunk's logits are about the size of ``hidden``
            (at most one piece per token).
        ignore_index: the target value that marks a token as padding: no loss, no gradient,
            not counted.
        reduction: ``"mean"`` over the counted tokens, or ``"sum"``. Over no counted token
            (all padding) the mean is 0 with a zero gradient, where ``F.cross_entropy``'s is
            NaN: a micro-batch of padding then adds nothing to a token-weighted update.
        z_loss: PaLM's z-loss coefficient: adds ``z_loss * logsumexp(logits)**2`` for each
            counted token, averaged (or summed) as the loss, which keeps the softmax's
            normaliser near one.
        return_count: also return the number of counted tokens.

    Returns:
        The loss (a float32 scalar tensor, float64 for float64 inputs); with
        ``return_count=True``, ``(loss, tokens)``, ``tokens`` the number of targets other than
        ``ignore_index`` (an int64 scalar on the device, no host sync): return
        ``{"loss": loss, "weight": tokens}`` from the step so that
        [`with_accumulation`][accelfn.with_accumulation] and
        [`distributed`][accelfn.distributed] weight each micro-batch and process by its
        tokens, which makes the update the same as one over the whole batch.

    Raises:
        ValueError: shapes that do not fit, or an option out of range.
    """
    _check(hidden, weight, targets, chunks, reduction, z_loss)
    features = weight.shape[1]
    flat = hidden.reshape(-1, features)
    labels = targets.reshape(-1)
    n = flat.shape[0]
    chosen = chunks
    if chunks is None:
        chunks = -(-weight.shape[0] // max(features, 1))
    rows = max(1, -(-n // max(1, min(chunks, n))))
    kind = hidden.device.type
    compute = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
               else torch.promote_types(hidden.dtype, weight.dtype))
    valid = labels != ignore_index
    if not z_loss and _torch_computes(flat, weight):
        total = _torch_op(flat, weight, labels.long(), chosen, n, ignore_index)
        count = valid.sum()
        loss = total / count.clamp(min=1) if reduction == "mean" else total  # as below
        return (loss, count) if return_count else loss
    grad = torch.is_grad_enabled()
    total = _ChunkedLinearCrossEntropy.apply(
        flat, weight, torch.where(valid, labels, 0), valid, rows, float(z_loss), compute,
        grad and flat.requires_grad, grad and weight.requires_grad)
    count = valid.sum()
    # count 0: total is 0, and 0 / 1 keeps the backward finite (0 / 0 would make it NaN)
    loss = total / count.clamp(min=1) if reduction == "mean" else total
    return (loss, count) if return_count else loss
