"""A monitor for any training loop: where does the time go, and what to do about it.

>>> mon = Monitor(log_every=50, jsonl="runs/a/metrics.jsonl", plot="runs/a/run.png")
>>> with mon:
...     for batch in mon.iterate(loader):          # times every next(): the data wait
...         metrics = step(state, batch)
...         mon.step(metrics, samples=batch.batch_size[0])
>>> print(mon.report())

Per step it keeps, without ever making the host wait for the device:

* the iteration time: CUDA events recorded at each step boundary on a GPU (read lazily,
  only once they have completed), ``time.perf_counter`` on the CPU;
* the time the loop waited for data (every ``next()`` under :meth:`Monitor.iterate`, the
  time spent outside :meth:`Monitor.measure`, or a loader's own ``last_wait_s``);
* samples and tokens, from which samples/s, tokens/s and MFU follow (FLOPs of one step are
  counted once with ``torch.utils.flop_counter.FlopCounterMode``);
* memory (``torch.cuda.memory_allocated`` / the process's resident memory on the CPU);
* the step's metrics: scalar tensors are copied to pinned host memory with
  ``non_blocking=True`` right after the step and read when their boundary event completed;
* GPU utilisation, memory and power sampled by pynvml in a background thread.

Every ``log_every`` steps the completed records go to a progress bar, JSONL, CSV and
TensorBoard. :meth:`Monitor.report` ends with a bottleneck verdict against the seeds'
checklist: data loading under 20% of an iteration, GPU busy over 85%, no unnecessary host
syncs (one step is probed with :class:`~accelfn.diagnostics.SyncProbe`), and the fix for each.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import os
import re
import resource
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from .diagnostics import (
    Diagnostics,
    Finding,
    SyncPoint,
    SyncProbe,
    check_model,
    format_findings,
)
from .profiling import Profiler

__all__ = [
    "PEAK_FLOPS",
    "GPUSampler",
    "Monitor",
    "MonitorReport",
    "Thresholds",
    "count_flops",
    "peak_flops",
    "progress",
    "training_flops",
]

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# FLOPs and peaks
# --------------------------------------------------------------------------------------------

# Dense (no sparsity) datasheet peaks per GPU in FLOP/s, matched against the device name in
# order (first match wins). tf32/bf16/fp16 are tensor-core rates with fp32 accumulation.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    (r"\bB200\b", {"bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15}),
    (r"\bH200 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bGH200\b|\bH200\b", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                             "fp32": 66.9e12}),
    (r"\bH100 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH100 PCIe\b", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51.2e12}),
    (r"\bH100\b|\bH800\b", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                            "fp32": 66.9e12}),
    (r"\bA100\b|\bA800\b", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\bL40S\b", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bA10\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"\bV100\b", {"fp16": 125e12, "fp32": 15.7e12}),
    (r"\bT4\b", {"fp16": 65e12, "fp32": 8.1e12}),
]

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device_name: str, dtype: torch.dtype | str = torch.bfloat16) -> float | None:
    """Datasheet dense peak FLOP/s of the GPU called ``device_name`` for ``dtype``.

    ``dtype`` is a torch dtype or one of ``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``.
    Returns ``None`` for an unknown GPU or a dtype it has no rate for (e.g. bf16 on a V100);
    pass ``peak_flops=`` to :class:`Monitor` then.
    """
    key = _DTYPE_KEYS.get(dtype, None) if isinstance(dtype, torch.dtype) else str(dtype)
    for pattern, rates in PEAK_FLOPS:
        if re.search(pattern, device_name):
            return rates.get(key or "")
    return None


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """FLOPs of whatever ``fn(*args, **kwargs)`` runs, counted by ``FlopCounterMode``.

    Matrix multiplications and convolutions (forward and, if ``fn`` calls ``backward``,
    backward) are counted as 2 FLOPs per multiply-add; elementwise work is not counted,
    which is the usual convention for MFU.
    """
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def training_flops(model: nn.Module, *inputs: Any,
                   loss_fn: Callable[[Any], Tensor] | None = None) -> int:
    """FLOPs of one forward and backward of ``model(*inputs)`` (one training step's work).

    ``loss_fn(output)`` makes the loss (default ``output.sum()``; the loss itself adds no
    counted FLOPs for the usual losses). Gradients and buffers (BatchNorm statistics) are
    restored afterwards, so counting does not change training. For a ``Linear(i, o)`` on a
    batch of ``B`` this is ``2*B*i*o`` forward plus ``2*B*i*o`` for the weight gradient,
    and another ``2*B*i*o`` when the input needs a gradient (every layer but the first).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    for p in params:
        p.grad = None

    def run() -> None:
        out = model(*inputs)
        if loss_fn is not None:
            loss = loss_fn(out)
        else:
            if isinstance(out, Mapping):
                out = out.get("loss", next(iter(out.values())))
            elif isinstance(out, (tuple, list)):
                out = out[0]
            loss = out.float().sum()
        loss.backward()

    try:
        return count_flops(run)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved_buffers):
                b.copy_(s)


# --------------------------------------------------------------------------------------------
# Progress bars
# --------------------------------------------------------------------------------------------


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class _SimpleBar:
    """A one-line progress bar for when tqdm is not installed."""

    def __init__(self, total: int | None, desc: str, file: IO[str], interval: float = 0.2):
        self.total, self.desc, self.file, self.interval = total, desc, file, interval
        self.n = 0
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self.interval or (self.total and self.n >= self.total):
            self._last = now
            self._draw(now)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def _draw(self, now: float) -> None:
        rate = self.n / max(now - self._t0, 1e-9)
        if self.total:
            frac = min(self.n / self.total, 1.0)
            bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
            head = f"{self.desc} {self.n}/{self.total} [{bar}] {100 * frac:3.0f}%"
        else:
            head = f"{self.desc} {self.n}"
        tail = f" {self.postfix}" if self.postfix else ""
        self.file.write(f"\r{head} {rate:.1f} it/s{tail}")
        self.file.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.file.write("\n")
        self.file.flush()


def _make_bar(total: int | None, desc: str, file: IO[str] | None) -> Any:
    file = file if file is not None else sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc, file)
    return tqdm(total=total, desc=desc, file=file, dynamic_ncols=True, leave=True)


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "",
             disable: bool | None = None, file: IO[str] | None = None) -> Iterator[T]:
    """Iterate with a console progress bar (tqdm if installed, else a built-in one).

    Shown on rank 0 only when ``torch.distributed`` is initialised; ``disable=True`` hides
    it. ``total`` defaults to ``len(iterable)`` when it has one.
    """
    if disable is None:
        disable = _rank() != 0
    if disable:
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    bar = _make_bar(total, desc, file)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()


# --------------------------------------------------------------------------------------------
# GPU sampling
# --------------------------------------------------------------------------------------------


class GPUSampler:
    """Samples one GPU's utilisation, memory and power with pynvml in a daemon thread.

    ``samples`` holds ``(t, util_percent, memory_used_gib, power_w)`` tuples (``t`` in
    seconds since :meth:`start`; ``power_w`` ``None`` where unsupported). When pynvml or the
    driver is missing, :meth:`start` returns False and ``error`` says why.
    """

    def __init__(self, index: int | None = None, *, interval: float = 0.5) -> None:
        self.index = index
        self.interval = interval
        self.samples: list[tuple[float, float, float, float | None]] = []
        self.error: str | None = None
        self.name: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._t0 = 0.0

    def _handle(self, nvml: Any) -> Any:
        if self.index is None and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            try:  # NVML numbers GPUs differently from CUDA_VISIBLE_DEVICES: match by PCI id
                bus = (f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:"
                       f"{props.pci_device_id:02X}.0")
                return nvml.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:
                return nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return nvml.nvmlDeviceGetHandleByIndex(self.index or 0)

    def start(self, t0: float | None = None) -> bool:
        """Start sampling; False (with ``error`` set) when NVML is unavailable."""
        try:
            import pynvml
        except ImportError:
            self.error = "pynvml is not installed (pip install nvidia-ml-py)"
            return False
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            self.error = f"no NVIDIA driver (NVML: {exc})"
            return False
        try:
            handle = self._handle(pynvml)
            name = pynvml.nvmlDeviceGetName(handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as exc:
            self.error = f"NVML could not open the GPU: {exc}"
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return False
        self._nvml = pynvml
        self._t0 = time.perf_counter() if t0 is None else t0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(handle,), daemon=True,
                                        name="accelfn-gpu-sampler")
        self._thread.start()
        return True

    def _sample(self, handle: Any) -> None:
        nvml = self._nvml
        util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
        try:
            power: float | None = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:
            power = None
        self.samples.append((time.perf_counter() - self._t0, util, mem, power))

    def _run(self, handle: Any) -> None:
        while True:
            try:
                self._sample(handle)
            except Exception as exc:  # keep what we have, say why it stopped
                self.error = f"NVML sampling stopped: {exc}"
                return
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        """Stop the thread and shut NVML down."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


# --------------------------------------------------------------------------------------------
# Output sinks
# --------------------------------------------------------------------------------------------


def _open(path: str | Path) -> IO[str]:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return open(p, "w", newline="")


class _CsvSink:
    def __init__(self, path: str | Path) -> None:
        self.file = _open(path)
        self.writer: csv.DictWriter[str] | None = None
        self.warned = False

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if self.writer is None:
            fields = list(dict.fromkeys(k for r in rows for k in r))
            self.writer = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")
            self.writer.writeheader()
        extra = {k for r in rows for k in r} - set(self.writer.fieldnames)
        if extra and not self.warned:
            self.warned = True
            warnings.warn(f"Monitor CSV: new metric(s) {sorted(extra)} after the header was "
                          "written are only in the JSONL output", stacklevel=3)
        self.writer.writerows(rows)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.file = _open(path)

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.file.write(json.dumps(r) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _TensorBoardSink:
    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "Monitor(tensorboard=...) needs the tensorboard package: "
                "pip install 'accelfn[tensorboard]' (or leave tensorboard=None)") from exc
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            for k, v in r.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(f"accelfn/{k}", v, r["step"])

    def close(self, text: str | None = None) -> None:
        if text:
            self.writer.add_text("accelfn/report", f"```\n{text}\n```")
        self.writer.close()


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    """The seeds' checklist: data wait under 20% of an iteration, GPU busy over 85%.

    ``mfu_low`` is the MFU under which a busy GPU is called compute-inefficient.
    """

    data_wait_share: float = 0.20
    gpu_busy: float = 0.85
    mfu_low: float = 0.25


def _fmt_rate(x: float | None, unit: str) -> str:
    if x is None:
        return "n/a"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


@dataclass
class MonitorReport:
    """Summary of a monitored run; ``rows`` keeps every step's record for plots.

    Timing statistics skip the first ``warmup`` steps (compilation, cuDNN autotuning,
    worker start-up) and the probed step, unless nothing else is left.
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
    gpu_samples: list[tuple[float, float, float, float | None]] = field(
        default_factory=list, repr=False)

    def to_dict(self, *, rows: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (per-step rows and GPU samples only with ``rows=True``)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__
               if k not in ("rows", "gpu_samples", "findings", "syncs")}
        out["findings"] = [f.to_dict() for f in self.findings]
        out["syncs"] = None if self.syncs is None else [
            {"op": s.op, "location": s.location, "code": s.code, "via": s.via,
             "count": s.count} for s in self.syncs]
        if rows:
            out["rows"] = self.rows
            out["gpu_samples"] = self.gpu_samples
        return out

    def to_json(self, *, rows: bool = False, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(rows=rows), indent=indent, default=str)

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
            f"steps           {self.steps} ({self.measured_steps} measured), "
            f"wall {self.wall_s:.1f} s",
            f"step time       mean {ms(self.step_time_s)}, median "
            f"{ms(self.step_time_median_s)}, p90 {ms(self.step_time_p90_s)}",
            f"data wait       {ms(self.data_wait_s)} per step = {pct(self.data_wait_share)} "
            "of an iteration",
            f"throughput      {_fmt_rate(self.samples_per_s, 'samples/s')}"
            + (f", {_fmt_rate(self.tokens_per_s, 'tokens/s')}" if self.tokens_per_s else ""),
        ]
        if self.flops_per_step:
            peak = _fmt_rate(self.peak_flops, "FLOP/s") if self.peak_flops else "unknown peak"
            lines.append(f"compute         {_fmt_rate(self.flops_per_step, 'FLOP')}/step, "
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
        lines += ["", f"verdict: {self.verdict}", "", format_findings(self.findings)]
        return "\n".join(lines)

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Write a PNG of the run: throughput, data wait, memory (and GPU busy) per step.

        Needs matplotlib (``pip install 'accelfn[plot]'``); raises ``ImportError`` saying
        so when it is absent.
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("MonitorReport.plot needs matplotlib: "
                              "pip install 'accelfn[plot]'") from exc
        rows = self.rows
        if not rows:
            raise ValueError("MonitorReport.plot: no steps recorded")
        steps = [r["step"] for r in rows]
        has_gpu = bool(self.gpu_samples)
        n = 4 if has_gpu else 3
        fig = Figure(figsize=(9, 2.3 * n + 0.6), constrained_layout=True)
        FigureCanvasAgg(fig)
        axes = fig.subplots(n, 1, sharex=True)
        warm = [r["step"] for r in rows if r["step"] < self.warmup]
        probed = [r["step"] for r in rows if r.get("probed")]

        def shade(ax: Any) -> None:
            if warm:
                ax.axvspan(min(steps) - 0.5, max(warm) + 0.5, color="0.9", lw=0)
            for s in probed:
                ax.axvspan(s - 0.5, s + 0.5, color="#fde0c5", lw=0)

        ax = axes[0]
        shade(ax)
        if self.tokens_per_s:
            ax.plot(steps, [r.get("tokens_per_s") for r in rows], color="C0")
            ax.set_ylabel("tokens/s")
        else:
            ax.plot(steps, [r.get("samples_per_s") for r in rows], color="C0")
            ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        ax.set_title("throughput per step")
        ax = axes[1]
        shade(ax)
        ax.plot(steps, [1e3 * r["step_s"] for r in rows], color="C1", label="iteration")
        ax.plot(steps, [1e3 * r["data_wait_s"] for r in rows], color="C3", label="data wait")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"iteration time and data wait (share {100 * (self.data_wait_share or 0):.0f}"
                     f"%, target < {100 * Thresholds().data_wait_share:.0f}%)")
        ax.legend(loc="upper right", fontsize=8)
        ax = axes[2]
        shade(ax)
        mem = [r.get("mem_gib") for r in rows]
        ax.plot(steps, mem, color="C2", label="allocated" if self.device.startswith("cuda")
                else "resident (RSS)")
        if has_gpu:
            t_to_step = [(r["time_s"], r["step"]) for r in rows]
            gs = [_interp(t, t_to_step) for t, *_ in self.gpu_samples]
            ax.plot(gs, [s[2] for s in self.gpu_samples], color="C4", ls="--",
                    label="GPU used (nvml)")
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        ax.set_title("memory")
        ax.legend(loc="upper right", fontsize=8)
        if has_gpu:
            ax = axes[3]
            shade(ax)
            ax.plot(gs, [s[1] for s in self.gpu_samples], color="C5")
            ax.axhline(100 * Thresholds().gpu_busy, color="k", ls=":", lw=1)
            ax.set_ylim(0, 105)
            ax.set_ylabel("%")
            ax.set_title("GPU busy (pynvml)")
        axes[-1].set_xlabel("step (grey: warm-up, orange: sync probe; neither in the summary)")
        fig.suptitle(title or f"verdict: {self.verdict}", fontsize=10)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        return out


def _interp(t: float, pairs: list[tuple[float, int]]) -> float:
    """Step coordinate of time ``t`` from (time, step) pairs (boundary times)."""
    if not pairs:
        return 0.0
    if t <= pairs[0][0]:
        return pairs[0][1] - 1 + t / max(pairs[0][0], 1e-9)
    for (t0, s0), (t1, s1) in itertools.pairwise(pairs):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * (t - t0) / max(t1 - t0, 1e-9)
    return float(pairs[-1][1])


# --------------------------------------------------------------------------------------------
# The monitor
# --------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    step: int
    time_s: float
    iter_s: float
    data_wait_s: float
    samples: float | None
    tokens: float | None
    mem_gib: float | None
    event: Any
    prev_event: Any
    snaps: list[tuple[list[str], Tensor]]
    py_metrics: dict[str, float]
    probed: bool


class StepRecord:
    """Handed out by :meth:`Monitor.measure`; give it the step's metrics with :meth:`record`."""

    def __init__(self) -> None:
        self.metrics: Any = None
        self.samples: float | None = None
        self.tokens: float | None = None

    def record(self, metrics: Any = None, *, samples: float | None = None,
               tokens: float | None = None) -> None:
        """Attach the step's metrics (device tensors are fine) and its sample/token count."""
        self.metrics = metrics
        if samples is not None:
            self.samples = samples
        if tokens is not None:
            self.tokens = tokens


def _batch_samples(batch: Any) -> int | None:
    """Leading dimension of a batch (TensorDict batch size, first tensor of a mapping/tuple)."""
    bs = getattr(batch, "batch_size", None)
    if bs is not None and len(bs) > 0:
        return int(bs[0])
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values: Iterable[Any] = batch.values() if isinstance(batch, Mapping) else (
        batch if isinstance(batch, (tuple, list)) else ())
    for v in values:
        if isinstance(v, Tensor) and v.dim():
            return int(v.shape[0])
    return None


def _rss_gib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return None


class Monitor:
    """Measures a training loop and says what limits it. See the module docstring.

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
        progress: show a console progress bar (rank 0 only); ``desc`` labels it.
        jsonl / csv: files for one row per step (rank 0 only).
        tensorboard: a log dir for ``SummaryWriter`` (needs the ``tensorboard`` extra).
        plot: write :meth:`MonitorReport.plot` here when the monitor closes.
        samples_per_step / tokens_per_step: defaults when a step does not say.
        flops_per_step: FLOPs of one step (see :func:`training_flops`, :meth:`count_flops`).
        peak_flops: the device's peak FLOP/s; looked up by GPU name when not given.
        peak_dtype: which peak to look up (``torch.bfloat16``, ``"tf32"``, ...).
        device: the training device (default: CUDA when available).
        gpu_index: the NVML index to sample (default: the current CUDA device); sampling is
            on when a GPU is used or ``gpu_index`` is given, and pynvml works.
        gpu_interval: seconds between pynvml samples.
        sync_check_step: index of the step run under :class:`SyncProbe` (``None``: never);
            needs :meth:`iterate` or :meth:`measure`, and is left out of timing.
        sync_allow: substrings of sync locations you accept (see :class:`SyncProbe`).
        model: optional; checked for BatchNorm under distributed training (SyncBatchNorm).
        diagnostics: a :class:`Diagnostics` stepped with each step's metrics and batch.
        profiler: a :class:`Profiler` started with the monitor and stepped with each step.
        thresholds: the checklist's limits.
        file: stream for the progress bar (default ``sys.stderr``).
    """

    def __init__(self, *, log_every: int = 50, warmup: int = 2, total: int | None = None,
                 progress: bool = True, desc: str = "train",
                 jsonl: str | Path | None = None, csv: str | Path | None = None,
                 tensorboard: str | Path | None = None, plot: str | Path | None = None,
                 samples_per_step: float | None = None, tokens_per_step: float | None = None,
                 flops_per_step: float | None = None, peak_flops: float | None = None,
                 peak_dtype: torch.dtype | str = torch.bfloat16,
                 device: torch.device | str | None = None, gpu_index: int | None = None,
                 gpu_interval: float = 0.5, sync_check_step: int | None = 3,
                 sync_allow: Iterable[str] = (),
                 model: nn.Module | None = None, diagnostics: Diagnostics | None = None,
                 profiler: Profiler | None = None, thresholds: Thresholds | None = None,
                 file: IO[str] | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"Monitor(log_every={log_every}): must be >= 1")
        if warmup < 0:
            raise ValueError(f"Monitor(warmup={warmup}): must be >= 0")
        self.log_every, self.warmup, self.total = log_every, warmup, total
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.flops_per_step, self.peak_dtype = flops_per_step, peak_dtype
        self._peak_given = peak_flops
        self.device = torch.device(device if device is not None else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self._cuda = self.device.type == "cuda"
        self.sync_check_step = sync_check_step
        self.sync_allow = tuple(sync_allow)
        self.model, self.diagnostics, self.profiler = model, diagnostics, profiler
        self.thresholds = thresholds or Thresholds()
        self._main = _rank() == 0
        self._want_progress, self._desc, self._file = progress, desc, file
        self._paths = {"jsonl": jsonl, "csv": csv, "tensorboard": tensorboard}
        self._plot_path = plot
        self._gpu = GPUSampler(gpu_index, interval=gpu_interval) \
            if (self._cuda or gpu_index is not None) else None
        self._gpu_note: str | None = None if self._gpu else "no GPU in use"
        self.rows: list[dict[str, Any]] = []
        self._pending: deque[_Pending] = deque()
        self._sinks: list[Any] = []
        self._bar: Any = None
        self._started = False
        self._closed = False
        self._report: MonitorReport | None = None
        self._n = 0
        self._t0 = self._t_last = time.perf_counter()
        self._ev_last: Any = None
        self._wait_acc = 0.0
        self._awaiting_step = False
        self._in_iterate = 0
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
        self._started = True
        self._t0 = self._t_last = time.perf_counter()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._ev_last = torch.cuda.Event(enable_timing=True)
            self._ev_last.record(torch.cuda.current_stream(self.device))
        if self._gpu is not None and not self._gpu.start(self._t0):
            self._gpu_note = self._gpu.error
            self._gpu = None
        if self._main:
            if self._paths["jsonl"]:
                self._sinks.append(_JsonlSink(self._paths["jsonl"]))
            if self._paths["csv"]:
                self._sinks.append(_CsvSink(self._paths["csv"]))
            if self._paths["tensorboard"]:
                self._sinks.append(_TensorBoardSink(self._paths["tensorboard"]))
            if self._want_progress:
                self._bar = _make_bar(self.total, self._desc, self._file)
        if self.profiler is not None and self.profiler._prof is None and not self.profiler.done:
            self.profiler.start()
        return self

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close()

    def close(self) -> MonitorReport:
        """Flush everything (one device sync), stop threads, close outputs; return the report."""
        if self._closed:
            assert self._report is not None
            return self._report
        self._end_probe()
        self.flush(wait=True)
        if self._gpu is not None:
            self._gpu.stop()
        if self.profiler is not None:
            self.profiler.stop()
        self._closed = True
        report = self._build_report()
        self._report = report
        for sink in self._sinks:
            if isinstance(sink, _TensorBoardSink):
                sink.close(str(report))
            else:
                sink.close()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._plot_path is not None and self._main and report.rows:
            try:
                report.plot(self._plot_path)
            except ImportError as exc:
                warnings.warn(f"Monitor(plot=...): {exc}; no plot written", stacklevel=2)
        return report

    def report(self) -> MonitorReport:
        """The report so far (waits for outstanding device work); final after :meth:`close`."""
        if self._closed:
            assert self._report is not None
            return self._report
        self.flush(wait=True)
        return self._build_report()

    # -- feeding ------------------------------------------------------------------------------

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, timing each ``next()`` as data wait.

        Call :meth:`step` after each training step; if you do not, each batch counts as one
        step when the next one is asked for.
        """
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
                self._awaiting_step = True
                if self._n == self.sync_check_step and self._probe_step is None:
                    self._begin_probe()
                yield batch
        finally:
            self._in_iterate -= 1
            self._end_probe()

    @contextlib.contextmanager
    def measure(self, *, samples: float | None = None, tokens: float | None = None,
                data_wait: float | None = None) -> Iterator[StepRecord]:
        """Context manager around one training step; the time since the previous one is the
        data wait (unless under :meth:`iterate`, which times ``next()`` itself)."""
        self.start()
        outside = time.perf_counter() - self._t_last
        rec = StepRecord()
        rec.samples, rec.tokens = samples, tokens
        if self._n == self.sync_check_step and self._probe_step is None:
            self._begin_probe()
        try:
            yield rec
        except BaseException:
            self._end_probe()
            raise
        if data_wait is None and not self._in_iterate:
            data_wait = outside
        self.step(rec.metrics, samples=rec.samples, tokens=rec.tokens, data_wait=data_wait)

    @contextlib.contextmanager
    def probe_syncs(self) -> Iterator[SyncProbe]:
        """Run the enclosed step under :class:`SyncProbe`; its result goes into the report."""
        with SyncProbe(allow=self.sync_allow) as probe:
            yield probe
        self._probe_result = (self._probe_result or []) + probe.syncs
        self._probe_mode = probe.mode

    def _begin_probe(self) -> None:
        self._probe = SyncProbe(allow=self.sync_allow)
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
        """Set ``flops_per_step`` from one forward+backward of ``model(*inputs)``."""
        self.flops_per_step = training_flops(model, *inputs, loss_fn=loss_fn)
        return int(self.flops_per_step)

    def _snapshot(self, metrics: Any) -> tuple[list[tuple[list[str], Tensor]], dict[str, float]]:
        """Copy scalar metrics off the step without a host sync."""
        if metrics is None:
            return [], {}
        if isinstance(metrics, Tensor):
            metrics = {"loss": metrics}
        try:
            items = list(metrics.items(include_nested=True, leaves_only=True))
        except TypeError:
            items = list(metrics.items())
        groups: dict[torch.device, tuple[list[str], list[Tensor]]] = {}
        py: dict[str, float] = {}
        for k, v in items:
            key = ".".join(k) if isinstance(k, tuple) else str(k)
            if isinstance(v, Tensor):
                if v.numel() == 1:
                    keys, ts = groups.setdefault(v.device, ([], []))
                    keys.append(key)
                    ts.append(v.detach().reshape(()).float())
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                py[key] = float(v)
        snaps = []
        with torch.no_grad():
            for dev, (keys, ts) in groups.items():
                stacked = torch.stack(ts)
                if dev.type == "cpu":
                    snaps.append((keys, stacked))
                else:
                    host = torch.empty(stacked.shape, dtype=stacked.dtype,
                                       pin_memory=torch.cuda.is_available())
                    host.copy_(stacked, non_blocking=True)
                    snaps.append((keys, host))
        return snaps, py

    def step(self, metrics: Any = None, *, samples: float | None = None,
             tokens: float | None = None, data_wait: float | None = None) -> None:
        """Record the end of one training step. Never waits for the device.

        Args:
            metrics: what the step returned (TensorDict / mapping of scalar tensors, a loss
                tensor, or None); read later, every ``log_every`` steps.
            samples / tokens: how many this step processed (default: ``samples_per_step`` or
                the batch's leading dimension under :meth:`iterate`; ``tokens_per_step``).
            data_wait: seconds this step waited for data, e.g. ``loader.last_wait_s``
                (default: what :meth:`iterate` / :meth:`measure` measured).
        """
        probed = self._probe is not None
        self._end_probe()
        if not self._started:
            self.start()
        now = time.perf_counter()
        snaps, py = self._snapshot(metrics)
        event = None
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        if samples is None:
            samples = self.samples_per_step
            if samples is None and self._awaiting_step:
                samples = _batch_samples(self._last_batch)
        if tokens is None:
            tokens = self.tokens_per_step
        wait = self._wait_acc if data_wait is None else float(data_wait)
        mem = (torch.cuda.memory_allocated(self.device) / 2**30 if self._cuda else _rss_gib())
        self._pending.append(_Pending(
            step=self._n, time_s=now - self._t0, iter_s=now - self._t_last, data_wait_s=wait,
            samples=samples, tokens=tokens, mem_gib=mem, event=event, prev_event=self._ev_last,
            snaps=snaps, py_metrics=py, probed=probed or self._probe_step == self._n))
        if self.diagnostics is not None:
            self.diagnostics.step(metrics if isinstance(metrics, Mapping) or hasattr(
                metrics, "get") else None, self._last_batch if self._awaiting_step else None)
        if self.profiler is not None and not self.profiler.done:
            self.profiler.step()
        self._ev_last = event
        self._t_last = now
        self._wait_acc = 0.0
        self._awaiting_step = False
        self._n += 1
        if self._bar is not None:
            self._bar.update(1)
        if self._n % self.log_every == 0:
            self.flush()

    # -- reading ------------------------------------------------------------------------------

    def flush(self, *, wait: bool = False) -> None:
        """Read every completed step record and write it out.

        Records whose CUDA event has not completed stay pending (no sync), unless ``wait``,
        which synchronises the device once.
        """
        if wait and self._cuda and self._pending:
            torch.cuda.synchronize(self.device)
        new: list[dict[str, Any]] = []
        while self._pending:
            p = self._pending[0]
            if p.event is not None and not p.event.query():
                break
            self._pending.popleft()
            new.append(self._row(p))
        if not new:
            return
        self.rows.extend(new)
        for sink in self._sinks:
            sink.write(new)
        if self._bar is not None:
            last = new[-1]
            parts = [f"{k}={last[k]:.4g}" for k in ("loss",) if k in last]
            if last.get("samples_per_s"):
                parts.append(f"{last['samples_per_s']:.0f} samples/s")
            parts.append(f"wait {100 * last['data_share']:.0f}%")
            self._bar.set_postfix_str(" ".join(parts))

    def _row(self, p: _Pending) -> dict[str, Any]:
        step_s = p.iter_s
        if p.event is not None and p.prev_event is not None:
            step_s = p.prev_event.elapsed_time(p.event) / 1e3
        row: dict[str, Any] = {
            "step": p.step, "time_s": round(p.time_s, 6), "iter_s": p.iter_s,
            "step_s": step_s, "data_wait_s": p.data_wait_s,
            "data_share": p.data_wait_s / p.iter_s if p.iter_s > 0 else 0.0,
            "samples": p.samples, "tokens": p.tokens,
            "samples_per_s": p.samples / step_s if p.samples and step_s > 0 else None,
            "tokens_per_s": p.tokens / step_s if p.tokens and step_s > 0 else None,
            "mem_gib": p.mem_gib,
        }
        if p.probed:
            row["probed"] = True
        for keys, values in p.snaps:
            row.update(zip(keys, values.tolist()))
        row.update(p.py_metrics)
        return row

    # -- the verdict --------------------------------------------------------------------------

    def _device_name(self) -> str | None:
        if self._cuda:
            try:
                return torch.cuda.get_device_name(self.device)
            except Exception:
                return None
        if self._gpu is not None and self._gpu.name:
            return self._gpu.name
        return None

    def _build_report(self) -> MonitorReport:
        th = self.thresholds
        rows = self.rows
        sel = [r for r in rows if r["step"] >= self.warmup and not r.get("probed")]
        if not sel:
            sel = [r for r in rows if not r.get("probed")] or list(rows)
        n = len(sel)
        step_times = sorted(r["step_s"] for r in sel)
        total_step = sum(step_times)
        total_iter = sum(r["iter_s"] for r in sel)
        total_wait = sum(r["data_wait_s"] for r in sel)

        def q(x: float) -> float | None:
            return step_times[min(int(x * n), n - 1)] if n else None

        share = total_wait / total_iter if total_iter > 0 else None
        samples = [r["samples"] for r in sel if r["samples"]]
        tokens = [r["tokens"] for r in sel if r["tokens"]]
        sps = sum(samples) / total_step if samples and total_step > 0 else None
        tps = sum(tokens) / total_step if tokens and total_step > 0 else None
        name = self._device_name()
        peak = self._peak_given
        if peak is None and name is not None and (self._cuda or self._gpu is not None):
            peak = peak_flops(name, self.peak_dtype)
        mfu = (self.flops_per_step * n / total_step / peak
               if self.flops_per_step and peak and total_step > 0 else None)
        if self._cuda:
            peak_mem: float | None = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB
        samples_gpu = self._gpu.samples if self._gpu is not None else []
        gpu_note = self._gpu_note
        if self._gpu is not None and self._gpu.error:
            gpu_note = self._gpu.error
        gpu_util = gpu_mem = gpu_power = None
        if samples_gpu:
            t_from = sel[0]["time_s"] - sel[0]["iter_s"] if sel else 0.0
            window = [s for s in samples_gpu if s[0] >= t_from] or samples_gpu
            gpu_util = sum(s[1] for s in window) / len(window)
            gpu_mem = max(s[2] for s in window)
            powers = [s[3] for s in window if s[3] is not None]
            gpu_power = sum(powers) / len(powers) if powers else None
        elif gpu_note is None:
            gpu_note = "no samples yet (run longer than gpu_interval)"
        metric_keys = [k for k in dict.fromkeys(k for r in sel for k in r)
                       if k not in _ROW_KEYS]
        metrics = {}
        for k in metric_keys:
            vals = [r[k] for r in sel if isinstance(r.get(k), (int, float))]
            if vals:
                metrics[k] = sum(vals) / len(vals)
        findings, verdict = self._verdict(share, gpu_util, gpu_note, mfu, th)
        if self.diagnostics is not None:
            findings += self.diagnostics.report().findings
        return MonitorReport(
            steps=len(rows), measured_steps=n, warmup=self.warmup,
            wall_s=(rows[-1]["time_s"] if rows else 0.0), device=str(self.device),
            device_name=name, step_time_s=total_step / n if n else None,
            step_time_median_s=q(0.5), step_time_p90_s=q(0.9),
            data_wait_s=total_wait / n if n else None, data_wait_share=share,
            samples_per_s=sps, tokens_per_s=tps, flops_per_step=self.flops_per_step,
            peak_flops=peak, mfu=mfu, peak_memory_gib=peak_mem, gpu_util=gpu_util,
            gpu_memory_gib=gpu_mem, gpu_power_w=gpu_power, gpu_note=gpu_note,
            syncs=self._probe_result, metrics=metrics, findings=findings, verdict=verdict,
            rows=list(rows), gpu_samples=list(samples_gpu))

    def _verdict(self, share: float | None, gpu_util: float | None, gpu_note: str | None,
                 mfu: float | None, th: Thresholds) -> tuple[list[Finding], str]:
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
        syncs = self._probe_result
        if syncs is None:
            out.append(Finding("host_syncs", "info",
                               "no step was probed for host syncs",
                               "use Monitor.iterate/measure (sync_check_step probes one step) "
                               "or `with mon.probe_syncs(): step(state, batch)`"))
        elif syncs:
            for s in syncs:
                out.append(Finding("host_syncs", "warning", f"host sync: {s}", s.fix))
        else:
            out.append(Finding("host_syncs", "ok",
                               f"no host-device sync points in the probed step "
                               f"({self._probe_mode})"))
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
        if self.model is not None:
            out += [f for f in check_model(self.model) if f.check == "sync_batchnorm"]
        if share is None:
            verdict = "no steps measured"
        elif data_bound:
            verdict = (f"input-bound: the loop waits for data {100 * share:.0f}% of each "
                       "iteration")
        elif syncs:
            verdict = (f"sync-bound: {len(syncs)} host sync point(s) in the step stall the GPU"
                       if self._probe_mode == "cuda" else
                       f"sync-bound: {len(syncs)} host sync point(s) in the step would stall a "
                       "GPU (emulated probe)")
        elif gpu_low:
            verdict = f"GPU underused ({gpu_util:.0f}% busy): launch or CPU overhead"
        elif gpu_util is not None:
            verdict = f"compute-bound: GPU busy {gpu_util:.0f}%" + (
                f", MFU {100 * mfu:.0f}%" if mfu is not None else "")
        else:
            verdict = (f"compute-bound on {self.device.type}: data wait "
                       f"{100 * share:.0f}%, no host syncs found" if syncs is not None else
                       f"compute-bound on {self.device.type}: data wait {100 * share:.0f}%")
        return out, verdict


_ROW_KEYS = {"step", "time_s", "iter_s", "step_s", "data_wait_s", "data_share", "samples",
             "tokens", "samples_per_s", "tokens_per_s", "mem_gib", "probed"}
