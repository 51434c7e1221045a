"""What a step is made of: transforms, user gradient transforms, and what they are handed.

A [`Transform`][] is an immutable value: a name, the options it was built with, and its
*part*: a built-in fills its one place of the update (see [`accelfn.core.places`][]); a
[`GradientTransform`][] is the user's extension, run in stacking order between the reduction
of the gradients and clipping. Transforms keep their state in the
:class:`~accelfn.core.state.TrainState`, never on themselves, so a transform is a value that
can sit in any number of stacks.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .batch import Batch
from .state import TrainState

if TYPE_CHECKING:
    from .engine import Step

__all__ = ["CallContext", "Chained", "GradientTransform", "Plan", "Prepared", "Transform",
           "UpdateContext"]

#: (grads, params, state) -> the new state, or None to keep it (grads edited in place)
GradientUpdate = Callable[[list[Tensor], list[Tensor], Any], Any]
#: (params, state) -> None: changes the parameters after the optimizer step
AfterStep = Callable[[list[Tensor], Any], None]


@dataclass(frozen=True, eq=True, init=False)
class Transform:
    """A transform: an immutable value naming its options and the part of the update it fills.

    ``transform(fn)`` is the step ``fn`` with this transform added outermost (``fn`` a step
    function or a step). Every transform is one: the built-ins (``with_clipping(max_norm=1)``
    is one), the user's, and a [`chain`][accelfn.chain] of the user's. The user's edit the
    gradients of each update, as optax's gradient transformations:

        af.Transform(name, update=update, init=None, label="", after_step=None)

    ``update(grads, params, state)`` edits ``grads`` in place and returns the new state (None:
    keep it); ``init(params)`` makes the first state; ``after_step(params, state)`` changes the
    parameters after the optimizer step (a projection, a constraint), skipped with the update
    (given alone, without ``update``, the gradients are left as they are). See
    [`GradientTransform`][] for the rules, docs/writing-a-transform.md for a guide.

    A built-in is ``Transform(name, part, options, label)``, ``part`` its place in the update
    (one of [`accelfn.core.places`][]'s types). Two transforms are equal when their name,
    options and label are equal (the part is made from the options).
    """

    name: str
    part: Any = field(compare=False)  # its functions are closures of the options
    options: tuple[tuple[str, Any], ...] = ()
    label: str = ""

    def __init__(self, name: str, part: Any = None, options: tuple[tuple[str, Any], ...] = (),
                 label: str = "", *, update: GradientUpdate | None = None,
                 init: Callable[[list[Tensor]], Any] | None = None,
                 after_step: AfterStep | None = None) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"a transform's name must be an identifier string, got {name!r}")
        if update is not None or init is not None or after_step is not None:
            if part is not None or options:
                raise TypeError(f"Transform({name!r}, update=...) makes a gradient transform: "
                                "give update=, init=, after_step= and label=, without a part "
                                "or options")
            if update is None and after_step is not None:  # a place after the step only
                update = _keep
            part = GradientTransform(name, update, init, label,  # type: ignore[arg-type]
                                     after_step=after_step)
            options, label = part.options, label or name
        elif part is None:
            raise TypeError(f"Transform({name!r}) needs update=: a function update(grads, "
                            "params, state) that edits the gradients in place (see "
                            "docs/writing-a-transform.md)")
        elif callable(part) and not hasattr(type(part), "__dataclass_fields__"):
            raise TypeError(f"Transform({name!r}, {part!r}): give a gradient transform's "
                            f"functions by keyword: Transform({name!r}, update=fn, init=...)")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "part", part)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "label", label)

    def __repr__(self) -> str:
        return self.label or self.name

    def __call__(self, fn: Callable[..., Any] | Step) -> Step:
        """The step ``fn`` with this transform added outermost (a chain's transforms added
        one by one, in written order: ``chain(a, b)(fn)`` is ``b(a(fn))``)."""
        from .engine import lift

        step = lift(fn)
        if isinstance(self.part, Chained):
            for member in self.part.members:
                step = step.with_transform(member)
            return step
        return step.with_transform(self)


def _keep(grads: list[Tensor], params: list[Tensor], state: Any) -> None:
    """The update of a transform given only ``after_step``: the gradients as they are."""


@dataclass(frozen=True)
class Chained:
    """The part of [`chain`][accelfn.chain]``(a, b, ...)``: its gradient transforms, in the
    order they run."""

    members: tuple[Transform, ...]


def _check_arity(name: str, what: str, fn: Any, n: int, signature_text: str) -> None:
    if not callable(fn):
        raise TypeError(f"GradientTransform {name!r}: {what} must be a function "
                        f"{signature_text}, got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(*range(n))
    except TypeError:
        raise TypeError(f"GradientTransform {name!r}: {what} must take {n} positional "
                        f"argument(s) {signature_text}, but its signature is {signature}"
                        ) from None


@dataclass(frozen=True, eq=True)
class GradientTransform:
    """The part a user's [`Transform`][] fills: ``af.Transform(name, update=..., ...)`` holds
    one; ``af.GradientTransform(name, update, init, label, after_step)`` is the same
    transform, spelled as before the two were one type (stackable as it is).

    Three concepts, as optax's gradient transformations: a ``name``; ``update(grads, params,
    state)``, which edits ``grads`` in place (the gradients the optimizers will apply, each
    beside its parameter in ``params``) and returns the new state (or None to keep it); and
    the state, made by ``init(params)`` at the first update (a dict of tensors and plain data,
    or an object with ``state_dict``/``load_state_dict``; None without ``init``). The state
    lives in the ``TrainState`` under ``"gradients.<name>"``: checkpointed and resumed with it.

    It runs after loss-scale unscaling, micro-batch weighting and the reduction across
    processes, before clipping and the non-finite decision, so it sees the true gradient of
    the update. Several run in the order they were stacked: ``b(a(fn))``, or
    ``chain(a, b)(fn)``, runs ``a`` then ``b``. After each, every gradient must have its
    parameter's shape, dtype and device, and no parameter may have been written (their
    version counters are compared): else the call fails naming it, before any optimizer
    state changes. The new state is kept with the update: not when the call fails before the
    optimizer step, nor when the update is skipped on the host (a skip decided on the device
    by fused optimizers keeps it); do not write to the state you are given (return a new
    one), so that a failed call leaves it as it was. ``label`` is how the stack prints it
    (``describe``) and checkpoints name it: put its options in it.

    ``after_step(params, state)``, when given, runs right after the optimizer step, under
    ``torch.no_grad()``, with the same ``params`` and the state this update kept: the place
    for a projection or a constraint of the weights (several in the order of their
    transforms). It does not run when the update is skipped on the host; a skip decided on
    the device (fused optimizers) cannot be seen without waiting for it, so there it runs on
    the unchanged weights.

        def clip_by_weight(grads, params, state):    # each gradient to 1% of its weight
            for g, p in zip(grads, params):
                limit = 0.01 * p.detach().norm().clamp_min(1e-3)
                g.mul_((limit / g.norm().clamp_min(1e-6)).clamp(max=1.0))

        step = af.Transform("clip_by_weight", update=clip_by_weight)(my_step)
    """

    name: str
    update: GradientUpdate
    init: Callable[[list[Tensor]], Any] | None = None
    label: str = ""  # how the stack prints it, with its options: "noise(0.01)"
    after_step: AfterStep | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise TypeError("a GradientTransform's name must be an identifier string, got "
                            f"{self.name!r}")
        _check_arity(self.name, "update", self.update, 3, "(grads, params, state)")
        if self.init is not None:
            _check_arity(self.name, "init", self.init, 1, "(params)")
        if self.after_step is not None:
            _check_arity(self.name, "after_step", self.after_step, 2, "(params, state)")

    @property
    def slot(self) -> str:
        """The TrainState slot its state is kept under."""
        return f"gradients.{self.name}"

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        """Its functions, as the options of the [`Transform`][] that holds it."""
        found = (("update", self.update), ("init", self.init))
        return found if self.after_step is None else (*found, ("after_step", self.after_step))

    def transform(self) -> Transform:
        """This gradient transform as a stackable [`Transform`][]."""
        return Transform(self.name, self, options=self.options, label=self.label or self.name)

    def __call__(self, fn: Callable[..., Any] | Step) -> Step:
        """The step ``fn`` with this gradient transform added outermost."""
        return self.transform()(fn)


# ---------------------------------------------------------------------------------- contexts
@dataclass(frozen=True, slots=True)
class Prepared:
    """What a [`TrainState`][] looks like to a step after preparation (immutable).

    Each preparing part returns a new one (``dataclasses.replace``). Fields and their owners:
    ``model`` (what ``fn`` receives: the state's model itself, every technique applied to it
    in place), ``call`` (sharding: runs a call of the step function as the model's forward,
    so DDP's and FSDP2's forward hooks wrap the whole function, whichever submodules and
    methods it calls; None: called as it is), ``optimizer_step``
    (compilation may replace it), ``device`` (the engine), ``compute_dtype`` (mixed
    precision: the autocast dtype of the forward, None in fp32), ``process_group``
    (sharding: the group gradients are reduced over, None in one process),
    ``skips_on_device`` (the engine: the optimizer honours a device ``found_inf`` flag),
    ``parameters`` (the engine: the state's model's parameters in ``model.parameters()``
    order once prepared, and ``held``, how many parameters its optimizers held then; see
    [`CallContext.parameters`][]).
    """

    model: nn.Module
    optimizer_step: Callable[[], object]
    device: torch.device
    call: Callable[[Callable[[], Any]], Any] | None = None
    compute_dtype: torch.dtype | None = None
    process_group: Any = None
    skips_on_device: bool = False
    parameters: tuple[Tensor, ...] = ()
    held: int = -1


def held(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """How many parameters ``optimizers`` hold (``add_param_group`` changes it)."""
    return sum(len(group["params"]) for o in optimizers for group in o.param_groups)


@dataclass(slots=True)
class CallContext:
    """Handed to the parts of a call: the state, its preparation, and whether this is training."""

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
        """Every optimizer of the state, in order."""
        return self.state.optimizers

    def parameters(self) -> tuple[Tensor, ...]:
        """``tuple(state.model.parameters())``: the model's parameters in their order (what
        ``clip_grad_norm_(model.parameters())`` sums over), walked once when the state was
        prepared and again only when its optimizers' parameters changed since (a module
        walk costs more than a small model's clip)."""
        prepared = self.prepared
        if prepared.held == held(self.state.optimizers):
            return prepared.parameters
        return tuple(self.state.model.parameters())


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
    """How one call is computed: the accumulation part's answer (one micro-batch without it).

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
    """The non-finite decision of an update.

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
    """Handed to the update's parts (unscaling to after the update). Fields and owners:

    ``loss`` (the engine: the weighted mean loss of the update, a device scalar);
    ``metrics`` (every part may add device scalars; they are returned with the step's);
    ``divisor`` (the engine sets the local weight total when micro-batches are weighted
    absolutely; the sharding part may replace it, the engine divides the gradients by it after
    the reduction); ``weight_total`` (likewise: the weight summed over processes).
    """

    __slots__ = ("divisor", "loss", "metrics", "weight_total")

    def __init__(self, state: TrainState, prepared: Prepared, loss: Tensor) -> None:
        self.state = state  # CallContext's fields, without a call per update
        self.prepared = prepared
        self.training = True
        self.loss = loss
        self.metrics: dict[str, Tensor] = {}
        self.divisor: Tensor | None = None
        self.weight_total: Tensor | None = None

    def grads(self) -> list[Tensor]:
        """The gradients the optimizers will apply (parameters without one are left out)."""
        return [p.grad for o in self.state.optimizers for g in o.param_groups
                for p in g["params"] if p.grad is not None]

    def params_with_grads(self) -> tuple[list[Tensor], list[Tensor]]:
        """(gradients, parameters) of the parameters the optimizers will update, aligned."""
        params = [p for o in self.state.optimizers for g in o.param_groups
                  for p in g["params"] if p.grad is not None]
        return [p.grad for p in params], params  # type: ignore[misc]

    def local_grads(self) -> list[Tensor]:
        """[`grads`][] as plain tensors: this process' shard of sharded (DTensor) ones."""
        out = []
        for g in self.grads():
            to_local = getattr(g, "to_local", None)
            out.append(to_local() if callable(to_local) else g)
        return out


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
