"""Oversubscription: more intra-op threads than free cores, or a load above the cores, is
named by doctor and by the monitor's verdict with the fix (the load faked)."""

from __future__ import annotations

import pytest
import torch
from machine import idle_machine, loaded  # noqa: F401  (autouse: an idle machine)

from accelfn.observe.environment import doctor
from accelfn.observe.monitor import Monitor
from accelfn.observe.threads import CpuLoad, default_threads, oversubscription


def threads_finding(report: object) -> object:
    (found,) = [f for f in report.findings if f.check == "threads"]  # type: ignore[attr-defined]
    return found


def test_threads_times_processes_beyond_the_free_cores() -> None:
    busy = oversubscription(CpuLoad(cores=2, local_processes=2, threads=2, load=0.0))
    assert busy.severity == "warning"
    assert busy.message.startswith("oversubscribed: 2 processes x 2 threads on 2 free core(s)")
    assert "OMP_NUM_THREADS=1" in (busy.fix or "")
    assert "torch.set_num_threads(1)" in (busy.fix or "")
    fits = oversubscription(CpuLoad(cores=4, local_processes=2, threads=2, load=0.0))
    assert fits.severity == "ok"


def test_a_load_above_the_cores_is_oversubscription_even_with_one_thread() -> None:
    found = oversubscription(CpuLoad(cores=2, local_processes=1, threads=1, load=10.0))
    assert found.severity == "warning"
    assert "load average 10.0 exceeds the 2 usable core(s)" in found.message
    assert "1 torch thread: within the free cores already" in (found.fix or "")
    found = oversubscription(CpuLoad(cores=4, local_processes=1, threads=2, load=4.5),
                             own_load=0.0)
    assert found.severity == "warning" and "2 torch threads on" in found.message
    assert "OMP_NUM_THREADS=1" in (found.fix or "")
    # 8 threads on a box whose other work leaves one core: the threads are the problem
    found = oversubscription(CpuLoad(cores=8, local_processes=1, threads=8, load=7.0))
    assert found.severity == "warning" and "on 1 free core(s)" in found.message
    # the load a running loop makes itself is no other work
    own = oversubscription(CpuLoad(cores=8, local_processes=1, threads=4, load=4.0),
                           own_load=4.0)
    assert own.severity == "ok"


def test_default_threads_share_the_free_cores() -> None:
    assert default_threads(1, CpuLoad(cores=16, local_processes=1, threads=16, load=0.0)) == 16
    assert default_threads(4, CpuLoad(cores=16, local_processes=4, threads=16, load=0.0)) == 4
    assert default_threads(1, CpuLoad(cores=2, local_processes=1, threads=2, load=9.0)) == 1
    assert default_threads(2, CpuLoad(cores=16, local_processes=2, threads=16, load=8.0)) == 4


def test_doctor_names_oversubscription_on_a_loaded_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loaded(monkeypatch, load=14.0, cores=2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    report = doctor()
    found = threads_finding(report)
    assert found.severity == "warning"  # type: ignore[attr-defined]
    assert "oversubscribed" in found.message  # type: ignore[attr-defined]
    assert "OMP_NUM_THREADS=1" in found.fix  # type: ignore[attr-defined]
    assert report.cpu["load_average"] == 14.0 and "oversubscribed" in str(report)
    loaded(monkeypatch, load=0.2, cores=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two torchrun processes of 2 threads
    found = threads_finding(doctor())
    assert found.severity == "warning"  # type: ignore[attr-defined]
    assert "2 processes x 2 threads on 2 free core(s)" in found.message  # type: ignore[attr-defined]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert threads_finding(doctor()).severity == "ok"  # type: ignore[attr-defined]


def run_cpu_monitor() -> Monitor:
    mon = Monitor(progress=False, sync_check=None, warmup=0, device="cpu")
    with mon:
        for i in range(3):
            mon.step({"loss": torch.tensor(float(i))}, samples=4, data_wait=0.0)
    return mon


def test_the_monitor_verdict_names_an_oversubscribed_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_cpu_monitor().report().verdict.startswith("compute-bound on cpu")
    loaded(monkeypatch, load=14.0, cores=2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # torch's default on 2 cores
    report = run_cpu_monitor().report()
    assert report.verdict.startswith("CPU oversubscribed: 2 torch threads on 1 free core(s)")
    assert "OMP_NUM_THREADS" in (threads_finding(report).fix or "")  # type: ignore[attr-defined]
