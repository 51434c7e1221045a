"""with_accumulation: gradient accumulation over micro-batches, exact for any split.

The batch contract: ``mode="split"`` (the default) takes the whole batch of an update and
splits it; loaders that yield micro-batches, one per call, as Accelerate's and Lightning
Fabric's gradient accumulation expects, need ``mode="calls"``. A batch with fewer samples
than the count of micro-batches is the one sign of a loader of micro-batches that a step can
see without reading the loader: it is split into one-sample micro-batches (the same update)
and warned about once per process, naming ``mode="calls"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.batch import Batch, batch_size, check_batch_dim, split_batch, split_checked
from ..core.contexts import CallContext
from ..core.plan import Plan, Sums
from ..step.checks import FINEST_SPLIT
from ..step.extension import Transform
from ..step.spec import Accumulation

__all__ = ["with_accumulation"]

_MODES = ("split", "calls")
_SLOT = "accumulation"


class _Window:
    """State of ``mode='calls'``: calls and running sums of the open window."""

    def __init__(self) -> None:
        self.calls = 0
        self.sums = Sums()

    def close(self) -> Sums:
        sums, self.calls, self.sums = self.sums, 0, Sums()
        return sums

    @property
    def open_calls(self) -> int:
        """Calls of the open window (0 at an update boundary), read by TrainState."""
        return self.calls

    def discard(self) -> None:
        """Forget the open window (TrainState clears its gradients)."""
        self.close()

    def state_dict(self) -> dict[str, Any]:
        if self.calls:
            raise RuntimeError(
                f"an accumulation window is open ({self.calls} call(s) with gradients not yet "
                "applied); call step.flush(state) or save at a window boundary")
        return {"calls": 0}

    def rollback_state_dict(self) -> dict[str, Any]:
        """The open window as it is, for TrainState's rollback copy (not a checkpoint)."""
        return {"calls": self.calls, "sums": self.sums}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        sums = saved.get("sums")  # a rollback copy's open window
        calls = int(saved["calls"])
        if calls and not isinstance(sums, Sums):
            raise ValueError(
                f"the checkpointed accumulation window has {calls} open call(s) but not their "
                "gradients; checkpoints are saved at window boundaries ({'calls': 0})")
        self.calls = calls
        self.sums = sums if isinstance(sums, Sums) else Sums()


class _Count:
    """State of ``adaptive=True``: the micro-batch count that fits (checkpointed)."""

    def __init__(self, n: int) -> None:
        self.count = n
        self.tried = 0  # the batch size the current call is split for (0: none yet)
        self.before: int | None = None  # the count before this call's retries (None: none)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        count = saved["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"the checkpointed micro-batch count is {count!r}, not an int >= 1")
        self.count = count


Splitter = Callable[[Batch, int], Sequence[Batch]]

_warned_small = False  # the small-batch warning is given once per process


def _warn_small_batch(n: int, size: int) -> None:
    """Warn, once per process, that a batch of ``size`` < ``n`` samples was given to
    ``with_accumulation(n)``: a loader of micro-batches wants ``mode="calls"``."""
    global _warned_small
    if _warned_small:
        return
    _warned_small = True
    warnings.warn(
        f"with_accumulation({n}) got a batch of {size} sample(s), fewer than its {n} "
        f"micro-batches: it splits each batch it is given into {n} (mode='split'), one "
        f"update per call, so this batch is one update in {size} micro-batch(es) of one "
        "sample. If the loader yields micro-batches (as with Accelerate's or Fabric's "
        f"gradient accumulation), use with_accumulation({n}, mode='calls'): one update every "
        f"{n} calls. (Warned once.)", UserWarning, stacklevel=6)


def _split_mode(n: int, dim: int, custom: Splitter | None, adaptive: bool) -> Accumulation:
    def split(ctx: CallContext, batch: Batch) -> Plan:
        if adaptive:
            count = ctx.state.slot(_SLOT, lambda: _Count(n))
            count.tried = batch_size(batch, dim)
            parts = min(count.count, count.tried)
            micros, sizes = split_batch(batch, parts, dim, with_sizes=True)
            return Plan(micros, dim=dim, sizes=sizes)
        if custom is not None:
            chosen = custom(batch, n)
            if not isinstance(chosen, Sequence) or not chosen:
                raise ValueError(f"with_accumulation(split=...) returned {type(chosen).__name__}"
                                 "; return a non-empty list of micro-batches")
            return Plan(tuple(chosen), dim=dim)
        if n == 1:
            return Plan((batch,), dim=dim)
        check_batch_dim(batch, dim)
        size = batch_size(batch, dim)  # a shape: no host sync
        if size < n:
            _warn_small_batch(n, size)
        micros, sizes = split_checked(batch, min(n, size), dim)
        return Plan(micros, dim=dim, sizes=sizes)

    def retry(ctx: CallContext, error: BaseException) -> bool:
        """After an out-of-memory error in a forward or backward (the call undone): twice as
        many micro-batches next time, up to one sample each; False when there is no smaller
        split to try."""
        count = ctx.state.get_slot(_SLOT)
        if count is None or not count.tried:
            return False
        if count.count >= count.tried:  # one sample each failed too: the call fails, and
            if count.before is not None:  # the count is the one before it (the finer ones
                count.count, count.before = count.before, None  # never worked)
            setattr(error, FINEST_SPLIT, count.tried)  # what its message says
            return False
        if count.before is None:
            count.before = count.count
        count.count = min(2 * count.count, count.tried)
        return True

    def report(ctx: CallContext) -> dict[str, torch.Tensor]:
        count = ctx.state.get_slot(_SLOT)
        if count is not None:
            count.before = None  # the call worked: its count is kept
        value = n if count is None else min(count.count, count.tried or count.count)
        return {"micro_batches": torch.scalar_tensor(float(value), device=ctx.device)}

    def agreed(ctx: CallContext, value: int | None) -> int:
        """The count in use; ``value`` (the processes' agreed count) replaces it first."""
        count = ctx.state.slot(_SLOT, lambda: _Count(n))
        if value is not None:
            count.count = value
        return int(count.count)

    if adaptive:
        return Accumulation(split, retry=retry, metrics=report, count=agreed)
    return Accumulation(split)


def _calls_mode(n: int, dim: int) -> Accumulation:
    def split(ctx: CallContext, batch: Batch) -> Plan:
        check_batch_dim(batch, dim)
        if not ctx.training:
            return Plan((batch,), absolute=True, dim=dim)
        window = ctx.state.slot(_SLOT, _Window)
        window.calls += 1
        if window.calls >= n:
            return Plan((batch,), update=True, sums=window.close(), absolute=True, dim=dim,
                        calls=n)
        return Plan((batch,), update=False, sums=window.sums, absolute=True, dim=dim, calls=n)

    def flush(ctx: CallContext) -> Sums | None:
        window = ctx.state.slot(_SLOT, _Window)
        return window.close() if window.calls else None

    def abort(ctx: CallContext) -> None:
        window = ctx.state.get_slot(_SLOT)
        if window is not None:
            window.close()  # a failed call discards the open window

    return Accumulation(split, flush=flush, abort=abort)


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
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"with_accumulation(n) takes the number of micro-batches as an int, got {n!r}; "
            "write with_accumulation(4)(my_step)")
    if n < 1:
        raise ValueError(f"with_accumulation(n) needs n >= 1, got {n}")
    if mode not in _MODES:
        raise ValueError(f"with_accumulation(mode={mode!r}) is unknown; use one of {_MODES}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"with_accumulation(dim={dim!r}) must be an int >= 0 (the batch "
                         "dimension: 0, or 1 for time-major batches)")
    if split is not None and (mode != "split" or not callable(split)):
        raise ValueError("with_accumulation(split=...) takes a function split(batch, n) -> "
                         "micro-batches, with mode='split'")
    if not isinstance(adaptive, bool):
        raise TypeError(f"with_accumulation(adaptive={adaptive!r}) takes True or False")
    if adaptive and (mode != "split" or split is not None):
        raise ValueError("with_accumulation(adaptive=True) chooses the count of the built-in "
                         "split: use it with mode='split' and without split=")
    label = f"with_accumulation({n}{', calls' if mode == 'calls' else ''}" \
            f"{f', dim={dim}' if dim else ''}{', split' if split is not None else ''}" \
            f"{', adaptive' if adaptive else ''})"
    part = _split_mode(n, dim, split, adaptive) if mode == "split" else _calls_mode(n, dim)
    return Transform("with_accumulation", part,
                     options=(("n", n), ("mode", mode), ("dim", dim), ("split", split),
                              ("adaptive", adaptive)), label=label)
