"""Timing and memory primitives: what a benchmark measures with, not what it measures.

    device = resolve_device("auto")             # the first CUDA GPU, else the CPU
    timing = time_steps(one, warmup=3, steps=20, device=device)   # first call timed alone
    hand, ours = interleaved([hand_step, our_step], steps=50, device=device)  # per-call s
    with SavedActivations(model) as acts:       # bytes autograd keeps for the backward
        loss_fn(model, batch).backward()
    machine = environment(device)              # date, CPU, load, versions, device

``interleaved`` rotates which side goes first at every step, so that slow drifts of the
machine hit all sides alike; on CUDA every call is followed by a synchronisation, so that its
time is its own. :class:`PeakMemory` reads the CUDA allocator's peak; :class:`SavedActivations`
counts what autograd saves on any device. Used by ``accelfn bench`` and ``benchmarks/``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import os
import platform
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "PeakMemory",
    "SavedActivations",
    "StepTiming",
    "environment",
    "interleaved",
    "resolve_device",
    "state_mib",
    "sync",
    "time_steps",
]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` is the first CUDA GPU when there is one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} but CUDA is not available; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """The machine a measurement came from: date, host CPU, cores, load, versions, device."""
    dev = resolve_device("auto" if device is None else device)
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(dev),
        "device_name": _cpu_name(),
    }
    with contextlib.suppress(OSError, AttributeError):
        env["load_average"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(Exception):
        import torchvision  # type: ignore[import-untyped]  # ships no py.typed

        env["torchvision"] = torchvision.__version__
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        env["accelfn"] = importlib.metadata.version("accelfn")
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            device_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),  # type: ignore[no-untyped-call]
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return env


class PeakMemory:
    """Peak CUDA memory while the block runs, in MiB (``torch.cuda.max_memory_allocated``
    after resetting the peak); ``peak_mib`` stays ``None`` on other devices, where PyTorch
    keeps no allocator statistics (see :class:`SavedActivations` for a measure that works
    everywhere)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mib: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20


class _Packed:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivations:
    """Peak bytes of the tensors autograd holds for the backward pass while the block runs.

    Counted with ``torch.autograd.graph.saved_tensors_hooks``: a storage counts from the
    moment a tensor of it is saved until autograd releases the last tensor saved from it
    (after its backward), once however many tensors share it. The storages of ``exclude``
    (the model's parameters and buffers, in memory anyway) are left out. ``bytes`` is the
    peak of that live total: the activation memory that AMP halves, that activation
    checkpointing trades for recomputation and that micro-batching divides. Exact on any
    device; what checkpointing recomputes during the backward is not saved, so not counted.
    """

    def __init__(self, exclude: nn.Module | None = None) -> None:
        self._skip: set[int] = set()
        if exclude is not None:
            for t in [*exclude.parameters(), *exclude.buffers()]:
                self._skip.add(t.untyped_storage().data_ptr())
        self._live: dict[tuple[str, int], list[int]] = {}  # key -> [references, bytes]
        self._total = 0
        self._hooks: Any = None
        self.bytes = 0

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._total -= entry[1]
            del self._live[key]

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        ptr = storage.data_ptr()
        if ptr in self._skip:
            return t
        key = (str(t.device), ptr)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, storage.nbytes()]
            self._total += entry[1]
            self.bytes = max(self.bytes, self._total)
        entry[0] += 1
        packed = _Packed(t)
        weakref.finalize(packed, self._release, key)
        return packed

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed

    @property
    def mib(self) -> float:
        """The peak counted, in MiB."""
        return self.bytes / 2**20

    def __enter__(self) -> SavedActivations:
        self._live.clear()
        self._total = self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def state_mib(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> float:
    """Memory of the model's parameters and buffers and the optimizer's state, in MiB."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def interleaved(fns: Sequence[Callable[[], Any]], steps: int,
                device: torch.device | None = None) -> list[list[float]]:
    """Per-call seconds of each of ``fns``, called in turn ``steps`` times, rotating which goes
    first at every step (so slow drifts of the machine hit all sides alike). On CUDA the device
    is synchronised before the first call and after each one, so that its time is its own."""
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    k = len(fns)
    if device is not None:
        sync(device)  # work queued before (set-up, an earlier measurement) is no call's time
    for i in range(steps):
        for j in range(k):
            idx = (i + j) % k
            t0 = clock()
            fns[idx]()
            if device is not None:
                sync(device)
            times[idx].append(clock() - t0)
    return times


@dataclass
class StepTiming:
    """What :func:`time_steps` measured."""

    first_s: float  # the first call alone (compilation, autotuning, lazy initialisation)
    elapsed_s: float  # the ``steps`` timed calls together
    per_step_s: list[float]  # each timed call (on the CPU only: no queue to drain)
    peak_mib: float | None  # peak CUDA memory over all calls (None on the CPU)


def time_steps(one: Callable[[], Any], *, warmup: int, steps: int,
               device: torch.device) -> StepTiming:
    """Call ``one`` ``warmup`` times (the first timed alone), then time ``steps`` calls.

    Both must be at least 1: the first call is always the warm-up one.
    """
    if warmup < 1 or steps < 1:
        raise ValueError(f"time_steps(warmup={warmup}, steps={steps}): both must be >= 1 "
                         "(the first call is timed on its own as the warm-up)")
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        one()
        sync(device)
        first = time.perf_counter() - t0
        for _ in range(warmup - 1):
            one()
        sync(device)
        per_step: list[float] = []
        t0 = last = time.perf_counter()
        for _ in range(steps):
            one()
            if device.type == "cpu":
                now = time.perf_counter()
                per_step.append(now - last)
                last = now
        sync(device)
        elapsed = time.perf_counter() - t0
    return StepTiming(first, elapsed, per_step, mem.peak_mib)

