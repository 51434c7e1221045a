"""with_ema: an exponential moving average of the weights, updated after every real update.

    step = af.with_ema(decay=0.999)(my_step)
    ...
    with af.ema_weights(state):                   # evaluate with the averaged weights
        val = step.evaluate(state, val_batch)

The average lives on the model's device, is updated with foreach ops and device-side
weights (no host sync, skipped updates leave it untouched), and is saved in the state's
``with_ema`` slot by ``state.state_dict()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, overload

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.engine import LossFn, Step
from ..core.protocol import CallContext, Hooks, Prepared, Transform, UpdateContext, configure
from ..core.state import TrainState

__all__ = ["ema_state_dict", "ema_weights", "with_ema"]

_SLOT = "with_ema"
_BUFFERS = ("average", "copy")


class _EmaWeights:
    """Slot of ``with_ema``: EMA copies of the parameters (and buffers) and device counters."""

    def __init__(self, model: nn.Module, average_buffers: bool) -> None:
        params = list(model.named_parameters())
        if not params:
            raise ValueError("with_ema: the model has no parameters to average")
        self.names = [n for n, _ in params]
        self.values = [p.detach().clone() for _, p in params]
        self.average_buffers = average_buffers
        self.buffer_names: list[str] = []
        if average_buffers:
            buffers = list(model.named_buffers())
            self.buffer_names = [n for n, _ in buffers]
            self.values += [b.detach().clone() for _, b in buffers]
        device = self.values[0].device
        self.n_averaged = torch.zeros((), dtype=torch.int64, device=device)
        self.updates = torch.zeros((), dtype=torch.int64, device=device)
        # averaged (floating) entries, grouped by device and dtype for one foreach call each;
        # other buffers (BatchNorm's num_batches_tracked) are copied from the model
        self.groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        self.copied: list[int] = []
        for i, v in enumerate(self.values):
            if v.is_floating_point() or v.is_complex():
                self.groups.setdefault((v.device, v.dtype), []).append(i)
            else:
                self.copied.append(i)
        self._constants: dict[float, Tensor] = {}

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
    def update(self, model: nn.Module, skipped: Tensor, decay: float, every: int,
               warmup: bool) -> None:
        real = ~skipped.to(self.n_averaged.device)
        self.updates += real
        due = real if every == 1 else real & (self.updates % every == 0)
        n = self.n_averaged
        if warmup:  # decay_t = min(decay, (1 + n) / (10 + n)), n = averages taken so far
            nf = n.to(torch.float32)
            step_weight = 1.0 - torch.clamp((1.0 + nf) / (10.0 + nf), max=decay)
        else:
            step_weight = self._constant(1.0 - decay)
        # the first average copies the model (as AveragedModel does); skipped: weight 0
        weight = torch.where(n == 0, self._constant(1.0), step_weight) * due
        sources = self.sources(model)
        for (device, _), index in self.groups.items():
            w = weight.to(device)
            compat.foreach_lerp_([self.values[i] for i in index],
                                 [sources[i].detach() for i in index], [w] * len(index))
        for i in self.copied:
            v = self.values[i]
            v.copy_(torch.where(due.to(v.device), sources[i].detach(), v))
        self.n_averaged += due

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


def _ema(decay: float, every: int, warmup: bool, buffers: str) -> Transform:
    def slot(state: TrainState) -> _EmaWeights:
        weights = state.slot(_SLOT, lambda: _EmaWeights(state.model, buffers == "average"))
        if weights.average_buffers != (buffers == "average"):
            raise ValueError("the state's EMA was built with another buffers= option than "
                             "this step's with_ema")
        return weights  # type: ignore[no-any-return]

    def average(prepared: Prepared, state: TrainState) -> Prepared:
        slot(state)
        return prepared

    def after_update(ctx: UpdateContext, skipped: Tensor) -> None:
        slot(ctx.state).update(ctx.state.model, skipped, decay, every, warmup)

    def evaluate_context(ctx: CallContext, options: Mapping[str, Any]
                         ) -> contextlib.AbstractContextManager[Any]:
        """``step.evaluate(state, batch, weights="ema")`` evaluates the EMA weights."""
        weights = options.get("weights", "model")
        if weights not in ("model", "ema"):
            raise ValueError(f"evaluate(weights={weights!r}): use 'model' or 'ema'")
        return ema_weights(ctx.state) if weights == "ema" else contextlib.nullcontext()

    extra = "".join([
        f", every={every}" if every != 1 else "",
        ", warmup" if warmup else "",
        ", buffers='copy'" if buffers != "average" else "",
    ])
    return Transform(
        _SLOT, Hooks(average=average, after_update=after_update,
                     evaluate_context=evaluate_context),
        options=(("decay", decay), ("every", every), ("warmup", warmup), ("buffers", buffers)),
        label=f"with_ema({decay:g}{extra})",
        commutes=frozenset({"with_amp"}),  # its after_update reads the weights amp leaves be
        evaluate_options=("weights",))


@overload
def with_ema(fn: LossFn | Step, /) -> Step: ...
@overload
def with_ema(*, decay: float = 0.999, every: int = 1, warmup: bool = False,
             buffers: str = "average") -> Transform: ...
def with_ema(
    fn: LossFn | Step | None = None,
    /,
    *,
    decay: float = 0.999,
    every: int = 1,
    warmup: bool = False,
    buffers: str = "average",
) -> Step | Transform:
    """Equivalent to ``ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay),
    use_buffers=True)`` and ``ema.update_parameters(model)`` after every real optimizer update.

    ``ema = decay * ema + (1 - decay) * weights``, the first update copying the weights
    (``torch.optim.swa_utils``' rule). Updates skipped by the non-finite guard (or by AMP
    overflow) leave the average and its counters untouched; the choice is made on the
    device. ``every=k`` averages after every ``k``-th real update only. ``warmup=True`` uses
    ``min(decay, (1 + n) / (10 + n))`` for the ``n``-th average (TensorFlow's
    ``ExponentialMovingAverage(num_updates=...)``), so early averages forget the
    initialisation faster. Floating buffers (BatchNorm statistics) are averaged like the
    weights (``buffers="average"``) or used as the model has them (``buffers="copy"``, i.e.
    ``use_buffers=False``); integer buffers are copied from the model.

    Evaluate with :func:`ema_weights`; export with :func:`ema_state_dict`. Memory: one copy
    of the weights on their device. State: slot ``with_ema``.
    """
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
        raise ValueError(f"with_ema(decay={decay!r}) must be in [0, 1), e.g. 0.999")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"with_ema(every={every!r}) must be an int >= 1 (optimizer updates "
                         "between averages)")
    if not isinstance(warmup, bool):
        raise TypeError(f"with_ema(warmup={warmup!r}) takes True or False")
    if buffers not in _BUFFERS:
        raise ValueError(f"with_ema(buffers={buffers!r}) must be one of {_BUFFERS}")
    return configure("with_ema", fn, _ema(float(decay), every, warmup, buffers))


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
    """
    slot = _ema_slot(state)
    targets = [t.detach() for t in slot.sources(state.model)]
    with torch.no_grad():
        own = [t.clone() for t in targets]
        compat.foreach_copy_(targets, slot.values)
        try:
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
