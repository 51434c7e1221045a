"""Gradient accumulation over micro-batches, exact for any split: ``with_accumulation``'s
options and its calls in the update (the split of a call into micro-batches; with
``mode="calls"`` the window of calls and its flush; with ``adaptive=True`` the retry with a
finer split after an out-of-memory error and the count the processes agree on).

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
from dataclasses import dataclass
from typing import Any

import torch

from ..core.batch import Batch, batch_size, check_batch_dim, split_batch, split_checked
from ..core.contexts import CallContext
from ..core.plan import Plan, Sums
from ..core.state import TrainState

__all__ = ["FINEST_SPLIT", "Accumulation", "abort", "count", "flush", "metrics", "retry",
           "split"]

#: The attribute an out-of-memory error gets from ``with_accumulation(adaptive=True)`` once
#: it failed at one sample per micro-batch: the number of micro-batches of that last split.
FINEST_SPLIT = "accelfn_finest_split"
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
        f"{n} calls. Under distributed(strategy='fsdp'/'hsdp') or static_graph=True every "
        "process must run as many micro-batches: one given fewer rows than the others waits "
        "in a collective they never reach. (Warned once.)", UserWarning, stacklevel=6)



@dataclass(frozen=True, slots=True, repr=False)
class Accumulation:
    """``with_accumulation``'s options: ``n`` micro-batches (or calls, ``mode="calls"``),
    the batch dimension ``dim``, a custom ``split(batch, n)``, and ``adaptive`` (the count
    found at run time)."""

    n: int
    mode: str = "split"
    dim: int = 0
    split: Splitter | None = None
    adaptive: bool = False

    def __post_init__(self) -> None:
        n, mode, dim, custom, adaptive = self.n, self.mode, self.dim, self.split, self.adaptive
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
        if custom is not None and (mode != "split" or not callable(custom)):
            raise ValueError("with_accumulation(split=...) takes a function split(batch, n) -> "
                             "micro-batches, with mode='split'")
        if not isinstance(adaptive, bool):
            raise TypeError(f"with_accumulation(adaptive={adaptive!r}) takes True or False")
        if adaptive and (mode != "split" or custom is not None):
            raise ValueError("with_accumulation(adaptive=True) chooses the count of the "
                             "built-in split: use it with mode='split' and without split=")

    def __repr__(self) -> str:
        return (f"with_accumulation({self.n}{', calls' if self.mode == 'calls' else ''}"
                f"{f', dim={self.dim}' if self.dim else ''}"
                f"{', split' if self.split is not None else ''}"
                f"{', adaptive' if self.adaptive else ''})")


def split(options: Accumulation, ctx: CallContext, batch: Batch) -> Plan:
    """The plan of a call: its micro-batches, and whether it ends with an update."""
    n, dim = options.n, options.dim
    if options.mode == "calls":
        check_batch_dim(batch, dim)
        if not ctx.training:
            return Plan((batch,), absolute=True, dim=dim)
        window = ctx.state.slot(_SLOT, _Window)
        window.calls += 1
        if window.calls >= n:
            return Plan((batch,), update=True, sums=window.close(), absolute=True, dim=dim,
                        calls=n)
        return Plan((batch,), update=False, sums=window.sums, absolute=True, dim=dim, calls=n)
    if options.adaptive:
        counted = ctx.state.slot(_SLOT, lambda: _Count(n))
        counted.tried = batch_size(batch, dim)
        pieces = min(counted.count, counted.tried)
        micros, sizes = split_batch(batch, pieces, dim, with_sizes=True)
        return Plan(micros, dim=dim, sizes=sizes)
    if options.split is not None:
        chosen = options.split(batch, n)
        if not isinstance(chosen, Sequence) or not chosen:
            raise ValueError(f"with_accumulation(split=...) returned {type(chosen).__name__}"
                             "; return a non-empty list of micro-batches")
        empty = [i for i, micro in enumerate(chosen) if batch_size(micro, dim) == 0]
        if empty:  # a mean over no sample is NaN: the update would be skipped as non-finite
            raise ValueError(f"with_accumulation(split=...) returned empty micro-batches (at "
                             f"{empty}); leave them out of the list it returns")
        return Plan(tuple(chosen), dim=dim)
    if n == 1:
        return Plan((batch,), dim=dim)
    check_batch_dim(batch, dim)
    size = batch_size(batch, dim)  # a shape: no host sync
    if size < n:
        _warn_small_batch(n, size)
    micros, sizes = split_checked(batch, min(n, size), dim)
    return Plan(micros, dim=dim, sizes=sizes)


def flush(options: Accumulation, ctx: CallContext) -> Sums | None:
    """``mode="calls"``: the sums of the open window, closed (None: no window is open)."""
    if options.mode != "calls":
        return None
    window = ctx.state.slot(_SLOT, _Window)
    return window.close() if window.calls else None


def refuse_open_window(state: TrainState) -> None:
    """Refuse a call of a step that does not count calls while a ``mode="calls"`` window is
    open on ``state``: it would clear the window's gradients while the window still counts
    their call (its update would then apply part of its batches). Before anything changes."""
    window = state.get_slot(_SLOT)
    if type(window) is _Window and window.calls:
        raise RuntimeError(
            f"an accumulation window is open on this TrainState ({window.calls} call(s) of "
            "with_accumulation(n, mode='calls') with gradients not yet applied), and this "
            "step would clear them: call flush(state) on the accumulating step first (it "
            "applies the open window), or call this step at a window boundary")


def abort(options: Accumulation, ctx: CallContext) -> None:
    """After a failed call: ``mode="calls"`` discards the open window."""
    if options.mode != "calls":
        return
    window = ctx.state.get_slot(_SLOT)
    if window is not None:
        window.close()


def retry(options: Accumulation, ctx: CallContext, error: BaseException) -> bool:
    """After an out-of-memory error in a forward or backward (the call undone), whether to
    run the call again: ``adaptive`` doubles the micro-batches, up to one sample each; False
    when there is no smaller split to try (or the count is fixed)."""
    if not options.adaptive:
        return False
    counted = ctx.state.get_slot(_SLOT)
    if counted is None or not counted.tried:
        return False
    if counted.count >= counted.tried:  # one sample each failed too: the call fails, and
        if counted.before is not None:  # the count is the one before it (the finer ones
            counted.count, counted.before = counted.before, None  # never worked)
        setattr(error, FINEST_SPLIT, counted.tried)  # what its message says
        return False
    if counted.before is None:
        counted.before = counted.count
    counted.count = min(2 * counted.count, counted.tried)
    return True


def metrics(options: Accumulation, ctx: CallContext) -> dict[str, torch.Tensor]:
    """What an update reports: ``adaptive``'s count in use (metric ``micro_batches``)."""
    if not options.adaptive:
        return {}
    counted = ctx.state.get_slot(_SLOT)
    if counted is not None:
        counted.before = None  # the call worked: its count is kept
    n = options.n
    value = n if counted is None else min(counted.count, counted.tried or counted.count)
    return {"micro_batches": torch.scalar_tensor(float(value), device=ctx.device)}


def count(options: Accumulation, ctx: CallContext, agreed: int | None) -> int:
    """``adaptive``: the count in use; ``agreed`` (the processes' agreed count) replaces it
    first."""
    counted = ctx.state.slot(_SLOT, lambda: _Count(options.n))
    if agreed is not None:
        counted.count = agreed
    return int(counted.count)
