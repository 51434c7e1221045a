"""The monitor's report: the numbers of a run, its verdict and findings, as text, JSON and
a plot; and the checklist's [`Thresholds`][] it is judged against."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..findings import Finding, format_findings
from ..sync_probe import SyncPoint
from .gpu_sampler import GPUSample

__all__ = ["MonitorReport", "Thresholds"]


@dataclass(frozen=True)
class Thresholds:
    """The performance checklist: data wait under 20% of an iteration, GPU busy over 85%.

    ``mfu_low`` is the MFU under which a busy GPU is called compute-inefficient.
    """

    data_wait_share: float = 0.20
    gpu_busy: float = 0.85
    mfu_low: float = 0.25


def fmt_rate(x: float | None, unit: str) -> str:
    """``x`` with an SI prefix (``"1.23 Msamples/s"``); ``"n/a"`` for ``None``."""
    if x is None:
        return "n/a"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


@dataclass
class MonitorReport:
    """Summary of a monitored run.

    Timing statistics skip the first ``warmup`` steps (compilation, cuDNN autotuning,
    worker start-up) and the probed step, unless nothing else is left; then
    ``warmup_included`` is true when warm-up steps were counted, and the text says so.

    ``rows`` is the run's picture for plots, in bounded memory: every step's record up to
    2048 of them, beyond that means of ``rows_per_point`` consecutive steps (each point
    has the first step's number). ``logged`` holds the last value of each name given to
    [`Monitor.log`][accelfn.Monitor.log], ``logged_rows`` their rows
    (bounded the same way).
    """

    steps: int
    measured_steps: int
    warmup: int
    wall_s: float
    device: str
    device_name: str | None
    step_time_s: float | None
    step_time_median_s: float | None
    step_time_p90_s: float | None
    data_wait_s: float | None
    data_wait_share: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    flops_per_step: float | None
    peak_flops: float | None
    mfu: float | None
    peak_memory_gib: float | None
    gpu_util: float | None
    gpu_memory_gib: float | None
    gpu_power_w: float | None
    gpu_note: str | None
    syncs: list[SyncPoint] | None
    metrics: dict[str, float]
    findings: list[Finding]
    verdict: str
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)
    gpu_samples: list[GPUSample] = field(default_factory=list, repr=False)
    #: the run had no step past the warm-up: the timing numbers include warm-up steps
    warmup_included: bool = False
    #: how many consecutive steps each of ``rows`` is the mean of
    rows_per_point: int = 1
    #: the last value of each name given to Monitor.log
    logged: dict[str, float] = field(default_factory=dict)
    logged_rows: list[dict[str, Any]] = field(default_factory=list, repr=False)
    #: the run's number of processes (``torch.distributed``'s world size)
    processes: int = 1
    #: samples/s and tokens/s of all processes together: this process's times ``processes``
    global_samples_per_s: float | None = None
    global_tokens_per_s: float | None = None
    #: the checklist's limits the verdict (and the plot's target lines) used
    thresholds: Thresholds = field(default_factory=Thresholds, repr=False)

    def to_dict(self, *, rows: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (per-step rows and GPU samples only with ``rows=True``)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__
               if k not in ("rows", "gpu_samples", "findings", "syncs", "logged_rows",
                            "thresholds")}
        out["findings"] = [f.to_dict() for f in self.findings]
        out["syncs"] = None if self.syncs is None else [
            {"op": s.op, "location": s.location, "code": s.code, "via": s.via,
             "count": s.count} for s in self.syncs]
        if rows:
            out["rows"] = self.rows
            out["gpu_samples"] = self.gpu_samples
            out["logged_rows"] = self.logged_rows
        return out

    def to_json(self, *, rows: bool = False, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(rows=rows), indent=indent, default=str)

    def _throughput(self) -> str:
        """The throughput line: this process's rates, then all processes' beside them."""
        def rates(samples: float | None, tokens: float | None) -> str:
            return fmt_rate(samples, "samples/s") + (
                f", {fmt_rate(tokens, 'tokens/s')}" if tokens else "")

        own = rates(self.samples_per_s, self.tokens_per_s)
        if self.processes <= 1:
            return own
        return (f"{own} per process; {rates(self.global_samples_per_s, self.global_tokens_per_s)}"
                f" over all {self.processes} processes")

    def __str__(self) -> str:
        def ms(x: float | None) -> str:
            return "n/a" if x is None else f"{1e3 * x:.1f} ms"

        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.1f}%"

        dev = self.device + (f" ({self.device_name})" if self.device_name else "")
        lines = [
            "accelfn monitor report",
            "======================",
            f"device          {dev}",
            f"steps           {self.steps} ({self.measured_steps} measured"
            + (", warm-up included" if self.warmup_included else "") + "), "
            f"wall {self.wall_s:.1f} s",
            f"step time       mean {ms(self.step_time_s)}, median "
            f"{ms(self.step_time_median_s)}, p90 {ms(self.step_time_p90_s)}",
            f"data wait       {ms(self.data_wait_s)} per step = {pct(self.data_wait_share)} "
            "of an iteration",
            f"throughput      {self._throughput()}",
        ]
        if self.flops_per_step:
            peak = fmt_rate(self.peak_flops, "FLOP/s") if self.peak_flops else "unknown peak"
            lines.append(f"compute         {fmt_rate(self.flops_per_step, 'FLOP')}/step, "
                         f"MFU {pct(self.mfu)} of {peak}")
        if self.peak_memory_gib is not None:
            lines.append(f"peak memory     {self.peak_memory_gib:.2f} GiB")
        if self.gpu_util is not None:
            power = f", {self.gpu_power_w:.0f} W" if self.gpu_power_w is not None else ""
            lines.append(f"GPU (pynvml)    busy {self.gpu_util:.0f}%, memory used "
                         f"{self.gpu_memory_gib:.2f} GiB{power}")
        elif self.gpu_note:
            lines.append(f"GPU (pynvml)    not sampled: {self.gpu_note}")
        if self.metrics:
            lines.append("metrics (mean)  " + ", ".join(f"{k} {v:.4g}"
                                                        for k, v in self.metrics.items()))
        if self.logged:
            lines.append("logged (last)   " + ", ".join(f"{k} {v:.4g}"
                                                        for k, v in self.logged.items()))
        lines += ["", f"verdict: {self.verdict}", "", format_findings(self.findings)]
        return "\n".join(lines)

    def plot(self, path: str | Path, *, title: str | None = None,
             history: str | Path | None = None) -> Path:
        """Write a PNG of the run and return its path: training loss (with a moving mean,
        and the logged values whose name has ``loss`` in it, e.g. a validation loss),
        learning rate (when the steps report ``lr``), the other logged values, throughput,
        iteration time against data wait, memory, and GPU busy when pynvml sampled it, per
        step.

        ``history``: draw the steps from this metrics JSONL file (what a ``JsonlSink``
        writes) instead of the report's own rows: the whole history on disk, the rows of
        earlier runs of a resumed run included (read in bounded memory).

        Needs matplotlib (``pip install 'accelfn[plot]'``); raises ``ImportError`` saying
        so when it is absent.
        """
        from .plots import plot_report

        report = self
        if history is not None:
            from .aggregates import read_history

            training, logged = read_history(history)
            report = replace(self, rows=training.rows(),
                             rows_per_point=training.rows_per_point,
                             logged_rows=logged.rows())
        return plot_report(report, path, title=title)
