"""``accelfn doctor``: the environment checks usually run by hand, with a fix for each.

Performance guides start every speed-up with ``nvidia-smi``, ``nvcc --version``,
``torch.__version__`` and ``torch.backends.cudnn.version()``. :func:`doctor` gathers the same
facts in one structured :class:`DoctorReport`:

* versions of Python, torch, torchvision, tensordict, torchdata, numpy and nvidia-ml-py;
* the CUDA runtime torch was built with, cuDNN, and ``nvcc`` when it is on ``PATH``;
* the NVIDIA driver and the newest CUDA it supports (through pynvml), GPU names, memory and
  compute capability, both as NVML and as torch see them;
* bf16 / TF32 support and the current TF32 and ``cudnn.benchmark`` settings;
* CPU cores (usable by this process, and per rank under ``torchrun``) against data-loader
  workers, and against torch's threads and the load average (oversubscription, see
  `accelfn.observe.threads`);

and turns what is wrong or slow into :class:`~accelfn.observe.findings.Finding` s with the fix.
It never fails for want of a GPU, a driver or pynvml: it says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .findings import Finding, Severity, format_findings, worst_severity
from .threads import CpuLoad, cpu_load, oversubscription

__all__ = ["DoctorReport", "GPUInfo", "doctor"]

_PACKAGES = (
    ("torch", "torch"),
    ("torchvision", "torchvision"),
    ("tensordict", "tensordict"),
    ("torchdata", "torchdata"),
    ("numpy", "numpy"),
)


@dataclass
class GPUInfo:
    """One GPU as torch (``source="torch"``) or only NVML (``source="nvml"``) sees it."""

    index: int
    name: str
    memory_gib: float | None = None
    compute_capability: str | None = None
    multiprocessors: int | None = None
    bf16: bool | None = None
    tf32: bool | None = None
    source: str = "torch"


@dataclass
class DoctorReport:
    """The result of [`doctor`][].

    ``versions`` maps package to version (``None`` when absent); ``cuda`` holds what torch
    was built with and can use; ``driver`` what NVML says (or ``error`` with the reason);
    ``gpus`` each device; ``settings`` the TF32 / cuDNN switches; ``cpu`` core counts;
    ``findings`` every check's result, each problem with its fix.
    """

    versions: dict[str, str | None]
    cuda: dict[str, Any]
    driver: dict[str, Any]
    gpus: list[GPUInfo]
    settings: dict[str, Any]
    cpu: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no finding is an error."""
        return worst_severity(self.findings) != "error"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["findings"] = [f.to_dict() for f in self.findings]
        out["ok"] = self.ok
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        def fmt(d: dict[str, Any]) -> str:
            return ", ".join(f"{k} {v}" for k, v in d.items() if v is not None)

        lines = ["accelfn doctor", "=============="]
        lines.append("versions: " + fmt(self.versions))
        lines.append("cuda:     " + fmt(self.cuda))
        lines.append("driver:   " + fmt(self.driver))
        if not self.gpus:
            lines.append("gpus:     none visible")
        for g in self.gpus:
            mem = f"{g.memory_gib:.1f} GiB" if g.memory_gib is not None else "? GiB"
            lines.append(f"gpu {g.index}:    {g.name}, {mem}, compute capability "
                         f"{g.compute_capability or '?'}, bf16 {g.bf16}, tf32 {g.tf32} "
                         f"(seen by {g.source})")
        lines.append("settings: " + fmt(self.settings))
        lines.append("cpu:      " + fmt(self.cpu))
        lines.append("")
        lines.append(format_findings(self.findings))
        return "\n".join(lines)


def _version(module: str, dist: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    except Exception as exc:  # a broken install (ABI mismatch) raises other errors
        return f"import failed: {type(exc).__name__}: {exc}"
    v = getattr(mod, "__version__", None)
    if v is None:
        try:
            v = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v = "unknown"
    return str(v)


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _cuda_tuple(v: str | int | None) -> tuple[int, int] | None:
    """``"12.4"`` or NVML's ``12040`` to ``(12, 4)``."""
    if v is None:
        return None
    if isinstance(v, int):
        return v // 1000, (v % 1000) // 10
    m = re.match(r"(\d+)\.(\d+)", str(v))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _query_nvml() -> dict[str, Any]:
    """Driver, its CUDA version and the GPUs, from pynvml; ``error`` says why not."""
    try:
        import pynvml
    except ImportError:
        return {"error": "pynvml is not installed (pip install nvidia-ml-py)",
                "pynvml": False}
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return {"error": f"no NVIDIA driver found (NVML: {exc})", "pynvml": True}
    try:
        out: dict[str, Any] = {"pynvml": True}
        out["version"] = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        out["cuda_max"] = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        gpus = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = GPUInfo(index=i, name=_text(pynvml.nvmlDeviceGetName(h)), source="nvml")
            try:
                info.memory_gib = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            except Exception:
                pass
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                info.compute_capability = f"{major}.{minor}"
                info.bf16 = info.tf32 = major >= 8
            except Exception:
                pass
            gpus.append(info)
        out["gpus"] = gpus
        return out
    except Exception as exc:
        return {"error": f"NVML query failed: {exc}", "pynvml": True}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _cudnn_version() -> str | None:
    """cuDNN as ``"9.24.0"`` (torch reports ``92400``; cuDNN 8 used ``8700`` for 8.7.0)."""
    try:
        cudnn = torch.backends.cudnn
        v = cudnn.version() if cudnn.is_available() else None  # type: ignore[no-untyped-call]
    except Exception:
        return None
    if v is None:
        return None
    if v >= 90000:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def _nvcc_version() -> str | None:
    exe = shutil.which("nvcc")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out.stdout)
    return m.group(1) if m else None


def _settings() -> dict[str, Any]:
    s: dict[str, Any] = {
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    return s


def _cpu(num_workers: int | None) -> dict[str, Any]:
    logical = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = logical
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    load = cpu_load(local_processes=local_ranks).load
    return {
        "logical_cores": logical,
        "usable_cores": usable,
        "local_ranks": local_ranks,
        "cores_per_rank": max(1, usable // max(local_ranks, 1)),
        "torch_threads": torch.get_num_threads(),
        "num_workers": num_workers,
        "load_average": None if load is None else round(load, 2),
    }


def doctor(*, num_workers: int | None = None) -> DoctorReport:
    """Check this machine for training with accelfn; return a [`DoctorReport`][].

    Args:
        num_workers: the data-loader worker count you plan to use (per process); checked
            against the CPU cores this process may use.

    Works with no GPU, no driver and no pynvml (each is reported plainly). Only reads state:
    nothing is initialised except CUDA's device query when CUDA is available.
    """
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for module, dist in _PACKAGES:
        versions[module] = _version(module, dist)
    try:
        versions["nvidia-ml-py"] = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        versions["nvidia-ml-py"] = None
    try:
        versions["accelfn"] = importlib.metadata.version("accelfn")
    except importlib.metadata.PackageNotFoundError:
        versions["accelfn"] = None

    built = torch.version.cuda
    available = torch.cuda.is_available()
    cudnn = _cudnn_version()
    cuda: dict[str, Any] = {
        "built_with": built,
        "available": available,
        "device_count": torch.cuda.device_count() if available else 0,
        "cudnn": cudnn,
        "nvcc": _nvcc_version(),
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    nvml = _query_nvml()
    nvml_gpus: list[GPUInfo] = nvml.pop("gpus", [])
    driver = {k: v for k, v in nvml.items() if k != "pynvml"}

    gpus: list[GPUInfo] = []
    if available:
        for i in range(cuda["device_count"]):
            p = torch.cuda.get_device_properties(i)
            gpus.append(GPUInfo(
                index=i, name=p.name, memory_gib=p.total_memory / 2**30,
                compute_capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                bf16=p.major >= 8, tf32=p.major >= 8, source="torch"))
    else:
        gpus = nvml_gpus

    settings = _settings()
    cpu = _cpu(num_workers)
    findings = _findings(versions, cuda, nvml, nvml_gpus, gpus, settings, cpu)
    return DoctorReport(versions, cuda, driver, gpus, settings, cpu, findings)


_WHEELS = "https://pytorch.org/get-started/locally/"


def _findings(versions: dict[str, str | None], cuda: dict[str, Any], nvml: dict[str, Any],
              nvml_gpus: list[GPUInfo], gpus: list[GPUInfo], settings: dict[str, Any],
              cpu: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    for pkg in ("torchvision", "tensordict", "torchdata"):
        v = versions.get(pkg)
        if v is None:
            out.append(Finding("versions", "warning", f"{pkg} is not installed",
                               f"pip install {pkg} (accelfn depends on it)"))
        elif v.startswith("import failed"):
            out.append(Finding("versions", "error", f"{pkg} is installed but {v}",
                               f"reinstall {pkg} built for torch {versions['torch']}: "
                               f"pip install --force-reinstall {pkg}"))

    built = cuda["built_with"]
    runtime = _cuda_tuple(built)
    driver_cuda = _cuda_tuple(nvml.get("cuda_max"))
    nvml_error = nvml.get("error")

    # -- which torch build, which driver --------------------------------------------------
    if built is None:
        if nvml_gpus:
            out.append(Finding(
                "cuda_build", "error",
                f"torch {versions['torch']} is a CPU-only build but NVML sees "
                f"{len(nvml_gpus)} GPU(s) ({nvml_gpus[0].name})",
                f"install a CUDA build of torch for CUDA <= {nvml.get('cuda_max')}: see "
                f"{_WHEELS} (pip install torch --index-url https://download.pytorch.org/whl/"
                "cuXYZ)"))
        else:
            out.append(Finding("cuda_build", "info",
                               f"torch {versions['torch']} is a CPU-only build; training "
                               "runs on the CPU (fine for tests, slow for real work)",
                               f"on a GPU machine install a CUDA build: {_WHEELS}"))
    else:
        out.append(Finding("cuda_build", "ok", f"torch built with CUDA {built}"
                           + (f", cuDNN {cuda['cudnn']}" if cuda["cudnn"] else "")))
        if not cuda["cudnn"]:
            out.append(Finding("cudnn", "warning",
                               "cuDNN is not available to torch: convolutions run slowly",
                               "install the torch wheel (it bundles cuDNN) rather than a "
                               "source build without cuDNN"))

    if nvml_error:
        sev: Severity = "info" if built is None or not cuda["available"] else "warning"
        if cuda["available"]:
            sev = "warning"
            fix = ("pip install nvidia-ml-py (GPU utilisation and memory sampling need it)"
                   if not nvml.get("pynvml") else
                   "NVML ships with the NVIDIA driver: check the driver install "
                   "(nvidia-smi must work)")
        else:
            fix = ("on a GPU machine install the NVIDIA driver (nvidia-smi must work)"
                   if nvml.get("pynvml") else "pip install nvidia-ml-py")
        out.append(Finding("driver", sev, nvml_error, fix))
    elif runtime and driver_cuda:
        drv = nvml.get("version")
        if driver_cuda[0] < runtime[0]:
            out.append(Finding(
                "cuda_mismatch", "error",
                f"driver {drv} supports CUDA up to {nvml['cuda_max']} but torch was built "
                f"with CUDA {built}: CUDA cannot initialise",
                f"upgrade the NVIDIA driver to one supporting CUDA {built}, or install a "
                f"torch build for CUDA <= {nvml['cuda_max']} ({_WHEELS})"))
        elif driver_cuda < runtime:
            out.append(Finding(
                "cuda_mismatch", "warning",
                f"driver {drv} supports CUDA {nvml['cuda_max']}, older than torch's CUDA "
                f"{built}: runs through minor-version compatibility, but PTX JIT and newer "
                "features can fail",
                f"upgrade the NVIDIA driver to one supporting CUDA {built}"))
        else:
            out.append(Finding("driver", "ok", f"driver {drv} supports CUDA "
                               f"{nvml['cuda_max']} >= torch's CUDA {built}"))

    if built is not None and not cuda["available"]:
        visible = cuda["visible_devices"]
        if nvml_gpus:
            why = (f"CUDA_VISIBLE_DEVICES={visible!r} hides them"
                   if visible is not None and visible.strip() in ("", "-1") else
                   "the driver and torch's CUDA do not match or the driver failed")
            out.append(Finding(
                "cuda_unavailable", "error",
                f"NVML sees {len(nvml_gpus)} GPU(s) but torch.cuda.is_available() is False: "
                f"{why}",
                "unset CUDA_VISIBLE_DEVICES or fix it" if "VISIBLE" in why else
                "compare the driver's CUDA version above with torch's and upgrade the driver"))
        else:
            out.append(Finding("cuda_unavailable", "warning",
                               "torch has CUDA but no GPU is visible: training runs on the CPU",
                               "run on a machine with an NVIDIA GPU and driver, or ignore "
                               "for CPU tests"))

    nvcc = cuda["nvcc"]
    if nvcc and built and _cuda_tuple(nvcc) != runtime:
        out.append(Finding("nvcc", "info",
                           f"nvcc on PATH is CUDA {nvcc}, torch uses its own CUDA {built}",
                           "harmless for training; only CUDA extensions you compile need a "
                           "toolkit matching torch's CUDA (set CUDA_HOME)"))

    # -- GPUs and their settings -------------------------------------------------------------
    if cuda["available"]:
        for g in gpus:
            if g.bf16 is False:
                out.append(Finding(
                    "precision", "info",
                    f"GPU {g.index} ({g.name}, compute {g.compute_capability}) has no bf16 "
                    "or TF32 tensor cores",
                    "use fp16 with loss scaling: accelfn.with_amp(dtype=torch.float16)"))
        if any(g.tf32 for g in gpus):
            if not settings["tf32_matmul"] and settings["float32_matmul_precision"] == "highest":
                out.append(Finding(
                    "tf32", "info",
                    "TF32 is off for float32 matmuls on a GPU that supports it",
                    "torch.set_float32_matmul_precision('high') speeds up fp32 matmuls up to "
                    "8x at ~1e-3 relative precision (or train in bf16 with with_amp)"))
            else:
                out.append(Finding("tf32", "ok", "TF32 enabled for float32 matmuls"))
        if not settings["cudnn_benchmark"]:
            out.append(Finding(
                "cudnn_benchmark", "info",
                "torch.backends.cudnn.benchmark is False",
                "for convolution models with fixed input shapes set "
                "torch.backends.cudnn.benchmark = True (it picks the fastest kernels once)"))
        if settings["deterministic_algorithms"] or settings["cudnn_deterministic"]:
            out.append(Finding("determinism", "info",
                               "deterministic algorithms are on: some kernels are slower",
                               "turn them off outside reproducibility runs"))
        for g in gpus:
            out.append(Finding("gpu", "ok",
                               f"GPU {g.index}: {g.name}, {g.memory_gib:.1f} GiB, compute "
                               f"{g.compute_capability}"))

    # -- CPU against workers ----------------------------------------------------------------
    per_rank = cpu["cores_per_rank"]
    nw = cpu["num_workers"]
    if nw is not None:
        if nw >= per_rank and nw > 0:
            out.append(Finding(
                "workers", "warning",
                f"num_workers={nw} but only {per_rank} core(s) per training process "
                f"({cpu['usable_cores']} usable / {cpu['local_ranks']} local rank(s)): "
                "workers compete with the training process",
                f"use num_workers <= {max(per_rank - 1, 1)}; beyond the physical cores more "
                "workers only slow loading down"))
        elif nw == 0 and cuda["available"]:
            out.append(Finding(
                "workers", "info", "num_workers=0: batches are prepared in the training "
                "process while the GPU waits",
                f"use num_workers={min(4, max(per_rank - 1, 1))} with pin_memory=True and "
                "persistent_workers=True, or accelfn.data's GPU-side preprocessing"))
        else:
            out.append(Finding("workers", "ok", f"num_workers={nw} fits {per_rank} core(s) "
                               "per process"))
    out.append(oversubscription(CpuLoad(
        cores=cpu["usable_cores"], local_processes=cpu["local_ranks"],
        threads=cpu["torch_threads"], load=cpu.get("load_average"))))
    return out
