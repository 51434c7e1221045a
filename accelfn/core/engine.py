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

from . import compat
from .batch import Batch, batch_size, check_batch
from .carry import SLOT as CARRY
from .carry import Carries, detached, takes_carry
from .guard import NonFiniteError, nonfinite
from .outputs import unpack
from .protocol import (
    EXCLUSIVE,
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


def _check_stack(transforms: tuple[Transform, ...], text: Callable[[], str]) -> None:
    names = [t.name for t in transforms]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{name} is applied twice in {text()}; apply each transform once")
    for phase in _ORDER:
        members = sorted((t for t in transforms if phase in t.hooks), key=lambda t: t.name)
        if len(members) < 2:
            continue
        first, second = members[0], members[1]
        if phase in EXCLUSIVE:
            raise ValueError(
                f"{first.name} and {second.name} both fill the {phase!r} phase, which runs one "
                f"hook only; keep one of them in {text()}")
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if not (a.commutes_with(b) and b.commutes_with(a)):
                    raise ValueError(
                        f"{a.name} and {b.name} both have a {phase!r} hook and do not both "
                        f"declare that they commute, so their order would change the result; "
                        f"declare commutes=True (or name the other) on both if it does not")


def _check_optimizer_holds_trainable(state: TrainState) -> None:
    held = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in state.model.named_parameters() if p.requires_grad
               and id(p) not in held]
    if missing:
        state.warn_once("missing", (
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they get "
            "gradients that nothing applies or clears, every update. Add them to the "
            "optimizer, or freeze them with requires_grad_(False) (accelfn.freeze)"))


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
        _check_stack(transforms, lambda: describe(self))
        active = transforms
        if not any("decide" in t.hooks for t in transforms):
            active = (*transforms, _DEFAULT_GUARD)
        ordered = sorted(active, key=lambda t: t.name)
        self._hooks: dict[str, list[tuple[Transform, Any]]] = {
            phase: [(t, t.hooks[phase]) for t in ordered if phase in t.hooks]  # type: ignore[literal-required]
            for phase in _ORDER}
        self._key = self._prepare_key()
        self._carry = takes_carry(fn)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("fn", "transforms", "_hooks", "_key", "_carry") and hasattr(self, "_carry"):
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
        if not isinstance(state, TrainState):
            raise TypeError(
                f"a step is called as step(state, batch) with an accelfn.TrainState, got "
                f"{type(state).__name__}")
        key = self._key
        for done_key, prepared, text in state.preparations:
            if done_key is key or done_key == key:
                return prepared  # type: ignore[no-any-return]
            if _sharding(done_key) != _sharding(key):
                raise ValueError(
                    f"this TrainState was prepared by {text}, which shards the model "
                    f"differently from {describe(self)}; a model is sharded once. Use the "
                    "same distributed(...) in every step of a state, or build a new TrainState")
        prepared = Prepared(model=state.model, optimizer_step=state.optimizer.step,
                            device=state.device)
        for phase in PREPARE_PHASES:
            for t, hook in self._hooks[phase]:
                result = hook(prepared, state)
                if not isinstance(result, Prepared):
                    raise TypeError(f"{t.name}'s {phase!r} hook returned {result!r}; return a "
                                    "Prepared (dataclasses.replace(prepared, ...))")
                prepared = result
        skips = compat.step_supports_amp_scaling(state.optimizer) and all(
            group.get("fused") for group in state.optimizer.param_groups)
        prepared = dataclasses.replace(prepared, skips_on_device=skips)
        _check_optimizer_holds_trainable(state)
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
            carried: dict[int, Any] = {}
            absolute = self._backward(ctx, plan, sums, plan.absolute or ctx.distributed is not None,
                                      carried)
            if self._carry:
                state.slot(CARRY, Carries).commit("train", carried)
        except BaseException as error:
            self._abort(ctx)
            if isinstance(error, torch.OutOfMemoryError):
                raise _out_of_memory(self, error) from error
            raise
        if not plan.update:
            return TensorDict(sums.result(divide=True), batch_size=[])
        return self._update(ctx, sums, absolute)

    def _backward(self, ctx: CallContext, plan: Plan, sums: Sums, absolute: bool,
                  carried: dict[int, Any]) -> bool:
        """Forward and backward of every micro-batch, each loss weighted by its share; returns
        whether the micro-batches were weighted absolutely (gradients and metrics to be divided
        by the total weight). One loop, no call per micro-batch beyond the user's: it is the
        hot path of every step."""
        micros = plan.micros
        n = len(micros)
        sizes = plan.sizes
        if sizes is None and (n > 1 or absolute):
            sizes = [batch_size(m, plan.dim) for m in micros]
        elif sizes is not None and len(sizes) != n:
            raise ValueError(f"the 'split' hook's Plan has {n} micro-batches but {len(sizes)} "
                             "sizes; give one size per micro-batch, or leave sizes out")
        total = sum(sizes) if sizes is not None else 0
        micro_hooks = self._hooks["micro_context"]
        scale_hooks = self._hooks["scale_loss"]
        forward_hooks = self._hooks["forward_context"]
        direct = not self._carry and not forward_hooks and not micro_hooks
        fn, model = self.fn, ctx.prepared.model
        check = sums.weight is None  # the first micro-batch of a window: check the output
        shares = [size / total for size in sizes] if sizes is not None and n > 1 \
            and not absolute else None  # each micro-batch's share of the call's samples
        weighted: bool | None = None
        for i, micro in enumerate(micros):
            if direct:
                out = fn(model, micro)
            elif micro_hooks:
                sync = plan.update and i == n - 1
                with entered([hook(ctx, i, sync) for _, hook in micro_hooks]):
                    out = self._forward(ctx, micro, i, carried)
            else:
                out = self._forward(ctx, micro, i, carried)
            first = check and i == 0
            if type(out) is Tensor and not first:  # a loss, checked on the first micro-batch
                loss, weight, metrics = out, None, None
            else:
                loss, weight, metrics = unpack(out, first=first)
            if weighted is None:
                weighted = weight is not None
            elif weighted != (weight is not None):
                raise ValueError("the step function returned 'weight' for some micro-batches "
                                 "but not others; return it always")
            coef: Tensor | float | None
            if weight is not None and (n > 1 or absolute):
                coef = weight.detach().to(torch.float32)
                absolute = True
            elif absolute:
                assert sizes is not None
                coef = float(sizes[i])
            elif shares is not None:
                coef = shares[i]
            else:
                coef = None
            objective = loss if coef is None else loss * coef
            if metrics:
                sums.add(coef, metrics, {"loss": objective})
            else:
                sums.losses(coef).append(objective.detach())
            for _, hook in scale_hooks:
                objective = hook(ctx, objective)
            try:
                objective.backward()  # type: ignore[no-untyped-call]
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
        ctx.state.optimizer.zero_grad(set_to_none=True)
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

    def _update(self, ctx: CallContext, sums: Sums, absolute: bool) -> TensorDict:
        state, optimizer = ctx.state, ctx.state.optimizer
        metrics = sums.result(divide=absolute)
        uctx = UpdateContext(state, ctx.prepared, metrics["loss"])
        if absolute:
            uctx.divisor = uctx.weight_total = torch.as_tensor(
                sums.weight, dtype=torch.float32, device=ctx.device)
        try:
            decision = self._gradient_path(uctx)
        except BaseException:
            self._abort(uctx)
            raise
        lr = optimizer.param_groups[0]["lr"]  # the learning rate this update uses
        if isinstance(lr, Tensor):  # schedulers update a tensor learning rate in place
            lr = lr.detach().clone()
        on_device = self._apply(uctx, decision)  # the skip flag when decided on the device
        device = ctx.device
        host_skip = float(bool(decision.skip))
        # fills, not copies: nothing waits for the device
        lr_value = (lr if isinstance(lr, Tensor)
                    else torch.scalar_tensor(float(lr), device=device))
        skip_value = (on_device.float() if on_device is not None
                      else torch.scalar_tensor(host_skip, device=device))
        metrics["lr"] = lr_value
        if decision.checked:
            metrics["skipped"] = skip_value
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        if self._hooks["after_update"]:
            skipped = on_device if on_device is not None else skip_value.bool()
            for _, hook in self._hooks["after_update"]:
                hook(uctx, skipped)
        metrics.update(uctx.metrics)
        return compat.tensordict_unchecked(metrics, _SCALAR, None)  # type: ignore[no-any-return]

    def _gradient_path(self, ctx: UpdateContext) -> Decision:
        for phase in GRADIENT_PHASES:
            for t, hook in self._hooks[phase]:
                if not t.preserves_finite:
                    ctx.grads_written()
                hook(ctx)
            if phase == "reduce" and ctx.divisor is not None:
                grads = ctx.local_grads()
                if grads:
                    compat.foreach_div_(grads, ctx.divisor)
        t, hook = self._hooks["decide"][0]
        decision = hook(ctx)
        if not isinstance(decision, Decision):
            raise TypeError(f"{t.name}'s 'decide' hook returned {decision!r}; return a Decision")
        return decision  # type: ignore[no-any-return]

    def _apply(self, ctx: UpdateContext, decision: Decision) -> Tensor | None:
        """Run the optimizer step as decided; returns the device flag 'skipped' when the
        decision was taken on the device (None: decided on the host)."""
        state, optimizer = ctx.state, ctx.state.optimizer
        flags = decision.flags
        if decision.skip is None:  # decided on the device by a fused optimizer
            assert flags is not None
            skip = flags.any()
            optimizer.found_inf = skip.float()  # type: ignore[attr-defined]
            try:
                ctx.prepared.optimizer_step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
            return skip  # the scheduler steps when the guard settles the decision
        if not decision.skip:
            ctx.prepared.optimizer_step()
            state.step_scheduler()
        return None

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, state: TrainState, batch: Batch, **options: Any) -> TensorDict:
        """The same forward as a training call (autocast, compiled), without gradients.

        The model is put in eval mode for the call and restored afterwards; metrics are
        weighted over micro-batches exactly as in training. ``options`` go to the transforms
        that declare them in ``evaluate_options`` (e.g. ``weights="ema"`` with ``with_ema``).
        """
        hooks = self._hooks["evaluate_context"]
        known = {o: t for t, _ in hooks for o in t.evaluate_options}
        unknown = sorted(set(options) - set(known))
        if unknown:
            offered = ", ".join(f"{o!r} ({known[o].name})" for o in sorted(known)) or "none"
            raise TypeError(f"evaluate() got unknown option(s) {unknown}; this step offers "
                            f"{offered}")
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


def _out_of_memory(step: Step, error: BaseException) -> torch.OutOfMemoryError:
    split = step._hooks["split"]
    n = int(dict(split[0][0].options).get("n", 1)) if split else 1
    advice = [f"with_accumulation({2 * n}) (same update, half the activations)"]
    if not step.has("checkpoint"):
        advice.append("checkpointed (recompute block activations in backward)")
    if not step.has("forward_context"):
        advice.append("with_amp (bf16 activations take half the memory)")
    advice.append("a smaller batch")
    return torch.OutOfMemoryError(
        f"out of memory in {describe(step)}; the model, optimizer and scheduler are unchanged "
        f"and gradients were cleared. Try: {'; '.join(advice)}. ({error})")


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

