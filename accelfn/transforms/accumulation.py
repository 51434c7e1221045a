"""with_accumulation: gradient accumulation over micro-batches, exact for any split
(``accelfn.parts.accumulation``)."""

from __future__ import annotations

from ..parts.accumulation import Accumulation, Splitter
from ..step.extension import Transform, builtin

__all__ = ["with_accumulation"]


def with_accumulation(n: int, *, mode: str = "split", dim: int = 0,
                      split: Splitter | None = None, adaptive: bool = False) -> Transform:
    """Equivalent to one optimizer update on the whole batch, computed in ``n`` pieces.

    ``mode="split"`` splits each batch into ``n`` contiguous micro-batches (sizes may differ
    by one) and runs forward and backward on each; the micro-batch losses are weighted by
    their share of the samples, or by the ``"weight"`` the step function returns (e.g. valid
    tokens), so the gradient equals the full-batch gradient. It is this loop, exactly:

        for micro in batch.split(sizes):
            (fn(model, micro) * len(micro) / len(batch)).backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

    Gradients are synchronised across processes only on the last micro-batch.

    The batch is the update's whole batch, not a micro-batch: a ``DataLoader(batch_size=64)``
    with ``with_accumulation(4)`` makes one update per batch, in micro-batches of 16. A loader
    that yields micro-batches (Accelerate's and Fabric's convention) needs ``mode="calls"``.
    A batch with fewer samples than ``n`` (a loader of micro-batches, or an epoch's short
    last batch) is split into one-sample micro-batches, the same update, with a warning
    naming ``mode="calls"`` the first time in the process.

    ``mode="calls"`` is for streaming loaders: each call does forward and backward on its
    batch, and every ``n``-th call applies the update, weighting calls by samples (or
    ``"weight"``). ``step.flush(state)`` applies a short final window with the same
    weighting. Non-update calls return the window's running metrics. A call that fails
    discards the open window (its gradients are cleared).

    ``dim`` is the batch dimension: ``dim=1`` splits time-major ``(time, batch, ...)``
    tensors (a TensorDict with ``batch_size=[bptt, batch]``) along the batch, as truncated
    backpropagation through time needs; samples are counted along it.

    ``split(batch, n)`` replaces the contiguous split (``mode="split"`` only): it returns the
    micro-batches (any number, any sizes, e.g. grouped by sequence length), weighted by their
    samples along ``dim`` (or their ``"weight"``) exactly as the built-in split's.

    ``adaptive=True`` (``mode="split"``): when a micro-batch's forward or
    backward raises ``torch.OutOfMemoryError``, the call is undone (no gradients, no state
    change), the memory released, and the same batch retried with twice as many
    micro-batches, up to one sample each. The count that worked is kept in the TrainState
    (checkpointed, resumed) and used by later calls; metric ``micro_batches`` reports it. The
    update is the same maths whatever the count, so choosing it at run time changes nothing
    but memory: bitwise equal to a run with that count from the start when the micro-batches'
    shares of the batch are powers of two. Under ``distributed`` (DDP) the processes agree
    after every call: one process out of memory makes all of them retry with the same count.
    """
    options = Accumulation(n, mode, dim, split, adaptive)
    return builtin("with_accumulation", options)
