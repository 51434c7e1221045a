"""captured: the whole update recorded once as CUDA graphs and replayed at each call
(``accelfn.parts.capture``; the sequence in ``accelfn.step.captured``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch

from ..parts.capture import Capture, Recorder
from ..step.engine import LossFn, Step
from ..step.extension import Transform, builtin, configure

__all__ = ["captured"]


@overload
def captured(fn: LossFn | Step, /) -> Step: ...
@overload
def captured(*, warmup: int = 3,
             recorder: Callable[[torch.device], Recorder] | None = None) -> Transform: ...
def captured(
    fn: LossFn | Step | None = None,
    /,
    *,
    warmup: int = 3,
    recorder: Callable[[torch.device], Recorder] | None = None,
) -> Step | Transform:
    """Equivalent to PyTorch's whole-network capture: after ``warmup`` eager updates on a
    side stream, ``with torch.cuda.graph(g):`` around one update (forward and backward of
    every micro-batch, clipping, the non-finite check, ``optimizer.step()``), then
    ``static_batch.copy_(batch); g.replay()`` at each call.

    One launch replaces the update's hundreds of kernel launches: the speed-up of a model
    too small to keep the GPU busy. The result equals the eager step's (the same kernels on
    the same memory); what the host does each update (the schedulers, the step count, the
    skip decision read one update later, the EMA, the metrics) still runs each call. The
    learning rates become tensors on the device, which schedulers fill in place. A
    recording is made again, after ``warmup`` eager calls, when what it holds fixed
    changed: the optimizer's state or hyperparameters (``load_state_dict``, a changed
    ``weight_decay``), or where the parameters live.

    Refused, with the reason: a batch of other shapes than the first (pad, pack or
    ``drop_last=True``); a host read in the step function (``.item()``, ``bool(t)``,
    boolean-mask indexing, ``.cpu()``), stopped where it happens in the first call;
    optimizers that are neither fused nor capturable (and, when the update is checked for
    NaN/Inf, not fused); and, when the step is built: ``distributed``, fp16 loss scaling,
    ``with_float8``, ``checkpointed``, gradient transforms, a carry, accumulation that
    decides on the host (``mode="calls"``, ``adaptive``, ``split=``),
    ``with_nonfinite(policy="raise")`` and ``compiled(mode="reduce-overhead")``.

    ``recorder`` replaces CUDA graphs: ``accelfn.testing.TapeRecorder`` records the update's
    operators and replays them on the CPU, as a graph would, for tests without a GPU.
    """
    return configure("captured", fn, builtin("captured", Capture(warmup, recorder)))
