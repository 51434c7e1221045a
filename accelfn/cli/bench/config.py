"""``accelfn bench``'s configuration: the stages of the case study, its published figures, the
options of a run (:class:`BenchConfig`) and the command line that reproduces them."""

from __future__ import annotations

import copy
import os
from collections.abc import Collection
from dataclasses import asdict, dataclass, field

from ...core import compat
from ...observe.threads import default_threads
from ...observe.timing import resolve_device

__all__ = [
    "MEAN",
    "MODELS",
    "SEED_CASE_STUDY",
    "STAGES",
    "STD",
    "BenchConfig",
    "Stage",
    "cli_args",
]

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MODELS = ("resnet50", "resnet18", "cnn", "mlp")
#: The published ResNet-50 case study on one V100 (images/s; ``ddp`` on 4 GPUs), by stage.
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
    threads: int | None = None
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
        if str(c.device).split(":")[0] not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {c.device!r} is unknown; use auto, cpu, cuda or cuda:N")
        try:
            dev = resolve_device(c.device)
        except RuntimeError as exc:  # torch.device("cuda:x") and the like
            raise ValueError(f"--device {c.device!r} is not understood ({exc}); use auto, cpu, "
                             "cuda or cuda:N") from None
        c.device = str(dev)
        gpu = dev.type == "cuda"
        if c.model is None:
            c.model = "cnn" if c.quick else "resnet50"
        if c.model not in MODELS:
            raise ValueError(f"--model {c.model!r} is unknown; use one of {MODELS}")
        defaults: dict[str, int | None]
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
        if c.threads is None:  # one process's share of the free cores, not one per core
            c.threads = default_threads(1)
        if c.threads < 1:
            raise ValueError(f"--threads {c.threads}: must be >= 1 (torch's intra-op threads "
                             "per process)")
        for name in ("workers", "overhead_steps"):
            if getattr(c, name) is not None and getattr(c, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if c.ddp_procs is not None and c.ddp_procs < 1:
            raise ValueError("--ddp-procs must be >= 1")
        if c.compile is None:
            c.compile = not c.quick
        if c.workers is None:
            c.workers = max(1, min(8, os.cpu_count() or 1))
        if (c.compile and c.compile_backend == "inductor" and c.compile_mode is not None
                and c.compile_mode not in compat.compile_modes()):
            raise ValueError(f"--compile-mode {c.compile_mode!r} is unknown; use one of "
                             f"{', '.join(compat.compile_modes())}")
        if c.data not in ("synthetic", "digits"):
            raise ValueError(f"--data {c.data!r} is unknown; use 'synthetic' or 'digits'")
        if c.amp_dtype not in ("auto", "bf16", "fp16"):
            raise ValueError(f"--amp-dtype {c.amp_dtype!r} is unknown; use auto, bf16 or fp16")
        if c.stages is not None:
            if not c.stages:
                raise ValueError("--stages names no stage; use names from "
                                 f"{[s.name for s in STAGES]}, separated by commas")
            unknown = set(c.stages) - {s.name for s in STAGES}
            if unknown:
                raise ValueError(f"--stages: unknown {sorted(unknown)}; use names from "
                                 f"{[s.name for s in STAGES]}")
        return c


def cli_args(cfg: BenchConfig, exclude: Collection[str] = ()) -> list[str]:
    """Command-line arguments that reproduce the resolved ``cfg`` (for the DDP worker and the
    ``command`` of the result), leaving out the fields named in ``exclude``."""
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

