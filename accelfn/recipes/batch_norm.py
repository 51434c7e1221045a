"""untracked_batchnorm: run a model's BatchNorm layers on batch statistics without updating
their running statistics.

    with torch.no_grad(), af.untracked_batchnorm(netG):   # a GAN's extra generator forward
        fake = netG(noise)

A model in training mode normalises with each batch's statistics and folds them into its
running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``). A forward
that should not count (a second forward of the same batch, samples drawn for another model's
update, a probe) changes them all the same; ``model.eval()`` would not, but it normalises with
the running statistics instead. Inside this block each BatchNorm layer that tracks its
statistics has ``track_running_stats = False``, which torch's ``_BatchNorm.forward`` reads:
in training mode it normalises with the batch's statistics and passes no running
statistics to ``F.batch_norm`` (nor counts the batch); in eval mode it still uses the running
statistics, so an eval-mode forward is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["untracked_batchnorm"]

M = TypeVar("M", bound=nn.Module)


@contextlib.contextmanager
def untracked_batchnorm(model: M) -> Iterator[M]:
    """Equivalent to running ``model`` with ``track_running_stats = False`` on each of its
    BatchNorm layers (``nn.BatchNorm1d/2d/3d``, their lazy forms, ``nn.SyncBatchNorm``: every
    ``_BatchNorm``) that tracks statistics, restored when the block ends: in training mode
    they normalise with batch statistics and leave ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` as they were; the forward's outputs and gradients are those of
    the same forward outside the block.

    Restores exactly what it changed, when the block ends, raises or is interrupted: layers
    that track no statistics are not touched. Blocks nest (an inner block over the same
    layers changes and restores nothing). Yields ``model``. Under ``torch.compile`` the
    compiled forward is guarded on the flag (a compiled function that enters the block
    traces it); each setting compiles once.

    Raises (before changing anything):
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an InstanceNorm layer tracks running statistics (it updates them whatever
            the flag says in training mode), or a lazy BatchNorm layer has not run yet (its
            first forward makes its running statistics only when tracking): run the model
            once outside the block first.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"untracked_batchnorm() takes a module, got {type(model).__name__}")
    changed: list[_BatchNorm] = []
    for name, m in model.named_modules():
        if isinstance(m, _InstanceNorm) and m.track_running_stats:
            raise ValueError(
                f"untracked_batchnorm: {name or 'the model'} ({type(m).__name__}) tracks "
                "running statistics, and InstanceNorm updates them in training mode whatever "
                "track_running_stats says: build it with track_running_stats=False (instance "
                "statistics in both modes), or put it in eval mode for the block")
        if isinstance(m, _LazyNormBase) and m.has_uninitialized_params():
            raise ValueError(
                f"untracked_batchnorm: {name or 'the model'} ({type(m).__name__}) has not run "
                "yet, and a lazy BatchNorm makes its running statistics at its first forward "
                "only when it tracks them: run the model once outside the block first")
    try:
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats:
                changed.append(m)  # before the change: an interrupt between restores True
                m.track_running_stats = False
        yield model
    finally:
        for m in changed:
            m.track_running_stats = True
