"""Persistent workers: a ``torchdata.nodes`` node mapping over its source in a pool.

:class:`PoolMapper` maps over its source in worker threads or processes that persist across
epochs (``ParallelMapper`` in torchdata 0.11 starts new ones on every ``reset()``, i.e. every
epoch). Worker processes watch the process that started them and exit as soon as it is gone,
killed or not (a killed trainer cannot shut its pool down, and workers waiting for work would
otherwise outlive it, holding its output pipes open), as torch's DataLoader workers do.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torchdata.nodes import BaseNode, ParallelMapper

from .rng import own_process_generators

__all__ = ["PoolMapper"]

_WORKER_FN: Callable[[Any], Any] | None = None

#: How often a worker process checks that its trainer is alive (seconds).
PARENT_POLL_S = 0.1

_HAS_PROC = os.path.isdir("/proc/self")

#: The key of ``torchdata.nodes.Mapper``'s state, whose shape a PoolMapper's state has.
_IT_STATE: str = ParallelMapper.IT_STATE_KEY


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    if _HAS_PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        return stat.rpartition(b")")[2].split()[:1] not in ([b"Z"], [b"X"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _watch_trainer(trainer: int) -> None:
    """Exit this worker process as soon as ``trainer``, the process that started it, is gone.

    Two signals, polled every ``PARENT_POLL_S``: the parent changes (the trainer died and the
    worker was re-parented; with ``forkserver`` the parent is the fork server, which lives as
    long as its workers), or the trainer no longer runs (also when it died before this worker
    started). The exit is immediate (``os._exit``): there is nobody to return results to.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent and _alive(trainer):
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="accelfn-data-watch-trainer", daemon=True).start()


def _process_init(fn: Callable[[Any], Any], trainer: int) -> None:
    global _WORKER_FN
    _watch_trainer(trainer)
    own_process_generators()  # one item at a time: seeded_draws may seed the globals
    _WORKER_FN = fn
    torch.set_num_threads(1)


def _thread_init() -> None:
    torch.set_num_threads(1)  # per thread (OpenMP): no oversubscription across workers


def _noop() -> None:
    return None


def _broke(fut: cf.Future[Any]) -> bool:
    """Whether ``fut`` failed because its pool lost a worker process."""
    return fut.done() and not fut.cancelled() and isinstance(fut.exception(), BrokenProcessPool)


def _describe_samples(items: list[Any]) -> str:
    """``items`` (index tensors, or pairs holding one, as samplers give) as "one of the
    samples 16-19, 24" when they are indices, else as a count of items."""
    indices: list[int] = []
    for item in items:
        idx = item if isinstance(item, torch.Tensor) else getattr(item, "indices", None)
        if not isinstance(idx, torch.Tensor) or idx.is_floating_point():
            return f"one of the items in flight ({len(items)})"
        indices += idx.reshape(-1).tolist()
    runs: list[list[int]] = []  # [first, last] of each run of consecutive indices
    for i in sorted(set(indices)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    shown = ", ".join(text[:20]) + (", ..." if len(text) > 20 else "")
    return f"one of the samples in flight ({shown})"


def _process_call(item: Any) -> Any:
    assert _WORKER_FN is not None
    try:
        return _WORKER_FN(item)
    except Exception as error:
        raise _sendable(error) from None


def _sendable(error: Exception) -> Exception:
    """``error`` if it survives the trip back from a worker process (pickled, rebuilt from
    its ``args``), else a RuntimeError saying what it was: one whose constructor takes
    other arguments would fail to rebuild in the trainer, which concurrent.futures reports
    as a worker that died."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        kind = type(error)
        sent = RuntimeError(f"{kind.__module__}.{kind.__qualname__}: {error}")
        for note in getattr(error, "__notes__", []):
            sent.add_note(note)
        sent.add_note(f"raised in a worker process; {kind.__qualname__} cannot be rebuilt from "
                      "its args to be sent back (a constructor taking other arguments than "
                      "super().__init__ gets: define __reduce__), so it arrives as this "
                      "RuntimeError. worker_type='thread' or num_workers=0 raise it as it is")
        return sent


class PoolMapper(BaseNode[Any]):  # type: ignore[misc]  # torchdata: untyped
    """Map ``map_fn`` over a source node in worker threads or processes that persist.

    The workers start at the first ``reset()`` and serve every later epoch (for processes,
    ``map_fn`` is sent to each once, at start-up, and tensors come back through shared
    memory). Results are returned in source order; at most ``max_in_flight`` items are being
    processed or waiting. Its state is the source's state as of the last item returned, so
    resume is exact whatever was in flight. Exceptions in ``map_fn`` are re-raised with
    their type and message. Worker processes exit within 0.1 s (``PARENT_POLL_S``) of the
    death of the process that created the pool, by ``SIGKILL`` too. If a worker process dies
    (killed for memory, a segfault), ``next()`` raises ``BrokenProcessPool`` naming the
    samples in flight and what to check, and drops the pool: the next ``reset()`` (epoch)
    starts new processes.

    Its state has the shape of ``torchdata.nodes.Mapper``'s (``{"it_state": {"source": ...}}``)
    whatever ``num_workers`` and ``worker_type``, so that a position saved with workers
    resumes without them, and the other way round (the batches do not depend on them); the
    ``{"source": ...}`` it had before loads too.

    (``torchdata.nodes.ParallelMapper`` in torchdata 0.11 starts new threads or processes on
    every ``reset()``, i.e. every epoch.)

    Args:
        source: node whose items are passed to ``map_fn`` (e.g. index tensors).
        map_fn: the function; picklable for processes.
        num_workers: number of threads or processes (>= 1).
        worker_type: ``"thread"`` (work that releases the GIL: I/O, decoding, tensor ops) or
            ``"process"`` (Python-heavy work that holds it).
        max_in_flight: items submitted ahead; default ``2 * num_workers``.
        mp_context: start method for processes (``"fork"``, ``"spawn"``, ``"forkserver"``);
            default the platform's.
    """

    def __init__(
        self,
        source: BaseNode[Any],
        map_fn: Callable[[Any], Any],
        num_workers: int,
        *,
        worker_type: str = "thread",
        max_in_flight: int | None = None,
        mp_context: str | None = None,
    ) -> None:
        super().__init__()
        if num_workers < 1:
            raise ValueError(f"PoolMapper needs num_workers >= 1, got {num_workers}")
        if worker_type not in ("thread", "process"):
            raise ValueError(f"worker_type must be 'thread' or 'process', got {worker_type!r}")
        self.source = source
        self.map_fn = map_fn
        self.num_workers = num_workers
        self.worker_type = worker_type
        self.max_in_flight = max_in_flight or 2 * num_workers
        self.mp_context = mp_context
        self._pool: cf.Executor | None = None
        self._pending: deque[tuple[cf.Future[Any], dict[str, Any], Any]] = deque()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._state: dict[str, Any] | None = None
        self._exhausted = False

    def _ensure_pool(self) -> cf.Executor:
        if self._pool is None:
            if self.worker_type == "thread":
                self._pool = cf.ThreadPoolExecutor(
                    self.num_workers, thread_name_prefix="accelfn-data", initializer=_thread_init
                )
            else:
                ctx = (
                    torch_mp.get_context(self.mp_context)
                    if self.mp_context
                    else multiprocessing.get_context()
                )
                self._pool = cf.ProcessPoolExecutor(
                    self.num_workers,
                    mp_context=ctx,
                    initializer=_process_init,
                    initargs=(self.map_fn, os.getpid()),
                )
                # Start the processes now, from the thread calling reset() (normally the main
                # thread), rather than from whichever thread submits the first item.
                self._pool.submit(_noop)
            self._finalizer = weakref.finalize(
                self, self._pool.shutdown, wait=False, cancel_futures=True
            )
        return self._pool

    def _submit(self, pool: cf.Executor, item: Any) -> cf.Future[Any]:
        if self.worker_type == "thread":
            return pool.submit(self.map_fn, item)
        return pool.submit(_process_call, item)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if self.worker_type == "process" and any(_broke(fut) for fut, _, _ in self._pending):
            self._drop_pool()  # a worker process died in an epoch left unfinished
        self._ensure_pool()
        for fut, _, _ in self._pending:
            fut.cancel()
        self._pending.clear()
        self._exhausted = False
        if initial_state is not None and _IT_STATE in initial_state:
            initial_state = initial_state[_IT_STATE]  # else a state written before: {"source"}
        self.source.reset(None if initial_state is None else initial_state["source"])
        self._state = self.source.state_dict()

    def _fill(self) -> None:
        pool = self._ensure_pool()
        while not self._exhausted and len(self._pending) < self.max_in_flight:
            try:
                item = next(self.source)
            except StopIteration:
                self._exhausted = True
                break
            try:
                fut = self._submit(pool, item)
            except BrokenProcessPool as e:
                raise self._broken([item]) from e
            self._pending.append((fut, self.source.state_dict(), item))

    def next(self) -> Any:
        self._fill()
        if not self._pending:
            raise StopIteration
        fut, state, item = self._pending.popleft()
        try:
            result = fut.result()
        except BrokenProcessPool as e:
            if self.worker_type != "process":
                raise  # raised by map_fn itself: a thread pool has no process to lose
            raise self._broken([item]) from e
        self._state = state
        self._fill()
        return result

    def _drop_pool(self) -> None:
        """Forget a broken pool (its processes are gone or going): the next ``reset()``
        starts a new one."""
        for fut, _, _ in self._pending:
            fut.cancel()
        self._pending.clear()
        if self._finalizer is not None:
            self._finalizer()  # shutdown(wait=False, cancel_futures=True), once
        self._pool = self._finalizer = None

    def _broken(self, items: list[Any]) -> BrokenProcessPool:
        """The error for a pool one of whose processes died, naming the samples in flight
        (one of which it was loading, if the items are batches of indices); drops the pool."""
        items += [item for _, _, item in self._pending]
        self._drop_pool()
        samples = _describe_samples(items)
        return BrokenProcessPool(
            "a worker process died abruptly (killed, e.g. by the out-of-memory killer, or "
            "crashed, e.g. by a segfault in native code) while it was loading "
            f"{samples}. Check the machine's memory (dmesg, the container's memory limit; "
            "lower num_workers, batch_size or prefetch), and load these samples in this "
            "process (num_workers=0, or dataset[i] by hand) to see a crash in the dataset's "
            "__getitem__ or sample_transform. The pool is dropped: the next epoch (iter()) "
            "starts new worker processes."
        )

    def get_state(self) -> dict[str, Any]:
        return {_IT_STATE: {"source": self._state}}

    def close(self) -> None:
        """Stop the workers (a later ``reset()`` starts new ones)."""
        if self._pool is not None:
            for fut, _, _ in self._pending:
                fut.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._finalizer is not None:
                self._finalizer.detach()
            self._pool = self._finalizer = None
