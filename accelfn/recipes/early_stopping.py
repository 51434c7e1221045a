"""EarlyStopping: stop when a validation metric stops improving, keeping the best weights.

    es = af.EarlyStopping(patience=10, min_delta=1e-3)
    for epoch in range(epochs):
        train_one_epoch()
        val_loss = evaluate()                     # a float or a 0-d tensor
        if es.update(val_loss, state):            # state, or any nn.Module
            break                                 # best weights are back in the model

Usable from any loop: it only needs the metric and the model at evaluation time.
"""

from __future__ import annotations

import math
from typing import Any, Literal, SupportsFloat

import torch
from torch import Tensor, nn

from ..core.state import TrainState

__all__ = ["EarlyStopping"]

_MODES = ("min", "max")
_STORES = ("cpu", "device")


_KEYS = ("best", "best_index", "counter", "calls", "should_stop", "best_weights")


def _value_of(metric: Any) -> float:
    """The metric as a float; one number only (a mapping of metrics or a tensor of several
    elements is the usual slip: ``step.evaluate(...)`` instead of its ``["loss"]``)."""
    if isinstance(metric, Tensor):
        if metric.numel() != 1:
            raise TypeError(f"EarlyStopping.update() takes one number, got a tensor of shape "
                            f"{tuple(metric.shape)}; reduce it first (e.g. .mean()), or pick "
                            'the metric: metrics["loss"]')
        return float(metric.detach())
    if isinstance(metric, (bool, str)) or not isinstance(metric, SupportsFloat):
        raise TypeError(f"EarlyStopping.update() takes one number (a float or a one-element "
                        f"tensor), got {type(metric).__name__}; pick the metric, e.g. "
                        'update(metrics["loss"], state)')
    return float(metric)


def _model_of(target: TrainState | nn.Module) -> nn.Module:
    if isinstance(target, TrainState):
        return target.model
    if isinstance(target, nn.Module):
        return target
    raise TypeError(f"EarlyStopping takes an accelfn.TrainState or an nn.Module, got "
                    f"{type(target).__name__}")


class EarlyStopping:
    """Equivalent to the usual hand-written early-stopping class,
    ``EarlyStopping(patience, min_delta, restore_best_weights)``: stop after ``patience``
    evaluations in a row without an improvement larger than ``min_delta``, and load the best
    weights back when stopping.

    ``mode="min"`` (a loss) improves when ``metric < best - min_delta``; ``mode="max"`` (an
    accuracy) when ``metric > best + min_delta``; a NaN metric never improves. The first
    metric is always the best so far.

    Best weights: a copy of ``model.state_dict()`` (parameters and buffers) taken at each
    improvement, kept on the CPU (``store="cpu"``, the default: no accelerator memory) or on
    the model's device (``store="device"``: faster copies). With ``restore_best=True``,
    [`update`][] loads them back into the model when it decides to stop; [`restore`][]
    does it on demand (e.g. after the last epoch). For a [`TrainState`][], only the
    model's weights are stored and restored (not the optimizer's state).

    To keep the best *EMA* weights, call it inside [`accelfn.ema_weights`][] with
    ``restore_best=False`` and restore after the block (changes inside it are undone):

        with af.ema_weights(state):
            stop = es.update(step.evaluate(state, val)["loss"], state)
        if stop:
            es.restore(state)

    ``update`` reads the metric on the host (``float``): call it at evaluation time, not in
    the per-step loop. [`state_dict`][] covers counters and best weights for checkpoints.
    """

    def __init__(
        self,
        patience: int,
        *,
        min_delta: float = 0.0,
        mode: Literal["min", "max"] = "min",
        restore_best: bool = True,
        store: Literal["cpu", "device"] = "cpu",
    ) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}) must be an int >= 1: "
                             "evaluations without improvement before stopping")
        if not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}) must be a number >= 0")
        if mode not in _MODES:
            raise ValueError(f"EarlyStopping(mode={mode!r}) must be 'min' (losses) or 'max' "
                             "(accuracies)")
        if store not in _STORES:
            raise ValueError(f"EarlyStopping(store={store!r}) must be 'cpu' or 'device'")
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = mode
        self.restore_best = bool(restore_best)
        self.store = store
        self.best: float | None = None
        self.best_index: int | None = None  # which update() call gave the best metric
        self.counter = 0  # evaluations since the last improvement
        self.calls = 0
        self.should_stop = False
        self.best_weights: dict[str, Tensor] | None = None

    def is_improvement(self, value: float) -> bool:
        """Whether ``value`` beats the best metric by more than ``min_delta``."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def update(self, metric: SupportsFloat | Tensor,
               target: TrainState | nn.Module | None = None) -> bool:
        """Record one evaluation; return True when training should stop.

        ``target`` (a TrainState or model) is whose weights are saved at improvements and
        restored on stopping; it may be omitted with ``restore_best=False``. After the stop
        decision, further calls keep returning True and change nothing.
        """
        if target is None and self.restore_best:
            raise ValueError("EarlyStopping.update(metric) needs the model (or TrainState) "
                             "to save the best weights: update(metric, state), or build it "
                             "with restore_best=False")
        model = None if target is None else _model_of(target)
        if self.should_stop:
            return True
        value = _value_of(metric)
        index = self.calls
        self.calls += 1
        if self.is_improvement(value):
            self.best, self.best_index, self.counter = value, index, 0
            if model is not None:
                self._save(model)
            return False
        self.counter += 1
        if self.counter >= self.patience:
            self.should_stop = True
            # no finite metric yet (NaN from the start): nothing better to go back to
            if self.restore_best and model is not None and self.best_weights is not None:
                self.restore(model)
        return self.should_stop

    @torch.no_grad()
    def _save(self, model: nn.Module) -> None:
        weights = model.state_dict()
        if self.best_weights is None or set(self.best_weights) != set(weights):
            self.best_weights = {
                k: (v.detach().to("cpu", copy=True) if self.store == "cpu"
                    else v.detach().clone())
                for k, v in weights.items()}
            return
        for k, v in weights.items():
            self.best_weights[k].copy_(v.detach())

    def restore(self, target: TrainState | nn.Module) -> None:
        """Load the best weights seen so far into the model."""
        model = _model_of(target)
        if self.best_weights is None:
            raise RuntimeError("EarlyStopping.restore(): no weights saved yet (call "
                               "update(metric, model) at least once)")
        model.load_state_dict(self.best_weights)

    def state_dict(self) -> dict[str, Any]:
        """Counters, best metric and best weights (tensors and plain data; copies, so later
        improvements do not write into a checkpoint taken before them)."""
        weights = None if self.best_weights is None else {
            k: v.detach().clone() for k, v in self.best_weights.items()}
        return {"best": self.best, "best_index": self.best_index, "counter": self.counter,
                "calls": self.calls, "should_stop": self.should_stop,
                "best_weights": weights, "mode": self.mode}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load counters, best metric and best weights (copies); checked first, so a
        checkpoint that does not fit raises ``ValueError`` and changes nothing."""
        missing = [k for k in _KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"EarlyStopping.load_state_dict(): the checkpoint lacks {missing}; "
                             "give it what EarlyStopping.state_dict() returned")
        # checkpoints written before the mode was recorded have none: taken as this one's
        mode = state_dict.get("mode", self.mode)
        if mode != self.mode:
            raise ValueError(f"EarlyStopping.load_state_dict(): the checkpoint was taken with "
                             f"mode={mode!r} and this one has mode={self.mode!r}; its best "
                             f"metric would be compared the other way round. Build it with "
                             f"EarlyStopping(..., mode={mode!r})")
        self.best = state_dict["best"]
        self.best_index = state_dict["best_index"]
        self.counter = int(state_dict["counter"])
        self.calls = int(state_dict["calls"])
        self.should_stop = bool(state_dict["should_stop"])
        weights = state_dict["best_weights"]
        if weights is not None:  # copies: the checkpoint stays as it was loaded
            weights = {k: (v.detach().to("cpu", copy=True) if self.store == "cpu"
                           else v.detach().clone()) for k, v in weights.items()}
        self.best_weights = weights

    def __repr__(self) -> str:
        return (f"EarlyStopping(patience={self.patience}, mode={self.mode!r}, "
                f"best={self.best}, counter={self.counter}, should_stop={self.should_stop})")
