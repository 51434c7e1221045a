"""with_accumulation: gradient accumulation over micro-batches, exact for any split."""

from __future__ import annotations

from collections.abc import Callable

from ..core.engine import LossFn, Step, apply_transform

__all__ = ["with_accumulation"]

_MODES = ("split", "calls")


class _Accumulation:
    name = "with_accumulation"

    def __init__(self, n: int, mode: str) -> None:
        self.accumulation = (n, mode)  # read by the step engine, which owns the micro-loop

    def __repr__(self) -> str:
        n, mode = self.accumulation
        return f"with_accumulation({n})" if mode == "split" else f"with_accumulation({n}, calls)"


def with_accumulation(n: int, *, mode: str = "split") -> Callable[[LossFn | Step], Step]:
    """Equivalent to one optimizer update on the whole batch, computed in ``n`` pieces.

    ``mode="split"`` splits each batch into ``n`` contiguous micro-batches (sizes may differ
    by one) and runs forward and backward on each; the micro-batch losses are weighted by
    their share of the samples, or by the ``"weight"`` the step function returns (e.g. valid
    tokens), so the gradient equals the full-batch gradient. It is the seeds' loop written
    exactly::

        for micro in batch.split(sizes):
            (fn(model, micro) * len(micro) / len(batch)).backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

    Gradients are synchronised across processes only on the last micro-batch.

    ``mode="calls"`` is for streaming loaders: each call does forward and backward on its
    batch, and every ``n``-th call applies the update, weighting calls by samples (or
    ``"weight"``). ``step.flush(state)`` applies a short final window with the same
    weighting. Non-update calls return the window's running metrics.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"with_accumulation(n) takes the number of micro-batches as an int, got {n!r}; "
            "write with_accumulation(4)(my_step)"
        )
    if n < 1:
        raise ValueError(f"with_accumulation(n) needs n >= 1, got {n}")
    if mode not in _MODES:
        raise ValueError(f"with_accumulation(mode={mode!r}) is unknown; use one of {_MODES}")
    transform = _Accumulation(n, mode)
    return lambda fn: apply_transform(fn, transform)
