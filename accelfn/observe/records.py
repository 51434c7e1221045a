"""The monitor's per-step records: what one step leaves behind until it can be read.

:func:`snapshot_metrics` copies a step's metrics off the device without a sync; a
:class:`PendingStep` holds them with the step's times and boundary event; :func:`make_row`
reads it into a row once the event has completed.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ROW_KEYS", "PendingStep", "StepRecord", "batch_samples", "make_row", "rss_gib",
           "snapshot_metrics"]

#: The fields of every row; anything else in a row is one of the step's metrics.
ROW_KEYS = {"step", "time_s", "iter_s", "step_s", "data_wait_s", "data_share", "samples",
            "tokens", "samples_per_s", "tokens_per_s", "mem_gib", "probed"}


@dataclass
class PendingStep:
    """A step recorded but not read yet: its CUDA event may still be pending."""

    step: int
    time_s: float
    iter_s: float
    data_wait_s: float
    samples: float | None
    tokens: float | None
    mem_gib: float | None
    event: torch.cuda.Event | None
    prev_event: torch.cuda.Event | None
    snaps: list[tuple[list[str], Tensor]]
    py_metrics: dict[str, float]
    probed: bool


class StepRecord:
    """Handed out by :meth:`~accelfn.observe.monitor.Monitor.measure`; give it the step's
    metrics with :meth:`record`."""

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


def batch_samples(batch: Any) -> int | None:
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


def rss_gib() -> float | None:
    """The resident memory of this process in GiB (Linux), else ``None``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return None


def snapshot_metrics(metrics: Any) -> tuple[list[tuple[list[str], Tensor]], dict[str, float]]:
    """Copy a step's scalar metrics off the device without a host sync.

    Scalar tensors are stacked per device and copied to (pinned) host memory with
    ``non_blocking=True``; Python and numpy numbers are kept as they are. Nested mappings
    (and nested TensorDicts) give one metric per leaf, named ``"outer.inner"``. Read the
    copies only once the step's boundary event has completed.
    """
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
    while items:
        k, v = items.pop(0)
        key = ".".join(k) if isinstance(k, tuple) else str(k)
        if isinstance(v, Tensor):
            if v.numel() == 1:
                keys, ts = groups.setdefault(v.device, ([], []))
                keys.append(key)
                ts.append(v.detach().reshape(()).float())
        elif isinstance(v, Mapping):  # a nested dict: its leaves as "outer.inner"
            items[:0] = [(f"{key}.{k2}", v2) for k2, v2 in v.items()]
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
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


def make_row(p: PendingStep) -> dict[str, Any]:
    """The row of a completed step (its boundary event, if any, has completed)."""
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
