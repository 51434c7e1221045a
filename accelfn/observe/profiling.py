"""Profiler traces for a window of steps, in a folder TensorBoard and Perfetto open.

This is the usual profiling recipe made reusable::

    torch.profiler.profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3),
        on_trace_ready=torch.profiler.tensorboard_trace_handler("./log"),
        record_shapes=True)

:class:`Profiler` adds CUDA only where it exists, stops profiling (and its overhead) as soon
as the window is recorded, lists the trace files written and keeps the operator summary.
:func:`profiled` wraps a step so that each call advances the schedule.

Open the traces with ``tensorboard --logdir DIR`` (with the ``torch-tb-profiler`` plugin) or
drop a ``*.pt.trace.json`` file onto https://ui.perfetto.dev (or ``chrome://tracing``).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

__all__ = ["Profiler", "profiled"]


def _activities(requested: Iterable[str] | None) -> list[ProfilerActivity]:
    names = list(requested) if requested is not None else ["cpu", "cuda"]
    out = []
    for n in names:
        if n.lower() == "cpu":
            out.append(ProfilerActivity.CPU)
        elif n.lower() == "cuda":
            if torch.cuda.is_available():
                out.append(ProfilerActivity.CUDA)
        else:
            raise ValueError(f"Profiler(activities=...): unknown activity {n!r}; use 'cpu' "
                             "and/or 'cuda'")
    return out


class Profiler:
    """Record ``torch.profiler`` traces of ``active`` steps after ``wait`` + ``warmup``.

    >>> with Profiler("runs/profile", wait=1, warmup=1, active=3) as prof:
    ...     for batch in loader:
    ...         metrics = step(state, batch)
    ...         prof.step()
    >>> prof.trace_files     # [PosixPath('runs/profile/host_123.1717....pt.trace.json')]
    >>> print(prof.summary())

    ``skip_first`` steps are ignored entirely (e.g. ``torch.compile`` warm-up), then ``wait``
    steps run unprofiled, ``warmup`` steps are profiled and thrown away (profiler start-up
    cost), and ``active`` steps are recorded; the cycle repeats ``repeat`` times. After the
    last cycle the profiler stops and [`step`][] costs nothing.

    Args:
        dir: folder for the traces (created); one file per recorded cycle.
        activities: ``"cpu"`` and/or ``"cuda"`` (CUDA is skipped where unavailable).
        record_shapes: as for ``torch.profiler.profile``.
        profile_memory: as for ``torch.profiler.profile``.
        with_stack: as for ``torch.profiler.profile``.
        with_flops: as for ``torch.profiler.profile``.
        use_gzip: write ``.pt.trace.json.gz`` (Perfetto and TensorBoard read both).
        worker_name: file name prefix (default ``host_pid``); use the rank under torchrun.
    """

    def __init__(self, dir: str | Path = "runs/profile", *, wait: int = 1, warmup: int = 1,
                 active: int = 3, repeat: int = 1, skip_first: int = 0,
                 activities: Iterable[str] | None = None, record_shapes: bool = True,
                 profile_memory: bool = False, with_stack: bool = False,
                 with_flops: bool = False, use_gzip: bool = False,
                 worker_name: str | None = None) -> None:
        for k, v in (("wait", wait), ("warmup", warmup), ("skip_first", skip_first)):
            if v < 0:
                raise ValueError(f"Profiler({k}={v}): must be >= 0")
        if active < 1 or repeat < 1:
            raise ValueError(f"Profiler(active={active}, repeat={repeat}): both must be >= 1 "
                             "(repeat=0 would profile forever)")
        self.dir = Path(dir)
        self.wait, self.warmup, self.active = wait, warmup, active
        self.repeat, self.skip_first = repeat, skip_first
        self._activities = _activities(activities)
        self._record_shapes, self._profile_memory = record_shapes, profile_memory
        self._with_stack, self._with_flops = with_stack, with_flops
        self._gzip = use_gzip
        self._worker = worker_name
        self._prof: profile | None = None
        self._steps = 0
        self._summaries: list[str] = []
        self._started_at = 0.0
        self.trace_files: list[Path] = []

    @property
    def total_steps(self) -> int:
        """Steps until the last cycle is recorded."""
        return self.skip_first + (self.wait + self.warmup + self.active) * self.repeat

    @property
    def done(self) -> bool:
        """True once every cycle has been recorded (and the profiler stopped)."""
        return self._steps >= self.total_steps

    @property
    def running(self) -> bool:
        """True between [`start`][] and [`stop`][] (or the end of the last cycle)."""
        return self._prof is not None

    @property
    def activities(self) -> list[str]:
        """The activities actually recorded (``"cpu"``, ``"cuda"``)."""
        return [a.name.lower() for a in self._activities]

    def _on_ready(self, prof: profile) -> None:
        handler = tensorboard_trace_handler(str(self.dir), worker_name=self._worker,
                                            use_gzip=self._gzip)
        before = set(self.dir.glob("*.pt.trace.json*")) if self.dir.exists() else set()
        handler(prof)
        after = set(self.dir.glob("*.pt.trace.json*"))
        self.trace_files.extend(sorted(after - before))
        sort_by = "self_cuda_time_total" if ProfilerActivity.CUDA in self._activities \
            else "self_cpu_time_total"
        try:
            self._summaries.append(prof.key_averages().table(sort_by=sort_by, row_limit=20))
        except Exception as exc:  # summaries are a convenience, traces are the product
            self._summaries.append(f"(no summary: {exc})")

    def start(self) -> Profiler:
        """Start profiling (done by ``with``)."""
        if self._prof is not None:
            raise RuntimeError("Profiler.start(): already started")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._started_at = time.time()
        self._prof = profile(
            activities=self._activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                              repeat=self.repeat, skip_first=self.skip_first),
            on_trace_ready=self._on_ready, record_shapes=self._record_shapes,
            profile_memory=self._profile_memory, with_stack=self._with_stack,
            with_flops=self._with_flops)
        self._prof.start()
        return self

    def step(self) -> None:
        """Mark the end of one training step; stops the profiler after the last cycle."""
        if self._prof is None:
            if self.done:
                return
            raise RuntimeError("Profiler.step(): call start() or use `with Profiler(...)`")
        if self.repeat > 1:
            with warnings.catch_warnings():
                # each cycle is written and summarised as it ends: clearing is intended
                warnings.filterwarnings("ignore", message=".*clears events at the end of")
                self._prof.step()
        else:
            self._prof.step()
        self._steps += 1
        if self.done:
            self.stop()

    def stop(self) -> None:
        """Stop profiling; a cycle cut short is written as it is."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def summary(self) -> str:
        """The operator table (``key_averages``) of the last recorded cycle."""
        return self._summaries[-1] if self._summaries else "(no cycle recorded yet)"

    def __repr__(self) -> str:
        return (f"Profiler({str(self.dir)!r}, wait={self.wait}, warmup={self.warmup}, "
                f"active={self.active}, repeat={self.repeat}, skip_first={self.skip_first})")


def profiled(step: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Wrap a step so that each call advances a [`Profiler`][] window.

    >>> pstep = profiled(step, dir="runs/profile", wait=1, warmup=1, active=3)
    >>> for batch in loader:
    ...     metrics = pstep(state, batch)          # profiler starts on the first call
    >>> pstep.profiler.trace_files

    Works bare or configured (``profiled(dir=...)(step)``). Attributes of the wrapped step
    (e.g. ``evaluate``) stay reachable; ``evaluate`` calls are not profiled. A call that
    raises stops the profiler (the cycle cut short is written) and later calls run
    unprofiled. This is a plain wrapper around any callable, placed outermost, not a
    transform of the step algebra.
    """
    if step is None:
        return functools.partial(profiled, **options)
    return _Profiled(step, Profiler(**options))


class _Profiled:
    def __init__(self, step: Callable[..., Any], profiler: Profiler) -> None:
        self.__wrapped__ = step
        self.profiler = profiler
        self._failed = False
        functools.update_wrapper(self, step, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prof = self.profiler
        if self._failed:
            return self.__wrapped__(*args, **kwargs)
        if prof._prof is None and not prof.done:
            prof.start()
        try:
            out = self.__wrapped__(*args, **kwargs)
        except BaseException:
            # the window cannot go on: write what was recorded and stop profiling, so the
            # profiler's overhead does not outlive the step that raised
            self._failed = True
            prof.stop()
            raise
        if not prof.done:
            prof.step()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"profiled({self.__wrapped__!r}, {self.profiler!r})"
