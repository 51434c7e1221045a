"""The step: a pure user function lifted into exactly one optimizer update.

A *step* is built from the user's function ``fn(model, batch) -> loss | mapping`` and a set of
transforms. Whatever order the transforms were stacked in, a step runs one canonical sequence::

    prepare once (by prepare_order): fp32 islands -> checkpoint wrap -> DDP/FSDP -> compile
    for each micro-batch:                        (micro_context: e.g. no_sync but on the last)
        out = fn(model, micro)                   (forward_context: e.g. autocast)
        backward(scale_loss(coefficient * loss)) (coefficient weights micro-batches exactly)
    on_grads, by grads_order:  unscale (0) -> weight division (10) -> clip (30) -> custom (50)
    non-finite guard -> optimizer.step() -> zero_grad(set_to_none=True) -> scheduler.step()
    on_update                                    (e.g. EMA, after every real update)

so stacking order changes only the printed description, never the result. A transform is any
object with a unique ``name`` and some of the optional hooks of :class:`Transform`.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from .batch import Batch, batch_size, check_batch, split_batch
from .state import TrainState

__all__ = [
    "LossFn",
    "NonFiniteError",
    "Prepared",
    "Step",
    "StepContext",
    "Transform",
    "apply_transform",
    "describe",
    "lift",
]

LossFn = Callable[[nn.Module, Batch], "Tensor | Mapping[str, Tensor]"]


class NonFiniteError(FloatingPointError):
    """Raised when the non-finite policy says a NaN/Inf loss or gradient must stop training."""


@runtime_checkable
class Transform(Protocol):
    """The public protocol every transform follows, built-in or user-written.

    Only ``name`` is required. Each hook below is optional and looked up by name:

    ``validate(transforms)``
        Called whenever a step is built, with every transform of the stack; raise
        ``ValueError`` to refuse a combination.
    ``prepare(prepared, state)`` with ``prepare_order: int``
        Called once per :class:`TrainState`, lazily on the first call, in ascending
        ``prepare_order``; may replace ``prepared.model`` (what ``fn`` receives) or
        ``prepared.optimizer_step``.
    ``forward_context(ctx)``
        A context manager around each forward (training and ``evaluate``), e.g. autocast.
    ``micro_context(ctx, index, sync)``
        A context manager around forward and backward of micro-batch ``index``; ``sync`` is
        False on micro-batches whose gradients must not be synchronised across processes.
    ``scale_loss(loss, ctx)``
        Returns the tensor to differentiate, e.g. multiplied by a loss scale.
    ``on_grads(ctx)`` with ``grads_order: int``
        Called once per update with fully accumulated gradients, in ascending ``grads_order``
        (0 unscale, 10 micro-batch weighting, 30 clipping; user transforms default to 50).
    ``on_update(ctx, skipped)``
        Called after the optimizer update; ``skipped`` is a device bool tensor.
    ``evaluate_context(ctx, **options)`` with ``evaluate_options: tuple[str, ...]``
        A context manager around ``step.evaluate``, given the evaluate options it declares
        (e.g. ``with_ema`` takes ``weights="ema"``).

    Hooks may keep checkpointable state in ``ctx.state.slot(name, factory)`` and add metrics
    to ``ctx.metrics`` (device tensors, never read on the host).
    """

    name: str


@dataclass(slots=True)
class Prepared:
    """What one :class:`TrainState` looks like to a step after preparation."""

    model: nn.Module
    optimizer_step: Callable[[], Any]
    device: torch.device
    process_group: Any = None  # set by ``distributed`` when more than one process trains
    skips_on_device: bool = False  # the optimizer honours a device found_inf flag


@dataclass(slots=True)
class StepContext:
    """Per-call information handed to transform hooks."""

    state: TrainState
    prepared: Prepared
    device: torch.device
    num_micro_batches: int
    metrics: dict[str, Tensor] = field(default_factory=dict)
    loss: Tensor | None = None
    grad_norm: Tensor | None = None
    grads_nonfinite: Tensor | None = None
    grad_divisor: Tensor | None = None
    weight_total: Tensor | None = None

    @property
    def model(self) -> nn.Module:
        return self.prepared.model

    @property
    def distributed(self) -> Any:
        """The process group gradients are reduced over, or None in a single process."""
        return self.prepared.process_group

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    def grads(self) -> list[Tensor]:
        """The gradients the optimizer will apply (parameters without one are left out)."""
        return [p.grad for g in self.state.optimizer.param_groups for p in g["params"]
                if p.grad is not None]

    def local_grads(self) -> list[Tensor]:
        """:meth:`grads` as plain tensors: this process' shard of sharded (DTensor) ones."""
        return [g.to_local() if hasattr(g, "to_local") else g for g in self.grads()]


def _hooks(transforms: tuple[Any, ...], hook: str, order: str | None = None,
           default: int = 50) -> list[tuple[int, Any]]:
    found = [(getattr(t, order, default) if order else 0, t) for t in transforms
             if callable(getattr(t, hook, None))]
    return sorted(found, key=lambda pair: pair[0])


def _unpack(out: Any, first: bool) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    if isinstance(out, Tensor):
        loss, weight, metrics = out, None, {}
    elif type(out) is dict and "loss" in out:
        loss = out["loss"]
        weight = out.get("weight")
        metrics = {k: v for k, v in out.items() if k != "loss" and k != "weight"}
    elif isinstance(out, (Mapping, TensorDictBase)):
        if "loss" not in out.keys():
            raise KeyError(
                f"the step function returned a mapping without 'loss' (keys: {list(out.keys())}); "
                "return a scalar loss or a mapping with a 'loss' entry"
            )
        loss = out["loss"]
        weight = out["weight"] if "weight" in out.keys() else None
        metrics = {k: out[k] for k in out.keys() if k not in ("loss", "weight")}
    else:
        raise TypeError(
            f"the step function returned a {type(out).__name__}; return a scalar loss tensor or "
            "a mapping with 'loss' (and optional 'weight' and scalar metrics)"
        )
    if first:
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in "
                "the step function"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                "the loss does not require grad: it is not computed from the model's trainable "
                "parameters (was it detached, or computed under torch.no_grad()?)"
            )
        if weight is not None and (not isinstance(weight, Tensor) or weight.dim() != 0):
            raise ValueError("'weight' must be a scalar tensor (e.g. the number of tokens)")
        for k, v in metrics.items():
            if not isinstance(v, Tensor) or v.dim() != 0:
                raise ValueError(
                    f"metric {k!r} must be a scalar tensor; compute it on the device and reduce"
                )
    return loss, weight, metrics


class _Accumulator:
    """Running weighted sums of loss and metrics over micro-batches (on the device)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.weight: Tensor | float | None = None

    def add(self, coef: Tensor | float | None, values: dict[str, Tensor]) -> None:
        if coef is None and not self.sums:  # one micro-batch: nothing to weight
            self.sums = {key: value.detach() for key, value in values.items()}
            return
        for key, value in values.items():
            value = value.detach()
            term = value if coef is None else value * coef
            self.sums[key] = term if key not in self.sums else self.sums[key] + term
        if coef is not None:
            self.weight = coef if self.weight is None else self.weight + coef

    def result(self, divide: bool) -> dict[str, Tensor]:
        if not divide or self.weight is None:
            return dict(self.sums)
        return {k: v / self.weight for k, v in self.sums.items()}


class _CallWindow:
    """Slot of ``with_accumulation(n, mode='calls')``: calls and sums of the open window."""

    def __init__(self) -> None:
        self.calls = 0
        self.acc = _Accumulator()

    def state_dict(self) -> dict[str, Any]:
        if self.calls:
            raise RuntimeError(
                f"an accumulation window is open ({self.calls} call(s) with gradients not yet "
                "applied); call step.flush(state) or save at a window boundary"
            )
        return {"calls": 0}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.calls = int(saved["calls"])
        self.acc = _Accumulator()


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours a device ``found_inf`` flag (fused Adam/AdamW/SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups)


class _Guard:
    """Slot of the non-finite guard: skipped updates in total and in a row.

    With a fused optimizer the skip happens on the device and the flags are read one update
    later (:meth:`settle`), when they are long computed; otherwise :meth:`decide` reads them
    before the optimizer step.
    """

    def __init__(self) -> None:
        self.skipped = 0
        self.consecutive = 0
        self._pending: tuple[Any, ...] | None = None

    def decide(self, flags: Tensor, overflow_only: bool, update: int, policy: str,
               limit: int) -> bool:
        loss_bad, grads_bad = flags.tolist()  # the host read of a non-fused update
        return self._account(loss_bad, grads_bad, overflow_only, update, policy, limit)

    def defer(self, flags: Tensor, overflow_only: bool, update: int, policy: str,
              limit: int) -> None:
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flags
        self._pending = (host, event, overflow_only, update, policy, limit)

    def settle(self, state: TrainState) -> None:
        """Apply a deferred decision: count it, step the scheduler if the update was real."""
        if self._pending is None:
            return
        host, event, overflow_only, update, policy, limit = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        loss_bad, grads_bad = host.tolist()
        skipped = self._account(loss_bad, grads_bad, overflow_only, update, policy, limit)
        if not skipped and state.scheduler is not None:
            state.scheduler.step()

    def _account(self, loss_bad: bool, grads_bad: bool, overflow_only: bool, update: int,
                 policy: str, limit: int) -> bool:
        if not (loss_bad or grads_bad):
            self.consecutive = 0
            return False
        self.skipped += 1
        if not (loss_bad or not overflow_only):
            return True  # an fp16 overflow: the loss scale backs off, it is not divergence
        what = "loss" if loss_bad else "gradients"
        if policy == "raise":
            raise NonFiniteError(
                f"non-finite {what} at update {update}; no state was changed. Lower the "
                "learning rate, clip gradients, or use with_nonfinite(policy='skip') to skip "
                "such updates"
            )
        self.consecutive += 1
        if self.consecutive >= limit:
            raise NonFiniteError(
                f"{self.consecutive} updates in a row had a non-finite {what} (last at update "
                f"{update}); training diverged. Lower the learning rate or check the data"
            )
        return True

    def state_dict(self) -> dict[str, int]:
        if self._pending is not None:
            raise RuntimeError("call state.sync() before saving (a decision is pending)")
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.skipped, self.consecutive = int(saved["skipped"]), int(saved["consecutive"])
        self._pending = None


def _engine_option(transforms: tuple[Any, ...], attr: str, default: Any) -> Any:
    for t in transforms:
        if hasattr(t, attr):
            return getattr(t, attr)
    return default


class Step:
    """A training step: ``step(state, batch)`` runs exactly one optimizer update.

    Equivalent to the plain PyTorch loop body::

        out = fn(model, batch); loss = out if tensor else out["loss"]
        loss.backward()
        if all gradients and the loss are finite: optimizer.step(); scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    with each transform of the stack adding its part at a fixed place (see the module
    docstring), and returns a TensorDict of detached metrics left on the device.
    """

    def __init__(self, fn: LossFn, transforms: tuple[Any, ...] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"a step needs a callable fn(model, batch), got {type(fn).__name__}")
        self.fn = fn
        self.transforms = transforms
        names = [t.name for t in transforms]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(
                    f"{name} is applied twice in {describe(self)}; apply each transform once"
                )
        for t in transforms:
            validate = getattr(t, "validate", None)
            if callable(validate):
                validate(transforms)
        self._prepared: weakref.WeakKeyDictionary[TrainState, Prepared] = (
            weakref.WeakKeyDictionary()
        )
        acc = _engine_option(transforms, "accumulation", (1, "split"))
        self._micro, self._mode = acc
        policy = _engine_option(transforms, "nonfinite", ("skip", 10))
        self._policy, self._max_consecutive = policy
        self._forward_ctx = [t for _, t in _hooks(transforms, "forward_context")]
        self._micro_ctx = [t for _, t in _hooks(transforms, "micro_context")]
        self._scale = [t for _, t in _hooks(transforms, "scale_loss")]
        grad_steps = [(order, t.on_grads) for order, t in
                      _hooks(transforms, "on_grads", "grads_order")]
        grad_steps.append((10, _divide_grads))
        self._grad_steps = [hook for _, hook in sorted(grad_steps, key=lambda pair: pair[0])]
        self._on_update = [t for _, t in _hooks(transforms, "on_update")]
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    # ----------------------------------------------------------------- building
    def with_transform(self, transform: Any) -> Step:
        """A new step with ``transform`` added on the outside of this one."""
        if not isinstance(getattr(transform, "name", None), str):
            raise TypeError(
                f"{transform!r} is not a transform: it needs a string attribute 'name' "
                "(see accelfn.Transform)"
            )
        return Step(self.fn, (*self.transforms, transform))

    def __repr__(self) -> str:
        return describe(self)

    # ----------------------------------------------------------------- preparation
    def prepare(self, state: TrainState) -> Prepared:
        """Prepare ``state`` for this step (done once, lazily, by the first call)."""
        prepared = self._prepared.get(state)
        if prepared is None:
            prepared = Prepared(model=state.model, optimizer_step=state.optimizer.step,
                                device=state.device)
            for _, t in _hooks(self.transforms, "prepare", "prepare_order"):
                t.prepare(prepared, state)
            prepared.skips_on_device = _skips_on_device(state.optimizer)
            self._prepared[state] = prepared
        return prepared

    def _context(self, state: TrainState, micro: int) -> StepContext:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"a step is called as step(state, batch) with an accelfn.TrainState, got "
                f"{type(state).__name__}"
            )
        prepared = self.prepare(state)
        return StepContext(state=state, prepared=prepared, device=prepared.device,
                           num_micro_batches=micro)

    def _forward(self, ctx: StepContext) -> contextlib.AbstractContextManager[Any]:
        hooks = self._forward_ctx
        if not hooks:
            return _NULL
        if len(hooks) == 1:
            return hooks[0].forward_context(ctx)
        return _stacked([t.forward_context(ctx) for t in hooks])

    def _micro_context(self, ctx: StepContext, index: int,
                       sync: bool) -> contextlib.AbstractContextManager[Any]:
        hooks = self._micro_ctx
        if not hooks:
            return _NULL
        if len(hooks) == 1:
            return hooks[0].micro_context(ctx, index, sync)
        return _stacked([t.micro_context(ctx, index, sync) for t in hooks])

    # ----------------------------------------------------------------- the update
    def __call__(self, state: TrainState, batch: Batch) -> TensorDict:
        check_batch(batch)
        calls_mode = self._mode == "calls"
        n = 1 if calls_mode else self._micro
        micros = [batch] if n == 1 else split_batch(batch, n)
        ctx = self._context(state, n)
        window = state.slot("accumulation", _CallWindow) if calls_mode else None
        update = window is None or window.calls + 1 >= self._micro
        acc = window.acc if window is not None else _Accumulator()
        post_divide = calls_mode or ctx.distributed is not None
        total = batch_size(batch)
        weight_mode: bool | None = None
        try:
            for i, micro in enumerate(micros):
                sync = update and i == len(micros) - 1
                with self._micro_context(ctx, i, sync):
                    with self._forward(ctx):
                        out = self.fn(ctx.model, micro)
                    loss, weight, metrics = _unpack(out, first=i == 0 and acc.weight is None)
                    if weight_mode is None:
                        weight_mode = weight is not None
                    elif weight_mode != (weight is not None):
                        raise ValueError("the step function returned 'weight' for some "
                                         "micro-batches but not others; return it always")
                    coef: Tensor | float | None
                    if weight is not None and (n > 1 or post_divide):
                        coef = weight.detach().to(torch.float32)
                        post_divide = True
                    elif post_divide:
                        coef = float(batch_size(micro))
                    elif n > 1:
                        coef = batch_size(micro) / total
                    else:
                        coef = None
                    acc.add(coef, {"loss": loss, **metrics})
                    objective = loss if coef is None else loss * coef
                    for t in self._scale:
                        objective = t.scale_loss(objective, ctx)
                    objective.backward()
        except BaseException as error:
            if window is not None:
                window.calls, window.acc = 0, _Accumulator()
            state.optimizer.zero_grad(set_to_none=True)
            if isinstance(error, torch.OutOfMemoryError):
                raise _out_of_memory(self, error) from error
            raise
        if window is not None:
            window.calls += 1
            if not update:
                return TensorDict(acc.result(divide=True), batch_size=[])
            window.calls, window.acc = 0, _Accumulator()
        return self._update(ctx, acc, post_divide)

    def flush(self, state: TrainState) -> TensorDict | None:
        """Apply the update of a short final window in ``mode='calls'`` accumulation."""
        if self._mode != "calls":
            return None
        window = state.slot("accumulation", _CallWindow)
        if window.calls == 0:
            return None
        ctx = self._context(state, 1)
        acc = window.acc
        window.calls, window.acc = 0, _Accumulator()
        return self._update(ctx, acc, True)

    def _update(self, ctx: StepContext, acc: _Accumulator, post_divide: bool) -> TensorDict:
        state, optimizer = ctx.state, ctx.state.optimizer
        metrics = acc.result(divide=post_divide)
        ctx.loss = metrics["loss"]
        if post_divide:
            ctx.weight_total = torch.as_tensor(acc.weight, dtype=torch.float32,
                                               device=ctx.device)
            ctx.grad_divisor = ctx.weight_total
        guard = state.slot("nonfinite", _Guard)
        try:
            for hook in self._grad_steps:
                hook(ctx)
            flags = self._flags(ctx)
            guard.settle(state)  # the previous update's deferred decision (steps the scheduler)
            lr = optimizer.param_groups[0]["lr"]
            metrics["lr"] = (lr.detach().clone() if isinstance(lr, Tensor)
                             else torch.full((), float(lr), device=ctx.device))
            on_device = (flags is not None and self._policy != "raise"
                         and ctx.prepared.skips_on_device)
            skip = False
            if flags is not None and not on_device:
                skip = guard.decide(flags, ctx.grads_nonfinite is not None, state.step,
                                    self._policy, self._max_consecutive)
        except BaseException:
            optimizer.zero_grad(set_to_none=True)
            raise
        skip_flag: Tensor | None = None
        if on_device:
            skip_flag = flags.any()
            metrics["skipped"] = skip_float = skip_flag.float()
        elif flags is not None:  # decided on the host: no need to reduce the flags again
            metrics["skipped"] = torch.full((), float(skip), device=ctx.device)
            if self._on_update:
                skip_flag = metrics["skipped"].bool()
        elif self._on_update:
            skip_flag = torch.zeros((), dtype=torch.bool, device=ctx.device)
        if on_device:
            # A fused optimizer skips on the device: no host read now. The flags are read at
            # the next update (long computed by then), which also steps the scheduler.
            optimizer.found_inf = skip_float
            try:
                ctx.prepared.optimizer_step()
            finally:
                del optimizer.found_inf
            guard.defer(flags, ctx.grads_nonfinite is not None, state.step, self._policy,
                        self._max_consecutive)
        elif not skip:
            ctx.prepared.optimizer_step()
            if state.scheduler is not None:
                state.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        for t in self._on_update:
            t.on_update(ctx, skip_flag)  # type: ignore[arg-type]
        metrics.update(ctx.metrics)
        return TensorDict(metrics, batch_size=[])

    def _flags(self, ctx: StepContext) -> Tensor | None:
        """Device flags [loss non-finite, gradients non-finite], or None when not checked."""
        if self._policy == "off" and ctx.grads_nonfinite is None:
            return None
        # x * 0 is NaN exactly when x is NaN or +-Inf: two kernels where isfinite takes four
        if ctx.grads_nonfinite is not None:  # loss scaling already checked the gradients
            flags = torch.stack([ctx.loss.float().mul(0).ne(0), ctx.grads_nonfinite])
        elif ctx.grad_norm is not None:  # a NaN/Inf gradient makes the total norm NaN/Inf
            flags = torch.stack([ctx.loss.float(), ctx.grad_norm.float()]).mul_(0).ne_(0)
        else:
            grads_bad = _grads_nonfinite(ctx.local_grads(), ctx.device)
            flags = torch.stack([ctx.loss.float().mul(0).ne(0), grads_bad])
        if ctx.distributed is not None:  # every process takes the same decision
            flags = flags.to(torch.int32)
            torch.distributed.all_reduce(flags, torch.distributed.ReduceOp.MAX,
                                         group=ctx.distributed)
            flags = flags.bool()
        return flags

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, state: TrainState, batch: Batch, **options: Any) -> TensorDict:
        """The same forward as a training call (autocast, compiled), without gradients.

        The model is put in eval mode for the call and restored afterwards; metrics are
        weighted over micro-batches exactly as in training. ``options`` go to the transforms
        that declare them in ``evaluate_options`` (e.g. ``weights="ema"`` with ``with_ema``).
        """
        hooks = [t for t in self.transforms if callable(getattr(t, "evaluate_context", None))]
        known = {o: t for t in hooks for o in getattr(t, "evaluate_options", ())}
        unknown = sorted(set(options) - set(known))
        if unknown:
            offered = ", ".join(f"{o!r} ({known[o].name})" for o in sorted(known)) or "none"
            raise TypeError(f"evaluate() got unknown option(s) {unknown}; this step offers "
                            f"{offered}")
        check_batch(batch)
        n = 1 if self._mode == "calls" else self._micro
        micros = [batch] if n == 1 else split_batch(batch, n)
        ctx = self._context(state, n)
        acc = _Accumulator()
        model = ctx.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for t in hooks:
                    mine = {k: v for k, v in options.items()
                            if k in getattr(t, "evaluate_options", ())}
                    stack.enter_context(t.evaluate_context(ctx, **mine))
                for i, micro in enumerate(micros):
                    with self._forward(ctx):
                        out = self.fn(model, micro)
                    loss, weight, metrics = _unpack(out, first=i == 0)
                    coef = None if n == 1 else (
                        weight.to(torch.float32) if weight is not None
                        else float(batch_size(micro)))
                    acc.add(coef, {"loss": loss, **metrics})
        finally:
            model.train(was_training)
        return TensorDict(acc.result(divide=n > 1), batch_size=[])


_NULL = contextlib.nullcontext()


@contextlib.contextmanager
def _stacked(managers: list[contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _out_of_memory(step: Step, error: BaseException) -> torch.OutOfMemoryError:
    names = {t.name for t in step.transforms}
    advice = []
    n = step._micro if "with_accumulation" in names else 1
    advice.append(f"with_accumulation({2 * n}) (same update, half the activations)")
    if "checkpointed" not in names:
        advice.append("checkpointed (recompute block activations in backward)")
    if "with_amp" not in names:
        advice.append("with_amp (bf16 activations take half the memory)")
    advice.append("a smaller batch")
    return torch.OutOfMemoryError(
        f"out of memory in {describe(step)}; the model, optimizer and scheduler are unchanged "
        f"and gradients were cleared. Try: {'; '.join(advice)}. ({error})"
    )


def _divide_grads(ctx: StepContext) -> None:
    if ctx.grad_divisor is not None:
        grads = ctx.local_grads()
        if grads:
            torch._foreach_div_(grads, ctx.grad_divisor)


def _grads_nonfinite(grads: list[Tensor], device: torch.device) -> Tensor:
    """A device flag: does any gradient hold NaN or Inf (one fused pass, values unchanged)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    if not grads:
        return found.bool()
    one = torch.ones((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in groups.items():
        flag = found if dev == device else torch.zeros((), device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one.to(dev))
        if flag is not found:
            found += flag.to(device)
    return found > 0


def lift(fn: LossFn | Step) -> Step:
    """The step of ``fn`` with no transform (a step is returned unchanged)."""
    if isinstance(fn, Step):
        return fn
    if not callable(fn):
        raise TypeError(
            f"transforms wrap a function fn(model, batch) -> loss, got {type(fn).__name__}"
        )
    return Step(fn)


def apply_transform(fn: LossFn | Step, transform: Any) -> Step:
    """Add ``transform`` on the outside of ``fn`` (a plain function is lifted first)."""
    return lift(fn).with_transform(transform)


def describe(step: Step | Callable[..., Any]) -> str:
    """The stack as text, outermost first: ``compiled ∘ with_amp(bf16) ∘ my_step``."""
    if not isinstance(step, Step):
        return getattr(step, "__name__", repr(step))
    parts = [repr(t) for t in reversed(step.transforms)]
    return " ∘ ".join([*parts, getattr(step.fn, "__name__", type(step.fn).__name__)])


def configurable(name: str, build: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ``build(**options) -> transform`` into a transform usable bare or configured.

    ``name(fn)`` applies the transform with default options; ``name(**options)(fn)`` with
    options, which are checked when the transform is built, before any function is given.
    """

    def decorator(fn: LossFn | Step | None = None, /, **options: Any) -> Any:
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name}() takes options by keyword only: write {name}(option=...)(fn), "
                f"not {name}({fn!r})"
            )
        transform = build(**options)
        if fn is None:
            return lambda f: apply_transform(f, transform)
        return apply_transform(fn, transform)

    decorator.__name__ = decorator.__qualname__ = name
    decorator.__doc__ = build.__doc__
    options = inspect.signature(build).parameters.values()
    decorator.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("fn", inspect.Parameter.POSITIONAL_ONLY, default=None),
         *(o.replace(kind=inspect.Parameter.KEYWORD_ONLY) for o in options)])
    return decorator
