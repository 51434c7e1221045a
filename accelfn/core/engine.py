"""The step: a pure user function lifted into exactly one optimizer update.

Whatever order the transforms were stacked in, a step runs the phases of
[`accelfn.PHASES`][] in that order, and nothing else:

    prepare once per TrainState:  islands -> checkpoint -> shard -> compile -> average
    plan = split(batch)                            (default: the whole batch, one update)
    for each micro-batch:                          (micro_context: no_sync but on the last)
        out = fn(model, micro)                     (forward_context: autocast)
        backward(scale_loss(coefficient * loss))   (coefficients weight micro-batches exactly)
    unscale -> reduce -> divide by the weight -> gradients -> clip -> decide
    optimizer.step() unless skipped -> zero_grad(set_to_none=True) -> scheduler.step()
    after_update(skipped)

Within a phase, hooks run in the order of their transforms' names; two transforms in one
phase must both declare that they commute, or the stack is refused. So stacking order
changes only the printed description, never the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from . import checks, compat, units
from . import optimizers as optimizers_
from .batch import Batch, batch_size, check_batch
from .carry import SLOT as CARRY
from .carry import Carries, detached, takes_carry
from .guard import SLOT as GUARD_SLOT
from .guard import Guard, NonFiniteError, nonfinite
from .outputs import unpack
from .protocol import (
    GRADIENT_PHASES,
    PHASES,
    PREPARE_PHASES,
    CallContext,
    Decision,
    Plan,
    Prepared,
    Sums,
    Transform,
    UpdateContext,
    entered,
)
from .state import TrainState

__all__ = ["LossFn", "NonFiniteError", "Step", "apply_transform", "describe", "lift"]

LossFn = Callable[..., "Tensor | Mapping[str, Tensor]"]  # fn(model, batch[, carry])
_DEFAULT_GUARD = nonfinite()
_ORDER = {name: i for i, (name, _, _) in enumerate(PHASES)}
_SCALAR = torch.Size([])
_FIXED = frozenset({"fn", "transforms", "_hooks", "_key", "_before_divide", "_after_divide",
                    "_carry"})


def _sharding(key: tuple[Transform, ...]) -> tuple[Transform, ...]:
    return tuple(t for t in key if "shard" in t.hooks)


class Step:
    """A training step: ``step(state, batch)`` runs exactly one optimizer update.

    Equivalent to the plain PyTorch loop body:

        out = fn(model, batch); loss = out if tensor else out["loss"]
        loss.backward()
        if the loss and all gradients are finite: optimizer.step(); scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    with each transform of the stack adding its part in its phase (see [`accelfn.core.engine`][]),
    and returns a TensorDict of detached metrics left on the device. A step is a value: it
    holds the function and the transforms only; everything a call changes lives in the
    [`TrainState`][].
    """

    def __init__(self, fn: LossFn, transforms: tuple[Transform, ...] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"a step needs a callable fn(model, batch), got {type(fn).__name__}")
        for t in transforms:
            if not isinstance(t, Transform):
                raise TypeError(f"{t!r} is not a transform: build one with accelfn.Transform")
        self.fn = fn
        self.transforms = transforms
        checks.check_stack(transforms, lambda: describe(self))
        active = transforms
        if not any("decide" in t.hooks for t in transforms):
            active = (*transforms, _DEFAULT_GUARD)
        ordered = sorted(active, key=lambda t: t.name)
        self._hooks: dict[str, list[tuple[Transform, Any]]] = {
            phase: [(t, t.hooks[phase]) for t in ordered if phase in t.hooks]  # type: ignore[literal-required]
            for phase in _ORDER}
        self._key = self._prepare_key()
        # the update's gradient hooks, flat: (preserves_finite, hook), before and after the
        # engine divides by the weight total (after 'reduce')
        gradient_hooks = [[(t.preserves_finite, hook) for t, hook in self._hooks[phase]]
                          for phase in GRADIENT_PHASES]
        cut = GRADIENT_PHASES.index("reduce") + 1
        self._before_divide = [h for hooks in gradient_hooks[:cut] for h in hooks]
        self._after_divide = [h for hooks in gradient_hooks[cut:] for h in hooks]
        self._carry = takes_carry(fn)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIXED and hasattr(self, "_carry"):
            raise AttributeError(f"a step is immutable: build a new one instead of setting {name}")
        object.__setattr__(self, name, value)

    # ----------------------------------------------------------------- building
    def with_transform(self, transform: Transform) -> Step:
        """A new step with ``transform`` added on the outside of this one."""
        if not isinstance(transform, Transform):
            raise TypeError(
                f"{transform!r} is not a transform: build one with accelfn.Transform(name, "
                "hooks=accelfn.Hooks(...)) (see docs/writing-a-transform.md)")
        return Step(self.fn, (*self.transforms, transform))

    def has(self, phase: str) -> bool:
        """Whether some transform of this step fills ``phase``."""
        return bool(self._hooks[phase])

    def __repr__(self) -> str:
        return describe(self)

    # ----------------------------------------------------------------- preparation
    def _prepare_key(self) -> tuple[Transform, ...]:
        return tuple(t for t in self.transforms if any(p in t.hooks for p in PREPARE_PHASES))

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
        for _, check in self._hooks["check"]:  # every refusal before anything changes
            check(state)
        optimizers = state.optimizers
        prepared = Prepared(model=state.model, optimizer_step=optimizers_.stepper(optimizers),
                            device=state.device)
        for phase in PREPARE_PHASES:
            for t, hook in self._hooks[phase]:
                result = hook(prepared, state)
                if not isinstance(result, Prepared):
                    raise TypeError(f"{t.name}'s {phase!r} hook returned {result!r}; return a "
                                    "Prepared (dataclasses.replace(prepared, ...))")
                prepared = result
        skips = all(compat.step_supports_amp_scaling(optimizer) and all(
            group.get("fused") for group in optimizer.param_groups) for optimizer in optimizers)
        prepared = dataclasses.replace(prepared, skips_on_device=skips)
        checks.check_optimizer_holds_trainable(state)
        state.add_preparation(key, prepared, describe(self))
        return prepared

    # ----------------------------------------------------------------- the update
    def _plan(self, ctx: CallContext, batch: Batch) -> Plan:
        hooks = self._hooks["split"]
        if not hooks:
            return Plan((batch,))
        t, hook = hooks[0]
        plan = hook(ctx, batch)
        if not isinstance(plan, Plan):
            raise TypeError(f"{t.name}'s 'split' hook returned {plan!r}; return a Plan")
        return plan

    def _forward(self, ctx: CallContext, micro: Batch, index: int = 0,
                 carried: dict[int, Any] | None = None) -> Any:
        hooks = self._hooks["forward_context"]
        if not self._carry:  # the common case: fn(model, micro), at most one context
            if not hooks:
                return self.fn(ctx.prepared.model, micro)
            if len(hooks) == 1:  # autocast: no context stack
                with hooks[0][1](ctx):
                    return self.fn(ctx.prepared.model, micro)
            with entered([hook(ctx) for _, hook in hooks]):
                return self.fn(ctx.prepared.model, micro)
        mode = "train" if ctx.training else "evaluate"
        carry = ctx.state.slot(CARRY, Carries).get(mode, index)
        with entered([hook(ctx) for _, hook in hooks]):
            out = self.fn(ctx.prepared.model, micro, carry=carry)
        if not isinstance(out, Mapping) or "carry" not in out:
            raise ValueError("a step function taking 'carry' returns a mapping with 'loss' and "
                             "'carry' (None to carry nothing)")
        assert carried is not None
        rest = {k: v for k, v in out.items() if k != "carry"}
        carried[index] = detached(out["carry"])
        return rest

    def __call__(self, state: TrainState, batch: Batch) -> TensorDict:
        check_batch(batch)
        ctx = CallContext(state, self.prepare(state))
        try:
            plan = self._plan(ctx, batch)
            sums = Sums() if plan.sums is None else plan.sums
            if sums.empty:  # a new window: gradients left by anything else are not this one's
                optimizers_.clear_grads(state.optimizers)
            carried: dict[int, Any] = {}
            absolute = self._backward(ctx, plan, sums, plan.absolute or ctx.distributed is not None,
                                      carried)
            if self._carry and not plan.update:  # no update to wait for: the call succeeded
                state.slot(CARRY, Carries).commit("train", carried)
        except BaseException as error:
            self._abort(ctx)
            if isinstance(error, torch.OutOfMemoryError):
                raise checks.out_of_memory(self, error) from error
            raise
        if not plan.update:
            return TensorDict(sums.result(divide=True), batch_size=[])
        # the carry is committed with the update, if it is applied (see accelfn.core.carry)
        return self._update(ctx, sums, absolute, carried if self._carry else None)

    def _backward(self, ctx: CallContext, plan: Plan, sums: Sums, absolute: bool,
                  carried: dict[int, Any]) -> bool:
        """Forward and backward of every micro-batch, each loss weighted by its share; returns
        whether the micro-batches were weighted absolutely (gradients and metrics to be divided
        by the total weight). One loop, no call per micro-batch beyond the user's and the
        backward: it is the hot path of every step."""
        micros = plan.micros
        n = len(micros)
        sizes = plan.sizes
        if sizes is None and (n > 1 or absolute):
            sizes = [batch_size(m, plan.dim) for m in micros]
        elif sizes is not None and len(sizes) != n:
            raise ValueError(f"the 'split' hook's Plan has {n} micro-batches but {len(sizes)} "
                             "sizes; give one size per micro-batch, or leave sizes out")
        # a micro-batch's coefficient unless it returns a weight: its sample count when
        # weighted absolutely, its share of the call's samples, nothing when it is alone
        fixed: list[float | None]
        if absolute:
            assert sizes is not None
            fixed = [float(size) for size in sizes]
        elif n > 1:
            assert sizes is not None
            total = sum(sizes)
            fixed = [size / total for size in sizes]
        else:
            fixed = [None]
        micro_hooks = self._hooks["micro_context"]
        scale_hooks = self._hooks["scale_loss"]
        forward_hooks = self._hooks["forward_context"]
        plain = not self._carry and not micro_hooks
        direct = plain and not forward_hooks
        # one forward context (autocast) and nothing else: entered here, without a call
        single = forward_hooks[0][1] if plain and len(forward_hooks) == 1 else None
        fn, model = self.fn, ctx.prepared.model
        check = sums.empty  # the first micro-batch of a window: check the output
        losses, coefs = sums.loss_terms()
        backward = compat.backward
        inputs = optimizers_.backward_inputs(ctx.state)
        weighted: bool | None = None
        coef: Tensor | float | None
        for i, micro in enumerate(micros):
            if direct:
                out = fn(model, micro)
            elif single is not None:
                with single(ctx):
                    out = fn(model, micro)
            elif micro_hooks:
                sync = plan.update and i == n - 1
                with entered([hook(ctx, i, sync) for _, hook in micro_hooks]):
                    out = self._forward(ctx, micro, i, carried)
            else:
                out = self._forward(ctx, micro, i, carried)
            metrics = None
            if type(out) is Tensor and (i or not check) and not weighted:  # a loss, as before
                loss, coef = out, fixed[i]
                weighted = False
            else:
                loss, weight, metrics = unpack(out, first=check and i == 0)
                if weighted is not None and weighted != (weight is not None):
                    raise ValueError("the step function returned 'weight' for some "
                                     "micro-batches but not others; return it always")
                weighted = weight is not None
                if weight is not None and (n > 1 or absolute):
                    coef = weight.detach().to(torch.float32)
                    absolute = True
                else:
                    coef = fixed[i]
            if absolute and scale_hooks and coef is not None:  # see accelfn.core.units
                coef = coef * units.inverse_unit(ctx, coef, n * plan.calls)
            objective = loss if coef is None else loss * coef
            if metrics:
                sums.add(coef, metrics, {"loss": objective})
            else:
                losses.append(objective.detach())
                if coef is not None:
                    coefs.append(coef)
            if scale_hooks:
                for _, hook in scale_hooks:
                    objective = hook(ctx, objective)
            try:
                backward(objective, inputs)
            except RuntimeError as error:
                if "backward through the graph a second time" in str(error):
                    raise RuntimeError(
                        "the step function called backward() itself: return the loss instead "
                        "and let the step differentiate it (once, weighted and scaled as the "
                        f"stack needs) ({error})") from error
                raise
        return absolute

    def _abort(self, ctx: CallContext) -> None:
        """Undo a failed call: gradients cleared, every transform's partial work undone."""
        optimizers_.clear_grads(ctx.state.optimizers)
        guard = ctx.state.get_slot(GUARD_SLOT)
        if isinstance(guard, Guard):  # a decision deferred by this call: no update to settle
            guard.forget(ctx.state.step)
        for _, hook in self._hooks["abort"]:
            hook(ctx)

    def flush(self, state: TrainState) -> TensorDict | None:
        """Apply the update of an open call-counting window (``with_accumulation(n,
        mode='calls')``); None when there is nothing to apply."""
        hooks = self._hooks["flush"]
        if not hooks:
            return None
        ctx = CallContext(state, self.prepare(state))
        sums = hooks[0][1](ctx)
        if sums is None:
            return None
        return self._update(ctx, sums, True)

    def _update(self, ctx: CallContext, sums: Sums, absolute: bool,
                carried: dict[int, Any] | None = None) -> TensorDict:
        state, prepared = ctx.state, ctx.prepared
        optimizers = state.optimizers
        metrics = sums.result(divide=absolute)
        uctx = UpdateContext(state, prepared, metrics["loss"])
        if absolute:
            uctx.divisor = uctx.weight_total = torch.as_tensor(
                sums.weight, dtype=torch.float32, device=prepared.device)
        fresh = [not optimizer.state for optimizer in optimizers]  # a failed first update
        # leaves no state either
        decided: Decision | None = None
        try:
            decision = decided = self._gradient_path(uctx)
            rates = [optimizers_.rate(o) for o in optimizers]  # what this update uses
            on_device = self._apply(uctx, decision)  # the skip flag when decided on the device
        except BaseException as error:
            optimizing = decided is not None  # the optimizer step itself raised
            for optimizer, first in zip(optimizers, fresh):
                if optimizing and first:
                    optimizer.state.clear()  # half-built state would break the next update
            self._abort(uctx)
            if optimizing:
                if isinstance(error, torch.OutOfMemoryError):
                    raise checks.optimizer_out_of_memory(self, error, all(fresh)) from error
                error.add_note(checks.optimizer_failed(all(fresh)))
            raise
        # from here on the update is applied (or skipped): it cannot be undone
        counted = False
        try:
            if decision.skip is False:
                state.step_scheduler()
            if carried is not None:
                state.slot(CARRY, Carries).commit_update(carried, decision.skip, on_device)
            device = prepared.device
            after = self._hooks["after_update"]
            # fills, not copies: nothing waits for the device
            optimizers_.rate_metrics(metrics, rates, optimizers, device)
            skip_value: Tensor | None = None
            if on_device is not None:
                skip_value = on_device.float()
            elif decision.checked or after:
                skip_value = torch.scalar_tensor(1.0 if decision.skip else 0.0, device=device)
            if decision.checked:
                assert skip_value is not None
                metrics["skipped"] = skip_value
            optimizers_.clear_grads(optimizers)
            state.step += 1
            counted = True
            if after:
                assert skip_value is not None
                skipped = on_device if on_device is not None else skip_value.bool()
                for _, hook in after:
                    hook(uctx, skipped)
        except BaseException as error:
            if not counted:
                state.step += 1
            self._abort(uctx)
            error.add_note(checks.after_update_failed(state.step, decision.skip))
            raise
        if uctx.metrics:
            metrics.update(uctx.metrics)
        return compat.tensordict_unchecked(metrics, _SCALAR, None)  # type: ignore[no-any-return]

    def _gradient_path(self, ctx: UpdateContext) -> Decision:
        for preserves_finite, hook in self._before_divide:
            if not preserves_finite:
                ctx.grads_written()
            hook(ctx)
        if ctx.divisor is not None:
            grads = ctx.local_grads()
            if grads:
                compat.foreach_div_(grads, ctx.divisor)
        for preserves_finite, hook in self._after_divide:
            if not preserves_finite:
                ctx.grads_written()
            hook(ctx)
        t, hook = self._hooks["decide"][0]
        decision = hook(ctx)
        if not isinstance(decision, Decision):
            raise TypeError(f"{t.name}'s 'decide' hook returned {decision!r}; return a Decision")
        return decision  # type: ignore[no-any-return]

    def _apply(self, ctx: UpdateContext, decision: Decision) -> Tensor | None:
        """Run the optimizer step as decided (the scheduler steps after it, in ``_update``);
        returns the device flag 'skipped' when the decision was taken on the device (None:
        decided on the host)."""
        optimizers = ctx.state.optimizers
        flags = decision.flags
        if decision.skip is None:  # decided on the device by fused optimizers
            assert flags is not None
            skip = flags.any()
            optimizers_.step_unless(ctx.prepared.optimizer_step, optimizers, skip)
            return skip  # the scheduler steps when the guard settles the decision
        if not decision.skip:
            ctx.prepared.optimizer_step()
        return None

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, state: TrainState, batch: Batch, **options: Any) -> TensorDict:
        """The same forward as a training call (autocast, compiled), without gradients.

        The model is put in eval mode for the call and restored afterwards; metrics are
        weighted over micro-batches exactly as in training. ``options`` go to the transforms
        that declare them in ``evaluate_options`` (e.g. ``weights="ema"`` with ``with_ema``).
        """
        hooks = self._hooks["evaluate_context"]
        checks.check_evaluate_options([t for t, _ in hooks], options)
        check_batch(batch)
        ctx = CallContext(state, self.prepare(state), training=False)
        plan = self._plan(ctx, batch)
        n = len(plan.micros)
        sums = Sums()
        model = ctx.model
        was_training = model.training
        model.eval()
        try:
            managers = [hook(ctx, {k: v for k, v in options.items() if k in t.evaluate_options})
                        for t, hook in hooks]
            carried: dict[int, Any] = {}
            with torch.no_grad(), entered(managers):
                for i, micro in enumerate(plan.micros):
                    out = self._forward(ctx, micro, i, carried)
                    loss, weight, metrics = unpack(out, first=i == 0)
                    coef = None if n == 1 else (
                        weight.to(torch.float32) if weight is not None
                        else float(batch_size(micro, plan.dim)))
                    sums.add(coef, {"loss": loss, **metrics})
        finally:
            model.train(was_training)
        if self._carry:
            state.slot(CARRY, Carries).commit("evaluate", carried)
        return TensorDict(sums.result(divide=n > 1), batch_size=[])


def lift(fn: LossFn | Step) -> Step:
    """The step of ``fn`` with no transform (a step is returned unchanged)."""
    if isinstance(fn, Step):
        return fn
    if not callable(fn):
        raise TypeError(
            f"transforms wrap a function fn(model, batch) -> loss, got {type(fn).__name__}")
    return Step(fn)


def apply_transform(fn: LossFn | Step, transform: Transform) -> Step:
    """Add ``transform`` on the outside of ``fn`` (a plain function is lifted first)."""
    return lift(fn).with_transform(transform)


def describe(step: Step | Callable[..., Any]) -> str:
    """The stack as text, outermost first: ``compiled ∘ with_amp(bf16) ∘ my_step``."""
    if not isinstance(step, Step):
        return getattr(step, "__name__", repr(step))
    parts = [repr(t) for t in reversed(step.transforms)]
    return " ∘ ".join([*parts, getattr(step.fn, "__name__", type(step.fn).__name__)])

