"""GPU utilisation, memory and power, sampled by pynvml in a background thread."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

__all__ = ["GPUSample", "GPUSampler", "check_interval"]

#: One sample: ``(t, util_percent, memory_used_gib, power_w)``, ``t`` in seconds since the
#: sampler started, ``power_w`` ``None`` where the GPU does not report it.
GPUSample = tuple[float, float, float, float | None]


def check_interval(call: str, interval: float) -> None:
    """Refuse a sampling interval that is not a positive number of seconds (0 would spin
    the sampler thread flat out, stealing a core from training)."""
    if not (isinstance(interval, (int, float)) and interval > 0):
        raise ValueError(f"{call}: give the time between pynvml samples in seconds > 0 "
                         "(default 0.5)")


class GPUSampler:
    """Samples one GPU's utilisation, memory and power with pynvml in a daemon thread.

    ``samples`` holds ``(t, util_percent, memory_used_gib, power_w)`` tuples (``t`` in
    seconds since :meth:`start`; ``power_w`` ``None`` where unsupported). When pynvml or the
    driver is missing, :meth:`start` returns False and ``error`` says why.
    """

    def __init__(self, index: int | None = None, *, interval: float = 0.5) -> None:
        check_interval(f"GPUSampler(interval={interval})", interval)
        self.index = index
        self.interval = interval
        self.samples: list[GPUSample] = []
        self.error: str | None = None
        self.name: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._t0 = 0.0

    def _handle(self, nvml: Any) -> Any:
        if self.index is None and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            try:  # NVML numbers GPUs differently from CUDA_VISIBLE_DEVICES: match by PCI id
                bus = (f"{props.pci_domain_id:08X}:"  # type: ignore[attr-defined]
                       f"{props.pci_bus_id:02X}:"  # type: ignore[attr-defined]
                       f"{props.pci_device_id:02X}.0")  # type: ignore[attr-defined]
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

    def rebase(self, t0: float) -> None:
        """Count sample times from ``t0`` (a ``time.perf_counter`` value) on, the samples
        taken so far included (earlier ones get negative times)."""
        with self._lock:
            shift = self._t0 - t0
            self._t0 = t0
            self.samples[:] = [(t + shift, u, m, p) for t, u, m, p in self.samples]

    def _sample(self, handle: Any) -> None:
        nvml = self._nvml
        util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
        try:
            power: float | None = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except Exception:
            power = None
        with self._lock:
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
