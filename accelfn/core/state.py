"""TrainState: the model, optimizer, scheduler and every transform's checkpointable state."""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .ownership import check_model_and_optimizers, paired_schedulers
from .schedulers import EpochCheck
from .schedulers import mark as _mark
from .schedulers import per_update as _per_update

__all__ = ["TrainState"]
# torch warns when a scheduler steps before the optimizer did in this process
_STEPPED_FIRST = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"


_ALIVE = [0]  # TrainStates alive in this process (a count read per call: no WeakSet walk)


def _gone() -> None:
    _ALIVE[0] -= 1


@runtime_checkable
class Deferred(Protocol):
    """A slot holding bookkeeping deferred to avoid a host sync (the non-finite guard's
    decision read one update later): [`TrainState.sync`][] settles it."""

    def settle(self, state: TrainState) -> None: ...


@runtime_checkable
class Window(Protocol):
    """A slot holding an open accumulation window (calls whose gradients are not applied
    yet): the state is not at an update boundary while ``open_calls`` > 0; a rollback copy
    keeps the window (``rollback_state_dict``); loading a checkpoint drops it."""

    @property
    def open_calls(self) -> int: ...

    def rollback_state_dict(self) -> Any: ...


class TrainState:
    """Everything a training run updates: model, optimizers, schedulers, transform state.

    ``optimizer`` is one optimizer, or a sequence of them that together hold the model's
    trainable parameters, each parameter in exactly one (Muon for the hidden matrices and AdamW
    for the rest, say); every update steps all of them. ``scheduler`` is one scheduler (or
    None) for one optimizer, or a sequence with one entry per optimizer (None entries allowed).

    ``state_dict()`` / ``load_state_dict()`` cover all of it. Transforms keep their state in
    named *slots* (``state.slot(name, factory)``); a slot is created on first use, and a slot
    loaded from a checkpoint before it exists is applied when it is created.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scheduler: Any | None = None,
        *,
        scheduler_every: int | str = 1,
    ) -> None:
        optimizers: tuple[torch.optim.Optimizer, ...] = (
            tuple(optimizer) if isinstance(optimizer, (list, tuple))
            else (optimizer,))  # type: ignore[assignment]
        check_model_and_optimizers(model, optimizers)
        if not (scheduler_every == "epoch" or (isinstance(scheduler_every, int)
                                               and not isinstance(scheduler_every, bool)
                                               and scheduler_every >= 1)):
            raise ValueError(
                f"TrainState(scheduler_every={scheduler_every!r}): give an int N >= 1 (step the "
                "scheduler every N real updates) or 'epoch' (step it in state.end_epoch())")
        schedulers = paired_schedulers(scheduler, optimizers)
        self._model = model
        self._optimizers = optimizers
        self._schedulers = schedulers
        self._has_scheduler = any(s is not None for s in schedulers)
        self.step = 0  # optimizer updates attempted (skipped ones included)
        self.epoch = 0  # epochs ended with end_epoch()
        self.scheduler_every = scheduler_every
        self._real_updates = 0  # updates applied since the scheduler last stepped
        self._updates = 0  # updates applied in all (timm schedulers' num_updates)
        self._slots: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._factories: dict[str, Callable[[], Any]] = {}  # each slot's, to start it afresh
        self._preparations: list[tuple[Any, Any, str]] = []
        self._scheduler_marks: list[Any] = [_mark(s) for s in schedulers]
        self._epoch_check = EpochCheck(schedulers, scheduler_every)  # end_epoch() forgotten
        self._warned: set[str] = set()
        self._lent: dict[int, torch.Tensor] = {}  # id(model tensor) -> its own value, held
        _ALIVE[0] += 1
        weakref.finalize(self, _gone)

    @staticmethod
    def several_alive() -> bool:
        """Whether more than one TrainState lives in this process (several models: a GAN,
        distillation), when a step's backward must reach its own parameters only."""
        return _ALIVE[0] > 1

    def backward_inputs(self) -> tuple[torch.Tensor, ...]:
        """The trainable parameters the optimizers hold, for ``backward(inputs=...)``; ``()``
        (everything that requires grad) when some are not plain parameters (FSDP2's DTensor
        shards and float8 weights receive their gradients through hooks, not as leaves)."""
        params = tuple(p for optimizer in self._optimizers for group in optimizer.param_groups
                       for p in group["params"] if p.requires_grad)
        if any(type(p) is not nn.Parameter for p in params):
            return ()
        return params

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
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """Every optimizer of [`model`][], in the order given (fixed, like the model)."""
        return self._optimizers

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of [`model`][] when the state has one (see [`optimizers`][])."""
        if len(self._optimizers) > 1:
            raise AttributeError(
                f"this TrainState has {len(self._optimizers)} optimizers "
                f"({', '.join(type(o).__name__ for o in self._optimizers)}); use "
                "state.optimizers")
        return self._optimizers[0]

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        raise AttributeError(
            "TrainState.optimizer cannot be replaced: it holds the prepared model's parameters. "
            "Build a new TrainState(model, optimizer); to change hyper-parameters, edit "
            "optimizer.param_groups")

    @property
    def schedulers(self) -> tuple[Any | None, ...]:
        """One scheduler or None per optimizer, in the order of [`optimizers`][]."""
        return self._schedulers

    @property
    def scheduler(self) -> Any | None:
        """The scheduler of the state's one optimizer, or None (see [`schedulers`][])."""
        if len(self._schedulers) > 1:
            raise AttributeError(
                f"this TrainState has {len(self._schedulers)} optimizers, each with its own "
                "scheduler entry; use state.schedulers")
        return self._schedulers[0]

    @property
    def has_scheduler(self) -> bool:
        """Whether any optimizer has a scheduler."""
        return self._has_scheduler

    @property
    def preparations(self) -> tuple[tuple[Any, Any, str], ...]:
        """(key, prepared, description) of each stack that prepared this state so far."""
        return tuple(self._preparations)

    def add_preparation(self, key: Any, prepared: Any, description: str) -> None:
        """Record the preparation a step made of this state (the engine calls it)."""
        self._preparations.append((key, prepared, description))

    def step_scheduler(self) -> None:
        """Step the schedulers after a real update (the engine's call, once per update).

        Warns once when a scheduler was stepped by someone else since the last update: a
        step already steps it, so a loop that also calls ``scheduler.step()`` moves the
        schedule twice as fast.
        """
        if not self._has_scheduler:
            return
        self._updates += 1
        self._epoch_check.after_update(self.warn_once)
        for scheduler in self._schedulers:  # timm's: told the count of updates, each update
            if scheduler is not None and _per_update(scheduler):
                scheduler.step_update(num_updates=self._updates)
        if self.scheduler_every == "epoch":
            return
        self._real_updates += 1
        if self._real_updates < int(self.scheduler_every):
            return
        self._real_updates = 0
        self._advance()

    def end_epoch(self) -> None:
        """Mark the end of an epoch: counts ``state.epoch`` and, with
        ``scheduler_every="epoch"``, steps the schedulers (a per-epoch ``StepLR``, say).
        A timm scheduler is stepped with the epoch count, as timm's loop does after each
        epoch (``scheduler.step(epoch + 1)``). A loop that never calls it while a scheduler
        moves per epoch is warned once, at the first update in the loader's next epoch."""
        self.epoch += 1
        self._epoch_check.ended()
        for scheduler in self._schedulers:
            if scheduler is not None and _per_update(scheduler):
                scheduler.step(self.epoch)
        if self.has_scheduler and self.scheduler_every == "epoch":
            with warnings.catch_warnings():
                if self.step:  # updates ran, maybe in the process that saved this state
                    warnings.filterwarnings("ignore", _STEPPED_FIRST, UserWarning)
                self._advance()

    def _advance(self) -> None:
        marks = self._scheduler_marks
        for i, scheduler in enumerate(self._schedulers):
            if scheduler is None or _per_update(scheduler):
                continue
            mark = _mark(scheduler)
            if mark is not None and marks[i] is not None and mark != marks[i]:
                self.warn_once(
                    "scheduler",
                    f"the scheduler was stepped outside the step ({mark - marks[i]} "
                    "extra time(s) since the last update): accelfn steps the TrainState's "
                    "scheduler once per real update already. Remove scheduler.step() from the "
                    "loop (or keep the scheduler out of the TrainState to step it yourself)")
            scheduler.step()
            marks[i] = _mark(scheduler)

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
            self._factories[name] = factory
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
        return not any(obj.open_calls for obj in self._slots.values()
                       if isinstance(obj, Window))

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
            if isinstance(obj, Deferred):
                obj.settle(self)

    def state_dict(self) -> dict[str, Any]:
        """All training state as tensors and plain data (loadable with ``weights_only=True``)."""
        self.sync()
        slots = {name: _save(obj) for name, obj in self._slots.items()}
        slots.update({k: v for k, v in self._pending.items() if k not in slots})
        return {
            "model": self._model_state_dict(),
            **self._optimization_state_dict(),
            "step": self.step,
            "slots": slots,
            "schedule": {"epoch": self.epoch, "real_updates": self._real_updates,
                         "every": self.scheduler_every, "updates": self._updates},
        }

    def refuse_while_lent(self, what: str) -> None:
        """Raise RuntimeError naming ``what`` inside ``with af.ema_weights(state):``, where
        the model holds borrowed weights that its own replace when the block ends."""
        if self._lent:
            raise RuntimeError(
                f"{what} inside `with af.ema_weights(state):` (the model holds borrowed "
                "weights, and its own come back when the block ends, over what would be "
                "loaded); load after the block")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned; refuses a mismatched checkpoint whole.

        Loading a checkpoint rolls back to it: the transforms' state it does not hold (an
        average, a loss scale, counters of a later run) starts afresh, as in a new state, and
        an accumulation window open at the call (``mode="calls"``) is discarded with the
        gradients it accumulated. A failed load changes nothing, the open window included.
        [`snapshot`][]'s copy loads too, and puts back exactly what it copied."""
        self.refuse_while_lent("load_state_dict")
        missing = {"model", "optimizer", "scheduler", "step", "slots"} - set(state_dict)
        if missing:
            raise KeyError(f"not a TrainState checkpoint: missing {sorted(missing)}")
        schedule = state_dict.get("schedule", {"every": self.scheduler_every})
        if schedule.get("every", self.scheduler_every) != self.scheduler_every:
            raise ValueError(
                f"the checkpoint stepped its scheduler every {schedule['every']!r}, this state "
                f"every {self.scheduler_every!r}; build the state with the checkpointed run's "
                "scheduler_every")
        self._check_optimization(state_dict["optimizer"], state_dict["scheduler"])
        backup = self.snapshot()
        was_open = not self.at_update_boundary
        try:
            self._apply(state_dict)
        except BaseException:
            self._apply(backup)  # whole or nothing: never a partial restore
            raise
        if "pending" not in state_dict and was_open:  # a checkpoint: the window is gone
            self.model.zero_grad(set_to_none=True)  # (its slot was started afresh)

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the whole state, to roll back to with [`load_state_dict`][].

        Unlike [`state_dict`][] it can be taken with an accumulation window open: it holds
        the window and its gradients, so it is no checkpoint (it cannot be saved).
        """
        self.sync()
        snap = {
            "model": self._model_state_dict(),
            **self._optimization_state_dict(),
            "step": self.step,
            "slots": {name: _save(obj, rollback=True) for name, obj in self._slots.items()},
            "pending": dict(self._pending),
            "schedule": {"epoch": self.epoch, "real_updates": self._real_updates,
                         "every": self.scheduler_every, "updates": self._updates},
        }
        if not self.at_update_boundary:  # the open window's gradients
            snap["grads"] = [None if p.grad is None else p.grad.detach()
                             for p in self.model.parameters()]
        return copy.deepcopy(snap)

    def _optimization_state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}``: one optimizer's state dict and its
        scheduler's (or None), or with several optimizers a list of each, in order."""
        optimizers = [o.state_dict() for o in self._optimizers]
        schedulers = [None if s is None else s.state_dict() for s in self._schedulers]
        if len(optimizers) == 1:
            return {"optimizer": optimizers[0], "scheduler": schedulers[0]}
        return {"optimizer": optimizers, "scheduler": schedulers}

    def _check_optimization(self, optimizer: Any, scheduler: Any) -> None:
        """Refuse a checkpoint of another number of optimizers or other schedulers."""
        n = len(self._optimizers)
        saved_n = len(optimizer) if isinstance(optimizer, list) else 1
        if saved_n != n:
            raise ValueError(
                f"the checkpoint holds {saved_n} optimizer(s), this state {n}; build the state "
                "with the optimizers of the checkpointed run, in the same order")
        schedulers = scheduler if n > 1 else [scheduler]
        if not isinstance(schedulers, list) or len(schedulers) != n:
            raise ValueError(f"the checkpoint's schedulers do not match its {n} optimizers")
        for i, (saved, here) in enumerate(zip(schedulers, self._schedulers)):
            if (saved is None) != (here is None):
                which = "" if n == 1 else f" of optimizer {i}"
                raise ValueError(
                    f"the checkpoint and this state disagree on having a scheduler{which}; "
                    "build the state the way the checkpointed run did"
                )

    def _apply(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict["model"], strict=True)
        several = len(self._optimizers) > 1
        optimizers = state_dict["optimizer"] if several else [state_dict["optimizer"]]
        schedulers = state_dict["scheduler"] if several else [state_dict["scheduler"]]
        for optimizer, saved in zip(self._optimizers, optimizers):
            optimizer.load_state_dict(saved)
        for i, (scheduler, saved) in enumerate(zip(self._schedulers, schedulers)):
            if scheduler is not None:
                scheduler.load_state_dict(saved)
                self._scheduler_marks[i] = getattr(scheduler, "last_epoch", None)
        self.step = int(state_dict["step"])
        schedule = state_dict.get("schedule", {})
        self.epoch = int(schedule.get("epoch", 0))
        self._real_updates = int(schedule.get("real_updates", 0))
        self._updates = int(schedule.get("updates", self.step))
        # a rollback puts back what waited; a checkpoint's missing slots start afresh
        self._pending = dict(state_dict["pending"]) if "pending" in state_dict else {}
        for name, saved in state_dict["slots"].items():
            if name in self._slots:
                _load_into(self._slots[name], saved, name)
            else:
                self._pending[name] = saved
        if "pending" not in state_dict:  # last, once the model is loaded: what a new state
            for name, obj in self._slots.items():  # would make (an average of these weights)
                if name not in state_dict["slots"]:
                    _load_into(obj, _save(self._factories[name]()), name)
        if "grads" in state_dict:  # a rollback with a window open: its gradients
            for p, grad in zip(self.model.parameters(), state_dict["grads"]):
                p.grad = None if grad is None else grad.to(p.device, copy=True)

    def __repr__(self) -> str:
        def names(items: Sequence[Any]) -> str:
            text = [None if x is None else type(x).__name__ for x in items]
            return str(text[0]) if len(text) == 1 else f"[{', '.join(map(str, text))}]"

        several = len(self._optimizers) > 1
        return (
            f"TrainState(model={type(self.model).__name__}, "
            f"optimizer{'s' if several else ''}={names(self._optimizers)}, "
            f"scheduler{'s' if several else ''}={names(self._schedulers)}, step={self.step}, "
            f"slots={sorted(self._slots)})"
        )


def _save(obj: Any, rollback: bool = False) -> Any:
    if rollback and isinstance(obj, Window):  # may hold what a checkpoint cannot
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
