"""The monitor's grouped options: how it counts a step's work ([`Throughput`][]), which GPU
it samples and how often ([`GPUSampling`][]), and which step it probes for host syncs
([`SyncCheck`][]). Each is a frozen value checked when it is built, before a monitor starts.

``Monitor(csv=..., samples_per_step=..., gpu_index=..., sync_check_step=...)``, the flat form
of earlier versions, is refused with the grouped form to write instead
([`check_grouped`][]).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..flops import _dtype_key
from .gpu_sampler import check_interval

__all__ = ["GPUSampling", "SyncCheck", "Throughput", "check_grouped"]


def _check_count(owner: str, name: str, value: object, *, low: float = 0.0) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or math.isinf(value) or value <= low:
        raise ValueError(f"{owner}({name}={value!r}): must be a finite number > {low:g} "
                         f"(or None)")


@dataclass(frozen=True, slots=True)
class Throughput:
    """How [`Monitor`][accelfn.Monitor] counts a step's work, for samples/s, tokens/s and MFU.

    ``samples_per_step`` / ``tokens_per_step``: samples and tokens in one step, when the step
    does not say (``mon.step(samples=...)``, a batch's leading dimension under ``iterate``,
    the ``"weight"`` a step returns). ``flops_per_step``: FLOPs of one step (see
    [`training_flops`][accelfn.training_flops]; ``Monitor.count_flops`` sets it).
    ``peak_flops``: the device's peak FLOP/s, looked up by GPU name and ``peak_dtype``
    (``torch.bfloat16``, ``"tf32"``, ...) when not given. Numbers are finite and > 0.
    """

    samples_per_step: float | None = None
    tokens_per_step: float | None = None
    flops_per_step: float | None = None
    peak_flops: float | None = None
    peak_dtype: torch.dtype | str = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("samples_per_step", "tokens_per_step", "flops_per_step", "peak_flops"):
            _check_count("Throughput", name, getattr(self, name))
        if not isinstance(self.peak_dtype, torch.dtype):
            _dtype_key(self.peak_dtype)  # an unknown name raises here, not as a missing MFU


@dataclass(frozen=True, slots=True)
class GPUSampling:
    """Which GPU [`Monitor`][accelfn.Monitor] samples with pynvml, and how often.

    ``index``: the NVML index (default: the current CUDA device); sampling is on when the
    monitor's device is a GPU or ``index`` is given, and pynvml works. ``interval``: seconds
    between samples, in a background thread.
    """

    index: int | None = None
    interval: float = 0.5

    def __post_init__(self) -> None:
        if self.index is not None and (isinstance(self.index, bool)
                                       or not isinstance(self.index, int) or self.index < 0):
            raise ValueError(f"GPUSampling(index={self.index!r}): an NVML device index >= 0 "
                             "(or None: the current CUDA device)")
        check_interval(f"GPUSampling(interval={self.interval!r})", self.interval)


@dataclass(frozen=True, slots=True)
class SyncCheck:
    """Which step [`Monitor`][accelfn.Monitor] runs under [`SyncProbe`][accelfn.SyncProbe],
    the host syncs it found going into the report (``Monitor(sync_check=None)``: none).

    ``step``: the index of the probed step (0: the first), left out of the timing; needs
    ``Monitor.iterate`` or ``Monitor.measure``. ``allow``: substrings of sync locations you
    accept (see [`SyncProbe`][accelfn.SyncProbe]).
    """

    step: int = 3
    allow: Sequence[str] = ()

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"SyncCheck(step={self.step!r}): a step index >= 0 (to probe no "
                             "step, pass Monitor(sync_check=None))")
        if isinstance(self.allow, str):
            raise TypeError(f"SyncCheck(allow={self.allow!r}): a list of substrings, e.g. "
                            f"allow=[{self.allow!r}]")
        object.__setattr__(self, "allow", tuple(self.allow))


# each keyword of the flat form, and what it is now
_MOVED = {
    "jsonl": "sinks=[af.JsonlSink({})]", "csv": "sinks=[af.CsvSink({})]",
    "tensorboard": "sinks=[af.TensorBoardSink({})]",
    **{name: f"throughput=af.Throughput({name}={{}})" for name in (
        "samples_per_step", "tokens_per_step", "flops_per_step", "peak_flops", "peak_dtype")},
    "gpu_index": "gpu=af.GPUSampling(index={})",
    "gpu_interval": "gpu=af.GPUSampling(interval={})",
    "sync_check_step": "sync_check=af.SyncCheck(step={})",
    "sync_allow": "sync_check=af.SyncCheck(allow={})",
}


def check_grouped(removed: Mapping[str, object], **grouped: object) -> None:
    """Raise what ``Monitor(**removed, **grouped)`` is wrong in, before anything starts: a
    keyword of the flat form (``removed``) named with the grouped form that replaced it
    (``Monitor(csv=...) is now Monitor(sinks=[af.CsvSink(...)])``); a grouped option
    (``throughput``, ``gpu``, ``sync_check``) of another type than its class."""
    lines = []
    for name, value in removed.items():
        if name not in _MOVED:
            lines.append(f"Monitor() got an unexpected keyword argument {name!r}")
        elif name == "sync_check_step" and value is None:
            lines.append("Monitor(sync_check_step=None) is now Monitor(sync_check=None)")
        else:
            lines.append(f"Monitor({name}=...) is now Monitor({_MOVED[name].format('...')})")
    if lines:
        raise TypeError("; ".join(lines))
    kinds = {"throughput": Throughput, "gpu": GPUSampling, "sync_check": SyncCheck}
    for name, value in grouped.items():
        if not isinstance(value, kinds[name]) and not (value is None and name == "sync_check"):
            raise TypeError(f"Monitor({name}=...) takes an af.{kinds[name].__name__}(...), "
                            f"not {type(value).__name__}")
