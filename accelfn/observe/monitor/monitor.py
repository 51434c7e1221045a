"""A monitor for any training loop: where does the time go, and what to do about it.

>>> mon = Monitor(log_every=50, sinks=[JsonlSink("runs/a/metrics.jsonl")],
...               plot="runs/a/run.png")
>>> with mon:
...     for batch in mon.iterate(loader):          # times every next(): the data wait
...         metrics = step(state, batch)
...         mon.step(metrics, samples=batch.batch_size[0])
>>> print(mon.report())

Per step it keeps, without ever making the host wait for the device:

* the iteration time: CUDA events at each step boundary on a GPU (read once completed),
  ``time.perf_counter`` on the CPU;
* the time the loop waited for data (every ``next()`` under [`Monitor.iterate`][], the time
  spent outside [`Monitor.measure`][], or a loader's own ``last_wait_s``);
* samples and tokens, from which samples/s, tokens/s and MFU follow (FLOPs of one step
  counted once with ``torch.utils.flop_counter.FlopCounterMode``);
* memory (``torch.cuda.memory_allocated``; the process's resident memory on the CPU);
* the step's metrics: scalar tensors copied to pinned host memory (``non_blocking=True``)
  after the step, read when their boundary event completed;
* GPU utilisation, memory and power sampled by pynvml in a background thread;
* under a process group, stragglers (`accelfn.observe.monitor.stragglers`).

Every ``log_every`` steps the completed records go to a progress bar and the sinks (JSONL,
CSV, TensorBoard, any [`Sink`][]; W&B and MLflow in `accelfn.observe.monitor.trackers`), with the
values of [`Monitor.log`][]; rows are numbered as the [`TrainState`][]'s ``step`` counts.
Memory stays bounded however long the run (`accelfn.observe.monitor.aggregates`). The report
ends with a verdict against the checklist (`accelfn.observe.monitor.verdict`): data loading under
20% of an iteration, GPU busy over 85%, no unnecessary host syncs (one step probed with
[`SyncProbe`][]), a CPU not oversubscribed, and each fix. With ``memory_snapshot``, an
out-of-memory error leaving the loop dumps what filled the memory ([`MemorySnapshot`][]).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Never, TypeVar

import torch
from torch import Tensor, nn

from ...core.processes import is_main_process
from ...core.state import TrainState
from ..diagnostics import Diagnostics
from ..flops import training_flops
from ..memory_snapshots import MemorySnapshot, snapshot_option
from ..profiling import Profiler
from ..sync_probe import SyncPoint, SyncProbe
from . import records
from .aggregates import RunBook
from .gpu_sampler import GPUSampler
from .options import GPUSampling, SyncCheck, Throughput, check_grouped
from .outputs import Outputs
from .records import PendingLog, PendingStep, StepRecord
from .report import MonitorReport, Thresholds
from .reporting import build_report
from .sinks import Sink
from .stragglers import Stragglers

__all__ = ["Monitor"]

T = TypeVar("T")


class Monitor:
    """Measures a training loop and says what limits it (see
    [`accelfn.observe.monitor.monitor`][]).

    Three ways to feed it, all without a host sync per step:

    * ``for batch in mon.iterate(loader): ...; mon.step(metrics)`` times each ``next()``
      as data wait (``mon.step`` may be omitted: each batch is then one step);
    * ``with mon.measure(samples=B) as rec: rec.record(step(state, batch))`` counts the time
      between two measured steps as data wait;
    * ``mon.step(metrics, samples=B, data_wait=loader.last_wait_s)`` after each step.

    Args:
        log_every: read completed records and write them out every this many steps.
        warmup: leading steps left out of the summary (compilation, autotuning, start-up).
        total: expected steps, for the progress bar.
        progress: show a console progress bar (rank 0 only); ``desc`` labels it. In a
            terminal it is redrawn in place; elsewhere (a log file, a pipe) it writes a plain
            line each 10% of ``total`` and its last line once, at [`close`][].
        state: the run's [`TrainState`][]. A row's ``step`` is then the update it measured as
            ``state.step`` counts it (the update that made ``state.step`` 20 is row 20, so a
            validation loss logged at ``state.step`` shares its row; the calls of one
            accumulation window in ``mode="calls"`` share their update's), and on a resumed
            run the files, trackers and progress bar continue from the checkpoint's step.
            Without it the n-th step is row n. Start the monitor after loading the checkpoint.
        sinks: where the rows go, written on rank 0 only: any [`Sink`][], e.g.
            [`JsonlSink(path)`][accelfn.observe.monitor.sinks.JsonlSink],
            [`CsvSink(path)`][accelfn.observe.monitor.sinks.CsvSink],
            [`TensorBoardSink(log_dir)`][accelfn.observe.monitor.sinks.TensorBoardSink],
            [`WandbSink`][accelfn.observe.monitor.trackers.WandbSink],
            [`MlflowSink`][accelfn.observe.monitor.trackers.MlflowSink]. The files keep the
            rows an earlier run wrote before the starting step and drop the rest.
        plot: write [`MonitorReport.plot`][] here when the monitor closes (its path is
            then `plot_file`); with ``state`` and a ``JsonlSink``, of that whole file
            (resumes too).
        throughput: samples, tokens and FLOPs of a step when it does not say, and the peak
            FLOP/s for MFU ([`Throughput`][accelfn.Throughput]; see [`count_flops`][]).
        device: the training device (default: CUDA when available).
        gpu: which GPU pynvml samples and how often ([`GPUSampling`][accelfn.GPUSampling]).
        sync_check: the step run under [`SyncProbe`][] and the syncs accepted
            ([`SyncCheck`][accelfn.SyncCheck]; ``None``: no step probed).
        model: optional; checked for BatchNorm under distributed training (SyncBatchNorm).
        diagnostics: a [`Diagnostics`][] stepped with each step's metrics and batch.
        stragglers: flag a process 20% slower than the median (default: on under a process
            group of several; one ``all_gather`` each ``log_every`` updates on every process).
        profiler: a [`Profiler`][] started with the monitor and stepped with each step.
        thresholds: the checklist's limits.
        file: stream for the progress bar (default ``sys.stderr``).
        keep_rows: how many of the latest rows [`rows`][] keeps (the report and the plot
            need none of them: memory stays bounded however long the run).
        initial: the bar's start (its rate: this run's steps); default ``state.step`` when
            ``state`` is given (a resumed run's bar continues), else 0.
        memory_snapshot: a path: the allocations of the first 3 steps are recorded and, when
            an out-of-memory error leaves ``with monitor:`` or [`measure`][], what was
            alive is dumped there (see [`MemorySnapshot`][]) and named in the error and the
            report. Or [`memory_snapshot(path, step=step)`][accelfn.memory_snapshot] with
            the training step: with ``state`` and [`iterate`][], the step's peak by kind
            is estimated on the first batch, before its update
            ([`estimate_memory`][accelfn.estimate_memory]; in the report), and the error
            names that peak and the fixes for the step's stack.
    """

    def __init__(self, *, log_every: int = 50, warmup: int = 2, total: int | None = None,
                 progress: bool = True, desc: str = "train", sinks: Iterable[Sink] = (),
                 state: TrainState | None = None, plot: str | Path | None = None,
                 device: torch.device | str | None = None,
                 # the grouped options' defaults are frozen values, shared safely
                 throughput: Throughput = Throughput(),  # noqa: B008
                 gpu: GPUSampling = GPUSampling(),  # noqa: B008
                 sync_check: SyncCheck | None = SyncCheck(),  # noqa: B008
                 stragglers: bool | None = None, model: nn.Module | None = None,
                 diagnostics: Diagnostics | None = None, profiler: Profiler | None = None,
                 thresholds: Thresholds | None = None, file: IO[str] | None = None,
                 keep_rows: int = 1000, initial: int | None = None,
                 memory_snapshot: str | os.PathLike[str] | MemorySnapshot | None = None,
                 **removed_keywords: Never) -> None:
        check_grouped(removed_keywords, throughput=throughput, gpu=gpu, sync_check=sync_check)
        for name, value, low in (("log_every", log_every, 1), ("warmup", warmup, 0),
                                 ("keep_rows", keep_rows, 0), ("initial", initial or 0, 0)):
            if value < low:
                raise ValueError(f"Monitor({name}={value}): must be >= {low}")
        if total is not None and initial is not None and initial > total:
            raise ValueError(f"Monitor(initial={initial}): more steps done than total={total}")
        self.log_every, self.warmup, self.total, self._initial = log_every, warmup, total, initial
        self.throughput, self.sync_check = throughput, sync_check
        self.device = torch.device(device if device is not None else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self._cuda = self.device.type == "cuda"
        self.model, self.diagnostics, self.profiler = model, diagnostics, profiler
        self.thresholds = thresholds or Thresholds()
        self._out = Outputs(main=is_main_process(), sinks=sinks, progress=progress, desc=desc,
                            file=file, total=total, initial=initial or 0, plot=plot)
        self.state, self._snapshot = state, snapshot_option(memory_snapshot, self.device, state)
        #: where [`close`][] wrote the plot (``None``: not asked for, or not written)
        self.plot_file: Path | None = None
        self._gpu = GPUSampler(gpu.index, interval=gpu.interval) \
            if (self._cuda or gpu.index is not None) else None
        self._gpu_note: str | None = None if self._gpu else "no GPU in use"
        self._book = RunBook(warmup, records.ROW_KEYS, keep_rows)
        self._stragglers = Stragglers(stragglers, warmup=warmup)
        self._pending: deque[PendingStep | PendingLog] = deque()
        self._last_step: int | None = None  # the step of the latest training row
        self._started = self._closed = False
        self._report: MonitorReport | None = None
        self._n, self._next_step = 0, 1  # steps seen; the next row's step (as state.step's)
        self._t0 = self._t_last = time.perf_counter()
        self._ev_last: torch.cuda.Event | None = None
        self._wait_acc, self._in_iterate = 0.0, 0
        self._awaiting_step = self._measuring = False
        self._last_batch: Any = None
        self._probe: SyncProbe | None = None
        self._probe_step: int | None = None
        self._probe_result: list[SyncPoint] | None = None
        self._probe_mode: str | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Monitor:
        """Start the clock, the GPU sampler, outputs and the profiler (done by ``with``)."""
        if self._started:
            return self
        self._refuse_closed("start")
        self._next_step = self.state.step + 1 if self.state is not None else 1
        # the bar continues from the state's step, read now: after the checkpoint was loaded;
        # one output failing to open closes those opened: start again
        initial = self._initial if self._initial is not None else \
            min(self._next_step - 1, self.total or self._next_step)
        self._out.open(self._next_step, initial=initial)
        self._started = True
        if self._snapshot is not None:
            self._snapshot.start()
        if self.profiler is not None and not self.profiler.running and not self.profiler.done:
            self.profiler.start()
        if self._gpu is not None and not self._gpu.start():
            self._gpu_note = self._gpu.error
            self._gpu = None
        # the clock starts once the outputs and NVML are up (wandb.init takes seconds)
        self._t0 = self._t_last = time.perf_counter()
        if self._gpu is not None:
            self._gpu.rebase(self._t0)
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._ev_last = records.boundary_event(self.device)
        return self

    @property
    def _probe_at(self) -> int | None:
        return self.sync_check.step if self.sync_check is not None else None

    @property
    def _allow(self) -> tuple[str, ...]:
        return tuple(self.sync_check.allow) if self.sync_check is not None else ()

    def _refuse_closed(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"Monitor.{what}() after close(): its outputs are closed and "
                               "its report is final; start a new Monitor for more steps")

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, exc_type: Any, error: BaseException | None, tb: Any) -> None:
        if error is None:
            self.close()
            return
        self._out_of_memory(error)
        try:  # the loop's own error goes on; a failing output must not replace it
            self._close(failed_loop=True)
        except Exception as err:
            warnings.warn(f"Monitor.close() after an error in the loop failed too: "
                          f"{type(err).__name__}: {err}", stacklevel=2)

    def close(self) -> MonitorReport:
        """Flush everything (one device sync), stop threads, close outputs; return the report.

        Everything is stopped and closed even when flushing or a sink fails; the first such
        error is raised at the end."""
        return self._close(failed_loop=False)

    def _close(self, *, failed_loop: bool) -> MonitorReport:
        """[`close`][]; ``failed_loop``: the monitored loop raised, so sinks that can mark a
        run as failed (an ``abort(report)`` method: W&B, MLflow) are closed with it."""
        if self._closed:
            assert self._report is not None
            return self._report
        failed: BaseException | None = None
        try:
            self._end_probe()
            self.flush(wait=True)
        except Exception as exc:
            failed = exc
        if self._gpu is not None:
            self._gpu.stop()
        if self.profiler is not None:
            self.profiler.stop()
        if self._snapshot is not None:
            self._snapshot.close()
        self._closed = True
        self._report = report = self._build_report()
        history = self._out.history if self.state is not None else None
        closing = self._out.close(report, failed_loop=failed_loop, history=history)
        failed = failed or closing
        self.plot_file = self._out.plot_file
        if failed is not None:
            raise failed
        return report

    def report(self) -> MonitorReport:
        """The report so far (waits for outstanding device work); final after [`close`][]."""
        if self._closed:
            assert self._report is not None
            return self._report
        self.flush(wait=True)
        return self._build_report()

    # -- feeding and reading --------------------------------------------------------------

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, timing each ``next()`` as data wait.

        Call [`step`][] after each training step; if you do not, each batch counts as one
        step when the next one is asked for.
        """
        self._refuse_closed("iterate")
        self.start()
        it = iter(iterable)
        self._in_iterate += 1
        try:
            while True:
                if self._awaiting_step:
                    self.step()
                t = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self._wait_acc += time.perf_counter() - t
                self._last_batch = batch
                if self._n == 0 and self._snapshot is not None and self.state is not None:
                    self._t_last += self._snapshot.estimate_before(self.state, batch)
                self._awaiting_step = True
                if self._n == self._probe_at and self._probe_step is None:
                    self._begin_probe()
                yield batch
        finally:
            self._in_iterate -= 1
            self._end_probe()

    @contextlib.contextmanager
    def measure(self, *, samples: float | Tensor | None = None,
                tokens: float | Tensor | None = None,
                data_wait: float | None = None) -> Iterator[StepRecord]:
        """Context manager around one training step; the time since the previous one is the
        data wait (unless under [`iterate`][], which times ``next()`` itself)."""
        self._refuse_closed("measure")
        self.start()
        outside = time.perf_counter() - self._t_last
        rec = StepRecord()
        rec.samples, rec.tokens = samples, tokens
        if self._n == self._probe_at and self._probe_step is None:
            self._begin_probe()
        self._measuring = True
        try:
            yield rec
        except BaseException as error:
            self._out_of_memory(error)
            raise
        finally:
            self._measuring = False
        if data_wait is None and not self._in_iterate:
            data_wait = outside
        self.step(rec.metrics, samples=rec.samples, tokens=rec.tokens, data_wait=data_wait)

    @contextlib.contextmanager
    def probe_syncs(self) -> Iterator[SyncProbe]:
        """Run the enclosed step under [`SyncProbe`][]; its result goes into the report."""
        with SyncProbe(allow=self._allow) as probe:
            yield probe
        self._probe_result = (self._probe_result or []) + probe.syncs
        self._probe_mode = probe.mode

    def _out_of_memory(self, error: BaseException) -> None:
        """An error leaves the loop: the probe ends; an out-of-memory one dumps the snapshot."""
        self._end_probe()
        if self._snapshot is not None:
            self._snapshot.on_error(error)  # other errors pass untouched

    def _begin_probe(self) -> None:
        self._probe = SyncProbe(allow=self._allow)
        self._probe_step = self._n
        self._probe.__enter__()

    def _end_probe(self) -> None:
        if self._probe is not None:
            probe, self._probe = self._probe, None
            probe.__exit__(None, None, None)
            self._probe_result = (self._probe_result or []) + probe.syncs
            self._probe_mode = probe.mode

    def count_flops(self, model: nn.Module, *inputs: Any,
                    loss_fn: Callable[[Any], Tensor] | None = None) -> int:
        """Set ``throughput.flops_per_step`` from one forward+backward of ``model(*inputs)``."""
        flops = training_flops(model, *inputs, loss_fn=loss_fn)
        self.throughput = replace(self.throughput, flops_per_step=flops)
        return int(flops)

    def step(self, metrics: Any = None, *, samples: float | Tensor | None = None,
             tokens: float | Tensor | None = None, data_wait: float | None = None) -> None:
        """Record the end of one training step. Never waits for the device.

        Args:
            metrics: what the step returned (TensorDict / mapping of scalar tensors, a loss
                tensor, or None); read later, every ``log_every`` steps.
            samples: how many samples this step processed (default: ``throughput``'s
                ``samples_per_step``, or
                the batch's leading dimension under [`iterate`][]); a one-element tensor
                (``mask.sum()``) is read with the metrics, later.
            tokens: how many tokens this step processed (default: ``tokens_per_step``, else
                the ``"weight"`` in ``metrics``, the token count a step returns for
                token-weighted accumulation); a tensor as for ``samples``.
            data_wait: seconds this step waited for data, e.g. ``loader.last_wait_s``
                (default: what [`iterate`][] / [`measure`][] measured).
        """
        self._refuse_closed("step")
        probed = self._probe is not None
        self._end_probe()
        if not self._started:
            self.start()
        if self._snapshot is not None:
            self._snapshot.updated()  # recording stops after its first updates
        now = time.perf_counter()
        if samples is None:
            samples = self.throughput.samples_per_step
            if samples is None and self._awaiting_step:
                samples = records.batch_samples(self._last_batch)
        if tokens is None:  # else the step's token count ("weight"), when it gives one
            given = self.throughput.tokens_per_step
            tokens = given if given is not None else records.weight_of(metrics)
        snaps, py = records.snapshot_metrics(metrics, {"samples": samples, "tokens": tokens})
        samples, tokens = (None if isinstance(x, Tensor) else x for x in (samples, tokens))
        event = records.boundary_event(self.device) if self._cuda else None
        wait = self._wait_acc if data_wait is None else float(data_wait)
        mem = (torch.cuda.memory_allocated(self.device) / 2**30 if self._cuda
               else records.rss_gib())
        self._pending.append(PendingStep(
            step=self._next_step, time_s=now - self._t0, iter_s=now - self._t_last,
            data_wait_s=wait, samples=samples, tokens=tokens, mem_gib=mem, event=event,
            prev_event=self._ev_last, snaps=snaps, py_metrics=py,
            probed=probed or self._probe_step == self._n))
        if self.diagnostics is not None:
            self.diagnostics.step(metrics if isinstance(metrics, Mapping) or hasattr(
                metrics, "get") else None, self._last_batch if self._awaiting_step else None)
        if self.profiler is not None and not self.profiler.done:
            self.profiler.step()
        self._ev_last, self._last_step, self._t_last = event, self._next_step, now
        self._wait_acc, self._awaiting_step = 0.0, False
        self._n += 1
        self._next_step = self.state.step + 1 if self.state is not None else self._next_step + 1
        self._out.advance()
        if self._n % self.log_every == 0:
            self.flush()
            self._stragglers.check()  # on every process at the same update

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write ``values`` (a validation loss, any scalars) to every sink at ``step``, one
        row ``{"step": step, **values}`` among the training rows. Never waits for the device.

        ``values``: names to Python numbers or one-element tensors on any device (nested mappings
        give ``"outer.inner"``), copied off without a sync and written once the device has
        passed this call. ``step``: default, that of the latest training row (before any, the
        first step). The report's ``logged`` holds each name's last value and the plot draws
        them; see `accelfn.observe.monitor.sinks` for what each sink writes. Called between steps
        (after ``step()``, as after an evaluation), it restarts the step clock: the
        evaluation's time is not the next step's iteration or data wait.
        """
        records.check_logged(values, step)
        self._refuse_closed("log")
        self.start()
        snaps, py = records.snapshot_metrics(values)
        if step is None:
            step = self._last_step if self._last_step is not None else self._next_step
        event = records.boundary_event(self.device) if self._cuda else None
        self._pending.append(PendingLog(step=int(step), event=event, snaps=snaps,
                                        py_metrics=py))
        self.flush()
        if not (self._awaiting_step or self._measuring):  # between steps: not training
            self._t_last, self._ev_last = time.perf_counter(), event or self._ev_last

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The latest rows read (at most ``keep_rows``): one per step, as the sinks got them."""
        return list(self._book.recent)

    def flush(self, *, wait: bool = False) -> None:
        """Read every completed step record and write it out.

        Records whose CUDA event has not completed stay pending (no sync), unless ``wait``,
        which synchronises the device once.
        """
        if wait and self._cuda and self._pending:
            torch.cuda.synchronize(self.device)
        new: list[dict[str, Any]] = []
        last: dict[str, Any] | None = None
        while self._pending:
            p = self._pending[0]
            if p.event is not None and not records.completed(p.event):
                break
            self._pending.popleft()
            if isinstance(p, PendingLog):
                new.append(records.make_log_row(p))
                self._book.add_logged(new[-1])
            else:
                new.append(last := records.make_row(p))
                self._book.add(last)
        if new:
            self._out.write(new, last)
            self._stragglers.add(new)

    def _build_report(self) -> MonitorReport:
        report = build_report(
            book=self._book, warmup=self.warmup, device=self.device,
            gpu=self._gpu, gpu_note=self._gpu_note, throughput=self.throughput,
            model=self.model, diagnostics=self.diagnostics, syncs=self._probe_result,
            probe_mode=self._probe_mode, sync_check=self.sync_check is not None,
            thresholds=self.thresholds,
            snapshot=self._snapshot)
        report.findings += self._stragglers.findings()
        return report
