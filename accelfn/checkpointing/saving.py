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
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.engine import Step
from ..core.state import TrainState
from . import files
from .checks import is_sharded, model_signature, optimizer_signature, stack_signature
from .collective import agree, from_rank0, gather, rank_world
from .dcp import rewrite_metadata, save_sharded, shard_owner
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
)
from .lock import WriterLock
from .rng import rng_state

__all__ = ["save"]


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    loader: Any | None = None,
    step: Step | None = None,
    keep: int | None = None,
    extra: Any = None,
    sharded: bool | None = None,
) -> Path:
    """Equivalent to ``torch.save`` of the whole run (state, RNG states, loader position), atomic.

    That is ``torch.save({"state": state.state_dict(), "loader": loader.state_dict(),
    "rng": <every RNG's state>}, path)``, where the checkpoint appears as
    ``directory/step-<state.step>`` only once it is complete (see the module docstring); the
    path is returned.
    Saving reads no random number generator, so it does not change the run.

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

    Raises:
        TypeError: ``extra`` or a state entry is not tensors and plain data.
        ValueError: ``keep < 1``.
        RuntimeError: a transform refuses to be saved now (an open accumulation window).
        OSError: writing failed, or a file changed before the commit; nothing was committed
            and earlier checkpoints are intact.
        CheckpointLockedError: (an OSError) another live process is saving into
            ``directory``; the message names its pid and host.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save() takes an accelfn.TrainState, got {type(state).__name__}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: give the number of checkpoints to keep (>= 1) or None")
    if loader is not None and not callable(getattr(loader, "state_dict", None)):
        raise TypeError(f"loader={type(loader).__name__} has no state_dict(); pass an "
                        "accelfn.data loader or another object with state_dict()")
    rank, world = rank_world()
    root = Path(directory)
    sharded = is_sharded(state.model) if sharded is None else bool(sharded)

    # 1. Gather and check everything on every process before anything is written; rank 0
    #    takes the folder's lock (one writer at a time) and makes the temporary directory.
    error: BaseException | None = None
    lock: WriterLock | None = None
    tmp: Path | None = None
    try:
        work = _gather(state, loader, step, extra, sharded, rank, world)
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            lock = WriterLock(root).acquire()
            tmp = root / f"{TMP_PREFIX}step-{state.step:09d}-{secrets.token_hex(4)}"
            tmp.mkdir()
    except BaseException as exc:  # every process must hear of it
        error = exc
    final: Path | None = None
    try:
        agree(error, "preparing the checkpoint")
        tmp = Path(from_rank0(str(tmp)))
        written = _write(tmp, state, work, rank, world)
        final = _commit(root, tmp, state.step, work, written, lock, rank, world)
        if rank == 0:  # 4. Only now: delete what is beyond `keep`, and leftovers of crashed
            try:       #    saves (under the lock, nobody else is writing here)
                files.rotate(root, keep, final)
            except OSError as exc:  # the new checkpoint is committed; do not fail the save
                warnings.warn(f"checkpoint rotation in {root} failed: {exc}", stacklevel=2)
    except BaseException:
        if rank == 0 and tmp is not None:  # only what this save wrote
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # nobody returns (and reads the directory) before rotation is done
    return final


@dataclass
class _Work:
    payload: dict[str, Any]
    per_rank: dict[str, Any]
    meta: dict[str, Any]
    sharded: bool
    optimizer_in_dcp: bool


def _gather(state: TrainState, loader: Any, step: Step | None, extra: Any, sharded: bool,
            rank: int, world: int) -> _Work:
    stack = stack_signature(step)
    full = state.state_dict()
    optimizer_in_dcp = sharded and bool(state.optimizer.state)
    saved_state = dict(full)
    if sharded:
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
    return _Work(payload, per_rank, meta, sharded, optimizer_in_dcp)


def _write(tmp: Path, state: TrainState, work: _Work, rank: int, world: int) -> Digests:
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
        agree(error, "writing the checkpoint", OSError)
        try:  # collective: every process writes its shards, then checksums them
            save_sharded(tmp / SHARDED_DIR, state, work.optimizer_in_dcp)
            for file in sorted((tmp / SHARDED_DIR).iterdir()):
                rel = f"{SHARDED_DIR}/{file.name}"
                if file.name != ".metadata" and shard_owner(rel, world) == rank:
                    written[rel] = files.digest_file(file)
        except BaseException as exc:
            error = exc
    agree(error, "writing the checkpoint", OSError)
    return written


def _commit(root: Path, tmp: Path, step: int, work: _Work, written: Digests,
            lock: WriterLock | None, rank: int, world: int) -> Path:
    """3. Rename the complete directory, check every file in it, write the marker last."""
    listed = {k: v for part in gather(written) for k, v in part.items()}
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
    agree(error, "committing the checkpoint", OSError)
    final = Path(from_rank0(str(final)))
    try:
        try:  # every process checks what it wrote, where it now is
            files.verify_written(final, written)
        except BaseException as exc:
            error = exc
        agree(error, "checking the checkpoint before committing it", OSError)
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
        agree(error, "committing the checkpoint", OSError)
    except BaseException:
        if rank == 0:  # never committed: nobody may take it for a checkpoint
            files.remove_checkpoint(final)
        raise
    return final
