"""The transform protocol: the phases, the hooks a transform may declare, and their contexts.

A transform is an immutable :class:`Transform` record: a name, the options it was built with,
and a :class:`Hooks` mapping from phase to function. The phases are written down once, here,
in the order the engine runs them (see :data:`PHASES`); a hook's phase is its key, so there is
nothing to guess and nothing to misspell silently: an unknown key or a hook of the wrong
arity is a ``TypeError`` when the transform is built.

Per call, hooks receive contexts whose every field has one owner (written in its docstring):
the engine, or the phase that may replace it. Hooks keep their state in the
:class:`~accelfn.core.state.TrainState` (``ctx.state.slot(name, factory)``), never on the
transform, so a transform is a value that can sit in any number of stacks.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor, nn

from .batch import Batch
from .state import TrainState

if TYPE_CHECKING:
    from .engine import Step

__all__ = [
    "PHASES",
    "CallContext",
    "Decision",
    "Hooks",
    "Plan",
    "Prepared",
    "Sums",
    "Transform",
    "UpdateContext",
]

# ------------------------------------------------------------------------------------ phases
#: Every phase, in the order the engine runs it, with the hook signature it takes.
#: ``ordered`` phases run their hooks one after another, so two transforms filling the same
#: one must both declare that they commute (see :attr:`Transform.commutes`); they then run in
#: the order of their names, whatever the stacking order.
PHASES: tuple[tuple[str, str, str], ...] = (
    # (name, when, signature)
    ("check", "check", "(state) -> None: refuse the state before any prepare phase changes it"),
    ("convert", "prepare", "(prepared, state) -> Prepared: module swaps (float8 Linear layers)"),
    ("islands", "prepare", "(prepared, state) -> Prepared: fp32 islands, compute dtype"),
    ("checkpoint", "prepare", "(prepared, state) -> Prepared: activation checkpointing"),
    ("shard", "prepare", "(prepared, state) -> Prepared: DDP/FSDP wrapping, process group"),
    ("compile", "prepare", "(prepared, state) -> Prepared: torch.compile"),
    ("average", "prepare", "(prepared, state) -> Prepared: EMA copies of the final weights"),
    ("split", "call", "(ctx, batch) -> Plan: the micro-batches of this call"),
    ("micro_context", "call", "(ctx, index, sync) -> context manager around fwd+bwd"),
    ("forward_context", "call", "(ctx) -> context manager around each forward"),
    ("scale_loss", "call", "(ctx, loss) -> Tensor to differentiate"),
    ("unscale", "update", "(ctx) -> None: undo loss scaling"),
    ("reduce", "update", "(ctx) -> None: cross-process weights (the engine divides after)"),
    ("gradients", "update", "(ctx) -> None: user gradient transforms"),
    ("clip", "update", "(ctx) -> None: clipping"),
    ("decide", "update", "(ctx) -> Decision: skip the update or not"),
    ("after_update", "update", "(ctx, skipped) -> None: after the optimizer step"),
    ("flush", "other", "(ctx) -> Sums | None: the open window of a call-counting split"),
    ("evaluate_context", "other", "(ctx, options) -> context manager around evaluate()"),
    ("abort", "other", "(ctx) -> None: undo this call's partial work after an error"),
)
PREPARE_PHASES = tuple(name for name, when, _ in PHASES if when == "prepare")
GRADIENT_PHASES = ("unscale", "reduce", "gradients", "clip")
_ARITY = {"split": 2, "micro_context": 3, "scale_loss": 2, "after_update": 2,
          "evaluate_context": 2, **{p: 2 for p in PREPARE_PHASES}}
#: Phases a stack may fill once at most whatever it declares: two of them cannot both run.
EXCLUSIVE = frozenset({"split", "flush", "decide", "scale_loss", "unscale", "shard", "compile"})
#: Phases whose hooks each see to their own transform only (a check of the state before it is
#: prepared; undoing a failed call's partial work): they run in the order of the transforms'
#: names and need no ``commutes`` declaration.
INDEPENDENT = frozenset({"abort", "check"})


class Hooks(TypedDict, total=False):
    """The hooks a transform implements, keyed by the phase each belongs to (see PHASES)."""

    check: Callable[[TrainState], object]  # what it returns is ignored
    convert: Callable[[Prepared, TrainState], Prepared]
    islands: Callable[[Prepared, TrainState], Prepared]
    checkpoint: Callable[[Prepared, TrainState], Prepared]
    shard: Callable[[Prepared, TrainState], Prepared]
    compile: Callable[[Prepared, TrainState], Prepared]
    average: Callable[[Prepared, TrainState], Prepared]
    split: Callable[[CallContext, Batch], Plan]
    micro_context: Callable[[CallContext, int, bool], contextlib.AbstractContextManager[Any]]
    forward_context: Callable[[CallContext], contextlib.AbstractContextManager[Any]]
    scale_loss: Callable[[CallContext, Tensor], Tensor]
    unscale: Callable[[UpdateContext], None]
    reduce: Callable[[UpdateContext], None]
    gradients: Callable[[UpdateContext], None]
    clip: Callable[[UpdateContext], None]
    decide: Callable[[UpdateContext], Decision]
    after_update: Callable[[UpdateContext, Tensor], None]
    flush: Callable[[CallContext], Sums | None]
    evaluate_context: Callable[[CallContext, Mapping[str, Any]],
                               contextlib.AbstractContextManager[Any]]
    abort: Callable[[CallContext], None]


_VALID = tuple(name for name, _, _ in PHASES)


def _check_hooks(name: str, hooks: Mapping[str, Any]) -> None:
    for key, hook in hooks.items():
        if key not in _VALID:
            raise TypeError(
                f"transform {name!r} declares an unknown hook {key!r}; the hooks are "
                f"{', '.join(_VALID)} (accelfn.core.protocol.PHASES says when each runs)")
        if not callable(hook):
            raise TypeError(f"transform {name!r}: hook {key!r} is {hook!r}, not a function")
        want = _ARITY.get(key, 1)
        try:
            signature = inspect.signature(hook)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            continue
        try:
            signature.bind(*range(want))
        except TypeError:
            spec = next(s for n, _, s in PHASES if n == key)
            raise TypeError(
                f"transform {name!r}: hook {key!r} must take {want} positional argument(s) "
                f"{spec.split(' ->')[0]}, but its signature is {signature}") from None


@dataclass(frozen=True, eq=True)
class Transform:
    """A transform: an immutable value naming its options and the hooks it implements.

    Apply it to a step function with ``transform(fn)`` (or ``accelfn.apply_transform``).
    Two transforms are equal when their name, options and declarations are equal.

    ``commutes`` is True when every hook of this transform commutes with any other
    transform's hook in the same phase, or the names of the transforms it commutes with.
    ``preserves_finite`` declares that its gradient hooks (unscale, reduce, gradients, clip)
    only multiply gradients by finite factors, so a finiteness check made before them still
    holds after them; otherwise the non-finite guard checks the gradients again.
    ``evaluate_options`` are the keyword options of ``step.evaluate`` this transform takes.
    """

    name: str
    hooks: Hooks = field(default_factory=lambda: Hooks(), compare=False)
    options: tuple[tuple[str, Any], ...] = ()
    label: str = ""
    commutes: bool | frozenset[str] = False
    preserves_finite: bool = False
    evaluate_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise TypeError(f"a transform's name must be an identifier string, got {self.name!r}")
        if not isinstance(self.hooks, Mapping):
            raise TypeError(f"transform {self.name!r}: hooks must be an accelfn.Hooks mapping "
                            f"of phase to function, got {type(self.hooks).__name__}")
        _check_hooks(self.name, self.hooks)
        if "evaluate_context" not in self.hooks and self.evaluate_options:
            raise TypeError(f"transform {self.name!r} declares evaluate_options without an "
                            "evaluate_context hook to receive them")
        if not isinstance(self.commutes, bool):
            object.__setattr__(self, "commutes", frozenset(self.commutes))

    def __repr__(self) -> str:
        return self.label or self.name

    def commutes_with(self, other: Transform) -> bool:
        """Whether this transform declares that it commutes with ``other``."""
        if isinstance(self.commutes, bool):
            return self.commutes
        return other.name in self.commutes

    def __call__(self, fn: Callable[..., Any] | Step) -> Step:
        """The step ``fn`` with this transform added outermost."""
        from .engine import lift

        return lift(fn).with_transform(self)


# ---------------------------------------------------------------------------------- contexts
@dataclass(frozen=True, slots=True)
class Prepared:
    """What a [`TrainState`][] looks like to a step after preparation (immutable).

    Each prepare phase returns a new one (``dataclasses.replace``). Fields and their owners:
    ``model`` (what ``fn`` receives: every prepare phase may wrap it), ``optimizer_step``
    (the ``compile`` phase may replace it), ``device`` (the engine), ``compute_dtype`` (the
    ``islands`` phase: the autocast dtype of the forward, None in fp32), ``process_group``
    (the ``shard`` phase: the group gradients are reduced over, None in one process),
    ``skips_on_device`` (the engine: the optimizer honours a device ``found_inf`` flag).
    """

    model: nn.Module
    optimizer_step: Callable[[], object]
    device: torch.device
    compute_dtype: torch.dtype | None = None
    process_group: Any = None
    skips_on_device: bool = False


@dataclass(slots=True)
class CallContext:
    """Handed to per-call hooks: the state, its preparation, and whether this is training."""

    state: TrainState
    prepared: Prepared
    training: bool = True

    @property
    def model(self) -> nn.Module:
        return self.prepared.model

    @property
    def device(self) -> torch.device:
        return self.prepared.device

    @property
    def distributed(self) -> Any:
        """The process group gradients are reduced over, or None in a single process."""
        return self.prepared.process_group

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The state's optimizer when it has one (see [`optimizers`][])."""
        return self.state.optimizer

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return self.state.optimizers


class Sums:
    """Weighted sums of loss and metrics over micro-batches, kept on the device.

    Terms are collected as they come and summed once, when the result is read (one stack
    and one sum per metric, not an addition per micro-batch).
    """

    __slots__ = ("_coefs", "_terms")

    def __init__(self) -> None:
        self._terms: dict[str, list[Tensor]] = {}
        self._coefs: list[Tensor | float] = []

    def add(self, coef: Tensor | float | None, values: Mapping[str, Tensor],
            weighted: Mapping[str, Tensor] | None = None) -> None:
        """Add ``coef * value`` for each of ``values`` (detached), and the terms of
        ``weighted`` as they are (already multiplied by ``coef``). ``coef=None``: one
        unweighted micro-batch."""
        terms = self._terms
        for key, value in values.items():
            term = value.detach() if coef is None else value.detach() * coef
            terms.setdefault(key, []).append(term)
        for key, value in (weighted or {}).items():
            terms.setdefault(key, []).append(value.detach())
        if coef is not None:
            self._coefs.append(coef)

    def loss_terms(self) -> tuple[list[Tensor], list[Tensor | float]]:
        """The lists the engine appends a plain micro-batch loss to: its weighted loss
        (detached) and its coefficient (unless None), as ``add(coef, {}, {"loss": weighted})``
        does, without a mapping and a call per micro-batch."""
        terms = self._terms.get("loss")
        if terms is None:
            terms = self._terms["loss"] = []
        return terms, self._coefs

    @property
    def empty(self) -> bool:
        """Whether nothing was added yet (the first micro-batch of a window)."""
        return not self._terms

    @property
    def weight(self) -> Tensor | float | None:
        """The sum of the coefficients added so far (None when unweighted)."""
        coefs = self._coefs
        if not coefs:
            return None
        if len(coefs) == 1:
            return coefs[0]
        if any(isinstance(c, Tensor) for c in coefs):
            return torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in coefs]).sum()
        return sum(coefs)  # type: ignore[arg-type]

    def result(self, divide: bool) -> dict[str, Tensor]:
        """The sums, divided by the total weight when ``divide`` (the weighted means)."""
        out = {k: v[0] if len(v) == 1 else torch.stack(v).sum(0) for k, v in self._terms.items()}
        weight = self.weight if divide else None
        if weight is None:
            return out
        return {k: v / weight for k, v in out.items()}


@dataclass(frozen=True, slots=True)
class Plan:
    """The ``split`` phase's answer: how one call is computed.

    ``micros`` are run forward and backward in order. ``update`` says whether the call ends
    with an optimizer update. ``sums`` carries the running metric sums across calls (a
    call-counting split keeps them in its state; None: fresh for this call). ``absolute``
    weights micro-batches by their sample count (or ``"weight"``) and divides the gradients
    by the total at the update, instead of weighting by the share of this call's batch.
    ``dim`` is the batch dimension samples are counted along (1 for time-major batches).
    ``sizes``, when the split knows them, are the micro-batches' sample counts along ``dim``
    (the engine counts them otherwise). ``calls`` is how many calls one update spans (a
    call-counting split gives its ``n``): under loss scaling the engine counts absolute
    weights in a power of two near an update's total, estimated once as the first
    micro-batch's weight times micro-batches times calls (``accelfn.core.units``).
    """

    micros: Sequence[Batch]
    update: bool = True
    sums: Sums | None = None
    absolute: bool = False
    dim: int = 0
    sizes: Sequence[int] | None = None
    calls: int = 1

    def __post_init__(self) -> None:
        if type(self.calls) is not int or self.calls < 1:
            raise ValueError(f"Plan(calls={self.calls!r}) must be an int >= 1: the calls one "
                             "update spans (1 unless the split counts calls)")


@dataclass(frozen=True, slots=True)
class Decision:
    """The ``decide`` phase's answer.

    ``skip`` is the decision taken on the host; or None to leave it to the device: then
    ``flags`` is a device bool tensor and the optimizer skips on ``flags.any()`` through its
    ``found_inf`` input (fused optimizers only), the transform settling its counters later
    (``TrainState.sync``). ``checked=False`` says nothing was checked: the update is applied
    and no ``skipped`` metric is reported.
    """

    skip: bool | None = False
    flags: Tensor | None = None
    checked: bool = True

    def __post_init__(self) -> None:
        if self.skip is None and self.flags is None:
            raise ValueError("Decision(skip=None) leaves the decision to the device and needs "
                             "the device flags: Decision(None, flags=...)")


class UpdateContext(CallContext):
    """Handed to the update's hooks (``unscale`` to ``after_update``). Fields and owners:

    ``loss`` (the engine: the weighted mean loss of the update, a device scalar);
    ``metrics`` (every hook may add device scalars; they are returned with the step's);
    ``divisor`` (the engine sets the local weight total when micro-batches are weighted
    absolutely; ``reduce`` hooks may replace it, the engine divides the gradients by it after
    the ``reduce`` phase); ``weight_total`` (likewise: the weight summed over processes).
    Facts about the gradients ([`report_overflow`][], [`report_norm`][]) are kept with
    the gradients' version: any hook not declared ``preserves_finite`` makes them stale.
    """

    __slots__ = ("_facts", "_version", "divisor", "loss", "metrics", "weight_total")

    def __init__(self, state: TrainState, prepared: Prepared, loss: Tensor) -> None:
        self.state = state  # CallContext's fields, without a call per update
        self.prepared = prepared
        self.training = True
        self.loss = loss
        self.metrics: dict[str, Tensor] = {}
        self.divisor: Tensor | None = None
        self.weight_total: Tensor | None = None
        self._version = 0
        self._facts: dict[str, tuple[Tensor, int]] = {}

    def grads(self) -> list[Tensor]:
        """The gradients the optimizer will apply (parameters without one are left out)."""
        return [p.grad for o in self.state.optimizers for g in o.param_groups
                for p in g["params"] if p.grad is not None]

    def local_grads(self) -> list[Tensor]:
        """[`grads`][] as plain tensors: this process' shard of sharded (DTensor) ones."""
        out = []
        for g in self.grads():
            to_local = getattr(g, "to_local", None)
            out.append(to_local() if callable(to_local) else g)
        return out

    def grads_written(self) -> None:
        """Declare that the gradients changed in a way that may make them non-finite."""
        self._version += 1

    def report_overflow(self, found: Tensor) -> None:
        """A device bool: unscaling found NaN/Inf in the gradients as they are now."""
        self._facts["overflow"] = (found, self._version)

    def report_norm(self, norm: Tensor) -> None:
        """The total norm of the gradients as they are now (NaN/Inf if any is)."""
        self._facts["norm"] = (norm, self._version)

    def fact(self, kind: str, current: bool = True) -> Tensor | None:
        """A reported fact (``"overflow"`` or ``"norm"``); with ``current``, only while no
        hook wrote the gradients after it was reported."""
        found = self._facts.get(kind)
        if found is None or (current and found[1] != self._version):
            return None
        return found[0]


@contextlib.contextmanager
def entered(managers: Sequence[contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """Enter ``managers`` in order (the first outermost)."""
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield



def configure(name: str, fn: Callable[..., Any] | Step | None,
              transform: Transform) -> Step | Transform:
    """``name(fn)`` applies ``transform`` (built with default options); ``name(**options)``
    returns it, to apply later. Refuses a positional option with the fix."""
    if fn is None:
        return transform
    if not callable(fn):
        raise TypeError(f"{name}() takes options by keyword only: write {name}(option=...)(fn), "
                        f"not {name}({fn!r})")
    return transform(fn)
