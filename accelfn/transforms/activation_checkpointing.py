"""checkpointed: activation checkpointing per block, optionally selective (op-level)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..core.engine import Prepared, configurable
from ..core.modules import find_blocks, wrap_forward
from ..core.state import TrainState

__all__ = ["checkpointed"]

BlockSpec = str | tuple[type, ...] | type | Callable[[str, nn.Module], bool]

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps ("compute"): recomputing them costs most.
COMPUTE_INTENSIVE_OPS = (
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
)


def _select(model: nn.Module, blocks: BlockSpec) -> list[tuple[str, nn.Module]]:
    if blocks == "auto":
        return find_blocks(model)
    if isinstance(blocks, type):
        blocks = (blocks,)
    if isinstance(blocks, tuple):
        chosen = [(n, m) for n, m in model.named_modules() if n and isinstance(m, blocks)]
    else:
        chosen = [(n, m) for n, m in model.named_modules() if n and blocks(n, m)]
    names = [n for n, _ in chosen]
    return [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o in names if o != n)]


def _policy(save: Iterable[Any]) -> Callable[..., CheckpointPolicy]:
    keep = frozenset(save)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _run_checkpointed(module: nn.Module, forward: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    save = module._accelfn_ckpt_save
    context_fn = (
        (lambda: create_selective_checkpoint_contexts(_policy(save))) if save is not None
        else None
    )
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


class _Checkpointed:
    name = "checkpointed"
    prepare_order = 10

    def __init__(self, blocks: BlockSpec, every: int, save: tuple[Any, ...] | None) -> None:
        self.blocks = blocks
        self.every = every
        self.save = save

    def __repr__(self) -> str:
        blocks = self.blocks if isinstance(self.blocks, str) else "custom"
        parts = [f"blocks={blocks}"]
        if self.every != 1:
            parts.append(f"every={self.every}")
        if self.save is not None:
            parts.append(f"selective={len(self.save)} ops")
        return f"checkpointed({', '.join(parts)})"

    def prepare(self, prepared: Prepared, state: TrainState) -> None:
        chosen = _select(state.model, self.blocks)
        if not chosen:
            raise ValueError(
                f"checkpointed(blocks={self.blocks!r}) found no block to checkpoint in "
                f"{type(state.model).__name__}; pass blocks=(MyBlock,) or a "
                "predicate(name, module)"
            )
        for _, module in chosen[:: self.every]:
            module._accelfn_ckpt_save = self.save
            wrap_forward(module, "checkpoint", _run_checkpointed)
        state.slot(self.name, lambda: {"blocks": len(chosen[:: self.every])})


def _build_checkpointed(
    *,
    blocks: BlockSpec = "auto",
    every: int = 1,
    selective: bool | Iterable[Any] = False,
) -> _Checkpointed:
    """Equivalent to replacing each chosen block's ``forward(x)`` by
    ``torch.utils.checkpoint.checkpoint(block.forward, x, use_reentrant=False)``.

    Activations inside a block are recomputed in the backward pass instead of kept, trading
    one extra forward per block for memory; gradients are identical. ``blocks`` is
    ``"auto"`` (the model's repeated blocks, see :func:`find_blocks`), module types, or a
    ``predicate(name, module)``; ``every=k`` checkpoints every k-th chosen block.
    ``selective=True`` keeps the outputs of compute-intensive ops (matmuls, convolutions,
    attention) and recomputes only the cheap ones; or give the list of ops to keep.
    The wrap keeps parameter names, so ``state_dict`` keys do not change.
    """
    if not (blocks == "auto" or isinstance(blocks, (type, tuple)) or callable(blocks)):
        raise ValueError(
            f"checkpointed(blocks={blocks!r}) is not understood; use 'auto', module types or "
            "a predicate(name, module)"
        )
    if isinstance(blocks, tuple) and not all(isinstance(b, type) for b in blocks):
        raise TypeError("checkpointed(blocks=(...)) takes module classes")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpointed(every={every!r}) must be an int >= 1")
    if selective is True:
        save: tuple[Any, ...] | None = COMPUTE_INTENSIVE_OPS
    elif selective is False:
        save = None
    else:
        save = tuple(selective)
    return _Checkpointed(blocks, every, save)


checkpointed = configurable("checkpointed", _build_checkpointed)
