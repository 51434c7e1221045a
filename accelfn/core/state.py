"""TrainState: the model, optimizer, scheduler and every transform's checkpointable state."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["TrainState"]
# torch warns when a scheduler steps before the optimizer did in this process
_STEPPED_FIRST = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


def _check_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ValueError(
            "the model has no trainable parameters (all requires_grad=False); unfreeze some "
            "parameters or there is nothing to train"
        )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in {id(q) for q in model.parameters()}]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's; build "
            "it from this model, e.g. torch.optim.AdamW(model.parameters())"
        )
    if not any(id(p) in trainable for p in held):
        raise ValueError(
            "the optimizer holds none of the model's trainable parameters; build it from "
            "model.parameters() after freezing, not before"
        )


class TrainState:
    """Everything a training run updates: model, optimizer, scheduler, transform state.

    ``state_dict()`` / ``load_state_dict()`` cover all of it. Transforms keep their state in
    named *slots* (``state.slot(name, factory)``); a slot is created on first use, and a slot
    loaded from a checkpoint before it exists is applied when it is created.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        *,
        scheduler_every: int | str = 1,
    ) -> None:
        _check_model_and_optimizer(model, optimizer)
        if not (scheduler_every == "epoch" or (isinstance(scheduler_every, int)
                                               and not isinstance(scheduler_every, bool)
                                               and scheduler_every >= 1)):
            raise ValueError(
                f"TrainState(scheduler_every={scheduler_every!r}): give an int N >= 1 (step the "
                "scheduler every N real updates) or 'epoch' (step it in state.end_epoch())")
        if scheduler is not None and not hasattr(scheduler, "step"):
            raise TypeError(
                f"scheduler must be a torch.optim.lr_scheduler scheduler, got "
                f"{type(scheduler).__name__}"
            )
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau steps on a validation metric, not once per update; use "
                "accelfn.warmup_plateau(optimizer, ...) and call .observe(metric) when you "
                "evaluate, or keep the plateau scheduler outside the TrainState"
            )
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("the scheduler was built for another optimizer than this state's")
        self._model = model
        self._optimizer = optimizer
        self.scheduler = scheduler
        self.step = 0  # optimizer updates attempted (skipped ones included)
        self.epoch = 0  # epochs ended with end_epoch()
        self.scheduler_every = scheduler_every
        self._real_updates = 0  # updates applied since the scheduler last stepped
        self._slots: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._preparations: list[tuple[Any, Any, str]] = []
        self._scheduler_mark: Any = getattr(scheduler, "last_epoch", None)
        self._warned: set[str] = set()
        self._lent: dict[int, torch.Tensor] = {}  # id(model tensor) -> its own value, held

    @property
    def model(self) -> nn.Module:
        """The model this state trains (fixed: a state is built for one model)."""
        return self._model

    @model.setter
    def model(self, value: nn.Module) -> None:
        raise AttributeError(
            "TrainState.model cannot be replaced: steps prepare the model once (wrapping, "
            "sharding, compiling) and keep training what they prepared. Build a new "
            "TrainState(model, optimizer) for another model")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of [`model`][] (fixed, like the model)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        raise AttributeError(
            "TrainState.optimizer cannot be replaced: it holds the prepared model's parameters. "
            "Build a new TrainState(model, optimizer); to change hyper-parameters, edit "
            "optimizer.param_groups")

    @property
    def preparations(self) -> tuple[tuple[Any, Any, str], ...]:
        """(key, prepared, description) of each stack that prepared this state so far."""
        return tuple(self._preparations)

    def add_preparation(self, key: Any, prepared: Any, description: str) -> None:
        """Record the preparation a step made of this state (the engine calls it)."""
        self._preparations.append((key, prepared, description))

    def step_scheduler(self) -> None:
        """Step the scheduler after a real update (the engine's call, once per update).

        Warns once when the scheduler was stepped by someone else since the last update: a
        step already steps it, so a loop that also calls ``scheduler.step()`` moves the
        schedule twice as fast.
        """
        scheduler = self.scheduler
        if scheduler is None or self.scheduler_every == "epoch":
            return
        self._real_updates += 1
        if self._real_updates < int(self.scheduler_every):
            return
        self._real_updates = 0
        self._advance(scheduler)

    def end_epoch(self) -> None:
        """Mark the end of an epoch: counts ``state.epoch`` and, with
        ``scheduler_every="epoch"``, steps the scheduler (a per-epoch ``StepLR``, say)."""
        self.epoch += 1
        if self.scheduler is not None and self.scheduler_every == "epoch":
            with warnings.catch_warnings():
                if self.step:  # updates ran, maybe in the process that saved this state
                    warnings.filterwarnings("ignore", _STEPPED_FIRST, UserWarning)
                self._advance(self.scheduler)

    def _advance(self, scheduler: Any) -> None:
        mark = getattr(scheduler, "last_epoch", None)
        if mark is not None and self._scheduler_mark is not None and mark != self._scheduler_mark:
            self.warn_once(
                "scheduler",
                f"the scheduler was stepped outside the step ({mark - self._scheduler_mark} "
                "extra time(s) since the last update): accelfn steps the TrainState's "
                "scheduler once per real update already. Remove scheduler.step() from the loop "
                "(or keep the scheduler out of the TrainState to step it yourself)")
        scheduler.step()
        self._scheduler_mark = getattr(scheduler, "last_epoch", None)

    def reset_carry(self, evaluate: bool | None = None) -> None:
        """Forget what the step function carries between calls (see accelfn.core.carry):
        training's (``evaluate=False``), evaluation's (``True``) or both (None)."""
        carries = self._slots.get("carry")
        if carries is not None:
            carries.reset(None if evaluate is None else ("evaluate" if evaluate else "train"))

    def warn_once(self, key: str, message: str) -> None:
        """Issue ``message`` as a RuntimeWarning the first time ``key`` is seen for this state."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def slot(self, name: str, factory: Callable[[], Any]) -> Any:
        """The state object a transform keeps under ``name``, created by ``factory`` once.

        The object is a dict of tensors and plain data, or has ``state_dict``/``load_state_dict``.
        """
        if name not in self._slots:
            obj = factory()
            if name in self._pending:  # kept waiting if it does not fit: a retry still gets it
                _load_into(obj, self._pending[name], name)
                del self._pending[name]
            self._slots[name] = obj
        return self._slots[name]

    def get_slot(self, name: str) -> Any | None:
        """The state object kept under ``name``, or None if no transform created it yet."""
        return self._slots.get(name)

    @property
    def slots(self) -> dict[str, Any]:
        """The transform state objects created so far, by name."""
        return dict(self._slots)

    @contextlib.contextmanager
    def lend_model(self, tensors: Sequence[torch.Tensor],
                   own: Sequence[torch.Tensor]) -> Iterator[None]:
        """While the block runs, the model's ``tensors`` (its parameters and buffers, as
        ``named_parameters()``/``named_buffers()`` give them) hold other values, e.g. EMA
        weights to evaluate, and ``own`` holds their own values: [`state_dict`][] and
        [`snapshot`][] give ``own`` in their place, and [`load_state_dict`][] refuses (the
        block puts ``own`` back on exit). The caller swaps the values in and out."""
        if len(tensors) != len(own):
            raise ValueError(f"lend_model: {len(tensors)} tensors but {len(own)} own values")
        added = {id(t): v for t, v in zip(tensors, own)
                 if id(t) not in self._lent}  # nested blocks: the outermost's own values
        self._lent.update(added)
        try:
            yield
        finally:
            for key in added:
                self._lent.pop(key, None)

    @property
    def lends_model(self) -> bool:
        """Whether the model holds other values than its own (inside [`lend_model`][])."""
        return bool(self._lent)

    def _model_state_dict(self) -> dict[str, Any]:
        """``model.state_dict()``, with the model's own values of tensors it lent."""
        saved = self.model.state_dict()
        if self._lent:
            for key, tensor in self.model.state_dict(keep_vars=True).items():
                own = self._lent.get(id(tensor))
                if own is not None:
                    saved[key] = own.detach()
        return saved

    @property
    def at_update_boundary(self) -> bool:
        """Whether no accumulation window is open (``with_accumulation(n, mode="calls")``
        between its calls), so that the state can be saved. A host read of plain counters:
        no sync. Every process of a run shares it (they make the same calls)."""
        return not any(_open_calls(obj) for obj in self._slots.values())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sync(self) -> None:
        """Apply the bookkeeping transforms deferred to avoid host syncs.

        With a fused optimizer the non-finite guard reads an update's flags at the next update
        and steps the scheduler then; call this after the loop before reading the scheduler or
        the guard's counters. [`state_dict`][] calls it.
        """
        for obj in self._slots.values():
            settle = getattr(obj, "settle", None)
            if callable(settle):
                settle(self)

    def state_dict(self) -> dict[str, Any]:
        """All training state as tensors and plain data (loadable with ``weights_only=True``)."""
        self.sync()
        slots = {name: _save(obj) for name, obj in self._slots.items()}
        slots.update({k: v for k, v in self._pending.items() if k not in slots})
        return {
            "model": self._model_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "step": self.step,
            "slots": slots,
            "schedule": {"epoch": self.epoch, "real_updates": self._real_updates,
                         "every": self.scheduler_every},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned; refuses a mismatched checkpoint whole.

        Loading a checkpoint rolls back to it: an accumulation window open at the call
        (``mode="calls"``) is discarded with the gradients it accumulated. A failed load
        changes nothing, the open window included. [`snapshot`][]'s copy loads too, and
        puts back exactly what it copied."""
        if self._lent:
            raise RuntimeError(
                "load_state_dict inside `with af.ema_weights(state):` (the model holds "
                "borrowed weights, and its own come back when the block ends, over what "
                "would be loaded); load after the block")
        missing = {"model", "optimizer", "scheduler", "step", "slots"} - set(state_dict)
        if missing:
            raise KeyError(f"not a TrainState checkpoint: missing {sorted(missing)}")
        schedule = state_dict.get("schedule", {"every": self.scheduler_every})
        if schedule.get("every", self.scheduler_every) != self.scheduler_every:
            raise ValueError(
                f"the checkpoint stepped its scheduler every {schedule['every']!r}, this state "
                f"every {self.scheduler_every!r}; build the state with the checkpointed run's "
                "scheduler_every")
        if (state_dict["scheduler"] is None) != (self.scheduler is None):
            raise ValueError(
                "the checkpoint and this state disagree on having a scheduler; build the state "
                "the way the checkpointed run did"
            )
        backup = self.snapshot()
        was_open = not self.at_update_boundary
        try:
            self._apply(state_dict)
        except BaseException:
            self._apply(backup)  # whole or nothing: never a partial restore
            raise
        if "pending" not in state_dict and was_open:  # a checkpoint: the window is gone
            for name, obj in self._slots.items():
                discard = getattr(obj, "discard", None)
                if name not in state_dict["slots"] and callable(discard):
                    discard()
            self.model.zero_grad(set_to_none=True)

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the whole state, to roll back to with [`load_state_dict`][].

        Unlike [`state_dict`][] it can be taken with an accumulation window open: it holds
        the window and its gradients, so it is no checkpoint (it cannot be saved).
        """
        self.sync()
        snap = {
            "model": self._model_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "step": self.step,
            "slots": {name: _save(obj, rollback=True) for name, obj in self._slots.items()},
            "pending": dict(self._pending),
            "schedule": {"epoch": self.epoch, "real_updates": self._real_updates,
                         "every": self.scheduler_every},
        }
        if not self.at_update_boundary:  # the open window's gradients
            snap["grads"] = [None if p.grad is None else p.grad.detach()
                             for p in self.model.parameters()]
        return copy.deepcopy(snap)

    def _apply(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict["model"], strict=True)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
            self._scheduler_mark = getattr(self.scheduler, "last_epoch", None)
        self.step = int(state_dict["step"])
        schedule = state_dict.get("schedule", {})
        self.epoch = int(schedule.get("epoch", 0))
        self._real_updates = int(schedule.get("real_updates", 0))
        if "pending" in state_dict:  # a rollback
            self._pending = dict(state_dict["pending"])
        for name, saved in state_dict["slots"].items():
            if name in self._slots:
                _load_into(self._slots[name], saved, name)
            else:
                self._pending[name] = saved
        if "grads" in state_dict:  # a rollback with a window open: its gradients
            for p, grad in zip(self.model.parameters(), state_dict["grads"]):
                p.grad = None if grad is None else grad.to(p.device, copy=True)

    def __repr__(self) -> str:
        sched = type(self.scheduler).__name__ if self.scheduler is not None else None
        return (
            f"TrainState(model={type(self.model).__name__}, "
            f"optimizer={type(self.optimizer).__name__}, scheduler={sched}, step={self.step}, "
            f"slots={sorted(self._slots)})"
        )


def _open_calls(obj: Any) -> int:
    calls = getattr(obj, "open_calls", 0)
    return calls if isinstance(calls, int) else 0


def _save(obj: Any, rollback: bool = False) -> Any:
    if rollback and hasattr(obj, "rollback_state_dict"):  # may hold what a checkpoint cannot
        return obj.rollback_state_dict()
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, dict):
        return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in obj.items()}
    raise TypeError(f"slot of type {type(obj).__name__} cannot be saved")


def _load_into(obj: Any, saved: Any, name: str) -> None:
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(saved)
        return
    if set(obj) != set(saved):
        raise ValueError(
            f"checkpointed state of {name!r} has keys {sorted(saved)}, this step expects "
            f"{sorted(obj)}; the checkpoint comes from a different transform stack"
        )
    for key, value in saved.items():
        if isinstance(obj[key], torch.Tensor):
            obj[key].copy_(value)
        else:
            obj[key] = value
