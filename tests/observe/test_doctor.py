"""accelfn doctor: with and without pynvml, with faked drivers, and the CLI."""

from __future__ import annotations

import importlib
import json
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from accelfn.cli import main as cli
from accelfn.observe.environment import GPUInfo, doctor

# the module that defines doctor()
doctor_mod = importlib.import_module("accelfn.observe.environment")


def fake_pynvml(*, cuda: int = 12040, driver: str = "550.54.15",
                gpus: tuple[tuple[str, int, tuple[int, int]], ...] = (
                    ("NVIDIA H100 80GB HBM3", 80, (9, 0)),),
                fail_init: bool = False, util: int = 50) -> types.ModuleType:
    """A stand-in ``pynvml`` module answering like a machine with ``gpus``."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.calls = {"init": 0, "shutdown": 0}  # type: ignore[attr-defined]

    def init() -> None:
        if fail_init:
            raise NVMLError("Driver Not Loaded")
        m.calls["init"] += 1  # type: ignore[attr-defined]

    def shutdown() -> None:
        m.calls["shutdown"] += 1  # type: ignore[attr-defined]

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    m.nvmlSystemGetDriverVersion = lambda: driver.encode()  # type: ignore[attr-defined]
    m.nvmlSystemGetCudaDriverVersion = lambda: cuda  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: len(gpus)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByPciBusId = lambda bus: 0  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: gpus[h][0]  # type: ignore[attr-defined]
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(  # type: ignore[attr-defined]
        total=gpus[h][1] * 2**30, used=gpus[h][1] * 2**28, free=0)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: gpus[h][2]  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(  # type: ignore[attr-defined]
        gpu=util, memory=10)
    m.nvmlDeviceGetPowerUsage = lambda h: 300_000  # type: ignore[attr-defined]
    return m


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch was built with CUDA 13.0 and sees no GPU, whatever machine runs this."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _by_check(report: Any, check: str) -> list:
    return [f for f in report.findings if f.check == check]


def test_without_pynvml_says_so_and_still_reports(monkeypatch: pytest.MonkeyPatch,
                                                  no_gpu: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    report = doctor()
    assert report.driver == {"error": "pynvml is not installed (pip install nvidia-ml-py)"}
    (driver,) = _by_check(report, "driver")
    assert "pip install nvidia-ml-py" in (driver.fix or "")
    assert report.gpus == []
    assert report.versions["torch"] == torch.__version__
    assert set(report.versions) >= {"python", "torch", "torchvision", "tensordict",
                                    "torchdata", "numpy"}
    assert report.cuda["built_with"] == "13.0" and report.cuda["available"] is False
    (unavail,) = _by_check(report, "cuda_unavailable")
    assert unavail.severity == "warning" and "runs on the CPU" in unavail.message
    assert report.ok
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["findings"]
    text = str(report)
    assert "gpus:     none visible" in text and "pynvml is not installed" in text


def test_driver_missing(monkeypatch: pytest.MonkeyPatch, no_gpu: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_init=True))
    report = doctor()
    assert "no NVIDIA driver found" in report.driver["error"]
    assert "Driver Not Loaded" in report.driver["error"]
    assert report.ok


def test_faked_old_driver_is_a_cuda_mismatch(monkeypatch: pytest.MonkeyPatch,
                                             no_gpu: None) -> None:
    nvml = fake_pynvml(cuda=12040, driver="550.54.15")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    report = doctor()
    assert report.driver == {"version": "550.54.15", "cuda_max": "12.4"}
    (gpu,) = report.gpus
    assert gpu == GPUInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_gib=80.0,
                          compute_capability="9.0", bf16=True, tf32=True, source="nvml")
    (mismatch,) = _by_check(report, "cuda_mismatch")
    assert mismatch.severity == "error"
    assert "supports CUDA up to 12.4" in mismatch.message and "CUDA 13.0" in mismatch.message
    assert "upgrade the NVIDIA driver" in (mismatch.fix or "")
    # NVML sees a GPU torch cannot use: said as an error too
    (unavail,) = _by_check(report, "cuda_unavailable")
    assert unavail.severity == "error" and "NVML sees 1 GPU(s)" in unavail.message
    assert not report.ok
    assert nvml.calls == {"init": 1, "shutdown": 1}  # type: ignore[attr-defined]


def test_faked_driver_versions(monkeypatch: pytest.MonkeyPatch, no_gpu: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(cuda=13010))
    report = doctor()
    assert not _by_check(report, "cuda_mismatch")
    (ok,) = _by_check(report, "driver")
    assert ok.severity == "ok" and "13.1 >= torch's CUDA 13.0" in ok.message

    monkeypatch.setattr(torch.version, "cuda", "12.8")  # same major, older minor driver
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(cuda=12040))
    (minor,) = _by_check(doctor(), "cuda_mismatch")
    assert minor.severity == "warning" and "minor-version compatibility" in minor.message


def test_cpu_only_build_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch, no_gpu: None) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=(("Tesla T4", 16, (7, 5)),)))
    report = doctor()
    (build,) = _by_check(report, "cuda_build")
    assert build.severity == "error" and "CPU-only build" in build.message
    assert "Tesla T4" in build.message and "CUDA <= 12.4" in (build.fix or "")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    (build,) = _by_check(doctor(), "cuda_build")
    assert build.severity == "info"


def test_hidden_gpus_are_explained(monkeypatch: pytest.MonkeyPatch, no_gpu: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(cuda=13000))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (unavail,) = _by_check(doctor(), "cuda_unavailable")
    assert "CUDA_VISIBLE_DEVICES=''" in unavail.message


def test_workers_against_cores(monkeypatch: pytest.MonkeyPatch, no_gpu: None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(doctor_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    report = doctor(num_workers=4)
    assert report.cpu["cores_per_rank"] == 2
    (w,) = _by_check(report, "workers")
    assert w.severity == "warning" and "num_workers <= 1" in (w.fix or "")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    (w,) = _by_check(doctor(num_workers=2), "workers")
    assert w.severity == "ok"


def test_gpu_settings_findings() -> None:
    """The GPU-side checks, fed a machine description directly (no GPU needed)."""
    cuda = {"built_with": "12.4", "available": True, "device_count": 2, "cudnn": "9.1.0",
            "nvcc": None, "visible_devices": None}
    nvml = {"version": "550.0", "cuda_max": "12.4"}
    gpus = [GPUInfo(0, "Tesla V100-SXM2-16GB", 16.0, "7.0", 80, False, False),
            GPUInfo(1, "NVIDIA A100-SXM4-80GB", 80.0, "8.0", 108, True, True)]
    settings = {"tf32_matmul": False, "tf32_cudnn": True, "float32_matmul_precision": "highest",
                "cudnn_benchmark": False, "cudnn_deterministic": False,
                "deterministic_algorithms": False}
    cpu = {"usable_cores": 8, "cores_per_rank": 8, "local_ranks": 1, "torch_threads": 8,
           "num_workers": 0}
    versions = {"torch": "2.5", "torchvision": "0.20", "tensordict": "0.15",
                "torchdata": "0.11"}
    findings = doctor_mod._findings(versions, cuda, nvml, [], gpus, settings, cpu)
    by = {f.check: f for f in findings}
    assert "fp16 with loss scaling" in (by["precision"].fix or "")
    assert "V100" in by["precision"].message
    assert "set_float32_matmul_precision('high')" in (by["tf32"].fix or "")
    assert by["cudnn_benchmark"].severity == "info"
    assert by["workers"].severity == "info" and "pin_memory=True" in (by["workers"].fix or "")
    settings["float32_matmul_precision"] = "high"
    by = {f.check: f for f in doctor_mod._findings(versions, cuda, nvml, [], gpus, settings,
                                                   cpu)}
    assert by["tf32"].severity == "ok"


def test_cli_doctor(monkeypatch: pytest.MonkeyPatch, no_gpu: None,
                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cuda"]["built_with"] == "13.0" and data["ok"] is True
    assert cli.main(["doctor", "--num-workers", "1"]) == 0
    assert "accelfn doctor" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(cuda=11080))
    assert cli.main(["doctor"]) == 1  # an error finding fails the command
    assert "cuda_mismatch" in capsys.readouterr().out
    assert cli.main([]) == 0  # bare `accelfn` prints the help
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--bogus"])
