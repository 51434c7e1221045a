"""The transform types: a [`Transform`][] (a built-in, or the user's extension of the update) and
the user's [`GradientTransform`][], [`Chained`][] transforms, and ``configure`` (a built-in's
bare and configured forms).

A [`Transform`][] is an immutable value: a name, the options it was built with, and its
*part*: a built-in fills its one place of the update (see [`accelfn.step.spec`][]); a
[`GradientTransform`][] is the user's extension, run in stacking order between the reduction
of the gradients and clipping. Transforms keep their state in the
:class:`~accelfn.core.state.TrainState`, never on themselves, so a transform is a value that
can sit in any number of stacks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from .engine import Step

__all__ = ["Chained", "GradientTransform", "Transform", "builtin", "configure"]

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
    (one of [`accelfn.step.spec`][]'s types). Two transforms are equal when their name,
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


def builtin(name: str, options: Any) -> Transform:
    """The transform ``name`` of a built-in's ``options`` (a frozen dataclass of
    ``accelfn.parts``): its fields are the transform's options, its repr the label."""
    found = tuple((f.name, getattr(options, f.name)) for f in fields(options))
    return Transform(name, options, options=found, label=repr(options))


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
