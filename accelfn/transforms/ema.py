"""with_ema: an exponential moving average of the weights, updated after every real update
(``accelfn.parts.averaging``).

    step = af.with_ema(decay=0.999)(my_step)
    with af.ema_weights(state):                   # evaluate with the averaged weights
        val = step.evaluate(state, val_batch)
"""

from __future__ import annotations

from typing import overload

from ..parts.averaging import Averaging, DecayFn, ema_state_dict, ema_weights
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["ema_state_dict", "ema_weights", "with_ema"]


@overload
def with_ema(fn: LossFn | Step, /) -> Step: ...
@overload
def with_ema(*, decay: float | DecayFn = 0.999, every: int = 1, warmup: bool | str = False,
             buffers: str = "average", updates_per_epoch: int | None = None,
             warmup_epochs: int = 0, adjust: float | None = None,
             formula: str = "lerp", warmup_gamma: float = 1.0,
             warmup_power: float = 2 / 3) -> Transform: ...
def with_ema(
    fn: LossFn | Step | None = None,
    /,
    *,
    decay: float | DecayFn = 0.999,
    every: int = 1,
    warmup: bool | str = False,
    buffers: str = "average",
    updates_per_epoch: int | None = None,
    warmup_epochs: int = 0,
    adjust: float | None = None,
    formula: str = "lerp",
    warmup_gamma: float = 1.0,
    warmup_power: float = 2 / 3,
) -> Step | Transform:
    """Equivalent to ``ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
    use_buffers=True)`` and ``ema.update_parameters(model)`` after every real optimizer update.

    ``ema = decay * ema + (1 - decay) * weights``, the first update copying the weights
    (``torch.optim.swa_utils``' rule). Updates skipped by the non-finite guard (or by AMP
    overflow) leave the average and its counters untouched; the choice is made on the
    device. ``every=k`` averages after every ``k``-th real update only. ``warmup=True`` uses
    ``min(decay, (1 + n) / (10 + n))`` for the ``n``-th average (TensorFlow's
    ``ExponentialMovingAverage(num_updates=...)``), so early averages forget the
    initialisation faster. Buffers (BatchNorm statistics) are averaged like the weights
    (``buffers="average"``) or used as the model has them (``buffers="copy"``, i.e.
    ``use_buffers=False``). Averaged, every tensor of ``AveragedModel.module.state_dict()``
    is reproduced bitwise, integer buffers included: ``num_batches_tracked`` is averaged in
    floating point and truncated back to an integer, as ``AveragedModel`` does (BatchNorm
    reads it only with ``momentum=None``). ``buffers="average_floats"`` averages the
    floating-point buffers and copies the others (``num_batches_tracked`` is then the
    model's), as timm's ``ModelEmaV3`` does.

    timm's ``ModelEmaV3`` (its ``update(model, step=num_updates)`` after each update, with
    ``num_updates`` counting updates from 1) is these options:

    - ``warmup="power"``: the decay of the average after the update of 0-based index ``s``
      (``state.step - 1``: updates attempted before it, skipped ones included) is
      ``min(decay, 1 - (1 + s / warmup_gamma) ** -warmup_power)``, computed on the host in
      double precision as timm's ``get_decay(s + 1)`` (``use_warmup=True``; ``warmup_gamma``
      and ``warmup_power`` are its own, default 1 and 2/3); ``s = 0`` gives 0, a copy.
    - ``decay=<function>``: ``decay(updates)`` gives the decay of the average after update
      number ``updates`` (1 for the first, ``state.step``: timm's ``num_updates``), a Python
      number in [0, 1]; e.g. ``decay=lambda n: timm_ema.get_decay(n)``. Not with ``warmup``
      or ``adjust``.
    - ``buffers="average_floats"`` (timm's default) or ``"copy"`` (``exclude_buffers=True``:
      the EMA evaluates with the model's buffers, which timm copies at each update).

    A host decay becomes the ``lerp`` weight ``1 - decay`` rounded to float32, as torch
    rounds timm's Python scalar ``weight=1. - decay``: the average equals timm's bitwise.
    Unlike timm, an update skipped by AMP overflow or the non-finite guard is not averaged
    (timm averages the unchanged weights), though it is counted. The first average always
    copies the weights (timm's ``get_decay`` gives 0 there too).

    torchvision's classification recipe (``--model-ema``) is these options:

    - ``updates_per_epoch=len(loader)``: ``every`` counts within the epoch, whose updates
      are ``state.step`` (updates attempted) in blocks of ``updates_per_epoch``; the updates
      ``i = 0, every, 2 * every, ...`` of each epoch average (``i % model_ema_steps == 0``).
      A skipped update keeps its place and is not averaged.
    - ``warmup_epochs=w`` (needs ``updates_per_epoch``): an average during the first ``w``
      epochs copies the weights, and so does the first one after (``n_averaged.fill_(0)``).
    - ``adjust=a``: the decay used is ``1 - min(1, (1 - decay) * a)``; torchvision's is
      ``a = world_size * batch_size * model_ema_steps / epochs``.
    - ``formula="weighted_sum"``: ``decay * ema + (1 - decay) * weights`` as written (its
      ``ExponentialMovingAverage``: other roundings than ``lerp``), every buffer averaged,
      integer ones (``num_batches_tracked``) truncated back to integers as ``copy_`` does.

    Evaluate with [`ema_weights`][] (or ``step.evaluate(..., weights="ema")``); export with
    [`ema_state_dict`][]. Memory: one copy of the weights on their device. State: slot
    ``with_ema``.
    """
    options = Averaging(decay, every, warmup, buffers, updates_per_epoch, warmup_epochs,
                        adjust, formula, warmup_gamma, warmup_power)
    return configure("with_ema", fn, builtin("with_ema", options))
