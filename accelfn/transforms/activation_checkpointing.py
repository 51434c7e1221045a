"""checkpointed: activation checkpointing per block, optionally selective (op-level), or
activation offload to the host (``accelfn.parts.activation_checkpointing``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, overload

from ..parts.activation_checkpointing import BlockSpec, Checkpointing, Offload, saved_ops
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["checkpointed"]


@overload
def checkpointed(fn: LossFn | Step, /) -> Step: ...
@overload
def checkpointed(*, blocks: BlockSpec = "auto", every: int = 1,
                 selective: bool | Iterable[Any] = False,
                 offload: Offload | None = None) -> Transform: ...
def checkpointed(
    fn: LossFn | Step | None = None,
    /,
    *,
    blocks: BlockSpec = "auto",
    every: int = 1,
    selective: bool | Iterable[Any] = False,
    offload: Offload | None = None,
) -> Step | Transform:
    """Equivalent to replacing each chosen block's ``forward(x)`` by
    ``torch.utils.checkpoint.checkpoint(block.forward, x, use_reentrant=False)``.

    Activations inside a block are recomputed in the backward pass instead of kept, trading
    one extra forward per block for memory; gradients are identical. ``blocks`` is
    ``"auto"`` (the model's repeated blocks, see [`find_blocks`][]), module types, or a
    ``predicate(name, module)``; ``every=k`` checkpoints every k-th chosen block.
    ``selective=True`` keeps the outputs of compute-intensive ops (matmuls, convolutions,
    attention) and recomputes only the cheap ones; or give the list of ops to keep.
    The wrap keeps parameter names, so ``state_dict`` keys do not change. Running statistics
    (BatchNorm ``running_mean``/``running_var``/``num_batches_tracked``) update once per
    forward, as without checkpointing: the recompute's second update is undone.

    ``offload="cpu"`` instead runs each chosen block under
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: the activations the block saves
    for the backward are copied to (pinned) host memory and back, not recomputed, so each
    block's forward runs once and the results are the plain model's bitwise; parameters (and
    views of them) are saved as they are, on the device.
    It costs two host-device copies of the blocks' activations per step instead of one extra
    forward. With ``every=k`` every k-th block is offloaded and the others keep their
    activations; ``selective`` (what a recompute keeps) does not combine with it.
    """
    options = Checkpointing(blocks, every, saved_ops(selective), offload)
    return configure("checkpointed", fn, builtin("checkpointed", options))
