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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch

from ..core.state import TrainState
from ..step.engine import Step
from . import background, files
from .background import AsyncSave
from .checks import is_sharded
from .collective import agree, from_rank0, gather, rank_world
from .dcp import (
    Part,
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
    ONE,
    SHARDED_DIR,
    STATE_FILE,
    TMP_PREFIX,
    check_plain,
    rank_file,
    split_refs,
)
from .lock import WriterLock
from .rng import rng_state
from .states import (
    States,
    Steps,
    as_saved,
    checkpoint_step,
    held_by_dcp,
    named_states,
    named_steps,
    per_optimizer,
    signatures,
)

__all__ = ["save"]


@overload
def save(directory: str | os.PathLike[str], state: States, *, loader: Any | None = ...,
         step: Steps = ..., keep: int | None = ..., extra: Any = ...,
         sharded: bool | None = ..., asynchronous: Literal[False] = ...) -> Path: ...
@overload
def save(directory: str | os.PathLike[str], state: States, *, loader: Any | None = ...,
         step: Steps = ..., keep: int | None = ..., extra: Any = ...,
         sharded: bool | None = ..., asynchronous: Literal[True]) -> AsyncSave: ...
@overload
def save(directory: str | os.PathLike[str], state: States, *, loader: Any | None = ...,
         step: Steps = ..., keep: int | None = ..., extra: Any = ...,
         sharded: bool | None = ..., asynchronous: bool) -> Path | AsyncSave: ...
def save(
    directory: str | os.PathLike[str],
    state: States,
    *,
    loader: Any | None = None,
    step: Steps = None,
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

    Several states (a GAN's generator and discriminator, each a [`TrainState`][] with its
    own step) are one checkpoint: ``save(directory, {"generator": state_g, "discriminator":
    state_d}, step={"generator": g_step, "discriminator": d_step})`` writes each state under
    its name, with one RNG state and one loader position (the run's), and commits them
    together; the checkpoint is named after the largest of their steps. [`load`][] takes the
    same mapping, and refuses a checkpoint of other states (one state into a mapping, the
    reverse, other names).

    A state may have several optimizers (``TrainState(model, [muon, adamw],
    scheduler=[...])``): each one's state and scheduler are saved, in order, and [`load`][]
    refuses a state with another number of optimizers, another order or other schedulers.
    Any optimizer's state is saved as the optimizer keeps it (Adafactor's factored moments,
    stacked buffers, scalars), sharded too, and so is that of an optimizer whose ``step()``
    takes no ``closure``.

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
        state: the [`TrainState`][] to save (``state.sync()`` is applied), or several by
            name: ``{name: TrainState}`` (names of letters, digits, ``_`` and ``-``).
        loader: anything with ``state_dict()``, e.g. an ``accelfn.data`` loader: its position,
            so that a resumed run continues with the next batch (saved per process).
        step: the [`Step`][] being trained: its transform stack is recorded and
            [`load`][] refuses another one. For several states, ``{name: step}`` (some names
            only, or None, to record no stack for the others).
        keep: keep only the newest ``keep`` checkpoints (older ones are deleted after this one
            is committed); None keeps all. A save at a step saved before replaces that
            checkpoint once it is committed (as ``step-<step>.<n>``), whatever ``keep``: one
            checkpoint per step, and no other evicted for it.
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
        TypeError: ``extra`` or a state entry is not tensors and plain data; ``state`` or
            ``step`` is not what save takes.
        ValueError: ``keep < 1``; an empty mapping of states, a state given twice, a name
            that cannot name a state, a step for no state of the mapping.
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
    states = named_states(state, "save")
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
    number = checkpoint_step(states)
    sharded = any(is_sharded(s.model) for s in states.values()) if sharded is None \
        else bool(sharded)
    if sharded and any(s.lends_model for s in states.values()):  # DCP reads the model itself
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
    try:  # one try from the lock to the hand-off: an interrupt at any line releases both
        try:
            work = _gather(states, loader, named_steps(step, states, "save"), extra, sharded,
                           rank, world, keep)
            if rank == 0:
                root.mkdir(parents=True, exist_ok=True)
                lock = WriterLock(root)  # first: an interrupted acquire is released too
                lock.acquire()
                tmp = root / f"{TMP_PREFIX}step-{number:09d}-{secrets.token_hex(4)}"
                tmp.mkdir()
        except BaseException as exc:  # every process must hear of it
            error = exc
        # every process raises the type save() documents for the failure, as the failing
        # one does (another failure: a RuntimeError naming it)
        agree(error, "preparing the checkpoint", RuntimeError,
              like=(TypeError, ValueError, RuntimeError, OSError))
        tmp = Path(from_rank0(str(tmp)))
        shards = tmp / SHARDED_DIR
        if not asynchronous:  # (_finish abandons on its own failures too: harmless twice)
            work.write_shards = lambda: save_sharded(shards, work.parts)
            return _finish(root, tmp, work, lock, rank, world, None)
        try:  # the only copy made in the loop: what is written from here on
            staged = background.stage({  # (only rank 0 writes the payload)
                "payload": work.payload if rank == 0 else {}, "per_rank": work.per_rank,
                "dcp": sharded_state(work.parts) if sharded else None})
            work.payload, work.per_rank = staged["payload"], staged["per_rank"]
        except BaseException as exc:
            error = exc
        agree(error, "staging the checkpoint", OSError)
        if sharded:
            future = start_sharded(shards, staged["dcp"], group)
            work.write_shards, work.shards_running = lambda: wait_sharded(future, shards), True
        del staged
        return background.start(root, number,
                                lambda: _finish(root, tmp, work, lock, rank, world, group),
                                lambda: _abandon(rank, tmp, lock))
    except BaseException:
        if not background.writing(root):  # else the background thread owns lock and files
            _abandon(rank, tmp, lock)
        raise


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
    parts: dict[str, Part]  # what DCP writes of each state (sharded)
    step: int
    keep: int | None = None
    write_shards: Callable[[], None] | None = None  # DCP's write (or the wait for it)
    shards_running: bool = False  # DCP's write was started already (asynchronous)


def _gather(states: dict[str, TrainState], loader: Any, steps: dict[str, Step | None],
            extra: Any, sharded: bool, rank: int, world: int, keep: int | None) -> _Work:
    saved: dict[str, Any] = {}
    records: dict[str, Any] = {}
    parts: dict[str, Part] = {}
    for name, state in states.items():
        full = state.state_dict()  # first: under FSDP2 it leaves the sharded parameters
        record = signatures(state, steps[name])  # registered, which the optimizers hold
        n = len(state.optimizers)
        held = held_by_dcp(state, sharded)  # an optimizer without state: in state.pt
        saved_state = dict(full)
        if sharded:  # the slots' DTensors (with_ema's average under FSDP2) are in DCP too
            saved_state["slots"], slot_shards = split_refs(full["slots"])
            saved_state["model"] = None
            saved_state["optimizer"] = as_saved(
                [None if h else entry for entry, h in
                 zip(per_optimizer(full["optimizer"], n, "optimizer state"), held)], n)
            parts[name] = Part(state, held, slot_shards)
        if rank == 0:
            check_plain(saved_state, "the training state" + (f" {name!r}" if name else ""))
        saved[name] = saved_state
        records[name] = {"step": state.step, "optimizer_sharded": any(held), **record}
    check_plain(extra, "extra")
    per_rank = {"format": FORMAT, "rank": rank, "world_size": world, "rng": rng_state(),
                "loader": None if loader is None else loader.state_dict()}
    check_plain(per_rank["loader"], "the loader state")
    number = checkpoint_step(states)
    meta: dict[str, Any] = {"format": FORMAT, "step": number, "world_size": world,
                            "sharded": sharded, "created": time.time(),
                            "torch": torch.__version__, "loader": loader is not None}
    if ONE in states:  # one state: its record at the top, as checkpoints always had it
        del records[ONE]["step"]
        meta.update(records[ONE])
        payload = {"format": FORMAT, "state": saved[ONE], "extra": extra}
    else:
        meta["states"] = records
        payload = {"format": FORMAT, "states": saved, "extra": extra}
    return _Work(payload, per_rank, meta, sharded, parts, number, keep)


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
    except BaseException as exc:
        if rank == 0 and files.is_committed(final):  # every process had checked its files
            exc.add_note(f"{final} was committed before this error: it is complete and loads")
        elif rank == 0:  # never committed: nobody may take it for a checkpoint
            files.remove_checkpoint(final)
        raise
    return final
