"""What a checkpoint holds per state: one TrainState, or several by name (a GAN's generator
and discriminator), each with one optimizer or several.

A checkpoint of one state keeps the layout it always had (``state.pt``'s ``"state"``, the
state's signatures at the top of ``meta.json``); a checkpoint of several keeps each state
under its name (``"states": {name: ...}`` in both). Inside, the calls go over
``{name: state}``: ``{ONE: state}`` for one state (``ONE`` is ``""``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeAlias

from ..core.state import TrainState
from ..step.engine import Step
from .checks import model_signature, optimizer_signature, stack_signature
from .format import ONE, CheckpointError

__all__ = ["States", "Steps", "as_saved", "at_update_boundary", "check_names", "checkpoint_step",
           "describe_names", "held_by_dcp", "named_states", "named_steps", "per_optimizer",
           "saved_states", "signatures"]

States: TypeAlias = "TrainState | Mapping[str, TrainState]"
"""What ``save()`` and ``load()`` take: a TrainState, or several by name (a GAN's)."""
Steps: TypeAlias = "Step | Mapping[str, Step] | None"
"""The step being trained; for several states, the step of each by the state's name."""
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,99}")


def named_states(state: Any, caller: str) -> dict[str, TrainState]:
    """``{name: state}`` sorted by name for a mapping of states, ``{ONE: state}`` for one."""
    if isinstance(state, TrainState):
        return {ONE: state}
    if not isinstance(state, Mapping):
        raise TypeError(f"{caller}() takes an accelfn.TrainState or a mapping {{name: "
                        f"TrainState}} of several states, got {type(state).__name__}")
    if not state:
        raise ValueError(f"{caller}() got an empty mapping of states; pass the TrainState, or "
                         "{name: TrainState} for each state the checkpoint holds")
    seen: dict[int, str] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"{caller}(): the state name {name!r} cannot name a state in a checkpoint; use "
                "letters, digits, '_' and '-' (e.g. 'generator', 'discriminator')")
        if not isinstance(value, TrainState):
            raise TypeError(f"{caller}(): states[{name!r}] is a {type(value).__name__}; each "
                            "value of the mapping is an accelfn.TrainState")
        if id(value) in seen:
            raise ValueError(f"{caller}(): states {seen[id(value)]!r} and {name!r} are the same "
                             "TrainState twice; give each state once")
        seen[id(value)] = name
    return {name: state[name] for name in sorted(state)}


def named_steps(step: Any, states: dict[str, TrainState], caller: str
                ) -> dict[str, Step | None]:
    """The step of each state: ``step`` for one state, ``step={name: step}`` for several."""
    if ONE in states:
        if isinstance(step, Mapping):
            raise TypeError(f"{caller}() got a mapping of steps for one state; pass the Step "
                            "that trains it (a mapping is for a mapping of states)")
        stack_signature(step)  # a TypeError for what is no Step
        return {ONE: step}
    if step is None:
        return dict.fromkeys(states)
    if not isinstance(step, Mapping):
        raise TypeError(
            f"{caller}() of several states ({describe_names(states)}) takes step={{name: step}}"
            f": the step that trains each state, by its name (or None), got "
            f"{type(step).__name__}")
    unknown = sorted(str(name) for name in step if name not in states)
    if unknown:
        raise ValueError(f"{caller}(): step= names {', '.join(unknown)}, which is not one of "
                         f"the states ({describe_names(states)})")
    for value in step.values():
        stack_signature(value)
    return {name: step.get(name) for name in states}


def describe_names(names: Mapping[str, Any] | list[str]) -> str:
    return ", ".join(sorted(names))


def checkpoint_step(states: dict[str, TrainState]) -> int:
    """The step a checkpoint is named after: its state's, the largest of several states'."""
    return max(state.step for state in states.values())


def at_update_boundary(state: Any) -> bool:
    """Whether a state, or every state of a mapping, may be saved now (no window open)."""
    if isinstance(state, Mapping):
        return all(not isinstance(s, TrainState) or s.at_update_boundary
                   for s in state.values())
    return not isinstance(state, TrainState) or state.at_update_boundary


# ------------------------------------------------------------------------------ optimizers
def signatures(state: TrainState, step: Step | None) -> dict[str, Any]:
    """meta.json's record of a state: its model's, optimizers' and schedulers' signatures
    and its step's stack. One optimizer: ``"optimizer"`` is its signature and
    ``"scheduler"`` its scheduler's class name (or None); several: a list of each, in order."""
    optimizers = [optimizer_signature(o, state.model) for o in state.optimizers]
    schedulers = [None if s is None else type(s).__name__ for s in state.schedulers]
    return {"model": model_signature(state.model),
            "optimizer": as_saved(optimizers, len(optimizers)),
            "scheduler": as_saved(schedulers, len(schedulers)),
            "stack": stack_signature(step)}


def per_optimizer(saved: Any, n: int, what: str) -> list[Any]:
    """A state dict's (or meta.json's) ``"optimizer"`` or ``"scheduler"`` entry as one entry
    per optimizer: one optimizer's is not a list, several optimizers' is one."""
    if n == 1 and not isinstance(saved, list):
        return [saved]
    if n > 1 and isinstance(saved, list) and len(saved) == n:
        return list(saved)
    raise CheckpointError(f"the checkpoint's {what} does not match its {n} optimizer(s): it is "
                          "malformed (forged or damaged); load an earlier checkpoint")


def as_saved(entries: list[Any], n: int) -> Any:
    """The inverse of [`per_optimizer`][]: one optimizer's entry, or the list of several."""
    return entries[0] if n == 1 else list(entries)


def saved_states(payload: dict[str, Any], names: list[str], where: str
                 ) -> dict[str, dict[str, Any]]:
    """The saved TrainState(s) of a checkpoint's state.pt, by name (``ONE`` for one)."""
    found = {ONE: payload.get("state")} if names == [ONE] else payload.get("states")
    if names == [ONE] and not isinstance(payload.get("state"), dict):
        raise CheckpointError(f"{where} is not an accelfn checkpoint state")
    if not isinstance(found, dict) or sorted(found) != sorted(names):
        raise CheckpointError(f"{where} does not hold the states its metadata names; it is "
                              "forged or damaged")
    for state in found.values():
        if not isinstance(state, dict) or \
                not {"model", "optimizer", "scheduler", "step", "slots"} <= set(state):
            raise CheckpointError(f"{where} lacks parts of the training state")
    return found


def check_names(saved: list[str], states: dict[str, TrainState]) -> None:
    """A checkpoint of one state loads into one state, one of several into the same names."""
    if (saved == [ONE]) == (ONE in states) and (ONE in states or sorted(saved) == list(states)):
        return
    if ONE in states:
        names = ", ".join(f"{name!r}: ..." for name in sorted(saved))
        raise CheckpointError(
            f"the checkpoint holds several states ({describe_names(saved)}), this call passes "
            f"one TrainState; pass a mapping {{{names}}} of states built as the checkpointed "
            "run built them")
    if saved == [ONE]:
        raise CheckpointError(
            f"the checkpoint holds one TrainState, this call passes several states "
            f"({describe_names(states)}); pass the state itself (the one the checkpointed run "
            "saved), not a mapping")
    raise CheckpointError(
        f"the checkpoint holds the states {describe_names(saved)}; this call passes "
        f"{describe_names(states)}: name the states as the checkpointed run did, one for each "
        "state it saved")


def held_by_dcp(state: TrainState, sharded: bool) -> tuple[bool, ...]:
    """Per optimizer: whether a sharded save writes its state with DCP (it has state; an
    optimizer without any is saved in state.pt, so that saving never initialises it)."""
    return tuple(sharded and bool(o.state) for o in state.optimizers)

