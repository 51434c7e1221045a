"""The verdict: a run's rows summarised and judged against the performance checklist.

Data loading under 20% of an iteration, GPU busy over 85%, no unnecessary host syncs; for
each miss a finding says what to do, and one line says what limits the run (input-bound,
sync-bound, GPU underused or compute-bound).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..findings import Finding
from ..sync_probe import SyncPoint
from .aggregates import History, RunningSummary
from .gpu_sampler import GPUSample
from .records import ROW_KEYS
from .report import MonitorReport, Thresholds

__all__ = ["summarise", "verdict"]


def summarise(rows: Sequence[dict[str, Any]] | RunningSummary, *, warmup: int,
              device: torch.device, device_name: str | None, flops_per_step: float | None,
              peak: float | None, peak_memory_gib: float | None,
              gpu_samples: Sequence[GPUSample], gpu_note: str | None,
              syncs: list[SyncPoint] | None, probe_mode: str | None, th: Thresholds,
              more_findings: Iterable[Finding] = (), sync_check: bool = True,
              history: History | None = None, logged: History | None = None,
              last_logged: Mapping[str, float] | None = None,
              threads: Finding | None = None, processes: int = 1) -> MonitorReport:
    """The report of a run from its rows (one per step, or their [`RunningSummary`][]) and
    what the monitor knows besides.

    Timing statistics skip the first ``warmup`` rows of the run (whatever step a resumed run
    starts at) and the probed step, unless nothing else is left (then a warm-up step counted
    sets ``warmup_included`` and adds a ``warmup`` warning); GPU samples count from the
    first measured step on. ``more_findings`` go after the checklist's. ``sync_check=False``
    (the check turned off) leaves the host-sync finding out when no step was probed.
    ``history`` is the plot's picture of the rows (default: built from ``rows``),
    ``logged`` that of the values given to ``Monitor.log`` and ``last_logged`` the last
    value of each; ``threads`` the CPU oversubscription check (a warning names it in the
    verdict of a run that is not input- or sync-bound). ``processes``: the run's number of
    processes; the global rates are this process's times it (no collective: every process
    of a data-parallel run takes its share of each step's samples).
    """
    if isinstance(rows, RunningSummary):
        summary = rows
    else:
        summary = RunningSummary(warmup, ROW_KEYS)
        history = History() if history is None else history
        for r in rows:
            summary.add(r)
            history.add(r)
    totals, warmup_included = summary.measured()
    n = totals.n
    total_step = totals.step
    share = totals.wait / totals.iter if totals.iter > 0 else None
    # over the rows that counted them: a row without a count is no row of zero samples
    sps = (totals.samples / totals.samples_step
           if totals.samples_n and totals.samples_step > 0 else None)
    tps = (totals.tokens / totals.tokens_step
           if totals.tokens_n and totals.tokens_step > 0 else None)
    mfu = (flops_per_step * n / total_step / peak
           if flops_per_step and peak and total_step > 0 else None)
    samples_gpu = list(gpu_samples)
    gpu_util = gpu_mem = gpu_power = None
    if samples_gpu:
        # the measured steps' time only: not the warm-up, nor what ran after the last step
        # (a checkpoint saved, an evaluation) while the GPU idled
        first, last = totals.first, totals.last
        t_from = first["time_s"] - first["iter_s"] if first else 0.0
        t_to = last["time_s"] if last else math.inf
        window = [s for s in samples_gpu if t_from <= s[0] <= t_to] or samples_gpu
        gpu_util = sum(s[1] for s in window) / len(window)
        gpu_mem = max(s[2] for s in window)
        powers = [s[3] for s in window if s[3] is not None]
        gpu_power = sum(powers) / len(powers) if powers else None
    elif gpu_note is None:
        gpu_note = "no samples yet (run longer than GPUSampling's interval)"
    metrics = totals.metric_means()
    nonfinite = _nonfinite(summary)
    findings, line = verdict(share=share, gpu_util=gpu_util, gpu_note=gpu_note, mfu=mfu,
                             syncs=syncs, probe_mode=probe_mode, device_type=device.type,
                             th=th, sync_check=sync_check, threads=threads)
    if warmup_included:
        findings.append(Finding(
            "warmup", "warning",
            f"all {summary.count} step(s) fall within warmup={warmup}: the timing numbers "
            "include the warm-up (compilation, autotuning, start-up)",
            "run more steps than warmup, or lower Monitor(warmup=...)"))
    findings += nonfinite
    findings += more_findings
    plot_rows = history.rows() if history is not None else []
    return MonitorReport(
        steps=summary.count, measured_steps=n, warmup=warmup,
        wall_s=(summary.last["time_s"] if summary.last else 0.0), device=str(device),
        device_name=device_name, step_time_s=total_step / n if n else None,
        step_time_median_s=totals.times.quantile(0.5),
        step_time_p90_s=totals.times.quantile(0.9),
        data_wait_s=totals.wait / n if n else None, data_wait_share=share,
        samples_per_s=sps, tokens_per_s=tps, flops_per_step=flops_per_step,
        peak_flops=peak, mfu=mfu, peak_memory_gib=peak_memory_gib, gpu_util=gpu_util,
        gpu_memory_gib=gpu_mem, gpu_power_w=gpu_power, gpu_note=gpu_note,
        syncs=syncs, metrics=metrics, findings=findings, verdict=line,
        rows=plot_rows, gpu_samples=list(samples_gpu), warmup_included=warmup_included,
        rows_per_point=history.rows_per_point if history is not None else 1,
        logged=dict(last_logged or {}),
        logged_rows=logged.rows() if logged is not None else [], processes=processes,
        global_samples_per_s=None if sps is None else sps * processes,
        global_tokens_per_s=None if tps is None else tps * processes, thresholds=th)


def _nonfinite(summary: RunningSummary) -> list[Finding]:
    """A warning for each metric that was NaN or Inf at some step."""
    out = []
    for k, (count, bad, first) in summary.nonfinite.items():
        if bad:
            out.append(Finding(
                "nonfinite", "warning",
                f"{k!r} was NaN or Inf at {bad} of {count} steps (first at step "
                f"{first}); the report's mean of it is over the finite values",
                "a NaN or Inf loss: lower the learning rate or warm it up, clip gradients "
                "(accelfn.with_clipping), use bf16 or fp16 with loss scaling "
                "(accelfn.with_amp); accelfn.with_nonfinite(policy='skip') skips such "
                "updates and counts them"))
    return out


def verdict(*, share: float | None, gpu_util: float | None, gpu_note: str | None,
            mfu: float | None, syncs: list[SyncPoint] | None, probe_mode: str | None,
            device_type: str, th: Thresholds, sync_check: bool = True,
            threads: Finding | None = None) -> tuple[list[Finding], str]:
    """The checklist's findings and the one-line verdict of a run.

    ``share`` is the data-wait share of an iteration, ``gpu_util`` the mean pynvml busy
    percentage (``gpu_note`` says why it is ``None``), ``syncs`` the probed step's sync
    points (``None``: no step probed) found in ``probe_mode``. With ``sync_check=False``
    an unprobed run gets no host-sync finding (the user turned the check off).
    ``threads`` (the oversubscription check) goes among the findings; a warning of it is
    the verdict of a run neither input- nor sync-bound: its CPU is oversubscribed.
    """
    out: list[Finding] = []
    data_bound = share is not None and share >= th.data_wait_share
    if share is None:
        out.append(Finding("data_wait", "info", "no steps measured"))
    elif data_bound:
        out.append(Finding(
            "data_wait", "warning",
            f"the loop waits for data {100 * share:.0f}% of each iteration "
            f"(target < {100 * th.data_wait_share:.0f}%)",
            "more loader workers (up to the cores per process), pin_memory=True, "
            "persistent_workers=True, prefetching; move decoding and augmentation to the "
            "GPU (accelfn.data) or preload into a memory-mapped TensorDict"))
    else:
        out.append(Finding("data_wait", "ok",
                           f"data wait {100 * share:.1f}% of an iteration "
                           f"(< {100 * th.data_wait_share:.0f}%)"))
    if syncs is None and sync_check:
        out.append(Finding("host_syncs", "info",
                           "no step was probed for host syncs",
                           "use Monitor.iterate/measure (its SyncCheck probes one step) "
                           "or `with mon.probe_syncs(): step(state, batch)`"))
    elif syncs:  # a non-empty list
        for s in syncs:
            out.append(Finding("host_syncs", "warning", f"host sync: {s}", s.fix))
    elif syncs is not None:
        out.append(Finding("host_syncs", "ok",
                           f"no host-device sync points in the probed step "
                           f"({probe_mode})"))
    gpu_low = gpu_util is not None and gpu_util < 100 * th.gpu_busy
    if gpu_util is None:
        out.append(Finding("gpu_busy", "info", f"GPU utilisation not measured: {gpu_note}"))
    elif gpu_low:
        if data_bound:
            fix = "fix the data loading first (above): the GPU idles while it waits"
        elif syncs:
            fix = "remove the host syncs listed above: each one drains the GPU's queue"
        else:
            fix = ("the GPU runs out of work between kernels: larger batches, "
                   "torch.compile (accelfn.compiled, mode='reduce-overhead' uses CUDA "
                   "graphs against launch overhead), bf16 autocast, fewer small ops")
        out.append(Finding("gpu_busy", "warning",
                           f"GPU busy {gpu_util:.0f}% (target > {100 * th.gpu_busy:.0f}%)",
                           fix))
    else:
        out.append(Finding("gpu_busy", "ok", f"GPU busy {gpu_util:.0f}%"))
    if mfu is not None:
        if mfu < th.mfu_low and not data_bound and not gpu_low:
            out.append(Finding(
                "mfu", "info", f"MFU {100 * mfu:.1f}%: the GPU is busy but far below its "
                "peak", "bf16 autocast (accelfn.with_amp), TF32 for fp32 matmuls, "
                "torch.compile to fuse elementwise ops, channels_last for convolutions, "
                "matrix sizes that are multiples of 8/64"))
        else:
            out.append(Finding("mfu", "ok" if mfu >= th.mfu_low else "info",
                               f"MFU {100 * mfu:.1f}%"))
    if threads is not None:
        out.append(threads)
    oversubscribed = threads is not None and threads.severity == "warning"
    if share is None:
        verdict = "no steps measured"
    elif data_bound:
        verdict = (f"input-bound: the loop waits for data {100 * share:.0f}% of each "
                   "iteration")
    elif syncs:
        verdict = (f"sync-bound: {len(syncs)} host sync point(s) in the step stall the GPU"
                   if probe_mode == "cuda" else
                   f"sync-bound: {len(syncs)} host sync point(s) in the step would stall a "
                   "GPU (emulated probe)")
    elif oversubscribed:
        assert threads is not None
        verdict = (f"CPU {threads.message} (the checklist's threads finding has the fix)")
    elif gpu_low:
        verdict = f"GPU underused ({gpu_util:.0f}% busy): launch or CPU overhead"
    elif gpu_util is not None:
        verdict = f"compute-bound: GPU busy {gpu_util:.0f}%" + (
            f", MFU {100 * mfu:.0f}%" if mfu is not None else "")
    else:
        verdict = (f"compute-bound on {device_type}: data wait "
                   f"{100 * share:.0f}%, no host syncs found" if syncs is not None else
                   f"compute-bound on {device_type}: data wait {100 * share:.0f}%")
    return out, verdict
