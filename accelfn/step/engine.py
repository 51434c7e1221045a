"""The step: a pure user function lifted into exactly one optimizer update, written once.

Whatever order the transforms were stacked in, one call runs this sequence, and nothing
else; each built-in fills its one place in it (``accelfn.step.spec``) with its options, and
the engine calls its functions by name (``accelfn.parts``: ``clipping.clip(options, ctx)``);
the user's gradient transforms run in the order they were stacked:

    prepare once per TrainState: float8 -> fp32 islands -> activation checkpointing
                                 -> shard (DDP/FSDP) -> compile -> EMA copies
    plan = split(batch)                                 (accumulation; default: one)
    for each micro-batch:                               (no gradient sync but on the last)
        out = fn(model, micro)                          (autocast)
        backward(scale(coefficient * loss))             (coefficients weight exactly)
    unscale -> reduce -> divide by the weight -> gradient transforms -> clip -> decide
    optimizer.step() for each optimizer unless skipped -> zero_grad -> scheduler.step()
    after the update: loss-scale update, float8 scales, EMA, compile cache

A call that fails at any line leaves no gradients and no half-applied state (``_abort``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from ..core import compat
from ..core import optimizers as optimizers_
from ..core.batch import Batch, batch_size, check_batch
from ..core.carry import SLOT as CARRY
from ..core.carry import Carries, takes_carry
from ..core.contexts import CallContext, Prepared, UpdateContext, entered, held
from ..core.modules import evaluating
from ..core.outputs import unpack
from ..core.plan import Plan, Sums
from ..core.state import TrainState
from ..parts import (
    accumulation,
    activation_checkpointing,
    averaging,
    clipping,
    compilation,
    float8,
    nonfinite,
    precision,
    sharding,
)
from ..parts.clipping import Clipping
from ..parts.nonfinite import Decision, NonFinite, NonFiniteError
from ..parts.sharding import Sharding
from . import agreement, captured, chain, checks, micro
from .extension import Chained, GradientTransform, Transform
from .spec import Spec, spec_of

__all__ = ["LossFn", "NonFiniteError", "Step", "apply_transform", "describe", "lift"]

LossFn = Callable[..., "Tensor | Mapping[str, Tensor]"]  # fn(model, batch[, carry])
_DEFAULT_GUARD = NonFinite()  # every update decides
_UNCOMMITTED = Decision(True)  # an update the replica groups did not commit: skipped
_SCALAR = torch.Size([])
_NOTHING = contextlib.nullcontext()
_FIXED = frozenset({"fn", "transforms", "spec", "_key", "_after", "_guard", "_outside_windows",
                    "_carry"})
_PREPARING = ("float8", "precision", "checkpointing", "sharding", "compilation", "averaging")


class Step:
    """A training step: ``step(state, batch)`` runs exactly one optimizer update.

    Equivalent to the plain PyTorch loop body:

        out = fn(model, batch); loss = out if tensor else out["loss"]
        loss.backward()
        if the loss and all gradients are finite: optimizer.step(); scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    for every optimizer of the state, with each transform of the stack adding its part at
    its place (see [`accelfn.step.engine`][]), and returns a TensorDict of detached metrics
    left on the device. A step is a value: it holds the function and the transforms only;
    everything a call changes lives in the [`TrainState`][].
    """

    def __init__(self, fn: LossFn, transforms: tuple[Transform, ...] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"a step needs a callable fn(model, batch), got {type(fn).__name__}")
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"{t!r} is not a transform: extend the update with "
                                "accelfn.Transform(name, update=...)")
        self.fn = fn
        self.transforms = transforms
        self.spec: Spec = spec_of(transforms, lambda: describe(self))
        # what prepares the state: steps whose preparing transforms are equal share it
        self._key = tuple(t for t in transforms if any(
            getattr(self.spec, place) is t.part for place in _PREPARING))
        self._after = tuple(self.spec.after_update)
        self._guard = self.spec.nonfinite or _DEFAULT_GUARD
        # a step that does not count calls clears gradients a calls window holds: refused
        self._outside_windows = self.spec.accumulation is None or \
            self.spec.accumulation.mode != "calls"
        self._carry = takes_carry(fn)
        if self.spec.capture is not None:  # what a replay cannot reproduce: refused now
            captured.check(self.spec, self._carry)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIXED and hasattr(self, "_carry"):
            raise AttributeError(f"a step is immutable: build a new one instead of setting {name}")
        object.__setattr__(self, name, value)

    def with_transform(self, transform: Transform | GradientTransform) -> Step:
        """A new step with ``transform`` added on the outside of this one."""
        if isinstance(transform, GradientTransform):
            transform = transform.transform()
        if not isinstance(transform, Transform):
            raise TypeError(
                f"{transform!r} is not a transform: extend the update with "
                "accelfn.Transform(name, update=...) (see docs/writing-a-transform.md)")
        if isinstance(transform.part, Chained):  # its members, as stacking them one by one
            return transform(self)
        return Step(self.fn, (*self.transforms, transform))

    def __repr__(self) -> str:
        return describe(self)

    # ----------------------------------------------------------------- preparation
    def prepare(self, state: TrainState) -> Prepared:
        """Prepare ``state`` for this step (done once per state, lazily, by the first call).

        The preparation is kept in the state and shared by every step whose preparing
        transforms are equal. A step that prepares differently gets its own preparation of
        the same model, unless the two disagree on sharding (DDP/FSDP wrap the model once).
        """
        checks.check_state(state)
        key = self._key
        for done_key, prepared, text in state.preparations:
            if done_key is key or done_key == key:
                return prepared  # type: ignore[no-any-return]
            if _sharding(done_key) != _sharding(key):
                raise ValueError(
                    f"this TrainState was prepared by {text}, which shards the model "
                    f"differently from {describe(self)}; a model is sharded once. Use the "
                    "same distributed(...) in every step of a state, or build a new TrainState")
        spec = self.spec
        for check in spec.checks:  # every refusal before anything changes
            check(state)
        optimizers = state.optimizers
        prepared = Prepared(model=state.model, optimizer_step=optimizers_.stepper(optimizers),
                            device=state.device)
        # the canonical order: each wraps what the one before it made
        if spec.float8 is not None:
            prepared = float8.convert(spec.float8, prepared, state)
        if spec.precision is not None:
            prepared = precision.islands(spec.precision, prepared, state)
        if spec.checkpointing is not None:
            prepared = activation_checkpointing.wrap(spec.checkpointing, prepared, state)
        if spec.sharding is not None:
            prepared = sharding.shard(spec.sharding, prepared, state)
        if spec.compilation is not None:
            prepared = compilation.compile(spec.compilation, prepared, state)
        if spec.averaging is not None:
            prepared = averaging.average(spec.averaging, prepared, state)
        skips = all(compat.step_supports_amp_scaling(o) and all(
            group.get("fused") for group in o.param_groups) for o in optimizers)
        prepared = dataclasses.replace(prepared, skips_on_device=skips,
                                       parameters=tuple(state.model.parameters()),
                                       held=held(optimizers))
        checks.check_optimizer_holds_trainable(state)
        state.add_preparation(key, prepared, describe(self))
        return prepared

    # ----------------------------------------------------------------- the update
    def _plan(self, ctx: CallContext, batch: Batch) -> Plan:
        options = self.spec.accumulation
        if options is None:
            return Plan((batch,))
        return accumulation.split(options, ctx, batch)

    def __call__(self, state: TrainState, batch: Batch) -> TensorDict:
        check_batch(batch)
        ctx = CallContext(state, self.prepare(state))
        if self._outside_windows:
            accumulation.refuse_open_window(state)
        if self.spec.capture is not None:  # recorded once, replayed (accelfn.step.captured)
            return captured.call(self, ctx, batch)
        try:  # every exit, at any line, leaves no gradients (undoing twice changes nothing)
            done = self._forward_backward(ctx, batch)
            while done is None:  # out of memory, undone: again, split finer (adaptive)
                _release_memory(ctx.device)
                done = self._forward_backward(ctx, batch)
            if isinstance(done, TensorDict):  # no update: the running metrics of the window
                return done
            sums, absolute, carried = done
            # the carry is committed with the update, if it is applied (accelfn.core.carry)
            return self._update(ctx, sums, absolute, carried if self._carry else None)
        except BaseException:
            self._abort(ctx)
            raise

    def _forward_backward(self, ctx: CallContext, batch: Batch
                          ) -> tuple[Sums, bool, dict[int, Any]] | TensorDict | None:
        """The call's forward and backward passes: what the update needs, the running
        metrics of a call that does not update, or None to run the call again (it ran out
        of memory, was undone, and the accumulation splits finer next time)."""
        state = ctx.state
        agrees = agreement.needed(self, ctx)  # adaptive in several processes: no collective
        # until the processes agree on the pass
        try:
            plan = self._plan(ctx, batch)
            sums = Sums() if plan.sums is None else plan.sums
            if sums.empty:  # a new window: gradients left by anything else are not this one's
                optimizers_.clear_grads(state.optimizers)
            carried: dict[int, Any] = {}
            compiling = self.spec.compilation
            with (_NOTHING if compiling is None else compilation.watching(compiling, state)):
                absolute = micro.forward_and_backward(  # adaptive, several processes: unsynced
                    self.spec, self.fn, self._carry, ctx, plan, sums,
                    plan.absolute or ctx.distributed is not None, carried, unsynced=agrees)
            if agrees and not agreement.agree(self, ctx, None):  # another ran out of memory
                self._abort(ctx)
                return None
            if not plan.update:  # no update to wait for: the call succeeds with its metrics
                running = TensorDict(sums.result(divide=True), batch_size=[])
                if self._carry:
                    state.slot(CARRY, Carries).commit("train", carried)
                return running
            return sums, absolute, carried
        except BaseException as error:  # any exit, at any line: no gradients left behind
            self._abort(ctx)
            if agrees and isinstance(error, Exception):
                if agreement.agreed(error):
                    raise  # every process raises it, agreed
                agreement.agree(self, ctx, error)  # raises unless every process retries
                return None
            if isinstance(error, torch.OutOfMemoryError):
                options = self.spec.accumulation
                if options is not None and accumulation.retry(options, ctx, error):
                    return None  # leaves the handler: the failed pass's tensors can go
                raise checks.out_of_memory(describe(self), self.transforms, self.spec,
                                           error) from error
            distributed = self.spec.sharding
            explained = None if distributed is None else sharding.explain(distributed, ctx,
                                                                          error)
            if explained is not None:
                raise explained from error
            raise

    def _update(self, ctx: CallContext, sums: Sums, absolute: bool,
                carried: dict[int, Any] | None = None) -> TensorDict:
        """The update, undone by ``_recover`` if it fails before the optimizer steps (and
        counted, with a note, if it fails after them)."""
        progress = _Progress([not optimizer.state for optimizer in ctx.state.optimizers])
        try:
            return self._sequence(ctx, sums, absolute, carried, progress)
        except BaseException as error:
            self._recover(ctx, progress, error)
            raise

    def _sequence(self, ctx: CallContext, sums: Sums, absolute: bool,
                  carried: dict[int, Any] | None, progress: _Progress) -> TensorDict:
        """The update in order; ``progress`` notes how far it went (for ``_recover``)."""
        state, prepared, spec = ctx.state, ctx.prepared, self.spec
        optimizers = state.optimizers
        metrics = sums.result(divide=absolute)
        returned = sums.returned_weight()
        if returned is not None:  # the update's token count (what tokens/s is counted from)
            metrics["weight"] = returned
        if spec.accumulation is not None and spec.accumulation.adaptive:
            metrics.update(accumulation.metrics(spec.accumulation, ctx))
        uctx = UpdateContext(state, prepared, metrics["loss"])
        if absolute:
            uctx.divisor = uctx.weight_total = torch.as_tensor(
                sums.weight, dtype=torch.float32, device=prepared.device)
        # the gradients: unscaled, reduced, divided, the user's transforms, clipped
        scales = spec.precision is not None and spec.precision.scales
        overflow = precision.unscale(uctx) if scales else None  # fp16's flag
        if spec.sharding is not None:
            sharding.reduce(spec.sharding, uctx)
        if uctx.divisor is not None:
            grads = uctx.local_grads()
            if grads:
                compat.foreach_div_(grads, uctx.divisor)
        states = chain.run(spec.gradients, uctx) if spec.gradients else None  # checked
        norm = clipping.clip(spec.clipping, uctx) if spec.clipping is not None else None
        # the decision, then the optimizer steps
        # fault tolerance: every replica group committed the update
        committed = spec.sharding is None or sharding.commit(spec.sharding, uctx)
        decision = progress.decision = nonfinite.decide(
            self._guard, uctx, overflow, norm, not spec.gradients) if committed else _UNCOMMITTED
        optimizers_.rate_metrics(metrics, optimizers, prepared.device)  # what it uses
        on_device = self._apply(uctx, decision, progress)  # a device flag: decided there
        # from here on the update is applied (or skipped): it cannot be undone
        if states and decision.skip is not True:  # the user's after-step places run here
            chain.commit(states)
        nonfinite.schedule(self._guard, state, decision.skip)  # settled later if on the device
        advance = self._guard.advance
        if carried is not None:
            state.slot(CARRY, Carries).commit_update(carried, decision.skip, on_device)
        after = self._after
        skip_value: Tensor | None = None
        if on_device is not None:
            skip_value = on_device.float()
        elif decision.checked or after:
            skip_value = torch.scalar_tensor(1.0 if decision.skip else 0.0,
                                             device=prepared.device)
        if decision.checked:
            assert skip_value is not None
            metrics["skipped"] = skip_value
        optimizers_.clear_grads(optimizers)
        state.step += 1; progress.counted = True  # noqa: E702  (one line: counted as it counts)
        if after:
            assert skip_value is not None
            skipped = on_device if on_device is not None else skip_value.bool()
            if advance:  # the EMA averages a skipped update's (unchanged) weights too
                skipped = torch.zeros_like(skipped)
            for update in after:
                update(uctx, skipped)
        if uctx.metrics:
            metrics.update(uctx.metrics)
        return compat.tensordict_unchecked(metrics, _SCALAR, None)  # type: ignore[no-any-return]

    def _recover(self, ctx: CallContext, progress: _Progress, error: BaseException) -> None:
        """After a failed update: undo it when the optimizers had not stepped (a first
        update's half-built optimizer state cleared too), or count it and say so when they
        had; raises the error explained where it helps (returns to re-raise it as it is)."""
        state = ctx.state
        if progress.applied:  # after the optimizer steps (or a skip): the update counts
            if not progress.counted:
                state.step += 1
            self._abort(ctx)
            decision = progress.decision
            error.add_note(checks.after_update_failed(
                state.step, None if decision is None else decision.skip))
            return
        stepping = progress.decision is not None  # the optimizer step itself raised
        fresh = progress.fresh
        for optimizer, first in zip(state.optimizers, fresh):
            if stepping and first:
                optimizer.state.clear()  # half-built state would break the next update
        self._abort(ctx)
        if stepping:
            if isinstance(error, torch.OutOfMemoryError):
                raise checks.optimizer_out_of_memory(describe(self), error,
                                                     all(fresh)) from error
            error.add_note(checks.optimizer_failed(all(fresh)))

    def _apply(self, ctx: UpdateContext, decision: Decision, progress: _Progress
               ) -> Tensor | None:
        """Run the optimizer steps as decided (the schedulers step after them, in
        ``_sequence``) and mark ``progress.applied`` in the same line; returns the device flag
        'skipped' when the decision was taken on the device (None: decided on the host)."""
        if decision.skip is None:  # decided on the device by fused optimizers
            assert decision.flags is not None
            skip = decision.flags.any()
            step, optimizers = ctx.prepared.optimizer_step, ctx.state.optimizers
            optimizers_.step_unless(step, optimizers, skip); progress.applied = True  # noqa: E702
            return skip  # the scheduler steps when the guard settles the decision
        if decision.skip:
            progress.applied = True  # nothing to apply: the skip is the update
        else:
            ctx.prepared.optimizer_step(); progress.applied = True  # noqa: E702
        return None

    def _abort(self, ctx: CallContext) -> None:
        """Undo a failed call: gradients cleared, every part's partial work undone."""
        optimizers_.clear_grads(ctx.state.optimizers)
        spec = self.spec
        nonfinite.abort(ctx)
        if spec.accumulation is not None:
            accumulation.abort(spec.accumulation, ctx)
        if spec.precision is not None:
            precision.forget(ctx)
        if spec.sharding is not None:
            sharding.abort(spec.sharding, ctx)

    def flush(self, state: TrainState) -> TensorDict | None:
        """Apply the update of an open call-counting window (``with_accumulation(n,
        mode='calls')``); None when there is nothing to apply."""
        options = self.spec.accumulation
        if options is None or options.mode != "calls":
            return None
        ctx = CallContext(state, self.prepare(state))
        sums = accumulation.flush(options, ctx)
        if sums is None:
            return None
        return self._update(ctx, sums, True)

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, state: TrainState, batch: Batch, **options: Any) -> TensorDict:
        """The same forward as a training call (autocast, compiled), without gradients.

        The model is put in eval mode for the call, and every module's own mode restored
        afterwards (a submodule kept in eval mode stays there); metrics are
        weighted over micro-batches exactly as in training. ``options`` go to the transforms
        that take them (``weights="ema"`` with ``with_ema``).
        """
        ema = self.spec.averaging
        checks.check_evaluate_options(ema, options)
        check_batch(batch)
        ctx = CallContext(state, self.prepare(state), training=False)
        plan = self._plan(ctx, batch)
        n = len(plan.micros)
        sums = Sums()
        with evaluating(ctx.model):
            managers = [] if ema is None else [averaging.evaluate(ema, ctx, options)]
            carried: dict[int, Any] = {}
            with torch.no_grad(), entered(managers):
                for i, one in enumerate(plan.micros):
                    out = micro.forward(self.spec, self.fn, self._carry, ctx, one, i, carried)
                    loss, weight, metrics = unpack(out, first=i == 0)
                    coef = None if n == 1 else (
                        weight.to(torch.float32) if weight is not None
                        else float(batch_size(one, plan.dim)))
                    values = {"loss": loss, **metrics}
                    if isinstance(coef, Tensor):  # weight 0 (all padding): left out, as in
                        values = micro.without_empty(coef, values)  # training
                    sums.add(coef, values)
        if self._carry:
            state.slot(CARRY, Carries).commit("evaluate", carried)
        return TensorDict(sums.result(divide=n > 1), batch_size=[])


class _Progress:
    """How far an update went, for its recovery: whether its optimizers had state before it
    (``fresh``: a failed first update leaves none), the non-finite decision once taken, the
    optimizer steps applied (set in the line that runs them), the update counted."""

    __slots__ = ("applied", "counted", "decision", "fresh")

    def __init__(self, fresh: list[bool]) -> None:
        self.fresh = fresh
        self.decision: Decision | None = None
        self.applied = False
        self.counted = False


def _release_memory(device: torch.device) -> None:
    """Free what a failed pass left: reference cycles (``gc.collect``) and, on CUDA, the
    caching allocator's unused blocks. After an out-of-memory error only: milliseconds."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sharding(key: tuple[Transform, ...]) -> tuple[Transform, ...]:
    return tuple(t for t in key if isinstance(t.part, Sharding))


def lift(fn: LossFn | Step) -> Step:
    """The step of ``fn`` with no transform (a step is returned unchanged)."""
    if isinstance(fn, Step):
        return fn
    if not callable(fn):
        raise TypeError(
            f"transforms wrap a function fn(model, batch) -> loss, got {type(fn).__name__}")
    return Step(fn)


def apply_transform(fn: LossFn | Step, transform: Transform | GradientTransform) -> Step:
    """Add ``transform`` on the outside of ``fn`` (a plain function is lifted first)."""
    return lift(fn).with_transform(transform)


def describe(step: Step | Callable[..., Any], state: TrainState | None = None) -> str:
    """The stack as text, outermost first, in the order the update runs (``f ∘ g`` runs ``g``
    first): ``compiled ∘ with_amp(bf16) ∘ my_step``. The built-ins print as they were stacked
    (their order changes nothing); the user's gradient transforms print together, in the
    order they run (one alone, several as their ``chain(...)``), inside ``with_clipping`` and
    ``with_nonfinite``, which act on what they leave, and outside the other built-ins, whose
    unscaling, reduction and weighting come before them:
    ``with_clipping(max_norm=1) ∘ chain(a, b) ∘ with_amp(bf16) ∘ my_step``.

    With ``state``, the lines below it say what preparing ``state`` fixed (before the first
    call: what it will fix): ``with_float8``'s Linear layers converted and left out, with
    why."""
    if not isinstance(step, Step):
        return getattr(step, "__name__", repr(step))
    name = getattr(step.fn, "__name__", type(step.fn).__name__)
    stack = [m for t in reversed(step.transforms)
             for m in (reversed(t.part.members) if isinstance(t.part, Chained) else (t,))]
    user = [t for t in stack if isinstance(t.part, GradientTransform)][::-1]  # run order
    if not user:
        text = " ∘ ".join([*(repr(t) for t in stack), name])
    else:
        builtins = [t for t in stack if not isinstance(t.part, GradientTransform)]
        after = [isinstance(t.part, (Clipping, NonFinite)) for t in builtins]  # run after them
        chained = repr(user[0]) if len(user) == 1 else f"chain({', '.join(map(repr, user))})"
        text = " ∘ ".join([*(repr(t) for t, a in zip(builtins, after) if a), chained,
                           *(repr(t) for t, a in zip(builtins, after) if not a), name])
    if state is not None and step.spec.float8 is not None:
        text += "\n" + float8.describe(step.spec.float8, state)
    return text
