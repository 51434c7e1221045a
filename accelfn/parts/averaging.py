"""An exponential moving average of the weights, updated after every real update:
``with_ema``'s options and its calls (the average made when preparing, updated after each
update, swapped in by ``evaluate(weights="ema")``), and ``ema_weights``/``ema_state_dict``.

    step = af.with_ema(decay=0.999)(my_step)
    with af.ema_weights(state):                   # evaluate with the averaged weights
        val = step.evaluate(state, val_batch)

    # torchvision's recipe: every 32 iterations, copies in the warm-up, decay scaled
    af.with_ema(decay=0.99998, every=32, updates_per_epoch=len(loader), warmup_epochs=5,
                adjust=world_size * batch_size * 32 / epochs, formula="weighted_sum")

    # timm's ModelEmaV3(model, decay=0.9998, use_warmup=True) updated with step=num_updates
    af.with_ema(decay=0.9998, warmup="power", buffers="average_floats")

Written here, not on ``torch.optim.swa_utils.AveragedModel`` (which deep-copies the module
and is updated by the loop, with a host-side count): the average is the averaged tensors
only, on the model's device, updated with device-side weights and flags (no host sync,
skipped updates leave it untouched), by one foreach ``lerp`` per device and dtype (per-tensor
ops for ``formula="weighted_sum"``; integer buffers by a truncated weighted sum, as
``AveragedModel`` does), saved in the state's ``with_ema`` slot by ``state.state_dict()``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.state import TrainState

__all__ = ["EVALUATE_OPTIONS", "Averaging", "DecayFn", "average", "ema_state_dict",
           "ema_weights", "evaluate", "update"]

#: the options ``step.evaluate`` takes from this transform
EVALUATE_OPTIONS = ("weights",)

_SLOT = "with_ema"
_BUFFERS = ("average", "copy", "average_floats")
_FORMULAS = ("lerp", "weighted_sum")
DecayFn = Callable[[int], float]


@dataclass(frozen=True)
class _Schedule:
    """When and how with_ema averages (the transform's options, the decay adjusted)."""

    decay: float
    every: int = 1
    warmup: bool | str = False
    updates_per_epoch: int | None = None
    warmup_epochs: int = 0
    formula: str = "lerp"
    decay_fn: DecayFn | None = None
    warmup_gamma: float = 1.0
    warmup_power: float = 2 / 3

    @property
    def per_update(self) -> bool:
        """Whether the decay is computed on the host for each update (it varies)."""
        return self.decay_fn is not None or self.warmup == "power"

    def host_decay(self, index: int) -> float:
        """The decay of the average after the update of 0-based ``index`` (host maths):
        ``decay_fn(index + 1)``; timm's ``ModelEmaV3.get_decay(index + 1)`` with warmup,
        ``min(decay, 1 - (1 + index / gamma) ** -power)`` (0.0, a copy, for index 0); else
        the decay."""
        if self.decay_fn is not None:
            value: Any = self.decay_fn(index + 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0.0 <= value <= 1.0):
                raise ValueError(f"with_ema(decay=<function>) returned {value!r} for update "
                                 f"{index + 1}: give a Python number in [0, 1] (no tensor)")
            return float(value)
        if self.warmup == "power":
            if index <= 0:
                return 0.0
            warm: float = 1 - (1 + index / self.warmup_gamma) ** -self.warmup_power
            return max(min(warm, self.decay), 0.0)
        return self.decay

    def position(self, index: int) -> tuple[bool, bool]:
        """(due, in a warm-up epoch) for the update of 0-based ``index`` in the run."""
        assert self.updates_per_epoch is not None
        epoch, within = divmod(index, self.updates_per_epoch)
        return within % self.every == 0, epoch < self.warmup_epochs


class _EmaWeights:
    """Slot of ``with_ema``: EMA copies of the parameters (and buffers) and device counters."""

    def __init__(self, model: nn.Module, buffers: str, formula: str = "lerp") -> None:
        params = list(model.named_parameters())
        if not params:
            raise ValueError("with_ema: the model has no parameters to average")
        self.names = [n for n, _ in params]
        self.values = [p.detach().clone() for _, p in params]
        self.buffers = buffers
        average_buffers = self.average_buffers = buffers != "copy"
        self.buffer_names: list[str] = []
        if average_buffers:
            named = list(model.named_buffers())
            self.buffer_names = [n for n, _ in named]
            self.values += [b.detach().clone() for _, b in named]
        device = self.values[0].device
        self.n_averaged = torch.zeros((), dtype=torch.int64, device=device)
        self.updates = torch.zeros((), dtype=torch.int64, device=device)
        self.formula = formula
        # averaged (floating) entries, grouped by device, dtype and whether they are DTensors
        # (FSDP2's sharded parameters beside its plain buffers: one foreach call takes one
        # kind) for one foreach call each; other buffers (BatchNorm's num_batches_tracked) are
        # averaged and truncated back to integers, as AveragedModel does with either formula
        self.groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
        self.truncated: list[int] = []
        for i, v in enumerate(self.values):
            if v.is_floating_point() or v.is_complex():
                self.groups.setdefault((v.device, v.dtype, hasattr(v, "device_mesh")),
                                       []).append(i)
            else:
                self.truncated.append(i)
        self._constants: dict[float, Tensor] = {}
        # the lerp weight of a decay computed on the host per update, filled in place
        self._weight = torch.zeros((), dtype=torch.float32, device=device)

    # ----------------------------------------------------------------- model side
    def sources(self, model: nn.Module) -> list[Tensor]:
        """The model's tensors in the order of :attr:`values`."""
        found: list[Tensor] = [p for _, p in model.named_parameters()]
        if self.average_buffers:
            found += [b for _, b in model.named_buffers()]
        if len(found) != len(self.values):
            raise RuntimeError(
                f"with_ema: the model now has {len(found)} parameters/buffers, the average "
                f"{len(self.values)}; parameters were added or removed after the first step"
            )
        return found

    def _constant(self, value: float) -> Tensor:
        if value not in self._constants:
            self._constants[value] = torch.tensor(value, dtype=torch.float32,
                                                  device=self.n_averaged.device)
        return self._constants[value]

    @torch.no_grad()
    def update(self, model: nn.Module, skipped: Tensor, schedule: _Schedule,
               index: int) -> None:
        """Average after the update of 0-based ``index`` in the run (``skipped``: a device
        bool), all on the device."""
        real = ~skipped.to(self.n_averaged.device)
        self.updates += real
        warm_epoch = False
        if schedule.updates_per_epoch is not None:  # torchvision: i % every == 0 in the epoch
            on_time, warm_epoch = schedule.position(index)
            if not on_time:
                return
            due = real
        elif schedule.every == 1:
            due = real
        else:
            due = real & (self.updates % schedule.every == 0)
        n = self.n_averaged
        decay: Tensor | float = schedule.decay
        if schedule.per_update:  # a function of the update count, on the host
            decay = schedule.host_decay(index)
        elif schedule.warmup:  # decay_t = min(decay, (1 + n) / (10 + n)), n = averages so far
            nf = n.to(torch.float32)
            decay = torch.clamp((1.0 + nf) / (10.0 + nf), max=schedule.decay)
        sources = self.sources(model)
        if schedule.formula == "lerp":
            self._lerp(sources, decay, due, schedule.per_update)
        else:
            self._weighted_sum(sources, decay, due)
        if self.buffers == "average_floats":
            self._copied(sources, due)
        else:
            self._truncated(sources, decay, due)
        self.n_averaged += due
        if warm_epoch:  # torchvision's n_averaged.fill_(0): the next average copies too
            self.n_averaged.zero_()

    def _lerp(self, sources: list[Tensor], decay: Tensor | float, due: Tensor,
              varying: bool = False) -> None:
        """swa_utils' get_ema_multi_avg_fn: ``ema.lerp_(w, 1 - decay)``, one foreach call per
        device and dtype; the first average copies (weight 1), a skipped one has weight 0.
        ``1 - decay`` is rounded from the host's double to float32 as torch rounds a Python
        scalar weight (timm's ``_foreach_lerp_(ema, model, weight=1. - decay)``)."""
        n = self.n_averaged
        if isinstance(decay, Tensor):
            step_weight = 1.0 - decay
        elif varying:  # a new value each update: one tensor filled in place, no cache growth
            step_weight = self._weight.fill_(1.0 - decay)
        else:
            step_weight = self._constant(1.0 - decay)
        weight = torch.where(n == 0, self._constant(1.0), step_weight) * due
        for (device, _, sharded), index in self.groups.items():
            w = weight.to(device)
            values = [self.values[i] for i in index]
            ends = [sources[i].detach() for i in index]
            if sharded:  # each DTensor's shard, laid out as its source's (cloned from it)
                values = [v.to_local() for v in values]  # type: ignore[attr-defined]
                ends = [e.to_local() for e in ends]  # type: ignore[attr-defined]
            compat.foreach_lerp_(values, ends, [w] * len(index))

    def _weighted_sum(self, sources: list[Tensor], decay: Tensor | float, due: Tensor) -> None:
        """torchvision's ExponentialMovingAverage avg_fn: ``decay * ema + (1 - decay) * w``
        with the same roundings; the first average copies, a skipped one leaves the value as
        it was (selected, not weighted)."""
        first = self.n_averaged == 0
        for index in self.groups.values():
            for i in index:
                v, src = self.values[i], sources[i].detach()
                d = decay.to(v.device) if isinstance(decay, Tensor) else decay
                new = torch.mul(v, d)
                new.add_(torch.mul(src, 1 - d))  # a + b: the rounding of d * v + (1 - d) * w
                torch.where(first.to(v.device), src, new, out=new)
                torch.where(due.to(v.device), new, v, out=v)

    def _truncated(self, sources: list[Tensor], decay: Tensor | float, due: Tensor) -> None:
        """Integer buffers, with either formula: ``ema * decay + w * (1 - decay)`` in floating
        point, truncated back to the integer dtype by ``copy_``, as ``get_ema_multi_avg_fn``
        and torchvision's avg_fn both do (one formula: their products and sum round alike);
        the first average copies, a skipped one leaves the value as it was."""
        first = self.n_averaged == 0
        for i in self.truncated:
            v, src = self.values[i], sources[i].detach()
            d = decay.to(v.device) if isinstance(decay, Tensor) else decay
            new = (v * d + src * (1 - d)).to(v.dtype)  # the truncation AveragedModel's copy_ makes
            v.copy_(torch.where(due.to(v.device), torch.where(first.to(v.device), src, new), v))

    def _copied(self, sources: list[Tensor], due: Tensor) -> None:
        """``buffers="average_floats"``: integer buffers are the model's, copied at each
        average (timm's ``ModelEmaV3``); a skipped one leaves them as they were."""
        for i in self.truncated:
            v, src = self.values[i], sources[i].detach()
            v.copy_(torch.where(due.to(v.device), src, v))

    # ----------------------------------------------------------------- checkpoint
    def named_values(self) -> dict[str, Tensor]:
        names = self.names + [f"buffer:{n}" for n in self.buffer_names]
        return dict(zip(names, self.values))

    def state_dict(self) -> dict[str, Any]:
        return {"n_averaged": self.n_averaged, "updates": self.updates,
                "weights": self.named_values()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        mine = self.named_values()
        if set(saved["weights"]) != set(mine):
            missing = sorted(set(mine) - set(saved["weights"]))[:3]
            extra = sorted(set(saved["weights"]) - set(mine))[:3]
            raise ValueError(
                f"with_ema checkpoint does not match this model (missing {missing}, "
                f"unexpected {extra}); build with_ema with the same buffers= option and model"
            )
        with torch.no_grad():
            for name, value in saved["weights"].items():
                mine[name].copy_(value)
            self.n_averaged.copy_(saved["n_averaged"])
            self.updates.copy_(saved["updates"])




@dataclass(frozen=True, slots=True, repr=False)
class Averaging:
    """``with_ema``'s options (see [`with_ema`][accelfn.with_ema]): the ``decay`` (a number,
    or a function of the update count), ``every`` k-th update, the ``warmup``, the
    ``buffers`` rule, torchvision's ``updates_per_epoch``, ``warmup_epochs`` and ``adjust``,
    the ``formula``, and timm's ``warmup_gamma`` and ``warmup_power``."""

    decay: float | DecayFn = 0.999
    every: int = 1
    warmup: bool | str = False
    buffers: str = "average"
    updates_per_epoch: int | None = None
    warmup_epochs: int = 0
    adjust: float | None = None
    formula: str = "lerp"
    warmup_gamma: float = 1.0
    warmup_power: float = 2 / 3
    # when and how it averages: the options with the decay adjusted
    schedule: _Schedule = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        decay, every, warmup, buffers = self.decay, self.every, self.warmup, self.buffers
        updates_per_epoch, warmup_epochs, adjust = (self.updates_per_epoch,
                                                    self.warmup_epochs, self.adjust)
        formula, warmup_gamma, warmup_power = self.formula, self.warmup_gamma, self.warmup_power
        decay_fn: DecayFn | None = None
        if callable(decay):
            decay_fn, decay = decay, 0.0
            if warmup is not False or adjust is not None:
                raise ValueError("with_ema(decay=<function>) gives the decay of every update: "
                                 "drop warmup= and adjust= (put them in the function)")
        elif (isinstance(decay, bool) or not isinstance(decay, (int, float))
              or not 0.0 <= decay < 1.0):
            raise ValueError(f"with_ema(decay={decay!r}) must be in [0, 1), e.g. 0.999, or a "
                             "function of the update count")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"with_ema(every={every!r}) must be an int >= 1 (optimizer updates "
                             "between averages)")
        if not (isinstance(warmup, bool) or warmup == "power"):
            raise TypeError(f"with_ema(warmup={warmup!r}) takes True or False (TensorFlow's ramp "
                            "(1 + n) / (10 + n)) or 'power' (timm's ModelEmaV3 warmup)")
        for name, value, default in (("warmup_gamma", warmup_gamma, 1.0),
                                     ("warmup_power", warmup_power, 2 / 3)):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"with_ema({name}={value!r}) must be a finite number > 0")
            if value != default and warmup != "power":
                raise ValueError(f"with_ema({name}=...) shapes warmup='power' only; add "
                                 "warmup='power'")
        if buffers not in _BUFFERS:
            raise ValueError(f"with_ema(buffers={buffers!r}) must be one of {_BUFFERS}")
        if updates_per_epoch is not None and (isinstance(updates_per_epoch, bool) or not isinstance(
                updates_per_epoch, int) or updates_per_epoch < 1):
            raise ValueError(f"with_ema(updates_per_epoch={updates_per_epoch!r}) must be an int "
                             ">= 1: the optimizer updates of an epoch, e.g. len(loader)")
        if (isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int)
                or warmup_epochs < 0):
            raise ValueError(f"with_ema(warmup_epochs={warmup_epochs!r}) must be an int >= 0")
        if warmup_epochs and updates_per_epoch is None:
            raise ValueError("with_ema(warmup_epochs=...) needs updates_per_epoch=<updates in an "
                             "epoch, e.g. len(loader)> to know when an epoch ends")
        if adjust is not None and (isinstance(adjust, bool) or not isinstance(adjust, (int, float))
                                   or not adjust > 0):
            raise ValueError(f"with_ema(adjust={adjust!r}) must be a number > 0, e.g. "
                             "torchvision's world_size * batch_size * every / epochs")
        if formula not in _FORMULAS:
            raise ValueError(f"with_ema(formula={formula!r}) must be one of {_FORMULAS}")
        used = float(decay)
        if adjust is not None:  # torchvision: alpha = min(1.0, (1.0 - decay) * adjust)
            used = 1.0 - min(1.0, (1.0 - used) * adjust)
        if decay_fn is None:
            object.__setattr__(self, "decay", float(decay))
        object.__setattr__(self, "warmup_gamma", float(warmup_gamma))
        object.__setattr__(self, "warmup_power", float(warmup_power))
        object.__setattr__(self, "schedule", _Schedule(
            used, every, warmup, updates_per_epoch, warmup_epochs, formula, decay_fn,
            float(warmup_gamma), float(warmup_power)))

    def __repr__(self) -> str:
        every, warmup, adjust = self.every, self.warmup, self.adjust
        extra = "".join([
            f", every={every}" if every != 1 else "",
            f", updates_per_epoch={self.updates_per_epoch}"
            if self.updates_per_epoch is not None else "",
            f", warmup_epochs={self.warmup_epochs}" if self.warmup_epochs else "",
            f", adjust={adjust:g}" if adjust is not None else "",
            ", warmup" if warmup is True else "",
            "" if warmup != "power" else (
                f", warmup='power', warmup_gamma={self.warmup_gamma:g}, "
                f"warmup_power={self.warmup_power:g}"),
            f", buffers={self.buffers!r}" if self.buffers != "average" else "",
            f", formula={self.formula!r}" if self.formula != "lerp" else "",
        ])
        decay = self.decay
        shown = (f"decay={getattr(decay, '__name__', 'function')}" if callable(decay)
                 else f"{decay:g}")
        return f"with_ema({shown}{extra})"


def _slot(options: Averaging, state: TrainState) -> _EmaWeights:
    weights = state.slot(_SLOT, lambda: _EmaWeights(state.model, options.buffers,
                                                    options.formula))
    if weights.buffers != options.buffers:
        raise ValueError("the state's EMA was built with another buffers= option than "
                         "this step's with_ema")
    if weights.formula != options.formula:
        raise ValueError("the state's EMA was built with another formula= option than "
                         "this step's with_ema")
    return weights  # type: ignore[no-any-return]


def average(options: Averaging, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: the averaged copies of the weights made (or checked against the state's)."""
    _slot(options, state)
    return prepared


def update(options: Averaging, ctx: UpdateContext, skipped: Tensor) -> None:
    """After an update: the average moves, unless the update was skipped (a device flag)."""
    # the engine counts this update in state.step before the after_update phase
    _slot(options, ctx.state).update(ctx.state.model, skipped, options.schedule,
                                     ctx.state.step - 1)


def evaluate(options: Averaging, ctx: CallContext, given: Mapping[str, Any]
             ) -> contextlib.AbstractContextManager[Any]:
    """``step.evaluate(state, batch, weights="ema")`` evaluates the EMA weights."""
    weights = given.get("weights", "model")
    if weights not in ("model", "ema"):
        raise ValueError(f"evaluate(weights={weights!r}): use 'model' or 'ema'")
    return ema_weights(ctx.state) if weights == "ema" else contextlib.nullcontext()


def _ema_slot(state: TrainState) -> _EmaWeights:
    if not isinstance(state, TrainState):
        raise TypeError(f"takes an accelfn.TrainState, got {type(state).__name__}")
    slot = state.slots.get(_SLOT)
    if slot is None:
        raise ValueError(
            "this state has no EMA weights: build the step with af.with_ema(...) and call it "
            "(or step.prepare(state) after loading a checkpoint) first"
        )
    assert isinstance(slot, _EmaWeights)
    return slot


@contextlib.contextmanager
def ema_weights(state: TrainState) -> Iterator[nn.Module]:
    """Equivalent to evaluating ``AveragedModel.module``: inside the block ``state.model``
    holds the EMA weights (and averaged buffers); its own come back on exit.

        with af.ema_weights(state):
            metrics = step.evaluate(state, batch)

    The EMA values are copied into the model's own tensors (a compiled or wrapped model sees
    them too) and the model's values are put back on exit, also after an exception; changes
    made to the model inside the block are discarded and never reach the average. Costs one
    temporary copy of the weights. Yields ``state.model``.

    Saving inside the block (the best model at evaluation time) saves the model's own
    weights as the model, and the average as the EMA: ``state.state_dict()`` gives them
    while the block runs. Loading inside it is refused (the block would put the old
    weights back over the loaded ones).
    """
    slot = _ema_slot(state)
    sources = slot.sources(state.model)
    targets = [t.detach() for t in sources]
    with torch.no_grad():
        own = [t.clone() for t in targets]
        compat.foreach_copy_(targets, slot.values)
        try:
            with state.lend_model(sources, own):
                yield state.model
        finally:
            compat.foreach_copy_(targets, own)


def ema_state_dict(state: TrainState) -> dict[str, Tensor]:
    """Equivalent to ``AveragedModel.module.state_dict()``: ``state.model.state_dict()`` with
    the EMA weights in place of the model's, ready for ``model.load_state_dict``.

    Values are copies (they do not change with later updates).
    """
    slot = _ema_slot(state)
    averaged = {id(t): v for t, v in zip(slot.sources(state.model), slot.values)}
    return {k: averaged.get(id(t), t).detach().clone()  # tied weights: every name
            for k, t in state.model.state_dict(keep_vars=True).items()}
