"""The captured update: the engine's sequence for an update recorded once and replayed.

    refuse a batch of other shapes; copy the batch into the recording's memory
    warm-up calls, eager (the first with host reads refused), then once: record
    part 1, recorded:   plan = split(batch) -> forward and backward of each micro-batch
                        -> divide -> clip -> the decision's flags
    host:               settle the previous update's decision (its schedulers step)
    part 2, recorded:   the rates -> optimizer step unless flagged -> gradients cleared
    each call:          replay part 1 -> settle -> replay part 2
    host, every call:   defer the flags -> schedulers -> step += 1 -> after the update
                        (EMA, compile cache) -> the metrics, copied out

The device work is the engine's own (``micro``, ``clipping.clip``, ``nonfinite``'s flags,
``optimizers.step_unless``), for the updates it can record (``check``); the host work is
what ``accelfn.step.engine`` does after a device-side decision. A recording is kept per
state and step, and made again when what it holds fixed changed (``capture.fingerprint``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from ..core import compat
from ..core import optimizers as optimizers_
from ..core.batch import Batch
from ..core.contexts import CallContext, UpdateContext
from ..core.plan import Plan, Sums
from ..core.state import TrainState
from ..parts import accumulation, capture, clipping, compilation, nonfinite
from ..parts.capture import Recorder
from . import checks, micro
from .spec import Spec

if TYPE_CHECKING:
    from .engine import Step

__all__ = ["call", "check"]

_SCALAR = torch.Size([])
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check(spec: Spec, carries: bool) -> None:
    """Refuse, when the step is built, what a replay cannot reproduce (its reason and fix)."""
    options = spec.capture
    assert options is not None
    why = None
    acc, amp, compiling = spec.accumulation, spec.precision, spec.compilation
    if spec.sharding is not None:
        why = ("runs in one process: a distributed update's collectives and DDP/FSDP hooks "
               "run Python each update; leave out distributed() or captured()")
    elif amp is not None and amp.scales:
        why = ("does not record fp16's loss scaling (its scale is updated on the host); use "
               "with_amp(dtype=torch.bfloat16), which needs none")
    elif spec.float8 is not None:
        why = "does not record with_float8's scaling yet; leave out with_float8 or captured()"
    elif spec.checkpointing is not None:
        why = ("does not record activation checkpointing: a recompute saves and restores the "
               "random number generator's state on the host; leave out checkpointed()")
    elif acc is not None and (acc.mode == "calls" or acc.adaptive or acc.split is not None):
        why = ("records a fixed split of each batch: with_accumulation(n) without "
               "mode='calls', adaptive=True or split= (they decide on the host each call)")
    elif spec.gradients:
        why = ("does not record gradient transforms: their Python (state, decisions) would run "
               "at the recording only; apply them with with_clipping/with_nonfinite or leave "
               "captured() out")
    elif carries:
        why = "does not record a step function's carry (kept on the host between calls)"
    elif spec.nonfinite is not None and spec.nonfinite.policy == "raise":
        why = ("skips a non-finite update on the device; with_nonfinite(policy='raise') "
               "decides on the host: use policy='skip' or 'off'")
    elif compiling is not None and (compiling.mode or "") in _CUDA_GRAPH_MODES:
        why = (f"records the whole update, and compiled(mode={compiling.mode!r}) records CUDA "
               "graphs of its own inside it; use compiled() or "
               "compiled(mode='max-autotune-no-cudagraphs')")
    elif compiling is not None and options.warmup < 2:
        why = ("needs warmup >= 2 with compiled(): the first warm-up call runs eager (it looks "
               "for host reads), the second compiles; use captured(warmup=3)")
    if why is not None:
        raise ValueError(f"captured() {why}")


class _Recording:
    """One recording of a step's update on a state: the recorder, the calls warmed up, the
    batch's signature and its static copy, and the outputs each replay rewrites."""

    __slots__ = ("batch", "fingerprint", "metrics", "recorder", "restarts", "signature", "spec",
                 "warm")

    def __init__(self, recorder: Recorder, spec: Spec) -> None:
        self.recorder = recorder
        amp = spec.precision  # autocast's weight cache would outlive a recording's forward:
        self.spec = spec if amp is None or not amp.cache else dataclasses.replace(  # off
            spec, precision=dataclasses.replace(amp, cache=False))
        self.warm = 0
        self.signature: tuple[Any, ...] | None = None
        self.fingerprint: tuple[Any, ...] | None = None
        self.batch: Batch | None = None
        self.metrics: dict[str, Tensor] | None = None
        self.restarts = 0  # warm-ups begun again, in a row, before anything was recorded


# per state, per step (a step dropped takes its recording with it, its graphs' memory too)
_RECORDINGS: weakref.WeakKeyDictionary[
    TrainState, weakref.WeakKeyDictionary[Step, _Recording]] = weakref.WeakKeyDictionary()


def _signature(batch: Batch) -> tuple[Any, ...]:
    items = (batch.items(include_nested=True, leaves_only=True)
             if isinstance(batch, TensorDictBase) else batch.items())
    return tuple((key, tuple(v.shape), v.dtype, v.device) for key, v in items)


def _copy_in(static: Batch, batch: Batch) -> None:
    if isinstance(static, TensorDictBase):
        static.update_(batch)
        return
    for key, value in batch.items():
        static[key].copy_(value)


def _static(batch: Batch) -> Batch:
    if isinstance(batch, TensorDictBase):
        return batch.clone()
    return {key: value.clone() for key, value in batch.items()}


def _described(signature: tuple[Any, ...]) -> str:
    return ", ".join(f"{key}: {list(shape)} {str(dtype).replace('torch.', '')}"
                     for key, shape, dtype, _ in signature)


def call(step: Step, ctx: CallContext, batch: Batch) -> TensorDict:
    """One call of a captured step (see the module's sequence)."""
    options = step.spec.capture
    assert options is not None
    state = ctx.state
    recordings = _RECORDINGS.get(state)
    if recordings is None:
        recordings = _RECORDINGS[state] = weakref.WeakKeyDictionary()
    rec = recordings.get(step)
    signature = _signature(batch)
    if rec is not None and rec.signature != signature:
        raise ValueError(
            f"captured(): this batch ({_described(signature)}) differs from the one the update "
            f"is recorded for ({_described(rec.signature or ())}); a recorded update replays "
            "fixed shapes. Give every batch the same shapes (drop_last=True, sequences padded "
            "or packed to one length), or leave captured() out")
    capture.prepare_optimizers(state)  # again: load_state_dict puts back float rates
    printed = capture.fingerprint(state)
    if rec is None or rec.fingerprint != printed:  # new, or what it held fixed changed
        factory = options.recorder or capture.CudaGraphs
        restarts = 0 if rec is None or rec.metrics is not None else rec.restarts + 1
        if restarts == 2 and rec is not None and rec.fingerprint is not None:
            _warn_unstable(state, capture.changed(rec.fingerprint, printed))
        rec = recordings[step] = _Recording(factory(ctx.device), step.spec)
        rec.signature, rec.fingerprint, rec.restarts = signature, printed, restarts
        # the memory every call reads its batch from, the warm-up calls' too: compiled code
        # is compiled for the tensors it is recorded with (a clone's strides may differ)
        rec.batch = _static(batch)
    else:
        _copy_in(rec.batch, batch)
    if rec.warm < options.warmup:
        uctx, metrics = _eager(step, rec, ctx)
        rec.warm += 1
        return _finish(step, uctx, metrics, copy=False)
    if rec.metrics is None:
        _record(step, rec, ctx)
    assert rec.metrics is not None
    # gradients something else left are not this update's (as the eager step's new window)
    optimizers_.clear_grads(state.optimizers)
    rec.recorder.replay(0)  # the gradients and the flags
    _settle(ctx)  # the previous update's decision, while the device computes this one's
    rec.recorder.replay(1)  # the optimizer steps unless flagged
    # no reference to the state is kept with the recording: the state's memory goes with it
    return _finish(step, UpdateContext(state, ctx.prepared, rec.metrics["loss"]), rec.metrics,
                   copy=True)


def _warn_unstable(state: TrainState, names: list[str]) -> None:
    state.warn_once("captured.unstable", (
        f"captured(): the update is never recorded: {', '.join(names)} changed at each of "
        "the last calls, and a recording holds it fixed, so every call begins the eager "
        "warm-up again (slower than the eager step). Change it in place (a rate tensor's "
        "fill_, as torch's schedulers do; OneCycleLR(cycle_momentum=False)), or leave "
        "captured() out"))


def _settle(ctx: CallContext) -> None:
    """Settle the previous update's deferred decision (its schedulers step, and this
    update's optimizer step reads their rates), as the eager step does before its own."""
    ctx.state.slot(nonfinite.SLOT, nonfinite.Guard).settle(ctx.state)  # none pending: nothing


def _record(step: Step, rec: _Recording, ctx: CallContext) -> None:
    """Record the update in two parts replayed in turn (the gradients and flags; the
    optimizer steps), between which the host settles the previous update's decision; a
    failure applies nothing and drops the recording."""
    static = rec.batch
    try:
        uctx, metrics = rec.recorder.record(lambda: _gradients(step, rec.spec, ctx, static))
        rec.recorder.record(lambda: _apply(ctx, uctx, metrics))
        rec.metrics = metrics
    except BaseException as error:
        step._abort(ctx)  # the engine's undo: no gradient, no decision deferred
        del _RECORDINGS[ctx.state][step]
        if isinstance(error, Exception):
            raise RuntimeError(f"captured(): the update could not be recorded ({error}); it "
                               "was not applied") from error
        raise


def _eager(step: Step, rec: _Recording, ctx: CallContext
           ) -> tuple[UpdateContext, dict[str, Tensor]]:
    """A warm-up call: the recorded work run eagerly, on the recorder's warm-up stream (the
    first with host reads refused until its optimizer step); a failure leaves no gradient
    and applies nothing."""
    try:
        with rec.recorder.warming():
            if rec.warm == 0:
                with capture.host_reads_refused(ctx.device):
                    uctx, metrics = _gradients(step, rec.spec, ctx, rec.batch)
            else:
                uctx, metrics = _gradients(step, rec.spec, ctx, rec.batch)
            _settle(ctx)
            with capture.uncaptured_steps():
                _apply(ctx, uctx, metrics)
        return uctx, metrics
    except BaseException:
        step._abort(ctx)  # the engine's undo: no gradient, no decision deferred
        raise


def _gradients(step: Step, spec: Spec, ctx: CallContext, batch: Batch
               ) -> tuple[UpdateContext, dict[str, Tensor]]:
    """Forward and backward of the micro-batches, the gradients divided and clipped, the
    decision's flags: as ``Step._forward_backward`` and ``Step._sequence`` compute them
    (``spec``: the step's, autocast's cache off)."""
    state = ctx.state
    # gradients something else left are not this update's, and a recorded backward must
    # make its own in the recording's memory rather than add into tensors freed later
    optimizers_.clear_grads(state.optimizers)
    acc = spec.accumulation
    plan = Plan((batch,)) if acc is None else accumulation.split(acc, ctx, batch)
    sums = Sums()
    compiling = spec.compilation
    with (compilation.watching(compiling, state) if compiling is not None
          else contextlib.nullcontext()):
        absolute = micro.forward_and_backward(spec, step.fn, False, ctx, plan, sums,
                                              plan.absolute, {})
    metrics = sums.result(divide=absolute)
    returned = sums.returned_weight()
    if returned is not None:
        metrics["weight"] = returned
    uctx = UpdateContext(state, ctx.prepared, metrics["loss"])
    if absolute:
        # a number is filled on the device: a copy from the host's memory would not record
        weight = sums.weight
        divisor = (weight.to(torch.float32) if isinstance(weight, Tensor)
                   else torch.full((), float(weight), device=ctx.device))  # type: ignore[arg-type]
        grads = uctx.local_grads()
        if grads:
            compat.foreach_div_(grads, divisor)
    norm = clipping.clip(spec.clipping, uctx) if spec.clipping is not None else None
    flags = nonfinite.device_flags(step._guard, uctx, norm)
    if flags is not None:
        metrics["flags"] = flags
    return uctx, metrics


def _apply(ctx: CallContext, uctx: UpdateContext, metrics: dict[str, Tensor]) -> None:
    """The optimizer steps, skipped on the device when the flags say so; gradients cleared;
    the metrics the update's parts added (``grad_norm``) last, as the eager step's."""
    optimizers = ctx.state.optimizers
    optimizers_.rate_metrics(metrics, optimizers, ctx.device)  # the rates it steps with
    flags = metrics.get("flags")
    if flags is None:
        ctx.prepared.optimizer_step()
    else:
        skip = flags.any()
        optimizers_.step_unless(ctx.prepared.optimizer_step, optimizers, skip)
        metrics["skipped"] = skip.float()
    optimizers_.clear_grads(optimizers)
    metrics.update(uctx.metrics)


def _finish(step: Step, uctx: UpdateContext, outputs: Mapping[str, Tensor], copy: bool
            ) -> TensorDict:
    """The host work after the device's: the decision deferred, the schedulers, the update
    counted, what runs after it, the metrics (copied out of a recording's memory)."""
    state, guard = uctx.state, step._guard
    flags = outputs.get("flags")
    counted = False
    try:
        if flags is not None:  # read at the next call, after the next replay rewrote them:
            # a copy (on CUDA the guard's own copy to host memory, queued before that replay)
            kept = flags.clone() if copy and not flags.is_cuda else flags
            state.slot(nonfinite.SLOT, nonfinite.Guard).defer(kept, state.step, guard)
        nonfinite.schedule(guard, state, None if flags is not None else False)
        state.step += 1; counted = True  # noqa: E702  (one line: counted as it counts)
        metrics = {k: v.clone() if copy else v for k, v in outputs.items() if k != "flags"}
        after = step._after
        if after:
            skipped = (outputs["skipped"].bool() if flags is not None and not guard.advance
                       else torch.zeros((), dtype=torch.bool, device=uctx.device))
            for update in after:
                update(uctx, skipped)
    except BaseException as error:  # the update was applied: it counts, as in the engine
        if not counted:
            state.step += 1
        error.add_note(checks.after_update_failed(state.step, None if flags is not None
                                                  else False))
        raise
    return compat.tensordict_unchecked(metrics, _SCALAR, None)  # type: ignore[no-any-return]
