"""save(): one call writes everything a run needs to continue, atomically.

Writes are atomic: everything goes to a hidden temporary directory, is fsynced, the directory
is renamed, and the ``COMMITTED`` marker is written last; :func:`~accelfn.checkpointing.latest`
and :func:`~accelfn.checkpointing.load` never use a directory without it, and rotation
(``keep``) deletes old checkpoints only after the new one is committed.

Under ``torchrun`` every process calls :func:`save` (it is collective): with DDP, rank 0
writes the replicated state and every rank its own RNG states and loader position; with FSDP2
(DTensor parameters) model and optimizer are written by all ranks through DCP.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..core.engine import Step
from ..core.state import TrainState
from . import files
from .checks import is_sharded, model_signature, optimizer_signature, stack_signature
from .collective import agree, from_rank0, gather, rank_world
from .dcp import rewrite_metadata, save_sharded, shard_owner
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
        state: the :class:`~accelfn.TrainState` to save (``state.sync()`` is applied).
        loader: anything with ``state_dict()``, e.g. an ``accelfn.data`` loader: its position,
            so that a resumed run continues with the next batch (saved per process).
        step: the :class:`~accelfn.Step` being trained: its transform stack is recorded and
            :func:`load` refuses another one.
        keep: keep only the newest ``keep`` checkpoints (older ones are deleted after this one
            is committed); None keeps all.
        extra: plain data to store along (e.g. ``{"epoch": 3, "best": 0.91}``), returned by
            :func:`load` as ``info.extra``.
        sharded: write model and optimizer with ``torch.distributed.checkpoint``; the default
            when the parameters are DTensors (FSDP2).

    Raises:
        TypeError: ``extra`` or a state entry is not tensors and plain data.
        ValueError: ``keep < 1``.
        RuntimeError: a transform refuses to be saved now (an open accumulation window).
        OSError: writing failed; nothing was committed and earlier checkpoints are intact.
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

    # 1. Gather and check everything on every process before anything is written.
    error: BaseException | None = None
    tmp: Path | None = None
    try:
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
            "optimizer": optimizer_signature(state.optimizer),
            "scheduler": None if state.scheduler is None else type(state.scheduler).__name__,
            "stack": stack,
            "loader": loader is not None,
        }
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f"{TMP_PREFIX}step-{state.step:09d}-{secrets.token_hex(4)}"
            tmp.mkdir()
    except BaseException as exc:  # every process must hear of it
        error = exc
    try:
        agree(error, "preparing the checkpoint")
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp = Path(from_rank0(str(tmp)))

    # 2. Write into the hidden temporary directory (every process its own files).
    digests: dict[str, Any] = {}
    try:
        if rank == 0:
            digests[STATE_FILE] = files.write_torch(tmp / STATE_FILE, payload)
        digests[rank_file(rank)] = files.write_torch(tmp / rank_file(rank), per_rank)
    except BaseException as exc:
        error = exc
    if sharded:
        try:
            agree(error, "writing the checkpoint")
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:  # collective: every process writes its shards, then checksums them
            save_sharded(tmp / SHARDED_DIR, state, optimizer_in_dcp)
            for file in sorted((tmp / SHARDED_DIR).iterdir()):
                rel = f"{SHARDED_DIR}/{file.name}"
                if file.name != ".metadata" and shard_owner(rel, world) == rank:
                    digests[rel] = files.digest_file(file)
        except BaseException as exc:
            error = exc
    try:
        agree(error, "writing the checkpoint")
        digests = {k: v for part in gather(digests) for k, v in part.items()}
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # 3. Commit: rename the complete directory, then write the marker (rank 0).
    final: Path | None = None
    if rank == 0:
        try:
            final = _commit(root, tmp, state.step, meta, sharded, digests)
        except BaseException as exc:
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
    agree(error, "committing the checkpoint")
    final = Path(from_rank0(str(final)))

    # 4. Only now: delete what is beyond `keep`, and leftovers of crashed saves.
    if rank == 0:
        try:
            files.rotate(root, keep, final)
        except OSError as exc:  # the new checkpoint is committed; do not fail the save
            warnings.warn(f"checkpoint rotation in {root} failed: {exc}", stacklevel=2)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # nobody returns (and reads the directory) before rotation is done
    return final


def _commit(root: Path, tmp: Path, step: int, meta: dict[str, Any], sharded: bool,
            digests: dict[str, Any]) -> Path:
    listed = dict(digests)
    if sharded:
        rewrite_metadata(tmp / SHARDED_DIR)
        for file in (tmp / SHARDED_DIR).iterdir():
            rel = f"{SHARDED_DIR}/{file.name}"
            if rel not in listed:
                listed[rel] = files.digest_file(file)
    listed[META_FILE] = files.write_json(tmp / META_FILE, meta)
    files.fsync_dir(tmp)
    final = files.final_name(root, step)
    os.replace(tmp, final)
    files.fsync_dir(root)
    try:
        marker_tmp = final / (MARKER + ".tmp")
        files.write_json(marker_tmp, {"format": FORMAT, "step": step, "files": listed})
        os.replace(marker_tmp, final / MARKER)
        files.fsync_dir(final)
    except BaseException:
        files.remove_checkpoint(final)  # never committed: nobody may take it for a checkpoint
        raise
    return final
