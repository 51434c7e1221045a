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

from ...core.syncs import deferred_read

__all__ = ["COUNT_KEYS", "ROW_KEYS", "PendingLog", "PendingStep", "StepRecord",
           "batch_samples", "boundary_event", "check_logged", "completed", "make_log_row",
           "make_row", "rss_gib", "snapshot_metrics"]

#: The fields of every row; anything else in a row is one of the step's metrics.
ROW_KEYS = {"step", "time_s", "iter_s", "step_s", "data_wait_s", "data_share", "samples",
            "tokens", "samples_per_s", "tokens_per_s", "mem_gib", "probed"}

#: The snapshot keys of a step's ``samples`` and ``tokens`` given as tensors (read with its
#: metrics, never on their own); no metric name holds a NUL.
COUNT_KEYS = {"samples": "\0samples", "tokens": "\0tokens"}


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


@dataclass
class PendingLog:
    """Values given to ``Monitor.log``, copied off the device but maybe not readable yet."""

    step: int
    event: torch.cuda.Event | None
    snaps: list[tuple[list[str], Tensor]]
    py_metrics: dict[str, float]


def check_logged(values: Any, step: int | None) -> None:
    """Refuse what ``Monitor.log(values, step)`` cannot log, before anything is recorded:
    a mapping (or TensorDict) of numbers and one-element tensors, nested mappings allowed,
    no name of a training row's own fields."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)
                             or step < 0):
        raise ValueError(f"Monitor.log(step={step!r}): a step is an int >= 0 (or None: the "
                         "step of the latest training row)")
    if isinstance(values, Tensor) or not (isinstance(values, Mapping) or hasattr(
            values, "items")):
        raise TypeError(f"Monitor.log({type(values).__name__}): give a mapping of names to "
                        "numbers, e.g. mon.log({'val_loss': loss}) (a scalar tensor is fine)")
    try:
        items = list(values.items(include_nested=True, leaves_only=True))
    except TypeError:
        items = list(values.items())
    while items:
        k, v = items.pop(0)
        key = ".".join(k) if isinstance(k, tuple) else str(k)
        if isinstance(v, Mapping):
            items[:0] = [(f"{key}.{k2}", v2) for k2, v2 in v.items()]
            continue
        if key in ROW_KEYS:
            raise ValueError(f"Monitor.log: {key!r} is a field of the training rows; log the "
                             f"value under another name (e.g. 'val_{key}')")
        if isinstance(v, Tensor):
            _one_number(f"value {key!r}", v)
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"Monitor.log: {key!r} is {type(v).__name__}, not a number: log "
                            "ints, floats or one-element tensors")


def make_log_row(p: PendingLog) -> dict[str, Any]:
    """The row of logged values (their copies readable): ``{"step": ..., name: value}``."""
    row: dict[str, Any] = {"step": p.step}
    with deferred_read():  # host copies whose event completed: no device wait
        for keys, snap in p.snaps:
            row.update(zip(keys, snap.tolist()))
    row.update(p.py_metrics)
    return row


def boundary_event(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream (a step boundary)."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch
    event.record(torch.cuda.current_stream(device))
    return event


def completed(event: torch.cuda.Event) -> bool:
    """Whether the device has passed ``event`` (asks, never waits)."""
    return bool(event.query())  # type: ignore[no-untyped-call]  # unannotated in torch


class StepRecord:
    """Handed out by :meth:`~accelfn.observe.monitor.Monitor.measure`; give it the step's
    metrics with :meth:`record`."""

    def __init__(self) -> None:
        self.metrics: Any = None
        self.samples: float | Tensor | None = None
        self.tokens: float | Tensor | None = None

    def record(self, metrics: Any = None, *, samples: float | Tensor | None = None,
               tokens: float | Tensor | None = None) -> None:
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


def _one_number(what: str, v: Tensor) -> Tensor:
    """``v`` as a 0-d tensor, or a ``ValueError`` saying why it is not one number."""
    if v.numel() != 1 or v.is_complex():
        kind = "a complex tensor" if v.is_complex() else "a tensor"
        raise ValueError(
            f"Monitor: {what} is {kind} of shape {list(v.shape)}, not one number: "
            "reduce it on the device first (e.g. .mean() or .sum()), or leave it out")
    return v.detach().reshape(())


def weight_of(metrics: Any) -> float | Tensor | None:
    """The ``"weight"`` of a step's metrics (its token count), or None: a one-element
    tensor (read later, with the metrics) or a Python number."""
    if metrics is None or isinstance(metrics, Tensor):
        return None
    try:
        weight = metrics.get("weight")
    except (AttributeError, TypeError):
        return None
    if isinstance(weight, Tensor) and weight.numel() == 1:
        return weight
    if isinstance(weight, numbers.Real) and not isinstance(weight, bool):
        return float(weight)
    return None


def snapshot_metrics(metrics: Any, counts: Mapping[str, Any] | None = None,
                     ) -> tuple[list[tuple[list[str], Tensor]], dict[str, float]]:
    """Copy a step's scalar metrics off the device without a host sync.

    Scalar tensors are stacked per device and copied to (pinned) host memory with
    ``non_blocking=True``; Python and numpy numbers are kept as they are. Nested mappings
    (and nested TensorDicts) give one metric per leaf, named ``"outer.inner"``. A device's
    metrics are stacked in ``float32``, or in ``float64`` when one of them is ``float64``,
    ``int32`` or ``int64`` (so that a count of 2**24 + 1 tokens keeps its last digit). A
    tensor of more than one element is refused (``ValueError``). ``counts`` (the step's
    ``samples`` and ``tokens``, when tensors) go with them under their own keys. Read the
    copies only once the step's boundary event has completed.
    """
    items: list[tuple[Any, Any]] = []
    if isinstance(metrics, Tensor):
        metrics = {"loss": metrics}
    if metrics is not None:
        try:
            items = list(metrics.items(include_nested=True, leaves_only=True))
        except TypeError:
            items = list(metrics.items())
    groups: dict[torch.device, tuple[list[str], list[Tensor]]] = {}
    py: dict[str, float] = {}

    def add(key: str, v: Tensor) -> None:
        keys, ts = groups.setdefault(v.device, ([], []))
        keys.append(key)
        wide = v.dtype in (torch.int32, torch.int64) and v.device.type != "mps"  # no f64
        # float32 and float64 as they are: the stack promotes to float64 when one is
        ts.append(v if v.dtype in (torch.float32, torch.float64) else
                  v.double() if wide else v.float())

    while items:
        k, v = items.pop(0)
        key = ".".join(k) if isinstance(k, tuple) else str(k)
        if isinstance(v, Tensor):
            add(key, _one_number(f"metric {key!r}", v))
        elif isinstance(v, Mapping):  # a nested dict: its leaves as "outer.inner"
            items[:0] = [(f"{key}.{k2}", v2) for k2, v2 in v.items()]
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            py[key] = float(v)
    for key, v in (counts or {}).items():
        if isinstance(v, Tensor):
            add(COUNT_KEYS[key], _one_number(f"{key}=...", v))
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
    values: dict[str, Any] = {}
    with deferred_read():  # host copies whose event completed: no device wait
        for keys, snap in p.snaps:
            values.update(zip(keys, snap.tolist()))
    counts = {k: values.pop(COUNT_KEYS[k]) for k in COUNT_KEYS if COUNT_KEYS[k] in values}
    samples, tokens = counts.get("samples", p.samples), counts.get("tokens", p.tokens)
    row: dict[str, Any] = {
        "step": p.step, "time_s": round(p.time_s, 6), "iter_s": p.iter_s,
        "step_s": step_s, "data_wait_s": p.data_wait_s,
        "data_share": p.data_wait_s / p.iter_s if p.iter_s > 0 else 0.0,
        "samples": samples, "tokens": tokens,
        "samples_per_s": samples / step_s if samples and step_s > 0 else None,
        "tokens_per_s": tokens / step_s if tokens and step_s > 0 else None,
        "mem_gib": p.mem_gib,
    }
    if p.probed:
        row["probed"] = True
    row.update(values)
    row.update(p.py_metrics)
    return row
