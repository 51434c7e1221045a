"""Asynchronous saves: stage a host copy in the loop, write and commit it in the background.

``save(..., asynchronous=True)`` does in the caller what must see the live state (checks,
the lock, the temporary directory, and the *staging*: one copy of every tensor to be saved
into host memory, pinned when the state is on a GPU), then returns an [`AsyncSave`][]; a
background thread writes that copy with the same code as a synchronous save, verifies it and
commits it (marker, rotation, lock release). Sharded state goes through
``torch.distributed.checkpoint.async_save`` (DCP writes in its own thread; the commit waits for
its Future).

At most one asynchronous save runs per process: the next ``save()`` or ``load()`` first waits
for it, and raises its error if it failed and nobody has seen that error yet
(:func:`wait_previous`). Under ``torchrun`` the background thread talks over its own gloo
process group (:func:`save_group`), created by the first asynchronous save, so that its
collectives never interleave with the training loop's on the default group.
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core import compat
from .collective import rank_world

__all__ = ["AsyncSave", "save_group", "stage", "start", "wait_previous", "writing"]

_lock = threading.Lock()
_pending: AsyncSave | None = None
# weak references to (the default group it was made for, the save group): torch holds both
# until destroy_process_group(), after which nothing here keeps them (and their gloo threads)
# alive into the interpreter's exit
_group: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None
_pinned: Any = None  # a DCP stager kept between saves: its pinned buffers are reused


class AsyncSave:
    """A checkpoint being written in the background: equivalent to a
    ``concurrent.futures.Future`` of the path a synchronous [`save`][] returns.

    Returned by ``save(..., asynchronous=True)`` once the state is staged (copied to host
    memory); training may change the state from then on. The checkpoint is committed (it
    appears in [`latest`][], its marker written, older ones rotated) only when the background
    write has completed and checked out.
    """

    def __init__(self, directory: Path, step: int) -> None:
        self.directory = directory
        """The run folder being saved into."""
        self.step = step
        """``state.step`` of the state being saved."""
        self._done = threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        self._decided = threading.Event()  # set once: the thread writes, or was cancelled
        self._decision = threading.Lock()
        self._write = False

    def done(self) -> bool:
        """Whether the save has finished: committed, or failed with nothing committed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the commit and return the checkpoint's path (what a synchronous
        [`save`][] returns); raise the save's error if it failed (nothing was committed and
        earlier checkpoints are intact), as often as it is called.

        Raises:
            TimeoutError: still writing after ``timeout`` seconds (the save goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the checkpoint of step {self.step} into {self.directory} is "
                               f"still being written after {timeout} s; call wait() again")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._path is not None
        return self._path

    @property
    def path(self) -> Path | None:
        """The committed checkpoint's directory, None until then (and if the save failed)."""
        return self._path if self._done.is_set() else None

    def __repr__(self) -> str:
        status = ("writing" if not self.done() else
                  f"failed ({type(self._error).__name__})" if self._error else
                  f"committed as {self._path}")
        return f"AsyncSave(step={self.step}, directory={str(self.directory)!r}: {status})"

    def _run(self, work: Callable[[], Path]) -> None:
        self._decided.wait()  # the caller registers this save, then lets it write
        if not self._write:
            return  # cancelled: the caller undid the save (nobody waits for it)
        try:
            self._path = work()
        except BaseException as error:  # nothing escapes a thread: it is wait()'s to raise
            self._error = error
        finally:
            self._done.set()

    def _decide(self, write: bool) -> bool:
        """Let the thread write (``True``) or cancel it; the first decision holds. Whether
        this one was it."""
        with self._decision:
            if self._decided.is_set():
                return False
            self._write = write
            self._decided.set()
            return True

    @property
    def writing(self) -> bool:
        """Whether the background thread was let write (it owns the save's lock and files)."""
        return self._decided.is_set() and self._write


def start(directory: Path, step: int, work: Callable[[], Path],
          abandon: Callable[[], None]) -> AsyncSave:
    """Run ``work`` (write, verify, commit) in a background thread; the handle of it.

    The thread starts, the save is registered as this process' pending one, and only then is
    the thread let write: an interrupt anywhere before that cancels it (``abandon`` then
    undoes the caller's part: the lock, the temporary directory), so no pending save is left
    that nobody runs and every later ``save()`` or ``load()`` would wait for."""
    global _pending
    handle = AsyncSave(directory, step)
    try:
        # Not a daemon: an interpreter that exits lets the save finish (and commit) first.
        thread = threading.Thread(target=handle._run, args=(work,), daemon=False,
                                  name=f"accelfn-checkpoint-step-{step}")
        handle._thread = thread
        thread.start()
        with _lock:
            _pending = handle
        handle._decide(True)
    except BaseException:
        if handle._decide(False):  # not let write yet: nothing runs in the background
            with _lock:
                if _pending is handle:
                    _pending = None
            abandon()
        raise
    return handle


def writing(directory: Path) -> bool:
    """Whether this process' pending save into ``directory`` was let write in the
    background (it owns its lock and files from then on)."""
    with _lock:
        handle = _pending
    return handle is not None and handle.directory == directory and handle.writing \
        and not handle.done()


def wait_previous(caller: str) -> None:
    """Wait for this process' asynchronous save, if one is running; raise its error if it
    failed and no ``wait()`` raised it yet (then ``caller`` did nothing)."""
    global _pending
    with _lock:
        handle = _pending
    if handle is None:
        return
    handle._done.wait()
    with _lock:  # only now: an interrupted wait leaves it for the next call
        if _pending is handle:
            _pending = None
    if handle._error is not None and not handle._reported:
        handle._reported = True
        error = handle._error
        error.add_note(f"raised by {caller}(): the asynchronous save of step {handle.step} "
                       f"into {handle.directory} failed in the background, nothing was "
                       f"committed for it; {caller}() did nothing, call it again")
        raise error


@atexit.register
def _unreported_at_exit() -> None:  # runs after the interpreter joined the save's thread
    handle = _pending
    if handle is not None and handle.done() and handle._error is not None \
            and not handle._reported:
        warnings.warn(f"the asynchronous save of step {handle.step} into {handle.directory} "
                      f"failed and nothing was committed: {type(handle._error).__name__}: "
                      f"{handle._error}", RuntimeWarning, stacklevel=1)


def save_group() -> Any:
    """The gloo process group the background thread communicates over (None in a single
    process): made once per default group, by every process together."""
    global _group
    if rank_world()[1] == 1:
        return None
    world = dist.group.WORLD
    group = _group[1]() if _group is not None and _group[0]() is world else None
    if group is None:
        group = dist.new_group(backend="gloo")
        _group = (weakref.ref(world), weakref.ref(group))
    return group


def _on_gpu(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return bool(local.is_cuda)
    if isinstance(obj, dict):
        return any(_on_gpu(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_on_gpu(v) for v in obj)
    return False


def stage(obj: Any) -> Any:
    """A host copy of ``obj`` (nested dicts, lists and tuples of tensors and plain data) that
    later changes to ``obj`` do not reach: ``torch.distributed.checkpoint``'s ``DefaultStager``.

    Every tensor is copied (CPU tensors too) and storages shared within ``obj`` stay shared.
    When a tensor is on a GPU the copy goes to pinned memory, and the stager is kept: the
    next save copies into the same pinned buffers (the previous save has finished by then).
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    global _pinned
    if not _on_gpu(obj):
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=False,
                                              use_non_blocking_copy=False))
        try:
            return stager.stage(obj)
        finally:
            stager.close()
    # Non-blocking copies into pinned memory, then one synchronisation: the call returns
    # once the copy is complete. Kept between saves where this torch's stager allows it.
    _pinned = compat.dcp_stager(_pinned, lambda: DefaultStager(StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
        use_non_blocking_copy=True)))
    return _pinned.stage(obj)
