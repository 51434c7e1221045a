"""load(): one call restores everything a run needs to continue exactly, whole or not at all.

Everything is read and checked before anything changes (``_read_and_check()``, before the
step prepares the state; then ``_check_prepared()``, what only the prepared state can tell);
should restoring still fail part-way, what was restored is rolled back. Every file loads with
``torch.load(weights_only=True)`` (DCP's metadata with the same restricted unpickler), so
loading never runs pickled code.

Under ``torchrun`` every process calls ``load()`` (it is collective).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.state import TrainState
from ..step.engine import Step
from . import background, checks
from .collective import agree, anyone, from_rank0, rank_world
from .dcp import Part, check_metadata, load_sharded, parse_metadata, verify_shards
from .files import (
    check_files,
    is_committed,
    latest,
    memory_available,
    read_torch,
    read_verified,
)
from .format import (
    FORMAT,
    MARKER,
    META_FILE,
    ONE,
    SHARDED_DIR,
    STATE_FILE,
    CheckpointError,
    CheckpointInfo,
    check_meta,
    clone,
    fill_refs,
    loads_json,
    parse_name,
    rank_file,
    refs_in,
    states_meta,
    tensors_at,
)
from .rng import rng_setters, rng_state, set_rng_state
from .states import (
    States,
    Steps,
    as_saved,
    check_names,
    named_states,
    named_steps,
    per_optimizer,
    saved_states,
)

__all__ = ["load"]

# The types load() raises before it changes anything, mirrored on the processes where it did
# not fail (agree: the failing process' own error there, else a CheckpointError): every
# process raises the same type, FileNotFoundError (no checkpoint) included.
_MIRRORED = (FileNotFoundError, TypeError, OSError)

# Test-only hook: parts named here are left out when a checkpoint is restored, to show that
# resuming without them is not exact. Set it with ``_dropping(...)``; never in real code.
_DROPPED: frozenset[str] = frozenset()


@contextlib.contextmanager
def _dropping(*parts: str) -> Iterator[None]:
    """Test-only: leave ``parts`` (see ``format.PARTS``, or ``"slot:<name>"``) out of restores."""
    global _DROPPED
    before = _DROPPED
    _DROPPED = frozenset(parts)
    try:
        yield
    finally:
        _DROPPED = before


def _resolve(path: Path) -> Path:
    if parse_name(path.name) is not None and path.is_symlink():
        raise CheckpointError(
            f"{path} is refused: it is a symbolic link (to {os.readlink(path)}), not a "
            "checkpoint directory of its run folder; a link could lead to any folder. Load the "
            "directory it points to by its own path if you trust it")
    if is_committed(path):
        return path
    if parse_name(path.name) is not None and path.is_dir():
        raise CheckpointError(
            f"{path} has no {MARKER} marker: its save did not complete (the process died "
            f"while writing it); load the previous one, e.g. latest({str(path.parent)!r})"
        )
    found = latest(path)
    if found is None:
        raise FileNotFoundError(
            f"no complete checkpoint in {path}; check the path (start from scratch when "
            "latest(directory) is None)"
        )
    return found


@dataclass
class _Checked:
    meta: dict[str, Any]
    records: dict[str, dict[str, Any]]  # meta.json's record of each state, by name
    payload: dict[str, Any]
    saved: dict[str, dict[str, Any]]  # state.pt's state of each state, by name
    rank_state: dict[str, Any] | None
    rng_setters: list[tuple[str, Callable[[], None]]]
    dcp_metadata: Any


@contextlib.contextmanager
def _named(name: str) -> Iterator[None]:
    """A CheckpointError raised for one of several states names the state."""
    try:
        yield
    except CheckpointError as error:
        if not name:
            raise
        raise CheckpointError(f"state {name!r}: {error}") from error


def _compare(record: dict[str, Any], state: TrainState, step: Step | None,
             resharding: bool) -> None:
    checks.compare_models(record["model"], checks.model_signature(state.model))
    checks.compare_stacks(record["stack"], checks.stack_signature(step), resharding)
    checks.compare_optimizers(record["optimizer"], state)
    checks.compare_schedulers(record["scheduler"], state)


def _read_and_check(path: Path, states: dict[str, TrainState], loader: Any,
                    steps: dict[str, Step | None], allow_resharding: bool, rank: int,
                    world: int, dropped: frozenset[str]) -> _Checked:
    for state in states.values():  # DCP writes into the model before the state could refuse
        state.refuse_while_lent("load()")
    marker = check_files(path)
    listed = marker["files"]
    meta = check_meta(loads_json(read_verified(path, META_FILE, listed), str(path / META_FILE)),
                      marker, str(path))
    records = states_meta(meta)
    check_names(list(records), states)
    for name, state in states.items():
        with _named(name):
            _compare(records[name], state, steps[name], allow_resharding)
    same_world = int(meta["world_size"]) == world
    if not same_world and not allow_resharding:
        raise CheckpointError(
            f"the checkpoint was written by {meta['world_size']} process(es), this run has "
            f"{world}: RNG states and loader positions belong to processes and cannot carry "
            "over. Resume with the same number of processes for an exact resume, or pass "
            "allow_resharding=True (and loader=None) to restore everything else"
        )
    if loader is not None:
        if not same_world:
            raise CheckpointError(
                f"the loader positions of {meta['world_size']} process(es) cannot be mapped "
                f"onto {world}; pass loader=None with allow_resharding=True and start the "
                "loader at a new epoch"
            )
        if not meta["loader"]:
            raise CheckpointError(f"{path} was saved without a loader position; pass "
                                  "loader=None, or save with loader= next time")
        if not callable(getattr(loader, "load_state_dict", None)):
            raise TypeError(f"loader={type(loader).__name__} has no load_state_dict()")
    dcp_metadata = None
    if meta["sharded"]:  # read and checked before anything changes; DCP loads with it
        where = path / SHARDED_DIR / ".metadata"
        dcp_metadata = parse_metadata(read_verified(path, f"{SHARDED_DIR}/.metadata", listed),
                                      where)
        check_metadata(dcp_metadata, listed, where, memory_available())
        verify_shards(path, listed, rank, world, int(meta["world_size"]))
    payload = read_torch(path, STATE_FILE, listed)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path / STATE_FILE} is not an accelfn checkpoint state")
    saved = saved_states(payload, list(records), str(path / STATE_FILE))
    for name, state in states.items():
        with _named(name):
            _check_optimizers(saved[name], state, records[name], meta["sharded"], dropped)
    rank_state = None
    setters: list[tuple[str, Callable[[], None]]] = []
    if same_world:
        rank_state = read_torch(path, rank_file(rank), listed)
        if not isinstance(rank_state, dict) or rank_state.get("format") != FORMAT \
                or rank_state.get("rank") != rank:
            raise CheckpointError(f"{path}/{rank_file(rank)} is not this process' state")
        setters = rng_setters(rank_state.get("rng"), dropped)
        if loader is not None:
            checks.check_loader(rank_state.get("loader"), loader)
    return _Checked(meta, records, payload, saved, rank_state, setters, dcp_metadata)


def _check_optimizers(saved: dict[str, Any], state: TrainState, record: dict[str, Any],
                      sharded: bool, dropped: frozenset[str]) -> None:
    """state.pt's optimizer states fit the state's optimizers (those DCP holds are None)."""
    n = len(state.optimizers)
    entries = per_optimizer(saved["optimizer"], n, "optimizer state")
    per_optimizer(saved["scheduler"], n, "scheduler state")
    if any(entry is None for entry in entries) and not (sharded and record["optimizer_sharded"]):
        raise CheckpointError("the checkpoint's optimizer state is missing: it is malformed "
                              "(forged or damaged); load an earlier checkpoint")
    if "optimizer" in dropped:
        return
    for entry, optimizer in zip(entries, state.optimizers):
        if entry is not None:  # else: in sharded/, where DCP checks it
            checks.check_optimizer_state(entry, optimizer, state.model)


def _check_prepared(path: Path, states: dict[str, TrainState], checked: _Checked) -> None:
    """The checks that need the states as the steps prepared them (sharded by FSDP2, with the
    transforms' slots made)."""
    for name, state in states.items():
        with _named(name):
            if not checked.meta["sharded"] and checks.is_sharded(state.model):
                raise CheckpointError(
                    f"{path} holds an unsharded model but this model's parameters are sharded "
                    "(FSDP2); write the checkpoint with save(..., sharded=True) to load it "
                    "under FSDP"
                )
            checks.check_slots(checked.saved[name].get("slots"), state)


def load(
    path: str | os.PathLike[str],
    state: States,
    *,
    loader: Any | None = None,
    step: Steps = None,
    allow_resharding: bool = False,
    allow_nonfinite: bool = False,
) -> CheckpointInfo:
    """Equivalent to ``state.load_state_dict``, ``loader.load_state_dict`` and setting every RNG.

    It restores a checkpoint written by [`save`][] whole or not at all. Everything is
    checked before anything changes: the files against the commit marker (sizes and
    SHA-256), the model's parameter names, shapes and dtypes, the optimizers (as many, in the
    same order, each of the same class over the same parameters by name, group by group),
    the schedulers, the transform stack (when ``step`` is given) and the loader's
    configuration. Should restoring still fail part-way, what was restored is rolled back
    (``load`` keeps a host copy of the state meanwhile) and the error is raised. An
    asynchronous [`save`][] of this process still writing is waited for first (and its error
    raised, if it failed and ``wait()`` did not raise it already).

    A checkpoint of several states (``save(directory, {name: state})``) loads into a mapping
    of states of the same names, ``load(directory, {name: state}, step={name: step})``, all of
    them or none; a checkpoint of one state loads into one state.

    Args:
        path: a checkpoint directory, or a run's folder (then its newest committed one).
        state: the [`TrainState`][] to restore into, built like the saved one; for a
            checkpoint of several states, ``{name: TrainState}`` with the saved names.
        loader: the loader whose position was saved.
        step: the step being trained: its transform stack must be the saved one; once the
            checkpoint's model, stack and optimizer are found to match, it prepares ``state``
            before anything is restored (e.g. FSDP2 shards the model before shards are
            loaded). A step refused for another stack prepares nothing. For several states,
            ``{name: step}`` (some names only, or None).
        allow_resharding: load a checkpoint written by another number of processes or
            another layout (``distributed``'s strategy and mesh may differ from the saved
            step's): model, optimizer, scheduler and transform state are restored (sharded
            ones are resharded by DCP), RNG states and loader positions are not (they
            belonged to processes that no longer exist); ``loader`` must be None.
        allow_nonfinite: load a checkpoint whose parameters or optimizer state hold NaN
            or Inf (refused by default: a diverged run's, or a forged one).

    Returns:
        [`CheckpointInfo`][] with the step, ``extra`` and the names of the parts restored.

    Raises:
        FileNotFoundError: no committed checkpoint at ``path``.
        TypeError: ``state``, ``step`` or ``loader`` is not what load takes.
        ValueError: an empty mapping of states, a state given twice, a step for no state.
        CheckpointError: (a ValueError) an incomplete, damaged or mismatched checkpoint (a
            checkpoint of other states, too), with what differs and how to fix it; the states
            and ``loader`` are as they were.
            Under torchrun every process raises the same type, when only one failed too.
    """
    states = named_states(state, "load")
    background.wait_previous("load")  # an asynchronous save of this process commits first
    rank, world = rank_world()
    error: BaseException | None = None
    resolved: Path | None = None
    if rank == 0:
        try:
            resolved = _resolve(Path(path))
        except BaseException as exc:  # every process must hear of it
            error = exc
    agree(error, "finding the checkpoint", like=_MIRRORED)
    resolved = Path(from_rank0(str(resolved)))
    dropped = _DROPPED
    checked: _Checked | None = None
    steps: dict[str, Step | None] = {}
    try:  # model, stack, optimizer, files, loader: before the step prepares anything
        steps = named_steps(step, states, "load")  # (a refused step: on every process)
        checked = _read_and_check(resolved, states, loader, steps, allow_resharding, rank,
                                  world, dropped)
    except BaseException as exc:
        error = exc
    agree(error, "checking the checkpoint", like=_MIRRORED)
    assert checked is not None
    try:
        for name, own in states.items():  # only a step the checkpoint was saved with
            chosen = steps[name]  # prepares the state: what its first call would do
            if chosen is not None:  # (collective under torchrun)
                chosen.prepare(own)
        _check_prepared(resolved, states, checked)
    except BaseException as exc:
        error = exc
    agree(error, "checking the checkpoint", like=_MIRRORED)
    meta = checked.meta

    snapshots = {name: clone(own.snapshot()) for name, own in states.items()}  # open windows
    rng_before = rng_state()  # included
    restored: list[str] = []
    try:
        restored += _restore_states(resolved, states, checked, dropped)
        if not allow_nonfinite:  # a failure rolls back what was restored, as any
            for name, own in states.items():
                checks.check_finite(own, name)
        if checked.rank_state is not None:
            for part, setter in checked.rng_setters:
                setter()
                restored.append(part)
    except BaseException as exc:
        error = exc
    failed = anyone(error is not None)
    if not failed and loader is not None and "data" not in dropped:
        assert checked.rank_state is not None
        try:  # last, and checked above: a BatchLoader refuses before it changes anything
            loader.load_state_dict(checked.rank_state["loader"])
            restored.append("data")
        except BaseException as exc:
            error = exc
        failed = anyone(error is not None)
    if failed:
        unrolled = [problem for name, own in states.items()
                    if (problem := _rollback(own, snapshots[name])) is not None]
        with contextlib.suppress(Exception):
            set_rng_state(rng_before)
        cause = error if error is not None else CheckpointError("failed on another process")
        if not isinstance(cause, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise cause
        outcome = ("nothing was restored (the state and RNGs were rolled back)" if not unrolled
                   else f"rolling the state back failed too ({'; '.join(unrolled)}), so it may "
                   "hold part of the checkpoint: build a new state")
        raise CheckpointError(
            f"restoring {resolved} failed ({type(cause).__name__}: {cause}); {outcome}. Build "
            "the state, step and loader as the checkpointed run did"
        ) from cause
    if loader is None and meta["loader"] and checked.rank_state is not None and rank == 0:
        warnings.warn(
            f"{resolved} holds the loader position of the run it saved, but load() was given "
            "no loader=: the loader starts where it was built, so batches already trained on "
            "come again and the resume is not exact. Pass load(..., loader=loader) (the "
            "loader, built as before) to continue with the next batch", UserWarning,
            stacklevel=2)
    stacks = {name: r["stack"]["describe"] for name, r in checked.records.items()
              if r["stack"] is not None}
    return CheckpointInfo(
        path=resolved, step=int(meta["step"]), world_size=int(meta["world_size"]),
        sharded=bool(meta["sharded"]), created=float(meta["created"]),
        stack=stacks.get(ONE) if ONE in states else
        "; ".join(f"{name}: {text}" for name, text in stacks.items()) or None,
        extra=checked.payload.get("extra"), restored=tuple(restored),
        states=() if ONE in states else tuple(states))


def _restore_states(path: Path, states: dict[str, TrainState], checked: _Checked,
                    dropped: frozenset[str]) -> list[str]:
    saved = {name: dict(checked.saved[name]) for name in states}
    for one in saved.values():
        one["slots"] = {k: v for k, v in one["slots"].items() if f"slot:{k}" not in dropped}
    if checked.meta["sharded"]:  # every state's sharded part in one DCP load
        parts = {}
        for name, state in states.items():
            held = tuple(entry is None and "optimizer" not in dropped for entry in
                         per_optimizer(saved[name]["optimizer"], len(state.optimizers),
                                       "optimizer state"))
            parts[name] = Part(state, held, _slot_targets(path, state, saved[name]["slots"]))
        load_sharded(path / SHARDED_DIR, parts, checked.dcp_metadata)
        for name, part in parts.items():
            state, one = part.state, saved[name]
            one["model"] = state.model.state_dict()  # already restored: load it onto itself
            entries = per_optimizer(one["optimizer"], len(state.optimizers), "optimizer state")
            one["optimizer"] = as_saved(
                [o.state_dict() if held else entry
                 for o, held, entry in zip(state.optimizers, part.held, entries)], len(entries))
            one["slots"] = fill_refs(one["slots"], part.slots)
    restored = []
    for name, state in states.items():
        one, n = saved[name], len(state.optimizers)
        if "optimizer" in dropped:
            one["optimizer"] = as_saved([o.state_dict() for o in state.optimizers], n)
        if "scheduler" in dropped:
            one["scheduler"] = as_saved(
                [None if s is None else s.state_dict() for s in state.schedulers], n)
        if "step" in dropped:
            one["step"] = state.step
        state.load_state_dict(one)
        parts_ = ["model", "optimizer", "scheduler", "step", *(f"slot:{k}" for k in one["slots"])]
        restored += [f"{name}/{p}" if name else p for p in parts_ if p not in dropped]
    return restored


def _slot_targets(path: Path, state: TrainState, saved: dict[str, Any]) -> dict[str, Any]:
    """Copies of this state's slot tensors that DCP loads the checkpoint's sharded slot
    tensors into (resharded to this run's layout, as the model's are)."""
    wanted = refs_in(saved)
    if not wanted:
        return {}
    live = tensors_at(state.state_dict()["slots"], wanted)
    missing = sorted(wanted - set(live))
    if missing:
        raise CheckpointError(
            f"{path} holds sharded transform state ({', '.join(missing[:3])}) that this state "
            "has no tensor for; pass the step the checkpoint was saved with (load(..., "
            "step=step)) so that its transforms make their state first")
    return {k: v.detach().clone() for k, v in live.items()}


def _rollback(state: TrainState, snapshot: dict[str, Any]) -> str | None:
    """Put back what a failed ``load()`` changed in ``state`` (the original error is raised
    after); what went wrong if it could not (None: rolled back)."""
    pending = getattr(state, "_pending", None)
    problem = None
    try:
        state.load_state_dict(snapshot)
    except Exception as error:
        problem = f"{type(error).__name__}: {error}"
    if isinstance(pending, dict):  # slots the failed load left waiting for their transform
        for name in [k for k in pending if k not in snapshot["slots"]]:
            del pending[name]
    return problem
