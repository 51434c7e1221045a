"""``accelfn bench``: the seeds' staged ResNet-50 case study, reproduced on this machine.

The seeds report, on one V100: baseline 312 img/s, then pinned memory and workers 387 (+24%),
AMP 542 (+40%), ``torch.compile`` 798 (+47%), 4-GPU DDP 2832 (3.55x). This harness runs the
same story on your hardware, one stage after the other, each adding one technique to the
previous ones, on preloaded uint8 images (synthetic, or the embedded digits upscaled):

==================  ===========================================================================
stage               what it runs
==================  ===========================================================================
baseline            ``torch.utils.data.DataLoader`` (no workers, no pinning) with per-sample
                    torchvision transforms (random crop with padding, flip, normalise), fp32,
                    eager, a hand-written loop
dataloader_tuned    the same loop, ``num_workers``, ``pin_memory``, ``persistent_workers``,
                    ``prefetch_factor`` (the seeds' first stage)
accelfn_data        ``accelfn.data.loader``: one gather per batch, augmentation on whole batches
                    on the device; the loop is an accelfn step
amp                 ``af.with_amp`` (bf16; fp16 with loss scaling where bf16 is missing)
compiled            ``af.compiled``
channels_last       the model and the input batches in NHWC (``ChannelsLast``)
ddp                 ``af.distributed`` on every GPU under ``torchrun`` (skipped, with the
                    reason, on fewer than two GPUs)
==================  ===========================================================================

For each stage: samples/s, mean step time, first-step time (compilation), peak memory,
speedup against the previous stage and the baseline, MFU where the GPU's peak is known, and
the seeds' ratio for the same stage. The same run also measures accelfn's per-step overhead:
the last single-device stack (without compile) against the same loop written by hand, steps
interleaved on fixed device batches (medians).

    accelfn bench                          # ResNet-50: 224 px on a GPU, 32 px on a CPU
    accelfn bench --quick                  # a tiny CNN, a few steps, no compile (CI)
    accelfn bench --model resnet18 --json bench.json --plot bench.png

Also ``python -m accelfn.bench``. The functions :func:`run_bench`, :func:`format_table`,
:func:`plot_bench`, :class:`PeakMemory`, :class:`SavedActivations` and :func:`interleaved`
are reused by the scripts in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

__all__ = [
    "SEED_CASE_STUDY",
    "STAGES",
    "BenchConfig",
    "PeakMemory",
    "SavedActivations",
    "Stage",
    "add_bench",
    "environment",
    "format_table",
    "interleaved",
    "main",
    "plot_bench",
    "run_bench",
    "state_mib",
]

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MODELS = ("resnet50", "resnet18", "cnn", "mlp")

#: The seeds' ResNet-50 case study on one V100 (images/s; ``ddp`` on 4 GPUs), by stage.
SEED_CASE_STUDY: dict[str, dict[str, float]] = {
    "baseline": {"samples_per_s": 312.0},
    "dataloader_tuned": {"samples_per_s": 387.0, "speedup_vs_previous": 387 / 312},
    "amp": {"samples_per_s": 542.0, "speedup_vs_previous": 542 / 387},
    "compiled": {"samples_per_s": 798.0, "speedup_vs_previous": 798 / 542},
    "ddp": {"samples_per_s": 2832.0, "speedup_vs_previous": 2832 / 798, "gpus": 4},
}


@dataclass(frozen=True)
class Stage:
    """One stage of the case study: the techniques in use (cumulative)."""

    name: str
    title: str
    data: str  # "dataloader" | "dataloader_tuned" | "accelfn"
    amp: bool = False
    compile: bool = False
    channels_last: bool = False
    ddp: bool = False

    @property
    def hand_written(self) -> bool:
        """Whether the stage's loop is hand-written (the DataLoader stages) or an accelfn step."""
        return self.data != "accelfn"


STAGES: tuple[Stage, ...] = (
    Stage("baseline", "DataLoader, per-sample transforms, fp32, eager", "dataloader"),
    Stage("dataloader_tuned", "+ workers, pin_memory, persistent workers", "dataloader_tuned"),
    Stage("accelfn_data", "+ accelfn.data: batch gather, augmentation on the device", "accelfn"),
    Stage("amp", "+ af.with_amp", "accelfn", amp=True),
    Stage("compiled", "+ af.compiled", "accelfn", amp=True, compile=True),
    Stage("channels_last", "+ channels_last model and input", "accelfn", amp=True, compile=True,
          channels_last=True),
    Stage("ddp", "+ af.distributed on every GPU (torchrun)", "accelfn", amp=True, compile=True,
          channels_last=True, ddp=True),
)


@dataclass
class BenchConfig:
    """What ``accelfn bench`` runs; ``None`` fields get device- and ``quick``-dependent defaults
    from :meth:`resolved`."""

    model: str | None = None
    device: str = "auto"
    steps: int | None = None
    warmup: int | None = None
    batch_size: int | None = None
    image_size: int | None = None
    samples: int | None = None
    data: str = "synthetic"
    classes: int = 10
    amp_dtype: str = "auto"
    compile: bool | None = None
    compile_mode: str | None = None
    compile_backend: str = "inductor"
    workers: int | None = None
    overhead_steps: int | None = None
    repeats: int = 1
    ddp: bool = True
    ddp_procs: int | None = None
    stages: tuple[str, ...] | None = None
    quick: bool = False
    seed: int = 0
    notes: list[str] = field(default_factory=list)

    def resolved(self) -> BenchConfig:
        """A copy with every ``None`` default filled in for the chosen device."""
        c = copy.deepcopy(self)
        dev = resolve_device(c.device)
        c.device = str(dev)
        gpu = dev.type == "cuda"
        if c.model is None:
            c.model = "cnn" if c.quick else "resnet50"
        if c.model not in MODELS:
            raise ValueError(f"--model {c.model!r} is unknown; use one of {MODELS}")
        if c.quick:
            defaults = dict(steps=8, warmup=2, batch_size=32, image_size=32, samples=256,
                            overhead_steps=16)
        elif gpu:
            defaults = dict(steps=30, warmup=5, batch_size=256 if c.model != "mlp" else 1024,
                            image_size=224 if c.model.startswith("resnet") else 32,
                            samples=None, overhead_steps=30)
        else:
            defaults = dict(steps=10, warmup=3, batch_size=32, image_size=32, samples=None,
                            overhead_steps=30)
        for key, value in defaults.items():
            if getattr(c, key) is None:
                setattr(c, key, value)
        assert c.batch_size is not None and c.steps is not None and c.warmup is not None
        if c.samples is None:
            c.samples = max(c.batch_size * 4, min(c.batch_size * (c.steps + c.warmup), 8192))
        if c.samples < c.batch_size:
            raise ValueError(f"--samples {c.samples} is smaller than --batch-size {c.batch_size}")
        for name in ("steps", "batch_size", "image_size"):
            if getattr(c, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if c.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if c.warmup < 1:
            raise ValueError("--warmup must be >= 1 (the first step is timed on its own)")
        if c.compile is None:
            c.compile = not c.quick
        if c.workers is None:
            c.workers = max(1, min(8, os.cpu_count() or 1))
        if c.data not in ("synthetic", "digits"):
            raise ValueError(f"--data {c.data!r} is unknown; use 'synthetic' or 'digits'")
        if c.amp_dtype not in ("auto", "bf16", "fp16"):
            raise ValueError(f"--amp-dtype {c.amp_dtype!r} is unknown; use auto, bf16 or fp16")
        if c.stages is not None:
            unknown = set(c.stages) - {s.name for s in STAGES}
            if unknown:
                raise ValueError(f"--stages: unknown {sorted(unknown)}; use names from "
                                 f"{[s.name for s in STAGES]}")
        return c


# --------------------------------------------------------------------------------------------
# Machine, memory and timing helpers (also used by benchmarks/)
# --------------------------------------------------------------------------------------------


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
        import torchvision

        env["torchvision"] = torchvision.__version__
    with contextlib.suppress(Exception):
        from .. import __version__

        env["accelfn"] = __version__
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            device_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
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
    first at every step (so slow drifts of the machine hit all sides alike). On CUDA each call
    is followed by a synchronisation, so that its time is its own."""
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    k = len(fns)
    for i in range(steps):
        for j in range(k):
            idx = (i + j) % k
            t0 = clock()
            fns[idx]()
            if device is not None:
                sync(device)
            times[idx].append(clock() - t0)
    return times


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


# --------------------------------------------------------------------------------------------
# Data and models
# --------------------------------------------------------------------------------------------


def make_images(kind: str, samples: int, size: int, classes: int = 10,
                seed: int = 0) -> TensorDict:
    """Preloaded uint8 images ``[samples, 3, size, size]`` and int64 labels.

    ``"synthetic"``: uniform random pixels and labels from ``seed``. ``"digits"``: the
    embedded handwritten digits (8x8, 17 grey levels) upscaled bilinearly to ``size`` and
    repeated over 3 channels (and over the dataset, past its 1,797 images).
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "synthetic":
        images = torch.randint(0, 256, (samples, 3, size, size), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, classes, (samples,), generator=g)
    elif kind == "digits":
        from ..data.datasets import digits

        d = digits()
        idx = torch.arange(samples) % d.batch_size[0]
        small = d["image"][idx].float() * (255.0 / 16.0)
        images = F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False)
        images = images.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1)
        images = images.contiguous()
        labels = d["label"][idx] % classes
    else:
        raise ValueError(f"unknown data {kind!r}; use 'synthetic' or 'digits'")
    return TensorDict({"image": images, "label": labels}, batch_size=[samples])


class TinyCNN(nn.Module):
    """A small convolutional net (three conv-BN-ReLU layers, pooling, a linear head)."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            layers += [nn.Conv2d(cin, cout, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def build_model(name: str, image_size: int, classes: int = 10, seed: int = 0) -> nn.Module:
    """``resnet50``/``resnet18`` (torchvision, random init), ``cnn`` (:class:`TinyCNN`) or
    ``mlp`` (two hidden layers of 512 over the flattened image)."""
    torch.manual_seed(seed)
    if name in ("resnet50", "resnet18"):
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=classes)
    if name == "cnn":
        return TinyCNN(classes)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, 512),
                             nn.ReLU(inplace=True), nn.Linear(512, 512), nn.ReLU(inplace=True),
                             nn.Linear(512, classes))
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, fused (one kernel for the update; lets accelfn skip on the device)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    """The step function of every stage: cross-entropy of the model's logits."""
    return F.cross_entropy(model(batch["image"]), batch["label"])


class _TensorImages(torch.utils.data.Dataset):
    """The baseline's dataset: preloaded uint8 images, a per-sample torchvision transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Any) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.labels[i]


def _dataloader(data: TensorDict, cfg: BenchConfig, device: torch.device,
                tuned: bool) -> torch.utils.data.DataLoader:
    from torchvision.transforms import v2

    size = int(cfg.image_size or 32)
    transform = v2.Compose([
        v2.RandomCrop(size, padding=max(1, size // 8)),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])
    workers = int(cfg.workers or 0) if tuned else 0
    return torch.utils.data.DataLoader(
        _TensorImages(data["image"], data["label"], transform),
        batch_size=cfg.batch_size, shuffle=True, drop_last=True,
        num_workers=workers,
        pin_memory=tuned and device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def _accelfn_loader(data: TensorDict, cfg: BenchConfig, device: torch.device,
                    channels_last: bool, rank: int | None = None,
                    world: int | None = None) -> Any:
    from .. import data as ad

    size = int(cfg.image_size or 32)
    transforms: list[Any] = [ad.RandomCrop(size, padding=max(1, size // 8)),
                             ad.RandomHorizontalFlip(), ad.Normalize(MEAN, STD)]
    if channels_last:
        transforms.append(ad.ChannelsLast())
    return ad.loader(data, batch_size=int(cfg.batch_size or 1), device=device,
                     transform=ad.Compose(*transforms), seed=cfg.seed, rank=rank,
                     world_size=world)


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _amp_dtype(cfg: BenchConfig, device: torch.device) -> torch.dtype:
    if cfg.amp_dtype == "fp16":
        return torch.float16
    if cfg.amp_dtype == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _build_step(stage: Stage, cfg: BenchConfig, device: torch.device,
                nonfinite: bool = True, compile_: bool | None = None) -> Any:
    import accelfn as af

    step: Any = af.lift(classify)
    if stage.amp:
        step = af.with_amp(dtype=_amp_dtype(cfg, device))(step)
    if stage.compile if compile_ is None else compile_:
        step = af.compiled(mode=cfg.compile_mode, backend=cfg.compile_backend)(step)
    if stage.ddp:
        step = af.distributed(step)
    if not nonfinite:
        step = af.with_nonfinite(policy="off")(step)
    return step


def _prepare_model(cfg: BenchConfig, init: dict[str, torch.Tensor], device: torch.device,
                   channels_last: bool) -> nn.Module:
    from ..recipes.memory_format import channels_last as to_channels_last

    assert cfg.model is not None and cfg.image_size is not None
    model = build_model(cfg.model, cfg.image_size, cfg.classes, cfg.seed)
    model.load_state_dict(init)
    model.to(device)
    if channels_last:
        model = to_channels_last(model)
    return model


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


def _model_flops(cfg: BenchConfig, init: dict[str, torch.Tensor], device: torch.device) -> int:
    """Counted FLOPs (matmuls and convolutions, forward and backward) of one sample."""
    from ..observe.monitor import training_flops

    model = _prepare_model(cfg, init, device, channels_last=False)
    size = int(cfg.image_size or 32)
    x = torch.randn(2, 3, size, size, device=device)
    try:
        return training_flops(model, x) // 2
    finally:
        del model


def _peak(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    from ..observe.monitor import peak_flops

    return peak_flops(torch.cuda.get_device_name(device), dtype)


@dataclass
class StepTiming:
    """What :func:`time_steps` measured."""

    first_s: float  # the first call alone (compilation, autotuning, lazy initialisation)
    elapsed_s: float  # the ``steps`` timed calls together
    per_step_s: list[float]  # each timed call (on the CPU only: no queue to drain)
    peak_mib: float | None  # peak CUDA memory over all calls (None on the CPU)


def time_steps(one: Callable[[], Any], *, warmup: int, steps: int,
               device: torch.device) -> StepTiming:
    """Call ``one`` ``warmup`` times (the first timed alone), then time ``steps`` calls."""
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


def _run_stage(stage: Stage, cfg: BenchConfig, data: TensorDict,
               init: dict[str, torch.Tensor], device: torch.device,
               log: Callable[[str], None]) -> dict[str, Any]:
    """Train ``warmup + steps`` updates of one stage and time the last ``steps`` of them."""
    import accelfn as af

    assert cfg.steps is not None and cfg.warmup is not None and cfg.batch_size is not None
    model = _prepare_model(cfg, init, device, stage.channels_last)
    optimizer = make_optimizer(model)
    loader: Any
    closer: Callable[[], None] = lambda: None
    if stage.hand_written:
        loader = _dataloader(data, cfg, device, tuned=stage.data == "dataloader_tuned")
        batches = _endless(loader)

        def one() -> None:
            x, y = next(batches)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        stack = "hand-written loop"
    else:
        loader = _accelfn_loader(data, cfg, device, stage.channels_last)
        closer = loader.close
        batches = _endless(loader)
        step = _build_step(stage, cfg, device)
        state = af.TrainState(model, optimizer)

        def one() -> None:
            step(state, next(batches))

        stack = af.describe(step)

    timing = time_steps(one, warmup=cfg.warmup, steps=cfg.steps, device=device)
    first, elapsed, per_step = timing.first_s, timing.elapsed_s, timing.per_step_s
    activation: float | None = None
    try:  # one more (untimed) step, counting what autograd saves for the backward
        with SavedActivations(model) as acts:
            one()
        activation = acts.mib
    except Exception as exc:  # e.g. a compiled graph refusing the hooks: report, go on
        log(f"  {stage.name}: saved activations not measured ({type(exc).__name__}: {exc})")
    sync(device)
    if not stage.hand_written:
        state.sync()
    closer()
    rate = cfg.steps * cfg.batch_size / elapsed
    log(f"  {stage.name}: {rate:,.1f} samples/s ({elapsed / cfg.steps * 1e3:.1f} ms/step)")
    return {
        "samples_per_s": rate,
        "step_ms": elapsed / cfg.steps * 1e3,
        "step_ms_median": statistics.median(per_step) * 1e3 if per_step else None,
        "first_step_s": first,
        "peak_memory_mib": timing.peak_mib,
        "activation_mib": activation,
        "state_mib": state_mib(model, optimizer),
        "stack": stack,
    }


def _warm_up(cfg: BenchConfig, init: dict[str, torch.Tensor], device: torch.device) -> None:
    """A few untimed fp32 steps, so that the first stage does not pay the process's one-time
    costs (kernel selection, allocator growth, lazy initialisation)."""
    assert cfg.batch_size is not None and cfg.image_size is not None
    model = _prepare_model(cfg, init, device, channels_last=False)
    optimizer = make_optimizer(model)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=g).to(device)
    y = torch.randint(0, cfg.classes, (cfg.batch_size,), generator=g).to(device)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)


def _run_ddp(stage: Stage, cfg: BenchConfig, device: torch.device,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Run the DDP stage under ``torchrun`` on every GPU (or ``ddp_procs`` CPU processes)."""
    procs = cfg.ddp_procs or (torch.cuda.device_count() if device.type == "cuda" else 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        args = _cli_args(cfg, exclude={"stages", "ddp", "ddp_procs", "notes", "classes"})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={procs}", "-m", "accelfn.bench", "--ddp-worker", str(out),
               *args]
        log(f"  ddp: {shlex.join(cmd)}")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise RuntimeError(f"torchrun exited with {proc.returncode}: {tail}")
        result = json.loads(out.read_text())
    result["processes"] = procs
    return result


def _ddp_worker(cfg: BenchConfig, out: str) -> int:
    """One rank of the DDP stage (started by :func:`_run_ddp` through torchrun)."""
    import torch.distributed as dist

    import accelfn as af

    device = af.init_distributed()
    cfg.device = str(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert cfg.model and cfg.image_size and cfg.batch_size and cfg.samples
    assert cfg.steps is not None and cfg.warmup is not None
    last = STAGES[-1]
    stage = Stage(last.name, last.title, "accelfn", amp=True, compile=bool(cfg.compile),
                  channels_last=True, ddp=True)
    # Each rank preloads its own images (seeded by rank): as many per rank as one device had.
    data = make_images(cfg.data, cfg.samples, cfg.image_size, cfg.classes, cfg.seed + rank)
    init = build_model(cfg.model, cfg.image_size, cfg.classes, cfg.seed).state_dict()
    model = _prepare_model(cfg, init, device, stage.channels_last)
    optimizer = make_optimizer(model)
    state = af.TrainState(model, optimizer)
    step = _build_step(stage, cfg, device)
    loader = _accelfn_loader(data, cfg, device, stage.channels_last, rank=0, world=1)
    batches = _endless(loader)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        step(state, next(batches))
        sync(device)
        first = time.perf_counter() - t0
        for _ in range(cfg.warmup - 1):
            step(state, next(batches))
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg.steps):
            step(state, next(batches))
        sync(device)
        dist.barrier()
        elapsed = time.perf_counter() - t0
    state.sync()
    loader.close()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "samples_per_s": cfg.steps * cfg.batch_size * world / elapsed,
            "step_ms": elapsed / cfg.steps * 1e3,
            "first_step_s": first,
            "peak_memory_mib": mem.peak_mib,
            "activation_mib": None,
            "state_mib": state_mib(model, optimizer),
            "stack": af.describe(step),
            "world_size": world,
            "batch_per_process": cfg.batch_size,
        }))
    dist.destroy_process_group()
    return 0


def _overhead(stage: Stage, cfg: BenchConfig, data: TensorDict, init: dict[str, torch.Tensor],
              device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    """accelfn's step against the same update written by hand, on fixed device batches.

    Three sides, interleaved step by step: the hand-written loop (autocast, and GradScaler
    for fp16, as in the seeds), the accelfn step (with its default non-finite guard) and the
    accelfn step with ``with_nonfinite(policy="off")``. Compile is left out (both sides would
    compile the same model; accelfn adds the same Python around it)."""
    import accelfn as af

    assert cfg.batch_size is not None and cfg.overhead_steps is not None
    loader = _accelfn_loader(data, cfg, device, stage.channels_last)
    batch = next(iter(loader)).clone()
    loader.close()
    x, y = batch["image"], batch["label"]
    dtype = _amp_dtype(cfg, device)

    models = [_prepare_model(cfg, init, device, stage.channels_last) for _ in range(3)]
    opts = [make_optimizer(m) for m in models]
    scaler = (torch.amp.GradScaler(device.type) if stage.amp and dtype == torch.float16
              else None)

    def hand() -> None:
        model, opt = models[0], opts[0]
        with (torch.autocast(device.type, dtype=dtype) if stage.amp
              else contextlib.nullcontext()):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    step_on = _build_step(stage, cfg, device, compile_=False)
    step_off = _build_step(stage, cfg, device, nonfinite=False, compile_=False)
    st_on = af.TrainState(models[1], opts[1])
    st_off = af.TrainState(models[2], opts[2])
    fns = [hand, lambda: step_on(st_on, batch), lambda: step_off(st_off, batch)]
    for _ in range(3):
        for fn in fns:
            fn()
    sync(device)
    t_hand, t_on, t_off = interleaved(fns, cfg.overhead_steps, device)
    st_on.sync()
    m_hand, m_on, m_off = (statistics.median(t) for t in (t_hand, t_on, t_off))
    same = all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                  models[2].parameters()))
    log(f"  overhead: hand-written {m_hand * 1e3:.2f} ms, accelfn {m_on * 1e3:.2f} ms "
        f"(guard off {m_off * 1e3:.2f} ms) per step")
    return {
        "stack": af.describe(step_on),
        "stack_guard_off": af.describe(step_off),
        "timing": "fixed device batch; per-step times interleaved, order rotated; medians",
        "steps": cfg.overhead_steps,
        "hand_written_step_ms": m_hand * 1e3,
        "accelfn_step_ms": m_on * 1e3,
        "accelfn_guard_off_step_ms": m_off * 1e3,
        "ratio": m_on / m_hand,
        "ratio_guard_off": m_off / m_hand,
        "added_us_per_step": (m_on - m_hand) * 1e6,
        "added_us_per_step_guard_off": (m_off - m_hand) * 1e6,
        "parameters_equal_guard_off": same,
    }


def _skip_reason(stage: Stage, cfg: BenchConfig, device: torch.device) -> str | None:
    if cfg.stages is not None and stage.name not in cfg.stages:
        return "not selected (--stages)"
    if stage.name == "compiled" and not cfg.compile:
        return ("--quick leaves compile out (10-60 s per graph on a CPU); add --compile to "
                "include it; later stages run without it" if cfg.quick else
                "--no-compile; later stages run without it")
    if stage.ddp:
        if not cfg.ddp:
            return "DDP skipped (--no-ddp)"
        if cfg.ddp_procs:
            return None
        if device.type != "cuda":
            return ("DDP needs several GPUs; this run is on the CPU (--ddp-procs N runs it "
                    "with gloo, to check the harness only)")
        if torch.cuda.device_count() < 2:
            return (f"{torch.cuda.device_count()} CUDA device visible; DDP needs at least 2")
    return None


def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None,
              on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every stage of the case study and the overhead check; return the JSON result.

    ``on_progress(result)`` receives the result so far after each stage (``"complete":
    false``), so that a run cut short still leaves its figures."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    cfg = cfg.resolved()
    device = resolve_device(cfg.device)
    assert cfg.model and cfg.image_size and cfg.samples and cfg.batch_size
    env = environment(device)
    log(f"accelfn bench: {cfg.model}, {cfg.image_size}px, batch {cfg.batch_size}, "
        f"{cfg.steps} steps (+{cfg.warmup} warm-up) per stage on {env['device_name']}")
    t_all = time.perf_counter()
    data = make_images(cfg.data, cfg.samples, cfg.image_size, cfg.classes, cfg.seed)
    init = build_model(cfg.model, cfg.image_size, cfg.classes, cfg.seed).state_dict()
    flops = _model_flops(cfg, init, device)
    dtype = _amp_dtype(cfg, device)
    peak = _peak(device, dtype)
    info = {"cfg": cfg, "env": env, "flops": flops, "peak": peak, "dtype": dtype,
            "t_all": t_all, "device": device}

    _warm_up(cfg, init, device)
    stages: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(cfg.repeats):
        if cfg.repeats > 1:
            log(f" repeat {rep + 1} of {cfg.repeats}")
        for listed in STAGES:
            stage = dataclasses.replace(listed, compile=listed.compile and bool(cfg.compile))
            if rep == 0:
                entry: dict[str, Any] = {
                    "name": stage.name, "title": stage.title,
                    "techniques": {k: v for k, v in asdict(stage).items()
                                   if k not in ("name", "title")}}
                if stage.name in SEED_CASE_STUDY:
                    entry["seed_v100"] = {k: _round(v)
                                          for k, v in SEED_CASE_STUDY[stage.name].items()}
                stages.append(entry)
                reason = _skip_reason(stage, cfg, device)
                if reason is not None:
                    entry.update(status="skipped", reason=reason)
                    log(f"  {stage.name}: skipped ({reason})")
                    continue
            entry = next(e for e in stages if e["name"] == stage.name)
            if entry.get("status") in ("skipped", "error"):
                continue
            try:
                if stage.ddp:
                    result = _run_ddp(stage, cfg, device, log)
                else:
                    result = _run_stage(stage, cfg, data, init, device, log)
            except Exception as exc:  # a failing stage is reported; the others still run
                entry.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:2000])
                log(f"  {stage.name}: error ({entry['reason'][:300]})")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            runs.setdefault(stage.name, []).append(result)
            entry.update(_combine(runs[stage.name]), status="ok")
            flops_s = flops * entry["samples_per_s"]
            entry["model_tflops_per_s"] = flops_s / 1e12
            procs = entry.get("world_size", 1)
            entry["mfu"] = None if peak is None else flops_s / (peak * procs)
            if on_progress is not None:
                on_progress(_assemble(info, stages, None, complete=False))

    overhead: dict[str, Any] | None = None
    accel = [s for s in stages if s.get("status") == "ok" and not s["techniques"]["ddp"]
             and s["techniques"]["data"] == "accelfn"]
    if accel and cfg.overhead_steps:
        last = next(st for st in STAGES if st.name == accel[-1]["name"])
        last = dataclasses.replace(last, compile=False)
        try:
            overhead = _overhead(last, cfg, data, init, device, log)
        except Exception as exc:
            overhead = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    return _assemble(info, stages, overhead, complete=True)


def _combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage's figures over its repeats: the median rate (and each one), the first
    repeat's first step (the cold compile), the largest memory."""
    if len(results) == 1:
        return dict(results[0])
    rates = [r["samples_per_s"] for r in results]
    mid = sorted(results, key=lambda r: r["samples_per_s"])[(len(results) - 1) // 2]
    out = dict(mid)
    out["samples_per_s"] = statistics.median(rates)
    out["step_ms"] = statistics.median(r["step_ms"] for r in results)
    out["samples_per_s_all"] = rates
    out["first_step_s"] = results[0]["first_step_s"]
    medians = [r["step_ms_median"] for r in results if r.get("step_ms_median") is not None]
    out["step_ms_median"] = statistics.median(medians) if medians else None
    for key in ("peak_memory_mib", "activation_mib"):
        values = [r[key] for r in results if r.get(key) is not None]
        out[key] = max(values) if values else None
    return out


def _assemble(info: dict[str, Any], stages: list[dict[str, Any]],
              overhead: dict[str, Any] | None, complete: bool) -> dict[str, Any]:
    """The JSON result from the stages measured so far."""
    cfg: BenchConfig = info["cfg"]
    ok = [s for s in stages if s.get("status") == "ok"]
    base = next((s for s in ok if s["name"] == "baseline"), ok[0] if ok else None)
    prev = None
    for s in ok:
        s["speedup_vs_previous"] = (None if prev is None
                                    else s["samples_per_s"] / prev["samples_per_s"])
        s["speedup_vs_baseline"] = None if base is None else (
            s["samples_per_s"] / base["samples_per_s"])
        prev = s
    single = [s for s in ok if not s["techniques"]["ddp"]]
    seed = SEED_CASE_STUDY
    summary = {
        "baseline_samples_per_s": base["samples_per_s"] if base else None,
        "best_single_device": max(single, key=lambda s: s["samples_per_s"])["name"]
        if single else None,
        "single_device_speedup": (max(s["samples_per_s"] for s in single)
                                  / base["samples_per_s"]) if single and base else None,
        "total_speedup": (ok[-1]["samples_per_s"] / base["samples_per_s"]) if ok and base
        else None,
        "seed_v100_single_gpu_speedup": seed["compiled"]["samples_per_s"]
        / seed["baseline"]["samples_per_s"],
        "seed_total_speedup_4_gpus": seed["ddp"]["samples_per_s"]
        / seed["baseline"]["samples_per_s"],
    }
    env = dict(info["env"])
    with contextlib.suppress(OSError, AttributeError):
        env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    quick = ["--quick"] if cfg.quick else []
    command = shlex.join(["accelfn", "bench", *quick,
                          *_cli_args(cfg, exclude={"notes", "classes", "ddp_procs"})])
    peak, dtype = info["peak"], info["dtype"]
    return {
        "benchmark": "accelfn bench",
        "complete": complete,
        "command": command,
        "machine": env,
        "config": {k: v for k, v in asdict(cfg).items() if k != "notes"},
        "model_flops_per_sample": info["flops"],
        "mfu_peak": None if peak is None else {"dtype": str(dtype).replace("torch.", ""),
                                               "flop_per_s": peak},
        "stages": [_rounded(s) for s in stages],
        "summary": _rounded(summary),
        "overhead": None if overhead is None else _rounded(overhead),
        "notes": [*cfg.notes, *_notes(cfg, info["device"])],
        "seconds": round(time.perf_counter() - info["t_all"], 1),
    }


def _notes(cfg: BenchConfig, device: torch.device) -> list[str]:
    notes = [
        "samples/s = steps x batch / wall time of the timed steps, data loading included "
        "(with --repeats: the median over the repeats); step_ms_median (CPU only): the median "
        "single step, steadier on a busy machine",
        "stages are cumulative: each adds one technique to the previous stage",
        "peak_memory_mib: torch.cuda.max_memory_allocated over the stage; activation_mib: "
        "bytes autograd saved for backward in one step (parameters excluded); state_mib: "
        "parameters, buffers and optimizer state",
        "seed_v100: the seeds' ResNet-50 case study on one V100 (ddp: 4 GPUs); compare "
        "ratios, not absolute numbers, across machines",
    ]
    if device.type != "cuda":
        notes.append("CPU run: AMP is bf16 autocast (its speed depends on the CPU's bf16 "
                     "support); no allocator peak (peak_memory_mib is null) and no MFU")
    return notes


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float):
            out[k] = round(v, 6) if abs(v) < 1 else round(v, 3)
        elif isinstance(v, dict):
            out[k] = _rounded(v)
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Output: table, plot
# --------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(result: dict[str, Any]) -> str:
    """The stages as a text table, the overhead line and the summary."""
    head = ("stage", "samples/s", "step ms", "vs prev", "vs base", "seeds V100", "peak MiB",
            "act. MiB", "MFU", "note")
    rows: list[tuple[str, ...]] = []
    for s in result["stages"]:
        seed = s.get("seed_v100", {})
        seed_txt = (f"x{seed['speedup_vs_previous']:.2f}" if "speedup_vs_previous" in seed
                    else (f"{seed['samples_per_s']:.0f}/s" if seed else ""))
        if s["status"] != "ok":
            rows.append((s["name"], "-", "-", "-", "-", seed_txt, "-", "-", "-",
                         f"{s['status']}: {s['reason']}"))
            continue
        notes = [f"{s['world_size']} processes"] if s.get("world_size") else []
        if s["first_step_s"] > 1:
            notes.append(f"first step {s['first_step_s']:.1f} s")
        if s["techniques"]["compile"] is False and s["name"] == "channels_last":
            notes.append("without compile")
        note = "; ".join(notes)
        rows.append((
            s["name"], _fmt(s["samples_per_s"], ",.1f"), _fmt(s["step_ms"], ".1f"),
            _fmt(s["speedup_vs_previous"], ".2f", "x"), _fmt(s["speedup_vs_baseline"], ".2f", "x"),
            seed_txt, _fmt(s["peak_memory_mib"], ",.0f"), _fmt(s["activation_mib"], ",.1f"),
            _fmt(None if s["mfu"] is None else s["mfu"] * 100, ".1f", "%"), note))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    o = result.get("overhead")
    if o and "ratio" in o:
        lines.append("")
        lines.append(
            f"overhead ({o['stack']}): hand-written {o['hand_written_step_ms']:.2f} ms, "
            f"accelfn {o['accelfn_step_ms']:.2f} ms per step (x{o['ratio']:.3f}, "
            f"{o['added_us_per_step']:+.0f} us); guard off x{o['ratio_guard_off']:.3f}")
    elif o:
        lines.append(f"overhead: {o.get('status')}: {o.get('reason')}")
    sm = result["summary"]
    if sm.get("single_device_speedup"):
        lines.append(
            f"single device: x{sm['single_device_speedup']:.2f} over the baseline "
            f"(seeds on a V100: x{sm['seed_v100_single_gpu_speedup']:.2f})")
    m = result["machine"]
    lines.append(f"{m['device_name']} ({m['device']}), torch {m['torch']}, "
                 f"{m['cpu_cores']} CPU cores, load {m.get('load_average')}, "
                 f"{result['seconds']} s")
    return "\n".join(lines)


def plot_bench(result: dict[str, Any], path: str | Path) -> Path | None:
    """A bar chart of samples/s per stage with speedups over the baseline (and the seeds'
    ratios); returns ``None`` (and says so) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'accelfn[plot]')",
              file=sys.stderr)
        return None
    ok = [s for s in result["stages"] if s["status"] == "ok"]
    skipped = [s["name"] for s in result["stages"] if s["status"] != "ok"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(ok) + 2), 4.2))
    names = [s["name"] for s in ok]
    rates = [s["samples_per_s"] for s in ok]
    colors = ["#9e9e9e" if s["techniques"]["data"].startswith("dataloader") else "#1f77b4"
              for s in ok]
    bars = ax.bar(names, rates, color=colors)
    for bar, s in zip(bars, ok):
        label = f"x{s['speedup_vs_baseline']:.2f}"
        seed = s.get("seed_v100", {}).get("speedup_vs_previous")
        if s["speedup_vs_previous"] is not None:
            label += f"\n(prev x{s['speedup_vs_previous']:.2f}"
            label += f"; seeds x{seed:.2f})" if seed else ")"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    m, c = result["machine"], result["config"]
    ax.set_ylabel("samples/s")
    ax.set_ylim(0, max(rates or [1]) * 1.3)
    ax.set_title(f"accelfn bench: {c['model']} {c['image_size']}px, batch {c['batch_size']} "
                 f"on {m['device_name']}", fontsize=9)
    if skipped:
        ax.text(0.01, 0.97, "skipped: " + ", ".join(skipped), transform=ax.transAxes,
                fontsize=7, va="top", color="#555555")
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default=None,
                   help="resnet50 (default), resnet18, cnn (tiny; --quick's default) or mlp")
    p.add_argument("--steps", type=int, default=None, help="timed steps per stage")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before them (the first one, compile included, is "
                        "reported as first_step_s)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per device (default 256 on a GPU, 32 on a CPU)")
    p.add_argument("--image-size", type=int, default=None,
                   help="pixels (default 224 for ResNets on a GPU, else 32)")
    p.add_argument("--samples", type=int, default=None, help="images preloaded in memory")
    p.add_argument("--data", choices=("synthetic", "digits"), default="synthetic",
                   help="random uint8 images, or the embedded handwritten digits upscaled")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--amp-dtype", choices=("auto", "bf16", "fp16"), default="auto",
                   help="AMP stages' dtype (auto: bf16, fp16 where bf16 is not supported)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="include the compile stages (default: on, off with --quick)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the compile stages")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (default inductor; 'eager' only traces, to check "
                        "the harness quickly)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers of the tuned stage (default min(8, cores))")
    p.add_argument("--overhead-steps", type=int, default=None,
                   help="interleaved steps of the overhead check (0 skips it)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole sequence of stages this many times and report each "
                        "stage's median (steadier figures on a busy machine)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", default=True,
                   help="skip the DDP stage")
    p.add_argument("--ddp-procs", type=int, default=None, metavar="N",
                   help="processes of the DDP stage (default: every GPU; on a CPU it runs "
                        "only when given, with gloo)")
    p.add_argument("--stages", default=None,
                   help="comma-separated stage names to run (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="tiny CNN, 32 px, a few steps, no compile unless --compile: under a "
                        "minute on a laptop CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the result as JSON ('-' prints it to stdout)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG bar chart (needs matplotlib: pip install 'accelfn[plot]')")
    p.add_argument("--ddp-worker", default=None, help=argparse.SUPPRESS)


def _config_from_args(args: argparse.Namespace) -> BenchConfig:
    stages = None if not args.stages else tuple(s.strip() for s in args.stages.split(",") if s)
    return BenchConfig(
        model=args.model, device=args.device, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size, image_size=args.image_size, samples=args.samples,
        data=args.data, amp_dtype=args.amp_dtype, compile=args.compile,
        compile_mode=args.compile_mode, compile_backend=args.compile_backend,
        workers=args.workers,
        overhead_steps=args.overhead_steps, repeats=args.repeats, ddp=args.ddp,
        ddp_procs=args.ddp_procs,
        stages=stages, quick=args.quick, seed=args.seed)


def _cli_args(cfg: BenchConfig, exclude: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Command-line arguments that reproduce the resolved ``cfg`` (for the DDP worker)."""
    out: list[str] = []
    for key, value in asdict(cfg).items():
        if key in exclude or value is None or key == "quick":
            continue
        flag = "--" + key.replace("_", "-")
        if key == "compile":
            out.append("--compile" if value else "--no-compile")
        elif isinstance(value, bool):
            if key == "ddp" and not value:
                out.append("--no-ddp")
        elif isinstance(value, (tuple, list)):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out


def _run(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args)
    if args.ddp_worker:
        return _ddp_worker(cfg.resolved(), args.ddp_worker)
    def write(result: dict[str, Any]) -> None:
        if args.json and args.json != "-":
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    try:
        result = run_bench(cfg, on_progress=write)
    except ValueError as exc:
        print(f"accelfn bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json == "-":
        print(json.dumps(result, indent=2))
    elif args.json:
        write(result)
        print(f"JSON: {args.json}")
    if args.plot:
        saved = plot_bench(result, args.plot)
        if saved is not None:
            print(f"plot: {saved}")
    failed = [s["name"] for s in result["stages"] if s["status"] == "error"]
    return 1 if failed else 0


def add_bench(subparsers: Any) -> None:
    """``accelfn bench``: the seeds' staged case study (baseline to DDP) on this machine."""
    p = subparsers.add_parser(
        "bench", help="the staged speed-up case study (DataLoader baseline -> accelfn data "
                      "-> AMP -> compile -> channels_last -> DDP) on this machine",
        description="Reproduce the seeds' staged ResNet-50 case study on this machine: a "
                    "hand-written DataLoader baseline, then the accelfn data pipeline, AMP, "
                    "torch.compile, channels_last and DDP, each added to the previous; "
                    "samples/s, speedups, peak memory, MFU, and accelfn's per-step overhead "
                    "against the same loop written by hand.")
    _add_arguments(p)
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m accelfn.bench [options]``: the same as ``accelfn bench``."""
    parser = argparse.ArgumentParser(prog="accelfn bench", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
