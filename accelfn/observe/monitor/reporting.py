"""The monitor's report assembled: what it measured (the rows' running summary, the GPU
samples, the probed syncs) with what it looks up at the end (the device's name and peak
FLOP/s, peak memory, the model's and the diagnostics' findings, CPU oversubscription)."""

from __future__ import annotations

import resource

import torch
from torch import nn

from ...core.processes import world_size
from ..diagnostics import Diagnostics
from ..findings import Finding
from ..flops import peak_flops
from ..initialisation import check_model
from ..memory_snapshots import MemorySnapshot
from ..sync_probe import SyncPoint
from ..threads import cpu_load, oversubscription
from .aggregates import RunBook
from .gpu_sampler import GPUSampler
from .options import Throughput
from .report import MonitorReport, Thresholds
from .verdict import summarise

__all__ = ["build_report", "device_name"]


def device_name(device: torch.device, gpu: GPUSampler | None) -> str | None:
    """The training device's name: CUDA's, else what NVML sampled, else ``None``."""
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except Exception:
            return None
    if gpu is not None and gpu.name:
        return gpu.name
    return None


def build_report(*, book: RunBook, warmup: int, device: torch.device,
                 gpu: GPUSampler | None, gpu_note: str | None, throughput: Throughput,
                 model: nn.Module | None, diagnostics: Diagnostics | None,
                 syncs: list[SyncPoint] | None, probe_mode: str | None, sync_check: bool,
                 thresholds: Thresholds, snapshot: MemorySnapshot | None = None
                 ) -> MonitorReport:
    """The [`MonitorReport`][] of a monitor's run so far (with what a memory snapshot found,
    its estimate and where a dump went, last)."""
    cuda = device.type == "cuda"
    name = device_name(device, gpu)
    peak = throughput.peak_flops
    if peak is None and name is not None and (cuda or gpu is not None):
        peak = peak_flops(name, throughput.peak_dtype)
    if cuda:
        peak_mem: float | None = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB
    if gpu is not None and gpu.error:
        gpu_note = gpu.error
    more: list[Finding] = []
    if model is not None:
        more += [f for f in check_model(model) if f.check == "sync_batchnorm"]
    if diagnostics is not None:
        more += diagnostics.report().findings
    threads = None
    if device.type == "cpu":  # a loaded CPU, not the model, may be what limits the run
        cpu = cpu_load()
        threads = oversubscription(cpu, own_load=cpu.threads * cpu.local_processes)
    report = summarise(
        book.summary, warmup=warmup, device=device, device_name=name,
        flops_per_step=throughput.flops_per_step, peak=peak, peak_memory_gib=peak_mem,
        gpu_samples=gpu.samples if gpu is not None else [], gpu_note=gpu_note, syncs=syncs,
        probe_mode=probe_mode, sync_check=sync_check, th=thresholds, more_findings=more,
        history=book.history, logged=book.logged, last_logged=book.last_logged,
        threads=threads, processes=world_size())
    if snapshot is not None:
        report.findings += snapshot.findings()
    return report
