"""Oversubscription: more compute threads than the machine has free cores.

torch runs each CPU operator on ``torch.get_num_threads()`` intra-op threads, by default one
per core. Several training processes on one machine (``torchrun --nproc_per_node=N``), or a
machine other work already loads, then run more busy threads than there are cores: the
threads wait on each other at every operator, and a step can take ten times longer than with
one thread per process. [`oversubscription`][] says whether that is the case and what to set
(``OMP_NUM_THREADS=1`` or ``torch.set_num_threads(k)``); ``accelfn doctor`` and the
[`Monitor`][accelfn.Monitor]'s verdict report it, and
[`default_threads`][] is the count ``accelfn bench`` uses unless told.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .findings import Finding

__all__ = ["CpuLoad", "cpu_load", "default_threads", "oversubscription"]


@dataclass(frozen=True)
class CpuLoad:
    """What the check reads: the cores this process may use, the processes of this job on
    this machine, torch's intra-op threads and the 1-minute load average (``None``: unknown)."""

    cores: int
    local_processes: int
    threads: int
    load: float | None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def cpu_load(*, threads: int | None = None, local_processes: int | None = None) -> CpuLoad:
    """The machine as it is now (``LOCAL_WORLD_SIZE`` from torchrun for the processes)."""
    try:
        load: float | None = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform
        load = None
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return CpuLoad(cores=min(usable_cores(), os.cpu_count() or 1),
                   local_processes=max(1, local_processes),
                   threads=torch.get_num_threads() if threads is None else threads,
                   load=load)


def free_cores(cpu: CpuLoad, *, own_load: float = 0.0) -> int:
    """Cores left for this job: the usable cores less the load of other work (``own_load``
    is the part of the load average this job itself makes, when it is running)."""
    other = max(0.0, (cpu.load or 0.0) - own_load)
    return max(1, math.floor(cpu.cores - other + 0.5))


def default_threads(local_processes: int = 1, cpu: CpuLoad | None = None) -> int:
    """Intra-op threads per process that keep ``threads x processes`` within the free cores
    (at least 1)."""
    cpu = cpu or cpu_load(local_processes=local_processes)
    return max(1, free_cores(cpu) // max(1, local_processes))


def oversubscription(cpu: CpuLoad | None = None, *, own_load: float = 0.0) -> Finding:
    """The ``threads`` finding: a warning when ``threads x local processes`` exceeds the free
    cores, or the load average exceeds the cores; ``ok`` otherwise.

    ``own_load`` is the load this job adds itself (a running training loop: its threads);
    ``accelfn doctor`` runs before training and leaves it 0.
    """
    cpu = cpu or cpu_load()
    free = free_cores(cpu, own_load=own_load)
    busy = cpu.threads * cpu.local_processes
    per_process = max(1, free // cpu.local_processes)
    procs = (f"{cpu.local_processes} processes x {cpu.threads} threads" if
             cpu.local_processes > 1 else
             f"{cpu.threads} torch thread{'s' if cpu.threads != 1 else ''}")
    load = f", load average {cpu.load:.1f}" if cpu.load is not None else ""
    fix = (f"OMP_NUM_THREADS={per_process} in the environment (torchrun sets 1 only when "
           f"it starts more than one process), or torch.set_num_threads({per_process}) at the "
           "start of the script: threads x processes within the free cores")
    if busy > free:
        return Finding(
            "threads", "warning",
            f"oversubscribed: {procs} on {free} free core(s) ({cpu.cores} usable{load}): "
            "the threads wait on each other at every operator; CPU steps can be many times "
            "slower", fix)
    if cpu.load is not None and cpu.load - own_load > cpu.cores:
        return Finding(
            "threads", "warning",
            f"oversubscribed: the load average {cpu.load:.1f} exceeds the {cpu.cores} "
            f"usable core(s): other work competes for the CPU, timings are slow and vary",
            fix + "; or run when the machine is less busy" if cpu.threads > per_process else
            f"{procs}: within the free cores already; run when the machine is less busy "
            "(timings taken now are not comparable with an idle machine's)")
    return Finding("threads", "ok", f"{procs} on {free} free core(s) ({cpu.cores} usable"
                   f"{load})")
