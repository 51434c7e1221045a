"""What filled the memory: a record of the first updates' allocations, dumped on an OOM.

On CUDA this is PyTorch's own allocator history (``_record_memory_history``), dumped as a
pickle that PyTorch's memory viewer opens. The CPU has no such history, hence this module's
own: a dispatch mode notes where each tensor of the recorded updates was made, and the dump
lists the largest tensors alive (shape, dtype, bytes, the line that made them) as JSON.

[`Monitor`][accelfn.Monitor]'s ``memory_snapshot=`` runs one around its loop:
[`snapshot_option`][] reads that option.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
import warnings
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from ..core import compat_memory as compat
from ..core.batch import Batch
from ..core.state import TrainState
from .findings import Finding
from .logs import get_logger
from .memory import MemoryEstimate, estimate_memory, oom_advice

__all__ = ["MemorySnapshot", "memory_snapshot", "snapshot_option"]

_log = get_logger("observe")

_OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)
_OURS = (f"{os.sep}torch{os.sep}", f"{os.sep}accelfn{os.sep}", f"{os.sep}tensordict{os.sep}")


def _where() -> str:
    """The innermost line outside torch, tensordict and accelfn: the user's line."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-3]):
        if not any(part in frame.filename for part in _OURS):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "inside torch"


def _own_file(path: str) -> str:
    """``path``, or this process's own under a process group of several (its rank added)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return path
    root, suffix = os.path.splitext(path)
    return f"{root}.rank{dist.get_rank()}{suffix}"


class _Origins(compat.DispatchMode):  # type: ignore[misc,no-untyped-call]  # untyped in torch
    """Notes, for every storage an operator makes, the line that made it (while alive)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: dict[int, tuple[Any, tuple[int, ...], str, str]] = {}
        self.paused = False  # the operators of an estimate: fake tensors, not the run's

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = None
        for leaf in compat.leaves(out):
            if isinstance(leaf, Tensor) and leaf.device.type == "cpu":
                storage = leaf.untyped_storage()
                key = storage._cdata
                if inputs is None:  # views, in-place and out= results made nothing new
                    inputs = {t.untyped_storage()._cdata for t in compat.leaves((args, kwargs))
                              if isinstance(t, Tensor)}
                if key not in self.made and key not in inputs:
                    self.made[key] = (weakref.ref(storage), tuple(leaf.shape),
                                      str(leaf.dtype).removeprefix("torch."), _where())
                    weakref.finalize(storage, self.made.pop, key, None)
        return out


class MemorySnapshot:
    """Records the allocations of the first ``updates`` updates and dumps what is alive on
    an out-of-memory error (``torch.OutOfMemoryError`` or ``MemoryError``) to ``path``.

    Use it around the loop (``with memory_snapshot("oom.pickle"):``) and call
    ``updated()`` after each update (the Monitor does), or call ``dump()`` yourself. On
    CUDA the file is PyTorch's allocator snapshot (open it in PyTorch's memory viewer); on
    the CPU it is JSON: the largest live tensors, with shape, dtype, bytes and the line that
    made them (for tensors of the recorded updates). Under several processes each writes
    its own file, its rank before the suffix (``oom.rank1.json``). With an ``estimate`` (see
    [`estimate_memory`][]) and the ``step``, the error also gets the peak by kind and the
    one-line fixes for the stack; given the ``step`` alone, [`estimate_before`][] makes the
    estimate from the run's state and first batch (the Monitor does).
    """

    def __init__(self, path: str | os.PathLike[str], *, updates: int = 3,
                 device: torch.device | str | None = None, top: int = 20,
                 estimate: MemoryEstimate | None = None, step: Any = None) -> None:
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
            raise ValueError(f"memory_snapshot(updates={updates!r}) takes an int >= 1: the "
                             "number of first updates whose allocations are recorded")
        if estimate is not None and step is None:
            raise ValueError("memory_snapshot(estimate=...) needs step= too: the advice "
                             "names the changes that apply to that step's stack")
        self.path = os.fspath(path)
        self.updates = updates
        self.top = top
        self.estimate, self.step = estimate, step
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.seen = 0
        self.recording = False
        #: the file the out-of-memory error's snapshot went to (``None``: none written)
        self.dumped: str | None = None
        self._origins: _Origins | None = None
        self._estimated = estimate is not None
        self._estimate_error: str | None = None

    # ------------------------------------------------------------------ recording
    def start(self) -> MemorySnapshot:
        if self.recording:
            return self
        if self.device.type == "cuda":
            compat.record_cuda_history(True)
        else:
            self._origins = _Origins()
            self._origins.__enter__()  # type: ignore[no-untyped-call]
        self.recording = True
        return self

    def stop(self) -> None:
        """Stop recording new allocations (what was noted stays, for the dump)."""
        if not self.recording:
            return
        self.recording = False
        if self.device.type == "cuda":  # the blocks alive keep the stacks they were made at
            compat.record_cuda_history(False)
            return
        assert self._origins is not None
        self._origins.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def estimate_before(self, state: TrainState, batch: Batch) -> float:
        """Estimate the ``step``'s update of ``state`` on ``batch`` ([`estimate_memory`][],
        outside the recording: no allocation, the state unchanged) for the error's advice,
        once, when given a ``step`` and no ``estimate``; returns the seconds it took. An
        estimate that fails is a warning: the run goes on, its errors without the advice."""
        if self._estimated or self.step is None:
            return 0.0
        self._estimated = True
        start = time.perf_counter()
        if self._origins is not None:
            self._origins.paused = True
        try:
            self.estimate = estimate_memory(self.step, state, batch)
            _log.info("memory snapshot: %s", self.estimate)
        except Exception as failed:
            self._estimate_error = f"{type(failed).__name__}: {failed}"
            warnings.warn(f"memory_snapshot(step=...): the step's memory could not be "
                          f"estimated ({self._estimate_error}); an out-of-memory error will "
                          "name no peak by kind", RuntimeWarning, stacklevel=3)
        finally:
            if self._origins is not None:
                self._origins.paused = False
        return time.perf_counter() - start

    def updated(self) -> None:
        """One update done: recording stops after the first ``updates``."""
        self.seen += 1
        if self.seen >= self.updates:
            self.stop()

    # ------------------------------------------------------------------ the dump
    def dump(self) -> str:
        """Write the snapshot to ``path`` now; returns the path. Under several processes
        each writes its own file, the rank before the suffix (``oom.rank1.json``)."""
        path = _own_file(self.path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if self.device.type == "cuda":
            compat.dump_cuda_snapshot(path)
            return path
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.largest(), file, indent=1)
        return path

    def largest(self) -> dict[str, Any]:
        """The largest live CPU tensors (one entry per storage), largest first."""
        found: dict[int, dict[str, Any]] = {}
        made = {} if self._origins is None else dict(self._origins.made)
        for key, (ref, shape, dtype, where) in made.items():
            storage = ref()
            if storage is not None:
                found[key] = {"bytes": storage.nbytes(), "shape": list(shape), "dtype": dtype,
                              "made at": where}
        for obj in gc.get_objects():
            if type(obj) not in (Tensor, torch.nn.Parameter) or obj.device.type != "cpu":
                continue
            try:
                storage = obj.untyped_storage()
            except (NotImplementedError, RuntimeError):  # no storage: vmap's batched tensors
                continue
            key = storage._cdata
            if key not in found:
                found[key] = {"bytes": storage.nbytes(), "shape": list(obj.shape),
                              "dtype": str(obj.dtype).removeprefix("torch."),
                              "made at": "not recorded (outside the recorded updates)"}
        ordered = sorted(found.values(), key=lambda entry: -entry["bytes"])
        return {"live_bytes": sum(entry["bytes"] for entry in ordered),
                "tensors": len(ordered), "largest": ordered[:self.top]}

    def explain(self, error: BaseException) -> None:
        """Dump, and add the path (and the estimate's advice) to ``error``'s notes."""
        self.stop()
        try:
            path = self.dump()
            self.dumped = path
            error.add_note(f"accelfn: the memory snapshot is in {path}")
        except Exception as failed:  # the snapshot must not hide the out-of-memory error
            error.add_note(f"accelfn: the memory snapshot could not be written ({failed})")
        if self.estimate is not None:
            error.add_note(f"accelfn: {oom_advice(self.estimate, self.step)}")

    def on_error(self, error: BaseException) -> None:
        """An error ends the recorded block: [`explain`][] an out-of-memory error (once);
        any other error passes untouched."""
        notes = getattr(error, "__notes__", ())
        if isinstance(error, _OUT_OF_MEMORY) and not any(
                note.startswith("accelfn: the memory snapshot") for note in notes):
            self.explain(error)

    def findings(self) -> list[Finding]:
        """What a report says of this snapshot: where the dump went, and the estimate."""
        if self.dumped is not None:
            kind = "PyTorch's memory viewer opens it" if self.device.type == "cuda" else \
                "JSON: the largest live tensors and the lines that made them"
            where = f"the out-of-memory error's snapshot is in {self.dumped} ({kind})"
        else:
            n = min(self.seen, self.updates)
            where = f"the first {n} update{'' if n == 1 else 's'} recorded; no out-of-memory " \
                    "error, nothing dumped"
        found = [Finding("memory_snapshot", "info", where)]
        if self.estimate is not None:
            found.append(Finding("memory_estimate", "info",
                                 str(self.estimate).removeprefix("memory: ")))
        elif self._estimate_error is not None:
            found.append(Finding("memory_estimate", "info",
                                 f"not estimated: {self._estimate_error}"))
        return found

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> MemorySnapshot:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if error is not None:
                self.on_error(error)
        finally:
            self.close()


def memory_snapshot(path: str | os.PathLike[str], *, updates: int = 3,
                    device: torch.device | str | None = None, top: int = 20,
                    estimate: MemoryEstimate | None = None, step: Any = None) -> MemorySnapshot:
    """Equivalent to ``torch.cuda.memory._record_memory_history()`` for the first
    ``updates`` updates and ``_dump_snapshot(path)`` on an out-of-memory error, on the CPU a
    JSON list of the largest live tensors and where they were made (see [`MemorySnapshot`][]).
    """
    return MemorySnapshot(path, updates=updates, device=device, top=top, estimate=estimate,
                          step=step)


def snapshot_option(value: str | os.PathLike[str] | MemorySnapshot | None,
                    device: torch.device, state: TrainState | None) -> MemorySnapshot | None:
    """``Monitor(memory_snapshot=value)`` read: a path becomes a snapshot of the monitor's
    ``device``; a [`MemorySnapshot`][] is kept as given. A snapshot given the ``step`` but
    no ``estimate`` needs the monitor's ``state`` to make it."""
    if value is None or isinstance(value, MemorySnapshot):
        if value is not None and value.step is not None and value.estimate is None \
                and state is None:
            raise ValueError("Monitor(memory_snapshot=memory_snapshot(..., step=...)) "
                             "estimates that step's memory from the run's state: pass "
                             "Monitor(state=state), or the estimate itself as "
                             "memory_snapshot(..., estimate=estimate_memory(step, state, "
                             "batch), step=step)")
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"Monitor(memory_snapshot={value!r}) takes a path (a str or Path) "
                        "or accelfn.memory_snapshot(path, ...)")
    return MemorySnapshot(value, device=device)
