"""The contract kit: test a transform, yours or a built-in, the way accelfn tests its own.

    from accelfn.testing import check_transform, plain_update

    def by_hand(model, optimizer, batch):          # what the transform is equivalent to
        plain_update(model, optimizer, batch, loss_fn, edit_grads=my_gradient_edit)

    check_transform(with_my_thing(), reference=by_hand)

[`plain_update`][] is one update of the plain PyTorch loop (forward, backward, an optional
edit of the gradients, ``optimizer.step()``, ``zero_grad(set_to_none=True)``); it uses torch
only. [`check_transform`][] runs the contract on a transform (a
[`GradientTransform`][accelfn.GradientTransform] or a built-in): equivalence to the reference
you give (parameters, buffers and optimizer state, bitwise; the batches left as they were),
every stacking order with the built-ins, ``state_dict`` round trip and exact resume, purity
(reuse in two stacks, and two states trained one after the other and in turn), no host sync
in any step, and a refused bad input or a call failing half-way (in the loss function, or in
the optimizer step after the gradient transforms ran) leaving every piece of state intact.
Each check raises ``AssertionError`` saying what differed; a check that could not run (every
stacking order refused) fails too.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor, nn

from ..core.state import TrainState
from ..observe.sync_probe import SyncProbe
from ..step.chain import GradientTransformError
from ..step.engine import Step, apply_transform
from ..step.extension import GradientTransform, Transform
from ..transforms.accumulation import with_accumulation
from ..transforms.amp import with_amp
from ..transforms.clipping import with_clipping
from .reference import plain_update
from .tape import TapeRecorder

__all__ = ["ContractReport", "TapeRecorder", "check_transform", "plain_update"]

LossFn = Callable[[nn.Module, Any], Any]
Reference = Callable[[nn.Module, torch.optim.Optimizer, Any], None]


# ------------------------------------------------------------------------ the default problem
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16),
                                                    nn.GELU()) for _ in range(2)))
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x)))  # type: ignore[no-any-return]


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _make_batch(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"x": torch.randn(12, 6, generator=g),
                       "y": torch.randint(0, 4, (12,), generator=g)}, batch_size=[12])


def _loss(model: nn.Module, batch: Any) -> dict[str, Tensor]:
    logits = model(batch["x"])
    return {"loss": F.cross_entropy(logits, batch["y"])}


@dataclass
class ContractReport:
    """What [`check_transform`][] ran: the checks passed, the orders compared, and the
    checks that do not apply to the transform, with why (``not_applicable``)."""

    transform: str
    passed: list[str] = field(default_factory=list)
    orders: int = 0
    not_applicable: list[str] = field(default_factory=list)


def _params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, Tensor]]:
    """What an update changes: the model's parameters and buffers (``state_dict()``) and the
    optimizer's state (momentum buffers, step counts), as named copies."""
    named = [(f"model {k!r}", v) for k, v in model.state_dict().items()]
    for index, per_param in sorted(optimizer.state_dict()["state"].items(), key=str):
        named += [(f"optimizer state {index} {k!r}", v) for k, v in sorted(per_param.items())
                  if isinstance(v, Tensor)]
    return [(name, v.detach().clone()) for name, v in named]


def _assert_same(a: Sequence[tuple[str, Tensor]], b: Sequence[tuple[str, Tensor]],
                 what: str) -> None:
    names, others = [n for n, _ in a], [n for n, _ in b]
    if names != others:
        odd = sorted(set(names) ^ set(others))
        raise AssertionError(f"{what}: different tensors ({odd})")
    by_name = dict(b)
    for name, x in a:
        y = by_name[name]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            diff = ((x.double() - y.double()).abs().max().item()
                    if x.shape == y.shape and x.numel() else float("nan"))
            raise AssertionError(f"{what}: {name} differs (max {diff:.3g})")


def _batch_tensors(batches: Any, where: str = "batches") -> list[tuple[str, Tensor]]:
    """Copies of the tensors in ``batches`` (mappings, lists and tuples of them), by place."""
    if isinstance(batches, Tensor):
        return [(where, batches.detach().clone())]
    if isinstance(batches, Mapping):
        items: Any = batches.items()
    elif isinstance(batches, (list, tuple)):
        items = enumerate(batches)
    else:
        return []
    return [named for key, value in items
            for named in _batch_tensors(value, f"{where}[{key!r}]")]


def _assert_same_state(a: Any, b: Any, what: str, where: str = "state") -> None:
    """``a == b`` for two ``state_dict()``s: every tensor and every plain value."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b)):
            raise AssertionError(f"{what}: {where} differs")
    elif isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            raise AssertionError(f"{what}: {where} has keys {sorted(map(str, a))} before, "
                                 f"{sorted(map(str, b))} after")
        for key in a:
            _assert_same_state(a[key], b[key], what, f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{what}: {where} has {len(a)} items before, {len(b)} after")
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, what, f"{where}[{i}]")
    elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        raise AssertionError(f"{what}: {where} is {b!r}, was {a!r}")


def _without(state_dict: dict[str, Any], buffers: set[str]) -> dict[str, Any]:
    """``state_dict`` without the model's buffers."""
    model = {k: v for k, v in state_dict["model"].items() if k not in buffers}
    return {**state_dict, "model": model}


def _at_boundary(step: Step, state: TrainState) -> None:
    """Apply an open call-counting window, so the state can be saved."""
    if not state.at_update_boundary:
        step.flush(state)


class _InjectedFailure(Exception):
    """The error of the loss function in the failed-call check."""


def _failing_optimizer(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                      armed: list[bool]) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """``make_optimizer`` whose optimizers' ``step()`` raises, before changing anything,
    while ``armed``."""
    def make(model: nn.Module) -> torch.optim.Optimizer:
        optimizer = make_optimizer(model)
        inner = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if armed[0]:
                raise _InjectedFailure("the optimizer step failed")
            return inner(*args, **kwargs)

        optimizer.step = step  # type: ignore[method-assign]
        return optimizer

    return make


def _failing(loss_fn: LossFn, armed: list[bool]) -> LossFn:
    @functools.wraps(loss_fn)
    def fn(*args: Any, **kwargs: Any) -> Any:
        if armed[0]:
            raise _InjectedFailure("the loss function failed (a batch it cannot take)")
        return loss_fn(*args, **kwargs)

    return fn


def _train(step: Step, make_model: Callable[[], nn.Module],
           make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
           batches: Sequence[Any], state: TrainState | None = None,
           ) -> tuple[TrainState, list[tuple[str, Tensor]]]:
    """Train a new state (or ``state``) on ``batches``."""
    if state is None:
        model = make_model()
        state = TrainState(model, make_optimizer(model))
    for batch in batches:
        step(state, batch)
    state.sync()
    return state, _params(state.model, state.optimizer)


def check_transform(
    transform: Transform | GradientTransform,
    *,
    reference: Reference | None = None,
    loss_fn: LossFn = _loss,
    make_model: Callable[[], nn.Module] = _make_model,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _make_optimizer,
    make_batch: Callable[[int], Any] = _make_batch,
    steps: int = 3,
    builtins: Sequence[Transform] | None = None,
) -> ContractReport:
    """Run accelfn's contract on ``transform``; raises ``AssertionError`` on the first breach.

    ``reference(model, optimizer, batch)`` is one update written by hand (plain PyTorch,
    e.g. with [`plain_update`][]); the transform's step must give the same model state
    (parameters and buffers) and optimizer state bitwise. A call whose loss function raises
    must leave the whole ``TrainState`` as it was, and so must a call whose optimizer step
    fails after the gradient transforms ran (a gradient transform returns its new state, it
    does not write to the one it is given). ``builtins`` are the transforms it is stacked
    with in every order (default: bf16 ``with_amp``, ``with_accumulation(2)``,
    ``with_clipping``, less the built-in checked): every order must give the same result,
    or be refused when built;
    at least one order must run. ``make_model`` must return the same initial weights on
    every call (seed inside it).
    """
    if isinstance(transform, GradientTransform):
        transform = transform.transform()
    if not isinstance(transform, Transform):
        raise TypeError(f"check_transform takes an accelfn.GradientTransform or a built-in "
                        f"transform, got {transform!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"check_transform(steps={steps!r}) must be an int >= 2: the resume "
                         "check needs a step before the checkpoint and one after it")
    report = ContractReport(repr(transform))
    try:
        _assert_same(_params(make_model(), torch.optim.SGD([torch.zeros(1)])),
                     _params(make_model(), torch.optim.SGD([torch.zeros(1)])), "make_model()")
    except AssertionError as error:  # every check below would blame the transform
        raise AssertionError(f"make_model() returns different initial weights on two calls "
                             f"({error}); seed inside it, e.g. torch.manual_seed(0)") from None
    batches = [make_batch(i) for i in range(steps)]
    armed = [False]  # makes the step's loss function fail, for check 6
    armed_optimizer = [False]  # makes the optimizer step fail, for check 6
    make_optimizer = _failing_optimizer(make_optimizer, armed_optimizer)
    step = apply_transform(_failing(loss_fn, armed), transform)

    # 1. equivalence to the hand-written reference, on the batches as made
    pristine = _batch_tensors(batches)
    try:
        _, params = _train(step, make_model, make_optimizer, batches)
    except GradientTransformError as error:  # the engine's own check refused it
        where = "against the reference" if reference is not None else "in a first run"
        raise AssertionError(f"{transform!r} {where}: {error}") from error
    _assert_same(pristine, _batch_tensors(batches),
                 "a step changed its batch in place (it must not write to its input)")
    if reference is not None:
        model = make_model()
        optimizer = make_optimizer(model)
        for batch in batches:
            reference(model, optimizer, batch)
        _assert_same(params, _params(model, optimizer), f"{transform!r} against the reference")
        report.passed.append("reference")

    # 2. purity: the same transform and step in two stacks and two states, as if built alone
    outer = _neutral_outer(step)
    wrapped = outer(step)
    _, again = _train(step, make_model, make_optimizer, batches)
    _, fresh = _train(outer(apply_transform(loss_fn, transform)), make_model, make_optimizer,
                      batches)
    _, reused = _train(wrapped, make_model, make_optimizer, batches)
    _assert_same(params, again, "the same step trained twice on fresh states")
    _assert_same(fresh, reused, "a step reused inside another stack")
    report.passed.append("purity")

    # 3. every order with the built-ins, or a refusal
    others = list(builtins) if builtins is not None else [  # the other built-ins
        t for t in (with_amp(dtype=torch.bfloat16), with_accumulation(2),
                    with_clipping(max_norm=0.5)) if t.name != transform.name]
    outcome: list[tuple[str, Tensor]] | None = None
    refusal: str | None = None
    for order in itertools.permutations([transform, *others]):
        try:
            stacked: Step | LossFn = loss_fn
            for t in order:
                stacked = t(stacked)
        except ValueError as error:
            refusal = refusal or str(error)
            if outcome is not None:
                raise AssertionError(f"order {order} is refused ({error}) where another "
                                     "order was accepted") from error
            continue
        if refusal is not None:
            raise AssertionError(f"order {order} builds where another was refused: {refusal}")
        assert isinstance(stacked, Step)
        _, got = _train(stacked, make_model, make_optimizer, batches)
        if outcome is None:
            outcome = got
        _assert_same(outcome, got, f"stacking order {order}")
        report.orders += 1
    if not report.orders:
        raise AssertionError(f"no stacking order of {transform!r} with {others} could run: "
                             f"every one was refused ({refusal}); pass builtins= it stacks with")
    report.passed.append("orders")

    # 4. state_dict round trip and exact resume; the two states are trained in turn, and
    # each must equal a run alone (state kept outside the TrainState mixes them)
    half = steps // 2 or 1
    alone, _ = _train(step, make_model, make_optimizer, batches[:half])
    _at_boundary(step, alone)
    _, alone_params = _train(step, make_model, make_optimizer, batches[half:], alone)
    first, _ = _train(step, make_model, make_optimizer, batches[:half])
    _at_boundary(step, first)
    saved = copy.deepcopy(first.state_dict())
    model = make_model()
    resumed = TrainState(model, make_optimizer(model))
    resumed.load_state_dict(saved)
    for batch in batches[half:]:
        step(resumed, batch)
        step(first, batch)
    resumed.sync()
    first.sync()
    _assert_same(alone_params, _params(first.model, first.optimizer),
                 "two states trained in turn, against one trained alone (state kept outside "
                 "the TrainState?)")
    _assert_same(_params(first.model, first.optimizer),
                 _params(resumed.model, resumed.optimizer), "resume from state_dict()")
    report.passed.append("resume")

    # 5. no host sync in a step (emulated: every would-be device sync is reported), over
    # several updates (a sync made every other update, logging say, is a sync too) and from
    # a fresh state's first update (a sync made once, when a slot is first filled, too)
    new_model = make_model()
    new_state = TrainState(new_model, make_optimizer(new_model))
    with SyncProbe(mode="emulate", allow=("parts/nonfinite.py",)) as probe:
        for batch in batches if len(batches) > 1 else batches * 2:
            step(new_state, batch)
            step(first, batch)
    if probe.syncs:
        raise AssertionError(f"{transform!r} adds host syncs: {probe.syncs}")
    report.passed.append("no host sync")

    # 6. a refused bad input, and a call failing half-way (its loss function raising),
    # leave every piece of state as it was, and the next step works as if they never came
    _at_boundary(step, first)
    before = copy.deepcopy(first.state_dict())
    try:
        step(first, [1, 2, 3])
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError("a list batch was accepted")
    _assert_same_state(before, first.state_dict(), "state after a refused batch")
    if step.spec.capture is not None:  # recorded: a replay calls neither of them
        report.not_applicable.append(
            "a failing loss function or optimizer step: a captured step replays its recorded "
            "update without calling them")
        _train_on(step, first, batches, make_model, make_optimizer)
        report.passed.append("bad input")
        return report
    armed[0] = True
    try:
        step(first, batches[0])
    except _InjectedFailure:
        pass
    else:
        raise AssertionError(f"{transform!r} hid the error of a failing loss function")
    finally:
        armed[0] = False
    _assert_same_state(before, first.state_dict(), "state after a failed call")
    armed_optimizer[0] = True
    try:  # calls until one updates (a call-counting split updates every n-th call; a
        for batch in batches * 8:  # failed call discards its open window)
            step(first, batch)
    except _InjectedFailure:
        pass
    else:
        raise AssertionError(f"{transform!r} hid the error of a failing optimizer step")
    finally:
        armed_optimizer[0] = False
    # the forward ran: buffers it updates (BatchNorm's statistics) are as it left them
    buffers = {name for name, _ in first.model.named_buffers()}
    _assert_same_state(_without(before, buffers), _without(first.state_dict(), buffers),
                       "state after a call whose optimizer step failed (a gradient transform "
                       "writing to its state instead of returning the new one?)")
    _train_on(step, first, batches, make_model, make_optimizer)
    report.passed.append("bad input")
    return report


def _train_on(step: Step, first: TrainState, batches: Sequence[Any],
              make_model: Callable[[], nn.Module],
              make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> None:
    """The steps after a refused or failed call: ``first`` goes on as a twin loaded from
    its state does."""
    model = make_model()
    twin = TrainState(model, make_optimizer(model))
    twin.load_state_dict(copy.deepcopy(first.state_dict()))  # `before`, with those buffers
    for batch in batches:
        step(first, batch)
        step(twin, batch)
    first.sync()
    twin.sync()
    _assert_same(_params(twin.model, twin.optimizer), _params(first.model, first.optimizer),
                 "the steps after a failed call")


def _neutral_outer(step: Step) -> Transform:
    """A built-in that changes nothing here and that ``step`` accepts on top of it."""
    for candidate in (with_clipping(max_norm=1e9), with_accumulation(1)):
        try:
            candidate(step)
        except ValueError:
            continue
        return candidate
    raise AssertionError(f"{step!r} refuses every neutral outer transform; purity is untested")

