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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.engine import Step
from ..core.state import TrainState
from . import background, checks
from .collective import agree, anyone, from_rank0, rank_world
from .dcp import check_metadata, load_sharded, parse_metadata, verify_shards
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
    tensors_at,
)
from .rng import rng_setters, rng_state, set_rng_state

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
    payload: dict[str, Any]
    rank_state: dict[str, Any] | None
    rng_setters: list[tuple[str, Callable[[], None]]]
    dcp_metadata: Any


def _read_and_check(path: Path, state: TrainState, loader: Any, step: Step | None,
                    allow_resharding: bool, rank: int, world: int,
                    dropped: frozenset[str]) -> _Checked:
    marker = check_files(path)
    listed = marker["files"]
    meta = check_meta(loads_json(read_verified(path, META_FILE, listed), str(path / META_FILE)),
                      marker, str(path))
    checks.compare_models(meta["model"], checks.model_signature(state.model))
    checks.compare_stacks(meta["stack"], checks.stack_signature(step))
    checks.compare_optimizers(meta["optimizer"],
                              checks.optimizer_signature(state.optimizer, state.model))
    here_sched = None if state.scheduler is None else type(state.scheduler).__name__
    if meta["scheduler"] != here_sched:
        raise CheckpointError(
            f"the checkpoint's scheduler is {meta['scheduler']}, this state's is {here_sched}; "
            "build the state with the scheduler the checkpointed run used"
        )
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
    if not isinstance(payload, dict) or payload.get("format") != FORMAT \
            or not isinstance(payload.get("state"), dict):
        raise CheckpointError(f"{path / STATE_FILE} is not an accelfn checkpoint state")
    saved_state = payload["state"]
    if not {"model", "optimizer", "scheduler", "step", "slots"} <= set(saved_state):
        raise CheckpointError(f"{path / STATE_FILE} lacks parts of the training state")
    if not meta["optimizer_sharded"] and "optimizer" not in dropped:
        checks.check_optimizer_state(saved_state.get("optimizer"), state.optimizer)
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
    return _Checked(meta, payload, rank_state, setters, dcp_metadata)


def _check_prepared(path: Path, state: TrainState, checked: _Checked) -> None:
    """The checks that need the state as the step prepared it (sharded by FSDP2, with the
    transforms' slots made)."""
    if not checked.meta["sharded"] and checks.is_sharded(state.model):
        raise CheckpointError(
            f"{path} holds an unsharded model but this model's parameters are sharded "
            "(FSDP2); write the checkpoint with save(..., sharded=True) to load it under FSDP"
        )
    checks.check_slots(checked.payload["state"].get("slots"), state)


def load(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    loader: Any | None = None,
    step: Step | None = None,
    allow_resharding: bool = False,
) -> CheckpointInfo:
    """Equivalent to ``state.load_state_dict``, ``loader.load_state_dict`` and setting every RNG.

    It restores a checkpoint written by [`save`][] whole or not at all. Everything is
    checked before anything changes: the files against the commit marker (sizes and
    SHA-256), the model's parameter names, shapes and dtypes, the optimizer and its
    parameters, the scheduler, the transform stack (when ``step`` is given) and the loader's
    configuration. Should restoring still fail part-way, what was restored is rolled back
    (``load`` keeps a host copy of the state meanwhile) and the error is raised. An
    asynchronous [`save`][] of this process still writing is waited for first (and its error
    raised, if it failed and ``wait()`` did not raise it already).

    Args:
        path: a checkpoint directory, or a run's folder (then its newest committed one).
        state: the [`TrainState`][] to restore into, built like the saved one.
        loader: the loader whose position was saved.
        step: the step being trained: its transform stack must be the saved one; once the
            checkpoint's model, stack and optimizer are found to match, it prepares ``state``
            before anything is restored (e.g. FSDP2 shards the model before shards are
            loaded). A step refused for another stack prepares nothing.
        allow_resharding: load a checkpoint written by another number of processes:
            model, optimizer, scheduler and transform state are restored (sharded ones are
            resharded by DCP), RNG states and loader positions are not (they belonged to
            processes that no longer exist); ``loader`` must be None.

    Returns:
        [`CheckpointInfo`][] with the step, ``extra`` and the names of the parts restored.

    Raises:
        FileNotFoundError: no committed checkpoint at ``path``.
        TypeError: ``state``, ``step`` or ``loader`` is not what load takes.
        CheckpointError: (a ValueError) an incomplete, damaged or mismatched checkpoint, with
            what differs and how to fix it; ``state`` and ``loader`` are as they were.
            Under torchrun every process raises the same type, when only one failed too.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"load() takes an accelfn.TrainState, got {type(state).__name__}")
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
    try:  # model, stack, optimizer, files, loader: before the step prepares anything
        checks.stack_signature(step)
        checked = _read_and_check(resolved, state, loader, step, allow_resharding, rank, world,
                                  dropped)
    except BaseException as exc:
        error = exc
    agree(error, "checking the checkpoint", like=_MIRRORED)
    assert checked is not None
    try:
        if step is not None:  # only a step the checkpoint was saved with prepares the state:
            step.prepare(state)  # what its first call would do (collective under torchrun)
        _check_prepared(resolved, state, checked)
    except BaseException as exc:
        error = exc
    agree(error, "checking the checkpoint", like=_MIRRORED)
    meta = checked.meta

    snapshot = clone(state.snapshot())  # an open accumulation window included
    rng_before = rng_state()
    restored: list[str] = []
    try:
        restored += _restore_state(resolved, state, checked, dropped)
        if checked.rank_state is not None:
            for name, setter in checked.rng_setters:
                setter()
                restored.append(name)
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
        _rollback(state, snapshot, rng_before)
        cause = error if error is not None else CheckpointError("failed on another process")
        if not isinstance(cause, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise cause
        raise CheckpointError(
            f"restoring {resolved} failed ({type(cause).__name__}: {cause}); nothing was "
            "restored (the state and RNGs were rolled back). Build the state, step and loader "
            "as the checkpointed run did"
        ) from cause
    return CheckpointInfo(
        path=resolved, step=int(meta["step"]), world_size=int(meta["world_size"]),
        sharded=bool(meta["sharded"]), created=float(meta["created"]),
        stack=None if meta["stack"] is None else meta["stack"]["describe"],
        extra=checked.payload.get("extra"), restored=tuple(restored))


def _restore_state(path: Path, state: TrainState, checked: _Checked,
                   dropped: frozenset[str]) -> list[str]:
    meta, saved = checked.meta, dict(checked.payload["state"])
    saved["slots"] = {k: v for k, v in saved["slots"].items() if f"slot:{k}" not in dropped}
    if meta["sharded"]:
        with_optimizer = meta["optimizer_sharded"] and "optimizer" not in dropped
        slots = _slot_targets(path, state, saved["slots"])
        load_sharded(path / SHARDED_DIR, state, with_optimizer, checked.dcp_metadata, slots)
        saved["model"] = state.model.state_dict()  # already restored: load it onto itself
        if with_optimizer:
            saved["optimizer"] = state.optimizer.state_dict()
        saved["slots"] = fill_refs(saved["slots"], slots)
    if "optimizer" in dropped:
        saved["optimizer"] = state.optimizer.state_dict()
    if "scheduler" in dropped and state.scheduler is not None:
        saved["scheduler"] = state.scheduler.state_dict()
    if "step" in dropped:
        saved["step"] = state.step
    state.load_state_dict(saved)
    parts = ["model", "optimizer", "scheduler", "step", *(f"slot:{k}" for k in saved["slots"])]
    return [p for p in parts if p not in dropped]


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


def _rollback(state: TrainState, snapshot: dict[str, Any], rng: dict[str, Any]) -> None:
    """Put back what a failed ``load()`` changed (the original error is raised after)."""
    pending = getattr(state, "_pending", None)
    with contextlib.suppress(Exception):
        state.load_state_dict(snapshot)
    if isinstance(pending, dict):  # slots the failed load left waiting for their transform
        for name in [k for k in pending if k not in snapshot["slots"]]:
            del pending[name]
    with contextlib.suppress(Exception):
        set_rng_state(rng)
