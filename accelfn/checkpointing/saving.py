"""save(): one call writes everything a run needs to continue, atomically.

Writes are atomic: everything goes to a hidden temporary directory, is fsynced, the directory
is renamed, every file is checked against what was written, and the ``COMMITTED`` marker is
written last; ``latest()`` and ``load()``
never use a directory without it, and rotation (``keep``) deletes old checkpoints only after
the new one is committed. One writer at a time: a save holds the folder's lock (see
``lock``) from before its first write until rotation is done, so the leftovers it deletes
are those of saves that died, never another live writer's files.

Under ``torchrun`` every process calls ``save()`` (it is collective): with DDP, rank 0
writes the replicated state and every rank its own RNG states and loader position; with FSDP2
(DTensor parameters) model and optimizer are written by all ranks through DCP.

``save(..., asynchronous=True)`` runs step 1 and a staging copy in the caller and steps 2-4
(``_finish``) in a background thread (see ``background``): the same writes, checks and commit.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import Tensor

from ..core.engine import Step
from ..core.state import TrainState
from . import background, files
from .background import AsyncSave
from .checks import is_sharded, model_signature, optimizer_signature, stack_signature
from .collective import agree, from_rank0, gather, rank_world
from .dcp import (
    rewrite_metadata,
    save_sharded,
    shard_owner,
    sharded_state,
    start_sharded,
    wait_sharded,
)
from .files import Digests
from .format import (
    FORMAT,
    MARKER,
    META_FILE,
    SHARDED_DIR,
    STATE_FILE,
    TMP_PREFIX,
    check_plain,
    rank_file,
    split_refs,
)
from .lock import WriterLock
from .rng import rng_state

__all__ = ["save"]


@overload
def save(directory: str | os.PathLike[str], state: TrainState, *, loader: Any | None = ...,
         step: Step | None = ..., keep: int | None = ..., extra: Any = ...,
         sharded: bool | None = ..., asynchronous: Literal[False] = ...) -> Path: ...
@overload
def save(directory: str | os.PathLike[str], state: TrainState, *, loader: Any | None = ...,
         step: Step | None = ..., keep: int | None = ..., extra: Any = ...,
         sharded: bool | None = ..., asynchronous: Literal[True]) -> AsyncSave: ...
@overload
def save(directory: str | os.PathLike[str], state: TrainState, *, loader: Any | None = ...,
         step: Step | None = ..., keep: int | None = ..., extra: Any = ...,
         sharded: bool | None = ..., asynchronous: bool) -> Path | AsyncSave: ...
def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    loader: Any | None = None,
    step: Step | None = None,
    keep: int | None = None,
    extra: Any = None,
    sharded: bool | None = None,
    asynchronous: bool = False,
) -> Path | AsyncSave:
    """Equivalent to ``torch.save`` of the whole run (state, RNG states, loader position), atomic.

    That is ``torch.save({"state": state.state_dict(), "loader": loader.state_dict(),
    "rng": <every RNG's state>}, path)``, where the checkpoint appears as
    ``directory/step-<state.step>`` only once it is complete (see the module docstring); the
    path is returned.
    Saving reads no random number generator, so it does not change the run.

    With ``asynchronous=True`` the call returns once the state is *staged*: every tensor to be
    saved is copied into host memory (pinned when the state is on a GPU; that buffer is kept
    for the next save). A background thread then writes that copy, checks it and commits it
    exactly as a synchronous save does (sharded state through
    ``torch.distributed.checkpoint.async_save``), and releases the folder's lock. Training
    may change the state as soon as ``save`` returns: the checkpoint holds the state as it was
    at the call. The returned [`AsyncSave`][] has ``wait()`` (the path, or the save's error)
    and ``done()``. The next ``save()`` or [`load`][] in this process waits for it first and
    raises its error if it failed and ``wait()`` did not raise it already. A process killed
    before the commit leaves the previous checkpoint the newest, as with a synchronous save.
    Costs: one host copy of the saved state while it is written, and the writing's CPU time
    in a background thread.

    Args:
        directory: the run's checkpoint folder (created if needed).
        state: the [`TrainState`][] to save (``state.sync()`` is applied).
        loader: anything with ``state_dict()``, e.g. an ``accelfn.data`` loader: its position,
            so that a resumed run continues with the next batch (saved per process).
        step: the [`Step`][] being trained: its transform stack is recorded and
            [`load`][] refuses another one.
        keep: keep only the newest ``keep`` checkpoints (older ones are deleted after this one
            is committed); None keeps all.
        extra: plain data to store along (e.g. ``{"epoch": 3, "best": 0.91}``), returned by
            [`load`][] as ``info.extra``.
        sharded: write model and optimizer with ``torch.distributed.checkpoint``; the default
            when the parameters are DTensors (FSDP2).
        asynchronous: return after staging, with an [`AsyncSave`][], and write in the
            background (under ``torchrun`` every process passes the same value).

    Returns:
        The committed checkpoint's directory; with ``asynchronous=True`` an [`AsyncSave`][]
        whose ``wait()`` returns it.

    Raises:
        TypeError: ``extra`` or a state entry is not tensors and plain data.
        ValueError: ``keep < 1``.
        RuntimeError: a transform refuses to be saved now (an open accumulation window).
        OSError: writing failed, or a file changed before the commit; nothing was committed
            and earlier checkpoints are intact (asynchronously: raised by ``wait()``, or by
            the next ``save()`` or ``load()``).
        CheckpointLockedError: (an OSError) another live process is saving into
            ``directory``; the message names its pid and host.

    Under ``torchrun`` a failure on one process raises on every process: there its own
    error, on the others the same one of these types (an ``OSError`` for a
    ``CheckpointLockedError``; a ``RuntimeError`` for an error of any other type) naming
    the failing rank, its error's type and message.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save() takes an accelfn.TrainState, got {type(state).__name__}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: give the number of checkpoints to keep (>= 1) or None")
    if loader is not None and not callable(getattr(loader, "state_dict", None)):
        raise TypeError(f"loader={type(loader).__name__} has no state_dict(); pass an "
                        "accelfn.data loader or another object with state_dict()")
    if not isinstance(asynchronous, bool):
        raise TypeError(f"asynchronous={asynchronous!r}: pass True or False")
    background.wait_previous("save")  # one save at a time; a failed one is reported first
    rank, world = rank_world()
    root = Path(directory)
    sharded = is_sharded(state.model) if sharded is None else bool(sharded)
    if sharded and state.lends_model:  # torch.distributed.checkpoint reads the model itself
        raise RuntimeError(
            "save(sharded=True) inside `with af.ema_weights(state):` would write the EMA "
            "weights the model holds there as the model; save after the block (an unsharded "
            "save inside it writes the model's own weights)")
    group = background.save_group() if asynchronous else None  # collective, once

    # 1. Gather and check everything on every process before anything is written; rank 0
    #    takes the folder's lock (one writer at a time) and makes the temporary directory.
    error: BaseException | None = None
    lock: WriterLock | None = None
    tmp: Path | None = None
    try:
        work = _gather(state, loader, step, extra, sharded, rank, world, keep)
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            lock = WriterLock(root).acquire()
            tmp = root / f"{TMP_PREFIX}step-{state.step:09d}-{secrets.token_hex(4)}"
            tmp.mkdir()
    except BaseException as exc:  # every process must hear of it
        error = exc
    try:
        # every process raises the type save() documents for the failure, as the failing
        # one does (another failure: a RuntimeError naming it)
        agree(error, "preparing the checkpoint", RuntimeError,
              like=(TypeError, ValueError, RuntimeError, OSError))
        tmp = Path(from_rank0(str(tmp)))
    except BaseException:
        _abandon(rank, tmp, lock)
        raise
    shards = tmp / SHARDED_DIR
    if not asynchronous:
        work.write_shards = lambda: save_sharded(shards, state, work.optimizer_in_dcp,
                                                 work.slot_shards)
        return _finish(root, tmp, work, lock, rank, world, None)
    try:
        try:  # the only copy made in the loop: what is written from here on
            staged = background.stage({  # (only rank 0 writes the payload)
                "payload": work.payload if rank == 0 else {}, "per_rank": work.per_rank,
                "dcp": sharded_state(state, work.optimizer_in_dcp, work.slot_shards)
                if sharded else None})
            work.payload, work.per_rank = staged["payload"], staged["per_rank"]
        except BaseException as exc:
            error = exc
        agree(error, "staging the checkpoint", OSError)
        if sharded:
            future = start_sharded(shards, staged["dcp"], group)
            work.write_shards, work.shards_running = lambda: wait_sharded(future, shards), True
        del staged
    except BaseException:
        _abandon(rank, tmp, lock)
        raise
    return background.start(root, state.step,
                            lambda: _finish(root, tmp, work, lock, rank, world, group))


def _abandon(rank: int, tmp: Path | None, lock: WriterLock | None) -> None:
    """A save that failed before its commit: remove what it wrote, release the lock."""
    if rank == 0 and tmp is not None:  # only what this save wrote
        shutil.rmtree(tmp, ignore_errors=True)
    if lock is not None:
        lock.release()


def _finish(root: Path, tmp: Path, work: _Work, lock: WriterLock | None, rank: int,
            world: int, group: Any) -> Path:
    """2.-4. Write, commit and rotate, then release the lock (in the caller, or in the
    background thread of an asynchronous save, whose collectives go over ``group``)."""
    try:
        written = _write(tmp, work, rank, world, group)
        final = _commit(root, tmp, work, written, lock, rank, world, group)
        if rank == 0:  # 4. Only now: delete what is beyond `keep`, and leftovers of crashed
            try:       #    saves (under the lock, nobody else is writing here)
                files.rotate(root, work.keep, final)
            except OSError as exc:  # the new checkpoint is committed; do not fail the save
                warnings.warn(f"checkpoint rotation in {root} failed: {exc}", stacklevel=2)
    except BaseException:
        _abandon(rank, tmp, lock)
        raise
    if lock is not None:
        lock.release()
    if world > 1:
        import torch.distributed as dist

        dist.barrier(group=group)  # nobody returns (and reads the directory) before rotation
    return final


@dataclass
class _Work:
    payload: dict[str, Any]
    per_rank: dict[str, Any]
    meta: dict[str, Any]
    sharded: bool
    optimizer_in_dcp: bool
    step: int
    keep: int | None = None
    slot_shards: dict[str, Tensor] = field(default_factory=dict)  # the slots' DTensors
    write_shards: Callable[[], None] | None = None  # DCP's write (or the wait for it)
    shards_running: bool = False  # DCP's write was started already (asynchronous)


def _gather(state: TrainState, loader: Any, step: Step | None, extra: Any, sharded: bool,
            rank: int, world: int, keep: int | None) -> _Work:
    stack = stack_signature(step)
    full = state.state_dict()
    optimizer_in_dcp = sharded and bool(state.optimizer.state)
    saved_state = dict(full)
    slot_shards: dict[str, Tensor] = {}
    if sharded:  # the slots' DTensors (with_ema's under FSDP2) are written by DCP too
        saved_state["slots"], slot_shards = split_refs(full["slots"])
        saved_state["model"] = None
        if optimizer_in_dcp:
            saved_state["optimizer"] = None
    payload = {"format": FORMAT, "state": saved_state, "extra": extra}
    per_rank = {"format": FORMAT, "rank": rank, "world_size": world, "rng": rng_state(),
                "loader": None if loader is None else loader.state_dict()}
    check_plain(extra, "extra")
    if rank == 0:
        check_plain(saved_state, "the training state")
    check_plain(per_rank["loader"], "the loader state")
    meta = {
        "format": FORMAT,
        "step": state.step,
        "world_size": world,
        "sharded": sharded,
        "optimizer_sharded": optimizer_in_dcp,
        "created": time.time(),
        "torch": torch.__version__,
        "model": model_signature(state.model),
        "optimizer": optimizer_signature(state.optimizer, state.model),
        "scheduler": None if state.scheduler is None else type(state.scheduler).__name__,
        "stack": stack,
        "loader": loader is not None,
    }
    return _Work(payload, per_rank, meta, sharded, optimizer_in_dcp, state.step, keep,
                 slot_shards)


def _write(tmp: Path, work: _Work, rank: int, world: int, group: Any) -> Digests:
    """2. Write into the hidden temporary directory, every process its own files; the
    digests of what this process wrote."""
    error: BaseException | None = None
    written: Digests = {}
    try:
        if rank == 0:
            written[STATE_FILE] = files.write_torch(tmp / STATE_FILE, work.payload)
        written[rank_file(rank)] = files.write_torch(tmp / rank_file(rank), work.per_rank)
    except BaseException as exc:
        error = exc
    if work.sharded:
        if not work.shards_running:  # nobody starts DCP's collective write alone
            agree(error, "writing the checkpoint", OSError, group)
        try:  # collective: every process writes its shards (or waits for DCP's thread to,
            assert work.write_shards is not None  # which talks over `group` meanwhile)
            work.write_shards()
            for file in sorted((tmp / SHARDED_DIR).iterdir()):
                rel = f"{SHARDED_DIR}/{file.name}"
                if file.name != ".metadata" and shard_owner(rel, world) == rank:
                    written[rel] = files.digest_file(file)
        except BaseException as exc:
            error = error or exc
    agree(error, "writing the checkpoint", OSError, group)
    return written


def _commit(root: Path, tmp: Path, work: _Work, written: Digests, lock: WriterLock | None,
            rank: int, world: int, group: Any) -> Path:
    """3. Rename the complete directory, check every file in it, write the marker last."""
    step = work.step
    listed = {k: v for part in gather(written, group) for k, v in part.items()}
    error: BaseException | None = None
    final: Path | None = None
    if rank == 0:
        try:
            if work.sharded:
                rewrite_metadata(tmp / SHARDED_DIR)
                for file in (tmp / SHARDED_DIR).iterdir():
                    rel = f"{SHARDED_DIR}/{file.name}"
                    if rel not in listed:
                        listed[rel] = written[rel] = files.digest_file(file)
            listed[META_FILE] = written[META_FILE] = files.write_json(tmp / META_FILE, work.meta)
            files.fsync_dir(tmp)
            assert lock is not None
            lock.check()
            final = files.final_name(root, step)
            os.replace(tmp, final)
            files.fsync_dir(root)
        except BaseException as exc:
            error = exc
    agree(error, "committing the checkpoint", OSError, group)
    final = Path(from_rank0(str(final), group))
    try:
        try:  # every process checks what it wrote, where it now is
            files.verify_written(final, written)
        except BaseException as exc:
            error = exc
        agree(error, "checking the checkpoint before committing it", OSError, group)
        if rank == 0:
            try:
                assert lock is not None
                lock.check()
                marker_tmp = final / (MARKER + ".tmp")
                files.write_json(marker_tmp, {"format": FORMAT, "step": step, "files": listed})
                os.replace(marker_tmp, final / MARKER)
                files.fsync_dir(final)
            except BaseException as exc:
                error = exc
        agree(error, "committing the checkpoint", OSError, group)
    except BaseException:
        if rank == 0:  # never committed: nobody may take it for a checkpoint
            files.remove_checkpoint(final)
        raise
    return final
